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
//                         overflow must be reported by every rank, move nothing and combine to zeros. (The EP cases
//                         are fuzz_ep.hpp's, shared with MultiNodeFuzz.Ep in tests/dist.)
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

#include "fuzz_ep.hpp"
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
