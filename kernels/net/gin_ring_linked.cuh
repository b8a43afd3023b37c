// SPDX-License-Identifier: MIT
// gin_ring.cuh's ring for JIT kernels: the same tile, put and wait, through GinLinked (gin_jit.cuh), so that it
// compiles under NVRTC and links weft's GIN device library (GinBackend::device_library()) with LTO.
#pragma once

#include "net/gin_jit.cuh"

namespace weft::kernels::net {

/// See gin_ring_put_tile (gin_ring.cuh); `gin_comm` is GinBackend::device_comm_ptr(), `heap_window` its
/// heap_window().
__global__ void gin_ring_put_tile_linked(DeviceCtx ctx, const void* gin_comm, void* heap_window, const void* src,
                                         void* dst, uint64_t tile_bytes, uint32_t signal_idx, uint64_t epoch) {
    const weft::net::GinLinked gin(ctx, gin_comm, heap_window);
    const int next = (ctx.rank + 1) % ctx.num_ranks;
    const int prev = (ctx.rank + ctx.num_ranks - 1) % ctx.num_ranks;
    gin.put_signal_add(device::Block{}, next, dst, src, tile_bytes, signal_idx, 1);
    gin.wait_signal_ge(device::Block{}, signal_idx, epoch, prev, __LINE__);
    gin.flush(device::Block{});
}

}  // namespace weft::kernels::net
