// SPDX-License-Identifier: MIT
// Planning of weft::ops::gemm (pure host logic, no CUDA call): argument validation, the path and config
// heuristics, the cost model, the autotuner's candidates and problem key, and its decision logic.
#include "weft/ops/gemm_plan.hpp"

#include <algorithm>
#include <limits>
#include <sstream>

#include "weft/common/math.hpp"
#include "weft/detail/gemm_launch.hpp"
#include "weft/jit/autotune.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"

namespace weft::ops {
namespace {

constexpr int64_t kMaxStrideBytes = int64_t{1} << 40;   // TMA global strides

const char* layout_name(BLayout l) { return l == BLayout::kNK ? "[N,K] row-major" : "[K,N] row-major"; }

void check_matrix(const TensorView& v, const char* name, const char* shape_text) {
    WEFT_CHECK(v.ndim == 2, "gemm: " << name << " must be a 2-D matrix " << shape_text << ", got " << v.ndim
                                     << " dimensions (" << v.describe() << ")");
    WEFT_CHECK(v.dim(0) >= 0 && v.dim(1) >= 0, "gemm: " << name << " has a negative extent: " << v.describe());
    WEFT_CHECK(v.dim(1) <= 1 || v.stride(1) == 1,
               "gemm: " << name << " must be row-major (inner stride 1), got " << v.describe());
    WEFT_CHECK(v.dim(0) <= 1 || v.stride(0) >= v.dim(1),
               "gemm: " << name << "'s row stride must be >= its row length " << v.dim(1) << ", got "
                        << v.describe());
    WEFT_CHECK(v.dim(0) <= kGemmMaxExtent && v.dim(1) <= kGemmMaxExtent,
               "gemm: " << name << "'s extents must be at most 2^31 - 2^24 = " << kGemmMaxExtent
                        << " (int32 tile and TMA coordinates), got " << v.describe());
    if (v.numel() == 0) return;
    WEFT_CHECK(v.data != nullptr, "gemm: " << name << " has a null data pointer (" << v.describe() << ")");
    const auto addr = reinterpret_cast<uintptr_t>(v.data);
    WEFT_CHECK(addr % 16 == 0, "gemm: " << name << "'s base address must be 16-byte aligned (TMA), got 0x"
                                        << std::hex << addr << std::dec);
    const int64_t row_bytes = (v.dim(0) <= 1 ? std::max<int64_t>(v.stride(0), v.dim(1)) : v.stride(0)) *
                              dtype_bytes(v.dtype);
    WEFT_CHECK(v.dim(0) <= 1 || row_bytes % 16 == 0,
               "gemm: " << name << "'s row stride must be a multiple of 16 bytes (TMA), got " << v.stride(0)
                        << " elements = " << row_bytes << " bytes (" << v.describe() << ")");
    WEFT_CHECK(row_bytes < kMaxStrideBytes, "gemm: " << name << "'s row stride is too large for TMA: " << row_bytes
                                                     << " bytes");
}

// Relative speed of one tile's worth of MMAs at depth k: planning estimates fitted to the ratios measured on the large
// shapes of docs/performance.md's GEMM table (with them the heuristic picks the fastest measured candidate or one
// within 1%; the measurements: kernels/gemm/README.md). Larger tiles reuse shared memory better; a cooperative tile's
// epilogue stalls both consumer warpgroups for about as long as 128 k of mainloop, which ping-pong hides under the
// other's mainloop. Cooperative tiles in cluster pairs ran no faster than alone: 2% less, so the plain tile wins a
// tie; the ping-pong 128x128 pair ran faster than the cooperative 128x128 at N = 1792.
double tile_efficiency(const GemmConfig& c, int64_t k) {
    const int area = c.tile_m * c.tile_n;
    if (c.pingpong) {
        if (area >= 128 * 192) return 1.0;
        if (area >= 128 * 176) return 0.99;
        if (area >= 128 * 160) return 0.98;
        return area >= 128 * 128 ? 0.95 : 0.70;
    }
    double e = 0.70;                 // 128x64
    if (area >= 128 * 256) {
        e = 1.0;                     // 128x256, 256x128
    } else if (area == 128 * 176) {
        e = 0.96;                    // 128x176 (its last 48 columns by plain stores)
    } else if (area >= 128 * 128) {
        e = 0.97;                    // 128x128, 128x192
    }
    if (c.cluster_m * c.cluster_n > 1) e *= 0.98;
    constexpr double kEpilogueK = 128;
    return e * static_cast<double>(k) / (static_cast<double>(k) + kEpilogueK);
}

// Throws unless `v` names a small-M kernel (`what` names the argument).
void check_gemv_variant(GemvVariant v, const char* what) {
    WEFT_CHECK(v == GemvVariant::kTmaRing || v == GemvVariant::kBulkRows || v == GemvVariant::kTmaWgmma,
               what << " must be GemvVariant::kTmaRing (3), GemvVariant::kBulkRows (4) or GemvVariant::kTmaWgmma (5), "
                       "got "
                    << static_cast<int>(v));
}

// The largest M the small-M path may take for these options: kGemvWgmmaMaxM where kTmaWgmma is forced (its own
// limit), else options.small_m_max_m.
// The largest M the small-M path takes: a forced variant's own bound (small_m_max_m bounds the heuristic only).
int64_t small_m_limit(const GemmOptions& options) {
    if (!options.small_m_variant) return options.small_m_max_m;
    return *options.small_m_variant == GemvVariant::kTmaWgmma ? int64_t{kGemvWgmmaMaxM} : int64_t{kGemvMaxM};
}

}  // namespace

GemmProblem validate_gemm_args(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout) {
    WEFT_CHECK(b_layout == BLayout::kNK || b_layout == BLayout::kKN,
               "gemm: b_layout must be BLayout::kNK or BLayout::kKN, got " << static_cast<int>(b_layout));
    check_matrix(a, "a", "[M,K]");
    check_matrix(b, "b", b_layout == BLayout::kNK ? "[N,K]" : "[K,N]");
    check_matrix(d, "d", "[M,N]");
    WEFT_CHECK(a.dtype == DType::kBF16 || a.dtype == DType::kF16,
               "gemm: a must be bf16 or f16, got " << dtype_name(a.dtype));
    WEFT_CHECK(b.dtype == a.dtype,
               "gemm: b must have a's dtype " << dtype_name(a.dtype) << ", got " << dtype_name(b.dtype));
    WEFT_CHECK(d.dtype == a.dtype || d.dtype == DType::kF32,
               "gemm: d must be " << dtype_name(a.dtype) << " (the input dtype) or f32, got " << dtype_name(d.dtype));
    GemmProblem p;
    p.m = a.dim(0);
    p.k = a.dim(1);
    p.b_layout = b_layout;
    p.in_dtype = a.dtype;
    p.out_dtype = d.dtype;
    const int64_t b_k = b_layout == BLayout::kNK ? b.dim(1) : b.dim(0);
    p.n = b_layout == BLayout::kNK ? b.dim(0) : b.dim(1);
    WEFT_CHECK(b_k == p.k, "gemm: b (" << layout_name(b_layout) << ") must have K = " << p.k
                                      << " (a's columns), got " << b.describe());
    WEFT_CHECK(d.dim(0) == p.m && d.dim(1) == p.n,
               "gemm: d must be [M,N] = [" << p.m << ", " << p.n << "], got " << d.describe());
    WEFT_CHECK(p.k >= 8 && p.k % 8 == 0, "gemm: K (a's columns) must be a positive multiple of 8, got " << p.k);
    p.b_rows_contiguous = b_layout == BLayout::kNK && (b.dim(0) <= 1 || b.stride(0) == p.k) &&
                          reinterpret_cast<uintptr_t>(b.data) % 16 == 0;
    return p;
}

std::string gemv_rows_unsupported(const GemmProblem& p) {
    std::ostringstream why;
    if (p.m > kGemvGroupsMaxM) {
        why << "M = " << p.m << " > " << kGemvGroupsMaxM;
    } else if (p.b_layout != BLayout::kNK || !p.b_rows_contiguous) {
        why << "B is not [N,K] with contiguous, 16-byte aligned rows (ldb = K)";
    } else if (!gemv_rows_uses_ffma(p.m, p.k) && p.k % kGemvRowsSpanElems != 0) {
        why << "K = " << p.k << " is not a multiple of " << kGemvRowsSpanElems;
    }
    return why.str();
}

std::vector<GemmConfig> gemm_candidate_configs(DType in_dtype, DType out_dtype, BLayout b_layout) {
    std::vector<GemmConfig> out;
    for (int i = 0; i < kGemmNumCandidates; ++i) {
        const GemmConfig c = gemm_candidate(i, in_dtype, out_dtype, b_layout);
        if (is_valid(c)) out.push_back(c);
    }
    return out;
}

std::vector<GemmConfig> gemm_split_k_configs(DType in_dtype, DType out_dtype, BLayout b_layout) {
    std::vector<GemmConfig> out;
    // The cluster-free tiles that fill the SMs in one wave for few rows (kernels/gemm/README.md, "Few rows"): ping-pong
    // 64x128 (candidate 12), 128x128 (6), 128x192 (5), 128x256 (0). Not 256x128: its split-K epilogue spilled (two
    // 64-row slabs per warpgroup; CUDA 13.0).
    for (int index : {12, 6, 5, 0}) {
        for (int splits : kGemmSplitKCounts) {
            GemmConfig c = gemm_candidate(index, in_dtype, out_dtype, b_layout);
            c.splits = splits;
            if (is_valid(c)) out.push_back(c);
        }
    }
    return out;
}

namespace {

// `c` with the most stages (at most 8) whose ring fits shared memory; the same with and without a cluster pair (the
// pair adds no shared memory).
GemmConfig with_most_stages(GemmConfig c) {
    c.stages = 8;
    while (c.stages > 2 && gemm_smem_plan(c).alloc_bytes > kGemmMaxSmemBytes) --c.stages;
    return c;
}

}  // namespace

GemmConfig gemm_swap_ab_config_of(int tile_m, DType in_dtype, DType out_dtype) {
    GemmConfig c = gemm_candidate(6, in_dtype, out_dtype, BLayout::kNK);  // cooperative 128x128, no cluster
    c.swap_ab = true;
    c.tile_m = tile_m;
    c.tile_n = 128;
    c.cluster_m = c.cluster_n = 1;
    c.splits = 1;
    return with_most_stages(c);
}

GemmConfig gemm_swap_ab_rule(const GemmProblem& p, const GemmConfig& picked, const GemmOptions& options, int num_sms) {
    WEFT_CHECK(num_sms > 0, "gemm_swap_ab_rule: num_sms must be positive, got " << num_sms);
    if (options.sm_budget != 0 || options.config || options.split_k != 0 || p.m <= kGemmSwapRuleMinM || p.m > 512) {
        return picked;
    }
    // The share of a config's CTA slots (whole waves) whose tile area is D: row padding and a part-filled last wave
    // both lower it (M = 320, N = 4096: 128x128 0.61, 80-row swapped 0.97).
    const auto fill = [&](const GemmConfig& c) {
        const GemmTileGrid g(c, static_cast<int32_t>(p.m), static_cast<int32_t>(p.n));
        const int64_t ctas = static_cast<int64_t>(g.num_cluster_tiles()) * c.cluster_m * c.cluster_n;
        const int64_t waves = ceil_div(ctas, int64_t{num_sms});
        return static_cast<double>(p.m) * static_cast<double>(p.n) /
               (static_cast<double>(waves * num_sms) * c.tile_m * c.tile_n);
    };
    GemmConfig best = picked;
    double best_fill = 0;
    for (const GemmConfig& c : gemm_swap_ab_configs(p, num_sms)) {
        // The pairs measured slower (B multicast did not pay); tiles under kGemmSwapRuleMinRows rows re-read B for
        // too few rows; the ping-pong tiles are the autotuner's only.
        if (c.cluster_m != 1 || c.pingpong || c.tile_m < kGemmSwapRuleMinRows) continue;
        const double f = fill(c);
        if (f > best_fill + 1e-9 || (f > best_fill - 1e-9 && c.tile_m > best.tile_m)) {  // ties: the larger tile
            best = c;
            best_fill = f;
        }
    }
    // Only where the pick wastes more of its slots, by 5% at least, and the swapped tiles fill 3/4 of theirs.
    return best_fill >= 0.75 && best_fill > 1.05 * fill(picked) ? best : picked;
}

std::vector<GemmConfig> gemm_swap_ab_configs(const GemmProblem& p, int budget) {
    WEFT_CHECK(budget > 0, "gemm_swap_ab_configs: budget must be positive, got " << budget);
    std::vector<GemmConfig> out;
    if (p.m < 1 || p.m > 512 || p.n <= 0 || p.k <= 0 || p.b_layout != BLayout::kNK) return out;
    for (int t = 1; t <= 8; ++t) {
        const int tile_m = static_cast<int>(round_up(ceil_div(p.m, int64_t{t}), int64_t{kGemmSwapStoreRows}));
        if (tile_m > 256) continue;
        for (int variant = 0; variant < 4; ++variant) {
            // Cooperative 128 columns, or ping-pong 64 (each warpgroup a tile of its own); without and with the pair.
            GemmConfig c = gemm_swap_ab_config_of(tile_m, p.in_dtype, p.out_dtype);
            const int cluster_m = variant % 2 + 1;
            if (variant >= 2) {
                c.pingpong = true;
                c.tile_n = 64;
                c = with_most_stages(c);
            }
            c.cluster_m = cluster_m;
            if (!is_valid(c)) continue;
            const GemmTileGrid g(c, static_cast<int32_t>(p.m), static_cast<int32_t>(p.n));
            // The tiles of D (a pair's padding tile past M does not count) fill half a wave at least; every CTA of
            // the launch (padding included) fits two.
            const int64_t ctas = static_cast<int64_t>(g.num_cluster_tiles()) * cluster_m;
            if (2 * int64_t{g.num_tiles()} < budget || ctas > 2 * budget) continue;
            if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
        }
    }
    return out;
}

int gemm_fill_splits(const GemmProblem& p, const GemmConfig& c, int budget) {
    const int64_t tiles = GemmTileGrid(c, static_cast<int32_t>(p.m), static_cast<int32_t>(p.n)).num_tiles();
    const int64_t k_blocks = ceil_div(p.k, c.tile_k);
    int best = 1;
    for (int splits : kGemmSplitKCounts) {
        const bool fits = tiles * splits <= budget && k_blocks >= int64_t{kGemmMinSplitKBlocks} * splits;
        if (fits) best = std::max(best, splits);
    }
    return best;
}

GemmConfig gemm_split_k_config(const GemmProblem& p, const GemmConfig& picked, int budget) {
    WEFT_CHECK(budget > 0, "gemm_split_k_config: budget must be positive, got " << budget);
    const auto tiles = [&](const GemmConfig& c) {
        return GemmTileGrid(c, static_cast<int32_t>(p.m), static_cast<int32_t>(p.n)).num_tiles();
    };
    const int64_t picked_tiles = tiles(picked);
    if (picked.splits != 1 || picked.cluster_m * picked.cluster_n != 1 || picked_tiles >= budget || p.m > 384) {
        return picked;
    }
    auto candidate = [&](int index) { return gemm_candidate(index, p.in_dtype, p.out_dtype, p.b_layout); };
    // Only where split-K measured faster than the unsplit pick (one H200, interleaved with cuBLASLt): up to 64 rows
    // (4096^2: 0.57-0.64x -> 0.77-0.78x cuBLASLt) and 129..192 rows at N = K = 8192 (0.53-0.70x -> 0.80-0.87x). Split
    // 128x128 at 65..96 rows, 64x128 at 97..128 and 128x192 at 193..384 measured 6-19% slower than the unsplit pick
    // at N = K = 4096 (the partials' round trip costs more than the idle SMs), so those keep the pick.
    GemmConfig tile = picked;
    if (p.m <= 64) {
        tile = candidate(12);  // ping-pong 64x128: whole 64-row m-tiles
    } else if (p.m > 128 && p.m <= 192) {
        // The ping-pong 64x128 where its tiles fit a wave (N = 4096: 1.0-1.2x cuBLASLt); else 128x256 (B read twice,
        // the fewest tiles) split to fill the SMs, which gemm_swap_ab_rule replaces where swapped tiles fill 3/4 of
        // their wave (N = K = 8192: 0.95-1.00x against 0.72-0.84x split).
        if (tiles(candidate(12)) <= budget) return picked;
        tile = candidate(0);
    } else {
        return picked;
    }
    if (!is_valid(tile)) return picked;
    tile.splits = gemm_fill_splits(p, tile, budget);
    return tile.splits > 1 ? tile : picked;
}

size_t gemm_workspace_bytes(const GemmProblem& p, int splits, GemvVariant variant) {
    check_gemv_variant(variant, "gemm_workspace_bytes: variant");
    // kTmaWgmma's splits add through distributed shared memory (one cluster per column block): no workspace.
    if (splits <= 1 || variant == GemvVariant::kTmaWgmma) return 0;
    const size_t partials = static_cast<size_t>(splits) * static_cast<size_t>(p.m) * static_cast<size_t>(p.n) * 4;
    const int max_m = variant == GemvVariant::kTmaWgmma ? kGemvWgmmaMaxM : kGemvMaxM;
    const int m_tiles = std::clamp(static_cast<int>(ceil_div(p.m, 16)), 1, max_m / 16);
    const int n_tiles = gemv_shape(GemvConfig{.variant = variant, .m_tiles = m_tiles}).n_tiles;
    const size_t blocks = static_cast<size_t>(ceil_div(p.n, gemv_cols_per_cta(n_tiles)));
    return static_cast<size_t>(round_up(static_cast<int64_t>(blocks * 4), 256) +
                               round_up(static_cast<int64_t>(partials), 256));
}

double gemm_config_cost(const GemmProblem& p, const GemmConfig& c, int budget, double per_tile_cost, GemmWaves w) {
    const int cluster = c.cluster_m * c.cluster_n;
    if (cluster > budget) return std::numeric_limits<double>::infinity();
    const GemmTileGrid g(c, static_cast<int32_t>(p.m), static_cast<int32_t>(p.n));
    const int clusters = std::max(1, budget / cluster);
    // A wave of cluster tiles runs on `cluster` CTAs at once: one tile's time per CTA.
    const double waves = w == GemmWaves::kWhole ? static_cast<double>(ceil_div(g.num_cluster_tiles(), clusters))
                                                : static_cast<double>(g.num_cluster_tiles()) / clusters;
    const double cost = waves * (c.tile_m * c.tile_n / tile_efficiency(c, p.k) + per_tile_cost);
    // Padding tiles of a cluster pair past the edge of D are pure waste.
    const double useful = static_cast<double>(g.num_tiles()) / (g.num_cluster_tiles() * cluster);
    return cost / useful;
}

GemmConfig gemm_few_rows_config(const GemmProblem& p, const GemmConfig& picked, int budget) {
    WEFT_CHECK(budget > 0, "gemm_few_rows_config: budget must be positive, got " << budget);
    auto tiles = [&](const GemmConfig& c) {
        return GemmTileGrid(c, static_cast<int32_t>(p.m), static_cast<int32_t>(p.n)).num_tiles();
    };
    if (picked.cluster_m * picked.cluster_n != 1 || tiles(picked) > budget) return picked;
    // 129..192 rows: the second 128-row m-tile is at most half full. The cooperative 128x192 (candidate 5) ran 1.2x
    // and 1.0x the 128x128 at M = 160 / 192, N = K = 8192 (63.8 / 65.0 against 80.0 / 66.1 µs), where its tiles fill a
    // wave.
    if (p.m > 128 && p.m <= 192) {
        const GemmConfig c = gemm_candidate(5, p.in_dtype, p.out_dtype, p.b_layout);
        if (is_valid(c) && tiles(c) <= budget && 2 * tiles(c) >= budget) return c;
    }
    return picked;
}

bool gemm_allows_small_m(const GemmProblem& p, const GemmOptions& options) {
    WEFT_CHECK(options.small_m_max_m >= 0 && options.small_m_max_m <= kGemvMaxM,
               "gemm: options.small_m_max_m must be in [0, " << kGemvMaxM << "] (kGemvMaxM), got "
                                                             << options.small_m_max_m);
    return !options.config && options.allow_small_m && p.m <= small_m_limit(options) && p.b_layout == BLayout::kNK;
}

bool gemm_allows_small_m_v5(const GemmProblem& p, const GemmOptions& options) {
    return !options.config && options.allow_small_m && p.m <= kGemvWgmmaMaxM && p.b_layout == BLayout::kNK;
}

int gemv_auto_splits(int grid, int ctas_per_sm, int num_sms, int64_t k) {
    WEFT_CHECK(grid > 0 && ctas_per_sm > 0 && num_sms > 0 && k > 0,
               "gemv_auto_splits: grid, ctas_per_sm, num_sms and k must be positive, got "
                   << grid << ", " << ctas_per_sm << ", " << num_sms << ", " << k);
    if (3 * grid > num_sms) return 1;
    const int splits = std::clamp(ctas_per_sm * num_sms / grid, 1, 32);
    return std::min(splits, std::max(1, static_cast<int>(k / 256)));
}

int gemv_wgmma_max_clusters(int cluster_size, int num_sms) {
    WEFT_CHECK(cluster_size >= 1 && cluster_size <= kGemvWgmmaMaxSplits && num_sms > 0,
               "gemv_wgmma_max_clusters: cluster_size must be in [1, "
                   << kGemvWgmmaMaxSplits << "] and num_sms positive, got " << cluster_size << ", " << num_sms);
    if (num_sms == 132) {
        // cudaOccupancyMaxActiveClusters at one CTA per SM on an H200 (the H100 SXM's GPC layout).
        constexpr int kMeasured[kGemvWgmmaMaxSplits] = {132, 66, 39, 30, 22, 17, 15, 15};
        return kMeasured[cluster_size - 1];
    }
    if (cluster_size <= 2) return num_sms / cluster_size;  // GPCs hold whole TPCs (SM pairs)
    constexpr int kMaxGpcSms = 18;
    const int gpcs = (num_sms + kMaxGpcSms - 1) / kMaxGpcSms;
    return std::max(0, (num_sms - gpcs * (cluster_size - 1)) / cluster_size);
}

int gemv_wgmma_splits(int64_t n, int64_t k, int num_sms) {
    WEFT_CHECK(n > 0 && k > 0 && num_sms > 0,
               "gemv_wgmma_splits: n, k and num_sms must be positive, got " << n << ", " << k << ", " << num_sms);
    const int64_t blocks = ceil_div(n, int64_t{kGemvWgmmaCols});
    const int64_t k_blocks = ceil_div(k, int64_t{kGemvWgmmaStageK});
    int64_t splits = std::max<int64_t>(1, num_sms / blocks);  // one wave: blocks x splits <= num_sms
    splits = std::min(splits, std::max<int64_t>(1, k_blocks / kGemvWgmmaMinSplitKBlocks));
    splits = std::min<int64_t>(splits, kGemvWgmmaMaxSplits);
    // Every cluster (a column block's splits) running at once: else the last ones wait for the first to finish.
    while (splits > 1 && blocks > gemv_wgmma_max_clusters(static_cast<int>(splits), num_sms)) --splits;
    return static_cast<int>(splits);
}

// The small-M kernel when the caller leaves it to the op: bulk-copied rows (kBulkRows, variant 4) where it serves and
// K >= 4096, else the TMA ring (kTmaRing, variant 3). With K >= 4096 both of variant 4's bodies (whole rows, row
// groups) ran faster than variant 3 or even with it on every shape measured; at K = 2048 (one span per row) the
// whole-row body gained nothing at M = 1 and lost at M = 2 (the measurements: kernels/gemm/README.md, small M).
namespace {
// A split-K count the caller asked for (options.small_m_splits > 1) keeps the choice to the variants that split K.
GemvVariant auto_small_m_variant(const GemmProblem& p, const GemmOptions& options) {
    return options.small_m_splits <= 1 && p.k >= 2 * kGemvRowsSpanElems && gemv_rows_unsupported(p).empty()
               ? GemvVariant::kBulkRows
               : GemvVariant::kTmaRing;
}
}  // namespace

GemvConfig gemv_config(const GemmPlan& plan, const GemmProblem& p) {
    WEFT_CHECK(plan.path == GemmPath::kSmallM, "gemv_config: the plan is not a small-M plan");
    return GemvConfig{.variant = plan.small_m_variant,
                      .m_tiles = plan.small_m_tiles,
                      .in_dtype = p.in_dtype,
                      .out_dtype = p.out_dtype};
}

bool gemm_launches_programmatically(const GemmPlan& plan, const GemmOptions& options) {
    return options.programmatic_launch && plan.path == GemmPath::kSmallM;
}

void validate_gemm_options(const GemmProblem& p, const GemmOptions& options) {
    WEFT_CHECK(options.sm_budget >= 0, "gemm: options.sm_budget must be >= 0, got " << options.sm_budget);
    WEFT_CHECK(options.split_k >= 0 && options.split_k <= kGemmMaxSplits,
               "gemm: options.split_k must be in [0, " << kGemmMaxSplits << "] (0: the op's rule, 1: none), got "
                                                       << options.split_k);
    WEFT_CHECK(
        options.small_m_max_m >= 0 && options.small_m_max_m <= kGemvMaxM,
        "gemm: options.small_m_max_m must be in [0, " << kGemvMaxM << "] (kGemvMaxM), got " << options.small_m_max_m);
    WEFT_CHECK(options.small_m_wgmma_max_m >= 0 && options.small_m_wgmma_max_m <= kGemvWgmmaMaxM,
               "gemm: options.small_m_wgmma_max_m must be in [0, " << kGemvWgmmaMaxM << "] (kGemvWgmmaMaxM), got "
                                                                   << options.small_m_wgmma_max_m);
    WEFT_CHECK(options.small_m_splits >= 0 && options.small_m_splits <= kGemmMaxSmallMSplits,
               "gemm: options.small_m_splits must be in [0, "
                   << kGemmMaxSmallMSplits << "] (0: heuristic; the grid's y extent), got " << options.small_m_splits);
    if (options.small_m_variant) check_gemv_variant(*options.small_m_variant, "gemm: options.small_m_variant");
    if (options.small_m_variant && !options.config && options.allow_small_m) {
        // A forced small-M kernel runs, or the call is refused: never the tiled kernel in its place (options.config
        // and allow_small_m = false take precedence over it: the tiled path, as asked).
        const GemvVariant v = *options.small_m_variant;
        if (v == GemvVariant::kTmaWgmma) {
            WEFT_CHECK(p.m <= kGemvWgmmaMaxM, "gemm: small-M variant 5 (swapped wgmma) serves M <= "
                                                  << kGemvWgmmaMaxM << " (kGemvWgmmaMaxM), got M = " << p.m);
            WEFT_CHECK(p.b_layout == BLayout::kNK,
                       "gemm: small-M variant 5 (swapped wgmma) needs B [N,K] (BLayout::kNK), got B [K,N]");
        } else if (v == GemvVariant::kTmaRing) {
            WEFT_CHECK(p.m <= kGemvMaxM, "gemm: small-M variant 3 (TMA ring) serves M <= "
                                             << kGemvMaxM << " (kGemvMaxM), got M = " << p.m);
            WEFT_CHECK(p.b_layout == BLayout::kNK,
                       "gemm: small-M variant 3 (TMA ring) needs B [N,K] (BLayout::kNK), got B [K,N]");
        }
    }
    (void)detail::gemm_timeout_ns(options);  // refuses a timeout (or WEFT_TIMEOUT_MS) outside (0, 30 days]
    WEFT_CHECK(reinterpret_cast<uintptr_t>(options.workspace) % 256 == 0,
               "gemm: options.workspace must be 256-byte aligned, got " << options.workspace);
    if (options.config) {
        const GemmConfig& c = *options.config;
        WEFT_CHECK(is_valid(c), "gemm: options.config is not a valid GemmConfig: " << format_gemm_config(c));
        WEFT_CHECK(c.in_dtype == p.in_dtype && c.out_dtype == p.out_dtype && c.b_layout == p.b_layout,
                   "gemm: options.config's dtypes/layout must match the call (in "
                       << dtype_name(p.in_dtype) << ", out " << dtype_name(p.out_dtype) << ", "
                       << layout_name(p.b_layout) << "), got " << format_gemm_config(c));
        // The kernel orders its tiles in int32 (GemmTileGrid::tile, over D's tiles whether swapped or not): a raster
        // group (raster_group lines of cluster tiles across the raster direction) and the cluster tile count must
        // stay below 2^31; the heuristic's configs (raster_group 8) always do.
        const int64_t m_clusters = ceil_div(ceil_div(p.m, int64_t{c.tile_m}), int64_t{c.cluster_m});
        const int64_t n_clusters = ceil_div(ceil_div(p.n, int64_t{c.tile_n}), int64_t{c.cluster_n});
        const int64_t per_group = int64_t{c.raster_group} * (c.raster == Raster::kAlongN ? n_clusters : m_clusters);
        WEFT_CHECK(per_group < (int64_t{1} << 31) && m_clusters * n_clusters < (int64_t{1} << 31),
                   "gemm: options.config " << format_gemm_config(c) << " is too fine for M = " << p.m << ", N = " << p.n
                                           << ": its " << m_clusters << " x " << n_clusters
                                           << " cluster tiles in raster "
                                           << "groups of " << per_group
                                           << " pass the kernel's int32 tile order; use "
                                              "larger tiles or a smaller raster_group");
    }
    if (options.small_m_variant == GemvVariant::kBulkRows && !options.config && options.allow_small_m) {
        const std::string why = gemv_rows_unsupported(p);
        WEFT_CHECK(why.empty(), "gemm: small-M variant 4 (bulk-copied rows) cannot serve this call: " << why);
        WEFT_CHECK(
            options.small_m_splits <= 1,
            "gemm: small-M variant 4 (bulk-copied rows) has no split-K, got small_m_splits " << options.small_m_splits);
    }
}

namespace {

GemmPlan plan_small_m(const GemmProblem& p, GemvVariant variant, const GemmOptions& options, int budget, int num_sms) {
    GemmPlan plan;
    plan.path = GemmPath::kSmallM;
    plan.small_m_variant = variant;
    plan.small_m_tiles = static_cast<int>(ceil_div(p.m, 16));
    const GemvShape shape = gemv_shape(GemvConfig{.variant = plan.small_m_variant, .m_tiles = plan.small_m_tiles});
    plan.grid = static_cast<int>(ceil_div(p.n, gemv_cols_per_cta(shape.n_tiles)));
    if (plan.small_m_variant == GemvVariant::kBulkRows) {
        const std::string why = gemv_rows_unsupported(p);
        WEFT_CHECK(why.empty(), "gemm: small-M variant 4 (bulk-copied rows) cannot serve this call: " << why);
        WEFT_CHECK(options.small_m_splits <= 1, "gemm: small-M variant 4 (bulk-copied rows) has no split-K, got "
                                                "small_m_splits " << options.small_m_splits);
        // One CTA per SM of the budget, N spread evenly: ceil(N / grid) rows each, none empty.
        plan.grid = static_cast<int>(ceil_div(p.n, ceil_div(p.n, budget)));
        plan.small_m_k_per_split = static_cast<int>(round_up(p.k, 32));
        plan.small_m_splits = 1;
        plan.workspace_bytes = 0;
        return plan;
    }
    const bool wgmma = plan.small_m_variant == GemvVariant::kTmaWgmma;
    int splits = options.small_m_splits;
    if (splits <= 0) {
        splits = wgmma ? gemv_wgmma_splits(p.n, p.k, budget)
                       : gemv_auto_splits(plan.grid, shape.ctas_per_sm, num_sms, p.k);
    }
    // kTmaWgmma's splits start on whole stages (kGemvWgmmaStageK); kTmaRing's on its 32-wide chunks.
    plan.small_m_k_per_split = static_cast<int>(round_up(ceil_div(p.k, splits), wgmma ? kGemvWgmmaStageK : 32));
    plan.small_m_splits = static_cast<int>(ceil_div(p.k, plan.small_m_k_per_split));
    WEFT_CHECK(!wgmma || plan.small_m_splits <= kGemvWgmmaMaxSplits,
               "gemm: small-M variant 5 splits K over one cluster of at most "
                   << kGemvWgmmaMaxSplits << " CTAs per column block, got " << plan.small_m_splits
                   << " splits (options.small_m_splits " << options.small_m_splits << ", K = " << p.k << ")");
    plan.workspace_bytes = gemm_workspace_bytes(p, plan.small_m_splits, plan.small_m_variant);
    return plan;
}

// `swap_rule`: whether the op's swapped-operand rule may replace the pick (plan_gemm weighs small-M variant 5 against
// the unswapped pick first).
GemmPlan plan_tiled(const GemmProblem& p, const GemmOptions& options, int budget, bool swap_rule) {
    GemmPlan plan;
    plan.path = GemmPath::kTiled;
    if (options.config) {
        plan.config = *options.config;  // checked by validate_gemm_options
    } else {
        // Minimise waves x tile work / efficiency; ties keep the earlier (preferred) candidate.
        double best = 0;
        bool have = false;
        for (const GemmConfig& c : gemm_candidate_configs(p.in_dtype, p.out_dtype, p.b_layout)) {
            if (c.cluster_m * c.cluster_n > budget) continue;  // a cluster pair would break the SM budget
            const double cost = gemm_config_cost(p, c, budget);
            // NOTE: no bonus for multicast pairs: on equal cost the plain config (listed first) wins until
            // measurements say otherwise (kernels/gemm/README.md, variant log).
            if (!have || cost < best * 0.999) {
                best = cost;
                plan.config = c;
                have = true;
            }
        }
        WEFT_CHECK(have, "gemm: no valid config for in " << dtype_name(p.in_dtype) << ", out "
                                                         << dtype_name(p.out_dtype));
        plan.config = gemm_few_rows_config(p, plan.config, budget);
        if (options.split_k == 0) plan.config = gemm_split_k_config(p, plan.config, budget);
        if (options.split_k == 0 && swap_rule) plan.config = gemm_swap_ab_rule(p, plan.config, options, budget);
        if (options.split_k > 1) {
            // Forced: that many splits of the heuristic's tile, without its cluster pair.
            plan.config.cluster_m = plan.config.cluster_n = 1;
            plan.config.splits = options.split_k;
            WEFT_CHECK(is_valid(plan.config), "gemm: options.split_k " << options.split_k << " does not fit the tile "
                                                                     << gemm_candidate_name(plan.config));
        }
    }
    const GemmConfig& c = plan.config;
    const GemmTileGrid g(c, static_cast<int32_t>(p.m), static_cast<int32_t>(p.n));
    const int cluster = c.cluster_m * c.cluster_n;
    const int clusters = std::max(1, std::min(budget / cluster, g.num_cluster_tiles()));
    // Split-K: one CTA per work unit (tile x split) up to the budget.
    const int64_t units = static_cast<int64_t>(g.num_cluster_tiles()) * c.splits;
    plan.grid = c.splits == 1 ? clusters * cluster : static_cast<int>(std::min<int64_t>(budget, units));
    plan.smem_bytes = gemm_smem_plan(c).alloc_bytes;
    if (c.splits > 1) {
        const GemmSplitKLayout l = gemm_split_k_layout(c, static_cast<int32_t>(p.m), static_cast<int32_t>(p.n));
        plan.workspace_bytes = static_cast<size_t>(l.counter_bytes + round_up(l.partial_bytes, 256));
    }
    return plan;
}

}  // namespace

bool gemm_prefers_wgmma_small_m(const GemmProblem& p, const GemmOptions& options, const GemmPlan* tiled, int num_sms) {
    WEFT_CHECK(num_sms > 0, "gemm: the device must report a positive SM count, got " << num_sms);
    if (options.config || options.small_m_variant || options.split_k != 0 || !options.allow_small_m ||
        p.b_layout != BLayout::kNK || (options.sm_budget > 0 && options.sm_budget < num_sms) || p.m < 17 ||
        p.m > options.small_m_wgmma_max_m || p.n <= 0 || p.k <= 0 || options.small_m_splits > kGemvWgmmaMaxSplits) {
        return false;
    }
    const int splits = gemv_wgmma_splits(p.n, p.k, num_sms);
    // Measured faster where its grid (column blocks x splits) filled half to one wave of the device; a smaller grid
    // leaves SMs idle, a larger one a partial last wave (N = 28672: 448 CTAs, 3.4 waves, 10-13% behind the tiled
    // kernel at M = 77..128).
    const int64_t grid = ceil_div(p.n, int64_t{kGemvWgmmaCols}) * splits;
    if (2 * grid < num_sms || grid > num_sms) return false;
    if (tiled == nullptr) return true;
    const GemmConfig& c = tiled->config;
    const GemmTileGrid g(c, static_cast<int32_t>(p.m), static_cast<int32_t>(p.n));
    const double tiles = g.num_tiles();
    const double rows_used = static_cast<double>(p.m) / static_cast<double>(round_up(p.m, int64_t{c.tile_m}));
    if (tiles >= 1.5 * num_sms) return false;
    // Above kGemmSwapRuleMinM, where variant 5 runs unsplit and the swapped rule finds tiles that fill 3/4 of their
    // wave, the swapped tiles ran faster (M = 136..192: N = 7168, K = 2048 0.91-0.92x cuBLASLt against 0.84-0.86;
    // N = K = 8192 0.95-1.00x against 0.93-0.97).
    if (p.m > kGemmSwapRuleMinM && splits == 1 && gemm_swap_ab_rule(p, c, options, num_sms).swap_ab) return false;
    return tiles < 0.8 * num_sms || rows_used <= 0.8;
}

GemmPlan plan_gemm(const GemmProblem& p, int num_sms, const GemmOptions& options) {
    WEFT_CHECK(num_sms > 0, "gemm: the device must report a positive SM count, got " << num_sms);
    validate_gemm_options(p, options);
    if (p.m == 0 || p.n == 0) {  // nothing to compute: a plan that launches nothing (gemm() returns before it)
        GemmPlan empty;
        empty.config =
            options.config ? *options.config : gemm_candidate_configs(p.in_dtype, p.out_dtype, p.b_layout).front();
        return empty;
    }
    const int budget = options.sm_budget > 0 ? std::min(options.sm_budget, num_sms) : num_sms;
    if (gemm_allows_small_m(p, options)) {
        const bool wgmma = gemm_prefers_wgmma_small_m(p, options, nullptr, num_sms);
        const GemvVariant v =
            options.small_m_variant.value_or(wgmma ? GemvVariant::kTmaWgmma : auto_small_m_variant(p, options));
        // Variant 3 launches a CTA per column block and split, whatever the budget: left to the op, a budget below the
        // device's SMs takes the tiled kernel (its persistent grid keeps to the budget) instead.
        if (options.small_m_variant || v != GemvVariant::kTmaRing || budget >= num_sms) {
            return plan_small_m(p, v, options, budget, num_sms);
        }
    }
    // Variant 5's band rule was fitted against the unswapped tiled pick; the swapped rule then serves the calls it
    // leaves to the tiled kernel.
    const GemmPlan unswapped = plan_tiled(p, options, budget, /*swap_rule=*/false);
    if (gemm_prefers_wgmma_small_m(p, options, &unswapped, num_sms)) {
        return plan_small_m(p, GemvVariant::kTmaWgmma, options, budget, num_sms);
    }
    return plan_tiled(p, options, budget, /*swap_rule=*/true);
}

std::string gemm_candidate_name(const GemmConfig& c) {
    std::ostringstream os;
    os << c.tile_m << "x" << c.tile_n << "x" << c.tile_k << "_s" << c.stages << "_c" << c.cluster_m << "x"
       << c.cluster_n;
    if (c.pingpong) os << "_pp";
    if (c.splits != 1) os << "_k" << c.splits;
    if (c.swap_ab) os << "_sw";
    return os.str();
}

std::string gemm_candidate_name(const GemmPlan& plan) {
    return plan.path == GemmPath::kSmallM ? "small_m_v" + std::to_string(static_cast<int>(plan.small_m_variant))
                                          : gemm_candidate_name(plan.config);
}

std::vector<GemmCandidate> gemm_tune_candidates(const GemmProblem& p, int num_sms, const GemmOptions& options) {
    std::vector<GemmCandidate> out;
    auto add = [&](const GemmPlan& plan) {
        const std::string name = gemm_candidate_name(plan);
        for (const auto& c : out) {
            if (c.name == name) return;
        }
        out.push_back({name, plan});
    };
    GemmOptions base = options;
    base.config.reset();
    add(plan_gemm(p, num_sms, base));  // the heuristic's pick first: it wins ties
    const int budget = options.sm_budget > 0 ? std::min(options.sm_budget, num_sms) : num_sms;
    for (const GemmConfig& c : gemm_candidate_configs(p.in_dtype, p.out_dtype, p.b_layout)) {
        if (c.cluster_m * c.cluster_n > budget) continue;  // as plan_gemm: a pair would break the SM budget
        GemmOptions forced = base;
        forced.config = c;
        add(plan_gemm(p, num_sms, forced));
    }
    if (options.split_k != 1) {
        // The split-K configs whose tiles are fewer than the SMs, with at least kGemmMinSplitKBlocks k-blocks per split.
        for (const GemmConfig& c : gemm_split_k_configs(p.in_dtype, p.out_dtype, p.b_layout)) {
            if (ceil_div(p.k, c.tile_k) < int64_t{kGemmMinSplitKBlocks} * c.splits) continue;
            if (GemmTileGrid(c, static_cast<int32_t>(p.m), static_cast<int32_t>(p.n)).num_tiles() >= budget) continue;
            GemmOptions forced = base;
            forced.config = c;
            add(plan_gemm(p, num_sms, forced));
        }
    }
    for (const GemmConfig& c : gemm_swap_ab_configs(p, budget)) {
        GemmOptions forced = base;
        forced.config = c;
        add(plan_gemm(p, num_sms, forced));
    }
    GemmOptions unforced = base;  // small_m_max_m bounds variants 3 and 4 (a forced variant 5 would lift it)
    unforced.small_m_variant.reset();
    if (gemm_allows_small_m(p, unforced)) {  // as plan_gemm: only where the small-M path may serve this M
        for (GemvVariant variant : {GemvVariant::kTmaRing, GemvVariant::kBulkRows}) {
            // Variant 3's grid is not bounded by a budget (plan_gemm): not a candidate under one.
            if (variant == GemvVariant::kTmaRing && budget < num_sms) continue;
            // Variant 4 has no split-K: not a candidate where the caller asked for splits.
            if (variant == GemvVariant::kBulkRows && (!gemv_rows_unsupported(p).empty() || base.small_m_splits > 1)) {
                continue;
            }
            GemmOptions small = base;
            small.small_m_variant = variant;
            add(plan_gemm(p, num_sms, small));
        }
    }
    // Variant 5 up to its own M limit, whatever small_m_max_m, and up to its own split count; as variant 3, not under a
    // budget.
    if (gemm_allows_small_m_v5(p, base) && base.small_m_splits <= kGemvWgmmaMaxSplits && budget >= num_sms) {
        GemmOptions small = base;
        small.small_m_variant = GemvVariant::kTmaWgmma;
        add(plan_gemm(p, num_sms, small));
    }
    return out;
}

std::string gemm_tune_problem(const GemmProblem& p, int num_sms, const GemmOptions& options) {
    const int budget = options.sm_budget > 0 ? std::min(options.sm_budget, num_sms) : num_sms;
    std::ostringstream os;
    os << "m=" << p.m << ",n=" << p.n << ",k=" << p.k << ",in=" << dtype_name(p.in_dtype)
       << ",out=" << dtype_name(p.out_dtype) << ",b=" << (p.b_layout == BLayout::kNK ? "nk" : "kn")
       << ",sms=" << budget << ",small_m=" << (gemm_allows_small_m(p, options) ? 1 : 0)
       << ",splits=" << options.small_m_splits;
    if (options.split_k != 0) os << ",split_k=" << options.split_k;  // absent when 0: earlier keys stay valid
    // Present where small-M variant 5 is a candidate: decisions recorded before it existed never timed it.
    if (gemm_allows_small_m_v5(p, options)) os << ",v5=1";
    return os.str();
}

bool gemm_wants_autotuner(const GemmOptions& options, std::optional<bool> env_autotune, bool env_force_names_gemm) {
    if (options.config || options.small_m_variant) return false;  // the caller chose
    if (env_force_names_gemm) return true;      // forcing needs no timing
    if (env_autotune.has_value() && !*env_autotune) return false;  // WEFT_AUTOTUNE=0: the heuristic
    return options.autotune || env_autotune.value_or(false);
}

GemmSelection select_gemm_plan(const GemmProblem& p, int num_sms, const GemmOptions& options, const std::string& arch,
                               const GemmRunPlan& run, cudaStream_t stream, bool capturing,
                               const GemmPrepareCandidates& prepare) {
    GemmSelection sel;
    sel.plan = plan_gemm(p, num_sms, options);
    sel.candidate = gemm_candidate_name(sel.plan);
    if (options.config) {
        sel.origin = GemmChoice::kOptions;
        return sel;
    }
    bool forced = false;
    if (const auto f = env::get("WEFT_AUTOTUNE_FORCE")) forced = jit::parse_force_list(*f).count("gemm") > 0;
    if (!gemm_wants_autotuner(options, env::get_bool("WEFT_AUTOTUNE"), forced)) return sel;

    const std::vector<GemmCandidate> candidates = gemm_tune_candidates(p, num_sms, options);
    jit::Autotuner& tuner = options.autotuner != nullptr ? *options.autotuner : jit::autotuner();
    jit::TuneKey key;
    key.op = "gemm";
    key.problem = gemm_tune_problem(p, num_sms, options);
    key.world_size = 1;
    key.arch = arch;
    auto index_of = [&](const std::string& name) -> int {
        for (size_t i = 0; i < candidates.size(); ++i) {
            if (candidates[i].name == name) return static_cast<int>(i);
        }
        return -1;
    };
    const std::optional<std::string> cached = tuner.cached_decision(key);
    if (capturing && !forced) {
        // Timing synchronises the stream, which a capture forbids: use what is known.
        const int idx = cached ? index_of(*cached) : -1;
        if (idx >= 0) {
            sel.plan = candidates[static_cast<size_t>(idx)].plan;
            sel.candidate = candidates[static_cast<size_t>(idx)].name;
            sel.origin = GemmChoice::kCached;
        } else {
            WEFT_LOG_WARN("gemm: autotuning [" << key.problem << "] was asked for during CUDA graph capture, which "
                                              "cannot time kernels; using the heuristic's " << sel.candidate
                                              << " (tune once outside the capture to record a decision)");
        }
        return sel;
    }
    if (!forced && !(cached && index_of(*cached) >= 0) && prepare) prepare(candidates);

    std::vector<jit::TuneCandidate> runs;
    runs.reserve(candidates.size());
    for (const GemmCandidate& c : candidates) {
        const GemmPlan* plan = &c.plan;
        runs.push_back({c.name, [&run, plan](cudaStream_t s) { run(*plan, s); }});
    }
    jit::TuneOptions tune_options;
    tune_options.stream = stream;
    const jit::TuneResult r = tuner.tune(key, runs, nullptr, tune_options);
    WEFT_CHECK(r.index < candidates.size(), "gemm: the autotuner returned candidate " << r.index << " of "
                                                                                     << candidates.size());
    sel.plan = candidates[r.index].plan;
    sel.candidate = candidates[r.index].name;
    switch (r.origin) {
        case jit::TuneResult::Origin::kTuned: sel.origin = GemmChoice::kTuned; break;
        case jit::TuneResult::Origin::kCached: sel.origin = GemmChoice::kCached; break;
        case jit::TuneResult::Origin::kForced: sel.origin = GemmChoice::kForced; break;
        case jit::TuneResult::Origin::kDisabled: sel.origin = GemmChoice::kHeuristic; break;
    }
    return sel;
}

}  // namespace weft::ops
