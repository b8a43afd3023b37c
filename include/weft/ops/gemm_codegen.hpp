// SPDX-License-Identifier: MIT
// Code generation for weft::ops::gemm: configs printed with designated initialisers, kernel instantiation
// strings, the weft::jit specs of every GEMM kernel, and the ahead-of-time spec list (pure text; no GPU).
#pragma once

#include <string>
#include <vector>

#include "weft/common/gemm_config.hpp"
#include "weft/common/gemv_config.hpp"
#include "weft/jit/compiler.hpp"

namespace weft::ops {

/// "weft::GemmConfig{.tile_m = 128, ...}": the config as the JIT prints it into generated code.
std::string format_gemm_config(const GemmConfig& config);

/// The kernel instantiation for a config with the default scheduler and no epilogue hook, e.g.
/// "weft::kernels::gemm::gemm_kernel<C, weft::kernels::gemm::PersistentScheduler<C>,
///                                   weft::kernels::gemm::NoEpilogueHook>".
std::string gemm_kernel_instantiation(const GemmConfig& config);

/// The kernel instantiation for a config with any scheduler template and hook type, e.g.
/// gemm_kernel_instantiation(c, "weft::kernels::gemm::ChunkWaitScheduler", "weft::kernels::gemm::TileSignalHook") ->
/// "weft::kernels::gemm::gemm_kernel<C, weft::kernels::gemm::ChunkWaitScheduler<C>,
///                                   weft::kernels::gemm::TileSignalHook>".
std::string gemm_kernel_instantiation(const GemmConfig& config, const std::string& scheduler_template,
                                      const std::string& hook);

/// "weft::GemvConfig{.variant = weft::GemvVariant::kTmaRing, .m_tiles = 1, ...}": the small-M config as the JIT
/// prints it into generated code.
std::string format_gemv_config(const GemvConfig& config);

/// The small-M kernel instantiation: "weft::kernels::gemm::gemv_tma_kernel<CFG>" (kTmaRing),
/// "weft::kernels::gemm::gemv_rows_kernel<CFG>" (kBulkRows) or "weft::kernels::gemm::gemv_wgmma_kernel<CFG>"
/// (kTmaWgmma), CFG = format_gemv_config(config). Throws weft::Error naming what is wrong unless is_valid(config).
std::string gemv_kernel_instantiation(const GemvConfig& config);

/// The weft::jit specs of the tiled kernel (header "gemm/gemm_sm90.cuh"), of the small-M kernels
/// ("gemm/gemv_tma_sm90.cuh", "gemm/gemv_rows_sm90.cuh", "gemm/gemv_wgmma_sm90.cuh") and of the epoch-advance kernel
/// ("gemm/gemm_hooks.cuh").
/// `arch` as KernelSpec::arch (empty: WEFT_JIT_ARCH, else the current device's).
jit::KernelSpec gemm_kernel_spec(const GemmConfig& config, const std::string& arch = "");
jit::KernelSpec gemm_kernel_spec(const GemmConfig& config, const std::string& scheduler_template,
                                 const std::string& hook, const std::string& arch = "");
jit::KernelSpec gemv_kernel_spec(const GemvConfig& config, const std::string& arch = "");
jit::KernelSpec gemm_advance_epoch_spec(const std::string& arch = "");

/// Every kernel weft::ops::gemm may launch: each valid candidate config and split-K config (gemm_split_k_configs) for
/// every dtype pair (bf16->bf16, bf16->f32, f16->f16, f16->f32) and B layout, each small-M kernel (kTmaRing with
/// m_tiles 1..4, kBulkRows; kTmaWgmma with m_tiles 1..16 for bf16->bf16 only), and the epoch-advance kernel.
/// register_gemm_aot_specs() hands them to weft::jit::register_aot_spec (once per process), so that `weft-compile
/// --builtin` warms them.
std::vector<jit::KernelSpec> gemm_aot_specs();
void register_gemm_aot_specs();

}  // namespace weft::ops
