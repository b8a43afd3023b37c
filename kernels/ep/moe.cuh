// SPDX-License-Identifier: MIT
// The SwiGLU between a MoE block's two expert GEMMs (weft::ops::ep::MoeBlock): the up-projection's output holds gate
// and up side by side ([rows, 2F]: gate in columns [0, F), up in [F, 2F)); the down-projection reads
// silu(gate) * up ([rows, F]). Row count from the device (the dispatch's expert_offsets[E_local]: padding rows between
// experts included, their values unspecified and never read downstream).
#pragma once

#include "ep/common.cuh"
#include "weft/common/ep_workspace.hpp"

namespace weft::kernels::ep {

/// out[r][j] = bf16(silu(g) * u), g = float(gate_up[r][j]), u = float(gate_up[r][F + j]), silu(g) = g / (1 + exp(-g))
/// in fp32 (__expf), for r < min(*rows_end, max_rows) (a negative count computes nothing). One warp per row at a
/// time, 8 channels per lane per step; any grid, kThreads threads.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) moe_swiglu(weft::ep::MoeSwigluArgs a) {
    static_assert(kThreads % 32 == 0 && kThreads >= 32 && kThreads <= 1024, "moe_swiglu: whole warps, <= 1024");
    const int end = min(*a.rows_end, a.max_rows);
    const int warps = static_cast<int>(gridDim.x) * (kThreads / 32);
    const int granules = a.ffn / 8;
    for (int r = static_cast<int>(blockIdx.x) * (kThreads / 32) + warp_id(); r < end; r += warps) {
        const auto* gate = reinterpret_cast<const uint4*>(a.gate_up + static_cast<int64_t>(r) * a.gate_up_stride);
        const auto* up = gate + granules;
        auto* out = reinterpret_cast<uint4*>(a.out + static_cast<int64_t>(r) * a.out_stride);
        for (int i = lane_id(); i < granules; i += 32) {
            const uint4 gv = ptx::ld(gate + i);
            const uint4 uv = ptx::ld(up + i);
            float g[8];
            float u[8];
            bf16x8_to_f32(gv, g);
            bf16x8_to_f32(uv, u);
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                g[q] = g[q] / (1.0f + __expf(-g[q])) * u[q];
            }
            ptx::st(out + i, f32_to_bf16x8(g));
        }
    }
}

}  // namespace weft::kernels::ep
