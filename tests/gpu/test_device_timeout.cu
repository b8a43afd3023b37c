// SPDX-License-Identifier: MIT
// GPU tests that a wait which can never be satisfied ends in a weft::Error naming the word it waited on
// (and that a put to an unreachable peer fails clearly), instead of hanging; and that the forms that return
// instead of trapping (tile::wait_checked, tile::notify_checked) record the same diagnosis and report the failure
// to every thread of the group, leaving the kernel running.
//
// A timed-out spin traps, which leaves the process's CUDA context unusable. So each scenario runs in a
// death-test child (gtest's "threadsafe" style re-executes this binary for just that test: a fresh
// process and context, whatever ran before in the parent). The child exits 0 only if the error names
// the right address; an alarm bounds it, so a hang is a failure, not a stuck test run.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/device_test_util.cuh"
#include "weft/device.cuh"

namespace weft {
namespace {

using device::Block;
using device::Thread;
namespace shmem = device::shmem;
namespace tile = device::tile;

constexpr int kTileSignals = 40;
constexpr int kMissingSignal = 37;

__global__ void never_signalled_kernel(DeviceCtx ctx, const uint64_t* sig) {
    if (threadIdx.x == 0) {
        shmem::signal_wait_until(Thread{}, ctx, sig, Cmp::kGe, 1);
    }
}

__global__ void tile_wait_kernel(DeviceCtx ctx, const uint64_t* sigs) {
    tile::wait(Block{}, ctx, sigs, kTileSignals, Cmp::kGe, 1);
}

__global__ void barrier_kernel(DeviceCtx ctx, uint64_t* psync) { shmem::barrier_all(Block{}, ctx, psync); }

__global__ void unreachable_put_kernel(DeviceCtx ctx, uint8_t* dst, const uint8_t* src) {
    shmem::putmem(Block{}, ctx, dst, src, 64, 1);
}

// Warpgroup 0 waits for the signals that arrived, warpgroup 1 also for the missing one (checked: no trap): every
// thread writes what its wait returned.
__global__ void warpgroup_wait_checked_kernel(DeviceCtx ctx, const uint64_t* sigs, int* ok_out) {
    const uint32_t wg = threadIdx.x / 128;
    const device::WaitResult r =
        tile::wait_checked(device::Warpgroup{1 + wg}, ctx, sigs, wg == 0 ? kMissingSignal : kTileSignals, Cmp::kGe, 1);
    ok_out[threadIdx.x] = r.ok() ? 1 : 0;
}

__global__ void block_wait_checked_kernel(DeviceCtx ctx, const uint64_t* sigs, int n, int* ok_out) {
    const device::WaitResult r = tile::wait_checked(Block{}, ctx, sigs, n, Cmp::kGe, 1);
    ok_out[threadIdx.x] = r.ok() ? 1 : 0;
}

__global__ void notify_checked_kernel(DeviceCtx ctx, uint64_t* sig, int* ok_out) {
    ok_out[threadIdx.x] = tile::notify_checked(device::Warp{}, ctx, sig, 1, 1) ? 1 : 0;
}

enum class Scenario { kSignalWait, kTileWait, kBarrier, kUnreachablePeer };

std::string hex(const void* p) {
    std::ostringstream os;
    os << "0x" << std::hex << reinterpret_cast<uintptr_t>(p);
    return os.str();
}

// A copy of `ctx` claiming a second rank whose heap is `peer1_base` (nullptr: unreachable). Lets one
// rank provoke a barrier nobody joins, or a put to a peer without a load/store path.
DeviceCtx two_rank_ctx(const DeviceCtx& ctx, uint8_t* peer1_base, uint8_t*** table_out) {
    uint8_t* host_table[2] = {ctx.heap_base, peer1_base};
    WEFT_CUDA_CHECK(cudaMalloc(table_out, sizeof(host_table)));
    WEFT_CUDA_CHECK(cudaMemcpy(*table_out, host_table, sizeof(host_table), cudaMemcpyHostToDevice));
    DeviceCtx fake = ctx;
    fake.num_ranks = 2;
    fake.rank = 0;
    fake.peer_bases = *table_out;
    fake.team_to_world = nullptr;
    return fake;
}

// Runs in the death-test child: provokes the failure, checks the error, exits.
[[noreturn]] void provoke(Scenario scenario) {
    alarm(120);  // a hang ends the child with SIGALRM: the death test then fails instead of hanging
    WorldOptions options = test::device_test_options();
    options.timeout = std::chrono::milliseconds(200);
    std::string expected_addr;
    std::string message;
    double seconds = 0;
    try {
        run_local(1, [&](World& w) {
            test::RankStream stream;
            SymmetricHeap& heap = w.heap();
            uint64_t* sigs = heap.alloc_signals(kTileSignals);
            uint8_t** table = nullptr;
            const auto start = std::chrono::steady_clock::now();
            switch (scenario) {
                case Scenario::kSignalWait:
                    expected_addr = hex(sigs + 3);
                    never_signalled_kernel<<<2, 64, 0, stream>>>(w.device_ctx(), sigs + 3);
                    break;
                case Scenario::kTileWait: {
                    std::vector<uint64_t> ones(kTileSignals, 1);
                    ones[kMissingSignal] = 0;
                    WEFT_CUDA_CHECK(cudaMemcpy(sigs, ones.data(), ones.size() * 8, cudaMemcpyHostToDevice));
                    expected_addr = hex(sigs + kMissingSignal);
                    tile_wait_kernel<<<1, 128, 0, stream>>>(w.device_ctx(), sigs);
                    break;
                }
                case Scenario::kBarrier: {
                    const DeviceCtx ctx = w.device_ctx();
                    // "Rank 1" maps to the upper half of this heap: its arrivals land there, harmlessly,
                    // and its own arrival here (psync[1]) never comes.
                    const DeviceCtx fake = two_rank_ctx(ctx, ctx.heap_base + ctx.heap_bytes / 2, &table);
                    expected_addr = hex(sigs + 1);
                    barrier_kernel<<<1, 64, 0, stream>>>(fake, sigs);
                    break;
                }
                case Scenario::kUnreachablePeer: {
                    auto* buf = static_cast<uint8_t*>(heap.alloc(256));
                    const DeviceCtx fake = two_rank_ctx(w.device_ctx(), nullptr, &table);
                    expected_addr = hex(buf);
                    unreachable_put_kernel<<<1, 64, 0, stream>>>(fake, buf, buf + 128);
                    break;
                }
            }
            try {
                test::finish(w, stream, "the provoking kernel");
            } catch (...) {
                seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
                throw;
            }
        }, options);
    } catch (const std::exception& e) {
        message = e.what();
    }
    std::fprintf(stderr, "error after %.3f s: %s\n", seconds, message.c_str());
    bool ok = true;
    if (message.empty()) {
        std::fprintf(stderr, "FAIL: no error was raised\n");
        ok = false;
    }
    if (message.find(expected_addr) == std::string::npos) {
        std::fprintf(stderr, "FAIL: the error does not name the address %s\n", expected_addr.c_str());
        ok = false;
    }
    if (scenario != Scenario::kUnreachablePeer && seconds < 0.15) {
        std::fprintf(stderr, "FAIL: gave up after %.3f s, before the 0.2 s timeout\n", seconds);
        ok = false;
    }
    if (ok) {
        std::fprintf(stderr, "the error named %s\n", expected_addr.c_str());
    }
    std::fflush(stderr);
    std::_Exit(ok ? 0 : 1);
}

class DeviceTimeoutDeathTest : public ::testing::Test {
protected:
    void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(DeviceTimeoutDeathTest, SignalWaitUntilNamesTheSignal) {
    EXPECT_EXIT(provoke(Scenario::kSignalWait), ::testing::ExitedWithCode(0), "the error named 0x");
}

TEST_F(DeviceTimeoutDeathTest, TileWaitNamesTheMissingSignal) {
    EXPECT_EXIT(provoke(Scenario::kTileWait), ::testing::ExitedWithCode(0), "the error named 0x");
}

TEST_F(DeviceTimeoutDeathTest, BarrierNamesTheMissingArrival) {
    EXPECT_EXIT(provoke(Scenario::kBarrier), ::testing::ExitedWithCode(0), "the error named 0x");
}

TEST_F(DeviceTimeoutDeathTest, PutToUnreachablePeerFailsClearly) {
    EXPECT_EXIT(provoke(Scenario::kUnreachablePeer), ::testing::ExitedWithCode(0), "the error named 0x");
}

// The checked forms run in this process: they do not trap, so the context stays usable.
TEST(DeviceCheckedForms, RecordTheDiagnosisAndReturnTheFailureToTheWholeGroup) {
    WorldOptions options = test::device_test_options();
    options.timeout = std::chrono::milliseconds(200);
    test::run_world(1, [&](World& w) {
        test::RankStream stream;
        uint64_t* sigs = w.heap().alloc_signals(kTileSignals);
        std::vector<uint64_t> ones(kTileSignals, 1);
        ones[kMissingSignal] = 0;
        WEFT_CUDA_CHECK(cudaMemcpy(sigs, ones.data(), ones.size() * 8, cudaMemcpyHostToDevice));
        int* d_ok = nullptr;
        WEFT_CUDA_CHECK(cudaMalloc(&d_ok, 256 * sizeof(int)));
        std::vector<int> ok(256);
        const auto run = [&](const char* what, const std::function<void()>& launch) {
            WEFT_CUDA_CHECK(cudaMemset(d_ok, 0x7f, 256 * sizeof(int)));
            launch();
            std::string message;
            try {
                test::finish(w, stream, what);
            } catch (const std::exception& e) {
                message = e.what();
            }
            WEFT_CUDA_CHECK(cudaMemcpy(ok.data(), d_ok, ok.size() * sizeof(int), cudaMemcpyDeviceToHost));
            w.clear_diagnostics();
            return message;
        };

        // Everything arrived: ok in every thread, nothing recorded.
        std::string m = run("block_wait_checked_kernel (all arrived)", [&] {
            block_wait_checked_kernel<<<1, 128, 0, stream>>>(w.device_ctx(), sigs, kMissingSignal, d_ok);
        });
        EXPECT_EQ(m, "");
        for (int t = 0; t < 128; ++t) ASSERT_EQ(ok[t], 1) << "thread " << t;

        // One signal missing: one thread polls it, every thread of the block learns the wait failed.
        m = run("block_wait_checked_kernel", [&] {
            block_wait_checked_kernel<<<1, 128, 0, stream>>>(w.device_ctx(), sigs, kTileSignals, d_ok);
        });
        EXPECT_NE(m.find(hex(sigs + kMissingSignal)), std::string::npos) << m;
        EXPECT_NE(m.find("tile_wait"), std::string::npos) << m;
        EXPECT_EQ(m.find("trapped"), std::string::npos) << "a checked wait must not trap: " << m;
        for (int t = 0; t < 128; ++t) ASSERT_EQ(ok[t], 0) << "thread " << t;

        // Two warpgroups, each its own group (named barriers 1 and 2): only the one that waits for the missing
        // signal fails, in all of its 128 threads.
        m = run("warpgroup_wait_checked_kernel", [&] {
            warpgroup_wait_checked_kernel<<<1, 256, 0, stream>>>(w.device_ctx(), sigs, d_ok);
        });
        EXPECT_NE(m.find(hex(sigs + kMissingSignal)), std::string::npos) << m;
        EXPECT_EQ(m.find("trapped"), std::string::npos) << m;
        for (int t = 0; t < 256; ++t) ASSERT_EQ(ok[t], t < 128 ? 1 : 0) << "thread " << t;

        // A notify to a peer that is not load/store reachable: recorded, false in every lane, nothing raised.
        uint8_t** table = nullptr;
        const DeviceCtx fake = two_rank_ctx(w.device_ctx(), nullptr, &table);
        m = run("notify_checked_kernel", [&] { notify_checked_kernel<<<1, 32, 0, stream>>>(fake, sigs, d_ok); });
        EXPECT_NE(m.find(hex(sigs)), std::string::npos) << m;
        EXPECT_NE(m.find("not load/store reachable"), std::string::npos) << m;
        EXPECT_EQ(m.find("trapped"), std::string::npos) << m;
        for (int t = 0; t < 32; ++t) ASSERT_EQ(ok[t], 0) << "lane " << t;
        uint64_t first = 0;
        WEFT_CUDA_CHECK(cudaMemcpy(&first, sigs, 8, cudaMemcpyDeviceToHost));
        EXPECT_EQ(first, 1u) << "notify_checked raised a signal although it failed";
        cudaFree(table);
        cudaFree(d_ok);
    }, options);
}

}  // namespace
}  // namespace weft
