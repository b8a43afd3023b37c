// SPDX-License-Identifier: MIT
// Small-M GEMM, GemvVariant::kTmaRing (decode, M <= 64, B [N,K] row-major): memory-bound, so B is streamed exactly
// once through a shared-memory ring filled by TMA, multiplied on the tensor cores with mma.sync m16n8k16 (the k
// permutation of gemv_common.cuh), split-K over gridDim.y, and the split-K partial sums reduced deterministically by
// the last CTA of each column block.
//
// B's and A's rows of each 256-wide k stage come into the ring by TMA (one 2D box per operand and stage,
// kGemvBulkBoxK wide; one thread issues them), completing on an mbarrier per stage: the bytes in flight do not
// depend on registers. Every warp covers all the CTA's columns for its eighth of each stage's k (so shared memory
// is read once per byte), and the warps' sums are added once at the end. (One 1D bulk copy per row and stage, and
// four 64-wide swizzled boxes per stage, ran slower: kernels/gemm/README.md, variant log.)
#pragma once

#include "gemm/gemv_common.cuh"
#include "weft/common/gemv_config.hpp"
#include "weft/ptx/griddep.cuh"
#include "weft/ptx/mbarrier.cuh"
#include "weft/ptx/tma.cuh"

namespace weft::kernels::gemm {
namespace detail {

/// The main loop (the file's header comment). Ring stage s (kStages of them, 1024-byte aligned,
/// after the barriers) holds k = k0 .. k0 + 255 as 256 / kGemvBulkBoxK TMA boxes of B (32 kNTiles rows: the
/// CTA's columns n_cta + r), then as many of A (16 kMTiles rows), each box rows x 2 kGemvBulkBoxK bytes (64-wide
/// boxes with the 128-byte swizzle: 16-byte piece c of row r at piece c ^ (r % 8)): rows past N or M and k past
/// K are zero-filled by TMA. Warp w of kWarps reads chunks w, w + kWarps, ... (32 k each) of every stage, lane (g, t)
/// the 16 bytes at k 32 chunk + 8t of rows g, g + 8, ..., with the k permutation of gemv_common.cuh (the
/// unswizzled 512-byte rows put a read's 8 rows in the same 16 banks: 2 wavefronts more per read, which the
/// longer TMA requests pay for); k past this split's end (the next split's data) is dropped.
/// On return acc of warps 0..3 holds the warp's kNTiles n8 tiles (columns n_cta + 8 (w kNTiles + j)) summed
/// over all warps: the layout the epilogue takes (warps 4..7, when there are 8, own no columns).
template <int kMTiles, int kNTiles, int kStages, int kWarps, bool kIsBF16>
__device__ __forceinline__ void gemv_tma_mainloop(float (&acc)[kMTiles][kNTiles][4], const GemvArgs& args,
                                                  const GemvMaps& maps, int n_cta, int k_begin, int k_end,
                                                  int warp, int lane) {
    constexpr int kBRows = 32 * kNTiles;
    constexpr int kARows = 16 * kMTiles;
    constexpr int kBoxes = kGemvBulkStageK / kGemvBulkBoxK;
    constexpr int kBoxRowBytes = 2 * kGemvBulkBoxK;
    constexpr bool kSwizzled = kGemvBulkBoxK == 64;
    constexpr int kStageBytes = kGemvBulkStageK * 2 * (kBRows + kARows);
    constexpr int kWarpTiles = 4 * kNTiles;  // every warp: all the CTA's n8 tiles
    constexpr int kChunksPerWarp = kGemvBulkStageK / 32 / kWarps;
    static_assert(kWarps == 4 || kWarps == 8, "gemv_tma_mainloop: 4 or 8 warps share each stage's k");
    extern __shared__ __align__(1024) unsigned char gemv_smem[];
    const unsigned bars = ptx::shared_address(gemv_smem);
    // The ring starts at the first 1024-byte boundary past the barriers (static shared memory comes first).
    const unsigned ring = (bars + 128 + 1023) & ~1023u;
    unsigned char* const ring_ptr = gemv_smem + (ring - bars);
    const int g = lane / 4, t = lane % 4;
    const int steps = k_end > k_begin ? (k_end - k_begin + kGemvBulkStageK - 1) / kGemvBulkStageK : 0;
    const auto* map_a = reinterpret_cast<const ptx::TmaDescriptor*>(&maps.a);
    const auto* map_b = reinterpret_cast<const ptx::TmaDescriptor*>(&maps.b);

    if (threadIdx.x == 0) {
        ptx::tma_prefetch_descriptor(map_a);
        ptx::tma_prefetch_descriptor(map_b);
#pragma unroll
        for (int s = 0; s < kStages; ++s) ptx::mbarrier_init(bars + 8 * s, 1);
        ptx::fence_mbarrier_init();
    }
    __syncthreads();

    // Thread 0 fills the stage of `step`: whole boxes, so the byte count never changes. B's boxes are read once
    // (evict-first in L2), A's by every CTA (evict-last), so the stream does not push A out of L2
    // (kernels/gemm/README.md).
    const unsigned long long stream_policy = ptx::l2_policy_evict_first();
    const unsigned long long shared_policy = ptx::l2_policy_evict_last();
    // A stage's B part arms its barrier for the whole stage; its A part may follow later (the prologue below).
    const auto fill = [&](int step, bool b_part, bool a_part) {
        const int s = step % kStages;
        const int k0 = k_begin + step * kGemvBulkStageK;
        const unsigned bar = bars + 8 * s;
        const unsigned stage = ring + static_cast<unsigned>(s * kStageBytes);
        if (b_part) ptx::mbarrier_arrive_expect_tx(bar, static_cast<unsigned>(kStageBytes));
#pragma unroll
        for (int q = 0; q < kBoxes; ++q) {
            if (b_part) {
                ptx::tma_load_2d_hint(stage + q * kBRows * kBoxRowBytes, map_b, bar, k0 + kGemvBulkBoxK * q, n_cta,
                                      stream_policy);
            }
            if (a_part) {
                ptx::tma_load_2d_hint(stage + (kBoxes * kBRows + q * kARows) * kBoxRowBytes, map_a, bar,
                                      k0 + kGemvBulkBoxK * q, 0, shared_policy);
            }
        }
    };

    float part[kMTiles][kWarpTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kWarpTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) part[mt][nt][i] = 0.f;

    // Launched programmatically (args.programmatic), the first stages' B boxes load while the kernel before this
    // one on the stream still runs; their A boxes, and everything after (partials, counters, D), wait for it to
    // complete. Launched plainly, the wait returns at once and each stage's A boxes follow its B boxes.
    const bool b_first = args.programmatic != 0;
    if (threadIdx.x == 0) {
        for (int i = 0; i < kStages && i < steps; ++i) fill(i, true, !b_first);
    }
    ptx::wait_for_prior_grids();
    if (threadIdx.x == 0) {
        ptx::launch_dependents();
        if (b_first) {
            for (int i = 0; i < kStages && i < steps; ++i) fill(i, false, true);
        }
    }
    for (int i = 0; i < steps; ++i) {
        const int s = i % kStages;
        if (!ptx::mbarrier_wait_parity_bounded(bars + 8 * s, static_cast<unsigned>(i / kStages) & 1u,
                                               kGemvStageWaitNs)) {
            __trap();
        }
        const int k0 = k_begin + i * kGemvBulkStageK;
        const unsigned char* stage = ring_ptr + s * kStageBytes;
        const unsigned char* a_boxes = stage + kBoxes * kBRows * kBoxRowBytes;
#pragma unroll
        for (int c = 0; c < kChunksPerWarp; ++c) {
            const int chunk = warp + kWarps * c;
            const int kl = 32 * chunk + 8 * t;  // the lane's 8 k of this chunk, stage-relative
            const bool k_ok = k0 + kl < k_end;
            const int q = kl / kGemvBulkBoxK;  // box
            // Byte offset in the box row; swizzled: 16-byte piece p of a 128-byte row r sits at p ^ (r % 8), and
            // every row read here has r % 8 = g.
            const int piece = kSwizzled ? ((((kl % 64) / 8) ^ g) * 16) : 2 * (kl % kGemvBulkBoxK);
            uint4 av[kMTiles][2];
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = mt * 16 + h * 8 + g;
                    av[mt][h] = lds_16_if(k_ok, a_boxes + (q * kARows + row) * kBoxRowBytes + piece);
                }
#pragma unroll
            for (int nt = 0; nt < kWarpTiles; ++nt) {
                const uint4 bb = lds_16_if(k_ok, stage + (q * kBRows + nt * 8 + g) * kBoxRowBytes + piece);
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) {
                    const uint4& lo = av[mt][0];
                    const uint4& hi = av[mt][1];
                    mma_m16n8k16<kIsBF16>(part[mt][nt], lo.x, hi.x, lo.y, hi.y, bb.x, bb.y);
                    mma_m16n8k16<kIsBF16>(part[mt][nt], lo.z, hi.z, lo.w, hi.w, bb.z, bb.w);
                }
            }
        }
        __syncthreads();  // every warp has read stage s
        if (threadIdx.x == 0 && i + kStages < steps) {
            ptx::fence_proxy_async_shared_cta();  // the generic reads above before TMA's writes
            fill(i + kStages, true, true);
        }
    }

    // The warps' sums: [warp][mt][nt][i][lane] in the (now idle) ring; every issued load was waited for. The
    // first four warps add them up (each its own kNTiles n8 tiles); the others' acc stays zero.
    __syncthreads();
    float* sums = reinterpret_cast<float*>(ring_ptr);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kWarpTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                sums[(((warp * kMTiles + mt) * kWarpTiles + nt) * 4 + i) * 32 + lane] = part[mt][nt][i];
            }
    __syncthreads();
    if (warp >= 4) return;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int j = 0; j < kNTiles; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int nt = warp * kNTiles + j;
                float v = 0.f;
#pragma unroll
                for (int w = 0; w < kWarps; ++w) {
                    v += sums[(((w * kMTiles + mt) * kWarpTiles + nt) * 4 + i) * 32 + lane];
                }
                acc[mt][j][i] = v;
            }
}

}  // namespace detail

/// The split-K small-M GEMM of GemvVariant::kTmaRing for kConfig (m_tiles = ceil(M / 16), 1..4). Grid
/// (ceil(N / gemv_cols_per_cta(n_tiles)), num_splits), kGemvBulkThreads threads, gemv_smem_bytes(kConfig) of dynamic
/// shared memory; gemv_shape(kConfig) gives n_tiles and the ring's stages (256 k each), filled by TMA through `maps`.
/// May be launched programmatically (GemmOptions::programmatic_launch, args.programmatic): the ring's first B boxes
/// are issued before griddepcontrol.wait, every read of A and write of D (and of the split-K partials and counters)
/// after it, and the next kernel is let go once the wait has returned.
template <GemvConfig kConfig>
__global__ void __launch_bounds__(kGemvBulkThreads, gemv_shape(kConfig).ctas_per_sm)
    gemv_tma_kernel(const GemvArgs args, const __grid_constant__ GemvMaps maps) {
    static_assert(is_valid(kConfig) && kConfig.variant == GemvVariant::kTmaRing,
                  "gemv_tma_kernel: a valid GemvConfig of GemvVariant::kTmaRing (M <= 64)");
    constexpr int kMTiles = kConfig.m_tiles;
    constexpr DType kOut = kConfig.out_dtype;
    constexpr int kNTiles = gemv_shape(kConfig).n_tiles;
    constexpr int kStages = gemv_shape(kConfig).stages;
    constexpr bool kIsBF16 = kConfig.in_dtype == DType::kBF16;
    constexpr int kColsPerCta = gemv_cols_per_cta(kNTiles);
    constexpr int kThreads = kGemvBulkThreads;

    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int g = lane / 4, t = lane % 4;
    const int n_warp = static_cast<int>(blockIdx.x) * kColsPerCta + warp * 8 * kNTiles;
    const int split = static_cast<int>(blockIdx.y);
    const int k_begin = split * args.k_per_split;
    const int k_end = min(args.k, k_begin + args.k_per_split);

    float acc[kMTiles][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

    detail::gemv_tma_mainloop<kMTiles, kNTiles, kStages, kThreads / 32, kIsBF16>(
        acc, args, maps, static_cast<int>(blockIdx.x) * kColsPerCta, k_begin, k_end, warp, lane);

    // Accumulator (mt, nt): c0,c1 at row mt*16 + g, columns n_warp + nt*8 + 2t, +1; c2,c3 at row + 8. Only
    // warps 0..3 own columns (the others stop here in a single split, or only join the count).
    const bool owns_columns = warp < 4;
    if (args.num_splits == 1) {
        if (!owns_columns) return;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int m = mt * 16 + g + (i >= 2 ? 8 : 0);
                    const int n = n_warp + nt * 8 + 2 * t + (i & 1);
                    if (m < args.m && n < args.n) detail::store_out<kOut>(args.d, m * args.ldd + n, acc[mt][nt][i]);
                }
        return;
    }

    // Split-K: write this split's partial sums, then the last CTA of the column block reduces them in split
    // order (deterministic) and writes D.
    float* part = args.partials + static_cast<int64_t>(split) * args.m * args.n;
#pragma unroll
    for (int mt = 0; mt < kMTiles && owns_columns; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = mt * 16 + g + (i >= 2 ? 8 : 0);
                const int n = n_warp + nt * 8 + 2 * t + (i & 1);
                if (m < args.m && n < args.n) part[static_cast<int64_t>(m) * args.n + n] = acc[mt][nt][i];
            }
    const int n_begin = static_cast<int>(blockIdx.x) * kColsPerCta;
    detail::gemv_split_k_reduce<kOut, kThreads>(args, n_begin, min(kColsPerCta, args.n - n_begin));
}

}  // namespace weft::kernels::gemm