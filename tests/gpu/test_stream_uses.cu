// SPDX-License-Identifier: MIT
// GPU tests that an op's release waits for its own work only: StreamUses::wait_all returns while a kernel on another
// stream still spins, and waits for a kernel on a noted stream; the host-mapped pool hands out status words while a
// kernel spins (cudaHostAlloc would wait for it). The spinning kernel reads a host-mapped flag and gives up after a
// bound, so a failing test ends instead of hanging.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <thread>

#include <cuda_runtime_api.h>

#include "weft/detail/host_mapped_pool.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/stream.hpp"

namespace weft {
namespace {

// Spins until *flag != 0 or about `bound_ns` have passed; writes 1 (released) or 2 (gave up) to *outcome.
__global__ void spin_on_flag(const volatile uint32_t* flag, uint32_t* outcome, uint64_t bound_ns) {
    uint64_t start = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
        if (*flag != 0) {
            *outcome = 1;
            return;
        }
        uint64_t now = 0;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > bound_ns) {
            *outcome = 2;
            return;
        }
        __nanosleep(1000);
    }
}

__global__ void write_word(uint32_t* p, uint32_t v) { *p = v; }

struct Spinner {
    cudaStream_t stream = nullptr;
    detail::HostMappedBlock flag, outcome;
    Spinner() {
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        flag = detail::host_mapped_alloc(4);
        outcome = detail::host_mapped_alloc(4);
    }
    ~Spinner() {
        release();
        cudaStreamSynchronize(stream);
        cudaStreamDestroy(stream);
        detail::host_mapped_free(flag.host);
        detail::host_mapped_free(outcome.host);
    }
    void start(uint64_t bound_ns) {
        spin_on_flag<<<1, 1, 0, stream>>>(static_cast<const uint32_t*>(flag.device),
                                          static_cast<uint32_t*>(outcome.device), bound_ns);
        WEFT_CUDA_CHECK(cudaGetLastError());
    }
    void release() { *static_cast<volatile uint32_t*>(flag.host) = 1; }
    uint32_t result() const { return *static_cast<volatile uint32_t*>(outcome.host); }
};

constexpr uint64_t kBoundNs = 10'000'000'000ull;  // 10 s: far longer than any step below should take

TEST(StreamUses, WaitsForNotedStreamsOnlyNotForTheWholeDevice) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    detail::host_mapped_reserve();
    Spinner other;
    other.start(kBoundNs);
    cudaStream_t mine = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&mine, cudaStreamNonBlocking));
    const detail::HostMappedBlock word = detail::host_mapped_alloc(4);  // from the pool: no wait for the spinner
    StreamUses uses;
    write_word<<<1, 1, 0, mine>>>(static_cast<uint32_t*>(word.device), 7u);
    uses.note(mine);
    const auto t0 = std::chrono::steady_clock::now();
    uses.wait_all();
    const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(*static_cast<volatile uint32_t*>(word.host), 7u) << "wait_all returned before the noted kernel ended";
    EXPECT_EQ(other.result(), 0u) << "the other stream's kernel ended before it was released";
    EXPECT_LT(waited_s, 2.0) << "wait_all waited for a kernel on a stream it never noted";
    other.release();
    WEFT_CUDA_CHECK(cudaStreamSynchronize(other.stream));
    EXPECT_EQ(other.result(), 1u);
    detail::host_mapped_free(word.host);
    WEFT_CUDA_CHECK(cudaStreamDestroy(mine));
}

TEST(StreamUses, WaitsForTheLatestWorkOnANotedStream) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    Spinner s;
    StreamUses uses;
    s.start(kBoundNs);
    uses.note(s.stream);
    std::thread releaser([&s] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        s.release();
    });
    const auto t0 = std::chrono::steady_clock::now();
    uses.wait_all();
    const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    releaser.join();
    EXPECT_EQ(s.result(), 1u) << "wait_all returned before the noted kernel ended";
    EXPECT_GE(waited_s, 0.2);
}

TEST(HostMappedPool, BlocksAreZeroedDistinctAndBounded) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    detail::HostMappedBlock a = detail::host_mapped_alloc(detail::kHostMappedBlockBytes);
    static_cast<char*>(a.host)[5] = 9;
    detail::host_mapped_free(a.host);
    detail::HostMappedBlock b = detail::host_mapped_alloc(16);
    detail::HostMappedBlock c = detail::host_mapped_alloc(16);
    EXPECT_NE(b.host, c.host);
    for (const detail::HostMappedBlock* blk : {&b, &c}) {
        for (size_t i = 0; i < detail::kHostMappedBlockBytes; ++i) {
            ASSERT_EQ(static_cast<const char*>(blk->host)[i], 0) << "byte " << i << " of a fresh block";
        }
    }
    EXPECT_THROW(detail::host_mapped_alloc(detail::kHostMappedBlockBytes + 1), Error);
    EXPECT_THROW(detail::host_mapped_alloc(0), Error);
    detail::host_mapped_free(b.host);
    detail::host_mapped_free(c.host);
}

}  // namespace
}  // namespace weft
