// SPDX-License-Identifier: MIT
// Expert parallelism across nodes, on the CPU: the record layout of the exchange (weft/common/ep_internode.hpp), the
// per-destination routes of a token, and a host simulation of the whole design (pack, exchange, one-rank dispatch,
// one-rank combine, exchange back, sum) against the one-node reference: the same receive layout and the same combine
// bits for every routing scenario.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "support/ep_reference.hpp"
#include "support/ep_testing.hpp"
#include "support/jit_testing.hpp"
#include "weft/common/ep_internode.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/ep.hpp"
#include "weft/runtime/error.hpp"

namespace weft::ops::ep {
namespace {

namespace ref = weft::test::ep;
using weft::ep::InternodeLayout;
using weft::ep::routes_to_rank;

Config config_of(int experts, int hidden, int topk, int max_tokens, int alignment = 1) {
    Config c;
    c.num_experts = experts;
    c.hidden = hidden;
    c.topk = topk;
    c.max_tokens_per_rank = max_tokens;
    c.low_latency = false;
    c.expert_alignment = alignment;
    return c;
}

TEST(EpInternodePlan, RecordLayout) {
    struct Case {
        int ranks, experts, hidden, topk, max_tokens;
    };
    for (const Case c : {Case{4, 16, 7168, 8, 4096}, Case{4, 8, 8, 8, 1}, Case{6, 12, 136, 2, 129},
                         Case{2, 2, 24, 1, 7}, Case{16, 256, 4096, 8, 512}}) {
        const Geometry g = resolve_geometry(config_of(c.experts, c.hidden, c.topk, c.max_tokens), c.ranks, 0);
        const InternodeLayout l = InternodeLayout::make(g);
        SCOPED_TRACE("W " + std::to_string(c.ranks) + ", E " + std::to_string(c.experts) + ", H " +
                     std::to_string(c.hidden) + ", k " + std::to_string(c.topk));
        EXPECT_EQ(l.local_topk, std::min(c.topk, c.experts / c.ranks));
        EXPECT_EQ(l.capacity, c.max_tokens);
        EXPECT_EQ(l.ids_offset, int64_t{c.hidden} * 2);
        EXPECT_EQ(l.weights_offset, l.ids_offset + 4 * l.local_topk);
        EXPECT_GE(l.record_bytes, l.weights_offset + 4 * l.local_topk);
        EXPECT_LT(l.record_bytes, l.weights_offset + 4 * l.local_topk + 16);
        EXPECT_EQ(l.record_bytes % 16, 0) << "rows must stay 16-byte aligned";
        EXPECT_EQ(l.records(), int64_t{c.ranks} * c.max_tokens);
        // all_to_all splits each buffer into W equal blocks.
        EXPECT_EQ(l.dispatch_bytes() % c.ranks, 0);
        EXPECT_EQ(l.combine_bytes() % c.ranks, 0);
        EXPECT_EQ(l.dispatch_bytes() / c.ranks, int64_t{c.max_tokens} * l.record_bytes);
        EXPECT_EQ(l.record_offset(c.ranks - 1, c.max_tokens - 1) + l.record_bytes, l.dispatch_bytes());
        EXPECT_EQ(l.partial_offset(c.ranks - 1, c.max_tokens - 1) + c.hidden, l.combine_bytes() / 2);
    }
}

TEST(EpInternodePlan, RoutesToRankKeepsSlotOrderAndDropsWhatTheOneNodeOpDrops) {
    // E = 8 over W = 4 ranks: rank r owns experts 2r, 2r + 1.
    const Geometry g = resolve_geometry(config_of(8, 8, 6, 4), 4, 0);
    const int32_t row[6] = {5, -1, 4, 5, 9, 1};  // 5 repeated (dropped), 9 invalid (dropped)
    const float w[6] = {0.5f, 0.25f, 0.125f, 2.0f, 4.0f, 8.0f};
    const int kk = InternodeLayout::make(g).local_topk;
    ASSERT_EQ(kk, 2);
    int32_t ids[2];
    float weights[2];
    EXPECT_EQ(routes_to_rank(g, kk, row, w, 2, ids, weights), 2);
    EXPECT_EQ(ids[0], 1);  // expert 5, slot 0
    EXPECT_EQ(ids[1], 0);  // expert 4, slot 2
    EXPECT_EQ(weights[0], 0.5f);
    EXPECT_EQ(weights[1], 0.125f);
    EXPECT_EQ(routes_to_rank(g, kk, row, w, 0, ids, weights), 1);
    EXPECT_EQ(ids[0], 1);  // expert 1, slot 5
    EXPECT_EQ(ids[1], -1);
    EXPECT_EQ(weights[0], 8.0f);
    EXPECT_EQ(weights[1], 0.0f);
    EXPECT_EQ(routes_to_rank(g, kk, row, w, 1, ids, weights), 0);
    EXPECT_EQ(ids[0], -1);
    EXPECT_EQ(ids[1], -1);
    EXPECT_EQ(routes_to_rank(g, kk, row, w, 3, ids, weights), 0);
}

// What one rank r receives from the exchange: the one-rank routing of the W * capacity records, and for each record
// its (source rank, source token) or (-1, -1) for padding.
struct Received {
    ref::Routing routing;
    std::vector<std::pair<int, int>> origin;
};

Received simulate_exchange(const ref::Params& p, const std::vector<ref::Routing>& all, int capacity, int r,
                           const ref::NormalPlan& plan) {
    const Geometry g =
        resolve_geometry(config_of(p.num_experts, p.hidden, p.topk, capacity, p.expert_alignment), p.num_ranks, 0);
    const InternodeLayout l = InternodeLayout::make(g);
    Received got;
    const size_t kk = static_cast<size_t>(l.local_topk);
    got.routing.num_tokens = static_cast<int>(l.records());
    got.routing.topk_idx.assign(static_cast<size_t>(l.records()) * kk, -1);
    got.routing.topk_weights.assign(static_cast<size_t>(l.records()) * kk, 0.0f);
    got.origin.assign(static_cast<size_t>(l.records()), {-1, -1});
    for (int s = 0; s < p.num_ranks; ++s) {
        const ref::Routing& src = all[static_cast<size_t>(s)];
        const ref::RankLayout& layout = plan.layouts[static_cast<size_t>(s)];
        for (int t = 0; t < src.num_tokens; ++t) {
            const int32_t idx = layout.send_idx[static_cast<size_t>(t) * p.num_ranks + r];
            if (idx < 0) continue;
            EXPECT_LT(idx, capacity);
            const size_t record = static_cast<size_t>(s) * capacity + static_cast<size_t>(idx);
            EXPECT_EQ(got.origin[record].first, -1) << "two tokens in one record";
            got.origin[record] = {s, t};
            const int n = routes_to_rank(g, l.local_topk, &src.topk_idx[static_cast<size_t>(t) * p.topk],
                                         &src.topk_weights[static_cast<size_t>(t) * p.topk], r,
                                         &got.routing.topk_idx[record * kk], &got.routing.topk_weights[record * kk]);
            EXPECT_GT(n, 0) << "a token sent to rank " << r << " without a route there";
        }
    }
    return got;
}

// The whole design on the host, against the one-node reference, for every scenario and a few shapes: the receive
// layout of every rank (counts, offsets, which (source, token) each row holds) and the combine's bits.
TEST(EpInternodePlan, TheExchangeGivesTheOneNodeLayoutAndCombine) {
    struct Case {
        int ranks, experts, topk, alignment, max_tokens;
    };
    const int hidden = 16;
    int checked = 0;
    for (const Case c :
         {Case{4, 8, 2, 1, 7}, Case{4, 16, 8, 4, 9}, Case{2, 4, 1, 1, 5}, Case{6, 12, 8, 2, 6}, Case{4, 4, 2, 1, 5}}) {
        ref::Params p;
        p.num_ranks = c.ranks;
        p.num_experts = c.experts;
        p.topk = c.topk;
        p.hidden = hidden;
        p.expert_alignment = c.alignment;
        ref::Params one = p;
        one.num_ranks = 1;
        one.num_experts = p.local_experts();
        one.topk = std::min(p.topk, p.local_experts());
        for (const ref::Scenario sc : ref::all_scenarios()) {
            for (uint32_t seed : {1u, 2u, 3u}) {
                const std::string what = std::string(ref::scenario_name(sc)) + ", W " + std::to_string(c.ranks) +
                                         ", E " + std::to_string(c.experts) + ", k " + std::to_string(c.topk) +
                                         ", seed " + std::to_string(seed);
                SCOPED_TRACE(what);
                const std::vector<ref::Routing> all = ref::make_routing(sc, p, c.max_tokens, seed);
                const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
                // y of every rank: rows as the one-node op lays them out, each a function of its row index.
                std::vector<std::vector<uint16_t>> y(static_cast<size_t>(c.ranks));
                for (int r = 0; r < c.ranks; ++r) {
                    const size_t rows = plan.rows[static_cast<size_t>(r)].size();
                    y[static_cast<size_t>(r)].resize(rows * hidden);
                    for (size_t i = 0; i < y[static_cast<size_t>(r)].size(); ++i) {
                        y[static_cast<size_t>(r)][i] = ref::f32_to_bf16(
                            static_cast<float>(static_cast<int>((i * 2654435761u + r * 97u + seed) % 509) - 254) /
                            64.0f);
                    }
                }
                // Per rank: the one-rank dispatch of what it received, and its combine's partials.
                std::vector<Received> received;
                std::vector<std::vector<uint16_t>> partials;
                for (int r = 0; r < c.ranks; ++r) {
                    received.push_back(simulate_exchange(p, all, c.max_tokens, r, plan));
                    const Received& got = received.back();
                    const ref::NormalPlan inner = ref::reference_normal_plan(one, {got.routing});
                    const size_t ru = static_cast<size_t>(r);
                    ASSERT_EQ(inner.expert_counts[0], plan.expert_counts[ru]) << "rank " << r;
                    ASSERT_EQ(inner.expert_offsets[0], plan.expert_offsets[ru]) << "rank " << r;
                    ASSERT_EQ(inner.recv_tokens[0], plan.recv_tokens[ru]) << "rank " << r;
                    ASSERT_EQ(inner.recv_rows[0], plan.recv_rows[ru]) << "rank " << r;
                    ASSERT_EQ(inner.rows[0].size(), plan.rows[ru].size());
                    for (size_t row = 0; row < plan.rows[ru].size(); ++row) {
                        const ref::RowSource want = plan.rows[ru][row];
                        const ref::RowSource have = inner.rows[0][row];
                        if (want.src < 0) {
                            ASSERT_LT(have.src, 0) << "rank " << r << " row " << row << " should be padding";
                            continue;
                        }
                        ASSERT_GE(have.src, 0) << "rank " << r << " row " << row;
                        const std::pair<int, int> origin = got.origin[static_cast<size_t>(have.token)];
                        ASSERT_EQ(origin.first, want.src) << "rank " << r << " row " << row;
                        ASSERT_EQ(origin.second, want.token) << "rank " << r << " row " << row;
                    }
                    const auto y_row = [&](int, int32_t row) { return &y[ru][static_cast<size_t>(row) * hidden]; };
                    partials.push_back(ref::reference_normal_combine(one, inner, {got.routing}, 0, y_row));
                }
                // The sum at each source, in rank order, against the one-node combine.
                for (int s = 0; s < c.ranks; ++s) {
                    const ref::Routing& src = all[static_cast<size_t>(s)];
                    const auto y_row = [&](int r, int32_t row) {
                        return &y[static_cast<size_t>(r)][static_cast<size_t>(row) * hidden];
                    };
                    const std::vector<uint16_t> want = ref::reference_normal_combine(p, plan, all, s, y_row);
                    const ref::RankLayout& layout = plan.layouts[static_cast<size_t>(s)];
                    for (int t = 0; t < src.num_tokens; ++t) {
                        for (int ch = 0; ch < hidden; ++ch) {
                            float acc = 0.0f;
                            for (int r = 0; r < c.ranks; ++r) {
                                const int32_t idx = layout.send_idx[static_cast<size_t>(t) * c.ranks + r];
                                if (idx < 0) continue;
                                const size_t record = static_cast<size_t>(s) * c.max_tokens + static_cast<size_t>(idx);
                                acc += ref::bf16_to_f32(partials[static_cast<size_t>(r)][record * hidden + ch]);
                            }
                            ASSERT_EQ(ref::f32_to_bf16(acc), want[static_cast<size_t>(t) * hidden + ch])
                                << "source " << s << " token " << t << " channel " << ch;
                        }
                    }
                }
                ++checked;
            }
        }
    }
    EXPECT_GT(checked, 0);
}

// The two-hop dispatch on the host, with the helpers its kernels use (fill_node_record, clear_node_record,
// fill_node_header, routes_to_rank) and the byte layouts they share: node pack, the network hop (block m of t(n, l) to
// t(m, l)), the forward inside node n, the node all_to_all and the reorder by source team rank. Every rank's final
// records equal the record exchange's (the pack kernel's records after all_to_all: row, routes and padding), for
// node-major and interleaved teams and every routing scenario.
TEST(EpInternodePlan, TwoHopDispatchGivesTheRecordsOfTheExchange) {
    struct Case {
        int nodes, per_node, experts_per_rank, topk, max_tokens;
        bool interleaved;
    };
    const int hidden = 16;  // rows carry (source, token) in their first 8 bytes
    int checked = 0;
    for (const Case c : {Case{2, 2, 2, 2, 7, false}, Case{2, 2, 4, 8, 5, true}, Case{4, 1, 2, 1, 6, false},
                         Case{3, 2, 1, 2, 4, true}, Case{2, 3, 3, 8, 9, false}}) {
        const int w = c.nodes * c.per_node;
        ref::Params p;
        p.num_ranks = w;
        p.num_experts = c.experts_per_rank * w;
        p.topk = std::min(c.topk, p.num_experts);
        p.hidden = hidden;
        const Geometry g = resolve_geometry(config_of(p.num_experts, hidden, p.topk, c.max_tokens), w, 0);
        const InternodeLayout fin = InternodeLayout::make(g);
        const weft::ep::NodeRecordLayout hop = weft::ep::NodeRecordLayout::make(g, c.nodes, c.per_node);
        // by_node[m][l]: the team rank of node m's member l; node_of / local_of the inverse.
        std::vector<int32_t> by_node(static_cast<size_t>(w));
        std::vector<int> node_of(static_cast<size_t>(w)), local_of(static_cast<size_t>(w));
        for (int m = 0; m < c.nodes; ++m) {
            for (int l = 0; l < c.per_node; ++l) {
                const int r = c.interleaved ? l * c.nodes + m : m * c.per_node + l;
                by_node[static_cast<size_t>(m * c.per_node + l)] = r;
                node_of[static_cast<size_t>(r)] = m;
                local_of[static_cast<size_t>(r)] = l;
            }
        }
        const size_t rec = static_cast<size_t>(fin.record_bytes);
        const size_t cap = static_cast<size_t>(c.max_tokens);
        for (const ref::Scenario sc : ref::all_scenarios()) {
            for (uint32_t seed : {5u, 6u}) {
                SCOPED_TRACE(std::string(ref::scenario_name(sc)) + ", " + std::to_string(c.nodes) + " x " +
                             std::to_string(c.per_node) + (c.interleaved ? " interleaved" : "") + ", k " +
                             std::to_string(p.topk) + ", seed " + std::to_string(seed));
                const std::vector<ref::Routing> all = ref::make_routing(sc, p, c.max_tokens, seed);
                const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
                const auto row_of = [&](int s, int t) {
                    std::vector<uint8_t> row(static_cast<size_t>(hidden) * 2, 0);
                    const int32_t id[2] = {s, t};
                    std::memcpy(row.data(), id, sizeof(id));
                    return row;
                };
                // Node pack on every rank.
                std::vector<std::vector<uint8_t>> node_send(static_cast<size_t>(w));
                for (int s = 0; s < w; ++s) {
                    const ref::Routing& src = all[static_cast<size_t>(s)];
                    const ref::RankLayout& layout = plan.layouts[static_cast<size_t>(s)];
                    auto& out = node_send[static_cast<size_t>(s)];
                    out.assign(static_cast<size_t>(hop.bytes()), 0xCD);
                    for (int m = 0; m < c.nodes; ++m) {
                        const int32_t* members = &by_node[static_cast<size_t>(m * c.per_node)];
                        for (int t = 0; t < c.max_tokens; ++t) {
                            uint8_t* record = out.data() + hop.record_offset(m, t);
                            if (t >= src.num_tokens) {
                                weft::ep::clear_node_record(hop, record);
                                continue;
                            }
                            if (weft::ep::fill_node_record(hop, &src.topk_idx[static_cast<size_t>(t) * p.topk],
                                                           &src.topk_weights[static_cast<size_t>(t) * p.topk],
                                                           &layout.send_idx[static_cast<size_t>(t) * w], members,
                                                           record)) {
                                const std::vector<uint8_t> row = row_of(s, t);
                                std::memcpy(record, row.data(), row.size());
                            }
                        }
                        weft::ep::fill_node_header(hop, layout.tokens_per_rank.data(), members,
                                                   out.data() + hop.record_offset(m, c.max_tokens));
                    }
                }
                // Network hop and forward on every rank t(n, l): block j of `forward` is [N][cap] final records.
                std::vector<std::vector<uint8_t>> forward(static_cast<size_t>(w));
                for (int me = 0; me < w; ++me) {
                    const int n = node_of[static_cast<size_t>(me)];
                    const int l = local_of[static_cast<size_t>(me)];
                    const int32_t* members = &by_node[static_cast<size_t>(n * c.per_node)];
                    auto& fwd = forward[static_cast<size_t>(me)];
                    fwd.assign(static_cast<size_t>(c.per_node * c.nodes) * cap * rec, 0xAB);
                    for (int m = 0; m < c.nodes; ++m) {
                        // Block n of the column peer on node m.
                        const uint8_t* block =
                            node_send[static_cast<size_t>(by_node[static_cast<size_t>(m * c.per_node + l)])].data() +
                            hop.record_offset(n, 0);
                        const auto* header = reinterpret_cast<const int32_t*>(
                            block + static_cast<size_t>(c.max_tokens) * hop.record_bytes + hop.send_idx_offset);
                        for (int t = 0; t < c.max_tokens; ++t) {
                            const uint8_t* record = block + static_cast<size_t>(t) * hop.record_bytes;
                            const auto* idx = reinterpret_cast<const int32_t*>(record + hop.send_idx_offset);
                            for (int j = 0; j < c.per_node; ++j) {
                                if (idx[j] < 0) continue;
                                ASSERT_LT(idx[j], header[j]);
                                uint8_t* dst =
                                    fwd.data() +
                                    ((static_cast<size_t>(j) * c.nodes + m) * cap + static_cast<size_t>(idx[j])) * rec;
                                std::memcpy(dst, record, static_cast<size_t>(hidden) * 2);
                                weft::ep::routes_to_rank(g, fin.local_topk,
                                                         reinterpret_cast<const int32_t*>(record + hop.ids_offset),
                                                         reinterpret_cast<const float*>(record + hop.weights_offset),
                                                         members[j], reinterpret_cast<int32_t*>(dst + fin.ids_offset),
                                                         reinterpret_cast<float*>(dst + fin.weights_offset));
                            }
                        }
                        for (int j = 0; j < c.per_node; ++j) {
                            for (int q = header[j]; q < c.max_tokens; ++q) {
                                uint8_t* dst =
                                    fwd.data() +
                                    ((static_cast<size_t>(j) * c.nodes + m) * cap + static_cast<size_t>(q)) * rec;
                                for (int k = 0; k < fin.local_topk; ++k) {
                                    reinterpret_cast<int32_t*>(dst + fin.ids_offset)[k] = -1;
                                    reinterpret_cast<float*>(dst + fin.weights_offset)[k] = 0.0f;
                                }
                            }
                        }
                    }
                }
                // Node all_to_all and reorder at t(n, j), against the record exchange's records for it.
                for (int r = 0; r < w; ++r) {
                    const int n = node_of[static_cast<size_t>(r)];
                    const int j = local_of[static_cast<size_t>(r)];
                    std::vector<uint8_t> recv(static_cast<size_t>(fin.dispatch_bytes()), 0);
                    for (int l = 0; l < c.per_node; ++l) {
                        const auto& fwd =
                            forward[static_cast<size_t>(by_node[static_cast<size_t>(n * c.per_node + l)])];
                        for (int m = 0; m < c.nodes; ++m) {
                            const int s = by_node[static_cast<size_t>(m * c.per_node + l)];
                            std::memcpy(recv.data() + static_cast<size_t>(s) * cap * rec,
                                        fwd.data() + (static_cast<size_t>(j) * c.nodes + m) * cap * rec, cap * rec);
                        }
                    }
                    for (int s = 0; s < w; ++s) {
                        const ref::Routing& src = all[static_cast<size_t>(s)];
                        const ref::RankLayout& layout = plan.layouts[static_cast<size_t>(s)];
                        std::vector<int> token_at(cap, -1);
                        for (int t = 0; t < src.num_tokens; ++t) {
                            const int32_t idx = layout.send_idx[static_cast<size_t>(t) * w + r];
                            if (idx >= 0) token_at[static_cast<size_t>(idx)] = t;
                        }
                        for (size_t i = 0; i < cap; ++i) {
                            const uint8_t* got = recv.data() + (static_cast<size_t>(s) * cap + i) * rec;
                            std::vector<int32_t> ids(static_cast<size_t>(fin.local_topk), -1);
                            std::vector<float> weights(static_cast<size_t>(fin.local_topk), 0.0f);
                            const int t = token_at[i];
                            if (t >= 0) {
                                routes_to_rank(g, fin.local_topk, &src.topk_idx[static_cast<size_t>(t) * p.topk],
                                               &src.topk_weights[static_cast<size_t>(t) * p.topk], r, ids.data(),
                                               weights.data());
                                int32_t origin[2];
                                std::memcpy(origin, got, sizeof(origin));
                                ASSERT_EQ(origin[0], s) << "rank " << r << " record " << i << " of source " << s;
                                ASSERT_EQ(origin[1], t) << "rank " << r << " record " << i << " of source " << s;
                            }
                            ASSERT_EQ(std::memcmp(got + fin.ids_offset, ids.data(), ids.size() * 4), 0)
                                << "rank " << r << " record " << i << " of source " << s << ": routes";
                            ASSERT_EQ(std::memcmp(got + fin.weights_offset, weights.data(), weights.size() * 4), 0)
                                << "rank " << r << " record " << i << " of source " << s << ": weights";
                        }
                    }
                }
                ++checked;
            }
        }
    }
    EXPECT_GT(checked, 0);
}

// ---- low-latency mode across nodes ----

TEST(EpInternodePlan, LowLatencyRecordLayout) {
    struct Case {
        int ranks, experts, hidden, topk, max_tokens;
    };
    for (const Case c : {Case{4, 16, 7168, 8, 128}, Case{4, 8, 8, 8, 1}, Case{6, 12, 136, 3, 129}, Case{2, 2, 24, 1, 7},
                         Case{16, 256, 4096, 8, 1024}}) {
        Config cfg = config_of(c.experts, c.hidden, c.topk, c.max_tokens);
        cfg.normal = false;
        cfg.low_latency = true;
        const Geometry g = resolve_geometry(cfg, c.ranks, 0);
        const weft::ep::LowLatencyRecordLayout l = weft::ep::LowLatencyRecordLayout::make(g);
        SCOPED_TRACE("W " + std::to_string(c.ranks) + ", E " + std::to_string(c.experts) + ", H " +
                     std::to_string(c.hidden) + ", k " + std::to_string(c.topk));
        EXPECT_EQ(l.local_topk, std::min(c.topk, c.experts / c.ranks));
        EXPECT_EQ(l.ids_offset, int64_t{c.hidden} * 2);
        EXPECT_EQ(l.signature_offset, l.ids_offset + 4 * c.topk);
        EXPECT_GE(l.record_bytes, l.signature_offset + 4);
        EXPECT_LT(l.record_bytes, l.signature_offset + 4 + 16);
        EXPECT_EQ(l.record_bytes % 16, 0) << "rows must stay 16-byte aligned";
        EXPECT_EQ(l.records(), int64_t{c.ranks} * c.max_tokens);
        // all_to_all splits each buffer into W equal blocks, a block per rank.
        EXPECT_EQ(l.dispatch_bytes() / c.ranks, int64_t{c.max_tokens} * l.record_bytes);
        EXPECT_EQ(l.combine_bytes() / c.ranks, int64_t{c.max_tokens} * l.local_topk * c.hidden * 2);
        EXPECT_EQ(l.record_offset(c.ranks - 1, c.max_tokens - 1) + l.record_bytes, l.dispatch_bytes());
        EXPECT_EQ((l.combine_row_offset(c.ranks - 1, c.max_tokens - 1, l.local_topk - 1) + c.hidden) * 2,
                  l.combine_bytes());
        EXPECT_EQ(l.combine_row_offset(1, 0, 0) * 2 % 16, 0);
    }
}

// Both sides of a combine row's position agree: the source's ll_route_position over the token's team-wide ids and the
// owner's ll_record_position over the record it received (ll_record_routes); every valid route has a distinct position
// below local_topk on its owner, and slots that are not routes have none (invalid, -1, repeated ids included).
TEST(EpInternodePlan, LowLatencyRoutePositionsAgreeOnBothSides) {
    Config cfg = config_of(8, 16, 4, 4);
    cfg.normal = false;
    cfg.low_latency = true;
    const Geometry g = resolve_geometry(cfg, 4, 0);  // 2 experts per rank: local_topk 2
    const int local_topk = weft::ep::LowLatencyRecordLayout::make(g).local_topk;
    const std::vector<std::vector<int32_t>> rows = {{0, 1, 2, 3}, {1, 1, 0, -1}, {7, 6, 9, 6}, {-1, -1, -1, -1},
                                                    {5, 3, 4, 2}, {0, -3, 0, 1}, {2, 4, 6, 0}};
    for (const std::vector<int32_t>& row : rows) {
        std::vector<int> used(static_cast<size_t>(g.num_ranks) * local_topk, 0);
        for (int r = 0; r < g.num_ranks; ++r) {
            std::vector<int32_t> ids(static_cast<size_t>(g.topk));
            const int n = weft::ep::ll_record_routes(g, row.data(), r, ids.data());
            int counted = 0;
            for (int j = 0; j < g.topk; ++j) {
                const int32_t e = weft::ep::valid_route_expert(g, row.data(), j);
                const bool here = e >= 0 && g.owner(e) == r;
                ASSERT_EQ(ids[static_cast<size_t>(j)], here ? e - r * g.local_experts() : -1) << "slot " << j;
                if (!here) continue;
                const int p = weft::ep::ll_route_position(g, row.data(), j);
                ASSERT_EQ(p, weft::ep::ll_record_position(ids.data(), j)) << "slot " << j;
                ASSERT_GE(p, 0);
                ASSERT_LT(p, local_topk);
                ++used[static_cast<size_t>(r) * local_topk + p];
                ++counted;
            }
            EXPECT_EQ(n, counted);
        }
        for (int j = 0; j < g.topk; ++j) {
            if (weft::ep::valid_route_expert(g, row.data(), j) < 0) {
                EXPECT_EQ(weft::ep::ll_route_position(g, row.data(), j), -1);
            }
        }
        for (const int u : used) EXPECT_LE(u, 1) << "two routes share a combine row";
    }
}

// The low-latency design on the host, with the helpers and byte layouts its kernels use: pack (ll_record_routes, one
// record per (destination, token)), the exchange (block r of every rank to rank r), the layout (each local expert's
// routes in record order) against the one-node receive order (reference_low_latency_rows: rows, source info, slots),
// then the combine's pack (ll_record_position), the exchange back and the sum in slot order (ll_route_position)
// against the one-node arithmetic (fp32 fma over the slots in slot order, one rounding): the same bits.
TEST(EpInternodePlan, LowLatencyExchangeGivesTheOneNodeLayoutAndCombine) {
    struct Case {
        int ranks, experts, topk, max_tokens;
    };
    const int hidden = 16;
    int checked = 0;
    for (const Case c : {Case{4, 8, 2, 7}, Case{4, 16, 8, 9}, Case{2, 4, 1, 5}, Case{6, 12, 8, 6}, Case{4, 4, 2, 5},
                         Case{3, 9, 3, 4}}) {
        Config cfg = config_of(c.experts, hidden, c.topk, c.max_tokens);
        cfg.normal = false;
        cfg.low_latency = true;
        ref::Params p;
        p.num_ranks = c.ranks;
        p.num_experts = c.experts;
        p.topk = c.topk;
        p.hidden = hidden;
        for (const ref::Scenario sc : ref::all_scenarios()) {
            for (uint32_t seed : {1u, 2u, 3u}) {
                SCOPED_TRACE(std::string(ref::scenario_name(sc)) + ", W " + std::to_string(c.ranks) + ", E " +
                             std::to_string(c.experts) + ", k " + std::to_string(c.topk) + ", seed " +
                             std::to_string(seed));
                const std::vector<ref::Routing> all = ref::make_routing(sc, p, c.max_tokens, seed);
                const int w = c.ranks;
                const int el = p.local_experts();
                std::vector<Geometry> geos;
                for (int r = 0; r < w; ++r) geos.push_back(resolve_geometry(cfg, w, r));
                const Geometry g0 = resolve_geometry(cfg, w, 0);
                const weft::ep::LowLatencyRecordLayout l = weft::ep::LowLatencyRecordLayout::make(g0);
                const auto row_value = [&](int s, int t, int ch) {
                    return ref::f32_to_bf16(
                        static_cast<float>((s * 131 + t * 17 + ch * 5 + static_cast<int>(seed)) % 97 - 48) / 16.0f);
                };
                // Pack: every rank's send buffer.
                std::vector<std::vector<uint8_t>> send(
                    static_cast<size_t>(w), std::vector<uint8_t>(static_cast<size_t>(l.dispatch_bytes()), 0xAB));
                for (int s = 0; s < w; ++s) {
                    const ref::Routing& src = all[static_cast<size_t>(s)];
                    for (int r = 0; r < w; ++r) {
                        for (int t = 0; t < c.max_tokens; ++t) {
                            uint8_t* record = &send[static_cast<size_t>(s)][static_cast<size_t>(l.record_offset(r, t))];
                            auto* ids = reinterpret_cast<int32_t*>(record + l.ids_offset);
                            if (t >= src.num_tokens) {
                                for (int j = 0; j < c.topk; ++j) ids[j] = -1;
                                continue;
                            }
                            const int n = weft::ep::ll_record_routes(
                                geos[static_cast<size_t>(s)], &src.topk_idx[static_cast<size_t>(t) * c.topk], r, ids);
                            if (n == 0) continue;  // the row is not written
                            auto* row = reinterpret_cast<uint16_t*>(record);
                            for (int ch = 0; ch < hidden; ++ch) row[ch] = row_value(s, t, ch);
                        }
                    }
                }
                // The exchange: rank r's receive block s = rank s's send block r.
                const size_t block = static_cast<size_t>(l.dispatch_bytes()) / static_cast<size_t>(w);
                std::vector<std::vector<uint8_t>> recv(static_cast<size_t>(w),
                                                       std::vector<uint8_t>(static_cast<size_t>(l.dispatch_bytes())));
                for (int r = 0; r < w; ++r) {
                    for (int s = 0; s < w; ++s) {
                        std::memcpy(&recv[static_cast<size_t>(r)][static_cast<size_t>(s) * block],
                                    &send[static_cast<size_t>(s)][static_cast<size_t>(r) * block], block);
                    }
                }
                // Layout and copy on each rank, then y = a function of (rank, expert, row).
                const int64_t rpe = int64_t{w} * c.max_tokens;
                std::vector<std::vector<uint16_t>> y(static_cast<size_t>(w));
                std::vector<std::vector<int32_t>> src_info(static_cast<size_t>(w)), src_slot(static_cast<size_t>(w));
                for (int r = 0; r < w; ++r) {
                    const std::vector<std::vector<ref::RowSource>> want = ref::reference_low_latency_rows(p, all, r);
                    y[static_cast<size_t>(r)].assign(static_cast<size_t>(el * rpe * hidden), 0x7fc1);
                    src_info[static_cast<size_t>(r)].assign(static_cast<size_t>(el * rpe), -1);
                    src_slot[static_cast<size_t>(r)].assign(static_cast<size_t>(el * rpe), -1);
                    for (int le = 0; le < el; ++le) {
                        int32_t count = 0;
                        for (int64_t rec = 0; rec < l.records(); ++rec) {
                            const uint8_t* record =
                                &recv[static_cast<size_t>(r)][static_cast<size_t>(rec * l.record_bytes)];
                            const auto* ids = reinterpret_cast<const int32_t*>(record + l.ids_offset);
                            for (int j = 0; j < c.topk; ++j) {
                                if (ids[j] != le) continue;
                                const size_t out = static_cast<size_t>(le * rpe + count);
                                ASSERT_LT(static_cast<size_t>(count), want[static_cast<size_t>(le)].size())
                                    << "rank " << r << " expert " << le << ": more rows than the one-node op";
                                const ref::RowSource ws = want[static_cast<size_t>(le)][static_cast<size_t>(count)];
                                ASSERT_EQ(rec, int64_t{ws.src} * c.max_tokens + ws.token)
                                    << "rank " << r << " expert " << le << " row " << count;
                                ASSERT_EQ(j, ws.slot) << "rank " << r << " expert " << le << " row " << count;
                                const auto* row = reinterpret_cast<const uint16_t*>(record);
                                for (int ch = 0; ch < hidden; ++ch) {
                                    ASSERT_EQ(row[ch], row_value(ws.src, ws.token, ch)) << "channel " << ch;
                                    y[static_cast<size_t>(r)][out * hidden + static_cast<size_t>(ch)] =
                                        ref::expert_output(row[ch], r * el + le);
                                }
                                src_info[static_cast<size_t>(r)][out] = static_cast<int32_t>(rec);
                                src_slot[static_cast<size_t>(r)][out] = j;
                                ++count;
                            }
                        }
                        ASSERT_EQ(static_cast<size_t>(count), want[static_cast<size_t>(le)].size())
                            << "rank " << r << " expert " << le;
                    }
                }
                // Combine: pack on each expert rank, the exchange back, the sum at each source.
                const size_t cblock = static_cast<size_t>(l.combine_bytes() / 2) / static_cast<size_t>(w);
                std::vector<std::vector<uint16_t>> csend(
                    static_cast<size_t>(w), std::vector<uint16_t>(static_cast<size_t>(l.combine_bytes() / 2), 0x7fc2));
                for (int r = 0; r < w; ++r) {
                    for (int le = 0; le < el; ++le) {
                        for (int64_t i = 0; i < rpe; ++i) {
                            const size_t row = static_cast<size_t>(le * rpe + i);
                            const int32_t rec = src_info[static_cast<size_t>(r)][row];
                            if (rec < 0) break;
                            const auto* ids = reinterpret_cast<const int32_t*>(&recv[static_cast<size_t>(
                                r)][static_cast<size_t>(rec * l.record_bytes + l.ids_offset)]);
                            const int32_t pos =
                                weft::ep::ll_record_position(ids, src_slot[static_cast<size_t>(r)][row]);
                            const size_t at = static_cast<size_t>((int64_t{rec} * l.local_topk + pos) * hidden);
                            std::memcpy(&csend[static_cast<size_t>(r)][at], &y[static_cast<size_t>(r)][row * hidden],
                                        hidden * 2);
                        }
                    }
                }
                for (int s = 0; s < w; ++s) {
                    std::vector<uint16_t> creturned(static_cast<size_t>(l.combine_bytes() / 2));
                    for (int r = 0; r < w; ++r) {
                        std::memcpy(&creturned[static_cast<size_t>(r) * cblock],
                                    &csend[static_cast<size_t>(r)][static_cast<size_t>(s) * cblock], cblock * 2);
                    }
                    const ref::Routing& src = all[static_cast<size_t>(s)];
                    const std::vector<std::vector<std::vector<ref::RowSource>>> rows_of = [&] {
                        std::vector<std::vector<std::vector<ref::RowSource>>> v;
                        for (int r = 0; r < w; ++r) v.push_back(ref::reference_low_latency_rows(p, all, r));
                        return v;
                    }();
                    for (int t = 0; t < src.num_tokens; ++t) {
                        const int32_t* idx = &src.topk_idx[static_cast<size_t>(t) * c.topk];
                        for (int ch = 0; ch < hidden; ++ch) {
                            float got = 0.0f;
                            float want = 0.0f;
                            for (int j = 0; j < c.topk; ++j) {
                                const int32_t e = weft::ep::valid_route_expert(g0, idx, j);
                                if (e < 0) continue;
                                ASSERT_EQ(e, ref::valid_expert(p, src, t, j));
                                const float wt = src.topk_weights[static_cast<size_t>(t) * c.topk + j];
                                const int32_t pos = weft::ep::ll_route_position(g0, idx, j);
                                const int owner = p.owner(e);
                                const uint16_t v =
                                    creturned[static_cast<size_t>(l.combine_row_offset(owner, t, pos) + ch)];
                                got = std::fma(wt, ref::bf16_to_f32(v), got);
                                // The one-node op: rank owner's row of route (s, t, j) in its expert's list.
                                const auto& list =
                                    rows_of[static_cast<size_t>(owner)][static_cast<size_t>(e - owner * el)];
                                size_t i = 0;
                                while (i < list.size() &&
                                       !(list[i].src == s && list[i].token == t && list[i].slot == j))
                                    ++i;
                                ASSERT_LT(i, list.size());
                                want = std::fma(wt, ref::bf16_to_f32(ref::expert_output(row_value(s, t, ch), e)), want);
                            }
                            ASSERT_EQ(ref::f32_to_bf16(got), ref::f32_to_bf16(want))
                                << "source " << s << " token " << t << " channel " << ch;
                        }
                    }
                }
                ++checked;
            }
        }
    }
    EXPECT_GT(checked, 0);
}

// ---- the footprint across nodes ----

// The configs the footprint tests walk: both modes, each alone, capacities set, an alignment, fp8-sized rows.
std::vector<Config> footprint_configs() {
    std::vector<Config> out;
    Config c;
    c.num_experts = 256;
    c.hidden = 7168;
    c.topk = 8;
    c.max_tokens_per_rank = 128;
    out.push_back(c);  // both modes
    Config n = c;
    n.low_latency = false;
    n.max_tokens_per_rank = 4096;
    n.max_recv_rows = 20000;
    n.max_recv_tokens = 9000;
    n.expert_alignment = 128;
    out.push_back(n);  // normal only, capacities and alignment
    Config l = c;
    l.normal = false;
    l.max_tokens_per_rank = 1;
    out.push_back(l);  // low-latency only
    Config s = config_of(32, 256, 4, 64, 8);
    s.low_latency = true;
    out.push_back(s);  // small
    Config k = config_of(64, 512, 6, 32);  // k larger than the experts per rank on 16 ranks
    out.push_back(k);
    return out;
}

void expect_same(const Footprint& a, const Footprint& b) {
    EXPECT_EQ(a.buffer_symmetric_bytes, b.buffer_symmetric_bytes);
    EXPECT_EQ(a.buffer_device_bytes, b.buffer_device_bytes);
    EXPECT_EQ(a.normal_handle_symmetric_bytes, b.normal_handle_symmetric_bytes);
    EXPECT_EQ(a.normal_handle_device_bytes, b.normal_handle_device_bytes);
    EXPECT_EQ(a.low_latency_handle_device_bytes, b.low_latency_handle_device_bytes);
    EXPECT_EQ(a.node_collectives_symmetric_bytes, b.node_collectives_symmetric_bytes);
}

TEST(EpFootprint, OneNodeIsTheOneNodeAnswer) {
    for (const Config& c : footprint_configs()) {
        for (int w : {1, 2, 4, 8}) {
            SCOPED_TRACE("E=" + std::to_string(c.num_experts) + " H=" + std::to_string(c.hidden) +
                         " k=" + std::to_string(c.topk) + " W=" + std::to_string(w));
            const Footprint one = footprint(c, w);
            expect_same(footprint(c, w, 1), one);
            EXPECT_EQ(one.node_collectives_symmetric_bytes, 0u);
            EXPECT_EQ(footprint(c, w, 1).describe(), one.describe());
            EXPECT_EQ(footprint(c, w, 1).heap_bytes(2), one.heap_bytes(2));
        }
    }
}

// The node stage's workspace: three staging regions, the signal words, the LL buffers and their header lines, each
// allocation rounded up to the heap's 256-byte alignment (the descriptor rows, 16 n bytes, and the copy-engine flags,
// 8 n bytes, leave gaps before the next allocation).
TEST(EpFootprint, NodeCollectivesAreTheWorkspaceSizes) {
    const weft::testing::ScopedEnv unset("WEFT_COLLECTIVE_STAGING_BYTES", std::nullopt);
    EXPECT_EQ(collective_workspace_heap_bytes(1), 0u);
    const auto signal_bytes = [](uint64_t n) {
        const auto up = [](uint64_t bytes) { return (bytes + 255) / 256 * 256; };
        return up(8 * 256 * n) + up(8 * 2 * n) + up(8 * n) + up(2 * n * (512 << 10)) + up(2 * n * 256 * 16);
    };
    for (uint64_t n : {2, 4, 8, 3, 33}) {
        EXPECT_EQ(collective_workspace_heap_bytes(static_cast<int>(n)), signal_bytes(n) + 3 * (32ull << 20)) << n;
    }
    {
        const weft::testing::ScopedEnv small("WEFT_COLLECTIVE_STAGING_BYTES", std::string("1000"));  // at least 64 KiB
        EXPECT_EQ(collective_workspace_heap_bytes(2), signal_bytes(2) + 3 * (64ull << 10));
    }
    {
        const weft::testing::ScopedEnv odd("WEFT_COLLECTIVE_STAGING_BYTES",
                                           std::string("1048577"));  // rounded up to 256
        EXPECT_EQ(collective_workspace_heap_bytes(2), signal_bytes(2) + 3 * ((1ull << 20) + 256));
    }
    {
        // Three times this wraps 2^64 (to 512 bytes): refused, not allocated as a sliver.
        const weft::testing::ScopedEnv huge("WEFT_COLLECTIVE_STAGING_BYTES", std::string("6148914691236517206"));
        try {
            (void)collective_workspace_heap_bytes(2);
            ADD_FAILURE() << "a staging region of 6e18 bytes was accepted";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("WEFT_COLLECTIVE_STAGING_BYTES must be at most 1 TiB"),
                      std::string::npos)
                << e.what();
        }
    }
    EXPECT_THROW((void)collective_workspace_heap_bytes(0), Error);
    EXPECT_THROW((void)collective_workspace_heap_bytes(65), Error);
}

// The exchange allocations are their parts, back to back, each on a 256-byte boundary; the all_to_all path's parts are
// the two-hop path's first ones.
TEST(EpFootprint, ExchangeLayoutsAreTheirPartsBackToBack) {
    for (const Config& c : footprint_configs()) {
        for (const auto& [w, n] : std::vector<std::pair<int, int>>{{2, 2}, {4, 2}, {8, 2}, {8, 4}, {16, 2}}) {
            if (c.num_experts % w != 0) continue;
            const Geometry g = resolve_geometry(c, w, 0);
            const InternodeLayout net = InternodeLayout::make(g);
            const weft::ep::NodeRecordLayout hop = weft::ep::NodeRecordLayout::make(g, n, w / n);
            const auto x = weft::ep::NormalExchangeLayout::make(net, hop, true);
            const auto a = weft::ep::NormalExchangeLayout::make(net, hop, false);
            const int64_t align = weft::ep::kExchangeAlign;
            EXPECT_GE(x.records, net.dispatch_bytes());
            EXPECT_LT(x.records, net.dispatch_bytes() + align);
            EXPECT_GE(x.partials, net.combine_bytes());
            EXPECT_GE(x.blocks, hop.bytes());
            for (int64_t v : {x.records, x.partials, x.blocks}) EXPECT_EQ(v % align, 0);
            EXPECT_EQ(x.send, 0);
            EXPECT_EQ(x.recv, x.send + x.records);
            EXPECT_EQ(x.partials_at, x.recv + x.records);
            EXPECT_EQ(x.returned, x.partials_at + x.partials);
            EXPECT_EQ(x.node_send, x.returned + x.partials);
            EXPECT_EQ(x.node_recv, x.node_send + x.blocks);
            EXPECT_EQ(x.gathered, x.node_recv + x.blocks);
            EXPECT_EQ(x.bytes, x.gathered + x.records);  // gathered holds one exchange's records
            EXPECT_EQ(a.blocks, 0);
            EXPECT_EQ(a.bytes, x.returned + x.partials);
            EXPECT_EQ(a.returned, x.returned);

            const weft::ep::LowLatencyRecordLayout ll = weft::ep::LowLatencyRecordLayout::make(g);
            const auto l = weft::ep::LowLatencyExchangeLayout::make(ll);
            EXPECT_GE(l.records, ll.dispatch_bytes());
            EXPECT_GE(l.routes, ll.records() * ll.topk * 4);
            EXPECT_GE(l.rows, ll.combine_bytes());
            for (int64_t v : {l.records, l.routes, l.rows}) EXPECT_EQ(v % align, 0);
            EXPECT_EQ(l.send, 0);
            EXPECT_EQ(l.recv, l.records);
            EXPECT_EQ(l.route_row, 2 * l.records);
            EXPECT_EQ(l.combine_send, l.route_row + l.routes);
            EXPECT_EQ(l.combine_recv, l.combine_send + l.rows);
            EXPECT_EQ(l.bytes, l.combine_recv + l.rows);
        }
    }
}

// Across nodes the footprint is what the Buffer allocates: its Workspace's device state and the node table; for the
// normal mode the one-rank Buffer of E / W experts and W x T tokens (and its handle per handle), the layout arrays and
// the two-hop exchange per handle; for the low-latency mode the exchange per handle; and the node stage's workspace.
TEST(EpFootprint, AcrossNodesAddsTheExchangeBuffers) {
    const weft::testing::ScopedEnv unset("WEFT_COLLECTIVE_STAGING_BYTES", std::nullopt);
    int checked = 0;
    for (const Config& c : footprint_configs()) {
        for (const auto& [w, n] : std::vector<std::pair<int, int>>{{2, 2}, {4, 2}, {8, 2}, {8, 4}, {8, 8}, {16, 2}}) {
            if (c.num_experts % w != 0) continue;
            SCOPED_TRACE("E=" + std::to_string(c.num_experts) + " H=" + std::to_string(c.hidden) +
                         " k=" + std::to_string(c.topk) + " W=" + std::to_string(w) + " nodes=" + std::to_string(n));
            const Geometry g = resolve_geometry(c, w, 0);
            const weft::ep::Workspace ws = weft::ep::Workspace::make(g);
            const InternodeLayout net = InternodeLayout::make(g);
            const Footprint f = footprint(c, w, n);

            Footprint want;
            want.buffer_device_bytes = static_cast<uint64_t>(ws.buffer_device.bytes) + 4ull * w;
            want.node_collectives_symmetric_bytes = collective_workspace_heap_bytes(w / n);
            if (c.normal) {
                Config one;
                one.num_experts = c.num_experts / w;
                one.hidden = c.hidden;
                one.topk = std::min(c.topk, c.num_experts / w);
                one.max_tokens_per_rank = w * c.max_tokens_per_rank;
                one.low_latency = false;
                one.max_recv_tokens = g.max_recv_tokens;
                one.max_recv_rows = g.max_recv_rows;
                one.expert_alignment = g.expert_alignment;
                const Footprint inner = footprint(one, 1);
                const int64_t exchange =
                    weft::ep::NormalExchangeLayout::make(net, weft::ep::NodeRecordLayout::make(g, n, w / n), true)
                        .bytes;
                want.buffer_symmetric_bytes = inner.buffer_symmetric_bytes;
                want.buffer_device_bytes += inner.buffer_device_bytes;
                want.normal_handle_symmetric_bytes = inner.normal_handle_symmetric_bytes;
                want.normal_handle_device_bytes =
                    static_cast<uint64_t>(ws.normal_handle_device.bytes + exchange) + inner.normal_handle_device_bytes;
            }
            if (c.low_latency) {
                want.low_latency_handle_device_bytes = static_cast<uint64_t>(
                    ws.low_latency_handle_device.bytes +
                    weft::ep::LowLatencyExchangeLayout::make(weft::ep::LowLatencyRecordLayout::make(g)).bytes);
            }
            expect_same(f, want);
            EXPECT_EQ(f.node_collectives_symmetric_bytes == 0, w == n);  // one member per node: no node stage
            // The heap holds the node stage's workspace too; the totals count every field.
            EXPECT_GE(f.heap_bytes(1),
                      f.buffer_symmetric_bytes + f.normal_handle_symmetric_bytes + f.node_collectives_symmetric_bytes);
            EXPECT_EQ(f.total_bytes(1, 1), f.buffer_symmetric_bytes + f.buffer_device_bytes +
                                               f.normal_handle_symmetric_bytes + f.normal_handle_device_bytes +
                                               f.low_latency_handle_device_bytes + f.node_collectives_symmetric_bytes);
            if (w > n) {
                EXPECT_NE(f.describe().find("node stage collectives"), std::string::npos) << f.describe();
            }
            ++checked;
        }
    }
    EXPECT_GT(checked, 20);
}

void expect_footprint_error(const Config& c, int ranks, int nodes, const std::string& fragment) {
    try {
        (void)footprint(c, ranks, nodes);
        ADD_FAILURE() << "footprint(" << ranks << " ranks, " << nodes << " nodes): expected an error mentioning '"
                      << fragment << "'";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
}

TEST(EpFootprint, BadNodeCountsAreErrors) {
    Config c = config_of(32, 256, 4, 64);
    expect_footprint_error(c, 8, 0, "num_nodes must be >= 1 (the nodes the team spans), got 0");
    expect_footprint_error(c, 8, -2, "num_nodes must be >= 1");
    expect_footprint_error(c, 8, 3, "num_ranks (8) must be a positive multiple of num_nodes (3)");
    expect_footprint_error(c, 4, 8, "num_ranks (4) must be a positive multiple of num_nodes (8)");
    expect_footprint_error(c, 0, 2, "num_ranks (0) must be a positive multiple of num_nodes (2)");
    expect_footprint_error(c, 6, 2, "multiple of the number of ranks");  // 32 experts over 6 ranks: the Config's check
    // The one-rank Buffer's tokens (W x max_tokens_per_rank records) are bounded.
    Config big = config_of(64, 256, 2, 1 << 19);
    expect_footprint_error(big, 64, 2, "more than 2^24");
}

}  // namespace
}  // namespace weft::ops::ep
