// SPDX-License-Identifier: MIT
// Unit tests (CPU): the GIN network backend. Its kernels build with nvcc (the cubin CMake makes) and hold the
// instructions of both NCCL GIN backends and of weft's bounded wait; under NVRTC the header refuses with its reason;
// the availability decision and the refusal text; the probe never throws.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "support/jit_testing.hpp"
#include "support/nvrtc_testing.hpp"
#include "support/sass_testing.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/runtime/error.hpp"
#include "weft/net/gin.hpp"

namespace weft {
namespace {

size_t count_of(const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
    return n;
}

TEST(GinKernels, NvccCubinHoldsBothGinBackendsAndTheBoundedWait) {
    const std::filesystem::path cubin = WEFT_GIN_CUBIN;
    ASSERT_TRUE(std::filesystem::is_regular_file(cubin)) << cubin << " was not built (target weft_gin_cubin)";
    std::string tool, why_not;
    const auto functions = testing::disassemble(cubin, &tool, &why_not);
    if (functions.empty()) GTEST_SKIP() << "no disassembler: " << why_not;
    std::string sass;
    for (const auto& [name, text] : functions) {
        if (name.find("gin_ring_put_tile") != std::string::npos) sass = text;
    }
    ASSERT_FALSE(sass.empty()) << "no gin_ring_put_tile in " << cubin << " (" << tool << ")";
    // GDAKI (the NIC driven from the GPU): the doorbell is an MMIO store to the NIC.
    EXPECT_GE(count_of(sass, "MMIO.SYS"), 1u) << "no GDAKI doorbell store";
    // The proxy (a CPU thread drives the NIC): a 64-byte descriptor in four 16-byte system-scope stores.
    EXPECT_GE(count_of(sass, "STG.E.128.STRONG.SYS"), 4u) << "no proxy descriptor stores";
    // weft's bounded wait: the timer read and the backoff sleep (NCCL's own waitSignal has neither).
    EXPECT_GE(count_of(sass, "GLOBALTIMER"), 1u) << "the signal wait reads no timer: unbounded?";
    EXPECT_GE(count_of(sass, "NANOSLEEP"), 1u) << "the signal wait has no backoff";
    EXPECT_GE(count_of(sass, "EXIT"), 2u) << "no early exit on a failed wait";
}

TEST(GinKernels, NvrtcCompileRefusesWithTheReason) {
    const auto r = testing::nvrtc_compile("#include \"net/gin_ring.cuh\"\n", "gin_nvrtc.cu", {});
    EXPECT_NE(r.result, NVRTC_SUCCESS);
    EXPECT_NE(r.log.find("needs nvcc: NVRTC cannot compile NCCL's GIN device headers"), std::string::npos) << r.log;
}

TEST(GinKernels, JitKernelLinksTheDeviceLibraryInline) {
    // NVRTC compiles the ring through GinLinked (no NCCL header), nvJitLink links weft's nvcc-built GIN library
    // with LTO: the kernel must hold NCCL's put code itself, inlined, and weft's bounded wait.
    jit::Compiler compiler(testing::isolated_compiler_config(std::filesystem::path()));
    jit::KernelSpec spec;
    spec.header = "net/gin_ring_linked.cuh";
    spec.instantiation = "weft::kernels::net::gin_ring_put_tile_linked";
    spec.arch = "sm_90a";
    spec.options.lto = true;
    spec.options.link_files = {net::GinBackend::device_library()};
    const jit::CompileResult r = compiler.compile(spec);
    ASSERT_TRUE(r.cubin && !r.cubin->empty());
    std::string tool, why_not;
    const auto functions = testing::disassemble(*r.cubin, &tool, &why_not);
    if (functions.empty()) GTEST_SKIP() << "no disassembler: " << why_not;
    const auto kernel = functions.find(r.lowered_name);
    ASSERT_NE(kernel, functions.end()) << r.lowered_name << " not in the linked cubin (" << tool << ")";
    const std::string& sass = kernel->second;
    EXPECT_GE(count_of(sass, "MMIO.SYS"), 1u) << "no GDAKI doorbell store";
    EXPECT_GE(count_of(sass, "STG.E.128.STRONG.SYS"), 4u) << "no proxy descriptor stores";
    EXPECT_GE(count_of(sass, "GLOBALTIMER"), 1u);
    EXPECT_GE(count_of(sass, "NANOSLEEP"), 1u);
    for (const auto& [name, text] : functions) {
        EXPECT_EQ(name.find("weft_gin_"), std::string::npos) << name << " was not inlined";
    }
}

TEST(GinKernels, DeviceLibraryOverrideMustBeAFile) {
    const testing::ScopedEnv env("WEFT_GIN_DEVICE_LIBRARY", "/nonexistent/weft_gin_device_sm90a.fatbin");
    try {
        (void)net::GinBackend::device_library();
        ADD_FAILURE() << "a missing WEFT_GIN_DEVICE_LIBRARY was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("WEFT_GIN_DEVICE_LIBRARY='/nonexistent/weft_gin_device_sm90a.fatbin' is "
                                             "not a file"),
                  std::string::npos)
            << e.what();
    }
}

net::GinProbeInputs ready_inputs() {
    net::GinProbeInputs in;
    in.nccl_version = 22809;
    in.gpu_visible = true;
    in.rdma_devices = {"mlx5_0", "mlx5_1"};
    return in;
}

TEST(GinProbe, AvailableWhenEveryRequirementHolds) {
    const auto a = net::decide_gin_availability(ready_inputs());
    EXPECT_TRUE(a.available);
    EXPECT_TRUE(a.reason.empty());
    EXPECT_EQ(a.nccl_version, 22809);
    EXPECT_EQ(a.rdma_devices.size(), 2u);
}

TEST(GinProbe, NamesTheFirstMissingRequirement) {
    {
        auto in = ready_inputs();
        in.nccl_version = 0;
        in.nccl_load_error = "cannot load libnccl.so.2";
        const auto a = net::decide_gin_availability(in);
        EXPECT_FALSE(a.available);
        EXPECT_NE(a.reason.find("cannot load libnccl.so.2"), std::string::npos) << a.reason;
    }
    {
        auto in = ready_inputs();
        in.nccl_version = 22703;
        const auto a = net::decide_gin_availability(in);
        EXPECT_FALSE(a.available);
        EXPECT_NE(a.reason.find("NCCL 2.27.3 has no GIN device API (needs 2.28 or newer)"), std::string::npos)
            << a.reason;
    }
    {
        auto in = ready_inputs();
        in.nccl_gin_enable = "0";
        const auto a = net::decide_gin_availability(in);
        EXPECT_FALSE(a.available);
        EXPECT_NE(a.reason.find("NCCL_GIN_ENABLE=0"), std::string::npos) << a.reason;
        in.nccl_gin_enable = "1";
        EXPECT_TRUE(net::decide_gin_availability(in).available);
    }
    {
        auto in = ready_inputs();
        in.gpu_visible = false;
        const auto a = net::decide_gin_availability(in);
        EXPECT_FALSE(a.available);
        EXPECT_NE(a.reason.find("no CUDA GPU"), std::string::npos) << a.reason;
    }
    {
        auto in = ready_inputs();
        in.rdma_devices.clear();
        const auto a = net::decide_gin_availability(in);
        EXPECT_FALSE(a.available);
        EXPECT_NE(a.reason.find("no RDMA device"), std::string::npos) << a.reason;
    }
}

TEST(GinProbe, NeverThrowsAndExplainsARefusal) {
    net::GinAvailability a;
    EXPECT_NO_THROW(a = net::GinBackend::probe());
    EXPECT_EQ(a.available, a.reason.empty()) << a.reason;
    EXPECT_EQ(net::GinBackend::available(), a.available);
    // This machine has the toolkit's NCCL (CI builds against it): the probe loads it and reads its version.
    EXPECT_GE(a.nccl_version, 22800) << a.reason;
    // No GPU, or a GPU without an RDMA NIC: both are refusals with a reason.
    const bool has_rdma = std::filesystem::exists("/sys/class/infiniband") &&
                          !std::filesystem::is_empty("/sys/class/infiniband");
    if (!has_rdma) {
        EXPECT_FALSE(a.available);
        EXPECT_FALSE(a.reason.empty());
    }
}

TEST(GinRefusal, SaysWhatWasAskedWhatNcclAnsweredAndTheFallback) {
    auto in = ready_inputs();
    in.rdma_devices.clear();
    const std::string text =
        net::gin_refusal_message("an NCCL device communicator with GIN (64 signals) over team world ranks 0, 1",
                                 "ncclDevCommCreate: invalid usage (ncclResult 5)", "GIN not supported.",
                                 net::decide_gin_availability(in));
    EXPECT_NE(text.find("GIN backend unavailable: an NCCL device communicator with GIN (64 signals)"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("NCCL answered ncclDevCommCreate: invalid usage (ncclResult 5): \"GIN not supported.\""),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("here: no RDMA device"), std::string::npos) << text;
    EXPECT_NE(text.find("NCCL host-API network backend"), std::string::npos) << text;
}

}  // namespace
}  // namespace weft
