// SPDX-License-Identifier: MIT
// GemmConfig: the compile-time configuration of weft's sm_90a tiled GEMM, its validity rule, shared-memory plan
// and tile grid, shared by host heuristics, the JIT code generator and the kernel (g++, nvcc, NVRTC). The
// small-M kernels' configuration is weft/common/gemv_config.hpp.
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
    /// mainloop (hooks that signal, add to or route a tile work with both: gemm_sm90.cuh).
    bool pingpong = false;
    /// Split-K: each tile's k blocks are split into `splits` balanced ranges, each computed by its own work unit (a
    /// CTA's turn); every unit writes its fp32 partial tile to a workspace, and the last unit of a tile to finish
    /// sums the partials in split order (deterministic) and stores D. 1: off. Only for the plain GEMM
    /// (PersistentScheduler, NoEpilogueHook) without clusters; fills the SMs where the tiles are fewer than them.
    int32_t splits = 1;
    /// Swapped operands: the kernel computes D^T = B A^T, so B's tile_n rows take the wgmma's 64-row M side (64-column
    /// slabs of D: cooperative, each consumer warpgroup its half of the columns; ping-pong, all of them) and A's
    /// tile_m rows its N side (any multiple of 16 from 16 to 256). A tile of few rows then costs no padding to 64:
    /// M = 320 runs as 4 x 80-row tiles. The epilogue transposes the accumulators back on their way to shared memory
    /// (stmatrix .trans) and stores D by boxes of kGemmSwapStoreRows rows. Only for the plain GEMM
    /// (PersistentScheduler, NoEpilogueHook), B [N,K], without split-K (is_valid).
    bool swap_ab = false;

    constexpr bool operator==(const GemmConfig&) const = default;
};

/// The most k splits of a split-K config (is_valid).
inline constexpr int32_t kGemmMaxSplits = 16;

/// Threads per CTA: one producer warpgroup (TMA) and two consumer warpgroups (wgmma).
inline constexpr int kGemmThreads = 384;
inline constexpr int kGemmConsumerWarpgroups = 2;
/// Rows of one wgmma (m64) and of one epilogue slab.
inline constexpr int kGemmSlabRows = 64;
/// Rows of D per TMA store box of a swapped config (GemmConfig::swap_ab): its tile_m is a multiple of them.
inline constexpr int kGemmSwapStoreRows = 16;
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
    int32_t tile_ring_offset;  ///< grouped schedulers: the tiles the producer hands the consumers (gemm_tile_slots)
    int32_t used_bytes;        ///< end of the tile ring
    int32_t alloc_bytes;     ///< what the launch asks for: used_bytes + 1024 to align the base
};

/// Bytes per element of the dtypes a GEMM takes (dtype_bytes is host-only).
WEFT_HOST_DEVICE constexpr int32_t gemm_elem_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

/// Columns of D in one epilogue store box (128 bytes of output per row).
WEFT_HOST_DEVICE constexpr int32_t gemm_epi_cols(const GemmConfig& c) { return 128 / gemm_elem_bytes(c.out_dtype); }

/// Whether a tile's columns are whole store boxes. Else the columns past the last box are written with plain
/// stores (a box would overwrite the next tile's columns): only for hooks that neither route nor signal stores.
WEFT_HOST_DEVICE constexpr bool gemm_whole_store_boxes(const GemmConfig& c) { return c.tile_n % gemm_epi_cols(c) == 0; }

/// Bytes of one slot of the tile ring (a GemmTile, padded).
inline constexpr int32_t kGemmTileSlotBytes = 32;
/// Slots of the tile ring: the producer writes tile j's slot once it has issued the loads of tile j - 1, and a consumer
/// reads tile i's slot after its mainloop, before it frees a stage of its next tile (ping-pong: i + 2); the producer
/// then has filled at most `stages` stages past that tile's first, so it writes at most tile i + 2 + stages (tiles of
/// one k-block each): stages + 3 slots never overwrite an unread one.
WEFT_HOST_DEVICE constexpr int32_t gemm_tile_slots(const GemmConfig& c) { return c.stages + 3; }

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
    p.tile_ring_offset = p.bar_offset + 2 * c.stages * 8;
    p.used_bytes = p.tile_ring_offset + gemm_tile_slots(c) * kGemmTileSlotBytes;
    p.alloc_bytes = p.used_bytes + 1024;
    return p;
}

/// 64-row accumulator slabs per consumer warpgroup: its share of the tile's rows (cooperative) or all of them
/// (ping-pong); swapped (GemmConfig::swap_ab), its share of the tile's columns in slabs of 64 columns.
WEFT_HOST_DEVICE constexpr int32_t gemm_slabs_per_consumer(const GemmConfig& c) {
    return (c.swap_ab ? c.tile_n : c.tile_m) / ((c.pingpong ? 1 : kGemmConsumerWarpgroups) * kGemmSlabRows);
}

/// The wgmma's N: tile_n, or (swapped) tile_m.
WEFT_HOST_DEVICE constexpr int32_t gemm_wgmma_n(const GemmConfig& c) { return c.swap_ab ? c.tile_m : c.tile_n; }

/// Accumulator floats per consumer thread: slabs x wgmma N / 2.
WEFT_HOST_DEVICE constexpr int32_t gemm_acc_regs(const GemmConfig& c) {
    return gemm_slabs_per_consumer(c) * (gemm_wgmma_n(c) / 2);
}

/// Rows of D per TMA store box: one 64-row slab, or (swapped) kGemmSwapStoreRows.
WEFT_HOST_DEVICE constexpr int32_t gemm_store_box_rows(const GemmConfig& c) {
    return c.swap_ab ? kGemmSwapStoreRows : kGemmSlabRows;
}

/// The one rule for which configs exist: host heuristics filter candidates with it, the kernel
/// static_asserts it.
WEFT_HOST_DEVICE constexpr bool is_valid(const GemmConfig& c) {
    const bool in_ok = c.in_dtype == DType::kBF16 || c.in_dtype == DType::kF16;
    const bool out_ok = c.out_dtype == DType::kBF16 || c.out_dtype == DType::kF16 || c.out_dtype == DType::kF32;
    if (!in_ok || !out_ok) return false;
    if (c.tile_k != 64) return false;  // one 128B swizzle row of 16-bit elements per stage
    if (c.swap_ab) {
        // Swapped: tile_n whole 64-column slabs, each consumer warpgroup at least one (cooperative 128 or 256,
        // ping-pong 64 or 128); tile_m the wgmma's N, whole store boxes of rows (a multiple of 16 up to 256). B [N,K]
        // (its rows are the wgmma's K-major M side), no split of K.
        const int32_t per_wg = c.pingpong ? 1 : kGemmConsumerWarpgroups;
        if (c.tile_n % (per_wg * kGemmSlabRows) != 0 || c.tile_n > per_wg * 2 * kGemmSlabRows) return false;
        if (c.tile_m < kGemmSwapStoreRows || c.tile_m > 256 || c.tile_m % kGemmSwapStoreRows != 0) return false;
        if (c.b_layout != BLayout::kNK || c.splits != 1) return false;
    } else {
        if (c.pingpong ? (c.tile_m != 64 && c.tile_m != 128) : (c.tile_m != 128 && c.tile_m != 256)) return false;
        // tile_n: whole 64-column blocks, or (B [N,K], no cluster) any multiple of 16 from 80 (an m64nNk16 wgmma
        // shape; the epilogue stores the columns past its last whole box with plain stores).
        if (c.tile_n < 64 || c.tile_n > 256 || c.tile_n % 16 != 0) return false;
        if (c.tile_n % 64 != 0 && (c.b_layout != BLayout::kNK || c.cluster_m != 1 || c.cluster_n != 1)) return false;
    }
    // Accumulators must leave room in the consumers' 232 registers: a ping-pong 128x192 tile (192 floats per thread)
    // uses R0..R229 without spilling (kernels/gemm/README.md).
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
    if (c.splits < 1 || c.splits > kGemmMaxSplits) return false;
    // Split-K without clusters (a pair would share one operand across two k ranges).
    if (c.splits > 1 && (c.cluster_m != 1 || c.cluster_n != 1)) return false;
    return true;
}

/// The configs a grouped GEMM (kernels/gemm GroupedScheduler) runs: valid, cluster-free (the groups' tiles are not
/// paired), no swap and no split-K. B is read through a 3D map (a box never crosses into the next group's slice), so
/// tile_n may leave a tail of plain-stored columns as in the dense GEMM (128x176, 128x160). (The consumers take their
/// tiles from the producer through shared memory and run no scheduler cursor, so a ping-pong 128x192 tile's 192
/// accumulator floats per thread fit as in the dense GEMM.)
WEFT_HOST_DEVICE constexpr bool is_valid_grouped(const GemmConfig& c) {
    return is_valid(c) && c.cluster_m == 1 && c.cluster_n == 1 && !c.swap_ab && c.splits == 1;
}

/// The configs of a grouped GEMM whose producer waits per group before loading A (GroupedWaitScheduler: a
/// GroupedGemmOptions::wait; the TP MoE layer 0's GatheredWaitScheduler): grouped-valid with at most 128 accumulator
/// floats per consumer thread (their consumers keep the scheduler's cursor in registers beside the accumulators).
WEFT_HOST_DEVICE constexpr bool is_valid_grouped_wait(const GemmConfig& c) {
    return is_valid_grouped(c) && gemm_acc_regs(c) <= 128;
}

/// A tile of D as the scheduler hands it out.
struct GemmTile {
    int32_t m_idx;  ///< tile row index
    int32_t n_idx;  ///< tile column index
    int32_t m0;     ///< first row of D
    int32_t n0;     ///< first column of D
    bool valid;     ///< false for the padding tile a cluster partner computes past the edge of D
    /// Grouped schedulers only (kernels/gemm/gemm_scheduler.cuh, kSchedulerGrouped): the group (expert) of the tile,
    /// whose B is slice `group` of a [groups, ...] tensor, and the end (exclusive) of its group's rows of D, past which
    /// the epilogue stores nothing. m_idx is then the tile row within the group; m0 the first row of D. Other
    /// schedulers leave both 0 (the kernel reads them only for grouped schedulers).
    int32_t group = 0;
    int32_t m_end = 0;
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
    /// Split-K (GemmConfig::splits > 1) only, else null: gemm_split_k_layout's fp32 partial tiles and per-tile
    /// arrival counters (zero before the launch; the kernel leaves them zero).
    float* partials;
    uint32_t* counters;
};

/// The k blocks one split of a tile computes: [begin, begin + count), balanced (counts differ by at most one; none is
/// empty while splits <= num_k_blocks).
struct GemmKRange {
    int32_t begin;
    int32_t count;
};

WEFT_HOST_DEVICE constexpr GemmKRange gemm_split_k_range(int32_t num_k_blocks, int32_t splits, int32_t split) {
    const int32_t begin = static_cast<int32_t>(static_cast<int64_t>(split) * num_k_blocks / splits);
    const int32_t end = static_cast<int32_t>(static_cast<int64_t>(split + 1) * num_k_blocks / splits);
    return GemmKRange{begin, end - begin};
}

/// The split-K workspace of a config on an M x N output: one uint32 arrival counter per tile (rounded up to 256
/// bytes), then fp32 partials, `splits` tiles of tile_m x tile_n per tile of D, tile-major ([tile][split][...]).
struct GemmSplitKLayout {
    int64_t counter_bytes;
    int64_t partial_bytes;
    int64_t tile_floats;  ///< tile_m x tile_n: one split's partial tile
};

WEFT_HOST_DEVICE constexpr GemmSplitKLayout gemm_split_k_layout(const GemmConfig& c, int32_t m, int32_t n) {
    const int64_t tiles = static_cast<int64_t>((m + c.tile_m - 1) / c.tile_m) * ((n + c.tile_n - 1) / c.tile_n);
    GemmSplitKLayout l{};
    l.tile_floats = static_cast<int64_t>(c.tile_m) * c.tile_n;
    l.counter_bytes = c.splits > 1 ? (tiles * 4 + 255) / 256 * 256 : 0;
    l.partial_bytes = c.splits > 1 ? tiles * c.splits * l.tile_floats * 4 : 0;
    return l;
}

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
        // CTA from L2 where 128x64 reads all of it; kernels/gemm/README.md).
        case 9: c.tile_m = 128; c.tile_n = 192; c.stages = 4; c.pingpong = true; break;
        case 10: c.tile_m = 128; c.tile_n = 176; c.stages = 5; c.pingpong = true; break;
        case 11: c.tile_m = 128; c.tile_n = 160; c.stages = 5; c.pingpong = true; break;
        case 12: c.tile_m = 64; c.tile_n = 128; c.stages = 8; c.pingpong = true; break;
        // Ping-pong 128x128 in pairs along M (B multicast): N = 1792, where 128x128 fills the waves best and
        // cuBLASLt runs it in clusters (kernels/gemm/README.md).
        default: c.tile_m = 128; c.tile_n = 128; c.stages = 6; c.pingpong = true; c.cluster_m = 2; break;
    }
    return c;
}

}  // namespace weft
