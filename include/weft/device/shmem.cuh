// SPDX-License-Identifier: MIT
// The shmem layer: OpenSHMEM 1.5 names and semantics inside kernels, with thread-group scopes.
//
// Conventions (read these once; every call follows them):
//  - Calls that a group can share take the group first and the DeviceCtx second:
//        shmem::putmem(Block{}, ctx, dest, source, bytes, pe);
//    every thread of the group calls with the same arguments (OpenSHMEM's _warp/_block variants).
//    Thread{} is the plain OpenSHMEM call.
//  - Single-word calls (p, g, signal_fetch) and queries (my_pe, n_pes, ptr) are per thread and take
//    the DeviceCtx first.
//  - `dest` of a put, `source` of a get and every signal word are symmetric (inside this rank's
//    symmetric heap); the call translates them to rank `pe`'s copy. A peer that is not load/store
//    reachable ends the kernel with a kUnreachablePeer diagnostic (only load/store transport exists).
//  - Ranks are the team ranks of `ctx` (ctx.rank, ctx.num_ranks).
//  - Synchronising operations are at system scope (.sys): correct between GPUs and with the host.
//  - Every wait is bounded by ctx.timeout_ns and by the World's abort word, and reports a Diagnostic when it gives up
//    (see spin.cuh: the thread, or the group, then ends with `exit`).
//  - The trailing `line` parameter defaults to the caller's source line (for diagnostics): leave it.
// Completion: with load/store transport a put's data is written by the time the call returns; `quiet`
// (or a signal, or barrier_all) makes it visible to other ranks in order. The _nbi variants skip the
// group barrier at the end of the blocking variants. See docs/memory_model.md for the guarantees.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/device/copy.cuh"
#include "weft/device/scope.cuh"
#include "weft/device/signal.cuh"
#include "weft/device/spin.cuh"
#include "weft/device/symmetric.cuh"
#include "weft/ptx/atom.cuh"
#include "weft/ptx/fence.cuh"
#include "weft/ptx/ld_st.cuh"

namespace weft::device::shmem {

using device::SignalOp;
using weft::Cmp;

/// This rank's index in ctx's team (nvshmem_my_pe).
__device__ __forceinline__ int my_pe(const DeviceCtx& ctx) { return ctx.rank; }

/// Number of ranks in ctx's team (nvshmem_n_pes).
__device__ __forceinline__ int n_pes(const DeviceCtx& ctx) { return ctx.num_ranks; }

/// Rank `pe`'s copy of the symmetric object `dest`, mapped for direct loads and stores, or nullptr when
/// not load/store reachable or `dest` is not symmetric (nvshmem_ptr).
template <class T>
__device__ __forceinline__ T* ptr(const DeviceCtx& ctx, T* dest, int pe) {
    return symm_at(ctx, dest, pe);
}

namespace detail {

/// Ends the kernel with a kBadArgument diagnostic when `group` cannot split a copy in this block: a Warp or Warpgroup
/// in a block whose thread count is not a multiple of its size (the missing lanes' share would not be copied, and
/// the signal after it would go out over part of the data), or a Warpgroup on a named barrier outside 1..15.
template <class Group>
__device__ __forceinline__ void check_group_or_trap(Group group, const DeviceCtx& ctx, int line) {
    if constexpr (Group::kBlockMultiple > 1) {
        const uint32_t threads = blockDim.x * blockDim.y * blockDim.z;
        if (threads % Group::kBlockMultiple != 0) {
            fail_and_trap(ctx, SpinSite{SpinKind::kBadArgument, -1, line}, Cmp::kEq, nullptr, Group::kBlockMultiple,
                          threads, kBadGroupSize);
        }
    }
    if constexpr (requires { group.barrier_id; }) {
        if (group.barrier_id - 1u >= 15u) {
            fail_and_trap(ctx, SpinSite{SpinKind::kBadArgument, -1, line}, Cmp::kEq, nullptr, 1, group.barrier_id,
                          kBadBarrierId);
        }
    }
}

}  // namespace detail

/// Copies `bytes` bytes from local `source` to symmetric `dest` on rank `pe`; the group shares the
/// copy (16-byte accesses where alignment allows). Returns when this thread's part is written; the
/// source may then be reused by this thread. Not ordered before later operations without fence/quiet.
template <class Group>
__device__ __forceinline__ void putmem_nbi(Group group, const DeviceCtx& ctx, void* dest, const void* source,
                                           uint64_t bytes, int pe, int line = __builtin_LINE()) {
    detail::check_group_or_trap(group, ctx, line);
    void* remote = symm_range_at_or_trap(ctx, dest, bytes, pe, line);
    copy(group, remote, source, bytes);
}

/// putmem_nbi followed by a group barrier: on return every thread of the group may reuse `source`.
template <class Group>
__device__ __forceinline__ void putmem(Group group, const DeviceCtx& ctx, void* dest, const void* source,
                                       uint64_t bytes, int pe, int line = __builtin_LINE()) {
    putmem_nbi(group, ctx, dest, source, bytes, pe, line);
    group.sync();
}

/// Copies `bytes` bytes from symmetric `source` on rank `pe` to local `dest`; the group shares the
/// copy. This thread's part of `dest` is written on return; all of it after quiet (or a group barrier).
template <class Group>
__device__ __forceinline__ void getmem_nbi(Group group, const DeviceCtx& ctx, void* dest, const void* source,
                                           uint64_t bytes, int pe, int line = __builtin_LINE()) {
    detail::check_group_or_trap(group, ctx, line);
    const void* remote = symm_range_at_or_trap(ctx, source, bytes, pe, line);
    copy(group, dest, remote, bytes);
}

/// getmem_nbi followed by a group barrier: on return all of `dest` holds the data, for every thread.
template <class Group>
__device__ __forceinline__ void getmem(Group group, const DeviceCtx& ctx, void* dest, const void* source,
                                       uint64_t bytes, int pe, int line = __builtin_LINE()) {
    getmem_nbi(group, ctx, dest, source, bytes, pe, line);
    group.sync();
}

/// Puts the data, then updates rank `pe`'s copy of the symmetric word `sig_addr` with `signal` by
/// `sig_op`, ordered after the data: a rank that observes the update (signal_wait_until, tile::wait)
/// sees all `bytes` bytes. Group barrier, then the leader's `red.release.sys.add` / `st.release.sys`.
template <class Group>
__device__ __forceinline__ void putmem_signal(Group group, const DeviceCtx& ctx, void* dest, const void* source,
                                              uint64_t bytes, uint64_t* sig_addr, uint64_t signal, SignalOp sig_op,
                                              int pe, int line = __builtin_LINE()) {
    detail::check_group_or_trap(group, ctx, line);
    void* remote = symm_range_at_or_trap(ctx, dest, bytes, pe, line);
    uint64_t* remote_sig = symm_at_or_trap(ctx, sig_addr, pe, line);
    copy(group, remote, source, bytes);
    group.sync();
    if (group.is_leader()) {
        signal_release<ptx::Scope::kSys>(remote_sig, signal, sig_op);
    }
}

/// Same as putmem_signal: with load/store transport the signal must follow the data anyway, so the
/// non-blocking form completes the same way (as NVSHMEM's peer-to-peer path does).
template <class Group>
__device__ __forceinline__ void putmem_signal_nbi(Group group, const DeviceCtx& ctx, void* dest, const void* source,
                                                  uint64_t bytes, uint64_t* sig_addr, uint64_t signal,
                                                  SignalOp sig_op, int pe, int line = __builtin_LINE()) {
    putmem_signal(group, ctx, dest, source, bytes, sig_addr, signal, sig_op, pe, line);
}

/// Updates rank `pe`'s copy of the symmetric word `sig_addr` (set or add `signal`) with release
/// semantics at system scope, after a group barrier: every write of the group before the call is
/// visible to a rank that observes the update. One thread (the group's leader) performs the update.
template <class Group>
__device__ __forceinline__ void signal_op(Group group, const DeviceCtx& ctx, uint64_t* sig_addr, uint64_t signal,
                                          SignalOp sig_op, int pe, int line = __builtin_LINE()) {
    uint64_t* remote_sig = symm_at_or_trap(ctx, sig_addr, pe, line);
    group.sync();
    if (group.is_leader()) {
        signal_release<ptx::Scope::kSys>(remote_sig, signal, sig_op);
    }
}

/// Reads the local signal word with acquire semantics at system scope (per thread).
__device__ __forceinline__ uint64_t signal_fetch(const DeviceCtx& /*ctx*/, const uint64_t* sig_addr) {
    return ptx::ld<ptx::Sem::kAcquire, ptx::Scope::kSys>(sig_addr);
}

/// Waits until the local signal word satisfies `compare(*sig_addr, cmp, value)`; returns the value
/// that satisfied it, to every thread of the group. The group's leader polls (ld.acquire.sys, bounded,
/// backoff), then the group synchronises, so every thread's later reads see the data the signal
/// released. Bounded: after ctx.timeout_ns, or once the World is aborted, the leader records a kSignalWait diagnostic
/// naming the word, raises the abort word and exits; the other threads go on to their own next wait (spin.cuh's
/// rule: one lane keeps the round trip at one barrier).
template <class Group>
__device__ __forceinline__ uint64_t signal_wait_until(Group group, const DeviceCtx& ctx, const uint64_t* sig_addr,
                                                      Cmp cmp, uint64_t value, int line = __builtin_LINE()) {
    uint64_t observed = 0;
    if (group.is_leader()) {
        observed = spin_until<ptx::Sem::kAcquire, ptx::Scope::kSys>(ctx, sig_addr, cmp, value,
                                                                    SpinSite{SpinKind::kSignalWait, -1, line});
    }
    return group.broadcast(observed);
}

/// Orders the group's earlier puts, gets and signal updates (to any rank) before its later ones.
/// Group barrier, then `fence.acq_rel.sys` in every thread. With load/store transport this is also
/// what quiet does.
template <class Group>
__device__ __forceinline__ void fence(Group group, const DeviceCtx& /*ctx*/) {
    group.sync();
    ptx::fence<ptx::Sem::kAcqRel, ptx::Scope::kSys>();
}

/// Completes the group's earlier puts and gets: their data is written, and visible to any rank that
/// synchronises with a later write of any thread of the group. Group barrier, then
/// `fence.acq_rel.sys` in every thread.
template <class Group>
__device__ __forceinline__ void quiet(Group group, const DeviceCtx& /*ctx*/) {
    group.sync();
    ptx::fence<ptx::Sem::kAcqRel, ptx::Scope::kSys>();
}

/// Barrier over all ranks of ctx's team that also completes every earlier put and signal of the group
/// (nvshmem_barrier_all). Exactly one group per rank calls it at a time (for a grid-wide barrier, sync
/// the grid first and let one block call it).
///
/// `psync`: a symmetric array of at least n_pes zero-initialised 64-bit words (heap.alloc_signals),
/// used by nothing else. It carries the epoch: rank r's word r counts its own barriers, and word q
/// counts rank q's arrivals here. Arrival is an add, the wait is `>= epoch`, so nothing is ever reset
/// between calls, kernels or graph replays. Bounded: after ctx.timeout_ns, or once the World is aborted, a kBarrier
/// diagnostic names the word of the missing rank, the abort word is raised and the whole group ends (`exit`).
template <class Group>
__device__ __forceinline__ void barrier_all(Group group, const DeviceCtx& ctx, uint64_t* psync,
                                         int line = __builtin_LINE()) {
    const int me = ctx.rank;
    const int n = ctx.num_ranks;
    group.sync();  // the group's writes come before the arrival; the previous epoch store is visible
    const uint64_t epoch = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(psync + me) + 1;
    for (int p = static_cast<int>(group.rank()); p < n; p += static_cast<int>(group.size())) {
        if (p != me) {
            ptx::red_add<ptx::Sem::kRelease, ptx::Scope::kSys>(symm_at_or_trap(ctx, psync + me, p, line), uint64_t{1});
        }
    }
    bool ok = true;
    for (int q = static_cast<int>(group.rank()); ok && q < n; q += static_cast<int>(group.size())) {
        if (q != me) {
            ok = spin_until_or_record<ptx::Sem::kAcquire, ptx::Scope::kSys>(ctx, psync + q, Cmp::kGe, epoch,
                                                                            SpinSite{SpinKind::kBarrier, q, line})
                     .ok;
        }
    }
    // Every thread is after every arrival; or, when a wait gave up, the whole group ends together.
    exit_unless(group.all(ok));
    if (group.is_leader()) {
        ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(psync + me, epoch);
    }
}

/// Barrier over all ranks (nvshmem_sync_all). OpenSHMEM only requires it to order local stores; with
/// load/store transport that already completes puts, so it is barrier_all. Same `psync` contract.
template <class Group>
__device__ __forceinline__ void sync_all(Group group, const DeviceCtx& ctx, uint64_t* psync,
                                         int line = __builtin_LINE()) {
    barrier_all(group, ctx, psync, line);
}

/// Writes one 4- or 8-byte value to symmetric `dest` on rank `pe` (st.relaxed.sys: a strong store, so
/// it may also serve as a flag after fence()). Per thread.
template <class T>
__device__ __forceinline__ void p(const DeviceCtx& ctx, T* dest, ptx::NoDeduce<T> value, int pe,
                                  int line = __builtin_LINE()) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shmem::p: 32- or 64-bit values only");
    ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(symm_at_or_trap(ctx, dest, pe, line), value);
}

/// Reads one 4- or 8-byte value from symmetric `source` on rank `pe` (ld.relaxed.sys). Per thread.
template <class T>
__device__ __forceinline__ T g(const DeviceCtx& ctx, const T* source, int pe, int line = __builtin_LINE()) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shmem::g: 32- or 64-bit values only");
    return ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(symm_at_or_trap(ctx, source, pe, line));
}

}  // namespace weft::device::shmem
