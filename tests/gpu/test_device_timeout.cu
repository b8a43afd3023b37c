// SPDX-License-Identifier: MIT
// GPU tests that a wait which can never be satisfied ends in a weft::Error naming the word it waited on, instead of
// hanging, and ends its kernel cleanly: the CUDA context stays usable, and so does the World once every rank has
// cleared its diagnostics (World::clear_diagnostics); that World::abort and a wait that gives up on one rank stop
// the waits of every rank within seconds, whatever the timeout; that a put to an unreachable peer fails clearly;
// and that the forms that return (tile::wait_checked, tile::notify_checked) record the same diagnosis and report
// the failure to every thread of the group, leaving the kernel running.
//
// A put to an unreachable peer still traps (a programming error, not a wait), which leaves the process's CUDA
// context unusable: it runs in a death-test child (gtest's "threadsafe" style re-executes this binary for just that
// test). Every scenario is bounded: an alarm in the child, and a bound on how long each error may take.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
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

// The plain wait: a thread that writes 1 got past it.
__global__ void block_wait_kernel(DeviceCtx ctx, const uint64_t* sigs, int n, int* ok_out) {
    (void)tile::wait(Block{}, ctx, sigs, n, Cmp::kGe, 1);
    ok_out[threadIdx.x] = 1;
}

__global__ void notify_checked_kernel(DeviceCtx ctx, uint64_t* sig, int* ok_out) {
    ok_out[threadIdx.x] = tile::notify_checked(device::Warp{}, ctx, sig, 1, 1) ? 1 : 0;
}

__global__ void peer_signal_checked_kernel(DeviceCtx ctx, uint64_t* sig, int* ok_out) {
    const tile::PeerSignal remote = tile::peer_signal_checked(ctx, sig, 1);
    if (remote) tile::notify(device::Thread{}, remote, 1);
    ok_out[threadIdx.x] = remote ? 1 : 0;
}

// Every thread waits for its own LL line with the checked form, writes what it returned, then meets its warpgroup at
// its named barrier: the form must return (a wait that ended the thread would leave that barrier short of warps).
__global__ void ll_wait_checked_kernel(DeviceCtx ctx, const uint8_t* lines, uint32_t flag, int* ok_out) {
    uint2 payload{0, 0};
    const bool ok = device::ll::wait_line_checked(ctx, lines + threadIdx.x * device::ll::kLineBytes, flag, &payload);
    device::Warpgroup{1}.sync();
    ok_out[threadIdx.x] = ok ? static_cast<int>(payload.x) : -1;
}

// A put of 0 bytes whose destination is the heap's end (OpenSHMEM allows any address for no elements), then its signal.
__global__ void zero_byte_put_kernel(DeviceCtx ctx, uint64_t* sig) {
    uint8_t* end = ctx.heap_base + ctx.heap_bytes;
    shmem::putmem_signal(Block{}, ctx, end, end, 0, sig, 1, device::SignalOp::kAdd, ctx.rank);
    shmem::putmem(Block{}, ctx, nullptr, nullptr, 0, ctx.rank);
    shmem::getmem(Block{}, ctx, nullptr, end, 0, ctx.rank);
}

// A Warp group in a block of 48 threads: its second warp has 16 lanes, which cannot split a warp's copy.
__global__ void partial_warp_put_kernel(DeviceCtx ctx, uint8_t* dst, const uint8_t* src, uint64_t* sig) {
    shmem::putmem_signal(device::Warp{}, ctx, dst, src, 4096, sig, 1, device::SignalOp::kAdd, ctx.rank);
}

enum class Scenario { kSignalWait, kTileWait, kBarrier, kUnreachablePeer, kPartialWarpPut };

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

// Provokes `scenario` on a World of one rank (200 ms timeout) and returns the error, the address it must name and
// how long the error took. The waits end their kernels cleanly; the unreachable peer traps (death test only).
struct Provoked {
    std::string message;
    std::string expected_addr;
    double seconds = 0;
};

Provoked provoke_in(World& w, Scenario scenario) {
    Provoked out;
    test::RankStream stream;
    SymmetricHeap& heap = w.heap();
    uint64_t* sigs = heap.alloc_signals(kTileSignals);
    uint8_t** table = nullptr;
    const auto start = std::chrono::steady_clock::now();
    switch (scenario) {
        case Scenario::kSignalWait:
            out.expected_addr = hex(sigs + 3);
            never_signalled_kernel<<<2, 64, 0, stream>>>(w.device_ctx(), sigs + 3);
            break;
        case Scenario::kTileWait: {
            std::vector<uint64_t> ones(kTileSignals, 1);
            ones[kMissingSignal] = 0;
            WEFT_CUDA_CHECK(cudaMemcpy(sigs, ones.data(), ones.size() * 8, cudaMemcpyHostToDevice));
            out.expected_addr = hex(sigs + kMissingSignal);
            tile_wait_kernel<<<1, 128, 0, stream>>>(w.device_ctx(), sigs);
            break;
        }
        case Scenario::kBarrier: {
            const DeviceCtx ctx = w.device_ctx();
            // "Rank 1" maps to the upper half of this heap: its arrivals land there, harmlessly,
            // and its own arrival here (psync[1]) never comes.
            const DeviceCtx fake = two_rank_ctx(ctx, ctx.heap_base + ctx.heap_bytes / 2, &table);
            out.expected_addr = hex(sigs + 1);
            barrier_kernel<<<1, 64, 0, stream>>>(fake, sigs);
            break;
        }
        case Scenario::kUnreachablePeer: {
            auto* buf = static_cast<uint8_t*>(heap.alloc(256));
            const DeviceCtx fake = two_rank_ctx(w.device_ctx(), nullptr, &table);
            out.expected_addr = hex(buf);
            unreachable_put_kernel<<<1, 64, 0, stream>>>(fake, buf, buf + 128);
            break;
        }
        case Scenario::kPartialWarpPut: {
            auto* buf = static_cast<uint8_t*>(heap.alloc(8192));
            out.expected_addr =
                "a Warp group needs a block of whole warps (a thread count that is a multiple of 32), "
                "this block has 48 threads";
            partial_warp_put_kernel<<<1, 48, 0, stream>>>(w.device_ctx(), buf, buf + 4096, sigs);
            break;
        }
    }
    try {
        test::finish(w, stream, "the provoking kernel");
    } catch (const std::exception& e) {
        out.message = e.what();
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (table != nullptr) cudaFree(table);
    return out;
}

// The error names the address, came after the timeout (waits) and well within a generous bound.
bool check_provoked(const Provoked& p, Scenario scenario) {
    std::fprintf(stderr, "error after %.3f s: %s\n", p.seconds, p.message.c_str());
    bool ok = true;
    if (p.message.empty()) {
        std::fprintf(stderr, "FAIL: no error was raised\n");
        ok = false;
    }
    if (p.message.find(p.expected_addr) == std::string::npos) {
        std::fprintf(stderr, "FAIL: the error does not name %s\n", p.expected_addr.c_str());
        ok = false;
    }
    const bool trap = scenario == Scenario::kUnreachablePeer || scenario == Scenario::kPartialWarpPut;
    if (!trap && p.seconds < 0.15) {
        std::fprintf(stderr, "FAIL: gave up after %.3f s, before the 0.2 s timeout\n", p.seconds);
        ok = false;
    }
    if (p.seconds > 30) {
        std::fprintf(stderr, "FAIL: the error took %.3f s (bound 30 s)\n", p.seconds);
        ok = false;
    }
    return ok;
}

WorldOptions short_timeout_options() {
    WorldOptions options = test::device_test_options();
    options.timeout = std::chrono::milliseconds(200);
    return options;
}

// Runs in the death-test child: provokes the trap, checks the error, exits.
[[noreturn]] void provoke_trap(Scenario scenario) {
    alarm(120);  // a hang ends the child with SIGALRM: the death test then fails instead of hanging
    Provoked p;
    try {
        run_local(1, [&](World& w) { p = provoke_in(w, scenario); }, short_timeout_options());
    } catch (const std::exception& e) {
        if (p.message.empty()) p.message = e.what();
    }
    const bool ok = check_provoked(p, scenario);
    if (ok) std::fprintf(stderr, "the error named %s\n", p.expected_addr.c_str());
    std::fflush(stderr);
    std::_Exit(ok ? 0 : 1);
}

class DeviceTimeoutDeathTest : public ::testing::Test {
protected:
    void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(DeviceTimeoutDeathTest, PutToUnreachablePeerFailsClearly) {
    EXPECT_EXIT(provoke_trap(Scenario::kUnreachablePeer), ::testing::ExitedWithCode(0), "the error named 0x");
}

// A Warp's put in a block that is not whole warps would leave the missing lanes' share uncopied and signal anyway:
// it is refused, naming the block's thread count.
TEST_F(DeviceTimeoutDeathTest, AWarpPutInABlockOfPartWarpsFailsClearly) {
    EXPECT_EXIT(provoke_trap(Scenario::kPartialWarpPut), ::testing::ExitedWithCode(0),
                "the error named a Warp group needs a block of whole warps");
}

// Writes `value` into out[threadIdx.x]: a kernel that runs only if the context is usable.
__global__ void fill_kernel(int* out, int value) { out[threadIdx.x] = value; }

void expect_context_and_world_usable(World& w, const char* after) {
    SCOPED_TRACE(after);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    test::RankStream stream;
    test::DeviceArray<int> out(64, stream);
    fill_kernel<<<1, 64, 0, stream>>>(out.get(), 7);
    EXPECT_NO_THROW(test::finish(w, stream, "fill_kernel after a failed wait"));
    for (int v : out.to_host()) ASSERT_EQ(v, 7);
}

// A wait that can never be satisfied ends its kernel cleanly (no trap): the error names the word, and after
// clear_diagnostics the same World and the same context run the next kernel; so does a fresh World.
TEST(DeviceTimeout, AWaitThatGivesUpEndsItsKernelAndTheContextStaysUsable) {
    for (Scenario scenario : {Scenario::kSignalWait, Scenario::kTileWait, Scenario::kBarrier}) {
        SCOPED_TRACE(static_cast<int>(scenario));
        test::run_world(1, [&](World& w) {
            const Provoked p = provoke_in(w, scenario);
            EXPECT_TRUE(check_provoked(p, scenario)) << p.message;
            EXPECT_EQ(p.message.find("trapped"), std::string::npos) << "a wait must not trap: " << p.message;
            EXPECT_TRUE(w.aborted());
            w.clear_diagnostics();
            EXPECT_FALSE(w.aborted());
            expect_context_and_world_usable(w, "the same World after clear_diagnostics");
        }, short_timeout_options());
        test::run_world(1, [&](World& w) { expect_context_and_world_usable(w, "a fresh World"); },
                        short_timeout_options());
    }
}

__global__ void notify_kernel(DeviceCtx ctx, uint64_t* sig, int pe) {
    if (threadIdx.x == 0) shmem::signal_op(Thread{}, ctx, sig, 1, device::SignalOp::kAdd, pe);
}

__global__ void wait_kernel(DeviceCtx ctx, const uint64_t* sig, uint64_t value) {
    shmem::signal_wait_until(Block{}, ctx, sig, Cmp::kGe, value);
}

// Two ranks: rank 0 notifies rank 1, which waits; checks the pair works (after an abort was cleared).
void round_trip(World& w, uint64_t* sig, uint64_t value, cudaStream_t stream) {
    if (w.rank() == 0) {
        notify_kernel<<<1, 32, 0, stream>>>(w.device_ctx(), sig, 1);
    } else {
        wait_kernel<<<1, 64, 0, stream>>>(w.device_ctx(), sig, value);
    }
    test::finish(w, stream, "the round trip");
}

// World::abort on one rank stops a wait on another within seconds, under a ten-minute timeout; every rank then
// reports the abort, clears it, and the next op of the same Worlds works.
TEST(DeviceAbort, WorldAbortStopsEveryRanksWaitsAndTheWorldRunsAgainOnceCleared) {
    WorldOptions options = test::device_test_options();
    options.timeout = std::chrono::minutes(10);  // the abort, not the bound, must end the wait
    options.heartbeat = std::chrono::milliseconds(200);
    test::run_world(2, [&](World& w) {
        test::RankStream stream;
        uint64_t* sigs = w.heap().alloc_signals(4);
        w.barrier();
        std::string message;
        double seconds = 0;
        if (w.rank() == 0) {
            const auto start = std::chrono::steady_clock::now();
            never_signalled_kernel<<<2, 64, 0, stream>>>(w.device_ctx(), sigs + 3);
            try {
                test::finish(w, stream, "the wait that rank 1 aborts");
            } catch (const std::exception& e) {
                message = e.what();
            }
            seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            EXPECT_NE(message.find("rank 1 called World::abort: the test aborts"), std::string::npos) << message;
            EXPECT_NE(message.find(hex(sigs + 3)), std::string::npos) << "the error names the signal: " << message;
            EXPECT_NE(message.find("stopped (the World was aborted)"), std::string::npos) << message;
            EXPECT_LT(seconds, 10.0) << message;
        } else {
            std::this_thread::sleep_for(std::chrono::milliseconds(500));
            w.abort("the test aborts");
            EXPECT_TRUE(w.aborted());
            try {
                w.check_diagnostics();
            } catch (const std::exception& e) {
                message = e.what();
            }
            EXPECT_NE(message.find("rank 1 called World::abort"), std::string::npos) << message;
        }
        // Every rank clears, meets, and runs a round trip on the same World.
        std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // the abort reached every rank
        w.clear_diagnostics();
        w.barrier();
        round_trip(w, sigs, 1, stream);
        w.barrier();
    }, options);
}

// A wait that gives up on one rank (its own short bound) aborts the World: the other rank's wait, under a ten-minute
// bound, ends within seconds and its error names the rank and the signal that gave up.
TEST(DeviceAbort, AWaitThatGivesUpOnOneRankStopsThePeersWaits) {
    WorldOptions options = test::device_test_options();
    options.timeout = std::chrono::minutes(10);
    options.heartbeat = std::chrono::milliseconds(200);
    test::run_world(2, [&](World& w) {
        test::RankStream stream;
        uint64_t* sigs = w.heap().alloc_signals(4);
        w.barrier();
        DeviceCtx ctx = w.device_ctx();
        if (w.rank() == 0) ctx.timeout_ns = 300'000'000ull;  // this rank's wait gives up first
        const auto start = std::chrono::steady_clock::now();
        never_signalled_kernel<<<1, 64, 0, stream>>>(ctx, sigs + w.rank());
        std::string message;
        try {
            test::finish(w, stream, "a wait that never completes");
        } catch (const std::exception& e) {
            message = e.what();
        }
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        EXPECT_LT(seconds, 15.0) << message;
        EXPECT_NE(message.find("timed out after"), std::string::npos) << "rank 0's record: " << message;
        if (w.rank() == 0) {
            EXPECT_NE(message.find(hex(sigs + 0)), std::string::npos) << "its signal: " << message;
        } else {
            EXPECT_NE(message.find("rank 0: a device wait gave up"), std::string::npos) << message;
            EXPECT_NE(message.find(hex(sigs + 1)), std::string::npos) << "its own wait: " << message;
        }
        EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    }, options);
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
            // On `stream`: a legacy-stream cudaMemset is not ordered before the kernel on this non-blocking stream.
            WEFT_CUDA_CHECK(cudaMemsetAsync(d_ok, 0x7f, 256 * sizeof(int), stream));
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

        // The same peer through peer_signal_checked: a null PeerSignal in every lane, recorded, no trap.
        m = run("peer_signal_checked_kernel",
                [&] { peer_signal_checked_kernel<<<1, 32, 0, stream>>>(fake, sigs, d_ok); });
        EXPECT_NE(m.find(hex(sigs)), std::string::npos) << m;
        EXPECT_NE(m.find("not load/store reachable"), std::string::npos) << m;
        EXPECT_EQ(m.find("trapped"), std::string::npos) << m;
        for (int t = 0; t < 32; ++t) ASSERT_EQ(ok[t], 0) << "lane " << t;
        WEFT_CUDA_CHECK(cudaMemcpy(&first, sigs, 8, cudaMemcpyDeviceToHost));
        EXPECT_EQ(first, 1u) << "a null PeerSignal raised a signal";
        cudaFree(table);

        // A negative count (an inverted range) is refused, and the whole block ends there: no Token for nothing
        // waited on.
        m = run("block_wait_kernel (n = -1)",
                [&] { block_wait_kernel<<<1, 128, 0, stream>>>(w.device_ctx(), sigs, -1, d_ok); });
        EXPECT_NE(m.find("tile::wait of -1 signals: the count must be >= 0"), std::string::npos) << m;
        EXPECT_EQ(m.find("trapped"), std::string::npos) << m;
        for (int t = 0; t < 128; ++t) ASSERT_NE(ok[t], 1) << "thread " << t << " went past a refused wait";

        // LL lines, the checked wait: lines 0..63 carry the flag (payload = the thread's index + 1), 64..127 never
        // come. Every thread returns, and the warpgroup meets at its barrier.
        constexpr uint32_t kFlag = 5;
        auto* lines = static_cast<uint8_t*>(w.heap().alloc(128 * device::ll::kLineBytes));
        std::vector<uint32_t> words(128 * 4, 0);
        for (uint32_t t = 0; t < 64; ++t) {
            words[4 * t] = t + 1;
            words[4 * t + 1] = kFlag;
            words[4 * t + 2] = 0;
            words[4 * t + 3] = kFlag;
        }
        WEFT_CUDA_CHECK(cudaMemcpy(lines, words.data(), words.size() * 4, cudaMemcpyHostToDevice));
        m = run("ll_wait_checked_kernel",
                [&] { ll_wait_checked_kernel<<<1, 128, 0, stream>>>(w.device_ctx(), lines, kFlag, d_ok); });
        EXPECT_NE(m.find("signal_wait"), std::string::npos) << m;
        EXPECT_EQ(m.find("trapped"), std::string::npos) << m;
        for (int t = 0; t < 128; ++t) ASSERT_EQ(ok[t], t < 64 ? t + 1 : -1) << "thread " << t;

        // Zero bytes at the heap's end: nothing refused, the signal delivered.
        WEFT_CUDA_CHECK(cudaMemset(sigs, 0, 8));
        m = run("zero_byte_put_kernel", [&] { zero_byte_put_kernel<<<1, 64, 0, stream>>>(w.device_ctx(), sigs); });
        EXPECT_EQ(m, "");
        WEFT_CUDA_CHECK(cudaMemcpy(&first, sigs, 8, cudaMemcpyDeviceToHost));
        EXPECT_EQ(first, 1u);
        cudaFree(d_ok);
    }, options);
}

}  // namespace
}  // namespace weft
