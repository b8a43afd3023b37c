// SPDX-License-Identifier: MIT
// The layout kernel: per-expert and per-rank token counts, the token->rank mask and stable send offsets of one rank's
// routing.
#pragma once

#include "ep/common.cuh"
#include "weft/common/device_ctx.hpp"
#include "weft/common/ep_workspace.hpp"
#include "weft/device/trace.cuh"

namespace weft::kernels::ep {

/// Compile-time knobs of the layout kernel.
struct LayoutConfig {
    int threads = 512;  ///< one block; a multiple of 32, 64..1024
};

__host__ __device__ constexpr bool is_valid(const LayoutConfig& c) {
    return c.threads >= 64 && c.threads <= 1024 && c.threads % 32 == 0;
}

/// One block (LayoutSmem bytes of dynamic shared memory). Reads a.topk_idx for a.num_tokens tokens and
/// writes the handle's tokens_per_expert, tokens_per_rank, token_in_rank, send_idx and route_pos. Local
/// only (no peer is touched); graph-capturable. Invalid or repeated expert ids are reported to
/// a.status and dropped. Traced builds (weft/device/trace.cuh): "layout" from thread 0.
template <LayoutConfig C>
__global__ void __launch_bounds__(C.threads, 1) layout(weft::DeviceCtx ctx, weft::ep::NormalArgs a) {
    static_assert(is_valid(C), "LayoutConfig: threads must be a multiple of 32 in 64..1024");
    extern __shared__ __align__(16) uint8_t smem[];
    WEFT_TRACE_BEGIN(layout_t0);
    const Geometry g = a.geo;
    const weft::ep::LayoutSmem plan = weft::ep::LayoutSmem::make(g, C.threads);
    auto* hist = reinterpret_cast<int32_t*>(smem + plan.hist);
    auto* rank_hist = reinterpret_cast<int32_t*>(smem + plan.rank_hist);
    (void)ctx;
    const uint64_t call = a.buffer.state->dispatch_calls + 1;
    RouteOut out{a.handle.route_pos, a.handle.tokens_per_expert, a.handle.token_in_rank, a.handle.send_idx,
                 a.handle.tokens_per_rank};
    compute_routes(g, a.topk_idx, a.idx_stride, a.num_tokens, hist, rank_hist, out, a.status, true, call,
                   KernelId::kLayout);
    WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kLayout, TraceRole::kComm, layout_t0, a.num_tokens, 0, 0, 0);
}

}  // namespace weft::kernels::ep
