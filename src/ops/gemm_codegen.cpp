// SPDX-License-Identifier: MIT
// Code generation for weft::ops::gemm: configs printed with designated initialisers, kernel instantiations,
// the weft::jit specs of every GEMM kernel and the ahead-of-time spec list.
#include "weft/ops/gemm_codegen.hpp"

#include <mutex>
#include <sstream>
#include <utility>

#include "weft/jit/aot.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/runtime/error.hpp"

namespace weft::ops {
namespace {

// Short config text for logs and spec descriptions: "gemm 128x256x64_s4_c1x1 bf16->bf16 B[N,K]" (plus the
// raster when it is not the default).
std::string describe_config(const GemmConfig& c) {
    std::ostringstream os;
    os << "gemm " << gemm_candidate_name(c) << " " << dtype_name(c.in_dtype) << "->" << dtype_name(c.out_dtype)
       << (c.b_layout == BLayout::kNK ? " B[N,K]" : " B[K,N]");
    if (c.raster != Raster::kAlongN || c.raster_group != 8) {
        os << " raster " << (c.raster == Raster::kAlongN ? "N" : "M") << "/" << c.raster_group;
    }
    return os.str();
}

}  // namespace

std::string format_gemm_config(const GemmConfig& c) {
    std::ostringstream os;
    os << "weft::GemmConfig{.tile_m = " << c.tile_m << ", .tile_n = " << c.tile_n << ", .tile_k = " << c.tile_k
       << ", .stages = " << c.stages << ", .cluster_m = " << c.cluster_m << ", .cluster_n = " << c.cluster_n
       << ", .raster = " << (c.raster == Raster::kAlongN ? "weft::Raster::kAlongN" : "weft::Raster::kAlongM")
       << ", .raster_group = " << c.raster_group
       << ", .b_layout = " << (c.b_layout == BLayout::kNK ? "weft::BLayout::kNK" : "weft::BLayout::kKN")
       << ", .in_dtype = " << dtype_enum_name(c.in_dtype) << ", .out_dtype = " << dtype_enum_name(c.out_dtype);
    if (c.pingpong) os << ", .pingpong = true";  // omitted when false: cooperative kernels keep their names
    os << "}";
    return os.str();
}

std::string gemm_kernel_instantiation(const GemmConfig& c) {
    const std::string cfg = format_gemm_config(c);
    return "weft::gemm::gemm_kernel<" + cfg + ", weft::gemm::PersistentScheduler<" + cfg +
           ">, weft::gemm::NoEpilogueHook>";
}

std::string gemm_kernel_instantiation(const GemmConfig& c, const std::string& scheduler_template,
                                      const std::string& hook) {
    WEFT_CHECK(!scheduler_template.empty() && !hook.empty(),
               "gemm_kernel_instantiation: the scheduler template and the hook type must be named, got '"
                   << scheduler_template << "' and '" << hook << "'");
    const std::string cfg = format_gemm_config(c);
    return "weft::gemm::gemm_kernel<" + cfg + ", " + scheduler_template + "<" + cfg + ">, " + hook + ">";
}

std::string gemv_kernel_instantiation(int m_tiles, DType in_dtype, DType out_dtype, int variant) {
    WEFT_CHECK(m_tiles >= 1 && m_tiles <= kGemvMaxM / 16,
               "gemv_kernel_instantiation: m_tiles must be in [1, " << kGemvMaxM / 16 << "], got " << m_tiles);
    WEFT_CHECK(variant >= 0 && variant < kGemvNumVariants,
               "gemv_kernel_instantiation: variant must be 0, 1, 2, 3 or 4, got " << variant);
    const GemvShape shape = gemv_shape(variant, m_tiles);
    WEFT_CHECK(!shape.whole_rows || m_tiles == 1,
               "gemv_kernel_instantiation: variant 4 (bulk-copied rows) serves M <= " << kGemvGroupsMaxM << " (m_tiles 1), got m_tiles "
                                                                              << m_tiles);
    WEFT_CHECK((in_dtype == DType::kBF16 || in_dtype == DType::kF16) &&
                   (out_dtype == DType::kBF16 || out_dtype == DType::kF16 || out_dtype == DType::kF32),
               "gemv_kernel_instantiation: no kernel for " << dtype_name(in_dtype) << " -> " << dtype_name(out_dtype)
                                                           << " (bf16 or f16 in; bf16, f16 or f32 out)");
    std::ostringstream os;
    os << "weft::gemm::gemv_kernel<" << m_tiles << ", " << dtype_enum_name(in_dtype) << ", "
       << dtype_enum_name(out_dtype) << ", "
       << shape.n_tiles;
    if (shape.stages > 0) os << ", " << shape.stages;  // variants 0 and 1 keep their four-argument names
    if (shape.bulk) os << ", true";
    if (shape.whole_rows) os << ", true";
    os << ">";
    return os.str();
}

jit::KernelSpec gemm_kernel_spec(const GemmConfig& config, const std::string& arch) {
    WEFT_CHECK(is_valid(config), "gemm: invalid config " << format_gemm_config(config));
    jit::KernelSpec spec;
    spec.header = "gemm/gemm_sm90.cuh";
    spec.instantiation = gemm_kernel_instantiation(config);
    spec.description = describe_config(config);
    spec.arch = arch;
    return spec;
}

jit::KernelSpec gemm_kernel_spec(const GemmConfig& config, const std::string& scheduler_template,
                                 const std::string& hook, const std::string& arch) {
    WEFT_CHECK(is_valid(config), "gemm: invalid config " << format_gemm_config(config));
    jit::KernelSpec spec;
    spec.header = "gemm/gemm_sm90.cuh";
    spec.instantiation = gemm_kernel_instantiation(config, scheduler_template, hook);
    spec.description = describe_config(config) + " " + scheduler_template + " " + hook;
    spec.arch = arch;
    return spec;
}

jit::KernelSpec gemv_kernel_spec(int m_tiles, DType in_dtype, DType out_dtype, int variant, const std::string& arch) {
    jit::KernelSpec spec;
    spec.header = "gemm/gemv_sm90.cuh";
    spec.instantiation = gemv_kernel_instantiation(m_tiles, in_dtype, out_dtype, variant);
    spec.description = "gemm small-M m_tiles " + std::to_string(m_tiles) + " " + dtype_name(in_dtype) + "->" +
                       dtype_name(out_dtype) + " variant " + std::to_string(variant);
    spec.arch = arch;
    return spec;
}

jit::KernelSpec gemm_advance_epoch_spec(const std::string& arch) {
    jit::KernelSpec spec;
    spec.header = "gemm/gemm_hooks.cuh";
    spec.instantiation = "weft::gemm::gemm_advance_epoch_kernel<0>";
    spec.description = "gemm hook epoch advance";
    spec.arch = arch;
    return spec;
}

std::vector<jit::KernelSpec> gemm_aot_specs() {
    std::vector<jit::KernelSpec> specs;
    const std::pair<DType, DType> pairs[] = {{DType::kBF16, DType::kBF16},
                                             {DType::kBF16, DType::kF32},
                                             {DType::kF16, DType::kF16},
                                             {DType::kF16, DType::kF32}};
    for (const auto& [in, out] : pairs) {
        for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
            for (const GemmConfig& c : gemm_candidate_configs(in, out, layout)) specs.push_back(gemm_kernel_spec(c));
        }
        for (int variant : {1, 0, 2, 3, 4}) {
            for (int m_tiles = 1; m_tiles <= (gemv_shape(variant, 1).whole_rows ? 1 : kGemvMaxM / 16); ++m_tiles) {
                specs.push_back(gemv_kernel_spec(m_tiles, in, out, variant));
            }
        }
    }
    specs.push_back(gemm_advance_epoch_spec());
    return specs;
}

void register_gemm_aot_specs() {
    static std::once_flag once;
    std::call_once(once, [] {
        for (auto& spec : gemm_aot_specs()) jit::register_aot_spec(std::move(spec));
    });
}

}  // namespace weft::ops
