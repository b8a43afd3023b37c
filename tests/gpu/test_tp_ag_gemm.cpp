// SPDX-License-Identifier: MIT
// GPU tests of weft::ops::AgGemm (AllGather+GEMM) with ranks as threads sharing the visible GPUs: an fp64 CPU
// reference on awkward shapes, world sizes 1, 2, 3, 4, 8, bf16 and f16, poisoned outputs, fresh random data
// on every call, repeated calls without any reset, the zero-copy local shard, the gathered A checked bit for
// bit, a CUDA-graph replay, ranks that call with different M (diagnosed on every rank), and random cases at world
// sizes 5, 6 and 7.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "support/gemm_testing.hpp"
#include "support/runtime_checks.hpp"
#include "tp_test_util.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

using namespace tp_test;

struct AgCase {
    int64_t rows;  // per rank
    int64_t n, k;
    int64_t chunk_rows = 0;
    int64_t a_pad = 0, c_pad = 0;
    int copy_streams = 0;
    int sm_budget = 0;
    std::optional<GemmConfig> config = std::nullopt;
    bool autotune = false;
};

AgCase ag(int64_t rows, int64_t n, int64_t k, int64_t chunk_rows = 0, int64_t a_pad = 0, int64_t c_pad = 0,
          int copy_streams = 0, int sm_budget = 0) {
    return AgCase{rows, n, k, chunk_rows, a_pad, c_pad, copy_streams, sm_budget, std::nullopt, false};
}

std::string describe(const AgCase& c, DType dt, int w, uint64_t seed) {
    std::ostringstream os;
    os << "ag_gemm W=" << w << " rows/rank " << c.rows << " n " << c.n << " k " << c.k << " " << dtype_name(dt)
       << " chunk_rows " << c.chunk_rows << " pads(a " << c.a_pad << ", c " << c.c_pad << ") copy_streams "
       << c.copy_streams << " sm_budget " << c.sm_budget << (c.config ? " forced config" : "")
       << (c.autotune ? " autotune" : "") << " seed " << seed;
    return os.str();
}

enum class Mode { kEager, kGraph };

/// One case on one rank: `calls` calls with fresh data, each checked (C against fp64, gathered A bit-exact).
/// Eager calls vary M (the second call uses about 2/3 of the rows); graph replays keep the captured M.
void run_case(World& w, const AgCase& cs, DType dt, int calls, Mode mode, uint64_t base, Failures& f) {
    const int nr = w.num_ranks(), me = w.rank();
    const int64_t max_m = cs.rows * nr;
    const std::string what = describe(cs, dt, nr, base) + " rank " + std::to_string(me);
    ops::AgGemmOptions opt;
    opt.chunk_rows = cs.chunk_rows;
    opt.copy_streams = nr > 2 ? cs.copy_streams : 0;
    opt.sm_budget = cs.sm_budget;
    opt.config = cs.config;
    opt.autotune = cs.autotune;

    const int64_t lda = ld_for(cs.k, cs.a_pad), ldc = ld_for(cs.n, cs.c_pad);
    HostMat b(cs.n, cs.k, ld_for(cs.k), dt);
    DevBuf a_dev(static_cast<size_t>(cs.rows * lda * 2)), b_dev(b.bytes()), c_dev(static_cast<size_t>(max_m * ldc * 2));
    cudaStream_t st = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    {
        ops::AgGemm op(w, {max_m, cs.n, cs.k, dt}, opt);
        cudaGraphExec_t graph_exec = nullptr;
        for (int call = 0; call < calls; ++call) {
            const int64_t rows = mode == Mode::kEager && call == 1 ? std::max<int64_t>(1, cs.rows * 2 / 3) : cs.rows;
            const int64_t m = rows * nr;
            const std::string at = what + " call " + std::to_string(call) + " M " + std::to_string(m);
            // Fresh data: every rank's shard (for the reference), this rank's weight shard.
            std::vector<HostMat> shards;
            for (int r = 0; r < nr; ++r) {
                shards.emplace_back(rows, cs.k, cs.k, dt);
                shards.back().fill_random(seed_of(base, 0, r, call));
            }
            b.fill_random(seed_of(base, 1, me, call));
            upload(b, b_dev.ptr, st);
            // Poison the whole gathered buffer (no peer reads it between calls) and the output.
            const TensorView g = op.gathered(m);
            WEFT_CUDA_CHECK(cudaMemsetAsync(g.data, 0xFF, static_cast<size_t>(g.size_bytes()), st));
            HostMat c(m, cs.n, ldc, dt);
            poison(c);
            upload(c, c_dev.ptr, st);
            // Call 1 writes A straight into the gathered buffer (no local copy); the others from a padded buffer.
            const bool zero_copy = mode == Mode::kEager && call == 1;
            TensorView a_view;
            if (zero_copy) {
                a_view = op.local_shard(m);
                upload(shards[static_cast<size_t>(me)], a_view.data, st);
            } else {
                HostMat a(rows, cs.k, lda, dt);
                for (int64_t r = 0; r < rows; ++r)
                    for (int64_t j = 0; j < cs.k; ++j) a.set(r, j, shards[static_cast<size_t>(me)].at(r, j));
                upload(a, a_dev.ptr, st);
                a_view = view(a, a_dev.ptr);
                if (rows == 1) a_view.strides[0] = 0;  // a one-row view may carry any row stride (a broadcast row)
            }
            const TensorView bv = view(b, b_dev.ptr), cv = view(c, c_dev.ptr);
            if (mode == Mode::kEager || call == 0) {
                op.run(a_view, bv, cv, st);
                if (mode == Mode::kGraph) {
                    // Capture after one eager call (kernels loaded, attributes set), then replay from call 1.
                    w.sync_and_check(st);
                    cudaGraph_t graph = nullptr;
                    WEFT_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                    op.run(a_view, bv, cv, st);
                    WEFT_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
                    WEFT_CUDA_CHECK(cudaGraphInstantiate(&graph_exec, graph, 0));
                    WEFT_CUDA_CHECK(cudaGraphDestroy(graph));
                    WEFT_CUDA_CHECK(cudaGraphLaunch(graph_exec, st));  // a second call on the same data
                }
            } else {
                WEFT_CUDA_CHECK(cudaGraphLaunch(graph_exec, st));
            }
            w.sync_and_check(st);

            download(c, c_dev.ptr, st);
            const std::vector<int64_t> check_rows =
                rows_to_check(m, rows, static_cast<double>(cs.n * cs.k), seed_of(base, 2, me, call));
            HostMat a_full(m, cs.k, cs.k, dt);  // every rank's shard in rank order: the gathered A
            for (int r = 0; r < nr; ++r) {
                const auto& sh = shards[static_cast<size_t>(r)].bits;  // [rows, k], row stride k
                std::copy(sh.begin(), sh.end(), a_full.bits.begin() + r * rows * cs.k);
            }
            Reference ref(static_cast<int64_t>(check_rows.size()), cs.n);
            ref.add(a_full, 0, check_rows, b);
            const std::string bad = compare(c, check_rows, ref, ErrorModel::gemm(dt));
            if (!bad.empty()) f.add(at + ": C: " + bad);

            HostMat gathered(m, cs.k, cs.k, dt);
            download(gathered, g.data, st);
            int64_t wrong = 0;
            for (int r = 0; r < nr; ++r) {
                const auto& sh = shards[static_cast<size_t>(r)].bits;
                wrong += !std::equal(sh.begin(), sh.end(), gathered.bits.begin() + r * rows * cs.k);
            }
            if (wrong != 0) f.add(at + ": gathered A differs in " + std::to_string(wrong) + " shard(s)");
        }
        if (graph_exec != nullptr) WEFT_CUDA_CHECK(cudaGraphExecDestroy(graph_exec));
    }
    WEFT_CUDA_CHECK(cudaStreamDestroy(st));
}

const std::vector<AgCase>& cases() {
    static const std::vector<AgCase> v = [] {
        std::vector<AgCase> out;
        out.push_back(ag(100, 200, 72, 0, 8, 8));        // nothing a multiple of a tile; padded strides
        out.push_back(ag(1, 8, 8));                      // one row per rank: every tile spans every rank
        out.push_back(ag(300, 1100, 256, 64, 0, 0, 2));  // chunks of 64 rows, ragged N, two copy streams
        out.push_back(ag(256, 384, 512, 128, 0, 16, 0, 3));  // 3 CTAs: many tiles each
        AgCase forced = ag(200, 520, 136, 96);
        GemmConfig cfg = gemm_candidate(6, DType::kBF16, DType::kBF16, BLayout::kNK);  // 128x128, 6 stages
        forced.config = cfg;
        out.push_back(forced);
        // Ping-pong (each consumer warpgroup stores and signals its own tiles) on few SMs: several tiles per CTA.
        AgCase pingpong = ag(256, 1100, 512, 128, 0, 0, 0, 3);
        pingpong.config = gemm_candidate(9, DType::kBF16, DType::kBF16, BLayout::kNK);  // 128x192, 4 stages
        out.push_back(pingpong);
        AgCase pingpong64 = ag(200, 520, 136, 96, 0, 8, 0, 4);
        pingpong64.config = gemm_candidate(12, DType::kBF16, DType::kBF16, BLayout::kNK);  // 64x128, 8 stages
        out.push_back(pingpong64);
        return out;
    }();
    return v;
}

void run_world(int num_ranks, const std::vector<AgCase>& cs, const std::vector<DType>& dtypes, int calls,
               Mode mode = Mode::kEager, uint64_t base = fresh_seed()) {
    Failures f;
    test::run_ranks(
        num_ranks,
        [&](World& w) {
            for (DType dt : dtypes) {
                for (AgCase c : cs) {
                    if (c.config) {
                        c.config->in_dtype = dt;
                        c.config->out_dtype = dt;
                    }
                    run_case(w, c, dt, calls, mode, base, f);
                }
            }
        },
        test::test_options(256ull << 20));
    f.report();
}

// A quick subset for a first run on a new machine.
TEST(TpSmoke, AgGemmTwoRanks) { run_world(2, {cases()[0]}, {DType::kBF16}, 2); }

TEST(TpAgGemm, WorldSize1IsThePlainGemm) { run_world(1, cases(), {DType::kBF16, DType::kF16}, 2); }
TEST(TpAgGemm, WorldSize2) { run_world(2, cases(), {DType::kBF16, DType::kF16}, 3); }
TEST(TpAgGemm, WorldSize3) { run_world(3, cases(), {DType::kBF16, DType::kF16}, 3); }
TEST(TpAgGemm, WorldSize4) { run_world(4, cases(), {DType::kBF16}, 3); }
TEST(TpAgGemm, WorldSize8) { run_world(8, cases(), {DType::kBF16, DType::kF16}, 3); }

TEST(TpAgGemm, GraphReplayWithoutReset) { run_world(3, {cases()[0], cases()[2]}, {DType::kBF16}, 4, Mode::kGraph); }

/// A random case for `num_ranks` ranks, valid by validate_ag_gemm_shape and validate_ag_gemm_call: K a positive
/// multiple of 8, copy_streams in [0, W-1], chunk_rows and sm_budget >= 0 (any chunk: a tile may span chunks).
AgCase draw_case(gemm_test::RandomDraw& draw, int num_ranks) {
    AgCase c = ag(draw.log_uniform(1, 512), draw.log_uniform(8, 1500), 8 * draw.log_uniform(1, 150));
    // M x N x K (the GEMM's and the reference's cost) at most 2e9: K halved (at K = 8 it is below 4.4e7).
    while (c.rows * num_ranks * c.n * c.k > 2'000'000'000) c.k = std::max<int64_t>(8, c.k / 16 * 8);
    if (draw.uniform(0, 1) == 0) c.chunk_rows = draw.log_uniform(8, 256);
    if (draw.uniform(0, 1) == 0) c.a_pad = draw.uniform(1, 24);
    if (draw.uniform(0, 1) == 0) c.c_pad = draw.uniform(1, 24);
    c.copy_streams = static_cast<int>(draw.uniform(0, num_ranks - 1));
    if (draw.uniform(0, 1) == 0) c.sm_budget = static_cast<int>(draw.uniform(2, 8));
    return c;
}

// World sizes 5, 6 and 7 (the tests above take 1, 2, 3, 4 and 8) on four drawn cases each: rows per rank
// log-uniform in 1..512, N in 8..1500, K a multiple of 8 in 8..1200 (halved while M x N x K > 2e9), and each at
// even odds an explicit chunk_rows (8..256), a padded A and C (1..24 elements, rounded up to 16 bytes), an SM
// budget (2..8); copy streams 0..W-1. bf16 or f16 per world (world 6 the other of world 5's). Two calls per case,
// checked as above.
TEST(TpAgGemm, RandomShapesAtWorlds5To7) {
    run_random_worlds_5_to_7<AgCase>(
        [](gemm_test::RandomDraw& draw, int num_ranks, int) { return draw_case(draw, num_ranks); },
        [](int num_ranks, const std::vector<AgCase>& cases, DType dtype, uint64_t seed) {
            run_world(num_ranks, cases, {dtype}, 2, Mode::kEager, seed);
        });
}

// Tuning times every candidate config on the first call (all ranks together), then keeps one: every call's
// result must still be right, whichever config won.
TEST(TpAgGemm, AutotunedConfigStaysCorrect) {
    AgCase c = ag(200, 520, 136);
    c.autotune = true;
    run_world(2, {c}, {DType::kBF16}, 3);
}

// Rows of 2 GiB and more (K = 2^30 + 8, bf16): the local shard's rows lie back to back, so their copy into the
// gathered buffer is one copy (a 2-D copy refuses pitches of 2 GiB or more) and the GEMM indexes past 2^31 bytes of
// a row; a strided a_local whose pitch passes the device's maximum is refused before anything launches. A is zero
// but for a one in each row near its end (a different column per row), B zero but for small integers there, so C is
// exact: C[g][j] = (j + 1)(g + 1). Needs about 30 GiB per rank; skipped where the GPUs have less free.
TEST(TpAgGemm, RowsOfTwoGibibytes) {
    constexpr int kRanks = 2;
    constexpr int64_t kRowsPerRank = 2, kN = 8, kK = (int64_t{1} << 30) + 8, kM = kRanks * kRowsPerRank;
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) GTEST_SKIP() << "needs a GPU";
    size_t free_bytes = 0, total_bytes = 0;
    WEFT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const int ranks_per_gpu = (kRanks + gpus - 1) / gpus;
    const uint64_t heap_bytes = static_cast<uint64_t>(kM * kK * 2) + (uint64_t{1} << 30);
    const uint64_t per_rank = heap_bytes + static_cast<uint64_t>((kRowsPerRank + kN) * kK * 2) + (uint64_t{1} << 30);
    if (per_rank * ranks_per_gpu > free_bytes) {
        GTEST_SKIP() << "needs " << (per_rank * ranks_per_gpu >> 30) << " GiB free per GPU, " << (free_bytes >> 30)
                     << " GiB are";
    }
    const auto one_at = [](int64_t g) { return kK - 1 - 3 * g; };  // the column of row g's one
    const auto bf16 = [](float x) {
        uint32_t u = 0;
        std::memcpy(&u, &x, 4);
        return static_cast<uint16_t>(u >> 16);  // exact for the small integers used here
    };
    Failures f;
    test::run_ranks(
        kRanks,
        [&](World& w) {
            const int me = w.rank();
            cudaStream_t st = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
            DevBuf a(static_cast<size_t>(kRowsPerRank * kK * 2)), b(static_cast<size_t>(kN * kK * 2)),
                c(static_cast<size_t>(kM * kN * 2));
            WEFT_CUDA_CHECK(cudaMemsetAsync(a.ptr, 0, static_cast<size_t>(kRowsPerRank * kK * 2), st));
            WEFT_CUDA_CHECK(cudaMemsetAsync(b.ptr, 0, static_cast<size_t>(kN * kK * 2), st));
            WEFT_CUDA_CHECK(cudaMemsetAsync(c.ptr, 0xFF, static_cast<size_t>(kM * kN * 2), st));  // NaN
            const uint16_t one = bf16(1.0f);
            for (int64_t i = 0; i < kRowsPerRank; ++i) {
                const int64_t g = me * kRowsPerRank + i;
                WEFT_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint16_t*>(a.ptr) + i * kK + one_at(g), &one, 2,
                                                cudaMemcpyHostToDevice, st));
                WEFT_CUDA_CHECK(cudaStreamSynchronize(st));
            }
            std::vector<uint16_t> values(static_cast<size_t>(kN * kM));
            for (int64_t j = 0; j < kN; ++j) {
                for (int64_t g = 0; g < kM; ++g) {
                    values[static_cast<size_t>(j * kM + g)] = bf16(static_cast<float>((j + 1) * (g + 1)));
                    WEFT_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint16_t*>(b.ptr) + j * kK + one_at(g),
                                                    &values[static_cast<size_t>(j * kM + g)], 2, cudaMemcpyHostToDevice,
                                                    st));
                }
            }
            WEFT_CUDA_CHECK(cudaStreamSynchronize(st));
            {
                ops::AgGemm op(w, {kM, kN, kK, DType::kBF16});
                op.run(TensorView(a.ptr, DType::kBF16, {kRowsPerRank, kK}), TensorView(b.ptr, DType::kBF16, {kN, kK}),
                       TensorView(c.ptr, DType::kBF16, {kM, kN}), st);
                w.sync_and_check(st);
                std::vector<uint16_t> got(static_cast<size_t>(kM * kN));
                WEFT_CUDA_CHECK(cudaMemcpy(got.data(), c.ptr, got.size() * 2, cudaMemcpyDeviceToHost));
                for (int64_t g = 0; g < kM; ++g) {
                    for (int64_t j = 0; j < kN; ++j) {
                        // Row g reads B's column one_at(g) only: B[j][one_at(g)] = (j + 1)(g + 1).
                        const uint16_t want = bf16(static_cast<float>((j + 1) * (g + 1)));
                        if (got[static_cast<size_t>(g * kN + j)] != want) {
                            f.add("rank " + std::to_string(me) + ": C[" + std::to_string(g) + "][" + std::to_string(j) +
                                  "] has bits " + std::to_string(got[static_cast<size_t>(g * kN + j)]) + ", want " +
                                  std::to_string(want));
                        }
                    }
                }
                // A strided local shard whose row pitch passes the device's maximum: refused before any launch,
                // on every rank alike (the op stays usable; no peer waits for a call that never started).
                const TensorView strided(a.ptr, DType::kBF16, {kRowsPerRank, kK}, {kK + (int64_t{1} << 30), 1});
                try {
                    op.run(strided, TensorView(b.ptr, DType::kBF16, {kN, kK}),
                           TensorView(c.ptr, DType::kBF16, {kM, kN}), st);
                    f.add("rank " + std::to_string(me) + ": a row pitch past the device's maximum was accepted");
                } catch (const Error& e) {
                    if (std::string(e.what()).find("passes the device's maximum") == std::string::npos) {
                        f.add("rank " + std::to_string(me) + ": unexpected error: " + e.what());
                    }
                }
                w.barrier();
            }
            WEFT_CUDA_CHECK(cudaStreamDestroy(st));
        },
        test::test_options(heap_bytes));
    f.report();
}

TEST(TpAgGemm, BadCallThrowsNamingTheArgument) {
    Failures f;
    test::run_ranks(2, [&](World& w) {
        DevBuf buf(1 << 20);
        ops::AgGemm op(w, {256, 64, 64, DType::kBF16});
        const TensorView a(buf.ptr, DType::kBF16, {128, 64});
        const TensorView b(buf.ptr, DType::kBF16, {64, 64});
        const TensorView c_bad(buf.ptr, DType::kBF16, {255, 64});
        try {
            op.run(a, b, c_bad, nullptr);
            f.add("no error for a wrong c");
        } catch (const Error& e) {
            if (std::string(e.what()).find("c must be [M, N]") == std::string::npos) f.add(e.what());
        }
        w.barrier();
    });
    f.report();
}

// Ranks that call with different M (rank 0 with 64 rows, rank 1 with 32): every rank's call throws naming both
// ranks' M, and no row of C that depends on a peer's shard is written (its poison stays; rows of the rank's own shard
// may hold its own correct products). The call's protocol still ends on every rank (no abort is raised): after every
// rank cleared its diagnostics, a second call on the same op with agreeing M is right.
TEST(TpAgGemm, DifferentMOnTwoRanksIsDiagnosedOnBoth) {
    const int64_t n = 256, k = 128, max_rows = 64, max_m = 2 * max_rows;
    const DType dt = DType::kBF16;
    const uint64_t base = fresh_seed();
    std::mutex mutex;
    std::vector<std::string> messages(2);
    std::vector<int64_t> written(2, -1);
    Failures f;
    WorldOptions options = test::test_options(256ull << 20);
    options.heartbeat = std::chrono::milliseconds(200);
    test::run_ranks(
        2,
        [&](World& w) {
            const int me = w.rank();
            cudaStream_t st = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
            {
                DevBuf a_dev(static_cast<size_t>(max_rows * k * 2)), b_dev(static_cast<size_t>(n * k * 2)),
                    c_dev(static_cast<size_t>(max_m * n * 2));
                ops::AgGemm op(w, {max_m, n, k, dt});
                HostMat b(n, k, k, dt);
                b.fill_random(seed_of(base, 1, me, 0));
                upload(b, b_dev.ptr, st);
                // Call 0: M = 128 on rank 0, 64 on rank 1.
                {
                    const int64_t rows = me == 0 ? max_rows : max_rows / 2;
                    const int64_t m = 2 * rows;
                    HostMat a(rows, k, k, dt), c(m, n, n, dt);
                    a.fill_random(seed_of(base, 0, me, 0));
                    poison(c);
                    const HostMat c_poisoned = c;
                    upload(a, a_dev.ptr, st);
                    upload(c, c_dev.ptr, st);
                    w.barrier();
                    std::string message;
                    try {
                        op.run(view(a, a_dev.ptr), view(b, b_dev.ptr), view(c, c_dev.ptr), st);
                        w.sync_and_check(st);
                    } catch (const Error& e) {
                        message = e.what();
                    }
                    download(c, c_dev.ptr, st);
                    int64_t changed = 0;  // outside this rank's own rows [me * rows, (me + 1) * rows)
                    for (int64_t r = 0; r < m; ++r) {
                        if (r >= me * rows && r < (me + 1) * rows) continue;
                        for (int64_t j = 0; j < n; ++j) {
                            const auto i = static_cast<size_t>(r * n + j);
                            changed += c.bits[i] != c_poisoned.bits[i] ? 1 : 0;
                        }
                    }
                    {
                        std::lock_guard<std::mutex> lock(mutex);
                        messages[static_cast<size_t>(me)] = message;
                        written[static_cast<size_t>(me)] = changed;
                    }
                    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the context stays usable";
                    EXPECT_FALSE(w.aborted()) << "no abort: every rank found the mismatch itself";
                    w.barrier();  // every rank read its record before any clears it
                    w.clear_diagnostics();
                    w.barrier();
                }
                // Call 1: the ranks agree (M = 96): the op's protocol state came out of call 0 whole.
                {
                    const int64_t rows = 48, m = 2 * rows;
                    std::vector<HostMat> shards;
                    for (int r = 0; r < 2; ++r) {
                        shards.emplace_back(rows, k, k, dt);
                        shards.back().fill_random(seed_of(base, 0, r, 1));
                    }
                    HostMat c(m, n, n, dt);
                    poison(c);
                    upload(shards[static_cast<size_t>(me)], a_dev.ptr, st);
                    upload(c, c_dev.ptr, st);
                    try {
                        op.run(view(shards[static_cast<size_t>(me)], a_dev.ptr), view(b, b_dev.ptr), view(c, c_dev.ptr),
                               st);
                        w.sync_and_check(st);
                        download(c, c_dev.ptr, st);
                        HostMat a_full(m, k, k, dt);
                        for (int r = 0; r < 2; ++r) {
                            const auto& sh = shards[static_cast<size_t>(r)].bits;
                            std::copy(sh.begin(), sh.end(), a_full.bits.begin() + r * rows * k);
                        }
                        const std::vector<int64_t> check_rows =
                            rows_to_check(m, rows, static_cast<double>(n * k), seed_of(base, 2, me, 1));
                        Reference ref(static_cast<int64_t>(check_rows.size()), n);
                        ref.add(a_full, 0, check_rows, b);
                        const std::string bad = compare(c, check_rows, ref, ErrorModel::gemm(dt));
                        if (!bad.empty()) f.add("rank " + std::to_string(me) + ": the agreeing call after: " + bad);
                    } catch (const Error& e) {
                        f.add("rank " + std::to_string(me) + ": the agreeing call after threw: " + e.what());
                    }
                    w.barrier();
                }
            }
            WEFT_CUDA_CHECK(cudaStreamDestroy(st));
        },
        options);
    f.report();
    const std::vector<std::string> words = {"collective call differs from rank", "rank 0 called ag_gemm with M = 128",
                                            "rank 1 called ag_gemm with M = 64"};
    for (int r = 0; r < 2; ++r) {
        const std::string& m = messages[static_cast<size_t>(r)];
        EXPECT_FALSE(m.empty()) << "rank " << r << " did not throw";
        for (const std::string& word : words) {
            EXPECT_NE(m.find(word), std::string::npos) << "rank " << r << ": '" << word << "' not in: " << m;
        }
        EXPECT_EQ(written[static_cast<size_t>(r)], 0) << "rank " << r << ": rows of C from a peer were written";
    }
}

}  // namespace
}  // namespace weft
