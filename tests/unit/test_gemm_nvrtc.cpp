// SPDX-License-Identifier: MIT
// Unit tests (CPU): NVRTC compiles every GEMM kernel specialisation for sm_90a with a clean ptxas report
// (no wgmma serialisation, no ignored setmaxnreg, no spills), the tiled kernels' SASS uses HGMMA, and the
// pipelined small-M kernel (variant 2) keeps its ring of B loads in flight at its first MMA.
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
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "support/sass_testing.hpp"
#include "weft/common/gemm_config.hpp"
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

struct Compiled {
    nvrtcResult result = NVRTC_SUCCESS;
    std::string log;
    std::vector<char> cubin;
    std::map<std::string, std::string> lowered;  // instantiation -> mangled name
};

// NOTE: NVRTC has no C++ standard library: fixed-width integers come from libcu++ (the toolkit's cccl
// folder), as weft/common/macros.hpp expects; the JIT passes the same include path.
Compiled compile(const std::vector<std::string>& instantiations, const std::string& extra_source = "") {
    const std::string source = "#include \"gemm/gemm_sm90.cuh\"\n#include \"gemm/gemv_sm90.cuh\"\n" + extra_source;
    nvrtcProgram prog = nullptr;
    Compiled out;
    out.result = nvrtcCreateProgram(&prog, source.c_str(), "weft_gemm_test.cu", 0, nullptr, nullptr);
    if (out.result != NVRTC_SUCCESS) return out;
    for (const auto& name : instantiations) nvrtcAddNameExpression(prog, name.c_str());
    const std::string inc = std::string("-I") + WEFT_SOURCE_DIR + "/include";
    const std::string kinc = std::string("-I") + WEFT_SOURCE_DIR + "/kernels";
    const std::string cccl = std::string("-I") + WEFT_CUDA_INCLUDE_DIR + "/cccl";
    const std::string cuda_inc = std::string("-I") + WEFT_CUDA_INCLUDE_DIR;
    const char* opts[] = {"-arch=sm_90a", "-std=c++20", "--ptxas-options=-v", inc.c_str(),
                          kinc.c_str(),   cccl.c_str(), cuda_inc.c_str()};
    out.result = nvrtcCompileProgram(prog, static_cast<int>(std::size(opts)), opts);
    size_t log_size = 0;
    nvrtcGetProgramLogSize(prog, &log_size);
    out.log.assign(log_size, '\0');
    nvrtcGetProgramLog(prog, out.log.data());
    if (out.result == NVRTC_SUCCESS) {
        size_t cubin_size = 0;
        nvrtcGetCUBINSize(prog, &cubin_size);
        out.cubin.resize(cubin_size);
        nvrtcGetCUBIN(prog, out.cubin.data());
        for (const auto& name : instantiations) {
            const char* lowered = nullptr;
            if (nvrtcGetLoweredName(prog, name.c_str(), &lowered) == NVRTC_SUCCESS && lowered) {
                out.lowered[name] = lowered;
            }
        }
    }
    nvrtcDestroyProgram(&prog);
    return out;
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

std::vector<std::string> gemv_instantiations(const Combo& c, std::vector<int> variants = {0, 1, 2, 3, 4}) {
    std::vector<std::string> names;
    for (int m_tiles = 1; m_tiles <= 4; ++m_tiles) {
        for (int variant : variants) {
            if (variant == 4 && m_tiles > 1) continue;  // variant 4: M <= 16 (one m16 tile)
            names.push_back(ops::gemv_kernel_instantiation(m_tiles, c.in, c.out, variant));
        }
    }
    return names;
}

// The communication-hooked variant (what the fused kernels instantiate).
std::string hooked_instantiation() {
    const std::string cfg = ops::format_gemm_config(gemm_candidate(0, DType::kBF16, DType::kBF16, BLayout::kNK));
    return "weft::gemm::gemm_kernel<" + cfg + ", weft::gemm::ChunkWaitScheduler<" + cfg +
           ">, weft::gemm::TileSignalHook>";
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

// Compiles small-M `variant` for every B [N,K] dtype pair (ASSERTs NVRTC succeeded, checks ptxas' report: no
// spills, no wgmma serialisation) and collects every instance's SASS; `why_not` says why SASS cannot be checked.
CompiledSass gemv_variant_sass(int variant, const std::string& what) {
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
    const CompiledSass r = gemv_variant_sass(3, "small-M variant 3");
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
    const CompiledSass r = gemv_variant_sass(4, "small-M variant 4");
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

// ---- small-M variant 2: loads in flight -----------------------------------------------------------------

struct SassInstruction {
    uint32_t addr = 0;
    std::string text;  // "@P1 LDG.E.NA.LTC256B.128.CONSTANT R8, desc[UR8][R12.64+0x40]"
};

// Instructions of one function's SASS (cuobjdump: "/*0810*/ text ;", branch targets as addresses; nvdisasm:
// the same lines plus ".L_x_N:" labels that branches name).
std::vector<SassInstruction> parse_sass(const std::string& code, std::map<std::string, size_t>* labels) {
    std::vector<SassInstruction> out;
    const std::regex inst(R"(^\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);)");
    const std::regex label(R"(^\s*(\.L\w+):)");
    std::stringstream ss(code);
    std::string line;
    std::smatch m;
    while (std::getline(ss, line)) {
        if (std::regex_search(line, m, label)) {
            (*labels)[m[1].str()] = out.size();
        } else if (std::regex_search(line, m, inst)) {
            out.push_back({static_cast<uint32_t>(std::stoul(m[1].str(), nullptr, 16)), m[2].str()});
        }
    }
    return out;
}

struct RingReport {
    bool found_loop = false;
    int loop_stream_loads = 0;       // B loads (LDG ... LTC256B: the L2::256B hint) in the loop body
    int loop_mmas = 0;               // HMMA in the loop body
    int in_flight_at_first_mma = 0;  // B loads issued and not yet consumed when the body's first HMMA issues
    int max_in_flight_at_mma = 0;    // the most at any HMMA of the body
    int local_memory = 0;            // LDL / STL anywhere
};

// Finds the k loop (the first backward branch whose body holds an HMMA) and replays three trips of it after
// the code before it: a B load is outstanding from its issue until a later instruction names one of its four
// destination registers (the consuming MMA, or a reuse that must wait for it). The count before the body's
// first HMMA in the third trip is the steady state: what a warp has in flight when it first waits.
RingReport analyse_ring(const std::string& code) {
    RingReport r;
    std::map<std::string, size_t> labels;
    const std::vector<SassInstruction> insts = parse_sass(code, &labels);
    for (const auto& i : insts) {
        if (i.text.find(" LDL") != std::string::npos || i.text.find(" STL") != std::string::npos ||
            i.text.rfind("LDL", 0) == 0 || i.text.rfind("STL", 0) == 0) {
            ++r.local_memory;
        }
    }
    const std::regex bra_addr(R"(BRA\s+0x([0-9a-f]+))");
    const std::regex bra_label(R"(BRA\s+`\((\.L\w+)\))");
    size_t begin = 0, end = 0;
    for (size_t i = 0; i < insts.size() && !r.found_loop; ++i) {
        std::smatch m;
        std::optional<size_t> target;
        if (std::regex_search(insts[i].text, m, bra_addr)) {
            const uint32_t addr = static_cast<uint32_t>(std::stoul(m[1].str(), nullptr, 16));
            for (size_t j = 0; j < insts.size(); ++j) {
                if (insts[j].addr == addr) target = j;
            }
        } else if (std::regex_search(insts[i].text, m, bra_label)) {
            if (auto it = labels.find(m[1].str()); it != labels.end()) target = it->second;
        }
        if (!target || *target > i) continue;
        for (size_t j = *target; j <= i; ++j) {
            if (insts[j].text.find("HMMA") != std::string::npos) {
                r.found_loop = true;
                begin = *target;
                end = i;
                break;
            }
        }
    }
    if (!r.found_loop) return r;

    const std::regex reg(R"(\bR(\d+)\b)");
    const std::regex dest(R"(LDG\S*\s+R(\d+))");
    std::vector<std::set<int>> pending;  // destination registers of each outstanding B load
    bool first_mma_seen = false;
    auto step = [&](const SassInstruction& i, bool record) {
        std::set<int> named;
        for (auto it = std::sregex_iterator(i.text.begin(), i.text.end(), reg); it != std::sregex_iterator(); ++it) {
            named.insert(std::stoi((*it)[1].str()));
        }
        const bool is_mma = i.text.find("HMMA") != std::string::npos;
        if (record && is_mma) {
            if (!first_mma_seen) r.in_flight_at_first_mma = static_cast<int>(pending.size());
            first_mma_seen = true;
            r.max_in_flight_at_mma = std::max(r.max_in_flight_at_mma, static_cast<int>(pending.size()));
        }
        std::erase_if(pending, [&](const std::set<int>& regs) {
            for (int x : regs) {
                if (named.count(x)) return true;
            }
            return false;
        });
        std::smatch m;
        if (i.text.find("LDG") != std::string::npos && i.text.find("LTC256B") != std::string::npos &&
            std::regex_search(i.text, m, dest)) {
            const int d = std::stoi(m[1].str());
            pending.push_back({d, d + 1, d + 2, d + 3});
        }
    };
    for (size_t j = 0; j < begin; ++j) step(insts[j], false);
    for (int trip = 0; trip < 3; ++trip) {
        for (size_t j = begin; j <= end; ++j) step(insts[j], trip == 2);
    }
    for (size_t j = begin; j <= end; ++j) {
        r.loop_stream_loads +=
            insts[j].text.find("LDG") != std::string::npos && insts[j].text.find("LTC256B") != std::string::npos;
        r.loop_mmas += insts[j].text.find("HMMA") != std::string::npos;
    }
    return r;
}

// Variant 2 exists because ptxas sinks each 16-byte B load of variants 0/1 down to its MMA (one load in
// flight per warp). In its SASS, the ring must be in flight when the loop's first MMA waits: at least
// (stages - 1) x stage_chunks x n_tiles loads (the full ring is stages x ...), and nothing in local memory.
TEST(GemmNvrtc, small_m_variant2_keeps_the_ring_of_b_loads_in_flight) {
    const fs::path dir = fs::temp_directory_path() / ("weft_gemv_sass_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    int checked = 0;
    for (const Combo& c : combos()) {
        if (c.layout != BLayout::kNK) continue;
        const std::vector<std::string> names = gemv_instantiations(c, {2, 1});
        const Compiled r = compile(names);
        ASSERT_EQ(r.result, NVRTC_SUCCESS) << r.log;
        expect_clean_ptxas_report(r.log, "small-M kernels");
        const fs::path cubin = dir / "gemv.cubin";
        {
            std::ofstream f(cubin, std::ios::binary);
            f.write(r.cubin.data(), static_cast<std::streamsize>(r.cubin.size()));
        }
        std::string tool, why_not;
        const auto sass = disassemble(cubin, &tool, &why_not);
        if (sass.empty()) {
            fs::remove_all(dir);
            GTEST_SKIP() << "SKIPPED: cannot check SASS: " << why_not;
        }
        for (int m_tiles = 1; m_tiles <= 4; ++m_tiles) {
            for (int variant : {2, 1}) {
                const std::string name = ops::gemv_kernel_instantiation(m_tiles, c.in, c.out, variant);
                const auto lowered = r.lowered.find(name);
                ASSERT_NE(lowered, r.lowered.end()) << name;
                const auto fn = sass.find(lowered->second);
                ASSERT_NE(fn, sass.end()) << "no SASS for " << name << " (tool " << tool << ")";
                const RingReport rep = analyse_ring(fn->second);
                ASSERT_TRUE(rep.found_loop) << name << ": no k loop with HMMA found in\n" << fn->second;
                EXPECT_EQ(rep.local_memory, 0) << name << ": local-memory loads/stores";
                if (c.in == DType::kBF16 && c.out == DType::kBF16) {
                    std::printf(
                        "[ SASS     ] %s: B loads in flight at the k loop's first HMMA: %d, at most %d at any "
                        "HMMA (%d B loads, %d HMMA per trip)\n",
                        name.c_str(), rep.in_flight_at_first_mma, rep.max_in_flight_at_mma, rep.loop_stream_loads,
                        rep.loop_mmas);
                }
                if (variant != 2) continue;  // variant 1: the baseline printed above (one load in flight)
                const GemvShape shape = gemv_shape(2, m_tiles);
                const int ring = shape.stages * shape.stage_chunks * shape.n_tiles;
                EXPECT_EQ(rep.loop_stream_loads, ring) << name << ": one refill of every slot per trip";
                EXPECT_GE(rep.in_flight_at_first_mma, (shape.stages - 1) * shape.stage_chunks * shape.n_tiles)
                    << name << ": ptxas sank the refills below the MMAs\n"
                    << fn->second;
                ++checked;
            }
        }
    }
    fs::remove_all(dir);
    EXPECT_EQ(checked, 4 * 4);
}

}  // namespace
}  // namespace weft

namespace weft {
namespace {

// The GEMM+RS reduction reads peers' partials over NVLink (~2 us a round trip): its loads must be in flight
// together, kRsUnroll (8, kernels/gemm_rs/gemm_rs.cuh) per thread: a conversion right after each load once made
// them wait one by one (one load in flight; the fused op ran at the speed of ~2 GB/s per reduction CTA).
TEST(TpNvrtc, rs_reduce_keeps_its_partial_loads_in_flight) {
    const std::vector<std::string> names = {"weft::tp::rs_reduce_kernel<weft::DType::kBF16, weft::DType::kBF16>",
                                            "weft::tp::rs_reduce_kernel<weft::DType::kF32, weft::DType::kBF16>"};
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
