// SPDX-License-Identifier: MIT
// weft's GIN device library: the extern "C" functions gin_jit.cuh declares, over NCCL's device API. nvcc compiles it
// (as a .cu) into LTO IR that JIT kernels link through nvJitLink (GinBackend::device_library()); nvcc only, as
// gin.cuh.
#pragma once

#include "net/gin.cuh"
#include "net/gin_jit.cuh"

namespace weft::net::detail {

__device__ __forceinline__ const ncclDevComm& dev_comm_of(const void* p) { return *static_cast<const ncclDevComm*>(p); }

}  // namespace weft::net::detail

extern "C" __device__ void weft_gin_put(const void* dev_comm, void* window, int context_idx, int peer,
                                        uint64_t dst_offset, uint64_t src_offset, uint64_t bytes, int with_signal,
                                        uint32_t signal_idx, uint64_t signal_add) {
    const ncclDevComm& comm = weft::net::detail::dev_comm_of(dev_comm);
    const ncclGin gin(comm, context_idx);
    const auto win = static_cast<ncclWindow_t>(window);
    if (with_signal != 0) {
        gin.put(ncclTeamWorld(comm), peer, win, dst_offset, win, src_offset, bytes,
                ncclGin_SignalAdd{signal_idx, signal_add}, ncclGin_None{}, ncclCoopThread{});
    } else {
        gin.put(ncclTeamWorld(comm), peer, win, dst_offset, win, src_offset, bytes, ncclGin_None{}, ncclGin_None{},
                ncclCoopThread{});
    }
}

extern "C" __device__ void weft_gin_signal_add(const void* dev_comm, int context_idx, int peer, uint32_t signal_idx,
                                               uint64_t value) {
    const ncclDevComm& comm = weft::net::detail::dev_comm_of(dev_comm);
    const ncclGin gin(comm, context_idx);
    gin.signal(ncclTeamWorld(comm), peer, ncclGin_SignalAdd{signal_idx, value}, ncclCoopThread{});
}

extern "C" __device__ void weft_gin_flush(const void* dev_comm, int context_idx) {
    const ncclGin gin(weft::net::detail::dev_comm_of(dev_comm), context_idx);
    gin.flush(ncclCoopThread{});
}

extern "C" __device__ uint64_t weft_gin_read_signal(const void* dev_comm, int context_idx, uint32_t signal_idx) {
    const ncclGin gin(weft::net::detail::dev_comm_of(dev_comm), context_idx);
    return gin.readSignal(signal_idx, 64, cuda::memory_order_acquire);
}
