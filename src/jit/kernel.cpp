// SPDX-License-Identifier: MIT
// Loading a cubin through the driver API and launching its kernel with cuLaunchKernelEx.
#include "weft/jit/kernel.hpp"

#include <optional>
#include <sstream>

#include "weft/detail/cubin_params.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"

namespace weft::jit {

namespace {

// The calling thread's current context; when there is none, the current device's primary context is
// made current (cudaFree(0) initialises the runtime and binds it), which is what cudart would do.
CUcontext current_context(const std::string& description) {
    const DriverApi& api = driver();
    CUcontext ctx = nullptr;
    if (api.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || ctx == nullptr) {
        WEFT_CUDA_CHECK(cudaFree(nullptr));
        WEFT_CU_CHECK(api.cuCtxGetCurrent(&ctx));
    }
    WEFT_CHECK(ctx != nullptr, "no CUDA context is current for kernel " << description << " (call cudaSetDevice first)");
    return ctx;
}

std::string dims(const dim3& d) {
    std::ostringstream os;
    os << '(' << d.x << ", " << d.y << ", " << d.z << ')';
    return os.str();
}

}  // namespace

Kernel::Kernel(std::string description, std::string lowered_name, std::shared_ptr<const std::vector<char>> cubin)
    : description_(std::move(description)), lowered_name_(std::move(lowered_name)), cubin_(std::move(cubin)) {
    WEFT_CHECK(cubin_ && !cubin_->empty(), "Kernel: empty cubin for " << description_);
    WEFT_CHECK(cuda_available(), "cannot load JIT kernel " << description_ << ": no CUDA driver or GPU is visible");
    const DriverApi& api = driver();
    current_context(description_);  // initialises the driver on this thread
    CUresult status = api.cuLibraryLoadData(&library_, cubin_->data(), nullptr, nullptr, 0, nullptr, nullptr, 0);
    if (status != CUDA_SUCCESS) {
        const char* name = "?";
        api.cuGetErrorName(status, &name);
        WEFT_FAIL("cuLibraryLoadData failed (" << name << ") for JIT kernel " << description_
                                               << " (was it compiled for this GPU's arch?)");
    }
    status = api.cuLibraryGetKernel(&kernel_, library_, lowered_name_.c_str());
    if (status != CUDA_SUCCESS) {
        api.cuLibraryUnload(library_);
        const char* name = "?";
        api.cuGetErrorName(status, &name);
        WEFT_FAIL("cuLibraryGetKernel(" << lowered_name_ << ") failed (" << name << ") for JIT kernel " << description_);
    }
    // Parameter sizes, so that launch() can reject a wrong argument list instead of corrupting it. The count comes
    // from the cubin (the driver has no count query): the driver is asked about existing indices only, so a
    // loaded kernel costs no failing driver call (compute-sanitizer reports each one as an API error).
    const std::optional<size_t> count = detail::cubin_kernel_param_count(cubin_->data(), cubin_->size(), lowered_name_);
    params_known_ = count.has_value();
    for (size_t i = 0; params_known_ && i < *count; ++i) {
        size_t offset = 0, bytes = 0;
        status = api.cuKernelGetParamInfo(kernel_, i, &offset, &bytes);
        if (status != CUDA_SUCCESS) {
            const char* name = "?";
            api.cuGetErrorName(status, &name);
            WEFT_LOG_WARN("jit: cuKernelGetParamInfo(" << i << ") failed (" << name << ") for " << description_
                                                       << "; launch() cannot check its arguments");
            params_known_ = false;
        }
        param_bytes_.push_back(bytes);
    }
    if (!params_known_) {
        if (!count) {
            WEFT_LOG_WARN("jit: the cubin of " << description_ << " does not say how many parameters " << lowered_name_
                                               << " takes; launch() cannot check its arguments");
        }
        param_bytes_.clear();
    }
}

Kernel::~Kernel() {
    if (library_ != nullptr) {
        try {
            driver().cuLibraryUnload(library_);
        } catch (...) {
        }
    }
}

Kernel::PerContext& Kernel::state_for_current_context() const {
    const CUcontext ctx = current_context(description_);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& c : contexts_) {
        if (c->context == ctx) return *c;
    }
    const DriverApi& api = driver();
    auto state = std::make_unique<PerContext>();
    state->context = ctx;
    WEFT_CU_CHECK(api.cuKernelGetFunction(&state->function, kernel_));
    // NOTE: eager on purpose. Under lazy loading a function's module loads at its first launch, which
    // cannot happen while a spinning kernel of another stream occupies the device (docs/jit.md, "Loading and
    // launching").
    WEFT_CU_CHECK(api.cuFuncLoad(state->function));
    WEFT_CU_CHECK(api.cuFuncGetAttribute(&state->static_smem_bytes, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, state->function));
    int max_dynamic = 0;
    WEFT_CU_CHECK(api.cuFuncGetAttribute(&max_dynamic, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, state->function));
    state->max_dynamic_smem_bytes = max_dynamic;
    CUdevice device = 0;
    WEFT_CU_CHECK(api.cuCtxGetDevice(&device));
    WEFT_CU_CHECK(api.cuDeviceGetAttribute(&state->optin_smem_bytes, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                           device));
    // NOTE: the dynamic shared memory limit is raised to the device's opt-in maximum here, at load, and not
    // at the first launch that needs it: a first launch can come while a spinning kernel of another stream
    // (a fused op's reduction, a peer rank's GEMM on a shared GPU) waits for the kernel being launched, and a
    // driver call there must not wait for the device. (The limit permits; each launch still asks for its own.)
    // Should the driver refuse (not seen), the first launch that needs more raises the limit as before.
    const int optin_dynamic = state->optin_smem_bytes - state->static_smem_bytes;
    if (optin_dynamic > state->max_dynamic_smem_bytes) {
        const CUresult r =
            api.cuFuncSetAttribute(state->function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin_dynamic);
        if (r == CUDA_SUCCESS) {
            state->max_dynamic_smem_bytes = optin_dynamic;
        } else {
            const char* name = "?";
            api.cuGetErrorName(r, &name);
            WEFT_LOG_WARN("jit: raising the dynamic shared memory limit of " << description_ << " to " << optin_dynamic
                                                                            << " bytes at load failed (" << name
                                                                            << "); it is raised at the first launch");
        }
    }
    contexts_.push_back(std::move(state));
    return *contexts_.back();
}

CUfunction Kernel::load_for_current_context() const { return state_for_current_context().function; }

void Kernel::raise_dynamic_smem(PerContext& state, size_t bytes) const {
    if (bytes <= static_cast<size_t>(state.max_dynamic_smem_bytes.load())) return;
    const size_t total = bytes + static_cast<size_t>(state.static_smem_bytes);
    WEFT_CHECK(total <= static_cast<size_t>(state.optin_smem_bytes),
               "kernel " << description_ << " asks for " << bytes << " bytes of dynamic shared memory on top of "
                         << state.static_smem_bytes << " static; the device allows " << state.optin_smem_bytes
                         << " per block");
    std::lock_guard<std::mutex> lock(mutex_);
    if (bytes > static_cast<size_t>(state.max_dynamic_smem_bytes.load())) {
        WEFT_CU_CHECK(driver().cuFuncSetAttribute(state.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                  static_cast<int>(bytes)));
        state.max_dynamic_smem_bytes = static_cast<int>(bytes);
    }
}

CUfunction Kernel::allow_dynamic_smem(size_t bytes) const {
    PerContext& state = state_for_current_context();
    raise_dynamic_smem(state, bytes);
    return state.function;
}

void Kernel::launch_packed(const LaunchParams& params, void** args, const size_t* arg_bytes, size_t num_args) const {
    WEFT_CHECK(!params_known_ || num_args == param_bytes_.size(), "kernel " << description_ << " takes " << param_bytes_.size()
                                                          << " parameters, launch() got " << num_args << " arguments");
    for (size_t i = 0; params_known_ && i < num_args; ++i) {
        WEFT_CHECK(arg_bytes[i] == param_bytes_[i], "kernel " << description_ << ": argument " << i << " has "
                                                              << arg_bytes[i] << " bytes but parameter " << i
                                                              << " has " << param_bytes_[i]
                                                              << " (wrong type? e.g. double for float, size_t for int)");
    }
    const dim3& g = params.grid;
    const dim3& b = params.block;
    WEFT_CHECK(g.x > 0 && g.y > 0 && g.z > 0, "kernel " << description_ << ": grid must be positive, got " << dims(g));
    WEFT_CHECK(b.x > 0 && b.y > 0 && b.z > 0, "kernel " << description_ << ": block must be positive, got " << dims(b));
    WEFT_CHECK(static_cast<uint64_t>(b.x) * b.y * b.z <= 1024,
               "kernel " << description_ << ": block " << dims(b) << " has more than 1024 threads");

    const DriverApi& api = driver();
    PerContext& state = state_for_current_context();
    raise_dynamic_smem(state, params.dynamic_smem_bytes);

    CUlaunchConfig config{};
    config.gridDimX = g.x;
    config.gridDimY = g.y;
    config.gridDimZ = g.z;
    config.blockDimX = b.x;
    config.blockDimY = b.y;
    config.blockDimZ = b.z;
    config.sharedMemBytes = static_cast<unsigned>(params.dynamic_smem_bytes);
    config.hStream = params.stream;
    CUlaunchAttribute attributes[2]{};
    unsigned num_attributes = 0;
    if (params.cluster) {
        const dim3& c = *params.cluster;
        WEFT_CHECK(c.x > 0 && c.y > 0 && c.z > 0 && g.x % c.x == 0 && g.y % c.y == 0 && g.z % c.z == 0,
                   "kernel " << description_ << ": every grid dimension must be a positive multiple of the cluster's; grid "
                             << dims(g) << ", cluster " << dims(c));
        CUlaunchAttribute& a = attributes[num_attributes++];
        a.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        a.value.clusterDim.x = c.x;
        a.value.clusterDim.y = c.y;
        a.value.clusterDim.z = c.z;
    }
    if (params.programmatic) {
        CUlaunchAttribute& a = attributes[num_attributes++];
        a.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        a.value.programmaticStreamSerializationAllowed = 1;
    }
    config.attrs = num_attributes > 0 ? attributes : nullptr;
    config.numAttrs = num_attributes;
    const CUresult status = api.cuLaunchKernelEx(&config, state.function, args, nullptr);
    if (status != CUDA_SUCCESS) {
        const char* name = "?";
        const char* text = "?";
        api.cuGetErrorName(status, &name);
        api.cuGetErrorString(status, &text);
        WEFT_FAIL("launching kernel " << description_ << " (grid " << dims(g) << ", block " << dims(b) << ", "
                                      << params.dynamic_smem_bytes << " bytes dynamic smem"
                                      << (params.cluster ? ", cluster " + dims(*params.cluster) : std::string())
                                      << (params.programmatic ? ", programmatic" : "")
                                      << ") failed: " << name << " (" << text << ")");
    }
}

}  // namespace weft::jit
