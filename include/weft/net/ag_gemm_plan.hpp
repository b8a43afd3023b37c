// SPDX-License-Identifier: MIT
// Where AgGemm's gathered A comes from when its team spans nodes (docs/multinode.md, "AllGather+GEMM across nodes"):
// pure, unit-tested on the CPU. Team rank t(n, l) is node n's member with local index l (HostBackend::team_rank_at).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace weft::net {

/// How the shard of team rank `slot` (its slot of the gathered buffer) reaches this rank.
enum class AgSource : int32_t {
    kOwn,      ///< this rank's own shard (local copy)
    kPeer,     ///< a member of this node: copied from its gathered buffer once it raised ready[slot] (today's path)
    kNetwork,  ///< a member of this rank's column on another node: received over the network into the slot
    kRelay,    ///< another column on another node: received by `holder` (this node's member with the slot's local
               ///< index), then copied from the holder's gathered buffer, chunk by chunk, once it raised the chunk's
               ///< relay word
};

struct AgSlotSource {
    int32_t slot = 0;  ///< team rank whose shard this is
    AgSource source = AgSource::kOwn;
    int32_t holder = 0;  ///< team rank whose gathered buffer holds it first: slot (kPeer), this rank (kOwn, kNetwork),
                         ///< t(this node, local index of slot) (kRelay)
    int32_t node = 0;    ///< slot's node index
    int32_t local = 0;   ///< slot's local index
};

/// One network step of a call (per chunk of a shard, in this order on the comm stream): this rank sends its own
/// chunk to the column member on node `to_node` and receives the chunk of `from_slot` (the column member on node
/// `from_node`) into its slot. Every member runs the same steps in the same order; step k pairs node n with n - k
/// (sending) and n + k (receiving), so the pairs of a step match and the steps need no global order.
struct AgNetStep {
    int32_t distance = 0;   ///< k in [1, num_nodes)
    int32_t to_node = 0;    ///< (n - k) mod N
    int32_t from_node = 0;  ///< (n + k) mod N
    int32_t from_slot = 0;  ///< t(from_node, this rank's local index)
};

/// AgGemm's plan for one member of a team laid out as `by_node[n][l]` = team rank t(n, l) (every node the same number
/// of members; Team::node_members), from the member `me`.
struct AgInterNodePlan {
    int32_t me = 0, node = 0, local = 0, num_nodes = 0, per_node = 0, num_ranks = 0;
    std::vector<AgSlotSource> slots;   ///< [num_ranks], by slot
    std::vector<int32_t> node_peers;   ///< t(node, 0 .. per_node-1): the members this rank notifies and meets
    std::vector<AgNetStep> net_steps;  ///< distance 1 .. num_nodes-1
    /// The slots other than this rank's own in the order this rank's copy streams take them: this node's members
    /// (local index l+1, l+2, ... wrapping), then, per network step (distance 1, 2, ...), the relayed slots of node
    /// n + k by local index (its kNetwork slot has no copy). Chunk by chunk within a slot.
    std::vector<int32_t> copy_order;
    /// The slot whose first rows start this rank's GEMM tile order (AgGemmOrder::rotation_start): t(node, 0) when the
    /// team ranks are node-major (t(n, l) = n * per_node + l: this node's slots first, then node n+1's, n+2's ...,
    /// the order in which the network steps deliver them), else `me` (today's rotation: correct, not node-first).
    int32_t rotation_slot = 0;
    bool node_major = false;

    const AgSlotSource& slot(int32_t t) const { return slots[static_cast<size_t>(t)]; }
};

/// Builds the plan; throws weft::Error when the layout is not rectangular, a team rank is missing or repeated, or
/// `me` is not in it.
AgInterNodePlan plan_ag_internode(const std::vector<std::vector<int>>& by_node, int me);

}  // namespace weft::net
