// SPDX-License-Identifier: MIT
// The tile layer: Triton-distributed's primitives (rank, num_ranks, symm_at, wait, consume_token, notify).
//
// A producer finishes a tile and raises one signal (notify); a consumer waits for the signals of the
// data its tile needs (wait) and receives a Token; the loads of that data take the Token
// (consume_token, or a TMA load that requires one), so they cannot be issued before the wait.
// Signal indices come from a tile map (weft/common/tile_map.hpp) that producer and consumer share.
//
//     Token t = tile::wait(Block{}, ctx, signals + r.first, r.count(), Cmp::kGe, epoch);
//     const bf16* a = tile::consume_token(a_ptr, t);      // loads through `a` follow the wait
//     ...
//     tile::notify(Block{}, ctx, &signals[idx], peer, 1, SignalOp::kAdd);   // after the tile's stores
//
// Group first, DeviceCtx second, as in the shmem layer; scope (and the wait's load semantic) are
// template parameters defaulting to system scope, which is correct between GPUs.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/device/scope.cuh"
#include "weft/device/signal.cuh"
#include "weft/device/spin.cuh"
#include "weft/device/symmetric.cuh"
#include "weft/device/token.cuh"
#include "weft/ptx/fence.cuh"

namespace weft::device::tile {

using device::SignalOp;
using weft::Cmp;

/// This rank's index in ctx's team.
__device__ __forceinline__ int rank(const DeviceCtx& ctx) { return ctx.rank; }

/// Number of ranks in ctx's team.
__device__ __forceinline__ int num_ranks(const DeviceCtx& ctx) { return ctx.num_ranks; }

/// Rank `pe`'s copy of the symmetric object `ptr`, mapped for loads and stores, or nullptr when not
/// load/store reachable (then use the shmem put/get calls). Same as shmem::ptr.
template <class T>
__device__ __forceinline__ T* symm_at(const DeviceCtx& ctx, T* ptr, int pe) {
    return device::symm_at(ctx, ptr, pe);
}

/// Waits until every one of the `n` local signal words `signals[0..n)` satisfies
/// `compare(signal, cmp, value)`. Thread i of the group polls signals i, i + size, ... (bounded, with
/// backoff; S = kAcquire polls with ld.acquire.<C>, S = kRelaxed polls with ld.relaxed.<C> and issues
/// one fence.acq_rel.<C> after success); then the group synchronises and every thread issues
/// `fence.proxy.async.global`, so both its generic loads and its TMA loads of data released by the
/// signals' writers see that data. Every thread of the group calls; n may be 0 or any count.
/// Times out with a kTileWait diagnostic naming the first signal that did not arrive.
template <ptx::Scope C = ptx::Scope::kSys, ptx::Sem S = ptx::Sem::kAcquire, class Group>
__device__ __forceinline__ Token wait(Group group, const DeviceCtx& ctx, const uint64_t* signals, int n, Cmp cmp,
                                      uint64_t value, int line = __builtin_LINE()) {
    unsigned last = 0;
    for (int i = static_cast<int>(group.rank()); i < n; i += static_cast<int>(group.size())) {
        last = static_cast<unsigned>(
            spin_until<S, C>(ctx, signals + i, cmp, value, SpinSite{SpinKind::kTileWait, -1, line}));
    }
    group.sync();
    ptx::fence_proxy_async_global();
    return Token(last);
}

/// Returns `x` unchanged, but as a value the compiler must treat as computed from `token`: loads
/// through a pointer returned here cannot be scheduled before the wait that produced the token. An
/// empty `asm volatile` with a "memory" clobber ties the two (no instruction is emitted). Any 4- or
/// 8-byte T (pointers, integers, floats).
template <class T>
__device__ __forceinline__ T consume_token(T x, Token token) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "consume_token: 4- or 8-byte values (pointers, scalars)");
    if constexpr (sizeof(T) == 8) {
        auto bits = __builtin_bit_cast(unsigned long long, x);
        asm volatile("" : "+l"(bits) : "r"(token.value()) : "memory");
        return __builtin_bit_cast(T, bits);
    } else {
        auto bits = __builtin_bit_cast(unsigned, x);
        asm volatile("" : "+r"(bits) : "r"(token.value()) : "memory");
        return __builtin_bit_cast(T, bits);
    }
}

/// Raises rank `pe`'s copy of the symmetric signal word `signal` (add or set `value`) with release
/// semantics at scope C, after a group barrier: every write the group made before the call (to any
/// rank) is visible to whoever observes the new value. One thread (the leader) performs the update: a
/// `.sys` release costs a MEMBAR, so raise one signal per tile. Prefer kAdd with waits `>= epoch`.
template <ptx::Scope C = ptx::Scope::kSys, class Group>
__device__ __forceinline__ void notify(Group group, const DeviceCtx& ctx, uint64_t* signal, int pe, uint64_t value,
                                       SignalOp op = SignalOp::kAdd, int line = __builtin_LINE()) {
    uint64_t* remote = symm_at_or_trap(ctx, signal, pe, line);
    group.sync();
    if (group.is_leader()) {
        signal_release<C>(remote, value, op);
    }
}

}  // namespace weft::device::tile
