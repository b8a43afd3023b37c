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

/// Uniform values in [-1, 1) rounded to `t`, from a counter hash (fast: every rank regenerates every rank's inputs).
void fill_hashed(HostMat& h, uint64_t seed) {
    for (int64_t r = 0; r < h.rows; ++r) {
        for (int64_t c = 0; c < h.cols; ++c) {
            const uint64_t x = mix64(seed ^ mix64(static_cast<uint64_t>(r * h.cols + c) + 0x51ed27ull));
            h.set(r, c, static_cast<float>(static_cast<double>(x >> 11) * 0x1p-52 - 1.0));
        }
    }
}

HostMat hashed(int64_t rows, int64_t cols, int64_t ld, DType t, uint64_t seed) {
    HostMat h(rows, cols, ld, t);
    fill_hashed(h, seed);
    return h;
}

/// A copy of `src` with another row stride.
HostMat with_ld(const HostMat& src, int64_t ld) {
    HostMat h(src.rows, src.cols, ld, src.dtype);
    for (int64_t r = 0; r < src.rows; ++r) {
        std::copy_n(src.bits.begin() + r * src.ld, src.cols, h.bits.begin() + r * ld);
    }
    return h;
}

uint64_t seed_for(uint64_t base, int role, int rank, int call) {
    return mix64(base ^ mix64(static_cast<uint64_t>(role) << 40 ^ static_cast<uint64_t>(rank) << 20 ^
                              static_cast<uint64_t>(call)));
}

/// Device memory of one case, made and freed between the case's barriers (never while a peer's kernel may wait for
/// this rank: cudaMalloc and cudaFree may synchronise the device).
struct Arena {
    void* ptr = nullptr;
    size_t bytes = 0;
    explicit Arena(size_t n) : bytes(n) { check_cuda(cudaMalloc(&ptr, std::max<size_t>(n, 256)), "cudaMalloc"); }
    ~Arena() {
        if (ptr) cudaFree(ptr);
    }
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;
    uint8_t* at(size_t off) const { return static_cast<uint8_t*>(ptr) + off; }
};

// ---- GpuFuzz.TpFusedGemm -------------------------------------------------------------------------------------------

enum class TpOp { kAg, kRs, kAr };
const char* tp_op_name(TpOp o) { return o == TpOp::kAg ? "ag_gemm" : o == TpOp::kRs ? "gemm_rs" : "gemm_ar"; }

/// What makes an invalid call invalid (validate_*_call's checks, weft/ops/{ag_gemm,gemm_rs,gemm_ar}.hpp).
enum class TpBad {
    kNone,
    kRowsZero,      // M = 0
    kRowsTooMany,   // M past max_m
    kMNotMultiple,  // gemm_rs: M not a multiple of W (W = 1: rows zero)
    kKMismatch,     // a's K differs from the shape's
    kDtypeDiffers,  // a in the other 16-bit dtype
    kAllF32,        // a, b and c in f32
    kBShape,        // b not [n, k]
    kCShape,        // c not [M, n] / [M/W, n]
    kCStride,       // c's row stride not a multiple of 16 bytes
    kCBase,         // c's base not 16-byte aligned
    kCOverlapsA,    // c's bytes overlap a's
    kANot2D,        // a as a 3-D view
    kAInnerStride,  // a's columns strided
    kANull,         // a's data null
    kCount
};

const char* tp_bad_name(TpBad b) {
    static const char* const kNames[] = {"none",       "rows_zero",      "rows_too_many", "m_not_multiple_of_w",
                                         "k_mismatch", "a_dtype",        "all_f32",       "b_shape",
                                         "c_shape",    "c_stride",       "c_base",        "c_overlaps_a",
                                         "a_not_2d",   "a_inner_stride", "a_null"};
    return kNames[static_cast<int>(b)];
}

struct TpCall {
    int64_t rows = 1;  // ag_gemm / gemm_rs: rows per rank (M = W * rows); gemm_ar: M
    int64_t a_pad = 0, c_pad = 0;
    bool zero_copy = false;  // ag_gemm: A written into local_shard(M)
    bool recreate = false;   // the op object destroyed and made again before this call
    TpBad bad = TpBad::kNone;
};

struct TpCase {
    TpOp op = TpOp::kAg;
    DType dt = DType::kBF16;
    int world = 1;
    int64_t max_rows = 1;  // ag_gemm / gemm_rs: per rank; gemm_ar: max_m
    int64_t n = 8, k = 8, b_pad = 0;
    int sm_budget = 0, copy_streams = 0, reduce_ctas = 0;
    int64_t chunk_rows = 0;
    ops::GemmRsMode mode = ops::GemmRsMode::kAuto;
    bool f32_partials = false, collective_ar = true;
    bool bad_shape = false;  // a construction with K not a multiple of 8 first: refused on every member
    std::vector<TpCall> calls;

    int64_t max_m() const { return op == TpOp::kAr ? max_rows : max_rows * world; }
    bool invalid() const {
        if (bad_shape) return true;
        for (const TpCall& c : calls)
            if (c.bad != TpBad::kNone) return true;
        return false;
    }
};

std::string describe(const TpCase& c) {
    std::ostringstream os;
    os << tp_op_name(c.op) << " W=" << c.world << " " << dtype_name(c.dt) << " max_m=" << c.max_m() << " n=" << c.n
       << " k=" << c.k << " b_pad=" << c.b_pad << " sm_budget=" << c.sm_budget;
    if (c.op == TpOp::kAg) os << " chunk_rows=" << c.chunk_rows << " copy_streams=" << c.copy_streams;
    if (c.op == TpOp::kRs) {
        os << " mode=" << ops::gemm_rs_mode_name(c.mode) << " chunk_rows=" << c.chunk_rows
           << " reduce_ctas=" << c.reduce_ctas;
    }
    if (c.op == TpOp::kAr) os << " collective_all_reduce=" << c.collective_ar << " reduce_ctas=" << c.reduce_ctas;
    if (c.op != TpOp::kAg) os << " f32_partials=" << c.f32_partials;
    os << " bad_shape=" << c.bad_shape << " calls=[";
    for (size_t j = 0; j < c.calls.size(); ++j) {
        const TpCall& k = c.calls[j];
        os << (j ? "; " : "") << (c.op == TpOp::kAr ? "M=" : "rows/rank=") << k.rows << " pads " << k.a_pad << ","
           << k.c_pad << (k.zero_copy ? " zero_copy" : "") << (k.recreate ? " recreate" : "");
        if (k.bad != TpBad::kNone) os << " invalid=" << tp_bad_name(k.bad);
    }
    os << "]";
    return os.str();
}

TpCase draw_tp(Rng& r, World& w) {
    TpCase c;
    c.world = w.num_ranks();
    const int64_t nr = c.world;
    const bool shared = w.max_ranks_per_device() > 1;
    c.op = static_cast<TpOp>(r.uniform(0, 2));
    c.dt = r.chance(0.6) ? DType::kBF16 : DType::kF16;
    if (c.op == TpOp::kAr) {
        c.max_rows = r.chance(0.65) ? r.log_uniform(1, 64) : r.uniform(65, 192);
    } else {
        c.max_rows = r.chance(0.25) ? r.uniform(1, 8) : r.log_uniform(1, 512);
        if (r.chance(0.15)) c.max_rows = round_up(c.max_rows, 64);
    }
    c.n = r.chance(0.2) ? r.uniform(1, 40) : r.log_uniform(8, 2000);
    if (r.chance(0.2)) c.n = round_up(c.n, 64);
    c.k = 8 * (r.chance(0.2) ? r.uniform(1, 4) : r.log_uniform(1, 200));
    if (c.op == TpOp::kAr && r.chance(0.1)) c.k = r.chance(0.5) ? 2048 * r.uniform(1, 2) : 4096 + 8 * r.uniform(1, 64);
    // Host cost per rank thread: the inputs every rank regenerates, and the reference's products.
    const auto data = [&] {
        const int64_t m = c.max_m();
        switch (c.op) {
            case TpOp::kAg:
                return m * c.k + c.n * c.k;
            case TpOp::kRs:
                return m * c.k + nr * c.max_rows * c.k + nr * c.n * c.k;
            default:
                return nr * (m * c.k + c.n * c.k);
        }
    };
    const auto work = [&] { return c.max_m() * c.n * c.k * (c.op == TpOp::kAg ? 1 : nr); };
    while ((data() > 3'000'000 || work() > 400'000'000) && c.k > 8) c.k = std::max<int64_t>(8, c.k / 16 * 8);
    while ((data() > 3'000'000 || work() > 400'000'000) && c.n > 8) c.n = std::max<int64_t>(8, c.n / 2);
    while ((data() > 3'000'000 || work() > 400'000'000) && c.max_rows > 1)
        c.max_rows = std::max<int64_t>(1, c.max_rows / 2);
    if (r.chance(0.3)) c.b_pad = r.uniform(1, 24);
    // Options, valid for the world (a rank's share of a shared GPU bounds an explicit budget).
    const int share = w.shared_sm_budget();
    if (r.chance(0.25) && (!shared || share >= 3)) c.sm_budget = static_cast<int>(r.uniform(3, shared ? share : 24));
    const int budget = c.sm_budget > 0 ? c.sm_budget : share;
    switch (c.op) {
        case TpOp::kAg:
            if (r.chance(0.3)) c.chunk_rows = r.log_uniform(1, 256);
            c.copy_streams = static_cast<int>(r.uniform(0, std::max<int64_t>(1, nr - 1)));
            break;
        case TpOp::kRs: {
            c.f32_partials = r.chance(0.3);
            // Push where it applies and ranks have GPUs of their own (push calls of ranks sharing a GPU have waited
            // for a peer kernel that never started: kernels/gemm_rs/README.md).
            // A team of one runs the plain GEMM in either mode, needing none of push's conditions (gemm_rs.hpp).
            const bool push_ok = c.world == 1 || (!shared && c.n % 8 == 0 && !c.f32_partials);
            const double m = r.real(0, 1);
            c.mode = push_ok && m < 0.4 ? ops::GemmRsMode::kPush
                     : m < 0.7          ? ops::GemmRsMode::kPull
                                        : ops::GemmRsMode::kAuto;
            if (c.mode != ops::GemmRsMode::kPush && budget >= 3 && r.chance(0.25))
                c.reduce_ctas = static_cast<int>(r.uniform(1, std::min(4, budget - 2)));
            if (r.chance(0.2)) c.chunk_rows = r.pick<int64_t>({64, 128, 256});
            break;
        }
        case TpOp::kAr:
            c.f32_partials = r.chance(0.3);
            c.collective_ar = r.chance(0.8);
            if (r.chance(0.2)) c.reduce_ctas = static_cast<int>(r.uniform(1, std::min(8, budget)));
            break;
    }
    const int calls = static_cast<int>(r.uniform(1, 4));
    for (int j = 0; j < calls; ++j) {
        TpCall k;
        k.rows = j == 0 && r.chance(0.5) ? c.max_rows
                 : r.chance(0.3)         ? r.uniform(1, std::min<int64_t>(3, c.max_rows))
                                         : r.uniform(1, c.max_rows);
        if (r.chance(0.4)) k.a_pad = r.uniform(1, 24);
        if (r.chance(0.4)) k.c_pad = r.uniform(1, 24);
        k.zero_copy = c.op == TpOp::kAg && r.chance(0.25);
        k.recreate = j > 0 && r.chance(0.15);
        c.calls.push_back(k);
    }
    if (r.chance(0.12)) {  // one invalid call (the same on every rank), then a valid one on the same op object
        const size_t j = static_cast<size_t>(r.uniform(0, calls - 1));
        TpBad b = static_cast<TpBad>(r.uniform(1, static_cast<int>(TpBad::kCount) - 1));
        if (b == TpBad::kMNotMultiple && (c.op != TpOp::kRs || c.world == 1)) b = TpBad::kRowsZero;
        c.calls[j].bad = b;
        c.calls[j].zero_copy = false;
        if (j + 1 == c.calls.size()) {
            TpCall k;
            k.rows = r.uniform(1, c.max_rows);
            c.calls.push_back(k);
        }
        c.calls[j + 1].recreate = false;
    }
    c.bad_shape = r.chance(0.04);
    return c;
}

ops::AgGemmOptions ag_options(const TpCase& c) {
    ops::AgGemmOptions o;
    o.chunk_rows = c.chunk_rows;
    o.copy_streams = c.copy_streams;
    o.sm_budget = c.sm_budget;
    return o;
}

ops::GemmRsOptions rs_options(const TpCase& c) {
    ops::GemmRsOptions o;
    o.mode = c.mode;
    if (c.f32_partials) o.partial_dtype = DType::kF32;
    o.chunk_rows = c.chunk_rows;
    o.reduce_ctas = c.reduce_ctas;
    o.sm_budget = c.sm_budget;
    return o;
}

ops::GemmArOptions ar_options(const TpCase& c) {
    ops::GemmArOptions o;
    if (c.f32_partials) o.partial_dtype = DType::kF32;
    o.reduce_ctas = c.reduce_ctas;
    o.sm_budget = c.sm_budget;
    o.collective_all_reduce = c.collective_ar;
    return o;
}

/// The kernels a case's op loads, named by the config its planner picks (as the op's constructor does, with the
/// world's budgets).
std::string tp_kernel_key(const TpCase& c, World& w) {
    const int sms = gemm_test::num_sms();
    const bool one = c.world == 1;
    ops::GemmProblem p;
    p.m = c.max_m();
    p.n = c.n;
    p.k = c.k;
    p.in_dtype = p.out_dtype = c.dt;
    std::ostringstream os;
    os << tp_op_name(c.op) << (one ? " plain " : " ") << dtype_name(c.dt);
    switch (c.op) {
        case TpOp::kAg: {
            int budget = c.sm_budget > 0 ? std::min(c.sm_budget, sms) : w.sm_budget();
            if (!one && w.num_ranks_on_device() > 1) budget = std::min(budget, w.sm_budget() - 1);
            os << " " << ops::format_gemm_config(ops::fused_gemm_config(p, std::max(1, budget)));
            break;
        }
        case TpOp::kRs: {
            const int budget = c.sm_budget > 0 ? std::min(c.sm_budget, sms) : w.shared_sm_budget();
            const bool push =
                !one && ops::detail::resolve_gemm_rs_mode({c.max_m(), c.n, c.k, c.dt}, c.world, rs_options(c),
                                                          w.max_ranks_per_device() > 1) == ops::GemmRsMode::kPush;
            const int reduce = one || push         ? 0
                               : c.reduce_ctas > 0 ? c.reduce_ctas
                                                   : std::max(1, std::min(budget / 8, budget - 1));
            const ops::detail::GemmRsPlan plan = ops::detail::plan_gemm_rs({c.max_m(), c.n, c.k, c.dt}, c.world,
                                                                           std::max(1, budget - reduce), rs_options(c));
            os << (one ? "" : push ? " push" : " pull") << " " << ops::format_gemm_config(plan.configs.front());
            if (!one) os << " partials " << dtype_name(c.f32_partials ? DType::kF32 : c.dt);
            break;
        }
        case TpOp::kAr: {
            const DType out = one ? c.dt : c.f32_partials ? DType::kF32 : c.dt;
            p.out_dtype = out;
            os << "->" << dtype_name(out) << " small-M tiles " << (std::min<int64_t>(c.max_m(), 64) + 15) / 16;
            if (c.max_m() > 64) {
                const int budget = c.sm_budget > 0 ? std::min(c.sm_budget, sms) : w.sm_budget();
                os << " " << ops::format_gemm_config(ops::fused_gemm_config(p, budget));
            }
            break;
        }
    }
    return os.str();
}

/// One op object of a case (AgGemm, GemmRs or GemmAr), made collectively.
struct TpOpObject {
    std::unique_ptr<ops::AgGemm> ag;
    std::unique_ptr<ops::GemmRs> rs;
    std::unique_ptr<ops::GemmAr> ar;
    void make(const TpCase& c, World& w, int64_t k) {
        reset();
        switch (c.op) {
            case TpOp::kAg:
                ag = std::make_unique<ops::AgGemm>(w, ops::AgGemmShape{c.max_m(), c.n, k, c.dt}, ag_options(c));
                break;
            case TpOp::kRs:
                rs = std::make_unique<ops::GemmRs>(w, ops::GemmRsShape{c.max_m(), c.n, k, c.dt}, rs_options(c));
                break;
            case TpOp::kAr:
                ar = std::make_unique<ops::GemmAr>(w, ops::GemmArShape{c.max_m(), c.n, k, c.dt}, ar_options(c));
                break;
        }
    }
    void reset() {
        ag.reset();
        rs.reset();
        ar.reset();
    }
    void run(const TensorView& a, const TensorView& b, const TensorView& c, cudaStream_t st) {
        if (ag) ag->run(a, b, c, st);
        if (rs) rs->run(a, b, c, st);
        if (ar) ar->run(a, b, c, st);
    }
};

/// Hashes of each rank's C of a gemm_ar call (bit-identical on every member), shared by a world's rank threads.
struct TpShared {
    std::vector<uint64_t> hashes = std::vector<uint64_t>(8, 0);
};

uint64_t hash_rows(const HostMat& h) {
    uint64_t x = 1469598103934665603ull;
    for (int64_t r = 0; r < h.rows; ++r)
        for (int64_t c = 0; c < h.cols; ++c) x = (x ^ h.bits[static_cast<size_t>(r * h.ld + c)]) * 1099511628211ull;
    return x;
}

std::string run_tp(const TpCase& c, uint64_t seed, World& w, cudaStream_t st, TpShared& shared) {
    const int nr = c.world, me = w.rank();
    const int64_t max_m = c.max_m(), n = c.n, k = c.k;
    const char* op_name = tp_op_name(c.op);
    // One arena: a, b and c regions, each large enough for any view a call (valid or not) makes, so that a call that
    // wrongly accepted an invalid view stays inside it.
    const int64_t a_rows = (c.op == TpOp::kAg ? c.max_rows + 1 : max_m + nr) + 1;
    const int64_t c_rows = (c.op == TpOp::kAg ? max_m + nr : c.op == TpOp::kRs ? c.max_rows + 1 : max_m + 1) + 1;
    const size_t region = static_cast<size_t>(
        round_up(std::max({a_rows * (k + 48), (n + 2) * (k + 48 + c.b_pad), c_rows * (n + 48)}) * 4 + 4096, 256));
    Arena arena(3 * region + kGuard);
    uint8_t* const a_base = arena.at(0);
    uint8_t* const b_base = arena.at(region);
    uint8_t* const c_base = arena.at(2 * region);
    check_cuda(cudaMemsetAsync(arena.ptr, 0xFF, arena.bytes, st), "poison");
    check_cuda(cudaStreamSynchronize(st), "poison");
    w.barrier();  // every rank's memory is made before any op waits for a peer

    TpOpObject op;
    std::string what;
    // A failed check is recorded and the case goes on: every rank keeps making the same collective calls.
    const auto fail = [&](const std::string& s) {
        if (what.empty()) what = s;
    };
    if (c.bad_shape) {  // K not a multiple of 8: every member refuses the shape
        const std::string refused = expect_refused(op_name, [&] { op.make(c, w, k + 4); });
        w.barrier();
        if (!refused.empty()) {
            op.reset();
            return "a bad shape at construction: " + refused;
        }
    }
    op.make(c, w, k);
    const int64_t ldb = tp_test::ld_for(k, c.b_pad);
    for (size_t j = 0; j < c.calls.size(); ++j) {
        const TpCall& call = c.calls[j];
        const int call_no = static_cast<int>(j);
        if (call.recreate) op.make(c, w, k);
        const int64_t rows = call.rows;
        const int64_t m = c.op == TpOp::kAr ? rows : rows * nr;
        const int64_t lda = tp_test::ld_for(k, call.a_pad), ldc = tp_test::ld_for(n, call.c_pad);
        const int64_t out_rows = c.op == TpOp::kRs ? rows : m;
        const std::string at = "call " + std::to_string(j) + " (M " + std::to_string(m) + ")";
        // Inputs: every rank's pieces this rank's reference needs, and this rank's own.
        HostMat a_own, b_own;
        std::vector<HostMat> ref_a, ref_b;  // per rank: the A rows and the B the reference adds
        switch (c.op) {
            case TpOp::kAg: {
                HostMat full(m, k, k, c.dt);
                for (int q = 0; q < nr; ++q) {
                    const HostMat shard = hashed(rows, k, k, c.dt, seed_for(seed, 0, q, call_no));
                    std::copy(shard.bits.begin(), shard.bits.end(), full.bits.begin() + q * rows * k);
                    if (q == me) a_own = with_ld(shard, lda);
                }
                ref_a.push_back(std::move(full));
                b_own = hashed(n, k, ldb, c.dt, seed_for(seed, 1, me, call_no));
                ref_b.push_back(b_own);
                break;
            }
            case TpOp::kRs: {
                a_own = HostMat(m, k, lda, c.dt);
                for (int s = 0; s < nr; ++s) {  // this rank's A: block s from its own seed
                    const HostMat blk = hashed(rows, k, k, c.dt, seed_for(seed, 100 + s, me, call_no));
                    for (int64_t i = 0; i < rows; ++i)
                        std::copy_n(blk.bits.begin() + i * k, k, a_own.bits.begin() + (s * rows + i) * lda);
                }
                for (int q = 0; q < nr; ++q) {  // block `me` of every rank's A: the rows of this rank's C
                    ref_a.push_back(hashed(rows, k, k, c.dt, seed_for(seed, 100 + me, q, call_no)));
                    ref_b.push_back(hashed(n, k, k, c.dt, seed_for(seed, 1, q, call_no)));
                }
                b_own = with_ld(ref_b[static_cast<size_t>(me)], ldb);
                break;
            }
            case TpOp::kAr:
                for (int q = 0; q < nr; ++q) {
                    ref_a.push_back(hashed(m, k, k, c.dt, seed_for(seed, 0, q, call_no)));
                    ref_b.push_back(hashed(n, k, k, c.dt, seed_for(seed, 1, q, call_no)));
                }
                a_own = with_ld(ref_a[static_cast<size_t>(me)], lda);
                b_own = with_ld(ref_b[static_cast<size_t>(me)], ldb);
                break;
        }
        HostMat c_host(out_rows, n, ldc, c.dt);
        tp_test::poison(c_host);
        check_cuda(cudaMemsetAsync(c_base, 0xFF, region, st), "poison c");
        to_dev(c_base, c_host.bits.data(), c_host.bytes(), st);
        to_dev(b_base, b_own.bits.data(), b_own.bytes(), st);
        TensorView av(a_base, c.dt, {a_own.rows, k}, {lda, 1});
        if (call.zero_copy) {
            av = op.ag->local_shard(m);
            const HostMat packed = with_ld(a_own, k);
            to_dev(av.data, packed.bits.data(), packed.bytes(), st);
        } else {
            to_dev(a_base, a_own.bits.data(), a_own.bytes(), st);
        }
        TensorView bv(b_base, c.dt, {n, k}, {ldb, 1});
        TensorView cv(c_base, c.dt, {out_rows, n}, {ldc, 1});
        const size_t c_span = c_host.bytes() + kGuard;

        if (call.bad != TpBad::kNone) {
            // The same mutation on every rank: every member refuses before launching anything.
            const int64_t bad_a_rows = c.op == TpOp::kAg ? rows : m;
            switch (call.bad) {
                case TpBad::kRowsZero:
                    av = TensorView(a_base, c.dt, {0, k}, {lda, 1});
                    cv = TensorView(c_base, c.dt, {0, n}, {ldc, 1});
                    break;
                case TpBad::kRowsTooMany: {
                    const int64_t ar = c.op == TpOp::kAg ? c.max_rows + 1 : c.op == TpOp::kRs ? max_m + nr : max_m + 1;
                    av = TensorView(a_base, c.dt, {ar, k}, {lda, 1});
                    const int64_t cr = c.op == TpOp::kAg ? ar * nr : c.op == TpOp::kRs ? ar / nr : ar;
                    cv = TensorView(c_base, c.dt, {cr, n}, {ldc, 1});
                    break;
                }
                case TpBad::kMNotMultiple:
                    av = TensorView(a_base, c.dt, {m + 1, k}, {lda, 1});
                    break;
                case TpBad::kKMismatch:
                    av = TensorView(a_base, c.dt, {bad_a_rows, k + 8}, {std::max(lda, tp_test::ld_for(k + 8)), 1});
                    break;
                case TpBad::kDtypeDiffers:
                    av.dtype = c.dt == DType::kBF16 ? DType::kF16 : DType::kBF16;
                    break;
                case TpBad::kAllF32:
                    av.dtype = bv.dtype = cv.dtype = DType::kF32;
                    break;
                case TpBad::kBShape:
                    bv = rows % 2 ? TensorView(b_base, c.dt, {n + 1, k}, {ldb, 1})
                                  : TensorView(b_base, c.dt, {n, k + 8}, {std::max(ldb, tp_test::ld_for(k + 8)), 1});
                    break;
                case TpBad::kCShape:
                    cv = rows % 2
                             ? TensorView(c_base, c.dt, {out_rows + 1, n}, {ldc, 1})
                             : TensorView(c_base, c.dt, {out_rows, n + 1}, {std::max(ldc, tp_test::ld_for(n + 1)), 1});
                    break;
                case TpBad::kCStride:
                    if (out_rows >= 2) {  // a one-row view may carry any row stride: misalign its base instead
                        cv = TensorView(c_base, c.dt, {out_rows, n}, {tp_test::ld_for(n) + 1 + 2 * (n % 3), 1});
                        break;
                    }
                    [[fallthrough]];
                case TpBad::kCBase:
                    cv.data = c_base + 2 * (1 + rows % 7);
                    break;
                case TpBad::kCOverlapsA:
                    cv.data = av.data;
                    break;
                case TpBad::kANot2D:
                    av = TensorView(av.data, c.dt, {1, bad_a_rows, k});
                    break;
                case TpBad::kAInnerStride:
                    av = TensorView(av.data, c.dt, {bad_a_rows, k}, {2 * lda, 2});
                    break;
                case TpBad::kANull:
                    av.data = nullptr;
                    break;
                default:
                    return "no such invalid kind";
            }
            const std::string refused = expect_refused(op_name, [&] { op.run(av, bv, cv, st); });
            if (!refused.empty()) {  // the call ran (on every rank alike): end its work, then report
                fail(at + ", " + tp_bad_name(call.bad) + ": " + refused);
                try {
                    w.sync_and_check(st);
                } catch (const std::exception& e) {
                    fail(std::string("then: ") + e.what());
                }
                w.barrier();
                break;
            }
            check_cuda(cudaStreamSynchronize(st), "after a refused call");
            check_cuda(cudaGetLastError(), "after a refused call");
            const std::vector<uint8_t> after = from_dev(c_base, c_span, st);
            if (std::memcmp(after.data(), c_host.bits.data(), c_host.bytes()) != 0 ||
                !poison_intact(after.data() + c_host.bytes(), kGuard)) {
                fail(at + ", " + tp_bad_name(call.bad) + ": a refused call wrote into c");
            }
            w.barrier();
            continue;
        }

        // A valid call: poison the gathered buffer too (ag_gemm: no peer reads it between calls).
        if (c.op == TpOp::kAg && !call.zero_copy) {
            const TensorView g = op.ag->gathered(m);
            check_cuda(cudaMemsetAsync(g.data, 0xFF, static_cast<size_t>(g.size_bytes()), st), "poison gathered");
            check_cuda(cudaStreamSynchronize(st), "poison gathered");
        }
        w.barrier();  // every rank's inputs are in place
        op.run(av, bv, cv, st);
        w.sync_and_check(st);
        const std::vector<uint8_t> raw = from_dev(c_base, c_span, st);
        HostMat got(out_rows, n, ldc, c.dt);
        std::memcpy(got.bits.data(), raw.data(), got.bytes());
        if (!poison_intact(raw.data() + got.bytes(), kGuard)) fail(at + ": wrote past c's last row");
        for (int64_t i = 0; i < out_rows && what.empty(); ++i) {
            for (int64_t col = 0; col < n; ++col) {
                if (got.bits[static_cast<size_t>(i * ldc + col)] == 0xFFFF) {
                    fail(at + ": c[" + std::to_string(i) + ", " + std::to_string(col) + "] kept its poison");
                    break;
                }
            }
        }
        const std::vector<int64_t> check = tp_test::rows_to_check(
            out_rows, c.op == TpOp::kAg ? rows : std::max<int64_t>(1, out_rows),
            static_cast<double>(n * k * (c.op == TpOp::kAg ? 1 : nr)), seed_for(seed, 7, me, call_no));
        tp_test::Reference ref(static_cast<int64_t>(check.size()), n);
        for (size_t q = 0; q < ref_a.size(); ++q) ref.add(ref_a[q], 0, check, ref_b[q]);
        const DType partial = c.f32_partials ? DType::kF32 : c.dt;
        const tp_test::ErrorModel model =
            c.op == TpOp::kAg ? tp_test::ErrorModel::gemm(c.dt) : tp_test::ErrorModel::tp_sum(c.dt, partial, nr);
        const std::string bad = tp_test::compare(got, check, ref, model);
        if (!bad.empty()) fail(at + ": " + bad);
        if (c.op == TpOp::kAg) {  // the gathered A, bit for bit
            const TensorView g = op.ag->gathered(m);
            const std::vector<uint8_t> gb = from_dev(g.data, static_cast<size_t>(m * k * 2), st);
            if (std::memcmp(gb.data(), ref_a[0].bits.data(), gb.size()) != 0) fail(at + ": gathered(M) differs from A");
        }
        if (c.op == TpOp::kAr) {  // bit-identical on every member
            shared.hashes[static_cast<size_t>(me)] = hash_rows(got);
            w.barrier();
            for (int q = 0; q < nr; ++q) {
                if (shared.hashes[static_cast<size_t>(q)] != shared.hashes[static_cast<size_t>(me)]) {
                    fail(at + ": c differs from rank " + std::to_string(q) + "'s");
                }
            }
        }
        w.barrier();  // every rank read its results (and the hashes) before the next call
    }
    op.reset();
    w.sync_and_check(st);
    return what;
}

TEST_F(GpuFuzz, TpFusedGemm) {
    FuzzRun run("TpFusedGemm", 15, 100000, 6);
    // Small staging regions for GemmAr's collective all-reduce: the heaps of 8 ranks on one GPU stay small.
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::string("4M"));
    auto shared = std::make_shared<TpShared>();
    fuzz_worlds<TpCase>(
        run, test::test_options(192ull << 20), draw_tp, tp_kernel_key, [](const TpCase& c) { return describe(c); },
        [](const TpCase& c) { return c.invalid(); }, [](World& w) { return std::make_unique<StreamRank>(w); },
        [shared](const TpCase& c, uint64_t seed, World& w, StreamRank& rk) {
            return run_tp(c, seed, w, rk.st, *shared);
        });
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
