// SPDX-License-Identifier: MIT
// Which node each rank is on (real hosts, or virtual nodes), and a team's layout over nodes: pure, unit-tested.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace weft::detail {

/// Virtual nodes: `option` when positive, else `env_value` (WEFT_VIRTUAL_NODES, a whole number >= 1), else 1 (real
/// hosts only). Throws weft::Error naming the variable (or WorldOptions::virtual_nodes) when the value is malformed,
/// below 1, or does not divide `num_ranks`.
int resolve_virtual_nodes(int option, const std::optional<std::string>& env_value, int num_ranks);

/// The node of each rank as a label: its host name, and with k > 1 virtual nodes also "/vnode<i>" where
/// i = rank / (num_ranks / k). Ranks with equal labels are on one node. `hosts` is indexed by rank; k must divide
/// its size (resolve_virtual_nodes checked it).
std::vector<std::string> node_labels(const std::vector<std::string>& hosts, int virtual_nodes);

/// The virtual node index of `rank` (rank / (num_ranks / virtual_nodes)).
int virtual_node_of(int rank, int num_ranks, int virtual_nodes);

/// How a team's members lie over nodes.
struct NodeLayout {
    int num_nodes = 0;       ///< distinct nodes among the members
    int ranks_per_node = 0;  ///< members per node when every node holds the same number, else 0
    int node_index = -1;     ///< this member's node, numbered in order of first appearance in team-rank order
    int local_index = -1;    ///< this member's index among the members of its node, in team-rank order
    /// Team ranks by (node_index, local_index): members_by_node[n][l]. Always filled (ragged when uneven).
    std::vector<std::vector<int>> members_by_node;
    /// Team ranks of the members with this member's local index on every node (its column), by node index; empty
    /// for a non-member. With uneven nodes only the nodes that have such a member are in it.
    std::vector<int> column;
};

/// The layout of a team whose member i is on node group `member_nodes[i]` (any integer label per node), seen from
/// team rank `team_rank` (-1: a non-member, which gets the counts only).
NodeLayout node_layout(const std::vector<int>& member_nodes, int team_rank);

}  // namespace weft::detail
