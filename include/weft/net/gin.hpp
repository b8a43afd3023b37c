// SPDX-License-Identifier: MIT
// GinBackend: the network backend in which kernels post puts and signals themselves (NCCL's GIN), host side.
//
//     if (weft::net::GinBackend::available()) {
//         weft::net::GinBackend gin(world.team());       // collective over the team
//         launch(kernel, ctx, gin.device_comm(), gin.heap_window(), ...);   // nvcc kernel: kernels/net/gin.cuh
//         // JIT kernel (kernels/net/gin_jit.cuh): gin.device_comm_ptr(), linked with GinBackend::device_library()
//     }
//
// It registers the World's symmetric heap as an NCCL window and creates an ncclDevComm with GIN signals over an
// NCCL communicator of the team's ranks. GIN needs an RDMA NIC that NCCL can drive (InfiniBand or RoCE) and NCCL
// >= 2.28; where NCCL cannot give GIN the constructor throws weft::Error saying what was asked, what NCCL
// answered, and that the host-API backend is the fallback. Knobs, checks and the device calls: kernels/net/README.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nccl.h>
#include <nccl_device.h>

#include "weft/runtime/team.hpp"

namespace weft::net {

/// What GinBackend::probe() found. `available` is the cheap answer (NCCL >= 2.28 loads, a GPU is visible, GIN is
/// not disabled, an RDMA device exists); NCCL itself decides when a GinBackend is made.
struct GinAvailability {
    bool available = false;
    std::string reason;     ///< why not (empty when available), in plain words
    int nccl_version = 0;   ///< ncclGetVersion's code (22809 for 2.28.9), 0 when libnccl could not be loaded
    std::vector<std::string> rdma_devices;  ///< names under /sys/class/infiniband (mlx5_0 ...)
};

/// The inputs of the availability decision, gathered by GinBackend::probe() (a separate struct so that the
/// decision is a pure function, tested on the CPU).
struct GinProbeInputs {
    int nccl_version = 0;         ///< 0: libnccl.so.2 could not be loaded
    std::string nccl_load_error;  ///< dlerror() when it could not
    bool gpu_visible = false;
    std::string nccl_gin_enable;  ///< NCCL_GIN_ENABLE as set, empty when unset
    std::vector<std::string> rdma_devices;
};

/// The decision behind probe(): the first unmet requirement, in the order library, version, GIN_ENABLE, GPU, RDMA.
GinAvailability decide_gin_availability(const GinProbeInputs& inputs);

/// Options of a GinBackend: the GIN resources its ncclDevComm reserves.
struct GinOptions {
    int signal_count = 64;   ///< GIN signals (indices 0 .. signal_count-1 in kernels), > 0
    int counter_count = 0;   ///< GIN counters, >= 0
    int context_count = 1;   ///< a hint: NCCL may give a different number (NCCL_GIN_NCONTEXTS caps it)
};

/// An NCCL communicator over a team's ranks, the symmetric heap registered in it as a window, and an ncclDevComm
/// with GIN. Made and destroyed collectively by every member of the team (each blocks until all arrive, bounded by
/// the team's timeout). Not copyable; one per team at a time.
class GinBackend {
public:
    /// Collective over `team`: makes an NCCL communicator of its members (team rank 0 calls ncclGetUniqueId and
    /// the id travels through the team's all_gather), then as the other constructor. Throws weft::Error when this
    /// rank is not a member, when `options` are out of range, when libnccl >= 2.28 or a GPU is missing, when a
    /// member does not arrive within the team's timeout, and when NCCL refuses the window or GIN (the message
    /// names NCCL's answer and the host-API backend as the fallback). Nothing is left behind on failure.
    explicit GinBackend(const Team& team, const GinOptions& options = {});

    /// Collective over `team` with the caller's communicator, which must have exactly the team's ranks in team
    /// order (checked: ncclCommCount, ncclCommUserRank). The communicator stays the caller's: it must outlive this
    /// object and is not destroyed with it.
    GinBackend(const Team& team, ncclComm_t comm, const GinOptions& options = {});

    /// Collective: releases the devComm, the window and (when this object made it) the communicator.
    ~GinBackend();
    GinBackend(const GinBackend&) = delete;
    GinBackend& operator=(const GinBackend&) = delete;

    /// Cheap, never throws: whether GIN can be expected here (see GinAvailability). NCCL decides for certain when
    /// a GinBackend is made.
    static GinAvailability probe() noexcept;
    static bool available() noexcept { return probe().available; }

    /// The kernel arguments of kernels/net/gin.cuh (nvcc kernels): pass by value.
    const ncclDevComm& device_comm() const { return dev_comm_; }
    ncclWindow_t heap_window() const { return window_; }
    /// The same ncclDevComm in device memory, for JIT kernels (kernels/net/gin_jit.cuh's GinLinked).
    const void* device_comm_ptr() const { return dev_comm_device_; }

    /// weft's GIN device library for JIT kernels that include net/gin_jit.cuh: LTO IR for sm_90a, built by nvcc
    /// with libweft (kernels/net/gin_link.cuh). Pass it in CompileOptions::link_files with lto = true.
    /// Found at WEFT_GIN_DEVICE_LIBRARY (a path) when set, else in lib/ of the running program's folder or one of
    /// its parents (a build tree: build/lib/ for build/tests/x), else where libweft's build put it. Throws
    /// weft::Error naming the paths tried when none is a file.
    static std::string device_library();
    ncclComm_t comm() const { return comm_; }
    const GinOptions& options() const { return options_; }
    /// GIN contexts NCCL gave (kernels may pass any context index; it is taken modulo this).
    int context_count() const { return dev_comm_.ginContextCount; }

private:
    void init(const Team& team);
    void release() noexcept;

    Team team_;
    GinOptions options_;
    ncclComm_t comm_ = nullptr;
    bool owns_comm_ = false;
    ncclWindow_t window_ = nullptr;
    ncclDevComm dev_comm_{};
    bool has_dev_comm_ = false;
    void* dev_comm_device_ = nullptr;
};

/// The text of a refusal (exposed for tests): what was asked (`asked`), NCCL's answer (`nccl_result`, and its last
/// error line when non-empty), the probe's findings, and the fallback.
std::string gin_refusal_message(const std::string& asked, const std::string& nccl_result,
                                const std::string& nccl_last_error, const GinAvailability& probe);

}  // namespace weft::net
