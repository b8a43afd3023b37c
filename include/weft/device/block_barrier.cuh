// SPDX-License-Identifier: MIT
// block_barrier: the thread blocks with the same slot index on every rank of a team meet (add-only counters).
//
// Many-block collectives do not need a grid-wide barrier: block b of every rank exchanges data only with
// block b of the other ranks, so block b meets only them. Each rank keeps, per slot, one 64-bit arrival
// counter per peer in a symmetric array; arriving adds 1 to my counter on every peer (red.release.sys), waiting
// spins until every peer's counter here has reached the number of barriers this slot has completed + 1. Nothing
// is ever reset: the caller keeps that number (e.g. in its own device memory, advanced by the kernel itself, so
// CUDA graph replays stay in step), and it is the same on every rank as long as every rank runs the same
// sequence of kernels with the same grids. Add-only, so the protocol can move to a network transport that only
// has signal add.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/device/scope.cuh"
#include "weft/device/signal.cuh"
#include "weft/device/spin.cuh"
#include "weft/device/symmetric.cuh"
#include "weft/device/trace.cuh"

namespace weft::device {

/// Barrier of this block with the blocks of slot `slot` on every rank of ctx's team. Every thread of the block
/// calls it with the same arguments. `flags` is a symmetric array of at least (slot + 1) * n_pes zeroed words
/// (heap.alloc_signals) used by nothing else; `completed` is how many barriers this slot has completed before
/// (the same on every rank). Returns completed + 1, the value to pass next time.
///
/// Guarantees: every write the block made before the call (to any rank's memory) is visible to every peer block
/// after its call returns, and vice versa (block barrier, then thread t arrives at peer t with
/// red.release.sys.add and waits for peer t with ld.acquire.sys, then a block barrier). Bounded: a missing peer
/// (after ctx.timeout_ns), or an aborted World, ends the whole block (`exit`) with a kBarrier diagnostic naming the
/// counter word, and raises the abort word.
/// Traced builds (weft/device/trace.cuh): thread t records "wait peer t" (args: t, `line`, the count awaited).
__device__ __forceinline__ uint64_t block_barrier(Block block, const DeviceCtx& ctx, uint64_t* flags, uint32_t slot,
                                                  uint64_t completed, int line = __builtin_LINE()) {
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    uint64_t* row = flags + static_cast<uint64_t>(slot) * static_cast<uint64_t>(n);
    const uint64_t target = completed + 1;
    block.sync();  // the whole block's writes come before any arrival
    for (int t = static_cast<int>(block.rank()); t < n; t += static_cast<int>(block.size())) {
        if (t != me) {
            signal_release<ptx::Scope::kSys>(symm_at_or_trap(ctx, row + me, t, line), 1, SignalOp::kAdd);
        }
    }
    bool ok = true;
    for (int t = static_cast<int>(block.rank()); ok && t < n; t += static_cast<int>(block.size())) {
        if (t != me) {
            WEFT_TRACE_BEGIN(wait_t0);
            ok = spin_until_or_record<ptx::Sem::kAcquire, ptx::Scope::kSys>(ctx, row + t, Cmp::kGe, target,
                                                                            SpinSite{SpinKind::kBarrier, t, line})
                     .ok;
            WEFT_TRACE_RECORD(ctx, TraceKind::kWaitPeer, TraceRole::kComm, wait_t0, t, line,
                              static_cast<int32_t>(target), 0);
        }
    }
    exit_unless(block.all(ok));  // a wait that gave up ends the whole block together
    return target;
}

}  // namespace weft::device
