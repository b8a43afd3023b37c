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

void* malloc_beside_captures(size_t bytes, bool zeroed) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    WEFT_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
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
    cudaThreadExchangeStreamCaptureMode(&mode);  // back to the thread's own mode
    WEFT_CUDA_CHECK(err);
    return ptr;
}

}  // namespace weft::ops::detail
