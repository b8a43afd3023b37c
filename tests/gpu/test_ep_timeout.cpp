// SPDX-License-Identifier: MIT
// GPU tests that an expert-parallel call whose peer never joins ends in a weft::Error naming that peer, not a hang.
//
// A timed-out spin traps, which leaves the process's CUDA context unusable, so each scenario runs in a
// death-test child (gtest's "threadsafe" style re-executes the binary for that test alone). The child exits
// 0 only when the error names the missing rank; an alarm bounds it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "support/runtime_checks.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/ep.hpp"
#include "weft/weft.hpp"

namespace weft::ops::ep {
namespace {

enum class Scenario { kNormalDispatch, kLowLatencyDispatch };

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
    std::string message;
    double seconds = 0;
    try {
        run_local(
            2,
            [&](World& world) {
                cudaStream_t s = nullptr;
                WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
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
                WEFT_CUDA_CHECK(cudaMemset(x, 0, 16 * 256 * 2));
                WEFT_CUDA_CHECK(cudaMemset(w, 0, routes.size() * 4));
                WEFT_CUDA_CHECK(cudaMemcpy(idx, routes.data(), routes.size() * 4, cudaMemcpyHostToDevice));
                const TensorView xv(x, DType::kBF16, {16, 256});
                const TensorView iv(idx, DType::kI32, {16, 2});
                const TensorView wv(w, DType::kF32, {16, 2});
                const auto start = std::chrono::steady_clock::now();
                try {
                    if (scenario == Scenario::kNormalDispatch) {
                        ep.dispatch(h, xv, iv, wv, s);
                    } else {
                        ep.low_latency_dispatch(l, xv, iv, s);
                    }
                    ep.sync_and_check(s);
                } catch (...) {
                    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
                    throw;
                }
            },
            options);
    } catch (const std::exception& e) {
        message = e.what();
    }
    std::fprintf(stderr, "error after %.3f s: %s\n", seconds, message.c_str());
    bool ok = !message.empty() && message.find("owned by rank 1") != std::string::npos &&
              message.find("timed out") != std::string::npos && seconds >= 1.0 && seconds < 60.0;
    if (ok) {
        std::fprintf(stderr, "the error named the missing rank\n");
    }
    std::exit(ok ? 0 : 1);
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

}  // namespace
}  // namespace weft::ops::ep
