// SPDX-License-Identifier: MIT
// GPU tests of weft::ops::GemmAr (GEMM+AllReduce, small M) with ranks as threads sharing the visible GPUs: an
// fp64 CPU reference of sum_s A_s B_s^T, M from 1 to 128 (small-M and tiled GEMM paths), ragged N, world
// sizes 1, 2, 3, 4, 8, bf16 and f16, bf16 and fp32 partials, poisoned outputs, fresh data on every call,
// repeated calls without reset, bit-identical results on every rank, a CUDA-graph replay, and random cases at world
// sizes 5, 6 and 7.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "support/gemm_testing.hpp"
#include "support/runtime_checks.hpp"
#include "tp_test_util.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

using namespace tp_test;

struct ArCase {
    int64_t max_m;
    std::vector<int64_t> ms;  // M of the calls, cycled
    int64_t n, k;
    int64_t c_pad = 0;
    bool f32_partials = false;
};

enum class Mode { kEager, kGraph };

uint64_t hash_bits(const HostMat& h) {
    uint64_t x = 1469598103934665603ull;
    for (int64_t r = 0; r < h.rows; ++r)
        for (int64_t c = 0; c < h.cols; ++c) x = (x ^ h.bits[static_cast<size_t>(r * h.ld + c)]) * 1099511628211ull;
    return x;
}

struct Hashes {
    std::mutex mutex;
    std::map<std::string, std::vector<uint64_t>> by_call;  // call key -> hash per rank
};

void run_case(World& w, const ArCase& cs, DType dt, int calls, Mode mode, uint64_t base, Failures& f, Hashes& h) {
    const int nr = w.num_ranks(), me = w.rank();
    std::ostringstream id;
    id << "gemm_ar W=" << nr << " max_m " << cs.max_m << " n " << cs.n << " k " << cs.k << " " << dtype_name(dt)
       << " c_pad " << cs.c_pad << (cs.f32_partials ? " f32 partials" : "") << " seed " << base;
    ops::GemmArOptions opt;
    if (cs.f32_partials) opt.partial_dtype = DType::kF32;

    HostMat a_max(cs.max_m, cs.k, ld_for(cs.k), dt), b(cs.n, cs.k, ld_for(cs.k), dt);
    HostMat c_max(cs.max_m, cs.n, ld_for(cs.n, cs.c_pad), dt);
    DevBuf a_dev(a_max.bytes()), b_dev(b.bytes()), c_dev(c_max.bytes());
    cudaStream_t st = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    {
        ops::GemmAr op(w, {cs.max_m, cs.n, cs.k, dt}, opt);
        // The error model below follows the op's partials: they must be the ones asked for.
        EXPECT_EQ(op.partial_dtype(), cs.f32_partials ? DType::kF32 : dt) << id.str();
        cudaGraphExec_t graph_exec = nullptr;
        for (int call = 0; call < calls; ++call) {
            const int64_t m = mode == Mode::kGraph ? cs.ms[0] : cs.ms[static_cast<size_t>(call) % cs.ms.size()];
            const std::string what = id.str() + " M " + std::to_string(m) + " call " + std::to_string(call);
            std::vector<HostMat> as, bs;
            for (int r = 0; r < nr; ++r) {
                as.emplace_back(m, cs.k, ld_for(cs.k), dt);
                as.back().fill_random(seed_of(base, 0, r, call));
                bs.emplace_back(cs.n, cs.k, ld_for(cs.k), dt);
                bs.back().fill_random(seed_of(base, 1, r, call));
            }
            upload(as[static_cast<size_t>(me)], a_dev.ptr, st);
            upload(bs[static_cast<size_t>(me)], b_dev.ptr, st);
            HostMat c(m, cs.n, c_max.ld, dt);
            poison(c);
            upload(c, c_dev.ptr, st);
            const TensorView av = view(as[static_cast<size_t>(me)], a_dev.ptr), bv = view(b, b_dev.ptr),
                             cv = view(c, c_dev.ptr);
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
            std::vector<int64_t> rows;
            for (int64_t r = 0; r < m; ++r) rows.push_back(r);
            Reference ref(static_cast<int64_t>(rows.size()), cs.n);
            for (int r = 0; r < nr; ++r) ref.add(as[static_cast<size_t>(r)], 0, rows, bs[static_cast<size_t>(r)]);
            const std::string bad = compare(c, rows, ref, ErrorModel::tp_sum(dt, op.partial_dtype(), nr));
            if (!bad.empty()) f.add(what + " rank " + std::to_string(me) + ": " + bad);
            std::lock_guard<std::mutex> lock(h.mutex);
            auto& v = h.by_call[what];
            v.resize(static_cast<size_t>(nr));
            v[static_cast<size_t>(me)] = hash_bits(c);
        }
        if (graph_exec != nullptr) WEFT_CUDA_CHECK(cudaGraphExecDestroy(graph_exec));
    }
    WEFT_CUDA_CHECK(cudaStreamDestroy(st));
}

const std::vector<ArCase>& cases() {
    static const std::vector<ArCase> v = {
        {128, {1, 16, 128, 5}, 1000, 256, 8},  // small-M (1, 5, 16) and tiled (128) paths; padded c: own kernel
        {64, {1, 16, 64, 3}, 2048, 512},       // contiguous c, N % 8 == 0: the all-reduce is ops::all_reduce
        {64, {64, 17}, 8, 1000},               // N = 8
        {100, {100, 33}, 1100, 136, 0, true},  // ragged N, fp32 partials, tiled at M = 100
        {16, {1, 2, 4, 16}, 1000, 4096},       // K = 4096, B rows back to back: small-M variant 4 at M <= 16
    };
    return v;
}

void run_world(int num_ranks, const std::vector<ArCase>& cs, const std::vector<DType>& dtypes, int calls,
               Mode mode = Mode::kEager, uint64_t base = fresh_seed()) {
    Failures f;
    Hashes h;
    test::run_ranks(
        num_ranks,
        [&](World& w) {
            for (DType dt : dtypes) {
                for (const ArCase& c : cs) run_case(w, c, dt, calls, mode, base, f, h);
            }
        },
        test::test_options(256ull << 20));
    f.report();
    for (const auto& [what, hashes] : h.by_call) {
        for (size_t r = 1; r < hashes.size(); ++r) {
            EXPECT_EQ(hashes[r], hashes[0]) << what << ": rank " << r << "'s result differs from rank 0's";
        }
    }
}

TEST(TpSmoke, GemmArTwoRanks) { run_world(2, {cases()[0]}, {DType::kBF16}, 2); }

TEST(TpGemmAr, WorldSize1IsThePlainGemm) { run_world(1, cases(), {DType::kBF16, DType::kF16}, 4); }
TEST(TpGemmAr, WorldSize2) { run_world(2, cases(), {DType::kBF16, DType::kF16}, 4); }
TEST(TpGemmAr, WorldSize3) { run_world(3, cases(), {DType::kBF16, DType::kF16}, 4); }
TEST(TpGemmAr, WorldSize4) { run_world(4, cases(), {DType::kBF16}, 4); }
TEST(TpGemmAr, WorldSize8) { run_world(8, cases(), {DType::kBF16, DType::kF16}, 4); }

TEST(TpGemmAr, GraphReplayWithoutReset) { run_world(2, {cases()[0]}, {DType::kBF16}, 4, Mode::kGraph); }

/// Random case `idx` for `num_ranks` ranks (W <= 8), valid by validate_gemm_ar_shape and validate_gemm_ar_call: any
/// M >= 1, K a positive multiple of 8. The calls' M: max_m, then one log-uniform in 1..max_m. idx % 4 picks the side
/// of the all-reduce choice (GemmArOptions::collective_all_reduce): 0 ops::all_reduce (N a multiple of 8, C's rows
/// contiguous, partials in the output dtype), 1 the op's kernel for N not a multiple of 8, 2 the op's kernel for N a
/// multiple of 8 (padded C, or fp32 partials), 3 M <= 16 with K >= 4096 (where the small-M plan takes B's rows by bulk
/// copies, kBulkRows). Sides 0-2 take max_m > 64 (tiled GEMM at max_m) or <= 64 (small-M) by turns.
ArCase draw_case(gemm_test::RandomDraw& draw, int num_ranks, int idx) {
    const int side = idx % 4;
    ArCase c{};
    c.max_m = (idx + num_ranks) % 2 == 0 ? draw.log_uniform(1, 64) : draw.uniform(65, 128);
    c.n = draw.log_uniform(8, 1500);
    c.k = 8 * draw.log_uniform(1, 150);
    if (side == 0 || side == 2) c.n = 8 * draw.log_uniform(1, 187);
    if (side == 1) c.n = 8 * draw.log_uniform(1, 187) + draw.uniform(1, 7);
    if (side == 3) {
        c.max_m = draw.log_uniform(1, 16);
        c.k = draw.uniform(0, 1) == 0 ? 2048 * draw.uniform(2, 3) : 4096 + 8 * draw.uniform(1, 255);
    }
    if (side != 0) {
        if (draw.uniform(0, 1) == 0) c.c_pad = draw.uniform(1, 24);
        c.f32_partials = draw.uniform(0, 2) == 0;
    }
    if (side == 2 && c.c_pad == 0 && !c.f32_partials) c.c_pad = draw.uniform(1, 24);
    // The reference sums every row of every rank's product: max_m x N x K at most 1.5e8 (K halved; side 3's never is).
    while (c.max_m * c.n * c.k > 150'000'000) c.k = std::max<int64_t>(8, c.k / 16 * 8);
    c.ms = {c.max_m, draw.log_uniform(1, c.max_m)};
    return c;
}

// World sizes 5, 6 and 7 (the tests above take 1, 2, 3, 4 and 8) on four drawn cases each, one per side of the
// all-reduce choice (draw_case): max_m log-uniform in 1..64 or uniform in 65..128 (1..16 on side 3), N in 8..1500 (a
// multiple of 8 or not, by side), K a multiple of 8 in 8..1200 (4096..6144 on side 3), off side 0 a padded C (1..24
// elements, rounded up to 16 bytes) at even odds and fp32 partials (1 in 3). bf16 or f16 per world (world 6 the
// other of world 5's). Two calls per case (M = max_m, then less), checked as above, bit-identical on every rank.
TEST(TpGemmAr, RandomShapesAtWorlds5To7) {
    run_random_worlds_5_to_7<ArCase>(
        [](gemm_test::RandomDraw& draw, int num_ranks, int i) { return draw_case(draw, num_ranks, i); },
        [](int num_ranks, const std::vector<ArCase>& cases, DType dtype, uint64_t seed) {
            run_world(num_ranks, cases, {dtype}, 2, Mode::kEager, seed);
        });
}

// Ranks that call with different M: every rank's call throws naming both ranks' M (the op's own reduction kernel) or
// both all-reduce counts (the all-reduce half through ops::all_reduce), and no rank's C is written (its poison
// stays). The kernels end with `exit`: after every rank cleared its diagnostics the ranks meet again.
TEST(TpGemmAr, DifferentMOnTwoRanksIsDiagnosedOnBoth) {
    const int64_t n = 1024, k = 256, max_m = 64;
    for (bool collective : {false, true}) {
        SCOPED_TRACE(collective ? "ops::all_reduce" : "the op's reduction kernel");
        std::mutex mutex;
        std::vector<std::string> messages(2);
        std::vector<int64_t> written(2, -1);
        WorldOptions options = test::test_options(256ull << 20);
        options.heartbeat = std::chrono::milliseconds(200);
        test::run_ranks(
            2,
            [&](World& w) {
                const int me = w.rank();
                const int64_t m = me == 0 ? 16 : 32;
                const DType dt = DType::kBF16;
                cudaStream_t st = nullptr;
                WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
                {
                    ops::GemmArOptions opt;
                    opt.collective_all_reduce = collective;
                    ops::GemmAr op(w, {max_m, n, k, dt}, opt);
                    HostMat a(m, k, ld_for(k), dt), b(n, k, ld_for(k), dt), c(m, n, ld_for(n), dt);
                    a.fill_random(seed_of(11, 0, me, 0));
                    b.fill_random(seed_of(11, 1, me, 0));
                    poison(c);
                    const HostMat c_poisoned = c;
                    DevBuf a_dev(a.bytes()), b_dev(b.bytes()), c_dev(c.bytes());
                    upload(a, a_dev.ptr, st);
                    upload(b, b_dev.ptr, st);
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
                WEFT_CUDA_CHECK(cudaStreamDestroy(st));
            },
            options);
        const std::vector<std::string> words =
            collective ? std::vector<std::string>{"collective call differs from rank", "all_reduce",
                                                  std::to_string(16 * n) + " bf16 elements",
                                                  std::to_string(32 * n) + " bf16 elements"}
                       : std::vector<std::string>{"collective call differs from rank", "rank 0 called gemm_ar with M = 16",
                                                  "rank 1 called gemm_ar with M = 32"};
        for (int r = 0; r < 2; ++r) {
            const std::string& m = messages[static_cast<size_t>(r)];
            EXPECT_FALSE(m.empty()) << "rank " << r << " did not throw";
            for (const std::string& word : words) {
                EXPECT_NE(m.find(word), std::string::npos) << "rank " << r << ": '" << word << "' not in: " << m;
            }
            EXPECT_EQ(written[static_cast<size_t>(r)], 0) << "rank " << r << ": elements of C were written";
        }
    }
}

// Members that disagree on what their peers' partials are (the all-reduce path, the partials' dtype, N) fail at
// construction on every member, naming the field and both values, instead of runs that wait on different signal words.
TEST(TpGemmAr, MembersThatDisagreeFailConstructionOnEveryMember) {
    struct Disagreement {
        const char* field;
        std::string rank0, rank1;  // the values the error names
        std::function<void(int, ops::GemmArShape&, ops::GemmArOptions&)> apply;
    };
    const std::vector<Disagreement> cases = {
        {"all-reduce paths", "ops::all_reduce", "the op's own kernel",
         [](int me, ops::GemmArShape&, ops::GemmArOptions& o) { o.collective_all_reduce = me == 0; }},
        {"partial dtypes", "bf16", "f32",
         [](int me, ops::GemmArShape&, ops::GemmArOptions& o) {
             if (me == 1) o.partial_dtype = DType::kF32;
         }},
        {"shape.n", "1024", "1016",
         [](int me, ops::GemmArShape& s, ops::GemmArOptions&) { s.n = me == 0 ? 1024 : 1016; }},
    };
    for (const Disagreement& d : cases) {
        SCOPED_TRACE(d.field);
        const std::vector<std::string> messages = test::error_of_each_rank(2, [&](World& w) {
            ops::GemmArShape shape{64, 1024, 256, DType::kBF16};
            ops::GemmArOptions options;
            d.apply(w.rank(), shape, options);
            ops::GemmAr op(w, shape, options);
        });
        for (int r = 0; r < 2; ++r) {
            const std::string& m = messages[static_cast<size_t>(r)];
            EXPECT_NE(m.find(std::string("the members' ") + d.field), std::string::npos) << "rank " << r << ": " << m;
            EXPECT_NE(m.find(r == 0 ? d.rank0 : d.rank1), std::string::npos) << "rank " << r << ": " << m;
            EXPECT_NE(m.find(r == 0 ? d.rank1 : d.rank0), std::string::npos) << "rank " << r << ": " << m;
        }
    }
}

}  // namespace
}  // namespace weft
