// SPDX-License-Identifier: MIT
// Unit tests (CPU): NVRTC compiles the tensor-parallel fused kernels (AllGather+GEMM, GEMM+ReduceScatter,
// GEMM+AllReduce) through weft::jit for sm_90a, with a clean ptxas report (no spills, no wgmma serialisation,
// no ignored setmaxnreg).
#include <gtest/gtest.h>

#include <regex>
#include <set>
#include <string>
#include <vector>

#include "support/jit_testing.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/ops/tp_aot.hpp"

namespace weft {
namespace {

namespace fs = std::filesystem;
using testing::isolated_compiler_config;

constexpr const char* kArch = "sm_90a";

/// No ptxas performance warning, and spills of at most `max_spill_bytes` (0 for every kernel but the
/// GEMM+RS push epilogue, whose extra state shares the consumer's 168 registers: kernels/gemm_rs/README.md).
void expect_clean(const jit::CompileResult& r, const std::string& what, int max_spill_bytes = 0) {
    EXPECT_EQ(r.log.find("C75"), std::string::npos) << what << ": ptxas performance warning:\n" << r.log;
    EXPECT_EQ(r.log.find("warning"), std::string::npos) << what << ":\n" << r.log;
    const std::regex spill(R"((\d+) bytes spill stores, (\d+) bytes spill loads)");
    int functions = 0;
    for (auto it = std::sregex_iterator(r.log.begin(), r.log.end(), spill); it != std::sregex_iterator(); ++it) {
        ++functions;
        EXPECT_LE(std::stoi((*it)[1].str()), max_spill_bytes) << what << ": spill stores\n" << r.log;
        EXPECT_LE(std::stoi((*it)[2].str()), max_spill_bytes) << what << ": spill loads\n" << r.log;
    }
    EXPECT_GT(functions, 0) << what << ": no ptxas report in the log\n" << r.log;
    EXPECT_FALSE(r.lowered_name.empty()) << what;
    EXPECT_FALSE(r.cubin == nullptr || r.cubin->empty()) << what;
}

void compile_clean(jit::Compiler& compiler, const jit::KernelSpec& spec, int max_spill_bytes = 0) {
    SCOPED_TRACE(spec.describe());
    jit::CompileResult r;
    try {
        r = compiler.compile(spec);
    } catch (const std::exception& e) {
        FAIL() << e.what();
    }
    expect_clean(r, spec.describe(), max_spill_bytes);
}

/// The push epilogue's spill budget for the 128x256 and 256x128 tiles, whose extra state shares the consumer's 168
/// registers with the accumulators (kernels/gemm_rs/README.md).
constexpr int kPushSpillBudget = 320;

GemmConfig cfg(int index, DType in, DType out) {
    GemmConfig c = gemm_candidate(index, in, out, BLayout::kNK);
    c.cluster_m = c.cluster_n = 1;  // the fused ops are cluster-free
    return c;
}

TEST(TpNvrtc, AgGemmKernelsCompileClean) {
    jit::Compiler compiler(isolated_compiler_config(fs::path()));
    compile_clean(compiler, ops::detail::ag_gemm_kernel_spec(cfg(0, DType::kBF16, DType::kBF16), kArch));
    compile_clean(compiler, ops::detail::ag_gemm_kernel_spec(cfg(3, DType::kF16, DType::kF16), kArch));
    compile_clean(compiler, ops::detail::ag_notify_kernel_spec(kArch));
    compile_clean(compiler, ops::detail::ag_relay_kernel_spec(kArch));
    compile_clean(compiler,
                  ops::fused_gemm_kernel_spec(ops::plain_gemm_fused_spec(), cfg(0, DType::kBF16, DType::kBF16), kArch));
    // The shared-GPU pull kernel (AgGemm's, AgAttention's and the copy-engine collectives'), from the AOT list.
    int pull_kernels = 0;
    for (jit::KernelSpec spec : ops::tp_aot_specs()) {
        if (spec.header.find("peer_pull") == std::string::npos) continue;
        spec.arch = kArch;
        compile_clean(compiler, spec);
        ++pull_kernels;
    }
    EXPECT_EQ(pull_kernels, 1);
}

TEST(TpNvrtc, GemmRsKernelsCompileClean) {
    jit::Compiler compiler(isolated_compiler_config(fs::path()));
    compile_clean(compiler, ops::detail::gemm_rs_kernel_spec(cfg(0, DType::kBF16, DType::kBF16), kArch));
    compile_clean(compiler, ops::detail::gemm_rs_kernel_spec(cfg(6, DType::kF16, DType::kF32), kArch));
    compile_clean(compiler, ops::detail::rs_reduce_kernel_spec(DType::kBF16, DType::kBF16, kArch));
    compile_clean(compiler, ops::detail::rs_reduce_kernel_spec(DType::kF32, DType::kF16, kArch));
    compile_clean(compiler,
                  ops::detail::gemm_rs_kernel_spec(cfg(0, DType::kBF16, DType::kBF16), kArch, ops::GemmRsMode::kPush),
                  kPushSpillBudget);
    compile_clean(compiler,
                  ops::detail::gemm_rs_kernel_spec(cfg(3, DType::kF16, DType::kF16), kArch, ops::GemmRsMode::kPush),
                  kPushSpillBudget);
    compile_clean(compiler, ops::detail::gemm_rs_kernel_spec(cfg(6, DType::kBF16, DType::kBF16), kArch,
                                                             ops::GemmRsMode::kPush));  // 128x128: no spill
    // A team that spans nodes: the check of the calls that crossed the network, the final sum of the nodes' sums.
    compile_clean(compiler, ops::detail::net_check_calls_kernel_spec(kArch));
    compile_clean(compiler, ops::detail::rs_node_sum_kernel_spec(DType::kBF16, kArch));
    compile_clean(compiler, ops::detail::rs_node_sum_kernel_spec(DType::kF16, kArch));
}

// Ping-pong tiles in the fused kernels (each consumer warpgroup adds to, stores and signals its own tiles): no
// serialised wgmma and no spill (push: the cooperative push tiles' budget) at the widest ping-pong tile (128x192:
// 192 accumulators per thread, which any reachable trap in the tile loop would spill) and the 64-row one.
TEST(TpNvrtc, PingPongFusedKernelsCompileClean) {
    jit::Compiler compiler(isolated_compiler_config(fs::path()));
    compile_clean(compiler, ops::detail::ag_gemm_kernel_spec(cfg(9, DType::kBF16, DType::kBF16), kArch));
    compile_clean(compiler, ops::detail::gemm_rs_kernel_spec(cfg(9, DType::kBF16, DType::kBF16), kArch));
    compile_clean(compiler, ops::detail::gemm_rs_kernel_spec(cfg(9, DType::kF16, DType::kF32), kArch));
    compile_clean(compiler,
                  ops::detail::gemm_rs_kernel_spec(cfg(9, DType::kBF16, DType::kBF16), kArch, ops::GemmRsMode::kPush),
                  kPushSpillBudget);  // the cooperative push tiles' budget
    compile_clean(compiler,
                  ops::detail::gemm_rs_kernel_spec(cfg(12, DType::kF16, DType::kF16), kArch, ops::GemmRsMode::kPush));
    compile_clean(compiler,
                  ops::fused_gemm_kernel_spec(ops::plain_gemm_fused_spec(), cfg(13, DType::kBF16, DType::kF32), kArch));
}

TEST(TpNvrtc, GemmArKernelsCompileClean) {
    jit::Compiler compiler(isolated_compiler_config(fs::path()));
    compile_clean(compiler, ops::detail::ar_reduce_kernel_spec(DType::kBF16, DType::kBF16, kArch));
    compile_clean(compiler, ops::detail::ar_reduce_kernel_spec(DType::kF32, DType::kF16, kArch));
    compile_clean(compiler,
                  ops::detail::gemv_kernel_spec(1, DType::kBF16, DType::kBF16, GemvVariant::kBulkRows, kArch));
    compile_clean(compiler, ops::detail::gemv_kernel_spec(4, DType::kF16, DType::kF32, GemvVariant::kTmaRing, kArch));
}

// weft-compile --builtin warms the TP ops' kernels: the list is unique and covers what the ops launch.
TEST(TpNvrtc, AotSpecsCoverTheOpsKernels) {
    const std::vector<jit::KernelSpec> specs = ops::tp_aot_specs();
    std::set<std::string> names;
    for (const auto& s : specs) EXPECT_TRUE(names.insert(s.header + "|" + s.instantiation).second) << s.instantiation;
    const GemmConfig c = cfg(0, DType::kBF16, DType::kBF16);
    for (const jit::KernelSpec& want :
         {ops::detail::ag_gemm_kernel_spec(c), ops::detail::ag_notify_kernel_spec(),
          ops::detail::ag_relay_kernel_spec(), ops::detail::gemm_rs_kernel_spec(c),
          ops::detail::rs_reduce_kernel_spec(DType::kBF16, DType::kBF16), ops::detail::net_check_calls_kernel_spec(),
          ops::detail::rs_node_sum_kernel_spec(DType::kBF16),
          ops::detail::ar_reduce_kernel_spec(DType::kF32, DType::kF16)}) {
        EXPECT_EQ(names.count(want.header + "|" + want.instantiation), 1u) << want.instantiation;
    }
}

}  // namespace
}  // namespace weft
