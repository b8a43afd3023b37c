// SPDX-License-Identifier: MIT
// The tile layer: Triton-distributed's primitives (rank, num_ranks, symm_at, wait, consume_token, notify), and
// peer_signal (a peer's signal word translated once for many notifies).
//
// A producer finishes a tile and raises one signal (notify); a consumer waits for the signals of the
// data its tile needs (wait) and receives a Token; the loads of that data take the Token
// (consume_token, or a TMA load that requires one), so they cannot be issued before the wait. Only a wait
// makes a Token (weft/device/token.cuh): a kernel that forgets the wait does not compile.
// Signal indices come from a tile map (weft/common/tile_map.hpp) that producer and consumer share.
//
//     Token t = tile::wait(Block{}, ctx, signals + r.first, r.count(), Cmp::kGe, epoch);
//     const bf16* a = tile::consume_token(a_ptr, t);      // loads through `a` follow the wait
//     tile::tma_load_2d(t, smem, &tma_a, bar, k0, m0);     // so does this TMA load
//     ...
//     tile::notify(Block{}, ctx, &signals[idx], peer, 1, SignalOp::kAdd);   // after the tile's stores
//
// A loop that signals the same peer's word many times translates it once: `PeerSignal s = tile::peer_signal(ctx,
// &signals[idx], peer);` outside the loop, `tile::notify(Block{}, s, 1);` inside.
//
// Group first, DeviceCtx second, as in the shmem layer; scope (and the wait's load semantic) are
// template parameters defaulting to system scope, which is correct between GPUs.
// Two forms of every bounded call: wait / wait_each end the group on failure (timeout, or the World aborted) with a
// Diagnostic, the abort word raised and PTX `exit` in every thread of the group together (spin.cuh), and notify
// traps on an unreachable peer (a programming error); wait_checked / wait_each_checked / notify_checked record the
// same Diagnostic and return the failure instead, fully inline with no reachable call, exit or trap, for code that
// must contain none (the GEMM's consumer warpgroups: see spin.cuh).
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/device/scope.cuh"
#include "weft/device/signal.cuh"
#include "weft/device/spin.cuh"
#include "weft/device/symmetric.cuh"
#include "weft/device/token.cuh"
#include "weft/device/trace.cuh"
#include "weft/ptx/fence.cuh"
#include "weft/ptx/tma.cuh"

namespace weft::device {
namespace detail {

template <class T>
inline constexpr bool kIsToken = false;
template <>
inline constexpr bool kIsToken<Token> = true;

#if defined(WEFT_TRACE)
/// A polling thread's "wait peer" event, written after the group's barrier (off the path of the group's other
/// threads); into the block's trace log at the slot the signal functor names for the peer when it names one
/// (trace_slot_of: the kernel flushes the log), else straight into the trace buffer.
struct PendingWait {
    uint64_t begin_ns = 0;
    uint64_t end_ns = 0;
    int32_t peer = -1;

    template <class SignalAt>
    __device__ __forceinline__ void write(const DeviceCtx& ctx, const SignalAt& signal_at, int line, uint64_t value) {
        if (peer < 0) return;
        if constexpr (requires { signal_at.trace_slot_of(peer); }) {
            trace::defer_span_at(ctx, signal_at.trace_slot_of(peer), TraceKind::kWaitPeer, TraceRole::kComm, begin_ns,
                                 end_ns, peer, line, static_cast<int32_t>(value), 0);
        } else {
            trace::record_span(ctx, TraceKind::kWaitPeer, TraceRole::kComm, begin_ns, end_ns, peer, line,
                               static_cast<int32_t>(value), 0);
        }
        peer = -1;
    }
};
#endif

/// The only maker of Tokens (Token's friend). Every member polls its signals (bounded), synchronises the group and
/// issues fence.proxy.async.global in every thread before it constructs a Token: keep it that way.
struct TokenIssuer {
    /// Thread i of the group polls `signal_at(j)` for j = i, i + size, ... < n (a pointer, or a SignalFrom naming
    /// the rank that raises it; skipping null signals), then the group synchronises, then every thread fences.
    /// A thread stops polling at its first failed signal (timeout or abort: Diagnostic recorded, abort word raised);
    /// the group barrier reduces the outcome (Group::all). Traced builds (weft/device/trace.cuh): a thread that polls
    /// a SignalFrom records "wait peer <its rank>" (args: the rank, `line`, the value awaited) after the group's
    /// barrier (into the block's trace log when the functor names a slot: trace_slot_of); bare pointers record nothing.
    /// kChecked: the result, uniform over the group, says whether all arrived (spin_until_checked: inline). Otherwise
    /// (spin_until_or_record: the failure path is a call) every thread of the group ends together with `exit` when any
    /// failed, and the result is the Token: ending the group together keeps a counted named barrier (Warpgroup) from
    /// waiting for a warp that exited.
    template <ptx::Scope C, ptx::Sem S, bool kChecked, class Group, class SignalAt>
    __device__ __forceinline__ static auto wait_each(Group group, const DeviceCtx& ctx, int n, SignalAt&& signal_at,
                                                     Cmp cmp, uint64_t value, int line) {
        static_assert(kIsGroup<Group>, "tile::wait: the group must be Thread, Warp, Warpgroup or Block");
        unsigned last = 0;
        bool ok = true;
        if constexpr (!kChecked) {
            // A negative count (an inverted range) is refused: no Token for signals never waited for. (Not in the
            // checked forms, which serve code among live accumulators: the record's registers would spill them.)
            if (n < 0) {
                ok = false;
                if (group.is_leader()) {
                    record_failure(ctx, SpinSite{SpinKind::kBadArgument, -1, line}, Cmp::kGe, nullptr, 0,
                                   static_cast<uint64_t>(static_cast<int64_t>(n)), kBadWaitCount, false);
                }
            }
        }
        WEFT_TRACE_DO(PendingWait pending);  // this thread's last "wait peer" event, written after the barrier
        for (int i = static_cast<int>(group.rank()); i < n; i += static_cast<int>(group.size())) {
            const auto at = signal_at(i);
            const uint64_t* signal = nullptr;
            SpinSite site{SpinKind::kTileWait, -1, line};
            if constexpr (requires { at.peer; }) {
                signal = at.signal;
                site.peer = at.peer;
            } else {
                signal = at;
            }
            if (signal == nullptr) {
                continue;
            }
            WEFT_TRACE_DO(pending.write(ctx, signal_at, line, value));  // a thread's earlier signal
            WEFT_TRACE_DECLARE(wait_t0);
            WEFT_TRACE_STAMP_IF(site.peer >= 0, wait_t0);
            SpinResult r;
            if constexpr (kChecked) {
                r = spin_until_checked<S, C>(ctx, signal, cmp, value, site);
            } else {
                r = spin_until_or_record<S, C>(ctx, signal, cmp, value, site);
            }
            WEFT_TRACE_DO(if (site.peer >= 0) pending = PendingWait{wait_t0, ptx::globaltimer(), site.peer});
            last = static_cast<unsigned>(r.observed);
            if (!r.ok) {
                ok = false;
                break;
            }
        }
        ok = group.all(ok);
        WEFT_TRACE_DO(pending.write(ctx, signal_at, line, value));
        if constexpr (kChecked) {
            ptx::fence_proxy_async_global();
            return WaitResult(ok, Token(last));
        } else {
            exit_unless(ok);
            ptx::fence_proxy_async_global();
            return Token(last);
        }
    }
};

}  // namespace detail

namespace tile {

using device::SignalOp;
using weft::Cmp;

/// This rank's index in ctx's team.
__device__ __forceinline__ int rank(const DeviceCtx& ctx) { return ctx.rank; }

/// Number of ranks in ctx's team.
__device__ __forceinline__ int num_ranks(const DeviceCtx& ctx) { return ctx.num_ranks; }

/// Rank `pe`'s copy of the symmetric object `ptr`, mapped for loads and stores, or nullptr when not
/// load/store reachable (then use the shmem put/get calls). Same as shmem::ptr.
template <class T>
__device__ __forceinline__ T* symm_at(const DeviceCtx& ctx, T* ptr, int pe) {
    return device::symm_at(ctx, ptr, pe);
}

/// Waits until every one of the `n` local signal words `signals[0..n)` satisfies
/// `compare(signal, cmp, value)`. Thread i of the group polls signals i, i + size, ... (bounded, with
/// backoff; S = kAcquire polls with ld.acquire.<C>, S = kRelaxed polls with ld.relaxed.<C> and issues
/// one fence.acq_rel.<C> after success); then the group synchronises and every thread issues
/// `fence.proxy.async.global`, so both its generic loads and its TMA loads of data released by the
/// signals' writers see that data. Every thread of the group calls; n may be 0 or any count (a negative one is
/// refused: a kBadArgument diagnostic and the group ends, as after a timeout; the _checked forms do not check it).
/// Bounded: after ctx.timeout_ns, or once the World is aborted, a kTileWait diagnostic names the first signal that
/// did not arrive, the abort word is raised, and every thread of the group ends together (`exit`).
template <ptx::Scope C = ptx::Scope::kSys, ptx::Sem S = ptx::Sem::kAcquire, class Group>
__device__ __forceinline__ Token wait(Group group, const DeviceCtx& ctx, const uint64_t* signals, int n, Cmp cmp,
                                      uint64_t value, int line = __builtin_LINE()) {
    return detail::TokenIssuer::wait_each<C, S, false>(
        group, ctx, n, [signals](int i) { return signals + i; }, cmp, value, line);
}

/// wait() that returns instead of trapping: on timeout the kTileWait Diagnostic is recorded (spin_until_checked),
/// the thread that timed out stops polling, and after the group barrier (which reduces the outcome: ok() is the
/// same in every thread) and the proxy fence the result says so (WaitResult). Fully inline, no reachable call
/// and no reachable trap.
template <ptx::Scope C = ptx::Scope::kSys, ptx::Sem S = ptx::Sem::kAcquire, class Group>
__device__ __forceinline__ WaitResult wait_checked(Group group, const DeviceCtx& ctx, const uint64_t* signals, int n,
                                                   Cmp cmp, uint64_t value, int line = __builtin_LINE()) {
    return detail::TokenIssuer::wait_each<C, S, true>(
        group, ctx, n, [signals](int i) { return signals + i; }, cmp, value, line);
}

/// A local signal word and the team rank expected to raise it (a timeout's Diagnostic names that rank as the
/// word's owner): what wait_each's `signal_at` may return instead of a bare pointer.
struct SignalFrom {
    const uint64_t* signal;
    int32_t peer;
};

/// wait() over signals that are not one contiguous run: the local words `signal_at(i)` for i in [0, n), where
/// `signal_at` (called with each i by the thread that polls it) returns the word, or nullptr for an i with nothing
/// to wait for (a strided counter layout, a range with this rank's own signals skipped, ...), or a SignalFrom{word,
/// rank} when a timeout should name the rank that was to raise the word. Same contract as wait().
template <ptx::Scope C = ptx::Scope::kSys, ptx::Sem S = ptx::Sem::kAcquire, class Group, class SignalAt>
__device__ __forceinline__ Token wait_each(Group group, const DeviceCtx& ctx, int n, SignalAt&& signal_at, Cmp cmp,
                                           uint64_t value, int line = __builtin_LINE()) {
    return detail::TokenIssuer::wait_each<C, S, false>(group, ctx, n, signal_at, cmp, value, line);
}

/// wait_each() that returns instead of trapping, as wait_checked().
template <ptx::Scope C = ptx::Scope::kSys, ptx::Sem S = ptx::Sem::kAcquire, class Group, class SignalAt>
__device__ __forceinline__ WaitResult wait_each_checked(Group group, const DeviceCtx& ctx, int n,
                                                        SignalAt&& signal_at, Cmp cmp, uint64_t value,
                                                        int line = __builtin_LINE()) {
    return detail::TokenIssuer::wait_each<C, S, true>(group, ctx, n, signal_at, cmp, value, line);
}

/// Returns `x` unchanged, but as a value the compiler must treat as computed from `token`: loads
/// through a pointer returned here cannot be scheduled before the wait that produced the token. An
/// empty `asm volatile` with a "memory" clobber ties the two (no instruction is emitted). Any 4- or
/// 8-byte T (pointers, integers, floats).
template <class T>
__device__ __forceinline__ T consume_token(T x, Token token) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "consume_token: 4- or 8-byte values (pointers, scalars)");
    if constexpr (sizeof(T) == 8) {
        auto bits = __builtin_bit_cast(unsigned long long, x);
        asm volatile("" : "+l"(bits) : "r"(token.value()) : "memory");
        return __builtin_bit_cast(T, bits);
    } else {
        auto bits = __builtin_bit_cast(unsigned, x);
        asm volatile("" : "+r"(bits) : "r"(token.value()) : "memory");
        return __builtin_bit_cast(T, bits);
    }
}

/// ptx::tma_load_2d of data a wait made visible: the load takes the wait's Token (whose fence.proxy.async.global
/// lets the async proxy see the data). The TMA instruction, the wait's polls and its fence are all `asm volatile`
/// with a "memory" clobber, which the compiler keeps in program order: the Token is the proof, no instruction.
__device__ __forceinline__ void tma_load_2d(Token token, unsigned smem_dst, const ptx::TmaDescriptor* desc,
                                            unsigned bar, int c0, int c1) {
    (void)token;
    ptx::tma_load_2d(smem_dst, desc, bar, c0, c1);
}

/// ptx::tma_load_3d of data a wait made visible (as tile::tma_load_2d).
__device__ __forceinline__ void tma_load_3d(Token token, unsigned smem_dst, const ptx::TmaDescriptor* desc,
                                            unsigned bar, int c0, int c1, int c2) {
    (void)token;
    ptx::tma_load_3d(smem_dst, desc, bar, c0, c1, c2);
}

/// ptx::tma_load_2d_multicast of data a wait made visible (as tile::tma_load_2d).
__device__ __forceinline__ void tma_load_2d_multicast(Token token, unsigned smem_dst, const ptx::TmaDescriptor* desc,
                                                      unsigned bar, int c0, int c1, unsigned short cta_mask) {
    (void)token;
    ptx::tma_load_2d_multicast(smem_dst, desc, bar, c0, c1, cta_mask);
}

/// A TMA load of waited-for data called without the wait's Token: does not compile, and says why.
template <class First, class... Rest>
    requires(!detail::kIsToken<First>)
__device__ void tma_load_2d(First, Rest...) {
    static_assert(detail::kIsToken<First>,
                  "tile::tma_load_2d loads data another agent wrote and takes the Token of the wait that made it "
                  "visible as its first argument: wait first (tile::wait), or pass Token::assume_local_data() for "
                  "data this rank wrote itself (or call ptx::tma_load_2d for data no wait guards)");
}

/// tma_load_2d_multicast without the wait's Token: does not compile, and says why (see tma_load_2d).
template <class First, class... Rest>
    requires(!detail::kIsToken<First>)
__device__ void tma_load_2d_multicast(First, Rest...) {
    static_assert(detail::kIsToken<First>,
                  "tile::tma_load_2d_multicast loads data another agent wrote and takes the Token of the wait that "
                  "made it visible as its first argument: wait first (tile::wait), or pass "
                  "Token::assume_local_data() for data this rank wrote itself");
}

/// Rank `pe`'s copy of a symmetric signal word, translated once (peer_signal) for notify to raise as often as it
/// likes: the translation (symm_at: a load of the peer-base table, which misses L1 after every acquire) then stays
/// out of a loop that signals the same peer again and again. Trivially copyable: keep it in a register, or pass it to
/// a kernel. Null only from peer_signal_checked when the peer is unreachable.
struct PeerSignal {
    uint64_t* remote = nullptr;
    __device__ __forceinline__ explicit operator bool() const { return remote != nullptr; }
};

/// PeerSignal for rank `pe`'s copy of `signal`; an unreachable `pe` ends the kernel with a kUnreachablePeer
/// diagnostic (symm_at_or_trap), as notify() does.
__device__ __forceinline__ PeerSignal peer_signal(const DeviceCtx& ctx, uint64_t* signal, int pe,
                                                  int line = __builtin_LINE()) {
    return PeerSignal{symm_at_or_trap(ctx, signal, pe, line)};
}

/// peer_signal() that returns a null PeerSignal, with the kUnreachablePeer diagnostic recorded, instead of trapping
/// (symm_at_checked). Fully inline, no reachable call and no reachable trap.
__device__ __forceinline__ PeerSignal peer_signal_checked(const DeviceCtx& ctx, uint64_t* signal, int pe,
                                                          int line = __builtin_LINE()) {
    return PeerSignal{symm_at_checked(ctx, signal, pe, line)};
}

/// notify() of a signal translated before (peer_signal): after a group barrier the leader raises `signal` (add or set
/// `value`) with release semantics at scope C. The same ordering as notify(); no address translation on the way.
/// `signal` must be non-null (peer_signal never returns null; test peer_signal_checked's result).
template <ptx::Scope C = ptx::Scope::kSys, class Group>
__device__ __forceinline__ void notify(Group group, PeerSignal signal, uint64_t value, SignalOp op = SignalOp::kAdd) {
    group.sync();
    if (group.is_leader()) {
        signal_release<C>(signal.remote, value, op);
    }
}

/// Raises rank `pe`'s copy of the symmetric signal word `signal` (add or set `value`) with release
/// semantics at scope C, after a group barrier: every write the group made before the call (to any
/// rank) is visible to whoever observes the new value. One thread (the leader) performs the update: a
/// `.sys` release costs a MEMBAR, so raise one signal per tile. Prefer kAdd with waits `>= epoch`.
/// An unreachable `pe` ends the kernel with a kUnreachablePeer diagnostic (symm_at_or_trap).
template <ptx::Scope C = ptx::Scope::kSys, class Group>
__device__ __forceinline__ void notify(Group group, const DeviceCtx& ctx, uint64_t* signal, int pe, uint64_t value,
                                       SignalOp op = SignalOp::kAdd, int line = __builtin_LINE()) {
    notify<C>(group, peer_signal(ctx, signal, pe, line), value, op);
}

/// notify() that returns instead of trapping: false, with the kUnreachablePeer diagnostic recorded, the abort word
/// raised and no signal raised (and no group barrier: every thread of the group finds the same), when `pe` is not
/// load/store reachable (symm_at_checked); otherwise notify() and true. Fully inline, no reachable call and no
/// reachable trap.
template <ptx::Scope C = ptx::Scope::kSys, class Group>
[[nodiscard]] __device__ __forceinline__ bool notify_checked(Group group, const DeviceCtx& ctx, uint64_t* signal,
                                                             int pe, uint64_t value, SignalOp op = SignalOp::kAdd,
                                                             int line = __builtin_LINE()) {
    const PeerSignal remote = peer_signal_checked(ctx, signal, pe, line);
    if (!remote) {
        return false;
    }
    notify<C>(group, remote, value, op);
    return true;
}

}  // namespace tile
}  // namespace weft::device
