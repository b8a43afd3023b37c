// SPDX-License-Identifier: MIT
// AgGemm's inter-node plan (see include/weft/net/ag_gemm_plan.hpp).
#include "weft/net/ag_gemm_plan.hpp"

#include "weft/runtime/error.hpp"

namespace weft::net {

AgInterNodePlan plan_ag_internode(const std::vector<std::vector<int>>& by_node, int me) {
    AgInterNodePlan p;
    p.num_nodes = static_cast<int32_t>(by_node.size());
    WEFT_CHECK(p.num_nodes >= 1, "ag_gemm across nodes: no node in the team's layout");
    p.per_node = static_cast<int32_t>(by_node[0].size());
    WEFT_CHECK(p.per_node >= 1, "ag_gemm across nodes: node 0 has no member");
    p.num_ranks = p.num_nodes * p.per_node;
    p.slots.assign(static_cast<size_t>(p.num_ranks), AgSlotSource{-1, AgSource::kOwn, -1, -1, -1});
    p.node = -1;
    for (int32_t n = 0; n < p.num_nodes; ++n) {
        WEFT_CHECK(static_cast<int32_t>(by_node[static_cast<size_t>(n)].size()) == p.per_node,
                   "ag_gemm across nodes: node " << n << " has " << by_node[static_cast<size_t>(n)].size()
                                                 << " members, node 0 has " << p.per_node
                                                 << "; every node must hold the same number");
        for (int32_t l = 0; l < p.per_node; ++l) {
            const int t = by_node[static_cast<size_t>(n)][static_cast<size_t>(l)];
            WEFT_CHECK(t >= 0 && t < p.num_ranks && p.slots[static_cast<size_t>(t)].slot < 0,
                       "ag_gemm across nodes: team rank " << t << " is out of range or appears twice in the layout");
            p.slots[static_cast<size_t>(t)] = AgSlotSource{t, AgSource::kOwn, -1, n, l};
            if (t == me) {
                p.node = n;
                p.local = l;
            }
        }
    }
    WEFT_CHECK(p.node >= 0, "ag_gemm across nodes: team rank " << me << " is not in the layout");
    p.me = me;
    const auto at = [&](int32_t n, int32_t l) {
        return static_cast<int32_t>(by_node[static_cast<size_t>(n)][static_cast<size_t>(l)]);
    };
    p.node_major = true;
    for (int32_t n = 0; n < p.num_nodes; ++n) {
        for (int32_t l = 0; l < p.per_node; ++l) p.node_major = p.node_major && at(n, l) == n * p.per_node + l;
    }
    p.rotation_slot = p.node_major ? at(p.node, 0) : me;
    for (AgSlotSource& s : p.slots) {
        if (s.slot == me) {
            s.source = AgSource::kOwn;
            s.holder = me;
        } else if (s.node == p.node) {
            s.source = AgSource::kPeer;
            s.holder = s.slot;
        } else if (s.local == p.local) {
            s.source = AgSource::kNetwork;
            s.holder = me;
        } else {
            s.source = AgSource::kRelay;
            s.holder = at(p.node, s.local);
        }
    }
    for (int32_t l = 0; l < p.per_node; ++l) p.node_peers.push_back(at(p.node, l));
    for (int32_t i = 1; i < p.per_node; ++i) p.copy_order.push_back(at(p.node, (p.local + i) % p.per_node));
    for (int32_t k = 1; k < p.num_nodes; ++k) {
        AgNetStep st;
        st.distance = k;
        st.to_node = (p.node - k + p.num_nodes) % p.num_nodes;
        st.from_node = (p.node + k) % p.num_nodes;
        st.from_slot = at(st.from_node, p.local);
        p.net_steps.push_back(st);
        for (int32_t l = 0; l < p.per_node; ++l) {
            if (l != p.local) p.copy_order.push_back(at(st.from_node, l));
        }
    }
    return p;
}

}  // namespace weft::net
