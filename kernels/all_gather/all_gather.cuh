// SPDX-License-Identifier: MIT
// All-gather kernels: SM-driven push, low-latency (LL lines), and the two small kernels of the copy-engine
// algorithms (the entry barrier, and the wait for the peers' stream-written flags).
//
// Counts are bytes (an all-gather moves bytes; the dtype does not matter). Launched by weft::ops::all_gather
// (src/ops/all_gather.cpp) through the JIT, one specialisation per CopyKernelConfig. Schedules: README.md here.
#pragma once

#include "common/collective.cuh"
#include "weft/device/trace.cuh"

namespace weft::kernels::all_gather {

using common::BlockState;

/// SM push: block b meets block b of every rank (so every destination is ready), writes part b of this rank's
/// shard into slot `rank` of every rank's `out` (symmetric), starting with the next rank, and meets again: after
/// that barrier part b of every slot is here. p.count = shard bytes, p.out_stride = bytes between slots.
template <CopyKernelConfig C>
__global__ void __launch_bounds__(C.block_threads, collective_min_blocks_per_sm(C.block_threads))
    all_gather_push(DeviceCtx ctx, CollectiveParams p) {
    static_assert(is_valid(C), "CopyKernelConfig: see is_valid() in weft/common/collectives.hpp");
    BlockState st(ctx, p);
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    const Span part = split_span(p.count, gridDim.x, blockIdx.x, kCollectiveGranuleBytes);
    const auto* in = static_cast<const uint8_t*>(p.in) + part.begin;
    const uint64_t slot = static_cast<uint64_t>(me) * p.out_stride + part.begin;
    st.enter();
    for (int k = 0; k < n; ++k) {
        const int q = (me + k) % n;
        uint8_t* dst = device::symm_at_or_trap(ctx, static_cast<uint8_t*>(p.out), q, __LINE__) + slot;
        if (dst != in) {  // in place: this rank's slot already holds its shard
            WEFT_TRACE_BEGIN(push_t0);
            device::copy(device::Block{}, dst, in, part.size());
            WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kPushChunk, TraceRole::kComm, push_t0, blockIdx.x, q,
                                 0, 0);
        }
    }
    st.barrier();
    st.finish();
}

/// Low-latency: every thread sends its LL lines of this rank's shard to slot `rank` of every peer's receive buffer
/// and, once every peer's call descriptor (a header line sent ahead of the data) matched this call's, copies them into
/// its own output slot, then polls the lines of every peer's slot and writes them into that peer's output slot. No
/// barrier; buffers alternate by epoch parity and are never cleared.
/// p.count = shard bytes (at most p.ll_slot_bytes / 2), p.out_stride = bytes between output slots.
template <CopyKernelConfig C>
__global__ void __launch_bounds__(C.block_threads, collective_min_blocks_per_sm(C.block_threads))
    all_gather_low_latency(DeviceCtx ctx, CollectiveParams p) {
    static_assert(is_valid(C), "CopyKernelConfig: see is_valid() in weft/common/collectives.hpp");
    __shared__ uint8_t* remote[C.max_ranks];
    BlockState st(ctx, p);
    st.send_ll_descriptor();
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    const uint32_t flag = low_latency_flag(st.epoch());
    const uint64_t bytes = p.count;
    const uint64_t lines = (bytes + kLowLatencyPayloadBytes - 1) / kLowLatencyPayloadBytes;
    const Span span = split_span(lines, gridDim.x, blockIdx.x, 2);
    const auto* in = static_cast<const uint8_t*>(p.in);
    auto* out = static_cast<uint8_t*>(p.out);
    for (int q = static_cast<int>(threadIdx.x); q < n; q += static_cast<int>(blockDim.x)) {
        remote[q] = device::symm_at_or_trap(ctx, st.ll_slot(me), q, __LINE__);
    }
    __syncthreads();
    uint8_t* own = out + static_cast<uint64_t>(me) * p.out_stride;
    WEFT_TRACE_BEGIN(push_t0);
    for (uint64_t j = span.begin + threadIdx.x; j < span.end; j += blockDim.x) {
        const uint64_t at = j * kLowLatencyPayloadBytes;
        const uint2 mine = common::load_payload(in + at, bytes - at);
        for (int k = 1; k < n; ++k) {
            device::ll::store_line(remote[(me + k) % n] + j * kLowLatencyLineBytes, mine, flag);
        }
    }
    st.check_ll_descriptor();
    if (own != in) {  // after the check: nothing is written to the output before every peer's call matched
        for (uint64_t j = span.begin + threadIdx.x; j < span.end; j += blockDim.x) {
            const uint64_t at = j * kLowLatencyPayloadBytes;
            common::store_payload(own + at, common::load_payload(in + at, bytes - at), bytes - at);
        }
    }
    WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kPushChunk, TraceRole::kComm, push_t0, blockIdx.x, -1, 0, 0);
    for (int k = 1; k < n; ++k) {
        const int q = (me + k) % n;
        const uint8_t* slot = st.ll_slot(q);
        uint8_t* dst = out + static_cast<uint64_t>(q) * p.out_stride;
        WEFT_TRACE_BEGIN(recv_t0);  // the lines' waits included
        for (uint64_t j = span.begin + threadIdx.x; j < span.end; j += blockDim.x) {
            const uint64_t at = j * kLowLatencyPayloadBytes;
            const uint2 v = device::ll::wait_line_from(ctx, slot + j * kLowLatencyLineBytes, flag, q);
            common::store_payload(dst + at, v, bytes - at);
        }
        WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kRecv, TraceRole::kComm, recv_t0, q, -1, 0, 0);
    }
    st.finish();
}

/// The copy-engine algorithms' entry: one block meets every rank (and checks the call descriptor). After it, every
/// peer's source (pull) or destination (push) is ready for this rank's copies.
template <CopyKernelConfig C>
__global__ void __launch_bounds__(C.block_threads, collective_min_blocks_per_sm(C.block_threads))
    copy_engine_enter(DeviceCtx ctx, CollectiveParams p) {
    static_assert(is_valid(C), "CopyKernelConfig: see is_valid() in weft/common/collectives.hpp");
    BlockState st(ctx, p, BlockState::OnMismatch::kTrap);  // the copies queued after this kernel cannot be stopped
    st.enter<BlockState::OnMismatch::kTrap>();             // otherwise
    st.finish();
}

/// The copy-engine algorithms' exit: waits until every peer's copy engine has set this rank's flag for it to 1
/// (a stream write after its copies: pull = "done reading your buffer", push = "your slot is written"), then
/// consumes it (sets it back to 0). Stream writes carry constants (a captured graph replays the same value), so
/// these flags are set/consumed instead of epoch-counted; the next call's entry barrier orders the reset before
/// any peer's next write. One block; touches no other state.
template <CopyKernelConfig C>
__global__ void __launch_bounds__(C.block_threads, collective_min_blocks_per_sm(C.block_threads))
    copy_engine_exit(DeviceCtx ctx, CollectiveParams p) {
    static_assert(is_valid(C), "CopyKernelConfig: see is_valid() in weft/common/collectives.hpp");
    const int n = ctx.num_ranks;
    for (int q = static_cast<int>(threadIdx.x); q < n; q += static_cast<int>(blockDim.x)) {
        if (q != ctx.rank) {
            WEFT_TRACE_BEGIN(wait_t0);
            device::spin_until<ptx::Sem::kAcquire, ptx::Scope::kSys>(
                ctx, p.ce_flags + q, Cmp::kGe, 1, device::SpinSite{SpinKind::kSignalWait, q, __LINE__});
            WEFT_TRACE_RECORD(ctx, TraceKind::kWaitPeer, TraceRole::kComm, wait_t0, q, __LINE__, 1, 0);
            ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(p.ce_flags + q, uint64_t{0});
        }
    }
}

}  // namespace weft::kernels::all_gather
