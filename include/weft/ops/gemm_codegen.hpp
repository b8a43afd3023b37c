// SPDX-License-Identifier: MIT
// Code generation for weft::ops::gemm: configs printed with designated initialisers, kernel instantiation
// strings, the weft::jit specs of every GEMM kernel, and the ahead-of-time spec list (pure text; no GPU).
#pragma once

#include <string>
#include <vector>

#include "weft/common/gemm_config.hpp"
#include "weft/jit/compiler.hpp"

namespace weft::ops {

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

}  // namespace weft::ops
