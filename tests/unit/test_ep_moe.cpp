// SPDX-License-Identifier: MIT
// Unit tests (CPU) of the expert-parallel MoE block (weft/ops/ep_moe.hpp): its plan and config checks, the fused
// counters' places in the EP kernels' arguments and shared memory, and NVRTC compiles of the kernels it adds (the
// SwiGLU; the grouped GEMMs with the dispatch's count wait and the combine's tile signals).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <utility>

#include "support/error_text.hpp"
#include "support/jit_testing.hpp"
#include "weft/common/ep_workspace.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/ep_moe.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/grouped_gemm.hpp"
#include "weft/runtime/error.hpp"

namespace weft::ops::ep {
namespace {

MoeConfig small_config() {
    MoeConfig c;
    c.ep.num_experts = 16;
    c.ep.hidden = 256;
    c.ep.topk = 4;
    c.ep.max_tokens_per_rank = 64;
    c.ffn = 128;
    return c;
}

using testing::error_of;

TEST(EpMoePlan, RefusesBadConfigsNamingTheField) {
    MoeConfig c = small_config();
    c.ffn = 0;
    EXPECT_NE(error_of([&] { plan_moe_block(c, 2, 132); }).find("config.ffn"), std::string::npos);
    c.ffn = 100;  // not a multiple of 8
    EXPECT_NE(error_of([&] { plan_moe_block(c, 2, 132); }).find("multiple of 8"), std::string::npos);
    c = small_config();
    c.ep.normal = false;
    EXPECT_NE(error_of([&] { plan_moe_block(c, 2, 132); }).find("config.ep.normal"), std::string::npos);
    c = small_config();
    c.ep.num_experts = 15;  // not a multiple of the ranks: the EP buffer's own check
    EXPECT_NE(error_of([&] { plan_moe_block(c, 2, 132); }), "");
    c = small_config();
    EXPECT_NE(error_of([&] { plan_moe_block(c, 2, 0); }).find("num_sms"), std::string::npos);
}

// Communication keeps at most a quarter of the SMs, at least one, and never more than the EP default.
TEST(EpMoePlan, CommunicationSmsLeaveTheGemmsMostOfTheBudget) {
    for (int budget : {2, 3, 16, 33, 66, 132}) {
        for (int tokens : {0, 1, 8, 128, 4096, 65536}) {
            const int comm = moe_comm_sms(tokens, budget);
            EXPECT_GE(comm, 1);
            EXPECT_LT(comm, budget);
            EXPECT_LE(comm, std::max(1, budget / 4));
            EXPECT_LE(comm, default_normal_sms(tokens, budget - 1));
        }
    }
    EXPECT_EQ(moe_comm_sms(4096, 132), 24);
    EXPECT_EQ(moe_comm_sms(4096, 16), 4);
    EXPECT_EQ(moe_comm_sms(8, 16), 1);
    EXPECT_NE(error_of([] { moe_comm_sms(8, 1); }).find("SM budget"), std::string::npos);
}

// Ranks sharing a GPU: every rank's kernels of a call must be resident at once (the dispatch waits for every peer's,
// the up GEMM for its rank's dispatch, the combine for its down GEMM and every peer's combine). With the default SM
// budget (the device's SMs / ranks on it) a rank holds at most its budget of CTAs at once, so all ranks fit the GPU.
// The benchmark's world-8 case on one H200: budget 132 / 8 = 16; 8 tokens: dispatch 1 block + up GEMM 15 CTAs,
// 128 tokens: 2 + 14; 8 ranks x 16 = 128 <= 132 SMs (one SM per CTA at most).
TEST(EpMoePlan, EveryRanksKernelsFitItsShareOfASharedGpu) {
    constexpr int kSms = 132;
    struct Shape {
        int hidden, experts, topk, ffn;
    };
    for (const Shape& sh : {Shape{4096, 256, 8, 2048}, Shape{7168, 256, 8, 2048}, Shape{256, 32, 8, 512},
                            Shape{256, 16, 2, 128}, Shape{512, 120, 4, 256}, Shape{512, 168, 6, 256}}) {
        for (int ranks : {1, 2, 3, 4, 5, 6, 7, 8}) {
            if (sh.experts % ranks != 0) continue;
            const int budget = kSms / ranks;  // World::sm_budget's default rule
            ASSERT_LE(ranks * budget, kSms);
            for (int tokens : {1, 8, 96, 128, 4096}) {
                MoeConfig c;
                c.ep.num_experts = sh.experts;
                c.ep.hidden = sh.hidden;
                c.ep.topk = sh.topk;
                c.ep.max_tokens_per_rank = tokens;
                c.ffn = sh.ffn;
                const MoePlan plan = plan_moe_block(c, ranks, budget);
                for (bool fused : {true, false}) {
                    for (int comm_sms : {0, 1, budget - 1}) {
                        const MoeGrids g =
                            moe_block_grids(c, plan, ranks, tokens, budget, {.fused = fused, .comm_sms = comm_sms});
                        SCOPED_TRACE(std::to_string(sh.hidden) + "x" + std::to_string(sh.experts) + ", " +
                                     std::to_string(ranks) + " ranks, " + std::to_string(tokens) + " tokens, " +
                                     (fused ? "fused" : "sequential") + ", comm_sms " + std::to_string(comm_sms));
                        EXPECT_GE(g.comm, 1);
                        EXPECT_EQ(g.comm, comm_sms > 0 ? comm_sms : moe_comm_sms(tokens, budget));
                        // One rank: the separate ops either way (nothing to overlap).
                        EXPECT_EQ(g.fused, fused && ranks > 1);
                        EXPECT_EQ(g.gemm_sms, g.fused ? budget - g.comm : budget);
                        EXPECT_GE(g.up, 1);
                        EXPECT_GE(g.down, 1);
                        EXPECT_LE(g.up, g.gemm_sms);
                        EXPECT_LE(g.down, g.gemm_sms);
                        EXPECT_LE(g.swiglu, g.gemm_sms);
                        EXPECT_LE(g.resident(), budget);
                        EXPECT_LE(ranks * g.resident(), kSms);
                    }
                }
            }
        }
    }
    // The benchmark's case, in numbers.
    MoeConfig c;
    c.ep.num_experts = 256;
    c.ep.hidden = 4096;
    c.ep.topk = 8;
    c.ffn = 2048;
    for (const auto& [tokens, comm] : {std::pair{8, 1}, std::pair{128, 2}}) {
        c.ep.max_tokens_per_rank = tokens;
        c.ep.max_recv_rows = expected_recv_rows(c.ep, 8) * 5 / 4 + 256;  // the benchmark's receive limits
        c.ep.max_recv_tokens = expected_recv_tokens(c.ep, 8) * 5 / 4 + 64;
        const MoeGrids g = moe_block_grids(c, plan_moe_block(c, 8, 16), 8, tokens, 16);
        EXPECT_EQ(g.comm, comm);
        EXPECT_EQ(g.up, 16 - comm);  // the up GEMM fills the rest of the share: more tiles than SMs
        EXPECT_EQ(g.down, 16 - comm);
        EXPECT_EQ(g.resident(), 16);
    }
    // EpMoeGpu.WorldEightSharingOneGpuRunsFullGridsBackToBack's case: its GEMMs fill the share too.
    MoeConfig t;
    t.ep.num_experts = 32;
    t.ep.hidden = 256;
    t.ep.topk = 8;
    t.ep.max_tokens_per_rank = 96;
    t.ffn = 512;
    for (bool fused : {true, false}) {
        const MoeGrids g = moe_block_grids(t, plan_moe_block(t, 8, 16), 8, 96, 16, {.fused = fused});
        EXPECT_EQ(g.comm, 2);
        EXPECT_EQ(g.up, g.gemm_sms);
        EXPECT_EQ(g.down, g.gemm_sms);
        EXPECT_EQ(g.resident(), 16);
    }
}

TEST(EpMoePlan, GridsRefuseBadBudgetsAndCommSms) {
    const MoeConfig c = small_config();
    const MoePlan plan = plan_moe_block(c, 2, 16);
    EXPECT_NE(error_of([&] { moe_block_grids(c, plan, 2, 8, 1); }).find("SM budget"), std::string::npos);
    EXPECT_NE(error_of([&] { moe_block_grids(c, plan, 2, 8, 16, {.comm_sms = 16}); }).find("comm_sms"),
              std::string::npos);
    EXPECT_NE(error_of([&] { moe_block_grids(c, plan, 2, 8, 16, {.comm_sms = -1}); }).find("comm_sms"),
              std::string::npos);
    EXPECT_NE(error_of([&] { moe_block_grids(c, plan, 3, 8, 16); }).find("num_experts"), std::string::npos);
}

// The fused GEMMs wait for the dispatch, which waits for peers for up to the World's timeout: their bound is twice it.
TEST(EpMoePlan, GemmWaitsOutlastThePeerWaits) {
    EXPECT_EQ(moe_gemm_timeout_ns(std::chrono::milliseconds(30000)), 60000000000ull);
    EXPECT_EQ(moe_gemm_timeout_ns(std::chrono::minutes(10)), 1200000000000ull);
    // A World bound past 15 days: at most the 30 days the grouped GEMM takes.
    EXPECT_EQ(moe_gemm_timeout_ns(std::chrono::milliseconds(2592000000)), 2592000000ull * 1000000ull);
    EXPECT_NE(error_of([] { moe_gemm_timeout_ns(std::chrono::milliseconds(0)); }).find("timeout"), std::string::npos);
}

// The combine waits on a counter per (expert, row of down tiles): the stride covers the most rows an expert can
// receive, and the target is the tiles of one row of tiles.
TEST(EpMoePlan, TileCountersCoverEveryExpertsRows) {
    for (int ranks : {1, 2, 4, 8}) {
        for (int tokens : {1, 8, 128, 4096}) {
            MoeConfig c = small_config();
            c.ep.num_experts = 64;
            c.ep.hidden = 4096;
            c.ep.topk = 8;
            c.ep.max_tokens_per_rank = tokens;
            c.ffn = 1024;
            const MoePlan p = plan_moe_block(c, ranks, 132 / ranks);
            Config ep = c.ep;
            ep.low_latency = false;
            const Geometry g = resolve_geometry(ep, ranks, 0);
            EXPECT_EQ(p.max_recv_rows, g.max_recv_rows);
            EXPECT_TRUE(is_valid_grouped(p.up)) << format_gemm_config(p.up);
            EXPECT_TRUE(is_valid_grouped(p.down)) << format_gemm_config(p.down);
            EXPECT_GE(int64_t{p.tile_stride} * p.down.tile_m, g.max_recv_rows);
            EXPECT_LT(int64_t{p.tile_stride - 1} * p.down.tile_m, std::max<int64_t>(g.max_recv_rows, 1));
            EXPECT_EQ(p.down_n_tiles, (4096 + p.down.tile_n - 1) / p.down.tile_n);
            EXPECT_EQ(p.up.in_dtype, DType::kBF16);
            EXPECT_EQ(p.up.out_dtype, DType::kBF16);
            EXPECT_EQ(p.up.b_layout, BLayout::kNK);
        }
    }
}

// The fused words are appended to the kernels' arguments and shared memory: the normal kernels' existing fields
// keep their places, and an unfused call (zeroed NormalFused) touches none of them.
TEST(EpMoePlan, FusedWordsAreAppendedToTheNormalKernelsState) {
    weft::ep::Geometry g{};
    g.num_ranks = 4;
    g.num_experts = 32;
    g.topk = 4;
    g.hidden = 256;
    const auto s = weft::ep::NormalSmem::make(g, 512);
    EXPECT_GT(s.exp_rows, s.flags);
    EXPECT_GE(s.total - s.exp_rows, int64_t{g.local_experts()} * 4);
    EXPECT_EQ(s.exp_rows % 16, 0);
    const NormalOptions o{};
    EXPECT_EQ(o.fused.counts_ready, nullptr);
    EXPECT_EQ(o.fused.expert_ready, nullptr);
    EXPECT_EQ(o.fused.expert_rows, nullptr);
    EXPECT_EQ(o.fused.tile_done, nullptr);
    EXPECT_GT(offsetof(weft::ep::NormalArgs, fused), offsetof(weft::ep::NormalArgs, status));
}

TEST(EpMoeNvrtc, SwigluCompilesForSm90aWithoutSpills) {
    weft::testing::TempDir cache("weft_ep_moe_cache");
    jit::Compiler compiler(weft::testing::isolated_compiler_config(cache.path()));
    jit::KernelSpec s = moe_swiglu_kernel_spec("sm_90a");
    const jit::CompileResult r = compiler.compile(s);
    ASSERT_TRUE(r.cubin && !r.cubin->empty()) << s.describe() << "\n" << r.log;
    EXPECT_GT(r.ptxas_info.registers, 0) << r.log;
    EXPECT_EQ(r.ptxas_info.spill_store_bytes, 0) << r.ptxas_info.text;
}

// The two grouped GEMMs a fused block launches for a DeepSeek-like shape: the up-projection with the per-expert wait
// (and the wait for the dispatch's counts in its scheduler's constructor), the down-projection with per-(expert, row
// of tiles) signals.
TEST(EpMoeNvrtc, FusedExpertGemmsOfAPlanCompileWithoutSpills) {
    MoeConfig c;
    c.ep.num_experts = 256;
    c.ep.hidden = 4096;
    c.ep.topk = 8;
    c.ep.max_tokens_per_rank = 128;
    c.ffn = 2048;
    const MoePlan p = plan_moe_block(c, 8, 16);
    weft::testing::TempDir cache("weft_ep_moe_gemm_cache");
    jit::Compiler compiler(weft::testing::isolated_compiler_config(cache.path()));
    for (jit::KernelSpec s : {grouped_gemm_kernel_spec(p.up, true, false, "sm_90a"),
                              grouped_gemm_kernel_spec(p.down, false, true, "sm_90a")}) {
        const jit::CompileResult r = compiler.compile(s);
        ASSERT_TRUE(r.cubin && !r.cubin->empty()) << s.instantiation << "\n" << r.log;
        EXPECT_EQ(r.ptxas_info.spill_store_bytes, 0) << s.instantiation << "\n" << r.ptxas_info.text;
    }
}

}  // namespace
}  // namespace weft::ops::ep
