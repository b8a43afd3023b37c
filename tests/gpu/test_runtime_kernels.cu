// SPDX-License-Identifier: MIT
// GPU tests of what kernels see: peer tables in DeviceCtx (world and team), and the diagnostics path
// (a record written through ctx.diag, with and without a trap).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "support/runtime_checks.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

using test::run_ranks;
using test::test_options;

// Writes slot ctx.rank of every team peer's buffer at `offset` in its heap (world ranks in the pattern).
__global__ void put_pattern_kernel(DeviceCtx ctx, uint64_t offset, uint64_t count) {
    const int src = ctx.world_rank;
    for (int d = 0; d < ctx.num_ranks; ++d) {
        if (ctx.peer_bases[d] == nullptr) continue;
        const int dst = ctx.team_to_world != nullptr ? ctx.team_to_world[d] : d;
        uint32_t* slot =
            reinterpret_cast<uint32_t*>(ctx.peer_bases[d] + offset) + static_cast<uint64_t>(ctx.rank) * count;
        for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
            slot[i] = test::exchange_pattern(src, dst, i);
        }
    }
}

// Leaves a diagnostic record as a timed-out spin would (block 3, thread 0), then traps if asked.
__global__ void fake_timeout_kernel(DeviceCtx ctx, const uint64_t* signal, bool trap) {
    if (blockIdx.x != 3 || threadIdx.x != 0) return;
    Diagnostic* d = ctx.diag;
    if (atomicCAS(&d->claimed, 0u, 1u) == 0u) {
        d->kind = SpinKind::kSignalWait;
        d->cmp = Cmp::kGe;
        d->rank = ctx.world_rank;
        d->block_x = static_cast<int32_t>(blockIdx.x);
        d->block_y = static_cast<int32_t>(blockIdx.y);
        d->block_z = static_cast<int32_t>(blockIdx.z);
        d->thread_x = static_cast<int32_t>(threadIdx.x);
        d->signal_addr = reinterpret_cast<uint64_t>(signal);
        d->expected = 5;
        d->observed = *reinterpret_cast<const volatile uint64_t*>(signal);
        d->waited_ns = 10000000000ull;
        d->peer = 2;
        d->line = 0;
        __threadfence_system();
        atomicExch(&d->claimed, 2u);
    }
    if (trap) __trap();
}

class RuntimeKernels : public ::testing::Test {
protected:
    void SetUp() override { ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU"; }
};

// Kernel stores through ctx.peer_bases of `team`; every member checks its slots.
void exchange_by_kernel(World& w, const Team& team, uint64_t count) {
    SymmetricHeap& heap = w.heap();
    const int n = team.num_ranks();
    // Collective over the world, sized for the largest team.
    auto* buf = heap.alloc_array<uint32_t>(count * static_cast<uint64_t>(w.num_ranks()));
    WEFT_CUDA_CHECK(cudaMemset(buf, 0xCD, count * 4 * static_cast<uint64_t>(w.num_ranks())));
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    w.barrier();
    if (team.is_member()) {
        put_pattern_kernel<<<8, 128>>>(team.device_ctx(), heap.offset_of(buf), count);
        WEFT_CUDA_CHECK(cudaGetLastError());
    }
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    w.barrier();
    if (team.is_member()) {
        std::vector<uint32_t> in(count * static_cast<uint64_t>(n));
        WEFT_CUDA_CHECK(cudaMemcpy(in.data(), buf, in.size() * 4, cudaMemcpyDeviceToHost));
        for (int t = 0; t < n; ++t) {
            const int src = team.world_rank(t);
            for (uint64_t i = 0; i < count; ++i) {
                const uint32_t got = in[static_cast<uint64_t>(t) * count + i];
                WEFT_CHECK(got == test::exchange_pattern(src, w.rank(), i),
                           "rank " << w.rank() << ": element " << i << " from team rank " << t << " (world " << src
                                   << ") is " << got << ", expected " << test::exchange_pattern(src, w.rank(), i));
            }
        }
    }
    w.barrier();
    heap.free(buf);
}

TEST_F(RuntimeKernels, KernelStoresThroughWorldPeerTable) {
    for (int n : {1, 2, 3, 4, 8}) {
        SCOPED_TRACE("num_ranks " + std::to_string(n));
        run_ranks(n, [](World& w) { exchange_by_kernel(w, w.team(), 4096 + 5); });
    }
}

TEST_F(RuntimeKernels, KernelStoresThroughTeamPeerTable) {
    run_ranks(5, [](World& w) {
        exchange_by_kernel(w, w.team().split_strided(1, 2, 2), 1000);              // world ranks 1, 3
        exchange_by_kernel(w, w.team().split_color(w.rank() % 2, w.rank()), 777);  // evens, odds
    });
}

TEST_F(RuntimeKernels, DiagnosticRecordBecomesAnError) {
    run_ranks(2, [](World& w) {
        uint64_t* signal = w.heap().alloc_signals(1);
        WEFT_CUDA_CHECK(cudaMemset(signal, 0, 8));
        const uint64_t four = 4;
        WEFT_CUDA_CHECK(cudaMemcpy(signal, &four, 8, cudaMemcpyHostToDevice));
        if (w.rank() == 1) {
            fake_timeout_kernel<<<4, 32>>>(w.device_ctx(), signal, /*trap=*/false);
            WEFT_CUDA_CHECK(cudaGetLastError());
        }
        std::string message;
        try {
            w.sync_and_check(nullptr);
        } catch (const Error& e) {
            message = e.what();
        }
        char address[32];
        std::snprintf(address, sizeof(address), "0x%llx",
                      static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(signal)));
        if (w.rank() == 1) {
            const std::string expected = std::string("rank 1 block (3,0,0) thread 0 timed out after 10000 ms in ") +
                                         "signal_wait (GE) on signal " + address +
                                         " owned by rank 2: expected >= 5, observed 4";
            WEFT_CHECK(message.find(expected) != std::string::npos,
                       "got '" << message << "', expected '" << expected << "'");
            w.clear_diagnostics();
            w.check_diagnostics();  // cleared: no error
        } else {
            WEFT_CHECK(message.empty(), "rank 0 wrote no record but got '" << message << "'");
        }
        w.barrier();
        w.heap().free(signal);
    });
}

// A trap leaves the CUDA context unusable, so it runs in a child process (gtest re-runs this binary).
TEST_F(RuntimeKernels, TrapAfterTimeoutIsDiagnosed) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    EXPECT_EXIT(
        {
            try {
                run_local(
                    1,
                    [](World& w) {
                        uint64_t* signal = w.heap().alloc_signals(1);
                        fake_timeout_kernel<<<4, 32>>>(w.device_ctx(), signal, /*trap=*/true);
                        w.sync_and_check(nullptr);
                    },
                    test_options());
            } catch (const Error& e) {
                std::fprintf(stderr, "%s\n", e.what());
                std::fflush(stderr);
                std::_Exit(0);
            }
            std::_Exit(1);
        },
        ::testing::ExitedWithCode(0),
        "rank 0 block \\(3,0,0\\) thread 0 timed out after 10000 ms in signal_wait \\(GE\\) on signal 0x[0-9a-f]+ "
        "owned by rank 2: expected >= 5, observed 0; the kernel then trapped: cudaStreamSynchronize returned "
        "cudaError");
}

}  // namespace
}  // namespace weft
