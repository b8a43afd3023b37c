// SPDX-License-Identifier: MIT
// DeviceCtx: the small struct every weft kernel receives by value. No hidden global device state.
#pragma once

#include "weft/common/macros.hpp"  // fixed-width integers under g++, nvcc and NVRTC

#include "weft/common/diagnostics.hpp"

namespace weft {

/// Everything a kernel needs to talk to its peers. Built by the runtime (`World::device_ctx()` /
/// `Team::device_ctx()`); trivially copyable; passed by value as a kernel argument.
struct DeviceCtx {
    int32_t rank;                     ///< this rank's index in the team the kernel runs on
    int32_t num_ranks;                ///< team size
    uint8_t* heap_base;               ///< this rank's symmetric heap (device address)
    uint64_t heap_bytes;              ///< size of every rank's heap
    uint8_t* const* peer_bases;       ///< device array [num_ranks + 1]: peer heap bases mapped here, or
                                      ///< nullptr where the peer is not load/store reachable; then the
                                      ///< World's trace buffer or nullptr (include/weft/device/trace.cuh)
    int32_t sm_budget;                ///< SMs this rank's persistent kernels may occupy
    int32_t world_rank;               ///< this rank in the world (for diagnostics)
    uint64_t timeout_ns;              ///< every spin gives up after this long (WEFT_TIMEOUT_MS; 0: 10 min)
    Diagnostic* diag;                 ///< host-mapped record of the first timed-out spin, or nullptr
    const int32_t* team_to_world;     ///< device array [num_ranks]: team rank -> world rank, or nullptr
                                      ///< for the world team
    uint32_t* abort_flag;             ///< host-mapped abort word of the World (an AbortCode), or nullptr:
                                      ///< every bounded spin polls it and stops once it is non-zero
};

}  // namespace weft
