// SPDX-License-Identifier: MIT
// weft::ops::gemm: D = A * B on sm_90a (bf16/fp16 in, fp32 accumulate, bf16/fp16/fp32 out): the call, its
// options, and the plan it runs. Planning (weft/ops/gemm_plan.hpp) and code generation
// (weft/ops/gemm_codegen.hpp) have their own headers.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "weft/common/gemm_config.hpp"
#include "weft/common/gemv_config.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::jit {
class Autotuner;
}

namespace weft::ops {

/// Knobs of one gemm call. Defaults pick everything from the problem and the device.
struct GemmOptions {
    /// CTAs of the persistent grid (SMs it may occupy); 0 = every SM. Left to the op, a budget below the device's SMs
    /// keeps every launch within it: the small-M path then takes variant 4 (one CTA per SM of the budget) where it
    /// serves, else the tiled kernel; a forced small_m_variant 3 or 5 launches its grid of column blocks and splits
    /// whatever the budget.
    int sm_budget = 0;
    std::optional<GemmConfig> config;  ///< force this tiled-kernel config (dtypes/layout must match the call;
                                       ///< refused when its tile order would pass int32 for the shape)
    bool allow_small_m = true;         ///< let M <= small_m_max_m with B [N,K] take the small-M path
    /// The largest M the heuristic sends to the small-M path (0..kGemvMaxM = 64; above it: the tiled kernel).
    /// Default 32: the small-M kernels beat the tiled kernel up to M = 32, the ping-pong 64x128 tile from M = 48
    /// (figures: kernels/gemm/README.md, "Which M takes the small-M path"). Not applied where small_m_variant forces
    /// a kernel (variant 3 takes M up to kGemvMaxM = 64, variant 4 up to 16, variant 5 up to kGemvWgmmaMaxM = 256).
    int small_m_max_m = 32;
    /// The largest M the heuristic may send to small-M variant 5 (GemvVariant::kTmaWgmma; 0..kGemvWgmmaMaxM = 256,
    /// 0: never). Default 192: from 17 rows the op takes variant 5 where it beat variant 3 or the tiled kernel on
    /// the measured shapes (gemm_prefers_wgmma_small_m in weft/ops/gemm_plan.hpp; only with the whole device,
    /// sm_budget 0). Independent of small_m_max_m, which bounds variants 3 and 4.
    int small_m_wgmma_max_m = 192;
    /// Force the small-M path's split count (0 = heuristic). kTmaWgmma (variant 5) adds its splits inside one
    /// cluster per column block: at most kGemvWgmmaMaxSplits = 8 (more is an error), no workspace; a forced count
    /// whose clusters outnumber those the GPU runs at once (ops::gemv_wgmma_max_clusters: an H200 runs 30 clusters
    /// of 4) runs in two rounds, which the heuristic avoids. A count > 1 keeps the op's own pick to the variants that
    /// split K (kTmaRing, and kTmaWgmma up to its 8): kBulkRows has no split-K.
    int small_m_splits = 0;
    /// Split-K of the tiled kernel (GemmConfig::splits): 0 = the op's rule (gemm_split_k_config), 1 = never, 2..16 =
    /// that many splits of the heuristic's tile (without its cluster pair). Ignored when `config` is set (its own
    /// splits count). Needs a workspace (`workspace`, GemmPlan::workspace_bytes) like the small-M split-K.
    int split_k = 0;
    /// Force a small-M kernel (GemvVariant in weft/common/gemv_config.hpp); unset (the default): the op picks
    /// kBulkRows where it serves (gemv_rows_unsupported is empty) and K >= 4096, else kTmaRing. kBulkRows (variant
    /// 4) = B's rows by 1D bulk copies into a shared-memory ring, one CTA per SM (M <= 16, ldb = K, K a multiple of
    /// 2048): whole rows and CUDA-core FMAs for M <= 2 with K = 2048 x 1, 2, 4 or 8, else groups of 8 rows on the
    /// tensor cores; kTmaRing (variant 3) = split-K, B and A stream through a shared-memory ring filled by TMA.
    /// kBulkRows is the default where it serves because its copies stream faster than kTmaRing's TMA boxes
    /// (figures: kernels/gemm/README.md, the small-M sections). kTmaWgmma (variant 5, picked by the op for some M in
    /// 17..small_m_wgmma_max_m; the autotuner's "small_m_v5") = split-K in a cluster (the splits add through
    /// distributed shared memory), A and B swapped on wgmma (64 columns of D per CTA, A's rows padded to 16): forced,
    /// it serves any M <= kGemvWgmmaMaxM = 256 with B [N,K]. A forced variant runs or the call is refused (weft::Error
    /// naming why), never the tiled kernel in its place: variant 3 serves M <= kGemvMaxM = 64 with B [N,K], variant 4
    /// its domain above, variant 5 M <= 256 with B [N,K] (small_m_max_m does not apply to a forced variant). `config`
    /// or allow_small_m = false take precedence (the tiled kernel). A forced variant is not autotuned.
    std::optional<GemvVariant> small_m_variant;
    void* workspace = nullptr;  ///< split-K scratch of GemmPlan::workspace_bytes, 256-byte aligned, its
                                ///< workspace_bytes apart from a, b and d (refused otherwise): split-K
                                ///< counters first (zero-filled before the first use; each call leaves
                                ///< them zero), then fp32 partials. Zero it again if the counters grow
                                ///< (N of the small-M path, the tiles of a tiled split-K). nullptr =
                                ///< weft's per-(device, stream) scratch, grown by cudaMalloc at the first
                                ///< call that needs more (a device-wide wait: on a GPU shared by ranks,
                                ///< pass a workspace, docs/runtime.md); kept for the process's life, per
                                ///< stream (a program that makes a stream per call: pass a workspace).
                                ///< One call at a time per workspace.
    size_t workspace_bytes = 0;
    std::chrono::milliseconds timeout{0};  ///< bound on the tiled kernel's pipeline waits; 0 = WEFT_TIMEOUT_MS or
                                           ///< 10 s (the small-M kernels' stage waits have a fixed 2 s bound)
    /// Time the candidate kernels (gemm_tune_candidates) on this problem with weft::jit's autotuner and keep
    /// the fastest (decision cached in memory and in <cache dir>/autotune.txt, keyed by gemm_tune_problem).
    /// Also on when WEFT_AUTOTUNE is set to a true value; WEFT_AUTOTUNE=0 turns it off (the heuristic
    /// decides); WEFT_AUTOTUNE_FORCE=gemm=<candidate name> forces a candidate. Ignored when `config` is set.
    /// Tuning runs the candidates on the call's own buffers and synchronises `stream`: not during graph
    /// capture (a capture uses a cached decision, else the heuristic).
    bool autotune = false;
    jit::Autotuner* autotuner = nullptr;  ///< nullptr: weft::jit::autotuner() (tests pass their own)
    /// Programmatic dependent launch for a chain of decode GEMMs (the layers of one decode step): the small-M
    /// kernels (both have a shared-memory ring: gemm_launches_programmatically) start while the kernel
    /// before them on `stream` still runs and stream their first stages of B into shared memory during that
    /// kernel's last microseconds; they wait for that kernel to complete (griddepcontrol.wait) before they read A
    /// or write anything, and let the next kernel start only after that wait. So B must not be written by the
    /// kernel launched right before this call on `stream` (weights are not; a kernel that fills B right before the
    /// call is: leave this off there), nor, when that kernel is itself launched programmatically and lets its
    /// dependents go before its own wait, by the kernels it may overlap. The tiled kernel launches as usual
    /// (gemm_launches_programmatically says which). Off by default. Capturable: in a CUDA graph the launch becomes
    /// a programmatic edge.
    bool programmatic_launch = false;
};

/// D[M,N] = A[M,K] * B, asynchronous on `stream`, capturable in a CUDA graph once its kernels and
/// workspace exist (the first call may allocate the per-stream small-M workspace: per device and stream,
/// cudaStreamPerThread per thread; a captured graph uses the capturing stream's, so replay it where no other call
/// runs on that stream at the same time).
///   a: [M,K], row-major with a row stride (strides {lda, 1}); bf16 or f16
///   b: [N,K] (b_layout kNK) or [K,N] (kKN), row-major with a row stride; same dtype as a
///   d: [M,N], row-major with a row stride; bf16, f16 (f16 inputs only) or f32; its bytes must not overlap a's or b's
///      (the kernels read A and B while other CTAs write D)
/// K must be a positive multiple of 8; M, N and K at most kGemmMaxExtent = 2^31 - 2^24; every base address 16-byte
/// aligned, every row stride a multiple of 16 bytes (the tensor-memory-access engine's rules); M or N may be 0
/// (nothing is written). a, b and d: device memory of the current GPU (or managed memory); host memory and another
/// GPU's are refused naming the operand. Bad arguments and options
/// (validate_gemm_options) throw weft::Error naming the argument, before anything touches the device.
void gemm(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout, cudaStream_t stream,
          const GemmOptions& options = {});

/// Which kernel serves a call.
enum class GemmPath : int32_t { kTiled = 0, kSmallM = 1 };

/// Everything the launcher needs; pure function of problem, SM count and options (plan_gemm,
/// weft/ops/gemm_plan.hpp; unit-tested on the CPU).
struct GemmPlan {
    GemmPath path = GemmPath::kTiled;
    GemmConfig config{};   ///< kTiled
    int grid = 0;          ///< kTiled: persistent CTAs (multiple of the cluster size); kSmallM: gridDim.x
    int smem_bytes = 0;    ///< kTiled: dynamic shared memory
    int small_m_tiles = 0;       ///< kSmallM: ceil(M / 16)
    int small_m_splits = 1;      ///< kSmallM: split-K factor (gridDim.y)
    int small_m_k_per_split = 0;                          ///< kSmallM: multiple of 32 (kTmaWgmma: of 64)
    GemvVariant small_m_variant = GemvVariant::kTmaRing;  ///< kSmallM: which kernel (GemmOptions::small_m_variant)
    size_t workspace_bytes = 0;  ///< split-K (kSmallM, or kTiled with config.splits > 1): counters + partial sums
};

/// Where a call's plan came from.
enum class GemmChoice : int32_t {
    kHeuristic = 0,  ///< plan_gemm (autotuning not asked for, disabled, or impossible during capture)
    kOptions = 1,    ///< options.config
    kTuned = 2,      ///< timed now
    kCached = 3,     ///< an earlier decision (memory or disk)
    kForced = 4,     ///< WEFT_AUTOTUNE_FORCE (or the autotuner's forced list)
};

/// A call's plan and where it came from.
struct GemmSelection {
    GemmPlan plan;
    std::string candidate;  ///< the candidate's name (gemm_candidate_name: "128x256x64_s4_c1x1", "small_m_v3")
    GemmChoice origin = GemmChoice::kHeuristic;
};

/// The plan weft::ops::gemm uses for these arguments on the current device (may autotune: see GemmOptions;
/// the decision logic is select_gemm_plan in weft/ops/gemm_plan.hpp).
GemmSelection select_gemm(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout,
                          cudaStream_t stream, const GemmOptions& options = {});

/// Advances a device epoch word (a uint64 counter, SignalValueMode::kEpoch of the GEMM's hooks) by one, in
/// stream order on `stream` (one tiny JIT kernel; capturable in a CUDA graph, where each replay advances it).
void gemm_advance_epoch(uint64_t* epoch, cudaStream_t stream);

}  // namespace weft::ops
