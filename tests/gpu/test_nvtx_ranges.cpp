// SPDX-License-Identifier: MIT
// weft's op calls are NVTX ranges on their rank's thread, seen without a profiler: a child process runs all_reduce
// and AgGemm at world 2 (ranks as threads) with the NVTX recorder injected; per rank the record must hold each call
// as a "weft" range ("ag_gemm" with its "setup" and "launch" phases), every push closed by a pop.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include "support/jit_testing.hpp"
#include "support/nvtx_record.hpp"
#include "support/runtime_checks.hpp"
#include "tp_test_util.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

constexpr const char* kChildFlag = "WEFT_TEST_NVTX_GPU_CHILD";
constexpr int kCalls = 2;

// Runs only in the child NvtxRangesGpu.OpCallsAreRangesOnEveryRank starts (with the recorder injected).
TEST(NvtxRangesGpuChild, AllReduceAndAgGemmAtWorld2) {
    if (std::getenv(kChildFlag) == nullptr) {
        GTEST_SKIP() << "runs only as the child of NvtxRangesGpu.OpCallsAreRangesOnEveryRank";
    }
    constexpr int64_t kCount = 4096;                    // all_reduce: f32 elements
    constexpr int64_t kRows = 128, kN = 256, kK = 128;  // AgGemm: rows per rank, bf16
    test::run_ranks(
        2,
        [&](World& w) {
            nvtx_mark(("rank " + std::to_string(w.rank())).c_str());  // ties the recorder's thread to the rank
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            {
                tp_test::DevBuf in(kCount * sizeof(float)), out(kCount * sizeof(float));
                tp_test::DevBuf a(kRows * kK * 2), b(kN * kK * 2), c(2 * kRows * kN * 2);
                for (tp_test::DevBuf* buf : {&in, &a, &b}) {
                    WEFT_CUDA_CHECK(cudaMemsetAsync(buf->ptr, 0, buf->bytes, s));
                }
                const TensorView vin(in.ptr, DType::kF32, {kCount}), vout(out.ptr, DType::kF32, {kCount});
                for (int call = 0; call < kCalls; ++call) ops::all_reduce(w, vin, vout, s);
                w.sync_and_check(s);
                ops::AgGemm op(w, {2 * kRows, kN, kK, DType::kBF16});
                const TensorView va(a.ptr, DType::kBF16, {kRows, kK}), vb(b.ptr, DType::kBF16, {kN, kK});
                const TensorView vc(c.ptr, DType::kBF16, {2 * kRows, kN});
                for (int call = 0; call < kCalls; ++call) op.run(va, vb, vc, s);
                w.sync_and_check(s);
            }
            WEFT_CUDA_CHECK(cudaStreamDestroy(s));
        },
        test::test_options(192ull << 20));  // the collective workspace: 3 staging regions of 32 MiB
}

TEST(NvtxRangesGpu, OpCallsAreRangesOnEveryRank) {
    testing::TempDir dir("weft_nvtx_gpu");
    const auto record = dir / "record.txt";
    const testing::ChildRun child = testing::run_self_under_nvtx_recorder(
        "NvtxRangesGpuChild.AllReduceAndAgGemmAtWorld2", record, kChildFlag, std::chrono::milliseconds(540000));
    ASSERT_TRUE(child.exited_ok) << child.output;
    ASSERT_TRUE(std::filesystem::exists(record))
        << "no record: no weft NVTX call reached NVTX, or NVTX did not load " << testing::nvtx_recorder_path() << "\n"
        << child.output;
    const testing::NvtxRanges r = testing::nvtx_ranges(testing::read_nvtx_record(record), "weft");
    std::string seen;
    for (const testing::NvtxSeen& s : r.seen) seen += std::to_string(s.thread) + " " + s.kind + " " + s.path + "\n";
    SCOPED_TRACE("recorded in the weft domain:\n" + seen);
    EXPECT_EQ(r.problem, "");
    for (int rank = 0; rank < 2; ++rank) {
        int thread = -1;
        for (const testing::NvtxSeen& s : r.seen) {
            if (s.kind == "mark" && s.path == "rank " + std::to_string(rank)) thread = s.thread;
        }
        ASSERT_GE(thread, 0) << "no mark of rank " << rank;
        EXPECT_EQ(r.count(thread, "push", "all_reduce"), kCalls) << "rank " << rank;
        EXPECT_EQ(r.count(thread, "push", "ag_gemm"), kCalls) << "rank " << rank;
        EXPECT_EQ(r.count(thread, "push", "ag_gemm > setup"), kCalls) << "rank " << rank;
        EXPECT_EQ(r.count(thread, "push", "ag_gemm > launch"), kCalls) << "rank " << rank;
    }
}

}  // namespace
}  // namespace weft
