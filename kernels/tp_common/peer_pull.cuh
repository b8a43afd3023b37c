// SPDX-License-Identifier: MIT
// The shared-GPU pull kernel: ranks of one process sharing a GPU pull their peers' shards with one CTA instead of
// copy-engine copies behind stream memory waits (cuStreamWaitValue). A stream memory wait blocks the hardware queue
// it sits in, and with many ranks' streams in one context CUDA puts several streams in one queue: the wait can hold
// up the very peer launch it waits for. A spinning kernel leaves its queue free (docs/runtime.md, "Shared GPUs").
// Used by weft::ops::AgGemm and weft::ops::AgAttention when ranks share a process and a GPU, and by the copy-engine
// all-gathers (src/ops/all_gather.cpp) of a rank that shares its GPU with ranks of its process, whose items also push
// into a peer's output and set flags on peers that may be on the process's other GPUs.
//
// JIT instantiation: weft::kernels::tp_common::peer_pull_kernel<0>
#pragma once

#include "weft/common/tp_params.hpp"
#include "weft/device/copy.cuh"
#include "weft/device/signal.cuh"
#include "weft/device/spin.cuh"
#include "weft/device/tile.cuh"
#include "weft/device/trace.cuh"

namespace weft::kernels::tp_common {

/// Runs p.items[0, p.num_items) in order with one CTA of kPeerPullThreads threads: wait (bounded, diagnosed; the CTA
/// ends together when the wait gives up) and compare the peer's call descriptor (p.signatures: a difference is
/// recorded, not fatal), copy, block barrier, then thread 0 sets the item's signal with release at system scope: the
/// signal is this rank's own (AgGemm, AgAttention: the waiting GEMM or attention kernel acquires it and fences the
/// async proxy itself) or a peer's flag (the copy-engine collectives), and that peer may sit on another GPU of this
/// process (a team that spans GPUs while some of them are shared). kUnused: a
/// template, so that a header included by several translation units defines no non-inline kernel.
template <int kUnused>
__global__ void __launch_bounds__(kPeerPullThreads, 1) peer_pull_kernel(const PeerPullParams p) {
    for (int i = 0; i < p.num_items; ++i) {
        const PeerPullItem& it = p.items[i];
        if (it.wait_ready != nullptr) {
            const device::tile::SignalFrom from{it.wait_ready, it.peer};
            device::exit_unless(device::tile::wait_each_checked(
                                    device::Block{}, p.ctx, 1, [from](int) { return from; }, Cmp::kGe, 1ull)
                                    .ok());
            // The peer stored its call's descriptor before the ready word this wait acquired.
            if (p.signatures != nullptr && threadIdx.x == 0) {
                const uint64_t theirs = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(p.signatures + it.peer);
                if (theirs != p.signature) {
                    device::record_diagnostic(p.ctx, device::SpinSite{SpinKind::kCollectiveMismatch, it.peer, __LINE__},
                                              Cmp::kEq, p.signatures + it.peer, p.signature, theirs, 0);
                }
            }
        }
        WEFT_TRACE_BEGIN(copy_t0);
        device::copy(device::Block{}, it.dst, it.src, it.bytes);
        __syncthreads();
        if (threadIdx.x == 0 && it.signal != nullptr) {
            __threadfence_system();  // every thread's bytes (ordered here by the barrier), before the flag
            device::signal_release<ptx::Scope::kSys>(it.signal, 1ull, device::SignalOp::kSet);
            WEFT_TRACE_RECORD(p.ctx, TraceKind::kCopyChunk, TraceRole::kComm, copy_t0, it.chunk, it.peer, 0, 0);
        }
    }
}

}  // namespace weft::kernels::tp_common
