// SPDX-License-Identifier: MIT
// The check of a fused op's call across nodes (weft/common/net_call_check.hpp; docs/multinode.md): AgGemm and GemmRs
// on a team that spans nodes launch it on their comm stream after the call descriptors crossed the network and before
// the call's rows do.
//
// JIT instantiation (weft::ops::AgGemm and GemmRs build it for a team that spans nodes):
//   weft::kernels::tp_common::net_check_calls_kernel
#pragma once

#include "weft/common/net_call_check.hpp"
#include "weft/device/spin.cuh"

namespace weft::kernels::tp_common {

/// One warp. Plain loads: the descriptors were received by NCCL before this launch, in the comm stream's order. A word
/// still 0 (the call zeroed it before the exchange; no descriptor is 0) did not arrive: the World was aborted for
/// another reason, which is the diagnosis, and the communicator's abort ended the receive.
__global__ void __launch_bounds__(32) net_check_calls_kernel(const NetCheckCallsParams p) {
    const int32_t i = static_cast<int32_t>(threadIdx.x);
    if (i >= p.count) return;
    const uint64_t* word = p.words + p.index[i];
    const uint64_t theirs = *word;
    if (theirs != 0 && theirs != p.signature) {
        device::record_diagnostic(p.ctx, device::SpinSite{SpinKind::kCollectiveMismatch, p.peer[i], __LINE__}, Cmp::kEq,
                                  word, p.signature, theirs, 0);
        device::raise_abort(p.ctx);
    }
}

}  // namespace weft::kernels::tp_common
