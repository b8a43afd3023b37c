// SPDX-License-Identifier: MIT
// The context's first kernel launch, made while nothing spins (see runtime_internal.hpp and docs/runtime.md).
#include <mutex>
#include <set>

#include "runtime_internal.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/log.hpp"

namespace weft::detail {
namespace {

// An empty kernel in PTX: the driver compiles it for the device at load; no compiler of weft's is needed.
constexpr char kEmptyKernelPtx[] =
    ".version 7.0\n"
    ".target sm_75\n"
    ".address_size 64\n"
    ".visible .entry weft_first_kernel()\n"
    "{\n"
    "    ret;\n"
    "}\n";

}  // namespace

void launch_first_kernel_of_context(cudaStream_t stream) {
    static std::mutex mutex;
    static std::set<unsigned long long> done;  // context ids (unique for the process's life, unlike handles)
    const DriverApi& api = driver();
    CUcontext context = nullptr;
    WEFT_CU_CHECK(api.cuCtxGetCurrent(&context));
    WEFT_CHECK(context != nullptr, "launch_first_kernel_of_context: no CUDA context is current");
    unsigned long long id = 0;
    WEFT_CU_CHECK(api.cuCtxGetId(context, &id));
    std::lock_guard<std::mutex> lock(mutex);
    if (done.count(id) != 0) return;
    struct Library {
        CUlibrary handle = nullptr;
        ~Library() {
            if (handle != nullptr) driver().cuLibraryUnload(handle);
        }
    } library;
    WEFT_CU_CHECK(api.cuLibraryLoadData(&library.handle, kEmptyKernelPtx, nullptr, nullptr, 0, nullptr, nullptr, 0));
    CUkernel kernel = nullptr;
    WEFT_CU_CHECK(api.cuLibraryGetKernel(&kernel, library.handle, "weft_first_kernel"));
    CUfunction function = nullptr;
    WEFT_CU_CHECK(api.cuKernelGetFunction(&function, kernel));
    const auto cu_stream = reinterpret_cast<CUstream>(stream);
    WEFT_CU_CHECK(api.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, cu_stream, nullptr, nullptr));
    WEFT_CU_CHECK(api.cuStreamSynchronize(cu_stream));
    done.insert(id);
    WEFT_LOG_DEBUG("launched the first kernel of CUDA context " << id);
}

}  // namespace weft::detail
