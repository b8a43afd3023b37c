// SPDX-License-Identifier: MIT
// A JIT-compiled kernel loaded through the driver API, and its launch helper.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda.h>
#include <cuda_runtime_api.h>

namespace weft::jit {

/// Launch geometry. `cluster`, when set, launches thread-block clusters of that shape (sm_90+);
/// every grid dimension must then be a multiple of the cluster's.
struct LaunchParams {
    dim3 grid{1, 1, 1};
    dim3 block{1, 1, 1};
    size_t dynamic_smem_bytes = 0;  ///< up to the device's opt-in maximum (the limit is raised at load)
    cudaStream_t stream = nullptr;
    std::optional<dim3> cluster = std::nullopt;
    /// Programmatic dependent launch (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION): the kernel may start
    /// before the previous kernel on the stream has completed, once every CTA of that kernel has executed
    /// griddepcontrol.launch_dependents or exited; the kernel itself waits (griddepcontrol.wait,
    /// weft/ptx/griddep.cuh) before it touches what that kernel writes or reads.
    bool programmatic = false;
};

/// One loaded kernel. The library is loaded context-independently when the Kernel is built; the
/// function is fetched and loaded (cuKernelGetFunction + cuFuncLoad) per context by
/// `load_for_current_context()`, so nothing loads lazily behind a spinning kernel's back: call it
/// (Compiler::get_kernel does) on every device before launching anything that spins.
/// Thread-safe; owned by the Compiler that made it (or by the caller of the public constructor).
class Kernel {
public:
    /// Loads `cubin` (kept alive by the Kernel) and looks up `lowered_name`. Needs a CUDA driver and
    /// a GPU; throws weft::Error naming `description` otherwise.
    Kernel(std::string description, std::string lowered_name, std::shared_ptr<const std::vector<char>> cubin);
    ~Kernel();
    Kernel(const Kernel&) = delete;
    Kernel& operator=(const Kernel&) = delete;

    /// Launches on `params.stream` in the current context. Arguments are copied by value into the
    /// kernel's parameter space and must match the kernel's parameters in number and size (checked:
    /// a mismatch is a weft::Error naming the argument); types are the caller's responsibility, e.g.
    /// pass `2.0f`, not `2.0`, to a float parameter.
    template <class... Args>
    void launch(const LaunchParams& params, const Args&... args) const {
        static_assert((std::is_trivially_copyable_v<Args> && ...),
                      "kernel arguments are copied byte-wise: they must be trivially copyable");
        void* pointers[sizeof...(Args) + 1] = {const_cast<void*>(static_cast<const void*>(&args))..., nullptr};
        const size_t bytes[sizeof...(Args) + 1] = {sizeof(Args)..., 0};
        launch_packed(params, pointers, bytes, sizeof...(Args));
    }

    /// The untyped form of launch(): `args[i]` points at `arg_bytes[i]` bytes of parameter i.
    void launch_packed(const LaunchParams& params, void** args, const size_t* arg_bytes, size_t num_args) const;

    /// Fetches and loads the function into the calling thread's current context (making the
    /// device's primary context current first when none is). Idempotent and cheap when done.
    CUfunction load_for_current_context() const;

    /// load_for_current_context(), with the function's dynamic shared memory limit at least `bytes` in that
    /// context (the device's opt-in maximum is set at load; a driver call only where that failed). The one
    /// cache of this attribute, per (kernel, context): launch() goes through it too. Throws weft::Error when
    /// `bytes` plus the static shared memory exceed the device's per-block limit.
    CUfunction allow_dynamic_smem(size_t bytes) const;

    const std::string& description() const { return description_; }
    const std::string& lowered_name() const { return lowered_name_; }
    /// Byte size of each kernel parameter, from the driver, asked about the parameters the cubin lists
    /// (detail::cubin_kernel_param_count); empty when either could not say, in which case launch() checks
    /// nothing (a warning was logged).
    const std::vector<size_t>& param_bytes() const { return param_bytes_; }
    CUkernel handle() const { return kernel_; }

private:
    struct PerContext {
        CUcontext context;
        CUfunction function;
        std::atomic<int> max_dynamic_smem_bytes{0};  // the attribute value set on `function`
        int static_smem_bytes;
        int optin_smem_bytes;        // the device's per-block opt-in limit
    };
    PerContext& state_for_current_context() const;
    /// Raises state.function's dynamic shared memory limit to `bytes` when it is lower (see allow_dynamic_smem).
    void raise_dynamic_smem(PerContext& state, size_t bytes) const;

    std::string description_;
    std::string lowered_name_;
    std::shared_ptr<const std::vector<char>> cubin_;
    CUlibrary library_ = nullptr;
    CUkernel kernel_ = nullptr;
    std::vector<size_t> param_bytes_;
    bool params_known_ = false;
    mutable std::mutex mutex_;
    mutable std::vector<std::unique_ptr<PerContext>> contexts_;
};

}  // namespace weft::jit
