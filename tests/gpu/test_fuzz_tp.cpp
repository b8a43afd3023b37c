// SPDX-License-Identifier: MIT
// Seeded random fuzz of the tensor-parallel ops with ranks as threads sharing the visible GPUs (worlds 1..8, non-powers
// of two included): AgGemm, GemmRs and GemmAr (GpuFuzz.TpFusedGemm), the two TP MoE layers (GpuFuzz.MoeTpLayers) and
// all_reduce / all_gather / reduce_scatter (GpuFuzz.Collectives, whose cases are fuzz_collectives.hpp's, shared with
// GpuFuzz.Teams). Every case draws fresh inputs within what the headers allow, poisons the outputs (0xFF bytes: NaN)
// before each call and compares with an independent host reference of the unfused computation: fp64 all-gather then
// GEMM, GEMM then reduce-scatter, GEMM then all-reduce (rounding model of support/tp_reference.hpp); the MoE layers'
// routing, gathered GEMM and weighted top-k sum in fp64; the collectives exactly (small integer values, so every sum is
// exact in any order). A fraction of the calls are invalid arguments, made identically on every rank (a call refused on
// one rank only would leave its peers waiting): each must throw weft::Error naming the op before anything is launched,
// leave the output as it was, and the same op object must then run a valid call correctly.
//
// Knobs (environment, fuzz_harness.hpp): WEFT_FUZZ_SEED, WEFT_FUZZ_SECONDS (per test, default 15), WEFT_FUZZ_CASES,
// WEFT_FUZZ_KERNELS, WEFT_FUZZ_CASE=i.a to replay case i, where a = W * 100 + d: the world of W ranks and the case's
// draw d (what a failure's line prints). Worlds run one after another, each for a slice of the time; rank 0 decides
// each case (time, case and kernel budgets) and every rank then draws the same case from the same seed and makes the
// same calls.
//
// JIT cost (what makes a new kernel): TpFusedGemm, the op, the dtype, the partials' dtype, GemmRs's mode and the fused
// GEMM config the op plans from (max_m, n, k) and its SM budget (options.sm_budget, the world's share of the GPU);
// GemmAr also compiles ceil(min(max_m, 64) / 16) small-M kernels, and a team of one runs the plain GEMM's kernel
// instead of the fused one. MoeTpLayers, the two grouped GEMM configs the layers plan from (max_tokens, hidden, ffn,
// experts, topk, the SM budget less the communication CTAs). Collectives: none (one kernel set, compiled by
// prepare_collectives for any world). A test admits a draw with a kernel it has not run yet only while it has run
// fewer than WEFT_FUZZ_KERNELS of them and is in the first half of its time; otherwise it draws again. The keys are
// computed from the ops' public planners, so they follow the ops' choice closely but not necessarily exactly.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_collectives.hpp"
#include "fuzz_harness.hpp"
#include "fuzz_tp.hpp"
#include "support/gemm_testing.hpp"
#include "support/jit_testing.hpp"
#include "support/runtime_checks.hpp"
#include "support/tp_reference.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/ops/grouped_gemm.hpp"
#include "weft/ops/moe_tp.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/runtime/error.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

using namespace fuzz_test;
using tp_test::HostMat;

TEST_F(GpuFuzz, TpFusedGemm) {
    FuzzRun run("TpFusedGemm", 15, 100000, 6);
    // Small staging regions for GemmAr's collective all-reduce: the heaps of 8 ranks on one GPU stay small.
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::string("4M"));
    fuzz_worlds<TpCase>(
        run, test::test_options(192ull << 20), [](Rng& r, World& w) { return draw_tp(r, w, w.team()); },
        [](const TpCase& c, World& w) { return tp_kernel_key(c, w, w.team()); },
        [](const TpCase& c) { return describe(c); }, [](const TpCase& c) { return c.invalid(); },
        [](World& w) { return std::make_unique<StreamRank>(w); },
        [](const TpCase& c, uint64_t seed, World& w, StreamRank& rk) { return run_tp(c, seed, w, w.team(), rk.st); });
}

// ---- GpuFuzz.MoeTpLayers -------------------------------------------------------------------------------------------

enum class MoeRoute {
    kRandom,
    kDuplicates,
    kDropped,
    kHotExpert,
    kFewExperts,
    kRankWithoutTokens,
    kAllDropped,
    kBadIndex
};
const char* moe_route_name(MoeRoute r) {
    static const char* const kNames[] = {"random",      "duplicates",          "-1_slots",    "hot_expert",
                                         "few_experts", "rank_without_tokens", "all_dropped", "bad_indices"};
    return kNames[static_cast<int>(r)];
}

/// Invalid calls (MoeAgGroupedGemm::run / MoeGroupedGemmRs::run's checks), the same on every rank.
enum class MoeBad { kNone, kXRows, kTopkShape, kW0Shape, kYRows, kOutDtype, kWeightsShape, kHRows, kW1Shape, kCount };
const char* moe_bad_name(MoeBad b) {
    static const char* const kNames[] = {"none",    "x_rows",        "topk_idx_shape", "w0_shape", "y_rows",
                                         "out_f16", "weights_shape", "h_rows",         "w1_shape"};
    return kNames[static_cast<int>(b)];
}
bool moe_bad_in_layer1(MoeBad b) { return b >= MoeBad::kOutDtype; }

struct MoeCall {
    int64_t tpr = 1;  // tokens per rank
    MoeRoute route = MoeRoute::kRandom;
    DType out = DType::kBF16;
    MoeBad bad = MoeBad::kNone;
    bool recreate = false;
};

struct MoeCase {
    int world = 1;
    int64_t tpr_max = 1, hidden = 8, ffn = 8, experts = 1, topk = 1;
    int sm_budget = 0, comm_blocks = 0;
    std::vector<MoeCall> calls;
    int64_t max_tokens() const { return tpr_max * world; }
    bool invalid() const {
        for (const MoeCall& c : calls)
            if (c.bad != MoeBad::kNone) return true;
        return false;
    }
};

std::string describe(const MoeCase& c) {
    std::ostringstream os;
    os << "moe_tp W=" << c.world << " tokens/rank<=" << c.tpr_max << " H=" << c.hidden << " F/W=" << c.ffn
       << " E=" << c.experts << " topk=" << c.topk << " sm_budget=" << c.sm_budget << " comm_blocks=" << c.comm_blocks
       << " calls=[";
    for (size_t j = 0; j < c.calls.size(); ++j) {
        const MoeCall& k = c.calls[j];
        os << (j ? "; " : "") << "tokens/rank=" << k.tpr << " " << moe_route_name(k.route) << " out "
           << dtype_name(k.out) << (k.recreate ? " recreate" : "");
        if (k.bad != MoeBad::kNone) os << " invalid=" << moe_bad_name(k.bad);
    }
    os << "]";
    return os.str();
}

MoeCase draw_moe(Rng& r, World& w) {
    MoeCase c;
    c.world = w.num_ranks();
    const int64_t nr = c.world;
    c.topk = r.pick<int64_t>({1, 2, 4, 6, 8});
    c.experts = r.chance(0.2) ? r.uniform(1, 8) : r.log_uniform(1, 64);
    if (c.experts < c.topk) c.experts = r.chance(0.5) ? c.topk : r.uniform(c.topk, 64);
    c.tpr_max = r.chance(0.3) ? r.uniform(1, 4) : r.log_uniform(1, 96);
    c.hidden = 8 * (r.chance(0.3) ? r.uniform(1, 8) : r.uniform(1, 40));
    c.ffn = 8 * (r.chance(0.3) ? r.uniform(1, 6) : r.uniform(1, 24));
    // Host cost per rank thread: every rank's h and down weights, and the reference's products.
    const auto cost = [&] {
        const int64_t rows_cap = ops::moe_gathered_rows(c.max_tokens(), c.topk, c.experts, 1);
        return std::max(nr * (rows_cap * c.ffn + c.experts * c.hidden * c.ffn),
                        c.max_tokens() * c.topk * c.ffn * c.hidden / 8);
    };
    while (cost() > 3'000'000 && c.hidden > 8) c.hidden = std::max<int64_t>(8, c.hidden / 16 * 8);
    while (cost() > 3'000'000 && c.ffn > 8) c.ffn = std::max<int64_t>(8, c.ffn / 16 * 8);
    while (cost() > 3'000'000 && c.tpr_max > 1) c.tpr_max /= 2;
    const int share = w.shared_sm_budget();
    if (r.chance(0.25)) c.comm_blocks = static_cast<int>(r.uniform(1, 3));
    const int comm = c.comm_blocks > 0 ? c.comm_blocks : std::clamp(share / 8, 1, 16);
    if (r.chance(0.25) && share >= comm + 2) c.sm_budget = static_cast<int>(r.uniform(comm + 2, share));
    const int calls = static_cast<int>(r.uniform(1, 3));
    for (int j = 0; j < calls; ++j) {
        MoeCall k;
        k.tpr = j == 0 && r.chance(0.5) ? c.tpr_max : r.chance(0.3) ? 1 : r.uniform(1, c.tpr_max);
        const double u = r.real(0, 1);
        k.route = u < 0.3    ? MoeRoute::kRandom
                  : u < 0.4  ? MoeRoute::kDuplicates
                  : u < 0.55 ? MoeRoute::kDropped
                  : u < 0.7  ? MoeRoute::kHotExpert
                  : u < 0.82 ? MoeRoute::kFewExperts
                  : u < 0.92 ? MoeRoute::kRankWithoutTokens
                  : u < 0.96 ? MoeRoute::kAllDropped
                             : MoeRoute::kBadIndex;
        k.out = r.chance(0.3) ? DType::kF32 : DType::kBF16;
        k.recreate = j > 0 && r.chance(0.15);
        c.calls.push_back(k);
    }
    if (r.chance(0.12)) {  // one invalid call, then valid calls of both layers on the same op objects
        const size_t j = static_cast<size_t>(r.uniform(0, calls - 1));
        c.calls[j].bad = static_cast<MoeBad>(r.uniform(1, static_cast<int>(MoeBad::kCount) - 1));
    }
    return c;
}

/// The two layers' grouped GEMM configs (as their constructors plan them, with the world's budgets).
std::string moe_kernel_key(const MoeCase& c, World& w) {
    const int sms = gemm_test::num_sms();
    const int budget = c.sm_budget > 0 ? std::min(c.sm_budget, sms) : w.sm_budget();
    const int comm = c.comm_blocks > 0 ? c.comm_blocks : std::clamp(w.shared_sm_budget() / 8, 1, 16);
    ops::GroupedGemmOptions g;
    g.sm_budget = std::max(1, budget - comm);
    g.expected_rows_per_group = std::max<int64_t>(1, c.max_tokens() * c.topk / c.experts);
    ops::GroupedGemmProblem p;
    p.layout = ops::GroupedLayout::kContiguous;
    p.groups = c.experts;
    p.rows = ops::moe_gathered_rows(c.max_tokens(), c.topk, c.experts, 1);
    p.n = c.ffn;
    p.k = c.hidden;
    const GemmConfig up = ops::plan_grouped_gemm(p, sms, g).config;
    p.n = c.hidden;
    p.k = c.ffn;
    p.out_dtype = DType::kF32;
    const GemmConfig down = ops::plan_grouped_gemm(p, sms, g).config;
    return "moe " + ops::format_gemm_config(up) + " / " + ops::format_gemm_config(down);
}

/// topk_idx [tokens, topk], the same on every rank (replicated routing).
std::vector<int32_t> moe_topk(MoeRoute kind, int64_t tokens, int64_t topk, int64_t experts, int64_t tpr, int nr,
                              uint64_t seed) {
    Rng r(seed);
    std::vector<int32_t> out(static_cast<size_t>(tokens * topk));
    std::vector<int32_t> perm(static_cast<size_t>(experts));
    const int32_t hot = static_cast<int32_t>(r.uniform(0, experts - 1));
    const int silent = static_cast<int>(r.uniform(0, nr - 1));
    const int64_t used = r.uniform(1, experts);  // kFewExperts: experts [0, used) only, one in two
    for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t e = 0; e < experts; ++e) perm[static_cast<size_t>(e)] = static_cast<int32_t>(e);
        for (int64_t i = experts - 1; i > 0; --i)
            std::swap(perm[static_cast<size_t>(i)], perm[r.next() % static_cast<uint64_t>(i + 1)]);
        if (kind == MoeRoute::kHotExpert) std::iter_swap(perm.begin(), std::find(perm.begin(), perm.end(), hot));
        for (int64_t k = 0; k < topk; ++k) {
            int32_t e = perm[static_cast<size_t>(k)];
            switch (kind) {
                case MoeRoute::kDuplicates:
                    if (k > 0 && r.chance(0.3)) e = out[static_cast<size_t>(t * topk + k - 1)];
                    if (e < 0) e = perm[static_cast<size_t>(k)];
                    break;
                case MoeRoute::kDropped:
                    if (r.chance(0.3)) e = -1;
                    break;
                case MoeRoute::kFewExperts:
                    e = static_cast<int32_t>(r.uniform(0, used - 1));
                    if (e % 2 == 1 && used > 1) e = -1;
                    break;
                case MoeRoute::kRankWithoutTokens:
                    if (t / tpr == silent) e = -1;
                    break;
                case MoeRoute::kAllDropped:
                    e = -1;
                    break;
                case MoeRoute::kBadIndex:
                    if (r.chance(0.15))
                        e = r.chance(0.5) ? static_cast<int32_t>(experts + r.uniform(0, 5))
                                          : -2 - static_cast<int32_t>(r.uniform(0, 5));
                    break;
                default:
                    break;
            }
            out[static_cast<size_t>(t * topk + k)] = e;
        }
    }
    return out;
}

struct MoeHostRouting {
    std::vector<int32_t> counts, offsets, gather_index, slot_rows, expert_of_row;
};

/// The gathered layout (moe_tp.hpp): expert e's rows [offsets[e], offsets[e] + counts[e]) in (token, k) order.
MoeHostRouting moe_host_route(const std::vector<int32_t>& idx, int64_t tokens, int64_t topk, int64_t experts,
                              int64_t rows_cap) {
    MoeHostRouting r;
    r.counts.assign(static_cast<size_t>(experts), 0);
    r.offsets.assign(static_cast<size_t>(experts + 1), 0);
    r.gather_index.assign(static_cast<size_t>(rows_cap), -1);
    r.expert_of_row.assign(static_cast<size_t>(rows_cap), -1);
    r.slot_rows.assign(static_cast<size_t>(tokens * topk), -1);
    for (int32_t e : idx)
        if (e >= 0 && e < experts) ++r.counts[static_cast<size_t>(e)];
    for (int64_t e = 0; e < experts; ++e)
        r.offsets[static_cast<size_t>(e + 1)] = r.offsets[static_cast<size_t>(e)] + r.counts[static_cast<size_t>(e)];
    std::vector<int32_t> next(r.offsets.begin(), r.offsets.end() - 1);
    for (int64_t i = 0; i < tokens * topk; ++i) {
        const int32_t e = idx[static_cast<size_t>(i)];
        if (e < 0 || e >= experts) continue;
        const int32_t row = next[static_cast<size_t>(e)]++;
        r.gather_index[static_cast<size_t>(row)] = static_cast<int32_t>(i / topk);
        r.expert_of_row[static_cast<size_t>(row)] = e;
        r.slot_rows[static_cast<size_t>(i)] = row;
    }
    return r;
}

/// |got - want| <= u_out |want| + 2^-22 * terms * abs_sum (fp32 accumulation of `terms` products).
bool moe_close(double got, double want, double abs_sum, int64_t terms, DType out) {
    const double u = out == DType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -23);
    return std::isfinite(got) &&
           std::fabs(got - want) <=
               u * std::fabs(want) + std::ldexp(1.0, -22) * static_cast<double>(terms) * abs_sum + 1e-30;
}

/// a's row ra . b's row rb over k (both row-major, row stride k), and the sum of |products|.
void moe_dot(const HostMat& a, int64_t ra, const HostMat& b, int64_t rb, int64_t k, double* s, double* as) {
    double x = 0, y = 0;
    for (int64_t j = 0; j < k; ++j) {
        const double p = static_cast<double>(a.at(ra, j)) * b.at(rb, j);
        x += p;
        y += std::fabs(p);
    }
    *s = x;
    *as = y;
}

std::string run_moe(const MoeCase& c, uint64_t seed, World& w, cudaStream_t st) {
    const int nr = c.world, me = w.rank();
    const int64_t h = c.hidden, f = c.ffn, e = c.experts, topk = c.topk, max_m = c.max_tokens();
    const int64_t rows_cap = ops::moe_gathered_rows(max_m, topk, e, 1);
    // Buffers with room for the invalid views (one row or 8 columns more), so a wrongly accepted call stays inside.
    const auto sz = [](int64_t elems, int64_t bytes) {
        return static_cast<size_t>(round_up((elems + 64) * bytes + 4096, 256));
    };
    const size_t x_b = sz((c.tpr_max + 1) * h, 2), idx_b = sz(max_m * (topk + 1), 4),
                 w0_b = sz((e + 1) * (f + 8) * h, 2), y_b = sz((rows_cap + 1) * f, 2) + kGuard,
                 h_b = sz((rows_cap + 1) * f, 2), w1_b = sz((e + 1) * (h + 8) * f, 2), wt_b = sz(max_m * (topk + 1), 4),
                 out_b = sz((c.tpr_max + 1) * h, 4) + kGuard;
    Arena x_d(x_b), idx_d(idx_b), w0_d(w0_b), y_d(y_b), h_d(h_b), w1_d(w1_b), wt_d(wt_b), out_d(out_b);
    w.barrier();
    const ops::MoeTpShape shape{.max_tokens = max_m, .hidden = h, .ffn = f, .num_experts = e, .topk = topk};
    ops::MoeTpOptions options;
    options.sm_budget = c.sm_budget;
    options.comm_blocks = c.comm_blocks;
    std::unique_ptr<ops::MoeAgGroupedGemm> up;
    std::unique_ptr<ops::MoeGroupedGemmRs> down;
    const auto make = [&] {
        down.reset();
        up.reset();
        up = std::make_unique<ops::MoeAgGroupedGemm>(w, shape, options);
        down = std::make_unique<ops::MoeGroupedGemmRs>(w, shape, options);
    };
    make();
    if (up->rows_capacity() != rows_cap || down->rows_capacity() != rows_cap)
        return "rows_capacity() differs from moe_gathered_rows";
    std::string what;
    const auto fail = [&](const std::string& s) {
        if (what.empty()) what = s;
    };
    bool bad_index_seen = false;  // routing_status() is cumulative over the op object's calls
    for (size_t j = 0; j < c.calls.size(); ++j) {
        const MoeCall& call = c.calls[j];
        const int call_no = static_cast<int>(j);
        if (call.recreate) {
            make();
            bad_index_seen = false;
        }
        const int64_t tpr = call.tpr, m = tpr * nr;
        const std::string at = "call " + std::to_string(j) + " (M " + std::to_string(m) + ")";
        const std::vector<int32_t> idx = moe_topk(call.route, m, topk, e, tpr, nr, seed_for(seed, 0, 0, call_no));
        const MoeHostRouting want = moe_host_route(idx, m, topk, e, rows_cap);
        for (int32_t x : idx) bad_index_seen = bad_index_seen || x < -1 || x >= e;
        std::vector<float> weights(static_cast<size_t>(m * topk));
        {
            Rng wr(seed_for(seed, 5, 0, call_no));
            for (auto& x : weights) x = static_cast<float>(wr.real(0, 1));
        }
        std::vector<HostMat> xs, w1s, hs;
        for (int q = 0; q < nr; ++q) {
            xs.push_back(hashed(tpr, h, h, DType::kBF16, seed_for(seed, 1, q, call_no)));
            w1s.push_back(hashed(e * h, f, f, DType::kBF16, seed_for(seed, 3, q, call_no)));
            hs.push_back(hashed(rows_cap, f, f, DType::kBF16, seed_for(seed, 4, q, call_no)));
        }
        const HostMat w0 = hashed(e * f, h, h, DType::kBF16, seed_for(seed, 2, me, call_no));
        const size_t ob = static_cast<size_t>(dtype_bytes(call.out));
        const size_t y_bytes = static_cast<size_t>(rows_cap * f * 2), out_bytes = static_cast<size_t>(tpr * h) * ob;
        to_dev(x_d.ptr, xs[static_cast<size_t>(me)].bits.data(), xs[static_cast<size_t>(me)].bytes(), st);
        to_dev(idx_d.ptr, idx.data(), idx.size() * 4, st);
        to_dev(w0_d.ptr, w0.bits.data(), w0.bytes(), st);
        to_dev(w1_d.ptr, w1s[static_cast<size_t>(me)].bits.data(), w1s[static_cast<size_t>(me)].bytes(), st);
        to_dev(h_d.ptr, hs[static_cast<size_t>(me)].bits.data(), hs[static_cast<size_t>(me)].bytes(), st);
        to_dev(wt_d.ptr, weights.data(), weights.size() * 4, st);
        check_cuda(cudaMemsetAsync(y_d.ptr, 0xFF, y_d.bytes, st), "poison y");
        check_cuda(cudaMemsetAsync(out_d.ptr, 0xFF, out_d.bytes, st), "poison out");
        check_cuda(cudaStreamSynchronize(st), "poison");
        TensorView xv(x_d.ptr, DType::kBF16, {tpr, h});
        TensorView iv(idx_d.ptr, DType::kI32, {m, topk});
        TensorView w0v(w0_d.ptr, DType::kBF16, {e, f, h});
        TensorView yv(y_d.ptr, DType::kBF16, {rows_cap, f});
        TensorView hv(h_d.ptr, DType::kBF16, {rows_cap, f});
        TensorView w1v(w1_d.ptr, DType::kBF16, {e, h, f});
        TensorView wtv(wt_d.ptr, DType::kF32, {m, topk});
        TensorView ov(out_d.ptr, call.out, {tpr, h});
        w.barrier();  // every rank's inputs are in place
        const auto refused_cleanly = [&](const char* op, auto&& fn) {
            const std::string r = expect_refused(op, fn);
            if (!r.empty()) {
                fail(at + ", " + moe_bad_name(call.bad) + ": " + r);
                return false;
            }
            check_cuda(cudaStreamSynchronize(st), "after a refused call");
            check_cuda(cudaGetLastError(), "after a refused call");
            const std::vector<uint8_t> y_now = from_dev(y_d.ptr, y_d.bytes, st),
                                       o_now = from_dev(out_d.ptr, out_d.bytes, st);
            if (!poison_intact(y_now.data(), y_now.size()) || !poison_intact(o_now.data(), o_now.size())) {
                fail(at + ", " + moe_bad_name(call.bad) + ": a refused call wrote y or out");
            }
            return true;
        };
        bool clean = true;
        if (call.bad != MoeBad::kNone && !moe_bad_in_layer1(call.bad)) {
            TensorView bx = xv, bi = iv, bw = w0v, by = yv;
            switch (call.bad) {
                case MoeBad::kXRows:
                    bx = TensorView(x_d.ptr, DType::kBF16, {c.tpr_max + 1, h});
                    break;
                case MoeBad::kTopkShape:
                    bi = TensorView(idx_d.ptr, DType::kI32, {m, topk + 1});
                    break;
                case MoeBad::kW0Shape:
                    bw = TensorView(w0_d.ptr, DType::kBF16, {e, f + 8, h});
                    break;
                case MoeBad::kYRows:
                    by = TensorView(y_d.ptr, DType::kBF16, {rows_cap - 1, f});
                    break;
                default:
                    break;
            }
            clean = refused_cleanly("moe_ag_grouped_gemm", [&] { up->run(bx, bi, bw, by, st); });
        }
        if (clean) {
            up->run(xv, iv, w0v, yv, st);
            if (call.bad != MoeBad::kNone && moe_bad_in_layer1(call.bad)) {
                w.sync_and_check(st);
                check_cuda(cudaMemsetAsync(out_d.ptr, 0xFF, out_d.bytes, st), "poison out");
                TensorView bh = hv, bw = w1v, bwt = wtv, bo = ov;
                switch (call.bad) {
                    case MoeBad::kOutDtype:
                        bo = TensorView(out_d.ptr, DType::kF16, {tpr, h});
                        break;
                    case MoeBad::kWeightsShape:
                        bwt = TensorView(wt_d.ptr, DType::kF32, {m, topk + 1});
                        break;
                    case MoeBad::kHRows:
                        bh = TensorView(h_d.ptr, DType::kBF16, {rows_cap + 1, f});
                        break;
                    case MoeBad::kW1Shape:
                        bw = TensorView(w1_d.ptr, DType::kBF16, {e, h + 8, f});
                        break;
                    default:
                        break;
                }
                const ops::MoeRouting rt = up->routing();
                // y is written by now: check the out buffer only.
                const std::string r =
                    expect_refused("moe_grouped_gemm_rs", [&] { down->run(bh, bw, rt, bwt, bo, st); });
                if (!r.empty()) {
                    fail(at + ", " + moe_bad_name(call.bad) + ": " + r);
                    clean = false;
                } else {
                    check_cuda(cudaStreamSynchronize(st), "after a refused call");
                    check_cuda(cudaGetLastError(), "after a refused call");
                    const std::vector<uint8_t> o_now = from_dev(out_d.ptr, out_d.bytes, st);
                    if (!poison_intact(o_now.data(), o_now.size()))
                        fail(at + ", " + moe_bad_name(call.bad) + ": a refused call wrote out");
                }
            }
            if (clean) down->run(hv, w1v, up->routing(), wtv, ov, st);
        }
        w.sync_and_check(st);
        if (!clean) {
            w.barrier();
            break;
        }
        // The routing, exact.
        const ops::MoeRouting rt = up->routing();
        const auto slot_rows = from_dev(rt.slot_rows, want.slot_rows.size() * 4, st);
        const auto counts = from_dev(rt.counts, want.counts.size() * 4, st);
        if (std::memcmp(slot_rows.data(), want.slot_rows.data(), slot_rows.size()) != 0 ||
            std::memcmp(counts.data(), want.counts.data(), counts.size()) != 0) {
            fail(at + ": layer 0's routing (slot_rows, counts) differs from the host's");
        }
        if ((up->routing_status().code != 0) != bad_index_seen) {
            fail(at + ": routing_status() code " + std::to_string(up->routing_status().code) + ", bad indices " +
                 (bad_index_seen ? "given" : "not given"));
        }
        // Layer 0: y rows in expert order (this rank's FFN columns); rows past the used ones keep their poison.
        const std::vector<uint8_t> y_raw = from_dev(y_d.ptr, y_d.bytes, st);
        if (!poison_intact(y_raw.data() + y_bytes, y_raw.size() - y_bytes)) fail(at + ": wrote past y's last row");
        const int64_t used = want.offsets.back();
        HostMat x_full(m, h, h, DType::kBF16);
        for (int q = 0; q < nr; ++q)
            std::copy(xs[static_cast<size_t>(q)].bits.begin(), xs[static_cast<size_t>(q)].bits.end(),
                      x_full.bits.begin() + q * tpr * h);
        for (int64_t row = 0; row < rows_cap && what.empty(); ++row) {
            for (int64_t col = 0; col < f; ++col) {
                uint16_t bits;
                std::memcpy(&bits, y_raw.data() + (row * f + col) * 2, 2);
                if (row >= used) {
                    if (bits != 0xFFFF) {
                        fail(at + ": y row " + std::to_string(row) + " past the used rows was written");
                        break;
                    }
                    continue;
                }
                const int64_t ex = want.expert_of_row[static_cast<size_t>(row)];
                double s, as;
                moe_dot(x_full, want.gather_index[static_cast<size_t>(row)], w0, ex * f + col, h, &s, &as);
                const double got = tp_test::bits_to_float(DType::kBF16, bits);
                if (!moe_close(got, s, as, h, DType::kBF16)) {
                    std::ostringstream os;
                    os << at << ": y[" << row << ", " << col << "] = " << got << ", want " << s;
                    fail(os.str());
                    break;
                }
            }
        }
        // Layer 1: this rank's tokens, sum over k of weight * sum over ranks of h_r[row] . w1_r[expert]^T.
        const std::vector<uint8_t> o_raw = from_dev(out_d.ptr, out_d.bytes, st);
        if (!poison_intact(o_raw.data() + out_bytes, o_raw.size() - out_bytes))
            fail(at + ": wrote past out's last row");
        for (int64_t t = 0; t < tpr && what.empty(); ++t) {
            const int64_t token = me * tpr + t;
            for (int64_t col = 0; col < h; ++col) {
                double total = 0, total_abs = 0;
                for (int64_t k = 0; k < topk; ++k) {
                    const int32_t row = want.slot_rows[static_cast<size_t>(token * topk + k)];
                    if (row < 0) continue;
                    const int64_t ex = want.expert_of_row[static_cast<size_t>(row)];
                    const double wgt = weights[static_cast<size_t>(token * topk + k)];
                    for (int q = 0; q < nr; ++q) {
                        double s, as;
                        moe_dot(hs[static_cast<size_t>(q)], row, w1s[static_cast<size_t>(q)], ex * h + col, f, &s, &as);
                        total += wgt * s;
                        total_abs += wgt * as;
                    }
                }
                const double got = read_elem(o_raw.data() + static_cast<size_t>(t * h + col) * ob, call.out);
                if (!moe_close(got, total, total_abs, f * nr + topk * nr, call.out)) {
                    std::ostringstream os;
                    os << at << ": out[" << t << ", " << col << "] = " << got << ", want " << total;
                    fail(os.str());
                    break;
                }
            }
        }
        w.barrier();  // every rank read its results before the next call's inputs
    }
    down.reset();
    up.reset();
    w.sync_and_check(st);
    return what;
}

TEST_F(GpuFuzz, MoeTpLayers) {
    FuzzRun run("MoeTpLayers", 15, 100000, 3);
    fuzz_worlds<MoeCase>(
        run, test::test_options(128ull << 20), draw_moe, moe_kernel_key, [](const MoeCase& c) { return describe(c); },
        [](const MoeCase& c) { return c.invalid(); }, [](World& w) { return std::make_unique<StreamRank>(w); },
        [](const MoeCase& c, uint64_t seed, World& w, StreamRank& rk) { return run_moe(c, seed, w, rk.st); });
}

// ---- GpuFuzz.Collectives -------------------------------------------------------------------------------------------
// The cases (draw_coll, run_coll) are fuzz_collectives.hpp's, on the world's team.

constexpr uint64_t kCollBytes = 8ull << 20;                     // the largest buffer a case uses, bytes
constexpr uint64_t kCollCapacity = kCollBytes + 4096 + kGuard;  // each buffer: room for offsets and the guard

TEST_F(GpuFuzz, Collectives) {
    FuzzRun run("Collectives", 15, 1000000, 1);
    // Small staging regions: the staged algorithms run in several rounds from a few MiB.
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::string("2M"));
    fuzz_worlds<CollCase>(
        run, test::test_options(96ull << 20), [](Rng& r, World& w) { return draw_coll(r, w.num_ranks(), kCollBytes); },
        [](const CollCase&, World&) { return std::string("collectives"); },
        [](const CollCase& c) { return describe(c); }, [](const CollCase& c) { return c.invalid(); },
        [](World& w) { return std::make_unique<CollRank>(w, kCollCapacity); },
        [](const CollCase& c, uint64_t seed, World& w, CollRank& rk) {
            return run_coll(c, seed, w.team(), rk.buffers, rk.stream.st);
        });
}

}  // namespace
}  // namespace weft
