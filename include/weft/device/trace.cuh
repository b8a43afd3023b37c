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
// memory and writes them all at its end, with one atomic per block:
//
//   WEFT_TRACE_OPEN_BLOCK_LOG();          // at the kernel's start, before a __syncthreads
//   WEFT_TRACE_DEFER_IF(tid == 0, ctx, TraceKind::kSend, TraceRole::kComm, t0, -1, n, 0, 0);  // [t0, now], kept
//   WEFT_TRACE_FLUSH_BLOCK_LOG(ctx);      // at the kernel's end, every thread of the block (after its last signal)
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
/// A block's events kept in shared memory until the block ends (one per block: block_log()).
template <int N>
struct BlockLog {
    static constexpr int kCapacity = N;
    uint32_t count;  ///< events deferred (those past N were recorded at once)
    uint32_t reserved[3];
    TraceEvent events[N];
};

/// The block's log (a function-scope __shared__ object: the same one wherever a kernel calls this; it exists only in
/// kernels that call it). 64 events: 3 KiB of shared memory; a low-latency EP block with both phases keeps up to
/// 3 per rank + 2.
template <int N = 64>
__device__ __forceinline__ BlockLog<N>& block_log() {
    __shared__ BlockLog<N> log;
    return log;
}

/// Empties the block's log. Thread 0 writes: call it from every thread before a __syncthreads that precedes any defer.
__device__ __forceinline__ void open_block_log() {
    if (threadIdx.x == 0) block_log().count = 0;
}

/// Keeps the event [begin_ns, end_ns] in the block's log (a shared-memory atomic and store: no global memory); past
/// the log's capacity the event is recorded at once.
__device__ __forceinline__ void defer_span(const DeviceCtx& ctx, TraceKind kind, TraceRole role, uint64_t begin_ns,
                                           uint64_t end_ns, int32_t arg0, int32_t arg1, int32_t arg2, int32_t arg3) {
    auto& log = block_log();
    const uint32_t i = atomicAdd(&log.count, 1u);
    if (i >= static_cast<uint32_t>(log.kCapacity)) {
        record_span(ctx, kind, role, begin_ns, end_ns, arg0, arg1, arg2, arg3);
        return;
    }
    log.events[i] = make_event(kind, role, begin_ns, end_ns, arg0, arg1, arg2, arg3);
}

/// Keeps the event [begin_ns, now] in the block's log.
__device__ __forceinline__ void defer(const DeviceCtx& ctx, TraceKind kind, TraceRole role, uint64_t begin_ns,
                                      int32_t arg0, int32_t arg1, int32_t arg2, int32_t arg3) {
    defer_span(ctx, kind, role, begin_ns, ptx::globaltimer(), arg0, arg1, arg2, arg3);
}

/// Writes the block's log into the trace buffer: one atomic add claims every slot. Every thread of the block calls it
/// once, at the block's end (it begins with a __syncthreads; no defer may follow).
__device__ __forceinline__ void flush_block_log(const DeviceCtx& ctx) {
    __syncthreads();
    if (threadIdx.x != 0) return;
    const auto& log = block_log();
    const uint32_t n = log.count < static_cast<uint32_t>(log.kCapacity) ? log.count : log.kCapacity;
    TraceBuffer* b = buffer(ctx);
    if (b == nullptr || n == 0) return;
    const uint32_t first = atomicAdd(&b->count, n);
    for (uint32_t i = 0; i < n && first + i < b->capacity; ++i) {
        b->events[first + i] = log.events[i];
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
#define WEFT_TRACE_OPEN_BLOCK_LOG() ::weft::device::trace::open_block_log()
#define WEFT_TRACE_DEFER(ctx, kind, role, begin, a0, a1, a2, a3) \
    ::weft::device::trace::defer((ctx), ::weft::kind, ::weft::role, (begin), (a0), (a1), (a2), (a3))
#define WEFT_TRACE_DEFER_IF(cond, ctx, kind, role, begin, a0, a1, a2, a3) \
    if (cond) ::weft::device::trace::defer((ctx), ::weft::kind, ::weft::role, (begin), (a0), (a1), (a2), (a3))
#define WEFT_TRACE_FLUSH_BLOCK_LOG(ctx) ::weft::device::trace::flush_block_log(ctx)
#define WEFT_TRACE_DO(...) __VA_ARGS__
#else
#define WEFT_TRACE_BEGIN(var) static_cast<void>(0)
#define WEFT_TRACE_DECLARE(var) static_cast<void>(0)
#define WEFT_TRACE_STAMP_IF(cond, var) static_cast<void>(0)
#define WEFT_TRACE_RECORD(ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#define WEFT_TRACE_RECORD_IF(cond, ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#define WEFT_TRACE_OPEN_BLOCK_LOG() static_cast<void>(0)
#define WEFT_TRACE_DEFER(ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#define WEFT_TRACE_DEFER_IF(cond, ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#define WEFT_TRACE_FLUSH_BLOCK_LOG(ctx) static_cast<void>(0)
#define WEFT_TRACE_DO(...) static_cast<void>(0)
#endif
