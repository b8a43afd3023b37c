// SPDX-License-Identifier: MIT
// GPU tests of the runtime with ranks as threads: heap exchange through symm_at, collective alloc/free,
// mismatches, signals, DeviceCtx, teams, stream helpers, run_local failures.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "collectives_test_kernels.hpp"
#include "support/runtime_checks.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

using test::run_ranks;
using test::test_options;

class RuntimeGpu : public ::testing::Test {
protected:
    void SetUp() override { ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU"; }
};

int visible_devices() {
    int n = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&n));
    return n;
}

TEST_F(RuntimeGpu, PatternExchangeThroughSymmAt) {
    for (int n : {1, 2, 3, 4, 8}) {
        SCOPED_TRACE("num_ranks " + std::to_string(n));
        run_ranks(n, [](World& w) {
            test::check_exchange_through_symm_at(w, 1000 + 37);      // awkward size
            test::check_exchange_through_symm_at(w, (1 << 18) + 3);  // ~1 MiB per slot
        });
    }
}

// sync_and_check on a stream being captured is a usage error of that call: a weft::Error saying so, the World not
// aborted (CUDA refuses the synchronisation; it was taken for a failed kernel and aborted every rank), and another
// rank thread synchronising its own stream meanwhile neither fails nor breaks the capture.
TEST_F(RuntimeGpu, SyncAndCheckOfACapturingStreamIsAnErrorThatAbortsNothing) {
    std::mutex mutex;
    std::vector<std::string> errors;
    run_ranks(2, [&](World& w) {
        cudaStream_t s = nullptr;
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        if (w.rank() == 0) {
            WEFT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            std::string message;
            try {
                w.sync_and_check(s);
            } catch (const Error& e) {
                message = e.what();
            }
            w.barrier();  // rank 1 synchronises its own stream while this capture is open
            w.barrier();
            cudaGraph_t graph = nullptr;
            const cudaError_t ended = cudaStreamEndCapture(s, &graph);
            if (graph != nullptr) cudaGraphDestroy(graph);
            w.barrier();  // rank 1 leaves (run_local synchronises the device) only once the capture is closed
            std::lock_guard<std::mutex> lock(mutex);
            errors.push_back(message);
            errors.push_back(ended == cudaSuccess ? "" : std::string("capture broken: ") + cudaGetErrorName(ended));
        } else {
            w.barrier();
            w.sync_and_check(s);  // another thread's global-mode capture is open
            w.barrier();
            w.barrier();
        }
        EXPECT_FALSE(w.aborted()) << "rank " << w.rank();
        WEFT_CUDA_CHECK(cudaStreamDestroy(s));
    });
    ASSERT_EQ(errors.size(), 2u);
    EXPECT_NE(errors[0].find("being captured"), std::string::npos) << errors[0];
    EXPECT_EQ(errors[1], "");
}

std::atomic<int> sync_checks_asked{0};
std::optional<std::string> stop_every_sync() noexcept {
    ++sync_checks_asked;
    return std::string("the test stopped it");
}

/// stop_every_sync as the process's wait check while it lives.
struct ScopedStopEverySync {
    ScopedStopEverySync() { set_wait_interrupt_check(&stop_every_sync); }
    ~ScopedStopEverySync() { set_wait_interrupt_check(nullptr); }
    ScopedStopEverySync(const ScopedStopEverySync&) = delete;
    ScopedStopEverySync& operator=(const ScopedStopEverySync&) = delete;
};

// With an embedding's wait check set (the Python binding's: Ctrl-C), sync_and_check queries its stream and asks the
// check every 100 ms: a stream done sooner returns without asking, a longer wait ends with the check's reason (the
// stream's work still running, the World not aborted by the call); with no check the same call waits it out.
TEST_F(RuntimeGpu, SyncAndCheckAsksTheEmbeddingsWaitCheck) {
    run_ranks(1, [](World& w) {
        cudaStream_t s = nullptr;
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        std::string quick, stopped;
        int asked_quick = 0;
        std::chrono::steady_clock::duration waited{};
        bool still_running = false;
        {
            const ScopedStopEverySync check;
            sync_checks_asked = 0;
            test::launch_delay(s, 1'000'000);  // 1 ms
            try {
                w.sync_and_check(s);
            } catch (const Error& e) {
                quick = e.what();
            }
            asked_quick = sync_checks_asked.exchange(0);
            test::launch_delay(s, 3'000'000'000);  // 3 s
            const auto start = std::chrono::steady_clock::now();
            try {
                w.sync_and_check(s);
            } catch (const Error& e) {
                stopped = e.what();
            }
            waited = std::chrono::steady_clock::now() - start;
            still_running = cudaStreamQuery(s) == cudaErrorNotReady;
        }
        w.sync_and_check(s);  // no check: waits for the rest of the 3 s
        EXPECT_EQ(quick, "");
        EXPECT_EQ(asked_quick, 0) << "a stream done within 100 ms";
        EXPECT_NE(stopped.find("rank 0: sync_and_check stopped after "), std::string::npos) << stopped;
        EXPECT_NE(stopped.find(" ms with the stream's work still running: the test stopped it"), std::string::npos)
            << stopped;
        EXPECT_EQ(sync_checks_asked, 1) << "the first check (at 100 ms) stops it";
        EXPECT_LT(waited, std::chrono::milliseconds(1000));
        EXPECT_TRUE(still_running);
        EXPECT_FALSE(w.aborted());
        WEFT_CUDA_CHECK(cudaStreamDestroy(s));
    });
}

TEST_F(RuntimeGpu, WorldBindingAndBudget) {
    const int devices = visible_devices();
    for (int n : {1, 3, 4}) {
        run_ranks(n, [&](World& w) {
            WEFT_CHECK(w.device() == w.rank() % devices, "rank " << w.rank() << " on device " << w.device());
            int current = -1;
            WEFT_CUDA_CHECK(cudaGetDevice(&current));
            WEFT_CHECK(current == w.device(), "device " << w.device() << " is not current on the rank's thread");
            int sharing = 0;
            for (int r = 0; r < n; ++r) sharing += (r % devices == w.device()) ? 1 : 0;
            WEFT_CHECK(w.num_ranks_on_device() == sharing,
                       "num_ranks_on_device " << w.num_ranks_on_device() << ", expected " << sharing);
            int sms = 0;
            WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, w.device()));
            WEFT_CHECK(w.sm_budget() == std::max(1, sms / sharing), "sm_budget " << w.sm_budget());
            // The same on every rank, even where GPUs host different numbers of ranks (3 ranks on 2 GPUs).
            const int most = (n + std::min(n, devices) - 1) / std::min(n, devices);
            WEFT_CHECK(w.max_ranks_per_device() == most,
                       "max_ranks_per_device " << w.max_ranks_per_device() << ", expected " << most);
            WEFT_CHECK(w.shared_sm_budget() == std::max(1, sms / most), "shared_sm_budget " << w.shared_sm_budget());
            WEFT_CHECK(w.timeout() == std::chrono::milliseconds(30000), "timeout " << w.timeout().count());
            WEFT_CHECK(w.local_rank() == w.rank() && w.local_num_ranks() == n, "local rank/size");
            WEFT_CHECK(w.node_team().num_ranks() == n && w.node_team().rank() == w.rank(), "node team");
            WEFT_CHECK(w.heap().bytes() == (64ull << 20), "heap bytes " << w.heap().bytes());
            WEFT_CHECK(w.heap().bytes() % w.heap().granularity() == 0, "heap not granularity-aligned");
        });
    }
    WorldOptions options = test_options();
    options.sm_budget = 5;
    options.device = devices - 1;
    run_ranks(
        2,
        [&](World& w) {
            WEFT_CHECK(w.sm_budget() == 5, "sm_budget option ignored: " << w.sm_budget());
            WEFT_CHECK(w.device() == devices - 1, "device option ignored: " << w.device());
            WEFT_CHECK(w.num_ranks_on_device() == 2, "both ranks are on one device");
            WEFT_CHECK(w.max_ranks_per_device() == 2 && w.shared_sm_budget() == 5, "shared budget of the option");
        },
        options);
}

TEST_F(RuntimeGpu, RepeatedAllocFreeGivesIdenticalOffsets) {
    for (int n : {1, 2, 3}) {
        SCOPED_TRACE("num_ranks " + std::to_string(n));
        run_ranks(n, [](World& w) {
            test::check_alloc_free_cycles(w, 300);
            test::check_alloc_free_cycles(w, 301);  // again, on the heap the first cycle left empty
        });
    }
}

TEST_F(RuntimeGpu, MismatchedAllocationIsAnErrorOnEveryRank) {
    for (int n : {2, 3, 4}) {
        SCOPED_TRACE("num_ranks " + std::to_string(n));
        std::atomic<int> checked{0};
        run_ranks(n, [&](World& w) {
            test::check_mismatch_errors(w);
            ++checked;
        });
        EXPECT_EQ(checked.load(), n) << "not every rank saw the errors";
    }
}

TEST_F(RuntimeGpu, AllocSignalsAreZeroed) {
    run_ranks(3, [](World& w) { test::check_alloc_signals_zeroed(w); });
}

TEST_F(RuntimeGpu, OutOfHeapNamesTheSizeAndVariable) {
    run_ranks(2, [](World& w) {
        SymmetricHeap& heap = w.heap();
        std::string message;
        try {
            heap.alloc(heap.bytes() + 1);
        } catch (const Error& e) {
            message = e.what();
        }
        WEFT_CHECK(message.find("does not fit") != std::string::npos &&
                       message.find("WEFT_SYMMETRIC_HEAP_BYTES") != std::string::npos &&
                       message.find("64 MiB per rank") != std::string::npos,
                   "unexpected message: '" << message << "'");
        // Fill the heap exactly, then one more byte fails, and freeing makes room again.
        void* all = heap.alloc(heap.bytes());
        bool full = false;
        try {
            heap.alloc(1);
        } catch (const Error&) {
            full = true;
        }
        WEFT_CHECK(full, "a full heap accepted another allocation");
        heap.free(all);
        heap.free(heap.alloc(heap.bytes()));
        // Bad arguments are errors on every rank too.
        bool zero = false, align = false;
        try {
            heap.alloc(0);
        } catch (const Error&) {
            zero = true;
        }
        try {
            heap.alloc(64, 3);
        } catch (const Error&) {
            align = true;
        }
        WEFT_CHECK(zero && align, "alloc(0) or alloc(64, 3) was accepted");
    });
}

TEST_F(RuntimeGpu, SymmAtAndContains) {
    run_ranks(2, [](World& w) {
        SymmetricHeap& heap = w.heap();
        auto* p = heap.alloc_array<uint64_t>(16);
        const uint64_t to_end = heap.bytes() - heap.offset_of(p);
        WEFT_CHECK(heap.contains(p, 128) && heap.contains(p, to_end) && !heap.contains(p, to_end + 1),
                   "contains: [p, p + 128) and [p, end) are in the heap, one byte more is not");
        WEFT_CHECK(!heap.contains(heap.base() + heap.bytes()), "one past the end is not in the heap");
        WEFT_CHECK(heap.symm_at(p, w.rank()) == p, "symm_at of this rank is the pointer itself");
        const int peer = 1 - w.rank();
        WEFT_CHECK(heap.symm_at(static_cast<void*>(p), peer) ==
                       heap.peer_bases()[static_cast<size_t>(peer)] + heap.offset_of(p),
                   "symm_at of the peer");
        int local = 0;
        bool outside = false, bad_rank = false;
        try {
            heap.symm_at(&local, 0);
        } catch (const Error&) {
            outside = true;
        }
        try {
            heap.symm_at(p, 2);
        } catch (const Error&) {
            bad_rank = true;
        }
        WEFT_CHECK(outside && bad_rank, "symm_at accepted a pointer outside the heap or a bad rank");
        heap.free(p);
    });
}

TEST_F(RuntimeGpu, DeviceCtxFields) {
    run_ranks(3, [](World& w) {
        DeviceCtx ctx = w.device_ctx();
        WEFT_CHECK(ctx.rank == w.rank() && ctx.num_ranks == 3 && ctx.world_rank == w.rank(), "ranks");
        WEFT_CHECK(ctx.heap_base == w.heap().base() && ctx.heap_bytes == w.heap().bytes(), "heap");
        WEFT_CHECK(ctx.sm_budget == w.sm_budget() && ctx.sm_budget > 0, "sm_budget");
        WEFT_CHECK(ctx.timeout_ns == 30000ull * 1000000ull, "timeout_ns " << ctx.timeout_ns);
        WEFT_CHECK(ctx.diag != nullptr && ctx.team_to_world == nullptr, "diag / team_to_world");
        std::vector<uint8_t*> table(3);
        WEFT_CUDA_CHECK(cudaMemcpy(table.data(), ctx.peer_bases, 3 * sizeof(uint8_t*), cudaMemcpyDeviceToHost));
        WEFT_CHECK(table == w.heap().peer_bases(), "device peer table differs from the host table");
        WEFT_CHECK(table[static_cast<size_t>(w.rank())] == w.heap().base(), "own entry");
        w.check_diagnostics();  // nothing written: no-op
    });
}

TEST_F(RuntimeGpu, TeamsSplitTranslateAndCarryDeviceTables) {
    run_ranks(6, [](World& w) {
        const Team& world = w.team();
        WEFT_CHECK(world.num_ranks() == 6 && world.rank() == w.rank(), "world team");
        Team even = world.split_strided(0, 2, 3);
        WEFT_CHECK((even.members() == std::vector<int>{0, 2, 4}), "strided members");
        WEFT_CHECK(even.rank() == (w.rank() % 2 == 0 ? w.rank() / 2 : -1), "strided rank " << even.rank());
        // Colour = rank % 3, key = -rank: teams {3, 0}, {4, 1}, {5, 2}.
        Team color = world.split_color(w.rank() % 3, -w.rank());
        const std::vector<int> expected{w.rank() % 3 + 3, w.rank() % 3};
        WEFT_CHECK(color.members() == expected, "colour team of rank " << w.rank());
        WEFT_CHECK(color.rank() == (w.rank() >= 3 ? 0 : 1), "colour team rank");
        WEFT_CHECK(color.world_rank(color.rank()) == w.rank() && color.team_rank(w.rank()) == color.rank(),
                   "translation");
        // A second split of a sub-team (collective over its members only).
        Team single = color.split_color(color.rank() == 0 ? 7 : -1, 0);
        WEFT_CHECK(single.num_ranks() == (color.rank() == 0 ? 1 : 0), "split with a negative colour");
        DeviceCtx ctx = color.device_ctx();
        WEFT_CHECK(ctx.rank == color.rank() && ctx.num_ranks == 2 && ctx.world_rank == w.rank(), "team ctx ranks");
        std::vector<uint8_t*> peers(2);
        std::vector<int32_t> ranks(2);
        WEFT_CUDA_CHECK(cudaMemcpy(peers.data(), ctx.peer_bases, 2 * sizeof(uint8_t*), cudaMemcpyDeviceToHost));
        WEFT_CUDA_CHECK(cudaMemcpy(ranks.data(), ctx.team_to_world, 2 * sizeof(int32_t), cudaMemcpyDeviceToHost));
        for (int t = 0; t < 2; ++t) {
            WEFT_CHECK(ranks[static_cast<size_t>(t)] == expected[static_cast<size_t>(t)], "team_to_world");
            WEFT_CHECK(peers[static_cast<size_t>(t)] ==
                           w.heap().peer_bases()[static_cast<size_t>(expected[static_cast<size_t>(t)])],
                       "team peer table");
        }
        bool not_member = false;
        try {
            if (!even.is_member())
                even.device_ctx();
            else
                not_member = true;
        } catch (const Error&) {
            not_member = true;
        }
        WEFT_CHECK(not_member, "device_ctx of a team this rank is not in should throw");
    });
}

TEST_F(RuntimeGpu, StreamWritesReachPeersAndWaitsRelease) {
    for (int n : {1, 3}) run_ranks(n, [](World& w) { test::check_stream_writes_to_peers(w); });
}

TEST_F(RuntimeGpu, RunLocalNamesTheFirstFailingRankQuickly) {
    const auto start = std::chrono::steady_clock::now();
    std::string message;
    try {
        run_local(
            4,
            [](World& w) {
                if (w.rank() == 2) WEFT_FAIL("rank two gives up");
                w.barrier();  // the others wait for rank 2 here; the aborted store releases them
            },
            test_options());
    } catch (const Error& e) {
        message = e.what();
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    EXPECT_NE(message.find("run_local: rank 2 failed first: rank two gives up"), std::string::npos) << message;
    EXPECT_NE(message.find("(then ranks 0, 1, 3 failed too)"), std::string::npos) << message;
    EXPECT_LT(waited, std::chrono::seconds(20)) << "the other ranks waited for their timeout";
    // The GPU and the process are still usable afterwards.
    run_ranks(2, [](World& w) { test::check_exchange_through_symm_at(w, 4099); });
}

TEST_F(RuntimeGpu, BadOptionsAreRejected) {
    auto message_of = [](const WorldOptions& options) {
        try {
            run_local(
                2, [](World&) {}, options);
        } catch (const Error& e) {
            return std::string(e.what());
        }
        return std::string();
    };
    WorldOptions bad = test_options();
    bad.timeout = std::chrono::milliseconds(-5);
    EXPECT_NE(message_of(bad).find("WorldOptions::timeout must not be negative"), std::string::npos);
    bad = test_options();
    bad.device = visible_devices();
    EXPECT_NE(message_of(bad).find("WorldOptions::device must be a visible device"), std::string::npos);
    bad = test_options();
    bad.sm_budget = 100000;
    EXPECT_NE(message_of(bad).find("sm_budget must be in [1, "), std::string::npos);
}

}  // namespace
}  // namespace weft
