// SPDX-License-Identifier: MIT
// AllGather+GEMM with one process per rank, sharing one GPU: the ranks keep the copy engines (a context each), so the
// gathered chunks are pulled by copy streams that wait on a peer's ready flag with cuStreamWaitValue64, which has no
// bound of its own. A peer that never calls must still end the caller's call within the bound: the GEMM's chunk waits
// give up, and the end of the call raises the ready flags its copy streams wait on, so the caller's stream drains.
// Leaves diagnostics in the World: run alone (WEFT_TEST_FAULTS=1 weftrun -n 2 -- weft_dist_tests
// --gtest_filter=DistAgGemmFaults.*).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "dist/dist_world.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

// Rank 0 calls, the others make the op and never call: rank 0's call fails within the bound with a wait that gave up,
// its stream completes (the copy stream waiting for a peer's ready flag was released) and the CUDA context is usable.
TEST(DistAgGemmFaults, APeerThatNeverCallsFailsTheCallAndTheCopyStreamsDrain) {
    const char* faults = std::getenv("WEFT_TEST_FAULTS");
    if (faults == nullptr || std::string(faults) != "1") GTEST_SKIP() << "SKIPPED: set WEFT_TEST_FAULTS=1 (runs alone)";
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess || major < 9) {
        GTEST_SKIP() << "SKIPPED: the GEMM needs an sm_90 GPU";
    }
    World& w = dist_world();
    const int64_t rows = 128, n = 256, k = 128;  // per rank
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    void* buf = nullptr;
    const size_t a_bytes = rows * k * 2, b_bytes = n * k * 2, c_bytes = rows * w.num_ranks() * n * 2;
    ASSERT_EQ(cudaMalloc(&buf, a_bytes + b_bytes + c_bytes), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(buf, 0, a_bytes + b_bytes + c_bytes, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    std::string error;
    const auto start = std::chrono::steady_clock::now();
    {
        ops::AgGemm op(w, ops::AgGemmShape{rows * w.num_ranks(), n, k, DType::kBF16});
        if (w.rank() == 0) {
            auto* p = static_cast<uint8_t*>(buf);
            const TensorView a(p, DType::kBF16, {rows, k});
            const TensorView b(p + a_bytes, DType::kBF16, {n, k});
            const TensorView c(p + a_bytes + b_bytes, DType::kBF16, {rows * w.num_ranks(), n});
            try {
                op.run(a, b, c, s);
                w.sync_and_check(s);
            } catch (const std::exception& e) {
                error = e.what();
            }
        } else {
            // Past rank 0's failure (about one timeout) before the destructor's team barrier (bounded by one too).
            std::this_thread::sleep_for(w.timeout() * 3 / 2);
        }
    }
    const auto took = std::chrono::steady_clock::now() - start;
    if (w.rank() == 0) {
        EXPECT_FALSE(error.empty()) << "rank 0's call did not fail";
        EXPECT_TRUE(error.find("timed out") != std::string::npos || error.find("gave up") != std::string::npos)
            << error;
        // The chunk wait names the rank whose rows never came (the word is rank 0's own, raised by its copy).
        EXPECT_NE(error.find("rank 1"), std::string::npos) << "the error names the peer that never called: " << error;
        EXPECT_LT(took, 3 * w.timeout() + std::chrono::seconds(30)) << "the failure took too long";
        EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        EXPECT_EQ(cudaMemsetAsync(buf, 0, 4096, s), cudaSuccess);
        EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "no trap: the context stays usable";
        std::printf("[ FAULT    ] rank 0: %s\n", error.c_str());
    }
    cudaFree(buf);
    cudaStreamDestroy(s);
}

}  // namespace
}  // namespace weft::test
