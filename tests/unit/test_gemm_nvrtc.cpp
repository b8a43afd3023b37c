// SPDX-License-Identifier: MIT
// Unit tests (CPU): NVRTC compiles every GEMM kernel specialisation for sm_90a with a clean ptxas report
// (no wgmma serialisation, no ignored setmaxnreg, no spills), the tiled kernels' SASS uses HGMMA, and the small-M
// kernels' SASS streams B as designed (TMA boxes with L2 hints; 1D bulk copies) and multiplies as designed (mma.sync;
// variant 5: wgmma with A's rows on the N side).
#include <gtest/gtest.h>
#include <nvrtc.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "support/nvrtc_testing.hpp"
#include "support/sass_testing.hpp"
#include "weft/common/gemm_config.hpp"
#include "weft/common/gemv_config.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_plan.hpp"

#ifndef WEFT_SOURCE_DIR
#error "WEFT_SOURCE_DIR must name the source tree (tests/CMakeLists.txt defines it)"
#endif
#ifndef WEFT_CUDA_INCLUDE_DIR
#error "WEFT_CUDA_INCLUDE_DIR must name the toolkit's include folder (tests/CMakeLists.txt defines it)"
#endif

namespace weft {
namespace {

namespace fs = std::filesystem;
using testing::disassemble;
using testing::expect_clean_ptxas_report;
using testing::max_loads_in_flight;

using Compiled = testing::NvrtcCompiled;

Compiled compile(const std::vector<std::string>& instantiations, const std::string& extra_source = "") {
    return testing::nvrtc_compile(
        "#include \"gemm/gemm_sm90.cuh\"\n#include \"gemm/gemv_rows_sm90.cuh\"\n"
        "#include \"gemm/gemv_tma_sm90.cuh\"\n#include \"gemm/gemv_wgmma_sm90.cuh\"\n" +
            extra_source,
        "weft_gemm_test.cu", instantiations);
}

struct Combo {
    DType in, out;
    BLayout layout;
};

std::vector<Combo> combos() {
    std::vector<Combo> v;
    for (auto io : {std::pair{DType::kBF16, DType::kBF16}, std::pair{DType::kBF16, DType::kF32},
                    std::pair{DType::kF16, DType::kF16}, std::pair{DType::kF16, DType::kF32}}) {
        for (BLayout l : {BLayout::kNK, BLayout::kKN}) v.push_back({io.first, io.second, l});
    }
    return v;
}

std::vector<std::string> tiled_instantiations(const Combo& c) {
    std::vector<std::string> names;
    for (const GemmConfig& cfg : ops::gemm_candidate_configs(c.in, c.out, c.layout)) {
        names.push_back(ops::gemm_kernel_instantiation(cfg));
    }
    return names;
}

std::vector<std::string> gemv_instantiations(
    const Combo& c, std::vector<GemvVariant> variants = {GemvVariant::kTmaRing, GemvVariant::kBulkRows}) {
    std::vector<std::string> names;
    for (int m_tiles = 1; m_tiles <= 4; ++m_tiles) {
        for (GemvVariant variant : variants) {
            if (variant == GemvVariant::kBulkRows && m_tiles > 1) continue;  // M <= 16 (one m16 tile)
            names.push_back(ops::gemv_kernel_instantiation(
                GemvConfig{.variant = variant, .m_tiles = m_tiles, .in_dtype = c.in, .out_dtype = c.out}));
        }
    }
    return names;
}

// The communication-hooked variant (what the fused kernels instantiate).
std::string hooked_instantiation() {
    const std::string cfg = ops::format_gemm_config(gemm_candidate(0, DType::kBF16, DType::kBF16, BLayout::kNK));
    return "weft::kernels::gemm::gemm_kernel<" + cfg + ", weft::kernels::gemm::ChunkWaitScheduler<" + cfg +
           ">, weft::kernels::gemm::TileSignalHook>";
}

TEST(GemmNvrtc, EveryCandidateCompilesForSm90aWithoutSerialisationOrSpills) {
    for (const Combo& c : combos()) {
        std::vector<std::string> names = tiled_instantiations(c);
        if (c.layout == BLayout::kNK) {
            for (auto& g : gemv_instantiations(c)) names.push_back(g);
        }
        const std::string what = std::string("in ") + dtype_name(c.in) + " out " + dtype_name(c.out) + " " +
                                 (c.layout == BLayout::kNK ? "kNK" : "kKN");
        const Compiled r = compile(names);
        ASSERT_EQ(r.result, NVRTC_SUCCESS) << what << ":\n" << r.log;
        EXPECT_EQ(r.lowered.size(), names.size()) << what << ": some instantiation has no lowered name";
        expect_clean_ptxas_report(r.log, what);
        // One 128-register-or-more consumer budget: the kernel's register cap at entry is 168 (384 threads).
        EXPECT_EQ(r.log.find("Used 256 registers"), std::string::npos) << r.log;
    }
}

TEST(GemmNvrtc, HookedKernelCompilesWithoutSerialisationOrSpills) {
    const Compiled r = compile({hooked_instantiation()});
    ASSERT_EQ(r.result, NVRTC_SUCCESS) << r.log;
    expect_clean_ptxas_report(r.log, "ChunkWaitScheduler + TileSignalHook");
}

// ---- SASS check -----------------------------------------------------------------------------------------

size_t count(const std::string& hay, const std::string& needle) {
    size_t n = 0;
    for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
    return n;
}

// Lines of `hay` that contain both `needle` and `also`.
size_t count_lines_with(const std::string& hay, const std::string& needle, const std::string& also) {
    size_t n = 0;
    std::istringstream lines(hay);
    for (std::string line; std::getline(lines, line);) {
        n += line.find(needle) != std::string::npos && line.find(also) != std::string::npos;
    }
    return n;
}

// The SASS of each of `names` (instantiation -> text) in r's cubin; empty, with the reason in why_not, when no
// disassembler works here. A name without a lowered name or without SASS is a test failure.
std::map<std::string, std::string> sass_by_name(const Compiled& r, const std::vector<std::string>& names,
                                                std::string* why_not) {
    std::string tool;
    const auto sass = testing::disassemble(r.cubin, &tool, why_not);
    std::map<std::string, std::string> out;
    if (sass.empty()) return out;
    for (const auto& name : names) {
        const auto lowered = r.lowered.find(name);
        EXPECT_NE(lowered, r.lowered.end()) << name;
        if (lowered == r.lowered.end()) continue;
        const auto fn = sass.find(lowered->second);
        EXPECT_NE(fn, sass.end()) << "no SASS for " << name << " (tool " << tool << ")";
        if (fn != sass.end()) out[name] = fn->second;
    }
    return out;
}

// `names` compiled together, and the SASS of each (empty, with the reason in why_not, when no disassembler works).
struct CompiledSass {
    Compiled compiled;
    std::map<std::string, std::string> sass;
    std::string why_not;
};

CompiledSass compile_to_sass(const std::vector<std::string>& names) {
    CompiledSass out{compile(names), {}, {}};
    if (out.compiled.result == NVRTC_SUCCESS) out.sass = sass_by_name(out.compiled, names, &out.why_not);
    return out;
}

void expect_no_local_memory(const std::string& code, const std::string& name) {
    EXPECT_EQ(count(code, " LDL"), 0u) << name << ": local-memory loads";
    EXPECT_EQ(count(code, " STL"), 0u) << name << ": local-memory stores";
}

// A tiled GEMM kernel's SASS: wgmma (HGMMA, no mma.sync HMMA), nothing in local memory, TMA loads and stores.
void expect_tiled_sass(const std::string& code, const std::string& name) {
    EXPECT_GT(count(code, "HGMMA"), 0u) << name << ": no HGMMA in SASS";
    EXPECT_EQ(count(code, " HMMA"), 0u) << name << ": HMMA (mma.sync path) in a tiled kernel";
    expect_no_local_memory(code, name);
    EXPECT_GT(count(code, "UTMALDG"), 0u) << name << ": no TMA loads";
    EXPECT_GT(count(code, "UTMASTG"), 0u) << name << ": no TMA stores";
}

// The tiled GEMM must run on the wgmma path: HGMMA in SASS. HMMA (mma.sync) in a tiled kernel means a slower
// path; LDL/STL means registers went to local memory.
TEST(GemmNvrtc, gemm_sass_uses_hgmma) {
    int checked = 0;
    size_t expected = 0;
    for (const Combo& c : combos()) {
        expected += ops::gemm_candidate_configs(c.in, c.out, c.layout).size();
        const CompiledSass r = compile_to_sass(tiled_instantiations(c));
        ASSERT_EQ(r.compiled.result, NVRTC_SUCCESS) << r.compiled.log;
        if (r.sass.empty()) GTEST_SKIP() << "SKIPPED: cannot check SASS: " << r.why_not;
        for (const auto& [name, code] : r.sass) {
            expect_tiled_sass(code, name);
            ++checked;
        }
    }
    EXPECT_EQ(checked, static_cast<int>(expected));
}

// Ping-pong (GemmConfig::pingpong) keeps whole tiles in one warpgroup's registers. Two configs outside the candidate
// set (whose ping-pong tiles the tests above take): on the wgmma path, with TMA loads and stores, nothing in local
// memory, and ptxas' report clean, for both B layouts and both output widths.
TEST(GemmNvrtc, pingpong_sass_uses_hgmma_without_spills) {
    std::vector<std::string> names;
    for (const GemmConfig& c :
         {GemmConfig{.tile_m = 64, .tile_n = 256, .stages = 4, .pingpong = true},
          GemmConfig{.tile_m = 128, .tile_n = 128, .stages = 6, .b_layout = BLayout::kKN, .out_dtype = DType::kF32,
                     .pingpong = true}}) {
        ASSERT_TRUE(is_valid(c)) << ops::format_gemm_config(c);
        names.push_back(ops::gemm_kernel_instantiation(c));
    }
    const CompiledSass r = compile_to_sass(names);
    ASSERT_EQ(r.compiled.result, NVRTC_SUCCESS) << r.compiled.log;
    expect_clean_ptxas_report(r.compiled.log, "ping-pong");
    if (r.sass.empty()) GTEST_SKIP() << "SKIPPED: cannot check SASS: " << r.why_not;
    EXPECT_EQ(r.sass.size(), names.size());
    for (const auto& [name, code] : r.sass) expect_tiled_sass(code, name);
}

// Split-K (GemmConfig::splits > 1): every split-K config the op may run (gemm_split_k_configs) for bf16 -> bf16 with
// B [N,K], and two with f16 -> f32 and B [K,N], compile with ptxas' report clean (the partials' stores and the last
// unit's sum must not make ptxas spill the accumulators or serialise the wgmma), on the wgmma path, nothing in local
// memory, the tile counter taken by an atomic add and the last-unit test broadcast by a barrier reduction.
TEST(GemmNvrtc, split_k_sass_uses_hgmma_without_spills) {
    std::vector<std::string> names;
    for (const GemmConfig& c : ops::gemm_split_k_configs(DType::kBF16, DType::kBF16, BLayout::kNK)) {
        names.push_back(ops::gemm_kernel_instantiation(c));
    }
    ASSERT_EQ(names.size(), 8u);
    for (int index : {12, 0}) {
        GemmConfig c = gemm_candidate(index, DType::kF16, DType::kF32, BLayout::kKN);
        c.splits = 3;
        ASSERT_TRUE(is_valid(c)) << ops::format_gemm_config(c);
        names.push_back(ops::gemm_kernel_instantiation(c));
    }
    const CompiledSass r = compile_to_sass(names);
    ASSERT_EQ(r.compiled.result, NVRTC_SUCCESS) << r.compiled.log;
    EXPECT_EQ(r.compiled.lowered.size(), names.size());
    expect_clean_ptxas_report(r.compiled.log, "split-K");
    if (r.sass.empty()) GTEST_SKIP() << "SKIPPED: cannot check SASS: " << r.why_not;
    EXPECT_EQ(r.sass.size(), names.size());
    for (const auto& [name, code] : r.sass) {
        expect_tiled_sass(code, name);
        EXPECT_GT(count(code, "ATOMG"), 0u) << name << ": no atomic on the tile counter";
        EXPECT_GT(count(code, "BAR.RED.OR"), 0u) << name << ": no barrier reduction for the last unit";
    }
}

// Swapped configs (GemmConfig::swap_ab): the autotuner's set at M = 320 and 77 (N = 4096, 132 SMs), a ping-pong
// 64-column tile, and every 16-bit and fp32 output, compile with ptxas' report clean (the accumulators of D^T beside
// the transposing epilogue: no spills, no wgmma serialisation), on the wgmma path with TMA loads and stores, nothing in
// local memory, the 16-bit epilogues transposing through stmatrix .trans (STSM ... .MT88 in SASS).
TEST(GemmNvrtc, swapped_sass_uses_hgmma_and_transposing_stores) {
    std::vector<GemmConfig> configs;
    for (int64_t m : {320, 77}) {
        const ops::GemmProblem p{.m = m, .n = 4096, .k = 4096};
        for (const GemmConfig& c : ops::gemm_swap_ab_configs(p, 132)) configs.push_back(c);
    }
    ASSERT_GE(configs.size(), 3u);
    GemmConfig pp = configs.front();
    pp.pingpong = true;
    pp.tile_n = 64;
    pp.tile_m = 48;
    ASSERT_TRUE(is_valid(pp)) << ops::format_gemm_config(pp);
    configs.push_back(pp);
    for (DType out : {DType::kF32, DType::kF16}) {
        GemmConfig c = configs.front();
        c.out_dtype = out;
        if (out == DType::kF16) c.in_dtype = DType::kF16;
        ASSERT_TRUE(is_valid(c)) << ops::format_gemm_config(c);
        configs.push_back(c);
    }
    std::vector<std::string> names;
    for (const GemmConfig& c : configs) {
        if (std::find(names.begin(), names.end(), ops::gemm_kernel_instantiation(c)) == names.end()) {
            names.push_back(ops::gemm_kernel_instantiation(c));
        }
    }
    const CompiledSass r = compile_to_sass(names);
    ASSERT_EQ(r.compiled.result, NVRTC_SUCCESS) << r.compiled.log;
    EXPECT_EQ(r.compiled.lowered.size(), names.size());
    expect_clean_ptxas_report(r.compiled.log, "swapped");
    if (r.sass.empty()) GTEST_SKIP() << "SKIPPED: cannot check SASS: " << r.why_not;
    EXPECT_EQ(r.sass.size(), names.size());
    for (const auto& [name, code] : r.sass) {
        expect_tiled_sass(code, name);
        if (name.find(".out_dtype = weft::DType::kF32") == std::string::npos) {
            EXPECT_GT(count_lines_with(code, "STSM", ".MT88"), 0u) << name << ": no transposing stmatrix";
        }
    }
}

// Compiles the small-M kernel `variant` for every B [N,K] dtype pair (ASSERTs NVRTC succeeded, checks ptxas' report: no
// spills, no wgmma serialisation) and collects every instance's SASS; `why_not` says why SASS cannot be checked.
CompiledSass gemv_variant_sass(GemvVariant variant, const std::string& what) {
    CompiledSass all;
    for (const Combo& c : combos()) {
        if (c.layout != BLayout::kNK) continue;
        CompiledSass r = compile_to_sass(gemv_instantiations(c, {variant}));
        EXPECT_EQ(r.compiled.result, NVRTC_SUCCESS) << r.compiled.log;
        expect_clean_ptxas_report(r.compiled.log, what);
        if (r.sass.empty() && all.why_not.empty()) all.why_not = r.why_not.empty() ? "no SASS" : r.why_not;
        all.sass.merge(r.sass);
    }
    return all;
}

// Variant 3 streams B and A through TMA into shared memory and multiplies on the mma.sync path: every
// instance has TMA loads (UTMALDG), each with an L2 cache policy (B evict-first, A evict-last: the SASS shows the
// policy as the load's `desc[UR..]` operand), shared-memory fragment reads (LDS.128), HMMA, and nothing in local
// memory.
TEST(GemmNvrtc, small_m_variant3_loads_by_tma_with_l2_hints_and_multiplies_with_hmma) {
    const CompiledSass r = gemv_variant_sass(GemvVariant::kTmaRing, "small-M variant 3");
    if (::testing::Test::HasFailure()) return;
    if (!r.why_not.empty()) GTEST_SKIP() << "SKIPPED: cannot check SASS: " << r.why_not;
    for (const auto& [name, code] : r.sass) {
        EXPECT_GT(count(code, "UTMALDG"), 0u) << name << ": no TMA loads";
        EXPECT_EQ(count_lines_with(code, "UTMALDG", "desc["), count(code, "UTMALDG"))
            << name << ": a TMA load without an L2 cache policy";
        EXPECT_GT(count(code, "LDS.128"), 0u) << name << ": no 16-byte shared-memory fragment reads";
        EXPECT_GT(count(code, " HMMA"), 0u) << name << ": no HMMA";
        expect_no_local_memory(code, name);
    }
    EXPECT_EQ(r.sass.size(), 4u * 4u);  // 4 dtype pairs x 4 row-tile counts
}

// Variant 4 streams rows of B by 1D bulk copies (UBLKCP, no tensor maps), reads its stages with 16-byte
// shared-memory loads and keeps nothing in local memory. It has two bodies: whole rows on the CUDA cores (FFMA; M
// <= 2) and 8-row groups on the tensor cores (M 3..16, or K the first cannot hold): 2 instances of that body (M <=
// 8, M <= 16) x 8 groups x 16 m16n8k16 MMAs = 256 HMMA per kernel.
TEST(GemmNvrtc, small_m_variant4_streams_rows_by_bulk_copy_and_multiplies_with_ffma_and_hmma) {
    const CompiledSass r = gemv_variant_sass(GemvVariant::kBulkRows, "small-M variant 4");
    if (::testing::Test::HasFailure()) return;
    if (!r.why_not.empty()) GTEST_SKIP() << "SKIPPED: cannot check SASS: " << r.why_not;
    for (const auto& [name, code] : r.sass) {
        EXPECT_GT(count(code, "UBLKCP"), 0u) << name << ": no 1D bulk copies";
        EXPECT_EQ(count(code, "UTMALDG"), 0u) << name << ": TMA box loads in the bulk-copy variant";
        EXPECT_GT(count(code, "FFMA"), 0u) << name << ": no FFMA (the whole-row body)";
        EXPECT_EQ(count(code, " HMMA.16816.F32"), 256u) << name << ": the row-group body's MMAs";
        EXPECT_GT(count(code, "LDS.128"), 0u) << name << ": no 16-byte shared-memory reads";
        expect_no_local_memory(code, name);
    }
    EXPECT_EQ(r.sass.size(), 4u);  // 4 dtype pairs, one row tile
}

// Variant 5 (A and B swapped on wgmma) for every row-tile count (1..16) and dtype pair: ptxas' report clean (no wgmma
// serialisation, no spills) and, in SASS, only wgmma of the shape 64 x (16 m_tiles) x 16 (HGMMA.64x80x16 at m_tiles
// 5: B's 64 rows on the M side, A's rows padded to 80 on the N side), 4 per 64-k stage at least, no mma.sync (HMMA),
// TMA loads each with an L2 cache policy, the split-K sum through distributed shared memory (a cluster barrier, no
// global atomic), and nothing in local memory.
TEST(GemmNvrtc, small_m_variant5_multiplies_with_swapped_hgmma_and_loads_by_tma) {
    size_t checked = 0;
    std::string why_not;
    for (const Combo& c : combos()) {
        if (c.layout != BLayout::kNK) continue;
        std::vector<std::string> names;
        std::map<std::string, int> m_tiles_of;
        for (int m_tiles = 1; m_tiles <= 16; ++m_tiles) {
            const GemvConfig config{
                .variant = GemvVariant::kTmaWgmma, .m_tiles = m_tiles, .in_dtype = c.in, .out_dtype = c.out};
            names.push_back(ops::gemv_kernel_instantiation(config));
            m_tiles_of[names.back()] = m_tiles;
        }
        const std::string what = std::string("small-M variant 5 ") + dtype_name(c.in) + "->" + dtype_name(c.out);
        const CompiledSass r = compile_to_sass(names);
        ASSERT_EQ(r.compiled.result, NVRTC_SUCCESS) << what << ":\n" << r.compiled.log;
        EXPECT_EQ(r.compiled.lowered.size(), names.size()) << what;
        expect_clean_ptxas_report(r.compiled.log, what);
        if (r.sass.empty()) {
            why_not = r.why_not.empty() ? "no SASS" : r.why_not;
            continue;
        }
        // f16 inputs print without a type suffix ("HGMMA.64x80x16.F32 "), bf16 with ".BF16".
        const std::string type = c.in == DType::kBF16 ? ".BF16" : " ";
        for (const auto& [name, code] : r.sass) {
            const int m_tiles = m_tiles_of.at(name);
            const std::string shape = "HGMMA.64x" + std::to_string(16 * m_tiles) + "x16.F32" + type;
            EXPECT_GE(count(code, shape), 4u) << name << ": no " << shape;
            EXPECT_EQ(count(code, "HGMMA"), count(code, shape)) << name << ": a wgmma of another shape";
            EXPECT_EQ(count(code, " HMMA"), 0u) << name << ": mma.sync in the wgmma variant";
            EXPECT_GT(count(code, "UTMALDG"), 0u) << name << ": no TMA loads";
            EXPECT_EQ(count_lines_with(code, "UTMALDG", "desc["), count(code, "UTMALDG"))
                << name << ": a TMA load without an L2 cache policy";
            EXPECT_GT(count(code, "UCGABAR_WAIT"), 0u) << name << ": no cluster barrier before the split-K sum";
            EXPECT_EQ(count(code, "ATOMG"), 0u) << name << ": a global atomic (the splits add in shared memory)";
            expect_no_local_memory(code, name);
            if (m_tiles == 5) {
                EXPECT_GT(count(code, "HGMMA.64x80x16"), 0u) << name;
            }
            ++checked;
        }
    }
    if (!why_not.empty()) GTEST_SKIP() << "SKIPPED: cannot check SASS: " << why_not;
    EXPECT_EQ(checked, 4u * 16u);  // 4 dtype pairs x 16 row-tile counts
}

}  // namespace
}  // namespace weft

namespace weft {
namespace {

// The GEMM+RS reduction reads peers' partials over NVLink (microseconds a round trip): its loads must be in flight
// together, kRsUnroll (8, kernels/gemm_rs/gemm_rs.cuh) per thread. A conversion right after each load makes the next
// load wait for it (one load in flight: kernels/gemm_rs/README.md, History).
TEST(TpNvrtc, rs_reduce_keeps_its_partial_loads_in_flight) {
    const std::vector<std::string> names = {
        "weft::kernels::gemm_rs::rs_reduce_kernel<weft::DType::kBF16, weft::DType::kBF16>",
        "weft::kernels::gemm_rs::rs_reduce_kernel<weft::DType::kF32, weft::DType::kBF16>"};
    const Compiled r = compile(names, "#include \"gemm_rs/gemm_rs.cuh\"\n");
    ASSERT_EQ(r.result, NVRTC_SUCCESS) << r.log;
    expect_clean_ptxas_report(r.log, "the GEMM+RS reduction");
    const fs::path dir = fs::temp_directory_path() / ("weft_rs_sass_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    const fs::path cubin = dir / "rs.cubin";
    {
        std::ofstream f(cubin, std::ios::binary);
        f.write(r.cubin.data(), static_cast<std::streamsize>(r.cubin.size()));
    }
    std::string tool, why_not;
    const auto sass = disassemble(cubin, &tool, &why_not);
    fs::remove_all(dir);
    if (sass.empty()) GTEST_SKIP() << "SKIPPED: cannot check SASS: " << why_not;
    for (size_t i = 0; i < names.size(); ++i) {
        const auto lowered = r.lowered.find(names[i]);
        ASSERT_NE(lowered, r.lowered.end()) << names[i];
        const auto fn = sass.find(lowered->second);
        ASSERT_NE(fn, sass.end()) << "no SASS for " << names[i] << " (tool " << tool << ")";
        const int in_flight = max_loads_in_flight(fn->second);
        std::printf("[ SASS     ] %s: 16-byte loads in flight together: %d\n", names[i].c_str(), in_flight);
        constexpr int kRsUnroll = 8;
        const int want = kRsUnroll * (i == 0 ? 1 : 2);  // fp32 partials: two loads per 8 elements
        EXPECT_GE(in_flight, want) << names[i] << ": the partial loads wait for each other";
    }
}

}  // namespace
}  // namespace weft
