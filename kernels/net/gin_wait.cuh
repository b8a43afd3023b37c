// SPDX-License-Identifier: MIT
// The bounded wait on a GIN signal, shared by the two ways kernels reach GIN (gin.cuh with nvcc, gin_jit.cuh from
// JIT kernels). Compiles under nvcc and NVRTC: it only needs a function that reads the signal.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/device/scope.cuh"
#include "weft/device/spin.cuh"

namespace weft::net::detail {

/// Group call: the group's leader polls `read_signal()` (an acquire read of this rank's signal `signal_idx`) until
/// it is >= `expected`, bounded like every weft wait (ctx.timeout_ns, the World's abort word); then the group
/// synchronises, so the puts that raised the signal are visible to every thread of it. On expiry the leader records
/// a Diagnostic (kind kSignalWait; the signal's index stands in for the address, as the signal lives in NCCL's
/// signal pool rather than the heap; `from_peer` is the team rank that owes it, -1 when unknown), raises the abort
/// word, and every thread of the group ends (exit). Returns the observed value to every thread.
template <class Group, class ReadSignal>
__device__ __forceinline__ uint64_t wait_signal_ge(Group group, const DeviceCtx& ctx, ReadSignal&& read_signal,
                                                   uint32_t signal_idx, uint64_t expected, int from_peer, int line) {
    bool ok = true;
    uint64_t observed = 0;
    if (group.is_leader()) {
        uint64_t waited_ns = 0;
        bool aborted = false;
        const auto probe = [&] {
            observed = read_signal();
            return observed >= expected;
        };
        ok = device::detail::poll_bounded(ctx.timeout_ns, ctx.abort_flag, probe, &waited_ns, &aborted);
        if (!ok) {
            device::record_failure(ctx, device::SpinSite{SpinKind::kSignalWait, from_peer, line}, Cmp::kGe,
                                   reinterpret_cast<const void*>(static_cast<uintptr_t>(signal_idx)), expected,
                                   observed, waited_ns, aborted);
        }
    }
    if (!group.all(ok)) {
        device::exit_thread();
    }
    return group.broadcast(observed);
}

}  // namespace weft::net::detail
