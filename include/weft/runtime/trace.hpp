// SPDX-License-Identifier: MIT
// The intra-kernel trace on the host: WEFT_TRACE=path turns it on for a program (kernels are then JIT-compiled with
// WEFT_TRACE defined and record into a per-rank device buffer); write_trace gathers every rank's events into one
// Chrome-trace/Perfetto JSON: a process per rank, a track per SM and warp role. docs/profiling.md shows how to read it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "weft/common/trace.hpp"
#include "weft/runtime/store.hpp"

namespace weft {

class World;

/// WEFT_TRACE's value: the file the trace goes to; nullopt when it is unset or empty.
std::optional<std::string> trace_path_from_env();

/// Events per rank's buffer: WEFT_TRACE_EVENTS, default 262144 (12 MiB); events past it are dropped and counted.
uint32_t trace_capacity_from_env();

/// Whether `world` records a trace (WEFT_TRACE was set when it was made).
bool tracing(const World& world);

/// Writes every event the ranks recorded since the last write (or since the World was made) to `path` as one JSON
/// file, then empties the buffers. Collective: every rank calls it, with the same path; each sends its events to
/// rank 0, which writes the file. Synchronises this rank's device first: call it where no kernel of any rank waits
/// for work this rank has yet to launch (after the ops' streams are synchronised, for instance); no rank returns
/// before rank 0 has every rank's events, so a rank's next launch cannot meet a peer's sync of a shared GPU. Throws
/// weft::Error when `world` does not trace, the file cannot be written, or (on rank 0, after writing the events at
/// hand) a rank did not send within the World's timeout. A World that traces also writes the events since the last
/// write to WEFT_TRACE's path when it is destroyed: none when nothing was recorded since a write, and beside it
/// ("t.json" -> "t.at_exit.json") when a write went to that path.
void write_trace(World& world, const std::string& path);

/// Drops every event this rank recorded since the last write or discard (its device buffer, its timed copies, its
/// host events) and returns how many its kernels and copies tried to record in that time, kept or dropped: what a
/// benchmark calls between measurements so that each starts with an empty buffer (and learns whether one overflowed).
/// Not collective, but it synchronises this rank's device as write_trace does: call it where no kernel of any rank
/// waits for work this rank has yet to launch (between two host barriers, the streams drained). 0 when `world` does
/// not trace.
uint64_t discard_trace(World& world);

/// How many events this rank's kernels and copies tried to record since the last write or discard, kept or dropped
/// (more than trace_capacity_from_env(): some were dropped). Synchronises this rank's device as write_trace does.
/// 0 when `world` does not trace.
uint64_t trace_event_count(World& world);

/// This rank's trace buffer in device memory (what traced kernels write into; the entry after the peers in every
/// team's peer table), or nullptr when `world` does not trace. Kernels that take it as a parameter find it without
/// a load (the low-latency EP kernels: weft/device/trace.cuh's block log).
TraceBuffer* trace_device_buffer(const World& world);

/// Adds an event timed on the host's side of the device (a copy engine's copy, from CUDA events) to this rank's trace;
/// times in %globaltimer nanoseconds. Thread-safe per World. No-op when `world` does not trace.
void add_trace_event(World& world, const TraceEvent& event);

/// Two timing events for one copy a copy engine makes (record `begin` on the copy's stream before it, `end` after
/// it); the trace shows it as "copy chunk `chunk`" on the rank's track "copy engine `stream_idx`", its times mapped
/// onto %globaltimer when the trace is written. Both null when `world` does not trace (or holds its capacity of
/// pending copies): record nothing then. Copies recorded during graph capture get no time and are left out.
struct TraceCopyEvents {
    cudaEvent_t begin = nullptr;
    cudaEvent_t end = nullptr;
};
TraceCopyEvents trace_copy_events(World& world, uint16_t stream_idx, int32_t chunk, int32_t peer);

namespace detail {

/// One rank's part of a trace, as gathered.
struct RankTrace {
    int32_t rank = 0;
    std::string host;
    /// As gathered: CLOCK_REALTIME - %globaltimer on this rank; after align_rank_clocks: what to add to this rank's
    /// times to put them on rank 0's clock.
    int64_t clock_offset_ns = 0;
    uint64_t recorded = 0;        ///< events the kernels tried to record (more than events.size(): some dropped)
    std::vector<TraceEvent> events;
};

/// Ranks on rank 0's host share its %globaltimer: offset 0. A rank on another host is shifted by the difference of
/// the two hosts' (CLOCK_REALTIME - %globaltimer): its times land on rank 0's clock as well as the hosts' clocks agree
/// (NTP: about a millisecond; PTP: microseconds).
void align_rank_clocks(std::vector<RankTrace>& ranks);

Bytes encode_rank_trace(const RankTrace& trace);
/// Throws weft::Error on a truncated or malformed blob.
RankTrace decode_rank_trace(const Bytes& blob);

/// Removes the empty events (kind 0: slots a block claimed for its trace log and left empty) from `events`, in order;
/// returns how many it removed.
uint64_t drop_empty_trace_events(std::vector<TraceEvent>& events);

/// "wait chunk 3", "tile (2, 5)", "copy chunk 4", "notify", "reduce", "wait peers".
std::string trace_event_name(const TraceEvent& event);
/// "SM 12 producer", "SM 12 consumer 0", ..., "copy engine 1".
std::string trace_track_name(uint16_t sm, uint8_t role);

/// The Chrome-trace JSON (the "traceEvents" array format Perfetto and chrome://tracing read): per rank a process
/// "rank R (host)", per SM and role a thread, every event a complete ("X") event with microsecond times relative to
/// the earliest event of all ranks, its arguments and raw nanosecond times under "args".
std::string chrome_trace_json(const std::vector<RankTrace>& ranks);

}  // namespace detail

}  // namespace weft
