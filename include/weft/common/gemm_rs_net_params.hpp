// SPDX-License-Identifier: MIT
// Kernel parameters of GEMM+ReduceScatter across nodes (docs/multinode.md, "GEMM+ReduceScatter across nodes"): the
// final sum of the nodes' partial sums of this rank's rows (rs_node_sum_kernel, kernels/gemm_rs/node_sum.cuh). Kept
// apart from tp_params.hpp, which the one-node kernels include: their sources, and so their cache keys, stay as they
// are.
#pragma once

#include "weft/common/macros.hpp"  // fixed-width integers under g++, nvcc and NVRTC

namespace weft {

/// At most this many nodes in a GemmRs team that spans nodes (one input of the final sum per node).
inline constexpr int kRsMaxNodes = 32;
/// Threads per CTA of rs_node_sum_kernel.
inline constexpr int kRsNodeSumThreads = 256;

/// out[r, c] = sum over i < num_inputs of inputs[i][r * ld_in + c] (fp32 sum in input order, one rounding into the
/// output dtype), r < rows, c < cols. Every input and out hold 16-bit elements; inputs' rows are ld_in elements apart
/// (a multiple of 8, 16-byte aligned bases), out's ldc (16-byte aligned rows, or one row). Nothing is written when
/// any of descs[0 .. num_inputs) differs from `signature` (calls that differ across nodes, which net_check_calls_kernel
/// reported: out keeps what it held).
struct RsNodeSumParams {
    const void* inputs[kRsMaxNodes];
    const uint64_t* descs;
    uint64_t signature;
    int32_t num_inputs;
    int64_t rows;
    int64_t cols;
    int64_t ld_in;
    void* out;
    int64_t ldc;
};

}  // namespace weft
