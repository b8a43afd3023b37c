// SPDX-License-Identifier: MIT
// Stream helpers: 32/64-bit value writes and waits on a CUDA stream (copy-engine signalling), and events.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace weft {

/// Enqueues a write of `value` to `addr` (device, host-mapped or peer-mapped memory, 4-byte aligned) on
/// `stream`, ordered after the work already enqueued there (cuStreamWriteValue32). Use it after a
/// cudaMemcpyAsync to raise a flag that consumers acquire at .sys scope.
void stream_write_u32(cudaStream_t stream, uint32_t* addr, uint32_t value);
/// As stream_write_u32 for a 64-bit word (8-byte aligned; cuStreamWriteValue64).
void stream_write_u64(cudaStream_t stream, uint64_t* addr, uint64_t value);
/// Makes `stream` wait until the 32-bit word at `addr` is >= `value` (cuStreamWaitValue32, GEQ).
/// NOTE: the driver does not bound this wait: use it only where the writer is already enqueued;
/// kernels use bounded waits instead.
void stream_wait_u32_geq(cudaStream_t stream, uint32_t* addr, uint32_t value);
/// Makes `stream` wait until the 64-bit word at `addr` is >= `value` (cuStreamWaitValue64, GEQ); same caveat.
void stream_wait_u64_geq(cudaStream_t stream, uint64_t* addr, uint64_t value);

/// For its lifetime, the calling thread in relaxed stream-capture mode (then back to its own mode): the calls a global
/// or thread-local capture forbids (cudaMalloc, cudaEventQuery, synchronising a stream that is not captured,
/// cudaPointerGetAttributes) neither fail nor invalidate a capture that another stream of this thread, or in global
/// mode (PyTorch's default) another thread, is making.
class RelaxedCaptureMode {
public:
    RelaxedCaptureMode();
    ~RelaxedCaptureMode();
    RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
    RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

private:
    cudaStreamCaptureMode previous_ = cudaStreamCaptureModeRelaxed;
    bool exchanged_ = false;
};

/// A CUDA event, destroyed with its owner. Created on the current device.
class Event {
public:
    /// `timing`: whether elapsed_ms may be used (timing events are slower to record).
    explicit Event(bool timing = false);
    ~Event();
    Event(Event&& other) noexcept;
    Event& operator=(Event&& other) noexcept;
    Event(const Event&) = delete;
    Event& operator=(const Event&) = delete;

    void record(cudaStream_t stream);
    /// Makes `stream` wait for the work captured by the last record().
    void wait(cudaStream_t stream) const;
    void synchronize() const;
    /// True when the recorded work has finished (never blocks).
    bool query() const;
    /// Milliseconds from `start` to this event (both timing events, both recorded and finished).
    float elapsed_ms(const Event& start) const;
    cudaEvent_t get() const { return event_; }

private:
    cudaEvent_t event_ = nullptr;
};

/// The streams an object (an op, an EP buffer) launched work on, each with an event recorded after its latest
/// launch there. Before such an object frees memory its kernels use, it waits here for its own work only:
/// cudaDeviceSynchronize would also wait for every other kernel on the GPU, e.g. another team's kernels that spin
/// on a member which is itself held up behind this wait.
/// Not thread-safe (one owner, like the op). Launches made while the stream is captured are not noted: a graph
/// that uses the object must not outlive it (the graph's replays are the caller's to synchronise).
class StreamUses {
public:
    /// Records `stream`'s latest work (call right after enqueueing on it).
    void note(cudaStream_t stream);
    /// Waits until everything noted has finished; errors are logged, not thrown (destructors call it).
    void wait_all() noexcept;

private:
    std::vector<std::pair<cudaStream_t, Event>> uses_;
};

}  // namespace weft
