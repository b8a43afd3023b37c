// SPDX-License-Identifier: MIT
// Host state that ops keep per stream (scratch, work counters): the key that tells callers' streams apart, and the
// allocation such state grows by.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <thread>
#include <tuple>

namespace weft::ops::detail {

/// The current device, the stream, and for cudaStreamPerThread (one handle naming a different stream in every thread)
/// the calling thread. Two keys are equal when their launches are ordered on one stream.
struct StreamKey {
    int device = 0;
    cudaStream_t stream = nullptr;
    std::thread::id thread{};  // cudaStreamPerThread's calling thread; default otherwise

    static StreamKey of(cudaStream_t stream);
    bool operator<(const StreamKey& o) const {
        return std::tie(device, stream, thread) < std::tie(o.device, o.stream, o.thread);
    }
};

/// cudaMalloc in relaxed capture mode for the call: another thread's capture in global mode (PyTorch's default) does
/// not forbid it, and the allocation does not invalidate that capture. `zeroed`: also zeroed before it returns, on a
/// private stream the host waits for (so that no capture in progress records the zeroing). Throws weft::Error when
/// it fails.
void* malloc_beside_captures(size_t bytes, bool zeroed = false);

}  // namespace weft::ops::detail
