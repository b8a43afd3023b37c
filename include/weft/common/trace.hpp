// SPDX-License-Identifier: MIT
// The intra-kernel trace's records (host and device agree on this layout): what a traced kernel writes into its
// rank's TraceBuffer, and what the host turns into a Chrome-trace/Perfetto file. Kernels write them only when the
// JIT compiles them with WEFT_TRACE defined (weft/device/trace.cuh); docs/profiling.md says how to read the file.
// NOTE: no namespace-scope variables: NVRTC emits each as a module global in every kernel that includes this header,
// which would move the constant-bank addresses of an untraced kernel.
#pragma once

#include "weft/common/macros.hpp"  // fixed-width integers under g++, nvcc and NVRTC

namespace weft {

/// What an event is. The trace file names it from the kind and the arguments.
enum class TraceKind : uint16_t {
    kWaitChunk = 1,  ///< a tile waited for its chunk signals: args = first and last chunk (signal) index, tile m, n
    kTile = 2,       ///< a tile's mainloop and epilogue: args = m index, n index
    kCopyChunk = 3,  ///< a chunk copied to or from a peer: args = chunk (signal) index, peer
    kNotify = 4,     ///< signals raised for peers: args = signal index (or -1), peer (or -1: every peer)
    kReduce = 5,     ///< a reduction step: args = chunk index, peer (or -1)
    kWaitPeers = 6,  ///< waited for every peer at the end of a call (a done-barrier): args = the epoch awaited
    kWaitPeer = 7,   ///< waited for one peer's signal (a barrier arrival, a count, rows): args = peer, source line of
                     ///< the wait, low 32 bits of the value awaited
    kPushChunk = 8,  ///< a chunk written into peers' memory: args = chunk (the block's part), peer (or -1: every peer)
    kPullChunk = 9,  ///< a chunk read from a peer's memory: args = chunk (the block's part), peer
    kStage = 10,     ///< the input copied into the symmetric staging buffer: args = chunk (the block's part)
    kSend = 11,      ///< EP rows sent: args = destination rank (or -1: every destination), rows (or tokens)
    kRecv = 12,      ///< EP rows received and placed: args = source rank (or -1: every source), rows (or -1)
    kLayout = 13,    ///< EP routing layout (counts, masks, offsets): args = tokens
    kCombine = 14,   ///< EP weighted sum of the rows that came back: args = tokens
};

/// Which part of a CTA wrote an event (a track per SM and role in the trace file).
enum class TraceRole : uint8_t {
    kProducer = 0,   ///< the GEMM's TMA producer warp
    kConsumer0 = 1,  ///< the GEMM's first consumer warpgroup
    kConsumer1 = 2,  ///< the second consumer warpgroup
    kComm = 3,       ///< a communication warp or kernel
    kCopyEngine = 4, ///< copies made by a copy engine (recorded from the host with CUDA events)
};

/// One event: 48 bytes. Times are %globaltimer nanoseconds (shared by the GPUs of one host).
struct TraceEvent {
    uint64_t begin_ns;
    uint64_t end_ns;
    uint16_t kind;  ///< a TraceKind
    uint16_t sm;    ///< %smid of the writer (for kCopyEngine: the copy stream's index)
    uint8_t role;   ///< a TraceRole
    uint8_t reserved0;
    uint16_t reserved1;
    uint32_t block;  ///< blockIdx.x of the writer
    int32_t args[4];
    uint32_t reserved2;
};
static_assert(sizeof(TraceEvent) == 48, "TraceEvent is 48 bytes on host and device");

/// One rank's buffer in device memory: a header, then `capacity` events. Writers claim slots with an atomic add on
/// `count`; a writer that finds the buffer full drops its event (count keeps counting: the host reports the drops).
/// A block that keeps a trace log (weft/device/trace.cuh) claims its slots before it knows how many it will fill: it
/// writes those it leaves empty as empty events (kind 0), which the host skips and counts as unused, and adds those
/// past the capacity (never written) to `unused_past_capacity`. Events recorded: count less the unused slots. The
/// counters are 64-bit: a long traced run whose blocks keep claiming slots after the buffer filled never wraps them
/// (a wrapped count would hand out slots from 0 again, over the events kept).
struct TraceBuffer {
    uint32_t capacity;
    uint32_t reserved;
    unsigned long long count;                 ///< every slot claimed since the last drain
    unsigned long long unused_past_capacity;  ///< empty claimed slots at or past `capacity`
    unsigned long long reserved2;
    TraceEvent events[1];  ///< `capacity` of them in the allocation
};

#if !WEFT_DEVICE_PASS
}  // namespace weft
#include <cstddef>  // offsetof
namespace weft {
// A block log writes and copies events as three 16-byte words and fills in `sm` and `block` in the second (trace.cuh).
static_assert(offsetof(TraceBuffer, count) == 8 && offsetof(TraceBuffer, unused_past_capacity) == 16 &&
                  offsetof(TraceBuffer, events) == 32,
              "TraceBuffer: the two counters side by side, events 16-byte aligned");
static_assert(offsetof(TraceEvent, kind) == 16 && offsetof(TraceEvent, sm) == 18 && offsetof(TraceEvent, role) == 20 &&
                  offsetof(TraceEvent, block) == 24 && offsetof(TraceEvent, args) == 28,
              "TraceEvent: the second 16-byte word holds kind and sm, role (and its padding), block, args[0]");
#endif

/// Bytes of a TraceBuffer holding `capacity` events.
WEFT_HOST_DEVICE constexpr uint64_t trace_buffer_bytes(uint32_t capacity) {
    return sizeof(TraceBuffer) + (capacity > 0 ? capacity - 1 : 0) * sizeof(TraceEvent);
}

}  // namespace weft
