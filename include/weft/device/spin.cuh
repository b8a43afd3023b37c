// SPDX-License-Identifier: MIT
// Bounded spins: poll with backoff, give up after DeviceCtx::timeout_ns, leave a Diagnostic, then trap (or return).
//
// Every wait in weft goes through one poll loop. It polls a 64-bit word with the requested load semantic, tight
// for the first kSpinFastPolls polls (so a signal that is about to arrive costs no sleep), then with __nanosleep
// backoff doubling up to kSpinMaxSleepNs. After ctx.timeout_ns (0 means kDefaultTimeoutNs) it records what it
// waited for in ctx.diag (rank, block, thread, word address and owner, expected and last observed value, source
// line). Then one of two forms ends it:
//  - spin_until (the default) executes `trap` (through the __noinline__ fail_and_trap, which keeps the failure
//    path out of every call site), which ends the kernel with an error the host turns into a weft::Error
//    (World::sync_and_check);
//  - spin_until_checked returns a failed SpinResult instead: fully inline, no reachable call and no reachable trap,
//    for code that must not contain either (the GEMM's consumer warpgroups: with more than 128 live accumulator
//    floats per thread, a reachable trap or a call makes ptxas spill them and serialise every wgmma, warnings
//    C7510/C7512). Its caller ends the kernel once it may (the GEMM traps after its tile loop).
// A hang is a bug; a timeout with a message is a diagnosis.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/device/record.cuh"
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
/// Used when ctx.timeout_ns is 0.
inline constexpr uint64_t kDefaultTimeoutNs = 10ull * 1000 * 1000 * 1000;

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
__device__ __forceinline__ int32_t owner_of(const DeviceCtx& ctx, const void* addr) {
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

/// The outcome of spin_until_checked: `ok` false when the bound passed first (the Diagnostic is recorded);
/// `observed` is the value that satisfied the comparison, or the last value read.
struct [[nodiscard]] SpinResult {
    uint64_t observed;
    bool ok;
};

/// The world rank a Diagnostic for `site` names as the owner of `addr` (site.peer, or the owner of the address
/// when site.peer is -1; kUnreachablePeer keeps site.peer as given), or -1 when unknown. Inline.
__device__ __forceinline__ int32_t diagnostic_peer(const DeviceCtx& ctx, SpinSite site, const void* addr) {
    int32_t peer = site.peer >= 0 || site.kind == SpinKind::kUnreachablePeer ? site.peer : owner_of(ctx, addr);
    if (peer >= 0 && ctx.team_to_world != nullptr) {
        peer = ctx.team_to_world[peer];
    }
    return peer;
}

/// Records a failure in ctx.diag, first writer of the record wins (write_record_once: claimed 0 -> 1, the fields,
/// fence.sc.sys, claimed = 2), then waits until the record reads back complete (wait_record_complete: whether this
/// thread or another wrote it), so that a trap after it cannot lose it. Nothing when ctx.diag is null. The record
/// names ctx.world_rank, this block and thread, the word `addr` and its owner (diagnostic_peer), `cmp`,
/// `expected`, `observed`, `waited_ns` and site.line. Inline: no call, no trap. Any thread.
__device__ __forceinline__ void record_diagnostic(const DeviceCtx& ctx, SpinSite site, Cmp cmp, const void* addr,
                                                  uint64_t expected, uint64_t observed, uint64_t waited_ns) {
    Diagnostic* d = ctx.diag;
    if (d == nullptr) {
        return;
    }
    write_record_once(&d->claimed, [&] {
        d->kind = site.kind;
        d->cmp = cmp;
        d->rank = ctx.world_rank;
        d->block_x = static_cast<int32_t>(blockIdx.x);
        d->block_y = static_cast<int32_t>(blockIdx.y);
        d->block_z = static_cast<int32_t>(blockIdx.z);
        d->thread_x = static_cast<int32_t>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
        d->signal_addr = reinterpret_cast<uintptr_t>(addr);
        d->expected = expected;
        d->observed = observed;
        d->waited_ns = waited_ns;
        d->peer = diagnostic_peer(ctx, site, addr);
        d->line = site.line;
    });
    wait_record_complete(&d->claimed);
}

/// record_diagnostic, then `trap`. Without a diagnostics buffer it prints one line instead (which the trap may
/// lose). __noinline__: the failure path is one function, not a copy at every wait.
[[noreturn]] __device__ __noinline__ inline void fail_and_trap(DeviceCtx ctx, SpinSite site, Cmp cmp,
                                                               const void* addr, uint64_t expected,
                                                               uint64_t observed, uint64_t waited_ns) {
    if (ctx.diag != nullptr) {
        record_diagnostic(ctx, site, cmp, addr, expected, observed, waited_ns);
    } else {
        printf("weft: rank %d block (%d,%d,%d) thread %d gave up (kind %u): word %p owned by rank %d, "
               "expected %llu (cmp %u), observed %llu after %llu ns (line %d)\n",
               ctx.world_rank, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z),
               static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)),
               static_cast<unsigned>(site.kind), addr, diagnostic_peer(ctx, site, addr),
               static_cast<unsigned long long>(expected), static_cast<unsigned>(cmp),
               static_cast<unsigned long long>(observed), static_cast<unsigned long long>(waited_ns), site.line);
    }
    asm volatile("trap;");
    __builtin_unreachable();
}

/// Ends the kernel with `trap` when `ok` is false: the end of a *_checked call's failure (its Diagnostic is
/// recorded) where a trap may be reached but a call may not (the GEMM kernel outside its consumers' tile loop).
/// Inline.
__device__ __forceinline__ void trap_unless(bool ok) {
    if (!ok) {
        __trap();
    }
}

namespace detail {

/// The poll loop of every weft wait: calls `probe()` (true when the wait is over) until it returns true, tight for
/// kSpinFastPolls polls (the clock read every 8th: reading it costs more than a poll's issue), then with nanosleep
/// backoff from 32 ns doubling to kSpinMaxSleepNs (the clock read after every sleep). True when `probe` succeeded;
/// false once more than `timeout_ns` (0: kDefaultTimeoutNs) passed first, with the time waited in *waited_ns.
/// Inline; `probe` (a lambda) is inlined too.
template <class Probe>
__device__ __forceinline__ bool poll_bounded(uint64_t timeout_ns, Probe&& probe, uint64_t* waited_ns) {
    if (probe()) {
        return true;
    }
    const uint64_t bound_ns = timeout_ns != 0 ? timeout_ns : kDefaultTimeoutNs;
    const uint64_t start = ptx::globaltimer();
    uint32_t polls = 0;
    uint32_t sleep_ns = 32;
    while (true) {
        if (probe()) {
            return true;
        }
        ++polls;
        if (polls >= kSpinFastPolls) {
            ptx::nanosleep(sleep_ns);
            sleep_ns = sleep_ns < kSpinMaxSleepNs ? sleep_ns * 2 : kSpinMaxSleepNs;
        } else if ((polls & 7u) != 0) {
            continue;
        }
        const uint64_t waited = ptx::globaltimer() - start;
        if (waited > bound_ns) {
            *waited_ns = waited;
            return false;
        }
    }
}

}  // namespace detail

/// Polls `*addr` with load semantic S (kAcquire or kRelaxed) at scope C until `compare(*addr, cmp, value)`;
/// returns the value that satisfied it. With kRelaxed polls, one `fence.acq_rel.<C>` follows the successful poll,
/// so both forms give acquire ordering: reads after the call see every write that happened before the write that
/// satisfied the condition. Bounded: after ctx.timeout_ns it records a Diagnostic for `site` and traps. Per thread.
template <Sem S = Sem::kAcquire, Scope C = Scope::kSys>
__device__ __forceinline__ uint64_t spin_until(const DeviceCtx& ctx, const uint64_t* addr, Cmp cmp, uint64_t value,
                                               SpinSite site) {
    static_assert(S == Sem::kAcquire || S == Sem::kRelaxed, "spin_until: semantic must be kAcquire or kRelaxed");
    uint64_t observed = 0;
    uint64_t waited_ns = 0;
    const auto probe = [&] {
        observed = ptx::ld<S, C>(addr);
        return compare(observed, cmp, value);
    };
    if (!detail::poll_bounded(ctx.timeout_ns, probe, &waited_ns)) {
        fail_and_trap(ctx, site, cmp, addr, value, observed, waited_ns);
    }
    if constexpr (S == Sem::kRelaxed) {
        ptx::fence<Sem::kAcqRel, C>();
    }
    return observed;
}

/// spin_until that returns instead of trapping: {value, true} as spin_until would return it (same polls, same
/// acquire ordering), or, once ctx.timeout_ns passed, {last value read, false} after recording the Diagnostic
/// (record_diagnostic; no fence then: nothing was acquired). Fully inline, no reachable call and no reachable trap.
/// The caller must end the kernel (trap) once it may, and must not publish anything computed from data the wait
/// was guarding. Per thread.
template <Sem S = Sem::kAcquire, Scope C = Scope::kSys>
__device__ __forceinline__ SpinResult spin_until_checked(const DeviceCtx& ctx, const uint64_t* addr, Cmp cmp,
                                                         uint64_t value, SpinSite site) {
    static_assert(S == Sem::kAcquire || S == Sem::kRelaxed,
                  "spin_until_checked: semantic must be kAcquire or kRelaxed");
    uint64_t observed = 0;
    uint64_t waited_ns = 0;
    const auto probe = [&] {
        observed = ptx::ld<S, C>(addr);
        return compare(observed, cmp, value);
    };
    if (!detail::poll_bounded(ctx.timeout_ns, probe, &waited_ns)) {
        record_diagnostic(ctx, site, cmp, addr, value, observed, waited_ns);
        return SpinResult{observed, false};
    }
    if constexpr (S == Sem::kRelaxed) {
        ptx::fence<Sem::kAcqRel, C>();
    }
    return SpinResult{observed, true};
}

}  // namespace weft::device
