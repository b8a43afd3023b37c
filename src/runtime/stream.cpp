// SPDX-License-Identifier: MIT
// Stream value writes/waits through the driver table, and the Event wrapper.
#include "weft/runtime/stream.hpp"

#include <utility>

#include "weft/runtime/driver.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"

namespace weft {

namespace {
void check_address(const char* fn, const void* addr, uintptr_t align) {
    WEFT_CHECK(addr != nullptr, fn << ": addr must not be null");
    WEFT_CHECK(reinterpret_cast<uintptr_t>(addr) % align == 0,
               fn << ": addr must be " << align << "-byte aligned, got " << addr);
}
CUstream cu(cudaStream_t stream) { return reinterpret_cast<CUstream>(stream); }
CUdeviceptr cu(const void* addr) { return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(addr)); }
}  // namespace

void stream_write_u32(cudaStream_t stream, uint32_t* addr, uint32_t value) {
    check_address("stream_write_u32", addr, 4);
    WEFT_CU_CHECK(driver().cuStreamWriteValue32(cu(stream), cu(addr), value, CU_STREAM_WRITE_VALUE_DEFAULT));
}

void stream_write_u64(cudaStream_t stream, uint64_t* addr, uint64_t value) {
    check_address("stream_write_u64", addr, 8);
    WEFT_CU_CHECK(driver().cuStreamWriteValue64(cu(stream), cu(addr), value, CU_STREAM_WRITE_VALUE_DEFAULT));
}

void stream_wait_u32_geq(cudaStream_t stream, uint32_t* addr, uint32_t value) {
    check_address("stream_wait_u32_geq", addr, 4);
    WEFT_CU_CHECK(driver().cuStreamWaitValue32(cu(stream), cu(addr), value, CU_STREAM_WAIT_VALUE_GEQ));
}

void stream_wait_u64_geq(cudaStream_t stream, uint64_t* addr, uint64_t value) {
    check_address("stream_wait_u64_geq", addr, 8);
    WEFT_CU_CHECK(driver().cuStreamWaitValue64(cu(stream), cu(addr), value, CU_STREAM_WAIT_VALUE_GEQ));
}

Event::Event(bool timing) {
    WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
}

Event::~Event() {
    if (event_ != nullptr) {
        cudaError_t st = cudaEventDestroy(event_);
        if (st != cudaSuccess) WEFT_LOG_WARN("cudaEventDestroy failed: " << cudaGetErrorName(st));
    }
}

Event::Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

Event& Event::operator=(Event&& other) noexcept {
    if (this != &other) {
        if (event_ != nullptr) cudaEventDestroy(event_);
        event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
}

void Event::record(cudaStream_t stream) {
    WEFT_CHECK(event_ != nullptr, "Event::record on a moved-from event");
    WEFT_CUDA_CHECK(cudaEventRecord(event_, stream));
}

void Event::wait(cudaStream_t stream) const {
    WEFT_CHECK(event_ != nullptr, "Event::wait on a moved-from event");
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
}

void Event::synchronize() const {
    WEFT_CHECK(event_ != nullptr, "Event::synchronize on a moved-from event");
    WEFT_CUDA_CHECK(cudaEventSynchronize(event_));
}

bool Event::query() const {
    WEFT_CHECK(event_ != nullptr, "Event::query on a moved-from event");
    cudaError_t st = cudaEventQuery(event_);
    if (st == cudaErrorNotReady) return false;
    WEFT_CUDA_CHECK(st);
    return true;
}

float Event::elapsed_ms(const Event& start) const {
    WEFT_CHECK(event_ != nullptr && start.event_ != nullptr, "Event::elapsed_ms on a moved-from event");
    float ms = 0.0f;
    WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, event_));
    return ms;
}

RelaxedCaptureMode::RelaxedCaptureMode() {
    previous_ = cudaStreamCaptureModeRelaxed;
    exchanged_ = cudaThreadExchangeStreamCaptureMode(&previous_) == cudaSuccess;
    if (!exchanged_) (void)cudaGetLastError();
}

RelaxedCaptureMode::~RelaxedCaptureMode() {
    if (exchanged_) (void)cudaThreadExchangeStreamCaptureMode(&previous_);
}

void StreamUses::note(cudaStream_t stream) {
    // Work enqueued while the stream is being captured runs at the graph's replays, which are the caller's to
    // synchronise: nothing to record (an event recorded in a capture cannot be waited for afterwards).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    if (capture != cudaStreamCaptureStatusNone) return;
    for (auto& [s, e] : uses_) {
        if (s == stream) {
            e.record(stream);
            return;
        }
    }
    // A new stream. A caller cycling through short-lived streams would grow the list: past a few entries, drop
    // those whose work has finished (not on every new stream).
    if (uses_.size() >= 8) {
        const RelaxedCaptureMode relaxed;  // the queries must not invalidate another thread's global capture
        std::erase_if(uses_, [](const std::pair<cudaStream_t, Event>& u) {
            const cudaError_t st = cudaEventQuery(u.second.get());
            if (st == cudaErrorNotReady) return false;
            if (st != cudaSuccess) (void)cudaGetLastError();  // e.g. cudaErrorCapturedEvent: nothing to wait for
            return true;
        });
    }
    uses_.emplace_back(stream, Event());
    uses_.back().second.record(stream);
}

void StreamUses::wait_all() noexcept {
    const RelaxedCaptureMode relaxed;  // a release while another rank thread captures in global mode
    for (auto& [s, e] : uses_) {
        const cudaError_t st = cudaEventSynchronize(e.get());
        if (st != cudaSuccess) {
            (void)cudaGetLastError();
            WEFT_LOG_WARN("waiting for an op's work before releasing it: " << cudaGetErrorName(st));
        }
    }
    uses_.clear();
}

}  // namespace weft
