// SPDX-License-Identifier: MIT
// Bounded spins: poll with backoff, give up after DeviceCtx::timeout_ns, leave a Diagnostic, trap.
//
// Every wait in weft goes through spin_until(). It polls a 64-bit word with the requested load
// semantic, tight for the first kSpinFastPolls polls (so a signal that is about to arrive costs no
// sleep), then with __nanosleep backoff doubling up to kSpinMaxSleepNs. After ctx.timeout_ns (0 means
// kDefaultTimeoutNs) it records what it waited for in ctx.diag (rank, block, thread, word address and
// owner, expected and last observed value, source line) and executes `trap`, which ends the kernel with
// an error the host turns into a weft::Error (World::sync_and_check). A hang is a bug; a timeout with a
// message is a diagnosis.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/ptx/atom.cuh"
#include "weft/ptx/fence.cuh"
#include "weft/ptx/ld_st.cuh"
#include "weft/ptx/timer.cuh"

#if !defined(__CUDACC_RTC__)
#include <cstdio>  // device printf (NVRTC declares it itself)
#endif

#ifndef WEFT_SPIN_FAST_POLLS
#define WEFT_SPIN_FAST_POLLS 64
#endif
#ifndef WEFT_SPIN_MAX_SLEEP_NS
#define WEFT_SPIN_MAX_SLEEP_NS 1024
#endif

namespace weft::device {

using ptx::Scope;
using ptx::Sem;

/// Polls without sleeping before the backoff starts.
inline constexpr uint32_t kSpinFastPolls = WEFT_SPIN_FAST_POLLS;
/// Longest single backoff sleep (the hardware sleeps up to twice this).
inline constexpr uint32_t kSpinMaxSleepNs = WEFT_SPIN_MAX_SLEEP_NS;
/// Longest wait for the diagnostic record to reach host memory before the trap.
inline constexpr uint64_t kDiagnosticDrainNs = 100ull * 1000 * 1000;
/// Used when ctx.timeout_ns is 0.
inline constexpr uint64_t kDefaultTimeoutNs = 10ull * 1000 * 1000 * 1000;

/// Before a failed spin traps: waits (bounded by kDiagnosticDrainNs) until the record `d` reads back
/// complete (claimed == 2). A trap ends every thread of the grid at once and can drop writes still on
/// their way to host memory, so the winner that filled the record reads it back (a read does not pass the
/// posted writes before it), and the losers (threads that failed at the same moment) wait for the winner
/// instead of trapping over a half-written record. Every inline spin report calls it.
__device__ __forceinline__ void wait_for_diagnostic_record(Diagnostic* d) {
    const uint64_t drain_start = ptx::globaltimer();
    while (ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(&d->claimed) != 2u &&
           ptx::globaltimer() - drain_start < kDiagnosticDrainNs) {
        ptx::nanosleep(256);
    }
}

/// OpenSHMEM comparison of a signal word with a value (unsigned 64-bit).
__device__ __forceinline__ bool compare(uint64_t observed, Cmp cmp, uint64_t value) {
    switch (cmp) {
        case Cmp::kEq: return observed == value;
        case Cmp::kNe: return observed != value;
        case Cmp::kGt: return observed > value;
        case Cmp::kGe: return observed >= value;
        case Cmp::kLt: return observed < value;
        case Cmp::kLe: return observed <= value;
    }
    return false;
}

/// The team rank whose symmetric heap holds `addr` as mapped on this rank, or -1.
__device__ inline int32_t owner_of(const DeviceCtx& ctx, const void* addr) {
    const auto a = reinterpret_cast<uintptr_t>(addr);
    const auto in = [&](const uint8_t* base) {
        return base != nullptr && a >= reinterpret_cast<uintptr_t>(base) &&
               a - reinterpret_cast<uintptr_t>(base) < ctx.heap_bytes;
    };
    if (in(ctx.heap_base)) {
        return ctx.rank;
    }
    if (ctx.peer_bases != nullptr) {
        for (int32_t p = 0; p < ctx.num_ranks; ++p) {
            if (in(ctx.peer_bases[p])) {
                return p;
            }
        }
    }
    return -1;
}

/// What a failing spin (or failed peer access) reports besides the word and the values.
struct SpinSite {
    SpinKind kind;
    int32_t peer;  ///< team rank that owns the word (for barriers: the rank not yet arrived), or -1 to
                   ///< compute the owner from the address
    int32_t line;  ///< source line of the call, or 0
};

/// Records the failure in ctx.diag (first writer wins: claimed 0 -> 1, fields, system fence, 1 -> 2)
/// and traps. Without a diagnostics buffer it prints one line (which a trap may lose) and traps.
[[noreturn]] __device__ __noinline__ inline void fail_and_trap(DeviceCtx ctx, SpinSite site, Cmp cmp,
                                                               const void* addr, uint64_t expected,
                                                               uint64_t observed, uint64_t waited_ns) {
    int32_t peer = site.peer >= 0 || site.kind == SpinKind::kUnreachablePeer ? site.peer : owner_of(ctx, addr);
    if (peer >= 0 && ctx.team_to_world != nullptr) {
        peer = ctx.team_to_world[peer];
    }
    const int32_t thread = static_cast<int32_t>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
    Diagnostic* d = ctx.diag;
    if (d != nullptr) {
        if (ptx::atom_cas<Sem::kRelaxed, Scope::kSys>(&d->claimed, 0u, 1u) == 0u) {
            d->kind = site.kind;
            d->cmp = cmp;
            d->rank = ctx.world_rank;
            d->block_x = static_cast<int32_t>(blockIdx.x);
            d->block_y = static_cast<int32_t>(blockIdx.y);
            d->block_z = static_cast<int32_t>(blockIdx.z);
            d->thread_x = thread;
            d->signal_addr = reinterpret_cast<uintptr_t>(addr);
            d->expected = expected;
            d->observed = observed;
            d->waited_ns = waited_ns;
            d->peer = peer;
            d->line = site.line;
            ptx::fence<Sem::kSc, Scope::kSys>();
            ptx::st<Sem::kRelaxed, Scope::kSys>(&d->claimed, 2u);
            ptx::fence<Sem::kSc, Scope::kSys>();
        }
        wait_for_diagnostic_record(d);
    } else {
        printf("weft: rank %d block (%d,%d,%d) thread %d gave up (kind %u): word %p owned by rank %d, "
               "expected %llu (cmp %u), observed %llu after %llu ns (line %d)\n",
               ctx.world_rank, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z),
               thread, static_cast<unsigned>(site.kind), addr, peer, static_cast<unsigned long long>(expected),
               static_cast<unsigned>(cmp), static_cast<unsigned long long>(observed),
               static_cast<unsigned long long>(waited_ns), site.line);
    }
    asm volatile("trap;");
    __builtin_unreachable();
}

/// Polls `*addr` with load semantic S (kAcquire or kRelaxed) at scope C until `compare(*addr, cmp,
/// value)`; returns the value that satisfied it. With kRelaxed polls, one `fence.acq_rel.<C>` follows
/// the successful poll, so both forms give acquire ordering: reads after the call see every write that
/// happened before the write that satisfied the condition. Bounded: see the file comment.
template <Sem S = Sem::kAcquire, Scope C = Scope::kSys>
__device__ __forceinline__ uint64_t spin_until(const DeviceCtx& ctx, const uint64_t* addr, Cmp cmp, uint64_t value,
                                               SpinSite site) {
    static_assert(S == Sem::kAcquire || S == Sem::kRelaxed, "spin_until: semantic must be kAcquire or kRelaxed");
    uint64_t observed = ptx::ld<S, C>(addr);
    if (!compare(observed, cmp, value)) {
        const uint64_t timeout_ns = ctx.timeout_ns != 0 ? ctx.timeout_ns : kDefaultTimeoutNs;
        const uint64_t start = ptx::globaltimer();
        uint32_t polls = 0;
        uint32_t sleep_ns = 32;
        while (true) {
            observed = ptx::ld<S, C>(addr);
            if (compare(observed, cmp, value)) {
                break;
            }
            ++polls;
            // Tight polls first (the clock is read every 8th: reading it costs more than a poll's
            // issue), then exponential backoff with the clock read after every sleep.
            if (polls >= kSpinFastPolls) {
                ptx::nanosleep(sleep_ns);
                sleep_ns = sleep_ns < kSpinMaxSleepNs ? sleep_ns * 2 : kSpinMaxSleepNs;
            } else if ((polls & 7u) != 0) {
                continue;
            }
            const uint64_t waited = ptx::globaltimer() - start;
            if (waited > timeout_ns) {
                fail_and_trap(ctx, site, cmp, addr, value, observed, waited);
            }
        }
    }
    if constexpr (S == Sem::kRelaxed) {
        ptx::fence<Sem::kAcqRel, C>();
    }
    return observed;
}

}  // namespace weft::device
