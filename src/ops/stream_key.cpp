// SPDX-License-Identifier: MIT
#include "stream_key.hpp"

#include "weft/runtime/error.hpp"
#include "weft/runtime/stream.hpp"

namespace weft::ops::detail {

StreamKey StreamKey::of(cudaStream_t stream) {
    StreamKey key;
    WEFT_CUDA_CHECK(cudaGetDevice(&key.device));
    // The stream's id, unique for the process's life: a handle freed and handed out again names another stream
    // (state kept for the old one must not be shared with it), and cudaStreamPerThread names each thread's own.
    WEFT_CUDA_CHECK(cudaStreamGetId(stream, &key.stream_id));
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
