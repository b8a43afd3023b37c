// SPDX-License-Identifier: MIT
// weft-info: prints what weft sees on this machine (toolkit, driver, GPUs). Works without a GPU.
#include <cstdio>
#include <exception>
#include <string>

#include <cuda_runtime_api.h>
#include <nvrtc.h>

#include "weft/runtime/driver.hpp"
#include "weft/runtime/error.hpp"

namespace {

// Prints the report. Returns 0 also when kernels cannot run here, after saying why (that is what this tool
// is for); a failure past that point is thrown and reported by main.
int print_info() {
    std::printf("weft %s\n", WEFT_VERSION_STRING);
    int runtime_version = 0;
    cudaRuntimeGetVersion(&runtime_version);
    int nvrtc_major = 0, nvrtc_minor = 0;
    nvrtcVersion(&nvrtc_major, &nvrtc_minor);
    std::printf("CUDA runtime %d.%d (" WEFT_INFO_CUDART "), NVRTC %d.%d\n", runtime_version / 1000,
                (runtime_version % 1000) / 10, nvrtc_major, nvrtc_minor);
    // Say why kernels cannot run here rather than only that they cannot: diagnosing this is what the tool is for.
    auto cannot_run = [](const std::string& reason) {
        std::printf("%s\nkernels cannot run here; building, JIT compilation and unit tests can\n", reason.c_str());
        return 0;
    };
    int driver_version = 0;  // stays 0 when no driver is installed
    cudaDriverGetVersion(&driver_version);
    const std::string driver_text = driver_version == 0
                                        ? std::string("no CUDA driver found")
                                        : "driver supports CUDA " + std::to_string(driver_version / 1000) + "." +
                                              std::to_string((driver_version % 1000) / 10);
    try {
        weft::driver();
    } catch (const weft::Error& e) {
        return cannot_run(driver_text + "; the driver API is unusable: " + e.what());
    }
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess) {
        return cannot_run(driver_text + "; cudaGetDeviceCount failed: " + cudaGetErrorName(status) + " (" +
                          cudaGetErrorString(status) + ")");
    }
    if (count == 0) return cannot_run(driver_text + "; no GPU is visible");
    std::printf("%s; %d GPU(s)\n", driver_text.c_str(), count);
    for (int d = 0; d < count; ++d) {
        cudaDeviceProp prop{};
        WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, d));
        std::printf("  GPU %d: %s, sm_%d%d, %d SMs, %.1f GiB, L2 %.0f MB\n", d, prop.name, prop.major, prop.minor,
                    prop.multiProcessorCount, static_cast<double>(prop.totalGlobalMem) / (1ull << 30),
                    prop.l2CacheSize / 1e6);
    }
    return 0;
}

}  // namespace

int main() {
    try {
        return print_info();
    } catch (const std::exception& e) {
        std::fflush(stdout);
        std::fprintf(stderr, "weft-info: %s\n", e.what());
        return 1;
    }
}
