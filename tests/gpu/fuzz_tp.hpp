// SPDX-License-Identifier: MIT
// The fused tensor-parallel GEMM ops' fuzz cases (AgGemm, GemmRs, GemmAr) on any team: GpuFuzz.TpFusedGemm (ranks as
// threads, tests/gpu/test_fuzz_tp.cpp, worlds 1..8) and MultiNodeFuzz.FusedGemm (processes on teams that span virtual
// nodes, tests/dist/test_multinode_fuzz.cpp). A case is one op object of a random shape and options and 1-4 calls with
// fresh inputs (functions of the seed and the TEAM rank, so every member regenerates the inputs its reference needs),
// poisoned outputs, padded strides, A written in place (AgGemm's local_shard), the object made again between calls,
// and about an eighth of the cases one invalid call (the same on every member: refused naming the op before anything
// is launched, C untouched, then a valid call on the same object). Results against an fp64 host reference of the
// unfused computation (tp_reference.hpp's rounding model); AgGemm's gathered A bit for bit; GemmAr's C bit-identical on
// every member. Across nodes GemmAr is refused at construction (every member load/store reachable), and GemmRs's node
// sums round once more.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_harness.hpp"
#include "support/gemm_testing.hpp"
#include "support/tp_reference.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/world.hpp"

namespace weft::fuzz_test {

using tp_test::HostMat;

/// Uniform values in [-1, 1) rounded to `t`, from a counter hash (fast: every rank regenerates every rank's inputs).
inline void fill_hashed(HostMat& h, uint64_t seed) {
    for (int64_t r = 0; r < h.rows; ++r) {
        for (int64_t c = 0; c < h.cols; ++c) {
            const uint64_t x = mix64(seed ^ mix64(static_cast<uint64_t>(r * h.cols + c) + 0x51ed27ull));
            h.set(r, c, static_cast<float>(static_cast<double>(x >> 11) * 0x1p-52 - 1.0));
        }
    }
}

inline HostMat hashed(int64_t rows, int64_t cols, int64_t ld, DType t, uint64_t seed) {
    HostMat h(rows, cols, ld, t);
    fill_hashed(h, seed);
    return h;
}

/// A copy of `src` with another row stride.
inline HostMat with_ld(const HostMat& src, int64_t ld) {
    HostMat h(src.rows, src.cols, ld, src.dtype);
    for (int64_t r = 0; r < src.rows; ++r) {
        std::copy_n(src.bits.begin() + r * src.ld, src.cols, h.bits.begin() + r * ld);
    }
    return h;
}

inline uint64_t seed_for(uint64_t base, int role, int rank, int call) {
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
inline const char* tp_op_name(TpOp o) { return o == TpOp::kAg ? "ag_gemm" : o == TpOp::kRs ? "gemm_rs" : "gemm_ar"; }

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

inline const char* tp_bad_name(TpBad b) {
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
    int nodes = 1;  // nodes the team spans (GemmRs's node sums round once more; GemmAr refuses a team of several)
    int64_t max_rows = 1;  // ag_gemm / gemm_rs: per rank; gemm_ar: max_m
    int64_t n = 8, k = 8, b_pad = 0;
    int sm_budget = 0, copy_streams = 0, reduce_ctas = 0;
    int64_t chunk_rows = 0;
    ops::GemmRsMode mode = ops::GemmRsMode::kAuto;
    bool f32_partials = false, collective_ar = true;
    bool bad_shape = false;  // a construction with K not a multiple of 8 first: refused on every member
    std::vector<TpCall> calls;

    int64_t max_m() const { return op == TpOp::kAr ? max_rows : max_rows * world; }
    /// GemmAr on a team that spans nodes: its constructor refuses (every member load/store reachable, gemm_ar.hpp).
    bool refused_across_nodes() const { return op == TpOp::kAr && nodes > 1 && world > 1; }
    bool invalid() const {
        if (bad_shape || refused_across_nodes()) return true;
        for (const TpCall& c : calls)
            if (c.bad != TpBad::kNone) return true;
        return false;
    }
};

inline std::string describe(const TpCase& c) {
    std::ostringstream os;
    os << tp_op_name(c.op) << " W=" << c.world;
    if (c.nodes > 1) os << " on " << c.nodes << " nodes";
    os << " " << dtype_name(c.dt) << " max_m=" << c.max_m() << " n=" << c.n << " k=" << c.k << " b_pad=" << c.b_pad
       << " sm_budget=" << c.sm_budget;
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

inline TpCase draw_tp(Rng& r, World& w, const Team& team) {
    TpCase c;
    c.world = team.num_ranks();
    c.nodes = team.num_nodes();
    const int64_t nr = c.world;
    const bool shared = w.max_ranks_per_device() > 1;  // as the ops decide: the World's ranks, not the team's
    c.op = static_cast<TpOp>(r.uniform(0, 2));
    // Across nodes GemmAr is refused at construction: a few of those cases, AgGemm and GemmRs otherwise.
    if (c.op == TpOp::kAr && c.nodes > 1 && !r.chance(0.15)) c.op = r.chance(0.5) ? TpOp::kAg : TpOp::kRs;
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

inline ops::AgGemmOptions ag_options(const TpCase& c) {
    ops::AgGemmOptions o;
    o.chunk_rows = c.chunk_rows;
    o.copy_streams = c.copy_streams;
    o.sm_budget = c.sm_budget;
    return o;
}

inline ops::GemmRsOptions rs_options(const TpCase& c) {
    ops::GemmRsOptions o;
    o.mode = c.mode;
    o.push_on_shared_gpus = true;  // the fuzzer's ranks share one GPU
    if (c.f32_partials) o.partial_dtype = DType::kF32;
    o.chunk_rows = c.chunk_rows;
    o.reduce_ctas = c.reduce_ctas;
    o.sm_budget = c.sm_budget;
    return o;
}

inline ops::GemmArOptions ar_options(const TpCase& c) {
    ops::GemmArOptions o;
    if (c.f32_partials) o.partial_dtype = DType::kF32;
    o.reduce_ctas = c.reduce_ctas;
    o.sm_budget = c.sm_budget;
    o.collective_all_reduce = c.collective_ar;
    return o;
}

/// The kernels a case's op loads, named by the config its planner picks (as the op's constructor does, with the
/// world's budgets).
inline std::string tp_kernel_key(const TpCase& c, World& w, const Team& team) {
    const int sms = gemm_test::num_sms();
    const bool one = c.world == 1;
    ops::GemmProblem p;
    p.m = c.max_m();
    p.n = c.n;
    p.k = c.k;
    p.in_dtype = p.out_dtype = c.dt;
    // Across nodes the default budgets leave SMs to the network (kNetworkSms in src/ops/ag_gemm.cpp, gemm_rs.cpp) and
    // GemmRs's node stage is the one-node op over the node's members.
    const int network_sms = c.nodes > 1 ? 8 : 0;
    std::ostringstream os;
    if (c.refused_across_nodes()) return "none (refused across nodes)";
    os << tp_op_name(c.op) << (one ? " plain " : " ") << dtype_name(c.dt);
    switch (c.op) {
        case TpOp::kAg: {
            int budget = c.sm_budget > 0 ? std::min(c.sm_budget, sms) : w.sm_budget() - network_sms;
            if (!one && w.num_ranks_on_device() > 1) budget = std::min(budget, w.sm_budget() - 1);
            os << " " << ops::format_gemm_config(ops::fused_gemm_config(p, std::max(1, budget)));
            break;
        }
        case TpOp::kRs: {
            const int budget = c.sm_budget > 0 ? std::min(c.sm_budget, sms) : w.shared_sm_budget() - network_sms;
            const int stage = c.nodes > 1 ? std::max(1, team.ranks_per_node()) : c.world;  // the node stage's ranks
            const bool push =
                stage > 1 && ops::detail::resolve_gemm_rs_mode({c.max_m(), c.n, c.k, c.dt}, stage, rs_options(c),
                                                               w.max_ranks_per_device() > 1) == ops::GemmRsMode::kPush;
            const int reduce = one || push         ? 0
                               : c.reduce_ctas > 0 ? c.reduce_ctas
                                                   : std::max(1, std::min(budget / 8, budget - 1));
            const ops::detail::GemmRsPlan plan = ops::detail::plan_gemm_rs({c.max_m(), c.n, c.k, c.dt}, stage,
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
    void make(const TpCase& c, const Team& w, int64_t k) {
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

inline uint64_t hash_rows(const HostMat& h) {
    uint64_t x = 1469598103934665603ull;
    for (int64_t r = 0; r < h.rows; ++r)
        for (int64_t c = 0; c < h.cols; ++c) x = (x ^ h.bits[static_cast<size_t>(r * h.ld + c)]) * 1099511628211ull;
    return x;
}

inline std::string run_tp(const TpCase& c, uint64_t seed, World& w, const Team& team, cudaStream_t st) {
    const int nr = c.world, me = team.rank();
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
    team.barrier();  // every rank's memory is made before any op waits for a peer

    TpOpObject op;
    std::string what;
    // A failed check is recorded and the case goes on: every rank keeps making the same collective calls.
    const auto fail = [&](const std::string& s) {
        if (what.empty()) what = s;
    };
    if (c.refused_across_nodes()) {  // every member refuses, naming the op, before any kernel runs
        const std::string refused = expect_refused(op_name, [&] { op.make(c, team, k); });
        team.barrier();
        op.reset();
        return refused.empty() ? "" : "gemm_ar on a team that spans nodes: " + refused;
    }
    if (c.bad_shape) {  // K not a multiple of 8: every member refuses the shape
        const std::string refused = expect_refused(op_name, [&] { op.make(c, team, k + 4); });
        team.barrier();
        if (!refused.empty()) {
            op.reset();
            return "a bad shape at construction: " + refused;
        }
    }
    op.make(c, team, k);
    const int64_t ldb = tp_test::ld_for(k, c.b_pad);
    for (size_t j = 0; j < c.calls.size(); ++j) {
        const TpCall& call = c.calls[j];
        const int call_no = static_cast<int>(j);
        if (call.recreate) op.make(c, team, k);
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
                team.barrier();
                break;
            }
            check_cuda(cudaStreamSynchronize(st), "after a refused call");
            check_cuda(cudaGetLastError(), "after a refused call");
            const std::vector<uint8_t> after = from_dev(c_base, c_span, st);
            if (std::memcmp(after.data(), c_host.bits.data(), c_host.bytes()) != 0 ||
                !poison_intact(after.data() + c_host.bytes(), kGuard)) {
                fail(at + ", " + tp_bad_name(call.bad) + ": a refused call wrote into c");
            }
            team.barrier();
            continue;
        }

        // A valid call: poison the gathered buffer too (ag_gemm: no peer reads it between calls).
        if (c.op == TpOp::kAg && !call.zero_copy) {
            const TensorView g = op.ag->gathered(m);
            check_cuda(cudaMemsetAsync(g.data, 0xFF, static_cast<size_t>(g.size_bytes()), st), "poison gathered");
            check_cuda(cudaStreamSynchronize(st), "poison gathered");
        }
        team.barrier();  // every rank's inputs are in place
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
        tp_test::ErrorModel model =
            c.op == TpOp::kAg ? tp_test::ErrorModel::gemm(c.dt) : tp_test::ErrorModel::tp_sum(c.dt, partial, nr);
        // Across nodes each node's sum is rounded into the output dtype once before it crosses the network
        // (docs/multinode.md, "GEMM+ReduceScatter across nodes", Precision).
        if (c.op == TpOp::kRs && c.nodes > 1 && nr > 1) model.u_partial += tp_test::unit_roundoff(c.dt);
        const std::string bad = tp_test::compare(got, check, ref, model);
        if (!bad.empty()) fail(at + ": " + bad);
        if (c.op == TpOp::kAg) {  // the gathered A, bit for bit
            const TensorView g = op.ag->gathered(m);
            const std::vector<uint8_t> gb = from_dev(g.data, static_cast<size_t>(m * k * 2), st);
            if (std::memcmp(gb.data(), ref_a[0].bits.data(), gb.size()) != 0) fail(at + ": gathered(M) differs from A");
        }
        if (c.op == TpOp::kAr) {  // bit-identical on every member
            const uint64_t mine = hash_rows(got);
            std::vector<uint8_t> bytes(8);
            std::memcpy(bytes.data(), &mine, 8);
            const std::vector<std::vector<uint8_t>> all = team.all_gather("weft.test.fuzz_tp.c_hash", bytes);
            for (int q = 0; q < nr; ++q) {
                if (all[sz(q)] != bytes) fail(at + ": c differs from team rank " + std::to_string(q) + "'s");
            }
        }
        team.barrier();  // every rank read its results (and the hashes) before the next call
    }
    op.reset();
    w.sync_and_check(st);
    return what;
}

}  // namespace weft::fuzz_test
