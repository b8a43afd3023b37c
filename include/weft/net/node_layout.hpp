// SPDX-License-Identifier: MIT
// A team's layout over nodes, as the inter-node plans take it: checked once, and where one member sits in it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weft/runtime/error.hpp"

namespace weft::net {

/// Where team rank `me` sits in a layout by_node[n][l] = t(n, l), and the layout's extent.
struct NodeLayoutPosition {
    int32_t num_nodes = 0;
    int32_t per_node = 0;
    int32_t num_ranks = 0;  ///< num_nodes x per_node
    int32_t node = -1;      ///< n of t(n, l) == me
    int32_t local = -1;     ///< l of t(n, l) == me
};

/// Checks that `by_node` has at least one node, the same number (>= 1) of members on every node, and every team rank
/// in [0, num_nodes x per_node) exactly once, and that `me` is among them; throws weft::Error prefixed with `what`
/// ("ag_gemm across nodes", ...) otherwise.
inline NodeLayoutPosition locate_in_node_layout(const std::vector<std::vector<int>>& by_node, int me,
                                                const std::string& what) {
    NodeLayoutPosition p;
    p.num_nodes = static_cast<int32_t>(by_node.size());
    WEFT_CHECK(p.num_nodes >= 1, what << ": no node in the team's layout");
    p.per_node = static_cast<int32_t>(by_node[0].size());
    WEFT_CHECK(p.per_node >= 1, what << ": node 0 has no member");
    p.num_ranks = p.num_nodes * p.per_node;
    std::vector<bool> seen(static_cast<size_t>(p.num_ranks), false);
    for (int32_t n = 0; n < p.num_nodes; ++n) {
        const std::vector<int>& members = by_node[static_cast<size_t>(n)];
        WEFT_CHECK(static_cast<int32_t>(members.size()) == p.per_node,
                   what << ": node " << n << " has " << members.size() << " members, node 0 has " << p.per_node
                        << "; every node must hold the same number");
        for (int32_t l = 0; l < p.per_node; ++l) {
            const int t = members[static_cast<size_t>(l)];
            WEFT_CHECK(t >= 0 && t < p.num_ranks && !seen[static_cast<size_t>(t)],
                       what << ": team rank " << t << " is out of range or appears twice in the layout");
            seen[static_cast<size_t>(t)] = true;
            if (t == me) {
                p.node = n;
                p.local = l;
            }
        }
    }
    WEFT_CHECK(p.node >= 0, what << ": team rank " << me << " is not in the layout");
    return p;
}

}  // namespace weft::net
