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
// path (a signal that peers wait for, a barrier) that costs. Such a kernel takes its buffer's address as a kernel
// parameter (the host passes this rank's TraceBuffer, or nullptr), keeps its events in a block log in shared memory,
// each site at a slot of its own that it knows statically (no atomic, no count), and writes them at its end into
// slots the block claimed at its start:
//
//   WEFT_TRACE_OPEN_BLOCK_LOG(claim, a.trace, slots);  // at the kernel's start, before a __syncthreads: claims slots
//   WEFT_TRACE_DEFER_AT_IF(tid == 0, 0, ctx, TraceKind::kSend, TraceRole::kComm, t0, -1, n, 0, 0);  // [t0, now] at 0
//   WEFT_TRACE_FLUSH_BLOCK_LOG(claim);  // at the kernel's end, every thread of the block (after its last signal)
//
// OPEN declares `claim` (FLUSH reads it: both in the kernel's body, in one scope). The block's last thread issues the
// claim's atomic add at once (the address is a parameter: no load before it) and nothing reads its result until the
// flush, so no thread waits for it. `slots` is the number of log slots the block's sites use (at most the log's 64):
// the claimed slots no site wrote are written as empty events (kind 0), which the host skips and counts as unused;
// an event at a log slot past the claim is recorded at the flush, one past the log at once (an atomic round trip
// each: keep the slots below the claim).
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/trace.hpp"
#include "weft/ptx/atom.cuh"
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

/// The event [begin_ns, end_ns] as written by block `block` on SM `sm`.
__device__ __forceinline__ TraceEvent event_of(TraceKind kind, TraceRole role, uint64_t begin_ns, uint64_t end_ns,
                                               int32_t arg0, int32_t arg1, int32_t arg2, int32_t arg3, uint32_t sm,
                                               uint32_t block) {
    TraceEvent e;
    e.begin_ns = begin_ns;
    e.end_ns = end_ns;
    e.kind = static_cast<uint16_t>(kind);
    e.sm = static_cast<uint16_t>(sm);
    e.role = static_cast<uint8_t>(role);
    e.reserved0 = 0;
    e.reserved1 = 0;
    e.block = block;
    e.args[0] = arg0;
    e.args[1] = arg1;
    e.args[2] = arg2;
    e.args[3] = arg3;
    e.reserved2 = 0;
    return e;
}

/// The event [begin_ns, end_ns] as this thread of this block records it.
__device__ __forceinline__ TraceEvent make_event(TraceKind kind, TraceRole role, uint64_t begin_ns, uint64_t end_ns,
                                                 int32_t arg0, int32_t arg1, int32_t arg2, int32_t arg3) {
    return event_of(kind, role, begin_ns, end_ns, arg0, arg1, arg2, arg3, sm_id(), blockIdx.x);
}

/// Claims one slot of `b` (its count counts every claim) and stores make() there when the slot is below `capacity`
/// (else the event is dropped; make() is not called).
template <class MakeEvent>
__device__ __forceinline__ void append(TraceBuffer* b, uint32_t capacity, MakeEvent&& make) {
    const unsigned long long i = atomicAdd(&b->count, 1ull);
    if (i < capacity) b->events[i] = make();
}

/// Appends one event [begin_ns, end_ns] (dropped when the buffer is full or absent).
__device__ __forceinline__ void record_span(const DeviceCtx& ctx, TraceKind kind, TraceRole role, uint64_t begin_ns,
                                            uint64_t end_ns, int32_t arg0, int32_t arg1, int32_t arg2, int32_t arg3) {
    TraceBuffer* b = buffer(ctx);
    if (b == nullptr) return;
    append(b, b->capacity, [&] { return make_event(kind, role, begin_ns, end_ns, arg0, arg1, arg2, arg3); });
}

/// Appends one event [begin_ns, now] (dropped when the buffer is full or absent).
__device__ __forceinline__ void record(const DeviceCtx& ctx, TraceKind kind, TraceRole role, uint64_t begin_ns,
                                       int32_t arg0, int32_t arg1, int32_t arg2, int32_t arg3) {
    record_span(ctx, kind, role, begin_ns, ptx::globaltimer(), arg0, arg1, arg2, arg3);
}

#if defined(WEFT_TRACE)  // the block log exists only in traced builds (no shared variable otherwise)
/// A block's events kept in shared memory until the block ends (one per block: block_log()), each at a slot its site
/// names; a slot whose kind is 0 holds no event. The events' `sm` and `block` are filled in when the log is written (a
/// block stays on its SM): a defer reads no %smid.
template <int N>
struct BlockLog {
    static constexpr int kCapacity = N;
    TraceEvent events[N];
};

/// The block's log (a function-scope __shared__ object: the same one wherever a kernel calls this; it exists only in
/// kernels that call it). 64 events: 3 KiB of shared memory; a low-latency EP block with both phases keeps
/// 3 per rank + 2 (weft::ep::LlTraceSlots). 16-byte aligned: the flush copies 16-byte words.
template <int N = 64>
__device__ __forceinline__ BlockLog<N>& block_log() {
    __shared__ __align__(16) BlockLog<N> log;
    return log;
}

/// The trace-buffer slots [first, first + slots) a block claimed when it opened its log (the log's slots
/// [0, slots) land there). `buffer` and `slots` are the same in every thread; `first` (the claim's atomic result) and
/// `capacity` (the buffer's, loaded with it) are held by the block's last thread only and read first by the flush.
struct BlockLogClaim {
    TraceBuffer* buffer;
    unsigned long long first;
    uint32_t capacity;
    uint32_t slots;
};

/// Empties the block's log (its threads clear the slots' kinds) and claims min(slots, the log's capacity) slots of
/// `buffer` (nullptr: none) with one atomic add from the block's last thread, not waited for. Every thread calls it,
/// before a __syncthreads that precedes any defer.
__device__ __forceinline__ BlockLogClaim open_block_log(TraceBuffer* buffer, int slots) {
    constexpr int kCap = BlockLog<64>::kCapacity;
    BlockLogClaim c{buffer, 0, 0, 0};
    if (buffer != nullptr && slots > 0) c.slots = static_cast<uint32_t>(slots < kCap ? slots : kCap);
    if (threadIdx.x == blockDim.x - 1 && buffer != nullptr) {
        c.capacity = __ldg(&buffer->capacity);
        if (c.slots != 0) {
            // ptxas turns an atomic add on an address it knows to be uniform over the warp into a warp-aggregated
            // one whose result a shuffle broadcasts at once: the warp would wait for the round trip right here. An
            // address offset by (lane - the claiming thread's lane), 0 in the claiming thread, is not provably uniform.
            uint32_t lane;
            asm("mov.u32 %0, %%laneid;" : "=r"(lane));
            unsigned long long* const count =
                &buffer->count + (static_cast<int>(lane) - static_cast<int>((blockDim.x - 1u) & 31u));
            asm volatile("atom.relaxed.gpu.global.add.u64 %0, [%1], %2;"
                         : "=l"(c.first)
                         : "l"(__cvta_generic_to_global(count)), "l"(static_cast<unsigned long long>(c.slots))
                         : "memory");
        }
    }
    auto& log = block_log();
    for (uint32_t i = threadIdx.x; i < static_cast<uint32_t>(kCap); i += blockDim.x) log.events[i].kind = 0;
    return c;
}

/// Keeps the event [begin_ns, end_ns] at slot `slot` of the block's log: shared-memory stores only (no atomic, no
/// global memory, no %smid). A slot has one writer per launch (a second event replaces the first). A slot past the
/// log's capacity records the event at once (an atomic round trip: keep the slots below it).
__device__ __forceinline__ void defer_span_at(const DeviceCtx& ctx, int slot, TraceKind kind, TraceRole role,
                                              uint64_t begin_ns, uint64_t end_ns, int32_t arg0, int32_t arg1,
                                              int32_t arg2, int32_t arg3) {
    auto& log = block_log();
    if (static_cast<uint32_t>(slot) >= static_cast<uint32_t>(log.kCapacity)) {
        record_span(ctx, kind, role, begin_ns, end_ns, arg0, arg1, arg2, arg3);
        return;
    }
    // The event's three 16-byte words (trace.hpp checks the offsets): {begin, end}, {kind (sm 0), role, block 0, arg0},
    // {arg1, arg2, arg3, 0}; the flush fills in SM and block.
    // NOTE: event_of's layout packed again: one packer for both changed the traced kernels' SASS (measured), so two.
    auto* dst = reinterpret_cast<uint4*>(&log.events[slot]);
    dst[0] = uint4{static_cast<uint32_t>(begin_ns), static_cast<uint32_t>(begin_ns >> 32),
                   static_cast<uint32_t>(end_ns), static_cast<uint32_t>(end_ns >> 32)};
    dst[1] = uint4{static_cast<uint32_t>(kind), static_cast<uint32_t>(role), 0u, static_cast<uint32_t>(arg0)};
    dst[2] = uint4{static_cast<uint32_t>(arg1), static_cast<uint32_t>(arg2), static_cast<uint32_t>(arg3), 0u};
}

/// Keeps the event [begin_ns, now] at slot `slot` of the block's log.
__device__ __forceinline__ void defer_at(const DeviceCtx& ctx, int slot, TraceKind kind, TraceRole role,
                                         uint64_t begin_ns, int32_t arg0, int32_t arg1, int32_t arg2, int32_t arg3) {
    defer_span_at(ctx, slot, kind, role, begin_ns, ptx::globaltimer(), arg0, arg1, arg2, arg3);
}

/// Writes the block's log into the slots open_block_log claimed. Every thread of the block calls it once, at the
/// block's end (it begins with a __syncthreads; no defer may follow). Then the claiming thread's warp (the block's
/// last, possibly partial) writes slot first + i from lane i % lanes: the log's event i with the block's SM and index
/// filled in (three 16-byte stores), or an empty event (kind 0) where no site wrote slot i; no global load and no
/// returning atomic. Slots past the buffer's capacity are dropped (count counted them); the empty ones among them
/// are added to TraceBuffer::unused_past_capacity (a reduction: nothing waits for it). Events at log slots past the
/// claim (a bound that did not hold) are recorded one by one.
__device__ __forceinline__ void flush_block_log(const BlockLogClaim& c) {
    __syncthreads();
    TraceBuffer* const b = c.buffer;
    const uint32_t base = (blockDim.x - 1u) & ~31u;  // the claiming thread's warp
    if (b == nullptr || threadIdx.x < base) return;
    const uint32_t lanes = blockDim.x - base;
    const uint32_t mask = lanes == 32u ? 0xffffffffu : (1u << lanes) - 1u;
    const uint32_t lane = threadIdx.x - base;
    const unsigned long long first = __shfl_sync(mask, c.first, static_cast<int>(lanes - 1u));
    const uint32_t capacity = __shfl_sync(mask, c.capacity, static_cast<int>(lanes - 1u));
    const auto& log = block_log();
    const uint32_t sm = sm_id();
    uint32_t unused_past_capacity = 0;  // this lane's empty claimed slots at or past the capacity
    for (uint32_t i = lane; i < static_cast<uint32_t>(log.kCapacity); i += lanes) {
        const auto* src = reinterpret_cast<const uint4*>(&log.events[i]);
        uint4 w1 = src[1];
        const bool fired = (w1.x & 0xffffu) != 0u;  // kind (low half)
        w1.x = (w1.x & 0xffffu) | (sm << 16);       // sm (high half)
        w1.z = blockIdx.x;                          // block
        if (i < c.slots) {
            if (first + i >= capacity) {
                unused_past_capacity += fired ? 0u : 1u;  // dropped (count counted it)
                continue;
            }
            auto* dst = reinterpret_cast<uint4*>(&b->events[first + i]);
            const uint4 zero{0u, 0u, 0u, 0u};
            dst[0] = fired ? src[0] : zero;
            dst[1] = fired ? w1 : zero;
            dst[2] = fired ? src[2] : zero;
        } else if (fired) {
            append(b, capacity, [&] {
                TraceEvent out = log.events[i];
                out.sm = static_cast<uint16_t>(sm);
                out.block = blockIdx.x;
                return out;
            });
        }
    }
    if (unused_past_capacity != 0u) {
        ptx::red_add<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(&b->unused_past_capacity,
                                                           static_cast<unsigned long long>(unused_past_capacity));
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
#define WEFT_TRACE_OPEN_BLOCK_LOG(claim, buffer, slots) \
    const ::weft::device::trace::BlockLogClaim claim = ::weft::device::trace::open_block_log((buffer), (slots))
#define WEFT_TRACE_DEFER_AT(slot, ctx, kind, role, begin, a0, a1, a2, a3) \
    ::weft::device::trace::defer_at((ctx), (slot), ::weft::kind, ::weft::role, (begin), (a0), (a1), (a2), (a3))
#define WEFT_TRACE_DEFER_AT_IF(cond, slot, ctx, kind, role, begin, a0, a1, a2, a3) \
    if (cond) WEFT_TRACE_DEFER_AT(slot, ctx, kind, role, begin, a0, a1, a2, a3)
#define WEFT_TRACE_FLUSH_BLOCK_LOG(claim) ::weft::device::trace::flush_block_log(claim)
#define WEFT_TRACE_DO(...) __VA_ARGS__
#else
#define WEFT_TRACE_BEGIN(var) static_cast<void>(0)
#define WEFT_TRACE_DECLARE(var) static_cast<void>(0)
#define WEFT_TRACE_STAMP_IF(cond, var) static_cast<void>(0)
#define WEFT_TRACE_RECORD(ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#define WEFT_TRACE_RECORD_IF(cond, ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#define WEFT_TRACE_OPEN_BLOCK_LOG(claim, buffer, slots) static_cast<void>(0)
#define WEFT_TRACE_DEFER_AT(slot, ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#define WEFT_TRACE_DEFER_AT_IF(cond, slot, ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#define WEFT_TRACE_FLUSH_BLOCK_LOG(claim) static_cast<void>(0)
#define WEFT_TRACE_DO(...) static_cast<void>(0)
#endif
