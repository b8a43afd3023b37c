// SPDX-License-Identifier: MIT
// weft::ops::gemm: D = A * B on sm_90a (bf16/fp16 in, fp32 accumulate, bf16/fp16/fp32 out), plus the
// planning, validation and launch pieces that fused kernels and tests reuse.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "weft/common/gemm_config.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::jit {
class Autotuner;
}

namespace weft::ops {

/// Where the GEMM kernels come from.
enum class GemmBackend : int32_t {
    /// An instance compiled into the program by nvcc (kernels/gemm/gemm_instances.cuh, registered with
    /// register_gemm_instances()) when there is one, else weft::jit. A program built with g++ alone has no
    /// instances: every kernel comes from the JIT (compiled on first use, then from the disk cache).
    kAuto = 0,
    kJit = 1,  ///< always weft::jit (NVRTC + cache), even when an nvcc instance is registered
    kAot = 2,  ///< only registered nvcc instances; a missing one is an error
};

/// Knobs of one gemm call. Defaults pick everything from the problem and the device.
struct GemmOptions {
    int sm_budget = 0;                 ///< CTAs of the persistent grid (SMs it may occupy); 0 = every SM
    std::optional<GemmConfig> config;  ///< force this tiled-kernel config (dtypes/layout must match the call)
    bool allow_small_m = true;         ///< let M <= small_m_max_m with B [N,K] take the split-K small-M path
    /// The largest M the heuristic sends to the small-M path (0..kGemvMaxM = 64; above it: the tiled kernel).
    /// Default 64: measured on an H200 (bf16, N = K = 8192, 2026-11-29), the small-M kernel (variant 3) takes
    /// 39.0 us at M = 1, 39.3 us at M = 16, 40.3 us at M = 32, 45.3 us at M = 48 and 52.6 us at M = 64; the
    /// tiled kernel 69.2 us at M = 48 and 71.4 us at M = 64.
    int small_m_max_m = 64;
    int small_m_splits = 0;            ///< force the small-M path's split count (0 = heuristic)
    /// Small-M kernel (gemv_shape in weft/common/gemm_config.hpp, kernels/gemm/gemv_sm90.cuh): -1 = the op picks
    /// (default): 4 where it serves (gemv_rows_unsupported is empty) and K >= 4096, else 3. 4 = B's rows by 1D
    /// bulk copies into a shared-memory ring, one CTA per SM (M <= 16, ldb = K, K a multiple of 2048): whole rows
    /// and CUDA-core FMAs for M <= 2 with K = 2048 x 1, 2, 4 or 8, else groups of 8 rows on the
    /// tensor cores; 3 = B and A stream through a shared-memory ring filled by TMA; 2 = a register ring keeping 8-12
    /// B loads in flight per warp; 1 = 8 columns per warp, 1 KiB contiguous per row per iteration; 0 = 32 columns
    /// per warp. H200, bf16, B [N,K], one run each (kernels/gemm/README.md, v10): 1x8192x8192 v4 / v3 / cuBLASLt
    /// 35.3-36.3 / 37.3-38.1 / 37.2-37.4 us; 1x28672x4096 57.8-58.7 / 64.8-65.3 / 58.8-59.5 us; 16x8192x8192
    /// (row groups, v14, run K) 37.7-37.8 / 37.8-38.1 / 37.1-37.3 us.
    int small_m_variant = -1;
    void* workspace = nullptr;         ///< small-M scratch of gemm_workspace_bytes, 256-byte aligned: split-K
                                       ///< counters first (zero-filled before the first use; each call leaves
                                       ///< them zero), then fp32 partials. Zero it again if N grows. nullptr =
                                       ///< weft's per-(device, stream) scratch, grown by cudaMalloc at the first
                                       ///< call that needs more (a device-wide wait: on a GPU shared by ranks,
                                       ///< pass a workspace, docs/runtime.md). One call at a time per workspace.
    size_t workspace_bytes = 0;
    std::chrono::milliseconds timeout{0};  ///< bound on every pipeline wait; 0 = WEFT_TIMEOUT_MS or 10 s
    GemmBackend backend = GemmBackend::kAuto;
    /// Time the candidate kernels (gemm_tune_candidates) on this problem with weft::jit's autotuner and keep
    /// the fastest (decision cached in memory and in <cache dir>/autotune.txt, keyed by gemm_tune_problem).
    /// Also on when WEFT_AUTOTUNE is set to a true value; WEFT_AUTOTUNE=0 turns it off (the heuristic
    /// decides); WEFT_AUTOTUNE_FORCE=gemm=<candidate name> forces a candidate. Ignored when `config` is set.
    /// Tuning runs the candidates on the call's own buffers and synchronises `stream`: not during graph
    /// capture (a capture uses a cached decision, else the heuristic).
    bool autotune = false;
    jit::Autotuner* autotuner = nullptr;  ///< nullptr: weft::jit::autotuner() (tests pass their own)
    /// Programmatic dependent launch for a chain of decode GEMMs (the layers of one decode step): the small-M
    /// kernels with a shared-memory ring (variants 3 and 4, gemm_launches_programmatically) start while the kernel
    /// before them on `stream` still runs and stream their first stages of B into shared memory during that
    /// kernel's last microseconds; they wait for that kernel to complete (griddepcontrol.wait) before they read A
    /// or write anything, and let the next kernel start only after that wait. So B must not be written by the
    /// kernel launched right before this call on `stream` (weights are not; a kernel that fills B right before the
    /// call is: leave this off there), nor, when that kernel is itself launched programmatically and lets its
    /// dependents go before its own wait, by the kernels it may overlap. Other paths launch as usual
    /// (gemm_launches_programmatically says which). Off by default. Capturable: in a CUDA graph the launch becomes
    /// a programmatic edge.
    bool programmatic_launch = false;
};

/// D[M,N] = A[M,K] * B, asynchronous on `stream`, capturable in a CUDA graph once its kernels and
/// workspace exist (the first call may allocate the per-stream small-M workspace).
///   a: [M,K], row-major with a row stride (strides {lda, 1}); bf16 or f16
///   b: [N,K] (b_layout kNK) or [K,N] (kKN), row-major with a row stride; same dtype as a
///   d: [M,N], row-major with a row stride; bf16, f16 (f16 inputs only) or f32
/// K must be a multiple of 8; every base address 16-byte aligned, every row stride a multiple of 16 bytes
/// (the tensor-memory-access engine's rules). Bad arguments throw weft::Error naming the argument.
void gemm(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout, cudaStream_t stream,
          const GemmOptions& options = {});

/// The shape and types of one call, after validation.
struct GemmProblem {
    int64_t m = 0, n = 0, k = 0;
    BLayout b_layout = BLayout::kNK;
    DType in_dtype = DType::kBF16;
    DType out_dtype = DType::kBF16;
    /// B [N,K] with its rows back to back (ldb = K, 16-byte aligned): what small-M variant 4 streams whole.
    /// validate_gemm_args sets it from the views.
    bool b_rows_contiguous = false;
};

/// Why small-M variant 4 (B's rows by bulk copies) cannot serve `p`, or "" when it can: M <= kGemvGroupsMaxM, B
/// [N,K] with contiguous rows, and K a multiple of kGemvRowsSpanElems (any K of gemv_rows_k_ok for the whole-row
/// body, gemv_rows_uses_ffma). Any N: one CTA per SM of the budget takes ceil(N / SMs) consecutive rows (no split-K).
std::string gemv_rows_unsupported(const GemmProblem& p);

/// Which kernel serves a call.
enum class GemmPath : int32_t { kTiled = 0, kSmallM = 1 };

/// Everything the launcher needs; pure function of problem, SM count and options (unit-tested on the CPU).
struct GemmPlan {
    GemmPath path = GemmPath::kTiled;
    GemmConfig config{};   ///< kTiled
    int grid = 0;          ///< kTiled: persistent CTAs (multiple of the cluster size); kSmallM: column blocks
    int smem_bytes = 0;    ///< kTiled: dynamic shared memory
    int small_m_tiles = 0;       ///< kSmallM: ceil(M / 16)
    int small_m_splits = 1;      ///< kSmallM: split-K factor (gridDim.y)
    int small_m_k_per_split = 0; ///< kSmallM: multiple of 32
    int small_m_variant = 3;     ///< kSmallM: which gemv_kernel (GemmOptions::small_m_variant)
    size_t workspace_bytes = 0;  ///< kSmallM: partial sums + counters
};

/// Whether a call with these options launches `plan` programmatically (GemmOptions::programmatic_launch): only the
/// small-M kernels with a shared-memory ring (variants 3 and 4) wait for the previous kernel inside, so only they
/// are launched that way (the tiled kernel and variants 0-2 launch as usual).
bool gemm_launches_programmatically(const GemmPlan& plan, const GemmOptions& options);

/// Checks a, b, d against each other and TMA's rules; throws weft::Error naming the offending argument.
GemmProblem validate_gemm_args(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout);

/// The tiled-kernel configs the heuristic (and the autotuner) choose from for this problem's types/layout.
std::vector<GemmConfig> gemm_candidate_configs(DType in_dtype, DType out_dtype, BLayout b_layout);

/// The heuristic's estimate of the tiled kernel's run time with `config` on `budget` SMs (arbitrary units: output
/// elements of MMA work; lower is better; infinite when a cluster does not fit the budget). `per_tile_cost` adds
/// that many units per tile (the fused ops' hooks). plan_gemm picks the cheapest candidate.
double gemm_config_cost(const GemmProblem& problem, const GemmConfig& config, int budget, double per_tile_cost = 0);

/// Whether the small-M path may serve this call: no options.config, options.allow_small_m, B [N,K] and
/// M <= options.small_m_max_m. Throws weft::Error when small_m_max_m is outside 0..kGemvMaxM.
bool gemm_allows_small_m(const GemmProblem& problem, const GemmOptions& options);

/// Picks the path and config. `num_sms` is the device's SM count (the budget's default).
GemmPlan plan_gemm(const GemmProblem& problem, int num_sms, const GemmOptions& options = {});

/// Scratch the small-M path needs for this problem with `splits` splits (0 when none): counters (one per
/// column block of the variant) first, then fp32 partials, each rounded up to 256 bytes.
size_t gemm_workspace_bytes(const GemmProblem& problem, int splits, int small_m_variant = 3);

/// "weft::GemmConfig{.tile_m = 128, ...}": the config as the JIT prints it into generated code.
std::string format_gemm_config(const GemmConfig& config);

/// The kernel instantiation for a config with the default scheduler and no epilogue hook, e.g.
/// "weft::gemm::gemm_kernel<C, weft::gemm::PersistentScheduler<C>, weft::gemm::NoEpilogueHook>".
std::string gemm_kernel_instantiation(const GemmConfig& config);

/// The kernel instantiation for a config with any scheduler template and hook type, e.g.
/// gemm_kernel_instantiation(c, "weft::gemm::ChunkWaitScheduler", "weft::gemm::TileSignalHook") ->
/// "weft::gemm::gemm_kernel<C, weft::gemm::ChunkWaitScheduler<C>, weft::gemm::TileSignalHook>".
std::string gemm_kernel_instantiation(const GemmConfig& config, const std::string& scheduler_template,
                                      const std::string& hook);

/// The small-M kernel instantiation, e.g. "weft::gemm::gemv_kernel<2, weft::DType::kBF16, weft::DType::kF32, 1>"
/// (the fourth argument is the n8 tiles per warp of `variant`: 1 for variant 1, 4 for variant 0; variant 2 adds
/// its ring depth: "weft::gemm::gemv_kernel<1, weft::DType::kBF16, weft::DType::kBF16, 1, 6>"; both from
/// gemv_shape(variant, m_tiles)).
std::string gemv_kernel_instantiation(int m_tiles, DType in_dtype, DType out_dtype, int variant);

/// The weft::jit specs of the tiled kernel (header "gemm/gemm_sm90.cuh"), of the small-M kernel
/// ("gemm/gemv_sm90.cuh") and of the epoch-advance kernel ("gemm/gemm_hooks.cuh"). `arch` as KernelSpec::arch
/// (empty: WEFT_JIT_ARCH, else the current device's).
jit::KernelSpec gemm_kernel_spec(const GemmConfig& config, const std::string& arch = "");
jit::KernelSpec gemm_kernel_spec(const GemmConfig& config, const std::string& scheduler_template,
                                 const std::string& hook, const std::string& arch = "");
jit::KernelSpec gemv_kernel_spec(int m_tiles, DType in_dtype, DType out_dtype, int variant,
                                 const std::string& arch = "");
jit::KernelSpec gemm_advance_epoch_spec(const std::string& arch = "");

/// Every kernel weft::ops::gemm may launch: each valid candidate config for every dtype pair (bf16->bf16,
/// bf16->f32, f16->f16, f16->f32) and B layout, each small-M kernel (M tiles 1..4, variants 0, 1, 2), and the
/// epoch-advance kernel. register_gemm_aot_specs() hands them to weft::jit::register_aot_spec (once per
/// process), so that `weft-compile --builtin` warms them.
std::vector<jit::KernelSpec> gemm_aot_specs();
void register_gemm_aot_specs();

/// Advances a device epoch word (a uint64 counter, SignalValueMode::kEpoch of the GEMM's hooks) by one, in
/// stream order on `stream` (one tiny JIT kernel; capturable in a CUDA graph, where each replay advances it).
void gemm_advance_epoch(uint64_t* epoch, cudaStream_t stream);

// ---- autotuning ----------------------------------------------------------------------------------------

/// One config the autotuner may pick for a call: a stable name and the plan it stands for.
struct GemmCandidate {
    std::string name;  ///< gemm_candidate_name(config), or "small_m_v<variant>" for the small-M path
    GemmPlan plan;
};

/// "128x256x64_s4_c1x1": tile, stages, cluster (raster/dtypes/layout are fixed by the call). Used as the
/// autotuner's candidate name, so WEFT_AUTOTUNE_FORCE=gemm=<this> forces the config.
std::string gemm_candidate_name(const GemmConfig& config);

/// The candidates for a call, the heuristic's pick (plan_gemm) first so that it wins ties and is what a
/// disabled autotuner returns: the other valid tiled candidates that fit the SM budget, and, where the
/// small-M path is allowed for this call (gemm_allows_small_m), the three small-M variants (2, 1, 0).
std::vector<GemmCandidate> gemm_tune_candidates(const GemmProblem& problem, int num_sms, const GemmOptions& options);

/// The autotuner's problem key: shape, dtypes, layout, SM budget and the options that change the candidates,
/// e.g. "m=4096,n=4096,k=4096,in=bf16,out=bf16,b=nk,sms=132,small_m=0,splits=0" (small_m: whether
/// gemm_allows_small_m, i.e. whether the small-M variants are candidates).
std::string gemm_tune_problem(const GemmProblem& problem, int num_sms, const GemmOptions& options);

/// Whether a call asks the autotuner (pure rule): never with options.config; WEFT_AUTOTUNE_FORCE naming gemm
/// (`env_force_names_gemm`) always; otherwise when options.autotune or WEFT_AUTOTUNE (`env_autotune`, nullopt
/// when unset) is true, unless WEFT_AUTOTUNE is false.
bool gemm_wants_autotuner(const GemmOptions& options, std::optional<bool> env_autotune, bool env_force_names_gemm);

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
    std::string candidate;  ///< the candidate's name (gemm_candidate_name, small_m_v<variant>)
    GemmChoice origin = GemmChoice::kHeuristic;
};

/// Enqueues one run of `plan` on a stream (the autotuner times it).
using GemmRunPlan = std::function<void(const GemmPlan& plan, cudaStream_t stream)>;
/// Called once with the candidates right before they are timed (e.g. to compile them in parallel).
using GemmPrepareCandidates = std::function<void(const std::vector<GemmCandidate>& candidates)>;

/// The plan of a call: plan_gemm's, or the autotuner's pick among gemm_tune_candidates (decision logic above;
/// the tuner is options.autotuner or weft::jit::autotuner(), called with one rank and TuneKey{"gemm",
/// gemm_tune_problem, 1, arch}). `capturing`: the stream is being captured, so nothing may be timed (a cached
/// decision is used, else the heuristic). Reads WEFT_AUTOTUNE and WEFT_AUTOTUNE_FORCE.
GemmSelection select_gemm_plan(const GemmProblem& problem, int num_sms, const GemmOptions& options,
                               const std::string& arch, const GemmRunPlan& run, cudaStream_t stream,
                               bool capturing = false, const GemmPrepareCandidates& prepare = {});

/// The plan weft::ops::gemm uses for these arguments on the current device (may autotune: see GemmOptions).
GemmSelection select_gemm(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout,
                          cudaStream_t stream, const GemmOptions& options = {});

namespace detail {

/// Host-side tensor maps of one launch (A, B, D), built with the driver's cuTensorMapEncodeTiled.
struct GemmTensorMaps {
    CUtensorMap a;
    CUtensorMap b;
    CUtensorMap d;
};

/// Builds the tensor maps a gemm_kernel<config> expects for these (validated) views.
GemmTensorMaps make_gemm_tensor_maps(const GemmConfig& config, const TensorView& a, const TensorView& b,
                                     const TensorView& d);

/// The map a gemm_kernel<config> stores D through (the `d` of make_gemm_tensor_maps), for a (validated) view.
CUtensorMap make_gemm_store_map(const GemmConfig& config, const TensorView& d);

/// The kernel's run-time arguments for these (validated) views.
GemmArgs make_gemm_args(const TensorView& a, const TensorView& d, uint64_t timeout_ns);

/// One launch of the small-M kernel of `plan` (path kSmallM) for (validated) views: its arguments (the
/// caller sets counters and partials when plan.small_m_splits > 1), its tensor maps (variant 3; zeros for
/// the others, which take and ignore them), grid and dynamic shared memory. Launch with (args, maps).
struct GemvLaunch {
    GemvArgs args{};
    struct Maps {
        CUtensorMap a;
        CUtensorMap b;
    } maps{};
    dim3 grid;
    dim3 block;
    int smem_bytes = 0;
};
GemvLaunch make_gemv_launch(const GemmPlan& plan, const TensorView& a, const TensorView& b, const TensorView& d);

/// The pipeline-wait bound: options.timeout, else WEFT_TIMEOUT_MS, else 10 s.
uint64_t gemm_timeout_ns(const GemmOptions& options);

/// Launches a tiled-kernel instantiation (host stub `func`) with its scheduler and hook parameters, with
/// the cluster shape and shared memory of `config` and `grid` CTAs.
void launch_gemm_kernel(const void* func, const GemmConfig& config, const GemmTensorMaps& maps, const GemmArgs& args,
                        int grid, const void* sched_params, const void* hook_params, cudaStream_t stream);

/// Kernel registry: the one place where a config becomes a compiled function. Today it holds instances
/// compiled ahead of time by nvcc (kernels/gemm/gemm_instances.cuh registers them); when weft::jit lands,
/// a miss compiles the instantiation string through it instead of failing.
void register_gemm_kernel(const GemmConfig& config, const void* func);
const void* find_gemm_kernel(const GemmConfig& config);
void register_gemv_kernel(int m_tiles, DType in_dtype, DType out_dtype, int variant, const void* func);
const void* find_gemv_kernel(int m_tiles, DType in_dtype, DType out_dtype, int variant);

/// The JIT kernel of a spec (compiled or from the cache, loaded into the current context), memoised per
/// (device, spec) so that repeated calls cost a map lookup.
jit::Kernel& gemm_jit_kernel(const jit::KernelSpec& spec);

/// Launches a tiled-kernel instantiation loaded through weft::jit (any scheduler and hook; their Params passed
/// as raw bytes) with the cluster shape and shared memory of `config` and `grid` CTAs. `grid` must be a
/// positive multiple of the cluster size.
void launch_gemm_jit(const jit::Kernel& kernel, const GemmConfig& config, const GemmTensorMaps& maps,
                     const GemmArgs& args, int grid, const void* sched_params, size_t sched_bytes,
                     const void* hook_params, size_t hook_bytes, cudaStream_t stream);

template <class SchedParams, class HookParams>
void launch_gemm_jit(const jit::Kernel& kernel, const GemmConfig& config, const GemmTensorMaps& maps,
                     const GemmArgs& args, int grid, const SchedParams& sched, const HookParams& hook,
                     cudaStream_t stream) {
    static_assert(std::is_trivially_copyable_v<SchedParams> && std::is_trivially_copyable_v<HookParams>,
                  "kernel parameters are copied byte-wise");
    launch_gemm_jit(kernel, config, maps, args, grid, &sched, sizeof(SchedParams), &hook, sizeof(HookParams), stream);
}

/// The largest grid (a multiple of the cluster size, at most `grid`) whose clusters fit on the device at once
/// for this JIT kernel (cudaOccupancyMaxActiveClusters; GPC boundaries leave some SMs unpaired). `grid`
/// unchanged for cluster-free configs, or when the query fails (logged: launches still work, in waves).
int fit_gemm_jit_grid(const jit::Kernel& kernel, const GemmConfig& config, int grid);

}  // namespace detail
}  // namespace weft::ops
