// SPDX-License-Identifier: MIT
// GPU tests that a fused TP op (AllGather+GEMM, GEMM+ReduceScatter, GEMM+AllReduce) whose peer never calls ends in a
// weft::Error naming that peer's wait, within the bound, not a hang.
//
// Each scenario runs in a death-test child (gtest's "threadsafe" style re-executes the binary for that test alone):
// the GEMM-family kernels end a failed wait with `trap`, which leaves the process's CUDA context unusable, so the
// child leaves with _Exit right after reporting. It exits 0 only when rank 0's error is a wait that gave up and names
// rank 1; an alarm bounds it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <string>

#include "support/runtime_checks.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

enum class Op { kAgGemm, kGemmRs, kGemmAr };

constexpr int64_t kRows = 128, kN = 256, kK = 128;  // per rank (AgGemm, GemmRs: M = 2 x kRows)

/// Makes `op` (collective) and calls it once on rank 0, on zeroed buffers; rank 1 keeps the op alive without calling
/// it: it waits on a store key nobody sets, longer than rank 0's waits, and fails only when rank 0's error aborts the
/// store (so rank 0's error is the one run_local reports). Only rank 0's call is timed into `*seconds` (construction,
/// with its JIT compiles and barriers, is not).
void call_once(World& w, Op op, cudaStream_t s, double* seconds) {
    const DType dt = DType::kBF16;
    const int64_t m = 2 * kRows;
    void *a = nullptr, *b = nullptr, *c = nullptr;
    WEFT_CUDA_CHECK(cudaMalloc(&a, static_cast<size_t>(m * kK * 2)));
    WEFT_CUDA_CHECK(cudaMalloc(&b, static_cast<size_t>(kN * kK * 2)));
    WEFT_CUDA_CHECK(cudaMalloc(&c, static_cast<size_t>(m * kN * 2)));
    WEFT_CUDA_CHECK(cudaMemsetAsync(a, 0, static_cast<size_t>(m * kK * 2), s));
    WEFT_CUDA_CHECK(cudaMemsetAsync(b, 0, static_cast<size_t>(kN * kK * 2), s));
    const TensorView bv(b, dt, {kN, kK});
    const auto never_calls = [&] { (void)w.store().get("tp-fault-test-never-set", std::chrono::milliseconds(120000)); };
    const auto timed = [&](const std::function<void()>& run) {
        time_failure(
            [&] {
                run();
                w.sync_and_check(s);
            },
            seconds);
    };
    if (op == Op::kAgGemm) {
        ops::AgGemm g(w, {m, kN, kK, dt});
        if (w.rank() == 1) return never_calls();
        timed([&] { g.run(TensorView(a, dt, {kRows, kK}), bv, TensorView(c, dt, {m, kN}), s); });
    } else if (op == Op::kGemmRs) {
        ops::GemmRs g(w, {m, kN, kK, dt});
        if (w.rank() == 1) return never_calls();
        timed([&] { g.run(TensorView(a, dt, {m, kK}), bv, TensorView(c, dt, {kRows, kN}), s); });
    } else {
        ops::GemmAr g(w, {m, kN, kK, dt});
        if (w.rank() == 1) return never_calls();
        timed([&] { g.run(TensorView(a, dt, {m, kK}), bv, TensorView(c, dt, {m, kN}), s); });
    }
}

[[noreturn]] void provoke(Op op) {
    alarm(240);  // a hang ends the child with SIGALRM: the death test then fails instead of hanging
    WorldOptions options = test_options(256ull << 20);  // GemmAr's all-reduce half: the collectives' 96 MiB
    options.timeout = std::chrono::milliseconds(1500);
    std::string message;
    double seconds = 0;
    try {
        run_local(
            2,
            [&](World& w) {
                cudaStream_t s = nullptr;
                WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
                call_once(w, op, s, &seconds);  // only rank 0 calls (and is timed)
            },
            options);
    } catch (const std::exception& e) {
        message = e.what();
    }
    const bool gave_up = message.find("timed out") != std::string::npos || message.find("gave up") != std::string::npos;
    const bool ok =
        !message.empty() && gave_up && message.find("rank 1") != std::string::npos && seconds >= 1.0 && seconds < 90.0;
    exit_with_fault_report(message, seconds, ok, /*skip_destructors=*/true);  // the context may be lost (a trap)
}

class TpFaultsDeathTest : public ::testing::Test {
protected:
    void SetUp() override {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "needs a GPU";
        GTEST_FLAG_SET(death_test_style, "threadsafe");
    }
};

TEST_F(TpFaultsDeathTest, AgGemmWhosePeerNeverCallsFailsNamingIt) {
    EXPECT_EXIT(provoke(Op::kAgGemm), ::testing::ExitedWithCode(0), "the error named the missing rank");
}

TEST_F(TpFaultsDeathTest, GemmRsWhosePeerNeverCallsFailsNamingIt) {
    EXPECT_EXIT(provoke(Op::kGemmRs), ::testing::ExitedWithCode(0), "the error named the missing rank");
}

TEST_F(TpFaultsDeathTest, GemmArWhosePeerNeverCallsFailsNamingIt) {
    EXPECT_EXIT(provoke(Op::kGemmAr), ::testing::ExitedWithCode(0), "the error named the missing rank");
}

}  // namespace
}  // namespace weft::test
