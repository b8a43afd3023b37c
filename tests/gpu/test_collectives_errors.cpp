// SPDX-License-Identifier: MIT
// GPU tests of the collectives' failure paths: bad buffers are weft::Errors on every rank before anything is
// launched; ranks that call different collectives, or wait for data that never comes, end in a diagnosis (not a
// hang). A trap leaves the process's CUDA context unusable, so those scenarios run in death-test children
// (gtest's "threadsafe" style re-executes this binary for just that test).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "support/runtime_checks.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

using ops::AllGatherAlgo;
using ops::AllReduceAlgo;
using ops::ReduceScatterAlgo;

// Every rank calls `fn`, which must throw weft::Error mentioning every word of `words`.
void expect_error_on_every_rank(int num_ranks, const std::function<void(World&)>& fn,
                                const std::vector<std::string>& words) {
    std::mutex mutex;
    std::vector<std::string> messages;
    // The collectives' workspace takes 3 x 32 MiB of staging: more than the runtime tests' 64 MiB heap.
    run_ranks(
        num_ranks,
        [&](World& w) {
            ops::prepare_collectives(w);
            std::string message;
            try {
                fn(w);
            } catch (const Error& e) {
                message = e.what();
            }
            {
                std::lock_guard<std::mutex> lock(mutex);
                messages.push_back(message);
            }
            w.barrier();
        },
        test_options(256ull << 20));
    ASSERT_EQ(messages.size(), static_cast<size_t>(num_ranks));
    for (const std::string& m : messages) {
        EXPECT_FALSE(m.empty()) << "a rank did not throw weft::Error";
        for (const std::string& word : words)
            EXPECT_NE(m.find(word), std::string::npos) << "'" << word << "' not in: " << m;
    }
}

TEST(CollectivesErrors, PushAllGatherNeedsASymmetricOutput) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    for (AllGatherAlgo algo : {AllGatherAlgo::kSmPush, AllGatherAlgo::kCopyEnginePush}) {
        expect_error_on_every_rank(2,
                                   [&](World& w) {
                                       void* in = nullptr;
                                       void* out = nullptr;
                                       WEFT_CUDA_CHECK(cudaMalloc(&in, 1024));
                                       WEFT_CUDA_CHECK(cudaMalloc(&out, 2048));
                                       struct Free {
                                           void* a;
                                           void* b;
                                           ~Free() {
                                               cudaFree(a);
                                               cudaFree(b);
                                           }
                                       } guard{in, out};
                                       ops::all_gather(w, TensorView(in, DType::kF32, {256}),
                                                       TensorView(out, DType::kF32, {512}), nullptr, {.algo = algo});
                                   },
                                   {"all_gather", ops::algo_name(algo), "symmetric heap"});
    }
}

TEST(CollectivesErrors, HostMemoryIsRejected) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    expect_error_on_every_rank(2,
                               [&](World& w) {
                                   std::vector<float> host(64);
                                   void* out = w.heap().alloc(256);
                                   struct Free {
                                       World& w;
                                       void* p;
                                       ~Free() { w.heap().free(p); }
                                   } guard{w, out};
                                   ops::all_reduce(w, TensorView(host.data(), DType::kF32, {64}),
                                                   TensorView(out, DType::kF32, {64}), nullptr);
                               },
                               {"all_reduce", "input", "device memory"});
}

TEST(CollectivesErrors, BadShapesAreRejectedBeforeAnyLaunch) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    expect_error_on_every_rank(3,
                               [&](World& w) {
                                   void* buf = w.heap().alloc(4096);
                                   struct Free {
                                       World& w;
                                       void* p;
                                       ~Free() { w.heap().free(p); }
                                   } guard{w, buf};
                                   ops::reduce_scatter(w, TensorView(buf, DType::kBF16, {100}),
                                                       TensorView(buf, DType::kBF16, {33}), nullptr);
                               },
                               {"reduce_scatter", "num_ranks (3)", "99", "100"});
}

TEST(CollectivesErrors, WorkspaceIsAWorldExtensionDestroyedWithTheWorld) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    struct Probe final : WorldExtension {
        std::atomic<int>* destroyed;
        explicit Probe(std::atomic<int>* d) : destroyed(d) {}
        ~Probe() override { destroyed->fetch_add(1); }
    };
    std::atomic<int> destroyed[2] = {0, 0};  // per rank
    run_ranks(
        2,
        [&](World& w) {
            std::atomic<int>& mine = destroyed[w.rank()];
            EXPECT_EQ(w.find_extension("weft.ops.collectives"), nullptr);
            const ops::CollectiveWorkspaceInfo& info = ops::prepare_collectives(w);
            EXPECT_NE(w.find_extension("weft.ops.collectives"), nullptr);
            EXPECT_EQ(&ops::prepare_collectives(w), &info) << "the workspace is made once per World";
            EXPECT_EQ(info.topology.num_ranks, 2);
            EXPECT_GE(info.topology.grid_budget, 1);
            EXPECT_LE(info.topology.grid_budget, w.sm_budget());
            EXPECT_EQ(info.num_kernels, 23);  // all-reduce ll, one-shot, two-shot, reduce-scatter sm_pull, ll and
                                              // the attention combine x 3 dtypes; all-gather ll, push, CE enter,
                                              // CE exit; all-to-all pull
            EXPECT_GE(info.heap_bytes, 3 * info.staging_region_bytes + 2 * 2 * info.ll_slot_bytes);
            w.add_extension("test.probe", std::make_unique<Probe>(&mine));
            EXPECT_THROW(w.add_extension("test.probe", std::make_unique<Probe>(&mine)), Error);
            EXPECT_EQ(mine.load(), 1) << "the rejected duplicate is destroyed at once";
            w.barrier();
        },
        test_options(256ull << 20));  // room for the workspace's 3 x 32 MiB of staging
    EXPECT_EQ(destroyed[0].load(), 2) << "the World destroys its extensions at shutdown";
    EXPECT_EQ(destroyed[1].load(), 2);
}

// ------------------------------------------------------------------------------------------------
// Death-test scenarios: the child provokes the failure on 2 ranks, collects every rank's error, and exits 0 only if
// one of them carries the expected diagnosis. An alarm bounds the child: a hang fails the test.

enum class Scenario { kCountMismatch, kDtypeMismatch, kLowLatencyNeverArrives, kLowLatencyReduceScatterNeverArrives };

[[noreturn]] void provoke(Scenario scenario, const std::string& expected) {
    alarm(120);
    WorldOptions options = test_options(256ull << 20);
    // Short enough to keep the never-arriving LL case quick, long enough for the set-up's host barriers (the
    // workspace loads 19 kernels per process before its barrier).
    options.timeout = std::chrono::milliseconds(5000);
    std::mutex mutex;
    std::vector<std::string> messages;
    try {
        run_local(
            2,
            [&](World& w) {
                cudaStream_t s = nullptr;
                WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
                auto* buf = static_cast<uint8_t*>(w.heap().alloc(1 << 20));
                ops::prepare_collectives(w);
                const bool odd = w.rank() == 1;
                try {
                    switch (scenario) {
                        case Scenario::kCountMismatch:  // same grid (one block), different counts
                            ops::all_reduce(w, TensorView(buf, DType::kF32, {odd ? 1004 : 1000}),
                                            TensorView(buf + 65536, DType::kF32, {odd ? 1004 : 1000}), s,
                                            {.algo = AllReduceAlgo::kOneShot});
                            break;
                        case Scenario::kDtypeMismatch:
                            ops::all_reduce(w, TensorView(buf, odd ? DType::kF16 : DType::kBF16, {512}),
                                            TensorView(buf + 65536, odd ? DType::kF16 : DType::kBF16, {512}), s,
                                            {.algo = AllReduceAlgo::kTwoShot});
                            break;
                        case Scenario::kLowLatencyNeverArrives:  // rank 1 expects lines rank 0 never sends
                            ops::all_reduce(w, TensorView(buf, DType::kF32, {odd ? 2000 : 1000}),
                                            TensorView(buf + 65536, DType::kF32, {odd ? 2000 : 1000}), s,
                                            {.algo = AllReduceAlgo::kLowLatency});
                            break;
                        case Scenario::kLowLatencyReduceScatterNeverArrives:  // rank 1's slice is twice rank 0's
                            ops::reduce_scatter(w, TensorView(buf, DType::kF32, {odd ? 2000 : 1000}),
                                                TensorView(buf + 65536, DType::kF32, {odd ? 1000 : 500}), s,
                                                {.algo = ReduceScatterAlgo::kLowLatency});
                            break;
                    }
                    w.sync_and_check(s);
                } catch (const std::exception& e) {
                    std::lock_guard<std::mutex> lock(mutex);
                    messages.push_back(e.what());
                }
            },
            options);
    } catch (const std::exception& e) {
        messages.push_back(e.what());
    }
    bool found = false;
    for (const std::string& m : messages) {
        std::fprintf(stderr, "error: %s\n", m.c_str());
        found = found || m.find(expected) != std::string::npos;
    }
    std::fprintf(stderr, found ? "diagnosed: %s\n" : "FAIL: no error mentions '%s'\n", expected.c_str());
    std::fflush(stderr);
    std::_Exit(found ? 0 : 1);
}

class CollectivesDeathTest : public ::testing::Test {
protected:
    void SetUp() override {
        if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
        GTEST_FLAG_SET(death_test_style, "threadsafe");
    }
};

TEST_F(CollectivesDeathTest, RanksCallingDifferentCountsAreDiagnosed) {
    EXPECT_EXIT(provoke(Scenario::kCountMismatch, "collective call differs from rank"), ::testing::ExitedWithCode(0),
                "diagnosed");
}

TEST_F(CollectivesDeathTest, RanksCallingDifferentDtypesAreDiagnosed) {
    EXPECT_EXIT(provoke(Scenario::kDtypeMismatch, "collective call differs from rank"), ::testing::ExitedWithCode(0),
                "diagnosed");
}

TEST_F(CollectivesDeathTest, LowLatencyDataThatNeverArrivesTimesOut) {
    EXPECT_EXIT(provoke(Scenario::kLowLatencyNeverArrives, "signal_wait"), ::testing::ExitedWithCode(0), "diagnosed");
}

TEST_F(CollectivesDeathTest, LowLatencyReduceScatterLinesThatNeverArriveTimeOut) {
    EXPECT_EXIT(provoke(Scenario::kLowLatencyReduceScatterNeverArrives, "signal_wait"), ::testing::ExitedWithCode(0),
                "diagnosed");
}

}  // namespace
}  // namespace weft::test
