// SPDX-License-Identifier: MIT
// A .cu file of the installing project that includes weft's device layer, built by nvcc as weft_cuda_target() sets
// it up (C++20, sm_90a, weft's CUDA runtime).
#include "device_check.hpp"

#include "weft/device.cuh"

namespace {

// Each thread asks the device layer for this rank's own heap through symm_at: it is the heap itself.
__global__ void own_heap_kernel(weft::DeviceCtx ctx, int* out) {
    const uint8_t* self = weft::device::symm_at(ctx, ctx.heap_base, ctx.rank);
    out[threadIdx.x] = self == ctx.heap_base ? static_cast<int>(threadIdx.x) : -1;
}

}  // namespace

int device_layer_check(const weft::DeviceCtx& ctx) {
    constexpr int kThreads = 64;
    int* d_out = nullptr;
    if (cudaMalloc(reinterpret_cast<void**>(&d_out), kThreads * sizeof(int)) != cudaSuccess) return -1;
    own_heap_kernel<<<1, kThreads>>>(ctx, d_out);
    int out[kThreads] = {};
    const bool ok =
        cudaGetLastError() == cudaSuccess && cudaMemcpy(out, d_out, sizeof(out), cudaMemcpyDeviceToHost) == cudaSuccess;
    cudaFree(d_out);
    if (!ok) return -1;
    int correct = 0;
    for (int i = 0; i < kThreads; ++i) correct += out[i] == i;
    return correct;
}
