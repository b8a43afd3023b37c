// SPDX-License-Identifier: MIT
// Node topology maths (see include/weft/detail/node_topology.hpp).
#include "weft/detail/node_topology.hpp"

#include <algorithm>
#include <map>

#include "weft/runtime/error.hpp"

namespace weft::detail {

int resolve_virtual_nodes(int option, const std::optional<std::string>& env_value, int num_ranks) {
    WEFT_CHECK(option >= 0,
               "WorldOptions::virtual_nodes must be 0 (WEFT_VIRTUAL_NODES, else none) or at least 1, got " << option);
    int k = 1;
    std::string source = "WorldOptions::virtual_nodes";
    if (option > 0) {
        k = option;
    } else if (env_value && !env_value->empty()) {
        source = "WEFT_VIRTUAL_NODES";
        const std::string& text = *env_value;
        WEFT_CHECK(text.size() <= 6 && text.find_first_not_of("0123456789") == std::string::npos,
                   "WEFT_VIRTUAL_NODES must be a whole number >= 1, got '" << text << "'");
        k = std::stoi(text);
    } else {
        return 1;
    }
    WEFT_CHECK(k >= 1, source << " must be at least 1, got " << k);
    WEFT_CHECK(num_ranks % k == 0, source << " = " << k << " must divide the world size " << num_ranks
                                          << " (every virtual node holds world / k consecutive ranks)");
    return k;
}

int virtual_node_of(int rank, int num_ranks, int virtual_nodes) {
    WEFT_CHECK(
        virtual_nodes >= 1 && num_ranks % virtual_nodes == 0 && rank >= 0 && rank < num_ranks,
        "virtual_node_of: rank " << rank << " of " << num_ranks << " with " << virtual_nodes << " virtual nodes");
    return rank / (num_ranks / virtual_nodes);
}

std::vector<std::string> node_labels(const std::vector<std::string>& hosts, int virtual_nodes) {
    const int n = static_cast<int>(hosts.size());
    std::vector<std::string> labels = hosts;
    if (virtual_nodes <= 1) return labels;
    for (int r = 0; r < n; ++r) {
        labels[static_cast<size_t>(r)] += "/vnode" + std::to_string(virtual_node_of(r, n, virtual_nodes));
    }
    return labels;
}

NodeLayout node_layout(const std::vector<int>& member_nodes, int team_rank) {
    const int n = static_cast<int>(member_nodes.size());
    WEFT_CHECK(team_rank >= -1 && team_rank < n,
               "node_layout: team rank " << team_rank << " outside [-1, " << n << ")");
    NodeLayout layout;
    std::map<int, int> index;  // node label -> node index (order of first appearance)
    std::vector<int> node_of(static_cast<size_t>(n)), local_of(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
        auto [it, inserted] = index.emplace(member_nodes[static_cast<size_t>(r)], static_cast<int>(index.size()));
        if (inserted) layout.members_by_node.emplace_back();
        auto& members = layout.members_by_node[static_cast<size_t>(it->second)];
        node_of[static_cast<size_t>(r)] = it->second;
        local_of[static_cast<size_t>(r)] = static_cast<int>(members.size());
        members.push_back(r);
    }
    layout.num_nodes = static_cast<int>(layout.members_by_node.size());
    if (layout.num_nodes > 0) {
        const size_t first = layout.members_by_node[0].size();
        const bool even = std::all_of(layout.members_by_node.begin(), layout.members_by_node.end(),
                                      [&](const std::vector<int>& m) { return m.size() == first; });
        layout.ranks_per_node = even ? static_cast<int>(first) : 0;
    }
    if (team_rank >= 0) {
        layout.node_index = node_of[static_cast<size_t>(team_rank)];
        layout.local_index = local_of[static_cast<size_t>(team_rank)];
        for (const auto& members : layout.members_by_node) {
            if (static_cast<int>(members.size()) > layout.local_index) {
                layout.column.push_back(members[static_cast<size_t>(layout.local_index)]);
            }
        }
    }
    return layout;
}

}  // namespace weft::detail
