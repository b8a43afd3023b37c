// SPDX-License-Identifier: MIT
// Unit tests for the multi-node pieces that need no GPU: virtual nodes, a team's layout over nodes, the network
// path's chunk schedule, the hierarchical selection, NCCL's loading, AgGemm's plan across nodes (which shard comes
// from where, in what order) and GemmRs's (which rows are reduced where, which network steps pair up;
// docs/multinode.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <numeric>
#include <random>
#include <tuple>

#include "support/error_text.hpp"
#include "weft/common/tp_schedule.hpp"
#include "weft/detail/nccl_library.hpp"
#include "weft/detail/node_topology.hpp"
#include "weft/net/ag_gemm_plan.hpp"
#include "weft/net/all_to_all_plan.hpp"
#include "weft/net/chunk_schedule.hpp"
#include "weft/net/gemm_rs_plan.hpp"
#include "weft/net/host_backend.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

using detail::node_labels;
using detail::node_layout;
using detail::resolve_virtual_nodes;

using testing::error_of;

TEST(MultiNodeTopology, ResolveVirtualNodes) {
    EXPECT_EQ(resolve_virtual_nodes(0, std::nullopt, 8), 1);
    EXPECT_THROW(resolve_virtual_nodes(-3, std::nullopt, 8), Error);  // not "auto": refused
    EXPECT_EQ(resolve_virtual_nodes(0, std::string(), 8), 1);
    EXPECT_EQ(resolve_virtual_nodes(0, std::string("2"), 8), 2);
    EXPECT_EQ(resolve_virtual_nodes(4, std::string("2"), 8), 4);  // the option wins
    EXPECT_EQ(resolve_virtual_nodes(0, std::string("8"), 8), 8);
    EXPECT_EQ(resolve_virtual_nodes(0, std::string("1"), 3), 1);
    const std::string not_dividing = error_of([] { resolve_virtual_nodes(0, std::string("3"), 8); });
    EXPECT_NE(not_dividing.find("WEFT_VIRTUAL_NODES = 3 must divide the world size 8"), std::string::npos)
        << not_dividing;
    const std::string option = error_of([] { resolve_virtual_nodes(3, std::nullopt, 4); });
    EXPECT_NE(option.find("WorldOptions::virtual_nodes = 3"), std::string::npos) << option;
    for (const char* bad : {"0", "-1", "two", "2x", " 2"}) {
        EXPECT_NE(error_of([&] { resolve_virtual_nodes(0, std::string(bad), 8); }).find("WEFT_VIRTUAL_NODES"),
                  std::string::npos)
            << bad;
    }
}

TEST(MultiNodeTopology, NodeLabels) {
    const std::vector<std::string> one_host(8, "h");
    EXPECT_EQ(node_labels(one_host, 1), one_host);
    const auto two = node_labels(one_host, 2);
    for (int r = 0; r < 8; ++r) EXPECT_EQ(two[static_cast<size_t>(r)], r < 4 ? "h/vnode0" : "h/vnode1") << r;
    const auto four = node_labels(one_host, 4);
    for (int r = 0; r < 8; ++r) EXPECT_EQ(four[static_cast<size_t>(r)], "h/vnode" + std::to_string(r / 2)) << r;
    // Two real hosts of 2 ranks, split in 4: every virtual node is on one host.
    const auto mixed = node_labels({"a", "a", "b", "b"}, 4);
    EXPECT_EQ(mixed, (std::vector<std::string>{"a/vnode0", "a/vnode1", "b/vnode2", "b/vnode3"}));
    EXPECT_EQ(detail::virtual_node_of(5, 8, 2), 1);
    EXPECT_EQ(detail::virtual_node_of(0, 6, 3), 0);
    EXPECT_EQ(detail::virtual_node_of(5, 6, 3), 2);
    EXPECT_THROW(detail::virtual_node_of(8, 8, 2), Error);
    EXPECT_THROW(detail::virtual_node_of(0, 8, 3), Error);
}

TEST(MultiNodeTopology, LayoutOfAnEvenTeam) {
    // 2 nodes x 3: node-major.
    const std::vector<int> nodes{7, 7, 7, 9, 9, 9};
    for (int t = 0; t < 6; ++t) {
        const auto l = node_layout(nodes, t);
        EXPECT_EQ(l.num_nodes, 2);
        EXPECT_EQ(l.ranks_per_node, 3);
        EXPECT_EQ(l.node_index, t / 3);
        EXPECT_EQ(l.local_index, t % 3);
        EXPECT_EQ(l.column, (std::vector<int>{t % 3, 3 + t % 3}));
    }
    EXPECT_EQ(node_layout(nodes, -1).members_by_node, (std::vector<std::vector<int>>{{0, 1, 2}, {3, 4, 5}}));
    EXPECT_EQ(node_layout(nodes, -1).node_index, -1);
    EXPECT_TRUE(node_layout(nodes, -1).column.empty());
}

TEST(MultiNodeTopology, LayoutOfAnInterleavedTeam) {
    // Team ranks alternate between two nodes (a strided team): nodes in order of first appearance.
    const std::vector<int> nodes{1, 0, 1, 0};
    const auto l = node_layout(nodes, 3);
    EXPECT_EQ(l.num_nodes, 2);
    EXPECT_EQ(l.ranks_per_node, 2);
    EXPECT_EQ(l.node_index, 1);
    EXPECT_EQ(l.local_index, 1);
    EXPECT_EQ(l.members_by_node, (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));
    EXPECT_EQ(l.column, (std::vector<int>{2, 3}));
}

TEST(MultiNodeTopology, LayoutOfAnUnevenTeam) {
    const std::vector<int> nodes{0, 0, 0, 1};
    const auto l = node_layout(nodes, 1);
    EXPECT_EQ(l.num_nodes, 2);
    EXPECT_EQ(l.ranks_per_node, 0);
    EXPECT_EQ(l.local_index, 1);
    EXPECT_EQ(l.column, (std::vector<int>{1}));  // node 1 has no local index 1
    EXPECT_EQ(node_layout({5}, 0).num_nodes, 1);
    EXPECT_EQ(node_layout({5}, 0).ranks_per_node, 1);
    EXPECT_EQ(node_layout({}, -1).num_nodes, 0);
    EXPECT_THROW(node_layout({0, 1}, 2), Error);
}

TEST(MultiNodeTopology, RandomLayoutsAreConsistent) {
    std::mt19937 rng(1234);
    for (int trial = 0; trial < 200; ++trial) {
        const int n = 1 + static_cast<int>(rng() % 16);
        std::vector<int> nodes(static_cast<size_t>(n));
        for (int& x : nodes) x = static_cast<int>(rng() % 4);
        int seen = 0;
        for (int t = 0; t < n; ++t) {
            const auto l = node_layout(nodes, t);
            const auto& members = l.members_by_node[static_cast<size_t>(l.node_index)];
            ASSERT_EQ(members[static_cast<size_t>(l.local_index)], t);
            for (int m : members) ASSERT_EQ(nodes[static_cast<size_t>(m)], nodes[static_cast<size_t>(t)]);
            for (int c : l.column) ASSERT_EQ(node_layout(nodes, c).local_index, l.local_index);
            seen += l.local_index == 0 ? 1 : 0;
        }
        EXPECT_EQ(seen, node_layout(nodes, -1).num_nodes);
    }
}

TEST(MultiNodeChunks, PlanCoversTheMessage) {
    for (uint64_t units : {1ull, 2ull, 7ull, 1000ull, 1048577ull, 123456789ull}) {
        for (uint64_t multiple : {1ull, 2ull, 3ull, 8ull}) {
            const auto chunks = net::plan_chunks(units, 2, multiple, 1 << 20);
            ASSERT_FALSE(chunks.empty());
            ASSERT_LE(chunks.size(), static_cast<size_t>(net::kMaxChunks));
            uint64_t next = 0;
            for (size_t c = 0; c < chunks.size(); ++c) {
                ASSERT_EQ(chunks[c].begin, next);
                ASSERT_GT(chunks[c].count, 0u);
                if (c + 1 < chunks.size()) {
                    ASSERT_EQ(chunks[c].count % multiple, 0u) << units << " " << multiple;
                    ASSERT_EQ(chunks[c].count, chunks[0].count);
                }
                next += chunks[c].count;
            }
            ASSERT_EQ(next, units);
        }
    }
}

TEST(MultiNodeChunks, SizesFollowTheChunkBytes) {
    auto chunks = net::plan_chunks(10 << 20, 1, 1, 4 << 20);
    ASSERT_EQ(chunks.size(), 3u);
    EXPECT_EQ(chunks[0].count, 4u << 20);
    EXPECT_EQ(chunks[2].count, 2u << 20);
    // A chunk smaller than a unit still holds one multiple.
    chunks = net::plan_chunks(10, 4, 3, 1);
    EXPECT_EQ(chunks[0].count, 3u);
    EXPECT_EQ(chunks.back().count, 1u);
    // Too many chunks: they grow.
    chunks = net::plan_chunks(1000, 1, 1, 1);
    EXPECT_EQ(chunks.size(), 63u);  // ceil(1000 / 64) = 16 units each
    EXPECT_EQ(chunks[0].count, 16u);
    EXPECT_TRUE(net::plan_chunks(0, 4, 1, 16).empty());
    EXPECT_THROW(net::plan_chunks(4, 0, 1, 16), Error);
    EXPECT_THROW(net::plan_chunks(4, 1, 0, 16), Error);
    EXPECT_THROW(net::plan_chunks(4, 1, 1, 0), Error);
}

TEST(MultiNodeChunks, ResolveChunkBytes) {
    EXPECT_EQ(net::resolve_chunk_bytes(nullptr), net::kDefaultChunkBytes);
    EXPECT_EQ(net::resolve_chunk_bytes(""), net::kDefaultChunkBytes);
    EXPECT_EQ(net::resolve_chunk_bytes("1M"), 1u << 20);
    EXPECT_EQ(net::resolve_chunk_bytes("65536"), 65536u);
    EXPECT_NE(error_of([] { net::resolve_chunk_bytes("lots"); }).find("WEFT_NET_CHUNK_BYTES"), std::string::npos);
    EXPECT_NE(error_of([] { net::resolve_chunk_bytes("0"); }).find("WEFT_NET_CHUNK_BYTES"), std::string::npos);
}

TEST(MultiNodeSelect, HierarchicalExactlyWhenTheTeamSpansNodes) {
    EXPECT_FALSE(ops::select_hierarchical("all_gather", 1, ""));
    EXPECT_FALSE(ops::select_hierarchical("all_gather", 1, "sm_push"));  // single node: the forced algorithm runs
    EXPECT_TRUE(ops::select_hierarchical("all_gather", 2, ""));
    EXPECT_TRUE(ops::select_hierarchical("all_reduce", 4, "auto"));
    const std::string forced = error_of([] { ops::select_hierarchical("reduce_scatter", 2, "sm_pull"); });
    EXPECT_NE(forced.find("reduce_scatter: the algorithm 'sm_pull'"), std::string::npos) << forced;
    EXPECT_NE(forced.find("spans 2 nodes"), std::string::npos) << forced;
    // A name that is no algorithm is said to be so (not that it needs every member reachable).
    const std::string bogus = error_of([] { ops::select_hierarchical("all_reduce", 2, "bogus"); });
    EXPECT_NE(bogus.find("'bogus' is not an algorithm; expected one of: auto, ll, one_shot, two_shot"),
              std::string::npos)
        << bogus;
}

TEST(MultiNodeNccl, LoadingRefusesWhatIsNotNccl) {
    const std::string missing = net::detail::try_load_nccl("/nonexistent/libnccl.so.2");
    EXPECT_NE(missing.find("could not be loaded"), std::string::npos) << missing;
    EXPECT_NE(missing.find("/nonexistent/libnccl.so.2"), std::string::npos) << missing;
    // A library that loads but is not NCCL (when weft was built with nccl.h).
    const std::string not_nccl = net::detail::try_load_nccl("libc.so.6");
    EXPECT_FALSE(not_nccl.empty());
}

TEST(MultiNodeNccl, TheToolkitsNcclLoads) {
    const char* toolkit = "/usr/local/cuda/lib64/libnccl.so.2";
    if (!std::filesystem::exists(toolkit)) GTEST_SKIP() << "no NCCL in the toolkit here";
    const std::string why = net::detail::try_load_nccl(toolkit);
    if (why.find("without nccl.h") != std::string::npos) GTEST_SKIP() << why;
    EXPECT_EQ(why, "");
}

// The process's one libnccl (weft/detail/nccl_library.hpp), shared by both network backends and the benchmarks.
TEST(NcclLibrary, SearchOrder) {
    using detail::nccl_library_candidates;
    using V = std::vector<std::string>;
    EXPECT_EQ(nccl_library_candidates({}),
              (V{"libnccl.so.2", "/usr/local/cuda/lib/libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2"}));
    // WEFT_NCCL_LIBRARY alone when set; an empty one counts as unset.
    EXPECT_EQ(nccl_library_candidates({"/opt/nccl/libnccl.so.2", "/cuda", std::nullopt}),
              (V{"/opt/nccl/libnccl.so.2"}));
    EXPECT_EQ(nccl_library_candidates({"", "/h", "/p"}),
              (V{"libnccl.so.2", "/h/lib/libnccl.so.2", "/h/lib64/libnccl.so.2", "/p/lib/libnccl.so.2",
                 "/p/lib64/libnccl.so.2", "/usr/local/cuda/lib/libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2"}));
    // Repeats are tried once; empty variables are skipped.
    EXPECT_EQ(nccl_library_candidates({std::nullopt, "/usr/local/cuda", ""}),
              (V{"libnccl.so.2", "/usr/local/cuda/lib/libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2"}));
    EXPECT_EQ(detail::nccl_python_candidates("/py/nvidia/nccl"),
              (V{"/py/nvidia/nccl/lib/libnccl.so.2", "/py/nvidia/nccl/libnccl.so.2"}));
    EXPECT_TRUE(detail::nccl_python_candidates("").empty());
}

TEST(NcclLibrary, SaysWhichFilesWereTriedAndWhy) {
    const detail::NcclLibrary lib({"/nonexistent/a/libnccl.so.2", "/nonexistent/b/libnccl.so.2"});
    EXPECT_FALSE(lib.loaded());
    EXPECT_EQ(lib.version(), 0);
    EXPECT_EQ(lib.symbol("ncclGetVersion"), nullptr);
    const std::string& why = lib.why_not();
    EXPECT_EQ(why.rfind("libnccl.so.2 could not be loaded (tried /nonexistent/a/libnccl.so.2", 0), 0u) << why;
    EXPECT_NE(why.find("/nonexistent/b/libnccl.so.2"), std::string::npos) << why;
    EXPECT_NE(why.find("No such file or directory"), std::string::npos) << why;  // dlerror's text
}

TEST(NcclLibrary, ALibraryThatIsNotNcclLacksItsEntryPoints) {
    const detail::NcclLibrary lib({"/nonexistent/libnccl.so.2", "libc.so.6"});
    ASSERT_TRUE(lib.loaded()) << lib.why_not();
    EXPECT_EQ(lib.path(), "libc.so.6");
    EXPECT_EQ(lib.why_not(), "");
    EXPECT_EQ(lib.version(), 0);
    std::string missing;
    size_t (*length)(const char*) = nullptr;
    int (*get_version)(int*) = nullptr;
    lib.resolve(length, "strlen", missing);
    lib.resolve(get_version, "ncclGetVersion", missing);
    lib.resolve(get_version, "ncclGetUniqueId", missing);
    EXPECT_NE(length, nullptr);
    EXPECT_EQ(get_version, nullptr);
    EXPECT_EQ(missing, "ncclGetVersion, ncclGetUniqueId");
}

// ---- AgGemm across nodes (include/weft/net/ag_gemm_plan.hpp) ----

using net::AgInterNodePlan;
using net::AgSource;
using net::plan_ag_internode;

std::vector<std::vector<int>> node_major(int nodes, int per_node) {
    std::vector<std::vector<int>> by_node(static_cast<size_t>(nodes));
    for (int n = 0; n < nodes; ++n) {
        for (int l = 0; l < per_node; ++l) by_node[static_cast<size_t>(n)].push_back(n * per_node + l);
    }
    return by_node;
}

// Two nodes of two: rank 1 (node 0, local 1) copies rank 0 from its node, receives rank 3 (its column) over the
// network, and copies rank 2 from rank 0, which received it over the network.
TEST(MultiNodeAgPlan, TwoNodesOfTwo) {
    const AgInterNodePlan p = plan_ag_internode(node_major(2, 2), 1);
    EXPECT_EQ(p.node, 0);
    EXPECT_EQ(p.local, 1);
    EXPECT_TRUE(p.node_major);
    EXPECT_EQ(p.rotation_slot, 0);
    EXPECT_EQ(p.node_peers, (std::vector<int32_t>{0, 1}));
    EXPECT_EQ(p.slot(1).source, AgSource::kOwn);
    EXPECT_EQ(p.slot(0).source, AgSource::kPeer);
    EXPECT_EQ(p.slot(0).holder, 0);
    EXPECT_EQ(p.slot(3).source, AgSource::kNetwork);
    EXPECT_EQ(p.slot(3).holder, 1);
    EXPECT_EQ(p.slot(2).source, AgSource::kRelay);
    EXPECT_EQ(p.slot(2).holder, 0);
    EXPECT_EQ(p.copy_order, (std::vector<int32_t>{0, 2}));
    ASSERT_EQ(p.net_steps.size(), 1u);
    EXPECT_EQ(p.net_steps[0].to_node, 1);
    EXPECT_EQ(p.net_steps[0].from_node, 1);
    EXPECT_EQ(p.net_steps[0].from_slot, 3);
}

// One rank per node: every other shard comes over the network, nothing is copied on the node.
TEST(MultiNodeAgPlan, OneRankPerNode) {
    for (int me = 0; me < 3; ++me) {
        const AgInterNodePlan p = plan_ag_internode(node_major(3, 1), me);
        EXPECT_TRUE(p.copy_order.empty());
        EXPECT_EQ(p.node_peers, (std::vector<int32_t>{me}));
        EXPECT_EQ(p.rotation_slot, me);
        ASSERT_EQ(p.net_steps.size(), 2u);
        for (int k = 1; k <= 2; ++k) {
            const auto& st = p.net_steps[static_cast<size_t>(k - 1)];
            EXPECT_EQ(st.distance, k);
            EXPECT_EQ(st.from_node, (me + k) % 3);
            EXPECT_EQ(st.to_node, (me - k + 3) % 3);
            EXPECT_EQ(st.from_slot, (me + k) % 3);
            EXPECT_EQ(p.slot(st.from_slot).source, AgSource::kNetwork);
        }
    }
}

// Every layout (node-major and shuffled), every member: each other slot is either received over the network (one per
// other node: this rank's column) or copied exactly once, from a holder on this node with the slot's local index;
// the network steps pair up (node n's send at distance k is node n - k's receive at distance k); copies of relayed
// slots follow the network steps' order.
TEST(MultiNodeAgPlan, EveryShardComesFromExactlyOneSourceAndTheStepsPairUp) {
    std::mt19937 rng(7);
    for (const auto& [nodes, per_node] : {std::pair{2, 1}, std::pair{2, 2}, std::pair{2, 4}, std::pair{3, 2},
                                          std::pair{4, 2}, std::pair{4, 8}, std::pair{3, 3}}) {
        for (int shuffle = 0; shuffle < 3; ++shuffle) {
            std::vector<int> ranks(static_cast<size_t>(nodes * per_node));
            std::iota(ranks.begin(), ranks.end(), 0);
            if (shuffle > 0) std::shuffle(ranks.begin(), ranks.end(), rng);
            std::vector<std::vector<int>> by_node(static_cast<size_t>(nodes));
            for (size_t i = 0; i < ranks.size(); ++i) by_node[i / static_cast<size_t>(per_node)].push_back(ranks[i]);
            std::vector<AgInterNodePlan> plans;
            for (int me = 0; me < nodes * per_node; ++me) plans.push_back(plan_ag_internode(by_node, me));
            for (const AgInterNodePlan& p : plans) {
                SCOPED_TRACE(std::to_string(nodes) + " nodes x " + std::to_string(per_node) + ", shuffle " +
                             std::to_string(shuffle) + ", rank " + std::to_string(p.me));
                std::vector<int> copied(static_cast<size_t>(p.num_ranks), 0);
                for (int32_t t : p.copy_order) copied[static_cast<size_t>(t)] += 1;
                int network = 0;
                for (const auto& s : p.slots) {
                    const int c = copied[static_cast<size_t>(s.slot)];
                    switch (s.source) {
                        case AgSource::kOwn:
                            EXPECT_EQ(s.slot, p.me);
                            EXPECT_EQ(c, 0);
                            break;
                        case AgSource::kPeer:
                            EXPECT_EQ(s.node, p.node);
                            EXPECT_EQ(s.holder, s.slot);
                            EXPECT_EQ(c, 1);
                            break;
                        case AgSource::kNetwork:
                            EXPECT_NE(s.node, p.node);
                            EXPECT_EQ(s.local, p.local);
                            EXPECT_EQ(c, 0);
                            ++network;
                            break;
                        case AgSource::kRelay: {
                            EXPECT_NE(s.node, p.node);
                            EXPECT_NE(s.local, p.local);
                            EXPECT_EQ(c, 1);
                            // The holder is on this node, with the slot's local index, and receives it itself.
                            const AgInterNodePlan& h = plans[static_cast<size_t>(s.holder)];
                            EXPECT_EQ(h.node, p.node);
                            EXPECT_EQ(h.local, s.local);
                            EXPECT_EQ(h.slot(s.slot).source, AgSource::kNetwork);
                            break;
                        }
                    }
                }
                EXPECT_EQ(network, nodes - 1);
                ASSERT_EQ(p.net_steps.size(), static_cast<size_t>(nodes - 1));
                for (const auto& st : p.net_steps) {
                    // The receiver of this send receives from this node at the same distance, in the same column.
                    const int32_t peer = by_node[static_cast<size_t>(st.to_node)][static_cast<size_t>(p.local)];
                    const auto& q = plans[static_cast<size_t>(peer)].net_steps[static_cast<size_t>(st.distance - 1)];
                    EXPECT_EQ(q.from_node, p.node);
                    EXPECT_EQ(q.from_slot, p.me);
                }
                // This node's members first, then the relayed slots by network distance.
                int32_t last_distance = 0;
                for (int32_t t : p.copy_order) {
                    const int32_t d = (p.slot(t).node - p.node + nodes) % nodes;
                    EXPECT_GE(d, last_distance) << "slot " << t;
                    last_distance = d;
                }
                if (shuffle == 0) {
                    EXPECT_TRUE(p.node_major);
                }
                EXPECT_EQ(p.rotation_slot, p.node_major ? by_node[static_cast<size_t>(p.node)][0] : p.me);
            }
        }
    }
}

TEST(MultiNodeAgPlan, RefusesBadLayouts) {
    EXPECT_NE(error_of([] { (void)plan_ag_internode({{0, 1}, {2}}, 0); }).find("same number"), std::string::npos);
    EXPECT_NE(error_of([] { (void)plan_ag_internode({{0, 1}, {1, 2}}, 0); }).find("appears twice"), std::string::npos);
    EXPECT_NE(error_of([] {
                  (void)plan_ag_internode({{0, 1}, {2, 3}}, 5);
              }).find("not in the layout"),
              std::string::npos);
}

// The GEMM's tile order from the plan's rotation slot (AgGemmOrder::rotation_start, as AgGemm sets it): on a
// node-major team whose shards are whole cluster rows, every tile of this node's slots comes before any tile of node
// n+1's, and those before node n+2's (the order the network steps deliver them), with a raster group of one M-tile;
// a larger group (L2 reuse of B) mixes the M-rows inside a group, as on one node. Every tile exactly once.
TEST(MultiNodeAgPlan, TileOrderTakesThisNodeFirstThenTheNetworksOrder) {
    for (const int group : {1, 4}) {
        for (const auto& [nodes, per_node] : {std::pair{2, 1}, std::pair{2, 2}, std::pair{3, 2}, std::pair{4, 2}}) {
            GemmConfig c;
            c.tile_m = 128;
            c.tile_n = 128;
            c.cluster_m = c.cluster_n = 1;
            c.raster_group = group;
            const int w = nodes * per_node;
            for (int64_t rows : {int64_t{128}, int64_t{384}, int64_t{100}, int64_t{300}}) {
                for (int me = 0; me < w; ++me) {
                    const AgInterNodePlan p = plan_ag_internode(node_major(nodes, per_node), me);
                    AgGemmOrder o(c, rows, w, 64, 520, me);
                    o.rotation_start = o.rows().tile_at(p.rotation_slot, 0);
                    std::vector<int> seen(static_cast<size_t>(o.num_m_tiles * o.num_n_tiles), 0);
                    int32_t last_distance = 0;
                    for (int32_t t = 0; t < o.num_cluster_tiles(); ++t) {
                        const GemmTile g = o.tile(t, 0);
                        if (!g.valid) continue;
                        seen[static_cast<size_t>(g.m_idx * o.num_n_tiles + g.n_idx)] += 1;
                        // Tiles that straddle shards, or a raster group of several M-rows: only coverage is checked.
                        if (rows % c.tile_m != 0 || group > 1) continue;
                        const SignalRange r = o.signals_for(g);
                        const int32_t slot = r.last / o.chunks_per_rank;
                        const int32_t d = (p.slot(slot).node - p.node + nodes) % nodes;
                        EXPECT_GE(d, last_distance) << "rank " << me << " position " << t << " rows " << rows;
                        last_distance = d;
                    }
                    for (int v : seen) ASSERT_EQ(v, 1) << "rank " << me << " rows " << rows;
                }
            }
        }
    }
}

// ---- GemmRs across nodes (include/weft/net/gemm_rs_plan.hpp) ----

using net::plan_rs_internode;
using net::RsInterNodePlan;
using net::RsNetStep;
using net::RsNodeBlock;

// Two nodes of two, rank 1 (node 0, local 1): the node stage first reduces the rows of node 1's members (this rank
// keeps its node's sum of rank 3's rows, its column peer), then its own node's (it keeps its node's sum of its own
// rows); one network step sends the first to rank 3 and receives rank 3's node's sum of this rank's rows.
TEST(MultiNodeRsPlan, TwoNodesOfTwo) {
    const RsInterNodePlan p = plan_rs_internode(node_major(2, 2), 1);
    EXPECT_EQ(p.node, 0);
    EXPECT_EQ(p.local, 1);
    EXPECT_EQ(p.node_peers, (std::vector<int32_t>{0, 1}));
    ASSERT_EQ(p.blocks.size(), 2u);
    EXPECT_EQ(p.blocks[0].dest_node, 1);
    EXPECT_EQ(p.blocks[0].dest, 3);
    EXPECT_EQ(p.blocks[0].rows_of, (std::vector<int32_t>{2, 3}));
    EXPECT_EQ(p.blocks[0].first_rank, 2);
    EXPECT_EQ(p.blocks[1].dest_node, 0);
    EXPECT_EQ(p.blocks[1].dest, 1);
    EXPECT_EQ(p.blocks[1].rows_of, (std::vector<int32_t>{0, 1}));
    EXPECT_EQ(p.blocks[1].first_rank, 0);
    ASSERT_EQ(p.net_steps.size(), 1u);
    const RsNetStep& st = p.net_steps[0];
    EXPECT_EQ(st.distance, 1);
    EXPECT_EQ(st.block, 0);
    EXPECT_EQ(st.to_node, 1);
    EXPECT_EQ(st.to_rank, 3);
    EXPECT_EQ(st.from_node, 1);
    EXPECT_EQ(st.from_rank, 3);
}

// One rank per node: every block is one rank's rows (the node stage is the plain GEMM), every other node is a step.
TEST(MultiNodeRsPlan, OneRankPerNode) {
    for (int me = 0; me < 3; ++me) {
        const RsInterNodePlan p = plan_rs_internode(node_major(3, 1), me);
        EXPECT_EQ(p.node_peers, (std::vector<int32_t>{me}));
        ASSERT_EQ(p.blocks.size(), 3u);
        for (int i = 0; i < 3; ++i) {
            const RsNodeBlock& b = p.blocks[static_cast<size_t>(i)];
            EXPECT_EQ(b.dest_node, (me + 1 + i) % 3);
            EXPECT_EQ(b.rows_of, (std::vector<int32_t>{b.dest_node}));
            EXPECT_EQ(b.first_rank, b.dest_node);
        }
        ASSERT_EQ(p.net_steps.size(), 2u);
        EXPECT_EQ(p.net_steps[0].to_rank, (me + 1) % 3);
        EXPECT_EQ(p.net_steps[0].from_rank, (me + 2) % 3);
        EXPECT_EQ(p.net_steps[1].to_rank, (me + 2) % 3);
        EXPECT_EQ(p.net_steps[1].from_rank, (me + 1) % 3);
    }
}

// The whole protocol on the host, for every layout (node-major and shuffled) and every member, with an integer
// partial per (team rank, row): the node stage (the one-node GemmRs over each node's members: member l of a block
// keeps the node's sum of rows [l R, (l+1) R) of the block's A, i.e. of team rank rows_of[l]), the network steps
// (matched by sender, receiver and distance: every send has exactly its receive), the final sum. Every rank's C must
// be the sum over every team rank of that rank's rows, each partial counted once. Also: the members of a node run the
// same blocks in the same order (the node stage's calls match), blocks of other nodes come in step order and this
// node's last, first_rank describes a slice of A exactly when the block's ranks are consecutive.
TEST(MultiNodeRsPlan, EveryPartialIsSummedOnceAndTheStepsPairUp) {
    std::mt19937 rng(11);
    constexpr int64_t kRows = 3;  // R rows of C per rank
    for (const auto& [nodes, per_node] : {std::pair{2, 1}, std::pair{2, 2}, std::pair{2, 4}, std::pair{3, 2},
                                          std::pair{4, 2}, std::pair{4, 8}, std::pair{3, 3}, std::pair{5, 1}}) {
        for (int shuffle = 0; shuffle < 3; ++shuffle) {
            const int w = nodes * per_node;
            std::vector<int> ranks(static_cast<size_t>(w));
            std::iota(ranks.begin(), ranks.end(), 0);
            if (shuffle > 0) std::shuffle(ranks.begin(), ranks.end(), rng);
            std::vector<std::vector<int>> by_node(static_cast<size_t>(nodes));
            for (size_t i = 0; i < ranks.size(); ++i) by_node[i / static_cast<size_t>(per_node)].push_back(ranks[i]);
            SCOPED_TRACE(std::to_string(nodes) + " nodes x " + std::to_string(per_node) + ", shuffle " +
                         std::to_string(shuffle));
            std::vector<RsInterNodePlan> plans;
            for (int me = 0; me < w; ++me) plans.push_back(plan_rs_internode(by_node, me));
            // partial[t][row]: team rank t's partial of row `row` of the M = W R rows.
            const int64_t m = w * kRows;
            std::vector<std::vector<int64_t>> partial(static_cast<size_t>(w),
                                                      std::vector<int64_t>(static_cast<size_t>(m)));
            for (auto& p : partial) {
                for (auto& x : p) x = static_cast<int64_t>(rng() % 1000003);
            }
            const auto at = [&](const std::vector<int64_t>& v, int64_t i) { return v[static_cast<size_t>(i)]; };
            // Node stage: node_sum[t][dest_node][i], i < R, on member t.
            std::vector<std::vector<std::vector<int64_t>>> node_sum(
                static_cast<size_t>(w), std::vector<std::vector<int64_t>>(static_cast<size_t>(nodes)));
            for (const RsInterNodePlan& p : plans) {
                ASSERT_EQ(p.blocks.size(), static_cast<size_t>(nodes));
                EXPECT_EQ(p.blocks.back().dest_node, p.node) << "rank " << p.me << ": this node's rows last";
                EXPECT_EQ(p.node_peers, std::vector<int32_t>(by_node[static_cast<size_t>(p.node)].begin(),
                                                             by_node[static_cast<size_t>(p.node)].end()));
                for (size_t i = 0; i < p.blocks.size(); ++i) {
                    const RsNodeBlock& b = p.blocks[i];
                    // The node's members make the same calls: member 0's blocks.
                    const RsInterNodePlan& first = plans[static_cast<size_t>(p.node_peers[0])];
                    EXPECT_EQ(b.dest_node, first.blocks[i].dest_node) << "rank " << p.me << " block " << i;
                    EXPECT_EQ(b.rows_of, first.blocks[i].rows_of) << "rank " << p.me << " block " << i;
                    EXPECT_EQ(b.rows_of, std::vector<int32_t>(by_node[static_cast<size_t>(b.dest_node)].begin(),
                                                              by_node[static_cast<size_t>(b.dest_node)].end()));
                    EXPECT_EQ(b.dest, b.rows_of[static_cast<size_t>(p.local)]);
                    bool consecutive = true;
                    for (int l = 0; l < per_node; ++l) {
                        consecutive = consecutive && b.rows_of[static_cast<size_t>(l)] == b.rows_of[0] + l;
                    }
                    EXPECT_EQ(b.first_rank, consecutive ? b.rows_of[0] : -1);
                    if (i + 1 < p.blocks.size()) {
                        EXPECT_EQ(b.dest_node, p.net_steps[i].to_node) << "block " << i << " is sent at step " << i + 1;
                        EXPECT_EQ(p.net_steps[i].block, static_cast<int32_t>(i));
                    }
                    // The one-node GemmRs on A's block rows (rows_of[l]'s R rows at l R): member `local` keeps the
                    // node's sum of its rows.
                    std::vector<int64_t> sum(static_cast<size_t>(kRows), 0);
                    for (int32_t s : p.node_peers) {
                        for (int64_t r = 0; r < kRows; ++r) {
                            const int64_t row = b.rows_of[static_cast<size_t>(p.local)] * kRows + r;
                            sum[static_cast<size_t>(r)] += at(partial[static_cast<size_t>(s)], row);
                        }
                    }
                    node_sum[static_cast<size_t>(p.me)][static_cast<size_t>(b.dest_node)] = sum;
                }
            }
            // Network: (sender, receiver, distance) -> the bytes; every receive takes exactly one send.
            std::map<std::tuple<int, int, int>, std::vector<int64_t>> wire;
            for (const RsInterNodePlan& p : plans) {
                ASSERT_EQ(p.net_steps.size(), static_cast<size_t>(nodes - 1));
                for (const RsNetStep& st : p.net_steps) {
                    EXPECT_EQ(st.to_rank, by_node[static_cast<size_t>(st.to_node)][static_cast<size_t>(p.local)]);
                    EXPECT_EQ(st.from_rank, by_node[static_cast<size_t>(st.from_node)][static_cast<size_t>(p.local)]);
                    EXPECT_NE(st.to_node, p.node);
                    EXPECT_NE(st.from_node, p.node);
                    const auto key = std::tuple{p.me, static_cast<int>(st.to_rank), static_cast<int>(st.distance)};
                    EXPECT_EQ(wire.count(key), 0u);
                    wire[key] = node_sum[static_cast<size_t>(p.me)][static_cast<size_t>(st.to_node)];
                }
            }
            for (const RsInterNodePlan& p : plans) {
                std::vector<int64_t> c = node_sum[static_cast<size_t>(p.me)][static_cast<size_t>(p.node)];
                std::vector<bool> from_node(static_cast<size_t>(nodes), false);
                from_node[static_cast<size_t>(p.node)] = true;
                for (const RsNetStep& st : p.net_steps) {
                    const auto key = std::tuple{static_cast<int>(st.from_rank), p.me, static_cast<int>(st.distance)};
                    ASSERT_EQ(wire.count(key), 1u) << "rank " << p.me << " receives from " << st.from_rank
                                                   << " at distance " << st.distance << ", which does not send it";
                    const std::vector<int64_t>& got = wire[key];
                    ASSERT_EQ(got.size(), static_cast<size_t>(kRows));
                    for (int64_t r = 0; r < kRows; ++r) c[static_cast<size_t>(r)] += got[static_cast<size_t>(r)];
                    EXPECT_FALSE(from_node[static_cast<size_t>(st.from_node)]) << "node " << st.from_node << " twice";
                    from_node[static_cast<size_t>(st.from_node)] = true;
                    wire.erase(key);
                }
                for (int64_t r = 0; r < kRows; ++r) {
                    int64_t want = 0;
                    for (int t = 0; t < w; ++t) want += at(partial[static_cast<size_t>(t)], p.me * kRows + r);
                    EXPECT_EQ(c[static_cast<size_t>(r)], want) << "rank " << p.me << " row " << r;
                }
            }
            EXPECT_TRUE(wire.empty()) << wire.size() << " sends nobody received";
        }
    }
}

// A call's schedule (net::schedule_rs_call) on the host, for several layouts, row counts and chunk sizes: the node
// stage's calls cover every row of every block exactly once (sub-blocks of other nodes' blocks: multiples of
// kRsSubBlockRows but the last, within the chunk size unless the ready words run out; this node's block whole and
// last); ready words are distinct, fewer than net::kMaxChunks, and each transfer waits for the call that computed its
// rows; the transfers of a step cover its block's rows in order; a transfer's send is the matching receive of the
// column member it goes to (same step, same rows, paired by sender and receiver); and the sums come out right.
TEST(MultiNodeRsPlan, SubBlocksCoverEveryRowOnceAndTheTransfersPairUp) {
    std::mt19937 rng(5);
    for (const auto& [nodes, per_node] :
         {std::pair{2, 1}, std::pair{2, 2}, std::pair{3, 2}, std::pair{4, 2}, std::pair{2, 8}, std::pair{33, 1}}) {
        for (const int64_t rows : {int64_t{1}, int64_t{100}, int64_t{128}, int64_t{300}, int64_t{4097}}) {
            for (const uint64_t chunk_bytes : {uint64_t{1}, uint64_t{64} << 10, uint64_t{4} << 20}) {
                const uint64_t row_bytes = 272;
                const int w = nodes * per_node;
                std::vector<int> ranks(static_cast<size_t>(w));
                std::iota(ranks.begin(), ranks.end(), 0);
                std::shuffle(ranks.begin(), ranks.end(), rng);
                std::vector<std::vector<int>> by_node(static_cast<size_t>(nodes));
                for (size_t i = 0; i < ranks.size(); ++i)
                    by_node[i / static_cast<size_t>(per_node)].push_back(ranks[i]);
                SCOPED_TRACE(std::to_string(nodes) + " nodes x " + std::to_string(per_node) + ", rows " +
                             std::to_string(rows) + ", chunk_bytes " + std::to_string(chunk_bytes));
                std::vector<RsInterNodePlan> plans;
                std::vector<net::RsCallSchedule> scheds;
                for (int me = 0; me < w; ++me) {
                    plans.push_back(plan_rs_internode(by_node, me));
                    scheds.push_back(net::schedule_rs_call(plans.back(), rows, row_bytes, chunk_bytes));
                }
                // One value per (team rank t, row of the M = W R rows) as t's partial.
                const auto partial = [&](int t, int64_t row) {
                    return static_cast<int64_t>(t) * 1000003 + row * 7 + 1;
                };
                // node_sum[t][node m][r]: what member t holds for t(m, local)'s row r after the node stage.
                std::vector<std::vector<std::vector<int64_t>>> node_sum(
                    static_cast<size_t>(w),
                    std::vector<std::vector<int64_t>>(static_cast<size_t>(nodes),
                                                      std::vector<int64_t>(static_cast<size_t>(rows), -1)));
                for (int me = 0; me < w; ++me) {
                    const RsInterNodePlan& p = plans[static_cast<size_t>(me)];
                    const net::RsCallSchedule& sc = scheds[static_cast<size_t>(me)];
                    // The node's members make the same calls (the one-node op's calls must match).
                    const net::RsCallSchedule& first = scheds[static_cast<size_t>(p.node_peers[0])];
                    ASSERT_EQ(sc.calls.size(), first.calls.size());
                    std::vector<bool> ready_seen(static_cast<size_t>(net::kMaxChunks), false);
                    for (size_t i = 0; i < sc.calls.size(); ++i) {
                        const net::RsNodeCall& call = sc.calls[i];
                        EXPECT_EQ(call.block, first.calls[i].block);
                        EXPECT_EQ(call.row_begin, first.calls[i].row_begin);
                        EXPECT_EQ(call.num_rows, first.calls[i].num_rows);
                        const RsNodeBlock& b = p.blocks[static_cast<size_t>(call.block)];
                        ASSERT_GE(call.num_rows, 1);
                        ASSERT_LE(call.row_begin + call.num_rows, rows);
                        if (b.dest_node == p.node) {
                            EXPECT_EQ(call.ready, -1);
                            EXPECT_EQ(call.num_rows, rows);
                            EXPECT_EQ(i + 1, sc.calls.size()) << "this node's block last";
                        } else {
                            ASSERT_GE(call.ready, 0);
                            ASSERT_LT(call.ready, net::kMaxChunks);
                            EXPECT_FALSE(ready_seen[static_cast<size_t>(call.ready)]) << "ready " << call.ready;
                            ready_seen[static_cast<size_t>(call.ready)] = true;
                            EXPECT_EQ(call.row_begin % net::kRsSubBlockRows, 0);
                            if (call.row_begin + call.num_rows < rows) {
                                EXPECT_EQ(call.num_rows % net::kRsSubBlockRows, 0);
                                if (sc.sub_blocks * (nodes - 1) < net::kMaxChunks / 2) {
                                    EXPECT_LE(static_cast<uint64_t>(call.num_rows) * row_bytes,
                                              std::max<uint64_t>(chunk_bytes, net::kRsSubBlockRows * row_bytes));
                                }
                            }
                        }
                        for (int64_t r = call.row_begin; r < call.row_begin + call.num_rows; ++r) {
                            int64_t& slot = node_sum[static_cast<size_t>(me)][static_cast<size_t>(b.dest_node)]
                                                    [static_cast<size_t>(r)];
                            EXPECT_EQ(slot, -1) << "row " << r << " of block " << call.block << " computed twice";
                            slot = 0;
                            for (int32_t t : p.node_peers) slot += partial(t, b.dest * rows + r);
                        }
                    }
                    for (int node = 0; node < nodes; ++node) {
                        for (int64_t r = 0; r < rows; ++r) {
                            ASSERT_NE(
                                node_sum[static_cast<size_t>(me)][static_cast<size_t>(node)][static_cast<size_t>(r)],
                                -1)
                                << "rank " << me << ": row " << r << " for node " << node << " never computed";
                        }
                    }
                    // Transfers: per step, its block's rows in order, each after the call that computed them.
                    int64_t next = 0;
                    int32_t step = 0;
                    for (const net::RsNetChunk& ch : sc.chunks) {
                        if (ch.step != step) {
                            EXPECT_EQ(next, rows) << "step " << step << " covers its block";
                            EXPECT_EQ(ch.step, step + 1);
                            step = ch.step;
                            next = 0;
                        }
                        EXPECT_EQ(ch.row_begin, next);
                        next = ch.row_begin + ch.num_rows;
                        const auto it = std::find_if(sc.calls.begin(), sc.calls.end(),
                                                     [&](const net::RsNodeCall& c) { return c.ready == ch.ready; });
                        ASSERT_NE(it, sc.calls.end());
                        EXPECT_EQ(it->block, p.net_steps[static_cast<size_t>(ch.step)].block);
                        EXPECT_EQ(it->row_begin, ch.row_begin);
                        EXPECT_EQ(it->num_rows, ch.num_rows);
                    }
                    EXPECT_EQ(step, nodes - 2);
                    EXPECT_EQ(next, rows);
                }
                // The wire: (sender, receiver, step, first row) -> the rows' values.
                std::map<std::tuple<int, int, int, int64_t>, std::vector<int64_t>> wire;
                for (int me = 0; me < w; ++me) {
                    const RsInterNodePlan& p = plans[static_cast<size_t>(me)];
                    for (const net::RsNetChunk& ch : scheds[static_cast<size_t>(me)].chunks) {
                        const RsNetStep& st = p.net_steps[static_cast<size_t>(ch.step)];
                        const auto& from = node_sum[static_cast<size_t>(me)][static_cast<size_t>(st.to_node)];
                        wire[{me, st.to_rank, ch.step, ch.row_begin}] = std::vector<int64_t>(
                            from.begin() + ch.row_begin, from.begin() + ch.row_begin + ch.num_rows);
                    }
                }
                for (int me = 0; me < w; ++me) {
                    const RsInterNodePlan& p = plans[static_cast<size_t>(me)];
                    std::vector<int64_t> c = node_sum[static_cast<size_t>(me)][static_cast<size_t>(p.node)];
                    for (const net::RsNetChunk& ch : scheds[static_cast<size_t>(me)].chunks) {
                        const RsNetStep& st = p.net_steps[static_cast<size_t>(ch.step)];
                        const auto key =
                            std::tuple{static_cast<int>(st.from_rank), me, static_cast<int>(ch.step), ch.row_begin};
                        ASSERT_EQ(wire.count(key), 1u) << "rank " << me << " step " << ch.step << " rows from "
                                                       << ch.row_begin << ": nobody sends them";
                        const std::vector<int64_t>& got = wire[key];
                        ASSERT_EQ(static_cast<int64_t>(got.size()), ch.num_rows) << "send and receive sizes differ";
                        for (int64_t r = 0; r < ch.num_rows; ++r) {
                            c[static_cast<size_t>(ch.row_begin + r)] += got[static_cast<size_t>(r)];
                        }
                        wire.erase(key);
                    }
                    for (int64_t r = 0; r < rows; ++r) {
                        int64_t want = 0;
                        for (int t = 0; t < w; ++t) want += partial(t, me * rows + r);
                        ASSERT_EQ(c[static_cast<size_t>(r)], want) << "rank " << me << " row " << r;
                    }
                }
                EXPECT_TRUE(wire.empty()) << wire.size() << " transfers nobody received";
            }
        }
    }
}

TEST(MultiNodeRsPlan, RefusesBadLayouts) {
    EXPECT_NE(error_of([] { (void)plan_rs_internode({{0, 1}, {2}}, 0); }).find("same number"), std::string::npos);
    EXPECT_NE(error_of([] { (void)plan_rs_internode({{0, 1}, {1, 2}}, 0); }).find("appears twice"), std::string::npos);
    EXPECT_NE(error_of([] { (void)plan_rs_internode({{0, 1}, {2, 4}}, 0); }).find("out of range"), std::string::npos);
    EXPECT_NE(error_of([] {
                  (void)plan_rs_internode({{0, 1}, {2, 3}}, 5);
              }).find("not in the layout"),
              std::string::npos);
}

// ---- All-to-all across nodes (include/weft/net/all_to_all_plan.hpp) ----

using net::A2aInterNodePlan;
using net::plan_a2a_internode;

enum class A2aLayout { kNodeMajor, kInterleaved, kShuffled };

std::vector<std::vector<int>> a2a_layout(int nodes, int per_node, A2aLayout layout, std::mt19937& rng) {
    std::vector<int> ranks(static_cast<size_t>(nodes * per_node));
    std::iota(ranks.begin(), ranks.end(), 0);
    if (layout == A2aLayout::kShuffled) std::shuffle(ranks.begin(), ranks.end(), rng);
    std::vector<std::vector<int>> by_node(static_cast<size_t>(nodes));
    for (int n = 0; n < nodes; ++n) {
        for (int l = 0; l < per_node; ++l) {
            // Interleaved: team rank l * N + n (every other rank on another node), as Team::split_strided makes it.
            by_node[static_cast<size_t>(n)].push_back(
                layout == A2aLayout::kInterleaved ? l * nodes + n : ranks[static_cast<size_t>(n * per_node + l)]);
        }
    }
    return by_node;
}

// A host simulation of the whole call from every member's plan: the node stages (weft's all_to_all over each node's
// members: member j gets member l's j-th block at position l), the network steps (a send is delivered to the peer
// whose matching step receives from this rank, with as many blocks), and the output slots they write. Every output
// block must hold the block its source rank sent to this rank, written exactly once.
TEST(MultiNodeA2aPlan, EveryBlockLandsInItsSlotExactlyOnceAndTheStepsPairUp) {
    std::mt19937 rng(11);
    for (int nodes : {2, 3, 4}) {
        for (int per_node : {1, 2, 3}) {
            for (A2aLayout layout : {A2aLayout::kNodeMajor, A2aLayout::kInterleaved, A2aLayout::kShuffled}) {
                const int w = nodes * per_node;
                const auto by_node = a2a_layout(nodes, per_node, layout, rng);
                SCOPED_TRACE(std::to_string(nodes) + " nodes x " + std::to_string(per_node) + ", layout " +
                             std::to_string(static_cast<int>(layout)));
                std::vector<A2aInterNodePlan> plans;
                for (int me = 0; me < w; ++me) plans.push_back(plan_a2a_internode(by_node, me));
                // A block is identified by (source, destination): source * w + destination.
                const auto tag = [&](int src, int dst) { return src * w + dst; };
                std::vector<std::vector<int>> out(static_cast<size_t>(w), std::vector<int>(static_cast<size_t>(w), -1));
                std::vector<std::vector<int>> writes(static_cast<size_t>(w),
                                                     std::vector<int>(static_cast<size_t>(w), 0));
                const auto write = [&](int rank, int slot, int value) {
                    ASSERT_GE(slot, 0);
                    ASSERT_LT(slot, w);
                    out[static_cast<size_t>(rank)][static_cast<size_t>(slot)] = value;
                    writes[static_cast<size_t>(rank)][static_cast<size_t>(slot)] += 1;
                };
                // sent[rank][k - 1]: the blocks the node stage of distance k left this rank to send.
                std::vector<std::vector<std::vector<int>>> sent(
                    static_cast<size_t>(w), std::vector<std::vector<int>>(static_cast<size_t>(nodes - 1)));
                for (int n = 0; n < nodes; ++n) {
                    const std::vector<int>& members = by_node[static_cast<size_t>(n)];
                    const A2aInterNodePlan& first = plans[static_cast<size_t>(members[0])];
                    ASSERT_EQ(first.node_stages.size(), static_cast<size_t>(nodes));
                    for (size_t s = 0; s < first.node_stages.size(); ++s) {
                        // Every member of the node runs the same stage at the same position.
                        for (int t : members) {
                            const auto& st = plans[static_cast<size_t>(t)].node_stages[s];
                            EXPECT_EQ(st.dest_node, first.node_stages[s].dest_node);
                            EXPECT_EQ(st.distance, first.node_stages[s].distance);
                            ASSERT_EQ(st.send_blocks.size(), static_cast<size_t>(per_node));
                            if (layout == A2aLayout::kNodeMajor) {
                                EXPECT_TRUE(st.send_contiguous);
                            }
                        }
                        for (int j = 0; j < per_node; ++j) {
                            const int receiver = members[static_cast<size_t>(j)];
                            const auto& st = plans[static_cast<size_t>(receiver)].node_stages[s];
                            std::vector<int> result;
                            for (int l = 0; l < per_node; ++l) {
                                const int sender = members[static_cast<size_t>(l)];
                                const int dst = plans[static_cast<size_t>(sender)]
                                                    .node_stages[s]
                                                    .send_blocks[static_cast<size_t>(j)];
                                result.push_back(tag(sender, dst));
                            }
                            if (st.distance == 0) {
                                ASSERT_EQ(st.recv_blocks.size(), static_cast<size_t>(per_node));
                                if (layout == A2aLayout::kNodeMajor) {
                                    EXPECT_TRUE(st.recv_contiguous);
                                }
                                for (int l = 0; l < per_node; ++l) {
                                    write(receiver, st.recv_blocks[static_cast<size_t>(l)],
                                          result[static_cast<size_t>(l)]);
                                }
                            } else {
                                EXPECT_TRUE(st.recv_blocks.empty());
                                sent[static_cast<size_t>(receiver)][static_cast<size_t>(st.distance - 1)] = result;
                            }
                        }
                    }
                }
                for (const A2aInterNodePlan& p : plans) {
                    ASSERT_EQ(p.net_steps.size(), static_cast<size_t>(nodes - 1));
                    for (size_t i = 0; i < p.net_steps.size(); ++i) {
                        const auto& st = p.net_steps[i];
                        EXPECT_EQ(st.distance, static_cast<int32_t>(i + 1));
                        EXPECT_EQ(st.to_node, (p.node - st.distance + nodes) % nodes);
                        EXPECT_EQ(st.from_node, (p.node + st.distance) % nodes);
                        // The peer's step of the same distance receives from this rank, as many blocks as sent.
                        const A2aInterNodePlan& peer = plans[static_cast<size_t>(st.to_rank)];
                        EXPECT_EQ(peer.node, st.to_node);
                        EXPECT_EQ(peer.local, p.local);
                        const auto& ps = peer.net_steps[i];
                        EXPECT_EQ(ps.distance, st.distance);
                        EXPECT_EQ(ps.from_rank, p.me);
                        EXPECT_EQ(ps.from_node, p.node);
                        const auto& blocks = sent[static_cast<size_t>(p.me)][i];
                        ASSERT_EQ(blocks.size(), ps.recv_blocks.size());
                        if (layout == A2aLayout::kNodeMajor) {
                            EXPECT_TRUE(ps.recv_contiguous);
                        }
                        // One member per node sends straight from its input: the stage's only block is the peer's.
                        if (per_node == 1) {
                            EXPECT_EQ(p.node_stages[i].send_blocks, (std::vector<int32_t>{st.to_rank}));
                        }
                        for (size_t b = 0; b < blocks.size(); ++b) write(peer.me, ps.recv_blocks[b], blocks[b]);
                    }
                }
                for (int r = 0; r < w; ++r) {
                    for (int q = 0; q < w; ++q) {
                        EXPECT_EQ(writes[static_cast<size_t>(r)][static_cast<size_t>(q)], 1)
                            << "rank " << r << " slot " << q;
                        EXPECT_EQ(out[static_cast<size_t>(r)][static_cast<size_t>(q)], tag(q, r))
                            << "rank " << r << " slot " << q;
                    }
                }
            }
        }
    }
}

// The byte layout (net::layout_a2a_internode) simulated byte by byte, as hierarchical_all_to_all moves them: packing,
// the node stages (all_to_all_v over each node's members: sizes must agree between sender and receiver), the network
// steps (send and receive sizes must agree), the unpacking. Equal splits (awkward sizes, 1 byte included) and uneven
// ones (random counts, zeros included); every output byte holds the right source byte, written exactly once.
TEST(MultiNodeA2aPlan, EveryByteLandsInItsSlotExactlyOnce) {
    std::mt19937 rng(23);
    for (int nodes : {2, 3, 4}) {
        for (int per_node : {1, 2, 3}) {
            for (A2aLayout layout : {A2aLayout::kNodeMajor, A2aLayout::kInterleaved, A2aLayout::kShuffled}) {
                for (int counts_case = 0; counts_case < 4; ++counts_case) {
                    const int w = nodes * per_node;
                    const auto ws = static_cast<size_t>(w);
                    const auto by_node = a2a_layout(nodes, per_node, layout, rng);
                    SCOPED_TRACE(std::to_string(nodes) + " nodes x " + std::to_string(per_node) + ", layout " +
                                 std::to_string(static_cast<int>(layout)) + ", counts " + std::to_string(counts_case));
                    // bytes[s][d]: what s sends to d. Cases: 1 byte each, 7 bytes each, random 0..5, random 0..40.
                    std::vector<std::vector<uint64_t>> bytes(ws, std::vector<uint64_t>(ws));
                    for (auto& row : bytes) {
                        for (auto& x : row) {
                            x = counts_case == 0 ? 1
                                : counts_case == 1
                                    ? 7
                                    : std::uniform_int_distribution<uint64_t>(0, counts_case == 2 ? 5 : 40)(rng);
                        }
                    }
                    const auto tag = [&](size_t src, size_t dst, uint64_t i) {
                        return static_cast<int64_t>((src * ws + dst) * 64 + i);
                    };
                    std::vector<A2aInterNodePlan> plans;
                    std::vector<net::A2aByteLayout> layouts;
                    std::vector<std::vector<int64_t>> in(ws), out(ws), packed(ws), sent(ws), received(ws), own(ws);
                    std::vector<std::vector<int>> writes(ws);
                    std::vector<std::vector<uint64_t>> recv_at(ws, std::vector<uint64_t>(ws + 1, 0));
                    for (size_t r = 0; r < ws; ++r) {
                        plans.push_back(plan_a2a_internode(by_node, static_cast<int>(r)));
                        std::vector<uint64_t> send_bytes(ws), recv_bytes(ws);
                        for (size_t q = 0; q < ws; ++q) {
                            send_bytes[q] = bytes[r][q];
                            recv_bytes[q] = bytes[q][r];
                            for (uint64_t i = 0; i < bytes[r][q]; ++i) in[r].push_back(tag(r, q, i));
                            recv_at[r][q + 1] = recv_at[r][q] + recv_bytes[q];
                        }
                        std::vector<std::vector<uint64_t>> node_rows;
                        for (int t : by_node[static_cast<size_t>(plans[r].node)]) {
                            node_rows.push_back(bytes[static_cast<size_t>(t)]);
                        }
                        layouts.push_back(net::layout_a2a_internode(plans[r], send_bytes, recv_bytes, node_rows));
                        const net::A2aByteLayout& b = layouts.back();
                        out[r].assign(recv_at[r][ws], -1);
                        writes[r].assign(recv_at[r][ws], 0);
                        packed[r].assign(b.packed_bytes, -1);
                        sent[r].assign(b.sent_bytes, -1);
                        received[r].assign(b.received_bytes, -1);
                        own[r].assign(b.own_bytes, -1);
                    }
                    const auto put_out = [&](size_t r, uint64_t at, int64_t v) {
                        ASSERT_LT(at, out[r].size());
                        out[r][at] = v;
                        writes[r][at] += 1;
                    };
                    // Node stages (none with one member per node: the steps send from the input).
                    for (int n = 0; n < nodes; ++n) {
                        const std::vector<int>& members = by_node[static_cast<size_t>(n)];
                        for (size_t s = 0; s < static_cast<size_t>(nodes); ++s) {
                            const bool own_stage = plans[static_cast<size_t>(members[0])].node_stages[s].distance == 0;
                            if (per_node == 1 && !own_stage) continue;
                            // Each member's stage input, packed where needed.
                            std::vector<std::vector<int64_t>> stage_in(members.size());
                            for (size_t j = 0; j < members.size(); ++j) {
                                const auto r = static_cast<size_t>(members[j]);
                                const auto& st = plans[r].node_stages[s];
                                const auto& b = layouts[r].stages[s];
                                uint64_t total = 0;
                                for (uint64_t x : b.send_bytes) total += x;
                                if (st.send_contiguous) {
                                    ASSERT_LE(b.input_offset + total, in[r].size());
                                    stage_in[j].assign(in[r].begin() + static_cast<int64_t>(b.input_offset),
                                                       in[r].begin() + static_cast<int64_t>(b.input_offset + total));
                                } else {
                                    uint64_t at = b.input_offset;
                                    for (const net::A2aSpan& p : b.pack) {
                                        for (uint64_t i = 0; i < p.bytes; ++i)
                                            packed[r].at(at++) = in[r].at(p.offset + i);
                                    }
                                    stage_in[j].assign(
                                        packed[r].begin() + static_cast<int64_t>(b.input_offset),
                                        packed[r].begin() + static_cast<int64_t>(b.input_offset + total));
                                }
                            }
                            for (size_t j = 0; j < members.size(); ++j) {
                                const auto r = static_cast<size_t>(members[j]);
                                const auto& st = plans[r].node_stages[s];
                                const auto& b = layouts[r].stages[s];
                                std::vector<int64_t> result;
                                for (size_t l = 0; l < members.size(); ++l) {
                                    const auto& bl = layouts[static_cast<size_t>(members[l])].stages[s];
                                    ASSERT_EQ(bl.send_bytes[j], b.recv_bytes[l]) << "node stage sizes, member " << j;
                                    uint64_t from = 0;
                                    for (size_t i = 0; i < j; ++i) from += bl.send_bytes[i];
                                    for (uint64_t i = 0; i < bl.send_bytes[j]; ++i)
                                        result.push_back(stage_in[l][from + i]);
                                }
                                if (!own_stage) {
                                    for (size_t i = 0; i < result.size(); ++i)
                                        sent[r].at(b.output_offset + i) = result[i];
                                } else if (st.recv_contiguous) {
                                    for (size_t i = 0; i < result.size(); ++i)
                                        put_out(r, b.output_offset + i, result[i]);
                                } else {
                                    ASSERT_EQ(result.size(), own[r].size());
                                    uint64_t at = 0;
                                    for (const net::A2aSpan& p : b.unpack) {
                                        for (uint64_t i = 0; i < p.bytes; ++i) put_out(r, p.offset + i, result[at++]);
                                    }
                                }
                            }
                        }
                    }
                    // Network steps.
                    for (size_t r = 0; r < ws; ++r) {
                        for (size_t i = 0; i < plans[r].net_steps.size(); ++i) {
                            const auto& st = plans[r].net_steps[i];
                            const auto& b = layouts[r].steps[i];
                            const auto peer = static_cast<size_t>(st.to_rank);
                            const auto& pst = plans[peer].net_steps[i];
                            const auto& pb = layouts[peer].steps[i];
                            ASSERT_EQ(pst.from_rank, static_cast<int32_t>(r));
                            ASSERT_EQ(b.send_bytes, pb.recv_bytes) << "network sizes, rank " << r << " step " << i;
                            const std::vector<int64_t>& src = per_node == 1 ? in[r] : sent[r];
                            for (uint64_t k = 0; k < b.send_bytes; ++k) {
                                const int64_t v = src.at(b.send_offset + k);
                                if (pst.recv_contiguous) {
                                    put_out(peer, pb.recv_offset + k, v);
                                } else {
                                    received[peer].at(pb.recv_offset + k) = v;
                                }
                            }
                        }
                    }
                    // Unpacking of the received steps.
                    for (size_t r = 0; r < ws; ++r) {
                        for (const auto& b : layouts[r].steps) {
                            uint64_t at = b.recv_offset;
                            for (const net::A2aSpan& p : b.unpack) {
                                for (uint64_t i = 0; i < p.bytes; ++i) put_out(r, p.offset + i, received[r].at(at++));
                            }
                        }
                    }
                    uint64_t bad = 0;
                    for (size_t r = 0; r < ws; ++r) {
                        for (size_t q = 0; q < ws; ++q) {
                            for (uint64_t i = 0; i < bytes[q][r]; ++i) {
                                const uint64_t at = recv_at[r][q] + i;
                                bad += out[r][at] != tag(q, r, i) || writes[r][at] != 1;
                            }
                        }
                    }
                    EXPECT_EQ(bad, 0u);
                }
            }
        }
    }
}

// The interleaved layout packs: a node stage's blocks and a step's received blocks are not consecutive there.
TEST(MultiNodeA2aPlan, InterleavedTeamsPackAndUnpack) {
    std::mt19937 rng(1);
    const A2aInterNodePlan p = plan_a2a_internode(a2a_layout(2, 2, A2aLayout::kInterleaved, rng), 1);
    EXPECT_EQ(p.node, 1);
    EXPECT_EQ(p.local, 0);
    ASSERT_EQ(p.node_stages.size(), 2u);
    EXPECT_EQ(p.node_stages[0].dest_node, 0);
    EXPECT_EQ(p.node_stages[0].send_blocks, (std::vector<int32_t>{0, 2}));
    EXPECT_FALSE(p.node_stages[0].send_contiguous);
    EXPECT_EQ(p.node_stages[1].distance, 0);
    EXPECT_EQ(p.node_stages[1].recv_blocks, (std::vector<int32_t>{1, 3}));
    EXPECT_FALSE(p.node_stages[1].recv_contiguous);
    ASSERT_EQ(p.net_steps.size(), 1u);
    EXPECT_EQ(p.net_steps[0].to_rank, 0);
    EXPECT_EQ(p.net_steps[0].from_rank, 0);
    EXPECT_EQ(p.net_steps[0].recv_blocks, (std::vector<int32_t>{0, 2}));
}

TEST(MultiNodeA2aPlan, RefusesBadLayouts) {
    EXPECT_NE(error_of([] { (void)plan_a2a_internode({{0, 1}, {2}}, 0); }).find("same number"), std::string::npos);
    EXPECT_NE(error_of([] { (void)plan_a2a_internode({{0, 1}, {1, 2}}, 0); }).find("appears twice"), std::string::npos);
    EXPECT_NE(error_of([] {
                  (void)plan_a2a_internode({{0, 1}, {2, 3}}, 5);
              }).find("not in the layout"),
              std::string::npos);
}

}  // namespace
}  // namespace weft
