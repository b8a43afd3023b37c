// SPDX-License-Identifier: MIT
// Translating a local symmetric-heap pointer to a peer's mapped address (nvshmem_ptr semantics).
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/device/spin.cuh"

namespace weft::device {

/// The address of the object that `local` names in this rank's symmetric heap, as the same object in
/// rank `pe`'s heap is mapped here, for load/store access. nullptr when `pe` is out of range, `local`
/// is not inside this rank's heap (every symmetric object is), or `pe` is not load/store reachable
/// (then a put/get transport would be needed; only load/store exists today). Any thread may call it.
template <class T>
__device__ __forceinline__ T* symm_at(const DeviceCtx& ctx, T* local, int pe) {
    const auto a = reinterpret_cast<uintptr_t>(local);
    const auto base = reinterpret_cast<uintptr_t>(ctx.heap_base);
    if (a < base || a - base >= ctx.heap_bytes || pe < 0 || pe >= ctx.num_ranks) {
        return nullptr;
    }
    if (pe == ctx.rank) {
        return local;
    }
    if (ctx.peer_bases == nullptr) {
        return nullptr;
    }
    uint8_t* peer_base = ctx.peer_bases[pe];
    if (peer_base == nullptr) {
        return nullptr;
    }
    return reinterpret_cast<T*>(peer_base + (a - base));
}

namespace detail {

/// The kUnreachablePeer diagnostic's values for `local` and `pe`: expected = pe, observed = the heap offset of
/// `local` (~0 when it is outside this rank's heap), peer = pe when it is a rank of the team (else -1).
struct UnreachablePeer {
    SpinSite site;
    uint64_t expected;
    uint64_t offset;
};

__device__ __forceinline__ UnreachablePeer unreachable_peer(const DeviceCtx& ctx, const void* local, int pe, int line) {
    const auto a = reinterpret_cast<uintptr_t>(local);
    const auto base = reinterpret_cast<uintptr_t>(ctx.heap_base);
    const uint64_t offset = (a >= base && a - base < ctx.heap_bytes) ? a - base : ~0ull;
    const int32_t peer = (pe >= 0 && pe < ctx.num_ranks) ? pe : -1;
    return {SpinSite{SpinKind::kUnreachablePeer, peer, line}, static_cast<uint64_t>(static_cast<int64_t>(pe)), offset};
}

}  // namespace detail

/// symm_at() for the put/get/signal paths: a null result ends the kernel with a diagnostic of kind
/// kUnreachablePeer naming the local address and the peer (expected = pe, observed = heap offset or
/// ~0 when the pointer is outside the heap), instead of faulting on a null pointer later.
template <class T>
__device__ __forceinline__ T* symm_at_or_trap(const DeviceCtx& ctx, T* local, int pe, int line) {
    T* p = symm_at(ctx, local, pe);
    if (p == nullptr) {
        const detail::UnreachablePeer u = detail::unreachable_peer(ctx, local, pe, line);
        fail_and_trap(ctx, u.site, Cmp::kEq, local, u.expected, u.offset, 0);
    }
    return p;
}

/// symm_at_or_trap() for the `bytes` bytes at `local` (a put's destination, a get's source): also ends the kernel
/// with kUnreachablePeer, cmp kLe and waited_ns = bytes, when they run past the end of this rank's symmetric heap
/// (the peer's copy would run past its heap too, into other memory). Zero bytes touch no memory: nullptr, whatever
/// `local` is (one past the heap's end, null), as OpenSHMEM allows for a put or get of no elements.
template <class T>
__device__ __forceinline__ T* symm_range_at_or_trap(const DeviceCtx& ctx, T* local, uint64_t bytes, int pe, int line) {
    if (bytes == 0) return nullptr;
    T* p = symm_at_or_trap(ctx, local, pe, line);
    const uint64_t offset = reinterpret_cast<uintptr_t>(local) - reinterpret_cast<uintptr_t>(ctx.heap_base);
    if (bytes > ctx.heap_bytes - offset) {  // offset < heap_bytes: symm_at_or_trap returned
        const detail::UnreachablePeer u = detail::unreachable_peer(ctx, local, pe, line);
        fail_and_trap(ctx, u.site, Cmp::kLe, local, u.expected, u.offset, bytes);
    }
    return p;
}

/// symm_at_or_trap that returns instead of trapping: the peer's address, or nullptr after recording the same
/// kUnreachablePeer diagnostic (record_diagnostic) and raising the abort word (raise_abort: this rank's other waits
/// and, through the watchdog, its peers' stop, as after spin_until_checked). Fully inline, no reachable call and no
/// reachable trap (see spin_until_checked); the caller ends the kernel once it may. Any thread.
template <class T>
__device__ __forceinline__ T* symm_at_checked(const DeviceCtx& ctx, T* local, int pe, int line) {
    T* p = symm_at(ctx, local, pe);
    if (p == nullptr) {
        const detail::UnreachablePeer u = detail::unreachable_peer(ctx, local, pe, line);
        record_diagnostic(ctx, u.site, Cmp::kEq, local, u.expected, u.offset, 0);
        raise_abort(ctx);
    }
    return p;
}

}  // namespace weft::device
