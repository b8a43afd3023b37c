// SPDX-License-Identifier: MIT
// Kernel parameters of the check of a fused op's call across nodes (net_check_calls_kernel,
// kernels/tp_common/net_call_check.cuh): AgGemm and GemmRs on a team that spans nodes receive the call descriptor of
// the member of this rank's column on every other node before the call's rows cross the network; the comm stream
// runs this check next, so that calls that differ (their transfers differ in size, which NCCL does not define) end in
// a kCollectiveMismatch naming both calls, not in a network timeout: the World's abort aborts the communicators
// (within the watcher's ~20 ms), which ends the transfers queued behind the check. Kept apart from tp_params.hpp, which
// the one-node kernels include: their sources, and so their cache keys, stay as they are.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/macros.hpp"  // fixed-width integers under g++, nvcc and NVRTC

namespace weft {

/// At most this many descriptors per check (one per other node: at most 32 nodes).
inline constexpr int kNetCheckMaxCalls = 32;

/// words[index[i]], i < count, is the descriptor team rank peer[i] sent (the call zeroed the word before the exchange:
/// 0 = not arrived, skipped); each is compared with `signature` (this rank's call). One warp: lane i checks entry i;
/// the first difference is recorded (a kCollectiveMismatch naming peer[i]) and the World aborted, which aborts the
/// column's communicators and so ends the call's network steps.
struct NetCheckCallsParams {
    DeviceCtx ctx;
    const uint64_t* words;
    uint64_t signature;
    int32_t count;
    int32_t index[kNetCheckMaxCalls];
    int32_t peer[kNetCheckMaxCalls];
};

}  // namespace weft
