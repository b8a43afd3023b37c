// SPDX-License-Identifier: MIT
// GEMM+ReduceScatter across nodes (docs/multinode.md, "GEMM+ReduceScatter across nodes"): the last step of a call,
// after the node stage and the network steps: this rank's rows of C are the sum of every node's partial sum of them
// (its own node's from the node stage, the others' received over the network), in fp32, rounded once.
//
// JIT instantiation (weft::ops::GemmRs builds it for a team that spans nodes):
//   weft::kernels::gemm_rs::rs_node_sum_kernel<DTYPE>
#pragma once

#include "tp_common/tp_device.cuh"
#include "weft/common/dtype.hpp"
#include "weft/common/gemm_rs_net_params.hpp"

namespace weft::kernels::gemm_rs {

/// Grid-stride over 8-element vectors of the output (a ragged last vector of a row element by element). Plain loads:
/// the inputs were written by kernels and NCCL receives that precede this launch in stream order.
template <DType kT>
__global__ void __launch_bounds__(kRsNodeSumThreads) rs_node_sum_kernel(const RsNodeSumParams p) {
    static_assert(kT == DType::kBF16 || kT == DType::kF16, "the node sums are 16-bit");
    for (int32_t s = 0; s < p.num_inputs; ++s) {
        if (p.descs[s] != p.signature) return;  // calls that differ (net_check_calls_kernel recorded it)
    }
    constexpr int64_t kVec = 8;
    const int64_t vecs_per_row = (p.cols + kVec - 1) / kVec;
    const int64_t total = p.rows * vecs_per_row;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int64_t r = i / vecs_per_row;
        const int64_t col = (i - r * vecs_per_row) * kVec;
        auto* out = static_cast<unsigned char*>(p.out) + (r * p.ldc + col) * 2;
        const int64_t in_off = (r * p.ld_in + col) * 2;
        if (col + kVec <= p.cols) {
            float acc[8] = {-0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f};  // -0: a sum of -0 is -0
            for (int32_t s = 0; s < p.num_inputs; ++s) {
                float v[8];
                tp_common::load8<kT>(static_cast<const unsigned char*>(p.inputs[s]) + in_off, v);
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[j] += v[j];
            }
            tp_common::store8<kT>(out, acc);
        } else {
            for (int64_t j = 0; col + j < p.cols; ++j) {
                float acc = -0.f;
                for (int32_t s = 0; s < p.num_inputs; ++s) {
                    acc += tp_common::load_elem<kT>(static_cast<const unsigned char*>(p.inputs[s]) + in_off, j);
                }
                tp_common::store_elem<kT>(out, j, acc);
            }
        }
    }
}

}  // namespace weft::kernels::gemm_rs
