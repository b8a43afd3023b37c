// SPDX-License-Identifier: MIT
// NVRTC compiles of weft's kernel headers for the unit tests that check ptxas reports and SASS (header-only: the
// including test target defines WEFT_SOURCE_DIR and WEFT_CUDA_INCLUDE_DIR).
#pragma once

#include <nvrtc.h>

#include <iterator>
#include <map>
#include <string>
#include <vector>

namespace weft::testing {

struct NvrtcCompiled {
    nvrtcResult result = NVRTC_SUCCESS;
    std::string log;                             ///< NVRTC's log, with ptxas' -v report
    std::vector<char> cubin;                     ///< sm_90a cubin (empty when the compile failed)
    std::map<std::string, std::string> lowered;  ///< instantiation -> mangled name
};

/// Compiles `source` (which includes kernel headers as "gemm/...") for sm_90a with ptxas -v and the include paths the
/// JIT uses. NOTE: NVRTC has no C++ standard library: fixed-width integers come from libcu++ (the toolkit's cccl
/// folder), as weft/common/macros.hpp expects.
inline NvrtcCompiled nvrtc_compile(const std::string& source, const char* file_name,
                                   const std::vector<std::string>& instantiations) {
    nvrtcProgram prog = nullptr;
    NvrtcCompiled out;
    out.result = nvrtcCreateProgram(&prog, source.c_str(), file_name, 0, nullptr, nullptr);
    if (out.result != NVRTC_SUCCESS) return out;
    for (const auto& name : instantiations) nvrtcAddNameExpression(prog, name.c_str());
    const std::string inc = std::string("-I") + WEFT_SOURCE_DIR + "/include";
    const std::string kinc = std::string("-I") + WEFT_SOURCE_DIR + "/kernels";
    const std::string cccl = std::string("-I") + WEFT_CUDA_INCLUDE_DIR + "/cccl";
    const std::string cuda_inc = std::string("-I") + WEFT_CUDA_INCLUDE_DIR;
    const char* opts[] = {"-arch=sm_90a", "-std=c++20", "--ptxas-options=-v", inc.c_str(),
                          kinc.c_str(),   cccl.c_str(), cuda_inc.c_str()};
    out.result = nvrtcCompileProgram(prog, static_cast<int>(std::size(opts)), opts);
    size_t log_size = 0;
    nvrtcGetProgramLogSize(prog, &log_size);
    out.log.assign(log_size, '\0');
    nvrtcGetProgramLog(prog, out.log.data());
    if (out.result == NVRTC_SUCCESS) {
        size_t cubin_size = 0;
        nvrtcGetCUBINSize(prog, &cubin_size);
        out.cubin.resize(cubin_size);
        nvrtcGetCUBIN(prog, out.cubin.data());
        for (const auto& name : instantiations) {
            const char* lowered = nullptr;
            if (nvrtcGetLoweredName(prog, name.c_str(), &lowered) == NVRTC_SUCCESS && lowered) {
                out.lowered[name] = lowered;
            }
        }
    }
    nvrtcDestroyProgram(&prog);
    return out;
}

}  // namespace weft::testing
