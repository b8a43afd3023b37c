// SPDX-License-Identifier: MIT
// The chain GEMM's kernel parameters: one definition for the host (g++) and the kernel (NVRTC).
#pragma once

#include "weft/common/device_ctx.hpp"

namespace example {

/// WaitForRows's Params: before loading a tile's rows of X, wait until rows_ready[tile row] >= expected.
struct ChainWait {
    weft::DeviceCtx ctx;
    const uint64_t* rows_ready;  ///< this rank's signals, one per row of tiles (the previous rank adds to them)
    uint64_t expected;           ///< tiles per row the previous rank has stored by the end of this call
    int32_t wait;                ///< 0: this rank's X is its own (rank 0), nothing to wait for
    int32_t unused = 0;
};

/// NotifyNextRank's Params: after a tile is stored, rows_ready[tile row] += 1 on next_rank.
struct ChainNotify {
    weft::DeviceCtx ctx;
    uint64_t* rows_ready;  ///< symmetric: the same words on every rank
    int32_t next_rank;     ///< -1: the last rank of the chain keeps its output
    int32_t unused = 0;
};

}  // namespace example
