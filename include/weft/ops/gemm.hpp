// SPDX-License-Identifier: MIT
// weft::ops::gemm: D = A * B on sm_90a (bf16/fp16 in, fp32 accumulate, bf16/fp16/fp32 out), plus the
// planning, validation and launch pieces that fused kernels and tests reuse.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "weft/common/gemm_config.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::ops {

/// Knobs of one gemm call. Defaults pick everything from the problem and the device.
struct GemmOptions {
    int sm_budget = 0;                 ///< CTAs of the persistent grid (SMs it may occupy); 0 = every SM
    std::optional<GemmConfig> config;  ///< force this tiled-kernel config (dtypes/layout must match the call)
    bool allow_small_m = true;         ///< let M <= 64 with B [N,K] take the split-K small-M path
    int small_m_splits = 0;            ///< force the small-M path's split count (0 = heuristic)
    int small_m_variant = 1;           ///< small-M kernel: 1 = 8 columns per warp, 1 KiB contiguous per row per
                                       ///< iteration (default: faster in the last measurement); 0 = 32 columns
                                       ///< per warp (see kernels/gemm/gemv_sm90.cuh)
    void* workspace = nullptr;         ///< small-M scratch of gemm_workspace_bytes, 256-byte aligned: split-K
                                       ///< counters first (zero-filled before the first use; each call leaves
                                       ///< them zero), then fp32 partials. Zero it again if N grows. nullptr =
                                       ///< weft's per-(device, stream) scratch. One call at a time per workspace.
    size_t workspace_bytes = 0;
    std::chrono::milliseconds timeout{0};  ///< bound on every pipeline wait; 0 = WEFT_TIMEOUT_MS or 10 s
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
};

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
    int small_m_variant = 1;     ///< kSmallM: which gemv_kernel (GemmOptions::small_m_variant)
    size_t workspace_bytes = 0;  ///< kSmallM: partial sums + counters
};

/// Checks a, b, d against each other and TMA's rules; throws weft::Error naming the offending argument.
GemmProblem validate_gemm_args(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout);

/// The tiled-kernel configs the heuristic (and the autotuner) choose from for this problem's types/layout.
std::vector<GemmConfig> gemm_candidate_configs(DType in_dtype, DType out_dtype, BLayout b_layout);

/// Picks the path and config. `num_sms` is the device's SM count (the budget's default).
GemmPlan plan_gemm(const GemmProblem& problem, int num_sms, const GemmOptions& options = {});

/// Scratch the small-M path needs for this problem with `splits` splits (0 when none): counters (one per
/// column block of the variant) first, then fp32 partials, each rounded up to 256 bytes.
size_t gemm_workspace_bytes(const GemmProblem& problem, int splits, int small_m_variant = 1);

/// "weft::GemmConfig{.tile_m = 128, ...}": the config as the JIT prints it into generated code.
std::string format_gemm_config(const GemmConfig& config);

/// The kernel instantiation for a config with the default scheduler and no epilogue hook, e.g.
/// "weft::gemm::gemm_kernel<C, weft::gemm::PersistentScheduler<C>, weft::gemm::NoEpilogueHook>".
std::string gemm_kernel_instantiation(const GemmConfig& config);

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

/// The kernel's run-time arguments for these (validated) views.
GemmArgs make_gemm_args(const TensorView& a, const TensorView& d, uint64_t timeout_ns);

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

}  // namespace detail
}  // namespace weft::ops
