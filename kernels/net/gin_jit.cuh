// SPDX-License-Identifier: MIT
// GIN from JIT-compiled (NVRTC) kernels: weft::net::GinLinked, the calls of gin.cuh's Gin over weft's GIN device
// library instead of NCCL's headers, which NVRTC cannot compile (kernels/net/README.md says why).
//
// The library (gin_link.cuh, built by nvcc into LTO IR: GinBackend::device_library()) defines the extern "C"
// functions declared here over NCCL's device API. A JIT kernel that includes this header is compiled with
// CompileOptions{.lto = true, .link_files = {GinBackend::device_library()}}: nvJitLink links the two and, with LTO,
// inlines the library, so the kernel's SASS holds NCCL's put and signal code with no call. Compiles under nvcc too.
//
//     __global__ void k(weft::DeviceCtx ctx, const void* gin_comm, void* heap_window, ...) {
//         const weft::net::GinLinked gin(ctx, gin_comm, heap_window);   // GinBackend::device_comm_ptr(), heap_window()
//         gin.put_signal_add(weft::device::Block{}, peer, dst, src, bytes, signal_idx, 1);
//         gin.wait_signal_ge(weft::device::Block{}, signal_idx, epoch, peer, __LINE__);
//     }
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/device/scope.cuh"

#include "net/gin_wait.cuh"

/// weft's GIN device library (thread calls; defined in gin_link.cuh). `dev_comm` points to an ncclDevComm in device
/// memory (GinBackend::device_comm_ptr()), `window` is an ncclWindow_t (GinBackend::heap_window()), offsets are
/// window (= symmetric heap) offsets, `peer` a rank of the devComm's communicator, `context_idx` a GIN context
/// (taken modulo their number). See gin.cuh's Gin for each call's guarantees.
extern "C" {
/// Put `bytes` from `src_offset` here to `dst_offset` on `peer`; with `with_signal`, then add `signal_add` to
/// signal `signal_idx` on `peer` (visible after the bytes).
__device__ void weft_gin_put(const void* dev_comm, void* window, int context_idx, int peer, uint64_t dst_offset,
                             uint64_t src_offset, uint64_t bytes, int with_signal, uint32_t signal_idx,
                             uint64_t signal_add);
/// Add `value` to signal `signal_idx` on `peer`, after the earlier puts of this context to `peer`.
__device__ void weft_gin_signal_add(const void* dev_comm, int context_idx, int peer, uint32_t signal_idx,
                                    uint64_t value);
/// The sources of this thread's earlier puts on this context may be reused.
__device__ void weft_gin_flush(const void* dev_comm, int context_idx);
/// This rank's signal `signal_idx` (acquire, system scope).
__device__ uint64_t weft_gin_read_signal(const void* dev_comm, int context_idx, uint32_t signal_idx);
}

namespace weft::net {

/// gin.cuh's Gin for JIT kernels: the same group calls (the group synchronises, its leader posts, the group
/// synchronises again: NCCL's own cooperative-group contract) and the same bounded wait. Build one per thread.
class GinLinked {
public:
    __device__ __forceinline__ GinLinked(const DeviceCtx& ctx, const void* dev_comm, void* heap_window,
                                         int context_idx = 0)
        : ctx_(ctx), comm_(dev_comm), window_(heap_window), context_idx_(context_idx) {}

    template <class Group>
    __device__ __forceinline__ void put_signal_add(Group group, int peer, const void* dst, const void* src,
                                                   uint64_t bytes, uint32_t signal_idx, uint64_t value) const {
        group.sync();
        if (group.is_leader()) {
            weft_gin_put(comm_, window_, context_idx_, peer, heap_offset(dst), heap_offset(src), bytes, 1,
                         signal_idx, value);
        }
        group.sync();
    }

    template <class Group>
    __device__ __forceinline__ void put(Group group, int peer, const void* dst, const void* src,
                                        uint64_t bytes) const {
        group.sync();
        if (group.is_leader()) {
            weft_gin_put(comm_, window_, context_idx_, peer, heap_offset(dst), heap_offset(src), bytes, 0, 0, 0);
        }
        group.sync();
    }

    template <class Group>
    __device__ __forceinline__ void signal_add(Group group, int peer, uint32_t signal_idx, uint64_t value) const {
        group.sync();
        if (group.is_leader()) {
            weft_gin_signal_add(comm_, context_idx_, peer, signal_idx, value);
        }
        group.sync();
    }

    /// Group call: the sources of the group's earlier puts may be reused (the leader posted them all).
    template <class Group>
    __device__ __forceinline__ void flush(Group group) const {
        group.sync();
        if (group.is_leader()) {
            weft_gin_flush(comm_, context_idx_);
        }
        group.sync();
    }

    __device__ __forceinline__ uint64_t read_signal(uint32_t signal_idx) const {
        return weft_gin_read_signal(comm_, context_idx_, signal_idx);
    }

    template <class Group>
    __device__ __forceinline__ uint64_t wait_signal_ge(Group group, uint32_t signal_idx, uint64_t expected,
                                                       int from_peer = -1, int line = 0) const {
        return detail::wait_signal_ge(group, ctx_, [&] { return read_signal(signal_idx); }, signal_idx, expected,
                                      from_peer, line);
    }

private:
    __device__ __forceinline__ uint64_t heap_offset(const void* p) const {
        return static_cast<uint64_t>(static_cast<const uint8_t*>(p) - ctx_.heap_base);
    }

    const DeviceCtx& ctx_;
    const void* comm_;
    void* window_;
    int context_idx_;
};

}  // namespace weft::net
