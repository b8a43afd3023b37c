// SPDX-License-Identifier: MIT
// Sequence-parallel decode, the cross-rank half: every rank's decode kernels pushed their final rows (fp32 output and
// LSE of their KV shard) as LL lines into every rank's LL buffer (kernels/attention/decode.cuh, push_row_part); this
// collective kernel polls them and merges them by their LSE.
//
// Launched by weft::ops::sp_decode_attention (src/ops/attention_sp.cpp) through the collective workspace, one
// specialisation per ReduceKernelConfig (its dtype is the output's). Protocol: kernels/common/collective.cuh (an LL
// kernel: no barrier; it runs under the epoch the pushes were flagged with and advances it). README.md here.
#pragma once

#include "common/collective.cuh"
#include "weft/common/attention.hpp"

namespace weft::kernels::attention {

/// p.count = rows (sequences x q-heads), p.out_stride = head_dim (64, 128 or 256), p.out = output [rows, head_dim]
/// (C.dtype), p.res = fp32 LSE [rows] or null. Thread item i covers 4 columns of one row: it polls every rank's LSE
/// line and 2 data lines of that row, and writes sum_q e^(lse_q - lse) o_q with lse = ln sum_q e^(lse_q) (zeros and
/// -inf when every rank's shard was empty). Each LSE line carries its sender's tag (AttentionPeerPush::tag, 32 bits
/// of its call descriptor): one that differs from this call's records a kCollectiveMismatch (the abort word
/// raised) and ends the thread, which writes nothing.
template <ReduceKernelConfig C>
__global__ void __launch_bounds__(C.block_threads, collective_min_blocks_per_sm(C.block_threads))
    attention_sp_combine(DeviceCtx ctx, CollectiveParams p) {
    static_assert(is_valid(C), "ReduceKernelConfig: see is_valid() in weft/common/collectives.hpp");
    using N = common::Num<C.dtype>;
    using Bits = typename N::Bits;
    common::BlockState st(ctx, p);
    const int n = ctx.num_ranks;
    const uint32_t flag = low_latency_flag(st.epoch());
    const auto dim = static_cast<int64_t>(p.out_stride);
    const int64_t row_lines = attention_push_row_lines(dim);
    const int64_t items = static_cast<int64_t>(p.count) * (dim / 4);
    const float neg_inf = __int_as_float(0xff800000);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < items;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t row = i / (dim / 4);
        const int64_t col = (i % (dim / 4)) * 4;
        const uint64_t line = static_cast<uint64_t>(row * row_lines);
        float m = neg_inf;
        for (int q = 0; q < n; ++q) {
            const uint8_t* lse_line = st.ll_slot(q) + (line + dim / 2) * kLowLatencyLineBytes;
            const uint2 v = device::ll::wait_line_from(ctx, lse_line, flag, q);
            if (v.y != attention_push_tag(p.descriptor)) {
                device::fail_and_exit(ctx, device::SpinSite{SpinKind::kCollectiveMismatch, q, __LINE__}, Cmp::kEq,
                                      lse_line, p.descriptor, attention_descriptor_of_tag(p.descriptor, v.y), 0, false);
            }
            m = fmaxf(m, __uint_as_float(v.x));
        }
        float total = 0.f;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (m != neg_inf) {
            for (int q = 0; q < n; ++q) {
                const uint8_t* slot = st.ll_slot(q);
                const uint2 l =
                    device::ll::wait_line_from(ctx, slot + (line + dim / 2) * kLowLatencyLineBytes, flag, q);
                const float w = __expf(__uint_as_float(l.x) - m);  // 0 for a rank with an empty shard
                const uint2 a =
                    device::ll::wait_line_from(ctx, slot + (line + col / 2) * kLowLatencyLineBytes, flag, q);
                const uint2 b =
                    device::ll::wait_line_from(ctx, slot + (line + col / 2 + 1) * kLowLatencyLineBytes, flag, q);
                total += w;
                acc[0] += w * __uint_as_float(a.x);
                acc[1] += w * __uint_as_float(a.y);
                acc[2] += w * __uint_as_float(b.x);
                acc[3] += w * __uint_as_float(b.y);
            }
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        auto* out = static_cast<Bits*>(p.out) + row * dim + col;
#pragma unroll
        for (int k = 0; k < 4; ++k) out[k] = N::from_float(acc[k] * inv);
        if (p.res != nullptr && col == 0) {
            static_cast<float*>(p.res)[row] = m != neg_inf ? m + __logf(total) : neg_inf;
        }
    }
    st.finish();
}

}  // namespace weft::kernels::attention
