// SPDX-License-Identifier: MIT
#include "stream_key.hpp"

#include "weft/runtime/error.hpp"

namespace weft::ops::detail {

StreamKey StreamKey::of(cudaStream_t stream) {
    StreamKey key;
    WEFT_CUDA_CHECK(cudaGetDevice(&key.device));
    key.stream = stream;
    if (stream == cudaStreamPerThread) key.thread = std::this_thread::get_id();
    return key;
}

void* malloc_beside_captures(size_t bytes) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    WEFT_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    void* ptr = nullptr;
    const cudaError_t err = cudaMalloc(&ptr, bytes);
    cudaThreadExchangeStreamCaptureMode(&mode);  // back to the thread's own mode
    WEFT_CUDA_CHECK(err);
    return ptr;
}

}  // namespace weft::ops::detail
