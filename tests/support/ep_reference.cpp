// SPDX-License-Identifier: MIT
// The host reference of expert-parallel dispatch/combine (see ep_reference.hpp): sequential counters, no kernel code.
#include "support/ep_reference.hpp"

#include <cstring>
#include <limits>

namespace weft::test::ep {

int32_t valid_expert(const Params& p, const Routing& r, int t, int j) {
    const int32_t e = r.expert(t, j, p.topk);
    if (e < 0 || e >= p.num_experts) return -1;
    for (int i = 0; i < j; ++i) {
        if (r.expert(t, i, p.topk) == e) return -1;
    }
    return e;
}

RankLayout reference_layout(const Params& p, const Routing& r) {
    const size_t t_count = static_cast<size_t>(r.num_tokens);
    const size_t w = static_cast<size_t>(p.num_ranks);
    const size_t k = static_cast<size_t>(p.topk);
    RankLayout l;
    l.tokens_per_expert.assign(static_cast<size_t>(p.num_experts), 0);
    l.tokens_per_rank.assign(w, 0);
    l.token_in_rank.assign(t_count * w, 0);
    l.send_idx.assign(t_count * w, -1);
    l.route_pos.assign(t_count * k, -1);
    for (int t = 0; t < r.num_tokens; ++t) {
        std::vector<bool> to_rank(w, false);
        for (int j = 0; j < p.topk; ++j) {
            const int32_t e = valid_expert(p, r, t, j);
            if (e < 0) continue;
            l.route_pos[static_cast<size_t>(t) * k + static_cast<size_t>(j)] =
                l.tokens_per_expert[static_cast<size_t>(e)]++;
            to_rank[static_cast<size_t>(p.owner(e))] = true;
        }
        for (size_t dst = 0; dst < w; ++dst) {
            if (!to_rank[dst]) continue;
            l.token_in_rank[static_cast<size_t>(t) * w + dst] = 1;
            l.send_idx[static_cast<size_t>(t) * w + dst] = l.tokens_per_rank[dst]++;
        }
    }
    return l;
}

NormalPlan reference_normal_plan(const Params& p, const std::vector<Routing>& all) {
    const int w = p.num_ranks;
    const int el = p.local_experts();
    NormalPlan plan;
    for (const Routing& r : all) plan.layouts.push_back(reference_layout(p, r));
    plan.recv_tokens.assign(static_cast<size_t>(w), 0);
    plan.recv_rows.assign(static_cast<size_t>(w), 0);
    plan.expert_counts.assign(static_cast<size_t>(w), std::vector<int32_t>(static_cast<size_t>(el), 0));
    plan.expert_offsets.assign(static_cast<size_t>(w), std::vector<int32_t>(static_cast<size_t>(el) + 1, 0));
    plan.source_offsets.assign(static_cast<size_t>(w), std::vector<int32_t>(static_cast<size_t>(w) + 1, 0));
    plan.rows.assign(static_cast<size_t>(w), {});
    plan.row_of.resize(static_cast<size_t>(w));
    for (int s = 0; s < w; ++s) {
        plan.row_of[static_cast<size_t>(s)].assign(static_cast<size_t>(all[static_cast<size_t>(s)].num_tokens) * p.topk,
                                                   -1);
    }
    for (int r = 0; r < w; ++r) {
        const size_t ru = static_cast<size_t>(r);
        int64_t rows = 0;
        for (int le = 0; le < el; ++le) {
            int32_t count = 0;
            for (int s = 0; s < w; ++s)
                count += plan.layouts[static_cast<size_t>(s)].tokens_per_expert[static_cast<size_t>(r * el + le)];
            plan.expert_counts[ru][static_cast<size_t>(le)] = count;
            plan.expert_offsets[ru][static_cast<size_t>(le)] = static_cast<int32_t>(rows);
            rows += (count + p.expert_alignment - 1) / p.expert_alignment * p.expert_alignment;
        }
        plan.expert_offsets[ru][static_cast<size_t>(el)] = static_cast<int32_t>(rows);
        plan.recv_rows[ru] = rows;
        int64_t tokens = 0;
        for (int s = 0; s < w; ++s) {
            plan.source_offsets[ru][static_cast<size_t>(s)] = static_cast<int32_t>(tokens);
            tokens += plan.layouts[static_cast<size_t>(s)].tokens_per_rank[ru];
        }
        plan.source_offsets[ru][static_cast<size_t>(w)] = static_cast<int32_t>(tokens);
        plan.recv_tokens[ru] = tokens;
        if (rows > (int64_t{1} << 26)) continue;  // an overflow case: rows are not materialised
        plan.rows[ru].assign(static_cast<size_t>(rows), RowSource{});
        for (int le = 0; le < el; ++le) {
            int32_t next = plan.expert_offsets[ru][static_cast<size_t>(le)];
            for (int s = 0; s < w; ++s) {
                const Routing& src = all[static_cast<size_t>(s)];
                for (int t = 0; t < src.num_tokens; ++t) {
                    for (int j = 0; j < p.topk; ++j) {
                        if (valid_expert(p, src, t, j) != r * el + le) continue;
                        plan.rows[ru][static_cast<size_t>(next)] = RowSource{s, t, j};
                        plan.row_of[static_cast<size_t>(s)][static_cast<size_t>(t) * p.topk + j] = next;
                        ++next;
                    }
                }
            }
        }
    }
    return plan;
}

Overflow find_overflow(const NormalPlan& plan, int64_t max_recv_tokens, int64_t max_recv_rows) {
    for (size_t r = 0; r < plan.recv_tokens.size(); ++r) {
        if (plan.recv_tokens[r] > max_recv_tokens) return Overflow{static_cast<int>(r), 1, plan.recv_tokens[r]};
        if (plan.recv_rows[r] > max_recv_rows) return Overflow{static_cast<int>(r), 2, plan.recv_rows[r]};
    }
    return Overflow{};
}

std::vector<std::vector<RowSource>> reference_low_latency_rows(const Params& p, const std::vector<Routing>& all,
                                                               int r) {
    const int el = p.local_experts();
    std::vector<std::vector<RowSource>> rows(static_cast<size_t>(el));
    for (int le = 0; le < el; ++le) {
        for (int s = 0; s < p.num_ranks; ++s) {
            const Routing& src = all[static_cast<size_t>(s)];
            for (int t = 0; t < src.num_tokens; ++t) {
                for (int j = 0; j < p.topk; ++j) {
                    if (valid_expert(p, src, t, j) == r * el + le)
                        rows[static_cast<size_t>(le)].push_back(RowSource{s, t, j});
                }
            }
        }
    }
    return rows;
}

uint16_t f32_to_bf16(float f) {
    uint32_t u = 0;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

float bf16_to_f32(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f = 0.0f;
    std::memcpy(&f, &u, 4);
    return f;
}

namespace {
double e4m3_magnitude(int code) {  // code 0..126
    const int exp = code >> 3;
    const int mant = code & 7;
    if (exp == 0) return std::ldexp(static_cast<double>(mant), -9);
    return std::ldexp(1.0 + mant / 8.0, exp - 7);
}
}  // namespace

uint8_t f32_to_e4m3(float f) {
    if (std::isnan(f)) return 0x7f;
    const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
    const double a = std::fabs(static_cast<double>(f));
    if (a >= 448.0) return static_cast<uint8_t>(sign | 126);
    int lo = 0, hi = 126;  // largest code with magnitude <= a
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (e4m3_magnitude(mid) <= a)
            lo = mid;
        else
            hi = mid - 1;
    }
    int code = lo;
    if (e4m3_magnitude(lo) != a) {
        const double d_lo = a - e4m3_magnitude(lo);
        const double d_hi = e4m3_magnitude(lo + 1) - a;
        if (d_hi < d_lo || (d_hi == d_lo && (lo & 1) != 0)) code = lo + 1;
    }
    return static_cast<uint8_t>(sign | code);
}

float e4m3_to_f32(uint8_t v) {
    if ((v & 0x7f) == 0x7f) return std::numeric_limits<float>::quiet_NaN();
    const double m = e4m3_magnitude(v & 0x7f);
    return static_cast<float>((v & 0x80) ? -m : m);
}

void reference_quantize_row(const uint16_t* row, int hidden, uint8_t* codes, float* scales) {
    for (int g = 0; g < hidden / 128; ++g) {
        float amax = 0.0f;
        for (int c = g * 128; c < (g + 1) * 128; ++c) amax = std::max(amax, std::fabs(bf16_to_f32(row[c])));
        amax = std::max(amax, 1e-10f);
        const float scale = amax / 448.0f;
        const float inv = 448.0f / amax;
        scales[g] = scale;
        for (int c = g * 128; c < (g + 1) * 128; ++c) codes[c] = f32_to_e4m3(bf16_to_f32(row[c]) * inv);
    }
}

}  // namespace weft::test::ep
