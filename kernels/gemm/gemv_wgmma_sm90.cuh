// SPDX-License-Identifier: MIT
// Small-M GEMM, GemvVariant::kTmaWgmma (few rows, M <= 256, B [N,K] row-major): A and B swapped on wgmma. D = A B^T
// is computed as D^T = B A^T: 64 rows of B (the CTA's 64 columns of D) are the wgmma's M side and A's rows, padded
// only to 16, its N side (wgmma m64nNk16 with N = 16 m_tiles), so 77 rows cost 80 rows of MMA instead of 128, and
// N / 64 column blocks (x the K splits) spread over the SMs. The K splits of a column block form one cluster and add
// their fp32 tiles through distributed shared memory at the end (no global partials, no last-CTA pass).
//
// CTA: one consumer warpgroup (warps 0..3: the wgmma, then the epilogue) and one producer warp (warp 4; its lane 0
// issues the TMA boxes). Stage s of the ring (kStages of them, after the barriers, 1024-byte aligned) holds
// kGemvWgmmaStageK = 64 k of the CTA's 64 B rows ({64, 64} box, 8 KiB) then of A's 16 m_tiles rows ({64, 16 m_tiles}
// box), both with the 128-byte swizzle (one 128-byte row per matrix row: 16-byte piece p of row r at p ^ (r % 8)),
// rows past N or M and k past K zero-filled by TMA. A full barrier per stage completes on the boxes' bytes; an empty
// barrier per stage takes one arrival per consumer warp once the wgmma that read the stage have completed
// (wgmma_wait_group), and only then does the producer refill it.
#pragma once

#include "gemm/gemv_common.cuh"
#include "weft/common/gemv_config.hpp"
#include "weft/ptx/griddep.cuh"
#include "weft/ptx/mbarrier.cuh"
#include "weft/ptx/tma.cuh"
#include "weft/ptx/wgmma.cuh"

namespace weft::kernels::gemm {
namespace detail {

inline constexpr int kGemvWgmmaConsumerWarps = 4;
inline constexpr int kGemvWgmmaProducerWarp = 4;
static_assert(kGemvWgmmaThreads == 32 * (kGemvWgmmaConsumerWarps + 1),
              "kTmaWgmma: one consumer warpgroup and one producer warp");

/// Lane 0 of the producer warp: fills stage `step % kStages` of the ring for every step of this split's k range
/// (steps of kGemvWgmmaStageK from k_begin), whole boxes, so each stage's byte count never changes. B's boxes are read
/// once (evict-first in L2), A's by every CTA (evict-last), as kTmaRing's. Launched programmatically, the first stages'
/// B boxes are issued before griddepcontrol.wait and their A boxes after it; plainly, each stage's B then A box. A
/// stage is refilled only once its empty barrier says the consumers' wgmma have read it (bounded wait, trap on
/// timeout: a kernel bug).
template <int kMTiles, int kStages>
__device__ __forceinline__ void gemv_wgmma_produce(const GemvArgs& args, const GemvMaps& maps, unsigned full0,
                                                   unsigned empty0, unsigned ring, int n_cta, int k_begin, int steps) {
    constexpr int kStageBytes = gemv_wgmma_stage_bytes(kMTiles);
    constexpr int kBBoxBytes = kGemvWgmmaCols * kGemvWgmmaStageK * 2;
    const auto* map_a = reinterpret_cast<const ptx::TmaDescriptor*>(&maps.a);
    const auto* map_b = reinterpret_cast<const ptx::TmaDescriptor*>(&maps.b);
    const unsigned long long stream_policy = ptx::l2_policy_evict_first();
    const unsigned long long shared_policy = ptx::l2_policy_evict_last();
    // A stage's B part arms its full barrier for the whole stage; its A part may follow later (the prologue below).
    const auto fill = [&](int step, bool b_part, bool a_part) {
        const int s = step % kStages;
        const int k0 = k_begin + step * kGemvWgmmaStageK;
        const unsigned bar = full0 + 8 * s;
        const unsigned stage = ring + static_cast<unsigned>(s * kStageBytes);
        if (b_part) {
            ptx::mbarrier_arrive_expect_tx(bar, static_cast<unsigned>(kStageBytes));
            ptx::tma_load_2d_hint(stage, map_b, bar, k0, n_cta, stream_policy);
        }
        if (a_part) ptx::tma_load_2d_hint(stage + kBBoxBytes, map_a, bar, k0, 0, shared_policy);
    };
    const bool b_first = args.programmatic != 0;
    const int prologue = steps < kStages ? steps : kStages;
    for (int i = 0; i < prologue; ++i) fill(i, true, !b_first);
    ptx::wait_for_prior_grids();
    ptx::launch_dependents();
    if (b_first) {
        for (int i = 0; i < prologue; ++i) fill(i, false, true);
    }
    for (int i = kStages; i < steps; ++i) {
        const int s = i % kStages;
        // Phase i / kStages - 1 of the empty barrier: the consumers have released step i - kStages.
        if (!ptx::mbarrier_wait_parity_bounded(empty0 + 8 * s, static_cast<unsigned>(i / kStages - 1) & 1u,
                                               kGemvStageWaitNs)) {
            __trap();
        }
        fill(i, true, true);
    }
}

/// The consumer warpgroup's main loop: for each step, wait for its stage, then 4 wgmma m64nNk16 (kN = 16 kMTiles)
/// over the stage's 64 k (the descriptors advance 32 bytes per k16 inside the 128-byte swizzled rows, as the tiled
/// kernel's), one wgmma-group per stage; once the next stage's group is issued, wait for the previous one and free
/// its stage (one arrival per warp). On return every wgmma has completed. acc (the wgmma accumulator of D^T, thread
/// t = 32 w + l): acc[4j + e] = D[8j + 2 (l % 4) + e][n_cta + 16 w + l / 4], acc[4j + 2 + e] the same row of D at
/// column + 8 (e = 0, 1). A full-barrier wait that times out marks the pipeline stuck: the warpgroup stops waiting and
/// traps once no wgmma is in flight (NOTE: no trap inside the loop, as the tiled kernel: a reachable trap beside
/// live accumulators can make ptxas spill them and serialise the wgmma).
template <int kMTiles, int kStages, bool kIsBF16>
__device__ __forceinline__ void gemv_wgmma_consume(float (&acc)[8 * kMTiles], unsigned full0, unsigned empty0,
                                                   unsigned ring, int steps, int lane) {
    constexpr int kN = 16 * kMTiles;
    constexpr int kStageBytes = gemv_wgmma_stage_bytes(kMTiles);
    constexpr int kBBoxBytes = kGemvWgmmaCols * kGemvWgmmaStageK * 2;
    constexpr int kKSteps = kGemvWgmmaStageK / 16;
    static_assert(kStageBytes % 1024 == 0 && kBBoxBytes % 1024 == 0,
                  "kTmaWgmma: every box starts on a 1024-byte swizzle atom (the descriptors' base offset is 0)");
    bool stuck = false;
    int prev = 0;
    for (int i = 0; i < steps; ++i) {
        const int s = i % kStages;
        if (!stuck) {
            stuck = !ptx::mbarrier_wait_parity_bounded(full0 + 8 * s, static_cast<unsigned>(i / kStages) & 1u,
                                                       kGemvStageWaitNs);
        }
        const unsigned b_box = ring + static_cast<unsigned>(s * kStageBytes);
        const unsigned a_box = b_box + kBBoxBytes;
        ptx::wgmma_fence_operands(acc);
        ptx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) {
            // Both K-major with the 128-byte swizzle: 8-row groups 1024 bytes apart; k16 step kk at byte 32 kk of each
            // row. The wgmma's A operand (its 64-row M side) is B's box, its B operand (the N side) A's box.
            const unsigned long long desc_m_side =
                ptx::make_smem_desc(b_box + kk * 32, 16, 1024, ptx::SmemSwizzle::k128B);
            const unsigned long long desc_n_side =
                ptx::make_smem_desc(a_box + kk * 32, 16, 1024, ptx::SmemSwizzle::k128B);
            ptx::wgmma<kN, kIsBF16, 0>(acc, desc_m_side, desc_n_side, 1);
        }
        ptx::wgmma_commit_group();
        ptx::wgmma_fence_operands(acc);
        if (i > 0) {
            ptx::wgmma_wait_group<1>();  // the previous step's wgmma have read their stage
            if (lane == 0) ptx::mbarrier_arrive(empty0 + 8 * prev);
        }
        prev = s;
    }
    // NOTE: the last step's stage is never refilled, so it is not released.
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_operands(acc);
    if (stuck) __trap();
}

}  // namespace detail

/// The small-M GEMM of GemvVariant::kTmaWgmma for kConfig (m_tiles = ceil(M / 16), 1..16). Grid
/// (ceil(N / kGemvWgmmaCols), num_splits), kGemvWgmmaThreads threads, gemv_smem_bytes(kConfig) of dynamic shared
/// memory; gemv_shape(kConfig).stages stages of kGemvWgmmaStageK k, filled by TMA through `maps` (A: box {64, 16
/// m_tiles}, B: box {64, 64}, both 128-byte swizzled); args.k_per_split a multiple of kGemvWgmmaStageK, every split
/// non-empty. Split-K (num_splits 2..kGemvWgmmaMaxSplits): launched with clusters of 1 x num_splits CTAs, the splits
/// of one column block, which add their fp32 tiles through distributed shared memory (no workspace: args.partials
/// and args.counters are not read). May be launched programmatically (GemmOptions::programmatic_launch,
/// args.programmatic): the ring's first B boxes are issued before griddepcontrol.wait, every read of A and write of D
/// after it, and the next kernel is let go once the wait has returned.
template <GemvConfig kConfig>
__global__ void __launch_bounds__(kGemvWgmmaThreads, 1)
    gemv_wgmma_kernel(const GemvArgs args, const __grid_constant__ GemvMaps maps) {
    static_assert(is_valid(kConfig) && kConfig.variant == GemvVariant::kTmaWgmma,
                  "gemv_wgmma_kernel: a valid GemvConfig of GemvVariant::kTmaWgmma (M <= 256)");
    constexpr int kMTiles = kConfig.m_tiles;
    constexpr int kRows = 16 * kMTiles;  // A's rows in the wgmma's N, padded to 16
    constexpr DType kOut = kConfig.out_dtype;
    constexpr int kStages = gemv_shape(kConfig).stages;
    constexpr bool kIsBF16 = kConfig.in_dtype == DType::kBF16;
    constexpr int kThreads = kGemvWgmmaThreads;
    constexpr int kPitch = kGemvWgmmaStagePitch;
    static_assert(ptx::wgmma_supports_n(kRows), "kTmaWgmma: wgmma N = 16 m_tiles");
    static_assert(kStages >= 2 && kStages <= kGemvWgmmaMaxStages, "kTmaWgmma: 2..16 stages");
    static_assert(2 * 8 * kStages <= kGemvWgmmaBarrierBytes, "kTmaWgmma: the barriers fit before the ring");
    static_assert(kGemvWgmmaStageK * 2 == 128, "kTmaWgmma: a box row is one 128-byte swizzle row");

    extern __shared__ __align__(1024) unsigned char gemv_smem[];
    const unsigned full0 = ptx::shared_address(gemv_smem);
    const unsigned empty0 = full0 + 8 * kStages;
    // The ring starts at the first 1024-byte boundary past the barriers (static shared memory comes first).
    const unsigned ring = (full0 + kGemvWgmmaBarrierBytes + 1023) & ~1023u;
    unsigned char* const ring_ptr = gemv_smem + (ring - full0);

    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int n_cta = static_cast<int>(blockIdx.x) * kGemvWgmmaCols;
    const int split = static_cast<int>(blockIdx.y);
    const int k_begin = split * args.k_per_split;
    const int k_end = min(args.k, k_begin + args.k_per_split);
    const int steps = k_end > k_begin ? (k_end - k_begin + kGemvWgmmaStageK - 1) / kGemvWgmmaStageK : 0;

    if (threadIdx.x == 32 * detail::kGemvWgmmaProducerWarp) {
        ptx::tma_prefetch_descriptor(reinterpret_cast<const ptx::TmaDescriptor*>(&maps.a));
        ptx::tma_prefetch_descriptor(reinterpret_cast<const ptx::TmaDescriptor*>(&maps.b));
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            ptx::mbarrier_init(full0 + 8 * s, 1);
            ptx::mbarrier_init(empty0 + 8 * s, detail::kGemvWgmmaConsumerWarps);
        }
        ptx::fence_mbarrier_init();
    }
    __syncthreads();

    float acc[8 * kMTiles];
#pragma unroll
    for (int i = 0; i < 8 * kMTiles; ++i) acc[i] = 0.f;
    if (warp == detail::kGemvWgmmaProducerWarp) {
        if (lane == 0) {
            detail::gemv_wgmma_produce<kMTiles, kStages>(args, maps, full0, empty0, ring, n_cta, k_begin, steps);
        } else {
            ptx::wait_for_prior_grids();  // the warp's other lanes write D or partials below
        }
        __syncwarp();
    } else {
        ptx::wait_for_prior_grids();  // before any read of A (through the ring) or write of D
        detail::gemv_wgmma_consume<kMTiles, kStages, kIsBF16>(acc, full0, empty0, ring, steps, lane);
    }

    // Epilogue: the fp32 tile through the idle ring ([kRows][kPitch], row m = a row of D, column c = n - n_cta), then
    // out by rows (each row's 64 columns contiguous in D). Every issued box has landed (the consumers waited for each)
    // and every wgmma has completed (each consumer warp waited): after this barrier the ring is free.
    __syncthreads();
    float* const tile = reinterpret_cast<float*>(ring_ptr);
    if (warp < detail::kGemvWgmmaConsumerWarps) {
        const int c = 16 * warp + lane / 4;
#pragma unroll
        for (int j = 0; j < kRows / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int m = 8 * j + 2 * (lane % 4) + e;
                tile[m * kPitch + c] = acc[4 * j + e];
                tile[m * kPitch + c + 8] = acc[4 * j + 2 + e];
            }
    }
    // One split: this CTA writes every row of its column block. Split-K: the splits of a column block are one cluster
    // (dims 1 x num_splits, cluster rank = split); each CTA writes its share of the rows, summing every split's tile
    // through distributed shared memory in split order (the same bits whichever CTA sums), and leaves only once every
    // CTA of the cluster has read its tile (the second cluster barrier).
    const int rows = min(args.m, kRows);
    const int cols = min(kGemvWgmmaCols, args.n - n_cta);
    const int splits = args.num_splits;
    int row_begin = 0, row_end = rows;
    if (splits > 1) {
        if (ptx::cluster_num_ctas() != static_cast<unsigned>(splits)) __trap();  // a launch bug: the cluster is K
        const int share = (rows + splits - 1) / splits;
        row_begin = min(rows, split * share);
        row_end = min(rows, row_begin + share);
        ptx::cluster_sync();  // every split's tile is in its CTA's shared memory
    } else {
        __syncthreads();
    }
    constexpr int kQuads = kGemvWgmmaCols / 4;  // four columns (16 bytes of the tile) per thread and step
    const unsigned tile_addr = ring;
    const int tid = static_cast<int>(threadIdx.x);
    for (int idx = tid; idx < (row_end - row_begin) * kQuads; idx += kThreads) {
        const int m = row_begin + idx / kQuads;
        const int c = 4 * (idx % kQuads);
        if (c >= cols) continue;
        float4 v;
        if (splits == 1) {
            v = *reinterpret_cast<const float4*>(tile + m * kPitch + c);
        } else {
            const unsigned at = tile_addr + static_cast<unsigned>((m * kPitch + c) * 4);
            float4 part[kGemvWgmmaMaxSplits];
#pragma unroll
            for (int s = 0; s < kGemvWgmmaMaxSplits; ++s) {
                if (s < splits) part[s] = ptx::ld_shared_cluster_v4f32(ptx::cluster_map_shared(at, s));
            }
            v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int s = 0; s < kGemvWgmmaMaxSplits; ++s) {
                if (s < splits) {
                    v.x += part[s].x;
                    v.y += part[s].y;
                    v.z += part[s].z;
                    v.w += part[s].w;
                }
            }
        }
        detail::store_out_run<kOut>(args.d, m * args.ldd + n_cta + c, v, min(4, cols - c));
    }
    if (splits > 1) ptx::cluster_sync();  // no CTA's shared memory goes while a peer may still read it
}

}  // namespace weft::kernels::gemm
