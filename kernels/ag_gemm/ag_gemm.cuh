// SPDX-License-Identifier: MIT
// AllGather+GEMM device side: the GEMM's tile scheduler (local rows first, then rows in copy-engine arrival
// order; the producer waits on exactly the chunk signals a tile needs), the epilogue hook counting stored
// tiles, the end of a call (reset the copy-engine signals, then a done-barrier across ranks), and the kernel
// that tells peers this rank's shard is in place. The schedule picture and the protocol are in
// kernels/ag_gemm/README.md.
//
// JIT instantiations (weft::ops::AgGemm builds them):
//   weft::kernels::ag_gemm::ag_gemm_kernel<CFG>
//   weft::kernels::ag_gemm::ag_notify_ready_kernel<0>
//   weft::kernels::ag_gemm::ag_relay_notify_kernel<0>   (a team that spans nodes)
#pragma once

#include "gemm/gemm_sm90.cuh"
#include "tp_common/tp_device.cuh"
#include "weft/common/tp_params.hpp"
#include "weft/common/tp_schedule.hpp"
#include "weft/device/tile.cuh"
#include "weft/device/trace.cuh"

namespace weft::kernels::ag_gemm {

namespace tile = device::tile;

/// AgGemmScheduler's drop marker: the index (in this CTA's tile order) of the first tile whose rows came from a rank
/// whose call descriptor differs from this rank's, or kAgKeepAllTiles. Shared memory of the CTA: set by
/// ag_gemm_kernel before the GEMM's first barrier, written at most once more by the producer thread (before the loads
/// of that tile), read by the consumers after the stages of a tile have landed.
inline constexpr int32_t kAgKeepAllTiles = 0x7fffffff;
__device__ __forceinline__ int32_t* ag_drop_from() {
    __shared__ int32_t drop_from;
    return &drop_from;
}

/// Persistent striding over AgGemmOrder (see weft/common/tp_schedule.hpp). Before the producer loads the A
/// rows of a tile it waits until every chunk signal of those rows that belongs to a peer is >= 1 (its copy
/// engine raised it after the chunk landed); this rank's own rows are in place by stream order. The waits
/// are tile::wait_each's (one thread, ld.acquire.sys polls, fence.proxy.async.global), and its Token goes to the
/// A loads. Every wait and notify in this kernel is the device layer's checked (inline) form: a call anywhere in a
/// kernel that issues wgmma serialises them (ptxas C7510). A wait that gives up (a peer that never called, an aborted
/// World: its Diagnostic recorded, the abort word raised) ends the CTA's waiting (kSchedulerWaitMayFail): the kernel
/// runs to its end, the CUDA context stays usable, and the op throws the diagnosis.
/// After the wait, the producer compares the call descriptor of every peer whose rows the tile reads (slot s of
/// `signatures`, stored by s's notify kernel before the ready flag that its chunk's copy awaited) with this rank's:
/// one load and compare per peer and tile, no new wait. On a difference it records a kCollectiveMismatch diagnostic
/// (both descriptors; sync_and_check throws on it) and marks this tile and every later one of the CTA dropped
/// (ag_drop_from): they are computed, counted and signalled as usual (the call's protocol ends as always, so the op
/// stays usable), but not stored. Rows of this rank's own shard, and of peers that agree, loaded before, may be
/// stored. No abort word: every rank finds its own mismatch, and an abort would stop a slower peer's waits of this
/// very call, leaving the op's flags out of step.
// NOTE: the producer runs with 40 registers (setmaxnreg): the order lives in the kernel parameters (constant
// bank) and the scheduler keeps only a reference to them.
template <GemmConfig kCfg>
class AgGemmScheduler {
public:
    using Params = AgGemmParams;
    static constexpr int32_t kClusterSize = kCfg.cluster_m * kCfg.cluster_n;

    __device__ AgGemmScheduler(const Params& p, const GemmArgs&) : p_(p) {}

    __device__ int32_t num_tiles() const {
        const int32_t total = p_.order.num_cluster_tiles();
        const int32_t c = cluster_idx();
        return c < total ? (total - 1 - c) / num_clusters() + 1 : 0;
    }
    __device__ GemmTile tile(int32_t i) const {
        const int32_t cta_rank = kClusterSize == 1 ? 0 : static_cast<int32_t>(ptx::cluster_cta_rank());
        return p_.order.tile(cluster_idx() + i * num_clusters(), cta_rank);
    }

    __device__ device::WaitResult wait_before_load(const GemmTile& t, int32_t index) const {
        const SignalRange r = p_.order.signals_for(t);
        WEFT_TRACE_BEGIN(wait_t0);
        // The chunks were written by a copy engine (seen through the wait's acquire); the A loads that take this
        // token are TMA (async proxy) loads, which the wait's proxy fence lets see them.
        // A chunk signal is this rank's own word (the copy that delivers the chunk raises it): a timeout names the rank
        // whose rows the chunk holds (slot = team rank), not this one.
        const device::WaitResult waited = tile::wait_each_checked(
            device::Thread{}, p_.ctx, r.last - r.first + 1,
            [&](int i) {
                const int32_t s = r.first + i;
                return tile::SignalFrom{p_.order.is_local_signal(s) ? nullptr : p_.chunk_signals + s,
                                        s / p_.order.chunks_per_rank};
            },
            Cmp::kGe, 1ull);
        if (!waited.ok()) {
            // The end of the call (ag_finish_call) must not reset the ready flags under a copy stream that has not
            // consumed them yet: tell it that this CTA did not see every chunk land.
            ptx::red_add<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(p_.tile_counter, kAgGaveUpMark);
            return waited;
        }
        WEFT_TRACE_RECORD(p_.ctx, TraceKind::kWaitChunk, TraceRole::kProducer, wait_t0, r.first, r.last, t.m_idx,
                          t.n_idx);
        // The ranks whose rows the tile reads: their descriptors arrived before their ready flags, which the chunks'
        // copies awaited before the signals this wait acquired.
        if (r.last >= r.first) {
            const int32_t cpr = p_.order.chunks_per_rank;
            for (int32_t s = r.first / cpr; s <= r.last / cpr; ++s) {
                if (s == p_.ctx.rank) continue;
                const uint64_t theirs = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(p_.signatures + s);
                if (theirs != p_.signature && *ag_drop_from() == kAgKeepAllTiles) {
                    *ag_drop_from() = index;
                    device::record_diagnostic(p_.ctx, device::SpinSite{SpinKind::kCollectiveMismatch, s, __LINE__},
                                              Cmp::kEq, p_.signatures + s, p_.signature, theirs, 0);
                }
            }
        }
        return waited;
    }

    /// Whether the CTA's i-th tile is dropped (not stored). Every consumer thread reads it after the tile's stages
    /// landed: the producer marked a tile j <= i before loading it, so all see j; a mark j > i reads as kept either
    /// way.
    __device__ bool dropped(int32_t i) const {
        return i >= *static_cast<volatile int32_t*>(ag_drop_from());
    }

private:
    __device__ static int32_t cluster_idx() { return static_cast<int32_t>(blockIdx.x) / kClusterSize; }
    __device__ static int32_t num_clusters() { return static_cast<int32_t>(gridDim.x) / kClusterSize; }

    const Params& p_;
};

/// Counts stored tiles (release at GPU scope: the tile's TMA stores have completed).
struct AgGemmHook {
    using Params = AgGemmHookParams;
    static constexpr bool kNotifies = true;
    __device__ static bool after_tile_stored(const Params& p, const GemmTile&) {
        ptx::red_add<ptx::Sem::kRelease, ptx::Scope::kGpu>(p.tile_counter, 1ull);
        return true;
    }
};

/// The end of a call, run by CTA 0's producer thread after its last load: once every tile is stored, every
/// chunk has been awaited, so every copy and every peer's ready flag of this call has been consumed: reset
/// them (stream order puts the next call's copies after this kernel), tell every rank this one is done, and
/// wait until every rank is done, so that no peer still reads this rank's shard when the caller (or the next
/// call) overwrites it. The kernel, and with it the call, ends after this.
/// A wait here that gives up (a peer that never called, an aborted World: its Diagnostic recorded), or a chunk wait of
/// the GEMM that gave up (kAgGaveUpMark), ends the call at once, through ag_release_copy_waits: the op refuses its
/// next call (AbortMark), so the flags need no reset.
__device__ __forceinline__ void ag_release_copy_waits(const AgGemmHookParams& p);
__device__ __forceinline__ void ag_finish_call(const AgGemmHookParams& p) {
    const device::Thread me{};
    const auto num_tiles = static_cast<uint64_t>(p.num_tiles);
    // A CTA whose chunk wait gave up added kAgGaveUpMark (before its later tiles, which it still stores): the count
    // then passes num_tiles at once, and a copy stream may still be waiting on a peer's ready flag.
    // Twice the World's bound: the counter waits for this rank's own CTAs, whose chunk waits give up within one bound
    // and then mark it; expiring as early as they do, this wait could record the diagnosis first, naming this rank's
    // own counter instead of the peer whose chunk never came.
    DeviceCtx own = p.ctx;
    own.timeout_ns = 2 * p.ctx.timeout_ns;  // 0 (the default bound) stays 0
    const device::WaitResult counted = tile::wait_checked(me, own, p.tile_counter, 1, Cmp::kGe, num_tiles);
    if (!counted.ok() || counted.token().value() >= kAgGaveUpMark) return ag_release_copy_waits(p);
    ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(p.tile_counter, 0ull);
    for (int32_t s = 0; s < p.num_signals; ++s) ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(p.chunk_signals + s, 0ull);
    for (int32_t s = 0; s < p.ctx.num_ranks; ++s) {
        if (s != p.ctx.rank) ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(p.ready + s, 0ull);
    }
    // A team that spans nodes: the relay words too, and the done-barrier meets this node's members only (the network's
    // readers of this rank's shard are its comm stream's sends, which the caller's stream joins before the next call).
    if (p.relay_ready != nullptr) {
        for (int32_t s = 0; s < p.num_signals; ++s) ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(p.relay_ready + s, 0ull);
    }
    const bool all = p.peers.num == 0;
    const int32_t num_peers = all ? p.ctx.num_ranks : p.peers.num;
    const uint64_t e = ptx::ld(p.epoch) + 1;
    WEFT_TRACE_BEGIN(notify_t0);
    for (int32_t i = 0; i < num_peers; ++i) {  // release: the resets above come first
        const int32_t pe = all ? i : p.peers.rank[i];
        device::trap_unless(tile::notify_checked(me, p.ctx, p.done + p.ctx.rank, pe, 1ull, device::SignalOp::kAdd));
    }
    WEFT_TRACE_RECORD(p.ctx, TraceKind::kNotify, TraceRole::kProducer, notify_t0, -1, -1, 0, 0);
    WEFT_TRACE_BEGIN(done_t0);
    if (!tile::wait_each_checked(
             me, p.ctx, num_peers, [&](int i) { return p.done + (all ? i : p.peers.rank[i]); }, Cmp::kGe, e)
             .ok()) {
        return ag_release_copy_waits(p);
    }
    WEFT_TRACE_RECORD(p.ctx, TraceKind::kWaitPeers, TraceRole::kProducer, done_t0, static_cast<int32_t>(e), 0, 0, 0);
    ptx::st(p.epoch, e);
}

/// The end of a call that failed: raises every word this rank's copy streams may still wait on (a peer's ready flag,
/// a relay word: cuStreamWaitValue64, which has no bound of its own), so that they run to their end and the caller's
/// stream, which joins them, drains. The call's output is not defined (the op throws the Diagnostic).
__device__ __forceinline__ void ag_release_copy_waits(const AgGemmHookParams& p) {
    for (int32_t s = 0; s < p.ctx.num_ranks; ++s) {
        if (s != p.ctx.rank) ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(p.ready + s, 1ull);
    }
    if (p.relay_ready != nullptr) {
        for (int32_t s = 0; s < p.num_signals; ++s)
            ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(p.relay_ready + s, 1ull);
    }
}

/// The AllGather+GEMM kernel: weft's GEMM with AgGemmScheduler and AgGemmHook, then the end of the call in
/// CTA 0's producer thread (which has issued all its loads by then; its consumers need nothing from it).
template <GemmConfig kCfg>
__global__ void __launch_bounds__(kGemmThreads, 1)
    ag_gemm_kernel(const __grid_constant__ ptx::TmaDescriptor tma_a, const __grid_constant__ ptx::TmaDescriptor tma_b,
                   const __grid_constant__ ptx::TmaDescriptor tma_d, const GemmArgs args, const AgGemmParams sched_params,
                   const AgGemmHookParams hook_params) {
    if (threadIdx.x == 0) *ag_drop_from() = kAgKeepAllTiles;  // the GEMM's first barrier publishes it
    gemm::gemm_device<kCfg, AgGemmScheduler<kCfg>, AgGemmHook>(&tma_a, &tma_b, &tma_d, args, sched_params,
                                                               hook_params);
    if (blockIdx.x == 0 && threadIdx.x == 0) ag_finish_call(hook_params);
}

/// Tells every peer that this rank's shard is in its gathered buffer (ready[rank] = 1 on each peer, release
/// at system scope), after storing this call's descriptor into signatures[rank] on that peer (when the op passes
/// signatures: the release orders the descriptor before the flag). Launched with one warp after the local copy, in
/// stream order. kUnused: a template so that a header included by several translation units defines no non-inline
/// kernel.
/// A team that spans nodes: only this node's members (p.peers); the others learn of it through the network.
template <int kUnused>
__global__ void __launch_bounds__(kTpNotifyThreads) ag_notify_ready_kernel(const AgNotifyParams p) {
    WEFT_TRACE_BEGIN(notify_t0);
    const bool all = p.peers.num == 0;
    const int num_peers = all ? p.ctx.num_ranks : p.peers.num;
    for (int i = static_cast<int>(threadIdx.x); i < num_peers; i += static_cast<int>(blockDim.x)) {
        const int pe = all ? i : p.peers.rank[i];
        if (pe == p.ctx.rank) continue;
        if (p.signatures != nullptr) {
            // notify(), with the descriptor stored through the same translation (one allocation holds both).
            uint64_t* ready = device::symm_at_or_trap(p.ctx, p.ready + p.ctx.rank, pe, __LINE__);
            ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(ready + (p.signatures - p.ready), p.signature);
            device::signal_release<ptx::Scope::kSys>(ready, 1ull, device::SignalOp::kSet);
        } else {
            tile::notify(device::Thread{}, p.ctx, p.ready + p.ctx.rank, pe, 1ull, device::SignalOp::kSet);
        }
    }
    if (threadIdx.x == 0) {
        WEFT_TRACE_RECORD(p.ctx, TraceKind::kNotify, TraceRole::kComm, notify_t0, p.ctx.rank, -1, 0, 0);
    }
}

/// AllGather+GEMM across nodes (docs/multinode.md): launched on the network backend's comm stream after chunks of
/// other nodes' shards arrived in this rank's gathered buffer (stream order: the receive is complete). For each item
/// and each other member of this node: the slot's call descriptor (received over the network beside the shard) into
/// signatures[slot] there, then relay_ready[signal] = 1 there (release, system scope: the descriptor and, through
/// the receive's completion before this kernel, the chunk's bytes come first). That member's copy stream awaits
/// the word, copies the chunk from this rank's gathered buffer and raises its own chunk signal, as for a peer's shard.
template <int kUnused>
__global__ void __launch_bounds__(kTpNotifyThreads) ag_relay_notify_kernel(const AgRelayParams p) {
    const int n = p.num_items * p.peers.num;
    for (int j = static_cast<int>(threadIdx.x); j < n; j += static_cast<int>(blockDim.x)) {
        const int item = j / p.peers.num;
        const int pe = p.peers.rank[j % p.peers.num];
        if (pe == p.ctx.rank) continue;
        const int32_t slot = p.slot[item];
        const uint64_t descriptor = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(p.signatures + slot);
        uint64_t* sig = device::symm_at_or_trap(p.ctx, p.signatures + slot, pe, __LINE__);
        ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(sig, descriptor);
        uint64_t* word = device::symm_at_or_trap(p.ctx, p.relay_ready + p.signal[item], pe, __LINE__);
        device::signal_release<ptx::Scope::kSys>(word, 1ull, device::SignalOp::kSet);
    }
}

}  // namespace weft::kernels::ag_gemm
