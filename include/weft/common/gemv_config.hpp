// SPDX-License-Identifier: MIT
// GemvConfig: the compile-time configuration of weft's small-M GEMM kernels (decode and few rows, M <= 256, B [N,K]),
// their validity rule, shapes and shared memory, shared by host heuristics, the JIT code generator and the kernels
// (g++, nvcc, NVRTC). The kernels: kernels/gemm/gemv_tma_sm90.cuh, gemv_rows_sm90.cuh and gemv_wgmma_sm90.cuh.
#pragma once

#include "weft/common/dtype.hpp"
#include "weft/common/macros.hpp"

namespace weft {

/// The small-M kernel families (GemmOptions::small_m_variant). The values are the variant numbers of the
/// autotuner's candidate names ("small_m_v3", "small_m_v4", "small_m_v5") and of kernels/gemm/README.md's variant log.
enum class GemvVariant : int32_t {
    /// Split-K; B's and A's rows of each 256-wide k stage come into a shared-memory ring as TMA boxes
    /// (kernels/gemm/gemv_tma_sm90.cuh, weft::kernels::gemm::gemv_tma_kernel): any M <= 64, any B [N,K].
    kTmaRing = 3,
    /// B's rows by 1D bulk copies into a shared-memory ring, one CTA per SM with a contiguous range of rows, no
    /// split-K (kernels/gemm/gemv_rows_sm90.cuh, weft::kernels::gemm::gemv_rows_kernel): M <= 16, B's rows back to back
    /// (ldb = K), K a multiple of 2048. Whole rows and CUDA-core FMAs where gemv_rows_uses_ffma, else groups of 8
    /// rows on the tensor cores.
    kBulkRows = 4,
    /// Split-K; A and B swapped on wgmma: 64 rows of B (64 columns of D) are the wgmma's M side, A's rows (padded to
    /// 16) its N side, both streamed by TMA into a shared-memory ring (kernels/gemm/gemv_wgmma_sm90.cuh,
    /// weft::kernels::gemm::gemv_wgmma_kernel): any M <= kGemvWgmmaMaxM = 256, any B [N,K].
    kTmaWgmma = 5,
};

/// One small-M kernel specialisation. A C++20 structural type: it is the kernel's template argument, and the
/// JIT prints it with designated initialisers (see weft::ops::format_gemv_config).
struct GemvConfig {
    GemvVariant variant = GemvVariant::kTmaRing;
    int32_t m_tiles = 1;             ///< ceil(M / 16): 1..4 (kBulkRows: 1, M <= 16; kTmaWgmma: 1..16)
    DType in_dtype = DType::kBF16;   ///< A and B: kBF16 or kF16
    DType out_dtype = DType::kBF16;  ///< D: kBF16, kF16 or kF32

    constexpr bool operator==(const GemvConfig&) const = default;
};

/// Arguments of the small-M kernels (gemv_tma_kernel, gemv_rows_kernel, gemv_wgmma_kernel).
struct GemvArgs {
    const void* a;  ///< [M,K], row stride lda (elements)
    const void* b;  ///< [N,K], row stride ldb
    void* d;        ///< [M,N], row stride ldd
    int64_t lda, ldb, ldd;
    int32_t m, n, k;
    int32_t k_per_split;  ///< multiple of 32 (kTmaWgmma: of kGemvWgmmaStageK = 64)
    int32_t num_splits;   ///< gridDim.y
    int32_t rows_per_cta; ///< kBulkRows: rows of B per CTA (the last CTA may have fewer); else unused
    /// kTmaRing, kTmaWgmma: launched programmatically (ops::gemm_launches_programmatically), so the ring's first stages
    /// load their B boxes before griddepcontrol.wait and their A boxes after it; 0: each stage's B and A boxes in turn
    /// (in a plain launch, A's first boxes queued behind every prologue B box delay the first MMAs).
    int32_t programmatic;
    float* partials;      ///< [num_splits][M][N] fp32 (when num_splits > 1)
    uint32_t* counters;   ///< [gridDim.x], zero between launches (the last CTA of a column block resets it)
};

/// The largest M of kTmaRing and kBulkRows (and of GemmOptions::small_m_max_m); kTmaWgmma: kGemvWgmmaMaxM.
inline constexpr int kGemvMaxM = 64;
/// kTmaRing's CTA (and kBulkRows' whole-row body): 8 warps share each stage's k; the first 4 own the CTA's columns
/// in kTmaRing's epilogue.
inline constexpr int kGemvBulkThreads = 256;

/// kTmaWgmma (A and B swapped on wgmma; kernels/gemm/gemv_wgmma_sm90.cuh): D[M,N] = A[M,K] B[N,K]^T computed as
/// D^T = B A^T, so B's rows are the wgmma's M side (64 per CTA: kGemvWgmmaCols columns of D) and A's rows its N side
/// (wgmma N = 16 m_tiles, M padded to 16 instead of 64). A CTA is one consumer warpgroup (the wgmma) and one producer
/// warp (one lane issues the TMA boxes): kGemvWgmmaThreads threads, one CTA per SM. A stage is kGemvWgmmaStageK k of
/// the CTA's 64 B rows (a {64, 64} TMA box, 8 KiB) and of A's 16 m_tiles rows (a {64, 16 m_tiles} box), both
/// 128-byte swizzled (each row is one 128-byte swizzle row); as many stages as fit kGemvWgmmaRingBytes, at most
/// kGemvWgmmaMaxStages. Split-K over gridDim.y (k_per_split a multiple of kGemvWgmmaStageK): the splits of a column
/// block are one cluster (at most kGemvWgmmaMaxSplits CTAs, the portable cluster size) and add their fp32 tiles
/// through distributed shared memory; the epilogue stages the tile through the idle ring as fp32
/// [16 m_tiles][kGemvWgmmaStagePitch].
inline constexpr int kGemvWgmmaMaxM = 256;
inline constexpr int kGemvWgmmaCols = 64;      ///< columns of D (rows of B) per CTA: the wgmma's M
inline constexpr int kGemvWgmmaStageK = 64;    ///< k per stage: one 128-byte swizzle row of 16-bit elements
inline constexpr int kGemvWgmmaThreads = 160;  ///< one consumer warpgroup + one producer warp
inline constexpr int kGemvWgmmaRingBytes = 200 * 1024;
inline constexpr int kGemvWgmmaMaxStages = 16;
/// The most K splits of kTmaWgmma: one cluster of CTAs per column block (the portable cluster size).
inline constexpr int kGemvWgmmaMaxSplits = 8;
/// Shared memory before the ring: a full and an empty mbarrier per stage.
inline constexpr int kGemvWgmmaBarrierBytes = 2 * 8 * kGemvWgmmaMaxStages;
/// Floats per row of the epilogue's staging tile: 64 columns + 4, so the accumulator fragments' writes (4 rows 2
/// apart x 8 columns per warp and register) meet 32 distinct banks.
inline constexpr int kGemvWgmmaStagePitch = kGemvWgmmaCols + 4;
/// Bytes of one kTmaWgmma stage: 64 B rows and 16 m_tiles A rows of kGemvWgmmaStageK 16-bit elements.
WEFT_HOST_DEVICE constexpr int gemv_wgmma_stage_bytes(int m_tiles) {
    return (kGemvWgmmaCols + 16 * m_tiles) * kGemvWgmmaStageK * 2;
}
/// Bytes of kTmaWgmma's epilogue staging tile (fp32 [16 m_tiles][kGemvWgmmaStagePitch]).
WEFT_HOST_DEVICE constexpr int gemv_wgmma_staging_bytes(int m_tiles) { return 16 * m_tiles * kGemvWgmmaStagePitch * 4; }

/// The one rule for which small-M configs exist: host code checks it, the kernels static_assert it.
WEFT_HOST_DEVICE constexpr bool is_valid(const GemvConfig& c) {
    const bool in_ok = c.in_dtype == DType::kBF16 || c.in_dtype == DType::kF16;
    const bool out_ok = c.out_dtype == DType::kBF16 || c.out_dtype == DType::kF16 || c.out_dtype == DType::kF32;
    if (!in_ok || !out_ok) return false;
    if (c.variant == GemvVariant::kTmaRing) return c.m_tiles >= 1 && c.m_tiles <= kGemvMaxM / 16;
    if (c.variant == GemvVariant::kBulkRows) return c.m_tiles == 1;
    // Every wgmma N = 16 m_tiles (16..256) exists (weft::ptx::wgmma_supports_n).
    if (c.variant == GemvVariant::kTmaWgmma) return c.m_tiles >= 1 && c.m_tiles <= kGemvWgmmaMaxM / 16;
    return false;
}

/// Columns of D per CTA of kTmaRing: 4 warps x n_tiles_per_warp n8 tiles.
WEFT_HOST_DEVICE constexpr int gemv_cols_per_cta(int n_tiles_per_warp) { return 4 * 8 * n_tiles_per_warp; }

/// The shape of a small-M kernel: the single source of the kernels' ring depth and launch bounds and of the
/// split-count heuristic.
struct GemvShape {
    int n_tiles;      ///< n8 tiles (8 columns) per warp in kTmaRing's epilogue: gemv_cols_per_cta(n_tiles) per CTA
    int stages;       ///< stages of the shared-memory ring
    int ctas_per_sm;  ///< CTAs per SM the split count aims at; the kernels' __launch_bounds__ minimum
};

/// kTmaRing's stage: 256 k of every B and A row of the CTA (512 bytes per row), loaded as TMA boxes
/// kGemvBulkBoxK wide: 64 (128-byte rows, 128-byte swizzle: conflict-free fragment reads) or 256 (one box
/// per operand and stage, 512 contiguous bytes per row and request, no swizzle).
inline constexpr int kGemvBulkStageK = 256;
inline constexpr int kGemvBulkBoxK = 256;

/// kBulkRows (whole rows; M <= kGemvRowsMaxM, K = kGemvRowsSpanElems x 1, 2, 4 or 8, B's rows back to back: ldb
/// = K): one CTA per SM, CTA c owns rows_per_cta consecutive rows of B (GemvArgs::rows_per_cta; N spread evenly over
/// the SMs), one contiguous range, streamed in kGemvRowsStageBytes stages of one 1D bulk copy each (thread 0, one
/// proxy fence per stage as kTmaRing): such copies stream faster than kTmaRing's TMA row boxes (`weft_bench_stream`;
/// the figures are in kernels/gemm/README.md). A stage is 8 spans of 4 KiB
/// (kGemvBulkThreads x 16 bytes, one 16-byte piece per thread) and holds whole rows, so each thread meets the same
/// k in every row and keeps its A values in registers (fp32). CUDA-core FMAs; no split-K. Shared memory: barriers,
/// the ring, then the per-warp row sums of two stages' rows [2 x 8][8][kGemvRowsMaxM] (fp32). A in registers bounds
/// M x K (kGemvRowsMaxMK: 128 floats per thread), which every (M, K) the body takes keeps.
inline constexpr int kGemvRowsMaxM = 2;  // from M = 3 the row groups run faster (kernels/gemm/README.md)
inline constexpr int kGemvRowsMaxMK = 32768;
inline constexpr int kGemvRowsStages = 4;  // a deeper ring ran slower (kernels/gemm/README.md)
inline constexpr int kGemvRowsStageBytes = 32 * 1024;
inline constexpr int kGemvRowsSpanElems = 2048;  ///< 4 KiB of 16-bit elements: 256 threads x 16 bytes
/// Offset of the sums from the ring's start (the first 1024-byte boundary past 128 bytes of barriers).
WEFT_HOST_DEVICE constexpr int gemv_rows_sums_offset(int stages) { return stages * kGemvRowsStageBytes; }
/// kBulkRows' row-group body, for the M and K the whole-row FMA body cannot hold (gemv_rows_uses_ffma false): M <=
/// kGemvGroupsMaxM, K any multiple of kGemvRowsSpanElems. The CTA's rows go in blocks of kGemvGroupsBlockRows; a
/// stage is one k chunk (kGemvRowsSpanElems) of 8 rows, 8 1D bulk copies of 4 KiB; tensor cores (mma.sync
/// m16n8k16: the 8 rows are the n8, A's 16 rows the m16); the warps' sums of a block meet in shared memory after
/// the ring ([8 warps][8 groups][32 lanes][4] fp32, 32 KiB), then A's slot (the next k chunk of A's rows, 64 KiB).
inline constexpr int kGemvGroupsMaxM = 16;
inline constexpr int kGemvGroupsBlockRows = 64;
inline constexpr int kGemvGroupsThreads = 320;  ///< 8 consumer warps, a producer warp for B and one for A
/// The row-group body's block sums, [8 consumer warps][kGemvGroupsBlockRows / 8 groups][32 lanes][4] fp32; the
/// whole-row body's row sums [2 x 8][8 warps][kGemvRowsMaxM] use the same place.
inline constexpr int kGemvGroupsSumsBytes = 8 * (kGemvGroupsBlockRows / 8) * 32 * 4 * 4;
static_assert(2 * 8 * 8 * kGemvRowsMaxM * 4 <= kGemvGroupsSumsBytes,
              "kBulkRows: the whole-row sums fit the block sums' place");
/// Offset of the row-group body's A slot (A's kGemvGroupsMaxM rows of one k chunk, 4 KiB each) from the ring's start.
WEFT_HOST_DEVICE constexpr int gemv_groups_a_offset(int stages) {
    return gemv_rows_sums_offset(stages) + kGemvGroupsSumsBytes;
}
WEFT_HOST_DEVICE constexpr int gemv_rows_smem_bytes(int stages) {
    return 128 + 1024 + gemv_groups_a_offset(stages) + kGemvGroupsMaxM * 2 * kGemvRowsSpanElems;
}
/// K that kBulkRows' whole-row FMA body serves: kGemvRowsSpanElems times 1, 2, 4 or 8 (a stage of 8 spans holds
/// whole rows).
WEFT_HOST_DEVICE constexpr bool gemv_rows_k_ok(int64_t k) {
    return k == kGemvRowsSpanElems || k == 2 * kGemvRowsSpanElems || k == 4 * kGemvRowsSpanElems ||
           k == 8 * kGemvRowsSpanElems;
}
/// Which of kBulkRows' bodies serves (M, K): the whole-row FMA body (A in registers) where it can, else the
/// row-group body (tensor cores). The kernel and the op both decide by this. (M x K <= kGemvRowsMaxMK holds for
/// every M and K the first two terms admit: asserted below.)
WEFT_HOST_DEVICE constexpr bool gemv_rows_uses_ffma(int64_t m, int64_t k) {
    return m <= kGemvRowsMaxM && gemv_rows_k_ok(k) && m * k <= kGemvRowsMaxMK;
}
static_assert(kGemvRowsMaxM * 8 * kGemvRowsSpanElems <= kGemvRowsMaxMK,
              "kBulkRows: the whole-row body's A (M x K, the longest rows) fits in registers");
/// kBulkRows' block for (M, K): kGemvBulkThreads for the whole-row body, kGemvGroupsThreads for the row groups.
WEFT_HOST_DEVICE constexpr int gemv_rows_threads(int64_t m, int64_t k) {
    return gemv_rows_uses_ffma(m, k) ? kGemvBulkThreads : kGemvGroupsThreads;
}

/// kTmaRing: a CTA covers gemv_cols_per_cta(n_tiles) = 64 columns; every warp covers all of them for an eighth of
/// each 256-wide k stage (the warps' sums are added once, at the end), so each byte of A and B is read from shared
/// memory once. One CTA of 8 warps per SM, for every M (two warps per scheduler: one warp alone does not issue fast
/// enough to keep DRAM busy, ncu; two CTAs of 4 warps ran slower at M = 1, kernels/gemm/README.md). Stages: m_tiles
/// 1: 4 x (64 B rows + 16 A rows) x 512 bytes = 160 KiB; m_tiles 2: 4 x (64 + 32) rows = 192 KiB; m_tiles 3, 4:
/// 3 x (64 + 64) rows.
/// kBulkRows: kGemvRowsStages stages, one CTA per SM (its grid is one CTA per SM of the budget; n_tiles only sizes a
/// split-K workspace it never takes).
/// kTmaWgmma: kGemvWgmmaCols = 64 columns per CTA (n_tiles 2), as many stages of gemv_wgmma_stage_bytes as fit
/// kGemvWgmmaRingBytes (m_tiles 1: 16 x 10 KiB; 4: 12 x 16 KiB; 8: 8 x 24 KiB; 16: 5 x 40 KiB), one CTA per SM.
WEFT_HOST_DEVICE constexpr GemvShape gemv_shape(const GemvConfig& c) {
    if (c.variant == GemvVariant::kBulkRows) return GemvShape{2, kGemvRowsStages, 1};
    if (c.variant == GemvVariant::kTmaWgmma) {
        const int fit = kGemvWgmmaRingBytes / gemv_wgmma_stage_bytes(c.m_tiles < 1 ? 1 : c.m_tiles);
        return GemvShape{2, fit < kGemvWgmmaMaxStages ? fit : kGemvWgmmaMaxStages, 1};
    }
    return c.m_tiles <= 2 ? GemvShape{2, 4, 1} : GemvShape{2, 3, 1};
}

/// Dynamic shared memory of a small-M kernel: 128 bytes of barriers and up to 1024 of alignment, then kTmaRing's
/// ring (at least the end's cross-warp sum buffer: warps x m_tiles x 4 n_tiles n8 tiles x 4 floats x 32 lanes), or
/// kBulkRows' ring, sums and A slot (gemv_rows_smem_bytes), or kTmaWgmma's kGemvWgmmaBarrierBytes of barriers, up to
/// 1024 of alignment and its ring (at least the epilogue's staging tile).
WEFT_HOST_DEVICE constexpr int gemv_smem_bytes(const GemvConfig& c) {
    const GemvShape s = gemv_shape(c);
    if (c.variant == GemvVariant::kBulkRows) return gemv_rows_smem_bytes(s.stages);
    if (c.variant == GemvVariant::kTmaWgmma) {
        const int ring = s.stages * gemv_wgmma_stage_bytes(c.m_tiles);
        const int staging = gemv_wgmma_staging_bytes(c.m_tiles);
        return kGemvWgmmaBarrierBytes + 1024 + (ring > staging ? ring : staging);
    }
    const int ring = s.stages * (32 * s.n_tiles + 16 * c.m_tiles) * 2 * kGemvBulkStageK;
    const int sums = kGemvBulkThreads / 32 * c.m_tiles * 4 * s.n_tiles * 4 * 32 * 4;
    return 128 + 1024 + (ring > sums ? ring : sums);
}

}  // namespace weft
