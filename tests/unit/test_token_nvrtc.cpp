// SPDX-License-Identifier: MIT
// Unit tests (CPU): a Token is a guarantee. NVRTC (through weft::jit) compiles a kernel that waits and then issues
// the loads that take the wait's Token; the same kernel with the wait replaced by any other way of getting a Token
// (a raw value, default construction, a forged WaitResult, or the load called without one) must not compile, and
// NVRTC's log must say why in words a person understands.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "support/jit_testing.hpp"
#include "weft/jit/compiler.hpp"

namespace weft {
namespace {

using testing::isolated_compiler_config;

constexpr const char* kWaitSlot = "@WAIT@";
constexpr const char* kLoadSlot = "@LOAD@";

// A kernel that reads data other ranks wrote: a TMA load into shared memory and a plain load through
// consume_token, both after the wait that produced `token`. The slots are replaced per case.
constexpr const char* kKernel = R"(
using namespace weft;
using namespace weft::device;
template <int kUnused>
__global__ void token_kernel(const __grid_constant__ ptx::TmaDescriptor map, DeviceCtx ctx, const uint64_t* signals,
                             const float* data, float* out) {
    __shared__ alignas(1024) unsigned char smem[8192];
    __shared__ uint64_t bar;
    const unsigned smem_addr = ptx::shared_address(smem);
    const unsigned bar_addr = ptx::shared_address(&bar);
    @WAIT@
    if (threadIdx.x == 0) {
        @LOAD@
    }
    out[threadIdx.x] = tile::consume_token(data, token)[threadIdx.x] + static_cast<float>(smem[threadIdx.x]);
}
)";

constexpr const char* kWait = "const Token token = tile::wait(Block{}, ctx, signals, 4, Cmp::kGe, 1);";
constexpr const char* kLoad = "tile::tma_load_2d(token, smem_addr, &map, bar_addr, 0, 0);";

std::string replace(std::string text, const std::string& slot, const std::string& with) {
    const size_t at = text.find(slot);
    EXPECT_NE(at, std::string::npos) << slot;
    if (at != std::string::npos) text.replace(at, slot.size(), with);
    return text;
}

std::string kernel_source(const std::string& wait, const std::string& load) {
    return replace(replace(kKernel, kWaitSlot, wait), kLoadSlot, load);
}

jit::KernelSpec spec(const std::string& code) {
    jit::KernelSpec s;
    s.header = "weft/device.cuh";
    s.extra_code = code;
    s.instantiation = "token_kernel<0>";
    s.arch = "sm_90a";
    return s;
}

struct Outcome {
    bool compiled = false;
    std::string log;  ///< NVRTC's log alone (not the generated source the error message appends)
};

Outcome compile(const std::string& code) {
    jit::Compiler compiler(isolated_compiler_config(std::filesystem::path()));
    Outcome out;
    try {
        const jit::CompileResult r = compiler.compile(spec(code));
        out.compiled = r.cubin != nullptr && !r.cubin->empty();
        out.log = r.log;
    } catch (const std::exception& e) {
        const std::string what = e.what();
        const size_t begin = what.find("log:\n");
        const size_t end = what.find("\nGenerated source:");
        const size_t length = end == std::string::npos ? std::string::npos : end - begin - 5;
        out.log = begin == std::string::npos ? what : what.substr(begin + 5, length);
    }
    return out;
}

// The same harness compiles the kernel with its wait: any case below fails for its own reason, not the harness's.
TEST(TokenNvrtc, WaitThenTokenTakingLoadsCompiles) {
    const Outcome r = compile(kernel_source(kWait, kLoad));
    EXPECT_TRUE(r.compiled) << r.log;
    const Outcome checked = compile(kernel_source(
        "const Token token = tile::wait_checked(Block{}, ctx, signals, 4, Cmp::kGe, 1).token_or_trap();", kLoad));
    EXPECT_TRUE(checked.compiled) << checked.log;
    const Outcome local = compile(kernel_source("const Token token = Token::assume_local_data();", kLoad));
    EXPECT_TRUE(local.compiled) << local.log;
}

TEST(TokenNvrtc, KernelWithoutTheWaitDoesNotCompile) {
    struct Case {
        const char* what;
        std::string wait;
        std::string load;
        std::vector<std::string> log_says;  ///< each must appear in NVRTC's log
    };
    const std::vector<Case> cases = {
        {"a Token from a raw value", "const Token token(1u);", kLoad,
         {"weft::device::Token::Token(unsigned int)", "inaccessible"}},
        {"a Token from the signal's value, braced", "const Token token{static_cast<unsigned>(signals[0])};", kLoad,
         {"weft::device::Token::Token(unsigned int)", "inaccessible"}},
        {"a Token by conversion", "const Token token = static_cast<Token>(1u);", kLoad,
         {"weft::device::Token::Token(unsigned int)", "inaccessible"}},
        {"a default-constructed Token", "Token token;", kLoad,
         {"no default constructor", "weft::device::Token"}},
        {"a forged WaitResult", "const Token token = WaitResult(true, Token::assume_local_data()).token();", kLoad,
         {"weft::device::WaitResult::WaitResult", "inaccessible"}},
        {"the TMA load called without a Token",
         "const Token token = Token::assume_local_data();",
         "tile::tma_load_2d(smem_addr, &map, bar_addr, 0, 0);",
         {"tile::tma_load_2d loads data another agent wrote and takes the Token of the wait"}},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.what);
        const Outcome r = compile(kernel_source(c.wait, c.load));
        EXPECT_FALSE(r.compiled) << "compiled, but should not: " << c.what;
        for (const std::string& words : c.log_says) {
            EXPECT_NE(r.log.find(words), std::string::npos) << "NVRTC's log lacks '" << words << "':\n" << r.log;
        }
    }
}

}  // namespace
}  // namespace weft
