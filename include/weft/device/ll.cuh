// SPDX-License-Identifier: MIT
// LL (low-latency) lines: data and flag travel in one 8-byte word, so a receiver polls the data itself.
//
// A line is 16 bytes holding 8 bytes of payload as two words {payload.x, flag} and {payload.y, flag} (data in
// the low half, flag in the high half). The sender writes a line with one st.relaxed.sys.v2.b64; PTX makes each
// 8-byte element single-copy atomic, so a receiver that reads a word carrying the expected flag also reads the
// data written with it. No fence, no separate signal, no round trip: the receiver spins on the line until both
// words carry the flag. Buffers are reused without clearing by changing the flag every call (an epoch, see
// weft::low_latency_flag), with two buffers alternating so that a fast sender never overwrites a line a slow
// receiver has not read yet (the caller's protocol must guarantee that a sender is at most one call ahead).
//
//     ll::store_line(ptr_to_peer_line, payload, flag);                // sender, per thread
//     uint2 v = ll::wait_line(ctx, my_line, flag);                     // receiver, bounded
//
// wait_line ends the thread that gives up (PTX `exit`): safe before a barrier of the whole block (__syncthreads,
// Block) or of the warp, which release the threads that remain, but not before a counted named barrier (Warpgroup,
// bar.sync id, n) or an mbarrier arrive: a warp whose lanes all gave up never arrives there, and the rest wait for
// it without bound. There, wait with wait_line_checked and end the group together:
//
//     uint2 v;
//     const bool ok = ll::wait_line_checked(ctx, my_line, flag, &v);
//     device::exit_unless(Warpgroup{1}.all(ok));                         // every thread, or none, goes on
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/device/spin.cuh"
#include "weft/ptx/ld_st.cuh"

namespace weft::device::ll {

/// Bytes of one line and of its payload.
inline constexpr uint32_t kLineBytes = 16;
inline constexpr uint32_t kPayloadBytes = 8;

/// The line's two words for `payload` and `flag`.
__device__ __forceinline__ ulonglong2 pack(uint2 payload, uint32_t flag) {
    ulonglong2 v;
    v.x = (static_cast<unsigned long long>(flag) << 32) | payload.x;
    v.y = (static_cast<unsigned long long>(flag) << 32) | payload.y;
    return v;
}

/// Writes `payload` with `flag` to the 16-byte aligned `line` (local or a peer's, mapped): one
/// st.relaxed.sys.v2.b64. Per thread; nothing else is needed for a receiver to see the data.
__device__ __forceinline__ void store_line(void* line, uint2 payload, uint32_t flag) {
    ptx::st_pair_b64<ptx::Sem::kRelaxed, ptx::Scope::kSys>(line, pack(payload, flag));
}

/// Reads `line` once (ld.relaxed.sys.v2.b64). True, with the payload, when both words carry `flag`.
__device__ __forceinline__ bool try_load_line(const void* line, uint32_t flag, uint2* payload) {
    const ulonglong2 v = ptx::ld_pair_b64<ptx::Sem::kRelaxed, ptx::Scope::kSys>(line);
    payload->x = static_cast<uint32_t>(v.x);
    payload->y = static_cast<uint32_t>(v.y);
    return static_cast<uint32_t>(v.x >> 32) == flag && static_cast<uint32_t>(v.y >> 32) == flag;
}

/// The flag a line that did not come carries: the first of its two words' flags that is not `flag` (for the record).
__device__ __forceinline__ uint32_t flag_seen(const void* line, uint32_t flag) {
    const ulonglong2 v = ptx::ld_pair_b64<ptx::Sem::kRelaxed, ptx::Scope::kSys>(line);
    const auto x = static_cast<uint32_t>(v.x >> 32);
    return x != flag ? x : static_cast<uint32_t>(v.y >> 32);
}

/// Polls `line` until both words carry `flag` and returns the payload: the poll loop of spin_until (tight for
/// kSpinFastPolls polls, then nanosleep backoff, reading the abort word); after ctx.timeout_ns, or once the World is
/// aborted, it records a kSignalWait diagnostic (address of the line, expected flag, last flag seen, and `sender`, the
/// team rank whose line did not come, as the record's peer; -1: the owner of the line's address), raises the abort
/// word and ends the thread (fail_and_exit). Per thread.
__device__ __forceinline__ uint2 wait_line_from(const DeviceCtx& ctx, const void* line, uint32_t flag, int32_t sender,
                                                int line_no = __builtin_LINE()) {
    uint2 payload;
    uint64_t waited_ns = 0;
    const auto probe = [&] { return try_load_line(line, flag, &payload); };
    bool aborted = false;
    if (!detail::poll_bounded(ctx.timeout_ns, ctx.abort_flag, probe, &waited_ns, &aborted)) {
        const uint32_t seen = flag_seen(line, flag);
        fail_and_exit(ctx, SpinSite{SpinKind::kSignalWait, sender, line_no}, Cmp::kEq, line, flag, seen, waited_ns,
                      aborted);
    }
    return payload;
}

/// wait_line_from that returns instead of ending the thread: true with the payload in `*payload`, or, after the same
/// diagnostic and the abort word raised, false (`*payload` undefined). Fully inline, no reachable call, exit or trap
/// (as spin_until_checked). The caller ends the thread once it may, its whole group together where the group meets
/// at a counted barrier (`exit_unless(group.all(ok))`). Per thread.
__device__ __forceinline__ bool wait_line_checked_from(const DeviceCtx& ctx, const void* line, uint32_t flag,
                                                       uint2* payload, int32_t sender, int line_no = __builtin_LINE()) {
    uint64_t waited_ns = 0;
    const auto probe = [&] { return try_load_line(line, flag, payload); };
    bool aborted = false;
    if (!detail::poll_bounded(ctx.timeout_ns, ctx.abort_flag, probe, &waited_ns, &aborted)) {
        const uint32_t seen = flag_seen(line, flag);
        record_diagnostic(ctx, SpinSite{SpinKind::kSignalWait, sender, line_no}, Cmp::kEq, line, flag, seen, waited_ns,
                          aborted);
        raise_abort(ctx);
        return false;
    }
    return true;
}

/// wait_line_checked_from with the line's owner as the record's peer.
__device__ __forceinline__ bool wait_line_checked(const DeviceCtx& ctx, const void* line, uint32_t flag, uint2* payload,
                                                  int line_no = __builtin_LINE()) {
    return wait_line_checked_from(ctx, line, flag, payload, -1, line_no);
}

/// wait_line_from with the line's owner as the record's peer (a line in this rank's memory names this rank).
__device__ __forceinline__ uint2 wait_line(const DeviceCtx& ctx, const void* line, uint32_t flag,
                                           int line_no = __builtin_LINE()) {
    return wait_line_from(ctx, line, flag, -1, line_no);
}

}  // namespace weft::device::ll
