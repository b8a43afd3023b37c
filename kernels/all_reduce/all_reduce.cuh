// SPDX-License-Identifier: MIT
// All-reduce (sum) kernels: one-shot, two-shot (reduce-scatter then all-gather) and low-latency one-shot (LL lines).
//
// Launched by weft::ops::all_reduce (src/ops/all_reduce.cpp) through the JIT, one specialisation per
// ReduceKernelConfig{dtype, max_ranks, vec_bytes, block_threads}. Schedules, knobs and pitfalls: README.md here;
// the protocol shared by every collective kernel: kernels/common/collective.cuh.
#pragma once

#include "common/collective.cuh"
#include "weft/device/trace.cuh"

namespace weft::kernels::all_reduce {

using common::BlockState;
using common::Num;

/// One-shot: block b copies part b of its input into this epoch's staging half (when asked), meets block b of
/// every rank, then reads part b of every rank's staging and writes the rank-ordered fp32 sum to `out`.
/// Peers read only staging (double-buffered by epoch parity), so there is no exit barrier unless `src` is a
/// user buffer (kCollectiveExitBarrier).
template <ReduceKernelConfig C>
__global__ void __launch_bounds__(C.block_threads, collective_min_blocks_per_sm(C.block_threads))
    all_reduce_one_shot(DeviceCtx ctx, CollectiveParams p) {
    static_assert(is_valid(C), "ReduceKernelConfig: see is_valid() in weft/common/collectives.hpp");
    constexpr uint64_t kElem = sizeof(typename Num<C.dtype>::Bits);
    __shared__ const uint8_t* srcs[C.max_ranks];
    BlockState st(ctx, p);
    const Span part = split_span(p.count, gridDim.x, blockIdx.x, kCollectiveGranuleBytes / kElem);
    uint8_t* src = p.src != nullptr ? static_cast<uint8_t*>(p.src) : st.staging();
    if ((p.flags & kCollectiveStageInput) != 0) {
        WEFT_TRACE_BEGIN(stage_t0);
        device::copy(device::Block{}, src + part.begin * kElem, static_cast<const uint8_t*>(p.in) + part.begin * kElem,
                     part.size() * kElem);
        WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kStage, TraceRole::kComm, stage_t0, blockIdx.x, 0, 0, 0);
    }
    st.enter();
    WEFT_TRACE_BEGIN(reduce_t0);
    common::peer_pointers(ctx, srcs, src, 0);
    common::reduce_elements<C.dtype, C.vec_bytes, C.max_ranks>(srcs, ctx.num_ranks, part.begin, part.end,
                                                               static_cast<uint8_t*>(p.out), nullptr);
    WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kReduce, TraceRole::kComm, reduce_t0, blockIdx.x, -1, 0, 0);
    if ((p.flags & kCollectiveExitBarrier) != 0) {
        st.barrier();
    }
    st.finish();
}

/// Two-shot: the message is split into num_ranks slices (rank q owns slice q) and every slice into gridDim.x
/// parts. Block b: stage part b of every slice (when asked); meet; reduce part b of its own slice from every
/// rank's source into `res` (and `out` when they differ); meet; copy part b of every other slice from its owner's
/// `res` into `out`; meet again only when `res` is a user buffer (kCollectiveExitBarrier).
template <ReduceKernelConfig C>
__global__ void __launch_bounds__(C.block_threads, collective_min_blocks_per_sm(C.block_threads))
    all_reduce_two_shot(DeviceCtx ctx, CollectiveParams p) {
    static_assert(is_valid(C), "ReduceKernelConfig: see is_valid() in weft/common/collectives.hpp");
    constexpr uint64_t kElem = sizeof(typename Num<C.dtype>::Bits);
    constexpr uint64_t kGranule = kCollectiveGranuleBytes / kElem;
    __shared__ const uint8_t* srcs[C.max_ranks];
    BlockState st(ctx, p);
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    uint8_t* src = p.src != nullptr ? static_cast<uint8_t*>(p.src) : st.staging();
    uint8_t* res = p.res != nullptr ? static_cast<uint8_t*>(p.res) : st.staging();
    auto* out = static_cast<uint8_t*>(p.out);
    if ((p.flags & kCollectiveStageInput) != 0) {
        WEFT_TRACE_BEGIN(stage_t0);
        for (int q = 0; q < n; ++q) {
            const Span s = split_slice_part(p.count, n, q, gridDim.x, blockIdx.x, kGranule);
            device::copy(device::Block{}, src + s.begin * kElem, static_cast<const uint8_t*>(p.in) + s.begin * kElem,
                         s.size() * kElem);
        }
        WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kStage, TraceRole::kComm, stage_t0, blockIdx.x, 0, 0, 0);
    }
    st.enter();
    // Reduce-scatter: my slice, part b, from every rank's source.
    WEFT_TRACE_BEGIN(reduce_t0);
    const Span mine = split_slice_part(p.count, n, me, gridDim.x, blockIdx.x, kGranule);
    common::peer_pointers(ctx, srcs, src, 0);
    common::reduce_elements<C.dtype, C.vec_bytes, C.max_ranks>(srcs, n, mine.begin, mine.end, res,
                                                               out != res ? out : nullptr);
    WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kReduce, TraceRole::kComm, reduce_t0, blockIdx.x, -1, 0, 0);
    st.barrier();
    // All-gather: part b of every other slice, from its owner's result (rotated so peers spread their reads).
    for (int k = 1; k < n; ++k) {
        const int q = (me + k) % n;
        WEFT_TRACE_BEGIN(pull_t0);
        const Span s = split_slice_part(p.count, n, q, gridDim.x, blockIdx.x, kGranule);
        const uint8_t* theirs = device::symm_at_or_trap(ctx, res, q, __LINE__);
        device::copy(device::Block{}, out + s.begin * kElem, theirs + s.begin * kElem, s.size() * kElem);
        WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kPullChunk, TraceRole::kComm, pull_t0, blockIdx.x, q,
                             0, 0);
    }
    if ((p.flags & kCollectiveExitBarrier) != 0) {
        st.barrier();
    }
    st.finish();
}

/// Low-latency one-shot: every thread sends its LL lines (8 bytes of input + the epoch's flag in every 8-byte
/// word) to every peer's receive buffer for this rank, then polls the lines every peer sent it and writes the
/// rank-ordered fp32 sum. No barrier, no flag round trip; the receive buffers alternate by epoch parity and are
/// never cleared (the flag changes every epoch). The call descriptor travels as a header line ahead of the data and
/// is checked before the first output write (BlockState::check_ll_descriptor). p.count elements, at most
/// p.ll_slot_bytes / 2 bytes.
template <ReduceKernelConfig C>
__global__ void __launch_bounds__(C.block_threads, collective_min_blocks_per_sm(C.block_threads))
    all_reduce_low_latency(DeviceCtx ctx, CollectiveParams p) {
    static_assert(is_valid(C), "ReduceKernelConfig: see is_valid() in weft/common/collectives.hpp");
    constexpr uint64_t kElem = sizeof(typename Num<C.dtype>::Bits);
    __shared__ uint8_t* remote[C.max_ranks];
    BlockState st(ctx, p);
    st.send_ll_descriptor();
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    const uint32_t flag = low_latency_flag(st.epoch());
    const uint64_t bytes = p.count * kElem;
    const uint64_t lines = (bytes + kLowLatencyPayloadBytes - 1) / kLowLatencyPayloadBytes;
    const Span span = split_span(lines, gridDim.x, blockIdx.x, 2);
    const auto* in = static_cast<const uint8_t*>(p.in);
    auto* out = static_cast<uint8_t*>(p.out);
    // My lines land in slot `me` of every peer's buffer.
    for (int q = static_cast<int>(threadIdx.x); q < n; q += static_cast<int>(blockDim.x)) {
        remote[q] = device::symm_at_or_trap(ctx, st.ll_slot(me), q, __LINE__);
    }
    __syncthreads();
    WEFT_TRACE_BEGIN(push_t0);
    for (uint64_t j = span.begin + threadIdx.x; j < span.end; j += blockDim.x) {
        const uint64_t at = j * kLowLatencyPayloadBytes;
        const uint2 mine = common::load_payload(in + at, bytes - at);
        for (int k = 1; k < n; ++k) {
            const int q = (me + k) % n;
            device::ll::store_line(remote[q] + j * kLowLatencyLineBytes, mine, flag);
        }
    }
    WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kPushChunk, TraceRole::kComm, push_t0, blockIdx.x, -1, 0, 0);
    st.check_ll_descriptor();
    // The same thread handles line j in both loops, so in-place (out == in) reads before it writes.
    WEFT_TRACE_BEGIN(reduce_t0);  // the lines' waits included
    for (uint64_t j = span.begin + threadIdx.x; j < span.end; j += blockDim.x) {
        const uint64_t at = j * kLowLatencyPayloadBytes;
        common::store_payload(
            out + at, common::reduce_ll_line<C.dtype, C.max_ranks>(ctx, st, in + at, bytes - at, j, flag), bytes - at);
    }
    WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kReduce, TraceRole::kComm, reduce_t0, blockIdx.x, -1, 0, 0);
    st.finish();
}

}  // namespace weft::kernels::all_reduce
