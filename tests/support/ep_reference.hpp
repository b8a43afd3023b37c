// SPDX-License-Identifier: MIT
// A plain host reference of expert-parallel dispatch/combine (layout, receive order, combine arithmetic, bf16/e4m3
// encoding).
//
// Written independently of the kernels: sequential loops over tokens and slots, no shared code with
// kernels/ep. Used by the unit tests (checked against brute force and invariants) and by the GPU
// tests (every device output is compared with it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace weft::test::ep {

/// The sizes a reference needs (a subset of weft::ops::ep::Config).
struct Params {
    int num_ranks = 1;
    int num_experts = 1;
    int topk = 1;
    int hidden = 8;
    int expert_alignment = 1;
    int local_experts() const { return num_experts / num_ranks; }
    int owner(int expert) const { return expert / local_experts(); }
};

/// One rank's routing: T tokens, topk_idx [T, k] (-1 dropped).
struct Routing {
    int num_tokens = 0;
    std::vector<int32_t> topk_idx;
    std::vector<float> topk_weights;
    int32_t expert(int t, int j, int k) const { return topk_idx[static_cast<size_t>(t) * k + j]; }
};

/// The valid expert of slot j of token t, or -1 (dropped, out of range, or repeating an earlier slot).
int32_t valid_expert(const Params& p, const Routing& r, int t, int j);

/// The layout kernel's outputs for one rank.
struct RankLayout {
    std::vector<int32_t> tokens_per_expert;  ///< [E]
    std::vector<int32_t> tokens_per_rank;    ///< [W]
    std::vector<uint8_t> token_in_rank;      ///< [T, W]
    std::vector<int32_t> send_idx;           ///< [T, W]
    std::vector<int32_t> route_pos;          ///< [T, k]
};
RankLayout reference_layout(const Params& p, const Routing& r);

/// Where one received row came from.
struct RowSource {
    int src = -1;  ///< -1: padding
    int token = -1;
    int slot = -1;
};

/// The normal dispatch of all ranks' routings, as seen by every rank.
struct NormalPlan {
    std::vector<RankLayout> layouts;                   ///< [W]
    std::vector<int64_t> recv_tokens;                  ///< [W] distinct (source, token) pairs received
    std::vector<int64_t> recv_rows;                    ///< [W] expert-contiguous rows, padding included
    std::vector<std::vector<int32_t>> expert_counts;   ///< [W][E_local]
    std::vector<std::vector<int32_t>> expert_offsets;  ///< [W][E_local + 1]
    std::vector<std::vector<int32_t>> source_offsets;  ///< [W][W + 1]
    std::vector<std::vector<RowSource>> rows;          ///< [W][recv_rows]
    /// row_of[s][t * k + j]: the row of route (t, j) of source s on its expert's owner, or -1.
    std::vector<std::vector<int32_t>> row_of;
};
NormalPlan reference_normal_plan(const Params& p, const std::vector<Routing>& all);

/// The first rank (lowest) whose capacity a plan exceeds: {rank, 1 = tokens / 2 = rows, value}; rank -1
/// when it fits.
struct Overflow {
    int rank = -1;
    int kind = 0;
    int64_t value = 0;
};
Overflow find_overflow(const NormalPlan& plan, int64_t max_recv_tokens, int64_t max_recv_rows);

/// Normal combine of source rank s, emulating the kernels' arithmetic exactly: per destination rank in
/// ascending order, a partial = fma(w_j, y, partial) over the slots there in slot order, rounded to
/// bf16; out = bf16(sum of partials in rank order, fp32). y_rows(r, row) is rank r's y row (bf16 bits).
/// Returns [T, H] bf16 bits.
template <class YRow>
std::vector<uint16_t> reference_normal_combine(const Params& p, const NormalPlan& plan, const std::vector<Routing>& all,
                                               int s, YRow&& y_row);

/// The same combine in double precision without intermediate rounding (the mathematical value); with
/// `magnitude`, the sum of |w * y| instead (the scale of the rounding error, which cancellation can make
/// much larger than the value).
template <class YRow>
std::vector<double> ideal_combine(const Params& p, const NormalPlan& plan, const std::vector<Routing>& all, int s,
                                  YRow&& y_row, bool magnitude = false);

/// The low-latency dispatch as seen by receiving rank r: for each local expert, its rows in order
/// (source rank, then token).
std::vector<std::vector<RowSource>> reference_low_latency_rows(const Params& p, const std::vector<Routing>& all, int r);

// ---- number formats ----
uint16_t f32_to_bf16(float f);  ///< round to nearest even; NaN stays NaN
float bf16_to_f32(uint16_t b);
uint8_t f32_to_e4m3(float f);  ///< round to nearest even, saturating to +-448 (e4m3fn), NaN -> 0x7f
float e4m3_to_f32(uint8_t v);

/// The low-latency fp8 quantisation of one bf16 row: codes [H] and scales [H / 128], emulating the
/// kernel (amax clamped to >= 1e-10, scale = amax / 448, code = e4m3(x * (448 / amax))).
void reference_quantize_row(const uint16_t* row, int hidden, uint8_t* codes, float* scales);

// ---- template definitions ----

template <class YRow>
std::vector<uint16_t> reference_normal_combine(const Params& p, const NormalPlan& plan, const std::vector<Routing>& all,
                                               int s, YRow&& y_row) {
    const Routing& r = all[static_cast<size_t>(s)];
    const int h = p.hidden;
    std::vector<uint16_t> out(static_cast<size_t>(r.num_tokens) * h, 0);
    std::vector<float> acc(static_cast<size_t>(h));
    std::vector<float> partial(static_cast<size_t>(h));
    for (int t = 0; t < r.num_tokens; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int dst = 0; dst < p.num_ranks; ++dst) {
            bool any = false;
            std::fill(partial.begin(), partial.end(), 0.0f);
            for (int j = 0; j < p.topk; ++j) {
                const int32_t e = valid_expert(p, r, t, j);
                if (e < 0 || p.owner(e) != dst) continue;
                any = true;
                const int32_t row = plan.row_of[static_cast<size_t>(s)][static_cast<size_t>(t) * p.topk + j];
                const uint16_t* y = y_row(dst, row);
                const float w = r.topk_weights[static_cast<size_t>(t) * p.topk + j];
                for (int c = 0; c < h; ++c)
                    partial[static_cast<size_t>(c)] = std::fma(w, bf16_to_f32(y[c]), partial[static_cast<size_t>(c)]);
            }
            if (!any) continue;
            for (int c = 0; c < h; ++c)
                acc[static_cast<size_t>(c)] += bf16_to_f32(f32_to_bf16(partial[static_cast<size_t>(c)]));
        }
        for (int c = 0; c < h; ++c) out[static_cast<size_t>(t) * h + c] = f32_to_bf16(acc[static_cast<size_t>(c)]);
    }
    return out;
}

template <class YRow>
std::vector<double> ideal_combine(const Params& p, const NormalPlan& plan, const std::vector<Routing>& all, int s,
                                  YRow&& y_row, bool magnitude) {
    const Routing& r = all[static_cast<size_t>(s)];
    const int h = p.hidden;
    std::vector<double> out(static_cast<size_t>(r.num_tokens) * h, 0.0);
    for (int t = 0; t < r.num_tokens; ++t) {
        for (int j = 0; j < p.topk; ++j) {
            const int32_t e = valid_expert(p, r, t, j);
            if (e < 0) continue;
            const uint16_t* y =
                y_row(p.owner(e), plan.row_of[static_cast<size_t>(s)][static_cast<size_t>(t) * p.topk + j]);
            const double w = r.topk_weights[static_cast<size_t>(t) * p.topk + j];
            for (int c = 0; c < h; ++c) {
                const double term = w * bf16_to_f32(y[c]);
                out[static_cast<size_t>(t) * h + c] += magnitude ? std::fabs(term) : term;
            }
        }
    }
    return out;
}

}  // namespace weft::test::ep
