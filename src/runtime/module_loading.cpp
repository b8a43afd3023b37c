// SPDX-License-Identifier: MIT
// Eager module loading and hardware queues (see include/weft/runtime/module_loading.hpp).
#include "weft/runtime/module_loading.hpp"

#include <cstdlib>
#include <mutex>
#include <string>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "weft/runtime/env.hpp"
#include "weft/runtime/log.hpp"

namespace weft {

namespace {
std::once_flag g_eager_once;
bool g_weft_set_it = false;
std::once_flag g_connections_once;
bool g_weft_set_connections = false;
}  // namespace

bool ensure_eager_module_loading() {
    std::call_once(g_eager_once, [] {
        auto value = env::get("CUDA_MODULE_LOADING");
        if (!value) {
            ::setenv("CUDA_MODULE_LOADING", "EAGER", 0);
            g_weft_set_it = true;
            WEFT_LOG_INFO(
                "weft set CUDA_MODULE_LOADING=EAGER: lazy module loading can deadlock a kernel that spins "
                "on a flag set by a kernel whose module is not loaded yet (set CUDA_MODULE_LOADING "
                "yourself to override)");
        } else if (*value != "EAGER") {
            WEFT_LOG_WARN("CUDA_MODULE_LOADING=" << *value
                                                 << " (set by the user): with lazy loading a spinning kernel can "
                                                    "deadlock waiting for a kernel whose module cannot load; weft "
                                                    "recommends EAGER");
        }
    });
    return g_weft_set_it;
}

bool ensure_device_connections() {
    std::call_once(g_connections_once, [] {
        auto value = env::get("CUDA_DEVICE_MAX_CONNECTIONS");
        if (!value) {
            ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", std::to_string(kDeviceConnections).c_str(), 0);
            g_weft_set_connections = true;
            WEFT_LOG_INFO("weft set CUDA_DEVICE_MAX_CONNECTIONS=" << kDeviceConnections
                                                                  << ": ranks of one process sharing a GPU need "
                                                                     "their streams in separate hardware queues");
        } else if (std::atoi(value->c_str()) < kDeviceConnections) {
            WEFT_LOG_WARN("CUDA_DEVICE_MAX_CONNECTIONS=" << *value << " (set by the user): ranks of one process "
                          << "sharing a GPU (run_local) can deadlock when a spinning kernel shares a hardware "
                          << "queue with the peer work it waits for; weft recommends " << kDeviceConnections);
        }
    });
    return g_weft_set_connections;
}

void prepare_cuda_environment() {
    ensure_eager_module_loading();
    ensure_device_connections();
}

void warn_if_lazy_module_loading() {
    static std::once_flag once;
    std::call_once(once, [] {
        // Looked up here rather than in driver.hpp's table: only this diagnostic needs it.
        using GetLoadingMode = CUresult (*)(CUmoduleLoadingMode*);
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult query{};
        if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, CUDA_VERSION, cudaEnableDefault, &query) !=
                cudaSuccess ||
            query != cudaDriverEntryPointSuccess || fn == nullptr) {
            return;
        }
        CUmoduleLoadingMode mode{};
        if (reinterpret_cast<GetLoadingMode>(fn)(&mode) != CUDA_SUCCESS) return;
        auto value = env::get("CUDA_MODULE_LOADING");
        if (mode != CU_MODULE_LAZY_LOADING || !value || *value != "EAGER") return;
        // weft's own kernels load eagerly whatever the mode (the JIT loads each module whole); what stays lazy is
        // other libraries' kernels, whose first launch may wait for the whole GPU, a weft kernel spinning for a peer
        // included.
        constexpr const char* kWhat =
            "CUDA was initialised (by another library, e.g. PyTorch) before weft could select eager module loading: "
            "weft's kernels load eagerly regardless, but other libraries' kernels load at their first launch, which "
            "can wait for a weft kernel spinning on this GPU for a peer; to rule that out, set "
            "CUDA_MODULE_LOADING=EAGER in the environment before the program starts";
        if (g_weft_set_it) {
            WEFT_LOG_INFO(kWhat);
        } else {
            WEFT_LOG_WARN("CUDA loads modules lazily although you set CUDA_MODULE_LOADING=EAGER: " << kWhat);
        }
    });
}

}  // namespace weft
