// SPDX-License-Identifier: MIT
// The CUDA driver API, resolved at run time through cudart's entry-point query.
//
// weft never links libcuda: CPU-only machines (CI) run the unit tests without a driver, and a binary
// built there runs unchanged on a GPU machine. Call through `weft::driver()` and check with WEFT_CU_CHECK:
//     WEFT_CU_CHECK(weft::driver().cuMemCreate(&handle, bytes, &prop, 0));
#pragma once

#include <cuda.h>

#include <string_view>
#include <vector>

#include "weft/runtime/error.hpp"

// Every driver function weft uses. Add a name here to make `driver().name` available.
#define WEFT_DRIVER_FUNCTIONS(X)        \
    X(cuGetErrorName)                   \
    X(cuGetErrorString)                 \
    X(cuInit)                           \
    X(cuDriverGetVersion)               \
    X(cuDeviceGet)                      \
    X(cuDeviceGetAttribute)             \
    X(cuDeviceGetPCIBusId)              \
    X(cuCtxGetCurrent)                  \
    X(cuCtxGetId)                       \
    X(cuCtxGetDevice)                   \
    X(cuCtxSynchronize)                 \
    X(cuDevicePrimaryCtxRetain)         \
    X(cuPointerGetAttribute)            \
    X(cuMemGetAllocationGranularity)    \
    X(cuMemCreate)                      \
    X(cuMemRelease)                     \
    X(cuMemAddressReserve)              \
    X(cuMemAddressFree)                 \
    X(cuMemMap)                         \
    X(cuMemUnmap)                       \
    X(cuMemSetAccess)                   \
    X(cuMemExportToShareableHandle)     \
    X(cuMemImportFromShareableHandle)   \
    X(cuStreamWriteValue32)             \
    X(cuStreamWriteValue64)             \
    X(cuStreamWaitValue32)              \
    X(cuStreamWaitValue64)              \
    X(cuLibraryLoadData)                \
    X(cuLibraryUnload)                  \
    X(cuLibraryGetKernel)               \
    X(cuStreamSynchronize)              \
    X(cuKernelGetFunction)              \
    X(cuKernelGetParamInfo)             \
    X(cuFuncLoad)                       \
    X(cuFuncIsLoaded)                   \
    X(cuFuncSetAttribute)               \
    X(cuFuncGetAttribute)               \
    X(cuLaunchKernel)                   \
    X(cuLaunchKernelEx)                 \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessor) \
    X(cuOccupancyMaxActiveClusters)     \
    X(cuTensorMapEncodeTiled)

namespace weft {

/// Pointers to the driver functions above. Every member is non-null once `driver()` returns.
struct DriverApi {
#define WEFT_DRIVER_MEMBER(fn) decltype(&::fn) fn = nullptr;
    WEFT_DRIVER_FUNCTIONS(WEFT_DRIVER_MEMBER)
#undef WEFT_DRIVER_MEMBER
};

/// Resolves the driver table on first use (thread-safe). Throws weft::Error when no CUDA driver is
/// installed or a function is missing, naming it.
const DriverApi& driver();

/// True when a CUDA driver and at least one device are present (never throws).
bool cuda_available() noexcept;

namespace detail {
/// The CUDA version whose ABI of `name` the table asks the driver for: CUDA_VERSION, except for symbols
/// whose newest ABI no longer matches the declaration in cuda.h (see error.cpp).
int driver_abi_version(std::string_view name);
/// The names in WEFT_DRIVER_FUNCTIONS, in order (for tests).
const std::vector<std::string_view>& driver_function_names();
[[noreturn]] void throw_cu_error(const char* file, int line, const char* call, CUresult status);
}  // namespace detail

}  // namespace weft

/// Checks a driver API call made through weft::driver().
#define WEFT_CU_CHECK(call)                                                      \
    do {                                                                         \
        CUresult weft_cu_status_ = (call);                                       \
        if (weft_cu_status_ != CUDA_SUCCESS) {                                   \
            ::weft::detail::throw_cu_error(__FILE__, __LINE__, #call, weft_cu_status_); \
        }                                                                        \
    } while (0)
