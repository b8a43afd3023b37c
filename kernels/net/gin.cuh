// SPDX-License-Identifier: MIT
// weft's device calls over NCCL's GIN (GPU-initiated networking): put a chunk of the symmetric heap to a peer on
// another node with a signal add, raise a signal alone, and wait for a signal with weft's bounded wait.
//
// The host side is weft::net::GinBackend (weft/net/gin.hpp): it registers the symmetric heap as an NCCL window and
// creates the ncclDevComm with GIN signals; a kernel receives both (GinBackend::device_comm(), ::heap_window()) as
// arguments, with its DeviceCtx, and builds a Gin from them:
//
//     __global__ void k(weft::DeviceCtx ctx, ncclDevComm comm, ncclWindow_t heap, ...) {
//         const weft::net::Gin gin(ctx, comm, heap);
//         gin.put_signal_add(weft::device::Block{}, peer, dst, src, bytes, signal_idx, 1);
//         gin.wait_signal_ge(weft::device::Block{}, signal_idx, epoch, peer);
//     }
//
// Addresses are this rank's pointers into its own symmetric heap (ctx.heap_base ...): the object at the same offset
// on `peer` is written, as with shmem::putmem. Ranks are team ranks of the team the backend was made on (its NCCL
// communicator's ranks).
//
// NOTE: nvcc only. NVRTC (CUDA 13.0) cannot compile NCCL 2.28's device headers faithfully: it is not a GNU-mode
// front end, so the GNU attributes that follow a struct's closing brace (`} __attribute__((packed)) flag;` in
// nccl_device/gin/proxy/gin_proxy_device_host_common.h,
// `} __attribute__((__packed__)) __attribute__((__aligned__(4)));` in the DOCA GPUNetIO verbs headers of the GDAKI
// backend) are ignored ("attribute does not apply to any entity"),
// which changes the descriptor layouts (the proxy's 64-byte descriptor static_assert fails), and
// nccl::utility::loadConst declares zero-length arrays in branches of a plain `if`, an error outside GNU mode. Besides,
// nccl_device/core.h declares `__host__` functions, which NVRTC rejects. So this header is for nvcc kernels; JIT
// kernels use gin_jit.cuh's GinLinked, whose calls an nvcc-built library provides (kernels/net/README.md).
#pragma once

#if defined(__CUDACC_RTC__)
#error "kernels/net/gin.cuh needs nvcc: NVRTC cannot compile NCCL's GIN device headers (see the NOTE above)"
#endif

#include <nccl.h>
#include <nccl_device.h>

#include "weft/common/device_ctx.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/device/scope.cuh"
#include "weft/device/spin.cuh"

#include "net/gin_wait.cuh"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 28, 0)
#error "kernels/net/gin.cuh needs NCCL >= 2.28 (its device API with GIN)"
#endif

namespace weft::net {

namespace detail {

/// NCCL's cooperative group for a weft group: Thread -> ncclCoopThread, Warp -> ncclCoopWarp, Block -> ncclCoopCta.
/// NOTE: ncclCoopCta numbers threads by threadIdx.x alone, so Block calls need one-dimensional blocks.
template <class Group>
struct NcclCoop;
template <>
struct NcclCoop<device::Thread> {
    using type = ncclCoopThread;
};
template <>
struct NcclCoop<device::Warp> {
    using type = ncclCoopWarp;
};
template <>
struct NcclCoop<device::Block> {
    using type = ncclCoopCta;
};

}  // namespace detail

/// A rank's GIN endpoint inside a kernel: its DeviceCtx (heap base, timeout, diagnostics, abort word), the
/// ncclDevComm and the heap's NCCL window. Cheap to build (a few loads from the devComm); build one per thread
/// that calls it. `context_idx` picks one of the devComm's GIN contexts (modulo their number): separate contexts
/// are separate queues, so blocks that use different ones do not serialise on one queue.
class Gin {
public:
    __device__ __forceinline__ Gin(const DeviceCtx& ctx, const ncclDevComm& comm, ncclWindow_t heap_window,
                                   int context_idx = 0)
        : ctx_(ctx), comm_(comm), window_(heap_window), gin_(comm, context_idx) {}

    /// Group call (every thread of `group` calls with the same arguments): writes `bytes` bytes at `src` (this
    /// rank's heap) to the same offset as `dst` on team rank `peer`'s heap, then adds `value` to GIN signal
    /// `signal_idx` on `peer`. The signal is visible on `peer` only after this put's bytes and those of every earlier
    /// put of this context to `peer` (NCCL's guarantee). Writes of `group` before the call are released to the
    /// network (the call synchronises the group first). Returns once the put is posted: `src` may be reused after
    /// flush(). `dst` and `src` must lie in the heap (no check on the device).
    template <class Group>
    __device__ __forceinline__ void put_signal_add(Group group, int peer, const void* dst, const void* src,
                                                   size_t bytes, uint32_t signal_idx, uint64_t value) const {
        using Coop = typename detail::NcclCoop<Group>::type;
        (void)group;
        gin_.put(ncclTeamWorld(comm_), peer, window_, heap_offset(dst), window_, heap_offset(src), bytes,
                 ncclGin_SignalAdd{signal_idx, value}, ncclGin_None{}, Coop{});
    }

    /// Group call: put without a signal (a later signal_add or put_signal_add to `peer` on this context orders
    /// after it).
    template <class Group>
    __device__ __forceinline__ void put(Group group, int peer, const void* dst, const void* src, size_t bytes) const {
        using Coop = typename detail::NcclCoop<Group>::type;
        (void)group;
        gin_.put(ncclTeamWorld(comm_), peer, window_, heap_offset(dst), window_, heap_offset(src), bytes,
                 ncclGin_None{}, ncclGin_None{}, Coop{});
    }

    /// Group call: adds `value` to signal `signal_idx` on `peer`, after every earlier put of this context to `peer`.
    template <class Group>
    __device__ __forceinline__ void signal_add(Group group, int peer, uint32_t signal_idx, uint64_t value) const {
        using Coop = typename detail::NcclCoop<Group>::type;
        (void)group;
        gin_.signal(ncclTeamWorld(comm_), peer, ncclGin_SignalAdd{signal_idx, value}, Coop{});
    }

    /// Group call: every source buffer of the group's earlier puts on this context may be reused. Says nothing
    /// about arrival at the peer (wait for its signal for that).
    template <class Group>
    __device__ __forceinline__ void flush(Group group) const {
        using Coop = typename detail::NcclCoop<Group>::type;
        (void)group;
        gin_.flush(Coop{});
    }

    /// This rank's signal `signal_idx` (an acquire load at system scope).
    __device__ __forceinline__ uint64_t read_signal(uint32_t signal_idx) const {
        return gin_.readSignal(signal_idx, 64, cuda::memory_order_acquire);
    }

    /// Group call: waits until this rank's signal `signal_idx` is >= `expected` (signals only grow: add-only
    /// protocols with epochs), then the group synchronises; the puts that raised it are visible to the whole
    /// group. Bounded like every weft wait (ctx.timeout_ns, the World's abort word): on expiry the leader records a
    /// Diagnostic (kind kSignalWait, the signal's index as its address, `from_peer` as the rank that owes it; -1:
    /// unknown), raises the abort word, and the group's threads end together (exit); the host's
    /// World::sync_and_check reports it. Returns the observed value to every thread.
    template <class Group>
    __device__ __forceinline__ uint64_t wait_signal_ge(Group group, uint32_t signal_idx, uint64_t expected,
                                                       int from_peer = -1, int line = 0) const {
        return detail::wait_signal_ge(group, ctx_, [&] { return read_signal(signal_idx); }, signal_idx, expected,
                                      from_peer, line);
    }

    __device__ __forceinline__ const ncclDevComm& comm() const { return comm_; }

private:
    __device__ __forceinline__ size_t heap_offset(const void* p) const {
        return static_cast<size_t>(static_cast<const uint8_t*>(p) - ctx_.heap_base);
    }

    const DeviceCtx& ctx_;
    const ncclDevComm& comm_;
    ncclWindow_t window_;
    ncclGin gin_;
};

}  // namespace weft::net
