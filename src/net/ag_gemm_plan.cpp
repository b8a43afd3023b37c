// SPDX-License-Identifier: MIT
// AgGemm's inter-node plan (see include/weft/net/ag_gemm_plan.hpp).
#include "weft/net/ag_gemm_plan.hpp"

#include "weft/net/node_layout.hpp"
#include "weft/runtime/error.hpp"

namespace weft::net {

AgInterNodePlan plan_ag_internode(const std::vector<std::vector<int>>& by_node, int me) {
    AgInterNodePlan p;
    const NodeLayoutPosition at_me = locate_in_node_layout(by_node, me, "ag_gemm across nodes");
    p.num_nodes = at_me.num_nodes;
    p.per_node = at_me.per_node;
    p.num_ranks = at_me.num_ranks;
    p.node = at_me.node;
    p.local = at_me.local;
    p.slots.assign(static_cast<size_t>(p.num_ranks), AgSlotSource{-1, AgSource::kOwn, -1, -1, -1});
    for (int32_t n = 0; n < p.num_nodes; ++n) {
        for (int32_t l = 0; l < p.per_node; ++l) {
            const int t = by_node[static_cast<size_t>(n)][static_cast<size_t>(l)];
            p.slots[static_cast<size_t>(t)] = AgSlotSource{t, AgSource::kOwn, -1, n, l};
        }
    }
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
