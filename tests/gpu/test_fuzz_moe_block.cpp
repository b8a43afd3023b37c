// SPDX-License-Identifier: MIT
// Seeded random fuzz of the expert-parallel MoE block (weft/ops/ep_moe.hpp), ranks as threads sharing the GPU (worlds
// 1..8), with the harness of fuzz_harness.hpp (knobs and replay as every GpuFuzz suite: WEFT_FUZZ_SEED,
// WEFT_FUZZ_SECONDS, WEFT_FUZZ_CASES, WEFT_FUZZ_KERNELS, WEFT_FUZZ_CASE=i.a with a = W * 100 + draw).
//
//   GpuFuzz.MoeBlock  a case is one MoeBlock of a random MoeConfig (experts per rank 1..8, top-k 1, 2, 3, 4, 6 or 8,
//   hidden and
//                     ffn any multiple of 8 up to 1280 and 384, tokens per rank 1..96, expert alignment 1..128,
//                     sometimes receive limits that a routing overflows) and 1..4 calls on it: a routing scenario of
//                     support/ep_testing.hpp per call (tokens per rank differ, 0 included; hot, sparse, one-rank,
//                     dropped), sometimes repeated or out-of-range expert ids, the fused or the sequential form or both
//                     (then bit for bit equal), a random comm_sms, padded row strides of x and out, and sometimes a
//                     CUDA graph captured once and replayed on new inputs. Every output is poisoned before the call
//                     and checked against a host reference (fp64 sums with the block's bf16 roundings); its padding
//                     columns and the bytes past its last row must keep the poison. A routing that overflows a receive
//                     limit must make check() throw on every rank naming the limit, and give zeros; ids the kernels
//                     drop must be reported by the rank that sent them only. A fraction of the cases are invalid: a
//                     MoeConfig every rank must refuse (naming the field; the next valid block works), or a forward
//                     call with a bad argument, refused with a weft::Error naming ep::MoeBlock before anything is
//                     launched (out keeps its poison), after which the same block runs a valid call correctly.
//
// What makes a new JIT kernel: the block's two grouped GEMM configs (plan_moe_block of the config, the world and the
// rank's SM budget), four kernels each; the SwiGLU kernel is one for every config.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_harness.hpp"
#include "support/ep_reference.hpp"
#include "support/ep_testing.hpp"
#include "weft/ops/ep.hpp"
#include "weft/ops/ep_moe.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/runtime/error.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

using namespace fuzz_test;
namespace ep = ops::ep;
namespace ref = test::ep;
using ref::DeviceArray;
using ref::download;
using ref::Scenario;

constexpr uint64_t kHeapBytes = 192ull << 20;  // each rank's symmetric heap: every drawn config's footprint fits

/// A MoeConfig every rank refuses at construction (the same on every rank).
enum class CfgBad { kNone, kFfnNotMultipleOf8, kFfnZero, kExpertsNotMultipleOfRanks, kTopkAboveExperts, kCount };
const char* cfg_bad_name(CfgBad b) {
    static const char* const kNames[] = {"none", "ffn_not_multiple_of_8", "ffn_zero", "experts_not_multiple_of_ranks",
                                         "topk_above_experts"};
    return kNames[static_cast<int>(b)];
}
/// The word the refusal's message must hold.
const char* cfg_bad_needle(CfgBad b) {
    switch (b) {
        case CfgBad::kFfnNotMultipleOf8:
        case CfgBad::kFfnZero:
            return "ffn";
        case CfgBad::kExpertsNotMultipleOfRanks:
            return "num_experts";
        default:
            return "topk";
    }
}

/// A forward call with a bad argument (every rank alike), refused before anything is launched.
enum class CallBad {
    kNone,
    kXColumns,
    kXF16,
    kTooManyTokens,
    kIdxColumns,
    kWeightsI32,
    kWeightsRows,
    kOutRows,
    kOutF32,
    kGateUpShape,
    kDownShape,
    kCommSmsAtBudget,
    kOutOnHost,
    kCount
};
const char* call_bad_name(CallBad b) {
    static const char* const kNames[] = {
        "none",    "x_columns", "x_f16", "too_many_tokens",    "idx_columns", "weights_i32", "weights_rows", "out_rows",
        "out_f32", "gate_up",   "down",  "comm_sms_at_budget", "out_on_host"};
    return kNames[static_cast<int>(b)];
}

enum class Form { kFused, kSequential, kBoth };
const char* form_name(Form f) { return f == Form::kFused ? "fused" : f == Form::kSequential ? "sequential" : "both"; }

struct Call {
    Scenario scenario = Scenario::kUniform;
    int t_max = 1;         // the scenario's tokens-per-rank bound (<= the config's)
    bool bad_ids = false;  // some slots repeat an earlier one or lie outside [-1, E)
    Form form = Form::kBoth;
    int comm_sms = 0;            // 0 = the default; else 1..budget / 2
    int x_pad = 0, out_pad = 0;  // extra elements per row (multiples of 8)
    bool graph = false;          // captured once (the fused form, or sequential when the form says so), replayed twice
    CallBad bad = CallBad::kNone;
};

struct Case {
    int world = 1;
    int local_experts = 1, topk = 1, hidden = 8, ffn = 8, max_tokens = 1, alignment = 1;
    int64_t max_recv_tokens = 0, max_recv_rows = 0;  // 0 = the worst case
    CfgBad cfg_bad = CfgBad::kNone;
    std::vector<Call> calls;
    int experts() const { return local_experts * world; }
    bool invalid() const {
        if (cfg_bad != CfgBad::kNone) return true;
        for (const Call& c : calls)
            if (c.bad != CallBad::kNone) return true;
        return false;
    }
    ep::MoeConfig config() const {
        ep::MoeConfig c;
        c.ep.num_experts = experts();
        c.ep.hidden = hidden;
        c.ep.topk = topk;
        c.ep.max_tokens_per_rank = max_tokens;
        c.ep.expert_alignment = alignment;
        c.ep.max_recv_tokens = max_recv_tokens;
        c.ep.max_recv_rows = max_recv_rows;
        c.ep.low_latency = false;
        c.ffn = ffn;
        return c;
    }
};

std::string describe(const Case& c) {
    std::ostringstream os;
    os << "moe_block W=" << c.world << " E=" << c.experts() << " (" << c.local_experts << "/rank) topk=" << c.topk
       << " H=" << c.hidden << " F=" << c.ffn << " T<=" << c.max_tokens << " align=" << c.alignment;
    if (c.max_recv_tokens) os << " max_recv_tokens=" << c.max_recv_tokens;
    if (c.max_recv_rows) os << " max_recv_rows=" << c.max_recv_rows;
    if (c.cfg_bad != CfgBad::kNone) os << " invalid_config=" << cfg_bad_name(c.cfg_bad);
    os << " calls=[";
    for (size_t j = 0; j < c.calls.size(); ++j) {
        const Call& k = c.calls[j];
        os << (j ? "; " : "") << ref::scenario_name(k.scenario) << " T<=" << k.t_max << " " << form_name(k.form)
           << " comm_sms=" << k.comm_sms << " pads " << k.x_pad << "/" << k.out_pad << (k.bad_ids ? " bad_ids" : "")
           << (k.graph ? " graph" : "");
        if (k.bad != CallBad::kNone) os << " invalid=" << call_bad_name(k.bad);
    }
    os << "]";
    return os.str();
}

/// Host work per rank: the reference's multiply-adds (3 F H per routed slot) and the experts' weights it keeps.
int64_t reference_cost(const Case& c) { return int64_t{c.max_tokens} * c.topk * 3 * c.ffn * c.hidden; }
int64_t weight_elems(const Case& c) { return int64_t{c.experts()} * 3 * c.ffn * c.hidden; }

Case draw_case(Rng& r, World& w) {
    Case c;
    c.world = w.num_ranks();
    c.local_experts = r.chance(0.25) ? 1 : static_cast<int>(r.uniform(1, 8));
    c.topk = std::min(static_cast<int>(r.pick<int64_t>({1, 2, 3, 4, 6, 8})), c.experts());
    c.hidden = 8 * static_cast<int>(r.chance(0.15) ? r.uniform(64, 160) : r.uniform(1, 64));
    c.ffn = 8 * static_cast<int>(r.chance(0.3) ? r.uniform(1, 8) : r.uniform(1, 48));
    c.max_tokens = static_cast<int>(r.chance(0.2) ? r.uniform(1, 4) : r.log_uniform(1, 96));
    c.alignment = static_cast<int>(r.pick<int64_t>({1, 1, 1, 2, 8, 16, 64, 128}));
    while ((reference_cost(c) > 40'000'000 || weight_elems(c) > 6'000'000) && c.hidden > 8)
        c.hidden = std::max(8, c.hidden / 16 * 8);
    while ((reference_cost(c) > 40'000'000 || weight_elems(c) > 6'000'000) && c.ffn > 8)
        c.ffn = std::max(8, c.ffn / 16 * 8);
    while (reference_cost(c) > 40'000'000 && c.max_tokens > 1) c.max_tokens /= 2;
    if (r.chance(0.1)) c.max_recv_tokens = r.uniform(1, int64_t{c.max_tokens} * c.world);
    if (r.chance(0.1)) c.max_recv_rows = r.uniform(1, int64_t{c.max_tokens} * c.world * c.topk + c.alignment);
    if (r.chance(0.04)) {
        c.cfg_bad = static_cast<CfgBad>(r.uniform(1, static_cast<int>(CfgBad::kCount) - 1));
        if (c.cfg_bad == CfgBad::kExpertsNotMultipleOfRanks && c.world == 1) c.cfg_bad = CfgBad::kFfnZero;
    }
    const int budget = w.sm_budget();
    const auto scenarios = ref::all_scenarios();
    const int calls = static_cast<int>(r.uniform(1, 4));
    for (int j = 0; j < calls; ++j) {
        Call k;
        k.scenario = scenarios[sz(r.uniform(0, static_cast<int64_t>(scenarios.size()) - 1))];
        k.t_max = r.chance(0.6) ? c.max_tokens : static_cast<int>(r.uniform(1, c.max_tokens));
        k.bad_ids = r.chance(0.1);
        const double u = r.real(0, 1);
        k.form = u < 0.35 ? Form::kFused : u < 0.55 ? Form::kSequential : Form::kBoth;
        if (r.chance(0.3) && budget > 1) k.comm_sms = static_cast<int>(r.uniform(1, std::max(1, budget / 2)));
        if (r.chance(0.25)) k.x_pad = 8 * static_cast<int>(r.uniform(1, 4));
        if (r.chance(0.25)) k.out_pad = 8 * static_cast<int>(r.uniform(1, 4));
        k.graph = r.chance(0.12) && k.form != Form::kBoth;
        c.calls.push_back(k);
    }
    if (c.cfg_bad == CfgBad::kNone && r.chance(0.12)) {
        Call& k = c.calls[sz(r.uniform(0, calls - 1))];
        k.bad = static_cast<CallBad>(r.uniform(1, static_cast<int>(CallBad::kCount) - 1));
        k.graph = false;
    }
    return c;
}

/// The block's two GEMM configs, as its constructor plans them on this rank's budget (the harness's kernel key).
std::string kernel_key(const Case& c, World& w) {  // an invalid-config case runs the valid block after the refusal
    int device = 0, sms = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
    const ep::MoePlan plan = ep::plan_moe_block(c.config(), c.world, std::min(sms, w.sm_budget()));
    return "moe_block " + ops::format_gemm_config(plan.up) + " / " + ops::format_gemm_config(plan.down);
}

/// Whether the case's block fits the World's heap (the footprint of its EP buffer and one handle): compared with a
/// fresh heap, as every case frees its block before the next.
struct HeapRoom {
    bool operator()(const Case& c, StreamRank&) const {
        ep::Config e = c.config().ep;
        return ep::footprint(e, c.world).heap_bytes(1) + (8ull << 20) <= kHeapBytes;
    }
};

// ---- the experts and the host reference ----------------------------------------------------------------------------

/// Weight i of matrix m (0: gate_up, 1: down) of expert e: a multiple of 1/1024 in [-1/16, 1/16] times 2^scale (exact
/// in bf16), from a hash of the case's seed.
uint16_t weight_bits(uint64_t seed, int e, int m, int64_t i, int scale) {
    const uint64_t z =
        mix64(seed ^ (static_cast<uint64_t>(e) << 40) ^ (static_cast<uint64_t>(m) << 36) ^ static_cast<uint64_t>(i));
    const int v = static_cast<int>(z % 129) - 64;
    return ref::f32_to_bf16(std::ldexp(static_cast<float>(v) / 1024.0f, scale));
}

/// Powers of two that keep the GEMMs' outputs near 1 whatever H and F are (so the tolerance means the same).
int gate_up_scale(int hidden) {
    return static_cast<int>(std::lround(std::log2(1.0 / (0.036 * std::sqrt(static_cast<double>(hidden))))));
}
int down_scale(int ffn) {
    return static_cast<int>(std::lround(std::log2(3.0 / (0.036 * std::sqrt(static_cast<double>(ffn))))));
}

/// Every expert's weights as floats, made when first needed, and this rank's on the device.
struct Experts {
    const Case& c;
    uint64_t seed;
    int gu_scale, dn_scale;
    std::vector<std::vector<float>> gate_up, down;  // [E][2F * H], [E][H * F]; empty until needed
    DeviceArray<uint16_t> gate_up_dev, down_dev;
    Experts(const Case& cs, uint64_t s, int me, cudaStream_t st)
        : c(cs),
          seed(s),
          gu_scale(gate_up_scale(cs.hidden)),
          dn_scale(down_scale(cs.ffn)),
          gate_up(sz(cs.experts())),
          down(sz(cs.experts())),
          gate_up_dev(sz(cs.local_experts) * 2 * sz(cs.ffn) * sz(cs.hidden), st),
          down_dev(sz(cs.local_experts) * sz(cs.hidden) * sz(cs.ffn), st) {
        std::vector<uint16_t> gu, dn;
        const int64_t ngu = int64_t{2} * c.ffn * c.hidden, ndn = int64_t{c.hidden} * c.ffn;
        for (int le = 0; le < c.local_experts; ++le) {
            const int e = me * c.local_experts + le;
            for (int64_t i = 0; i < ngu; ++i) gu.push_back(weight_bits(seed, e, 0, i, gu_scale));
            for (int64_t i = 0; i < ndn; ++i) dn.push_back(weight_bits(seed, e, 1, i, dn_scale));
        }
        gate_up_dev.upload(gu);
        down_dev.upload(dn);
    }
    void make(int e) {
        if (!gate_up[sz(e)].empty()) return;
        const int64_t ngu = int64_t{2} * c.ffn * c.hidden, ndn = int64_t{c.hidden} * c.ffn;
        auto& a = gate_up[sz(e)];
        auto& b = down[sz(e)];
        a.resize(sz(ngu));
        b.resize(sz(ndn));
        for (int64_t i = 0; i < ngu; ++i) a[sz(i)] = ref::bf16_to_f32(weight_bits(seed, e, 0, i, gu_scale));
        for (int64_t i = 0; i < ndn; ++i) b[sz(i)] = ref::bf16_to_f32(weight_bits(seed, e, 1, i, dn_scale));
    }
    ep::MoeWeights views() const {
        return ep::MoeWeights{TensorView(gate_up_dev.get(), DType::kBF16, {c.local_experts, 2 * c.ffn, c.hidden}),
                              TensorView(down_dev.get(), DType::kBF16, {c.local_experts, c.hidden, c.ffn})};
    }
    /// Expert e's output row for x with the block's roundings: h = bf16(x W^T), a = bf16(silu(g) u), y = bf16(a D^T).
    std::vector<float> row(int e, const uint16_t* x) {
        make(e);
        const int h = c.hidden, f = c.ffn;
        const std::vector<float>& gu = gate_up[sz(e)];
        const std::vector<float>& dn = down[sz(e)];
        std::vector<double> xv(sz(h));
        for (int k = 0; k < h; ++k) xv[sz(k)] = ref::bf16_to_f32(x[k]);
        std::vector<float> hv(sz(2 * f));
        for (int n = 0; n < 2 * f; ++n) {
            double acc = 0;
            const float* wrow = &gu[sz(n) * sz(h)];
            for (int k = 0; k < h; ++k) acc += xv[sz(k)] * wrow[k];
            hv[sz(n)] = ref::bf16_to_f32(ref::f32_to_bf16(static_cast<float>(acc)));
        }
        std::vector<double> a(sz(f));
        for (int j = 0; j < f; ++j) {
            const float g = hv[sz(j)], u = hv[sz(f + j)];
            a[sz(j)] = ref::bf16_to_f32(ref::f32_to_bf16(g / (1.0f + std::exp(-g)) * u));
        }
        std::vector<float> y(sz(h));
        for (int n = 0; n < h; ++n) {
            double acc = 0;
            const float* drow = &dn[sz(n) * sz(f)];
            for (int k = 0; k < f; ++k) acc += a[sz(k)] * drow[k];
            y[sz(n)] = ref::bf16_to_f32(ref::f32_to_bf16(static_cast<float>(acc)));
        }
        return y;
    }
};

/// Random bf16 rows in [-1, 1), multiples of 1/64.
std::vector<uint16_t> random_rows(int tokens, int hidden, uint64_t seed) {
    Rng r(seed);
    std::vector<uint16_t> rows(sz(tokens) * sz(hidden));
    for (auto& v : rows) v = ref::f32_to_bf16(static_cast<float>(r.uniform(-64, 63)) / 64.0f);
    return rows;
}

/// Some slots of every rank's routing made ids the kernels drop and report: a repeat of slot 0 or an id outside
/// [-1, E).
void add_bad_ids(std::vector<ref::Routing>& all, int topk, int experts, uint64_t seed) {
    Rng r(seed);
    for (ref::Routing& rt : all) {
        for (int t = 0; t < rt.num_tokens; ++t) {
            if (!r.chance(0.2)) continue;
            const int j = static_cast<int>(r.uniform(0, topk - 1));
            int32_t& id = rt.topk_idx[sz(t) * sz(topk) + sz(j)];
            if (j > 0 && r.chance(0.5) && rt.topk_idx[sz(t) * sz(topk)] >= 0) {
                id = rt.topk_idx[sz(t) * sz(topk)];
            } else {
                id = r.chance(0.5) ? experts + static_cast<int32_t>(r.uniform(0, 5))
                                   : -2 - static_cast<int32_t>(r.uniform(0, 5));
            }
        }
    }
}

/// A routing with exactly `t` tokens: cut, or padded with tokens of distinct random experts.
ref::Routing fit_tokens(ref::Routing r, int t, int topk, int experts, Rng& rng) {
    while (r.num_tokens < t) {
        std::vector<int32_t> ids;
        while (static_cast<int>(ids.size()) < topk) {
            const auto e = static_cast<int32_t>(rng.uniform(0, experts - 1));
            if (std::find(ids.begin(), ids.end(), e) == ids.end()) ids.push_back(e);
        }
        for (int j = 0; j < topk; ++j) {
            r.topk_idx.push_back(ids[sz(j)]);
            r.topk_weights.push_back(static_cast<float>(rng.real(0.05, 1.0)));
        }
        ++r.num_tokens;
    }
    r.num_tokens = t;
    r.topk_idx.resize(sz(t) * sz(topk));
    r.topk_weights.resize(sz(t) * sz(topk));
    return r;
}

/// Whether this routing holds an id the dispatch reports (a repeat, or one outside [-1, E)).
bool has_reported_id(const ref::Params& p, const ref::Routing& r) {
    for (int t = 0; t < r.num_tokens; ++t)
        for (int j = 0; j < p.topk; ++j)
            if (r.expert(t, j, p.topk) != -1 && ref::valid_expert(p, r, t, j) < 0) return true;
    return false;
}

/// One rank's buffers: x, topk_idx, topk_weights and out, with room for every call's padding and the invalid views.
struct Io {
    int64_t x_ld_max, out_ld_max;
    DeviceArray<uint16_t> x, out;
    DeviceArray<int32_t> idx;
    DeviceArray<float> w;
    Io(const Case& c, cudaStream_t s)
        : x_ld_max(c.hidden + 40),
          out_ld_max(c.hidden + 40),
          x(sz(c.max_tokens + 2) * sz(x_ld_max), s),
          out(sz(c.max_tokens + 2) * sz(out_ld_max) + kGuard, s),
          idx(sz(c.max_tokens + 2) * sz(c.topk + 1), s),
          w(sz(c.max_tokens + 2) * sz(c.topk + 1), s) {}
};

/// Uploads a rank's routing and rows (row stride ld), poisons out.
void load(Io& io, const ref::Routing& r, const std::vector<uint16_t>& rows, int hidden, int64_t ld, cudaStream_t s) {
    if (r.num_tokens > 0) {
        check_cuda(cudaMemcpy2DAsync(io.x.get(), sz(ld) * 2, rows.data(), sz(hidden) * 2, sz(hidden) * 2,
                                     sz(r.num_tokens), cudaMemcpyHostToDevice, s),
                   "upload x");
    }
    io.idx.upload(r.topk_idx);
    io.w.upload(r.topk_weights);
    io.out.poison(0xFF);
}

/// This rank's output against the reference (bf16 [t, H] at row stride ld; padding columns and the bytes past the last
/// row poisoned); `zeros`: every element must be 0. "" or the first difference.
std::string check_out(const Case& c, const ref::Params& p, Experts& ex, const ref::Routing& r,
                      const std::vector<uint16_t>& x, const Io& io, int64_t ld, bool zeros, cudaStream_t s) {
    const int h = c.hidden, t = r.num_tokens;
    const std::vector<uint16_t> got = download(io.out.get(), io.out.size(), s);
    const size_t used = t > 0 ? sz(t - 1) * sz(ld) + sz(h) : 0;
    for (size_t i = used; i < got.size(); ++i) {
        if (got[i] != 0xFFFF) return "out element " + std::to_string(i) + " past the last row was written";
    }
    for (int tok = 0; tok < t; ++tok) {
        for (int64_t col = h; col < ld && sz(tok) * sz(ld) + sz(col) < used; ++col) {
            if (got[sz(tok) * sz(ld) + sz(col)] != 0xFFFF)
                return "out row " + std::to_string(tok) + "'s padding column " + std::to_string(col) + " was written";
        }
    }
    for (int tok = 0; tok < t; ++tok) {
        std::vector<double> want(sz(h), 0.0), mag(sz(h), 0.0);
        if (!zeros) {
            for (int j = 0; j < p.topk; ++j) {
                const int e = ref::valid_expert(p, r, tok, j);
                if (e < 0) continue;
                const double wt = r.topk_weights[sz(tok) * sz(p.topk) + sz(j)];
                const std::vector<float> y = ex.row(e, &x[sz(tok) * sz(h)]);
                for (int ch = 0; ch < h; ++ch) {
                    want[sz(ch)] += wt * y[sz(ch)];
                    mag[sz(ch)] += std::fabs(wt * y[sz(ch)]);
                }
            }
        }
        for (int ch = 0; ch < h; ++ch) {
            const uint16_t bits = got[sz(tok) * sz(ld) + sz(ch)];
            const double v = ref::bf16_to_f32(bits);
            const double tol = zeros ? 0.0 : mag[sz(ch)] / 32.0 + 1.0 / 1024.0;
            if (!std::isfinite(v) || std::fabs(v - want[sz(ch)]) > tol) {
                std::ostringstream os;
                os << "out[" << tok << "][" << ch << "] = " << v << " (0x" << std::hex << bits << std::dec
                   << "), expected " << want[sz(ch)] << " (tolerance " << tol << ")";
                return os.str();
            }
        }
    }
    return "";
}

/// The packed [t, H] elements of out (row stride ld).
std::vector<uint16_t> packed_out(const Io& io, int t, int h, int64_t ld, cudaStream_t s) {
    std::vector<uint16_t> o(sz(t) * sz(h));
    if (t > 0) {
        check_cuda(cudaMemcpy2DAsync(o.data(), sz(h) * 2, io.out.get(), sz(ld) * 2, sz(h) * 2, sz(t),
                                     cudaMemcpyDeviceToHost, s),
                   "download out");
        check_cuda(cudaStreamSynchronize(s), "download out");
    }
    return o;
}

/// What check() throws after a call ("" when nothing).
std::string check_error(ep::MoeBlock& moe) {
    try {
        moe.check();
    } catch (const Error& e) {
        return std::string(e.what()).empty() ? "(an empty message)" : e.what();
    }
    return "";
}

std::string run_case(const Case& c, uint64_t seed, World& w, StreamRank& rk) {
    const cudaStream_t s = rk.st;
    const int me = w.rank();
    ep::MoeConfig cfg = c.config();
    if (c.cfg_bad != CfgBad::kNone) {
        ep::MoeConfig bad = cfg;
        switch (c.cfg_bad) {
            case CfgBad::kFfnNotMultipleOf8:
                bad.ffn += 4;
                break;
            case CfgBad::kFfnZero:
                bad.ffn = 0;
                break;
            case CfgBad::kExpertsNotMultipleOfRanks:
                bad.ep.num_experts += 1;
                break;
            default:
                bad.ep.topk = bad.ep.num_experts + 1;
                break;
        }
        const std::string why = expect_refused(cfg_bad_needle(c.cfg_bad), [&] { ep::MoeBlock b(w, bad); });
        if (!why.empty()) return std::string("invalid config ") + cfg_bad_name(c.cfg_bad) + ": " + why;
        // The world goes on: a valid block of the same shape runs the calls below.
    }
    ep::MoeBlock moe(w, cfg);
    Experts ex(c, seed, me, s);
    Io io(c, s);
    const ref::Params p{.num_ranks = c.world,
                        .num_experts = c.experts(),
                        .topk = c.topk,
                        .hidden = c.hidden,
                        .expert_alignment = c.alignment};
    const ep::Geometry& g = moe.buffer().geometry();
    const int budget = w.sm_budget();
    std::string what;
    const auto fail = [&](const std::string& at, const std::string& why) {
        if (what.empty() && !why.empty()) what = at + ": " + why;
    };
    for (size_t j = 0; j < c.calls.size(); ++j) {
        const Call& call = c.calls[j];
        const std::string at = "call " + std::to_string(j);
        const uint64_t cs = mix64(seed + 977 * (j + 1));
        std::vector<ref::Routing> all =
            ref::make_routing(call.scenario, p, call.t_max, static_cast<uint32_t>(cs & 0xffffffffu));
        if (call.bad_ids) add_bad_ids(all, c.topk, c.experts(), cs ^ 0x5bd1e995u);
        const ref::Routing& mine = all[sz(me)];
        const int t = mine.num_tokens;
        const int64_t x_ld = c.hidden + call.x_pad, out_ld = c.hidden + call.out_pad;
        const std::vector<uint16_t> x = random_rows(t, c.hidden, cs * 31 + static_cast<uint64_t>(me));
        load(io, mine, x, c.hidden, x_ld, s);
        const TensorView xv(io.x.get(), DType::kBF16, {t, c.hidden}, {x_ld, 1});
        const TensorView iv(io.idx.get(), DType::kI32, {t, c.topk});
        const TensorView wv(io.w.get(), DType::kF32, {t, c.topk});
        const TensorView ov(io.out.get(), DType::kBF16, {t, c.hidden}, {out_ld, 1});
        const ep::MoeWeights weights = ex.views();
        const int comm = call.comm_sms > 0 ? std::min(call.comm_sms, budget - 1) : 0;
        w.barrier();  // every rank's inputs are in place

        if (call.bad != CallBad::kNone) {
            ep::MoeWeights bw = weights;
            TensorView bx = xv, bi = iv, bwt = wv, bo = ov;
            ep::MoeOptions bopt{.fused = call.form != Form::kSequential, .comm_sms = comm};
            std::vector<uint16_t> host_out;
            switch (call.bad) {
                case CallBad::kXColumns:
                    bx = TensorView(io.x.get(), DType::kBF16, {t, c.hidden + 8}, {c.hidden + 8, 1});
                    break;
                case CallBad::kXF16:
                    bx = TensorView(io.x.get(), DType::kF16, {t, c.hidden}, {x_ld, 1});
                    break;
                case CallBad::kTooManyTokens:
                    bx = TensorView(io.x.get(), DType::kBF16, {c.max_tokens + 1, c.hidden});
                    bi = TensorView(io.idx.get(), DType::kI32, {c.max_tokens + 1, c.topk});
                    bwt = TensorView(io.w.get(), DType::kF32, {c.max_tokens + 1, c.topk});
                    bo = TensorView(io.out.get(), DType::kBF16, {c.max_tokens + 1, c.hidden});
                    break;
                case CallBad::kIdxColumns:
                    bi = TensorView(io.idx.get(), DType::kI32, {t, c.topk + 1});
                    break;
                case CallBad::kWeightsI32:
                    bwt = TensorView(io.w.get(), DType::kI32, {t, c.topk});
                    break;
                case CallBad::kWeightsRows:
                    bwt = TensorView(io.w.get(), DType::kF32, {t + 1, c.topk});
                    break;
                case CallBad::kOutRows:
                    bo = TensorView(io.out.get(), DType::kBF16, {t + 1, c.hidden}, {out_ld, 1});
                    break;
                case CallBad::kOutF32:
                    bo = TensorView(io.out.get(), DType::kF32, {t, c.hidden}, {out_ld, 1});
                    break;
                case CallBad::kGateUpShape:
                    bw.gate_up = TensorView(weights.gate_up.data, DType::kBF16, {c.local_experts, c.ffn, c.hidden});
                    break;
                case CallBad::kDownShape:
                    bw.down = TensorView(weights.down.data, DType::kBF16, {c.local_experts, c.hidden, c.ffn + 8});
                    break;
                case CallBad::kCommSmsAtBudget:
                    bopt.comm_sms = budget;
                    break;
                default:  // kOutOnHost
                    host_out.assign(sz(std::max(t, 1)) * sz(c.hidden), 0);
                    bo = TensorView(host_out.data(), DType::kBF16, {std::max(t, 1), c.hidden});
                    if (t == 0) {  // a zero-row out is never dereferenced: give the host buffer rows to refuse
                        bx = TensorView(io.x.get(), DType::kBF16, {1, c.hidden});
                        bi = TensorView(io.idx.get(), DType::kI32, {1, c.topk});
                        bwt = TensorView(io.w.get(), DType::kF32, {1, c.topk});
                    }
                    break;
            }
            const std::string why = expect_refused("ep::MoeBlock", [&] { moe.forward(bx, bi, bwt, bw, bo, s, bopt); });
            if (!why.empty()) return at + ", invalid call " + call_bad_name(call.bad) + ": " + why;
            check_cuda(cudaStreamSynchronize(s), "after a refused call");
            check_cuda(cudaGetLastError(), "after a refused call");
            const std::vector<uint8_t> now = from_dev(io.out.get(), io.out.size() * 2, s);
            if (!poison_intact(now.data(), now.size()))
                fail(at, std::string("invalid call ") + call_bad_name(call.bad) + ": a refused call wrote out");
            // The same block then runs the valid call below.
        }

        // What every rank must see: an overflow anywhere (every rank reports it, zeros), ids this rank sent dropped.
        const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
        const ref::Overflow of = ref::find_overflow(plan, g.max_recv_tokens, g.max_recv_rows);
        const bool my_bad_ids = has_reported_id(p, mine);
        const auto after_call = [&](const std::string& where) {
            std::string err;
            try {
                w.sync_and_check(s);
            } catch (const Error& e) {
                return where + ": the call threw " + e.what();
            }
            err = check_error(moe);
            if (my_bad_ids) {  // reported by the rank that sent them (before an overflow, if both)
                if (err.empty()) return where + ": this rank sent repeated or out-of-range ids; check() reported none";
            } else if (of.rank >= 0) {
                const char* limit = of.kind == 1 ? "max_recv_tokens" : "max_recv_rows";
                if (err.find(limit) == std::string::npos)
                    return where + ": a routing over " + limit + " (rank " + std::to_string(of.rank) + " receives " +
                           std::to_string(of.value) +
                           ") must make check() throw naming it; it gave: " + (err.empty() ? "nothing" : err);
            } else if (!err.empty()) {
                return where + ": check() threw without a cause: " + err;
            }
            moe.buffer().clear_status();
            return std::string();
        };
        const auto run_form = [&](bool fused, const std::string& where) {
            io.out.poison(0xFF);
            moe.forward(xv, iv, wv, weights, ov, s, {.fused = fused, .comm_sms = comm});
            const std::string e = after_call(where);
            if (!e.empty()) return e;
            return check_out(c, p, ex, mine, x, io, out_ld, of.rank >= 0, s);
        };

        if (!call.graph) {
            std::vector<uint16_t> first;
            for (bool fused : {true, false}) {
                if ((fused && call.form == Form::kSequential) || (!fused && call.form == Form::kFused)) continue;
                const std::string form = fused ? "fused" : "sequential";
                fail(at + " (" + form + ")", run_form(fused, form));
                if (call.form == Form::kBoth) {
                    std::vector<uint16_t> o = packed_out(io, t, c.hidden, out_ld, s);
                    if (first.empty()) {
                        first = std::move(o);
                    } else if (o != first) {
                        fail(at, "the sequential form's out differs from the fused form's (bit for bit)");
                    }
                }
            }
        } else {
            // Captured once with this call's buffers; replayed on two new routings of the same tokens per rank.
            const bool fused = call.form != Form::kSequential;
            cudaGraph_t graph = nullptr;
            cudaGraphExec_t exec = nullptr;
            check_cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin capture");
            moe.forward(xv, iv, wv, weights, ov, s, {.fused = fused, .comm_sms = comm});
            check_cuda(cudaStreamEndCapture(s, &graph), "end capture");
            check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
            for (int replay = 0; replay < 2; ++replay) {
                const uint64_t rs = mix64(cs + 7919 * static_cast<uint64_t>(replay + 1));
                std::vector<ref::Routing> all_r =
                    ref::make_routing(Scenario::kUniform, p, c.max_tokens, static_cast<uint32_t>(rs & 0xffffffffu));
                Rng fr(rs);
                for (int q = 0; q < c.world; ++q)
                    all_r[sz(q)] = fit_tokens(all_r[sz(q)], all[sz(q)].num_tokens, c.topk, c.experts(), fr);
                const ref::NormalPlan plan_r = ref::reference_normal_plan(p, all_r);
                const ref::Overflow of_r = ref::find_overflow(plan_r, g.max_recv_tokens, g.max_recv_rows);
                const ref::Routing& mine_r = all_r[sz(me)];
                const std::vector<uint16_t> x_r = random_rows(t, c.hidden, rs * 31 + static_cast<uint64_t>(me));
                load(io, mine_r, x_r, c.hidden, x_ld, s);
                w.barrier();
                check_cuda(cudaGraphLaunch(exec, s), "graph launch");
                const std::string where = at + " (graph replay " + std::to_string(replay) + ")";
                std::string e;
                try {
                    w.sync_and_check(s);
                } catch (const Error& err) {
                    e = std::string("the replay threw ") + err.what();
                }
                const std::string err = e.empty() ? check_error(moe) : "";
                if (e.empty() && of_r.rank >= 0 && err.empty()) e = "an overflowing replay reported nothing";
                if (e.empty() && of_r.rank < 0 && !err.empty()) e = "check() threw after a replay: " + err;
                moe.buffer().clear_status();
                if (e.empty()) e = check_out(c, p, ex, mine_r, x_r, io, out_ld, of_r.rank >= 0, s);
                fail(where, e);
                w.barrier();
            }
            check_cuda(cudaGraphExecDestroy(exec), "graph destroy");
            check_cuda(cudaGraphDestroy(graph), "graph destroy");
        }
        w.barrier();  // every rank read its results before the next call's inputs go in
    }
    return what;
}

TEST_F(GpuFuzz, MoeBlock) {
    FuzzRun run("MoeBlock", 15, 100000, 3);
    fuzz_worlds<Case>(
        run, test::test_options(kHeapBytes), draw_case, kernel_key, [](const Case& c) { return describe(c); },
        [](const Case& c) { return c.invalid(); }, [](World& w) { return std::make_unique<StreamRank>(w); },
        [](const Case& c, uint64_t seed, World& w, StreamRank& rk) { return run_case(c, seed, w, rk); }, WorldSizes{},
        HeapRoom{});
}

}  // namespace
}  // namespace weft
