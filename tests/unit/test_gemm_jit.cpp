// SPDX-License-Identifier: MIT
// Unit tests (CPU) of weft::ops::gemm's JIT path: the generated instantiations and specs, NVRTC compiling
// them through weft::jit (with cache hits on the second request), the ahead-of-time spec list, and the
// autotuning decision logic with a fake measure (no GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "support/jit_testing.hpp"
#include "weft/common/gemm_config.hpp"
#include "weft/common/gemv_config.hpp"
#include "weft/jit/autotune.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/runtime/error.hpp"

namespace weft::ops {
namespace {

using weft::testing::isolated_compiler_config;
using weft::testing::read_text_file;
using weft::testing::ScopedEnv;
using weft::testing::TempDir;

constexpr const char* kArch = "sm_90a";

// ---- code generation ------------------------------------------------------------------------------------

TEST(GemmJitCodegen, InstantiationIsTheConfigWithDesignatedInitialisers) {
    const GemmConfig c = gemm_candidate(1, DType::kBF16, DType::kF32, BLayout::kKN);  // 128x256, B pair
    const std::string cfg =
        "weft::GemmConfig{.tile_m = 128, .tile_n = 256, .tile_k = 64, .stages = 4, .cluster_m = 2, .cluster_n = 1, "
        ".raster = weft::Raster::kAlongN, .raster_group = 8, .b_layout = weft::BLayout::kKN, "
        ".in_dtype = weft::DType::kBF16, .out_dtype = weft::DType::kF32}";
    EXPECT_EQ(gemm_kernel_instantiation(c), "weft::kernels::gemm::gemm_kernel<" + cfg +
                                                ", weft::kernels::gemm::PersistentScheduler<" + cfg +
                                                ">, weft::kernels::gemm::NoEpilogueHook>");
    EXPECT_EQ(
        gemm_kernel_instantiation(c, "weft::kernels::gemm::ChunkWaitScheduler", "weft::kernels::gemm::TileSignalHook"),
        "weft::kernels::gemm::gemm_kernel<" + cfg + ", weft::kernels::gemm::ChunkWaitScheduler<" + cfg +
            ">, weft::kernels::gemm::TileSignalHook>");
    EXPECT_THROW(gemm_kernel_instantiation(c, "", "weft::kernels::gemm::NoEpilogueHook"), Error);

    // The small-M kernels: one per family, their GemvConfig printed with designated initialisers.
    const GemvConfig tma{
        .variant = GemvVariant::kTmaRing, .m_tiles = 4, .in_dtype = DType::kF16, .out_dtype = DType::kF32};
    EXPECT_EQ(format_gemv_config(tma),
              "weft::GemvConfig{.variant = weft::GemvVariant::kTmaRing, .m_tiles = 4, .in_dtype = weft::DType::kF16, "
              ".out_dtype = weft::DType::kF32}");
    EXPECT_EQ(gemv_kernel_instantiation(tma), "weft::kernels::gemm::gemv_tma_kernel<" + format_gemv_config(tma) + ">");
    const GemvConfig rows{.variant = GemvVariant::kBulkRows, .m_tiles = 1};
    EXPECT_EQ(
        gemv_kernel_instantiation(rows),
        "weft::kernels::gemm::gemv_rows_kernel<weft::GemvConfig{.variant = weft::GemvVariant::kBulkRows, .m_tiles = 1, "
        ".in_dtype = weft::DType::kBF16, .out_dtype = weft::DType::kBF16}>");
    auto throws_mentioning = [](const GemvConfig& bad, const std::string& needle) {
        try {
            (void)gemv_kernel_instantiation(bad);
            ADD_FAILURE() << "expected weft::Error mentioning '" << needle << "' for " << format_gemv_config(bad);
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
    };
    throws_mentioning(GemvConfig{.variant = GemvVariant::kBulkRows, .m_tiles = 2}, "serves M <= 16 (m_tiles 1)");
    throws_mentioning(GemvConfig{.m_tiles = 5}, "m_tiles must be in [1, 4], got 5");
    throws_mentioning(GemvConfig{.m_tiles = 0}, "m_tiles must be in [1, 4], got 0");
    throws_mentioning(GemvConfig{.variant = static_cast<GemvVariant>(2)},
                      "GemvVariant::kTmaRing (3), kBulkRows (4) or kTmaWgmma (5)");
    // Variant 5 (swapped wgmma): m_tiles 1..16 (M <= 256), its own kernel template.
    const GemvConfig wgmma{
        .variant = GemvVariant::kTmaWgmma, .m_tiles = 5, .in_dtype = DType::kF16, .out_dtype = DType::kF32};
    EXPECT_EQ(format_gemv_config(wgmma),
              "weft::GemvConfig{.variant = weft::GemvVariant::kTmaWgmma, .m_tiles = 5, .in_dtype = weft::DType::kF16, "
              ".out_dtype = weft::DType::kF32}");
    EXPECT_EQ(gemv_kernel_instantiation(wgmma),
              "weft::kernels::gemm::gemv_wgmma_kernel<" + format_gemv_config(wgmma) + ">");
    EXPECT_NO_THROW(gemv_kernel_instantiation(GemvConfig{.variant = GemvVariant::kTmaWgmma, .m_tiles = 16}));
    throws_mentioning(GemvConfig{.variant = GemvVariant::kTmaWgmma, .m_tiles = 17},
                      "m_tiles must be in [1, 16], got 17");
    throws_mentioning(GemvConfig{.variant = GemvVariant::kTmaWgmma, .m_tiles = 0}, "m_tiles must be in [1, 16], got 0");
    throws_mentioning(GemvConfig{.variant = GemvVariant::kTmaWgmma, .out_dtype = DType::kI32},
                      "no kernel for bf16 -> i32");
    throws_mentioning(GemvConfig{.in_dtype = DType::kF32}, "no kernel for f32 -> bf16");
    throws_mentioning(GemvConfig{.out_dtype = DType::kI32}, "no kernel for bf16 -> i32");
}

TEST(GemmJitCodegen, SpecsNameTheHeaderTheInstantiationAndTheArch) {
    const GemmConfig c = gemm_candidate(6, DType::kF16, DType::kF16, BLayout::kNK);
    const jit::KernelSpec tiled = gemm_kernel_spec(c, kArch);
    EXPECT_EQ(tiled.header, "gemm/gemm_sm90.cuh");
    EXPECT_EQ(tiled.instantiation, gemm_kernel_instantiation(c));
    EXPECT_EQ(tiled.arch, kArch);
    EXPECT_NE(tiled.description.find("128x128x64_s6_c1x1"), std::string::npos) << tiled.description;
    const std::string source = jit::Compiler::generate_source(tiled);
    EXPECT_NE(source.find("#include <gemm/gemm_sm90.cuh>"), std::string::npos) << source;

    const GemvConfig tma{.variant = GemvVariant::kTmaRing, .m_tiles = 2};
    const jit::KernelSpec gemv = gemv_kernel_spec(tma, kArch);
    EXPECT_EQ(gemv.header, "gemm/gemv_tma_sm90.cuh");
    EXPECT_EQ(gemv.instantiation, gemv_kernel_instantiation(tma));
    EXPECT_EQ(gemv.arch, kArch);
    const GemvConfig rows{.variant = GemvVariant::kBulkRows, .m_tiles = 1, .out_dtype = DType::kF32};
    EXPECT_EQ(gemv_kernel_spec(rows, kArch).header, "gemm/gemv_rows_sm90.cuh");
    EXPECT_EQ(gemv_kernel_spec(rows, kArch).instantiation, gemv_kernel_instantiation(rows));
    const GemvConfig wgmma{.variant = GemvVariant::kTmaWgmma, .m_tiles = 5};
    EXPECT_EQ(gemv_kernel_spec(wgmma, kArch).header, "gemm/gemv_wgmma_sm90.cuh");
    EXPECT_EQ(gemv_kernel_spec(wgmma, kArch).instantiation, gemv_kernel_instantiation(wgmma));
    EXPECT_NE(
        jit::Compiler::generate_source(gemv_kernel_spec(wgmma, kArch)).find("#include <gemm/gemv_wgmma_sm90.cuh>"),
        std::string::npos);
    EXPECT_EQ(gemm_advance_epoch_spec(kArch).instantiation, "weft::kernels::gemm::gemm_advance_epoch_kernel<0>");

    GemmConfig bad = c;
    bad.tile_n = 88;
    EXPECT_THROW(gemm_kernel_spec(bad, kArch), Error);
}

TEST(GemmJitCodegen, CandidateNamesAreStableAndDistinct) {
    EXPECT_EQ(gemm_candidate_name(gemm_candidate(0, DType::kBF16, DType::kBF16, BLayout::kNK)), "128x256x64_s4_c1x1");
    EXPECT_EQ(gemm_candidate_name(gemm_candidate(2, DType::kBF16, DType::kBF16, BLayout::kNK)), "128x256x64_s4_c1x2");
    EXPECT_EQ(gemm_candidate_name(gemm_candidate(7, DType::kF16, DType::kF32, BLayout::kKN)), "128x64x64_s8_c1x1");
    std::set<std::string> names;
    for (int i = 0; i < kGemmNumCandidates; ++i) {
        names.insert(gemm_candidate_name(gemm_candidate(i, DType::kBF16, DType::kBF16, BLayout::kNK)));
    }
    EXPECT_EQ(names.size(), static_cast<size_t>(kGemmNumCandidates));
}

TEST(GemmJitAot, SpecsCoverEveryCandidateAndSmallMKernelOnce) {
    const auto specs = gemm_aot_specs();
    std::set<std::string> instantiations;
    for (const auto& s : specs) {
        EXPECT_TRUE(instantiations.insert(s.instantiation).second) << "listed twice: " << s.instantiation;
        EXPECT_TRUE(s.arch.empty()) << "AOT specs take weft-compile's --arch";
    }
    size_t expected = 1;  // the epoch-advance kernel
    for (auto [in, out] : {std::pair{DType::kBF16, DType::kBF16}, std::pair{DType::kBF16, DType::kF32},
                           std::pair{DType::kF16, DType::kF16}, std::pair{DType::kF16, DType::kF32}}) {
        for (BLayout l : {BLayout::kNK, BLayout::kKN}) {
            for (const GemmConfig& c : gemm_candidate_configs(in, out, l)) {
                EXPECT_EQ(instantiations.count(gemm_kernel_instantiation(c)), 1u) << format_gemm_config(c);
                ++expected;
            }
            for (const GemmConfig& c : gemm_split_k_configs(in, out, l)) {
                EXPECT_EQ(c.splits > 1, true);
                EXPECT_EQ(instantiations.count(gemm_kernel_instantiation(c)), 1u) << format_gemm_config(c);
                ++expected;
            }
        }
        for (GemvVariant variant : {GemvVariant::kTmaRing, GemvVariant::kBulkRows}) {
            for (int m_tiles = 1; m_tiles <= (variant == GemvVariant::kBulkRows ? 1 : 4); ++m_tiles) {  // M <= 16 only
                const GemvConfig c{.variant = variant, .m_tiles = m_tiles, .in_dtype = in, .out_dtype = out};
                EXPECT_EQ(instantiations.count(gemv_kernel_instantiation(c)), 1u) << format_gemv_config(c);
                ++expected;
            }
        }
        // The swapped configs of the op's rule: every tile_m from kGemmSwapRuleMinRows to 256.
        for (int tile_m = kGemmSwapRuleMinRows; tile_m <= 256; tile_m += kGemmSwapStoreRows) {
            const GemmConfig c = gemm_swap_ab_config_of(tile_m, in, out);
            EXPECT_EQ(instantiations.count(gemm_kernel_instantiation(c)), 1u) << format_gemm_config(c);
            ++expected;
        }
        // Variant 5 (the op's pick for some M in 17..192 at any dtype pair, and the autotuner's): every row-tile count.
        for (int m_tiles = 1; m_tiles <= 16; ++m_tiles) {
            const GemvConfig c{.variant = GemvVariant::kTmaWgmma, .m_tiles = m_tiles, .in_dtype = in, .out_dtype = out};
            EXPECT_EQ(instantiations.count(gemv_kernel_instantiation(c)), 1u) << format_gemv_config(c);
            ++expected;
        }
    }
    EXPECT_EQ(specs.size(), expected);
    EXPECT_EQ(instantiations.count("weft::kernels::gemm::gemm_advance_epoch_kernel<0>"), 1u);
}

// ---- NVRTC through weft::jit ------------------------------------------------------------------------------

void expect_clean(const jit::CompileResult& r, const std::string& what) {
    ASSERT_TRUE(r.cubin && !r.cubin->empty()) << what;
    EXPECT_FALSE(r.lowered_name.empty()) << what;
    EXPECT_EQ(r.ptxas_info.spill_store_bytes, 0) << what << "\n" << r.log;
    EXPECT_EQ(r.ptxas_info.spill_load_bytes, 0) << what << "\n" << r.log;
    EXPECT_EQ(r.log.find("C75"), std::string::npos) << what << ": ptxas performance warning\n" << r.log;
}

TEST(GemmJitCompile, NvrtcCompilesTheOpsSpecsAndTheSecondRequestHitsTheCache) {
    TempDir cache("weft_gemm_jit_cache");
    const std::vector<jit::KernelSpec> specs = {
        gemm_kernel_spec(gemm_candidate(6, DType::kBF16, DType::kBF16, BLayout::kNK), kArch),
        gemm_kernel_spec(gemm_candidate(2, DType::kF16, DType::kF32, BLayout::kKN), kArch),  // cluster pair, [K,N]
        gemm_kernel_spec(gemm_candidate(6, DType::kBF16, DType::kBF16, BLayout::kNK),
                         "weft::kernels::gemm::ChunkWaitScheduler", "weft::kernels::gemm::TileSignalHook", kArch),
        gemv_kernel_spec(GemvConfig{.variant = GemvVariant::kTmaRing, .m_tiles = 2, .out_dtype = DType::kF32}, kArch),
        gemv_kernel_spec(GemvConfig{.variant = GemvVariant::kBulkRows, .m_tiles = 1}, kArch),
        gemm_advance_epoch_spec(kArch),
    };
    std::vector<std::string> keys;
    {
        jit::Compiler compiler(isolated_compiler_config(cache.path()));
        for (const auto& spec : specs) {
            const jit::CompileResult r = compiler.compile(spec);
            EXPECT_EQ(r.origin, jit::CompileResult::Origin::kCompiled) << spec.describe();
            expect_clean(r, spec.describe());
            keys.push_back(r.key);
        }
        for (size_t i = 0; i < specs.size(); ++i) {
            const jit::CompileResult again = compiler.compile(specs[i]);
            EXPECT_EQ(again.origin, jit::CompileResult::Origin::kMemory) << specs[i].describe();
            EXPECT_EQ(again.key, keys[i]);
        }
        EXPECT_EQ(compiler.stats().compiles, specs.size());
        EXPECT_EQ(compiler.stats().memory_hits, specs.size());
    }
    // A new process (a new Compiler) finds them on disk.
    jit::Compiler fresh(isolated_compiler_config(cache.path()));
    for (const auto& spec : specs) {
        EXPECT_EQ(fresh.compile(spec).origin, jit::CompileResult::Origin::kDisk) << spec.describe();
    }
    EXPECT_EQ(fresh.stats().compiles, 0u);
    // The tiled kernel's key covers its headers: the hook and config headers are hashed into it.
    const jit::CompileResult r = fresh.compile(specs[0]);
    std::set<std::string> headers(r.headers.begin(), r.headers.end());
    EXPECT_EQ(headers.count("gemm/gemm_sm90.cuh"), 1u);
    EXPECT_EQ(headers.count("weft/common/gemm_hook_params.hpp"), 1u);
    EXPECT_EQ(headers.count("weft/common/gemm_config.hpp"), 1u);
}

// ---- autotuning decision logic ----------------------------------------------------------------------------

TEST(GemmAutotuneRule, WhenTheAutotunerIsAsked) {
    GemmOptions plain, tune, forced_config;
    tune.autotune = true;
    forced_config.autotune = true;
    forced_config.config = gemm_candidate(0, DType::kBF16, DType::kBF16, BLayout::kNK);
    const std::optional<bool> unset, on = true, off = false;
    EXPECT_FALSE(gemm_wants_autotuner(plain, unset, false));
    EXPECT_TRUE(gemm_wants_autotuner(plain, on, false));
    EXPECT_FALSE(gemm_wants_autotuner(plain, off, false));
    EXPECT_TRUE(gemm_wants_autotuner(tune, unset, false));
    EXPECT_TRUE(gemm_wants_autotuner(tune, on, false));
    EXPECT_FALSE(gemm_wants_autotuner(tune, off, false)) << "WEFT_AUTOTUNE=0 wins over options.autotune";
    EXPECT_TRUE(gemm_wants_autotuner(plain, off, true)) << "forcing needs no timing";
    EXPECT_TRUE(gemm_wants_autotuner(plain, unset, true));
    EXPECT_FALSE(gemm_wants_autotuner(forced_config, on, true)) << "options.config wins";
    GemmOptions forced_variant;
    forced_variant.autotune = true;
    forced_variant.small_m_variant = GemvVariant::kTmaRing;
    EXPECT_FALSE(gemm_wants_autotuner(forced_variant, on, true)) << "a forced small-M variant is the caller's choice";
}

GemmProblem problem(int64_t m, int64_t n, int64_t k, BLayout layout = BLayout::kNK, DType in = DType::kBF16,
                    DType out = DType::kBF16) {
    GemmProblem p;
    p.m = m;
    p.n = n;
    p.k = k;
    p.b_layout = layout;
    p.in_dtype = in;
    p.out_dtype = out;
    return p;
}

TEST(GemmAutotuneCandidates, HeuristicFirstThenEveryValidConfigAndSmallMWhereItApplies) {
    const GemmProblem p = problem(4096, 4096, 4096);
    const auto cands = gemm_tune_candidates(p, 132, {});
    ASSERT_EQ(cands.size(), static_cast<size_t>(kGemmNumCandidates));
    EXPECT_EQ(cands[0].plan.config, plan_gemm(p, 132).config) << "the heuristic's pick comes first";
    std::set<std::string> names;
    for (const auto& c : cands) {
        EXPECT_TRUE(names.insert(c.name).second) << c.name;
        EXPECT_EQ(c.plan.path, GemmPath::kTiled);
        EXPECT_TRUE(is_valid(c.plan.config)) << c.name;
        EXPECT_EQ(c.name, gemm_candidate_name(c.plan.config));
        EXPECT_GT(c.plan.grid, 0);
        EXPECT_EQ(c.plan.grid % (c.plan.config.cluster_m * c.plan.config.cluster_n), 0) << c.name;
        EXPECT_LE(c.plan.grid, 132);
    }

    // M <= small_m_max_m (default 32) with B [N,K]: the small-M kernels that can serve it join (variant 4, bulk-copied
    // rows, only M <= 16 with contiguous B rows); the heuristic's pick (variant 3 here) still comes first. Variant 5
    // (swapped wgmma) joins last wherever M <= 256 with B [N,K], whatever small_m_max_m.
    constexpr int kSplitKVariants = 1;  // variant 3
    constexpr size_t kV5 = 1;
    // Few rows at N = K = 8192: every split-K config (its tiles fewer than the SMs) joins the tiled candidates.
    const size_t kTiled = kGemmNumCandidates + gemm_split_k_configs(DType::kBF16, DType::kBF16, BLayout::kNK).size();
    // The swapped configs (gemm_swap_ab_configs) join after the tiled and split-K ones, before the small-M kernels.
    const auto sw = [](const GemmProblem& q) { return gemm_swap_ab_configs(q, 132).size(); };
    const GemmProblem small = problem(16, 8192, 8192);
    const auto sc = gemm_tune_candidates(small, 132, {});
    ASSERT_EQ(sc.size(), kTiled + sw(small) + kSplitKVariants + kV5);
    EXPECT_EQ(sc[0].name, "small_m_v3");
    EXPECT_EQ(sc.back().name, "small_m_v5");
    EXPECT_EQ(sc.back().plan.small_m_variant, GemvVariant::kTmaWgmma);
    EXPECT_EQ(sc.back().plan.small_m_tiles, 1);
    EXPECT_EQ(sc[0].plan.path, GemmPath::kSmallM);
    std::set<std::string> small_names;
    for (const auto& c : sc) {
        if (c.plan.path != GemmPath::kSmallM) continue;
        small_names.insert(c.name);
        EXPECT_EQ(c.name, "small_m_v" + std::to_string(static_cast<int>(c.plan.small_m_variant)));
    }
    EXPECT_EQ(small_names, (std::set<std::string>{"small_m_v3", "small_m_v5"}));
    GemmProblem decode = problem(1, 8192, 8192);
    decode.b_rows_contiguous = true;
    const auto dc = gemm_tune_candidates(decode, 132, {});
    ASSERT_EQ(dc.size(), kTiled + sw(decode) + 2 + kV5);
    EXPECT_EQ(dc[0].name, "small_m_v4");  // the heuristic's pick for decode with contiguous B rows
    EXPECT_EQ(dc[kTiled + sw(decode) + 1].name, "small_m_v3");
    EXPECT_EQ(dc[kTiled + sw(decode) + 2].name, "small_m_v5");
    GemmOptions no_small;
    no_small.allow_small_m = false;
    EXPECT_EQ(gemm_tune_candidates(small, 132, no_small).size(), kTiled + sw(small));
    EXPECT_EQ(gemm_tune_candidates(problem(16, 8192, 8192, BLayout::kKN), 132, {}).size(),
              gemm_candidate_configs(DType::kBF16, DType::kBF16, BLayout::kKN).size() +
                  gemm_split_k_configs(DType::kBF16, DType::kBF16, BLayout::kKN).size());
    GemmOptions never_split;
    never_split.split_k = 1;
    never_split.allow_small_m = false;
    EXPECT_EQ(gemm_tune_candidates(small, 132, never_split).size(), kGemmNumCandidates + sw(small));
    // K = 1024: 16 k-blocks, so only the 2-way splits get their 8 k-blocks each; K = 512: none.
    EXPECT_EQ(gemm_tune_candidates(problem(64, 8192, 1024), 132, no_small).size(),
              kGemmNumCandidates + 4 + sw(problem(64, 8192, 1024)));
    EXPECT_EQ(gemm_tune_candidates(problem(64, 8192, 512), 132, no_small).size(),
              kGemmNumCandidates + sw(problem(64, 8192, 512)));
    EXPECT_GE(sw(problem(64, 8192, 512)), 3u);  // 32-row tiles x 64 with and without the pair, 64-row ping-pong
    // M = 33..64: only where small_m_max_m lets the small-M path serve it (as plan_gemm). The heuristic's own pick
    // here is variant 5 (gemm_prefers_wgmma_small_m): with small_m_wgmma_max_m = 0 the picks of variant 3 / the tiled
    // kernel show.
    for (int64_t m : {33, 40, 64}) {
        SCOPED_TRACE("M = " + std::to_string(m));
        const GemmProblem mid = problem(m, 8192, 8192);
        const auto dflt = gemm_tune_candidates(mid, 132, {});
        ASSERT_EQ(dflt.size(), kTiled + sw(mid) + kV5) << "the default small_m_max_m is 32";
        EXPECT_EQ(dflt[0].name, "small_m_v5");
        GemmOptions up_to_64;
        up_to_64.small_m_max_m = 64;
        up_to_64.small_m_wgmma_max_m = 0;
        const auto mc = gemm_tune_candidates(mid, 132, up_to_64);
        ASSERT_EQ(mc.size(), kTiled + sw(mid) + kSplitKVariants + kV5);
        EXPECT_EQ(mc[0].name, "small_m_v3");
        GemmOptions up_to_32;
        up_to_32.small_m_max_m = 32;
        up_to_32.small_m_wgmma_max_m = 0;
        const auto mc32 = gemm_tune_candidates(mid, 132, up_to_32);
        ASSERT_EQ(mc32.size(), kTiled + sw(mid) + kV5);
        EXPECT_EQ(mc32[0].plan.path, GemmPath::kTiled);
        EXPECT_EQ(mc32[0].plan.config, plan_gemm(mid, 132, up_to_32).config);
        for (size_t i = 0; i + 1 < mc32.size(); ++i) EXPECT_EQ(mc32[i].plan.path, GemmPath::kTiled) << mc32[i].name;
        EXPECT_EQ(mc32.back().name, "small_m_v5");
        GemmOptions up_to_48;
        up_to_48.small_m_max_m = 48;
        EXPECT_EQ(gemm_tune_candidates(mid, 132, up_to_48).size(),
                  kTiled + sw(mid) + (m <= 48 ? kSplitKVariants : 0) + kV5);
    }
    // Variant 5 up to M = 256 (m_tiles 16) with B [N,K], never beyond, nor with B [K,N]; with small_m_variant forcing
    // it, it is the heuristic's pick (first) and not listed twice.
    for (int64_t m : {65, 77, 200, 256, 257, 512}) {
        SCOPED_TRACE("M = " + std::to_string(m));
        const auto v5_cands = gemm_tune_candidates(problem(m, 4096, 4096), 132, {});
        size_t v5 = 0;
        for (const auto& c : v5_cands) {
            if (c.name != "small_m_v5") continue;
            ++v5;
            EXPECT_EQ(c.plan.path, GemmPath::kSmallM);
            EXPECT_EQ(c.plan.small_m_tiles, (m + 15) / 16);
            EXPECT_EQ(c.plan.small_m_splits, 2) << "N = K = 4096 on 132 SMs: 64 column blocks x 2";
        }
        EXPECT_EQ(v5, m <= 256 ? 1u : 0u);
        for (const auto& c : gemm_tune_candidates(problem(m, 4096, 4096, BLayout::kKN), 132, {})) {
            EXPECT_NE(c.name, "small_m_v5");
        }
        if (m > 256) continue;
        GemmOptions forced;
        forced.small_m_variant = GemvVariant::kTmaWgmma;
        const auto fc = gemm_tune_candidates(problem(m, 4096, 4096), 132, forced);
        EXPECT_EQ(fc[0].name, "small_m_v5");
        EXPECT_EQ(std::count_if(fc.begin(), fc.end(), [](const GemmCandidate& c) { return c.name == "small_m_v5"; }),
                  1);
    }

    // A budget of one SM leaves no room for cluster pairs.
    GemmOptions one_sm;
    one_sm.sm_budget = 1;
    for (const auto& c : gemm_tune_candidates(p, 132, one_sm)) {
        EXPECT_EQ(c.plan.config.cluster_m * c.plan.config.cluster_n, 1) << c.name;
        EXPECT_EQ(c.plan.grid, 1);
    }
}

TEST(GemmAutotuneCandidates, ProblemKeyNamesWhatChangesTheCandidates) {
    GemmOptions o;
    o.sm_budget = 66;
    EXPECT_EQ(gemm_tune_problem(problem(100, 200, 72, BLayout::kKN, DType::kF16, DType::kF32), 132, o),
              "m=100,n=200,k=72,in=f16,out=f32,b=kn,sms=66,small_m=0,splits=0");
    EXPECT_EQ(gemm_tune_problem(problem(8, 16, 32), 132, {}),
              "m=8,n=16,k=32,in=bf16,out=bf16,b=nk,sms=132,small_m=1,splits=0,v5=1");
    // small_m says whether the small-M variants are candidates (gemm_allows_small_m), so small_m_max_m counts; v5=1
    // where variant 5 is (M <= 256, B [N,K]).
    GemmOptions up_to_64;
    up_to_64.small_m_max_m = 64;
    EXPECT_EQ(gemm_tune_problem(problem(40, 16, 32), 132, up_to_64),
              "m=40,n=16,k=32,in=bf16,out=bf16,b=nk,sms=132,small_m=1,splits=0,v5=1");
    EXPECT_EQ(gemm_tune_problem(problem(40, 16, 32), 132, {}),
              "m=40,n=16,k=32,in=bf16,out=bf16,b=nk,sms=132,small_m=0,splits=0,v5=1");
    EXPECT_EQ(gemm_tune_problem(problem(257, 16, 32), 132, {}),
              "m=257,n=16,k=32,in=bf16,out=bf16,b=nk,sms=132,small_m=0,splits=0");
    GemmOptions no_small;
    no_small.allow_small_m = false;
    EXPECT_EQ(gemm_tune_problem(problem(40, 16, 32), 132, no_small),
              "m=40,n=16,k=32,in=bf16,out=bf16,b=nk,sms=132,small_m=0,splits=0");
    EXPECT_NE(gemm_tune_problem(problem(8, 16, 32), 132, {}), gemm_tune_problem(problem(8, 16, 32), 114, {}));
}

// A fake measure: times by candidate name, counts calls, and runs the candidate (which records the plan).
struct FakeTimings {
    std::map<std::string, double> ms;  // missing names: 10 ms
    std::set<std::string> failing;
    int calls = 0;
    jit::TuneMeasure measure() {
        return [this](const jit::TuneCandidate& c, const jit::TuneOptions&) {
            ++calls;
            c.run(nullptr);
            if (failing.count(c.name)) throw Error("fake failure of " + c.name);
            auto it = ms.find(c.name);
            return it == ms.end() ? 10.0 : it->second;
        };
    }
};

jit::AutotuneConfig tuner_config(const TempDir* dir) {
    jit::AutotuneConfig config;
    config.enabled = true;
    if (dir != nullptr) config.cache_dir = dir->path();
    return config;
}

// No environment from the caller's shell leaks into these tests.
struct CleanAutotuneEnv {
    ScopedEnv autotune{"WEFT_AUTOTUNE", std::nullopt};
    ScopedEnv force{"WEFT_AUTOTUNE_FORCE", std::nullopt};
};

TEST(GemmAutotuneSelect, TunesOnceThenUsesTheCachedDecision) {
    CleanAutotuneEnv env;
    TempDir dir("weft_gemm_tune");
    FakeTimings fake;
    fake.ms["128x128x64_s6_c1x1"] = 1.0;
    fake.ms["128x256x64_s4_c1x1"] = 1.5;
    jit::Autotuner tuner(tuner_config(&dir), fake.measure());
    GemmOptions o;
    o.autotune = true;
    o.autotuner = &tuner;
    const GemmProblem p = problem(4096, 2048, 1024);
    std::vector<std::string> ran;  // what the run callback was handed
    const GemmRunPlan run = [&](const GemmPlan& plan, cudaStream_t) { ran.push_back(gemm_candidate_name(plan.config)); };
    int prepared = 0;
    const GemmPrepareCandidates prepare = [&](const std::vector<GemmCandidate>& c) {
        ++prepared;
        EXPECT_EQ(c.size(), gemm_tune_candidates(p, 132, o).size());
    };

    const GemmSelection first = select_gemm_plan(p, 132, o, kArch, run, nullptr, false, prepare);
    EXPECT_EQ(first.origin, GemmChoice::kTuned);
    EXPECT_EQ(first.candidate, "128x128x64_s6_c1x1");
    EXPECT_EQ(first.plan.config.tile_n, 128);
    EXPECT_EQ(first.plan.config.stages, 6);
    EXPECT_EQ(fake.calls, static_cast<int>(gemm_tune_candidates(p, 132, o).size())) << "every candidate timed once";
    EXPECT_EQ(prepared, 1);
    // Each timed run was handed its own candidate's plan.
    std::vector<std::string> expected_runs;
    for (const auto& c : gemm_tune_candidates(p, 132, o)) expected_runs.push_back(c.name);
    EXPECT_EQ(ran, expected_runs);

    const GemmSelection second = select_gemm_plan(p, 132, o, kArch, run, nullptr, false, prepare);
    EXPECT_EQ(second.origin, GemmChoice::kCached);
    EXPECT_EQ(second.candidate, first.candidate);
    EXPECT_EQ(second.plan.config, first.plan.config);
    EXPECT_EQ(fake.calls, static_cast<int>(expected_runs.size())) << "the second call re-tuned";
    EXPECT_EQ(prepared, 1) << "nothing to compile for a cached decision";

    // Another process: the decision file has it.
    FakeTimings other;
    jit::Autotuner reread(tuner_config(&dir), other.measure());
    o.autotuner = &reread;
    const GemmSelection third = select_gemm_plan(p, 132, o, kArch, run, nullptr, false, prepare);
    EXPECT_EQ(third.origin, GemmChoice::kCached);
    EXPECT_EQ(third.candidate, first.candidate);
    EXPECT_EQ(other.calls, 0);
    const std::string file = read_text_file(dir / "autotune.txt");
    EXPECT_NE(file.find("gemm\t" + gemm_tune_problem(p, 132, o)), std::string::npos) << file;
    EXPECT_NE(file.find("128x128x64_s6_c1x1"), std::string::npos) << file;

    // Another shape is another decision.
    const GemmSelection other_shape = select_gemm_plan(problem(4096, 2048, 2048), 132, o, kArch, run, nullptr);
    EXPECT_EQ(other_shape.origin, GemmChoice::kTuned);
}

TEST(GemmAutotuneSelect, HeuristicUnlessAskedAndWeftAutotuneZeroWins) {
    CleanAutotuneEnv env;
    FakeTimings fake;
    fake.ms["128x64x64_s8_c1x1"] = 0.5;
    jit::Autotuner tuner(tuner_config(nullptr), fake.measure());
    const GemmProblem p = problem(1000, 3000, 512);
    const GemmRunPlan run = [](const GemmPlan&, cudaStream_t) {};
    GemmOptions o;
    o.autotuner = &tuner;
    const GemmPlan heuristic = plan_gemm(p, 132, o);

    GemmSelection s = select_gemm_plan(p, 132, o, kArch, run, nullptr);
    EXPECT_EQ(s.origin, GemmChoice::kHeuristic);
    EXPECT_EQ(s.plan.config, heuristic.config);
    EXPECT_EQ(s.candidate, gemm_candidate_name(heuristic.config));
    EXPECT_EQ(fake.calls, 0);

    {
        ScopedEnv zero("WEFT_AUTOTUNE", "0");
        o.autotune = true;
        s = select_gemm_plan(p, 132, o, kArch, run, nullptr);
        EXPECT_EQ(s.origin, GemmChoice::kHeuristic);
        EXPECT_EQ(fake.calls, 0);
    }
    {
        ScopedEnv one("WEFT_AUTOTUNE", "1");
        o.autotune = false;
        s = select_gemm_plan(p, 132, o, kArch, run, nullptr);
        EXPECT_EQ(s.origin, GemmChoice::kTuned);
        EXPECT_EQ(s.candidate, "128x64x64_s8_c1x1");
        EXPECT_GT(fake.calls, 0);
    }
    // options.config: no tuner, whatever the environment says.
    ScopedEnv one("WEFT_AUTOTUNE", "1");
    const int before = fake.calls;
    o.autotune = true;
    o.config = gemm_candidate(5, DType::kBF16, DType::kBF16, BLayout::kNK);
    s = select_gemm_plan(p, 132, o, kArch, run, nullptr);
    EXPECT_EQ(s.origin, GemmChoice::kOptions);
    EXPECT_EQ(s.plan.config, *o.config);
    EXPECT_EQ(fake.calls, before);
}

TEST(GemmAutotuneSelect, ForcedByEnvironmentAndUnknownNamesAreErrors) {
    CleanAutotuneEnv env;
    const GemmProblem p = problem(2048, 2048, 2048);
    const GemmRunPlan run = [](const GemmPlan&, cudaStream_t) {};
    GemmOptions o;  // autotune not asked for: forcing alone consults the tuner
    {
        ScopedEnv force("WEFT_AUTOTUNE_FORCE", "other_op=x, gemm=256x128x64_s4_c2x1");
        FakeTimings fake;
        jit::AutotuneConfig config = jit::AutotuneConfig::from_env();
        config.cache_dir.reset();
        jit::Autotuner tuner(config, fake.measure());
        o.autotuner = &tuner;
        const GemmSelection s = select_gemm_plan(p, 132, o, kArch, run, nullptr, /*capturing=*/true);
        EXPECT_EQ(s.origin, GemmChoice::kForced);
        EXPECT_EQ(s.plan.config.tile_m, 256);
        EXPECT_EQ(s.plan.config.cluster_m, 2);
        EXPECT_EQ(fake.calls, 0) << "forcing times nothing (and is allowed during capture)";
    }
    {
        ScopedEnv force("WEFT_AUTOTUNE_FORCE", "gemm=96x96x64_s3_c1x1");
        FakeTimings fake;
        jit::AutotuneConfig config = jit::AutotuneConfig::from_env();
        config.cache_dir.reset();
        jit::Autotuner tuner(config, fake.measure());
        o.autotuner = &tuner;
        try {
            select_gemm_plan(p, 132, o, kArch, run, nullptr);
            ADD_FAILURE() << "an unknown forced candidate must be an error";
        } catch (const Error& e) {
            const std::string what = e.what();
            EXPECT_NE(what.find("96x96x64_s3_c1x1"), std::string::npos) << what;
            EXPECT_NE(what.find("128x256x64_s4_c1x1"), std::string::npos) << "lists the valid names: " << what;
        }
    }
}

// WEFT_AUTOTUNE_FORCE=gemm=small_m_v5 forces small-M variant 5 (swapped wgmma) past small_m_max_m, up to M = 256 with
// B [N,K]: M = 77, N = K = 4096 (issue #35's shape) gets 5 row tiles and 2 splits on 132 SMs; M = 257 has no such
// candidate (an error naming it).
TEST(GemmAutotuneSelect, ForcingSmallMV5ByNameTakesTheSwappedWgmmaKernel) {
    CleanAutotuneEnv env;
    ScopedEnv force("WEFT_AUTOTUNE_FORCE", "gemm=small_m_v5");
    const GemmRunPlan run = [](const GemmPlan&, cudaStream_t) {};
    FakeTimings fake;
    jit::AutotuneConfig config = jit::AutotuneConfig::from_env();
    config.cache_dir.reset();
    jit::Autotuner tuner(config, fake.measure());
    GemmOptions o;
    o.autotuner = &tuner;
    const GemmSelection s = select_gemm_plan(problem(77, 4096, 4096), 132, o, kArch, run, nullptr);
    EXPECT_EQ(s.origin, GemmChoice::kForced);
    EXPECT_EQ(s.candidate, "small_m_v5");
    EXPECT_EQ(s.plan.path, GemmPath::kSmallM);
    EXPECT_EQ(s.plan.small_m_variant, GemvVariant::kTmaWgmma);
    EXPECT_EQ(s.plan.small_m_tiles, 5);
    EXPECT_EQ(s.plan.grid, 64);
    EXPECT_EQ(s.plan.small_m_splits, 2);
    EXPECT_EQ(s.plan.small_m_k_per_split, 2048);
    EXPECT_EQ(fake.calls, 0);
    EXPECT_THROW(select_gemm_plan(problem(257, 4096, 4096), 132, o, kArch, run, nullptr), Error);
}

TEST(GemmAutotuneSelect, CaptureNeverTimesAndFailingCandidatesAreSkipped) {
    CleanAutotuneEnv env;
    FakeTimings fake;
    fake.ms["small_m_v3"] = 0.2;
    fake.ms["128x256x64_s4_c1x1"] = 0.1;
    fake.failing.insert("128x256x64_s4_c1x1");  // fastest, but fails: disqualified
    jit::Autotuner tuner(tuner_config(nullptr), fake.measure());
    GemmProblem p = problem(8, 4096, 4096);
    p.b_rows_contiguous = true;  // the heuristic picks variant 4
    const GemmRunPlan run = [](const GemmPlan&, cudaStream_t) {};
    GemmOptions o;
    o.autotune = true;
    o.autotuner = &tuner;

    // During capture with nothing cached: the heuristic, and nothing is timed.
    GemmSelection s = select_gemm_plan(p, 132, o, kArch, run, nullptr, /*capturing=*/true);
    EXPECT_EQ(s.origin, GemmChoice::kHeuristic);
    EXPECT_EQ(s.candidate, "small_m_v4");
    EXPECT_EQ(fake.calls, 0);

    s = select_gemm_plan(p, 132, o, kArch, run, nullptr);
    EXPECT_EQ(s.origin, GemmChoice::kTuned);
    EXPECT_EQ(s.candidate, "small_m_v3");
    EXPECT_EQ(s.plan.path, GemmPath::kSmallM);
    EXPECT_EQ(s.plan.small_m_variant, GemvVariant::kTmaRing);

    // During capture with a decision: the decision.
    const int calls = fake.calls;
    s = select_gemm_plan(p, 132, o, kArch, run, nullptr, /*capturing=*/true);
    EXPECT_EQ(s.origin, GemmChoice::kCached);
    EXPECT_EQ(s.candidate, "small_m_v3");
    EXPECT_EQ(fake.calls, calls);
}

}  // namespace
}  // namespace weft::ops
