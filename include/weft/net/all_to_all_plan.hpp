// SPDX-License-Identifier: MIT
// How an all-to-all of equal splits crosses nodes (docs/multinode.md, "All-to-all across nodes"): pure, unit-tested
// on the CPU. Team rank t(n, l) is node n's member with local index l (HostBackend::team_rank_at); block q of a rank's
// input goes to team rank q, block q of its output comes from team rank q.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace weft::net {

/// One node stage: weft's all_to_all over this node's members (one block per member), for the blocks this node sends
/// to node `dest_node`. Member j of this node receives, from every member l, l's block for t(dest_node, j), at
/// position l: so after the stage this rank holds, in local-index order, its node's blocks for its column member on
/// `dest_node`. Every member of a node runs the same stages in the same order.
struct A2aNodeStage {
    int32_t dest_node = 0;
    int32_t distance = 0;  ///< (node - dest_node) mod N: the network step that sends the result; 0: this node's stage
    /// [per_node]: the input block sent to node member j: t(dest_node, j).
    std::vector<int32_t> send_blocks;
    bool send_contiguous = false;  ///< send_blocks are consecutive: the stage reads the input in place, else packs it
    /// [per_node], this node's stage only (distance 0): the output block that node member l's block lands in,
    /// t(node, l); empty for the others (their result is the network step's send buffer).
    std::vector<int32_t> recv_blocks;
    bool recv_contiguous = false;  ///< recv_blocks are consecutive: the stage writes the output in place
};

/// One network step over this rank's column: send the result of the node stage of distance k (per_node blocks, for
/// t(to_node, local)) to node to_node = n - k, receive from node from_node = n + k its per_node blocks for this rank,
/// which came from t(from_node, l) for every l. Step k of node n pairs with step k of nodes n - k and n + k.
struct A2aNetStep {
    int32_t distance = 0;   ///< k in [1, num_nodes)
    int32_t to_node = 0;    ///< (n - k) mod N
    int32_t from_node = 0;  ///< (n + k) mod N
    int32_t to_rank = 0;    ///< t(to_node, local)
    int32_t from_rank = 0;  ///< t(from_node, local)
    /// [per_node]: the output block that received block l lands in, t(from_node, l).
    std::vector<int32_t> recv_blocks;
    bool recv_contiguous = false;  ///< recv_blocks are consecutive: the network writes the output in place
};

/// The plan of one member of a team laid out as `by_node[n][l]` = team rank t(n, l) (every node the same number of
/// members; Team::node_members), from the member `me`.
struct A2aInterNodePlan {
    int32_t me = 0, node = 0, local = 0, num_nodes = 0, per_node = 0, num_ranks = 0;
    /// In enqueue order: distance 1, 2, ..., N - 1 (the network's order), then this node's own (distance 0), which
    /// runs while the network moves the others.
    std::vector<A2aNodeStage> node_stages;
    std::vector<A2aNetStep> net_steps;  ///< distance 1 .. N - 1
};

/// Builds the plan; throws weft::Error when the layout is not rectangular, a team rank is missing or repeated, or
/// `me` is not in it.
A2aInterNodePlan plan_a2a_internode(const std::vector<std::vector<int>>& by_node, int me);

/// Bytes [offset, offset + bytes) of a buffer.
struct A2aSpan {
    uint64_t offset = 0;
    uint64_t bytes = 0;
};

/// Where every byte of one member's call lies, from its plan and the byte counts: buffers are the input, the output
/// and four scratch buffers (packed stage inputs, the steps' send buffers, the steps' receive buffers, this node's
/// stage output), each laid out back to back in plan order.
struct A2aByteLayout {
    struct Stage {                         ///< plan.node_stages[i]
        std::vector<uint64_t> send_bytes;  ///< [per_node]: to node member j (this rank's bytes for send_blocks[j])
        std::vector<uint64_t> recv_bytes;  ///< [per_node]: from node member l
        /// The stage's input: at `input_offset` of the input when send_contiguous, else of the packed scratch, filled
        /// from `pack` (the input spans for j = 0, 1, ... back to back).
        uint64_t input_offset = 0;
        std::vector<A2aSpan> pack;
        /// Its output: distance > 0, the step's send buffer at this offset of the sent scratch; this node's stage, the
        /// output at this offset when recv_contiguous, else the own scratch at 0, copied to the output spans `unpack`
        /// (node member l's bytes at unpack[l]).
        uint64_t output_offset = 0;
        std::vector<A2aSpan> unpack;
    };
    struct Step {  ///< plan.net_steps[i]
        /// Sent: the sent scratch at this offset (one member per node: the input at this offset).
        uint64_t send_offset = 0, send_bytes = 0;
        /// Received: the output at this offset when recv_contiguous, else the received scratch at this offset, copied
        /// to the output spans `unpack` (t(from_node, l)'s bytes at unpack[l]).
        uint64_t recv_offset = 0, recv_bytes = 0;
        std::vector<A2aSpan> unpack;
    };
    std::vector<Stage> stages;
    std::vector<Step> steps;
    uint64_t packed_bytes = 0, sent_bytes = 0, received_bytes = 0, own_bytes = 0;
};

/// The byte layout of a call (pure): `send_bytes[q]` / `recv_bytes[q]` this rank's bytes to / from team rank q (input
/// and output back to back in team-rank order); `node_send_bytes[l][q]` the bytes that t(node, l), this node's member
/// with local index l, sends to team rank q (this rank's row included). With one member per node the steps send
/// straight from the input and there are no node stages' buffers. Throws weft::Error when a count vector has the wrong
/// length.
A2aByteLayout layout_a2a_internode(const A2aInterNodePlan& plan, std::span<const uint64_t> send_bytes,
                                   std::span<const uint64_t> recv_bytes,
                                   const std::vector<std::vector<uint64_t>>& node_send_bytes);

}  // namespace weft::net
