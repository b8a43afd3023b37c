// SPDX-License-Identifier: MIT
// GPU tests of the runtime with ranks as threads: heap exchange through symm_at, collective alloc/free,
// mismatches, signals, DeviceCtx, teams, stream helpers, run_local failures.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "gpu/runtime_test_util.hpp"
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

// Every rank writes exchange_pattern(src, dst, i) into slot `src` of every peer's buffer with cudaMemcpy to
// the peer address from symm_at, then checks what it received from every peer.
void exchange_through_host(World& w, uint64_t count) {
    const int n = w.num_ranks();
    const int me = w.rank();
    SymmetricHeap& heap = w.heap();
    auto* buf = heap.alloc_array<uint32_t>(count * static_cast<uint64_t>(n));
    const size_t slot_bytes = count * sizeof(uint32_t);
    WEFT_CUDA_CHECK(cudaMemset(buf, 0xAB, slot_bytes * static_cast<size_t>(n)));  // poison
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    w.barrier();  // nobody writes into a buffer before its owner poisoned it
    std::vector<uint32_t> out(count);
    for (int d = 0; d < n; ++d) {
        for (uint64_t i = 0; i < count; ++i) out[i] = test::exchange_pattern(me, d, i);
        void* dst = heap.symm_at(buf + static_cast<uint64_t>(me) * count, d);
        WEFT_CHECK(dst != nullptr, "rank " << me << ": symm_at gave nullptr for rank " << d << " (same process)");
        WEFT_CUDA_CHECK(cudaMemcpy(dst, out.data(), slot_bytes, cudaMemcpyHostToDevice));
    }
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    w.barrier();
    std::vector<uint32_t> in(count * static_cast<uint64_t>(n));
    WEFT_CUDA_CHECK(cudaMemcpy(in.data(), buf, in.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
    for (int s = 0; s < n; ++s) {
        uint64_t bad = 0, first_bad = 0;
        for (uint64_t i = 0; i < count; ++i) {
            if (in[static_cast<uint64_t>(s) * count + i] != test::exchange_pattern(s, me, i) && bad++ == 0) first_bad = i;
        }
        WEFT_CHECK(bad == 0, "rank " << me << ": " << bad << " of " << count << " elements from rank " << s
                                     << " are wrong; first at " << first_bad << ": got "
                                     << in[static_cast<uint64_t>(s) * count + first_bad] << ", expected "
                                     << test::exchange_pattern(s, me, first_bad));
    }
    w.barrier();  // everyone has verified before the buffer is freed and reused
    heap.free(buf);
}

TEST_F(RuntimeGpu, PatternExchangeThroughSymmAt) {
    for (int n : {1, 2, 3, 4, 8}) {
        SCOPED_TRACE("num_ranks " + std::to_string(n));
        run_ranks(n, [](World& w) {
            exchange_through_host(w, 1000 + 37);     // awkward size
            exchange_through_host(w, (1 << 18) + 3);  // ~1 MiB per slot
        });
    }
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
    run_ranks(2, [&](World& w) {
        WEFT_CHECK(w.sm_budget() == 5, "sm_budget option ignored: " << w.sm_budget());
        WEFT_CHECK(w.device() == devices - 1, "device option ignored: " << w.device());
        WEFT_CHECK(w.num_ranks_on_device() == 2, "both ranks are on one device");
    }, options);
}

TEST_F(RuntimeGpu, RepeatedAllocFreeGivesIdenticalOffsets) {
    const uint32_t seed = std::random_device{}();
    SCOPED_TRACE("seed " + std::to_string(seed));
    for (int n : {2, 3}) {
        run_ranks(n, [&](World& w) {
            std::mt19937 rng(seed);  // the same call sequence on every rank
            SymmetricHeap& heap = w.heap();
            std::vector<uint8_t*> live;
            std::vector<uint64_t> offsets;
            for (int step = 0; step < 300; ++step) {
                if (!live.empty() && rng() % 100 < 45) {
                    const size_t k = rng() % live.size();
                    heap.free(live[k]);
                    live.erase(live.begin() + static_cast<long>(k));
                } else {
                    const uint64_t bytes = 1 + rng() % (rng() % 5 == 0 ? (4u << 20) : 5000u);
                    const uint64_t align = 1ull << (rng() % 13);
                    auto* p = static_cast<uint8_t*>(heap.alloc(bytes, align));
                    WEFT_CHECK(reinterpret_cast<uintptr_t>(p) % align == 0, "misaligned allocation");
                    WEFT_CHECK(heap.contains(p, bytes), "allocation outside the heap");
                    live.push_back(p);
                    offsets.push_back(heap.offset_of(p));
                }
            }
            for (auto* p : live) heap.free(p);
            WEFT_CHECK(heap.bytes_in_use() == 0, "bytes in use after freeing everything: " << heap.bytes_in_use());
            // Compare the whole offset history across ranks.
            Bytes mine(offsets.size() * 8);
            std::memcpy(mine.data(), offsets.data(), mine.size());
            auto all = w.store().all_gather("test/offsets", w.rank(), w.num_ranks(), mine, w.timeout());
            for (int r = 0; r < w.num_ranks(); ++r) {
                WEFT_CHECK(all[static_cast<size_t>(r)] == mine, "rank " << r << "'s offsets differ from rank " << w.rank());
            }
        });
    }
}

TEST_F(RuntimeGpu, MismatchedAllocationIsAnErrorOnEveryRank) {
    for (int n : {2, 3, 4}) {
        std::mutex mutex;
        std::vector<std::string> messages(static_cast<size_t>(n));
        run_ranks(n, [&](World& w) {
            const uint64_t bytes = w.rank() == n - 1 ? 8192 : 4096;
            std::string message;
            try {
                w.heap().alloc(bytes);
            } catch (const Error& e) {
                message = e.what();
            }
            {
                std::lock_guard<std::mutex> lock(mutex);
                messages[static_cast<size_t>(w.rank())] = message;
            }
            // The heap stays consistent: matching calls work afterwards, at the same offset everywhere.
            void* p = w.heap().alloc(4096);
            WEFT_CHECK(w.heap().offset_of(p) == 0, "offset after a mismatch: " << w.heap().offset_of(p));
            // Alignment mismatch and alloc/free mismatch are caught too.
            bool align_caught = false;
            try {
                w.heap().alloc(4096, w.rank() == 0 ? 512 : 256);
            } catch (const Error& e) {
                align_caught = std::string(e.what()).find("align 512") != std::string::npos;
            }
            WEFT_CHECK(align_caught, "alignment mismatch not reported on rank " << w.rank());
            bool kind_caught = false;
            try {
                if (w.rank() == 0) {
                    w.heap().free(p);
                } else {
                    w.heap().alloc(64);
                }
            } catch (const Error& e) {
                kind_caught = std::string(e.what()).find("rank 0 asked free(offset 0)") != std::string::npos;
            }
            WEFT_CHECK(kind_caught, "alloc/free mismatch not reported on rank " << w.rank());
            w.heap().free(p);
        });
        const std::string others = n == 2 ? "rank 0" : (n == 3 ? "ranks 0, 1" : "ranks 0, 1, 2");
        for (int r = 0; r < n; ++r) {
            const std::string& m = messages[static_cast<size_t>(r)];
            EXPECT_NE(m.find("symmetric heap call #1 differs across ranks"), std::string::npos) << "rank " << r << ": " << m;
            EXPECT_NE(m.find(others + " asked alloc(4096 bytes, align 256)"), std::string::npos) << "rank " << r << ": " << m;
            EXPECT_NE(m.find("rank " + std::to_string(n - 1) + " asked alloc(8192 bytes, align 256)"), std::string::npos)
                << "rank " << r << ": " << m;
        }
    }
}

TEST_F(RuntimeGpu, AllocSignalsAreZeroed) {
    run_ranks(3, [](World& w) {
        SymmetricHeap& heap = w.heap();
        void* dirty = heap.alloc(1 << 16);
        WEFT_CUDA_CHECK(cudaMemset(dirty, 0xFF, 1 << 16));
        WEFT_CUDA_CHECK(cudaDeviceSynchronize());
        heap.free(dirty);
        uint64_t* signals = heap.alloc_signals(777);
        WEFT_CHECK(static_cast<void*>(signals) == dirty, "first fit should reuse the dirty block");
        std::vector<uint64_t> host(777, 1);
        WEFT_CUDA_CHECK(cudaMemcpy(host.data(), signals, host.size() * 8, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < host.size(); ++i) WEFT_CHECK(host[i] == 0, "signal " << i << " is " << host[i]);
        heap.free(signals);
    });
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
        WEFT_CHECK(heap.contains(p, 128) && !heap.contains(p, heap.bytes()), "contains");
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
            WEFT_CHECK(peers[static_cast<size_t>(t)] == w.heap().peer_bases()[static_cast<size_t>(expected[static_cast<size_t>(t)])],
                       "team peer table");
        }
        bool not_member = false;
        try {
            if (!even.is_member()) even.device_ctx();
            else not_member = true;
        } catch (const Error&) {
            not_member = true;
        }
        WEFT_CHECK(not_member, "device_ctx of a team this rank is not in should throw");
    });
}

TEST_F(RuntimeGpu, StreamWritesReachPeersAndWaitsRelease) {
    run_ranks(3, [](World& w) {
        SymmetricHeap& heap = w.heap();
        uint64_t* signals = heap.alloc_signals(static_cast<uint64_t>(w.num_ranks()));
        uint32_t* words = heap.alloc_array<uint32_t>(static_cast<uint64_t>(w.num_ranks()));
        cudaStream_t stream = nullptr;
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        for (int d = 0; d < w.num_ranks(); ++d) {
            stream_write_u64(stream, heap.symm_at(signals + w.rank(), d), 1000ull + static_cast<uint64_t>(w.rank()));
            stream_write_u32(stream, heap.symm_at(words + w.rank(), d), 77u + static_cast<uint32_t>(w.rank()));
        }
        WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
        w.barrier();
        // Every peer's write has landed: waits on them pass at once.
        for (int s = 0; s < w.num_ranks(); ++s) {
            stream_wait_u64_geq(stream, signals + s, 1000ull + static_cast<uint64_t>(s));
            stream_wait_u32_geq(stream, words + s, 77u + static_cast<uint32_t>(s));
        }
        Event done(/*timing=*/true), start(/*timing=*/true);
        start.record(stream);
        done.record(stream);
        done.synchronize();
        WEFT_CHECK(done.query() && done.elapsed_ms(start) >= 0.0f, "event");
        std::vector<uint64_t> got(static_cast<size_t>(w.num_ranks()));
        WEFT_CUDA_CHECK(cudaMemcpy(got.data(), signals, got.size() * 8, cudaMemcpyDeviceToHost));
        for (int s = 0; s < w.num_ranks(); ++s) {
            WEFT_CHECK(got[static_cast<size_t>(s)] == 1000ull + static_cast<uint64_t>(s), "signal from rank " << s);
        }
        bool misaligned = false;
        try {
            stream_write_u64(stream, reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(signals) + 4), 1);
        } catch (const Error&) {
            misaligned = true;
        }
        WEFT_CHECK(misaligned, "a misaligned stream write was accepted");
        WEFT_CUDA_CHECK(cudaStreamDestroy(stream));
        w.barrier();
        heap.free(words);
        heap.free(signals);
    });
}

TEST_F(RuntimeGpu, RunLocalNamesTheFirstFailingRankQuickly) {
    const auto start = std::chrono::steady_clock::now();
    std::string message;
    try {
        run_local(4, [](World& w) {
            if (w.rank() == 2) WEFT_FAIL("rank two gives up");
            w.barrier();  // the others wait for rank 2 here; the aborted store releases them
        }, test_options());
    } catch (const Error& e) {
        message = e.what();
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    EXPECT_NE(message.find("run_local: rank 2 failed first: rank two gives up"), std::string::npos) << message;
    EXPECT_NE(message.find("(then ranks 0, 1, 3 failed too)"), std::string::npos) << message;
    EXPECT_LT(waited, std::chrono::seconds(20)) << "the other ranks waited for their timeout";
    // The GPU and the process are still usable afterwards.
    run_ranks(2, [](World& w) { exchange_through_host(w, 4099); });
}

TEST_F(RuntimeGpu, BadOptionsAreRejected) {
    auto message_of = [](const WorldOptions& options) {
        try {
            run_local(2, [](World&) {}, options);
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
