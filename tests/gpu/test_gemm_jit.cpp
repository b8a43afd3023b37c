// SPDX-License-Identifier: MIT
// GPU tests of weft::ops::gemm through weft::jit, from host-only C++: fp64 CPU references on awkward shapes,
// layouts, dtypes, strides and cluster configs; the autotuner's pick and its cached decision; and the hooks' epoch
// mode across CUDA-graph replays.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/gemm_testing.hpp"
#include "support/jit_testing.hpp"
#include "weft/common/gemm_hook_params.hpp"
#include "weft/jit/autotune.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/detail/gemm_launch.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

using namespace gemm_test;

using weft::testing::read_text_file;
using weft::testing::ScopedEnv;
using weft::testing::TempDir;

#define CK(call)                                                                          \
    do {                                                                                  \
        const cudaError_t err_ = (call);                                                  \
        ASSERT_EQ(err_, cudaSuccess) << #call << ": " << cudaGetErrorString(err_);        \
    } while (0)

#define REQUIRE_SM90()                               \
    do {                                             \
        std::string why_;                            \
        if (!have_sm90(&why_)) GTEST_SKIP() << why_; \
    } while (0)

std::vector<int64_t> all_rows(int64_t m) {
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < m; ++r) rows.push_back(r);
    return rows;
}

int64_t ld_for(int64_t cols, int64_t pad, DType t) {
    const int64_t align = 16 / dtype_bytes(t);  // row strides must be multiples of 16 bytes (TMA)
    return (cols + pad + align - 1) / align * align;
}

/// One call's shape, types, strides and options.
struct Case {
    int64_t m, n, k;
    DType in, out;
    BLayout layout;
    int64_t pad_a, pad_b, pad_d;  // extra elements per row
    std::optional<GemmConfig> config;
    std::optional<GemvVariant> small_m_variant;  // unset: the op picks
    int small_m_max_m = ops::GemmOptions{}.small_m_max_m;

    Case(int64_t m_, int64_t n_, int64_t k_, DType in_ = DType::kBF16, DType out_ = DType::kBF16,
         BLayout layout_ = BLayout::kNK, int64_t pad_a_ = 0, int64_t pad_b_ = 0, int64_t pad_d_ = 0)
        : m(m_), n(n_), k(k_), in(in_), out(out_), layout(layout_), pad_a(pad_a_), pad_b(pad_b_), pad_d(pad_d_) {}
};

std::string describe(const Case& c) {
    std::ostringstream os;
    os << c.m << "x" << c.n << "x" << c.k << " " << dtype_name(c.in) << "->" << dtype_name(c.out)
       << (c.layout == BLayout::kNK ? " B[N,K]" : " B[K,N]") << " pads(" << c.pad_a << "," << c.pad_b << ","
       << c.pad_d << ") variant "
       << (c.small_m_variant ? std::to_string(static_cast<int>(*c.small_m_variant)) : std::string("auto"))
       << " small_m_max_m " << c.small_m_max_m
       << (c.config ? " config " + ops::gemm_candidate_name(*c.config) : std::string(" auto"));
    return os.str();
}

/// Inputs and poisoned output of a case, on the host and the device.
struct Operands {
    HostMatrix a, b, d;
    DeviceBuffer da, db, dd;
    Operands(const Case& c, std::mt19937_64& rng)
        : a(c.m, c.k, ld_for(c.k, c.pad_a, c.in), c.in),
          b(c.layout == BLayout::kNK ? HostMatrix(c.n, c.k, ld_for(c.k, c.pad_b, c.in), c.in)
                                     : HostMatrix(c.k, c.n, ld_for(c.n, c.pad_b, c.in), c.in)),
          d(c.m, c.n, ld_for(c.n, c.pad_d, c.out), c.out),
          da(a.bytes.size()),
          db(b.bytes.size()),
          dd(d.bytes.size()) {
        a.fill_random(rng);
        b.fill_random(rng);
        poison(d);
    }
    bool allocated() const { return da.ptr && db.ptr && dd.ptr; }
};

ops::GemmOptions jit_options(const Case& c) {
    ops::GemmOptions o;
    o.config = c.config;
    o.small_m_variant = c.small_m_variant;
    o.small_m_max_m = c.small_m_max_m;
    return o;
}

/// Runs `c` through weft::ops::gemm (JIT) and checks it against fp64 (all rows, or `sample_rows` of them).
void check_case(const Case& c, const ops::GemmOptions& options, int sample_rows = 0) {
    const uint64_t seed = fresh_seed();
    const std::string what = describe(c) + " seed " + std::to_string(seed);
    SCOPED_TRACE(what);
    std::mt19937_64 rng(seed);
    Operands x(c, rng);
    ASSERT_TRUE(x.allocated());
    upload(x.a, x.da);
    upload(x.b, x.db);
    upload(x.d, x.dd);
    try {
        ops::gemm(view(x.a, x.da), view(x.b, x.db), view(x.d, x.dd), c.layout, nullptr, options);
    } catch (const std::exception& e) {
        FAIL() << "weft::ops::gemm threw: " << e.what();
    }
    const cudaError_t err = cudaDeviceSynchronize();
    ASSERT_EQ(err, cudaSuccess) << "kernel failed: " << cudaGetErrorString(err);
    download(x.d, x.dd);
    std::vector<int64_t> rows;
    if (sample_rows > 0 && sample_rows < c.m) {
        std::uniform_int_distribution<int64_t> u(0, c.m - 1);
        rows = {0, c.m - 1};
        while (static_cast<int>(rows.size()) < sample_rows) rows.push_back(u(rng));
    } else {
        rows = all_rows(c.m);
    }
    expect_matches(x.d, reference(x.a, x.b, c.layout, c.n, rows), rows, tolerance_for(c.out), what);
}

/// Compiles specs on several threads (a cold cache then costs one compile's time, not their sum).
void compile_in_parallel(const std::vector<jit::KernelSpec>& specs) {
    std::atomic<size_t> next{0};
    std::vector<std::thread> threads;
    const size_t n = std::min<size_t>(specs.size(), std::max(1u, std::thread::hardware_concurrency()));
    for (size_t t = 0; t < n; ++t) {
        threads.emplace_back([&] {
            for (size_t i = next++; i < specs.size(); i = next++) {
                try {
                    jit::compiler().compile(specs[i]);
                } catch (const std::exception&) {
                    // The test's own call reports it.
                }
            }
        });
    }
    for (auto& t : threads) t.join();
}

/// The kernel specs the op will compile for these cases (same text as the op's: same memo and cache key).
std::vector<jit::KernelSpec> specs_for(const std::vector<Case>& cases) {
    const std::string arch = jit::Compiler::resolve_arch("");
    std::vector<jit::KernelSpec> specs;
    for (const Case& c : cases) {
        ops::GemmProblem p;
        p.m = c.m;
        p.n = c.n;
        p.k = c.k;
        p.b_layout = c.layout;
        p.in_dtype = c.in;
        p.out_dtype = c.out;
        p.b_rows_contiguous = c.layout == BLayout::kNK && c.pad_b == 0;  // as validate_gemm_args sets it (K % 8 == 0)
        const ops::GemmPlan plan = ops::plan_gemm(p, num_sms(), jit_options(c));
        if (plan.path == ops::GemmPath::kSmallM) {
            specs.push_back(ops::gemv_kernel_spec(ops::gemv_config(plan, p), arch));
        } else {
            specs.push_back(ops::gemm_kernel_spec(plan.config, arch));
        }
    }
    return specs;
}

/// No autotuning setting of the caller's shell leaks into a test.
struct CleanAutotuneEnv {
    ScopedEnv autotune{"WEFT_AUTOTUNE", std::nullopt};
    ScopedEnv force{"WEFT_AUTOTUNE_FORCE", std::nullopt};
};

// ---- correctness through the JIT ------------------------------------------------------------------------

TEST(GemmJit, MatchesFp64OnAwkwardShapesLayoutsAndDtypes) {
    REQUIRE_SM90();
    CleanAutotuneEnv env;  // the heuristic plans these calls, whatever the caller's shell says
    const GemmConfig a_pair = gemm_candidate(2, DType::kBF16, DType::kBF16, BLayout::kNK);  // cluster 1x2
    const GemmConfig b_pair_kn = gemm_candidate(4, DType::kF16, DType::kF32, BLayout::kKN);  // 256x128, 2x1
    std::vector<Case> cases = {
        {1, 264, 72},                                             // small M (variant 3), K not a multiple of 64
        {37, 200, 1024, DType::kBF16, DType::kF32, BLayout::kNK, 8, 8, 8},  // small M, 3 row tiles, split-K, strides
        {64, 1000, 512, DType::kF16, DType::kF16},                // small M, 4 row tiles
        {100, 200, 72},                                           // tiled: nothing a multiple of the tile
        {129, 257, 136, DType::kF16, DType::kF32, BLayout::kKN},  // one past the tile, B [K,N]
        {255, 520, 328, DType::kBF16, DType::kBF16, BLayout::kNK, 16, 24, 8},  // strides everywhere
        {33, 3, 64, DType::kBF16, DType::kBF16, BLayout::kNK, 0, 0, 5},        // small M, N = 3
        {100, 3, 64, DType::kBF16, DType::kBF16, BLayout::kNK, 0, 0, 5},       // tiled, no TMA-stored column
        {777, 1100, 256},                                         // ragged N through the cluster pair (below)
        {300, 384, 512, DType::kF16, DType::kF32, BLayout::kKN},  // B pair with B [K,N] (below)
        {3, 100, 1000, DType::kBF16, DType::kBF16, BLayout::kNK, 8, 0, 8},  // small M: ragged N and K
        {17, 200, 1032, DType::kF16, DType::kF32},                          // small M, 2 row tiles
        {64, 136, 72, DType::kBF16, DType::kF32},                           // small M, 4 row tiles, K < one stage
        {2, 520, 4096, DType::kBF16, DType::kF32, BLayout::kNK, 8, 0, 8},   // variant 4, whole rows (below)
        {9, 700, 6144, DType::kF16, DType::kF16},                           // variant 4, row groups (below)
    };
    cases[13].small_m_variant = GemvVariant::kBulkRows;
    cases[14].small_m_variant = GemvVariant::kBulkRows;
    cases[8].config = a_pair;
    cases[9].config = b_pair_kn;
    // Every case with M <= 64 here is meant for the small-M kernels (the default sends M > 16 to the tiled one).
    for (Case& c : cases) {
        if (c.m <= kGemvMaxM) c.small_m_max_m = kGemvMaxM;
    }
    compile_in_parallel(specs_for(cases));
    for (const Case& c : cases) check_case(c, jit_options(c));
}

TEST(GemmJit, CompilesConfigsOutsideTheCandidateSet) {
    REQUIRE_SM90();
    CleanAutotuneEnv env;  // the heuristic plans these calls, whatever the caller's shell says
    GemmConfig c = gemm_candidate(5, DType::kBF16, DType::kBF16, BLayout::kKN);  // 128x192 ...
    c.stages = 3;                                                               // ... with 3 stages,
    c.raster = Raster::kAlongM;                                                 // raster along M,
    c.raster_group = 3;                                                         // groups of 3 columns
    ASSERT_TRUE(is_valid(c));
    Case k{700, 900, 320, DType::kBF16, DType::kBF16, BLayout::kKN, 0, 8, 8};
    k.config = c;
    check_case(k, jit_options(k));
}

TEST(GemmJit, RepeatedCallsCompileNothingAndStayCorrect) {
    REQUIRE_SM90();
    CleanAutotuneEnv env;  // the heuristic plans these calls, whatever the caller's shell says
    Case c{200, 320, 192, DType::kF16, DType::kF16, BLayout::kNK, 8, 0, 8};
    check_case(c, jit_options(c));  // compiles (or loads) the kernel
    const jit::CompilerStats before = jit::compiler().stats();
    for (int i = 0; i < 3; ++i) check_case(c, jit_options(c));
    const jit::CompilerStats after = jit::compiler().stats();
    EXPECT_EQ(after.compiles, before.compiles) << "a repeated call compiled again";
    EXPECT_EQ(after.loads, before.loads) << "a repeated call loaded again";
    EXPECT_EQ(after.hits() + after.misses, before.hits() + before.misses)
        << "a repeated call went back to the compiler instead of the op's kernel table";
}

// ---- autotuning -----------------------------------------------------------------------------------------

void check_autotune(const Case& c, int sample_rows) {
    CleanAutotuneEnv env;
    TempDir dir("weft_gemm_autotune");
    jit::AutotuneConfig config;
    config.enabled = true;
    config.cache_dir = dir.path();
    jit::Autotuner tuner(config);
    ops::GemmOptions o = jit_options(c);
    o.autotune = true;
    o.autotuner = &tuner;

    std::mt19937_64 rng(fresh_seed());
    Operands x(c, rng);
    ASSERT_TRUE(x.allocated());
    upload(x.a, x.da);
    upload(x.b, x.db);
    const ops::GemmSelection first = ops::select_gemm(view(x.a, x.da), view(x.b, x.db), view(x.d, x.dd), c.layout,
                                                      nullptr, o);
    CK(cudaDeviceSynchronize());
    EXPECT_EQ(first.origin, ops::GemmChoice::kTuned);
    ops::GemmProblem p = ops::validate_gemm_args(view(x.a, x.da), view(x.b, x.db), view(x.d, x.dd), c.layout);
    std::set<std::string> names;
    for (const auto& cand : ops::gemm_tune_candidates(p, num_sms(), o)) names.insert(cand.name);
    EXPECT_EQ(names.count(first.candidate), 1u) << first.candidate << " is not a candidate";
    if (first.plan.path == ops::GemmPath::kTiled) {
        EXPECT_TRUE(is_valid(first.plan.config)) << first.candidate;
    }
    std::printf("[ autotune ] %s -> %s\n", describe(c).c_str(), first.candidate.c_str());

    const ops::GemmSelection second = ops::select_gemm(view(x.a, x.da), view(x.b, x.db), view(x.d, x.dd), c.layout,
                                                       nullptr, o);
    EXPECT_EQ(second.origin, ops::GemmChoice::kCached) << "the second call tuned again";
    EXPECT_EQ(second.candidate, first.candidate);
    const std::string file = read_text_file(dir / "autotune.txt");
    EXPECT_NE(file.find(first.candidate), std::string::npos) << file;

    // A fresh tuner (another process) reads the decision from disk; the op's result is right.
    jit::Autotuner reread(config);
    o.autotuner = &reread;
    const ops::GemmSelection third = ops::select_gemm(view(x.a, x.da), view(x.b, x.db), view(x.d, x.dd), c.layout,
                                                      nullptr, o);
    EXPECT_EQ(third.origin, ops::GemmChoice::kCached);
    EXPECT_EQ(third.candidate, first.candidate);
    check_case(c, o, sample_rows);
}

TEST(GemmJit, AutotunePicksAValidConfigAndCachesTheDecision) {
    REQUIRE_SM90();
    check_autotune(Case{1024, 1536, 512}, 96);
    check_autotune(Case{16, 2048, 2048, DType::kBF16, DType::kF32}, 0);  // the small-M variants compete too
}

// ---- hooks in epoch mode under CUDA-graph replay ----------------------------------------------------------

// GEMM1 (C1 = A1 * B1, one tile column) raises flags[m_tile] = epoch with TileSignalHook (kSetPerTile, kEpoch);
// GEMM2 (D2 = C1 * B2) waits with ChunkWaitScheduler (kEpoch, one chunk per GEMM1 tile row) before loading C1
// rows. Both run concurrently on two streams after a node that advances the epoch: once eagerly, then as
// replays of a captured graph. The flags are never reset and C1 is poisoned before each generation: a GEMM2
// that waited for a frozen (captured) generation would start on poison from the second replay on; with the
// epoch it waits for its own generation's rows.
TEST(GemmJit, EpochModeHooksWaitForTheirReplaysGeneration) {
    REQUIRE_SM90();
    const GemmConfig cfg = gemm_candidate(6, DType::kBF16, DType::kBF16, BLayout::kNK);  // 128x128, 6 stages
    const int64_t m = 1000, k1 = 2048, n1 = cfg.tile_n, n2 = 328;
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    HostMatrix a1(m, k1, k1, DType::kBF16), b1(n1, k1, k1, DType::kBF16), c1(m, n1, n1, DType::kBF16),
        b2(n2, n1, n1, DType::kBF16), d2(m, n2, ld_for(n2, 0, DType::kBF16), DType::kBF16);
    b1.fill_random(rng);
    b2.fill_random(rng);
    const GemmTileGrid grid1(cfg, static_cast<int32_t>(m), static_cast<int32_t>(n1));
    const GemmTileGrid grid2(cfg, static_cast<int32_t>(m), static_cast<int32_t>(n2));
    ASSERT_EQ(grid1.num_n_tiles, 1);
    DeviceBuffer da1(a1.bytes.size()), db1(b1.bytes.size()), dc1(c1.bytes.size()), db2(b2.bytes.size()),
        dd2(d2.bytes.size()), dflags(8 * static_cast<size_t>(grid1.num_m_tiles)), depoch(8), dscratch(8);
    ASSERT_TRUE(da1.ptr && db1.ptr && dc1.ptr && db2.ptr && dd2.ptr && dflags.ptr && depoch.ptr && dscratch.ptr);
    upload(b1, db1);
    upload(b2, db2);
    CK(cudaMemset(dflags.ptr, 0, dflags.bytes));
    CK(cudaMemset(depoch.ptr, 0, 8));

    // Every kernel is compiled and loaded before anything is captured or spins.
    jit::Kernel& producer = ops::detail::gemm_jit_kernel(
        ops::gemm_kernel_spec(cfg, "weft::kernels::gemm::PersistentScheduler", "weft::kernels::gemm::TileSignalHook"));
    jit::Kernel& consumer = ops::detail::gemm_jit_kernel(
        ops::gemm_kernel_spec(cfg, "weft::kernels::gemm::ChunkWaitScheduler", "weft::kernels::gemm::NoEpilogueHook"));
    ops::gemm_advance_epoch(static_cast<uint64_t*>(dscratch.ptr), nullptr);
    CK(cudaDeviceSynchronize());

    constexpr uint64_t kTimeoutNs = 5'000'000'000ull;
    const TensorView va1 = view(a1, da1), vb1 = view(b1, db1), vc1 = view(c1, dc1), vb2 = view(b2, db2),
                     vd2 = view(d2, dd2);
    const auto maps1 = ops::detail::make_gemm_tensor_maps(cfg, va1, vb1, vc1);
    const auto maps2 = ops::detail::make_gemm_tensor_maps(cfg, vc1, vb2, vd2);
    const GemmArgs args1 = ops::detail::make_gemm_args(va1, vc1, kTimeoutNs);
    const GemmArgs args2 = ops::detail::make_gemm_args(vc1, vd2, kTimeoutNs);
    const gemm::PersistentSchedulerParams sched1{};
    gemm::TileSignalParams hook1{};
    hook1.flags = static_cast<uint64_t*>(dflags.ptr);
    hook1.value = 1;
    hook1.num_n_tiles = grid1.num_n_tiles;
    hook1.mode = gemm::TileSignalMode::kSetPerTile;
    hook1.value_mode = gemm::SignalValueMode::kEpoch;
    hook1.epoch = static_cast<const uint64_t*>(depoch.ptr);
    gemm::ChunkWaitParams sched2{};
    sched2.flags = static_cast<const uint64_t*>(dflags.ptr);
    sched2.rows_per_chunk = cfg.tile_m;
    sched2.expected = 1;
    sched2.timeout_ns = kTimeoutNs;
    sched2.diag = nullptr;
    sched2.value_mode = gemm::SignalValueMode::kEpoch;
    sched2.epoch = static_cast<const uint64_t*>(depoch.ptr);
    const gemm::NoEpilogueHookParams hook2{};
    // Both grids fit on the device at once (the consumer spins while the producer computes).
    const int grid_producer = grid1.num_tiles();
    const int grid_consumer = std::min(grid2.num_tiles(), num_sms() - grid_producer - 4);
    ASSERT_GT(grid_consumer, 0);

    // Streams, events and the graph, released however the test ends.
    struct Resources {
        cudaStream_t s0 = nullptr, s1 = nullptr, s2 = nullptr;
        cudaEvent_t fork = nullptr, join1 = nullptr, join2 = nullptr;
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        ~Resources() {
            if (exec) cudaGraphExecDestroy(exec);
            if (graph) cudaGraphDestroy(graph);
            for (cudaEvent_t e : {fork, join1, join2}) {
                if (e) cudaEventDestroy(e);
            }
            for (cudaStream_t s : {s0, s1, s2}) {
                if (s) cudaStreamDestroy(s);
            }
        }
    } r;
    CK(cudaStreamCreateWithFlags(&r.s0, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&r.s1, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&r.s2, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&r.fork, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&r.join1, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&r.join2, cudaEventDisableTiming));

    // One generation: advance the epoch on s0, fork, consumer on s2 and producer on s1 concurrently, join.
    auto enqueue_generation = [&] {
        ops::gemm_advance_epoch(static_cast<uint64_t*>(depoch.ptr), r.s0);
        WEFT_CUDA_CHECK(cudaEventRecord(r.fork, r.s0));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(r.s1, r.fork, 0));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(r.s2, r.fork, 0));
        ops::detail::launch_gemm_kernel(consumer, cfg, maps2, args2, grid_consumer, sched2, hook2, r.s2);
        ops::detail::launch_gemm_kernel(producer, cfg, maps1, args1, grid_producer, sched1, hook1, r.s1);
        WEFT_CUDA_CHECK(cudaEventRecord(r.join1, r.s1));
        WEFT_CUDA_CHECK(cudaEventRecord(r.join2, r.s2));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(r.s0, r.join1, 0));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(r.s0, r.join2, 0));
    };

    // Generation 1 runs eagerly (it also sets every kernel's attributes before the capture); generations 2..4
    // are replays of one captured graph.
    for (uint64_t generation = 1; generation <= 4; ++generation) {
        const bool eager = generation == 1;
        SCOPED_TRACE((eager ? "eager generation " : "graph replay, generation ") + std::to_string(generation));
        a1.fill_random(rng);  // fresh A1 every generation
        upload(a1, da1);
        CK(cudaMemset(dc1.ptr, 0xFF, dc1.bytes));  // C1 poison (NaN): a premature read shows in D2
        CK(cudaMemset(dd2.ptr, 0xFF, dd2.bytes));
        CK(cudaDeviceSynchronize());
        if (eager) {
            ASSERT_NO_THROW(enqueue_generation());
        } else {
            if (r.exec == nullptr) {
                CK(cudaStreamBeginCapture(r.s0, cudaStreamCaptureModeThreadLocal));
                try {
                    enqueue_generation();
                } catch (const std::exception& e) {
                    cudaStreamEndCapture(r.s0, &r.graph);
                    FAIL() << "capturing threw: " << e.what();
                }
                CK(cudaStreamEndCapture(r.s0, &r.graph));
                CK(cudaGraphInstantiate(&r.exec, r.graph, 0));
            }
            CK(cudaGraphLaunch(r.exec, r.s0));
        }
        const cudaError_t err = cudaStreamSynchronize(r.s0);
        ASSERT_EQ(err, cudaSuccess) << "the chain failed (a wait timed out?): " << cudaGetErrorString(err);

        uint64_t epoch = 0;
        CK(cudaMemcpy(&epoch, depoch.ptr, 8, cudaMemcpyDeviceToHost));
        EXPECT_EQ(epoch, generation) << "the epoch advanced once per generation";
        std::vector<uint64_t> flags(static_cast<size_t>(grid1.num_m_tiles));
        CK(cudaMemcpy(flags.data(), dflags.ptr, 8 * flags.size(), cudaMemcpyDeviceToHost));
        for (size_t t = 0; t < flags.size(); ++t) EXPECT_EQ(flags[t], generation) << "tile row " << t << " signal";

        download(c1, dc1);
        download(d2, dd2);
        const std::vector<int64_t> rows = all_rows(m);
        expect_matches(c1, reference(a1, b1, BLayout::kNK, n1, rows), rows, tolerance_for(DType::kBF16), "C1");
        // D2 against the C1 the GPU produced (independent of C1's rounding).
        expect_matches(d2, reference(c1, b2, BLayout::kNK, n2, rows), rows, tolerance_for(DType::kBF16), "D2");
        if (HasFailure()) break;
    }
}

// Host memory (pageable or pinned) as an operand is refused before anything is enqueued, naming the operand, not
// handed to the tensor maps.
TEST(GemmJit, HostMemoryIsRefusedNamingTheOperand) {
    REQUIRE_SM90();
    DeviceBuffer a_buf(128 * 64 * 2), b_buf(128 * 64 * 2), d_buf(128 * 128 * 2);
    ASSERT_TRUE(a_buf.ptr && b_buf.ptr && d_buf.ptr);
    std::vector<uint16_t> pageable(128 * 128);
    void* pinned = nullptr;
    ASSERT_EQ(cudaMallocHost(&pinned, 128 * 128 * 2), cudaSuccess);
    const auto message = error_message;
    const TensorView a(a_buf.ptr, DType::kBF16, {128, 64}), b(b_buf.ptr, DType::kBF16, {128, 64});
    const TensorView d(d_buf.ptr, DType::kBF16, {128, 128});
    const std::string a_err = message([&] {
        ops::gemm(TensorView(pageable.data(), DType::kBF16, {128, 64}), b, d, BLayout::kNK, nullptr);
    });
    EXPECT_NE(a_err.find("gemm: a ("), std::string::npos) << a_err;
    EXPECT_NE(a_err.find("must be device memory, got unregistered host memory"), std::string::npos) << a_err;
    const std::string d_err = message([&] {
        ops::gemm(a, b, TensorView(pinned, DType::kBF16, {128, 128}), BLayout::kNK, nullptr);
    });
    EXPECT_NE(d_err.find("gemm: d ("), std::string::npos) << d_err;
    EXPECT_NE(d_err.find("must be device memory, got pinned host memory"), std::string::npos) << d_err;
    EXPECT_EQ(message([&] { ops::gemm(a, b, d, BLayout::kNK, nullptr); }), "");  // device memory runs
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaFreeHost(pinned);
}

}  // namespace
}  // namespace weft
