// SPDX-License-Identifier: MIT
// GemmConfig: the compile-time configuration of weft's sm_90a GEMM, its validity rule, shared-memory plan
// and tile grid, shared by host heuristics, the JIT code generator and the kernel (g++, nvcc, NVRTC).
#pragma once

#include "weft/common/dtype.hpp"
#include "weft/common/macros.hpp"

namespace weft {

/// How B is stored. D[M,N] = A[M,K] * B with A row-major [M,K] in both cases.
enum class BLayout : int32_t {
    kNK = 0,  ///< B is [N,K] row-major (a linear layer's weight; "TN"): K-major, the natural wgmma layout
    kKN = 1,  ///< B is [K,N] row-major: N-major, read through wgmma's transpose bit
};

/// Order in which a persistent CTA walks the output tiles (always swizzled in groups for L2 reuse).
enum class Raster : int32_t {
    kAlongN = 0,  ///< groups of `raster_group` tile rows; inside a group, down the rows then across N
    kAlongM = 1,  ///< groups of `raster_group` tile columns; inside a group, across the columns then down M
};

/// One GEMM kernel specialisation. A C++20 structural type: it is the kernel's template argument, and the
/// JIT prints it with designated initialisers (see weft::ops::format_gemm_config).
struct GemmConfig {
    int32_t tile_m = 128;  ///< rows of D per tile: 128 or 256 (cooperative: the two consumer warpgroups split it
                           ///< into 64-row slabs), 64 or 128 (ping-pong: one warpgroup computes the whole tile)
    int32_t tile_n = 256;  ///< columns of D per tile: a multiple of 64 up to 256, or of 16 from 80 (is_valid)
    int32_t tile_k = 64;   ///< K per pipeline stage: 64 (one 128-byte swizzle row of 16-bit elements)
    int32_t stages = 4;    ///< depth of the shared-memory ring
    int32_t cluster_m = 1;  ///< CTAs per cluster along M (2: the pair shares B through TMA multicast)
    int32_t cluster_n = 1;  ///< CTAs per cluster along N (2: the pair shares A through TMA multicast)
    Raster raster = Raster::kAlongN;
    int32_t raster_group = 8;  ///< tile rows (kAlongN) or columns (kAlongM) per swizzle group
    BLayout b_layout = BLayout::kNK;
    DType in_dtype = DType::kBF16;   ///< A and B: kBF16 or kF16
    DType out_dtype = DType::kBF16;  ///< D: kBF16, kF16 or kF32
    /// false (cooperative): both consumer warpgroups compute every tile, each its half of the rows. true
    /// (ping-pong): the consumer warpgroups take alternate tiles, so one's epilogue runs under the other's
    /// mainloop; only hooks that neither add to, route nor signal a tile (gemm_sm90.cuh).
    bool pingpong = false;

    constexpr bool operator==(const GemmConfig&) const = default;
};

/// Threads per CTA: one producer warpgroup (TMA) and two consumer warpgroups (wgmma).
inline constexpr int kGemmThreads = 384;
inline constexpr int kGemmConsumerWarpgroups = 2;
/// Rows of one wgmma (m64) and of one epilogue slab.
inline constexpr int kGemmSlabRows = 64;
/// Largest dynamic shared memory one CTA may ask for on sm_90 (227 KiB).
inline constexpr int kGemmMaxSmemBytes = 232448;
/// Registers per thread after setmaxnreg: producer and consumers (128*40 + 256*232 <= 65536).
inline constexpr int kGemmProducerRegs = 40;
inline constexpr int kGemmConsumerRegs = 232;

/// Where everything lives in the kernel's dynamic shared memory (byte offsets from a 1024-aligned base).
struct GemmSmemPlan {
    int32_t a_stage_bytes;   ///< one stage of A: tile_m x tile_k
    int32_t b_stage_bytes;   ///< one stage of B: tile_n x tile_k
    int32_t stage_bytes;     ///< A then B
    int32_t epi_offset;      ///< epilogue staging buffers, after the ring
    int32_t epi_buf_bytes;   ///< one staging buffer: 64 rows x 128 bytes (one TMA store box)
    int32_t epi_bytes;       ///< 2 consumer warpgroups x 2 buffers
    int32_t bar_offset;      ///< full[stages] then empty[stages] mbarriers (8 bytes each)
    int32_t used_bytes;      ///< end of the barriers
    int32_t alloc_bytes;     ///< what the launch asks for: used_bytes + 1024 to align the base
};

/// Bytes per element of the dtypes a GEMM takes (dtype_bytes is host-only).
WEFT_HOST_DEVICE constexpr int32_t gemm_elem_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

/// Columns of D in one epilogue store box (128 bytes of output per row).
WEFT_HOST_DEVICE constexpr int32_t gemm_epi_cols(const GemmConfig& c) { return 128 / gemm_elem_bytes(c.out_dtype); }

/// Whether a tile's columns are whole store boxes. Else the columns past the last box are written with plain
/// stores (a box would overwrite the next tile's columns): only for hooks that neither route nor signal stores.
WEFT_HOST_DEVICE constexpr bool gemm_whole_store_boxes(const GemmConfig& c) { return c.tile_n % gemm_epi_cols(c) == 0; }

WEFT_HOST_DEVICE constexpr GemmSmemPlan gemm_smem_plan(const GemmConfig& c) {
    GemmSmemPlan p{};
    const int32_t in_bytes = gemm_elem_bytes(c.in_dtype);
    p.a_stage_bytes = c.tile_m * c.tile_k * in_bytes;
    p.b_stage_bytes = c.tile_n * c.tile_k * in_bytes;
    p.stage_bytes = p.a_stage_bytes + p.b_stage_bytes;
    p.epi_offset = c.stages * p.stage_bytes;
    p.epi_buf_bytes = kGemmSlabRows * 128;
    p.epi_bytes = kGemmConsumerWarpgroups * 2 * p.epi_buf_bytes;
    p.bar_offset = p.epi_offset + p.epi_bytes;
    p.used_bytes = p.bar_offset + 2 * c.stages * 8;
    p.alloc_bytes = p.used_bytes + 1024;
    return p;
}

/// 64-row accumulator slabs per consumer warpgroup: its share of the tile's rows (cooperative) or all of them
/// (ping-pong).
WEFT_HOST_DEVICE constexpr int32_t gemm_slabs_per_consumer(const GemmConfig& c) {
    return c.tile_m / ((c.pingpong ? 1 : kGemmConsumerWarpgroups) * kGemmSlabRows);
}

/// Accumulator floats per consumer thread: slabs x tile_n / 2.
WEFT_HOST_DEVICE constexpr int32_t gemm_acc_regs(const GemmConfig& c) {
    return gemm_slabs_per_consumer(c) * (c.tile_n / 2);
}

/// The one rule for which configs exist: host heuristics filter candidates with it, the kernel
/// static_asserts it.
WEFT_HOST_DEVICE constexpr bool is_valid(const GemmConfig& c) {
    const bool in_ok = c.in_dtype == DType::kBF16 || c.in_dtype == DType::kF16;
    const bool out_ok = c.out_dtype == DType::kBF16 || c.out_dtype == DType::kF16 || c.out_dtype == DType::kF32;
    if (!in_ok || !out_ok) return false;
    if (c.tile_k != 64) return false;  // one 128B swizzle row of 16-bit elements per stage
    if (c.pingpong ? (c.tile_m != 64 && c.tile_m != 128) : (c.tile_m != 128 && c.tile_m != 256)) return false;
    // tile_n: whole 64-column blocks, or (B [N,K], no cluster) any multiple of 16 from 80 (an m64nNk16 wgmma shape;
    // the epilogue stores the columns past its last whole box with plain stores).
    if (c.tile_n < 64 || c.tile_n > 256 || c.tile_n % 16 != 0) return false;
    if (c.tile_n % 64 != 0 && (c.b_layout != BLayout::kNK || c.cluster_m != 1 || c.cluster_n != 1)) return false;
    // Accumulators must leave room in the consumers' 232 registers: a ping-pong 128x192 tile (192 floats per thread)
    // uses R0..R229 without spilling (kernels/gemm/README.md, v24).
    if (gemm_acc_regs(c) > 192) return false;
    if (c.stages < 2 || c.stages > 8) return false;
    if (c.raster_group < 1 || c.raster_group > 64) return false;
    if (c.raster != Raster::kAlongN && c.raster != Raster::kAlongM) return false;
    if (c.b_layout != BLayout::kNK && c.b_layout != BLayout::kKN) return false;
    // Clusters: pairs along one dimension only; the shared operand is split between the pair.
    const bool cluster_ok = (c.cluster_m == 1 && c.cluster_n == 1) || (c.cluster_m == 2 && c.cluster_n == 1) ||
                            (c.cluster_m == 1 && c.cluster_n == 2);
    if (!cluster_ok) return false;
    if (c.cluster_m == 2 && c.b_layout == BLayout::kKN && (c.tile_n / 64) % 2 != 0) return false;
    if (gemm_smem_plan(c).alloc_bytes > kGemmMaxSmemBytes) return false;
    return true;
}

/// A tile of D as the scheduler hands it out.
struct GemmTile {
    int32_t m_idx;  ///< tile row index
    int32_t n_idx;  ///< tile column index
    int32_t m0;     ///< first row of D
    int32_t n0;     ///< first column of D
    bool valid;     ///< false for the padding tile a cluster partner computes past the edge of D
};

/// The grid of output tiles and the swizzled order of "cluster tiles" (cluster_m x cluster_n tiles that
/// the CTAs of one cluster compute together). Pure arithmetic: unit-tested on the CPU.
struct GemmTileGrid {
    int32_t tile_m, tile_n, cluster_m, cluster_n, group;
    Raster raster;
    int32_t num_m_tiles, num_n_tiles;      ///< tiles of D
    int32_t num_m_clusters, num_n_clusters;  ///< cluster tiles (rounded up)

    WEFT_HOST_DEVICE constexpr GemmTileGrid(const GemmConfig& c, int32_t m, int32_t n)
        : tile_m(c.tile_m),
          tile_n(c.tile_n),
          cluster_m(c.cluster_m),
          cluster_n(c.cluster_n),
          group(c.raster_group),
          raster(c.raster),
          num_m_tiles((m + c.tile_m - 1) / c.tile_m),
          num_n_tiles((n + c.tile_n - 1) / c.tile_n),
          num_m_clusters((num_m_tiles + c.cluster_m - 1) / c.cluster_m),
          num_n_clusters((num_n_tiles + c.cluster_n - 1) / c.cluster_n) {}

    WEFT_HOST_DEVICE constexpr int32_t num_cluster_tiles() const { return num_m_clusters * num_n_clusters; }
    WEFT_HOST_DEVICE constexpr int32_t num_tiles() const { return num_m_tiles * num_n_tiles; }

    /// The tile that CTA `cta_rank` of a cluster computes for linear cluster-tile index `t`.
    WEFT_HOST_DEVICE constexpr GemmTile tile(int32_t t, int32_t cta_rank) const {
        int32_t mc = 0, nc = 0;
        if (raster == Raster::kAlongN) {
            const int32_t per_group = group * num_n_clusters;
            const int32_t g = t / per_group;
            const int32_t first = g * group;
            const int32_t rows = (num_m_clusters - first) < group ? (num_m_clusters - first) : group;
            const int32_t local = t - g * per_group;
            mc = first + local % rows;
            nc = local / rows;
        } else {
            const int32_t per_group = group * num_m_clusters;
            const int32_t g = t / per_group;
            const int32_t first = g * group;
            const int32_t cols = (num_n_clusters - first) < group ? (num_n_clusters - first) : group;
            const int32_t local = t - g * per_group;
            nc = first + local % cols;
            mc = local / cols;
        }
        GemmTile out{};
        out.m_idx = mc * cluster_m + cta_rank % cluster_m;
        out.n_idx = nc * cluster_n + cta_rank / cluster_m;
        out.m0 = out.m_idx * tile_m;
        out.n0 = out.n_idx * tile_n;
        out.valid = out.m_idx < num_m_tiles && out.n_idx < num_n_tiles;
        return out;
    }
};

/// The kernel's run-time arguments (besides tensor maps and hook parameters).
struct GemmArgs {
    int32_t m, n, k;
    int32_t n_tma;        ///< columns of D written by TMA stores: N rounded down to 16 bytes (TMA stores write
                          ///< whole 16-byte chunks, so a ragged last chunk would spill into the row padding)
    uint64_t timeout_ns;  ///< bound on every pipeline wait; expiry traps (a hang is a bug)
    void* d;              ///< D, for the columns [n_tma, N) written with plain stores
    int64_t ldd;          ///< D's row stride in elements
};

/// Columns of D a TMA store may cover: the largest multiple of 16 bytes <= N.
WEFT_HOST_DEVICE constexpr int32_t gemm_tma_store_cols(int32_t n, DType out) {
    const int32_t per16 = 16 / gemm_elem_bytes(out);
    return n / per16 * per16;
}

/// The candidate set of tiled-kernel configs (same list for the heuristic, the autotuner and the
/// ahead-of-time instances): tile shape, ring depth and cluster shape; dtypes and layout come from the call.
inline constexpr int kGemmNumCandidates = 14;

WEFT_HOST_DEVICE constexpr GemmConfig gemm_candidate(int index, DType in_dtype, DType out_dtype, BLayout b_layout) {
    GemmConfig c{};
    c.in_dtype = in_dtype;
    c.out_dtype = out_dtype;
    c.b_layout = b_layout;
    switch (index) {
        case 0: c.tile_m = 128; c.tile_n = 256; c.stages = 4; break;
        case 1: c.tile_m = 128; c.tile_n = 256; c.stages = 4; c.cluster_m = 2; break;
        case 2: c.tile_m = 128; c.tile_n = 256; c.stages = 4; c.cluster_n = 2; break;
        case 3: c.tile_m = 256; c.tile_n = 128; c.stages = 4; break;
        case 4: c.tile_m = 256; c.tile_n = 128; c.stages = 4; c.cluster_m = 2; break;
        case 5: c.tile_m = 128; c.tile_n = 192; c.stages = 4; break;
        case 6: c.tile_m = 128; c.tile_n = 128; c.stages = 6; break;
        case 7: c.tile_m = 128; c.tile_n = 64; c.stages = 8; break;
        // 176 columns: N = 1376 (a TP shard) in 8 tiles, 512 per 8192 rows = 3.9 waves on 132 SMs (94.8% of the tile
        // slots busy; every whole-64 tile: 86.9%). B [N,K] only (is_valid).
        case 8: c.tile_m = 128; c.tile_n = 176; c.stages = 5; break;
        // Ping-pong (each consumer warpgroup a whole tile, its epilogue under the other's mainloop): 128x192 for most
        // large shapes, 128x176 for N = 1376, 128x160 where its waves fit better, 64x128 for M = 128 (half of A per
        // CTA from L2 where 128x64 reads all of it; kernels/gemm/README.md, v24).
        case 9: c.tile_m = 128; c.tile_n = 192; c.stages = 4; c.pingpong = true; break;
        case 10: c.tile_m = 128; c.tile_n = 176; c.stages = 5; c.pingpong = true; break;
        case 11: c.tile_m = 128; c.tile_n = 160; c.stages = 5; c.pingpong = true; break;
        case 12: c.tile_m = 64; c.tile_n = 128; c.stages = 8; c.pingpong = true; break;
        // Ping-pong 128x128 in pairs along M (B multicast): N = 1792, where 128x128 fills the waves best and
        // cuBLASLt runs it in clusters (kernels/gemm/README.md, v26).
        default: c.tile_m = 128; c.tile_n = 128; c.stages = 6; c.pingpong = true; c.cluster_m = 2; break;
    }
    return c;
}

/// Arguments of the small-M (M <= 64, B [N,K]) split-K kernel, weft::gemm::gemv_kernel.
struct GemvArgs {
    const void* a;  ///< [M,K], row stride lda (elements)
    const void* b;  ///< [N,K], row stride ldb
    void* d;        ///< [M,N], row stride ldd
    int64_t lda, ldb, ldd;
    int32_t m, n, k;
    int32_t k_per_split;  ///< multiple of 32
    int32_t num_splits;   ///< gridDim.y
    int32_t rows_per_cta; ///< variant 4: rows of B per CTA (the last CTA may have fewer); else unused
    /// Variant 3: launched programmatically (ops::gemm_launches_programmatically), so the ring's first stages load
    /// their B boxes before griddepcontrol.wait and their A boxes after it; 0: each stage's B and A boxes in turn
    /// (A's first boxes queued behind every prologue B box cost up to 9% at M = 64, kernels/gemm/README.md v28).
    int32_t programmatic;
    float* partials;      ///< [num_splits][M][N] fp32 (when num_splits > 1)
    uint32_t* counters;   ///< [gridDim.x], zero between launches (the last CTA of a column block resets it)
};

inline constexpr int kGemvThreads = 128;
/// Variant 3's CTA: 8 warps share each stage's k; the first 4 own the CTA's columns in the epilogue.
inline constexpr int kGemvBulkThreads = 256;
inline constexpr int kGemvColsPerCta = 128;  ///< variant 0: 4 warps x 32 columns (variant 1: 4 x 8)
inline constexpr int kGemvMaxM = 64;
inline constexpr int kGemvNumVariants = 5;  ///< GemmOptions::small_m_variant is 0, 1, 2, 3 or 4 (or -1: the op picks)

/// Columns of D per CTA of gemv_kernel<..., n_tiles_per_warp>: 4 warps x n_tiles_per_warp n8 tiles.
WEFT_HOST_DEVICE constexpr int gemv_cols_per_cta(int n_tiles_per_warp) { return 4 * 8 * n_tiles_per_warp; }

/// The shape of the small-M kernel of one variant for ceil(M / 16) = m_tiles (1..4): the single source of the
/// kernel's template arguments (host instantiation strings, nvcc instances) and of the split-count heuristic.
struct GemvShape {
    int n_tiles;       ///< n8 tiles (8 columns) per warp: gemv_kernel's kNTiles
    int stages;        ///< 0: batched loads per iteration (variants 0, 1); >= 2: a register ring of this many
                       ///< stages kept in flight (variant 2): gemv_kernel's kStages
    int stage_chunks;  ///< variant 2: 32-wide k chunks per stage (each one 16-byte load per lane and n8 tile)
    int ctas_per_sm;   ///< CTAs per SM the split count aims at; variants 2, 3: __launch_bounds__ minimum
    bool bulk = false; ///< variants 3, 4: B and A stream through a shared-memory ring
    bool whole_rows = false;  ///< variant 4: B's rows stream by 1D bulk copies, one CTA per SM (M <= 16)
};

/// Threads per CTA of the small-M kernel (the launch's block): kGemvBulkThreads for variant 3 (and variant 4's
/// whole-row body; its row groups take gemv_rows_threads), else kGemvThreads.
WEFT_HOST_DEVICE constexpr int gemv_threads(bool bulk) { return bulk ? kGemvBulkThreads : kGemvThreads; }

/// Variant 3's stage: 256 k of every B and A row of the CTA (512 bytes per row), loaded as TMA boxes
/// kGemvBulkBoxK wide: 64 (128-byte rows, 128-byte swizzle: conflict-free fragment reads) or 256 (one box
/// per operand and stage, 512 contiguous bytes per row and request, no swizzle).
inline constexpr int kGemvBulkStageK = 256;
inline constexpr int kGemvBulkBoxK = 256;

/// Variant 4 (whole rows; M <= kGemvRowsMaxM, K = kGemvRowsSpanElems x 1, 2, 4 or 8, B's rows back to back: ldb
/// = K): one CTA per SM, CTA c owns rows_per_cta consecutive rows of B (GemvArgs::rows_per_cta; N spread evenly over
/// the SMs), one contiguous range, streamed in kGemvRowsStageBytes stages of one 1D bulk copy each (thread 0, one
/// proxy fence per stage as variant 3): on the H200 such copies stream at 4.0-4.1 TB/s where variant 3's TMA row
/// boxes reach 3.6-3.7 (`weft_bench_stream`, kernels/gemm/README.md v9, v10). A stage is 8 spans of 4 KiB
/// (kGemvBulkThreads x 16 bytes, one 16-byte piece per thread) and holds whole rows, so each thread meets the same
/// k in every row and keeps its A values in registers (fp32). CUDA-core FMAs; no split-K. Shared memory: barriers,
/// the ring, then the per-warp row sums of two stages' rows [2 x 8][8][kGemvRowsMaxM] (fp32). A in registers bounds
/// M x K (kGemvRowsMaxMK: 128 floats per thread), which every (M, K) the body takes keeps.
inline constexpr int kGemvRowsMaxM = 2;  // M = 3, 4: the row groups ran 1-5% faster (kernels/gemm/README.md, v25)
inline constexpr int kGemvRowsMaxMK = 32768;
inline constexpr int kGemvRowsStages = 4;  // 6 ran 1-3% slower (kernels/gemm/README.md, v10)
inline constexpr int kGemvRowsStageBytes = 32 * 1024;
inline constexpr int kGemvRowsSpanElems = 2048;  ///< 4 KiB of 16-bit elements: 256 threads x 16 bytes
/// Offset of the sums from the ring's start (the first 1024-byte boundary past 128 bytes of barriers).
WEFT_HOST_DEVICE constexpr int gemv_rows_sums_offset(int stages) { return stages * kGemvRowsStageBytes; }
/// Variant 4's row-group body, for the M and K the whole-row FMA body cannot hold (gemv_rows_uses_ffma false): M <=
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
static_assert(2 * 8 * 8 * kGemvRowsMaxM * 4 <= kGemvGroupsSumsBytes, "variant 4: the whole-row sums fit the block sums' place");
/// Offset of the row-group body's A slot (A's kGemvGroupsMaxM rows of one k chunk, 4 KiB each) from the ring's start.
WEFT_HOST_DEVICE constexpr int gemv_groups_a_offset(int stages) { return gemv_rows_sums_offset(stages) + kGemvGroupsSumsBytes; }
WEFT_HOST_DEVICE constexpr int gemv_rows_smem_bytes(int stages) {
    return 128 + 1024 + gemv_groups_a_offset(stages) + kGemvGroupsMaxM * 2 * kGemvRowsSpanElems;
}
/// K that variant 4's whole-row FMA body serves: kGemvRowsSpanElems times 1, 2, 4 or 8 (a stage of 8 spans holds
/// whole rows).
WEFT_HOST_DEVICE constexpr bool gemv_rows_k_ok(int64_t k) {
    return k == kGemvRowsSpanElems || k == 2 * kGemvRowsSpanElems || k == 4 * kGemvRowsSpanElems ||
           k == 8 * kGemvRowsSpanElems;
}
/// Which of variant 4's bodies serves (M, K): the whole-row FMA body (A in registers) where it can, else the
/// row-group body (tensor cores). The kernel and the op both decide by this. (M x K <= kGemvRowsMaxMK holds for
/// every M and K the first two terms admit: asserted below.)
WEFT_HOST_DEVICE constexpr bool gemv_rows_uses_ffma(int64_t m, int64_t k) {
    return m <= kGemvRowsMaxM && gemv_rows_k_ok(k) && m * k <= kGemvRowsMaxMK;
}
static_assert(kGemvRowsMaxM * 8 * kGemvRowsSpanElems <= kGemvRowsMaxMK,
              "variant 4: the whole-row body's A (M x K, the longest rows) fits in registers");
/// Variant 4's block for (M, K): kGemvBulkThreads for the whole-row body, kGemvGroupsThreads for the row groups.
WEFT_HOST_DEVICE constexpr int gemv_rows_threads(int64_t m, int64_t k) {
    return gemv_rows_uses_ffma(m, k) ? kGemvBulkThreads : kGemvGroupsThreads;
}

/// Variant 2 keeps stages x stage_chunks x n_tiles 16-byte B loads (512 bytes per warp each) in flight per warp.
/// Bytes in flight needed: ~4.6 TB/s x ~1 us of loaded DRAM latency = ~4.6 MB, ~35 KiB per SM of 132. Here:
///   m_tiles 1 (M <= 16): 12 loads x 16 warps (4 CTAs/SM) = 96 KiB per SM (2.7x);
///   m_tiles 2:           8 loads x 12 warps (3 CTAs/SM) = 48 KiB per SM (1.4x);
///   m_tiles 3, 4:        12 loads x 8 warps (2 CTAs/SM) = 48 KiB per SM (1.4x).
/// The CTAs per SM are what the registers allow without spills: ptxas hoists a whole trip's A fragments
/// (stages x stage_chunks x m_tiles x 8 registers) next to the ring (stages x stage_chunks x n_tiles x 4).
/// Wider warps (n_tiles 2, 4) at 2..4 row tiles reuse each A fragment across columns.
///
/// Variant 3 (bulk): a CTA covers gemv_cols_per_cta(n_tiles) columns; every warp covers all of them for a
/// quarter of each 256-wide k stage (the warps' sums are added once, at the end), so each byte of A and B
/// is read from shared memory once. One CTA of 8 warps per SM, each warp an eighth of each stage's k (two warps
/// per scheduler: one warp alone issued every ~3 cycles at M = 64 and left DRAM at 62% of its peak, ncu), 64
/// columns per CTA. Stages: m_tiles 1: 4 x (64 B rows + 16 A rows) x 512 bytes = 160 KiB; m_tiles 2: 4 x
/// (64 + 32) rows = 192 KiB; m_tiles 3, 4: 3 x (64 + 64) rows. (M <= 16 ran 2 CTAs of 4 warps and 32 columns per
/// SM before: 8% slower at M = 1, kernels/gemm/README.md, variant log v8.)
WEFT_HOST_DEVICE constexpr GemvShape gemv_shape(int variant, int m_tiles) {
    if (variant == 0) return GemvShape{4, 0, 0, 4};
    if (variant == 1) return GemvShape{1, 0, 0, 8};
    if (variant == 3) {
        if (m_tiles <= 2) return GemvShape{2, 4, kGemvBulkStageK / 32, 1, true};
        return GemvShape{2, 3, kGemvBulkStageK / 32, 1, true};
    }
    if (variant == 4) return GemvShape{2, kGemvRowsStages, 0, 1, true, true};  // serves m_tiles 1 only (M <= 16)
    switch (m_tiles) {
        case 1: return GemvShape{1, 6, 2, 4};
        case 2: return GemvShape{2, 4, 1, 3};
        default: return GemvShape{4, 3, 1, 2};
    }
}

/// Dynamic shared memory of the small-M kernel (0 but for variants 3 and 4; variant 4: gemv_rows_smem_bytes): 128 bytes of barriers and up to 1024
/// of alignment, then the ring (at least the end's cross-warp sum buffer: warps x m_tiles x 4 n_tiles n8
/// tiles x 4 floats x 32 lanes).
WEFT_HOST_DEVICE constexpr int gemv_smem_bytes(int variant, int m_tiles) {
    const GemvShape s = gemv_shape(variant, m_tiles);
    if (!s.bulk) return 0;
    if (s.whole_rows) return gemv_rows_smem_bytes(s.stages);
    const int ring = s.stages * (32 * s.n_tiles + 16 * m_tiles) * 2 * kGemvBulkStageK;
    const int sums = gemv_threads(s.bulk) / 32 * m_tiles * 4 * s.n_tiles * 4 * 32 * 4;
    return 128 + 1024 + (ring > sums ? ring : sums);
}

}  // namespace weft
