// SPDX-License-Identifier: MIT
// Expert parallelism across nodes: the normal mode's record exchanges (one exchange, or two hops), the low-latency
// mode's record and return layouts, the per-destination routing of a token, and the kernels' arguments, shared by the
// op (src/ops/ep_*.cpp) and kernels/ep/internode.cuh, kernels/ep/internode_ll.cuh.
//
// A team of W ranks that spans nodes exchanges fixed-size blocks: block r of a rank's send buffer holds `capacity`
// (= max_tokens_per_rank) records for team rank r, the tokens that have a valid route to r in token order (record i
// is the token whose send_idx for r is i), then padding records whose routes are all -1. A record is the token's row
// (H bf16), its routes on r as r's local expert ids (the valid ones in slot order, then -1: `local_topk` ints) and
// their weights (`local_topk` floats), padded to 16 bytes. After the exchange, rank r's receive buffer is W such
// blocks in source-rank order: one-rank dispatch input whose token order is (source rank, source token), exactly the
// receive order of the one-node op. docs/multinode.md, "EP across nodes".
#pragma once

#include "weft/common/ep_workspace.hpp"

namespace weft::ep {

/// Where everything of one exchange lies (the same on every member: it depends on the Geometry alone).
struct InternodeLayout {
    int32_t num_ranks;       ///< W: blocks per exchange
    int32_t capacity;        ///< records per block: max_tokens_per_rank
    int32_t hidden;          ///< H
    int32_t local_topk;      ///< routes per record: min(k, experts per rank)
    int64_t ids_offset;      ///< bytes from a record's start to its int32 local expert ids
    int64_t weights_offset;  ///< bytes from a record's start to its fp32 weights
    int64_t record_bytes;    ///< bytes per record: a multiple of 16

    WEFT_HOST_DEVICE static constexpr InternodeLayout make(const Geometry& g) {
        InternodeLayout l{};
        l.num_ranks = g.num_ranks;
        l.capacity = g.max_tokens;
        l.hidden = g.hidden;
        l.local_topk = g.topk < g.local_experts() ? g.topk : g.local_experts();
        l.ids_offset = g.row_bytes();
        l.weights_offset = l.ids_offset + 4 * int64_t{l.local_topk};
        l.record_bytes = round_up(l.weights_offset + 4 * int64_t{l.local_topk}, 16);
        return l;
    }
    /// Records of one exchange: the rows of the one-rank dispatch on the receiving side.
    WEFT_HOST_DEVICE constexpr int64_t records() const { return int64_t{num_ranks} * capacity; }
    /// Bytes each rank sends (and receives) in a dispatch.
    WEFT_HOST_DEVICE constexpr int64_t dispatch_bytes() const { return records() * record_bytes; }
    /// Bytes each rank sends (and receives) in a combine: one bf16 partial row per record.
    WEFT_HOST_DEVICE constexpr int64_t combine_bytes() const { return records() * int64_t{hidden} * 2; }
    /// Record `index` of block `rank` (byte offset from the buffer's start).
    WEFT_HOST_DEVICE constexpr int64_t record_offset(int32_t rank, int32_t index) const {
        return (int64_t{rank} * capacity + index) * record_bytes;
    }
    /// Partial row of record `index` of block `rank` (element offset, bf16).
    WEFT_HOST_DEVICE constexpr int64_t partial_offset(int32_t rank, int32_t index) const {
        return (int64_t{rank} * capacity + index) * hidden;
    }
};

/// The routes of one token (`row`: k expert ids, `weights`: k weights) that rank `dst` owns, as `dst`'s local expert
/// ids in slot order, then -1 up to `local_topk`; weights beside them (0 for -1). A route is valid as on one node: an
/// id in [0, E) not repeated by an earlier slot. Returns the number of routes to `dst` (0: the token does not go
/// there). The pack kernel and the host tests share it.
WEFT_HOST_DEVICE inline int32_t routes_to_rank(const Geometry& g, int32_t local_topk, const int32_t* row,
                                               const float* weights, int32_t dst, int32_t* ids, float* out_weights) {
    const int32_t local = g.local_experts();
    int32_t n = 0;
    for (int32_t j = 0; j < g.topk; ++j) {
        const int32_t e = row[j];
        if (e < 0 || e >= g.num_experts || e / local != dst) continue;
        bool repeated = false;
        for (int32_t i = 0; i < j; ++i) repeated = repeated || row[i] == e;
        if (repeated || n >= local_topk) continue;  // n < local_topk always holds for distinct experts of dst
        ids[n] = e - dst * local;
        out_weights[n] = weights[j];
        ++n;
    }
    for (int32_t i = n; i < local_topk; ++i) {
        ids[i] = -1;
        out_weights[i] = 0.0f;
    }
    return n;
}

/// The network hop of the two-hop dispatch: t(n, l) (node n's member with local index l) sends one block per node m to
/// its column peer t(m, l). Record t of block m is token t (fixed slots: `capacity` of them), written when the token
/// has a valid route on node m: its row, its k expert ids and weights as given, and for each member j of node m the
/// token's send_idx for that rank (-1: not sent there). A token without a route on node m leaves its row unwritten and
/// every send_idx -1. A last record (index `capacity`) is the block's header: in its send_idx field, the number of this
/// rank's tokens going to each member j of node m (the layout kernel's tokens_per_rank).
struct NodeRecordLayout {
    int32_t num_nodes;        ///< N: blocks per exchange
    int32_t ranks_per_node;   ///< L: send_idx values per record
    int32_t capacity;         ///< token records per block: max_tokens_per_rank (then the header record)
    int32_t topk;             ///< k
    int64_t ids_offset;       ///< bytes from a record's start to its k int32 expert ids (team-wide ids)
    int64_t weights_offset;   ///< to its k fp32 weights
    int64_t send_idx_offset;  ///< to its L int32 send indices (the header's counts)
    int64_t record_bytes;     ///< a multiple of 16

    WEFT_HOST_DEVICE static constexpr NodeRecordLayout make(const Geometry& g, int32_t num_nodes,
                                                            int32_t ranks_per_node) {
        NodeRecordLayout l{};
        l.num_nodes = num_nodes;
        l.ranks_per_node = ranks_per_node;
        l.capacity = g.max_tokens;
        l.topk = g.topk;
        l.ids_offset = g.row_bytes();
        l.weights_offset = l.ids_offset + 4 * int64_t{g.topk};
        l.send_idx_offset = l.weights_offset + 4 * int64_t{g.topk};
        l.record_bytes = round_up(l.send_idx_offset + 4 * int64_t{ranks_per_node}, 16);
        return l;
    }
    WEFT_HOST_DEVICE constexpr int64_t block_bytes() const { return (int64_t{capacity} + 1) * record_bytes; }
    /// Bytes of one exchange (N blocks), sent and received alike.
    WEFT_HOST_DEVICE constexpr int64_t bytes() const { return int64_t{num_nodes} * block_bytes(); }
    WEFT_HOST_DEVICE constexpr int64_t record_offset(int32_t node, int32_t index) const {
        return int64_t{node} * block_bytes() + int64_t{index} * record_bytes;
    }
};

/// Writes the metadata of token record (block m, token t): k ids and weights as given (`row`, `weights`), and the
/// send_idx of each member of node m (`members`: their team ranks, L of them; `send_idx`: the token's [W] send
/// indices). Returns whether the token goes to node m at all (some send_idx >= 0); the row is the caller's to copy.
WEFT_HOST_DEVICE inline bool fill_node_record(const NodeRecordLayout& l, const int32_t* row, const float* weights,
                                              const int32_t* send_idx, const int32_t* members, uint8_t* record) {
    auto* ids = reinterpret_cast<int32_t*>(record + l.ids_offset);
    auto* w = reinterpret_cast<float*>(record + l.weights_offset);
    auto* idx = reinterpret_cast<int32_t*>(record + l.send_idx_offset);
    bool any = false;
    for (int32_t j = 0; j < l.ranks_per_node; ++j) {
        idx[j] = send_idx[members[j]];
        any = any || idx[j] >= 0;
    }
    for (int32_t j = 0; j < l.topk; ++j) {
        ids[j] = row[j];
        w[j] = weights[j];
    }
    return any;
}

/// A token record that goes nowhere on its node (every send_idx -1; ids and weights untouched, never read).
WEFT_HOST_DEVICE inline void clear_node_record(const NodeRecordLayout& l, uint8_t* record) {
    auto* idx = reinterpret_cast<int32_t*>(record + l.send_idx_offset);
    for (int32_t j = 0; j < l.ranks_per_node; ++j) idx[j] = -1;
}

/// The header record of block m: tokens going to each member of node m (`tokens_per_rank`: [W], `members`: L).
WEFT_HOST_DEVICE inline void fill_node_header(const NodeRecordLayout& l, const int32_t* tokens_per_rank,
                                              const int32_t* members, uint8_t* record) {
    auto* idx = reinterpret_cast<int32_t*>(record + l.send_idx_offset);
    for (int32_t j = 0; j < l.ranks_per_node; ++j) idx[j] = tokens_per_rank[members[j]];
}

// ---- low-latency mode across nodes ----
//
// The dispatch is one record exchange (ops::all_to_all on the team): block r of a rank's send buffer holds
// `capacity` records for team rank r, record t being token t (fixed slots, no compaction: the receiver knows each
// record's source token from its place). A record is the token's row (H bf16) and its k routes on r as r's local
// expert ids at their top-k slots (-1 where the slot's expert is elsewhere, dropped, invalid or a repeat), then the
// sender's call signature (fp8 or bf16, the geometry's digest: a receiver whose call differs receives nothing and
// reports kCallMismatch, as on one node). Every rank receives W blocks in source-rank order and places the rows into
// the masked layout itself. The combine returns every route's expert output row to the token's source: block s of the
// combine send buffer holds, for each of s's tokens t, `local_topk` rows (the token's routes on this rank, in slot
// order); the source sums the rows of each token over its slots in slot order (fp32 fma, one rounding), the one-node
// arithmetic. docs/multinode.md, "Low-latency mode across nodes".

/// The valid expert of slot j of `row` (k ids), or -1: an id in [0, E) not used by an earlier slot (the one-node
/// validity).
WEFT_HOST_DEVICE inline int32_t valid_route_expert(const Geometry& g, const int32_t* row, int32_t j) {
    const int32_t e = row[j];
    if (e < 0 || e >= g.num_experts) return -1;
    for (int32_t i = 0; i < j; ++i) {
        if (row[i] == e) return -1;
    }
    return e;
}

/// A low-latency record's routes for rank `dst`: ids[j] = the local id of slot j's expert when it is valid and `dst`
/// owns it, else -1, for j in [0, k). Returns the number of such routes (0: the token does not go to `dst`).
WEFT_HOST_DEVICE inline int32_t ll_record_routes(const Geometry& g, const int32_t* row, int32_t dst, int32_t* ids) {
    const int32_t local = g.local_experts();
    int32_t n = 0;
    for (int32_t j = 0; j < g.topk; ++j) {
        const int32_t e = valid_route_expert(g, row, j);
        ids[j] = e >= 0 && e / local == dst ? e - dst * local : -1;
        n += ids[j] >= 0 ? 1 : 0;
    }
    return n;
}

/// Where the combine returns route (token, slot j): its position among the token's routes on the same rank, in slot
/// order (the number of valid slots before j owned by slot j's rank); -1 when slot j is not a valid route. `row`: the
/// token's k team-wide ids (the source's view). The owner's view is a record's local ids: the number of ids >= 0
/// before slot j (ll_record_position); the two agree by construction (tests/unit/test_ep_internode.cpp).
WEFT_HOST_DEVICE inline int32_t ll_route_position(const Geometry& g, const int32_t* row, int32_t j) {
    const int32_t e = valid_route_expert(g, row, j);
    if (e < 0) return -1;
    const int32_t owner = e / g.local_experts();
    int32_t p = 0;
    for (int32_t i = 0; i < j; ++i) {
        const int32_t f = valid_route_expert(g, row, i);
        p += f >= 0 && f / g.local_experts() == owner ? 1 : 0;
    }
    return p;
}

/// The owner's side of ll_route_position: the position of slot j among a record's local ids (those >= 0).
WEFT_HOST_DEVICE inline int32_t ll_record_position(const int32_t* ids, int32_t j) {
    int32_t p = 0;
    for (int32_t i = 0; i < j; ++i) p += ids[i] >= 0 ? 1 : 0;
    return p;
}

/// Where everything of the low-latency exchanges lies (the same on every member: it depends on the Geometry alone).
struct LowLatencyRecordLayout {
    int32_t num_ranks;   ///< W: blocks per exchange
    int32_t capacity;    ///< records per block: max_tokens_per_rank (record t = token t)
    int32_t hidden;      ///< H
    int32_t topk;        ///< k: ids per record
    int32_t local_topk;  ///< rows per record in the combine: min(k, experts per rank)
    int32_t pad0;
    int64_t ids_offset;        ///< bytes from a record's start to its k int32 local ids
    int64_t signature_offset;  ///< to the sender's call signature (uint32, ll_call_signature)
    int64_t record_bytes;      ///< a multiple of 16

    WEFT_HOST_DEVICE static constexpr LowLatencyRecordLayout make(const Geometry& g) {
        LowLatencyRecordLayout l{};
        l.num_ranks = g.num_ranks;
        l.capacity = g.max_tokens;
        l.hidden = g.hidden;
        l.topk = g.topk;
        l.local_topk = g.topk < g.local_experts() ? g.topk : g.local_experts();
        l.ids_offset = g.row_bytes();
        l.signature_offset = l.ids_offset + 4 * int64_t{g.topk};
        l.record_bytes = round_up(l.signature_offset + 4, 16);
        return l;
    }
    /// Records of one dispatch exchange, sent and received alike (W * capacity).
    WEFT_HOST_DEVICE constexpr int64_t records() const { return int64_t{num_ranks} * capacity; }
    WEFT_HOST_DEVICE constexpr int64_t dispatch_bytes() const { return records() * record_bytes; }
    /// Record `index` of block `rank` (byte offset).
    WEFT_HOST_DEVICE constexpr int64_t record_offset(int32_t rank, int32_t index) const {
        return (int64_t{rank} * capacity + index) * record_bytes;
    }
    /// Rows of one combine exchange: local_topk per record.
    WEFT_HOST_DEVICE constexpr int64_t combine_rows() const { return records() * local_topk; }
    WEFT_HOST_DEVICE constexpr int64_t combine_bytes() const { return combine_rows() * hidden * 2; }
    /// Row `position` of token `index` in block `rank` of a combine buffer (element offset, bf16).
    WEFT_HOST_DEVICE constexpr int64_t combine_row_offset(int32_t rank, int32_t index, int32_t position) const {
        return ((int64_t{rank} * capacity + index) * local_topk + position) * hidden;
    }
};

/// Arguments of kernels/ep/internode_ll.cuh (one struct for its four kernels; each reads its own fields).
struct LowLatencyInternodeArgs {
    Geometry geo;  ///< the team's geometry (W ranks)
    LowLatencyRecordLayout net;
    int32_t num_tokens;  ///< T of this rank
    int32_t fp8;         ///< the dispatch's placement quantises to e4m3
    uint32_t signature;  ///< this rank's call signature (ll_call_signature): written into every record, compared
    int32_t pad0;
    // pack (this rank's tokens)
    const uint16_t* x;  ///< [T, H] bf16
    int64_t x_stride;
    const int32_t* topk_idx;  ///< [T, k]
    int64_t idx_stride;
    uint8_t* send;  ///< [dispatch_bytes()]
    // layout and copy (the records received)
    const uint8_t* recv;  ///< [dispatch_bytes()] block s = source s's records for this rank
    int32_t* route_row;   ///< [W * capacity, k] the output row of each received route (valid where its id >= 0)
    LowLatencyHandleView handle;
    // combine pack (this rank's expert outputs)
    const uint16_t* y;  ///< [E_local, >= W * capacity, H] bf16 rows
    int64_t y_expert_stride;
    int64_t y_row_stride;
    uint16_t* combine_send;  ///< [combine_rows(), H] block s for source s
    // combine sum (this rank's tokens)
    const uint16_t* combine_recv;  ///< [combine_rows(), H] block r from expert rank r
    const float* topk_weights;     ///< [T, k]
    int64_t weight_stride;
    uint16_t* out;  ///< [T, H] bf16
    int64_t out_stride;
    LowLatencyState* state;  ///< the Buffer's call counters (dispatch_send_calls: the dispatch's number, in reports)
    Status* status;          ///< host-mapped
};

/// Arguments of kernels/ep/internode.cuh (one struct for every kernel there; each reads its own fields).
struct InternodeArgs {
    Geometry geo;  ///< the team's geometry (W ranks)
    InternodeLayout net;
    int32_t num_tokens;  ///< T of this rank
    int32_t pad0;
    // pack
    const uint16_t* x;  ///< [T, H] bf16
    int64_t x_stride;
    const int32_t* topk_idx;  ///< [T, k]
    int64_t idx_stride;
    const float* topk_weights;  ///< [T, k]
    int64_t weight_stride;
    const int32_t* send_idx;         ///< [T, W] the layout kernel's: record index in block r, or -1
    const int32_t* tokens_per_rank;  ///< [W] the layout kernel's: records used in block r
    uint8_t* send;                   ///< [dispatch_bytes()] the exchange's send buffer
    // sum
    const uint16_t* partials;  ///< [W * capacity, H] bf16: block r = rank r's partials of this rank's tokens
    uint16_t* out;             ///< [T, H] bf16
    int64_t out_stride;
    // two-hop dispatch (node_pack: x, topk_idx, topk_weights, send_idx, tokens_per_rank as for pack)
    NodeRecordLayout hop;
    const int32_t* team_ranks_by_node;  ///< [N][L] device copy of HostBackend::team_ranks_by_node()
    int32_t node_index;                 ///< n: this rank's node among the team's
    int32_t pad1;
    uint8_t* node_send;        ///< [hop.bytes()] node_pack's output: block m for the column peer on node m
    const uint8_t* node_recv;  ///< [hop.bytes()] block m = what the column peer on node m sent to this node
    uint8_t* forward;          ///< [L][N][capacity] final records: block j for node member j, by source node
};

// ---- the private buffers of a Buffer across nodes ----
//
// A Buffer of a team that spans nodes allocates, beyond its Workspace's device state: the team's ranks by node (a
// device table), and per handle one private allocation for the record exchanges, carved as below. The op allocates
// and carves from these layouts and ops::ep::footprint(config, num_ranks, num_nodes) sums them: one definition each.

/// Each part of an exchange allocation starts at a multiple of this (bytes).
inline constexpr int64_t kExchangeAlign = 256;

/// Bytes of the Buffer's device table of team ranks by node ([N][L] int32, N x L = W).
WEFT_HOST_DEVICE constexpr int64_t node_table_bytes(int32_t num_ranks) { return 4 * int64_t{num_ranks}; }

/// A normal handle's exchange allocation: send | recv | partials | returned, then for two hops node_send | node_recv |
/// gathered (the network hop's blocks, and the node all_to_all's output, reordered into recv). Byte offsets.
struct NormalExchangeLayout {
    int64_t records;   ///< one exchange's records (InternodeLayout::dispatch_bytes), aligned
    int64_t partials;  ///< one combine's partial rows (InternodeLayout::combine_bytes), aligned
    int64_t blocks;    ///< two hops: one network exchange (NodeRecordLayout::bytes), aligned; else 0
    int64_t send, recv, partials_at, returned;
    int64_t node_send, node_recv, gathered;  ///< two hops only (else 0)
    int64_t bytes;                           ///< the allocation

    WEFT_HOST_DEVICE static constexpr NormalExchangeLayout make(const InternodeLayout& net, const NodeRecordLayout& hop,
                                                                bool two_hop) {
        NormalExchangeLayout l{};
        l.records = round_up(net.dispatch_bytes(), kExchangeAlign);
        l.partials = round_up(net.combine_bytes(), kExchangeAlign);
        l.blocks = two_hop ? round_up(hop.bytes(), kExchangeAlign) : 0;
        l.send = 0;
        l.recv = l.records;
        l.partials_at = 2 * l.records;
        l.returned = l.partials_at + l.partials;
        l.node_send = two_hop ? l.returned + l.partials : 0;
        l.node_recv = two_hop ? l.node_send + l.blocks : 0;
        l.gathered = two_hop ? l.node_recv + l.blocks : 0;
        l.bytes = 2 * l.records + 2 * l.partials + (two_hop ? 2 * l.blocks + l.records : 0);
        return l;
    }
};

/// A low-latency handle's exchange allocation: dispatch send | dispatch recv | route_row | combine send | combine recv.
/// Byte offsets.
struct LowLatencyExchangeLayout {
    int64_t records;  ///< one dispatch exchange (LowLatencyRecordLayout::dispatch_bytes), aligned
    int64_t routes;   ///< route_row: one int32 per (record, slot), aligned
    int64_t rows;     ///< one combine exchange (LowLatencyRecordLayout::combine_bytes), aligned
    int64_t send, recv, route_row, combine_send, combine_recv;
    int64_t bytes;  ///< the allocation

    WEFT_HOST_DEVICE static constexpr LowLatencyExchangeLayout make(const LowLatencyRecordLayout& net) {
        LowLatencyExchangeLayout l{};
        l.records = round_up(net.dispatch_bytes(), kExchangeAlign);
        l.routes = round_up(net.records() * net.topk * 4, kExchangeAlign);
        l.rows = round_up(net.combine_bytes(), kExchangeAlign);
        l.send = 0;
        l.recv = l.records;
        l.route_row = 2 * l.records;
        l.combine_send = l.route_row + l.routes;
        l.combine_recv = l.combine_send + l.rows;
        l.bytes = 2 * l.records + l.routes + 2 * l.rows;
        return l;
    }
};

}  // namespace weft::ep
