// SPDX-License-Identifier: MIT
// The skeleton of a weft_dist_tests fault test: rank 0 calls an op whose peers made it and never call it. Rank 0's call
// must fail within the bound with a wait that gave up, its stream must complete and the CUDA context stay usable.
// Such a test leaves diagnostics in the World, so it runs alone, under WEFT_TEST_FAULTS=1.
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

#include "weft/weft.hpp"

namespace weft::test {

/// Whether WEFT_TEST_FAULTS=1 asks for the fault tests.
inline bool fault_tests_enabled() {
    const char* faults = std::getenv("WEFT_TEST_FAULTS");
    return faults != nullptr && std::string(faults) == "1";
}

/// Makes the op on every rank (`make(world)`, every rank's constructor runs), calls it on rank 0 only
/// (`call(op, stream)`) while the others sleep past rank 0's failure, then checks on rank 0 that the call failed with
/// a wait that gave up, within three bounds, that `stream` drains and the context is usable. `buf` is a device buffer
/// of at least 4 KiB the check writes to. Returns rank 0's error text (empty on the other ranks).
template <class Make, class Call>
std::string expect_call_fails_when_peers_never_call(World& w, cudaStream_t stream, void* buf, Make make, Call call) {
    std::string error;
    const auto start = std::chrono::steady_clock::now();
    {
        auto op = make(w);
        if (w.rank() == 0) {
            try {
                call(op, stream);
                w.sync_and_check(stream);
            } catch (const std::exception& e) {
                error = e.what();
            }
        } else {
            // Past rank 0's failure (about one timeout) before the destructor's team barrier (bounded by one too).
            std::this_thread::sleep_for(w.timeout() * 3 / 2);
        }
    }
    const auto took = std::chrono::steady_clock::now() - start;
    if (w.rank() == 0) {
        EXPECT_FALSE(error.empty()) << "rank 0's call did not fail";
        // A bounded wait that gave up: a timeout diagnosis, not some unrelated error.
        EXPECT_TRUE(error.find("timed out") != std::string::npos || error.find("gave up") != std::string::npos)
            << error;
        EXPECT_LT(took, 3 * w.timeout() + std::chrono::seconds(30)) << "the failure took too long";
        // The caller's stream completed (no copy stream it joins is held by an unbounded wait), and no trap.
        EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        EXPECT_EQ(cudaMemsetAsync(buf, 0, 4096, stream), cudaSuccess);
        EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "no trap: the context stays usable";
        std::printf("[ FAULT    ] rank 0: %s\n", error.c_str());
    }
    return error;
}

}  // namespace weft::test
