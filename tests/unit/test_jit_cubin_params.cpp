// SPDX-License-Identifier: MIT
// Unit tests (CPU): jit::Kernel learns how many parameters a kernel takes from its cubin, so that it asks the
// driver (cuKernelGetParamInfo) about existing parameters only. NVRTC and nvJitLink cubins of kernels with 0, 1
// and several parameters (pointers, scalars, a large struct, a __grid_constant__ one); damaged images are refused.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "support/jit_testing.hpp"
#include "weft/detail/cubin_params.hpp"
#include "weft/jit/compiler.hpp"

namespace weft {
namespace {

using detail::cubin_kernel_param_count;

constexpr const char* kKernels = R"(
struct Big { long long words[40]; int tail; };
extern "C" __global__ void no_params() {}
extern "C" __global__ void one_param(int* out) { out[0] = 1; }
extern "C" __global__ void mixed(int* out, float x, Big big, char c, double d) {
    out[0] = static_cast<int>(x) + big.tail + c + static_cast<int>(d);
}
template <int kN>
__global__ void templated(const __grid_constant__ Big big, weft::DeviceCtx ctx, unsigned long long* out) {
    out[kN] = big.words[kN] + ctx.rank;
}
)";

jit::CompileResult compile(const std::string& instantiation, bool lto) {
    jit::Compiler compiler(testing::isolated_compiler_config(std::filesystem::path()));
    jit::KernelSpec spec;
    spec.header = "weft/common/device_ctx.hpp";
    spec.extra_code = kKernels;
    spec.instantiation = instantiation;
    spec.arch = "sm_90a";
    spec.options.lto = lto;
    return compiler.compile(spec);
}

std::optional<size_t> count(const jit::CompileResult& r) {
    return cubin_kernel_param_count(r.cubin->data(), r.cubin->size(), r.lowered_name);
}

TEST(JitCubinParams, CountsEveryParameterOfNvrtcAndNvJitLinkCubins) {
    for (bool lto : {false, true}) {
        SCOPED_TRACE(lto ? "nvJitLink" : "NVRTC");
        EXPECT_EQ(count(compile("no_params", lto)), std::optional<size_t>(0));
        EXPECT_EQ(count(compile("one_param", lto)), std::optional<size_t>(1));
        EXPECT_EQ(count(compile("mixed", lto)), std::optional<size_t>(5));
        EXPECT_EQ(count(compile("templated<3>", lto)), std::optional<size_t>(3));
    }
}

TEST(JitCubinParams, AnotherKernelsNameOrADamagedImageIsNotACount) {
    const jit::CompileResult r = compile("mixed", false);
    const std::vector<char>& image = *r.cubin;
    EXPECT_FALSE(cubin_kernel_param_count(image.data(), image.size(), "mixe").has_value());
    EXPECT_FALSE(cubin_kernel_param_count(image.data(), image.size(), "mixed_").has_value());
    EXPECT_FALSE(cubin_kernel_param_count(image.data(), image.size(), "").has_value());
    EXPECT_FALSE(cubin_kernel_param_count(nullptr, 0, "mixed").has_value());
    // Every truncation is refused or counted from what is there, never read past the end (ASan runs this in CI's
    // sanitizer build; here a wrong count would show).
    for (size_t size : {size_t{0}, size_t{4}, size_t{63}, image.size() / 2, image.size() - 1}) {
        std::vector<char> cut(image.begin(), image.begin() + static_cast<std::ptrdiff_t>(size));
        const auto n = cubin_kernel_param_count(cut.data(), cut.size(), "mixed");
        EXPECT_TRUE(!n.has_value() || *n == 5) << size;
    }
    std::vector<char> not_elf = image;
    not_elf[1] = 'X';
    EXPECT_FALSE(cubin_kernel_param_count(not_elf.data(), not_elf.size(), "mixed").has_value());
    std::vector<char> elf32 = image;
    elf32[4] = 1;
    EXPECT_FALSE(cubin_kernel_param_count(elf32.data(), elf32.size(), "mixed").has_value());
    // A section table said to lie beyond the image.
    std::vector<char> far = image;
    const uint64_t beyond = image.size();
    std::memcpy(far.data() + 0x28, &beyond, 8);
    EXPECT_FALSE(cubin_kernel_param_count(far.data(), far.size(), "mixed").has_value());
}

}  // namespace
}  // namespace weft
