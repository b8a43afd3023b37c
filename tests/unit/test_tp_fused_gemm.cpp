// SPDX-License-Identifier: MIT
// Unit tests (CPU) of the public fused-GEMM interface (weft/ops/fused_gemm.hpp): the JIT specs it makes (weft's own
// fused ops' kernels are the kernels they were, the plain one weft::ops::gemm's own cache entry), its checks, its
// config choice, and an NVRTC compile of examples/10_custom_fused_gemm's kernel (a user's header under an extra
// include root).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "support/jit_testing.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/jit/paths.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

namespace fs = std::filesystem;
using testing::isolated_compiler_config;

constexpr const char* kArch = "sm_90a";

GemmConfig fused_cfg(int index, DType in, DType out) {
    GemmConfig c = gemm_candidate(index, in, out, BLayout::kNK);
    c.cluster_m = c.cluster_n = 1;
    return c;
}

void expect_error(const std::function<void()>& fn, const std::string& needle) {
    try {
        fn();
        ADD_FAILURE() << "expected a weft::Error mentioning \"" << needle << "\"";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
}

// weft's fused ops launch through FusedGemm: their kernels are spelled exactly as before (one JIT cache entry each),
// and the plain GEMM of a world of one rank is weft::ops::gemm's own kernel.
TEST(TpFusedGemm, OpsSpecsNameTheKernelsTheyAlwaysWere) {
    jit::Compiler compiler(isolated_compiler_config(fs::path()));
    for (const GemmConfig& c : ops::fused_gemm_candidates(DType::kBF16, DType::kBF16)) {
        const std::string cfg = ops::format_gemm_config(c);
        const jit::KernelSpec plain = ops::fused_gemm_kernel_spec(ops::plain_gemm_fused_spec(), c, kArch);
        const jit::KernelSpec gemm = ops::gemm_kernel_spec(c, kArch);
        EXPECT_EQ(plain.header, gemm.header);
        EXPECT_EQ(plain.instantiation, gemm.instantiation);
        EXPECT_EQ(compiler.cache_key(plain), compiler.cache_key(gemm)) << cfg;

        const jit::KernelSpec ag = ops::detail::ag_gemm_kernel_spec(c, kArch);
        EXPECT_EQ(ag.header, "ag_gemm/ag_gemm.cuh");
        EXPECT_EQ(ag.instantiation, "weft::kernels::ag_gemm::ag_gemm_kernel<" + cfg + ">");
        const jit::KernelSpec pull = ops::detail::gemm_rs_kernel_spec(c, kArch, ops::GemmRsMode::kPull);
        EXPECT_EQ(pull.instantiation, "weft::kernels::gemm_rs::rs_gemm_kernel<" + cfg +
                                          ", weft::kernels::gemm_rs::RsGemmHook<" + cfg + ">>");
        const jit::KernelSpec push = ops::detail::gemm_rs_kernel_spec(c, kArch, ops::GemmRsMode::kPush);
        EXPECT_EQ(push.instantiation, "weft::kernels::gemm_rs::rs_gemm_kernel<" + cfg +
                                          ", weft::kernels::gemm_rs::RsPushHook<" + cfg + ">>");
        for (const jit::KernelSpec* s : {&plain, &ag, &pull, &push}) {
            EXPECT_TRUE(s->preamble.empty() && s->extra_code.empty()) << s->instantiation;
        }
    }
}

TEST(TpFusedGemm, SpecOfAUsersHeader) {
    const GemmConfig c = fused_cfg(0, DType::kF16, DType::kF32);
    const std::string cfg = ops::format_gemm_config(c);
    ops::FusedGemmSpec spec{.header = "my/hooks.cuh", .scheduler = "my::Wait", .hook = "my::Notify<CFG, MyCFG, CFG_>",
                            .include_root = fs::path("/somewhere"), .name = "mine"};
    const jit::KernelSpec k = ops::fused_gemm_kernel_spec(spec, c, kArch);
    EXPECT_EQ(k.header, "my/hooks.cuh");
    // "CFG" is replaced where it is a whole token only.
    EXPECT_EQ(k.instantiation, "weft::kernels::gemm::gemm_kernel<" + cfg + ", my::Wait<" + cfg + ">, my::Notify<" +
                                   cfg + ", MyCFG, CFG_>>");
    EXPECT_EQ(k.extra_code, "#include <gemm/gemm_sm90.cuh>");  // a header of one's own gets weft's kernel after it
    EXPECT_EQ(k.arch, kArch);
    EXPECT_EQ(k.description.rfind("mine ", 0), 0u) << k.description;
    spec.kernel_template = "my::wrapper<CFG>";
    EXPECT_EQ(ops::fused_gemm_kernel_spec(spec, c, kArch).instantiation, "my::wrapper<" + cfg + ">");
}

TEST(TpFusedGemm, ChecksSpecAndConfig) {
    const GemmConfig ok = fused_cfg(0, DType::kBF16, DType::kBF16);
    const ops::FusedGemmSpec spec{.header = "h.cuh", .scheduler = "S", .hook = "H"};
    EXPECT_NO_THROW(ops::fused_gemm_kernel_spec(spec, ok, kArch));
    expect_error([&] { ops::fused_gemm_kernel_spec({.scheduler = "S", .hook = "H"}, ok, kArch); }, ".header");
    expect_error([&] { ops::fused_gemm_kernel_spec({.header = "h.cuh", .hook = "H"}, ok, kArch); },
                 ".scheduler and .hook");
    GemmConfig pair = gemm_candidate(1, DType::kBF16, DType::kBF16, BLayout::kNK);
    ASSERT_GT(pair.cluster_m * pair.cluster_n, 1);
    expect_error([&] { ops::fused_gemm_kernel_spec(spec, pair, kArch); }, "cluster-free");
    GemmConfig bad = ok;
    bad.tile_k = 32;
    expect_error([&] { ops::check_fused_gemm_config(bad); }, "not a valid GemmConfig");
    expect_error([&] { ops::fused_gemm_compiler(fs::path("/no/such/folder/anywhere")); },
                 "fused_gemm: FusedGemmSpec::include_root must be a directory, got '/no/such/folder/anywhere'");
    EXPECT_EQ(&ops::fused_gemm_compiler(fs::path()), &jit::compiler());
    const fs::path root = jit::find_include_roots().weft_kernels;
    EXPECT_EQ(&ops::fused_gemm_compiler(root), &jit::compiler(root));
}

// FusedGemm::launch checks weft's own scheduler and hook parameters before the launch: a zero-initialised struct with a
// field forgotten is an error naming the field, not a kernel dividing by zero or loading through null.
TEST(TpFusedGemm, WeftsOwnParamsAreCheckedBeforeTheLaunch) {
    ops::FusedGemmCall call;
    call.config = gemm_candidate(0, DType::kBF16, DType::kBF16, BLayout::kNK);
    call.args.m = 300;
    call.args.n = 1000;  // 4 tiles of 256 columns
    uint64_t word = 0;
    gemm::ChunkWaitParams wait{};
    wait.flags = &word;
    wait.rows_per_chunk = 128;
    wait.timeout_ns = 1000;
    ops::detail::check_fused_gemm_params(wait, call);
    gemm::ChunkWaitParams bad = wait;
    bad.rows_per_chunk = 0;
    expect_error([&] { ops::detail::check_fused_gemm_params(bad, call); }, "rows_per_chunk must be >= 1, got 0");
    bad = wait;
    bad.flags = nullptr;
    expect_error([&] { ops::detail::check_fused_gemm_params(bad, call); }, "ChunkWaitParams::flags");
    bad = wait;
    bad.timeout_ns = 0;  // the device's default bound (10 minutes), as a zero-initialised struct promises
    ops::detail::check_fused_gemm_params(bad, call);
    bad = wait;
    bad.value_mode = gemm::SignalValueMode::kEpoch;
    expect_error([&] { ops::detail::check_fused_gemm_params(bad, call); }, "ChunkWaitParams::epoch");
    bad.epoch = &word;
    ops::detail::check_fused_gemm_params(bad, call);

    gemm::TileSignalParams signal{};
    signal.flags = &word;
    signal.num_n_tiles = 4;
    ops::detail::check_fused_gemm_params(signal, call);
    gemm::TileSignalParams wrong = signal;
    wrong.num_n_tiles = 3;
    expect_error([&] { ops::detail::check_fused_gemm_params(wrong, call); }, "at least the 4 tiles of N = 1000");
    wrong.mode = gemm::TileSignalMode::kAddPerTileRow;  // one counter per row of tiles: num_n_tiles is not a layout
    ops::detail::check_fused_gemm_params(wrong, call);
    wrong = signal;
    wrong.flags = nullptr;
    expect_error([&] { ops::detail::check_fused_gemm_params(wrong, call); }, "TileSignalParams::flags is null");
    wrong = signal;
    wrong.mode = static_cast<gemm::TileSignalMode>(7);
    expect_error([&] { ops::detail::check_fused_gemm_params(wrong, call); }, "got 7");
    wrong = signal;
    wrong.value_mode = gemm::SignalValueMode::kEpoch;
    expect_error([&] { ops::detail::check_fused_gemm_params(wrong, call); }, "TileSignalParams::epoch");
    wrong.mode = gemm::TileSignalMode::kAddPerTileRow;  // adds `value` in both modes: no epoch read
    ops::detail::check_fused_gemm_params(wrong, call);
    // A parameter type of the caller's own is the caller's to check.
    ops::detail::check_fused_gemm_params(uint64_t{0}, call);
}

// The candidates are what the fused kernels can run (cluster-free, whole store boxes, no duplicates), and the choice
// is the cheapest of them by the GEMM's cost model with the hooks' per-tile cost: the same on every call.
TEST(TpFusedGemm, CandidatesAndChoice) {
    for (DType out : {DType::kBF16, DType::kF32}) {
        const std::vector<GemmConfig> list = ops::fused_gemm_candidates(DType::kBF16, out);
        ASSERT_FALSE(list.empty());
        for (size_t i = 0; i < list.size(); ++i) {
            EXPECT_NO_THROW(ops::check_fused_gemm_config(list[i])) << ops::format_gemm_config(list[i]);
            EXPECT_EQ(std::count(list.begin(), list.end(), list[i]), 1);
        }
        for (const GemmConfig& c : ops::fused_gemm_candidates(DType::kBF16, out, 128)) EXPECT_EQ(128 % c.tile_m, 0);
    }
    const ops::GemmProblem p{.m = 8192, .n = 11008, .k = 4096};
    const GemmConfig chosen = ops::fused_gemm_config(p, 132);
    const std::vector<GemmConfig> list = ops::fused_gemm_candidates(DType::kBF16, DType::kBF16);
    EXPECT_NE(std::find(list.begin(), list.end(), chosen), list.end());
    for (const GemmConfig& c : list) {
        EXPECT_LE(ops::gemm_config_cost(p, chosen, 132, 1024), ops::gemm_config_cost(p, c, 132, 1024))
            << ops::format_gemm_config(c);
    }
    EXPECT_EQ(ops::detail::cheapest_fused_gemm_config(p, 132), chosen);
    EXPECT_FALSE(ops::detail::cheapest_fused_gemm_config(p, 132, 32).has_value());  // below every tile_m
    expect_error([&] { ops::fused_gemm_config(p, 0); }, "budget");
    EXPECT_EQ(ops::fused_gemm_grid(chosen, 8192, 11008, 16), 16);
    EXPECT_EQ(ops::fused_gemm_grid(chosen, 1, 8, 16), 1);
}

// examples/10_custom_fused_gemm: its scheduler and hook, in a header of its own found through an extra include root,
// compile into weft's GEMM kernel for sm_90a (the example runs it on a GPU), with a clean ptxas report: its checked
// wait and notify are call-free, so no wgmma is serialised (C75xx) and nothing spills.
TEST(TpFusedGemm, ExampleKernelCompiles) {
    const fs::path device_dir =
        jit::find_include_roots().weft_include.parent_path() / "examples" / "10_custom_fused_gemm" / "device";
    ASSERT_TRUE(fs::is_regular_file(device_dir / "chain_gemm.cuh")) << device_dir;
    jit::Compiler compiler(isolated_compiler_config(fs::path(), {device_dir}));
    const ops::FusedGemmSpec spec{.header = "chain_gemm.cuh", .scheduler = "example::WaitForRows",
                                  .hook = "example::NotifyNextRank", .include_root = device_dir};
    for (const GemmConfig& c :
         {ops::fused_gemm_config({.m = 1024, .n = 512, .k = 512}, 16), fused_cfg(9, DType::kBF16, DType::kBF16)}) {
        SCOPED_TRACE(ops::format_gemm_config(c));
        jit::CompileResult r;
        try {
            r = compiler.compile(ops::fused_gemm_kernel_spec(spec, c, kArch));
        } catch (const std::exception& e) {
            FAIL() << e.what();
        }
        EXPECT_FALSE(r.lowered_name.empty());
        EXPECT_FALSE(r.cubin == nullptr || r.cubin->empty());
        EXPECT_NE(r.source.find("#include <chain_gemm.cuh>"), std::string::npos) << r.source;
        // The user's headers are part of the cache key, as weft's own are.
        EXPECT_NE(std::find(r.headers.begin(), r.headers.end(), "chain_gemm.cuh"), r.headers.end());
        EXPECT_NE(std::find(r.headers.begin(), r.headers.end(), "chain_params.hpp"), r.headers.end());
        EXPECT_NE(r.log.find("bytes spill stores"), std::string::npos) << "no ptxas report:\n" << r.log;
        EXPECT_EQ(r.log.find("C75"), std::string::npos) << "ptxas performance warning:\n" << r.log;
        EXPECT_NE(r.log.find(" 0 bytes spill stores, 0 bytes spill loads"), std::string::npos) << "spills:\n" << r.log;
    }
}

}  // namespace
}  // namespace weft
