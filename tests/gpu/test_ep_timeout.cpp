// SPDX-License-Identifier: MIT
// GPU tests that an expert-parallel call whose peer never joins ends in a weft::Error naming that peer, not a hang.
//
// Each scenario runs in a death-test child (gtest's "threadsafe" style re-executes the binary for that test alone),
// so a kernel that traps (which leaves the process's CUDA context unusable) cannot harm the other tests. The child
// exits 0 only when the error names the missing rank (and, for the MoE block, when nothing trapped); an alarm bounds
// it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "support/runtime_checks.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/ep.hpp"
#include "weft/ops/ep_moe.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/grouped_gemm.hpp"
#include "weft/weft.hpp"

namespace weft::ops::ep {
namespace {

enum class Scenario { kNormalDispatch, kLowLatencyDispatch, kMoeBlock };

MoeConfig moe_config_of(const Config& c) {
    MoeConfig m;
    m.ep = c;
    m.ep.low_latency = false;
    m.ffn = 128;
    return m;
}

// A fused MoE block whose rank 1 never calls forward: rank 0's dispatch waits for rank 1's counts until the World's
// timeout (its error names rank 1), while rank 0's up-projection waits for that dispatch's counts word.
void run_moe_block_without_rank_1(World& world, const Config& c, cudaStream_t s, double* seconds) {
    const MoeConfig m = moe_config_of(c);
    MoeBlock moe(world, m);  // collective: both ranks
    if (world.rank() == 1) {
        // As in the EP scenarios: fails only once rank 0's error aborts the store.
        (void)world.store().get("ep-timeout-test-never-set", std::chrono::milliseconds(120000));
        return;
    }
    const int64_t local = c.num_experts / 2, h = c.hidden, f = m.ffn, t = c.max_tokens_per_rank;
    std::vector<int32_t> routes;
    for (int i = 0; i < t; ++i) {
        routes.push_back(i % 8);
        routes.push_back((i + 5) % 8);
    }
    void *x = nullptr, *idx = nullptr, *w = nullptr, *gate_up = nullptr, *down = nullptr, *out = nullptr;
    WEFT_CUDA_CHECK(cudaMalloc(&x, t * h * 2));
    WEFT_CUDA_CHECK(cudaMalloc(&idx, routes.size() * 4));
    WEFT_CUDA_CHECK(cudaMalloc(&w, routes.size() * 4));
    WEFT_CUDA_CHECK(cudaMalloc(&gate_up, local * 2 * f * h * 2));
    WEFT_CUDA_CHECK(cudaMalloc(&down, local * h * f * 2));
    WEFT_CUDA_CHECK(cudaMalloc(&out, t * h * 2));
    for (auto [p, bytes] : {std::pair{x, t * h * 2}, std::pair{w, static_cast<int64_t>(routes.size()) * 4},
                            std::pair{gate_up, local * 2 * f * h * 2}, std::pair{down, local * h * f * 2}}) {
        WEFT_CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(bytes), s));  // on `s`: ordered before the block
    }
    WEFT_CUDA_CHECK(cudaMemcpyAsync(idx, routes.data(), routes.size() * 4, cudaMemcpyHostToDevice, s));
    const MoeWeights weights{TensorView(gate_up, DType::kBF16, {local, 2 * f, h}),
                             TensorView(down, DType::kBF16, {local, h, f})};
    test::time_failure(
        [&] {
            moe.forward(TensorView(x, DType::kBF16, {t, h}), TensorView(idx, DType::kI32, {t, 2}),
                        TensorView(w, DType::kF32, {t, 2}), weights, TensorView(out, DType::kBF16, {t, h}), s);
            moe.sync_and_check(s);
        },
        seconds);
}

[[noreturn]] void provoke(Scenario scenario) {
    alarm(180);  // a hang ends the child with SIGALRM: the death test then fails instead of hanging
    for (const jit::KernelSpec& s : kernel_specs()) {
        (void)jit::compiler().compile(s);  // compile first: the short timeout below is for the spin only
    }
    WorldOptions options = test::test_options();
    options.timeout = std::chrono::milliseconds(1500);
    Config c;
    c.num_experts = 8;
    c.hidden = 256;
    c.topk = 2;
    c.max_tokens_per_rank = 16;
    if (scenario == Scenario::kMoeBlock) {
        // The block's kernels too, for the plans of both SM budgets two ranks can have (sharing a GPU or not).
        int sms = 0;
        WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        for (int budget : {sms, sms / 2}) {
            const MoePlan plan = plan_moe_block(moe_config_of(c), 2, budget);
            for (const jit::KernelSpec& s :
                 {grouped_gemm_kernel_spec(plan.up, true, false), grouped_gemm_kernel_spec(plan.up, false, false),
                  grouped_gemm_kernel_spec(plan.down, false, true), grouped_gemm_kernel_spec(plan.down, false, false),
                  moe_swiglu_kernel_spec(), gemm_advance_epoch_spec()}) {
                (void)jit::compiler().compile(s);
            }
        }
    }
    std::string message;
    double seconds = 0;
    try {
        run_local(
            2,
            [&](World& world) {
                cudaStream_t s = nullptr;
                WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
                if (scenario == Scenario::kMoeBlock) {
                    run_moe_block_without_rank_1(world, c, s, &seconds);
                    return;
                }
                Buffer ep(world, c);
                NormalHandle h = ep.make_normal_handle();  // collective: both ranks
                LowLatencyHandle l = ep.make_low_latency_handle();
                if (world.rank() == 1) {
                    // Never joins the dispatch. Waits on a key nobody sets, longer than rank 0's spin: it fails
                    // only when rank 0's error aborts the store, so rank 0's error is the one reported.
                    (void)world.store().get("ep-timeout-test-never-set", std::chrono::milliseconds(120000));
                    return;
                }
                std::vector<int32_t> routes;
                for (int t = 0; t < 16; ++t) {
                    routes.push_back(t % 8);
                    routes.push_back((t + 5) % 8);
                }
                void* x = nullptr;
                void* idx = nullptr;
                void* w = nullptr;
                WEFT_CUDA_CHECK(cudaMalloc(&x, 16 * 256 * 2));
                WEFT_CUDA_CHECK(cudaMalloc(&idx, routes.size() * 4));
                WEFT_CUDA_CHECK(cudaMalloc(&w, routes.size() * 4));
                // On `s`: legacy-stream copies are not ordered before the dispatch on this non-blocking stream.
                WEFT_CUDA_CHECK(cudaMemsetAsync(x, 0, 16 * 256 * 2, s));
                WEFT_CUDA_CHECK(cudaMemsetAsync(w, 0, routes.size() * 4, s));
                WEFT_CUDA_CHECK(cudaMemcpyAsync(idx, routes.data(), routes.size() * 4, cudaMemcpyHostToDevice, s));
                const TensorView xv(x, DType::kBF16, {16, 256});
                const TensorView iv(idx, DType::kI32, {16, 2});
                const TensorView wv(w, DType::kF32, {16, 2});
                test::time_failure(
                    [&] {
                        if (scenario == Scenario::kNormalDispatch) {
                            ep.dispatch(h, xv, iv, wv, s);
                        } else {
                            ep.low_latency_dispatch(l, xv, iv, s);
                        }
                        ep.sync_and_check(s);
                    },
                    &seconds);
            },
            options);
    } catch (const std::exception& e) {
        message = e.what();
    }
    bool ok = !message.empty() && message.find("owned by rank 1") != std::string::npos &&
              message.find("timed out") != std::string::npos && seconds >= 1.0 && seconds < 60.0;
    if (scenario == Scenario::kMoeBlock) {
        // The GEMM's wait for the counts ended with `exit` once the dispatch's wait aborted the World: no kernel
        // trapped, so the context still works.
        const cudaError_t sync = cudaDeviceSynchronize();
        std::fprintf(stderr, "after the error: cudaDeviceSynchronize -> %s\n", cudaGetErrorString(sync));
        ok = ok && sync == cudaSuccess;
    }
    test::exit_with_fault_report(message, seconds, ok, /*skip_destructors=*/false);
}

class EpTimeoutDeathTest : public ::testing::Test {
protected:
    void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(EpTimeoutDeathTest, NormalDispatchNamesTheMissingPeer) {
    ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU";
    EXPECT_EXIT(provoke(Scenario::kNormalDispatch), ::testing::ExitedWithCode(0), "the error named the missing rank");
}

TEST_F(EpTimeoutDeathTest, LowLatencyDispatchNamesTheMissingPeer) {
    ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU";
    EXPECT_EXIT(provoke(Scenario::kLowLatencyDispatch), ::testing::ExitedWithCode(0),
                "the error named the missing rank");
}

// The fused MoE block: the up-projection's CTAs wait for the dispatch's counts, which never come. The dispatch's
// wait names rank 1; its abort stops the GEMM's wait, which ends its CTAs with `exit` (no trap: the context works).
TEST_F(EpTimeoutDeathTest, MoeBlockNamesTheMissingPeerAndNothingTraps) {
    ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU";
    EXPECT_EXIT(provoke(Scenario::kMoeBlock), ::testing::ExitedWithCode(0), "the error named the missing rank");
}

}  // namespace
}  // namespace weft::ops::ep
