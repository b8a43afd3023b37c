// SPDX-License-Identifier: MIT
// AllGather+GEMM with one process per rank, sharing one GPU: the ranks keep the copy engines (a context each), so the
// gathered chunks are pulled by copy streams that wait on a peer's ready flag with cuStreamWaitValue64, which has no
// bound of its own. A peer that never calls must still end the caller's call within the bound: the GEMM's chunk waits
// give up, and the end of the call raises the ready flags its copy streams wait on, so the caller's stream drains.
// Leaves diagnostics in the World: run alone (WEFT_TEST_FAULTS=1 weftrun -n 2 -- weft_dist_tests
// --gtest_filter=DistAgGemmFaults.*).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <string>

#include "dist/dist_faults.hpp"
#include "dist/dist_world.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

// Rank 0 calls, the others make the op and never call: rank 0's call fails within the bound with a wait that gave up,
// its stream completes (the copy stream waiting for a peer's ready flag was released) and the CUDA context is usable.
TEST(DistAgGemmFaults, APeerThatNeverCallsFailsTheCallAndTheCopyStreamsDrain) {
    if (!fault_tests_enabled()) GTEST_SKIP() << "SKIPPED: set WEFT_TEST_FAULTS=1 (runs alone)";
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
    const std::string error = expect_call_fails_when_peers_never_call(
        w, s, buf,
        [&](World& world) {
            return ops::AgGemm(world, ops::AgGemmShape{rows * world.num_ranks(), n, k, DType::kBF16});
        },
        [&](ops::AgGemm& op, cudaStream_t stream) {
            auto* p = static_cast<uint8_t*>(buf);
            const TensorView a(p, DType::kBF16, {rows, k});
            const TensorView b(p + a_bytes, DType::kBF16, {n, k});
            const TensorView c(p + a_bytes + b_bytes, DType::kBF16, {rows * w.num_ranks(), n});
            op.run(a, b, c, stream);
        });
    if (w.rank() == 0) {
        // The chunk wait names the rank whose rows never came (the word is rank 0's own, raised by its copy).
        EXPECT_NE(error.find("rank 1"), std::string::npos) << "the error names the peer that never called: " << error;
    }
    cudaFree(buf);
    cudaStreamDestroy(s);
}

}  // namespace
}  // namespace weft::test
