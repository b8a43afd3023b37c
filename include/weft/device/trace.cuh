// SPDX-License-Identifier: MIT
// Intra-kernel trace records: a tag, begin and end %globaltimer, SM and warp role, into the rank's TraceBuffer.
// Compiled out entirely unless WEFT_TRACE is defined (the JIT defines it when the WEFT_TRACE variable names a
// file): without it every macro below expands to nothing, so a kernel's code is exactly what it is untraced.
//
//   WEFT_TRACE_BEGIN(t0);                                           // const uint64_t t0 = now (traced builds only)
//   WEFT_TRACE_DECLARE(t1); ... WEFT_TRACE_STAMP_IF(kb == 0, t1);    // a time taken later, e.g. inside a loop
//   ... the work ...
//   WEFT_TRACE_RECORD(ctx, TraceKind::kTile, TraceRole::kConsumer0, t0, m_idx, n_idx, 0, 0);
//   WEFT_TRACE_RECORD_IF(threadIdx.x == 0, ctx, TraceKind::kReduce, TraceRole::kComm, t0, chunk, -1, 0, 0);
//
// Keep each use on one line: the test that proves an untraced kernel unchanged (TraceNvrtc) strips every line that
// names WEFT_TRACE_ from the kernel sources and compares the SASS with the untraced build's.
//
// `ctx` is the kernel's DeviceCtx: the buffer's address is the entry after the peers in its peer table
// (ctx.peer_bases[ctx.num_ranks], device memory written when the team was made; nullptr when the World does not
// trace), not the host-mapped diagnostic record, which every recording CTA would read across PCIe. One thread per
// event: a warp that records from every lane writes 32 events.
//
// A record is a round trip to L2 (the atomic that claims the slot) before its store: on a short kernel's critical
// path (a signal that peers wait for, a barrier) that costs. Such a kernel keeps its events in a block log in shared
// memory (a shared-memory atomic and store per event) and writes them at its end into slots it claimed, with one
// atomic per block, at its start (so that no round trip to L2 waits at its end either):
//
//   WEFT_TRACE_OPEN_BLOCK_LOG(ctx, max_events);  // at the kernel's start, before a __syncthreads; claims the slots
//   WEFT_TRACE_DEFER_IF(tid == 0, ctx, TraceKind::kSend, TraceRole::kComm, t0, -1, n, 0, 0);  // [t0, now], kept
//   WEFT_TRACE_FLUSH_BLOCK_LOG(ctx);             // at the kernel's end, every thread (after the block's last signal)
//
// `max_events` bounds the events a block defers (claimed slots left unused stay empty, kind 0, and are counted in
// TraceBuffer::unused; a block that defers more claims the rest at its end). OPEN declares a variable that FLUSH
// reads: both go in the kernel's own body, in one scope.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/trace.hpp"
#include "weft/ptx/timer.cuh"

namespace weft::device::trace {

// NOTE: no namespace-scope variables here: NVRTC emits each as a module global, which moves the addresses an untraced
// kernel loads from its constant bank.

/// This rank's trace buffer, or nullptr when the host set none.
__device__ __forceinline__ TraceBuffer* buffer(const DeviceCtx& ctx) {
    if (ctx.peer_bases == nullptr) return nullptr;
    return reinterpret_cast<TraceBuffer*>(
        __ldg(reinterpret_cast<const unsigned long long*>(ctx.peer_bases + ctx.num_ranks)));
}

__device__ __forceinline__ uint32_t sm_id() {
    uint32_t id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

/// The event [begin_ns, end_ns] as this thread of this block records it.
__device__ __forceinline__ TraceEvent make_event(TraceKind kind, TraceRole role, uint64_t begin_ns, uint64_t end_ns,
                                                 int32_t arg0, int32_t arg1, int32_t arg2, int32_t arg3) {
    TraceEvent e;
    e.begin_ns = begin_ns;
    e.end_ns = end_ns;
    e.kind = static_cast<uint16_t>(kind);
    e.sm = static_cast<uint16_t>(sm_id());
    e.role = static_cast<uint8_t>(role);
    e.reserved0 = 0;
    e.reserved1 = 0;
    e.block = blockIdx.x;
    e.args[0] = arg0;
    e.args[1] = arg1;
    e.args[2] = arg2;
    e.args[3] = arg3;
    e.reserved2 = 0;
    return e;
}

/// Appends one event [begin_ns, end_ns] (dropped when the buffer is full or absent).
__device__ __forceinline__ void record_span(const DeviceCtx& ctx, TraceKind kind, TraceRole role, uint64_t begin_ns,
                                            uint64_t end_ns, int32_t arg0, int32_t arg1, int32_t arg2, int32_t arg3) {
    TraceBuffer* b = buffer(ctx);
    if (b == nullptr) return;
    const uint32_t i = atomicAdd(&b->count, 1u);
    if (i >= b->capacity) return;
    b->events[i] = make_event(kind, role, begin_ns, end_ns, arg0, arg1, arg2, arg3);
}

/// Appends one event [begin_ns, now] (dropped when the buffer is full or absent).
__device__ __forceinline__ void record(const DeviceCtx& ctx, TraceKind kind, TraceRole role, uint64_t begin_ns,
                                       int32_t arg0, int32_t arg1, int32_t arg2, int32_t arg3) {
    record_span(ctx, kind, role, begin_ns, ptx::globaltimer(), arg0, arg1, arg2, arg3);
}

#if defined(WEFT_TRACE)  // the block log exists only in traced builds (no shared variable otherwise)
/// A block's events kept in shared memory until the block ends (one per block: block_log()). The events' `sm` and
/// `block` are filled in when the log is written (one %smid read per block, not per event).
template <int N>
struct BlockLog {
    static constexpr int kCapacity = N;
    uint32_t count;  ///< events deferred (those past N were recorded at once)
    uint32_t reserved[3];
    TraceEvent events[N];
};

/// The block's log (a function-scope __shared__ object: the same one wherever a kernel calls this; it exists only in
/// kernels that call it). 64 events: 3 KiB of shared memory; a low-latency EP block with both phases keeps up to
/// 3 per rank + 2. 16-byte aligned: flush_block_log copies each event as three 16-byte words.
template <int N = 64>
__device__ __forceinline__ BlockLog<N>& block_log() {
    __shared__ __align__(16) BlockLog<N> log;
    return log;
}

/// The trace-buffer slots a block claimed when it opened its log: [first, first + claimed), held in registers of the
/// block's last thread (the one that claimed them; `buffer` is nullptr in every other thread, and when the World
/// does not trace).
struct BlockLogClaim {
    TraceBuffer* buffer;
    uint32_t first;
    uint32_t claimed;
    uint32_t capacity;  ///< the buffer's, read when claiming
};

/// The thread that claims and writes a block's log: the block's last, which in the kernels that keep a log has no
/// other load before their first barrier (load_peer_table loads from threads 0..num_ranks-1), so that waiting for the
/// buffer's address before its claim delays no one.
__device__ __forceinline__ bool is_block_log_writer() { return threadIdx.x == blockDim.x - 1; }

/// Empties the block's log and claims `max_events` (at most the log's capacity) slots of the trace buffer for it:
/// one atomic per block, issued at the kernel's start, whose result is needed only when the log is written, so no
/// round trip to L2 sits at the kernel's end. Every thread calls it, before a __syncthreads that precedes any defer.
/// Slots claimed but not used stay empty (kind 0; TraceBuffer::unused counts them); a block that defers more than it
/// claimed claims the rest when it writes its log.
__device__ __forceinline__ BlockLogClaim open_block_log(const DeviceCtx& ctx, int max_events) {
    if (threadIdx.x == 0) block_log().count = 0;
    BlockLogClaim c{nullptr, 0, 0, 0};
    if (!is_block_log_writer()) return c;
    c.buffer = buffer(ctx);
    if (c.buffer == nullptr) return c;
    const int cap = block_log().kCapacity;
    c.claimed = static_cast<uint32_t>(max_events < 0 ? 0 : (max_events > cap ? cap : max_events));
    c.first = c.claimed > 0 ? atomicAdd(&c.buffer->count, c.claimed) : 0;
    c.capacity = c.buffer->capacity;
    return c;
}

/// The event as deferred: `sm` and `block` are left 0 until the log is written.
__device__ __forceinline__ TraceEvent make_logged_event(TraceKind kind, TraceRole role, uint64_t begin_ns,
                                                        uint64_t end_ns, int32_t arg0, int32_t arg1, int32_t arg2,
                                                        int32_t arg3) {
    TraceEvent e;
    e.begin_ns = begin_ns;
    e.end_ns = end_ns;
    e.kind = static_cast<uint16_t>(kind);
    e.sm = 0;
    e.role = static_cast<uint8_t>(role);
    e.reserved0 = 0;
    e.reserved1 = 0;
    e.block = 0;
    e.args[0] = arg0;
    e.args[1] = arg1;
    e.args[2] = arg2;
    e.args[3] = arg3;
    e.reserved2 = 0;
    return e;
}

/// Keeps the event [begin_ns, end_ns] in the block's log (a shared-memory atomic and store: no global memory, no
/// %smid); past the log's capacity the event is recorded at once.
__device__ __forceinline__ void defer_span(const DeviceCtx& ctx, TraceKind kind, TraceRole role, uint64_t begin_ns,
                                           uint64_t end_ns, int32_t arg0, int32_t arg1, int32_t arg2, int32_t arg3) {
    auto& log = block_log();
    const uint32_t i = atomicAdd(&log.count, 1u);
    if (i >= static_cast<uint32_t>(log.kCapacity)) {
        record_span(ctx, kind, role, begin_ns, end_ns, arg0, arg1, arg2, arg3);
        return;
    }
    log.events[i] = make_logged_event(kind, role, begin_ns, end_ns, arg0, arg1, arg2, arg3);
}

/// Keeps the event [begin_ns, now] in the block's log (one %globaltimer read: its end).
__device__ __forceinline__ void defer(const DeviceCtx& ctx, TraceKind kind, TraceRole role, uint64_t begin_ns,
                                      int32_t arg0, int32_t arg1, int32_t arg2, int32_t arg3) {
    defer_span(ctx, kind, role, begin_ns, ptx::globaltimer(), arg0, arg1, arg2, arg3);
}

/// Writes the block's log into the slots open_block_log claimed: the writer's warp copies one event per lane (three
/// 16-byte loads and stores each, with the block's SM and index filled in), with no atomic unless the block deferred
/// more events than it claimed; slots it claimed and did not use are counted in TraceBuffer::unused (a reduction,
/// nothing waits for it). Every thread of the block calls it once, at the block's end (it begins with a
/// __syncthreads; no defer may follow).
__device__ __forceinline__ void flush_block_log(const DeviceCtx& /*ctx*/, const BlockLogClaim& claim) {
    __syncthreads();
    const uint32_t writer = blockDim.x - 1;
    if ((threadIdx.x >> 5) != (writer >> 5)) return;
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t writer_lane = writer & 31u;  // the warp's highest lane (lane 31 when blockDim.x is a multiple of 32)
    const uint32_t active = writer_lane == 31u ? 0xffffffffu : (2u << writer_lane) - 1u;
    auto* buffer = reinterpret_cast<TraceBuffer*>(
        __shfl_sync(active, reinterpret_cast<unsigned long long>(claim.buffer), writer_lane));
    if (buffer == nullptr) return;
    const auto& log = block_log();
    const uint32_t n = log.count < static_cast<uint32_t>(log.kCapacity) ? log.count : log.kCapacity;
    const uint32_t first = __shfl_sync(active, claim.first, writer_lane);
    const uint32_t claimed = __shfl_sync(active, claim.claimed, writer_lane);
    const uint32_t capacity = __shfl_sync(active, claim.capacity, writer_lane);
    uint32_t more_first = 0;  // slots for the events past the claim (none when the claim was large enough)
    if (lane == writer_lane) {
        if (n > claimed) {
            more_first = atomicAdd(&buffer->count, n - claimed);
        } else if (n < claimed) {
            atomicAdd(&buffer->unused, claimed - n);  // result unused: a reduction (RED), no round trip
        }
    }
    more_first = __shfl_sync(active, more_first, writer_lane);
    const uint32_t sm = sm_id();
    TraceEvent* events = buffer->events;
    for (uint32_t i = lane; i < n; i += 32) {
        const uint32_t slot = i < claimed ? first + i : more_first + (i - claimed);
        if (slot >= capacity) continue;
        const auto* src = reinterpret_cast<const uint4*>(&log.events[i]);
        auto* dst = reinterpret_cast<uint4*>(&events[slot]);
        uint4 w1 = src[1];
        w1.x = (w1.x & 0xffffu) | (sm << 16);  // kind (low half), sm (high half)
        w1.z = blockIdx.x;                     // block
        dst[0] = src[0];
        dst[1] = w1;
        dst[2] = src[2];
    }
}
#endif

}  // namespace weft::device::trace

#if defined(WEFT_TRACE)
#define WEFT_TRACE_BEGIN(var) const uint64_t var = ::weft::ptx::globaltimer()
#define WEFT_TRACE_DECLARE(var) uint64_t var = 0
#define WEFT_TRACE_STAMP_IF(cond, var) \
    if (cond) var = ::weft::ptx::globaltimer()
#define WEFT_TRACE_RECORD(ctx, kind, role, begin, a0, a1, a2, a3) \
    ::weft::device::trace::record((ctx), ::weft::kind, ::weft::role, (begin), (a0), (a1), (a2), (a3))
#define WEFT_TRACE_RECORD_IF(cond, ctx, kind, role, begin, a0, a1, a2, a3) \
    if (cond) ::weft::device::trace::record((ctx), ::weft::kind, ::weft::role, (begin), (a0), (a1), (a2), (a3))
#define WEFT_TRACE_OPEN_BLOCK_LOG(ctx, max_events)               \
    const ::weft::device::trace::BlockLogClaim weft_trace_block_log = \
        ::weft::device::trace::open_block_log((ctx), (max_events))
#define WEFT_TRACE_DEFER(ctx, kind, role, begin, a0, a1, a2, a3) \
    ::weft::device::trace::defer((ctx), ::weft::kind, ::weft::role, (begin), (a0), (a1), (a2), (a3))
#define WEFT_TRACE_DEFER_IF(cond, ctx, kind, role, begin, a0, a1, a2, a3) \
    if (cond) ::weft::device::trace::defer((ctx), ::weft::kind, ::weft::role, (begin), (a0), (a1), (a2), (a3))
#define WEFT_TRACE_FLUSH_BLOCK_LOG(ctx) ::weft::device::trace::flush_block_log((ctx), weft_trace_block_log)
#define WEFT_TRACE_DO(...) __VA_ARGS__
#else
#define WEFT_TRACE_BEGIN(var) static_cast<void>(0)
#define WEFT_TRACE_DECLARE(var) static_cast<void>(0)
#define WEFT_TRACE_STAMP_IF(cond, var) static_cast<void>(0)
#define WEFT_TRACE_RECORD(ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#define WEFT_TRACE_RECORD_IF(cond, ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#define WEFT_TRACE_OPEN_BLOCK_LOG(ctx, max_events) static_cast<void>(0)
#define WEFT_TRACE_DEFER(ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#define WEFT_TRACE_DEFER_IF(cond, ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#define WEFT_TRACE_FLUSH_BLOCK_LOG(ctx) static_cast<void>(0)
#define WEFT_TRACE_DO(...) static_cast<void>(0)
#endif
