// SPDX-License-Identifier: MIT
// GemmRs's inter-node plan (see include/weft/net/gemm_rs_plan.hpp).
#include "weft/net/gemm_rs_plan.hpp"

#include "weft/runtime/error.hpp"

namespace weft::net {

RsInterNodePlan plan_rs_internode(const std::vector<std::vector<int>>& by_node, int me) {
    RsInterNodePlan p;
    p.num_nodes = static_cast<int32_t>(by_node.size());
    WEFT_CHECK(p.num_nodes >= 1, "gemm_rs across nodes: no node in the team's layout");
    p.per_node = static_cast<int32_t>(by_node[0].size());
    WEFT_CHECK(p.per_node >= 1, "gemm_rs across nodes: node 0 has no member");
    p.num_ranks = p.num_nodes * p.per_node;
    std::vector<bool> seen(static_cast<size_t>(p.num_ranks), false);
    p.node = -1;
    for (int32_t n = 0; n < p.num_nodes; ++n) {
        WEFT_CHECK(static_cast<int32_t>(by_node[static_cast<size_t>(n)].size()) == p.per_node,
                   "gemm_rs across nodes: node " << n << " has " << by_node[static_cast<size_t>(n)].size()
                                                 << " members, node 0 has " << p.per_node
                                                 << "; every node must hold the same number");
        for (int32_t l = 0; l < p.per_node; ++l) {
            const int t = by_node[static_cast<size_t>(n)][static_cast<size_t>(l)];
            WEFT_CHECK(t >= 0 && t < p.num_ranks && !seen[static_cast<size_t>(t)],
                       "gemm_rs across nodes: team rank " << t << " is out of range or appears twice in the layout");
            seen[static_cast<size_t>(t)] = true;
            if (t == me) {
                p.node = n;
                p.local = l;
            }
        }
    }
    WEFT_CHECK(p.node >= 0, "gemm_rs across nodes: team rank " << me << " is not in the layout");
    p.me = me;
    const auto at = [&](int32_t n, int32_t l) {
        return static_cast<int32_t>(by_node[static_cast<size_t>(n)][static_cast<size_t>(l)]);
    };
    for (int32_t l = 0; l < p.per_node; ++l) p.node_peers.push_back(at(p.node, l));
    // Other nodes' rows first, in the order the network steps send them; this node's own rows last (nothing waits for
    // them on another node).
    for (int32_t i = 0; i < p.num_nodes; ++i) {
        RsNodeBlock b;
        b.dest_node = (p.node + 1 + i) % p.num_nodes;
        b.dest = at(b.dest_node, p.local);
        const int32_t first = at(b.dest_node, 0);
        bool consecutive = true;
        for (int32_t l = 0; l < p.per_node; ++l) {
            b.rows_of.push_back(at(b.dest_node, l));
            consecutive = consecutive && at(b.dest_node, l) == first + l;
        }
        b.first_rank = consecutive ? first : -1;
        p.blocks.push_back(b);
    }
    for (int32_t k = 1; k < p.num_nodes; ++k) {
        RsNetStep st;
        st.distance = k;
        st.block = k - 1;
        st.to_node = (p.node + k) % p.num_nodes;
        st.to_rank = at(st.to_node, p.local);
        st.from_node = (p.node - k + p.num_nodes) % p.num_nodes;
        st.from_rank = at(st.from_node, p.local);
        p.net_steps.push_back(st);
    }
    return p;
}

}  // namespace weft::net
