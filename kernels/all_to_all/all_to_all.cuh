// SPDX-License-Identifier: MIT
// All-to-all (pull): every rank publishes where its chunk for each peer lies, meets every rank, then reads the chunk
// each peer holds for it into its own output.
//
// Counts are bytes. Launched by weft::ops::all_to_all / all_to_all_v (src/ops/all_to_all.cpp) through the collective
// workspace, one specialisation per CopyKernelConfig. Schedule and pitfalls: README.md here; the protocol shared by
// every collective kernel: kernels/common/collective.cuh.
#pragma once

#include "common/collective.cuh"
#include "weft/common/all_to_all.hpp"
#include "weft/device/trace.cuh"

namespace weft::kernels::all_to_all {

using common::BlockState;

/// Block b, for every peer q (starting with this rank):
///   staged (kCollectiveStageInput): copy part b of this rank's chunk for q from `in` into this epoch's staging half
///     at kAllToAllHeaderBytes + t.source_offset[q];
///   publish the heap offset of its chunk for q (in the staging half or in `src`) into slot `rank` of q's staging
///     header, and its size into slot kMaxAllToAllRanks + rank (every block writes the same values, so that its own
///     barrier orders them for the peer block that reads them);
/// meet block b of every rank; check every peer's published size against t.recv_bytes[q] (a difference: a
/// kAllToAllCounts diagnostic, the abort word raised, and the block ends before it reads anything); then, for every
/// peer q, copy part b of q's chunk for this rank (t.recv_bytes[q] bytes at the heap offset q published: ranks may
/// differ in staging or not) into `out` at t.recv_offset[q]. With a user
/// `src` (direct) on any rank the peers read that rank's buffer until they are done: meet again before returning
/// (kCollectiveExitBarrier, then set on every rank). Parts are split the same way on both sides (same byte count,
/// same grid).
template <CopyKernelConfig C>
__global__ void __launch_bounds__(C.block_threads, collective_min_blocks_per_sm(C.block_threads))
    all_to_all_pull(DeviceCtx ctx, CollectiveParams p, AllToAllTable t) {
    static_assert(is_valid(C), "CopyKernelConfig: see is_valid() in weft/common/collectives.hpp");
    static_assert(C.max_ranks <= kMaxAllToAllRanks, "the table has kMaxAllToAllRanks rows");
    BlockState st(ctx, p);
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    const bool staged = (p.flags & kCollectiveStageInput) != 0;
    uint8_t* const half = st.staging();
    auto* const header = reinterpret_cast<uint64_t*>(half);
    uint8_t* const source = staged ? half + kAllToAllHeaderBytes : static_cast<uint8_t*>(p.src);
    if (staged) {
        WEFT_TRACE_BEGIN(stage_t0);
        const auto* in = static_cast<const uint8_t*>(p.in);
        for (int k = 0; k < n; ++k) {
            const int q = (me + k) % n;
            const Span part = split_span(t.send_bytes[q], gridDim.x, blockIdx.x, kCollectiveGranuleBytes);
            device::copy(device::Block{}, source + t.source_offset[q] + part.begin, in + t.send_offset[q] + part.begin,
                         part.size());
        }
        WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kStage, TraceRole::kComm, stage_t0, blockIdx.x, 0, 0, 0);
    }
    // Published as an offset in the heap, so that each rank may read its chunks from its staging or its own `src`.
    uint8_t* const heap_base = ctx.peer_bases[me];
    const auto source_at = static_cast<uint64_t>(source - heap_base);
    for (int q = static_cast<int>(threadIdx.x); q < n; q += static_cast<int>(blockDim.x)) {
        uint64_t* const theirs = device::symm_at_or_trap(ctx, header, q, __LINE__);
        ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(theirs + me, source_at + t.source_offset[q]);
        ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(theirs + kMaxAllToAllRanks + me, t.send_bytes[q]);
    }
    st.enter();
    // Counts that differ across a pair (all_to_all_v's contract; equal splits agree by the descriptor check): the
    // receiver's own count would read past the sender's chunk, even past its heap. Checked before any read.
    bool counts_agree = true;
    for (int q = static_cast<int>(threadIdx.x); q < n; q += static_cast<int>(blockDim.x)) {
        const uint64_t sent = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(header + kMaxAllToAllRanks + q);
        if (sent != t.recv_bytes[q]) {
            counts_agree = false;
            device::record_failure(ctx, device::SpinSite{SpinKind::kAllToAllCounts, q, __LINE__}, Cmp::kEq,
                                   header + kMaxAllToAllRanks + q, t.recv_bytes[q], sent, 0, false);
        }
    }
    device::exit_unless(device::Block{}.all(counts_agree));
    auto* out = static_cast<uint8_t*>(p.out);
    for (int k = 0; k < n; ++k) {
        const int q = (me + k) % n;  // rotated: the ranks spread their reads over different peers
        const Span part = split_span(t.recv_bytes[q], gridDim.x, blockIdx.x, kCollectiveGranuleBytes);
        if (part.size() == 0) continue;
        WEFT_TRACE_BEGIN(pull_t0);
        const uint64_t at = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(header + q);
        const uint8_t* from = device::symm_at_or_trap(ctx, heap_base + at, q, __LINE__) + part.begin;
        device::copy(device::Block{}, out + t.recv_offset[q] + part.begin, from, part.size());
        WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kPullChunk, TraceRole::kComm, pull_t0, blockIdx.x, q,
                             0, 0);
    }
    if ((p.flags & kCollectiveExitBarrier) != 0) {
        st.barrier();
    }
    st.finish();
}

}  // namespace weft::kernels::all_to_all
