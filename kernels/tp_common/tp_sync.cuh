// SPDX-License-Identifier: MIT
// Call-free signal operations for code that runs inside the GEMM's consumer warpgroups (epilogue hooks).
//
// WAR(ptxas, CUDA 13.0): any function call in the consumer warpgroups' code (the device layer's bounded
// spins report a timeout through a __noinline__ function) makes ptxas serialise every wgmma of the kernel
// (C7510) and spill around the call. These variants have the device layer's semantics (tile::notify /
// tile::wait with system scope, bounded, Diagnostic + trap on expiry) but are fully inline. Use the device
// layer everywhere else.
// WAR(ptxas, CUDA 13.0): a reachable trap while more than 128 accumulator floats per thread are live (a
// ping-pong 128x192 tile) makes ptxas spill them and serialise every wgmma (C7512). So the consumer
// warpgroups' hooks use the *_checked variants: they record the Diagnostic and return false, and the GEMM
// kernel traps once it has left its tile loop (gemm_sm90.cuh). The plain variants trap at once.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/device/spin.cuh"  // wait_for_diagnostic_record
#include "weft/device/symmetric.cuh"
#include "weft/ptx/atom.cuh"
#include "weft/ptx/fence.cuh"
#include "weft/ptx/ld_st.cuh"
#include "weft/ptx/timer.cuh"

namespace weft::tp {

/// Records a failed wait (or an unreachable peer) in ctx.diag, first writer wins, and returns once the record
/// is complete (the caller traps, now or after the GEMM's tile loop). Inline.
__device__ __forceinline__ void record_failure_inline(const DeviceCtx& ctx, SpinKind kind, const void* addr,
                                                      uint64_t expected, uint64_t observed, uint64_t waited_ns,
                                                      int32_t peer, int32_t line) {
    Diagnostic* d = ctx.diag;
    if (d != nullptr && ptx::atom_cas<ptx::Sem::kRelaxed, ptx::Scope::kSys>(&d->claimed, 0u, 1u) == 0u) {
        d->kind = kind;
        d->cmp = Cmp::kGe;
        d->rank = ctx.world_rank;
        d->block_x = static_cast<int32_t>(blockIdx.x);
        d->block_y = static_cast<int32_t>(blockIdx.y);
        d->block_z = static_cast<int32_t>(blockIdx.z);
        d->thread_x = static_cast<int32_t>(threadIdx.x);
        d->signal_addr = reinterpret_cast<uintptr_t>(addr);
        d->expected = expected;
        d->observed = observed;
        d->waited_ns = waited_ns;
        d->peer = peer;
        d->line = line;
        ptx::fence<ptx::Sem::kSc, ptx::Scope::kSys>();
        ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(&d->claimed, 2u);
        ptx::fence<ptx::Sem::kSc, ptx::Scope::kSys>();
    }
    if (d != nullptr) device::wait_for_diagnostic_record(d);  // e.g. the other consumer warpgroup failed too
}

/// Rank `pe`'s copy of the symmetric object `local`, or nullptr after recording a kUnreachablePeer diagnostic
/// when it is not load/store reachable. Inline.
template <class T>
__device__ __forceinline__ T* peer_checked_inline(const DeviceCtx& ctx, T* local, int pe, int32_t line) {
    T* p = device::symm_at(ctx, local, pe);
    if (p == nullptr) {
        record_failure_inline(ctx, SpinKind::kUnreachablePeer, local, static_cast<uint64_t>(pe), 0, 0, pe, line);
    }
    return p;
}

/// peer_checked_inline that traps when the peer is unreachable. Inline.
template <class T>
__device__ __forceinline__ T* peer_or_trap_inline(const DeviceCtx& ctx, T* local, int pe, int32_t line) {
    T* p = peer_checked_inline(ctx, local, pe, line);
    if (p == nullptr) __trap();
    return p;
}

/// One thread: rank pe's `*signal += value` with release semantics at system scope (tile::notify, kAdd);
/// false (diagnostic recorded, nothing raised) when pe is unreachable.
__device__ __forceinline__ bool notify_add_checked_inline(const DeviceCtx& ctx, uint64_t* signal, int pe,
                                                          uint64_t value, int32_t line) {
    uint64_t* const target = peer_checked_inline(ctx, signal, pe, line);
    if (target == nullptr) return false;
    ptx::red_add<ptx::Sem::kRelease, ptx::Scope::kSys>(target, value);
    return true;
}

/// notify_add_checked_inline that traps when pe is unreachable.
__device__ __forceinline__ void notify_add_inline(const DeviceCtx& ctx, uint64_t* signal, int pe, uint64_t value,
                                                  int32_t line) {
    if (!notify_add_checked_inline(ctx, signal, pe, value, line)) __trap();
}

/// One thread: waits until `*word >= value` (ld.acquire.sys polls with nanosleep backoff), bounded by
/// ctx.timeout_ns (10 s when 0), and stores the value it saw in *observed; on expiry records a kTileWait
/// diagnostic and returns false.
__device__ __forceinline__ bool wait_geq_checked_inline(const DeviceCtx& ctx, const uint64_t* word, uint64_t value,
                                                        int32_t line, uint64_t* observed) {
    uint64_t v = ptx::ld<ptx::Sem::kAcquire, ptx::Scope::kSys>(word);
    *observed = v;
    if (v >= value) return true;
    const uint64_t timeout_ns = ctx.timeout_ns != 0 ? ctx.timeout_ns : 10ull * 1000 * 1000 * 1000;
    const uint64_t start = ptx::globaltimer();
    uint32_t sleep_ns = 32;
    while (true) {
        ptx::nanosleep(sleep_ns);
        sleep_ns = sleep_ns < 1024 ? sleep_ns * 2 : 1024;
        v = ptx::ld<ptx::Sem::kAcquire, ptx::Scope::kSys>(word);
        *observed = v;
        if (v >= value) return true;
        const uint64_t waited = ptx::globaltimer() - start;
        if (waited > timeout_ns) {
            record_failure_inline(ctx, SpinKind::kTileWait, word, value, v, waited, ctx.world_rank, line);
            return false;
        }
    }
}

/// wait_geq_checked_inline that traps on expiry; returns the value it saw.
__device__ __forceinline__ uint64_t wait_geq_inline(const DeviceCtx& ctx, const uint64_t* word, uint64_t value,
                                                    int32_t line) {
    uint64_t v = 0;
    if (!wait_geq_checked_inline(ctx, word, value, line, &v)) __trap();
    return v;
}

}  // namespace weft::tp
