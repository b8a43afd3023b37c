// SPDX-License-Identifier: MIT
// The expert-parallel fuzz cases (ops::ep normal and low-latency dispatch + combine), shared by GpuFuzz.EpNormal and
// GpuFuzz.EpLowLatency (tests/gpu/test_fuzz_ep_attn.cpp: ranks as threads) and MultiNodeFuzz.Ep (tests/dist: processes
// on teams that span virtual nodes). A case is one Buffer of a random Config and 1..6 rounds of routings on it
// (draw_ep_case); run_ep_normal / run_ep_low_latency run it on every rank of a World and compare every output with the
// host reference of support/ep_reference.hpp: the layout and received rows exactly, the combine bit for bit against
// the kernels' arithmetic. Across nodes the normal mode's receive overflow is reported by the overflowing rank only,
// whose partials are zero (docs/multinode.md); everything else is checked as on one node.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_harness.hpp"
#include "support/ep_reference.hpp"
#include "support/ep_testing.hpp"
#include "weft/ops/ep.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/world.hpp"

namespace weft::fuzz_test {

namespace ep = ops::ep;
namespace ref = test::ep;
using ref::DeviceArray;
using ref::download;

// ---- EP: configs, routings, rounds ---------------------------------------------------------------------------------

constexpr uint64_t kEpHeapCap = 128ull << 20;  // symmetric heap a case's Buffer and handles may take per rank
constexpr int64_t kEpPad = 64;                 // most extra elements per row of x, y and out

/// What makes a Config invalid (resolve_geometry's checks; the constructor must throw on every member).
enum class EpCfgBad {
    kNone,
    kExpertsNotMultiple,
    kHiddenNot8,
    kHiddenZero,
    kTopkZero,
    kTopkAboveExperts,
    kTokensZero,
    kAlignmentZero,
    kAlignmentTooBig,
    kNegativeLimit,
    kNoMode,
    kLowLatencyTooManyTokens,
    kTooManyExperts,
    kConfigsDiffer,
    kCount
};
inline const char* cfg_bad_name(EpCfgBad b) {
    static const char* const kNames[] = {"none",           "experts_not_multiple_of_ranks",
                                         "hidden_not_8",   "hidden_zero",
                                         "topk_zero",      "topk_above_experts",
                                         "tokens_zero",    "alignment_zero",
                                         "alignment_1025", "negative_max_recv_rows",
                                         "no_mode",        "low_latency_1025_tokens",
                                         "experts_1025+",  "configs_differ_between_ranks"};
    return kNames[static_cast<int>(b)];
}

/// An invalid call of a round, made alike by every rank (so that every rank throws before anything launches); the
/// round's valid calls follow it on the same Buffer.
enum class EpCallBad {
    kNone,
    kTooManyTokens,
    kXNotBf16,
    kIdxRowsDiffer,
    kWeightsNotF32,
    kSmsOverBudget,
    kXMisaligned,
    kLegacyStream,
    kCombineUndispatched,
    kCombineYShort,   // normal: y with fewer than max_recv_rows rows; low-latency: y of the wrong shape
    kCombineOutRows,  // out rows != the dispatch's T
    kHostX,
    kXInRecvArea,     // normal only
    kFp8Hidden,       // low-latency only: fp8 with hidden % 128 != 0
    kRecvNothing,     // low-latency only: kRecv with no send outstanding
    kThirdSend,       // low-latency only
    kRecvOutOfOrder,  // low-latency only
    kCount
};
inline const char* call_bad_name(EpCallBad b) {
    static const char* const kNames[] = {"none",
                                         "too_many_tokens",
                                         "x_not_bf16",
                                         "idx_rows_differ",
                                         "weights_not_f32",
                                         "num_sms_over_budget",
                                         "x_misaligned",
                                         "legacy_stream",
                                         "combine_undispatched",
                                         "combine_y_short",
                                         "combine_out_rows",
                                         "host_x",
                                         "x_in_recv_area",
                                         "fp8_hidden",
                                         "recv_nothing",
                                         "third_send",
                                         "recv_out_of_order"};
    return kNames[static_cast<int>(b)];
}

struct EpRound {
    std::vector<ref::Routing> all;  // every rank's routing
    uint32_t x_seed = 0;
    const char* pattern = "";
    int handle = 0;   // normal: handle 0 or 1
    int num_sms = 0;  // 0: the default; else capped at the SM budget
    bool in_place = false;
    int64_t x_pad = 0, y_pad = 0, out_pad = 0;  // extra elements per row
    int64_t y_extra_rows = 0;
    EpCallBad bad = EpCallBad::kNone;
    // low-latency
    bool fp8 = false, split = false, mismatch = false, pair_with_next = false;
};

struct EpCase {
    bool low_latency = false;
    int world = 1;
    ep::Config cfg;
    EpCfgBad cfg_bad = EpCfgBad::kNone;
    std::vector<EpRound> rounds;
};

inline std::string describe_config(const ep::Config& c) {
    std::ostringstream os;
    os << "E=" << c.num_experts << " H=" << c.hidden << " k=" << c.topk << " T=" << c.max_tokens_per_rank
       << " align=" << c.expert_alignment << " max_recv_tokens=" << c.max_recv_tokens
       << " max_recv_rows=" << c.max_recv_rows;
    return os.str();
}

inline std::string describe(const EpCase& c) {
    std::ostringstream os;
    os << (c.low_latency ? "low_latency" : "normal") << " world=" << c.world << " " << describe_config(c.cfg)
       << " invalid_config=" << cfg_bad_name(c.cfg_bad) << " rounds=[";
    for (size_t i = 0; i < c.rounds.size(); ++i) {
        const EpRound& r = c.rounds[i];
        os << (i ? "; " : "") << r.pattern << " T=";
        for (size_t q = 0; q < r.all.size(); ++q) os << (q ? "," : "") << r.all[q].num_tokens;
        if (c.low_latency) {
            os << (r.fp8 ? " fp8" : " bf16") << (r.split ? " split" : "") << (r.mismatch ? " fp8_mismatch" : "")
               << (r.pair_with_next ? " paired" : "");
        } else {
            os << " handle=" << r.handle;
        }
        os << " sms=" << r.num_sms << (r.in_place ? " in_place" : "") << " pads=" << r.x_pad << "," << r.y_pad << ","
           << r.out_pad << " invalid=" << call_bad_name(r.bad);
    }
    os << "]";
    return os.str();
}

inline ref::Params params_of(const ep::Config& c, int world) {
    ref::Params p;
    p.num_ranks = world;
    p.num_experts = c.num_experts;
    p.topk = c.topk;
    p.hidden = c.hidden;
    p.expert_alignment = c.expert_alignment;
    return p;
}

/// Whether `routing` holds an id the kernels report (a repeat or one outside [-1, E)).
inline bool has_reported_id(const ref::Params& p, const ref::Routing& r) {
    for (int t = 0; t < r.num_tokens; ++t) {
        for (int j = 0; j < p.topk; ++j) {
            if (r.expert(t, j, p.topk) != -1 && ref::valid_expert(p, r, t, j) < 0) return true;
        }
    }
    return false;
}

/// One round's routings: the same pattern on every rank, tokens per rank drawn apart (0 included).
inline void draw_routings(Rng& r, const ep::Config& cfg, int world, EpRound& round, bool allow_bad_ids) {
    const int e = cfg.num_experts, k = cfg.topk, el = e / world, t_max = cfg.max_tokens_per_rank;
    static const char* const kPatterns[] = {"uniform",      "hot_expert",  "sparse_ranks", "one_rank",
                                            "some_dropped", "all_dropped", "few_experts"};
    const int pattern = static_cast<int>(r.uniform(0, 6));
    round.pattern = kPatterns[pattern];
    const int hot = static_cast<int>(r.uniform(0, e - 1));
    // The experts the pattern may route to.
    std::vector<int32_t> allowed;
    if (pattern == 2) {
        for (int q = 0; q < world; ++q) {
            if (q == 0 || r.chance(0.3)) {
                for (int x = q * el; x < (q + 1) * el; ++x) allowed.push_back(x);
            }
        }
    } else if (pattern == 6) {
        const int n = static_cast<int>(r.uniform(1, std::min(e, 3)));
        for (int i = 0; i < n; ++i) allowed.push_back(static_cast<int32_t>(r.uniform(0, e - 1)));
        std::sort(allowed.begin(), allowed.end());
        allowed.erase(std::unique(allowed.begin(), allowed.end()), allowed.end());
    } else {
        for (int x = 0; x < e; ++x) allowed.push_back(x);
    }
    const int t_mode = static_cast<int>(r.uniform(0, 9));  // 0: all zero, 1: all equal, else per rank
    const int t_equal = static_cast<int>(r.chance(0.3) ? t_max : r.uniform(0, t_max));
    const bool neg_weights = r.chance(0.5);
    const double drop = pattern == 4 ? 0.3 : pattern == 5 ? 1.0 : (r.chance(0.2) ? 0.05 : 0.0);
    const int bad_rank = allow_bad_ids && r.chance(0.15) ? static_cast<int>(r.uniform(0, world - 1)) : -1;
    const bool bad_out_of_range = r.chance(0.5);
    round.all.assign(sz(world), ref::Routing{});
    std::vector<int32_t> scratch;
    for (int q = 0; q < world; ++q) {
        ref::Routing& rt = round.all[sz(q)];
        int t = t_mode == 0 ? 0 : t_mode == 1 ? t_equal : 0;
        if (t_mode >= 2) {
            const double u = r.real(0, 1);
            t = u < 0.12 ? 0 : u < 0.22 ? 1 : u < 0.4 ? t_max : static_cast<int>(r.uniform(0, t_max));
        }
        rt.num_tokens = t;
        rt.topk_idx.assign(sz(t) * sz(k), -1);
        rt.topk_weights.assign(sz(t) * sz(k), 0.f);
        for (int tok = 0; tok < t; ++tok) {
            int32_t* row = rt.topk_idx.data() + sz(tok) * sz(k);
            scratch = allowed;
            if (pattern == 3) {  // every expert of the token on one rank
                const int owner = static_cast<int>(r.uniform(0, world - 1));
                scratch.clear();
                for (int x = owner * el; x < (owner + 1) * el; ++x) scratch.push_back(x);
            }
            int first = 0;
            if (pattern == 1) {
                row[0] = hot;
                first = 1;
                scratch.erase(std::remove(scratch.begin(), scratch.end(), hot), scratch.end());
            }
            size_t n = scratch.size();
            for (int j = first; j < k && n > 0; ++j) {  // distinct experts, a partial shuffle
                const size_t pick = sz(r.next() % n);
                row[j] = scratch[pick];
                std::swap(scratch[pick], scratch[n - 1]);
                --n;
            }
            for (int j = 0; j < k; ++j) {
                if (drop > 0 && r.chance(drop)) row[j] = -1;
                rt.topk_weights[sz(tok) * sz(k) + sz(j)] =
                    static_cast<float>(neg_weights ? r.real(-1, 1) : r.real(0.05, 1));
            }
            if (q == bad_rank && r.chance(0.3)) {
                const int j = static_cast<int>(r.uniform(0, k - 1));
                if (bad_out_of_range) {
                    row[j] = r.chance(0.5) ? static_cast<int32_t>(e + r.uniform(0, 100))
                                           : static_cast<int32_t>(-2 - r.uniform(0, 100));
                } else if (j > 0) {
                    row[j] = row[r.uniform(0, j - 1)];  // a repeat (of -1: not reported, also fine)
                }
            }
        }
    }
}

inline ep::Config draw_ep_config(Rng& r, int world, bool low_latency) {
    ep::Config c;
    c.normal = !low_latency;
    c.low_latency = low_latency;
    const int el = static_cast<int>(r.chance(0.7) ? r.pick<int64_t>({1, 1, 2, 3, 4, 8}) : r.uniform(1, 16));
    c.num_experts = world * el;
    c.topk = static_cast<int>(r.chance(0.9) ? r.pick<int64_t>({1, 2, 4, 6, 8}) : r.uniform(1, 12));
    c.topk = std::min(c.topk, c.num_experts);
    const double h = r.real(0, 1);
    if (low_latency && r.chance(0.6)) {
        c.hidden = 128 * static_cast<int>(r.chance(0.8) ? r.uniform(1, 8) : r.pick<int64_t>({16, 32, 56}));
    } else if (h < 0.35) {
        c.hidden = 8 * static_cast<int>(r.uniform(1, 8));
    } else if (h < 0.9) {
        c.hidden = 8 * static_cast<int>(r.uniform(1, 256));
    } else {
        c.hidden = static_cast<int>(r.pick<int64_t>({4096, 7168}));
    }
    c.max_tokens_per_rank = static_cast<int>(r.log_uniform(1, low_latency ? 256 : 512));
    if (r.chance(0.4)) c.expert_alignment = static_cast<int>(r.pick<int64_t>({2, 8, 16, 64, 128, 1024}));
    if (r.chance(0.3)) c.expert_alignment = static_cast<int>(r.uniform(1, 200));
    // Bounded work and memory: the host builds every rank's rows; the heap holds the Buffer and three handles.
    const auto fits = [&](const ep::Config& x) {
        const int64_t k_eff = std::min(x.topk, x.num_experts / world);
        const int64_t rows = int64_t{world} * x.max_tokens_per_rank * std::max<int64_t>(k_eff, 1) +
                             int64_t{x.num_experts / world} * (x.expert_alignment - 1);
        if (rows * x.hidden > (int64_t{3} << 20)) return false;
        if (low_latency &&
            int64_t{x.num_experts / world} * world * x.max_tokens_per_rank * x.hidden > (int64_t{4} << 20)) {
            return false;
        }
        try {
            return ep::footprint(x, world).heap_bytes(3) <= kEpHeapCap;
        } catch (const Error&) {
            return false;
        }
    };
    for (int guard = 0; guard < 64 && !fits(c); ++guard) {
        if (c.max_tokens_per_rank > 1 && (c.hidden <= 64 || r.chance(0.5))) {
            c.max_tokens_per_rank /= 2;
        } else if (c.hidden > 8) {
            c.hidden = std::max(low_latency && c.hidden % 128 == 0 ? 128 : 8, c.hidden / 2 / 8 * 8);
        } else if (c.expert_alignment > 1) {
            c.expert_alignment = 1;
        }
    }
    if (!low_latency && r.chance(0.3)) {  // receive limits some routings exceed
        const ep::Geometry g = ep::resolve_geometry(c, world, 0);
        if (r.chance(0.5)) {
            c.max_recv_tokens = r.uniform(1, std::max<int64_t>(1, g.max_recv_tokens));
        } else {
            c.max_recv_rows = r.uniform(1, std::max<int64_t>(1, g.max_recv_rows));
        }
    }
    return c;
}

inline EpCase draw_ep_case(Rng& r, int world, bool low_latency) {
    EpCase c;
    c.world = world;
    c.low_latency = low_latency;
    c.cfg = draw_ep_config(r, world, low_latency);
    if (r.chance(0.08)) {
        c.cfg_bad = static_cast<EpCfgBad>(r.uniform(1, static_cast<int>(EpCfgBad::kCount) - 1));
        ep::Config& x = c.cfg;
        switch (c.cfg_bad) {
            case EpCfgBad::kExpertsNotMultiple:
                if (world == 1) {
                    c.cfg_bad = EpCfgBad::kTopkZero;
                    x.topk = 0;
                } else {
                    x.num_experts += 1;
                }
                break;
            case EpCfgBad::kHiddenNot8:
                x.hidden += 1 + static_cast<int>(r.uniform(0, 6));
                break;
            case EpCfgBad::kHiddenZero:
                x.hidden = 0;
                break;
            case EpCfgBad::kTopkZero:
                x.topk = 0;
                break;
            case EpCfgBad::kTopkAboveExperts:
                x.topk = std::min(x.num_experts, ep::kMaxTopk) + 1;
                break;
            case EpCfgBad::kTokensZero:
                x.max_tokens_per_rank = 0;
                break;
            case EpCfgBad::kAlignmentZero:
                x.expert_alignment = 0;
                break;
            case EpCfgBad::kAlignmentTooBig:
                x.expert_alignment = ep::kMaxExpertAlignment + 1;
                break;
            case EpCfgBad::kNegativeLimit:
                x.max_recv_rows = -1 - r.uniform(0, 5);
                break;
            case EpCfgBad::kNoMode:
                x.normal = x.low_latency = false;
                break;
            case EpCfgBad::kLowLatencyTooManyTokens:
                x.low_latency = true;
                x.max_tokens_per_rank = ep::kMaxLowLatencyTokens + 1;
                break;
            case EpCfgBad::kTooManyExperts:
                x.num_experts = (ep::kMaxExperts / world + 1) * world;
                break;
            case EpCfgBad::kConfigsDiffer:
                if (world == 1) {
                    c.cfg_bad = EpCfgBad::kHiddenZero;
                    x.hidden = 0;
                }
                break;  // rank 0 raises its max_recv_tokens (cfg_for)
            default:
                break;
        }
        return c;
    }
    const int rounds = static_cast<int>(r.uniform(1, 6));
    for (int i = 0; i < rounds; ++i) {
        EpRound rd;
        // A mismatched call is a round of its own: the second round of a pair is checked with the first's status.
        const bool second_of_pair = i > 0 && c.rounds.back().pair_with_next;
        const bool mismatch = low_latency && world > 1 && c.cfg.hidden % 128 == 0 && !second_of_pair && r.chance(0.08);
        draw_routings(r, c.cfg, world, rd, !mismatch);
        rd.x_seed = static_cast<uint32_t>(r.next());
        rd.handle = static_cast<int>(r.uniform(0, 1));
        rd.num_sms = r.chance(0.6) ? 0 : static_cast<int>(r.uniform(1, 8));
        rd.in_place = r.chance(0.4);
        if (r.chance(0.3)) rd.x_pad = 8 * r.uniform(1, kEpPad / 8);
        if (r.chance(0.3)) rd.y_pad = 8 * r.uniform(1, kEpPad / 8);
        if (r.chance(0.3)) rd.out_pad = 8 * r.uniform(1, kEpPad / 8);
        if (r.chance(0.3)) rd.y_extra_rows = r.uniform(1, 8);
        if (low_latency) {
            rd.fp8 = c.cfg.hidden % 128 == 0 && r.chance(0.5);
            rd.split = r.chance(0.35);
            rd.mismatch = mismatch;
            rd.pair_with_next = !mismatch && i + 1 < rounds && r.chance(0.25);
            if (rd.fp8 || rd.mismatch) rd.in_place = false;
        }
        if (r.chance(0.12)) {
            rd.bad = static_cast<EpCallBad>(r.uniform(1, static_cast<int>(EpCallBad::kCount) - 1));
            const bool ll_only = rd.bad >= EpCallBad::kFp8Hidden;
            if (rd.bad == EpCallBad::kXInRecvArea && low_latency) rd.bad = EpCallBad::kHostX;
            if (ll_only && !low_latency) rd.bad = EpCallBad::kTooManyTokens;
            if (rd.bad == EpCallBad::kFp8Hidden && c.cfg.hidden % 128 == 0) rd.bad = EpCallBad::kXNotBf16;
            if (rd.bad == EpCallBad::kLegacyStream && world == 1) rd.bad = EpCallBad::kSmsOverBudget;
            if (low_latency && (rd.pair_with_next || (i > 0 && c.rounds.back().pair_with_next))) {
                rd.bad = EpCallBad::kNone;  // paired rounds run their calls interleaved: no invalid call among them
            }
        }
        c.rounds.push_back(std::move(rd));
    }
    return c;
}

/// The Config rank `me` passes (kConfigsDiffer: rank 0's differs).
inline ep::Config cfg_for(const EpCase& c, int me) {
    ep::Config x = c.cfg;
    if (c.cfg_bad == EpCfgBad::kConfigsDiffer && me == 0) x.max_recv_tokens = int64_t{c.world} * 1000 + 7;
    return x;
}

/// The status this rank must report after a dispatch: "" if right, else what is wrong.
inline std::string check_status(const ep::Buffer& buf, bool my_bad_ids, std::optional<ep::StatusCode> want, int culprit,
                                int64_t value, int me) {
    const std::optional<ep::StatusReport> st = buf.status();
    if (my_bad_ids) {
        if (!st || (st->code != ep::StatusCode::kDuplicateExpert && st->code != ep::StatusCode::kInvalidExpert) ||
            st->raw.culprit_rank != me) {
            return "expected a repeated or invalid expert id report naming this rank, got " +
                   (st ? st->message : std::string("no status"));
        }
        return "";
    }
    if (!want) return st ? "unexpected status: " + st->message : "";
    if (!st || st->code != *want) {
        return "expected status code " + std::to_string(static_cast<int>(*want)) + ", got " +
               (st ? st->message : std::string("no status"));
    }
    if (culprit >= 0 && (st->raw.culprit_rank != culprit || st->raw.value != value)) {
        return "status names culprit " + std::to_string(st->raw.culprit_rank) + " value " +
               std::to_string(st->raw.value) + ", expected " + std::to_string(culprit) + " / " + std::to_string(value) +
               ": " + st->message;
    }
    if (st->message.empty()) return "status with an empty message";
    return "";
}

/// Whether any rank of `w` failed its checks of a round (every rank calls it after each round): the ranks then end
/// the case together, so that none goes on into a collective call the others have left.
inline bool any_rank_failed(World& w, bool failed) {
    if (w.num_ranks() == 1) return failed;
    for (const auto& v : w.team().all_gather("weft.test.fuzz_ep_round", {static_cast<uint8_t>(failed)})) {
        if (v[0] != 0) return true;
    }
    return false;
}

/// An invalid-config case: making a Buffer of `cfg` must throw weft::Error naming ep; returns the failure
/// if not, setting *fatal (a Buffer made on some ranks only: the ranks' calls may no longer agree).
inline std::vector<std::string> check_config_refused(World& w, const EpCase& c, const ep::Config& cfg, bool* fatal) {
    std::vector<std::string> fails;
    const std::string why = expect_refused("ep", [&] { ep::Buffer b(w, cfg); });
    if (!why.empty()) {
        fails.push_back("invalid Config " + std::string(cfg_bad_name(c.cfg_bad)) + ": " + why);
        *fatal = true;
    }
    return fails;
}

/// Uploads `rows` rows of `cols` 16-bit values (packed) into a buffer of row stride ld (ordered on s).
template <class T>
inline void upload_rows(T* dst, const std::vector<T>& src, int64_t rows, int64_t cols, int64_t ld, cudaStream_t s) {
    if (rows == 0) return;
    WEFT_CUDA_CHECK(cudaMemcpy2DAsync(dst, sz(ld) * sizeof(T), src.data(), sz(cols) * sizeof(T), sz(cols) * sizeof(T),
                                      sz(rows), cudaMemcpyHostToDevice, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
}

/// Compares an output downloaded as [rows, ld] (plus kGuard poisoned bytes) with `want` [rows, cols]; the row padding
/// and the guard must keep their poison.
inline std::string compare_out(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, int64_t rows,
                               int64_t cols, int64_t ld, const std::function<std::string(int64_t, int64_t)>& where) {
    for (int64_t t = 0; t < rows; ++t) {
        for (int64_t c = 0; c < cols; ++c) {
            const uint16_t g = got[sz(t * ld + c)], x = want[sz(t * cols + c)];
            if (g != x) {
                std::ostringstream os;
                os << "out[" << t << "][" << c << "] = " << ref::bf16_to_f32(g) << " (0x" << std::hex << g << "), want "
                   << ref::bf16_to_f32(x) << " (0x" << x << std::dec << ")" << where(t, c);
                return os.str();
            }
        }
        if (!poison_intact(reinterpret_cast<const uint8_t*>(got.data() + t * ld + cols), sz(ld - cols) * 2)) {
            return "wrote into the row padding of out row " + std::to_string(t);
        }
    }
    if (!poison_intact(reinterpret_cast<const uint8_t*>(got.data() + rows * ld), kGuard)) return "wrote past out's end";
    return "";
}

// ---- GpuFuzz.EpNormal ----------------------------------------------------------------------------------------------

/// This rank's dispatch results against the plan: "" or the first difference.
/// Across nodes (`one_rank_tokens` > 0) `source_offsets` and `info` are the one-rank Buffer's the exchange feeds
/// (docs/multinode.md): info is checked for validity and that Buffer's token count, source_offsets not at all.
inline std::string check_normal_dispatch(const ref::Params& p, const ref::NormalPlan& plan,
                                         const std::vector<std::vector<uint16_t>>& x_all, const ep::NormalHandle& h,
                                         int me, int t, cudaStream_t s, int64_t one_rank_tokens = 0) {
    const ep::NormalHandleView& v = h.view();
    const size_t w = sz(p.num_ranks), el = sz(p.local_experts()), k = sz(p.topk), ts = sz(t);
    const ref::RankLayout& l = plan.layouts[sz(me)];
    if (download(v.tokens_per_expert, sz(p.num_experts), s) != l.tokens_per_expert) return "tokens_per_expert differs";
    if (download(v.tokens_per_rank, w, s) != l.tokens_per_rank) return "tokens_per_rank differs";
    if (download(v.token_in_rank, ts * w, s) != l.token_in_rank) return "token_in_rank differs";
    if (download(v.send_idx, ts * w, s) != l.send_idx) return "send_idx differs";
    if (download(v.route_pos, ts * k, s) != l.route_pos) return "route_pos differs";
    if (download(v.expert_counts, el, s) != plan.expert_counts[sz(me)]) return "expert_counts differ";
    if (download(v.expert_offsets, el + 1, s) != plan.expert_offsets[sz(me)]) return "expert_offsets differ";
    const std::vector<int32_t> info = download(v.info, sz(ep::kInfoInts), s);
    if (one_rank_tokens > 0) {
        if (info[ep::kInfoValid] != 1 || info[ep::kInfoNumTokens] != one_rank_tokens) {
            return "info {valid " + std::to_string(info[ep::kInfoValid]) + ", T " +
                   std::to_string(info[ep::kInfoNumTokens]) + "}: the one-rank Buffer's should be {1, " +
                   std::to_string(one_rank_tokens) + "}";
        }
    } else if (download(v.source_offsets, w + 1, s) != plan.source_offsets[sz(me)]) {
        return "source_offsets differ";
    } else if (info[ep::kInfoValid] != 1 || info[ep::kInfoNumTokens] != t ||
               info[ep::kInfoRecvTokens] != plan.recv_tokens[sz(me)] ||
               info[ep::kInfoRecvRows] != plan.recv_rows[sz(me)]) {
        return "info {valid " + std::to_string(info[0]) + ", T " + std::to_string(info[1]) + ", tokens " +
               std::to_string(info[2]) + ", rows " + std::to_string(info[3]) + "} differs from the plan {T " +
               std::to_string(t) + ", tokens " + std::to_string(plan.recv_tokens[sz(me)]) + ", rows " +
               std::to_string(plan.recv_rows[sz(me)]) + "}";
    }
    const auto& rows = plan.rows[sz(me)];
    const size_t hsz = sz(p.hidden);
    const std::vector<uint16_t> got = download(v.recv_x, rows.size() * hsz, s);
    for (size_t row = 0; row < rows.size(); ++row) {
        const ref::RowSource src = rows[row];
        if (src.src < 0) continue;  // padding: unspecified
        const uint16_t* want = &x_all[sz(src.src)][sz(src.token) * hsz];
        if (!std::equal(want, want + hsz, &got[row * hsz])) {
            return "received row " + std::to_string(row) + ": expected rank " + std::to_string(src.src) + " token " +
                   std::to_string(src.token) + " (slot " + std::to_string(src.slot) + "), found " +
                   ref::describe_row(&got[row * hsz]);
        }
    }
    return "";
}

/// Every rank's y rows (expert_output of the received payload; padding and rows past the plan NaN).
inline std::vector<std::vector<uint16_t>> normal_y(const ref::Params& p, const ref::NormalPlan& plan,
                                                   const std::vector<std::vector<uint16_t>>& x_all) {
    std::vector<std::vector<uint16_t>> y(sz(p.num_ranks));
    for (int r = 0; r < p.num_ranks; ++r) {
        const auto& rows = plan.rows[sz(r)];
        auto& yr = y[sz(r)];
        yr.assign(rows.size() * sz(p.hidden), 0x7fc1);
        const auto& off = plan.expert_offsets[sz(r)];
        for (int le = 0; le < p.local_experts(); ++le) {
            for (int32_t row = off[sz(le)]; row < off[sz(le) + 1]; ++row) {
                const ref::RowSource src = rows[sz(row)];
                if (src.src < 0) continue;
                const uint16_t* x = &x_all[sz(src.src)][sz(src.token) * sz(p.hidden)];
                for (int c = 0; c < p.hidden; ++c) {
                    yr[sz(row) * sz(p.hidden) + sz(c)] = ref::expert_output(x[c], r * p.local_experts() + le);
                }
            }
        }
    }
    return y;
}

/// Rank `me`'s part of a normal-mode case.
inline std::vector<std::string> run_ep_normal(World& w, const EpCase& c, cudaStream_t s, bool* fatal) {
    std::vector<std::string> fails;
    const int me = w.rank();
    const ep::Config cfg = cfg_for(c, me);
    if (c.cfg_bad != EpCfgBad::kNone) return check_config_refused(w, c, cfg, fatal);
    ep::Buffer buf(w, cfg);
    std::vector<ep::NormalHandle> h;
    for (int i = 0; i < 3; ++i) h.push_back(buf.make_normal_handle());  // handle 2 is never dispatched
    const ref::Params p = params_of(cfg, c.world);
    const ep::Geometry& g = buf.geometry();
    const int64_t hd = cfg.hidden, k = cfg.topk, tmax = cfg.max_tokens_per_rank;
    const int64_t ld_max = hd + kEpPad;
    DeviceArray<uint16_t> x(sz((tmax + 1) * ld_max + 64), s), y(sz((g.max_recv_rows + 8) * ld_max), s);
    DeviceArray<uint16_t> out(sz((tmax + 1) * ld_max) + kGuard / 2, s);
    DeviceArray<int32_t> idx(sz((tmax + 1) * k), s);
    DeviceArray<float> wts(sz((tmax + 1) * k), s);
    const int budget = w.sm_budget();
    for (size_t ri = 0; ri < c.rounds.size(); ++ri) {
        const EpRound& rd = c.rounds[ri];
        const std::string tag = "round " + std::to_string(ri) + ": ";
        std::vector<std::vector<uint16_t>> x_all;
        for (int q = 0; q < c.world; ++q) {
            x_all.push_back(ref::payload_rows(q, rd.all[sz(q)].num_tokens, cfg.hidden, rd.x_seed, false));
        }
        const ref::Routing& mine = rd.all[sz(me)];
        const int t = mine.num_tokens;
        const int64_t x_ld = hd + rd.x_pad, y_ld = hd + rd.y_pad, out_ld = hd + rd.out_pad;
        upload_rows(x.get(), x_all[sz(me)], t, hd, x_ld, s);
        idx.upload(mine.topk_idx);
        wts.upload(mine.topk_weights);
        ep::NormalHandle& hh = h[sz(rd.handle)];
        const TensorView xv = view2(x.get(), DType::kBF16, t, hd, x_ld);
        const TensorView iv(idx.get(), DType::kI32, {t, k});
        const TensorView wv(wts.get(), DType::kF32, {t, k});
        const ep::NormalOptions opt{.num_sms = std::min(rd.num_sms, budget)};
        // An invalid dispatch first (every rank alike): refused before anything launches.
        {
            std::function<void()> bad;
            switch (rd.bad) {
                case EpCallBad::kTooManyTokens:
                    bad = [&] {
                        buf.dispatch(hh, view2(x.get(), DType::kBF16, tmax + 1, hd, hd),
                                     TensorView(idx.get(), DType::kI32, {tmax + 1, k}),
                                     TensorView(wts.get(), DType::kF32, {tmax + 1, k}), s);
                    };
                    break;
                case EpCallBad::kXNotBf16:
                    bad = [&] { buf.dispatch(hh, view2(x.get(), DType::kF16, t, hd, x_ld), iv, wv, s); };
                    break;
                case EpCallBad::kIdxRowsDiffer:
                    bad = [&] { buf.dispatch(hh, xv, TensorView(idx.get(), DType::kI32, {t + 1, k}), wv, s); };
                    break;
                case EpCallBad::kWeightsNotF32:
                    bad = [&] {
                        buf.dispatch(hh, view2(x.get(), DType::kBF16, std::max(t, 1), hd, x_ld),
                                     TensorView(idx.get(), DType::kI32, {std::max(t, 1), k}),
                                     TensorView(wts.get(), DType::kI32, {std::max(t, 1), k}), s);
                    };
                    break;
                case EpCallBad::kSmsOverBudget:
                    bad = [&] { buf.dispatch(hh, xv, iv, wv, s, ep::NormalOptions{.num_sms = budget + 1}); };
                    break;
                case EpCallBad::kXMisaligned:
                    bad = [&] {
                        buf.dispatch(hh, view2(reinterpret_cast<uint8_t*>(x.get()) + 2, DType::kBF16, 1, hd, hd),
                                     TensorView(idx.get(), DType::kI32, {1, k}),
                                     TensorView(wts.get(), DType::kF32, {1, k}), s);
                    };
                    break;
                case EpCallBad::kLegacyStream:
                    bad = [&] { buf.dispatch(hh, xv, iv, wv, nullptr); };
                    break;
                case EpCallBad::kCombineUndispatched:
                    bad = [&] { buf.combine(h[2], h[2].recv_x(), view2(out.get(), DType::kBF16, t, hd, out_ld), s); };
                    break;
                case EpCallBad::kHostX:
                    bad = [&] {
                        std::vector<uint16_t> host(sz(hd));
                        buf.dispatch(hh, view2(host.data(), DType::kBF16, 1, hd, hd),
                                     TensorView(idx.get(), DType::kI32, {1, k}),
                                     TensorView(wts.get(), DType::kF32, {1, k}), s);
                    };
                    break;
                case EpCallBad::kXInRecvArea:
                    bad = [&] {
                        buf.dispatch(hh, view2(hh.recv_x().data, DType::kBF16, 1, hd, hd),
                                     TensorView(idx.get(), DType::kI32, {1, k}),
                                     TensorView(wts.get(), DType::kF32, {1, k}), s);
                    };
                    break;
                default:
                    break;
            }
            if (bad) {
                const std::string why = expect_refused("ep", bad);
                if (!why.empty()) {
                    fails.push_back(tag + "invalid call " + call_bad_name(rd.bad) + ": " + why);
                    *fatal = true;
                    return fails;
                }
            }
        }
        // The dispatch.
        const ref::NormalPlan plan = ref::reference_normal_plan(p, rd.all);
        const ref::Overflow of = ref::find_overflow(plan, g.max_recv_tokens, g.max_recv_rows);
        const bool my_bad = has_reported_id(p, mine);
        WEFT_CUDA_CHECK(cudaMemsetAsync(hh.recv_x().data, 0xEE, sz(g.max_recv_rows * hd) * 2, s));
        buf.dispatch(hh, xv, iv, wv, s, opt);
        w.sync_and_check(s);
        // On one node a receive overflow anywhere is reported by every rank (naming the first overflowing rank) and
        // nothing moves. Across nodes only the overflowing ranks report it (each its own count) and receive nothing;
        // the others' dispatch is exact, and the overflowing ranks' partials in the combine are zero.
        const bool across = w.num_nodes() > 1;
        std::vector<char> over(sz(c.world), 0);
        for (int q = 0; q < c.world; ++q) {
            over[sz(q)] = plan.recv_tokens[sz(q)] > g.max_recv_tokens || plan.recv_rows[sz(q)] > g.max_recv_rows;
        }
        const bool received_nothing = across ? over[sz(me)] != 0 : of.rank >= 0;
        std::optional<ep::StatusCode> want;
        int culprit = of.rank;
        int64_t value = of.value;
        if (across) {
            if (over[sz(me)]) {
                const bool tokens = plan.recv_tokens[sz(me)] > g.max_recv_tokens;
                want = tokens ? ep::StatusCode::kRecvTokensOverflow : ep::StatusCode::kRecvRowsOverflow;
                culprit = me;
                value = tokens ? plan.recv_tokens[sz(me)] : plan.recv_rows[sz(me)];
            }
        } else if (of.rank >= 0) {
            want = of.kind == 1 ? ep::StatusCode::kRecvTokensOverflow : ep::StatusCode::kRecvRowsOverflow;
        }
        std::string why = check_status(buf, my_bad, want, culprit, value, me);
        if (why.empty() && across && over[sz(me)] && !my_bad) {
            const std::string m = buf.status() ? buf.status()->message : std::string();
            if (m.find("this rank received nothing") == std::string::npos) {
                why = "an overflow across nodes is this rank's alone; its report says otherwise: " + m;
            }
        }
        if (why.empty() && !received_nothing) {
            why = check_normal_dispatch(p, plan, x_all, hh, me, t, s, across ? c.world * tmax : 0);
        }
        if (why.empty() && received_nothing) {
            for (int32_t v : download(hh.expert_counts(), sz(p.local_experts()), s)) {
                if (v != 0) why = "an overflowing dispatch left non-zero expert counts";
            }
        }
        if (!why.empty()) fails.push_back(tag + "dispatch: " + why);
        // The combine: y from the plan (in place in recv_x, or a buffer of its own with its row stride).
        const std::vector<std::vector<uint16_t>> y_all = normal_y(p, plan, x_all);
        const std::vector<uint16_t>& y_me = y_all[sz(me)];
        // An overflowing plan holds more rows than the buffers: what it combines is zeros whatever y holds.
        const int64_t y_rows = std::min<int64_t>(static_cast<int64_t>(y_me.size()) / hd, g.max_recv_rows);
        TensorView yv;
        if (rd.in_place) {
            WEFT_CUDA_CHECK(cudaMemsetAsync(hh.recv_x().data, 0xFF, sz(g.max_recv_rows * hd) * 2, s));
            upload_rows(static_cast<uint16_t*>(hh.recv_x().data), y_me, y_rows, hd, hd, s);
            yv = hh.recv_x();
        } else {
            WEFT_CUDA_CHECK(cudaMemsetAsync(y.get(), 0xFF, y.size() * 2, s));
            upload_rows(y.get(), y_me, y_rows, hd, y_ld, s);
            yv = view2(y.get(), DType::kBF16, g.max_recv_rows + rd.y_extra_rows, hd, y_ld);
        }
        const TensorView ov = view2(out.get(), DType::kBF16, t, hd, out_ld);
        if (rd.bad == EpCallBad::kCombineYShort || rd.bad == EpCallBad::kCombineOutRows) {
            const std::string bad_why = expect_refused("ep", [&] {
                if (rd.bad == EpCallBad::kCombineYShort) {
                    buf.combine(hh, view2(y.get(), DType::kBF16, g.max_recv_rows - 1, hd, y_ld), ov, s);
                } else {
                    buf.combine(hh, yv, view2(out.get(), DType::kBF16, t + 1, hd, out_ld), s);
                }
            });
            if (!bad_why.empty()) {
                fails.push_back(tag + "invalid call " + call_bad_name(rd.bad) + ": " + bad_why);
                *fatal = true;
                return fails;
            }
        }
        out.poison(0xFF);
        buf.combine(hh, yv, ov, s, opt);
        w.sync_and_check(s);
        const std::vector<uint16_t> got = download(out.get(), out.size(), s);
        std::vector<uint16_t> want_out(sz(t) * sz(hd), 0);
        const bool all_zero = !across && of.rank >= 0;
        if (!all_zero) {
            const std::vector<uint16_t> zeros(sz(hd), 0);
            want_out = ref::reference_normal_combine(p, plan, rd.all, me, [&](int r, int32_t row) {
                return over[sz(r)] ? zeros.data() : &y_all[sz(r)][sz(row) * sz(hd)];
            });
        }
        why = compare_out(got, want_out, t, hd, out_ld, [&](int64_t tok, int64_t) {
            if (all_zero) return std::string(" (an overflowed dispatch combines to zeros)");
            return " (token " + std::to_string(tok) +
                   (of.rank >= 0 ? "; the overflowing ranks' partials are zero)" : ")");
        });
        if (!why.empty()) fails.push_back(tag + "combine: " + why);
        if (buf.status()) buf.clear_status();
        if (any_rank_failed(w, !fails.empty())) return fails;  // every rank ends the case together
    }
    return fails;
}

// ---- GpuFuzz.EpLowLatency ------------------------------------------------------------------------------------------

/// One low-latency round's device inputs and outputs on this rank.
struct LlSlot {
    DeviceArray<uint16_t> x, y, out;
    DeviceArray<int32_t> idx;
    DeviceArray<float> wts;
    LlSlot(const ep::Config& c, int world, cudaStream_t s)
        : x(sz((c.max_tokens_per_rank + 1) * int64_t{c.hidden + kEpPad}), s),
          y(sz(int64_t{c.num_experts / world} * world * c.max_tokens_per_rank * (c.hidden + kEpPad)), s),
          out(sz((c.max_tokens_per_rank + 1) * int64_t{c.hidden + kEpPad}) + kGuard / 2, s),
          idx(sz((c.max_tokens_per_rank + 1) * c.topk), s),
          wts(sz((c.max_tokens_per_rank + 1) * c.topk), s) {}
};

/// This rank's low-latency dispatch results against the host: "" or the first difference.
inline std::string check_ll_dispatch(const ref::Params& p, const ref::LowLatencyCall& call,
                                     const ep::LowLatencyHandle& h, bool fp8, int me, int max_tokens, cudaStream_t s) {
    const ep::LowLatencyHandleView& v = h.view();
    const size_t el = sz(p.local_experts()), rpe = sz(p.num_ranks) * sz(max_tokens), hsz = sz(p.hidden);
    const size_t row_bytes = fp8 ? hsz : 2 * hsz, groups = hsz / 128;
    const std::vector<int32_t> counts = download(v.expert_counts, el, s);
    const std::vector<int32_t> src = download(v.recv_src_info, el * rpe, s);
    const std::vector<int32_t> slot = download(v.recv_src_slot, el * rpe, s);
    std::vector<uint8_t> codes(hsz);
    std::vector<float> want_scales(groups);
    for (size_t le = 0; le < el; ++le) {
        const auto& list = call.rows[sz(me)][le];
        if (counts[le] != static_cast<int32_t>(list.size())) {
            return "expert " + std::to_string(le) + " count " + std::to_string(counts[le]) + ", expected " +
                   std::to_string(list.size());
        }
        if (list.empty()) continue;
        const std::vector<uint8_t> data = download(v.recv_x + le * rpe * row_bytes, list.size() * row_bytes, s);
        const std::vector<float> scales =
            fp8 ? download(v.recv_scales + le * rpe * groups, list.size() * groups, s) : std::vector<float>();
        for (size_t i = 0; i < list.size(); ++i) {
            const size_t row = le * rpe + i;
            const ref::RowSource rs = list[i];
            const std::string at = "expert " + std::to_string(le) + " row " + std::to_string(i);
            if (src[row] != rs.src * max_tokens + rs.token || slot[row] != rs.slot) {
                return at + " source " + std::to_string(src[row]) + " slot " + std::to_string(slot[row]) +
                       ", expected rank " + std::to_string(rs.src) + " token " + std::to_string(rs.token) + " slot " +
                       std::to_string(rs.slot);
            }
            const uint16_t* x = &call.x_all[sz(rs.src)][sz(rs.token) * hsz];
            if (!fp8) {
                const auto* got = reinterpret_cast<const uint16_t*>(&data[i * row_bytes]);
                if (!std::equal(x, x + hsz, got)) {
                    return at + ": expected rank " + std::to_string(rs.src) + " token " + std::to_string(rs.token) +
                           ", found " + ref::describe_row(got);
                }
                continue;
            }
            ref::reference_quantize_row(x, p.hidden, codes.data(), want_scales.data());
            for (size_t gi = 0; gi < groups; ++gi) {
                const float sc = scales[i * groups + gi];
                if (!(sc == want_scales[gi])) {
                    return at + " scale " + std::to_string(gi) + " = " + std::to_string(sc) + ", the host quantiser " +
                           std::to_string(want_scales[gi]);
                }
            }
            for (size_t ch = 0; ch < hsz; ++ch) {
                if (ref::e4m3_to_f32(data[i * row_bytes + ch]) != ref::e4m3_to_f32(codes[ch])) {
                    return at + " channel " + std::to_string(ch) + ": code " +
                           std::to_string(data[i * row_bytes + ch]) + ", the host quantiser " +
                           std::to_string(codes[ch]);
                }
            }
        }
    }
    return "";
}

/// Rank r's y: expert_output of the payload for each received row, NaN past the counts; [E_local, rpe, H] packed.
inline std::vector<uint16_t> ll_y(const ref::Params& p, const ref::LowLatencyCall& call, int r, int max_tokens) {
    const size_t rpe = sz(p.num_ranks) * sz(max_tokens), hsz = sz(p.hidden);
    std::vector<uint16_t> y(sz(p.local_experts()) * rpe * hsz, 0x7fc1);
    for (int le = 0; le < p.local_experts(); ++le) {
        const auto& list = call.rows[sz(r)][sz(le)];
        for (size_t i = 0; i < list.size(); ++i) {
            const uint16_t* x = &call.x_all[sz(list[i].src)][sz(list[i].token) * hsz];
            for (size_t ch = 0; ch < hsz; ++ch) {
                y[(sz(le) * rpe + i) * hsz + ch] = ref::expert_output(x[ch], r * p.local_experts() + le);
            }
        }
    }
    return y;
}

/// The low-latency combine of rank me, emulated: fp32 fma over the valid slots in slot order, one bf16 rounding.
inline std::vector<uint16_t> ll_combine_reference(const ref::Params& p, const ref::LowLatencyCall& call, int me) {
    const ref::Routing& r = call.all[sz(me)];
    const size_t hsz = sz(p.hidden);
    std::vector<uint16_t> out(sz(r.num_tokens) * hsz);
    std::vector<float> acc(hsz);
    for (int t = 0; t < r.num_tokens; ++t) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int j = 0; j < p.topk; ++j) {
            const int e = ref::valid_expert(p, r, t, j);
            if (e < 0) continue;
            const float wgt = r.topk_weights[sz(t) * sz(p.topk) + sz(j)];
            const uint16_t* x = &call.x_all[sz(me)][sz(t) * hsz];
            for (size_t ch = 0; ch < hsz; ++ch) {
                acc[ch] = std::fma(wgt, ref::bf16_to_f32(ref::expert_output(x[ch], e)), acc[ch]);
            }
        }
        for (size_t ch = 0; ch < hsz; ++ch) out[sz(t) * hsz + ch] = ref::f32_to_bf16(acc[ch]);
    }
    return out;
}

/// Rank `me`'s part of a low-latency case.
inline std::vector<std::string> run_ep_low_latency(World& w, const EpCase& c, cudaStream_t s, bool* fatal) {
    std::vector<std::string> fails;
    const int me = w.rank();
    const ep::Config cfg = cfg_for(c, me);
    if (c.cfg_bad != EpCfgBad::kNone) return check_config_refused(w, c, cfg, fatal);
    ep::Buffer buf(w, cfg);
    std::vector<ep::LowLatencyHandle> h;
    for (int i = 0; i < 4; ++i) h.push_back(buf.make_low_latency_handle());  // handle 3 is never dispatched
    const ref::Params p = params_of(cfg, c.world);
    const int64_t hd = cfg.hidden, k = cfg.topk, tmax = cfg.max_tokens_per_rank, el = cfg.num_experts / c.world;
    const int64_t rpe = int64_t{c.world} * tmax;
    LlSlot slots[2] = {LlSlot(cfg, c.world, s), LlSlot(cfg, c.world, s)};
    const int budget = w.sm_budget();
    for (size_t ri = 0; ri < c.rounds.size();) {
        const size_t n = c.rounds[ri].pair_with_next && ri + 1 < c.rounds.size() ? 2 : 1;
        struct Live {
            const EpRound* rd = nullptr;
            ref::LowLatencyCall call;
            bool fp8 = false;
            int t = 0;
            int64_t x_ld = 0, y_ld = 0, out_ld = 0;
            TensorView xv, iv, wv, yv, ov;
            ep::LowLatencyOptions opt;
            std::string tag;
        };
        std::vector<Live> live;
        for (size_t j = 0; j < n; ++j) {
            const EpRound& rd = c.rounds[ri + j];
            LlSlot& sl = slots[j];
            Live lv;
            lv.rd = &rd;
            lv.call = ref::low_latency_call(p, rd.all, rd.x_seed, rd.fp8);
            lv.tag = "round " + std::to_string(ri + j) + ": ";
            lv.fp8 = rd.mismatch && me % 2 == 1 ? !rd.fp8 : rd.fp8;
            lv.t = lv.call.all[sz(me)].num_tokens;
            lv.x_ld = hd + rd.x_pad;
            lv.y_ld = hd + rd.y_pad;
            lv.out_ld = hd + rd.out_pad;
            upload_rows(sl.x.get(), lv.call.x_all[sz(me)], lv.t, hd, lv.x_ld, s);
            sl.idx.upload(lv.call.all[sz(me)].topk_idx);
            sl.wts.upload(lv.call.all[sz(me)].topk_weights);
            lv.xv = view2(sl.x.get(), DType::kBF16, lv.t, hd, lv.x_ld);
            lv.iv = TensorView(sl.idx.get(), DType::kI32, {lv.t, k});
            lv.wv = TensorView(sl.wts.get(), DType::kF32, {lv.t, k});
            lv.ov = view2(sl.out.get(), DType::kBF16, lv.t, hd, lv.out_ld);
            lv.opt = ep::LowLatencyOptions{.fp8 = lv.fp8, .num_sms = std::min(rd.num_sms, budget)};
            live.push_back(std::move(lv));
        }
        // An invalid call first (every rank alike; never in paired rounds).
        const EpRound& r0 = *live[0].rd;
        if (r0.bad != EpCallBad::kNone && r0.bad != EpCallBad::kCombineYShort && r0.bad != EpCallBad::kCombineOutRows) {
            Live& lv = live[0];
            LlSlot& sl = slots[0];
            const ep::LowLatencyOptions send{.fp8 = lv.fp8, .phase = ep::Phase::kSend};
            const ep::LowLatencyOptions recv{.fp8 = lv.fp8, .phase = ep::Phase::kRecv};
            std::function<void()> bad;
            std::function<void()> after;  // completes what the invalid call's set-up began
            switch (r0.bad) {
                case EpCallBad::kTooManyTokens:
                    bad = [&] {
                        buf.low_latency_dispatch(h[0], view2(sl.x.get(), DType::kBF16, tmax + 1, hd, hd),
                                                 TensorView(sl.idx.get(), DType::kI32, {tmax + 1, k}), s, lv.opt);
                    };
                    break;
                case EpCallBad::kXNotBf16:
                case EpCallBad::kWeightsNotF32:
                    bad = [&] {
                        buf.low_latency_dispatch(h[0], view2(sl.x.get(), DType::kF16, lv.t, hd, lv.x_ld), lv.iv, s,
                                                 lv.opt);
                    };
                    break;
                case EpCallBad::kIdxRowsDiffer:
                    bad = [&] {
                        buf.low_latency_dispatch(h[0], lv.xv, TensorView(sl.idx.get(), DType::kI32, {lv.t + 1, k}), s,
                                                 lv.opt);
                    };
                    break;
                case EpCallBad::kSmsOverBudget:
                    bad = [&] {
                        buf.low_latency_dispatch(h[0], lv.xv, lv.iv, s,
                                                 ep::LowLatencyOptions{.fp8 = lv.fp8, .num_sms = budget + 1});
                    };
                    break;
                case EpCallBad::kXMisaligned:
                    bad = [&] {
                        buf.low_latency_dispatch(
                            h[0], view2(reinterpret_cast<uint8_t*>(sl.x.get()) + 2, DType::kBF16, 1, hd, hd),
                            TensorView(sl.idx.get(), DType::kI32, {1, k}), s, lv.opt);
                    };
                    break;
                case EpCallBad::kLegacyStream:
                    bad = [&] { buf.low_latency_dispatch(h[0], lv.xv, lv.iv, nullptr, lv.opt); };
                    break;
                case EpCallBad::kCombineUndispatched:
                    bad = [&] { buf.low_latency_combine(h[3], h[0].recv_x(), lv.iv, lv.wv, lv.ov, s); };
                    break;
                case EpCallBad::kHostX:
                case EpCallBad::kXInRecvArea:
                    bad = [&] {
                        std::vector<uint16_t> host(sz(hd));
                        buf.low_latency_dispatch(h[0], view2(host.data(), DType::kBF16, 1, hd, hd),
                                                 TensorView(sl.idx.get(), DType::kI32, {1, k}), s, lv.opt);
                    };
                    break;
                case EpCallBad::kFp8Hidden:
                    bad = [&] { buf.low_latency_dispatch(h[0], lv.xv, lv.iv, s, ep::LowLatencyOptions{.fp8 = true}); };
                    break;
                case EpCallBad::kRecvNothing:
                    bad = [&] { buf.low_latency_dispatch(h[0], TensorView(), TensorView(), s, recv); };
                    break;
                case EpCallBad::kThirdSend:
                    buf.low_latency_dispatch(h[0], lv.xv, lv.iv, s, send);
                    buf.low_latency_dispatch(h[1], lv.xv, lv.iv, s, send);
                    bad = [&] { buf.low_latency_dispatch(h[2], lv.xv, lv.iv, s, send); };
                    after = [&] {
                        buf.low_latency_dispatch(h[0], TensorView(), TensorView(), s, recv);
                        buf.low_latency_dispatch(h[1], TensorView(), TensorView(), s, recv);
                    };
                    break;
                case EpCallBad::kRecvOutOfOrder:
                    buf.low_latency_dispatch(h[0], lv.xv, lv.iv, s, send);
                    buf.low_latency_dispatch(h[1], lv.xv, lv.iv, s, send);
                    bad = [&] { buf.low_latency_dispatch(h[1], TensorView(), TensorView(), s, recv); };
                    after = [&] {
                        buf.low_latency_dispatch(h[0], TensorView(), TensorView(), s, recv);
                        buf.low_latency_dispatch(h[1], TensorView(), TensorView(), s, recv);
                    };
                    break;
                default:
                    break;
            }
            if (bad) {
                const std::string why = expect_refused("ep", bad);
                if (!why.empty()) {
                    fails.push_back(lv.tag + "invalid call " + call_bad_name(r0.bad) + ": " + why);
                    *fatal = true;
                    return fails;
                }
            }
            if (after) {
                after();
                w.sync_and_check(s);
                if (buf.status()) buf.clear_status();  // the extra dispatches' reports: checked below, alike
            }
        }
        // The dispatches: whole, or split halves (paired rounds: send A, send B, receive A, receive B).
        for (size_t j = 0; j < n; ++j) {  // the masked outputs poisoned (this rank's receive half writes them)
            WEFT_CUDA_CHECK(cudaMemsetAsync(h[j].view().recv_x, 0xEE, sz(el * rpe * hd) * 2, s));
        }
        const auto send_opt = [](const Live& lv, ep::Phase ph) {
            ep::LowLatencyOptions o = lv.opt;
            o.phase = ph;
            return o;
        };
        if (n == 2) {
            for (size_t j = 0; j < 2; ++j)
                buf.low_latency_dispatch(h[j], live[j].xv, live[j].iv, s, send_opt(live[j], ep::Phase::kSend));
            for (size_t j = 0; j < 2; ++j)
                buf.low_latency_dispatch(h[j], TensorView(), TensorView(), s, send_opt(live[j], ep::Phase::kRecv));
        } else if (live[0].rd->split) {
            buf.low_latency_dispatch(h[0], live[0].xv, live[0].iv, s, send_opt(live[0], ep::Phase::kSend));
            buf.low_latency_dispatch(h[0], TensorView(), TensorView(), s, send_opt(live[0], ep::Phase::kRecv));
        } else {
            buf.low_latency_dispatch(h[0], live[0].xv, live[0].iv, s, live[0].opt);
        }
        w.sync_and_check(s);
        // Status: the first report of these dispatches (a mismatch on every rank; a bad id on its rank).
        bool any_bad_ids = false;
        for (const Live& lv : live) any_bad_ids = any_bad_ids || has_reported_id(p, lv.call.all[sz(me)]);
        const bool mismatch = live[0].rd->mismatch;
        {
            std::string why;
            if (mismatch) {
                why = check_status(buf, false, ep::StatusCode::kCallMismatch, -1, 0, me);
            } else {
                why = check_status(buf, any_bad_ids, std::nullopt, -1, 0, me);
            }
            if (!why.empty()) fails.push_back(live[0].tag + "dispatch: " + why);
        }
        for (size_t j = 0; j < n; ++j) {
            Live& lv = live[j];
            std::string why;
            if (mismatch) {
                for (int32_t v : download(h[j].expert_counts(), sz(el), s)) {
                    if (v != 0) why = "a mismatched dispatch received rows (counts not 0)";
                }
            } else {
                why = check_ll_dispatch(p, lv.call, h[j], lv.fp8, me, static_cast<int>(tmax), s);
            }
            if (!why.empty()) fails.push_back(lv.tag + "dispatch" + (lv.fp8 ? " fp8: " : " bf16: ") + why);
            // y: in place in recv_x (bf16), or a buffer of its own with its row stride.
            const std::vector<uint16_t> y_me = ll_y(p, lv.call, me, static_cast<int>(tmax));
            if (lv.rd->in_place && !lv.fp8) {
                WEFT_CUDA_CHECK(
                    cudaMemcpyAsync(h[j].recv_x().data, y_me.data(), y_me.size() * 2, cudaMemcpyHostToDevice, s));
                WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
                lv.yv = h[j].recv_x();
            } else {
                LlSlot& sl = slots[j];
                upload_rows(sl.y.get(), y_me, el * rpe, hd, lv.y_ld, s);
                lv.yv = TensorView(sl.y.get(), DType::kBF16, {el, rpe, hd}, {rpe * lv.y_ld, lv.y_ld, 1});
            }
            slots[j].out.poison(0xFF);
        }
        if (r0.bad == EpCallBad::kCombineYShort || r0.bad == EpCallBad::kCombineOutRows) {
            Live& lv = live[0];
            const std::string why = expect_refused("ep", [&] {
                if (r0.bad == EpCallBad::kCombineYShort) {
                    buf.low_latency_combine(h[0], TensorView(slots[0].y.get(), DType::kBF16, {el, rpe - 1, hd}), lv.iv,
                                            lv.wv, lv.ov, s);
                } else {
                    buf.low_latency_combine(h[0], lv.yv, lv.iv, lv.wv,
                                            view2(slots[0].out.get(), DType::kBF16, lv.t + 1, hd, lv.out_ld), s);
                }
            });
            if (!why.empty()) {
                fails.push_back(lv.tag + "invalid call " + call_bad_name(r0.bad) + ": " + why);
                *fatal = true;
                return fails;
            }
        }
        if (n == 2) {
            for (size_t j = 0; j < 2; ++j) {
                buf.low_latency_combine(h[j], live[j].yv, live[j].iv, live[j].wv, live[j].ov, s,
                                        send_opt(live[j], ep::Phase::kSend));
            }
            for (size_t j = 0; j < 2; ++j) {
                buf.low_latency_combine(h[j], TensorView(), live[j].iv, live[j].wv, live[j].ov, s,
                                        send_opt(live[j], ep::Phase::kRecv));
            }
        } else if (live[0].rd->split) {
            buf.low_latency_combine(h[0], live[0].yv, live[0].iv, live[0].wv, live[0].ov, s,
                                    send_opt(live[0], ep::Phase::kSend));
            buf.low_latency_combine(h[0], TensorView(), live[0].iv, live[0].wv, live[0].ov, s,
                                    send_opt(live[0], ep::Phase::kRecv));
        } else {
            ep::LowLatencyOptions o = live[0].opt;
            o.fp8 = false;
            buf.low_latency_combine(h[0], live[0].yv, live[0].iv, live[0].wv, live[0].ov, s, o);
        }
        w.sync_and_check(s);
        for (size_t j = 0; j < n; ++j) {
            const Live& lv = live[j];
            const std::vector<uint16_t> got = download(slots[j].out.get(), slots[j].out.size(), s);
            const std::vector<uint16_t> want =
                mismatch ? std::vector<uint16_t>(sz(lv.t) * sz(hd), 0) : ll_combine_reference(p, lv.call, me);
            const std::string why = compare_out(got, want, lv.t, hd, lv.out_ld, [&](int64_t tok, int64_t) {
                return mismatch ? std::string(" (a mismatched dispatch combines to zeros)")
                                : " (token " + std::to_string(tok) + ")";
            });
            if (!why.empty()) fails.push_back(lv.tag + "combine: " + why);
        }
        if (buf.status()) buf.clear_status();
        if (any_rank_failed(w, !fails.empty())) return fails;  // every rank ends the case together
        ri += n;
    }
    return fails;
}

}  // namespace weft::fuzz_test
