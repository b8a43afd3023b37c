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

// Throws weft::Error naming `what` unless is_valid(config), saying what is wrong.
void check_gemv_config(const GemvConfig& c, const char* what) {
    WEFT_CHECK(c.variant == GemvVariant::kTmaRing || c.variant == GemvVariant::kBulkRows ||
                   c.variant == GemvVariant::kTmaWgmma,
               what << ": the variant must be GemvVariant::kTmaRing (3), kBulkRows (4) or kTmaWgmma (5), got "
                    << static_cast<int>(c.variant));
    WEFT_CHECK((c.in_dtype == DType::kBF16 || c.in_dtype == DType::kF16) &&
                   (c.out_dtype == DType::kBF16 || c.out_dtype == DType::kF16 || c.out_dtype == DType::kF32),
               what << ": no kernel for " << dtype_name(c.in_dtype) << " -> " << dtype_name(c.out_dtype)
                    << " (bf16 or f16 in; bf16, f16 or f32 out)");
    WEFT_CHECK(c.variant != GemvVariant::kBulkRows || c.m_tiles == 1,
               what << ": variant 4 (bulk-copied rows) serves M <= " << kGemvGroupsMaxM
                    << " (m_tiles 1), got m_tiles " << c.m_tiles);
    const int max_m = c.variant == GemvVariant::kTmaWgmma ? kGemvWgmmaMaxM : kGemvMaxM;
    WEFT_CHECK(c.m_tiles >= 1 && c.m_tiles <= max_m / 16, what << ": m_tiles must be in [1, " << max_m / 16 << "], got "
                                                               << c.m_tiles << " (variant "
                                                               << static_cast<int>(c.variant) << ")");
    WEFT_CHECK(is_valid(c), what << ": invalid config " << format_gemv_config(c));
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
    if (c.splits != 1) os << ", .splits = " << c.splits;  // omitted when 1: kernels without split-K keep their names
    if (c.swap_ab) os << ", .swap_ab = true";             // omitted when false: unswapped kernels keep their names
    os << "}";
    return os.str();
}

std::string gemm_kernel_instantiation(const GemmConfig& c) {
    const std::string cfg = format_gemm_config(c);
    return "weft::kernels::gemm::gemm_kernel<" + cfg + ", weft::kernels::gemm::PersistentScheduler<" + cfg +
           ">, weft::kernels::gemm::NoEpilogueHook>";
}

std::string gemm_kernel_instantiation(const GemmConfig& c, const std::string& scheduler_template,
                                      const std::string& hook) {
    WEFT_CHECK(!scheduler_template.empty() && !hook.empty(),
               "gemm_kernel_instantiation: the scheduler template and the hook type must be named, got '"
                   << scheduler_template << "' and '" << hook << "'");
    const std::string cfg = format_gemm_config(c);
    return "weft::kernels::gemm::gemm_kernel<" + cfg + ", " + scheduler_template + "<" + cfg + ">, " + hook + ">";
}

std::string format_gemv_config(const GemvConfig& c) {
    const char* variant = c.variant == GemvVariant::kTmaRing    ? "weft::GemvVariant::kTmaRing"
                          : c.variant == GemvVariant::kBulkRows ? "weft::GemvVariant::kBulkRows"
                          : c.variant == GemvVariant::kTmaWgmma ? "weft::GemvVariant::kTmaWgmma"
                                                                : "weft::GemvVariant(?)";
    std::ostringstream os;
    os << "weft::GemvConfig{.variant = " << variant << ", .m_tiles = " << c.m_tiles
       << ", .in_dtype = " << dtype_enum_name(c.in_dtype) << ", .out_dtype = " << dtype_enum_name(c.out_dtype) << "}";
    return os.str();
}

std::string gemv_kernel_instantiation(const GemvConfig& config) {
    check_gemv_config(config, "gemv_kernel_instantiation");
    const char* kernel = config.variant == GemvVariant::kBulkRows   ? "weft::kernels::gemm::gemv_rows_kernel<"
                         : config.variant == GemvVariant::kTmaWgmma ? "weft::kernels::gemm::gemv_wgmma_kernel<"
                                                                    : "weft::kernels::gemm::gemv_tma_kernel<";
    return std::string(kernel) + format_gemv_config(config) + ">";
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

jit::KernelSpec gemv_kernel_spec(const GemvConfig& config, const std::string& arch) {
    jit::KernelSpec spec;
    spec.header = config.variant == GemvVariant::kBulkRows   ? "gemm/gemv_rows_sm90.cuh"
                  : config.variant == GemvVariant::kTmaWgmma ? "gemm/gemv_wgmma_sm90.cuh"
                                                             : "gemm/gemv_tma_sm90.cuh";
    spec.instantiation = gemv_kernel_instantiation(config);
    spec.description = "gemm small-M variant " + std::to_string(static_cast<int>(config.variant)) + " m_tiles " +
                       std::to_string(config.m_tiles) + " " + dtype_name(config.in_dtype) + "->" +
                       dtype_name(config.out_dtype);
    spec.arch = arch;
    return spec;
}

jit::KernelSpec gemm_advance_epoch_spec(const std::string& arch) {
    jit::KernelSpec spec;
    spec.header = "gemm/gemm_hooks.cuh";
    spec.instantiation = "weft::kernels::gemm::gemm_advance_epoch_kernel<0>";
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
            for (const GemmConfig& c : gemm_split_k_configs(in, out, layout)) specs.push_back(gemm_kernel_spec(c));
        }
        // The swapped configs the op's rule can pick (gemm_swap_ab_rule: kGemmSwapRuleMinM < M <= 512, B [N,K];
        // kGemmSwapRuleMinRows to 256 rows).
        for (int tile_m = kGemmSwapRuleMinRows; tile_m <= 256; tile_m += kGemmSwapStoreRows) {
            specs.push_back(gemm_kernel_spec(gemm_swap_ab_config_of(tile_m, in, out)));
        }
        for (int m_tiles = 1; m_tiles <= kGemvMaxM / 16; ++m_tiles) {
            specs.push_back(gemv_kernel_spec(
                GemvConfig{.variant = GemvVariant::kTmaRing, .m_tiles = m_tiles, .in_dtype = in, .out_dtype = out}));
        }
        // kBulkRows serves M <= 16 only: one row tile.
        specs.push_back(gemv_kernel_spec(
            GemvConfig{.variant = GemvVariant::kBulkRows, .m_tiles = 1, .in_dtype = in, .out_dtype = out}));
        // kTmaWgmma: the op's own pick for some M in 17..small_m_wgmma_max_m (gemm_prefers_wgmma_small_m, any dtype
        // pair), an autotuner candidate and a forced variant up to M = 256: every row-tile count.
        for (int m_tiles = 1; m_tiles <= kGemvWgmmaMaxM / 16; ++m_tiles) {
            specs.push_back(gemv_kernel_spec(
                GemvConfig{.variant = GemvVariant::kTmaWgmma, .m_tiles = m_tiles, .in_dtype = in, .out_dtype = out}));
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
