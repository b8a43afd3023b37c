// SPDX-License-Identifier: MIT
#include "stream_key.hpp"

#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "weft/runtime/error.hpp"
#include "weft/runtime/stream.hpp"

namespace weft::ops::detail {

StreamKey StreamKey::of(cudaStream_t stream) {
    // The ids of the handles seen outside a capture (cudaStreamPerThread: per thread, the legacy stream is one for
    // all), refreshed at every such call: a handle freed and given to a new stream gets its new id at the new stream's
    // first uncaptured call.
    using Handle = std::tuple<int, cudaStream_t, std::thread::id>;
    static std::mutex mutex;
    static std::map<Handle, unsigned long long> known;
    StreamKey key;
    WEFT_CUDA_CHECK(cudaGetDevice(&key.device));
    const Handle handle{key.device, stream,
                        stream == cudaStreamPerThread ? std::this_thread::get_id() : std::thread::id{}};
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    if (status == cudaStreamCaptureStatusNone) {
        // The stream's id, unique for the process's life: a handle freed and handed out again names another stream
        // (state kept for the old one must not be shared with it), and cudaStreamPerThread names each thread's own.
        WEFT_CUDA_CHECK(cudaStreamGetId(stream, &key.stream_id));
        const std::lock_guard<std::mutex> lock(mutex);
        known[handle] = key.stream_id;
        return key;
    }
    // Being captured (or a capture on it invalidated): cudaStreamGetId would fail and invalidate the capture.
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = known.find(handle);
    if (it != known.end()) {
        key.stream_id = it->second;
    } else {
        // Keyed by the handle, not the capture's id: that is new at every capture (each would grow state of its own for
        // good) and shared by the branches of one capture (which run at the same time).
        key.captured = true;
        key.handle = stream;
        // cudaStreamPerThread: one handle, each thread's own stream.
        if (stream == cudaStreamPerThread) key.stream_id = std::hash<std::thread::id>{}(std::this_thread::get_id());
    }
    return key;
}

void* malloc_beside_captures(size_t bytes, bool zeroed) {
    const RelaxedCaptureMode relaxed;
    void* ptr = nullptr;
    cudaStream_t zeroing = nullptr;
    cudaError_t err = cudaMalloc(&ptr, bytes);
    if (err == cudaSuccess && zeroed) {
        err = cudaStreamCreateWithFlags(&zeroing, cudaStreamNonBlocking);
        if (err == cudaSuccess) err = cudaMemsetAsync(ptr, 0, bytes, zeroing);
        if (err == cudaSuccess) err = cudaStreamSynchronize(zeroing);
        if (zeroing != nullptr) cudaStreamDestroy(zeroing);
        if (err != cudaSuccess) cudaFree(ptr);
    }
    WEFT_CUDA_CHECK(err);
    return ptr;
}

}  // namespace weft::ops::detail
