// SPDX-License-Identifier: MIT
// Kernel parameters of the tensor-parallel fused ops (AllGather+GEMM, GEMM+ReduceScatter, GEMM+AllReduce):
// trivially copyable structs that the host (src/ops) fills and the kernels (kernels/{ag_gemm,gemm_rs,gemm_ar})
// read, so both sides agree on the layout by construction.
//
// Signal words and their protocol (all in the symmetric heap unless said "local"):
//   ag  chunk_signals[W * cpr]  local; set to 1 by this rank's copy engine after chunk (s, c) landed; reset to 0
//                               by the GEMM's last tile (the next call's copies are stream-ordered after it)
//       ready[W]                ready[s] = 1 set by rank s once its shard is in its gathered buffer (call e);
//                               reset to 0 by this rank's GEMM's last tile, before `done` is raised
//       done[W]                 done[s] += 1 by rank s's last GEMM tile: s finished call e (read every shard)
//       epoch                   local; calls completed (advanced by the last GEMM tile)
//       signatures[W]           signatures[s] = rank s's call descriptor, stored by s's notify before its ready
//                               release (same allocation as ready); compared by every producer that loads a tile of
//                               s's rows, after the tile's chunk wait. Overwritten each call, never reset
//       relay_ready[W * cpr]    a team that spans nodes only: relay_ready[s * cpr + c] = 1 set by the member of
//                               this node that received chunk (s, c) over the network (s on another node, in that
//                               member's column), after it stored signatures[s] here; reset to 0 by this rank's GEMM
//                               with the chunk signals. Chunks of this rank's own column are signalled by its comm
//                               stream (chunk_signals, = 1 after the receive); ready/done then only among the node
//   rs  counters[W * cpr]       on destination d: [source s][chunk c] += 1 per finished tile of s for d; zeroed
//                               by d's reduction (pull mode) or d's last GEMM tile (push mode) once complete,
//                               before it raises `released`
//       released[W]             released[d] += 1 when rank d finished reading call e's partials
//       gemm_calls, red_epoch   local; calls completed by the GEMM / by the reduction
//       signatures[2][W]        on destination d: [parity of the call][source s] = s's call descriptor, stored by
//                               CTA 0 of s's GEMM kernel at its start; zeroed by d with its counters, before it
//                               raises `released` (s writes that parity again only two calls on, after it awaited
//                               that `released`). The reader of s's partial polls the slot, then the count: it goes
//                               on once the slot agrees and the count is complete, and stops at a slot holding
//                               another descriptor (kCollectiveMismatch), whatever the counts
//   ar  ready[W], done[W]       += 1 per call: partial complete / finished reading every partial
// Every wait compares with >= against a value derived from a device-side counter (never a host value frozen
// in a CUDA graph), or against the constant 1 of a word that is reset in stream order.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/dtype.hpp"
#include "weft/common/tp_schedule.hpp"

namespace weft {

/// The members of this rank's node (team ranks, this one included) when the team spans nodes: the AllGather+GEMM
/// kernels notify and meet only them (peers on other nodes are reached through the network backend). num == 0: every
/// rank of the DeviceCtx (one node: the kernels as before).
inline constexpr int kAgMaxNodePeers = 32;
struct AgNodePeers {
    int32_t num;
    int32_t rank[kAgMaxNodePeers];
};

/// AllGather+GEMM scheduler (AgGemmScheduler) parameters.
struct AgGemmParams {
    DeviceCtx ctx;
    AgGemmOrder order;              ///< built by the host for this call
    const uint64_t* chunk_signals;  ///< local [order.num_signals()]
    /// local view of the symmetric [num_ranks] descriptor slots: slot s holds rank s's `signature` of this call,
    /// stored there by s's notify kernel before it raised ready[s] (AgNotifyParams::signatures)
    const uint64_t* signatures;
    uint64_t signature;  ///< this call's descriptor (make_call_descriptor: CollectiveOp::kAgGemm, M, K, dtype)
    /// local: AgGemmHookParams::tile_counter, to which a chunk wait that gives up adds kAgGaveUpMark (so that the end
    /// of the call knows that not every chunk was seen to land)
    uint64_t* tile_counter;
};

/// What a CTA whose chunk wait gave up adds to the tile counter: above any launch's tile count, and the count plus
/// one mark per CTA stays below 2^32 (the 32 bits a wait's Token keeps): the op checks num_tiles < kAgGaveUpMark and
/// at most kAgMaxCtas CTAs.
inline constexpr uint64_t kAgGaveUpMark = uint64_t{1} << 23;
inline constexpr int32_t kAgMaxCtas = 511;

/// AllGather+GEMM epilogue hook (AgGemmHook: counts stored tiles) and end-of-call (ag_finish_call, run by
/// CTA 0's producer thread once every tile is stored) parameters.
struct AgGemmHookParams {
    DeviceCtx ctx;
    uint64_t* tile_counter;   ///< local; tiles stored in this call (back to 0 at the end)
    int32_t num_tiles;        ///< valid tiles of the launch
    int32_t num_signals;      ///< chunk signals in use
    uint64_t* chunk_signals;  ///< local [num_signals]
    uint64_t* ready;          ///< symmetric [num_ranks]
    uint64_t* done;           ///< symmetric [num_ranks]
    uint64_t* epoch;          ///< local
    /// A team that spans nodes (docs/multinode.md): local [num_signals] relay words, reset with the chunk signals;
    /// null on one node
    uint64_t* relay_ready;
    AgNodePeers peers;  ///< whom the done-barrier meets: num == 0 (one node) every rank of ctx
};

/// AllGather+GEMM's ready notification (ag_notify_ready_kernel) parameters.
struct AgNotifyParams {
    DeviceCtx ctx;
    uint64_t* ready;  ///< symmetric [num_ranks]
    /// symmetric [num_ranks], in the allocation of `ready` (reached through the translation of the peer's ready word),
    /// or null (no descriptor): `signature` is stored into slot `rank` on every peer before ready[rank]
    uint64_t* signatures;
    uint64_t signature;
    AgNodePeers peers;  ///< whom to notify: num == 0 (one node) every rank of ctx but this one
};

/// AllGather+GEMM across nodes: a member that received chunks over the network tells this node's other members
/// (ag_relay_notify_kernel, on the comm stream after the receive): for each item, the slot's call descriptor into
/// signatures[slot] on every peer, then relay_ready[signal] = 1 there (release, system scope).
inline constexpr int kAgMaxRelayItems = 16;
struct AgRelayParams {
    DeviceCtx ctx;
    uint64_t* relay_ready;  ///< symmetric [num_signals]
    uint64_t* signatures;   ///< symmetric [num_ranks] (AgNotifyParams::signatures)
    AgNodePeers peers;
    int32_t num_items;
    int32_t slot[kAgMaxRelayItems];    ///< team rank whose chunk arrived
    int32_t signal[kAgMaxRelayItems];  ///< its chunk signal index
};

/// GEMM+ReduceScatter scheduler (RsGemmScheduler) parameters.
struct RsGemmParams {
    DeviceCtx ctx;
    int64_t rows_per_rank;
    int64_t chunk_rows;
    const uint64_t* released;    ///< symmetric [num_ranks]
    const uint64_t* gemm_calls;  ///< local
    uint64_t* signatures;        ///< symmetric [2][num_ranks]: slot [calls & 1][rank] on every peer gets `signature`
    uint64_t signature;          ///< this call's descriptor (make_call_descriptor: CollectiveOp::kGemmRs, M, ...)
};

/// GEMM+ReduceScatter epilogue hook (RsGemmHook) parameters.
struct RsGemmHookParams {
    DeviceCtx ctx;
    int64_t rows_per_rank;
    int64_t chunk_rows;
    uint64_t* counters;      ///< symmetric [num_ranks * chunks_per_rank] (indexed on the destination)
    uint32_t* tile_counter;  ///< local
    int32_t num_tiles;
    int32_t n;               ///< columns of the partial
    uint64_t* gemm_calls;    ///< local
};

/// Most ranks GEMM+ReduceScatter's push mode serves (one tensor map per destination rides in the kernel's
/// parameters).
inline constexpr int kRsPushMaxRanks = 8;

/// A CUtensorMap's bytes, as the host encoded it (the device reads it as ptx::TmaDescriptor).
struct alignas(64) TmaMapBytes {
    uint64_t words[16];
};

/// GEMM+ReduceScatter push-mode epilogue hook (RsPushHook) parameters. The kernel takes them as
/// __grid_constant__: TMA stores read peer_maps in place (parameter space).
struct RsPushHookParams {
    TmaMapBytes peer_maps[kRsPushMaxRanks];  ///< [d]: rank d's receive slot for this rank, [rows_per_rank, n]
    DeviceCtx ctx;
    int64_t rows_per_rank;
    int64_t chunk_rows;
    const void* recv;        ///< symmetric [num_ranks * rows_per_rank, ldr]: slot s holds source s's partial
    int64_t ldr;             ///< elements
    uint64_t* counters;      ///< symmetric [num_ranks * chunks_per_rank] (indexed on the destination)
    uint64_t* released;      ///< symmetric [num_ranks]
    uint32_t* tile_counter;  ///< local
    int32_t num_tiles;
    int32_t n;               ///< columns of C
    uint64_t* gemm_calls;    ///< local
    uint64_t* signatures;    ///< symmetric [2][num_ranks] (RsGemmParams::signatures): compared by own tiles, zeroed
    uint64_t signature;      ///< this call's descriptor
};

/// GEMM+ReduceScatter reduction kernel (rs_reduce_kernel) parameters.
struct RsReduceParams {
    DeviceCtx ctx;
    int64_t rows_per_rank;
    int64_t chunk_rows;
    int32_t n;
    int32_t tile_m, tile_n;    ///< the GEMM's tile (for the expected counter values)
    int32_t reserved;
    const void* partial;       ///< symmetric [M, ldp]: this rank's partial; peers' through symm_at
    int64_t ldp;
    float* acc;                ///< local [rows_per_rank, lda] fp32 accumulator (num_ranks > 2)
    int64_t lda;
    void* out;                 ///< [rows_per_rank, ldc]
    int64_t ldc;
    uint64_t* counters;        ///< symmetric [num_ranks * chunks_per_rank] (zeroed here once complete)
    uint64_t* released;        ///< symmetric [num_ranks]
    uint64_t* epoch;           ///< local
    uint32_t* exit_count;      ///< local
    uint64_t* signatures;      ///< symmetric [2][num_ranks] (RsGemmParams::signatures): compared per chunk, zeroed
    uint64_t signature;        ///< this call's descriptor
};

/// GEMM+AllReduce one-shot reduction kernel (ar_reduce_kernel) parameters.
struct ArReduceParams {
    DeviceCtx ctx;
    int32_t m, n;
    const void* partial;   ///< symmetric [m, ldp]
    int64_t ldp;
    void* out;             ///< [m, ldc]
    int64_t ldc;
    uint64_t* ready;       ///< symmetric [num_ranks]
    uint64_t* done;        ///< symmetric [num_ranks]
    uint64_t* epoch;       ///< local
    uint32_t* exit_count;  ///< local
    /// symmetric [2 parities][num_ranks], in the allocation of `ready` (the kernel reaches a peer's copy through the
    /// translation of its ready word): CTA 0 writes `signature` into slot `rank` of every rank's row for this
    /// call's parity before it notifies `ready` (whose release covers it); every CTA compares every rank's after its
    /// wait and ends (exit, with a kCollectiveMismatch diagnostic) when one differs
    uint64_t* signatures;
    uint64_t signature;  ///< this call's descriptor (make_call_descriptor: CollectiveOp::kGemmAr, M, n, dtypes)
};

/// One copy of the shared-GPU pull kernel (kernels/tp_common/peer_pull.cuh): optionally wait for a peer's ready
/// word, copy `bytes` from `src` to `dst` (a peer's shard into this rank's buffer; for the copy-engine all-gathers also
/// this rank's shard into a peer's output), then optionally set a signal word to 1 (release at system scope).
struct PeerPullItem {
    const uint64_t* wait_ready;  ///< local word to await >= 1 before the copy (the peer's ready flag), or null
    void* dst;                   ///< where the bytes go: this rank's buffer, or a peer's (mapped for stores)
    const void* src;             ///< where they come from: a peer's buffer (mapped for loads), or this rank's
    uint64_t* signal;            ///< word set to 1 once this item's bytes (and every earlier item's) landed, or null
    uint64_t bytes;
    int32_t peer;   ///< the other team rank of the copy: source or destination (diagnostics, trace)
    int32_t chunk;  ///< the signal's index (trace), or -1
};

/// Items per launch of the pull kernel; a call with more launches it again on the same stream.
inline constexpr int kPeerPullMaxItems = 48;
/// Threads of the pull kernel's single CTA.
inline constexpr int kPeerPullThreads = 512;

/// The pull kernel's parameters: items[0, num_items) in order, by one CTA.
struct PeerPullParams {
    DeviceCtx ctx;
    /// local [num_ranks] (indexed by PeerPullItem::peer), in the allocation the peers' notify kernels store into
    /// before they raise the ready words the items wait for: after an item's wait, the peer's call descriptor is
    /// compared with `signature`; a difference records a kCollectiveMismatch diagnostic and the items still run (the
    /// call's protocol ends as always; its output is then undefined and sync_and_check throws). Null: no check.
    const uint64_t* signatures;
    uint64_t signature;
    int32_t num_items;
    PeerPullItem items[kPeerPullMaxItems];
};

/// Threads per CTA of the reduction kernels (rs_reduce_kernel, ar_reduce_kernel) and of the notify kernel.
inline constexpr int kTpReduceThreads = 256;
inline constexpr int kTpNotifyThreads = 32;
/// Elements per vector of the reductions (16 bytes of 16-bit elements).
inline constexpr int kTpVecElems = 8;

}  // namespace weft
