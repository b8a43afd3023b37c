// SPDX-License-Identifier: MIT
// What the TP MoE steps (moe_tp.cpp) and the fused TP MoE layers (moe_tp_layers.cpp) share: argument checks, the MoE
// kernels and their launch shapes, the routing's arrays as views.
#pragma once

#include <cstdint>

#include "weft/jit/kernel.hpp"
#include "weft/ops/moe_tp.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::ops::moe_detail {

inline constexpr int64_t kMaxTopk = 64;  ///< topk of a routing and of a layer's shape

/// SMs of the current device.
int num_sms();
/// A 1-D launch of `grid` (at least 1) CTAs of `block` threads on `stream`.
jit::LaunchParams launch_params(int grid, int block, cudaStream_t stream);
/// A row-major 2-D view of `dtype` with `rows` x `cols` (cols < 0: any), inner stride 1, 16-byte aligned base and row
/// stride; `what` names it. `written`: the op writes it, so its rows must not repeat or overlap (an input read only
/// may broadcast a row).
void check_matrix(const TensorView& v, const char* op, const char* what, DType dtype, int64_t rows, int64_t cols,
                  bool written = true);
/// A densely packed row-major [rows, cols] array of `dtype` read element by element (indices, weights): 4-byte aligned.
void check_dense(const TensorView& v, const char* op, const char* what, DType dtype, int64_t rows, int64_t cols);
/// The routing's sizes and arrays (given, aligned), naming `op`.
void check_routing(const MoeRouting& r, const char* op);
/// The MoE kernel `name` (moe_kernel_names), compiled and loaded.
jit::Kernel& moe_kernel(const char* name);
/// CTAs of a memory kernel (gather, combine) over `items` rows or tokens: a warp each, at most 4 per SM.
int memory_grid(int64_t items);
/// The gather kernel: a_rows[r] = a[gather_index[r]] (zeros for -1) for the routing's rows_capacity rows, on `stream`.
void launch_gather(const TensorView& a, const MoeRouting& r, const TensorView& a_rows, cudaStream_t stream);
/// The routing kernels over topk_idx [tokens, topk] into `r`'s arrays, on `stream`.
void launch_route(const int32_t* topk_idx, const MoeRouting& r, int64_t align, cudaStream_t stream,
                  MoeRoutingStatus* status);
/// The routing's arrays as views (their bytes, for the overlap checks).
TensorView counts_view(const MoeRouting& r);
TensorView offsets_view(const MoeRouting& r);
TensorView slot_rows_view(const MoeRouting& r);

}  // namespace weft::ops::moe_detail
