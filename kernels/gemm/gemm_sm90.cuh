// SPDX-License-Identifier: MIT
// weft's sm_90a GEMM kernel: persistent, warp-specialised (one TMA producer warpgroup, two wgmma consumer
// warpgroups, cooperative on each tile or ping-pong over alternate tiles), mbarrier ring over 128B-swizzled
// shared memory, stmatrix + TMA-store epilogue, optional 2-CTA cluster with TMA multicast, and the scheduler /
// epilogue hooks that communication kernels use.
//
//   D[M,N] = A[M,K] * B     A row-major; B [N,K] row-major (BLayout::kNK) or [K,N] row-major (kKN)
//
// The picture, schedule and pitfalls are in kernels/gemm/README.md. One instantiation per
// (GemmConfig, Scheduler, Hook); the host (weft::ops::gemm) builds the tensor maps and launches it.
#pragma once

#include "gemm/gemm_hooks.cuh"
#include "gemm/gemm_scheduler.cuh"
#include "gemm/gemm_sm90_epilogue.cuh"
#include "gemm/gemm_sm90_traits.cuh"
#include "weft/common/gemm_config.hpp"
#include "weft/device/tile.cuh"
#include "weft/device/token.cuh"
#include "weft/ptx/cvt.cuh"
#include "weft/ptx/ld_st.cuh"
#include "weft/ptx/matrix.cuh"
#include "weft/ptx/mbarrier.cuh"
#include "weft/ptx/setmaxnreg.cuh"
#include "weft/ptx/tma.cuh"
#include "weft/ptx/wgmma.cuh"

namespace weft::kernels::gemm {
namespace detail {

/// Pipeline wait that traps when the bound passes (a stuck pipeline is a kernel bug, not a slow peer).
/// Inline on purpose: no call may sit in the mainloop.
template <bool kClusterScope>
__device__ __forceinline__ void pipeline_wait(unsigned bar, unsigned parity, uint64_t timeout_ns) {
    if (!ptx::mbarrier_wait_parity_bounded<kClusterScope>(bar, parity, timeout_ns)) __trap();
}

/// Whether a scheduler names each work unit's k split (`split(i)`, PersistentScheduler): what a split-K config needs.
template <class Scheduler>
inline constexpr bool kSchedulerSplitsK = requires(const Scheduler& s) { s.split(int32_t{0}); };

/// Whether a scheduler may drop tiles (`dropped(i)`: the CTA's i-th tile is computed but not stored, AgGemmScheduler
/// on a call descriptor mismatch): its producer's wait takes the tile's index too (`wait_before_load(tile, i)`), and
/// the consumers skip the epilogue's stores of a dropped tile (the hook still hears of it: the call's counts stay
/// whole). `dropped(i)` must give every consumer thread the same answer once the tile's stages have landed.
template <class Scheduler>
inline constexpr bool kSchedulerDropsTiles = requires(const Scheduler& s) { s.dropped(int32_t{0}); };

/// The scheduler's wait before the A loads of the CTA's i-th tile: a Token, or a device::WaitResult (a wait that may
/// give up: kSchedulerWaitMayFail).
template <class Scheduler>
__device__ __forceinline__ auto scheduler_wait(const Scheduler& sched, const GemmTile& tile, int32_t i) {
    if constexpr (kSchedulerDropsTiles<Scheduler>) {
        return sched.wait_before_load(tile, i);
    } else {
        return sched.wait_before_load(tile);
    }
}

template <class A, class B>
inline constexpr bool kSameType = false;
template <class A>
inline constexpr bool kSameType<A, A> = true;

/// Whether a scheduler's wait may give up (returns device::WaitResult, not a Token). One that gives up (a peer that
/// never called, an aborted World: its Diagnostic recorded) ends the CTA's waiting: that tile and the later ones load
/// without waiting, and the kernel runs to its end (the CUDA context stays usable); what they store is not defined
/// (the call failed: World::sync_and_check throws the Diagnostic).
template <class Scheduler>
inline constexpr bool kSchedulerWaitMayFail =
    kSameType<decltype(scheduler_wait(*static_cast<const Scheduler*>(nullptr), GemmTile{}, 0)), device::WaitResult>;

/// The k blocks of this CTA's i-th work unit: all of them, or (split-K) its split's balanced range (never empty: the
/// scheduler splits K at most num_k_blocks ways).
template <GemmConfig kCfg, class Scheduler>
__device__ __forceinline__ GemmKRange unit_k_range(const Scheduler& sched, int32_t i, int32_t num_k_blocks) {
    if constexpr (kCfg.splits == 1) {
        return GemmKRange{0, num_k_blocks};
    } else {
        return gemm_split_k_range(num_k_blocks, sched.num_splits(), sched.split(i));
    }
}

/// Grouped schedulers whose wait cannot fail hand each tile to the consumers through the tile ring in shared memory
/// (gemm_tile_slots): the
/// producer writes tile i's slot as it takes the tile, before the first stage of i is marked full (the arrive releases
/// it, the consumers' wait acquires it), and a consumer reads it after its mainloop. The consumers then never run the
/// scheduler's cursor: no cursor lives in registers beside the accumulators (a ping-pong 128x192 tile fits without
/// spilling). The waiting grouped schedulers (GroupedWaitScheduler, GatheredWaitScheduler) do not: their producer's 40
/// registers spilled on the wait's failure path with the ring's stores; their consumers keep the cursor
/// (is_valid_grouped_wait).
template <class Scheduler>
inline constexpr bool kTilesThroughSmem = kSchedulerGrouped<Scheduler> && !kSchedulerWaitMayFail<Scheduler>;

template <GemmConfig kCfg>
__device__ __forceinline__ unsigned tile_slot(unsigned smem_base, int32_t i) {
    return smem_base + GemmTraits<kCfg>::kPlan.tile_ring_offset +
           static_cast<unsigned>(i % gemm_tile_slots(kCfg)) * kGemmTileSlotBytes;
}

__device__ __forceinline__ void put_tile(unsigned slot, const GemmTile& t) {
    ptx::st_shared(slot, make_uint4(static_cast<unsigned>(t.m_idx), static_cast<unsigned>(t.m0),
                                    static_cast<unsigned>(t.n0), static_cast<unsigned>(t.group)));
    ptx::st_shared(slot + 16, t.m_end);
}

/// The tile of a slot: a grouped tile is always valid (cluster-free: no partner's padding tile), and its column index
/// follows from its first column.
template <GemmConfig kCfg>
__device__ __forceinline__ GemmTile get_tile(unsigned slot) {
    const uint4 a = ptx::ld_shared<uint4>(slot);
    GemmTile t;
    t.m_idx = static_cast<int32_t>(a.x);
    t.m0 = static_cast<int32_t>(a.y);
    t.n0 = static_cast<int32_t>(a.z);
    t.n_idx = t.n0 / kCfg.tile_n;
    t.valid = true;
    t.group = static_cast<int32_t>(a.w);
    t.m_end = ptx::ld_shared<int32_t>(slot + 16);
    return t;
}

/// Producer: one thread walks this CTA's tiles and k-blocks, waits for a free stage, and issues the TMA
/// loads of A (after the scheduler's wait, whose Token it takes) and B into it.
template <GemmConfig kCfg, class Scheduler>
__device__ __forceinline__ void producer_loop(const Scheduler& sched, const ptx::TmaDescriptor* tma_a,
                                              const ptx::TmaDescriptor* tma_b, unsigned smem_base,
                                              unsigned bar_full0, unsigned bar_empty0, int32_t num_k_blocks,
                                              uint64_t timeout_ns) {
    using T = GemmTraits<kCfg>;
    const int cta_rank = T::kClusterSize == 1 ? 0 : static_cast<int>(ptx::cluster_cta_rank());
    const unsigned short all_ctas = static_cast<unsigned short>((1u << T::kClusterSize) - 1u);
    unsigned stage = 0, phase = 0;
    const int32_t num_tiles = sched.num_tiles();
    bool gave_up = false;  // a wait gave up (kSchedulerWaitMayFail): no more waits in this CTA
    for (int32_t i = 0; i < num_tiles; ++i) {
        const GemmTile tile = sched.tile(i);
        if constexpr (kTilesThroughSmem<Scheduler>) put_tile(tile_slot<kCfg>(smem_base, i), tile);
        // The A loads of this tile take its wait's Token; after a wait gave up, none (what they load is not defined).
        device::Token token = device::Token::assume_local_data();
        if constexpr (kSchedulerWaitMayFail<Scheduler>) {
            if (!gave_up) {
                const device::WaitResult r = scheduler_wait(sched, tile, i);
                token = r.token();
                gave_up = !r.ok();
            }
        } else {
            token = scheduler_wait(sched, tile, i);
        }
        const GemmKRange kr = unit_k_range<kCfg>(sched, i, num_k_blocks);
        for (int32_t kb = kr.begin; kb < kr.begin + kr.count; ++kb) {
            const unsigned full = bar_full0 + 8 * stage;
            pipeline_wait<(T::kClusterSize > 1)>(bar_empty0 + 8 * stage, phase ^ 1u, timeout_ns);
            ptx::mbarrier_arrive_expect_tx(full, T::kPlan.stage_bytes);
            const unsigned a_dst = smem_base + stage * T::kPlan.stage_bytes;
            const unsigned b_dst = a_dst + T::kPlan.a_stage_bytes;
            const int k0 = kb * kCfg.tile_k;
            // A: [tile_m rows][64 k], 128B swizzle. With cluster_n = 2 each CTA loads half the rows for both.
            if constexpr (kCfg.cluster_n == 1) {
                device::tile::tma_load_2d(token, a_dst, tma_a, full, k0, tile.m0);
            } else {
                const int half = cta_rank;
                device::tile::tma_load_2d_multicast(token, a_dst + half * T::kARowsPerCta * T::kRowBytes, tma_a, full,
                                                    k0, tile.m0 + half * T::kARowsPerCta, all_ctas);
            }
            // B: kNK: [tile_n rows][64 k]; kKN: tile_n/64 boxes of [64 k rows][64 n]. A grouped scheduler's B is a 3D
            // map [groups, N, K] / [groups, K, N]: the box of the tile's group (zero-filled past its N and K).
            if constexpr (kSchedulerGrouped<Scheduler>) {
                if constexpr (kCfg.b_layout == BLayout::kNK) {
                    ptx::tma_load_3d(b_dst, tma_b, full, k0, tile.n0, tile.group);
                } else {
#pragma unroll
                    for (int c = 0; c < T::kBChunks; ++c) {
                        ptx::tma_load_3d(b_dst + c * T::kBChunkBytes, tma_b, full, tile.n0 + c * 64, k0, tile.group);
                    }
                }
            } else if constexpr (kCfg.b_layout == BLayout::kNK) {
                if constexpr (kCfg.cluster_m == 1) {
                    ptx::tma_load_2d(b_dst, tma_b, full, k0, tile.n0);
                } else {
                    const int half = cta_rank;
                    ptx::tma_load_2d_multicast(b_dst + half * T::kBRowsPerCta * T::kRowBytes, tma_b, full, k0,
                                               tile.n0 + half * T::kBRowsPerCta, all_ctas);
                }
            } else {
#pragma unroll
                for (int c = 0; c < T::kBChunksPerCta; ++c) {
                    const int chunk = (kCfg.cluster_m == 1 ? 0 : cta_rank * T::kBChunksPerCta) + c;
                    if constexpr (kCfg.cluster_m == 1) {
                        ptx::tma_load_2d(b_dst + chunk * T::kBChunkBytes, tma_b, full, tile.n0 + chunk * 64, k0);
                    } else {
                        ptx::tma_load_2d_multicast(b_dst + chunk * T::kBChunkBytes, tma_b, full,
                                                   tile.n0 + chunk * 64, k0, all_ctas);
                    }
                }
            }
            if (++stage == static_cast<unsigned>(kCfg.stages)) {
                stage = 0;
                phase ^= 1u;
            }
        }
    }
}

/// Frees a stage: one arrival per consumer warp on the stage's empty barrier in every CTA of the cluster
/// (each CTA's producer writes into every CTA's stage when multicasting).
template <GemmConfig kCfg>
__device__ __forceinline__ void release_stage(unsigned bar_empty, int lane) {
    using T = GemmTraits<kCfg>;
    if (lane == 0) {
        if constexpr (T::kClusterSize == 1) {
            ptx::mbarrier_arrive(bar_empty);
        } else {
#pragma unroll
            for (int c = 0; c < T::kClusterSize; ++c) ptx::mbarrier_arrive_cluster(bar_empty, static_cast<unsigned>(c));
        }
    }
}

template <GemmConfig kCfg, class Scheduler, class Hook>
__device__ __forceinline__ void consumer_loop(const Scheduler& sched, const ptx::TmaDescriptor* tma_d,
                                              unsigned smem_base, unsigned bar_full0, unsigned bar_empty0,
                                              int32_t num_k_blocks, const GemmArgs& args,
                                              const typename Hook::Params& hook_params) {
    using T = GemmTraits<kCfg>;
    // A hook that signals a tile stored may take a tail: notify_stored's barrier orders the plain stores before it.
    static_assert(!T::kEpiTail || !kHookRoutesStores<Hook>,
                  "gemm: a hook that routes the tile's stores needs a tile width of whole store boxes (the tail's plain "
                  "stores are not routed)");
    constexpr bool kGrouped = kSchedulerGrouped<Scheduler>;
    static_assert(!kGrouped || !kHookRoutesStores<Hook>,
                  "gemm: a grouped scheduler's tiles end at their group's rows; a hook may not route their stores");
    static_assert(kCfg.splits == 1 || (kSchedulerSplitsK<Scheduler> && !Hook::kNotifies && !kHookAddsToTile<Hook> &&
                                       !kHookRoutesStores<Hook>),
                  "gemm: split-K (GemmConfig::splits > 1) needs a scheduler that names each unit's split "
                  "(PersistentScheduler) and a hook that neither signals, adds to nor routes a tile (NoEpilogueHook)");
    static_assert(!kCfg.swap_ab || (!kGrouped && !Hook::kNotifies && !kHookAddsToTile<Hook> &&
                                    !kHookRoutesStores<Hook> && !kSchedulerDropsTiles<Scheduler>),
                  "gemm: a swapped config (GemmConfig::swap_ab) is for the plain GEMM: a persistent scheduler and a "
                  "hook that neither signals, adds to nor routes a tile (NoEpilogueHook)");
    const int wg = static_cast<int>(threadIdx.x) / 128 - 1;
    const int tid = static_cast<int>(threadIdx.x) % 128;
    const int lane = tid % 32;
    const unsigned epi_base = smem_base + T::kPlan.epi_offset;
    // The first of this warpgroup's 64-row slabs in a tile: its half of the rows (cooperative), all (ping-pong).
    const int slab0 = kCfg.pingpong ? 0 : wg * T::kSlabs;

    float acc[T::kSlabs][T::kAccPerSlab];
    unsigned stage = 0, phase = 0;
    unsigned epi_count = 0;
    // A full-barrier wait that expires marks the pipeline stuck; the warpgroup stops waiting, leaves the tile loop
    // without storing and traps after it; a hook that fails (its diagnostic recorded) does the same in the thread
    // that ran it. NOTE: no trap inside the loop: a reachable trap while the accumulators are live made ptxas
    // (CUDA 13) spill them and serialise every wgmma once they pass 128 floats per thread.
    bool stuck = false;
    GemmTile pending{};
    bool has_pending = false;

    // Ping-pong: warpgroup wg takes this CTA's tiles wg, wg + 2, ...; the producer fills the ring with every tile's
    // k-blocks in order, so tile i starts at ring position i * num_k_blocks. Mainloops take turns: tile i's starts
    // once tile i - 1's has waited for all its stages (the other warpgroup arrives on this one's turn barrier), so
    // each epilogue runs under the other warpgroup's mainloop, and no wait on a full barrier can run two phases
    // ahead of it (the parity test would pass on a stale phase).
    const int32_t num_tiles = sched.num_tiles();
    const int32_t first_tile = kCfg.pingpong ? wg : 0;
    constexpr int32_t kTileStep = kCfg.pingpong ? kGemmConsumerWarpgroups : 1;
    for (int32_t i = first_tile; i < num_tiles; i += kTileStep) {
        // Grouped: the tile comes from the ring once the mainloop is done (tile_slot); its k range is all of K.
        GemmTile tile{};
        if constexpr (!kTilesThroughSmem<Scheduler>) tile = sched.tile(i);
        const GemmKRange kr = unit_k_range<kCfg>(sched, i, num_k_blocks);
        if constexpr (kCfg.pingpong) {
            // The ring position where tile i's k-blocks start: the k-blocks of this CTA's earlier units.
            uint32_t position = static_cast<uint32_t>(i) * static_cast<uint32_t>(num_k_blocks);
            if constexpr (kCfg.splits > 1) {
                position = 0;
                for (int32_t j = 0; j < i; ++j) position += unit_k_range<kCfg>(sched, j, num_k_blocks).count;
            }
            stage = position % kCfg.stages;
            phase = (position / kCfg.stages) & 1u;
            if (i > 0) ptx::named_barrier_sync(kBarMainloopTurn0 + wg, kGemmConsumerWarpgroups * 128);
        }

        // ---- mainloop: wait for a full stage, issue tile_k/16 wgmma per slab, free the previous stage ----
        unsigned prev_stage = 0;
        WEFT_TRACE_DECLARE(tile_t0);  // traced builds: the tile starts when its first stage has landed
        for (int32_t kb = kr.begin; kb < kr.begin + kr.count; ++kb) {
            if (!stuck) {
                stuck = !ptx::mbarrier_wait_parity_bounded<false>(bar_full0 + 8 * stage, phase, args.timeout_ns);
            }
            WEFT_TRACE_STAMP_IF(kb == kr.begin, tile_t0);
            const unsigned a_base = smem_base + stage * T::kPlan.stage_bytes + slab0 * kGemmSlabRows * T::kRowBytes;
            const unsigned b_base = smem_base + stage * T::kPlan.stage_bytes + T::kPlan.a_stage_bytes;
#pragma unroll
            for (int s = 0; s < T::kSlabs; ++s) ptx::wgmma_fence_operands(acc[s]);
            ptx::wgmma_fence();
            if constexpr (kCfg.swap_ab) {
                // Swapped: the wgmma's M side is 64 of B's rows (this slab's columns of D), its N side all tile_m of
                // A's rows; both K-major, 128-byte swizzled, k16 step kk at byte 32 kk of each row.
                const unsigned a_rows = smem_base + stage * T::kPlan.stage_bytes;
                const unsigned b_slabs = b_base + slab0 * kGemmSlabRows * T::kRowBytes;
#pragma unroll
                for (int kk = 0; kk < T::kKSteps; ++kk) {
                    const unsigned long long desc_n =
                        ptx::make_smem_desc(a_rows + kk * 32, 16, 1024, ptx::SmemSwizzle::k128B);
#pragma unroll
                    for (int s = 0; s < T::kSlabs; ++s) {
                        const unsigned long long desc_m = ptx::make_smem_desc(
                            b_slabs + s * kGemmSlabRows * T::kRowBytes + kk * 32, 16, 1024, ptx::SmemSwizzle::k128B);
                        ptx::wgmma<kCfg.tile_m, T::kIsBF16, 0>(acc[s], desc_m, desc_n,
                                                               (kb > kr.begin || kk > 0) ? 1 : 0);
                    }
                }
            } else {
#pragma unroll
                for (int kk = 0; kk < T::kKSteps; ++kk) {
                    unsigned long long desc_b;
                    if constexpr (kCfg.b_layout == BLayout::kNK) {
                        desc_b = ptx::make_smem_desc(b_base + kk * 32, 16, 1024, ptx::SmemSwizzle::k128B);
                    } else {
                        desc_b =
                            ptx::make_smem_desc(b_base + kk * 16 * 128, T::kBChunkBytes, 1024, ptx::SmemSwizzle::k128B);
                    }
#pragma unroll
                    for (int s = 0; s < T::kSlabs; ++s) {
                        const unsigned long long desc_a = ptx::make_smem_desc(
                            a_base + s * kGemmSlabRows * T::kRowBytes + kk * 32, 16, 1024, ptx::SmemSwizzle::k128B);
                        ptx::wgmma<kCfg.tile_n, T::kIsBF16, T::kTransB>(acc[s], desc_a, desc_b,
                                                                        (kb > kr.begin || kk > 0) ? 1 : 0);
                    }
                }
            }
            ptx::wgmma_commit_group();
#pragma unroll
            for (int s = 0; s < T::kSlabs; ++s) ptx::wgmma_fence_operands(acc[s]);
            if (kb > kr.begin) {
                ptx::wgmma_wait_group<1>();  // the previous k-block's wgmma have read their stage
                release_stage<kCfg>(bar_empty0 + 8 * prev_stage, lane);
            }
            prev_stage = stage;
            if (++stage == static_cast<unsigned>(kCfg.stages)) {
                stage = 0;
                phase ^= 1u;
            }
        }
        if constexpr (kCfg.pingpong) {
            if (i + 1 < num_tiles) {
                ptx::named_barrier_arrive(kBarMainloopTurn0 + (wg ^ 1), kGemmConsumerWarpgroups * 128);
            }
        }
        ptx::wgmma_wait_group<0>();
#pragma unroll
        for (int s = 0; s < T::kSlabs; ++s) ptx::wgmma_fence_operands(acc[s]);
        release_stage<kCfg>(bar_empty0 + 8 * prev_stage, lane);  // NOTE: every unit has >= 1 k-block
        if (stuck) break;
        if constexpr (kTilesThroughSmem<Scheduler>) tile = get_tile<kCfg>(tile_slot<kCfg>(smem_base, i));

        // ---- split-K: every unit leaves its partial tile; the tile's last unit sums them and stores D ----
        if constexpr (kCfg.splits > 1) {
            if (!split_k_reduce<kCfg>(acc, args, tile, sched.split(i), sched.num_splits(), wg, tid, slab0)) continue;
        }

        // ---- the previous tile's stores have had a whole mainloop to land: signal it now (cooperative) ----
        if constexpr (Hook::kNotifies && !kCfg.pingpong) {
            if (has_pending && !notify_stored<Hook, false>(hook_params, pending, wg, tid)) stuck = true;
        }

        // ---- the hook may add to the tile (e.g. the peers' partials of GEMM+ReduceScatter's own rows) ----
        if constexpr (kHookAddsToTile<Hook>) {
            if (tile.valid && !Hook::template add_to_tile<kCfg>(hook_params, tile, acc, wg, slab0, tid)) stuck = true;
        }
        if (stuck) break;

        // ---- epilogue: registers -> shared -> TMA store (asynchronous; overlaps the next mainloop) ----
        // A dropped tile (kSchedulerDropsTiles) goes through the epilogue as an invalid one: staged, never stored (the
        // same answer in every thread: the scheduler's rule). NOTE: a predicate, not a branch around the epilogue: the
        // branch made ptxas spill the 128x192 ping-pong accumulators.
        bool store = tile.valid;
        if constexpr (kSchedulerDropsTiles<Scheduler>) store = store && !sched.dropped(i);
        GemmStoreTarget target{tma_d, 0, args.m};
        if constexpr (kHookRoutesStores<Hook>) {
            if (tile.valid) target = Hook::store_target(hook_params, tile, tma_d);
        }
        const bool ragged = store && ((args.n_tma < args.n && tile.n0 + kCfg.tile_n > args.n_tma) || T::kEpiTail);
#pragma unroll
        for (int s = 0; s < T::kSlabs; ++s) {
            const int row0 = tile.m0 + (slab0 + s) * kGemmSlabRows;
            if constexpr (kGrouped) {
                // A slab wholly inside its group's rows goes out by TMA; one that the group's rows end inside by plain
                // stores of its rows (a box would write the next group's rows: copy_out_box, or for fp32 output
                // store_slab_tail); one past them not at all. The columns past the tile's last whole box (kEpiTail)
                // by store_slab_tail in either case.
                const bool in_group = store && row0 < tile.m_end;
                const bool whole = row0 + kGemmSlabRows <= tile.m_end;
                const bool past_n_tma = args.n_tma < args.n && tile.n0 + T::kEpiTmaCols > args.n_tma;
                constexpr bool kCopy = kCfg.out_dtype != DType::kF32;
                const bool copy = in_group && (past_n_tma || !whole);
                store_slab<kCfg, kCopy>(acc[s], target.map, epi_base, wg, tid, epi_count, row0, tile.n0, store,
                                        whole ? target.rows : row0, args, copy ? tile.m_end : row0,
                                        whole ? args.n_tma : tile.n0);
                if (kCopy ? T::kEpiTail && in_group : copy || (T::kEpiTail && in_group)) {
                    store_slab_tail<kCfg>(acc[s], row0, tile.n0, tid / 32, lane, args, tile.m_end, !kCopy && !whole);
                }
            } else if constexpr (kCfg.swap_ab) {
                const int col0 = tile.n0 + (slab0 + s) * kGemmSlabRows;
                store_slab_swapped<kCfg>(acc[s], tma_d, epi_base, wg, tid, epi_count, tile.m0, col0, store, args);
                if (ragged) store_slab_tail_swapped<kCfg>(acc[s], tile.m0, col0, tid / 32, lane, args);
            } else {
                store_slab<kCfg>(acc[s], target.map, epi_base, wg, tid, epi_count, row0 - target.row_offset, tile.n0,
                                 store, target.rows, args);
                if (ragged) store_slab_tail<kCfg>(acc[s], row0, tile.n0, tid / 32, lane, args, args.m);
            }
        }
        WEFT_TRACE_GEMM_TILE(hook_params, tile, wg, tid, tile_t0);
        if constexpr (kCfg.pingpong) {
            // The wait for the stores runs under the other warpgroup's mainloop, as this epilogue did.
            if constexpr (Hook::kNotifies) {
                if (!notify_stored<Hook, true>(hook_params, tile, wg, tid)) stuck = true;
            }
            if (stuck) break;
        } else {
            pending = tile;
            has_pending = true;
        }
    }
    if constexpr (Hook::kNotifies && !kCfg.pingpong) {
        if (!stuck && has_pending && !notify_stored<Hook, false>(hook_params, pending, wg, tid)) stuck = true;
    }
    if (stuck) __trap();
    if (tid == 0) ptx::tma_wait_group<0>();  // shared memory stays valid until every store has read it
}

}  // namespace detail

/// The whole GEMM as a device function: gemm_kernel below, and a fused GEMM's own kernel (FusedGemmSpec::
/// kernel_template, as ag_gemm_kernel), are thin __global__ wrappers around it. Contract of a launch: kGemmThreads
/// threads, gemm_smem_plan(kCfg).alloc_bytes of dynamic shared memory, a grid that is a multiple of the cluster size
/// (cluster dims cluster_m * cluster_n, 1, 1), one CTA per SM (persistent: grid <= SM budget). Tensor maps
/// (weft::ops::detail::make_gemm_tensor_maps), all 128B-swizzled:
///   tma_a: A [M,K], box {64, tile_m / cluster_n}; tma_b: B, box {64, tile_n / cluster_m} (kNK) or {64, 64}
///   (kKN); tma_d: D [M, n_tma], box {128 bytes of columns, 64} (args.n_tma: see GemmArgs).
template <GemmConfig kCfg, class Scheduler, class Hook>
__device__ __forceinline__ void gemm_device(const ptx::TmaDescriptor* tma_a, const ptx::TmaDescriptor* tma_b,
                                            const ptx::TmaDescriptor* tma_d, const GemmArgs& args,
                                            const typename Scheduler::Params& sched_params,
                                            const typename Hook::Params& hook_params) {
    static_assert(is_valid(kCfg), "invalid GemmConfig (see weft::is_valid)");
    using T = detail::GemmTraits<kCfg>;
    extern __shared__ __align__(1024) unsigned char gemm_smem[];
    const unsigned smem_base = (ptx::shared_address(gemm_smem) + 1023u) & ~1023u;
    const unsigned bar_full0 = smem_base + T::kPlan.bar_offset;
    const unsigned bar_empty0 = bar_full0 + 8 * kCfg.stages;

    if (threadIdx.x == 0) {
        for (int s = 0; s < kCfg.stages; ++s) {
            ptx::mbarrier_init(bar_full0 + 8 * s, 1);
            ptx::mbarrier_init(bar_empty0 + 8 * s, T::kConsumerWarps * T::kClusterSize);
        }
        ptx::fence_mbarrier_init();
    }
    if constexpr (T::kClusterSize > 1) {
        ptx::cluster_sync();
    } else {
        __syncthreads();
    }

    const Scheduler sched(sched_params, args);
    const int32_t num_k_blocks = (args.k + kCfg.tile_k - 1) / kCfg.tile_k;

    if (threadIdx.x / 128 == 0) {
        ptx::setmaxnreg_dec<kGemmProducerRegs>();
        if (threadIdx.x == 0) {
            ptx::tma_prefetch_descriptor(tma_a);
            ptx::tma_prefetch_descriptor(tma_b);
            ptx::tma_prefetch_descriptor(tma_d);
            detail::producer_loop<kCfg>(sched, tma_a, tma_b, smem_base, bar_full0, bar_empty0, num_k_blocks,
                                        args.timeout_ns);
        }
    } else {
        ptx::setmaxnreg_inc<kGemmConsumerRegs>();
        detail::consumer_loop<kCfg, Scheduler, Hook>(sched, tma_d, smem_base, bar_full0, bar_empty0, num_k_blocks,
                                                     args, hook_params);
    }
    // A CTA must not exit while its cluster partner may still arrive on its barriers or multicast into it.
    if constexpr (T::kClusterSize > 1) ptx::cluster_sync();
}

/// The kernel the JIT instantiates: "weft::kernels::gemm::gemm_kernel<weft::GemmConfig{...}, Scheduler, Hook>".
template <GemmConfig kCfg, class Scheduler, class Hook>
__global__ void __launch_bounds__(kGemmThreads, 1)
    gemm_kernel(const __grid_constant__ ptx::TmaDescriptor tma_a, const __grid_constant__ ptx::TmaDescriptor tma_b,
                const __grid_constant__ ptx::TmaDescriptor tma_d, const GemmArgs args,
                const typename Scheduler::Params sched_params,
                const __grid_constant__ typename Hook::Params hook_params) {
    gemm_device<kCfg, Scheduler, Hook>(&tma_a, &tma_b, &tma_d, args, sched_params, hook_params);
}

}  // namespace weft::kernels::gemm
