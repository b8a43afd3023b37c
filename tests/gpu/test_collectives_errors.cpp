// SPDX-License-Identifier: MIT
// GPU tests of the collectives' failure paths: bad buffers are weft::Errors on every rank before anything is
// launched; ranks that call different collectives (shape, dtype, algorithm) get a weft::Error on every rank naming
// both calls, with every block of every algorithm stopped before it wrote the output; data that never comes ends in a
// diagnosis (not a hang). A trap (the copy-engine algorithms' mismatch) leaves the process's CUDA context unusable,
// so those scenarios run in death-test children (gtest's "threadsafe" style re-executes this binary for just that
// test).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "support/runtime_checks.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

using ops::AllGatherAlgo;
using ops::AllReduceAlgo;
using ops::ReduceScatterAlgo;

// Every rank calls `fn`, which must throw weft::Error mentioning every word of `words`.
/// `prepare`: make the collectives' workspace first (prepare_collectives), as a program that calls outside a capture
/// first does.
void expect_error_on_every_rank(int num_ranks, const std::function<void(World&)>& fn,
                                const std::vector<std::string>& words, bool prepare = true) {
    std::mutex mutex;
    std::vector<std::string> messages;
    // The collectives' workspace takes 3 x 32 MiB of staging: more than the runtime tests' 64 MiB heap.
    run_ranks(
        num_ranks,
        [&](World& w) {
            if (prepare) ops::prepare_collectives(w);
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

TEST(CollectivesErrors, AFirstCallInsideAGraphCaptureIsRefusedNamingPrepareCollectives) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    expect_error_on_every_rank(
        2,
        [&](World& w) {
            void* buf = w.heap().alloc(4096);
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            struct Cleanup {
                World& w;
                void* p;
                cudaStream_t s;
                ~Cleanup() {
                    cudaGraph_t g = nullptr;
                    cudaStreamEndCapture(s, &g);
                    if (g != nullptr) cudaGraphDestroy(g);
                    (void)cudaGetLastError();
                    cudaStreamDestroy(s);
                    w.heap().free(p);
                }
            } guard{w, buf, s};
            WEFT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            ops::all_reduce(w, TensorView(buf, DType::kF32, {64}), TensorView(buf, DType::kF32, {64}), s);
        },
        {"all_reduce", "being captured", "prepare_collectives"}, /*prepare=*/false);
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

// After an abort (here World::abort on rank 0, which reaches rank 1 through the store) and clear_diagnostics on every
// rank, the workspace made before it refuses the next collective on every rank, naming the abort, before anything is
// launched (its epochs may be out of step after a wait that gave up); the World's own barrier still runs, and a fresh
// World's collectives run.
TEST(CollectivesErrors, AClearedAbortRetiresTheWorkspaceMadeBeforeIt) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    WorldOptions options = test_options(256ull << 20);
    options.heartbeat = std::chrono::milliseconds(200);  // the abort reaches the other rank quickly
    // One all_reduce on a stream of the rank's own (ranks may share the GPU: not the legacy stream, which would
    // serialise them), checked; returns the stream and the buffer for what follows.
    const auto all_reduce_once = [](World& w) {
        cudaStream_t s = nullptr;
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        auto* buf = static_cast<float*>(w.heap().alloc(1024 * sizeof(float)));
        ops::all_reduce(w, TensorView(buf, DType::kF32, {1024}), TensorView(buf, DType::kF32, {1024}), s);
        w.sync_and_check(s);
        w.barrier();
        return std::pair{s, buf};
    };
    std::mutex mutex;
    std::vector<std::string> messages;
    run_ranks(
        2,
        [&](World& w) {
            ops::prepare_collectives(w);
            const auto [s, buf] = all_reduce_once(w);
            const TensorView v(buf, DType::kF32, {1024});
            if (w.rank() == 0) w.abort("the test's abort");
            std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // it reached every rank
            EXPECT_TRUE(w.aborted());
            w.clear_diagnostics();
            EXPECT_EQ(w.cleared_aborts(), 1u);
            EXPECT_NE(w.last_cleared_abort().find("the test's abort"), std::string::npos) << w.last_cleared_abort();
            w.barrier();
            std::string message;
            try {
                ops::all_reduce(w, v, v, s);
            } catch (const Error& e) {
                message = e.what();
            }
            {
                std::lock_guard<std::mutex> lock(mutex);
                messages.push_back(message);
            }
            w.barrier();
            w.heap().free(buf);
            WEFT_CUDA_CHECK(cudaStreamDestroy(s));
        },
        options);
    ASSERT_EQ(messages.size(), 2u);
    for (const std::string& m : messages) {
        EXPECT_NE(m.find("clear_diagnostics does not repair its device state"), std::string::npos) << m;
        EXPECT_NE(m.find("the test's abort"), std::string::npos) << m;
        EXPECT_NE(m.find("make a new World"), std::string::npos) << m;
    }
    run_ranks(
        2,
        [&](World& w) {
            const auto [s, buf] = all_reduce_once(w);
            w.heap().free(buf);
            WEFT_CUDA_CHECK(cudaStreamDestroy(s));
        },
        test_options(256ull << 20));
}

// ------------------------------------------------------------------------------------------------
// Ranks that call a collective with different arguments. Each rank calls with its own arguments into an output
// poisoned beforehand; every rank's call must throw naming both calls, and no block of any rank may have written
// its output (every block checks the descriptors before it moves data, not only block 0). The kernels end with
// `exit`, so the context stays usable: after every rank has cleared its diagnostics the ranks meet again.

constexpr uint8_t kPoison = 0xA5;

struct MismatchCall {
    std::function<void(World&, cudaStream_t, uint8_t* in, uint8_t* out)> call;
    uint64_t out_bytes = 0;  // bytes of `out` that must stay poisoned on every rank
    std::function<std::vector<std::string>(int rank)> words;
};

void expect_mismatch_on_every_rank(int num_ranks, const MismatchCall& c) {
    WorldOptions options = test_options(256ull << 20);
    options.heartbeat = std::chrono::milliseconds(200);  // the abort reaches every rank quickly
    std::mutex mutex;
    std::vector<std::string> messages(static_cast<size_t>(num_ranks));
    std::vector<uint64_t> touched(static_cast<size_t>(num_ranks), 0);
    run_ranks(
        num_ranks,
        [&](World& w) {
            ops::prepare_collectives(w);
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            auto* in = static_cast<uint8_t*>(w.heap().alloc(16ull << 20));
            auto* out = static_cast<uint8_t*>(w.heap().alloc(16ull << 20));
            std::vector<uint8_t> ramp(16ull << 20);
            for (size_t i = 0; i < ramp.size(); ++i) ramp[i] = static_cast<uint8_t>((i * 7 + 1) & 0x3f);  // small values
            WEFT_CUDA_CHECK(cudaMemcpy(in, ramp.data(), ramp.size(), cudaMemcpyHostToDevice));
            WEFT_CUDA_CHECK(cudaMemset(out, kPoison, 16ull << 20));
            WEFT_CUDA_CHECK(cudaDeviceSynchronize());
            w.barrier();
            std::string message;
            try {
                c.call(w, s, in, out);
                w.sync_and_check(s);
            } catch (const Error& e) {
                message = e.what();
            }
            std::vector<uint8_t> back(c.out_bytes);
            WEFT_CUDA_CHECK(cudaMemcpy(back.data(), out, back.size(), cudaMemcpyDeviceToHost));
            uint64_t changed = 0;
            for (uint8_t b : back) changed += b != kPoison ? 1 : 0;
            {
                std::lock_guard<std::mutex> lock(mutex);
                messages[static_cast<size_t>(w.rank())] = message;
                touched[static_cast<size_t>(w.rank())] = changed;
            }
            EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the context stays usable";
            std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // every rank's abort reached every rank
            w.clear_diagnostics();
            w.barrier();
            WEFT_CUDA_CHECK(cudaStreamDestroy(s));
        },
        options);
    for (int r = 0; r < num_ranks; ++r) {
        const std::string& m = messages[static_cast<size_t>(r)];
        EXPECT_FALSE(m.empty()) << "rank " << r << " did not throw weft::Error";
        for (const std::string& word : c.words(r)) {
            EXPECT_NE(m.find(word), std::string::npos) << "rank " << r << ": '" << word << "' not in: " << m;
        }
        EXPECT_EQ(touched[static_cast<size_t>(r)], 0u) << "rank " << r << ": bytes of the output were written";
    }
}

// "rank r called <what r did>" and "rank q called <what q did>" for the pair of ranks 0 and 1.
std::function<std::vector<std::string>(int)> both_calls(const std::string& rank0, const std::string& rank1) {
    return [=](int r) {
        return std::vector<std::string>{"collective call differs from rank", "rank 0 called " + rank0,
                                        "rank 1 called " + rank1, r == 0 ? "rank 0 block" : "rank 1 block"};
    };
}

TEST(CollectivesMismatch, AllReduceOfThousandBf16AndFiveHundredF32ThrowsOnEveryRankNamingBoth) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    for (AllReduceAlgo algo : {AllReduceAlgo::kLowLatency, AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot}) {
        SCOPED_TRACE(ops::algo_name(algo));
        const std::string a = ops::algo_name(algo);
        expect_mismatch_on_every_rank(
            2, {[&](World& w, cudaStream_t s, uint8_t* in, uint8_t* out) {
                    const bool odd = w.rank() == 1;  // the same 2000 bytes on both ranks
                    const DType dt = odd ? DType::kF32 : DType::kBF16;
                    const int64_t n = odd ? 500 : 1000;
                    ops::all_reduce(w, TensorView(in, dt, {n}), TensorView(out, dt, {n}), s, {.algo = algo});
                },
                2000, both_calls("all_reduce (" + a + ") of 1000 bf16 elements",
                                 "all_reduce (" + a + ") of 500 f32 elements")});
    }
}

// Large messages on 3 ranks: many blocks per kernel, every one of which must stop (a poisoned output stays poisoned
// everywhere), whether the ranks differ in dtype (same bytes, same grid) or in count.
TEST(CollectivesMismatch, EveryBlockOfAManyBlockGridStopsBeforeWritingTheOutput) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    struct Case {
        AllReduceAlgo algo;
        int64_t bf16_count;
    };
    for (const Case& k : {Case{AllReduceAlgo::kLowLatency, 64 * 1024}, Case{AllReduceAlgo::kOneShot, 2 * 1024 * 1024},
                          Case{AllReduceAlgo::kTwoShot, 2 * 1024 * 1024}}) {
        SCOPED_TRACE(ops::algo_name(k.algo));
        for (bool dtype_differs : {true, false}) {
            std::atomic<int> grid{0};
            expect_mismatch_on_every_rank(
                3, {[&](World& w, cudaStream_t s, uint8_t* in, uint8_t* out) {
                        const ops::CollectiveWorkspaceInfo& info = ops::prepare_collectives(w);
                        grid = ops::all_reduce_grid(k.algo, static_cast<uint64_t>(k.bf16_count) * 2, info.topology);
                        const bool odd = w.rank() == 2;
                        const DType dt = odd && dtype_differs ? DType::kF32 : DType::kBF16;
                        const int64_t n = !odd ? k.bf16_count : dtype_differs ? k.bf16_count / 2 : k.bf16_count - 8;
                        ops::all_reduce(w, TensorView(in, dt, {n}), TensorView(out, dt, {n}), s, {.algo = k.algo});
                    },
                    static_cast<uint64_t>(k.bf16_count) * 2,
                    [](int r) {
                        return std::vector<std::string>{"collective call differs from rank",
                                                        r == 2 ? "rank 2 called all_reduce" : "rank 2 called"};
                    }});
            EXPECT_GT(grid.load(), 1) << "the case must launch more than one block";
        }
    }
}

// One rank low-latency, the other a barrier algorithm (the same call otherwise): the LL rank reads the barrier
// rank's header line and diagnoses the mismatch; its abort stops the barrier rank's entry barrier, whose error
// carries the LL rank's diagnosis.
TEST(CollectivesMismatch, RanksThatChoseDifferentAlgorithmsAreDiagnosed) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    for (AllReduceAlgo other : {AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot}) {
        SCOPED_TRACE(ops::algo_name(other));
        const std::string a = ops::algo_name(other);
        expect_mismatch_on_every_rank(
            2, {[&](World& w, cudaStream_t s, uint8_t* in, uint8_t* out) {
                    const AllReduceAlgo algo = w.rank() == 0 ? AllReduceAlgo::kLowLatency : other;
                    ops::all_reduce(w, TensorView(in, DType::kBF16, {4096}), TensorView(out, DType::kBF16, {4096}), s,
                                    {.algo = algo});
                },
                8192, [&](int) {
                    return std::vector<std::string>{"collective call differs from rank",
                                                    "rank 0 called all_reduce (ll) of 4096 bf16 elements",
                                                    "rank 1 called all_reduce (" + a + ") of 4096 bf16 elements"};
                }});
    }
}

TEST(CollectivesMismatch, AllGatherOfDifferentShardsThrowsOnEveryRank) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    for (AllGatherAlgo algo : {AllGatherAlgo::kLowLatency, AllGatherAlgo::kSmPush}) {
        SCOPED_TRACE(ops::algo_name(algo));
        const std::string a = ops::algo_name(algo);
        expect_mismatch_on_every_rank(
            2, {[&](World& w, cudaStream_t s, uint8_t* in, uint8_t* out) {
                    const int64_t shard = w.rank() == 1 ? 2048 : 1024;
                    ops::all_gather(w, TensorView(in, DType::kU8, {shard}), TensorView(out, DType::kU8, {2 * shard}),
                                    s, {.algo = algo});
                },
                4096, both_calls("all_gather (" + a + ") of 1024 bytes", "all_gather (" + a + ") of 2048 bytes")});
    }
}

TEST(CollectivesMismatch, ReduceScatterOfDifferentDtypesThrowsOnEveryRank) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    for (ReduceScatterAlgo algo : {ReduceScatterAlgo::kLowLatency, ReduceScatterAlgo::kSmPull}) {
        SCOPED_TRACE(ops::algo_name(algo));
        const std::string a = ops::algo_name(algo);
        expect_mismatch_on_every_rank(
            2, {[&](World& w, cudaStream_t s, uint8_t* in, uint8_t* out) {
                    const bool odd = w.rank() == 1;
                    const DType dt = odd ? DType::kF32 : DType::kBF16;
                    const int64_t n = odd ? 500 : 1000;
                    ops::reduce_scatter(w, TensorView(in, dt, {2 * n}), TensorView(out, dt, {n}), s, {.algo = algo});
                },
                2000, both_calls("reduce_scatter (" + a + ") of 1000 bf16 elements",
                                 "reduce_scatter (" + a + ") of 500 f32 elements")});
    }
}

TEST(CollectivesMismatch, AllToAllOfDifferentChunksThrowsOnEveryRank) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    expect_mismatch_on_every_rank(
        2, {[&](World& w, cudaStream_t s, uint8_t* in, uint8_t* out) {
                const int64_t total = w.rank() == 1 ? 8192 : 4096;
                ops::all_to_all(w, TensorView(in, DType::kU8, {total}), TensorView(out, DType::kU8, {total}), s);
            },
            8192, both_calls("all_to_all (direct) of 4096 bytes", "all_to_all (direct) of 8192 bytes")});
}

// all_to_all_v's counts that disagree across the pair, both ways: rank 0 expects 7000 bytes from rank 1, which sends
// it 6000; rank 1 expects 4000 from rank 0, which sends it 5000. Each receiver checks every sender's published size
// before it reads anything (a larger count read past the sender's chunk).
TEST(CollectivesMismatch, AllToAllVCountsThatDisagreeThrowOnEveryRankNamingBothCounts) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    expect_mismatch_on_every_rank(
        2, {[&](World& w, cudaStream_t s, uint8_t* in, uint8_t* out) {
                const std::vector<int64_t> send =
                    w.rank() == 0 ? std::vector<int64_t>{1000, 5000} : std::vector<int64_t>{6000, 1000};
                const std::vector<int64_t> recv =
                    w.rank() == 0 ? std::vector<int64_t>{1000, 7000} : std::vector<int64_t>{4000, 1000};
                ops::all_to_all_v(w, TensorView(in, DType::kU8, {send[0] + send[1]}), send,
                                  TensorView(out, DType::kU8, {recv[0] + recv[1]}), recv, s);
            },
            8192,
            [](int r) {
                return r == 0 ? std::vector<std::string>{"all_to_all_v counts differ",
                                                         "rank 0 expects 7000 bytes from rank 1",
                                                         "which sends it 6000 bytes"}
                              : std::vector<std::string>{"all_to_all_v counts differ",
                                                         "rank 1 expects 4000 bytes from rank 0",
                                                         "which sends it 5000 bytes"};
            }});
}

// A call of 0 elements on one rank only launches nothing there, yet counts in the team's sequence of calls: that
// rank's next call is not paired with its peer's first (same op, size and buffers: it would go undiagnosed, and every
// later pair of calls with it) but fails as a mismatch on both, saying the two differ in their place.
TEST(CollectivesMismatch, ACallOfZeroElementsOnOneRankFailsItsNextCallOnEveryRank) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    for (AllReduceAlgo algo : {AllReduceAlgo::kLowLatency, AllReduceAlgo::kOneShot}) {
        SCOPED_TRACE(ops::algo_name(algo));
        const std::string a = ops::algo_name(algo);
        expect_mismatch_on_every_rank(
            2, {[&](World& w, cudaStream_t s, uint8_t* in, uint8_t* out) {
                    if (w.rank() == 0) {
                        ops::all_reduce(w, TensorView(in, DType::kBF16, {0}), TensorView(out, DType::kBF16, {0}), s,
                                        {.algo = algo});
                    }
                    ops::all_reduce(w, TensorView(in, DType::kBF16, {4096}), TensorView(out, DType::kBF16, {4096}), s,
                                    {.algo = algo});
                },
                8192,
                [&](int) {
                    return std::vector<std::string>{"collective call differs from rank",
                                                    "called all_reduce (" + a + ") of 4096 bf16 elements",
                                                    "their place in the team's sequence of collective calls"};
                }});
    }
}

// An all_to_all_v that one rank refuses on the host (its count to itself differs from its count from itself) while its
// peer made the call: that rank's next call does not complete the peer's (it would, with the same op and counts)
// but fails as a mismatch on both ranks at once, naming the calls' places in the team's sequence.
TEST(CollectivesMismatch, AnAllToAllVRefusedOnOneRankFailsThatRanksNextCallAndItsPeersAtOnce) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    WorldOptions options = test_options(256ull << 20);
    options.heartbeat = std::chrono::milliseconds(200);
    options.timeout = std::chrono::milliseconds(10000);  // a rank left waiting would take this long
    std::mutex mutex;
    std::vector<std::string> refusals(2), messages(2);
    std::vector<double> seconds(2, 0.0);  // each rank's valid call until its error
    run_ranks(
        2,
        [&](World& w) {
            ops::prepare_collectives(w);
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            auto* in = static_cast<uint8_t*>(w.heap().alloc(1 << 20));
            auto* out = static_cast<uint8_t*>(w.heap().alloc(1 << 20));
            w.barrier();
            const std::vector<int64_t> send =
                w.rank() == 0 ? std::vector<int64_t>{1000, 2000} : std::vector<int64_t>{2000, 3000};
            const std::vector<int64_t> recv =
                send[0] == 1000 ? std::vector<int64_t>{1000, 2000} : std::vector<int64_t>{2000, 3000};
            const auto call = [&](const std::vector<int64_t>& r) {
                int64_t received = 0;
                for (int64_t x : r) received += x;
                ops::all_to_all_v(w, TensorView(in, DType::kU8, {send[0] + send[1]}), send,
                                  TensorView(out, DType::kU8, {received}), r, s);
            };
            std::string refusal, message;
            if (w.rank() == 1) {  // its count from itself: 3001 where it sends itself 3000
                try {
                    call({2000, 3001});
                } catch (const Error& e) {
                    refusal = e.what();
                }
            }
            const auto t0 = std::chrono::steady_clock::now();
            try {
                call(recv);
                w.sync_and_check(s);
            } catch (const Error& e) {
                message = e.what();
            }
            const std::chrono::duration<double> took = std::chrono::steady_clock::now() - t0;
            {
                std::lock_guard<std::mutex> lock(mutex);
                refusals[static_cast<size_t>(w.rank())] = refusal;
                messages[static_cast<size_t>(w.rank())] = message;
                seconds[static_cast<size_t>(w.rank())] = took.count();
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // every rank's abort reached every rank
            w.clear_diagnostics();
            w.barrier();
            WEFT_CUDA_CHECK(cudaStreamDestroy(s));
        },
        options);
    EXPECT_NE(refusals[1].find("send_counts[1] (to this rank itself) must equal recv_counts[1] (from itself)"),
              std::string::npos)
        << refusals[1];
    for (int r = 0; r < 2; ++r) {
        const std::string& m = messages[static_cast<size_t>(r)];
        EXPECT_NE(m.find("collective call differs from rank"), std::string::npos) << "rank " << r << ": " << m;
        EXPECT_NE(m.find("their place in the team's sequence of collective calls"), std::string::npos)
            << "rank " << r << ": " << m;
        EXPECT_LT(seconds[static_cast<size_t>(r)], 8.0) << "rank " << r << " waited out the timeout";
    }
}

// ------------------------------------------------------------------------------------------------
// Death-test scenarios: the child provokes the failure on 2 ranks, collects every rank's error, and exits 0 only if
// one of them carries the expected diagnosis. An alarm bounds the child: a hang fails the test.

enum class Scenario {
    kCountMismatch,
    kDtypeMismatch,
    kLowLatencyNeverArrives,
    kLowLatencyReduceScatterNeverArrives,
    kCopyEngineMismatch
};

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
                        case Scenario::kLowLatencyNeverArrives:  // rank 1 waits for lines rank 0 never sends
                            if (odd) {
                                ops::all_reduce(w, TensorView(buf, DType::kF32, {1000}),
                                                TensorView(buf + 65536, DType::kF32, {1000}), s,
                                                {.algo = AllReduceAlgo::kLowLatency});
                            }
                            break;
                        case Scenario::kLowLatencyReduceScatterNeverArrives:  // rank 0 never calls
                            if (odd) {
                                ops::reduce_scatter(w, TensorView(buf, DType::kF32, {2000}),
                                                    TensorView(buf + 65536, DType::kF32, {1000}), s,
                                                    {.algo = ReduceScatterAlgo::kLowLatency});
                            }
                            break;
                        case Scenario::kCopyEngineMismatch:  // the entry kernel traps: the queued copies never run
                            ops::all_gather(w, TensorView(buf, DType::kU8, {odd ? 2048 : 1024}),
                                            TensorView(buf + 65536, DType::kU8, {odd ? 4096 : 2048}), s,
                                            {.algo = AllGatherAlgo::kCopyEnginePush});
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

TEST_F(CollectivesDeathTest, CopyEngineAllGatherOfDifferentShardsIsDiagnosed) {
    EXPECT_EXIT(provoke(Scenario::kCopyEngineMismatch, "all_gather (ce_push) of 1024 bytes"),
                ::testing::ExitedWithCode(0), "diagnosed");
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
