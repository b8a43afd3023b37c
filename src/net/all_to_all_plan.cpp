// SPDX-License-Identifier: MIT
// The inter-node all-to-all plan (see include/weft/net/all_to_all_plan.hpp).
#include "weft/net/all_to_all_plan.hpp"

#include "weft/runtime/error.hpp"

namespace weft::net {

namespace {

bool consecutive(const std::vector<int32_t>& v) {
    for (size_t i = 1; i < v.size(); ++i) {
        if (v[i] != v[0] + static_cast<int32_t>(i)) return false;
    }
    return true;
}

}  // namespace

A2aInterNodePlan plan_a2a_internode(const std::vector<std::vector<int>>& by_node, int me) {
    A2aInterNodePlan p;
    p.num_nodes = static_cast<int32_t>(by_node.size());
    WEFT_CHECK(p.num_nodes >= 1, "all_to_all across nodes: no node in the team's layout");
    p.per_node = static_cast<int32_t>(by_node[0].size());
    WEFT_CHECK(p.per_node >= 1, "all_to_all across nodes: node 0 has no member");
    p.num_ranks = p.num_nodes * p.per_node;
    std::vector<bool> seen(static_cast<size_t>(p.num_ranks), false);
    p.node = -1;
    for (int32_t n = 0; n < p.num_nodes; ++n) {
        WEFT_CHECK(static_cast<int32_t>(by_node[static_cast<size_t>(n)].size()) == p.per_node,
                   "all_to_all across nodes: node " << n << " has " << by_node[static_cast<size_t>(n)].size()
                                                    << " members, node 0 has " << p.per_node
                                                    << "; every node must hold the same number");
        for (int32_t l = 0; l < p.per_node; ++l) {
            const int t = by_node[static_cast<size_t>(n)][static_cast<size_t>(l)];
            WEFT_CHECK(t >= 0 && t < p.num_ranks && !seen[static_cast<size_t>(t)],
                       "all_to_all across nodes: team rank " << t << " is out of range or appears twice in the layout");
            seen[static_cast<size_t>(t)] = true;
            if (t == me) {
                p.node = n;
                p.local = l;
            }
        }
    }
    WEFT_CHECK(p.node >= 0, "all_to_all across nodes: team rank " << me << " is not in the layout");
    p.me = me;
    const auto at = [&](int32_t n, int32_t l) {
        return static_cast<int32_t>(by_node[static_cast<size_t>(n)][static_cast<size_t>(l)]);
    };
    const auto node_at = [&](int32_t distance_back) {
        return ((p.node - distance_back) % p.num_nodes + p.num_nodes) % p.num_nodes;
    };
    for (int32_t i = 1; i <= p.num_nodes; ++i) {
        const int32_t k = i % p.num_nodes;  // 1, 2, ..., N - 1, then 0
        A2aNodeStage s;
        s.dest_node = node_at(k);
        s.distance = k;
        for (int32_t j = 0; j < p.per_node; ++j) s.send_blocks.push_back(at(s.dest_node, j));
        s.send_contiguous = consecutive(s.send_blocks);
        if (k == 0) {
            for (int32_t l = 0; l < p.per_node; ++l) s.recv_blocks.push_back(at(p.node, l));
            s.recv_contiguous = consecutive(s.recv_blocks);
        }
        p.node_stages.push_back(std::move(s));
    }
    for (int32_t k = 1; k < p.num_nodes; ++k) {
        A2aNetStep st;
        st.distance = k;
        st.to_node = node_at(k);
        st.from_node = (p.node + k) % p.num_nodes;
        st.to_rank = at(st.to_node, p.local);
        st.from_rank = at(st.from_node, p.local);
        for (int32_t l = 0; l < p.per_node; ++l) st.recv_blocks.push_back(at(st.from_node, l));
        st.recv_contiguous = consecutive(st.recv_blocks);
        p.net_steps.push_back(std::move(st));
    }
    return p;
}

}  // namespace weft::net
