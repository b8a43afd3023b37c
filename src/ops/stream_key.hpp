// SPDX-License-Identifier: MIT
// Host state that ops keep per stream (scratch, work counters): the key that tells callers' streams apart, and the
// allocation such state grows by.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <tuple>

namespace weft::ops::detail {

/// The current device and the stream's id (cudaStreamGetId: unique while the process lives, so a destroyed stream's
/// handle given to a new stream is another key, and cudaStreamPerThread is each thread's own stream). Two keys are
/// equal when their launches are ordered on one stream. State kept per key is not freed with the stream: a program
/// that makes a stream per call should pass the ops their workspace.
///
/// A stream being captured has no id to ask for (cudaStreamGetId fails on it and invalidates the capture): it gets
/// the id its handle had at the last call outside a capture (cudaStreamPerThread: this thread's), so that a captured
/// call finds the state its uncaptured calls on that stream made (a handle freed and given to a new stream that is
/// captured before any uncaptured call shares the old stream's state); a stream never seen outside a capture gets a
/// key of its handle (`captured`), the same for every capture on it (the branches of one capture: their own).
struct StreamKey {
    int device = 0;
    unsigned long long stream_id = 0;
    bool captured = false;          ///< a stream seen only under capture: keyed by `handle`, stream_id 0
    cudaStream_t handle = nullptr;  ///< captured keys only: the stream's handle

    static StreamKey of(cudaStream_t stream);
    bool operator<(const StreamKey& o) const {
        return std::tie(device, stream_id, captured, handle) < std::tie(o.device, o.stream_id, o.captured, o.handle);
    }
};

/// cudaMalloc in relaxed capture mode for the call: another thread's capture in global mode (PyTorch's default) does
/// not forbid it, and the allocation does not invalidate that capture. `zeroed`: also zeroed before it returns, on a
/// private stream the host waits for (so that no capture in progress records the zeroing). Throws weft::Error when
/// it fails.
void* malloc_beside_captures(size_t bytes, bool zeroed = false);

}  // namespace weft::ops::detail
