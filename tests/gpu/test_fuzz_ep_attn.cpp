// SPDX-License-Identifier: MIT
// Seeded random fuzz of the expert-parallel and attention ops (the harness of fuzz_harness.hpp; conventions of
// test_fuzz_ops.cpp): every case draws fresh inputs within what the headers and READMEs allow, poisons what the op
// writes (0xFF: NaN), runs it and compares it with an independent host reference; a fraction of the cases are invalid
// arguments that must throw weft::Error with a message on every rank, never crash or hang.
//
//   GpuFuzz.EpNormal      ops::ep normal dispatch + combine, ranks as threads (worlds 1..8): a case is one Buffer (a
//                         random Config: experts per rank, hidden, top-k, tokens, alignment, receive limits) and 1..6
//                         rounds of changing routings on it (tokens per rank differ, 0 included; dropped, hot, sparse,
//                         one-rank, repeated and out-of-range ids); every layout array, count, offset and received row
//                         checked exactly, the combine bit for bit against ep_reference's emulation; a receive
//                         overflow must be reported by every rank, move nothing and combine to zeros.
//   GpuFuzz.EpLowLatency  ops::ep low-latency dispatch + combine, bf16 and fp8, whole or split halves (two handles
//                         interleaved), a Buffer per case with several rounds; counts, sources, rows (fp8 codes and
//                         scales against the host quantiser) and the combine (exact emulation); ranks whose fp8 flags
//                         differ must be a kCallMismatch on every rank, nothing received, zeros combined.
//   GpuFuzz.Prefill       ops::flash_attention on one GPU: lengths tiny to a few thousand (sampled rows checked in
//                         fp64 when the whole reference would be slow), causal/no mask with q_position, GQA 1..16, head
//                         dims 64/128, bf16/f16, strided q/k/v, default or explicit kernel configs, scales, LSE.
//   GpuFuzz.SpDecode      ops::sp_decode_attention at worlds 1..8: every sequence split into random per-rank shards
//                         (empty ones too), per-rank page sizes, layouts, splits and max_seq_len; fp64 reference over
//                         the whole sequences.
//   GpuFuzz.AgAttention   ops::AgAttention at worlds 1..4 (equal shards, as the README requires), causal/no mask,
//                         several calls of different S on one op; fp64 reference over the whole sequence.
//
// Knobs (environment, as every GpuFuzz test): WEFT_FUZZ_SEED, WEFT_FUZZ_SECONDS (per test, default 15),
// WEFT_FUZZ_CASES, WEFT_FUZZ_KERNELS, WEFT_FUZZ_CASE=i.a (one-GPU tests: draw a of case i; multi-rank tests: case i in
// a world of a ranks). A failure prints one line with the seed, the case, every parameter and the replay command.
//
// What picks a JIT kernel (each new one compiles on first use, seconds on a cold cache): EP, nothing (one fixed set of
// kernels for every Config and world); prefill, the AttentionPrefillConfig (dtype, head_dim, block_m, stages, kernel:
// the default one follows seq_q and the q-heads at head_dim 64); sp_decode, the dtype and head_dim; AgAttention, its
// config (dtype, head_dim and the kernel; the default block_m follows max_seq / W and the q-heads at head_dim 64). A
// test admits a draw with a kernel it has not run yet only while it has run fewer than WEFT_FUZZ_KERNELS of them and
// is in the first half of its time; otherwise it draws again.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_harness.hpp"
#include "support/ep_reference.hpp"
#include "support/ep_testing.hpp"
#include "support/gemm_testing.hpp"
#include "support/jit_testing.hpp"
#include "support/runtime_checks.hpp"
#include "support/tp_reference.hpp"
#include "weft/ops/ag_attention.hpp"
#include "weft/ops/attention.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/ep.hpp"
#include "weft/runtime/error.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

using namespace fuzz_test;
namespace ep = ops::ep;
namespace ref = test::ep;
using ref::DeviceArray;
using ref::download;

// ---- ranks as threads: worlds drawn one after another, the same cases on every rank --------------------------------

/// One rank's part of case `idx`: returns this rank's failures ("what" each); sets *fatal when the World may be
/// unusable (an unexpected throw: the ranks may no longer make the same calls).
using RankCaseFn = std::function<std::vector<std::string>(World&, int64_t idx, cudaStream_t, bool* fatal)>;

/// Worlds of `min_world`..`max_world` ranks (the first from `first`), each for a slice of the time; rank 0 decides
/// before each case whether there is time for it (a flag the others read after a barrier), so every rank makes the same
/// calls. A case is named i.W: case i in a world of W ranks (WEFT_FUZZ_CASE=i.W replays it). `describe(idx, W)` gives
/// a failing case's parameters.
int64_t fuzz_worlds(FuzzRun& run, int min_world, int max_world, std::initializer_list<int> first,
                    const std::function<WorldOptions(int)>& options,
                    const std::function<std::string(int64_t, int)>& describe_case, const RankCaseFn& one_case,
                    const std::function<void(World&)>& setup = nullptr) {
    int64_t cases = 0;
    std::vector<std::string> failures;
    for (int64_t w_idx = 0; run.more(cases) && failures.empty(); ++w_idx) {
        Rng wr = run.rng(-1 - w_idx, 0);
        const int world = run.replaying()
                              ? run.first_attempt()
                              : static_cast<int>(w_idx == 0 ? wr.pick(first) : wr.uniform(min_world, max_world));
        if (world < min_world || world > max_world) {
            ADD_FAILURE() << "WEFT_FUZZ_CASE=i.W replays case i in a world of W = " << min_world << ".." << max_world
                          << " ranks, got W = " << world;
            break;
        }
        const double slice_end = world_slice_end(run);
        constexpr int kMaxCasesPerWorld = 400;
        std::vector<char> go(kMaxCasesPerWorld + 1, 0);
        std::vector<std::vector<std::string>> rank_failures(sz(world));
        std::atomic<bool> broken{false};
        const int64_t first_case = cases;
        announce_world(world);
        test::run_ranks(
            world,
            [&](World& w) {
                const int me = w.rank();
                auto& fails = rank_failures[sz(me)];
                cudaStream_t stream = nullptr;
                WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
                if (setup) setup(w);
                w.barrier();
                for (int i = 0; i < kMaxCasesPerWorld; ++i) {
                    if (me == 0) {
                        go[sz(i)] =
                            (run.replaying() ? i == 0 : run.elapsed() < slice_end && run.more(first_case + i)) &&
                            !broken.load();
                    }
                    w.barrier();
                    if (!go[sz(i)]) break;
                    const int64_t idx = run.case_index(first_case + i);
                    bool fatal = false;
                    std::vector<std::string> what;
                    try {
                        what = one_case(w, idx, stream, &fatal);
                    } catch (const std::exception& e) {
                        what.push_back(std::string("unexpected exception: ") + e.what());
                        fatal = true;
                    }
                    for (const std::string& m : what) {
                        fails.push_back("[ FUZZ FAIL ] " + describe_case(idx, world) + " :: rank " +
                                        std::to_string(me) + ": " + m + " :: " + run.repro(idx, world));
                    }
                    if (!what.empty()) broken = true;  // one failing case per world: its line replays it
                    if (fatal) break;                  // the World may be unusable: no more collective calls
                    w.barrier();
                    if (me == 0) ++cases;
                }
                cudaStreamSynchronize(stream);
                cudaStreamDestroy(stream);
            },
            options(world));
        for (const auto& f : rank_failures) failures.insert(failures.end(), f.begin(), f.end());
        if (run.replaying()) break;
    }
    for (const std::string& f : failures) ADD_FAILURE() << f;
    return cases;
}

// ---- EP: configs, routings, rounds ---------------------------------------------------------------------------------

constexpr uint64_t kEpHeapCap = 128ull << 20;  // symmetric heap a case's Buffer and handles may take per rank
constexpr int64_t kEpPad = 64;                 // most extra elements per row of x, y and out
constexpr size_t kGuard = 256;                 // poisoned bytes after an output that nothing may write

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
const char* cfg_bad_name(EpCfgBad b) {
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
const char* call_bad_name(EpCallBad b) {
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

std::string describe_config(const ep::Config& c) {
    std::ostringstream os;
    os << "E=" << c.num_experts << " H=" << c.hidden << " k=" << c.topk << " T=" << c.max_tokens_per_rank
       << " align=" << c.expert_alignment << " max_recv_tokens=" << c.max_recv_tokens
       << " max_recv_rows=" << c.max_recv_rows;
    return os.str();
}

std::string describe(const EpCase& c) {
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

ref::Params params_of(const ep::Config& c, int world) {
    ref::Params p;
    p.num_ranks = world;
    p.num_experts = c.num_experts;
    p.topk = c.topk;
    p.hidden = c.hidden;
    p.expert_alignment = c.expert_alignment;
    return p;
}

/// Whether `routing` holds an id the kernels report (a repeat or one outside [-1, E)).
bool has_reported_id(const ref::Params& p, const ref::Routing& r) {
    for (int t = 0; t < r.num_tokens; ++t) {
        for (int j = 0; j < p.topk; ++j) {
            if (r.expert(t, j, p.topk) != -1 && ref::valid_expert(p, r, t, j) < 0) return true;
        }
    }
    return false;
}

/// One round's routings: the same pattern on every rank, tokens per rank drawn apart (0 included).
void draw_routings(Rng& r, const ep::Config& cfg, int world, EpRound& round, bool allow_bad_ids) {
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

ep::Config draw_ep_config(Rng& r, int world, bool low_latency) {
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

EpCase draw_ep_case(Rng& r, int world, bool low_latency) {
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
ep::Config cfg_for(const EpCase& c, int me) {
    ep::Config x = c.cfg;
    if (c.cfg_bad == EpCfgBad::kConfigsDiffer && me == 0) x.max_recv_tokens = int64_t{c.world} * 1000 + 7;
    return x;
}

/// The status this rank must report after a dispatch: "" if right, else what is wrong.
std::string check_status(const ep::Buffer& buf, bool my_bad_ids, std::optional<ep::StatusCode> want, int culprit,
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

/// An invalid-config case: making a Buffer of `cfg` must throw weft::Error naming ep; returns the failure
/// if not, setting *fatal (a Buffer made on some ranks only: the ranks' calls may no longer agree).
std::vector<std::string> check_config_refused(World& w, const EpCase& c, const ep::Config& cfg, bool* fatal) {
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
void upload_rows(T* dst, const std::vector<T>& src, int64_t rows, int64_t cols, int64_t ld, cudaStream_t s) {
    if (rows == 0) return;
    WEFT_CUDA_CHECK(cudaMemcpy2DAsync(dst, sz(ld) * sizeof(T), src.data(), sz(cols) * sizeof(T), sz(cols) * sizeof(T),
                                      sz(rows), cudaMemcpyHostToDevice, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
}

/// Compares an output downloaded as [rows, ld] (plus kGuard poisoned bytes) with `want` [rows, cols]; the row padding
/// and the guard must keep their poison.
std::string compare_out(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, int64_t rows, int64_t cols,
                        int64_t ld, const std::function<std::string(int64_t, int64_t)>& where) {
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
std::string check_normal_dispatch(const ref::Params& p, const ref::NormalPlan& plan,
                                  const std::vector<std::vector<uint16_t>>& x_all, const ep::NormalHandle& h, int me,
                                  int t, cudaStream_t s) {
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
    if (download(v.source_offsets, w + 1, s) != plan.source_offsets[sz(me)]) return "source_offsets differ";
    const std::vector<int32_t> info = download(v.info, sz(ep::kInfoInts), s);
    if (info[ep::kInfoValid] != 1 || info[ep::kInfoNumTokens] != t ||
        info[ep::kInfoRecvTokens] != plan.recv_tokens[sz(me)] || info[ep::kInfoRecvRows] != plan.recv_rows[sz(me)]) {
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
std::vector<std::vector<uint16_t>> normal_y(const ref::Params& p, const ref::NormalPlan& plan,
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
std::vector<std::string> run_ep_normal(World& w, const EpCase& c, cudaStream_t s, bool* fatal) {
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
        std::optional<ep::StatusCode> want;
        if (of.rank >= 0) want = of.kind == 1 ? ep::StatusCode::kRecvTokensOverflow : ep::StatusCode::kRecvRowsOverflow;
        std::string why = check_status(buf, my_bad, want, of.rank, of.value, me);
        if (why.empty() && of.rank < 0) why = check_normal_dispatch(p, plan, x_all, hh, me, t, s);
        if (why.empty() && of.rank >= 0) {
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
        if (of.rank < 0) {
            want_out = ref::reference_normal_combine(
                p, plan, rd.all, me, [&](int r, int32_t row) { return &y_all[sz(r)][sz(row) * sz(hd)]; });
        }
        why = compare_out(got, want_out, t, hd, out_ld, [&](int64_t tok, int64_t) {
            return of.rank >= 0 ? std::string(" (an overflowed dispatch combines to zeros)")
                                : " (token " + std::to_string(tok) + ")";
        });
        if (!why.empty()) fails.push_back(tag + "combine: " + why);
        if (buf.status()) buf.clear_status();
        if (!fails.empty()) return fails;
    }
    return fails;
}

/// Runs EP suite `name`: worlds of 1..8 ranks whose cases draw_ep_case draws (`low_latency`: the low-latency mode's
/// configs) and `run_case` runs on every rank; an invalid config or call counts as an invalid-argument case.
void fuzz_ep(const char* name, bool low_latency,
             std::vector<std::string> (*run_case)(World&, const EpCase&, cudaStream_t, bool*)) {
    FuzzRun run(name, 15, 100000, 1);
    run.admit("ep kernels");  // one fixed kernel set
    int64_t invalid = 0;
    std::mutex mutex;
    const auto options = [](int) {
        WorldOptions o = test::test_options(kEpHeapCap + (32ull << 20));
        o.timeout = std::chrono::milliseconds(20000);
        return o;
    };
    const int64_t cases = fuzz_worlds(
        run, 1, 8, {3, 5, 6, 7}, options,
        [&](int64_t idx, int world) {
            Rng r = run.rng(idx, 0);
            return describe(draw_ep_case(r, world, low_latency));
        },
        [&](World& w, int64_t idx, cudaStream_t s, bool* fatal) {
            Rng r = run.rng(idx, 0);
            const EpCase c = draw_ep_case(r, w.num_ranks(), low_latency);
            if (w.rank() == 0) {
                std::lock_guard<std::mutex> lock(mutex);
                invalid += c.cfg_bad != EpCfgBad::kNone ||
                           std::any_of(c.rounds.begin(), c.rounds.end(),
                                       [](const EpRound& x) { return x.bad != EpCallBad::kNone; });
            }
            return run_case(w, c, s, fatal);
        });
    run.summary(cases, invalid, 0);
}

TEST_F(GpuFuzz, EpNormal) { fuzz_ep("EpNormal", false, run_ep_normal); }

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
std::string check_ll_dispatch(const ref::Params& p, const ref::LowLatencyCall& call, const ep::LowLatencyHandle& h,
                              bool fp8, int me, int max_tokens, cudaStream_t s) {
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
std::vector<uint16_t> ll_y(const ref::Params& p, const ref::LowLatencyCall& call, int r, int max_tokens) {
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
std::vector<uint16_t> ll_combine_reference(const ref::Params& p, const ref::LowLatencyCall& call, int me) {
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
std::vector<std::string> run_ep_low_latency(World& w, const EpCase& c, cudaStream_t s, bool* fatal) {
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
            const std::string why =
                expect_refused("ep", [&] {
                    if (r0.bad == EpCallBad::kCombineYShort) {
                        buf.low_latency_combine(h[0], TensorView(slots[0].y.get(), DType::kBF16, {el, rpe - 1, hd}),
                                                lv.iv, lv.wv, lv.ov, s);
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
        if (!fails.empty()) return fails;
        ri += n;
    }
    return fails;
}

TEST_F(GpuFuzz, EpLowLatency) { fuzz_ep("EpLowLatency", true, run_ep_low_latency); }

// ---- attention: shared pieces ------------------------------------------------------------------------------------

/// Host reference work per case (multiply-adds): the fp64 loops stay well under 50 ms.
constexpr int64_t kRefBudget = int64_t{12} << 20;

uint16_t nan16(DType t) { return t == DType::kBF16 ? 0x7fc0 : 0x7e00; }

/// fp64 softmax attention of one query (dim floats) over `keys` keys at kv + j * kv_stride (K and V rows alike):
/// writes o[dim], returns the LSE (-inf without keys).
double attend(const float* q, const float* k, const float* v, int64_t keys, int64_t kv_stride, int64_t dim,
              double scale, std::vector<double>& s, std::vector<double>& o) {
    o.assign(sz(dim), 0.0);
    if (keys == 0) return -INFINITY;
    s.resize(sz(keys));
    double m = -INFINITY;
    for (int64_t j = 0; j < keys; ++j) {
        const float* kr = k + j * kv_stride;
        double dot = 0;
        for (int64_t e = 0; e < dim; ++e) dot += static_cast<double>(q[e]) * kr[e];
        s[sz(j)] = dot * scale;
        m = std::max(m, s[sz(j)]);
    }
    double l = 0;
    for (int64_t j = 0; j < keys; ++j) {
        const double p = std::exp(s[sz(j)] - m);
        l += p;
        const float* vr = v + j * kv_stride;
        for (int64_t e = 0; e < dim; ++e) o[sz(e)] += p * vr[e];
    }
    for (double& x : o) x /= l;
    return m + std::log(l);
}

/// Checks one row of out (dim values) and its LSE against the reference: "" or what differs.
std::string check_attention_row(const uint16_t* got, DType dtype, const std::vector<double>& want, double want_lse,
                                const float* lse, int64_t dim, const std::string& where) {
    const bool empty = std::isinf(want_lse);
    if (lse != nullptr) {
        const double g = *lse;
        if (empty ? !(std::isinf(g) && g < 0) : !(std::fabs(g - want_lse) <= 2e-3 + 1e-5 * std::fabs(want_lse))) {
            std::ostringstream os;
            os << "lse " << where << " = " << g << ", want " << want_lse;
            return os.str();
        }
    }
    for (int64_t e = 0; e < dim; ++e) {
        const double g = tp_test::bits_to_float(dtype, got[e]);
        const double w = empty ? 0.0 : want[sz(e)];
        if (empty ? g != 0.0 : !(std::fabs(g - w) <= 6e-3 + 1.6e-2 * std::fabs(w))) {
            std::ostringstream os;
            os << "out " << where << " dim " << e << " = " << g << ", want " << w;
            return os.str();
        }
    }
    return "";
}

std::string config_key(const AttentionPrefillConfig& c) {
    std::ostringstream os;
    os << (c.kernel == AttentionPrefillKernel::kWgmma ? "wgmma " : "mma ") << dtype_name(c.dtype) << " dim "
       << c.head_dim << " block_m " << c.block_m << " stages " << c.stages;
    return os.str();
}

/// Query rows to check against fp64: all when `row_cost` summed stays within the budget, else the rows at tile
/// boundaries, the first and last, and random ones until the budget is spent.
std::vector<int64_t> rows_to_check(Rng& r, int64_t rows, const std::function<int64_t(int64_t)>& row_cost) {
    std::vector<int64_t> all;
    int64_t total = 0;
    for (int64_t i = 0; i < rows && total <= kRefBudget; ++i) total += row_cost(i) + 1;
    if (total <= kRefBudget) {
        for (int64_t i = 0; i < rows; ++i) all.push_back(i);
        return all;
    }
    std::set<int64_t> pick;
    for (int64_t b : {int64_t{0}, int64_t{1}, int64_t{63}, int64_t{64}, int64_t{127}, int64_t{128}, int64_t{191},
                      int64_t{192}, int64_t{255}, int64_t{256}, rows - 2, rows - 1}) {
        if (b >= 0 && b < rows) pick.insert(b);
    }
    std::set<int64_t> chosen;
    int64_t spent = 0;
    for (int64_t b : {rows - 1, int64_t{0}}) {  // the last and first rows always; the others within the budget
        chosen.insert(b);
        spent += row_cost(b);
    }
    for (int64_t b : pick) {
        if (spent >= kRefBudget) break;
        if (chosen.insert(b).second) spent += row_cost(b);
    }
    pick = chosen;
    for (int guard = 0; guard < 4096 && spent < kRefBudget; ++guard) {
        const int64_t i = r.uniform(0, rows - 1);
        if (pick.insert(i).second) spent += row_cost(i);
    }
    return std::vector<int64_t>(pick.begin(), pick.end());
}

// ---- GpuFuzz.Prefill ---------------------------------------------------------------------------------------------

enum class PrefillBad {
    kNone,
    kHeadDim96,
    kQHeadsNotMultiple,
    kGroupOver16,
    kKDtypeDiffers,
    kVShapeDiffers,
    kOutNotContiguous,
    kOutDtype,
    kLseShape,
    kLseDtype,
    kMisaligned,
    kStrideNot8,
    kQPositionRange,
    kMaskValue,
    kConfigInvalid,
    kConfigDtype,
    kWgmmaBroadcast,
    kOutOverlapsK,
    kScaleNotFinite,
    kNullData,
    kCount
};
const char* prefill_bad_name(PrefillBad b) {
    static const char* const kNames[] = {"none",
                                         "head_dim_96",
                                         "q_heads_not_multiple",
                                         "group_over_16",
                                         "k_dtype",
                                         "v_shape",
                                         "out_not_contiguous",
                                         "out_dtype",
                                         "lse_shape",
                                         "lse_dtype",
                                         "misaligned",
                                         "stride_not_8",
                                         "q_position",
                                         "mask_value",
                                         "config_invalid",
                                         "config_dtype",
                                         "wgmma_broadcast",
                                         "out_overlaps_k",
                                         "scale_not_finite",
                                         "null_data"};
    return kNames[static_cast<int>(b)];
}

struct PrefillCase {
    DType dtype = DType::kBF16;
    int64_t dim = 128, hkv = 1, group = 1, seq_q = 1, seq_kv = 1;
    bool causal = false;
    int64_t q_position = 0;
    int64_t q_head_pad = 0, q_row_pad = 0, kv_head_pad = 0, kv_row_pad = 0;  // elements (multiples of 8)
    bool want_lse = true, broadcast_kv = false, out_is_q = false;
    std::optional<float> scale;
    std::optional<AttentionPrefillConfig> config;
    double q_range = 2.0;
    PrefillBad bad = PrefillBad::kNone;
    int64_t hq() const { return hkv * group; }
};

std::string describe(const PrefillCase& c) {
    std::ostringstream os;
    os << "dtype=" << dtype_name(c.dtype) << " dim=" << c.dim << " heads=" << c.hq() << "/" << c.hkv
       << " seq_q=" << c.seq_q << " seq_kv=" << c.seq_kv << " mask=" << (c.causal ? "causal" : "none")
       << " q_position=" << c.q_position << " q_pad=" << c.q_head_pad << "," << c.q_row_pad
       << " kv_pad=" << c.kv_head_pad << "," << c.kv_row_pad << " lse=" << c.want_lse
       << " broadcast_kv=" << c.broadcast_kv << " out_is_q=" << c.out_is_q
       << " scale=" << (c.scale ? std::to_string(*c.scale) : "default")
       << " config=" << (c.config ? config_key(*c.config) : "default") << " q_range=" << c.q_range
       << " invalid=" << prefill_bad_name(c.bad);
    return os.str();
}

int64_t draw_length(Rng& r) {
    const double u = r.real(0, 1);
    if (u < 0.25) return r.uniform(1, 17);
    if (u < 0.65) return r.uniform(1, 700);
    if (u < 0.95) return r.log_uniform(64, 4200);
    return 0;
}

PrefillCase draw_prefill(Rng& r, AttentionPrefillKernel device_kernel) {
    PrefillCase c;
    c.dtype = r.chance(0.5) ? DType::kBF16 : DType::kF16;
    c.dim = r.chance(0.5) ? 64 : 128;
    c.hkv = r.chance(0.6) ? r.uniform(1, 2) : r.uniform(1, 8);
    c.group = r.chance(0.3) ? r.pick<int64_t>({1, 4, 8, 16}) : r.uniform(1, 16);
    c.seq_q = draw_length(r);
    c.seq_kv = r.chance(0.6) ? c.seq_q : draw_length(r);
    if (r.chance(0.15)) c.seq_q = weft::round_up(std::max<int64_t>(c.seq_q, 1), int64_t{64});  // whole tiles too
    // Bounded sizes: q [seq_q, hq, dim] and k/v within a few million elements.
    while (c.seq_q * c.hq() * c.dim > (int64_t{6} << 20) && c.group > 1) c.group = (c.group + 1) / 2;
    while (c.seq_q * c.hq() * c.dim > (int64_t{6} << 20) && c.hkv > 1) c.hkv = (c.hkv + 1) / 2;
    while (c.seq_kv * c.hkv * c.dim > (int64_t{3} << 20) && c.hkv > 1) c.hkv = (c.hkv + 1) / 2;
    // One query row's reference (every q-head over every key) within a third of the budget.
    while (c.seq_kv * c.hq() * c.dim * 2 > kRefBudget / 3 && c.group > 1) c.group = (c.group + 1) / 2;
    while (c.seq_kv * c.hq() * c.dim * 2 > kRefBudget / 3 && c.hkv > 1) c.hkv = (c.hkv + 1) / 2;
    c.causal = r.chance(0.5);
    const double p = r.real(0, 1);
    c.q_position = p < 0.4 ? std::max<int64_t>(0, c.seq_kv - c.seq_q) : p < 0.7 ? 0 : r.uniform(0, c.seq_kv + 300);
    if (r.chance(0.25)) c.q_head_pad = 8 * r.uniform(1, 4);
    if (r.chance(0.25)) c.q_row_pad = 8 * r.uniform(1, 8);
    if (r.chance(0.25)) c.kv_head_pad = 8 * r.uniform(1, 4);
    if (r.chance(0.25)) c.kv_row_pad = 8 * r.uniform(1, 8);
    c.want_lse = r.chance(0.8);
    if (r.chance(0.3)) {
        c.scale = static_cast<float>(r.pick<double>({0.0, -0.3, 1.0, 3.0, r.real(-2.0, 2.0) / std::sqrt(c.dim)}));
    }
    c.q_range = r.pick<double>({0.5, 1.0, 2.0, 4.0});
    if (r.chance(0.3)) {
        AttentionPrefillConfig cfg = attention_prefill_default_config(
            c.dtype, static_cast<int32_t>(c.dim), r.chance(0.5) ? AttentionPrefillKernel::kMmaSync : device_kernel);
        cfg.block_m = static_cast<int32_t>(r.pick<int64_t>({64, 128, 192}));
        cfg.stages = static_cast<int32_t>(r.uniform(2, 3));
        if (!is_valid(cfg)) cfg = attention_prefill_default_config(c.dtype, static_cast<int32_t>(c.dim), cfg.kernel);
        c.config = cfg;
    }
    if (!c.config && r.chance(0.06)) {  // K/V broadcast over their heads: the default config runs mma.sync
        c.broadcast_kv = true;
        c.kv_head_pad = 0;
    }
    c.out_is_q = c.seq_q > 0 && c.q_head_pad == 0 && c.q_row_pad == 0 && r.chance(0.06);
    if (r.chance(0.1)) {
        c.bad = static_cast<PrefillBad>(r.uniform(1, static_cast<int>(PrefillBad::kCount) - 1));
        c.seq_q = r.uniform(1, 64);
        c.seq_kv = r.uniform(1, 64);
        c.hkv = r.uniform(2, 4);
        c.group = r.uniform(1, 4);
        c.q_position = 0;
        c.q_head_pad = c.q_row_pad = c.kv_head_pad = c.kv_row_pad = 0;
        c.broadcast_kv = c.out_is_q = false;
        c.config.reset();
    }
    return c;
}

/// The kernel a valid case runs (its JIT specialisation).
AttentionPrefillConfig prefill_config_of(const PrefillCase& c, AttentionPrefillKernel device_kernel, int sms) {
    if (c.config) return *c.config;
    const AttentionPrefillKernel kernel = c.broadcast_kv ? AttentionPrefillKernel::kMmaSync : device_kernel;
    return attention_prefill_call_config(c.dtype, static_cast<int32_t>(c.dim), kernel, c.seq_q, c.hq(), sms);
}

/// An invalid call: must throw weft::Error naming flash_attention and leave out's poison.
std::string run_invalid_prefill(const PrefillCase& c, cudaStream_t stream) {
    constexpr size_t kRegion = size_t{1} << 20;
    gemm_test::DeviceBuffer arena(5 * kRegion);
    if (!arena.ptr) return "cudaMalloc failed";
    std::string why;
    if (!cuda_ok(cudaMemsetAsync(arena.ptr, 0, 5 * kRegion, stream), &why, "zero") ||
        !cuda_ok(cudaMemsetAsync(static_cast<uint8_t*>(arena.ptr) + 3 * kRegion, 0xFF, 2 * kRegion, stream), &why,
                 "poison") ||
        !cuda_ok(cudaStreamSynchronize(stream), &why, "poison")) {
        return why;
    }
    auto* base = static_cast<uint8_t*>(arena.ptr);
    void *pq = base, *pk = base + kRegion, *pv = base + 2 * kRegion, *po = base + 3 * kRegion, *pl = base + 4 * kRegion;
    int64_t dim = c.dim, hq = c.hq(), hkv = c.hkv, sq = c.seq_q, skv = c.seq_kv;
    DType tq = c.dtype, tk = c.dtype, to = c.dtype, tl = DType::kF32;
    int64_t v_rows = skv, lse_rows = sq, out_row_stride = hq * dim, k_row_stride = hkv * dim, k_head_stride = dim;
    ops::FlashAttentionOptions o;
    o.mask = c.causal ? AttentionMask::kCausal : AttentionMask::kNone;
    switch (c.bad) {
        case PrefillBad::kHeadDim96:
            dim = 96;
            break;
        case PrefillBad::kQHeadsNotMultiple:
            hq = hkv * c.group + 1;
            break;
        case PrefillBad::kGroupOver16:
            hkv = 1;
            hq = 17;
            break;
        case PrefillBad::kKDtypeDiffers:
            tk = c.dtype == DType::kBF16 ? DType::kF16 : DType::kBF16;
            break;
        case PrefillBad::kVShapeDiffers:
            v_rows = skv + 1;
            break;
        case PrefillBad::kOutNotContiguous:
            // One row is contiguous whatever its stride (a view's extent-1 dimensions have no stride that matters,
            // TensorView::is_contiguous): then the wrong dtype instead.
            if (sq > 1) {
                out_row_stride = hq * dim + 8;
            } else {
                to = DType::kF32;
            }
            break;
        case PrefillBad::kOutDtype:
            to = DType::kF32;
            break;
        case PrefillBad::kLseShape:
            lse_rows = sq + 1;
            break;
        case PrefillBad::kLseDtype:
            tl = DType::kBF16;
            break;
        case PrefillBad::kMisaligned:
            pq = base + 8;
            break;
        case PrefillBad::kStrideNot8:
            k_row_stride = hkv * dim + 4;
            break;
        case PrefillBad::kQPositionRange:
            o.q_position = sq % 2 ? -1 : (int64_t{1} << 31);
            break;
        case PrefillBad::kMaskValue:
            o.mask = static_cast<AttentionMask>(7);
            break;
        case PrefillBad::kConfigInvalid: {
            AttentionPrefillConfig cfg = attention_prefill_default_config(c.dtype, static_cast<int32_t>(dim));
            if (sq % 3 == 0) cfg.block_m = 192;  // mma.sync has no 192-row items
            if (sq % 3 == 1) cfg.stages = 4;
            if (sq % 3 == 2) cfg.block_m = 32;
            o.config = cfg;
            break;
        }
        case PrefillBad::kConfigDtype:
            o.config = attention_prefill_default_config(c.dtype == DType::kBF16 ? DType::kF16 : DType::kBF16,
                                                        static_cast<int32_t>(dim));
            break;
        case PrefillBad::kWgmmaBroadcast:
            o.config =
                attention_prefill_default_config(c.dtype, static_cast<int32_t>(dim), AttentionPrefillKernel::kWgmma);
            k_head_stride = 0;
            k_row_stride = dim;
            break;
        case PrefillBad::kOutOverlapsK:
            po = base + kRegion + 16 * (sq % 4);
            break;
        case PrefillBad::kScaleNotFinite:
            o.scale = sq % 2 ? INFINITY : NAN;
            break;
        case PrefillBad::kNullData:
            pq = nullptr;
            break;
        default:
            return "no such invalid kind";
    }
    const TensorView q(pq, tq, {sq, hq, dim});
    const TensorView k(pk, tk, {skv, hkv, dim}, {k_row_stride, k_head_stride, 1});
    const TensorView v(pv, c.dtype, {v_rows, hkv, dim}, {k_row_stride, k_head_stride, 1});
    const TensorView out(po, to, {sq, hq, dim}, {out_row_stride, dim, 1});
    const TensorView lse(pl, tl, {lse_rows, hq});
    const std::string refused =
        expect_refused("flash_attention", [&] { ops::flash_attention(q, k, v, out, lse, stream, o); });
    if (!refused.empty()) {
        cudaStreamSynchronize(stream);
        return refused;
    }
    if (!cuda_ok(cudaStreamSynchronize(stream), &why, "after the refused call")) return why;
    if (c.bad != PrefillBad::kOutOverlapsK) {
        std::vector<uint8_t> got(2 * kRegion);
        if (!cuda_ok(cudaMemcpy(got.data(), base + 3 * kRegion, got.size(), cudaMemcpyDeviceToHost), &why, "download"))
            return why;
        if (!poison_intact(got.data(), got.size())) return "a refused call wrote into out or lse";
    }
    return "";
}

std::string run_prefill(const PrefillCase& c, Rng& r, cudaStream_t stream, bool* fatal) {
    const int64_t d = c.dim, hq = c.hq(), hkv = c.hkv, sq = c.seq_q, skv = c.seq_kv;
    const int64_t hkv_store = c.broadcast_kv ? 1 : hkv;  // K/V heads held in memory
    const int64_t q_hs = d + c.q_head_pad, q_rs = hq * q_hs + c.q_row_pad;
    const int64_t kv_hs = c.broadcast_kv ? 0 : d + c.kv_head_pad,
                  kv_rs = hkv_store * (d + c.kv_head_pad) + c.kv_row_pad;
    const uint16_t nan = nan16(c.dtype);
    // Host inputs: fresh values, NaN in every padding element (the op must never read one).
    std::vector<uint16_t> q(sz(std::max<int64_t>(1, sq * q_rs)), nan), k(sz(std::max<int64_t>(1, skv * kv_rs)), nan),
        v(k.size(), nan);
    const ValuePool pool(r, c.dtype, d);
    for (int64_t i = 0; i < sq; ++i) {
        for (int64_t h = 0; h < hq; ++h) {
            for (int64_t e = 0; e < d; ++e) {
                q[sz(i * q_rs + h * q_hs + e)] =
                    tp_test::float_to_bits(c.dtype, static_cast<float>(r.real(-c.q_range, c.q_range)));
            }
        }
    }
    for (int64_t j = 0; j < skv; ++j) {
        for (int64_t h = 0; h < hkv_store; ++h) {
            std::memcpy(k.data() + j * kv_rs + h * (d + c.kv_head_pad), pool.window(r), sz(d) * 2);
            std::memcpy(v.data() + j * kv_rs + h * (d + c.kv_head_pad), pool.window(r), sz(d) * 2);
        }
    }
    const size_t out_elems = sz(sq * hq * d), lse_elems = sz(sq * hq);
    gemm_test::DeviceBuffer dq(q.size() * 2 + kGuard), dk(k.size() * 2), dv(v.size() * 2), dout(out_elems * 2 + kGuard),
        dlse(lse_elems * 4 + kGuard);
    if (!dq.ptr || !dk.ptr || !dv.ptr || !dout.ptr || !dlse.ptr) return "cudaMalloc failed";
    std::string why;
    void* out_ptr = c.out_is_q ? dq.ptr : dout.ptr;
    if (!cuda_ok(cudaMemcpyAsync(dq.ptr, q.data(), q.size() * 2, cudaMemcpyHostToDevice, stream), &why, "upload q") ||
        !cuda_ok(cudaMemcpyAsync(dk.ptr, k.data(), k.size() * 2, cudaMemcpyHostToDevice, stream), &why, "upload k") ||
        !cuda_ok(cudaMemcpyAsync(dv.ptr, v.data(), v.size() * 2, cudaMemcpyHostToDevice, stream), &why, "upload v") ||
        !cuda_ok(cudaMemsetAsync(dout.ptr, 0xFF, out_elems * 2 + kGuard, stream), &why, "poison out") ||
        !cuda_ok(cudaMemsetAsync(static_cast<uint8_t*>(dq.ptr) + q.size() * 2, 0xFF, kGuard, stream), &why,
                 "poison past q") ||
        !cuda_ok(cudaMemsetAsync(dlse.ptr, 0xFF, lse_elems * 4 + kGuard, stream), &why, "poison lse")) {
        return why;
    }
    const TensorView tq(dq.ptr, c.dtype, {sq, hq, d}, {q_rs, q_hs, 1});
    const TensorView tk(dk.ptr, c.dtype, {skv, hkv, d}, {kv_rs, kv_hs, 1});
    const TensorView tv(dv.ptr, c.dtype, {skv, hkv, d}, {kv_rs, kv_hs, 1});
    const TensorView tout(out_ptr, c.dtype, {sq, hq, d});
    const TensorView tlse = c.want_lse ? TensorView(dlse.ptr, DType::kF32, {sq, hq}) : TensorView();
    ops::FlashAttentionOptions o;
    o.scale = c.scale;
    o.mask = c.causal ? AttentionMask::kCausal : AttentionMask::kNone;
    o.q_position = c.q_position;
    o.config = c.config;
    try {
        ops::flash_attention(tq, tk, tv, tout, tlse, stream, o);
    } catch (const std::exception& e) {
        return std::string("the op refused a valid call: ") + e.what();
    }
    if (!cuda_ok(cudaStreamSynchronize(stream), &why, "the op's kernel")) {
        *fatal = true;
        return why;
    }
    std::vector<uint16_t> out(out_elems + kGuard / 2);
    std::vector<float> lse(lse_elems + kGuard / 4);
    if (!cuda_ok(cudaMemcpy(out.data(), out_ptr, out.size() * 2, cudaMemcpyDeviceToHost), &why, "download out") ||
        !cuda_ok(cudaMemcpy(lse.data(), dlse.ptr, lse.size() * 4, cudaMemcpyDeviceToHost), &why, "download lse")) {
        return why;
    }
    if (!poison_intact(reinterpret_cast<const uint8_t*>(out.data() + out_elems), kGuard)) return "wrote past out's end";
    if (!poison_intact(reinterpret_cast<const uint8_t*>(lse.data() + (c.want_lse ? lse_elems : 0)),
                       c.want_lse ? kGuard : lse.size() * 4)) {
        return c.want_lse ? "wrote past lse's end" : "wrote lse though none was asked for";
    }
    // The reference from the rounded inputs (as floats once, packed).
    std::vector<float> qf(sz(sq * hq * d)), kf(sz(skv * hkv_store * d)), vf(kf.size());
    for (int64_t i = 0; i < sq; ++i)
        for (int64_t h = 0; h < hq; ++h)
            for (int64_t e = 0; e < d; ++e)
                qf[sz((i * hq + h) * d + e)] = tp_test::bits_to_float(c.dtype, q[sz(i * q_rs + h * q_hs + e)]);
    for (int64_t j = 0; j < skv; ++j) {
        for (int64_t h = 0; h < hkv_store; ++h) {
            for (int64_t e = 0; e < d; ++e) {
                const size_t at = sz(j * kv_rs + h * (d + c.kv_head_pad) + e);
                kf[sz((j * hkv_store + h) * d + e)] = tp_test::bits_to_float(c.dtype, k[at]);
                vf[sz((j * hkv_store + h) * d + e)] = tp_test::bits_to_float(c.dtype, v[at]);
            }
        }
    }
    const auto visible = [&](int64_t i) { return c.causal ? std::clamp<int64_t>(c.q_position + i + 1, 0, skv) : skv; };
    const double scale = c.scale ? static_cast<double>(*c.scale) : 1.0 / std::sqrt(static_cast<double>(d));
    const std::vector<int64_t> rows = rows_to_check(r, sq, [&](int64_t i) { return visible(i) * hq * d * 2; });
    std::vector<char> checked(sz(sq), 0);
    std::vector<double> s, o_ref;
    for (int64_t i : rows) {
        checked[sz(i)] = 1;
        for (int64_t h = 0; h < hq; ++h) {
            const int64_t kvh = c.broadcast_kv ? 0 : h / c.group;
            const float* kb = kf.data() + kvh * d;
            const float* vb = vf.data() + kvh * d;
            const double want_lse =
                attend(qf.data() + (i * hq + h) * d, kb, vb, visible(i), hkv_store * d, d, scale, s, o_ref);
            const std::string bad = check_attention_row(out.data() + (i * hq + h) * d, c.dtype, o_ref, want_lse,
                                                        c.want_lse ? lse.data() + i * hq + h : nullptr, d,
                                                        "(row " + std::to_string(i) + ", q-head " + std::to_string(h) +
                                                            ", " + std::to_string(visible(i)) + " keys)");
            if (!bad.empty()) return bad;
        }
    }
    // The rows the reference skipped: finite, within the values' range (a convex combination of V rows), zeros where
    // no key is visible.
    for (int64_t i = 0; i < sq; ++i) {
        if (checked[sz(i)]) continue;
        for (int64_t e = 0; e < hq * d; ++e) {
            const double g = tp_test::bits_to_float(c.dtype, out[sz(i * hq * d + e)]);
            if (visible(i) == 0 ? g != 0.0 : !(std::fabs(g) <= 1.01)) {
                return "out (row " + std::to_string(i) + ", element " + std::to_string(e) + ") = " + std::to_string(g) +
                       (visible(i) == 0 ? ", want 0 (no key visible)" : ", outside [-1, 1]");
            }
        }
    }
    return "";
}

TEST_F(GpuFuzz, Prefill) {
    FuzzRun run("Prefill", 15, 2000, 4);
    const AttentionPrefillKernel device_kernel = ops::attention_prefill_device_kernel();
    const int sms = gemm_test::num_sms();
    fuzz_one_gpu<PrefillCase>(run, {[device_kernel](Rng& r) { return draw_prefill(r, device_kernel); },
                                    [device_kernel, sms](const PrefillCase& c, int64_t, int) -> DrawKernel {
                                        if (c.bad != PrefillBad::kNone || c.seq_q == 0) return {};
                                        return {config_key(prefill_config_of(c, device_kernel, sms))};
                                    },
                                    [](const PrefillCase& c) { return c.bad != PrefillBad::kNone; },
                                    [](const PrefillCase& c, Rng& r, cudaStream_t stream, bool* fatal) {
                                        return c.bad != PrefillBad::kNone ? run_invalid_prefill(c, stream)
                                                                          : run_prefill(c, r, stream, fatal);
                                    }});
}

// ---- GpuFuzz.SpDecode (ranks as threads) ---------------------------------------------------------------------------

enum class SpBad {
    kNone,
    kHeadDim96,
    kGroupOver16,
    kQHeadsNotMultiple,
    kOutDtype,
    kLseShape,
    kMaxSeqTooBig,
    kQF32,
    kMisalignedQ,
    kTooManyHeads,
    kCount
};
const char* sp_bad_name(SpBad b) {
    static const char* const kNames[] = {"none",
                                         "head_dim_96",
                                         "group_over_16",
                                         "q_heads_not_multiple",
                                         "out_dtype",
                                         "lse_shape",
                                         "max_seq_len_over_table",
                                         "q_f32",
                                         "misaligned_q",
                                         "too_many_heads_for_the_ll_slot"};
    return kNames[static_cast<int>(b)];
}

struct SpCase {
    int world = 1;
    DType dtype = DType::kBF16;
    int64_t dim = 128, hkv = 1, group = 1, batch = 1;
    std::vector<int64_t> lens;                            // whole sequences
    std::vector<std::vector<int64_t>> cuts;               // [b][0..W]: rank r holds tokens [cuts[b][r], cuts[b][r + 1])
    std::vector<int64_t> page, extra_max;                 // per rank: page size, max_seq_len above the longest shard
    std::vector<int32_t> splits;                          // per rank: DecodeAttentionOptions::num_splits
    std::vector<char> heads_slots, own_ws, programmatic;  // per rank
    std::optional<float> scale;
    bool want_lse = true;
    double q_range = 2.0;
    SpBad bad = SpBad::kNone;
    uint64_t data_seed = 0;
    int64_t hq() const { return hkv * group; }
};

std::string describe(const SpCase& c) {
    std::ostringstream os;
    os << "world=" << c.world << " dtype=" << dtype_name(c.dtype) << " dim=" << c.dim << " heads=" << c.hq() << "/"
       << c.hkv << " batch=" << c.batch << " scale=" << (c.scale ? std::to_string(*c.scale) : "default")
       << " lse=" << c.want_lse << " q_range=" << c.q_range << " invalid=" << sp_bad_name(c.bad) << " per_rank=[";
    for (int q = 0; q < c.world; ++q) {
        os << (q ? "; " : "") << "page " << c.page[sz(q)] << (c.heads_slots[sz(q)] ? " heads-slots" : " slots-heads")
           << " +max " << c.extra_max[sz(q)] << " splits " << c.splits[sz(q)] << (c.own_ws[sz(q)] ? " ws" : "")
           << (c.programmatic[sz(q)] ? " pdl" : "");
    }
    os << "] shards=[";
    for (size_t b = 0; b < c.cuts.size(); ++b) {
        os << (b ? "; " : "");
        for (int q = 0; q < c.world; ++q) os << (q ? "," : "") << c.cuts[b][sz(q) + 1] - c.cuts[b][sz(q)];
    }
    os << "]";
    return os.str();
}

SpCase draw_sp(Rng& r, int world) {
    SpCase c;
    c.world = world;
    c.dtype = r.chance(0.5) ? DType::kBF16 : DType::kF16;
    c.dim = r.pick<int64_t>({64, 128, 256});
    c.hkv = r.chance(0.6) ? r.uniform(1, 2) : r.uniform(1, 4);
    c.group = r.chance(0.3) ? r.pick<int64_t>({1, 4, 8, 16}) : r.uniform(1, 16);
    c.batch = r.chance(0.03) ? 0 : r.chance(0.5) ? r.uniform(1, 4) : r.uniform(1, 16);
    const int64_t budget = std::max<int64_t>(16, kRefBudget / (2 * c.hq() * c.dim));
    const int64_t longest = r.chance(0.3) ? 12000 : 3000;
    for (int64_t b = 0; b < c.batch; ++b) {
        const double u = r.real(0, 1);
        c.lens.push_back(u < 0.08 ? 0 : u < 0.18 ? r.uniform(1, world) : r.log_uniform(1, longest));
    }
    for (;;) {
        int64_t total = 0;
        for (int64_t l : c.lens) total += l;
        if (total <= budget) break;
        *std::max_element(c.lens.begin(), c.lens.end()) /= 2;
    }
    for (int64_t b = 0; b < c.batch; ++b) {
        const int64_t len = c.lens[sz(b)];
        std::vector<int64_t> cut = {0, len};
        const int mode = static_cast<int>(r.uniform(0, 3));  // random cuts, one rank holds all, even, some empty
        for (int q = 1; q < world; ++q) {
            if (mode == 1) {
                cut.push_back(0);
            } else if (mode == 2) {
                cut.push_back(len * q / world);
            } else {
                cut.push_back(r.uniform(0, len));
            }
        }
        std::sort(cut.begin(), cut.end());
        if (mode == 1 && r.chance(0.5)) {  // everything on the last rank instead of the first
            for (size_t i = 1; i + 1 < cut.size(); ++i) cut[i] = len;
        }
        if (mode == 3 && world > 1) {  // a random rank's shard emptied: its tokens go to a neighbour
            const size_t q = sz(r.uniform(0, world - 1));
            if (q + 1 < sz(world)) {
                cut[q + 1] = cut[q];
            } else {
                cut[q] = cut[q + 1];
            }
            std::sort(cut.begin(), cut.end());
        }
        c.cuts.push_back(cut);
    }
    for (int q = 0; q < world; ++q) {
        c.page.push_back(r.chance(0.5) ? (int64_t{1} << r.uniform(0, 8)) : r.uniform(1, 300));
        c.extra_max.push_back(r.chance(0.3) ? r.uniform(0, 300) : 0);
        c.splits.push_back(r.chance(0.3) ? static_cast<int32_t>(r.uniform(1, 64)) : 0);
        c.heads_slots.push_back(r.chance(0.3) ? 1 : 0);
        c.own_ws.push_back(r.chance(0.25) ? 1 : 0);
        c.programmatic.push_back(r.chance(0.15) ? 1 : 0);
    }
    if (r.chance(0.25)) c.scale = static_cast<float>(r.real(0.5, 2.0) / std::sqrt(static_cast<double>(c.dim)));
    c.want_lse = r.chance(0.8);
    c.q_range = r.pick<double>({0.5, 1.0, 2.0, 4.0});
    c.data_seed = r.next();
    if (r.chance(0.1)) {
        c.bad = static_cast<SpBad>(r.uniform(1, static_cast<int>(SpBad::kCount) - 1));
        if (c.bad == SpBad::kTooManyHeads && world == 1) c.bad = SpBad::kHeadDim96;  // one rank: decode_attention's
        c.batch = std::max<int64_t>(c.batch, 1);
    }
    return c;
}

/// An invalid call on every rank alike: must throw weft::Error naming the op, before any collective work.
std::string run_invalid_sp(World& w, const SpCase& c, cudaStream_t s) {
    const int64_t batch = c.batch;
    int64_t dim = c.dim, hkv = c.hkv, hq = c.hq(), page = 16, max_seq_len = page;
    DType tq = c.dtype, to = c.dtype;
    int64_t lse_rows = batch;
    int64_t q_offset = 0;
    switch (c.bad) {
        case SpBad::kHeadDim96:
            dim = 96;
            break;
        case SpBad::kGroupOver16:
            hkv = 1;
            hq = 17;
            break;
        case SpBad::kQHeadsNotMultiple:
            hkv = 2;
            hq = 3;
            break;
        case SpBad::kOutDtype:
            to = DType::kF32;
            break;
        case SpBad::kLseShape:
            lse_rows = batch + 1;
            break;
        case SpBad::kMaxSeqTooBig:
            max_seq_len = page + 1;
            break;
        case SpBad::kQF32:
            tq = DType::kF32;
            break;
        case SpBad::kMisalignedQ:
            q_offset = 8;
            break;
        case SpBad::kTooManyHeads:
            dim = 128;
            hkv = 32;
            hq = 512;  // 512 x (128 + 2) x 8 bytes of LL lines: more than the 512 KiB slot
            break;
        default:
            return "no such invalid kind";
    }
    const size_t q_bytes = sz(batch * hq * dim) * 4 + 64, kv_elems = sz(batch * page * hkv * dim);
    DeviceArray<uint8_t> dq(q_bytes, s), dk(kv_elems * 2, s), dv(kv_elems * 2, s), dout(q_bytes, s);
    DeviceArray<int32_t> dt(sz(batch), s), dl(sz(batch), s);
    DeviceArray<float> dlse(sz(batch + 1) * sz(hq), s);
    dout.poison(0xFF);
    dt.poison(0);
    dl.poison(0);
    const TensorView q(dq.get() + q_offset, tq, {batch, hq, dim});
    const TensorView k(dk.get(), c.dtype, {batch, page, hkv, dim});
    const TensorView v(dv.get(), c.dtype, {batch, page, hkv, dim});
    const TensorView table(dt.get(), DType::kI32, {batch, 1});
    const TensorView lens(dl.get(), DType::kI32, {batch});
    const TensorView out(dout.get(), to, {batch, hq, dim});
    const TensorView lse(dlse.get(), DType::kF32, {lse_rows, hq});
    std::string why = expect_refused(
        "attention", [&] { ops::sp_decode_attention(w, q, k, v, table, lens, max_seq_len, out, lse, s); });
    if (!why.empty()) return why;
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    if (!poison_intact(download(dout.get(), q_bytes, s).data(), q_bytes)) return "a refused call wrote into out";
    return "";
}

/// Rank me's part of a sequence-parallel decode case.
std::vector<std::string> run_sp(World& w, const SpCase& c, cudaStream_t s) {
    const int me = w.rank();
    if (c.bad != SpBad::kNone) {
        const std::string why = run_invalid_sp(w, c, s);
        return why.empty() ? std::vector<std::string>{} : std::vector<std::string>{why};
    }
    const int64_t hq = c.hq(), hkv = c.hkv, d = c.dim, batch = c.batch, ps = c.page[sz(me)];
    // The whole sequences (the same on every rank: one seed), and this rank's shards in a paged cache of its own.
    Rng dr(c.data_seed);
    const ValuePool pool(dr, c.dtype, d);
    std::vector<std::vector<uint16_t>> kseq(sz(batch)), vseq(sz(batch));
    for (int64_t b = 0; b < batch; ++b) {
        const size_t n = sz(c.lens[sz(b)] * hkv);
        kseq[sz(b)].resize(n * sz(d));
        vseq[sz(b)].resize(n * sz(d));
        for (size_t i = 0; i < n; ++i) {
            std::memcpy(kseq[sz(b)].data() + i * sz(d), pool.window(dr), sz(d) * 2);
            std::memcpy(vseq[sz(b)].data() + i * sz(d), pool.window(dr), sz(d) * 2);
        }
    }
    std::vector<uint16_t> q(sz(std::max<int64_t>(1, batch * hq * d)));
    for (auto& x : q) x = tp_test::float_to_bits(c.dtype, static_cast<float>(dr.real(-c.q_range, c.q_range)));
    std::vector<int32_t> lens(sz(std::max<int64_t>(batch, 1)), 0);
    int64_t pages = 0, longest = 0;
    for (int64_t b = 0; b < batch; ++b) {
        lens[sz(b)] = static_cast<int32_t>(c.cuts[sz(b)][sz(me) + 1] - c.cuts[sz(b)][sz(me)]);
        pages += (lens[sz(b)] + ps - 1) / ps;
        longest = std::max<int64_t>(longest, lens[sz(b)]);
    }
    const int64_t max_seq_len = longest + c.extra_max[sz(me)];
    const int64_t max_pages = std::max<int64_t>(1, (max_seq_len + ps - 1) / ps);
    Rng pr(mix64(c.data_seed ^ (uint64_t(me + 1) << 32)));
    const int64_t num_pages = pages + pr.uniform(0, 2) + 1;
    std::vector<int32_t> order(sz(num_pages));
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[sz(pr.next() % i)]);
    std::vector<int32_t> table(sz(std::max<int64_t>(1, batch * max_pages)), 1 << 30);
    const bool hs = c.heads_slots[sz(me)] != 0;
    const int64_t page_stride = ps * hkv * d, slot_stride = hs ? d : hkv * d, head_stride = hs ? ps * d : d;
    std::vector<uint16_t> kc(sz(num_pages * page_stride), nan16(c.dtype)), vc(kc.size(), nan16(c.dtype));
    size_t next = 0;
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t first = c.cuts[sz(b)][sz(me)];
        for (int64_t t = 0; t < lens[sz(b)]; ++t) {
            if (t % ps == 0) table[sz(b * max_pages + t / ps)] = order[next++];
            const int64_t page = table[sz(b * max_pages + t / ps)];
            for (int64_t h = 0; h < hkv; ++h) {
                const size_t dst = sz(page * page_stride + (t % ps) * slot_stride + h * head_stride);
                const size_t src = sz(((first + t) * hkv + h) * d);
                std::memcpy(kc.data() + dst, kseq[sz(b)].data() + src, sz(d) * 2);
                std::memcpy(vc.data() + dst, vseq[sz(b)].data() + src, sz(d) * 2);
            }
        }
    }
    const size_t out_elems = sz(batch * hq * d), lse_elems = sz(batch * hq);
    DeviceArray<uint16_t> dq(q.size(), s), dk(kc.size(), s), dv(vc.size(), s), dout(out_elems + kGuard / 2, s);
    DeviceArray<int32_t> dt(table.size(), s), dl(lens.size(), s);
    DeviceArray<float> dlse(lse_elems + kGuard / 4, s);
    dq.upload(q);
    dk.upload(kc);
    dv.upload(vc);
    dt.upload(table);
    dl.upload(lens);
    dout.poison(0xFF);
    dlse.poison(0xFF);
    ops::DecodeAttentionOptions opt;
    opt.scale = c.scale;
    opt.num_splits = c.splits[sz(me)];
    opt.programmatic_launch = c.programmatic[sz(me)] != 0;
    std::unique_ptr<DeviceArray<uint8_t>> ws;
    if (c.own_ws[sz(me)]) {
        const uint64_t bytes = ops::decode_attention_workspace_bytes(batch, hq, hkv, d, max_seq_len, opt);
        ws = std::make_unique<DeviceArray<uint8_t>>(std::max<size_t>(bytes, 16), s);
        ws->poison(0xFF);
        opt.workspace = TensorView(ws->get(), DType::kU8, {static_cast<int64_t>(std::max<uint64_t>(bytes, 16))});
    }
    const TensorView tq(dq.get(), c.dtype, {batch, hq, d});
    const TensorView tk(dk.get(), c.dtype, {num_pages, ps, hkv, d}, {page_stride, slot_stride, head_stride, 1});
    const TensorView tv(dv.get(), c.dtype, {num_pages, ps, hkv, d}, {page_stride, slot_stride, head_stride, 1});
    const TensorView tt(dt.get(), DType::kI32, {batch, max_pages});
    const TensorView tl(dl.get(), DType::kI32, {batch});
    const TensorView tout(dout.get(), c.dtype, {batch, hq, d});
    const TensorView tlse = c.want_lse ? TensorView(dlse.get(), DType::kF32, {batch, hq}) : TensorView();
    ops::sp_decode_attention(w, tq, tk, tv, tt, tl, max_seq_len, tout, tlse, s, opt);
    w.sync_and_check(s);
    const std::vector<uint16_t> out = download(dout.get(), dout.size(), s);
    const std::vector<float> lse = download(dlse.get(), dlse.size(), s);
    if (!poison_intact(reinterpret_cast<const uint8_t*>(out.data() + out_elems), kGuard)) return {"wrote past out"};
    if (!poison_intact(reinterpret_cast<const uint8_t*>(lse.data() + (c.want_lse ? lse_elems : 0)),
                       c.want_lse ? kGuard : lse.size() * 4)) {
        return {c.want_lse ? "wrote past lse" : "wrote lse though none was asked for"};
    }
    // fp64 over the whole sequences.
    const double scale = c.scale ? static_cast<double>(*c.scale) : 1.0 / std::sqrt(static_cast<double>(d));
    std::vector<float> qf(sz(d)), kf, vf;
    std::vector<double> sc, o_ref;
    for (int64_t b = 0; b < batch; ++b) {
        kf.resize(kseq[sz(b)].size());
        vf.resize(kf.size());
        for (size_t i = 0; i < kf.size(); ++i) {
            kf[i] = tp_test::bits_to_float(c.dtype, kseq[sz(b)][i]);
            vf[i] = tp_test::bits_to_float(c.dtype, vseq[sz(b)][i]);
        }
        for (int64_t h = 0; h < hq; ++h) {
            for (int64_t e = 0; e < d; ++e) qf[sz(e)] = tp_test::bits_to_float(c.dtype, q[sz((b * hq + h) * d + e)]);
            const int64_t kvh = h / c.group;
            const double want_lse = attend(qf.data(), kf.data() + kvh * d, vf.data() + kvh * d, c.lens[sz(b)], hkv * d,
                                           d, scale, sc, o_ref);
            const std::string bad =
                check_attention_row(out.data() + (b * hq + h) * d, c.dtype, o_ref, want_lse,
                                    c.want_lse ? lse.data() + b * hq + h : nullptr, d,
                                    "(sequence " + std::to_string(b) + " of " + std::to_string(c.lens[sz(b)]) +
                                        " tokens, q-head " + std::to_string(h) + ")");
            if (!bad.empty()) return {bad};
        }
    }
    return {};
}

TEST_F(GpuFuzz, SpDecode) {
    FuzzRun run("SpDecode", 15, 100000, 3);
    // A small staging region keeps the collective workspace within the test's heaps (the LL buffer is what this op
    // uses).
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::string("1M"));
    int64_t invalid = 0;
    std::mutex mutex;
    // The kernel of a case is admitted by rank 0 before the case starts (the same decision on every rank): a case whose
    // kernel the budget refuses is skipped on every rank.
    std::vector<char> admit_flag(1, 0);
    const auto options = [](int) {
        WorldOptions o = test::test_options(64ull << 20);
        o.timeout = std::chrono::milliseconds(20000);
        return o;
    };
    const int64_t cases = fuzz_worlds(
        run, 1, 8, {3, 5, 6, 7}, options,
        [&](int64_t idx, int world) {
            Rng r = run.rng(idx, 0);
            return describe(draw_sp(r, world));
        },
        [&](World& w, int64_t idx, cudaStream_t s, bool*) {
            Rng r = run.rng(idx, 0);
            const SpCase c = draw_sp(r, w.num_ranks());
            if (w.rank() == 0) {
                std::lock_guard<std::mutex> lock(mutex);
                admit_flag[0] = c.bad != SpBad::kNone || c.batch == 0 ||
                                run.admit(std::string(dtype_name(c.dtype)) + " dim " + std::to_string(c.dim));
                invalid += admit_flag[0] && c.bad != SpBad::kNone;
            }
            w.barrier();
            const bool go = admit_flag[0] != 0;
            w.barrier();
            if (!go) return std::vector<std::string>{};
            return run_sp(w, c, s);
        },
        [](World& w) { ops::prepare_collectives(w); });
    run.summary(cases, invalid, 0);
}

// ---- GpuFuzz.AgAttention (ranks as threads) ------------------------------------------------------------------------

enum class AgBad { kNone, kUnevenMaxSeq, kHeadDim96, kGroupOver16, kDtypeF32, kRowsOverMax, kKRowsDiffer, kCount };
const char* ag_bad_name(AgBad b) {
    static const char* const kNames[] = {"none",      "uneven_max_seq", "head_dim_96",  "group_over_16",
                                         "dtype_f32", "rows_over_max",  "k_rows_differ"};
    return kNames[static_cast<int>(b)];
}

struct AgCase {
    int world = 1;
    DType dtype = DType::kBF16;
    int64_t dim = 128, hkv = 1, group = 1, max_rows = 1;
    bool causal = true, want_lse = true, local_kv = false;
    std::vector<int64_t> call_rows;  // rows per rank of each call (S = W * rows)
    std::optional<AttentionPrefillConfig> config;
    std::optional<float> scale;
    int64_t kv_pad = 0;
    double q_range = 2.0;
    AgBad bad = AgBad::kNone;
    uint64_t data_seed = 0;
    int64_t hq() const { return hkv * group; }
};

std::string describe(const AgCase& c) {
    std::ostringstream os;
    os << "world=" << c.world << " dtype=" << dtype_name(c.dtype) << " dim=" << c.dim << " heads=" << c.hq() << "/"
       << c.hkv << " max_seq=" << c.max_rows * c.world << " mask=" << (c.causal ? "causal" : "none")
       << " lse=" << c.want_lse << " local_kv=" << c.local_kv << " kv_pad=" << c.kv_pad
       << " config=" << (c.config ? config_key(*c.config) : "default")
       << " scale=" << (c.scale ? std::to_string(*c.scale) : "default") << " q_range=" << c.q_range
       << " invalid=" << ag_bad_name(c.bad) << " rows=[";
    for (size_t i = 0; i < c.call_rows.size(); ++i) os << (i ? "," : "") << c.call_rows[i];
    os << "]";
    return os.str();
}

AgCase draw_ag(Rng& r, int world, AttentionPrefillKernel device_kernel) {
    AgCase c;
    c.world = world;
    c.dtype = r.chance(0.5) ? DType::kBF16 : DType::kF16;
    c.dim = r.chance(0.5) ? 64 : 128;
    c.hkv = r.chance(0.6) ? r.uniform(1, 2) : r.uniform(1, 4);
    c.group = r.chance(0.3) ? r.pick<int64_t>({1, 4, 8, 16}) : r.uniform(1, 8);
    c.max_rows = r.chance(0.3) ? r.uniform(1, 40) : r.log_uniform(1, 900);
    while (c.max_rows * world * c.hq() * c.dim > (int64_t{4} << 20) && c.max_rows > 1) c.max_rows /= 2;
    c.causal = r.chance(0.6);
    c.want_lse = r.chance(0.8);
    c.local_kv = r.chance(0.2);
    if (r.chance(0.25)) c.kv_pad = 8 * r.uniform(1, 4);
    if (r.chance(0.3)) {
        c.config = attention_prefill_default_config(c.dtype, static_cast<int32_t>(c.dim),
                                                    r.chance(0.5) ? AttentionPrefillKernel::kMmaSync : device_kernel);
    }
    if (r.chance(0.25)) c.scale = static_cast<float>(r.real(-1.0, 2.0) / std::sqrt(static_cast<double>(c.dim)));
    c.q_range = r.pick<double>({0.5, 1.0, 2.0});
    const int calls = static_cast<int>(r.uniform(1, 4));
    for (int i = 0; i < calls; ++i) c.call_rows.push_back(r.chance(0.5) ? c.max_rows : r.uniform(1, c.max_rows));
    c.data_seed = r.next();
    if (r.chance(0.1)) {
        c.bad = static_cast<AgBad>(r.uniform(1, static_cast<int>(AgBad::kCount) - 1));
        if (c.bad == AgBad::kUnevenMaxSeq && world == 1) c.bad = AgBad::kHeadDim96;
        c.max_rows = std::min<int64_t>(c.max_rows, 64);
        c.call_rows = {c.max_rows};
    }
    return c;
}

AttentionPrefillConfig ag_config_of(const AgCase& c, AttentionPrefillKernel device_kernel, int sms) {
    if (c.config) return *c.config;
    return attention_prefill_call_config(c.dtype, static_cast<int32_t>(c.dim), device_kernel, c.max_rows, c.hq(), sms);
}

std::vector<std::string> run_ag(World& w, const AgCase& c, cudaStream_t s) {
    const int me = w.rank(), world = c.world;
    const int64_t hq = c.hq(), hkv = c.hkv, d = c.dim;
    ops::AgAttentionShape shape{.max_seq = c.max_rows * world,
                                .num_q_heads = hq,
                                .num_kv_heads = hkv,
                                .head_dim = d,
                                .dtype = c.dtype,
                                .mask = c.causal ? AttentionMask::kCausal : AttentionMask::kNone};
    ops::AgAttentionOptions options{.scale = c.scale, .config = c.config};
    switch (c.bad) {
        case AgBad::kUnevenMaxSeq:
            shape.max_seq += 1;
            break;
        case AgBad::kHeadDim96:
            shape.head_dim = 96;
            break;
        case AgBad::kGroupOver16:
            shape.num_kv_heads = 1;
            shape.num_q_heads = 17;
            break;
        case AgBad::kDtypeF32:
            shape.dtype = DType::kF32;
            break;
        default:
            break;
    }
    if (c.bad == AgBad::kUnevenMaxSeq || c.bad == AgBad::kHeadDim96 || c.bad == AgBad::kGroupOver16 ||
        c.bad == AgBad::kDtypeF32) {
        const std::string why = expect_refused("ag_attention", [&] { ops::AgAttention op(w, shape, options); });
        return why.empty() ? std::vector<std::string>{} : std::vector<std::string>{"constructor: " + why};
    }
    ops::AgAttention op(w, shape, options);
    const int64_t max_rows = c.max_rows, kv_ld = hkv * d + c.kv_pad;
    DeviceArray<uint16_t> dq(sz(max_rows * hq * d) + 8, s), dk(sz(max_rows * kv_ld) + 8, s),
        dv(sz(max_rows * kv_ld) + 8, s), dout(sz(max_rows * hq * d) + kGuard / 2, s);
    DeviceArray<float> dlse(sz(max_rows * hq) + kGuard / 4, s);
    if (c.bad == AgBad::kRowsOverMax || c.bad == AgBad::kKRowsDiffer) {
        const int64_t rows = c.bad == AgBad::kRowsOverMax ? max_rows + 1 : max_rows;
        DeviceArray<uint16_t> big(sz((max_rows + 1) * hq * d), s);
        const TensorView q(big.get(), c.dtype, {rows, hq, d});
        const TensorView kv(dk.get(), c.dtype, {c.bad == AgBad::kKRowsDiffer ? rows - 1 : rows, hkv, d});
        const std::string why = expect_refused("ag_attention", [&] {
            op.run(q, kv, kv, TensorView(big.get(), c.dtype, {rows, hq, d}), TensorView(), s);
        });
        return why.empty() ? std::vector<std::string>{} : std::vector<std::string>{"run: " + why};
    }
    Rng dr(c.data_seed);
    for (size_t call = 0; call < c.call_rows.size(); ++call) {
        const int64_t rows = c.call_rows[call], seq = rows * world;
        const std::string tag = "call " + std::to_string(call) + " (S = " + std::to_string(seq) + "): ";
        // The whole sequence, the same on every rank (one seed per call); this rank uploads its shard.
        const ValuePool pool(dr, c.dtype, d);
        std::vector<uint16_t> q(sz(seq * hq * d)), k(sz(seq * hkv * d)), v(k.size());
        for (auto& x : q) x = tp_test::float_to_bits(c.dtype, static_cast<float>(dr.real(-c.q_range, c.q_range)));
        for (int64_t i = 0; i < seq * hkv; ++i) {
            std::memcpy(k.data() + i * d, pool.window(dr), sz(d) * 2);
            std::memcpy(v.data() + i * d, pool.window(dr), sz(d) * 2);
        }
        const std::vector<uint16_t> q_me(q.begin() + me * rows * hq * d, q.begin() + (me + 1) * rows * hq * d);
        const std::vector<uint16_t> k_me(k.begin() + me * rows * hkv * d, k.begin() + (me + 1) * rows * hkv * d);
        const std::vector<uint16_t> v_me(v.begin() + me * rows * hkv * d, v.begin() + (me + 1) * rows * hkv * d);
        dq.upload(q_me);
        TensorView tk, tv;
        if (c.local_kv) {  // written straight into this rank's slots: the local copy is skipped
            tk = op.local_k(seq);
            tv = op.local_v(seq);
            WEFT_CUDA_CHECK(cudaMemcpyAsync(tk.data, k_me.data(), k_me.size() * 2, cudaMemcpyHostToDevice, s));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(tv.data, v_me.data(), v_me.size() * 2, cudaMemcpyHostToDevice, s));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
        } else {
            upload_rows(dk.get(), k_me, rows, hkv * d, kv_ld, s);
            upload_rows(dv.get(), v_me, rows, hkv * d, kv_ld, s);
            tk = TensorView(dk.get(), c.dtype, {rows, hkv, d}, {kv_ld, d, 1});
            tv = TensorView(dv.get(), c.dtype, {rows, hkv, d}, {kv_ld, d, 1});
        }
        dout.poison(0xFF);
        dlse.poison(0xFF);
        w.barrier();  // every rank's previous call is over (its end of call meets the team) before the next
        const TensorView tq(dq.get(), c.dtype, {rows, hq, d});
        const TensorView tout(dout.get(), c.dtype, {rows, hq, d});
        const TensorView tlse = c.want_lse ? TensorView(dlse.get(), DType::kF32, {rows, hq}) : TensorView();
        op.run(tq, tk, tv, tout, tlse, s);
        w.sync_and_check(s);
        const std::vector<uint16_t> out = download(dout.get(), dout.size(), s);
        const std::vector<float> lse = download(dlse.get(), dlse.size(), s);
        const size_t out_elems = sz(rows * hq * d), lse_elems = sz(rows * hq);
        if (!poison_intact(reinterpret_cast<const uint8_t*>(out.data() + out_elems), kGuard))
            return {tag + "wrote past out"};
        if (!poison_intact(reinterpret_cast<const uint8_t*>(lse.data() + (c.want_lse ? lse_elems : 0)), kGuard)) {
            return {tag + (c.want_lse ? "wrote past lse" : "wrote lse though none was asked for")};
        }
        std::vector<float> qf(q_me.size()), kf(k.size()), vf(v.size());
        for (size_t i = 0; i < qf.size(); ++i) qf[i] = tp_test::bits_to_float(c.dtype, q_me[i]);
        for (size_t i = 0; i < kf.size(); ++i) {
            kf[i] = tp_test::bits_to_float(c.dtype, k[i]);
            vf[i] = tp_test::bits_to_float(c.dtype, v[i]);
        }
        const auto visible = [&](int64_t i) { return c.causal ? me * rows + i + 1 : seq; };
        const double scale = c.scale ? static_cast<double>(*c.scale) : 1.0 / std::sqrt(static_cast<double>(d));
        Rng rr(mix64(c.data_seed ^ uint64_t(me) ^ (call << 20)));
        std::vector<double> sc, o_ref;
        for (int64_t i : rows_to_check(rr, rows, [&](int64_t i) { return visible(i) * hq * d * 2; })) {
            for (int64_t h = 0; h < hq; ++h) {
                const int64_t kvh = h / c.group;
                const double want_lse = attend(qf.data() + (i * hq + h) * d, kf.data() + kvh * d, vf.data() + kvh * d,
                                               visible(i), hkv * d, d, scale, sc, o_ref);
                const std::string bad =
                    check_attention_row(out.data() + (i * hq + h) * d, c.dtype, o_ref, want_lse,
                                        c.want_lse ? lse.data() + i * hq + h : nullptr, d,
                                        "(local row " + std::to_string(i) + ", global " +
                                            std::to_string(me * rows + i) + ", q-head " + std::to_string(h) + ")");
                if (!bad.empty()) return {tag + bad};
            }
        }
    }
    return {};
}

TEST_F(GpuFuzz, AgAttention) {
    FuzzRun run("AgAttention", 15, 100000, 3);
    const AttentionPrefillKernel device_kernel = ops::attention_prefill_device_kernel();
    const int sms = gemm_test::num_sms();
    int64_t invalid = 0;
    std::mutex mutex;
    std::vector<char> admit_flag(1, 0);
    const auto options = [](int) {
        WorldOptions o = test::test_options(64ull << 20);
        o.timeout = std::chrono::milliseconds(20000);
        return o;
    };
    const int64_t cases = fuzz_worlds(
        run, 1, 4, {3, 4}, options,
        [&](int64_t idx, int world) {
            Rng r = run.rng(idx, 0);
            return describe(draw_ag(r, world, device_kernel));
        },
        [&](World& w, int64_t idx, cudaStream_t s, bool*) {
            Rng r = run.rng(idx, 0);
            const AgCase c = draw_ag(r, w.num_ranks(), device_kernel);
            if (w.rank() == 0) {
                std::lock_guard<std::mutex> lock(mutex);
                admit_flag[0] = c.bad != AgBad::kNone || run.admit(config_key(ag_config_of(c, device_kernel, sms)));
                invalid += admit_flag[0] && c.bad != AgBad::kNone;
            }
            w.barrier();
            const bool go = admit_flag[0] != 0;
            w.barrier();
            if (!go) return std::vector<std::string>{};
            return run_ag(w, c, s);
        });
    run.summary(cases, invalid, 0);
}

}  // namespace
}  // namespace weft
