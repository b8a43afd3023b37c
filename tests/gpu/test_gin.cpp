// SPDX-License-Identifier: MIT
// GPU tests of the GIN network backend. Where NCCL cannot give GIN (no RDMA NIC: the test machines) making a
// GinBackend throws weft::Error in plain words, leaves nothing behind (a second attempt answers the same), and the
// probe says no with a reason. Where it can, the backend is made and reports its GIN contexts and signals. A JIT
// kernel linked with weft's GIN device library loads on the GPU (launching it needs a GIN devComm).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include <cuda_runtime.h>

#include "weft/jit/compiler.hpp"
#include "weft/net/gin.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

WorldOptions small_world() {
    WorldOptions options;
    options.heap_bytes = 64ull << 20;
    return options;
}

TEST(GinGpu, ProbeAgreesWithTheMachine) {
    ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU";
    const net::GinAvailability a = net::GinBackend::probe();
    std::printf("GIN probe: %s%s (NCCL version code %d, %zu RDMA devices)\n",
                a.available ? "available" : "unavailable: ", a.reason.c_str(), a.nccl_version, a.rdma_devices.size());
    EXPECT_GE(a.nccl_version, 22800);
    EXPECT_EQ(a.available, !a.rdma_devices.empty()) << a.reason;
}

TEST(GinGpu, RefusesInPlainWordsWithoutRdma) {
    ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU";
    if (net::GinBackend::available()) GTEST_SKIP() << "this machine has an RDMA NIC: GinGpu.MadeWhereRdmaExists runs";
    run_local(
        1,
        [](World& world) {
            for (int attempt = 0; attempt < 2; ++attempt) {
                try {
                    net::GinBackend gin(world.team());
                    ADD_FAILURE() << "GinBackend was made without an RDMA NIC";
                } catch (const Error& e) {
                    const std::string what = e.what();
                    std::printf("GIN refusal (attempt %d): %s\n", attempt, what.c_str());
                    EXPECT_NE(what.find("GIN backend unavailable: an NCCL device communicator with GIN"),
                              std::string::npos)
                        << what;
                    EXPECT_NE(what.find("NCCL answered"), std::string::npos) << what;
                    EXPECT_NE(what.find("no RDMA device"), std::string::npos) << what;
                    EXPECT_NE(what.find("NCCL host-API network backend"), std::string::npos) << what;
                }
            }
            // The refusal left the World usable.
            world.barrier();
            void* p = world.heap().alloc(4096);
            world.heap().free(p);
        },
        small_world());
}

TEST(GinGpu, MadeWhereRdmaExists) {
    ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU";
    if (!net::GinBackend::available()) GTEST_SKIP() << "no RDMA NIC here: " << net::GinBackend::probe().reason;
    run_local(
        1,
        [](World& world) {
            net::GinOptions options;
            options.signal_count = 8;
            net::GinBackend gin(world.team(), options);
            EXPECT_NE(gin.heap_window(), nullptr);
            EXPECT_GT(gin.context_count(), 0);
            EXPECT_GE(gin.device_comm().ginSignalCount, 8);
        },
        small_world());
}

TEST(GinGpu, LinkedJitKernelLoads) {
    ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaFree(nullptr), cudaSuccess);  // the primary context, current on this thread
    jit::KernelSpec spec;
    spec.header = "net/gin_ring_linked.cuh";
    spec.instantiation = "weft::kernels::net::gin_ring_put_tile_linked";
    spec.options.lto = true;
    spec.options.link_files = {net::GinBackend::device_library()};
    EXPECT_NO_THROW((void)jit::compiler().get_kernel(spec));
}

TEST(GinGpu, RejectsBadOptions) {
    ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU";
    run_local(
        1,
        [](World& world) {
            net::GinOptions options;
            options.signal_count = 0;
            try {
                net::GinBackend gin(world.team(), options);
                ADD_FAILURE() << "signal_count 0 was accepted";
            } catch (const Error& e) {
                EXPECT_NE(std::string(e.what()).find("GinOptions.signal_count must be > 0, got 0"),
                          std::string::npos)
                    << e.what();
            }
        },
        small_world());
}

}  // namespace
}  // namespace weft::test
