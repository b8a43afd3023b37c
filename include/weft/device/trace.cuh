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

/// Appends one event [begin_ns, now] (dropped when the buffer is full or absent).
__device__ __forceinline__ void record(const DeviceCtx& ctx, TraceKind kind, TraceRole role, uint64_t begin_ns,
                                       int32_t arg0, int32_t arg1, int32_t arg2, int32_t arg3) {
    const uint64_t end_ns = ptx::globaltimer();
    TraceBuffer* b = buffer(ctx);
    if (b == nullptr) return;
    const uint32_t i = atomicAdd(&b->count, 1u);
    if (i >= b->capacity) return;
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
    b->events[i] = e;
}

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
#else
#define WEFT_TRACE_BEGIN(var) static_cast<void>(0)
#define WEFT_TRACE_DECLARE(var) static_cast<void>(0)
#define WEFT_TRACE_STAMP_IF(cond, var) static_cast<void>(0)
#define WEFT_TRACE_RECORD(ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#define WEFT_TRACE_RECORD_IF(cond, ctx, kind, role, begin, a0, a1, a2, a3) static_cast<void>(0)
#endif
