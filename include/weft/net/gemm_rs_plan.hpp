// SPDX-License-Identifier: MIT
// Which rows GemmRs reduces where when its team spans nodes (docs/multinode.md, "GEMM+ReduceScatter across nodes"):
// pure, unit-tested on the CPU. Team rank t(n, l) is node n's member with local index l (HostBackend::team_rank_at).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace weft::net {

/// One sub-call of the node stage: the one-node GemmRs over this node's members, on the rows of node `dest_node`'s
/// members. Its A is the rows of team ranks rows_of[0], rows_of[1], ... (t(dest_node, l) in local order, R rows each),
/// so that member t(this node, l) of the node stage keeps this node's sum of the rows of t(dest_node, l): for this rank
/// (local index `local`), this node's share of the rows that team rank `dest` owns.
struct RsNodeBlock {
    int32_t dest_node = 0;         ///< whose rows: node (node + 1 + i) mod N for block i, this node's last
    int32_t dest = 0;              ///< t(dest_node, this rank's local index): the team rank this block's sum is for
    std::vector<int32_t> rows_of;  ///< t(dest_node, 0 .. per_node-1)
    int32_t first_rank = 0;        ///< rows_of[0] when rows_of is consecutive (one slice of A), else -1 (A's rows
                                   ///< are gathered into a staging buffer first)
};

/// One network step: after node-stage block `block` (dest_node = node + distance), this rank sends that block's sum
/// to the column member t(to_node, local) and receives from t(from_node, local) that node's sum of this rank's rows.
/// Step k pairs node n with n + k (sending) and n - k (receiving): the pairs of a step match on every member, so the
/// steps need no global order.
struct RsNetStep {
    int32_t distance = 0;   ///< k in [1, num_nodes)
    int32_t block = 0;      ///< index into RsInterNodePlan::blocks (k - 1)
    int32_t to_node = 0;    ///< (n + k) mod N
    int32_t to_rank = 0;    ///< t(to_node, local)
    int32_t from_node = 0;  ///< (n - k) mod N
    int32_t from_rank = 0;  ///< t(from_node, local)
};

/// GemmRs's plan for one member of a team laid out as `by_node[n][l]` = team rank t(n, l) (every node the same number
/// of members; Team::node_members), from the member `me`. This rank's rows of C are the sum over nodes m of node m's
/// sum of them: its own node's from the last block, the others' received at the network steps.
struct RsInterNodePlan {
    int32_t me = 0, node = 0, local = 0, num_nodes = 0, per_node = 0, num_ranks = 0;
    std::vector<int32_t> node_peers;  ///< t(node, 0 .. per_node-1): the node stage's team, in local order
    /// The node stage's sub-calls in order: the other nodes' rows by distance 1, 2 ..., this node's last.
    std::vector<RsNodeBlock> blocks;
    std::vector<RsNetStep> net_steps;  ///< distance 1 .. num_nodes-1
};

/// Builds the plan; throws weft::Error when the layout is not rectangular, a team rank is missing or repeated, or
/// `me` is not in it.
RsInterNodePlan plan_rs_internode(const std::vector<std::vector<int>>& by_node, int me);

/// Rows of a sub-block are a multiple of this (but a block's last sub-block): whole M-tiles of the node stage's GEMM
/// for tile_m 64 and 128. A constant, not the node stage's tile, so that the sender and the receiver of a chunk cut
/// the rows the same way whatever GPU each node has.
inline constexpr int64_t kRsSubBlockRows = 128;

/// One call of the node stage: rows [row_begin, row_begin + num_rows) of each of block `block`'s members' R rows (the
/// one-node GemmRs on per_node x num_rows rows of A), then, when `ready` >= 0, ready word `ready` (those rows of the
/// block's node sum may leave).
struct RsNodeCall {
    int32_t block = 0;
    int64_t row_begin = 0;
    int64_t num_rows = 0;
    int32_t ready = -1;
};

/// One network transfer on the comm stream: after ready word `ready`, step `step`'s send/receive of rows
/// [row_begin, row_begin + num_rows) of the node sums (the same rows on the sender and on the receiver).
struct RsNetChunk {
    int32_t step = 0;  ///< index into RsInterNodePlan::net_steps
    int64_t row_begin = 0;
    int64_t num_rows = 0;
    int32_t ready = 0;
};

/// The calls and transfers of one GemmRs call with R = `rows` rows of C per rank.
struct RsCallSchedule {
    std::vector<RsNodeCall> calls;   ///< node stage, in order: each other node's block in sub-blocks, this node's last
    std::vector<RsNetChunk> chunks;  ///< comm stream, in order: step by step, sub-block by sub-block
    int32_t sub_blocks = 1;          ///< per block of another node
};

/// Cuts each other node's block into sub-blocks of about `chunk_bytes` (WEFT_NET_CHUNK_BYTES) of node sums
/// (`row_bytes` a row; kRsSubBlockRows rows at least), at most net::kMaxChunks ready words in all; this node's block
/// is one call (nothing waits for it). The same on every member for the same rows, row_bytes and chunk_bytes, so the
/// chunks of a step pair up. Throws weft::Error for rows < 1 or zero row_bytes / chunk_bytes.
RsCallSchedule schedule_rs_call(const RsInterNodePlan& plan, int64_t rows, uint64_t row_bytes, uint64_t chunk_bytes);

}  // namespace weft::net
