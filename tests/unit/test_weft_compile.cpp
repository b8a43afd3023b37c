// SPDX-License-Identifier: MIT
// Unit tests (CPU) of the weft-compile tool, run as a child process: --fused-gemm fills the cache entries a program's
// FusedGemm loads, its arguments are checked, --strict fails a kernel that spills.
#include <gtest/gtest.h>
#include <stdio.h>
#include <sys/wait.h>

#include <filesystem>
#include <string>
#include <vector>

#include "support/jit_testing.hpp"
#include "weft/jit/paths.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"

namespace weft {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;
using testing::write_text_file;

struct ToolRun {
    int exit_code = -1;
    std::string output;  // stdout and stderr
};

// weft-compile from this build tree (the test binary depends on it when the tools are built); empty without it.
fs::path weft_compile_path() {
#if defined(WEFT_WEFT_COMPILE_PATH)
    const fs::path p = WEFT_WEFT_COMPILE_PATH;
    return fs::is_regular_file(p) ? p : fs::path();
#else
    return fs::path();
#endif
}

ToolRun run_weft_compile(const std::vector<std::string>& args) {
    std::string command;
    command.append("'").append(weft_compile_path().string()).append("'");
    for (const std::string& a : args) command.append(" '").append(a).append("'");  // no argument holds a quote
    FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
    if (pipe == nullptr) return {};
    ToolRun run;
    char buffer[4096];
    for (size_t n; (n = fread(buffer, 1, sizeof buffer, pipe)) > 0;) run.output.append(buffer, n);
    const int status = ::pclose(pipe);
    run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return run;
}

fs::path example_10_device_dir() {
    return jit::find_include_roots().weft_include.parent_path() / "examples" / "10_custom_fused_gemm" / "device";
}

#define SKIP_WITHOUT_WEFT_COMPILE() \
    if (weft_compile_path().empty()) GTEST_SKIP() << "weft-compile is not built (WEFT_BUILD_TOOLS=OFF)"

// `weft-compile --fused-gemm` warms exactly the cache entries a program's FusedGemm loads: after it, the program's
// compiler (from the environment, with the FusedGemm's include root, here a copy of the headers elsewhere, as example
// 10 reads the copy next to its binary) finds every candidate config's kernel in the cache. --strict passes: example
// 10's kernel spills nothing and has no ptxas warning in any candidate config.
TEST(WeftCompile, FusedGemmWarmsTheProgramsCacheEntries) {
    SKIP_WITHOUT_WEFT_COMPILE();
    TempDir cache("weft_compile_cache"), copy("weft_compile_copy");
    fs::copy(example_10_device_dir(), copy.path(), fs::copy_options::recursive);
    const ToolRun run = run_weft_compile(
        {"--arch", "sm_90a", "--cache-dir", cache.path().string(), "--include-root", example_10_device_dir().string(),
         "--fused-gemm", "chain_gemm.cuh,example::WaitForRows,example::NotifyNextRank", "--strict", "--jobs", "4"});
    ASSERT_EQ(run.exit_code, 0) << run.output;
    jit::CompilerConfig config = jit::CompilerConfig::from_env();  // as jit::compiler(root)'s, on this cache
    config.cache_dir = cache.path();
    config.extra_include_roots.push_back(copy.path());
    const jit::Compiler program_compiler(config);
    const ops::FusedGemmSpec program{.header = "chain_gemm.cuh",
                                     .scheduler = "example::WaitForRows",
                                     .hook = "example::NotifyNextRank",
                                     .include_root = copy.path()};
    const std::vector<GemmConfig> configs = ops::fused_gemm_candidates(DType::kBF16, DType::kBF16);
    ASSERT_FALSE(configs.empty());
    for (const GemmConfig& c : configs) {
        const jit::KernelSpec spec = ops::fused_gemm_kernel_spec(program, c, "sm_90a");
        EXPECT_EQ(program_compiler.disk_status(spec), jit::DiskCache::LoadStatus::kHit)
            << ops::format_gemm_config(c) << " (key " << program_compiler.cache_key(spec) << ") is not cached:\n"
            << run.output;
    }
}

TEST(WeftCompile, FusedGemmArgumentsAreChecked) {
    SKIP_WITHOUT_WEFT_COMPILE();
    TempDir cache("weft_compile_cache");
    const std::vector<std::string> base = {"--arch", "sm_90a", "--cache-dir", cache.path().string(), "--list"};
    const auto with = [&](std::vector<std::string> more) {
        more.insert(more.begin(), base.begin(), base.end());
        return run_weft_compile(more);
    };
    for (const std::string bad : {"chain_gemm.cuh", "chain_gemm.cuh,S", ",S,H", "h.cuh,,H", "h.cuh,S,"}) {
        const ToolRun r = with({"--fused-gemm", bad});
        EXPECT_EQ(r.exit_code, 2) << bad << "\n" << r.output;
        EXPECT_NE(r.output.find("HEADER,SCHEDULER,HOOK"), std::string::npos) << r.output;
    }
    const ToolRun dtype = with({"--fused-gemm", "h.cuh,S,H", "--fused-gemm-dtypes", "bf16,f64"});
    EXPECT_EQ(dtype.exit_code, 2) << dtype.output;
    EXPECT_NE(dtype.output.find("unknown dtype 'f64'"), std::string::npos) << dtype.output;
    // A hook's template arguments may hold commas; f16 -> f32 has candidates of its own.
    const ToolRun ok =
        with({"--include-root", example_10_device_dir().string(), "--fused-gemm",
              "chain_gemm.cuh,example::WaitForRows,example::NotifyNextRank", "--fused-gemm-dtypes", "f16,f32"});
    EXPECT_EQ(ok.exit_code, 0) << ok.output;
    EXPECT_NE(ok.output.find("f16->f32"), std::string::npos) << ok.output;
    // --strict judges compiles: with --list (or --expect-cached) nothing is compiled, so it is refused, not passed.
    for (const char* mode : {"--list", "--expect-cached"}) {
        const ToolRun strict =
            run_weft_compile({"--arch", "sm_90a", "--cache-dir", cache.path().string(), mode, "--strict",
                              "--include-root", example_10_device_dir().string(), "--fused-gemm",
                              "chain_gemm.cuh,example::WaitForRows,example::NotifyNextRank"});
        EXPECT_EQ(strict.exit_code, 2) << mode << "\n" << strict.output;
        EXPECT_NE(strict.output.find(std::string("does not combine with ") + mode), std::string::npos) << strict.output;
    }
}

// --strict fails a kernel that spills (here forced by --maxrregcount); without it the same compile succeeds.
TEST(WeftCompile, StrictFailsAKernelThatSpills) {
    SKIP_WITHOUT_WEFT_COMPILE();
    TempDir cache("weft_compile_cache"), root("weft_compile_root");
    write_text_file(root / "spills.cuh",
                    "#pragma once\n"
                    "__global__ void spills(float* out, const float* in) {\n"
                    "    float acc[64];\n"
                    "#pragma unroll\n"
                    "    for (int i = 0; i < 64; ++i) acc[i] = in[threadIdx.x * 64 + i];\n"
                    "#pragma unroll\n"
                    "    for (int j = 1; j < 8; ++j) {\n"
                    "#pragma unroll\n"
                    "        for (int i = 0; i < 64; ++i) acc[i] = acc[i] * acc[(i + j) % 64] + in[j];\n"
                    "    }\n"
                    "#pragma unroll\n"
                    "    for (int i = 0; i < 64; ++i) out[threadIdx.x * 64 + i] = acc[i];\n"
                    "}\n");
    write_text_file(root / "specs.txt", "spills.cuh|spills\n");
    const std::vector<std::string> args = {"--arch",         "sm_90a",
                                           "--cache-dir",    cache.path().string(),
                                           "--include-root", root.path().string(),
                                           "--specs",        (root / "specs.txt").string(),
                                           "--maxrregcount", "16"};
    const ToolRun plain = run_weft_compile(args);
    ASSERT_EQ(plain.exit_code, 0) << plain.output;
    std::vector<std::string> strict_args = args;
    strict_args.push_back("--strict");
    const ToolRun strict = run_weft_compile(strict_args);  // a cache hit: the entry's ptxas report is checked as well
    EXPECT_EQ(strict.exit_code, 1) << strict.output;
    EXPECT_NE(strict.output.find("1 spilling or warned"), std::string::npos) << strict.output;
}

}  // namespace
}  // namespace weft
