// SPDX-License-Identifier: MIT
// GPU tests of weft::ops::GemmRs (GEMM+ReduceScatter) with ranks as threads sharing the visible GPUs: an fp64
// CPU reference of sum_s A_s B_s^T on each rank's rows, awkward shapes (segments not a multiple of the
// tile, ragged N), world sizes 1, 2, 3, 4, 8, bf16 and f16, bf16 and fp32 partials, poisoned outputs, fresh
// data on every call, repeated calls without reset, a CUDA-graph replay, ranks that call with different M
// (diagnosed on every rank), and random cases at world sizes 5, 6 and 7 (push and pull).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "support/gemm_testing.hpp"
#include "support/runtime_checks.hpp"
#include "tp_test_util.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

using namespace tp_test;

struct RsCase {
    int64_t rows;  // per rank (M / W)
    int64_t n, k;  // k: this rank's K
    int64_t chunk_rows = 0;
    int64_t c_pad = 0;
    bool f32_partials = false;
    int reduce_ctas = 0;
    int sm_budget = 0;
    bool autotune = false;
    ops::GemmRsMode mode = ops::GemmRsMode::kAuto;  // auto: push where it applies and ranks have GPUs of their own
    std::optional<GemmConfig> config = std::nullopt;  // forced (its dtypes set per run to the call's)
};

std::string describe(const RsCase& c, DType dt, int w, uint64_t seed) {
    std::ostringstream os;
    os << "gemm_rs W=" << w << " rows/rank " << c.rows << " n " << c.n << " k " << c.k << " " << dtype_name(dt)
       << " chunk_rows " << c.chunk_rows << " c_pad " << c.c_pad << (c.f32_partials ? " f32 partials" : "")
       << " reduce_ctas " << c.reduce_ctas << " sm_budget " << c.sm_budget << (c.autotune ? " autotune" : "")
       << " mode " << ops::gemm_rs_mode_name(c.mode)
       << (c.config ? " forced " + ops::gemm_candidate_name(*c.config) : std::string()) << " seed " << seed;
    return os.str();
}

enum class Mode { kEager, kGraph };

/// One case on one rank: `calls` calls with fresh data; eager calls vary M (the second call uses about 2/3
/// of the rows per rank), graph replays keep the captured M.
void run_case(World& w, const RsCase& cs, DType dt, int calls, Mode mode, uint64_t base, Failures& f) {
    const int nr = w.num_ranks(), me = w.rank();
    const int64_t max_m = cs.rows * nr;
    const std::string what = describe(cs, dt, nr, base) + " rank " + std::to_string(me);
    ops::GemmRsOptions opt;
    opt.chunk_rows = cs.chunk_rows;
    if (cs.f32_partials) opt.partial_dtype = DType::kF32;
    opt.reduce_ctas = cs.reduce_ctas;
    opt.sm_budget = cs.sm_budget;
    opt.autotune = cs.autotune;
    opt.mode = cs.mode;
    opt.push_on_shared_gpus = true;  // the push kernels' tests run with ranks sharing one GPU
    opt.config = cs.config;
    if (opt.config) {
        opt.config->in_dtype = dt;
        opt.config->out_dtype = cs.f32_partials && nr > 1 ? DType::kF32 : dt;
    }

    const int64_t ldk = ld_for(cs.k), ldc = ld_for(cs.n, cs.c_pad);
    DevBuf a_dev(static_cast<size_t>(max_m * ldk * 2)), b_dev(static_cast<size_t>(cs.n * ldk * 2)),
        c_dev(static_cast<size_t>(cs.rows * ldc * 2));
    cudaStream_t st = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    {
        ops::GemmRs op(w, {max_m, cs.n, cs.k, dt}, opt);
        // The error model below follows the op's partials: they must be the ones asked for.
        EXPECT_EQ(op.partial_dtype(), cs.f32_partials ? DType::kF32 : dt) << what;
        cudaGraphExec_t graph_exec = nullptr;
        for (int call = 0; call < calls; ++call) {
            const int64_t rows = mode == Mode::kEager && call == 1 ? std::max<int64_t>(1, cs.rows * 2 / 3) : cs.rows;
            const int64_t m = rows * nr;
            const std::string at = what + " call " + std::to_string(call) + " M " + std::to_string(m);
            // Every rank's A and B (the reference needs all of them); this rank uploads its own.
            std::vector<HostMat> as, bs;
            for (int r = 0; r < nr; ++r) {
                as.emplace_back(m, cs.k, ldk, dt);
                as.back().fill_random(seed_of(base, 0, r, call));
                bs.emplace_back(cs.n, cs.k, ldk, dt);
                bs.back().fill_random(seed_of(base, 1, r, call));
            }
            upload(as[static_cast<size_t>(me)], a_dev.ptr, st);
            upload(bs[static_cast<size_t>(me)], b_dev.ptr, st);
            HostMat c(rows, cs.n, ldc, dt);
            poison(c);
            upload(c, c_dev.ptr, st);
            const TensorView av = view(as[static_cast<size_t>(me)], a_dev.ptr);
            const TensorView bv = view(bs[static_cast<size_t>(me)], b_dev.ptr), cv = view(c, c_dev.ptr);
            if (mode == Mode::kEager || call == 0) {
                op.run(av, bv, cv, st);
                if (mode == Mode::kGraph) {
                    w.sync_and_check(st);
                    cudaGraph_t graph = nullptr;
                    WEFT_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                    op.run(av, bv, cv, st);
                    WEFT_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
                    WEFT_CUDA_CHECK(cudaGraphInstantiate(&graph_exec, graph, 0));
                    WEFT_CUDA_CHECK(cudaGraphDestroy(graph));
                    WEFT_CUDA_CHECK(cudaGraphLaunch(graph_exec, st));
                }
            } else {
                WEFT_CUDA_CHECK(cudaGraphLaunch(graph_exec, st));
            }
            w.sync_and_check(st);

            download(c, c_dev.ptr, st);
            const std::vector<int64_t> check_rows =
                rows_to_check(rows, rows, static_cast<double>(cs.n * cs.k * nr), seed_of(base, 2, me, call));
            Reference ref(static_cast<int64_t>(check_rows.size()), cs.n);
            for (int r = 0; r < nr; ++r) {
                ref.add(as[static_cast<size_t>(r)], me * rows, check_rows, bs[static_cast<size_t>(r)]);
            }
            const std::string bad =
                compare(c, check_rows, ref, ErrorModel::tp_sum(dt, op.partial_dtype(), nr));
            if (!bad.empty()) f.add(at + ": " + bad);
        }
        if (graph_exec != nullptr) WEFT_CUDA_CHECK(cudaGraphExecDestroy(graph_exec));
    }
    WEFT_CUDA_CHECK(cudaStreamDestroy(st));
}

constexpr ops::GemmRsMode kPush = ops::GemmRsMode::kPush;

const std::vector<RsCase>& cases() {
    static const std::vector<RsCase> v = {
        {100, 200, 72, 0, 8},                // segments shorter than a tile; padded c (auto)
        {1, 8, 8, 0, 0, false, 0, 0, false, kPush},               // one row per rank
        {300, 1100, 256, 128, 0, false, 1},  // several counters per segment, ragged N, one reduction CTA (pull)
        {256, 264, 512, 0, 0, true},         // fp32 partials (pull)
        {200, 520, 136, 0, 16, false, 0, 4, false, kPush},        // a budget of 4 SMs (push: all for the GEMM)
        {300, 1104, 256, 128, 0, false, 0, 0, false, kPush},      // several counters per segment, short last tile
        {100, 200, 72, 0, 8, false, 0, 0, false, kPush},          // case 0 in push mode
        {100, 200, 72, 0, 8, false, 0, 0, false, ops::GemmRsMode::kPull},  // case 0 in pull mode
        // Ping-pong (each consumer warpgroup adds to, stores and signals its own tiles) on few SMs: several tiles per
        // CTA; 128x192 and 64x128, push and pull.
        {300, 1104, 256, 128, 0, false, 0, 4, false, kPush,
         gemm_candidate(9, DType::kBF16, DType::kBF16, BLayout::kNK)},
        {300, 1100, 256, 128, 0, false, 1, 5, false, ops::GemmRsMode::kPull,
         gemm_candidate(12, DType::kBF16, DType::kBF16, BLayout::kNK)},
        {256, 1024, 512, 0, 0, false, 0, 3, false, kPush, gemm_candidate(12, DType::kBF16, DType::kBF16, BLayout::kNK)},
    };
    return v;
}

void run_world(int num_ranks, const std::vector<RsCase>& cs, const std::vector<DType>& dtypes, int calls,
               Mode mode = Mode::kEager, uint64_t base = fresh_seed()) {
    Failures f;
    test::run_ranks(
        num_ranks,
        [&](World& w) {
            for (DType dt : dtypes) {
                for (const RsCase& c : cs) run_case(w, c, dt, calls, mode, base, f);
            }
        },
        test::test_options(256ull << 20));
    f.report();
}

/// `calls` calls enqueued back to back on one stream with no host synchronisation between them, as a
/// training or inference loop does (and as the autotuner's trials did before they went in lockstep): the
/// ranks drift up to a call apart, so a GEMM may wait on the device for a peer's previous reduction while
/// that peer still runs it. Every call has fresh A and its own poisoned C; one synchronisation at the end.
void run_back_to_back(World& w, const RsCase& cs, DType dt, int calls, uint64_t base, Failures& f) {
    const int nr = w.num_ranks(), me = w.rank();
    const int64_t m = cs.rows * nr;
    const std::string what = describe(cs, dt, nr, base) + " back to back, rank " + std::to_string(me);
    ops::GemmRsOptions opt;
    opt.chunk_rows = cs.chunk_rows;
    opt.reduce_ctas = cs.reduce_ctas;
    opt.sm_budget = cs.sm_budget;
    opt.mode = cs.mode;
    opt.push_on_shared_gpus = true;  // the push kernels' tests run with ranks sharing one GPU
    const int64_t ldk = ld_for(cs.k), ldc = ld_for(cs.n, cs.c_pad);
    std::vector<std::vector<HostMat>> as(static_cast<size_t>(calls));  // [call][rank]
    std::vector<HostMat> bs, cs_host;
    for (int r = 0; r < nr; ++r) {
        bs.emplace_back(cs.n, cs.k, ldk, dt);
        bs.back().fill_random(seed_of(base, 1, r, 0));
    }
    std::vector<std::unique_ptr<DevBuf>> a_dev, c_dev;
    DevBuf b_dev(static_cast<size_t>(cs.n * ldk * 2));
    cudaStream_t st = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    upload(bs[static_cast<size_t>(me)], b_dev.ptr, st);
    for (int call = 0; call < calls; ++call) {
        for (int r = 0; r < nr; ++r) {
            as[static_cast<size_t>(call)].emplace_back(m, cs.k, ldk, dt);
            as[static_cast<size_t>(call)].back().fill_random(seed_of(base, 0, r, call));
        }
        a_dev.push_back(std::make_unique<DevBuf>(static_cast<size_t>(m * ldk * 2)));
        upload(as[static_cast<size_t>(call)][static_cast<size_t>(me)], a_dev.back()->ptr, st);
        cs_host.emplace_back(cs.rows, cs.n, ldc, dt);
        poison(cs_host.back());
        c_dev.push_back(std::make_unique<DevBuf>(static_cast<size_t>(cs.rows * ldc * 2)));
        upload(cs_host.back(), c_dev.back()->ptr, st);
    }
    {
        ops::GemmRs op(w, {m, cs.n, cs.k, dt}, opt);
        const TensorView bv = view(bs[static_cast<size_t>(me)], b_dev.ptr);
        for (int call = 0; call < calls; ++call) {
            op.run(view(as[static_cast<size_t>(call)][static_cast<size_t>(me)], a_dev[static_cast<size_t>(call)]->ptr),
                   bv, view(cs_host[static_cast<size_t>(call)], c_dev[static_cast<size_t>(call)]->ptr), st);
        }
        w.sync_and_check(st);
        for (int call = 0; call < calls; ++call) {
            HostMat& c = cs_host[static_cast<size_t>(call)];
            download(c, c_dev[static_cast<size_t>(call)]->ptr, st);
            const std::vector<int64_t> check_rows = rows_to_check(cs.rows, cs.rows, static_cast<double>(cs.n * cs.k * nr),
                                                                  seed_of(base, 2, me, call));
            Reference ref(static_cast<int64_t>(check_rows.size()), cs.n);
            for (int r = 0; r < nr; ++r) {
                ref.add(as[static_cast<size_t>(call)][static_cast<size_t>(r)], me * cs.rows, check_rows,
                        bs[static_cast<size_t>(r)]);
            }
            const std::string bad = compare(c, check_rows, ref, ErrorModel::tp_sum(dt, op.partial_dtype(), nr));
            if (!bad.empty()) f.add(what + " call " + std::to_string(call) + ": " + bad);
        }
    }
    WEFT_CUDA_CHECK(cudaStreamDestroy(st));
}

TEST(TpSmoke, GemmRsTwoRanks) { run_world(2, {cases()[0]}, {DType::kBF16}, 2); }

TEST(TpGemmRs, WorldSize1IsThePlainGemm) { run_world(1, cases(), {DType::kBF16, DType::kF16}, 2); }
TEST(TpGemmRs, WorldSize2) { run_world(2, cases(), {DType::kBF16, DType::kF16}, 3); }
TEST(TpGemmRs, WorldSize3) { run_world(3, cases(), {DType::kBF16, DType::kF16}, 3); }
TEST(TpGemmRs, WorldSize4) { run_world(4, cases(), {DType::kBF16}, 3); }
TEST(TpGemmRs, WorldSize8) { run_world(8, cases(), {DType::kBF16, DType::kF16}, 3); }

TEST(TpGemmRs, AutotunedConfigStaysCorrect) {
    RsCase pull{300, 1100, 256};  // n % 8 != 0: pull mode
    pull.autotune = true;
    RsCase push{300, 1104, 256};
    push.autotune = true;
    push.mode = kPush;
    run_world(2, {pull, push}, {DType::kBF16}, 3);
}

// No host synchronisation between calls (see run_back_to_back): one chunk per tile row (the heuristic), two
// tile rows per chunk (as the autotuner's shared chunk gives 128-row tiles), and three ranks.
void back_to_back_worlds(const std::vector<RsCase>& two_ranks, const std::vector<RsCase>& three_ranks) {
    const uint64_t base = fresh_seed();
    for (int w : {2, 3}) {
        Failures f;
        test::run_ranks(
            w, [&](World& world) {
                for (const RsCase& c : w == 2 ? two_ranks : three_ranks) {
                    run_back_to_back(world, c, DType::kBF16, 12, base, f);
                }
            },
            test::test_options(256ull << 20));
        f.report();
    }
}

TEST(TpGemmRs, BackToBackCallsWithoutHostSync) {  // pull mode (n % 8 != 0)
    back_to_back_worlds({{300, 1100, 256}, {300, 1100, 256, 256}}, {{300, 1100, 256}});
}

// Push mode with one rank per GPU (kAuto's push case). Needs two GPUs.
TEST(TpGemmRs, BackToBackPushCallsWithoutHostSync) {
    int gpus = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&gpus));
    if (gpus < 2) GTEST_SKIP() << "SKIPPED: needs 2 GPUs (one rank per GPU), " << gpus << " visible";
    const uint64_t base = fresh_seed();
    Failures f;
    test::run_ranks(
        2, [&](World& world) {
            for (RsCase c : {RsCase{300, 1104, 256}, RsCase{300, 1104, 256, 256}}) {
                c.mode = kPush;
                run_back_to_back(world, c, DType::kBF16, 12, base, f);
            }
        },
        test::test_options(256ull << 20));
    f.report();
}

// Push mode with ranks sharing a GPU, calls back to back: needs each config's first call synchronised on every rank
// (tp_detail::FirstCallSync; kernels/gemm_rs/README.md, "Ranks sharing a GPU").
TEST(TpGemmRs, BackToBackPushCallsRanksSharingAGpu) {
    std::vector<RsCase> two = {{300, 1104, 256}, {300, 1104, 256, 256}}, three = {{300, 1104, 256}};
    for (RsCase& c : two) c.mode = kPush;
    for (RsCase& c : three) c.mode = kPush;
    back_to_back_worlds(two, three);
}

TEST(TpGemmRs, GraphReplayWithoutReset) {
    run_world(3, {cases()[0], cases()[2], cases()[6] /* push */}, {DType::kBF16}, 4, Mode::kGraph);
}

/// Random case `idx` for `num_ranks` ranks, valid by validate_gemm_rs_shape / resolve_gemm_rs_mode /
/// validate_gemm_rs_call: M = rows x W (a multiple of W), K a positive multiple of 8, chunk_rows a multiple of 128
/// (of some config's tile_m, 64 or 128), reduce_ctas below the SM budget. idx % 4 picks the side of the push/pull
/// choice: 0 kPush (N a multiple of 8, partials in the output dtype, no reduce_ctas: gemm_rs_push_unsupported), 1 N
/// not a multiple of 8 (pull), 2 N a multiple of 8 in pull (kPull, fp32 partials or reduce_ctas), 3 any N, kAuto or
/// kPull (kAuto pulls on ranks sharing a GPU, else pushes where it can).
RsCase draw_case(gemm_test::RandomDraw& draw, int num_ranks, int idx) {
    const int side = idx % 4;
    RsCase c{draw.log_uniform(1, 384), draw.log_uniform(8, 1500), 8 * draw.log_uniform(1, 150)};
    if (side == 0 || side == 2) c.n = 8 * draw.log_uniform(1, 187);
    if (side == 1) c.n = 8 * draw.log_uniform(1, 187) + draw.uniform(1, 7);
    // M x N x K (the GEMM's and the reference's cost) at most 2e9: K halved (at K = 8 it is below 3.3e7).
    while (c.rows * num_ranks * c.n * c.k > 2'000'000'000) c.k = std::max<int64_t>(8, c.k / 16 * 8);
    if (draw.uniform(0, 1) == 0) c.chunk_rows = 128 * draw.uniform(1, 3);
    if (draw.uniform(0, 1) == 0) c.c_pad = draw.uniform(1, 24);
    if (draw.uniform(0, 1) == 0) c.sm_budget = static_cast<int>(draw.uniform(2, 8));
    if (side == 0) {
        c.mode = kPush;
        return c;
    }
    c.mode = draw.uniform(0, 1) == 0 ? ops::GemmRsMode::kAuto : ops::GemmRsMode::kPull;
    c.f32_partials = draw.uniform(0, 2) == 0;
    // Below the SM budget: the explicit one, else the world's (at least 16 SMs a rank on one H200 for W <= 8).
    const int max_reduce_ctas = c.sm_budget > 0 ? c.sm_budget - 1 : 4;
    if (draw.uniform(0, 2) == 0) c.reduce_ctas = static_cast<int>(draw.uniform(1, max_reduce_ctas));
    if (side == 2 && c.mode == ops::GemmRsMode::kAuto && !c.f32_partials && c.reduce_ctas == 0) {
        c.mode = ops::GemmRsMode::kPull;  // else kAuto would push with one rank per GPU
    }
    return c;
}

// World sizes 5, 6 and 7 (the tests above take 1, 2, 3, 4 and 8) on four drawn cases each, one per side of the
// push/pull choice (draw_case): rows per rank log-uniform in 1..384, N in 8..1500 (a multiple of 8 or not, by side),
// K a multiple of 8 in 8..1200 (halved while M x N x K > 2e9), and each at even odds an explicit chunk_rows (128,
// 256 or 384), a padded C (1..24 elements, rounded up to 16 bytes), an SM budget (2..8); off push, kAuto or kPull,
// fp32 partials (1 in 3) and reduce_ctas (1 in 3). bf16 or f16 per world (world 6 the other of world 5's). Two
// calls per case, checked as above.
TEST(TpGemmRs, RandomShapesAtWorlds5To7) {
    run_random_worlds_5_to_7<RsCase>(
        [](gemm_test::RandomDraw& draw, int num_ranks, int i) { return draw_case(draw, num_ranks, i); },
        [](int num_ranks, const std::vector<RsCase>& cases, DType dtype, uint64_t seed) {
            run_world(num_ranks, cases, {dtype}, 2, Mode::kEager, seed);
        });
}

// Ranks that call with different M (pull mode, the one ranks sharing a GPU run): after an agreeing call, rank 0 calls
// with M = 256 and rank 1 with M = 128. Every rank's call throws naming both ranks' M, and no element of C is written
// (the reductions stop at the peer's descriptor, before the last phase, the only one that writes C). The kernels end
// with `exit`: after every rank cleared its diagnostics the ranks meet again, and a new op's agreeing call is right
// (the mismatched call leaves the op's counters behind: as with GemmAr, the op is dropped).
TEST(TpGemmRs, DifferentMOnTwoRanksIsDiagnosedOnBoth) {
    const int64_t n = 256, k = 128, max_m = 256;
    const DType dt = DType::kBF16;
    const uint64_t base = fresh_seed();
    std::mutex mutex;
    std::vector<std::string> messages(2);
    std::vector<int64_t> written(2, -1);
    Failures f;
    WorldOptions options = test::test_options(256ull << 20);
    options.heartbeat = std::chrono::milliseconds(200);
    ops::GemmRsOptions opt;
    opt.mode = ops::GemmRsMode::kPull;
    test::run_ranks(
        2,
        [&](World& w) {
            const int me = w.rank();
            cudaStream_t st = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
            {
                DevBuf a_dev(static_cast<size_t>(max_m * k * 2)), b_dev(static_cast<size_t>(n * k * 2)),
                    c_dev(static_cast<size_t>(max_m / 2 * n * 2));
                // One call on `op` with M = rows * 2 on this rank into *c_out ([rows, n], poisoned first, read back
                // after): checked against the reference when `check`; returns the error text (empty: no throw).
                const auto call = [&](ops::GemmRs& op, int64_t rows, int call_idx, bool check, HostMat* c_out) {
                    const int64_t m = 2 * rows;
                    std::vector<HostMat> as, bs;
                    for (int r = 0; r < 2; ++r) {
                        as.emplace_back(m, k, k, dt);
                        as.back().fill_random(seed_of(base, 0, r, call_idx));
                        bs.emplace_back(n, k, k, dt);
                        bs.back().fill_random(seed_of(base, 1, r, call_idx));
                    }
                    upload(as[static_cast<size_t>(me)], a_dev.ptr, st);
                    upload(bs[static_cast<size_t>(me)], b_dev.ptr, st);
                    HostMat& c = *c_out;  // [rows, n]
                    poison(c);
                    upload(c, c_dev.ptr, st);
                    std::string message;
                    try {
                        const auto mine = static_cast<size_t>(me);
                        op.run(view(as[mine], a_dev.ptr), view(bs[mine], b_dev.ptr), view(c, c_dev.ptr), st);
                        w.sync_and_check(st);
                    } catch (const Error& e) {
                        message = e.what();
                    }
                    download(c, c_dev.ptr, st);
                    if (check) {
                        if (!message.empty()) {
                            f.add("rank " + std::to_string(me) + ": agreeing call " + std::to_string(call_idx) +
                                  " threw: " + message);
                            return message;
                        }
                        const std::vector<int64_t> check_rows =
                            rows_to_check(rows, rows, static_cast<double>(n * k * 2), seed_of(base, 2, me, call_idx));
                        Reference ref(static_cast<int64_t>(check_rows.size()), n);
                        for (int r = 0; r < 2; ++r) {
                            ref.add(as[static_cast<size_t>(r)], me * rows, check_rows, bs[static_cast<size_t>(r)]);
                        }
                        const std::string bad =
                            compare(c, check_rows, ref, ErrorModel::tp_sum(dt, op.partial_dtype(), 2));
                        if (!bad.empty()) {
                            f.add("rank " + std::to_string(me) + ": agreeing call " + std::to_string(call_idx) + ": " +
                                  bad);
                        }
                    }
                    return message;
                };
                {
                    ops::GemmRs op(w, {max_m, n, k, dt}, opt);
                    HostMat c0(64, n, n, dt);
                    call(op, 64, 0, true, &c0);  // agreeing: M = 128
                    const int64_t rows = me == 0 ? 128 : 64;
                    HostMat c(rows, n, n, dt);
                    poison(c);
                    const HostMat c_poisoned = c;
                    w.barrier();
                    const std::string message = call(op, rows, 1, false, &c);  // M = 256 on rank 0, 128 on rank 1
                    int64_t changed = 0;
                    for (size_t i = 0; i < c.bits.size(); ++i) changed += c.bits[i] != c_poisoned.bits[i] ? 1 : 0;
                    {
                        std::lock_guard<std::mutex> lock(mutex);
                        messages[static_cast<size_t>(me)] = message;
                        written[static_cast<size_t>(me)] = changed;
                    }
                    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the context stays usable";
                    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the aborts reached every rank
                    w.clear_diagnostics();
                    w.barrier();
                }
                ops::GemmRs op(w, {max_m, n, k, dt}, opt);
                HostMat c2(96, n, n, dt);
                call(op, 96, 2, true, &c2);  // agreeing again, on a new op: M = 192
                w.barrier();
            }
            WEFT_CUDA_CHECK(cudaStreamDestroy(st));
        },
        options);
    f.report();
    const std::vector<std::string> words = {"collective call differs from rank", "rank 0 called gemm_rs with M = 256",
                                            "rank 1 called gemm_rs with M = 128"};
    for (int r = 0; r < 2; ++r) {
        const std::string& m = messages[static_cast<size_t>(r)];
        EXPECT_FALSE(m.empty()) << "rank " << r << " did not throw";
        for (const std::string& word : words) {
            EXPECT_NE(m.find(word), std::string::npos) << "rank " << r << ": '" << word << "' not in: " << m;
        }
        EXPECT_EQ(written[static_cast<size_t>(r)], 0) << "rank " << r << ": elements of C were written";
    }
}

// Construction agreement: a member whose shape is invalid (an uneven K shard that is not a multiple of 8) fails every
// member naming it; members whose fields differ are named with both values; uneven K shards that are valid build
// (the config is the team's).
TEST(TpGemmRs, MembersThatDisagreeFailConstructionOnEveryMember) {
    const std::vector<std::string> invalid = test::error_of_each_rank(3, [&](World& w) {
        const int64_t k = w.rank() == 2 ? 1364 : 1368;  // K = 4100 over 3 ranks
        ops::GemmRs op(w, ops::GemmRsShape{192, 256, k, DType::kBF16});
    });
    for (int r = 0; r < 3; ++r) {
        const std::string& m = invalid[static_cast<size_t>(r)];
        EXPECT_NE(m.find("multiple of 8, got 1364"), std::string::npos) << "rank " << r << ": " << m;
        if (r != 2) {
            EXPECT_NE(m.find("world rank 2"), std::string::npos) << "rank " << r << ": " << m;
        }
    }
    const std::vector<std::string> differ = test::error_of_each_rank(2, [&](World& w) {
        ops::GemmRs op(w, ops::GemmRsShape{128, w.rank() == 0 ? 256 : 248, 256, DType::kBF16});
    });
    for (int r = 0; r < 2; ++r) {
        const std::string& m = differ[static_cast<size_t>(r)];
        EXPECT_NE(m.find("the members' shape.n differ"), std::string::npos) << "rank " << r << ": " << m;
        EXPECT_NE(m.find("256"), std::string::npos) << "rank " << r << ": " << m;
        EXPECT_NE(m.find("248"), std::string::npos) << "rank " << r << ": " << m;
    }
    // Uneven valid shards build on every member, with one config and chunking (chosen for the largest K).
    std::mutex mutex;
    std::vector<std::string> plans(3);
    test::run_ranks(3, [&](World& w) {
        ops::GemmRs op(w, ops::GemmRsShape{192, 256, w.rank() == 1 ? 1360 : 1376, DType::kBF16});
        const std::lock_guard<std::mutex> lock(mutex);
        plans[static_cast<size_t>(w.rank())] =
            ops::format_gemm_config(op.config()) + ", chunk_rows " + std::to_string(op.chunk_rows());
    });
    for (int r = 1; r < 3; ++r) EXPECT_EQ(plans[static_cast<size_t>(r)], plans[0]) << "rank " << r;
}

}  // namespace
}  // namespace weft
