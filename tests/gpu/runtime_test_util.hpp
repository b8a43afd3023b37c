// SPDX-License-Identifier: MIT
// Helpers shared by the runtime's GPU tests (host .cpp and .cu): the exchange pattern and a run_local wrapper.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#ifdef __CUDACC__
#define WEFT_TEST_HD __host__ __device__
#else
#define WEFT_TEST_HD
#endif

namespace weft::test {

/// The value rank `src` writes at element i of its slot in rank `dst`'s buffer (world ranks).
WEFT_TEST_HD inline uint32_t exchange_pattern(int src, int dst, uint64_t i) {
    return static_cast<uint32_t>(src) * 1000003u + static_cast<uint32_t>(dst) * 7919u + static_cast<uint32_t>(i);
}

}  // namespace weft::test

#include <gtest/gtest.h>

#include <chrono>

#include "weft/runtime/error.hpp"
#include "weft/runtime/world.hpp"

namespace weft::test {

/// Small heaps (8 ranks may share one GPU) and a generous timeout.
inline WorldOptions test_options(uint64_t heap_bytes = 64ull << 20) {
    WorldOptions o;
    o.heap_bytes = heap_bytes;
    o.timeout = std::chrono::milliseconds(30000);
    return o;
}

/// run_local that turns a weft::Error into a test failure with the message.
inline void run_ranks(int num_ranks, const std::function<void(World&)>& fn, const WorldOptions& options = test_options()) {
    try {
        run_local(num_ranks, fn, options);
    } catch (const std::exception& e) {
        ADD_FAILURE() << "run_local(" << num_ranks << ") failed: " << e.what();
    }
}

}  // namespace weft::test
