// SPDX-License-Identifier: MIT
// Error construction and the driver API table.
#include "weft/runtime/error.hpp"

#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "weft/runtime/driver.hpp"
#include "weft/runtime/module_loading.hpp"

namespace weft {
namespace detail {

namespace {
std::string base_name(const char* file) {
    std::string path(file);
    auto pos = path.find_last_of('/');
    return pos == std::string::npos ? path : path.substr(pos + 1);
}
}  // namespace

void throw_error(const char* file, int line, const std::string& message) {
    throw Error("weft: " + message + " [" + base_name(file) + ":" + std::to_string(line) + "]");
}

void throw_cuda_error(const char* file, int line, const char* call, cudaError_t status) {
    throw Error(std::string("weft: CUDA call failed: ") + call + " returned " + cudaGetErrorName(status) +
                " (" + cudaGetErrorString(status) + ") [" + base_name(file) + ":" + std::to_string(line) + "]");
}

void throw_cu_error(const char* file, int line, const char* call, CUresult status) {
    const char* name = "unknown";
    const char* text = "unknown";
    try {
        const DriverApi& api = driver();
        api.cuGetErrorName(status, &name);
        api.cuGetErrorString(status, &text);
    } catch (const Error&) {
    }
    throw Error(std::string("weft: CUDA driver call failed: ") + call + " returned " + name + " (" + text +
                ") [" + base_name(file) + ":" + std::to_string(line) + "]");
}

}  // namespace detail

namespace {

struct DriverLoad {
    DriverApi api;
    std::string error;  // empty when every function resolved
};

DriverLoad load_driver() {
    DriverLoad load;
    int runtime_driver = 0;
    cudaError_t st = cudaDriverGetVersion(&runtime_driver);
    if (st != cudaSuccess || runtime_driver == 0) {
        load.error = "no CUDA driver is installed (cudaDriverGetVersion returned driver version 0)";
        return load;
    }
    auto resolve = [&](const char* name, void** slot) {
        cudaDriverEntryPointQueryResult q{};
        cudaError_t s =
            cudaGetDriverEntryPointByVersion(name, slot, detail::driver_abi_version(name), cudaEnableDefault, &q);
        if ((s != cudaSuccess || q != cudaDriverEntryPointSuccess || *slot == nullptr) && load.error.empty()) {
            load.error = std::string("the CUDA driver does not provide ") + name + " (driver version " +
                         std::to_string(runtime_driver) + ", weft built against " + std::to_string(CUDA_VERSION) +
                         ")";
        }
    };
#define WEFT_DRIVER_RESOLVE(fn) resolve(#fn, reinterpret_cast<void**>(&load.api.fn));
    WEFT_DRIVER_FUNCTIONS(WEFT_DRIVER_RESOLVE)
#undef WEFT_DRIVER_RESOLVE
    return load;
}

const DriverLoad& driver_load() {
    static const DriverLoad load = load_driver();
    return load;
}

}  // namespace

namespace detail {

int driver_abi_version(std::string_view name) {
    // NOTE: the entry-point query returns the newest ABI of a symbol at the version asked for, which is not
    // always the one cuda.h declares under the plain name: at 13000 "cuCtxGetDevice" is cuCtxGetDevice_v2
    // (CUdevice*, CUcontext), while decltype(&::cuCtxGetDevice) takes one argument (cuCtxSynchronize alike).
    // Called that way, the context argument was whatever a register held: the driver crashed now and then
    // (seen with 8 rank threads). Such symbols are asked for at the last version whose ABI matches the
    // declaration; tests/unit/test_driver_abi.cpp checks every entry against cudaTypedefs.h.
    if (name == "cuCtxGetDevice" || name == "cuCtxSynchronize") return 12000;  // both gained a CUcontext in 13.0
    return CUDA_VERSION;
}

const std::vector<std::string_view>& driver_function_names() {
    static const std::vector<std::string_view> names = {
#define WEFT_DRIVER_NAME(fn) #fn,
        WEFT_DRIVER_FUNCTIONS(WEFT_DRIVER_NAME)
#undef WEFT_DRIVER_NAME
    };
    return names;
}

}  // namespace detail

const DriverApi& driver() {
    const DriverLoad& load = driver_load();
    if (!load.error.empty()) throw Error("weft: " + load.error);
    return load.api;
}

bool cuda_available() noexcept {
    try {
        if (!driver_load().error.empty()) return false;
        // This may be the process's first CUDA call (the JIT asks it before any World exists): choose eager
        // module loading first, as World::from_env and run_local would, since the mode is fixed from here on.
        ensure_eager_module_loading();
        int count = 0;
        return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    } catch (...) {
        return false;
    }
}

}  // namespace weft
