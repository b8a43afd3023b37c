// SPDX-License-Identifier: MIT
// Bounded spins: poll with backoff, stop at DeviceCtx::timeout_ns or when the World is aborted, leave a Diagnostic,
// raise the World's abort word, then end the thread (or return).
//
// Every wait in weft goes through one poll loop (detail::poll_bounded). It polls a 64-bit word with the requested
// load semantic, tight for the first kSpinFastPolls polls (so a signal that is about to arrive costs no sleep), then
// with __nanosleep backoff doubling up to kSpinMaxSleepNs. In the backoff phase it also reads the World's abort word
// (ctx.abort_flag, host-mapped) at its first step, then once every kSpinAbortPollNs of %globaltimer: the tight phase,
// where a signal round trip is measured, is the same code as without an abort word (no extra load; SpinSass tests
// check it). A wait ends in one of three ways:
//  - the word satisfied the comparison: the wait returns;
//  - ctx.timeout_ns passed (0 means kDefaultTimeoutNs, 10 minutes: a late peer is not a dead one; the host's
//    watchdog notices dead peers within seconds and sets the abort word);
//  - the abort word is non-zero (this rank's host, a peer through the store, or another wait on this rank).
// On either failure it records what it waited for in ctx.diag (rank, block, thread, word address and owner,
// expected and last observed value, source line, and whether the abort stopped it), raises the abort word (so that
// every other block and, through the host, every rank stops too), then:
//  - spin_until (the default) ends the thread with PTX `exit` (through the __noinline__ fail_and_exit, which keeps
//    the failure path out of every call site). The kernel ends normally once its threads have: the CUDA context
//    stays usable, and World::sync_and_check turns the record and the abort reason into a weft::Error;
//  - spin_until_checked returns a failed SpinResult instead: fully inline, no reachable call, exit or trap, for code
//    that must contain none (the GEMM's consumer warpgroups: with more than 128 live accumulator floats per thread, a
//    reachable trap or a call makes ptxas spill them and serialise every wgmma, warnings C7510/C7512). Its caller
//    ends the thread once it may (exit_unless, WaitResult::token_or_exit), hands the result on (a GEMM scheduler's
//    wait_before_load returns its WaitResult: the engine stops that CTA's waiting and runs its pipeline to the end),
//    or traps (trap_unless, token_or_trap).
//
// The rule for threads that end early (PTX `exit`), which every kernel built on these waits follows:
//  - A barrier of all the CTA's threads (__syncthreads, Block::sync/all/broadcast) and the warp's own barriers
//    (__syncwarp, votes: PTX waits for non-exited threads only) release the threads that remain. Such a thread goes
//    on past a wait that did not complete, on data that may be incomplete, until its own next bounded wait, which
//    sees the abort word and ends it too (within the tight phase and kSpinAbortPollNs). A shuffle from a lane that
//    exited returns an undefined value. So once a wait gives up, the op's outputs are undefined (its call throws on
//    every rank), but no thread hangs.
//  - A counted named barrier (Warpgroup::sync, bar.sync id, n) is released by a warp's arrival, which any one of its
//    non-exited lanes makes; a warp whose every lane exited never arrives, and an mbarrier never receives the
//    arrivals of threads that exited. So where a group synchronises through either, its threads must end together:
//    the device layer's group waits (tile::wait, tile::wait_each, shmem::barrier_all, block_barrier) reduce the
//    outcome over the group (Group::all) and then end every thread of the group at once; single-lane waits
//    (signal_wait_until's leader) leave the other lanes of the warp to arrive. Kernels with mbarrier pipelines (the
//    GEMM family) use the _checked forms and do not end a role early: their pipelines cannot drain once a role has
//    ended. The producer's wait that gives up stops waiting and the pipeline runs to its end (kernels/gemm); where
//    that does not fit (a wait among the consumers' live accumulators), they trap (trap_unless, token_or_trap).
// A hang is a bug; a timeout with a message is a diagnosis; a dead peer is an error that names it.
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
#ifndef WEFT_SPIN_ABORT_POLL_NS
#define WEFT_SPIN_ABORT_POLL_NS 16777216
#endif

namespace weft::device {

using ptx::Scope;
using ptx::Sem;

/// Polls without sleeping before the backoff starts.
inline constexpr uint32_t kSpinFastPolls = WEFT_SPIN_FAST_POLLS;
/// Longest single backoff sleep (the hardware sleeps up to twice this).
inline constexpr uint32_t kSpinMaxSleepNs = WEFT_SPIN_MAX_SLEEP_NS;
/// How often (in %globaltimer nanoseconds) a wait in its backoff phase reads the World's abort word: once at its first
/// backoff step, then once per this many nanoseconds of waiting (about 16 ms; the watchdog that raises the word acts
/// in seconds). Each read is a load of host-mapped memory across PCIe, and every waiting thread makes its own: with
/// thousands of threads waiting at once (ep::MoeBlock's fused combine: a lane per top-k slot of each token its warps
/// wait on) reads every few microseconds slowed the whole GPU several-fold on one H200 (docs/memory_model.md).
inline constexpr uint64_t kSpinAbortPollNs = WEFT_SPIN_ABORT_POLL_NS;
/// Used when ctx.timeout_ns is 0: ten minutes, so that a peer that starts late (checkpointing, data loading) is
/// waited for; dead peers are the host watchdog's (World, WEFT_DEAD_PEER_MS), which stops every wait in seconds.
inline constexpr uint64_t kDefaultTimeoutNs = 600ull * 1000 * 1000 * 1000;

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
    int32_t peer;  ///< team rank that owns the word (for barriers: the rank not yet arrived; for LL lines: the rank
                   ///< whose line has not come, though the line is in this rank's memory), or -1 to compute the
                   ///< owner from the address
    int32_t line;  ///< source line of the call, or 0
};

/// The outcome of spin_until_checked: `ok` false when the bound passed or the World was aborted first (the
/// Diagnostic is recorded, the abort word raised); `observed` is the value that satisfied the comparison, or the
/// last value read.
struct [[nodiscard]] SpinResult {
    uint64_t observed;
    bool ok;
};

/// The world rank a Diagnostic for `site` names as the owner of `addr` (site.peer, or the owner of the address
/// when site.peer is -1; kUnreachablePeer keeps site.peer as given), or -1 when unknown. Inline.
__device__ __forceinline__ int32_t diagnostic_peer(const DeviceCtx& ctx, SpinSite site, const void* addr) {
    int32_t peer = site.peer >= 0 || site.kind == SpinKind::kUnreachablePeer ? site.peer : owner_of(ctx, addr);
    if (peer >= 0 && peer < ctx.num_ranks && ctx.team_to_world != nullptr) {
        peer = ctx.team_to_world[peer];
    }
    return peer;
}

/// Records a failure in ctx.diag, first writer of the record wins (write_record_once: claimed 0 -> 1, the fields,
/// fence.sc.sys, claimed = 2), then waits until the record reads back complete (wait_record_complete: whether this
/// thread or another wrote it), so that a trap after it cannot lose it. Nothing when ctx.diag is null. The record
/// names ctx.world_rank, this block and thread, the word `addr` and its owner (diagnostic_peer), `cmp`,
/// `expected`, `observed`, `waited_ns`, site.line and `aborted` (the wait stopped because the abort word was set).
/// Inline: no call, no trap. Any thread.
__device__ __forceinline__ void record_diagnostic(const DeviceCtx& ctx, SpinSite site, Cmp cmp, const void* addr,
                                                  uint64_t expected, uint64_t observed, uint64_t waited_ns,
                                                  bool aborted = false) {
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
        d->aborted = aborted ? 1u : 0u;
    });
    wait_record_complete(&d->claimed);
}

/// Raises the World's abort word (0 -> kAbortByDeviceWait; a value already there, the host's included, stays), so
/// that every other wait of this rank stops and the host's watchdog tells the other ranks. Nothing when
/// ctx.abort_flag is null. Inline. Any thread.
__device__ __forceinline__ void raise_abort(const DeviceCtx& ctx) {
    if (ctx.abort_flag != nullptr) {
        // GPU scope, as in write_record_once: the device's raises are atomic among this GPU's threads; against the
        // host's own compare-and-swap (World::abort) it is not, so a raise within the same instant may replace the
        // host's code by this one: either way the World is aborted.
        (void)ptx::atom_cas<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(ctx.abort_flag, 0u, uint32_t{kAbortByDeviceWait});
    }
}

/// True when the World's abort word is set (one ld.relaxed.sys of host-mapped memory). Inline. Any thread.
__device__ __forceinline__ bool abort_requested(const DeviceCtx& ctx) {
    return ctx.abort_flag != nullptr && ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(ctx.abort_flag) != 0u;
}

/// Ends the calling thread (PTX `exit`): the kernel ends normally once all its threads have. See the rule at the
/// top of this file for barriers that the thread would have joined.
[[noreturn]] __device__ __forceinline__ void exit_thread() {
    asm volatile("exit;" ::: "memory");
    __builtin_unreachable();
}

/// Ends the calling thread when `ok` is false: the end of a *_checked call's failure (its Diagnostic is recorded,
/// the abort word raised) in code that may end but must not call. Call it where every thread of a group that
/// synchronises through a counted named barrier or an mbarrier ends together (a WaitResult's ok() is uniform over
/// its group). Inline.
__device__ __forceinline__ void exit_unless(bool ok) {
    if (!ok) {
        exit_thread();
    }
}

/// The failure path of the bounded waits that return: record_diagnostic (or, without a diagnostics buffer, one
/// printed line), then raise_abort. __noinline__: one function, not a copy at every wait.
__device__ __noinline__ inline void record_failure(DeviceCtx ctx, SpinSite site, Cmp cmp, const void* addr,
                                                   uint64_t expected, uint64_t observed, uint64_t waited_ns,
                                                   bool aborted) {
    if (ctx.diag != nullptr) {
        record_diagnostic(ctx, site, cmp, addr, expected, observed, waited_ns, aborted);
    } else {
        printf("weft: rank %d block (%d,%d,%d) thread %d %s (kind %u): word %p owned by rank %d, "
               "expected %llu (cmp %u), observed %llu after %llu ns (line %d)\n",
               ctx.world_rank, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z),
               static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)),
               aborted ? "stopped: the World was aborted" : "gave up", static_cast<unsigned>(site.kind), addr,
               diagnostic_peer(ctx, site, addr), static_cast<unsigned long long>(expected),
               static_cast<unsigned>(cmp), static_cast<unsigned long long>(observed),
               static_cast<unsigned long long>(waited_ns), site.line);
    }
    raise_abort(ctx);
}

/// record_failure, then `exit` (exit_thread). __noinline__: the failure path of spin_until and ll::wait_line.
[[noreturn]] __device__ __noinline__ inline void fail_and_exit(DeviceCtx ctx, SpinSite site, Cmp cmp,
                                                               const void* addr, uint64_t expected,
                                                               uint64_t observed, uint64_t waited_ns, bool aborted) {
    record_failure(ctx, site, cmp, addr, expected, observed, waited_ns, aborted);
    exit_thread();
}

/// record_failure, then `trap`: for programming errors that are not waits (a put to a rank that is not load/store
/// reachable, ranks calling different collectives), which end the kernel with an error that leaves the CUDA context
/// unusable. The abort word is raised first, so the other ranks stop rather than wait for this one. __noinline__.
[[noreturn]] __device__ __noinline__ inline void fail_and_trap(DeviceCtx ctx, SpinSite site, Cmp cmp,
                                                               const void* addr, uint64_t expected,
                                                               uint64_t observed, uint64_t waited_ns) {
    record_failure(ctx, site, cmp, addr, expected, observed, waited_ns, false);
    asm volatile("trap;");
    __builtin_unreachable();
}

/// Ends the kernel with `trap` when `ok` is false: the end of a *_checked call's failure (its Diagnostic is
/// recorded) where a trap may be reached but a call may not, in kernels whose mbarrier pipelines cannot drain once
/// a role has ended (the GEMM family). A trap leaves the CUDA context unusable: prefer exit_unless where the group
/// may end together. Inline.
__device__ __forceinline__ void trap_unless(bool ok) {
    if (!ok) {
        __trap();
    }
}

namespace detail {

/// The poll loop of every weft wait: calls `probe()` (true when the wait is over) until it returns true, tight for
/// kSpinFastPolls polls (the clock read every 8th: reading it costs more than a poll's issue), then with nanosleep
/// backoff from 32 ns doubling to kSpinMaxSleepNs (the clock read after every sleep, and the abort word `*abort_flag`
/// read when kSpinAbortPollNs passed since the last read). True when `probe` succeeded; false once more than
/// `timeout_ns` (0: kDefaultTimeoutNs) passed first, or, with *aborted set to true, when `*abort_flag` (null: never
/// read) was non-zero first; the time waited in *waited_ns on either failure. *aborted is written only then (the
/// caller initialises it). Inline; `probe` (a lambda) is inlined too.
/// NOTE: the tight phase is the code of a wait without an abort word: the abort read sits behind the sleep, and
/// nothing else is added to the path of a poll (SpinSass tests compare the two).
template <class Probe>
__device__ __forceinline__ bool poll_bounded(uint64_t timeout_ns, const uint32_t* abort_flag, Probe&& probe,
                                             uint64_t* waited_ns, bool* aborted) {
    if (probe()) {
        return true;
    }
    const uint64_t bound_ns = timeout_ns != 0 ? timeout_ns : kDefaultTimeoutNs;
    const uint64_t start = ptx::globaltimer();
    uint64_t next_abort_poll_ns = 0;  // the first backoff step reads it
    uint32_t polls = 0;
    uint32_t sleep_ns = 32;
    while (true) {
        if (probe()) {
            return true;
        }
        ++polls;
        if (polls < kSpinFastPolls) {
            // The tight phase: exactly the loop of a wait without an abort word.
            if ((polls & 7u) != 0) {
                continue;
            }
            const uint64_t waited = ptx::globaltimer() - start;
            if (waited > bound_ns) {
                *waited_ns = waited;
                return false;
            }
            continue;
        }
        ptx::nanosleep(sleep_ns);
        sleep_ns = sleep_ns < kSpinMaxSleepNs ? sleep_ns * 2 : kSpinMaxSleepNs;
        const uint64_t waited = ptx::globaltimer() - start;
        if (waited > bound_ns) {
            *waited_ns = waited;
            return false;
        }
        if (abort_flag != nullptr && waited >= next_abort_poll_ns) {
            next_abort_poll_ns = waited + kSpinAbortPollNs;
            if (ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(abort_flag) != 0u) {
                *waited_ns = waited;
                *aborted = true;
                return false;
            }
        }
    }
}

/// How a wait that fails ends: exit (spin_until), return after an inline record (spin_until_checked), or return
/// after the __noinline__ record_failure (the group waits, which then end the group together).
enum class OnFailure : uint32_t { kExit, kReturnInline, kReturnAfterCall };

/// The body of every spin_until form (see spin_until and spin_until_checked).
template <Sem S, Scope C, OnFailure F>
__device__ __forceinline__ SpinResult spin(const DeviceCtx& ctx, const uint64_t* addr, Cmp cmp, uint64_t value,
                                           SpinSite site) {
    static_assert(S == Sem::kAcquire || S == Sem::kRelaxed, "spin_until: semantic must be kAcquire or kRelaxed");
    uint64_t observed = 0;
    uint64_t waited_ns = 0;
    const auto probe = [&] {
        observed = ptx::ld<S, C>(addr);
        return compare(observed, cmp, value);
    };
    bool aborted = false;
    if (!poll_bounded(ctx.timeout_ns, ctx.abort_flag, probe, &waited_ns, &aborted)) {
        if constexpr (F == OnFailure::kExit) {
            fail_and_exit(ctx, site, cmp, addr, value, observed, waited_ns, aborted);
        } else if constexpr (F == OnFailure::kReturnAfterCall) {
            record_failure(ctx, site, cmp, addr, value, observed, waited_ns, aborted);
        } else {
            record_diagnostic(ctx, site, cmp, addr, value, observed, waited_ns, aborted);
            raise_abort(ctx);
        }
        return SpinResult{observed, false};
    }
    if constexpr (S == Sem::kRelaxed) {
        ptx::fence<Sem::kAcqRel, C>();
    }
    return SpinResult{observed, true};
}

}  // namespace detail

/// Polls `*addr` with load semantic S (kAcquire or kRelaxed) at scope C until `compare(*addr, cmp, value)`;
/// returns the value that satisfied it. With kRelaxed polls, one `fence.acq_rel.<C>` follows the successful poll,
/// so both forms give acquire ordering: reads after the call see every write that happened before the write that
/// satisfied the condition. Bounded: after ctx.timeout_ns, or once the World's abort word is set, it records a
/// Diagnostic for `site`, raises the abort word and ends the thread (fail_and_exit; the rule at the top of this
/// file). Per thread.
template <Sem S = Sem::kAcquire, Scope C = Scope::kSys>
__device__ __forceinline__ uint64_t spin_until(const DeviceCtx& ctx, const uint64_t* addr, Cmp cmp, uint64_t value,
                                               SpinSite site) {
    static_assert(S == Sem::kAcquire || S == Sem::kRelaxed, "spin_until: semantic must be kAcquire or kRelaxed");
    return detail::spin<S, C, detail::OnFailure::kExit>(ctx, addr, cmp, value, site).observed;
}

/// spin_until that returns instead of ending the thread: {value, true} as spin_until would return it (same polls,
/// same acquire ordering), or, once ctx.timeout_ns passed or the abort word was set, {last value read, false} after
/// recording the Diagnostic (record_diagnostic) and raising the abort word (no fence then: nothing was acquired).
/// Fully inline, no reachable call, exit or trap. The caller must end the thread once it may (exit_unless) and must
/// not publish anything computed from data the wait was guarding. Per thread.
template <Sem S = Sem::kAcquire, Scope C = Scope::kSys>
__device__ __forceinline__ SpinResult spin_until_checked(const DeviceCtx& ctx, const uint64_t* addr, Cmp cmp,
                                                         uint64_t value, SpinSite site) {
    static_assert(S == Sem::kAcquire || S == Sem::kRelaxed,
                  "spin_until_checked: semantic must be kAcquire or kRelaxed");
    return detail::spin<S, C, detail::OnFailure::kReturnInline>(ctx, addr, cmp, value, site);
}

/// spin_until_checked whose failure path is the __noinline__ record_failure (a call, fewer instructions per call
/// site): for the group waits, which reduce the outcome over the group and end it together. Per thread.
template <Sem S = Sem::kAcquire, Scope C = Scope::kSys>
__device__ __forceinline__ SpinResult spin_until_or_record(const DeviceCtx& ctx, const uint64_t* addr, Cmp cmp,
                                                           uint64_t value, SpinSite site) {
    static_assert(S == Sem::kAcquire || S == Sem::kRelaxed,
                  "spin_until_or_record: semantic must be kAcquire or kRelaxed");
    return detail::spin<S, C, detail::OnFailure::kReturnAfterCall>(ctx, addr, cmp, value, site);
}

}  // namespace weft::device
