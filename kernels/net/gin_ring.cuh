// SPDX-License-Identifier: MIT
// A ring over GIN, the network backend's smallest end-to-end kernel: each rank puts one tile of its heap to the next
// rank with a signal add, then waits for the previous rank's tile. Used by the GIN tests; nvcc only (gin.cuh).
//
//   rank r:  put  src[r] ──GIN──▶ dst on rank r+1, signal `signal_idx` += 1 there
//            wait signal `signal_idx` >= epoch (rank r-1's tile has landed in dst here)
#pragma once

#include "net/gin.cuh"

namespace weft::kernels::net {

/// One block of one-dimensional threads (the put and the wait are Block calls). `src` and `dst` point into this
/// rank's symmetric heap; `epoch` counts the calls made with this signal (1 on the first): the signal only grows,
/// so nothing is reset between calls. After the kernel, dst holds the previous rank's src tile.
__global__ void gin_ring_put_tile(DeviceCtx ctx, ncclDevComm comm, ncclWindow_t heap_window, const void* src,
                                  void* dst, size_t tile_bytes, uint32_t signal_idx, uint64_t epoch) {
    const weft::net::Gin gin(ctx, comm, heap_window);
    const int next = (ctx.rank + 1) % ctx.num_ranks;
    const int prev = (ctx.rank + ctx.num_ranks - 1) % ctx.num_ranks;
    gin.put_signal_add(device::Block{}, next, dst, src, tile_bytes, signal_idx, 1);
    gin.wait_signal_ge(device::Block{}, signal_idx, epoch, prev, __LINE__);
    gin.flush(device::Block{});
}

}  // namespace weft::kernels::net
