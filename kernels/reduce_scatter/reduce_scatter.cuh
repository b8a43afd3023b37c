// SPDX-License-Identifier: MIT
// Reduce-scatter (sum) kernels: SM pull (every rank reads its slice from every rank's source and reduces it in
// fp32, once) and low-latency (every rank pushes slice q to rank q as LL lines; rank q reduces them).
//
// Launched by weft::ops::reduce_scatter (src/ops/reduce_scatter.cpp) through the JIT, one specialisation per
// ReduceKernelConfig. Schedule and pitfalls: README.md here; shared protocol: kernels/common/collective.cuh.
#pragma once

#include "common/collective.cuh"
#include "weft/device/trace.cuh"

namespace weft::kernels::reduce_scatter {

using common::BlockState;
using common::Num;

/// SM pull: the input is num_ranks slices of p.count elements, slice q at element q * p.in_stride; rank q's output
/// is the sum of every rank's slice q. Block b: copy part b of every slice into this epoch's staging half (when
/// asked; there slice q starts at q * p.src_stride = q * p.count); meet block b of every rank; read part b of slice
/// `rank` from every rank's source, add in rank order in fp32, write `out` once; meet again only when peers read a
/// user buffer (kCollectiveExitBarrier).
template <ReduceKernelConfig C>
__global__ void __launch_bounds__(C.block_threads, collective_min_blocks_per_sm(C.block_threads))
    reduce_scatter_pull(DeviceCtx ctx, CollectiveParams p) {
    static_assert(is_valid(C), "ReduceKernelConfig: see is_valid() in weft/common/collectives.hpp");
    constexpr uint64_t kElem = sizeof(typename Num<C.dtype>::Bits);
    __shared__ const uint8_t* srcs[C.max_ranks];
    BlockState st(ctx, p);
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    const Span part = split_span(p.count, gridDim.x, blockIdx.x, kCollectiveGranuleBytes / kElem);
    uint8_t* src = p.src != nullptr ? static_cast<uint8_t*>(p.src) : st.staging();
    if ((p.flags & kCollectiveStageInput) != 0) {
        WEFT_TRACE_BEGIN(stage_t0);
        for (int q = 0; q < n; ++q) {
            device::copy(device::Block{}, src + (q * p.src_stride + part.begin) * kElem,
                         static_cast<const uint8_t*>(p.in) + (q * p.in_stride + part.begin) * kElem,
                         part.size() * kElem);
        }
        WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kStage, TraceRole::kComm, stage_t0, blockIdx.x, 0, 0, 0);
    }
    st.enter();
    WEFT_TRACE_BEGIN(reduce_t0);
    common::peer_pointers(ctx, srcs, src, static_cast<uint64_t>(me) * p.src_stride * kElem);
    common::reduce_elements<C.dtype, C.vec_bytes, C.max_ranks>(srcs, n, part.begin, part.end,
                                                               static_cast<uint8_t*>(p.out), nullptr);
    WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kReduce, TraceRole::kComm, reduce_t0, blockIdx.x, -1, 0, 0);
    if ((p.flags & kCollectiveExitBarrier) != 0) {
        st.barrier();
    }
    st.finish();
}

/// Low-latency: the input is num_ranks slices of p.count elements, slice q at element q * p.in_stride. Every thread
/// sends line j (8 bytes, fewer at the slice's end) of slice q, with the epoch's flag in every 8-byte word, to slot
/// `rank` of rank q's LL receive buffer, for every peer q; then polls line j of every peer's slot in its own buffer
/// and writes the rank-ordered fp32 sum (its own slice's line read from `in`) to `out`, once. No barrier, no flag
/// round trip: every rank waits for lines from every peer, so (as in the LL all-reduce) a rank running kernel e + 2
/// knows every peer has left kernel e, and the parity-alternated slots are reused without clearing. The same thread
/// handles line j in both loops, so in place (out = slice `rank` of in) reads a line before it writes it.
/// The call descriptor travels as a header line ahead of the data and is checked before the first output write
/// (BlockState::check_ll_descriptor). p.count elements, at most p.ll_slot_bytes / 2 bytes.
template <ReduceKernelConfig C>
__global__ void __launch_bounds__(C.block_threads, collective_min_blocks_per_sm(C.block_threads))
    reduce_scatter_low_latency(DeviceCtx ctx, CollectiveParams p) {
    static_assert(is_valid(C), "ReduceKernelConfig: see is_valid() in weft/common/collectives.hpp");
    constexpr uint64_t kElem = sizeof(typename Num<C.dtype>::Bits);
    __shared__ uint8_t* remote[C.max_ranks];
    BlockState st(ctx, p);
    st.send_ll_descriptor();
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    const uint32_t flag = low_latency_flag(st.epoch());
    const uint64_t bytes = p.count * kElem;
    const uint64_t slice_bytes = p.in_stride * kElem;
    const uint64_t lines = (bytes + kLowLatencyPayloadBytes - 1) / kLowLatencyPayloadBytes;
    const Span span = split_span(lines, gridDim.x, blockIdx.x, 2);
    const auto* in = static_cast<const uint8_t*>(p.in);
    const uint8_t* mine = in + static_cast<uint64_t>(me) * slice_bytes;
    auto* out = static_cast<uint8_t*>(p.out);
    // Slice q's lines land in slot `me` of rank q's buffer.
    for (int q = static_cast<int>(threadIdx.x); q < n; q += static_cast<int>(blockDim.x)) {
        remote[q] = device::symm_at_or_trap(ctx, st.ll_slot(me), q, __LINE__);
    }
    __syncthreads();
    WEFT_TRACE_BEGIN(push_t0);
    for (uint64_t j = span.begin + threadIdx.x; j < span.end; j += blockDim.x) {
        const uint64_t at = j * kLowLatencyPayloadBytes;
        for (int k = 1; k < n; ++k) {
            const int q = (me + k) % n;
            const uint2 v = common::load_payload(in + static_cast<uint64_t>(q) * slice_bytes + at, bytes - at);
            device::ll::store_line(remote[q] + j * kLowLatencyLineBytes, v, flag);
        }
    }
    WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kPushChunk, TraceRole::kComm, push_t0, blockIdx.x, -1, 0, 0);
    st.check_ll_descriptor();
    WEFT_TRACE_BEGIN(reduce_t0);  // the lines' waits included
    for (uint64_t j = span.begin + threadIdx.x; j < span.end; j += blockDim.x) {
        const uint64_t at = j * kLowLatencyPayloadBytes;
        common::store_payload(out + at,
                              common::reduce_ll_line<C.dtype, C.max_ranks>(ctx, st, mine + at, bytes - at, j, flag),
                              bytes - at);
    }
    WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kReduce, TraceRole::kComm, reduce_t0, blockIdx.x, -1, 0, 0);
    st.finish();
}

}  // namespace weft::kernels::reduce_scatter
