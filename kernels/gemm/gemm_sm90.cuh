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

/// Compile-time facts derived from a config.
template <GemmConfig kCfg>
struct GemmTraits {
    static constexpr GemmSmemPlan kPlan = gemm_smem_plan(kCfg);
    static constexpr int kClusterSize = kCfg.cluster_m * kCfg.cluster_n;
    static constexpr int kSlabs = gemm_slabs_per_consumer(kCfg);
    static constexpr int kAccPerSlab = gemm_wgmma_n(kCfg) / 2;
    static constexpr int kKSteps = kCfg.tile_k / 16;
    static constexpr bool kIsBF16 = kCfg.in_dtype == DType::kBF16;
    static constexpr int kTransB = kCfg.b_layout == BLayout::kKN ? 1 : 0;
    static constexpr int kEpiCols = gemm_epi_cols(kCfg);
    static constexpr int kEpiSubtiles = kCfg.tile_n / kEpiCols;  // whole store boxes
    static constexpr int kEpiTmaCols = kEpiSubtiles * kEpiCols;  // columns of a tile stored by TMA
    static constexpr bool kEpiTail = kEpiTmaCols < kCfg.tile_n;  // the rest by plain stores (gemm_epi_tail)
    // Warps that consume (and free) each stage: both consumer warpgroups, or one in ping-pong.
    static constexpr int kConsumerWarps = (kCfg.pingpong ? 1 : kGemmConsumerWarpgroups) * 4;
    static constexpr int kRowBytes = kCfg.tile_k * 2;  // 128: one swizzle row
    // Multicast split of the shared operand between the two CTAs of a cluster.
    static constexpr int kARowsPerCta = kCfg.tile_m / kCfg.cluster_n;
    static constexpr int kBRowsPerCta = kCfg.tile_n / kCfg.cluster_m;        // kNK: rows of B[N,K]
    static constexpr int kBChunks = kCfg.tile_n / 64;                          // kKN: 64-column boxes
    static constexpr int kBChunksPerCta = kBChunks / kCfg.cluster_m;
    static constexpr int kBChunkBytes = kCfg.tile_k * 128;                     // kKN: 64 k-rows x 128 B
    static_assert(kRowBytes == 128, "tile_k must span one 128-byte swizzle row");
};

// Named barrier ids (0 is __syncthreads): one per consumer warpgroup, one for both, and (ping-pong) one per
// consumer warpgroup that the other arrives on when this one's mainloop may start.
inline constexpr int kBarConsumer0 = 1;
inline constexpr int kBarBothConsumers = 3;
inline constexpr int kBarMainloopTurn0 = 4;

/// Two floats to packed 16-bit kOut (lo in the low half), rounded to nearest even.
template <DType kOut>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    if constexpr (kOut == DType::kBF16) {
        return ptx::cvt_rn_bf16x2(lo, hi);
    } else {
        return ptx::cvt_rn_f16x2(lo, hi);
    }
}

__device__ __forceinline__ void st_shared_v2_f32(unsigned addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

__device__ __forceinline__ void st_shared_f32(unsigned addr, float x) {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(x) : "memory");
}

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

/// Writes columns [j * kEpiCols, (j+1) * kEpiCols) of one 64-row accumulator slab into a staging buffer of
/// 64 rows x 128 bytes, 128B-swizzled (the layout the TMA store box reads).
template <GemmConfig kCfg, int kJ>
__device__ __forceinline__ void stage_subtile(const float (&acc)[GemmTraits<kCfg>::kAccPerSlab], unsigned buf,
                                              int warp_in_wg, int lane) {
    using T = GemmTraits<kCfg>;
    if constexpr (kCfg.out_dtype == DType::kF32) {
        // 32 columns = 4 groups of 8; each thread owns 2 adjacent columns in rows r and r + 8.
        const int row0 = warp_in_wg * 16 + lane / 4;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            constexpr int kGroupsPerSubtile = 4;
            const int g = kJ * kGroupsPerSubtile + q;
            const int col_byte = q * 32 + (lane % 4) * 8;
            const unsigned addr = buf + row0 * 128 + ((((col_byte >> 4) ^ (row0 & 7))) << 4) + (col_byte & 15);
            st_shared_v2_f32(addr, acc[4 * g + 0], acc[4 * g + 1]);
            st_shared_v2_f32(addr + 8 * 128, acc[4 * g + 2], acc[4 * g + 3]);
        }
    } else {
        // 64 columns = 8 groups of 8; one stmatrix.x4 stores two groups (rows 0-7 and 8-15 of this warp).
        const int mi = lane / 8;
        const int row = warp_in_wg * 16 + (mi & 1) * 8 + (lane % 8);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const int g = kJ * 8 + 2 * p;
            const unsigned r0 = pack2<kCfg.out_dtype>(acc[4 * g + 0], acc[4 * g + 1]);
            const unsigned r1 = pack2<kCfg.out_dtype>(acc[4 * g + 2], acc[4 * g + 3]);
            const unsigned r2 = pack2<kCfg.out_dtype>(acc[4 * g + 4], acc[4 * g + 5]);
            const unsigned r3 = pack2<kCfg.out_dtype>(acc[4 * g + 6], acc[4 * g + 7]);
            const int chunk = 2 * p + (mi >> 1);
            const unsigned addr = buf + row * 128 + ((chunk ^ (row & 7)) << 4);
            ptx::stmatrix_x4(addr, r0, r1, r2, r3);
        }
    }
    (void)T::kEpiCols;
}

/// Grouped tiles of 16-bit output: what a TMA store may not write of one staged store box (columns [c0, c0 + kEpiCols)
/// of rows row0..), by the warpgroup's plain stores from the staging buffer: its rows [row0, row_end) from column
/// c_from on, never a column from args.n on. For a slab that its group's rows end inside, c_from = c0 (a box would
/// write the next group's rows); for a whole slab, args.n_tma (the last columns, less than 16 bytes per row, past the
/// store map's width). From shared memory, not from the accumulators: they are not kept live for a second pass (with
/// 192 floats per thread and bf16 output that spilled 1388 bytes; with fp32 output the second pass is what spills
/// nothing, and copy_out_box's six boxes per slab spilled 24-44 bytes: store_slab_tail there).
template <GemmConfig kCfg>
__device__ __forceinline__ void copy_out_box(unsigned buf, int row0, int row_end, int c0, int c_from, int tid,
                                             const GemmArgs& args) {
    constexpr int kElemBytes = gemm_elem_bytes(kCfg.out_dtype);
    constexpr int kPerChunk = 16 / kElemBytes;  // elements per 16-byte chunk of a row
    const int rows = row_end - row0 < kGemmSlabRows ? row_end - row0 : kGemmSlabRows;
    for (int idx = tid; idx < rows * 8; idx += 128) {
        const int r = idx / 8, chunk = idx % 8;
        const int c = c0 + chunk * kPerChunk;
        if (c + kPerChunk <= c_from || c >= args.n) continue;
        const uint4 v = ptx::ld_shared<uint4>(buf + r * 128 + ((chunk ^ (r & 7)) << 4));
        unsigned char* const dst =
            static_cast<unsigned char*>(args.d) + ((static_cast<int64_t>(row0 + r) * args.ldd + c) * kElemBytes);
        if (c >= c_from && c + kPerChunk <= args.n) {
            *reinterpret_cast<uint4*>(dst) = v;  // D's rows are 16-byte aligned (TMA-stored)
            continue;
        }
        const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < kPerChunk; ++e) {
            if (c + e < c_from || c + e >= args.n) continue;
            if constexpr (kElemBytes == 4) {
                reinterpret_cast<unsigned*>(dst)[e] = words[e];
            } else {
                reinterpret_cast<unsigned short*>(dst)[e] = static_cast<unsigned short>(words[e / 2] >> (16 * (e % 2)));
            }
        }
    }
}

/// Epilogue of one 64-row slab: for each 128-byte-wide column block, registers -> swizzled shared buffer
/// (double-buffered per warpgroup) -> one TMA store issued by the warpgroup's first thread; with kCopyOut (grouped
/// tiles), then copy_out_box of its rows [row0, copy_row_end) from column copy_col_from on.
template <GemmConfig kCfg, bool kCopyOut = false, int kJ = 0>
__device__ __forceinline__ void store_slab(const float (&acc)[GemmTraits<kCfg>::kAccPerSlab],
                                           const ptx::TmaDescriptor* tma_d, unsigned epi_base, int wg, int tid,
                                           unsigned& epi_count, int row0, int col0, bool valid, int row_limit,
                                           const GemmArgs& args, int copy_row_end = 0, int copy_col_from = 0) {
    using T = GemmTraits<kCfg>;
    if constexpr (kJ < T::kEpiSubtiles) {
        const unsigned buf = epi_base + (wg * 2 + (epi_count & 1u)) * T::kPlan.epi_buf_bytes;
        if (tid == 0) ptx::tma_wait_group_read<1>();  // the store that last read this buffer is done reading
        ptx::named_barrier_sync(kBarConsumer0 + wg, 128);
        stage_subtile<kCfg, kJ>(acc, buf, tid / 32, tid % 32);
        ptx::fence_proxy_async_shared_cta();  // st.shared/stmatrix -> TMA (async proxy)
        ptx::named_barrier_sync(kBarConsumer0 + wg, 128);
        if (tid == 0) {
            const int c0 = col0 + kJ * T::kEpiCols;
            if (valid && c0 < args.n_tma && row0 < row_limit) ptx::tma_store_2d(tma_d, buf, c0, row0);
            ptx::tma_commit_group();
        }
        if constexpr (kCopyOut) {
            if (copy_row_end > row0) {
                const int c0 = col0 + kJ * T::kEpiCols;
                copy_out_box<kCfg>(buf, row0, copy_row_end, c0, copy_col_from, tid, args);
            }
        }
        ++epi_count;
        store_slab<kCfg, kCopyOut, kJ + 1>(acc, tma_d, epi_base, wg, tid, epi_count, row0, col0, valid, row_limit, args,
                                           copy_row_end, copy_col_from);
    }
}

template <DType kOut>
__device__ __forceinline__ void st_global_elem(void* base, int64_t idx, float v) {
    if constexpr (kOut == DType::kF32) {
        static_cast<float*>(base)[idx] = v;
    } else if constexpr (kOut == DType::kBF16) {
        static_cast<unsigned short*>(base)[idx] = ptx::cvt_rn_bf16(v);
    } else {
        static_cast<unsigned short*>(base)[idx] = ptx::cvt_rn_f16(v);
    }
}

/// Two adjacent elements of D at idx (even) as one store.
template <DType kOut>
__device__ __forceinline__ void st_global_pair(void* base, int64_t idx, float lo, float hi) {
    if constexpr (kOut == DType::kF32) {
        *reinterpret_cast<float2*>(static_cast<float*>(base) + idx) = make_float2(lo, hi);
    } else {
        *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(base) + idx) = pack2<kOut>(lo, hi);
    }
}

/// With plain stores: columns [n_tma, N) of one slab (less than 16 bytes per row: a TMA store box would write the
/// whole 16-byte chunk and overwrite the row padding past N), and, for a tile width that is not a whole number of
/// store boxes (GemmTraits::kEpiTail), the tile's columns past its last whole box (a box there would overwrite the
/// next tile's columns); with `all_columns`, every column of the slab (a grouped tile's slab, fp32 output, that its
/// group's rows end inside: a box would write the next group's rows). Rows from `row_end` on are not stored.
template <GemmConfig kCfg>
__device__ __forceinline__ void store_slab_tail(const float (&acc)[GemmTraits<kCfg>::kAccPerSlab], int row0, int col0,
                                                int warp_in_wg, int lane, const GemmArgs& args, int row_end,
                                                bool all_columns = false) {
    const int r_lo = row0 + warp_in_wg * 16 + lane / 4;
    const int r_hi = r_lo + 8;
#pragma unroll
    for (int g = 0; g < kCfg.tile_n / 8; ++g) {
        const bool past_boxes = all_columns || 8 * g >= GemmTraits<kCfg>::kEpiTmaCols;
        const int c0 = col0 + 8 * g + 2 * (lane % 4);
        if (past_boxes && c0 + 1 < args.n) {
            // Both columns: one 4- or 8-byte store per row (D's row stride is a multiple of 16 bytes: TMA-stored).
            if (r_lo < row_end) st_global_pair<kCfg.out_dtype>(args.d, r_lo * args.ldd + c0, acc[4 * g], acc[4 * g + 1]);
            if (r_hi < row_end) {
                st_global_pair<kCfg.out_dtype>(args.d, r_hi * args.ldd + c0, acc[4 * g + 2], acc[4 * g + 3]);
            }
            continue;
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int c = c0 + e;
            if ((past_boxes || c >= args.n_tma) && c < args.n) {
                if (r_lo < row_end) st_global_elem<kCfg.out_dtype>(args.d, r_lo * args.ldd + c, acc[4 * g + e]);
                if (r_hi < row_end) st_global_elem<kCfg.out_dtype>(args.d, r_hi * args.ldd + c, acc[4 * g + 2 + e]);
            }
        }
    }
}

/// Swapped configs (GemmConfig::swap_ab): writes rows [64 kR, 64 kR + 64) of the tile (fewer in the last chunk) and
/// columns [kJ kEpiCols, (kJ + 1) kEpiCols) of one 64-column slab into a staging buffer of 64 rows x 128 bytes,
/// 128B-swizzled as stage_subtile's. The accumulators hold D^T (thread: warp w, lane l): acc[4j + e] is D's row
/// 8j + 2(l%4) + e, column 16w + l/4 of the slab, acc[4j + 2 + e] the same row at column + 8. 16-bit outputs: one
/// stmatrix.x4 .trans per 16 rows (matrix i: rows of j + i/2, columns 16w + 8(i%2), stored transposed into D's
/// layout); fp32: element stores by the two warps whose columns the subtile holds.
template <GemmConfig kCfg, int kJ, int kR>
__device__ __forceinline__ void stage_subtile_swapped(const float (&acc)[GemmTraits<kCfg>::kAccPerSlab], unsigned buf,
                                                      int warp_in_wg, int lane) {
    constexpr int kRows = kCfg.tile_m - 64 * kR < 64 ? kCfg.tile_m - 64 * kR : 64;
    static_assert(kRows % 16 == 0, "gemm (swapped): tile_m is a multiple of 16 (is_valid)");
    if constexpr (kCfg.out_dtype == DType::kF32) {
        if (warp_in_wg / 2 == kJ) {
#pragma unroll
            for (int jj = 0; jj < kRows / 8; ++jj) {
                const int j = 8 * kR + jj;
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int row = 8 * jj + 2 * (lane % 4) + e;
                        const int col_byte = (16 * (warp_in_wg % 2) + lane / 4 + 8 * h) * 4;
                        st_shared_f32(buf + row * 128 + ((((col_byte >> 4) ^ (row & 7))) << 4) + (col_byte & 15),
                                      acc[4 * j + 2 * h + e]);
                    }
            }
        }
    } else {
        const int mi = lane / 8;
#pragma unroll
        for (int p = 0; p < kRows / 16; ++p) {
            const int j = 8 * kR + 2 * p;
            const unsigned r0 = pack2<kCfg.out_dtype>(acc[4 * j + 0], acc[4 * j + 1]);
            const unsigned r1 = pack2<kCfg.out_dtype>(acc[4 * j + 2], acc[4 * j + 3]);
            const unsigned r2 = pack2<kCfg.out_dtype>(acc[4 * j + 4], acc[4 * j + 5]);
            const unsigned r3 = pack2<kCfg.out_dtype>(acc[4 * j + 6], acc[4 * j + 7]);
            const int row = 16 * p + 8 * (mi >> 1) + lane % 8;
            const int chunk = 2 * warp_in_wg + (mi & 1);
            ptx::stmatrix_x4_trans(buf + row * 128 + ((chunk ^ (row & 7)) << 4), r0, r1, r2, r3);
        }
    }
}

/// Swapped configs: the epilogue of one 64-column slab (columns col0 .., rows row0 .. row0 + tile_m - 1): for each
/// 128-byte column block and each 64 rows, registers -> staging buffer (double-buffered per warpgroup) -> TMA stores
/// of kGemmSwapStoreRows rows each (the map's box), issued by the warpgroup's first thread; rows from M on are not
/// stored.
template <GemmConfig kCfg, int kJ = 0, int kR = 0>
__device__ __forceinline__ void store_slab_swapped(const float (&acc)[GemmTraits<kCfg>::kAccPerSlab],
                                                   const ptx::TmaDescriptor* tma_d, unsigned epi_base, int wg, int tid,
                                                   unsigned& epi_count, int row0, int col0, bool valid,
                                                   const GemmArgs& args) {
    using T = GemmTraits<kCfg>;
    constexpr int kSubtiles = kGemmSlabRows / T::kEpiCols;
    constexpr int kChunks = (kCfg.tile_m + 63) / 64;
    if constexpr (kJ < kSubtiles && kR < kChunks) {
        constexpr int kRows = kCfg.tile_m - 64 * kR < 64 ? kCfg.tile_m - 64 * kR : 64;
        const unsigned buf = epi_base + (wg * 2 + (epi_count & 1u)) * T::kPlan.epi_buf_bytes;
        if (tid == 0) ptx::tma_wait_group_read<1>();  // the stores that last read this buffer are done reading
        ptx::named_barrier_sync(kBarConsumer0 + wg, 128);
        stage_subtile_swapped<kCfg, kJ, kR>(acc, buf, tid / 32, tid % 32);
        ptx::fence_proxy_async_shared_cta();  // st.shared/stmatrix -> TMA (async proxy)
        ptx::named_barrier_sync(kBarConsumer0 + wg, 128);
        if (tid == 0) {
            const int c0 = col0 + kJ * T::kEpiCols;
#pragma unroll
            for (int b = 0; b < kRows / kGemmSwapStoreRows; ++b) {
                const int r = row0 + 64 * kR + b * kGemmSwapStoreRows;
                if (valid && c0 < args.n_tma && r < args.m) {
                    ptx::tma_store_2d(tma_d, buf + b * kGemmSwapStoreRows * 128, c0, r);
                }
            }
            ptx::tma_commit_group();
        }
        ++epi_count;
        if constexpr (kR + 1 < kChunks) {
            store_slab_swapped<kCfg, kJ, kR + 1>(acc, tma_d, epi_base, wg, tid, epi_count, row0, col0, valid, args);
        } else {
            store_slab_swapped<kCfg, kJ + 1, 0>(acc, tma_d, epi_base, wg, tid, epi_count, row0, col0, valid, args);
        }
    }
}

/// Swapped configs, with plain stores: the slab's columns [n_tma, N) (less than 16 bytes per row, as store_slab_tail).
template <GemmConfig kCfg>
__device__ __forceinline__ void store_slab_tail_swapped(const float (&acc)[GemmTraits<kCfg>::kAccPerSlab], int row0,
                                                        int col0, int warp_in_wg, int lane, const GemmArgs& args) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int c = col0 + 16 * warp_in_wg + lane / 4 + 8 * h;
        if (c < args.n_tma || c >= args.n) continue;
#pragma unroll
        for (int j = 0; j < kCfg.tile_m / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int r = row0 + 8 * j + 2 * (lane % 4) + e;
                if (r < args.m) st_global_elem<kCfg.out_dtype>(args.d, r * args.ldd + c, acc[4 * j + 2 * h + e]);
            }
    }
}

/// Every store of `tile` issued so far has completed: raise the hook. Cooperative (deferred by one tile): both
/// warpgroups stored halves of it; ping-pong (right after the tile's epilogue): this warpgroup stored all of it.
/// False in the thread that raised it when the hook failed (its diagnostic recorded).
template <class Hook, bool kPingPong>
__device__ __forceinline__ bool notify_stored(const typename Hook::Params& hook_params, const GemmTile& tile,
                                              int wg, int tid) {
    if (tid == 0) ptx::tma_wait_group<0>();
    if constexpr (kPingPong) {
        ptx::named_barrier_sync(kBarConsumer0 + wg, 128);  // the warpgroup's plain (tail) stores come first too
    } else {
        ptx::named_barrier_sync(kBarBothConsumers, kGemmConsumerWarpgroups * 128);
    }
    if ((kPingPong || wg == 0) && tid == 0 && tile.valid) return Hook::after_tile_stored(hook_params, tile);
    return true;
}

/// Split-K, after a unit's mainloop (`num_splits`: the scheduler's, at most kCfg.splits): stores its fp32 partial tile
/// into the workspace (GemmArgs::partials, gemm_split_k_layout) and counts it in (GemmArgs::counters); true in the unit
/// that arrived last, which then holds in `acc` the sum of the tile's partials added in split order 0, 1, ... (its own
/// read back too): the same bits whichever unit arrives last. Called by every thread that holds the tile (both consumer
/// warpgroups, cooperative; one, ping-pong), each for its own slabs; no thread waits for another CTA (nothing to
/// bound).
template <GemmConfig kCfg>
__device__ __forceinline__ bool split_k_reduce(float (&acc)[GemmTraits<kCfg>::kSlabs][GemmTraits<kCfg>::kAccPerSlab],
                                               const GemmArgs& args, const GemmTile& tile, int32_t split,
                                               int32_t num_splits, int wg, int tid, int slab0) {
    using T = GemmTraits<kCfg>;
    constexpr int kQuads = T::kAccPerSlab / 4;
    constexpr int64_t kTileFloats = static_cast<int64_t>(kCfg.tile_m) * kCfg.tile_n;
    constexpr int kThreads = (kCfg.pingpong ? 1 : kGemmConsumerWarpgroups) * 128;
    const int bar = kCfg.pingpong ? kBarConsumer0 + wg : kBarBothConsumers;
    const int32_t num_n_tiles = (args.n + kCfg.tile_n - 1) / kCfg.tile_n;
    const int64_t tile_idx = static_cast<int64_t>(tile.m_idx) * num_n_tiles + tile.n_idx;
    // Inside a split's tile: [slab][quad of accumulators][128 threads] float4, so a warp's accesses are contiguous;
    // (s, q) is a constant offset from this thread's first float4 (immediate offsets, no address per element).
    float* const first = args.partials + tile_idx * kCfg.splits * kTileFloats +
                         (static_cast<int64_t>(slab0 * kQuads) * 128 + tid) * 4;
    constexpr int kQuadStride = 128 * 4;  // floats between a thread's consecutive float4s
    float4* const mine = reinterpret_cast<float4*>(first + split * kTileFloats);
#pragma unroll
    for (int s = 0; s < T::kSlabs; ++s) {
#pragma unroll
        for (int q = 0; q < kQuads; ++q) {
            __stcg(mine + (s * kQuads + q) * (kQuadStride / 4),
                   make_float4(acc[s][4 * q], acc[s][4 * q + 1], acc[s][4 * q + 2], acc[s][4 * q + 3]));
        }
    }
    __threadfence();  // release this thread's partials at GPU scope before the tile's count includes them
    ptx::named_barrier_sync(bar, kThreads);
    bool last = false;
    if (tid == 0 && (kCfg.pingpong || wg == 0)) {
        last = atomicAdd(args.counters + tile_idx, 1u) == static_cast<uint32_t>(num_splits - 1);
        if (last) args.counters[tile_idx] = 0;  // every split has arrived: zero again for the next launch
    }
    last = ptx::named_barrier_sync_or(bar, kThreads, last);
    if (!last) return false;
    __threadfence();  // acquire: every other split's partials are visible
    // Chunks of quads in flight per split (one round trip to L2 per split and chunk): 16 (64 floats) beside up to 64
    // accumulators, fewer beside more (at 8 quads beside 128 accumulators ptxas spilled, CUDA 13.0).
    constexpr int kAccFloats = T::kSlabs * T::kAccPerSlab;
    constexpr int kChunk = kAccFloats <= 64 ? 16 : kAccFloats <= 96 ? 8 : 4;
    constexpr int kAllQuads = T::kSlabs * kQuads;
    const float4* const first4 = reinterpret_cast<const float4*>(first);
    constexpr int64_t kSplitStride4 = kTileFloats / 4;
#pragma unroll
    for (int c0 = 0; c0 < kAllQuads; c0 += kChunk) {
#pragma unroll
        for (int c = c0; c < (c0 + kChunk < kAllQuads ? c0 + kChunk : kAllQuads); ++c) {
            const float4 v = __ldcg(first4 + c * (kQuadStride / 4));
            float* const a = &acc[c / kQuads][4 * (c % kQuads)];
            a[0] = v.x;
            a[1] = v.y;
            a[2] = v.z;
            a[3] = v.w;
        }
#pragma unroll 1
        for (int32_t t = 1; t < num_splits; ++t) {
            const float4* const split_first = first4 + t * kSplitStride4;
#pragma unroll
            for (int c = c0; c < (c0 + kChunk < kAllQuads ? c0 + kChunk : kAllQuads); ++c) {
                const float4 v = __ldcg(split_first + c * (kQuadStride / 4));
                float* const a = &acc[c / kQuads][4 * (c % kQuads)];
                a[0] += v.x;
                a[1] += v.y;
                a[2] += v.z;
                a[3] += v.w;
            }
        }
    }
    return true;
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
