// SPDX-License-Identifier: MIT
// Launch pieces of weft::ops::gemm that the fused ops, tests and benchmarks reuse: tensor maps, kernel
// arguments, the small-M launch geometry, JIT kernel lookup and the launch of a gemm_kernel instantiation.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "weft/common/gemm_config.hpp"
#include "weft/common/gemv_config.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/jit/kernel.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::ops::detail {

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
/// caller sets counters and partials when plan.workspace_bytes > 0), its tensor maps (kTmaRing, kTmaWgmma; zeros for
/// kBulkRows, which takes and ignores them), grid, block, dynamic shared memory and cluster. Launch with (args, maps).
struct GemvLaunch {
    GemvArgs args{};
    struct Maps {
        CUtensorMap a;
        CUtensorMap b;
    } maps{};
    dim3 grid;
    dim3 block;
    int smem_bytes = 0;
    /// kTmaWgmma with split-K: clusters of 1 x small_m_splits CTAs (a column block's splits); else none.
    std::optional<dim3> cluster;
};
GemvLaunch make_gemv_launch(const GemmPlan& plan, const TensorView& a, const TensorView& b, const TensorView& d);

/// The pipeline-wait bound: options.timeout, else WEFT_TIMEOUT_MS, else 10 s.
uint64_t gemm_timeout_ns(const GemmOptions& options);

/// The JIT kernel of a spec (compiled or from the cache, loaded into the current context), memoised per
/// (device, spec) so that repeated calls cost a map lookup.
jit::Kernel& gemm_jit_kernel(const jit::KernelSpec& spec);

/// Launches `kernel`, a gemm_kernel<config, Scheduler<config>, Hook> instantiation loaded through weft::jit
/// (gemm_jit_kernel(gemm_kernel_spec(config, "ns::Scheduler", "ns::Hook")), or any kernel with gemm_kernel's
/// parameters, such as a fused op's), on `stream`: `grid` CTAs of
/// kGemmThreads threads in clusters of config's cluster shape, config's dynamic shared memory
/// (gemm_smem_plan), and the kernel's parameters (maps.a, maps.b, maps.d, args, the scheduler's Params, the hook's
/// Params). `grid` must be a positive multiple of the cluster size (fit_gemm_grid bounds it to the clusters that fit
/// at once). The Params are copied byte-wise; their sizes are checked against the kernel's parameters. The one
/// launch of a tiled GEMM: weft::ops::gemm and the fused ops call it.
void launch_gemm_kernel(const jit::Kernel& kernel, const GemmConfig& config, const GemmTensorMaps& maps,
                        const GemmArgs& args, int grid, const void* sched_params, size_t sched_bytes,
                        const void* hook_params, size_t hook_bytes, cudaStream_t stream);

template <class SchedParams, class HookParams>
void launch_gemm_kernel(const jit::Kernel& kernel, const GemmConfig& config, const GemmTensorMaps& maps,
                        const GemmArgs& args, int grid, const SchedParams& sched, const HookParams& hook,
                        cudaStream_t stream) {
    static_assert(std::is_trivially_copyable_v<SchedParams> && std::is_trivially_copyable_v<HookParams>,
                  "kernel parameters are copied byte-wise");
    launch_gemm_kernel(kernel, config, maps, args, grid, &sched, sizeof(SchedParams), &hook, sizeof(HookParams),
                       stream);
}

/// The largest grid (a multiple of the cluster size, at most `grid`) whose clusters of `config` fit on the current
/// device at once for `kernel` (the driver's occupancy query, with the dynamic shared memory limit raised through
/// jit::Kernel::allow_dynamic_smem; GPC boundaries leave some SMs unpaired), memoised per (device, kernel). `grid`
/// unchanged for cluster-free configs, or when the query fails (logged: launches still work, in waves).
int fit_gemm_grid(const jit::Kernel& kernel, const GemmConfig& config, int grid);

}  // namespace weft::ops::detail
