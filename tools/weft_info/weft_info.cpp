// SPDX-License-Identifier: MIT
// weft-info: prints what weft sees on this machine (toolkit, driver, GPUs). Works without a GPU.
#include <cstdio>

#include <cuda_runtime_api.h>
#include <nvrtc.h>

#include "weft/runtime/driver.hpp"
#include "weft/runtime/error.hpp"

int main() {
    std::printf("weft %s\n", WEFT_VERSION_STRING);
    int runtime_version = 0;
    cudaRuntimeGetVersion(&runtime_version);
    int nvrtc_major = 0, nvrtc_minor = 0;
    nvrtcVersion(&nvrtc_major, &nvrtc_minor);
    std::printf("CUDA runtime %d.%d (" WEFT_INFO_CUDART "), NVRTC %d.%d\n", runtime_version / 1000,
                (runtime_version % 1000) / 10, nvrtc_major, nvrtc_minor);
    if (!weft::cuda_available()) {
        std::printf("no CUDA driver or GPU: kernels cannot run here; building, JIT compilation and unit tests can\n");
        return 0;
    }
    int driver_version = 0;
    cudaDriverGetVersion(&driver_version);
    int count = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&count));
    std::printf("driver supports CUDA %d.%d; %d GPU(s)\n", driver_version / 1000, (driver_version % 1000) / 10, count);
    for (int d = 0; d < count; ++d) {
        cudaDeviceProp prop{};
        WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, d));
        std::printf("  GPU %d: %s, sm_%d%d, %d SMs, %.1f GiB, L2 %.0f MB\n", d, prop.name, prop.major, prop.minor,
                    prop.multiProcessorCount, static_cast<double>(prop.totalGlobalMem) / (1ull << 30),
                    prop.l2CacheSize / 1e6);
    }
    return 0;
}
