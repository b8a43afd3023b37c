// SPDX-License-Identifier: MIT
// Planning of weft::ops::gemm, testable without a GPU: validation of the views, the path and config
// heuristics and their cost model, the autotuner's candidates and problem key, and its decision logic.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "weft/common/gemm_config.hpp"
#include "weft/common/gemv_config.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::ops {

/// The shape and types of one call, after validation.
struct GemmProblem {
    int64_t m = 0, n = 0, k = 0;
    BLayout b_layout = BLayout::kNK;
    DType in_dtype = DType::kBF16;
    DType out_dtype = DType::kBF16;
    /// B [N,K] with its rows back to back (ldb = K, 16-byte aligned): what GemvVariant::kBulkRows streams whole.
    /// validate_gemm_args sets it from the views.
    bool b_rows_contiguous = false;
};

/// The largest M, N or K of a GEMM (dense, grouped or fused): the kernels' int32 arithmetic rounds extents up (to whole
/// tiles, k blocks and cluster tiles, the rows of a tile's last quad; the small-M split-K ranges, up to 32 x
/// kGemmMaxSmallMSplits past K) and needs that margin below 2^31.
inline constexpr int64_t kGemmMaxExtent = (int64_t{1} << 31) - (int64_t{1} << 24);

/// Checks a, b, d against each other and TMA's rules; throws weft::Error naming the offending argument.
GemmProblem validate_gemm_args(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout);

/// The most splits GemmOptions::small_m_splits may force (the small-M grid's y extent).
inline constexpr int kGemmMaxSmallMSplits = 65535;

/// Checks a call's options against its problem (weft::ops::gemm and select_gemm call it before anything touches the
/// device, plan_gemm again): sm_budget >= 0, split_k in [0, kGemmMaxSplits], small_m_max_m in [0, kGemvMaxM],
/// small_m_splits in [0, kGemmMaxSmallMSplits], small_m_variant kTmaRing, kBulkRows or kTmaWgmma (kBulkRows only where
/// it can serve a small-M call; kTmaWgmma, unless options.config is set or allow_small_m is off, only with M <=
/// kGemvWgmmaMaxM and B [N,K]), timeout (and WEFT_TIMEOUT_MS when it is 0) in [0, 30 days], workspace 256-byte
/// aligned, config valid with the call's dtypes and layout and not so fine that its raster groups or cluster tiles
/// reach 2^31 (the kernel's int32 tile order).
/// Throws weft::Error naming the option.
void validate_gemm_options(const GemmProblem& problem, const GemmOptions& options);

/// Why GemvVariant::kBulkRows (B's rows by bulk copies) cannot serve `p`, or "" when it can: M <= kGemvGroupsMaxM, B
/// [N,K] with contiguous rows, and K a multiple of kGemvRowsSpanElems (any K of gemv_rows_k_ok for the whole-row
/// body, gemv_rows_uses_ffma). Any N: one CTA per SM of the budget takes ceil(N / SMs) consecutive rows (no split-K).
std::string gemv_rows_unsupported(const GemmProblem& p);

/// The tiled-kernel configs the heuristic (and the autotuner) choose from for this problem's types/layout.
std::vector<GemmConfig> gemm_candidate_configs(DType in_dtype, DType out_dtype, BLayout b_layout);

/// How gemm_config_cost counts the waves of tiles: whole (the last one rounded up: the tile count is known), or
/// unrounded (tiles / concurrent tiles: for a caller that knows the tile count only roughly, a grouped call's rows
/// spread over its groups by counts read on the device).
enum class GemmWaves { kWhole, kUnrounded };

/// The heuristic's estimate of the tiled kernel's run time with `config` on `budget` SMs (arbitrary units: output
/// elements of MMA work; lower is better; infinite when a cluster does not fit the budget). `per_tile_cost` adds
/// that many units per tile (the fused ops' hooks). plan_gemm picks the cheapest candidate.
double gemm_config_cost(const GemmProblem& problem, const GemmConfig& config, int budget, double per_tile_cost = 0,
                        GemmWaves waves = GemmWaves::kWhole);

/// The tiled config for a problem of few rows, given the cost model's pick `picked` on `budget` SMs (pure rule, part of
/// plan_gemm; kernels/gemm/README.md, "Few rows"): `picked` unless it is cluster-free with all its tiles in one wave
/// and 128 < M <= 192, where the cooperative 128x192 takes over if its tiles fill at least half a wave.
GemmConfig gemm_few_rows_config(const GemmProblem& problem, const GemmConfig& picked, int budget);

/// Split counts of the split-K configs, and the fewest k-blocks (of 64 k) a split may get from the op's rule and the
/// autotuner.
inline constexpr int kGemmSplitKCounts[] = {2, 4};
inline constexpr int kGemmMinSplitKBlocks = 8;

/// The split-K configs the plain GEMM may run besides gemm_candidate_configs (never the fused ops): the cluster-free
/// ping-pong 64x128, 128x128, 128x192 and 128x256 tiles with each of kGemmSplitKCounts.
std::vector<GemmConfig> gemm_split_k_configs(DType in_dtype, DType out_dtype, BLayout b_layout);

/// The swapped configs (GemmConfig::swap_ab) the autotuner tries for a problem of few rows (M <= 512, B [N,K]): the
/// cooperative tile of 128 columns and the ping-pong tile of 64, with tile_m = M / t rounded up to 16 (t = 1..8, at
/// most 256), without and with a cluster pair along M (B multicast), each with the most stages that fit, where the
/// tiles fill half a wave of `budget` CTAs at least and two waves at most (M = 320, N = 4096: 80, 112 and 160 rows).
/// Empty for other problems.
std::vector<GemmConfig> gemm_swap_ab_configs(const GemmProblem& problem, int budget);

/// The swapped config of `tile_m` rows the op's rule may pick (cooperative 128 columns, no cluster, the most stages
/// that fit): what gemm_swap_ab_configs holds for that tile_m without a cluster, and what gemm_aot_specs lists for
/// tile_m = kGemmSwapRuleMinRows, + 16, ..., 256.
GemmConfig gemm_swap_ab_config_of(int tile_m, DType in_dtype, DType out_dtype);
/// The fewest rows of a tile gemm_swap_ab_rule picks: smaller swapped tiles read B for too few rows (384x2048x8192 in
/// 48-row tiles x 16 ran 0.81x cuBLASLt, one H200, 2026-12-04).
inline constexpr int kGemmSwapRuleMinRows = 80;
/// gemm_swap_ab_rule serves M above this (and up to 512); at this M and below, small-M variant 5 and the unswapped
/// tiles are what was measured.
inline constexpr int kGemmSwapRuleMinM = 128;

/// The op's rule for swapped configs: with the whole device (options.sm_budget 0), B [N,K], kGemmSwapRuleMinM < M <=
/// 512, where small-M variant 5 does not serve the call (plan_gemm weighs variant 5 against the unswapped pick first),
/// the cluster-free cooperative swapped config of gemm_swap_ab_configs (tiles of kGemmSwapRuleMinRows rows or more)
/// whose CTA slots, in whole waves, hold the most area of D (ties: the larger tile), where that share is at least 3/4
/// and beats the pick's by 5% (the pick pads rows or leaves a wave part-empty): M = 320, N = 4096: 4 x 32 tiles of 80
/// rows; 320x14336: 224 tiles of 160 rows in two waves. Else `picked`. A split pick (gemm_split_k_config's 128x256 at
/// 129..192 rows where 64x128 tiles overflow a wave) counts its tiles, not its units: 192x8192x8192 split 2 ran 0.84x
/// cuBLASLt, 96-row swapped 1.00x. Measured (one H200, interleaved with cuBLASLt): kernels/gemm/README.md, "Swapped
/// operands".
GemmConfig gemm_swap_ab_rule(const GemmProblem& problem, const GemmConfig& picked, const GemmOptions& options,
                             int num_sms);

/// The most splits of kGemmSplitKCounts (or 1) whose work units (tiles x splits) fit one wave of `budget` CTAs with at
/// least kGemmMinSplitKBlocks k-blocks each.
int gemm_fill_splits(const GemmProblem& problem, const GemmConfig& tile, int budget);

/// The op's split-K rule (pure, part of plan_gemm when GemmOptions::split_k is 0; kernels/gemm/README.md, "Few rows"),
/// given the pick `picked` (after gemm_few_rows_config): only where the pick is cluster-free, its tiles fill less than
/// one wave and M <= 384, a tile is taken by M and split so that its units fill the SMs (gemm_fill_splits):
///   M <= 64 and 97..128: ping-pong 64x128; 65..96: 128x128; 129..192: the pick where the ping-pong 64x128's tiles fit
///   a wave, else 128x256; 193..384: 128x192 where the pick leaves more than a quarter of the SMs idle.
/// The pick stands where that tile gets no second split.
GemmConfig gemm_split_k_config(const GemmProblem& problem, const GemmConfig& picked, int budget);

/// Whether the small-M path may serve this call: no options.config, options.allow_small_m, B [N,K] and
/// M <= options.small_m_max_m (M <= kGemvWgmmaMaxM where options.small_m_variant forces kTmaWgmma, whose own limit
/// replaces small_m_max_m). Throws weft::Error when small_m_max_m is outside 0..kGemvMaxM.
bool gemm_allows_small_m(const GemmProblem& problem, const GemmOptions& options);

/// Whether small-M variant 5 (GemvVariant::kTmaWgmma) may serve this call, so that the autotuner tries it: no
/// options.config, options.allow_small_m, B [N,K] and M <= kGemvWgmmaMaxM, whatever small_m_max_m.
bool gemm_allows_small_m_v5(const GemmProblem& problem, const GemmOptions& options);

/// The small-M kernel kTmaRing's split count when the caller leaves it to the op (pure rule): 1 (no split-K) while its
/// `grid` column blocks occupy more than a third of the `num_sms` SMs; else one wave of CTAs streaming B
/// (ctas_per_sm x num_sms / grid, at most 32) with at least 256 k per split. Measured (bf16, H200, N = K = 4096, a grid
/// of 64 on 132 SMs): one split ran 13-18% faster than two at M = 24..64 (the split-K partials and their last-CTA sum
/// cost more than the 64 idle SMs give back).
int gemv_auto_splits(int grid, int ctas_per_sm, int num_sms, int64_t k);

/// The fewest k-blocks of kGemvWgmmaStageK (64 k) one split of small-M variant 5 gets from gemv_wgmma_splits.
inline constexpr int kGemvWgmmaMinSplitKBlocks = 8;

/// The most clusters of `cluster_size` CTAs (1..kGemvWgmmaMaxSplits) a device of `num_sms` SMs runs at once when each
/// CTA takes a whole SM, as small-M variant 5's (~200 KiB of shared memory) do. A cluster lives inside one GPC, and a
/// GPC whose SM count is not a multiple of the cluster size leaves the rest idle: with 132 SMs (H100 SXM, H200) what
/// cudaOccupancyMaxActiveClusters reports there (2026-12-04, one H200: 132, 66, 39, 30, 22, 17, 15, 15 clusters of 1..8
/// CTAs); other SM counts: a bound that takes GPCs of at most 18 SMs, each leaving up to cluster_size - 1 idle.
int gemv_wgmma_max_clusters(int cluster_size, int num_sms);

/// Small-M variant 5's (GemvVariant::kTmaWgmma) split count when the caller leaves it to the op (pure rule): the most
/// splits S (at most kGemvWgmmaMaxSplits, at least 1) whose ceil(N / 64) column blocks x S fill at most one wave of
/// `num_sms` (the SM budget) and whose clusters of S CTAs all run at once (gemv_wgmma_max_clusters: 32 clusters of 4
/// would take two rounds on 132 SMs, which hold 30), each split keeping at least kGemvWgmmaMinSplitKBlocks k-blocks of
/// 64. E.g. 132 SMs: N = K = 4096 -> 64 blocks x 2; N = 8192 -> 128 x 1; N = 2048, K = 7168 -> 32 x 3; N = 1024, K =
/// 8192 -> 16 x 6; N = 64, K = 4096 -> 1 x 8.
int gemv_wgmma_splits(int64_t n, int64_t k, int num_sms);

/// Whether the op sends this call to small-M variant 5 (GemvVariant::kTmaWgmma) on its own (pure rule; `tiled` = the
/// tiled kernel's plan for the call, or nullptr where the call would take variant 3/4, M <= small_m_max_m). Only with
/// the whole device (no sm_budget below num_sms: variant 5's grid is not bounded by one), no forced config, variant or
/// split_k, B [N,K], 17 <= M <= options.small_m_wgmma_max_m and a grid of ceil(N / 64) x S CTAs of half to one wave
/// of the SMs; then, with S = gemv_wgmma_splits:
///  - against variant 3 (M <= small_m_max_m): always;
///  - against the tiled kernel: its T tiles fill less than 1.5 waves, and not T >= 0.8 x num_sms with the tile's rows
///    more than 80% used; and not, above kGemmSwapRuleMinM with S = 1, where gemm_swap_ab_rule takes swapped tiles.
/// (The first fit also asked S <= 2, or 65 <= M <= 160 against the tiled kernel: it had been measured with split
/// counts whose clusters did not all run at once, before gemv_wgmma_splits kept them to gemv_wgmma_max_clusters.)
/// Fitted to the sweep of 2026-12-04 (one H200, bf16, M = 17..256 at (N, K) = 4096², 8192², (7168, 2048),
/// (2048, 7168), (28672, 4096), (4096, 14336), (1024, 4096); kernels/gemm/README.md, "Which M takes the small-M path").
bool gemm_prefers_wgmma_small_m(const GemmProblem& problem, const GemmOptions& options, const GemmPlan* tiled,
                                int num_sms);

/// Picks the path and config. `num_sms` is the device's SM count (the budget's default).
GemmPlan plan_gemm(const GemmProblem& problem, int num_sms, const GemmOptions& options = {});

/// Scratch the small-M path needs for this problem with `splits` splits (0 when none, and for kTmaWgmma, whose
/// splits add through distributed shared memory): counters (one per column block of the variant) first, then fp32
/// partials, each rounded up to 256 bytes.
size_t gemm_workspace_bytes(const GemmProblem& problem, int splits, GemvVariant variant = GemvVariant::kTmaRing);

/// The small-M kernel of a kSmallM plan for a problem's dtypes.
GemvConfig gemv_config(const GemmPlan& plan, const GemmProblem& problem);

/// Whether a call with these options launches `plan` programmatically (GemmOptions::programmatic_launch): only the
/// small-M kernels (both have a shared-memory ring) wait for the previous kernel inside, so only they are launched
/// that way (the tiled kernel launches as usual).
bool gemm_launches_programmatically(const GemmPlan& plan, const GemmOptions& options);

// ---- autotuning ----------------------------------------------------------------------------------------

/// One config the autotuner may pick for a call: a stable name and the plan it stands for.
struct GemmCandidate {
    std::string name;  ///< gemm_candidate_name(plan)
    GemmPlan plan;
};

/// "128x256x64_s4_c1x1": tile, stages, cluster (raster/dtypes/layout are fixed by the call), "_pp" for ping-pong and
/// "_k<splits>" for split-K. Used as the autotuner's candidate name, so WEFT_AUTOTUNE_FORCE=gemm=<this> forces the
/// config.
std::string gemm_candidate_name(const GemmConfig& config);

/// A plan's candidate name: gemm_candidate_name(plan.config) for the tiled path, "small_m_v<variant>" for the
/// small-M path.
std::string gemm_candidate_name(const GemmPlan& plan);

/// The candidates for a call, the heuristic's pick (plan_gemm) first so that it wins ties and is what a
/// disabled autotuner returns: the other valid tiled candidates that fit the SM budget, the split-K configs
/// (gemm_split_k_configs; not with options.split_k = 1) whose tiles are fewer than the SMs of the budget and whose
/// splits get at least kGemmMinSplitKBlocks k-blocks each, and, where the
/// small-M path is allowed for this call (gemm_allows_small_m with small_m_max_m), the small-M kernels that can serve
/// it (kTmaRing; kBulkRows where gemv_rows_unsupported is empty), and last kTmaWgmma ("small_m_v5") wherever
/// gemm_allows_small_m_v5 (M <= 256, B [N,K]), past small_m_max_m.
std::vector<GemmCandidate> gemm_tune_candidates(const GemmProblem& problem, int num_sms, const GemmOptions& options);

/// The autotuner's problem key: shape, dtypes, layout, SM budget and the options that change the candidates,
/// e.g. "m=4096,n=4096,k=4096,in=bf16,out=bf16,b=nk,sms=132,small_m=0,splits=0" (small_m: whether
/// gemm_allows_small_m, i.e. whether the small-M variants are candidates), with ",v5=1" appended where small-M variant
/// 5 is a candidate (gemm_allows_small_m_v5: decisions recorded before it existed never timed it).
std::string gemm_tune_problem(const GemmProblem& problem, int num_sms, const GemmOptions& options);

/// Whether a call asks the autotuner (pure rule): never with options.config or options.small_m_variant (the caller
/// chose); WEFT_AUTOTUNE_FORCE naming gemm
/// (`env_force_names_gemm`) always; otherwise when options.autotune or WEFT_AUTOTUNE (`env_autotune`, nullopt
/// when unset) is true, unless WEFT_AUTOTUNE is false.
bool gemm_wants_autotuner(const GemmOptions& options, std::optional<bool> env_autotune, bool env_force_names_gemm);

/// Enqueues one run of `plan` on a stream (the autotuner times it).
using GemmRunPlan = std::function<void(const GemmPlan& plan, cudaStream_t stream)>;
/// Called once with the candidates right before they are timed (e.g. to compile them in parallel).
using GemmPrepareCandidates = std::function<void(const std::vector<GemmCandidate>& candidates)>;

/// The plan of a call: plan_gemm's, or the autotuner's pick among gemm_tune_candidates (decision logic above;
/// the tuner is options.autotuner or weft::jit::autotuner(), called with one rank and TuneKey{"gemm",
/// gemm_tune_problem, 1, arch}). `capturing`: the stream is being captured, so nothing may be timed (a cached
/// decision is used, else the heuristic). Reads WEFT_AUTOTUNE and WEFT_AUTOTUNE_FORCE; makes no CUDA call
/// itself (only `run` and `prepare` touch the device).
GemmSelection select_gemm_plan(const GemmProblem& problem, int num_sms, const GemmOptions& options,
                               const std::string& arch, const GemmRunPlan& run, cudaStream_t stream,
                               bool capturing = false, const GemmPrepareCandidates& prepare = {});

}  // namespace weft::ops
