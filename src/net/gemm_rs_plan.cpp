// SPDX-License-Identifier: MIT
// GemmRs's inter-node plan (see include/weft/net/gemm_rs_plan.hpp).
#include "weft/net/gemm_rs_plan.hpp"

#include <algorithm>

#include "weft/net/chunk_schedule.hpp"
#include "weft/net/node_layout.hpp"
#include "weft/runtime/error.hpp"

namespace weft::net {

RsInterNodePlan plan_rs_internode(const std::vector<std::vector<int>>& by_node, int me) {
    RsInterNodePlan p;
    const NodeLayoutPosition at_me = locate_in_node_layout(by_node, me, "gemm_rs across nodes");
    p.num_nodes = at_me.num_nodes;
    p.per_node = at_me.per_node;
    p.num_ranks = at_me.num_ranks;
    p.node = at_me.node;
    p.local = at_me.local;
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

RsCallSchedule schedule_rs_call(const RsInterNodePlan& plan, int64_t rows, uint64_t row_bytes, uint64_t chunk_bytes) {
    WEFT_CHECK(rows >= 1, "gemm_rs across nodes: rows per rank must be >= 1, got " << rows);
    WEFT_CHECK(row_bytes > 0 && chunk_bytes > 0, "gemm_rs across nodes: row_bytes and chunk_bytes must be positive");
    RsCallSchedule out;
    const int32_t remote = plan.num_nodes - 1;
    // Rows per sub-block: about chunk_bytes, a multiple of kRsSubBlockRows; fewer, larger ones when the ready words
    // (one per sub-block of every other node's block) would run out.
    const auto r = static_cast<uint64_t>(rows);
    const auto multiple = static_cast<uint64_t>(kRsSubBlockRows);
    uint64_t per = std::max<uint64_t>(1, chunk_bytes / row_bytes / multiple) * multiple;
    if (remote > 0) {
        const auto max_per_block = static_cast<uint64_t>(std::max(1, kMaxChunks / remote));
        if ((r + per - 1) / per > max_per_block) {
            per = ((r + max_per_block - 1) / max_per_block + multiple - 1) / multiple * multiple;
        }
    }
    std::vector<Chunk> sub;
    for (uint64_t begin = 0; begin < r; begin += per) sub.push_back({begin, std::min(per, r - begin)});
    out.sub_blocks = static_cast<int32_t>(sub.size());
    int32_t ready = 0;
    for (size_t i = 0; i < plan.blocks.size(); ++i) {
        if (plan.blocks[i].dest_node == plan.node) {
            out.calls.push_back({static_cast<int32_t>(i), 0, rows, -1});
            continue;
        }
        for (const Chunk& c : sub) {
            out.calls.push_back(
                {static_cast<int32_t>(i), static_cast<int64_t>(c.begin), static_cast<int64_t>(c.count), ready++});
        }
    }
    for (size_t k = 0; k < plan.net_steps.size(); ++k) {
        const int32_t block = plan.net_steps[k].block;
        for (const RsNodeCall& call : out.calls) {
            if (call.block == block) {
                out.chunks.push_back({static_cast<int32_t>(k), call.row_begin, call.num_rows, call.ready});
            }
        }
    }
    return out;
}

}  // namespace weft::net
