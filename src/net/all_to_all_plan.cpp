// SPDX-License-Identifier: MIT
// The inter-node all-to-all plan (see include/weft/net/all_to_all_plan.hpp).
#include "weft/net/all_to_all_plan.hpp"

#include "weft/net/node_layout.hpp"
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
    const NodeLayoutPosition where = locate_in_node_layout(by_node, me, "all_to_all across nodes");
    A2aInterNodePlan p;
    p.num_nodes = where.num_nodes;
    p.per_node = where.per_node;
    p.num_ranks = where.num_ranks;
    p.node = where.node;
    p.local = where.local;
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

A2aByteLayout layout_a2a_internode(const A2aInterNodePlan& plan, std::span<const uint64_t> send_bytes,
                                   std::span<const uint64_t> recv_bytes,
                                   const std::vector<std::vector<uint64_t>>& node_send_bytes) {
    const auto w = static_cast<size_t>(plan.num_ranks);
    const auto l_count = static_cast<size_t>(plan.per_node);
    WEFT_CHECK(send_bytes.size() == w && recv_bytes.size() == w,
               "all_to_all across nodes: " << w << " send and receive counts expected, got " << send_bytes.size()
                                           << " and " << recv_bytes.size());
    WEFT_CHECK(node_send_bytes.size() == l_count, "all_to_all across nodes: the node's counts must have "
                                                      << l_count << " rows, got " << node_send_bytes.size());
    for (const auto& row : node_send_bytes) {
        WEFT_CHECK(row.size() == w, "all_to_all across nodes: a row of the node's counts must have "
                                        << w << " entries, got " << row.size());
    }
    std::vector<uint64_t> send_at(w + 1, 0), recv_at(w + 1, 0);
    for (size_t q = 0; q < w; ++q) {
        send_at[q + 1] = send_at[q] + send_bytes[q];
        recv_at[q + 1] = recv_at[q] + recv_bytes[q];
    }
    const bool direct = plan.per_node == 1;
    const auto local = static_cast<size_t>(plan.local);
    A2aByteLayout b;
    for (const A2aNodeStage& s : plan.node_stages) {
        A2aByteLayout::Stage st;
        for (int32_t t : s.send_blocks) st.send_bytes.push_back(send_bytes[static_cast<size_t>(t)]);
        for (size_t l = 0; l < l_count; ++l) {
            // From node member l: its bytes for t(dest_node, local), which is this rank itself on this node's stage.
            st.recv_bytes.push_back(node_send_bytes[l][static_cast<size_t>(s.send_blocks[local])]);
        }
        uint64_t in_total = 0, out_total = 0;
        for (uint64_t x : st.send_bytes) in_total += x;
        for (uint64_t x : st.recv_bytes) out_total += x;
        if (s.send_contiguous) {
            st.input_offset = send_at[static_cast<size_t>(s.send_blocks[0])];
        } else {
            st.input_offset = b.packed_bytes;
            for (int32_t t : s.send_blocks) {
                st.pack.push_back({send_at[static_cast<size_t>(t)], send_bytes[static_cast<size_t>(t)]});
            }
            b.packed_bytes += in_total;
        }
        if (s.distance > 0) {
            st.output_offset = b.sent_bytes;
            if (!direct) b.sent_bytes += out_total;
        } else if (s.recv_contiguous) {
            st.output_offset = recv_at[static_cast<size_t>(s.recv_blocks[0])];
        } else {
            b.own_bytes = out_total;
            for (int32_t t : s.recv_blocks) {
                st.unpack.push_back({recv_at[static_cast<size_t>(t)], recv_bytes[static_cast<size_t>(t)]});
            }
        }
        b.stages.push_back(std::move(st));
    }
    for (const A2aNetStep& s : plan.net_steps) {
        A2aByteLayout::Step st;
        const A2aByteLayout::Stage& stage = b.stages[static_cast<size_t>(s.distance - 1)];
        if (direct) {
            st.send_offset = send_at[static_cast<size_t>(s.to_rank)];
            st.send_bytes = send_bytes[static_cast<size_t>(s.to_rank)];
        } else {
            st.send_offset = stage.output_offset;
            for (uint64_t x : stage.recv_bytes) st.send_bytes += x;
        }
        for (int32_t t : s.recv_blocks) st.recv_bytes += recv_bytes[static_cast<size_t>(t)];
        if (s.recv_contiguous) {
            st.recv_offset = recv_at[static_cast<size_t>(s.recv_blocks[0])];
        } else {
            st.recv_offset = b.received_bytes;
            b.received_bytes += st.recv_bytes;
            for (int32_t t : s.recv_blocks) {
                st.unpack.push_back({recv_at[static_cast<size_t>(t)], recv_bytes[static_cast<size_t>(t)]});
            }
        }
        b.steps.push_back(std::move(st));
    }
    return b;
}

}  // namespace weft::net
