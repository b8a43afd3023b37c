// SPDX-License-Identifier: MIT
// GPU tests of the sm_90a GEMM (kernels from weft::jit, the library's one launch path): an fp64 CPU reference on
// small and awkward shapes (every candidate config, both B layouts, every dtype pair, strides, tiny SM budgets), the
// small-M path, cuBLASLt on large shapes, and the communication hooks driven by a producer kernel on another stream.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/gemm_testing.hpp"
#include "weft/common/gemm_hook_params.hpp"
#include "weft/detail/gemm_launch.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/ptx/griddep.cuh"
#include "weft/ptx/timer.cuh"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

using namespace gemm_test;

// Eager module loading (spinning kernels need their producers loadable): tests/support/runtime_checks.cpp
// calls prepare_cuda_environment() before main for the whole binary.

#define CK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(call)

#define REQUIRE_SM90()                               \
    do {                                             \
        std::string why_;                            \
        if (!have_sm90(&why_)) GTEST_SKIP() << why_; \
    } while (0)

struct Case {
    int64_t m, n, k;
    DType in = DType::kBF16, out = DType::kBF16;
    BLayout layout = BLayout::kNK;
    int64_t pad_a = 0, pad_b = 0, pad_d = 0;  // extra elements per row
    std::optional<GemmConfig> config;
    int sm_budget = 0;
    bool allow_small_m = true;
    int small_m_splits = 0;
    std::optional<GemvVariant> small_m_variant;  // unset: the op picks
    int small_m_max_m = ops::GemmOptions{}.small_m_max_m;  // kGemvMaxM in the cases meant for the small-M path
    int split_k = 0;  // GemmOptions::split_k
};

std::string describe(const Case& c, uint64_t seed) {
    std::ostringstream os;
    os << c.m << "x" << c.n << "x" << c.k << " " << dtype_name(c.in) << "->" << dtype_name(c.out) << " "
       << (c.layout == BLayout::kNK ? "B[N,K]" : "B[K,N]") << " pads(" << c.pad_a << "," << c.pad_b << ","
       << c.pad_d << ") budget " << c.sm_budget << " splits " << c.small_m_splits << " variant "
       << (c.small_m_variant ? std::to_string(static_cast<int>(*c.small_m_variant)) : std::string("auto"))
       << " small_m_max_m " << c.small_m_max_m << " split_k " << c.split_k
       << (c.config ? " config " + ops::format_gemm_config(*c.config) : std::string(" auto")) << " seed " << seed;
    return os.str();
}

/// Runs one case against the fp64 reference (all rows, or `sample_rows` random rows when > 0).
void check_case(const Case& c, int sample_rows = 0) {
    const uint64_t seed = fresh_seed();
    const std::string what = describe(c, seed);
    SCOPED_TRACE(what);
    std::mt19937_64 rng(seed);
    const int64_t esize_in = dtype_bytes(c.in);
    auto ld_for = [&](int64_t cols, int64_t pad, int64_t esize) {
        int64_t ld = cols + pad;
        const int64_t align = 16 / esize;  // row strides must be multiples of 16 bytes
        return (ld + align - 1) / align * align;
    };
    HostMatrix a(c.m, c.k, ld_for(c.k, c.pad_a, esize_in), c.in);
    HostMatrix b = c.layout == BLayout::kNK ? HostMatrix(c.n, c.k, ld_for(c.k, c.pad_b, esize_in), c.in)
                                            : HostMatrix(c.k, c.n, ld_for(c.n, c.pad_b, esize_in), c.in);
    HostMatrix d(c.m, c.n, ld_for(c.n, c.pad_d, dtype_bytes(c.out)), c.out);
    a.fill_random(rng);
    b.fill_random(rng);
    poison(d);
    DeviceBuffer da(a.bytes.size()), db(b.bytes.size()), dd(d.bytes.size());
    ASSERT_TRUE(da.ptr && db.ptr && dd.ptr);
    upload(a, da);
    upload(b, db);
    upload(d, dd);
    ops::GemmOptions o;
    o.config = c.config;
    o.sm_budget = c.sm_budget;
    o.allow_small_m = c.allow_small_m;
    o.small_m_splits = c.small_m_splits;
    o.small_m_variant = c.small_m_variant;
    o.small_m_max_m = c.small_m_max_m;
    o.split_k = c.split_k;
    try {
        ops::gemm(view(a, da), view(b, db), view(d, dd), c.layout, nullptr, o);
    } catch (const Error& e) {
        FAIL() << "weft::ops::gemm threw: " << e.what();
    }
    const cudaError_t err = cudaDeviceSynchronize();
    ASSERT_EQ(err, cudaSuccess) << "kernel failed: " << cudaGetErrorString(err);
    download(d, dd);
    std::vector<int64_t> rows;
    if (sample_rows > 0 && sample_rows < c.m) {
        std::uniform_int_distribution<int64_t> u(0, c.m - 1);
        rows = {0, c.m - 1};
        while (static_cast<int>(rows.size()) < sample_rows) rows.push_back(u(rng));
    } else {
        for (int64_t r = 0; r < c.m; ++r) rows.push_back(r);
    }
    const auto ref = reference(a, b, c.layout, c.n, rows);
    expect_matches(d, ref, rows, tolerance_for(c.out), what);
}

// The (input, output) dtype pairs besides bf16 -> bf16 (the default every Case starts from).
constexpr std::array<std::array<DType, 2>, 3> kOtherIoPairs = {{{DType::kBF16, DType::kF32},
                                                                {DType::kF16, DType::kF16},
                                                                {DType::kF16, DType::kF32}}};

/// One forced config (its dtypes and B layout) on an M x N x K shape, every row stride padded past its width.
void check_padded_case(const std::array<int64_t, 3>& shape, const GemmConfig& cfg) {
    Case c{shape[0], shape[1], shape[2], cfg.in_dtype, cfg.out_dtype, cfg.b_layout};
    c.pad_a = 8;
    c.pad_b = 24;
    c.pad_d = 16;
    c.config = cfg;
    check_case(c);
}

const std::vector<std::array<int64_t, 3>>& awkward_shapes() {
    static const std::vector<std::array<int64_t, 3>> shapes = {
        {1, 8, 8},        // M = 1, N = 8, K = 8: one partial tile everywhere
        {1, 264, 72},     // M = 1, K not a multiple of 64
        {17, 8, 200},     // N = 8
        {100, 200, 72},   // nothing a multiple of the tile
        {128, 256, 64},   // exactly one 128x256 tile, one k-block
        {129, 257, 136},  // one past the tile in M and N
        {300, 8, 1000},   // odd tile rows (cluster padding tiles), tiny N
        {255, 520, 328},  // several tiles, K with a partial last block
        {777, 1100, 256}, // 7 x 5 tiles (odd in both), ragged N (1100 * 2 bytes is not a multiple of 16)
        {33, 3, 64},      // N < 8: no column is TMA-stored at all
    };
    return shapes;
}

// Every candidate config, both layouts, bf16 -> bf16: the tiled kernel itself (small-M path off).
TEST(GemmTiled, EveryCandidateMatchesFp64OnAwkwardShapes) {
    REQUIRE_SM90();
    for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
        for (const GemmConfig& cfg : ops::gemm_candidate_configs(DType::kBF16, DType::kBF16, layout)) {
            for (const auto& s : awkward_shapes()) {
                Case c{s[0], s[1], s[2]};
                c.layout = layout;
                c.config = cfg;
                check_case(c);
            }
        }
    }
}

// Every dtype pair through the heuristic and through a cluster config, with leading-dimension padding.
TEST(GemmTiled, EveryDtypePairWithStridesMatchesFp64) {
    REQUIRE_SM90();
    const DType pairs[][2] = {{DType::kBF16, DType::kBF16}, {DType::kBF16, DType::kF32},
                              {DType::kF16, DType::kF16}, {DType::kF16, DType::kF32}};
    for (const auto& io : pairs) {
        for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
            for (int variant = 0; variant < 3; ++variant) {
                for (const auto& s : {std::array<int64_t, 3>{129, 257, 136}, std::array<int64_t, 3>{300, 72, 1000}}) {
                    Case c{s[0], s[1], s[2], io[0], io[1], layout};
                    c.pad_a = 8;
                    c.pad_b = 24;
                    c.pad_d = 16;
                    c.allow_small_m = false;
                    if (variant == 1) c.config = gemm_candidate(1, io[0], io[1], layout);  // B multicast pair
                    if (variant == 2) c.config = gemm_candidate(2, io[0], io[1], layout);  // A multicast pair
                    check_case(c);
                }
            }
        }
    }
}

// Few CTAs, many tiles each: the ring's phase bits wrap many times inside one CTA, across tiles.
TEST(GemmTiled, TinySmBudgetsWrapThePipeline) {
    REQUIRE_SM90();
    for (int budget : {1, 2, 3, 7}) {
        for (int idx : {0, 1, 3, 6, 7, 9, 10, 11, 12, 13}) {
            Case c{520, 1100, 456};
            c.config = gemm_candidate(idx, DType::kBF16, DType::kBF16, BLayout::kNK);
            c.sm_budget = budget;
            if (c.config->cluster_m * c.config->cluster_n > budget) c.sm_budget = 2;
            check_case(c);
        }
    }
}

// ---- split-K of the tiled kernel (GemmConfig::splits) ------------------------------------------------------

// Every split-K config the op may run (gemm_split_k_configs), both layouts, bf16 -> bf16, on awkward shapes (K with a
// partial last block, fewer k-blocks than splits: the scheduler splits K at most k-blocks ways; ragged N; M past one
// tile), poisoned outputs, then every dtype pair with strides through two of them.
TEST(GemmSplitK, EveryConfigMatchesFp64OnAwkwardShapes) {
    REQUIRE_SM90();
    for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
        for (const GemmConfig& cfg : ops::gemm_split_k_configs(DType::kBF16, DType::kBF16, layout)) {
            for (const auto& s : awkward_shapes()) {
                Case c{s[0], s[1], s[2]};
                c.layout = layout;
                c.config = cfg;
                check_case(c);
            }
        }
    }
    for (const auto& io : kOtherIoPairs) {
        for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
            for (int index : {12, 0}) {
                GemmConfig cfg = gemm_candidate(index, io[0], io[1], layout);
                cfg.splits = 3;
                check_padded_case({77, 1000, 1000}, cfg);
            }
        }
    }
}

// The shapes split-K is for: M = 1, 7, 24, 77, 160, 320, 513 at N = K = 4096 and 8192 and at an awkward N x K
// (1000 x 1000, 1032 x 4104), through the op's rule (split_k 0, small-M path off so that every M runs the tiled
// kernel) and forced 2 and 4 splits of the heuristic's tile; sampled rows of the fp64 reference for the large shapes.
TEST(GemmSplitK, OpRuleAndForcedSplitsMatchFp64) {
    REQUIRE_SM90();
    const std::array<int64_t, 2> nks[] = {{4096, 4096}, {8192, 8192}, {1000, 1000}, {1032, 4104}};
    for (const auto& nk : nks) {
        for (int64_t m : {1, 7, 24, 77, 160, 320, 513}) {
            for (int split_k : {0, 2, 4}) {
                Case c{m, nk[0], nk[1]};
                c.allow_small_m = false;
                c.split_k = split_k;
                check_case(c, nk[0] * nk[1] >= 4096 * 4096 ? 24 : 0);
            }
        }
    }
}

// Split-K sums the partials in split order whichever unit arrives last: the same inputs give the same bits under
// SM budgets that change which CTA runs which unit and when (1, 5, 64, all), and calls back to back on one stream with
// different tile counts find their counters at zero.
TEST(GemmSplitK, DeterministicAndRepeatable) {
    REQUIRE_SM90();
    const int64_t m = 77, n = 2056, k = 4096;
    std::mt19937_64 rng(fresh_seed());
    HostMatrix a(m, k, k, DType::kBF16), b(n, k, k, DType::kBF16);
    a.fill_random(rng);
    b.fill_random(rng);
    DeviceBuffer da(a.bytes.size()), db(b.bytes.size());
    ASSERT_TRUE(da.ptr && db.ptr);
    upload(a, da);
    upload(b, db);
    GemmConfig cfg = gemm_candidate(12, DType::kBF16, DType::kBF16, BLayout::kNK);
    cfg.splits = 4;
    std::vector<uint8_t> first;
    for (int budget : {0, 1, 5, 64, 0}) {
        HostMatrix d(m, n, n, DType::kBF16);
        poison(d);
        DeviceBuffer dd(d.bytes.size());
        ASSERT_TRUE(dd.ptr);
        upload(d, dd);
        ops::GemmOptions o;
        o.config = cfg;
        o.sm_budget = budget;
        ops::gemm(view(a, da), view(b, db), view(d, dd), BLayout::kNK, nullptr, o);
        CK(cudaDeviceSynchronize());
        download(d, dd);
        if (first.empty()) {
            first = d.bytes;
            const std::vector<int64_t> rows = {0, 1, 40, m - 1};
            expect_matches(d, reference(a, b, BLayout::kNK, n, rows), rows, tolerance_for(DType::kBF16), "split-K");
        } else {
            EXPECT_EQ(d.bytes, first) << "budget " << budget << ": not the same bits";
        }
        // A different tile count in between: its counters must come back to zero too.
        Case other{200, 1000, 2048};
        other.config = gemm_candidate(6, DType::kBF16, DType::kBF16, BLayout::kNK);
        other.config->splits = 2;
        check_case(other);
    }
}

// Raster orders and group sizes are pure scheduling: same result (configs outside the candidate set, which only
// holds the default raster: the JIT compiles them on first use).
// ---- swapped operands (GemmConfig::swap_ab) ----------------------------------------------------------------

// The swapped configs the tests run: the autotuner's sets at M = 320 and 77 (N = 4096) and at M = 160 (N = 8192), the
// narrowest and widest tile_m (16, 256), a ping-pong tile of 64 columns (48 rows) and its cluster pair.
std::vector<GemmConfig> swapped_test_configs(DType in = DType::kBF16, DType out = DType::kBF16) {
    std::vector<GemmConfig> v;
    const std::array<int64_t, 3> shapes[] = {{320, 4096, 4096}, {77, 4096, 4096}, {160, 8192, 8192}};
    for (const auto& s : shapes) {
        const ops::GemmProblem p{.m = s[0], .n = s[1], .k = s[2], .in_dtype = in, .out_dtype = out};
        for (const GemmConfig& c : ops::gemm_swap_ab_configs(p, 132)) {
            if (std::find(v.begin(), v.end(), c) == v.end()) v.push_back(c);
        }
    }
    GemmConfig base = gemm_candidate(6, in, out, BLayout::kNK);
    base.swap_ab = true;
    base.tile_n = 128;
    for (auto [tile_m, tile_n, pingpong, cluster_m, stages] :
         {std::array<int, 5>{16, 128, 0, 1, 8}, {256, 128, 0, 2, 4}, {48, 64, 1, 1, 8}, {48, 64, 1, 2, 8}}) {
        GemmConfig c = base;
        c.tile_m = tile_m;
        c.tile_n = tile_n;
        c.pingpong = pingpong != 0;
        c.cluster_m = cluster_m;
        c.stages = stages;
        EXPECT_TRUE(is_valid(c)) << ops::format_gemm_config(c);
        v.push_back(c);
    }
    return v;
}

// Every swapped test config on the awkward shapes (B [N,K], bf16 -> bf16): ragged M inside a row tile, N not a multiple
// of the 64-column slab, N with fewer than 16 bytes of columns past the last TMA-stored one, K with a partial last
// block, cluster pairs with a padding tile; poisoned outputs, every row against the fp64 reference.
TEST(GemmSwapAB, EveryConfigMatchesFp64OnAwkwardShapes) {
    REQUIRE_SM90();
    const std::vector<GemmConfig> configs = swapped_test_configs();
    ASSERT_GE(configs.size(), 8u);
    for (const GemmConfig& cfg : configs) {
        for (const auto& s : awkward_shapes()) {
            Case c{s[0], s[1], s[2]};
            c.config = cfg;
            check_case(c);
        }
    }
}

// Every other dtype pair (fp32 out: element stores into the staging buffer; f16: stmatrix .trans) with padded strides.
TEST(GemmSwapAB, EveryDtypePairWithStridesMatchesFp64) {
    REQUIRE_SM90();
    for (const auto& io : kOtherIoPairs) {
        const std::vector<GemmConfig> configs = swapped_test_configs(io[0], io[1]);
        for (const GemmConfig& cfg : {configs.front(), configs.back()}) {
            for (const auto& s : {std::array<int64_t, 3>{129, 257, 136}, std::array<int64_t, 3>{300, 1100, 1000}}) {
                check_padded_case(s, cfg);
            }
        }
    }
}

// Few CTAs, many tiles each (the ring's phases wrap across tiles; cluster pairs walk padding tiles), and the shapes the
// swapped configs are for (M = 77, 320, 512 at N = K = 4096; sampled rows).
TEST(GemmSwapAB, SmBudgetsAndBenchmarkShapesMatchFp64) {
    REQUIRE_SM90();
    for (const GemmConfig& cfg : swapped_test_configs()) {
        for (int budget : {1, 3, 7}) {
            Case c{520, 1100, 456};
            c.config = cfg;
            c.sm_budget = cfg.cluster_m > budget ? 2 : budget;
            check_case(c);
        }
        for (int64_t m : {77, 320, 512}) {
            Case c{m, 4096, 4096};
            c.config = cfg;
            check_case(c, 24);
        }
    }
}

// The op's own pick (no option set) on random shapes: M log-uniform in 1..640, N in 1..30000, K in 8..16384 (a
// multiple of 8, as the op requires; N x K bounded for the host reference), half of them near the shapes whose rules
// differ (N = 4096, 7168, 14336, 28672 and K = 2048, 4096, 7168), random dtype pair and B layout, so that the draws
// meet the rules' paths (small-M variants 3/4/5, tiled, split-K, swapped; the paths taken are printed, not asserted).
// Sampled rows against fp64, poisoned outputs. The seed is printed.
TEST(GemmOp, RandomShapesMatchFp64OnEveryPathThePlanTakes) {
    REQUIRE_SM90();
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("draw seed " + std::to_string(seed));
    RandomDraw draw(seed);
    const int64_t kNs[] = {4096, 7168, 14336, 28672};
    const int64_t kKs[] = {2048, 4096, 7168};
    std::map<std::string, int> paths;
    for (int i = 0; i < 40; ++i) {
        Case c{draw.log_uniform(1, 640), 0, 0};
        if (i % 2 == 0) {
            c.n = kNs[draw.uniform(0, 3)] + (draw.uniform(0, 3) == 0 ? draw.uniform(-40, 40) : 0);
            c.k = kKs[draw.uniform(0, 2)] + (draw.uniform(0, 3) == 0 ? 8 * draw.uniform(-5, 5) : 0);
        } else {
            c.n = draw.log_uniform(1, 30000);
            c.k = 8 * draw.log_uniform(1, 2048);
        }
        while (c.n * c.k > (int64_t{48} << 20)) c.k = std::max<int64_t>(8, c.k / 16 * 8);  // the reference's cost
        const int io = static_cast<int>(draw.uniform(0, 3));
        if (io > 0) {
            c.in = kOtherIoPairs[io - 1][0];
            c.out = kOtherIoPairs[io - 1][1];
        }
        c.layout = draw.uniform(0, 3) == 0 ? BLayout::kKN : BLayout::kNK;
        const ops::GemmProblem p{.m = c.m,
                                 .n = c.n,
                                 .k = c.k,
                                 .b_layout = c.layout,
                                 .in_dtype = c.in,
                                 .out_dtype = c.out,
                                 .b_rows_contiguous = c.layout == BLayout::kNK && (c.k * dtype_bytes(c.in)) % 16 == 0};
        const std::string path = ops::gemm_candidate_name(ops::plan_gemm(p, num_sms()));
        ++paths[path];
        SCOPED_TRACE("the plan's pick: " + path);
        check_case(c, 6);
        if (HasFatalFailure()) return;
    }
    std::ostringstream os;
    for (const auto& [name, count] : paths) os << " " << name << " x" << count;
    std::printf("[ paths    ]%s\n", os.str().c_str());
}

constexpr GemmConfig raster_variant(int index) {
    GemmConfig c = gemm_candidate(index, DType::kBF16, DType::kBF16, BLayout::kNK);
    c.raster = Raster::kAlongM;
    c.raster_group = 3;
    return c;
}
constexpr GemmConfig kRasterPlain = raster_variant(0);
constexpr GemmConfig kRasterPair = raster_variant(1);

TEST(GemmTiled, RasterOrdersAgree) {
    REQUIRE_SM90();
    for (const GemmConfig& cfg : {kRasterPlain, kRasterPair}) {
        for (int budget : {0, 5}) {
            Case c{1000, 1000, 256};
            c.config = cfg;
            c.sm_budget = budget;
            check_case(c);
        }
    }
}

// Ping-pong (GemmConfig::pingpong) in two configs outside the candidate set (whose ping-pong tiles the tests above
// take): the consumer warpgroups take alternate tiles, turn by turn. Awkward shapes, strides, f32 output, B [K,N] and
// budgets of 1..7 CTAs (many tiles per CTA: odd tile counts leave one warpgroup a tile more, and the ring's phases
// wrap inside each warpgroup's tiles).
constexpr GemmConfig kPingPong64x256{.tile_m = 64, .tile_n = 256, .stages = 4, .pingpong = true};
constexpr GemmConfig kPingPong128x128{.tile_m = 128, .tile_n = 128, .stages = 6, .b_layout = BLayout::kKN,
                                      .out_dtype = DType::kF32, .pingpong = true};

TEST(GemmTiled, PingPongMatchesFp64) {
    REQUIRE_SM90();
    for (const GemmConfig& cfg : {kPingPong64x256, kPingPong128x128}) {
        SCOPED_TRACE(ops::format_gemm_config(cfg));
        for (const auto& s : awkward_shapes()) {
            Case c{s[0], s[1], s[2]};
            c.out = cfg.out_dtype;
            c.layout = cfg.b_layout;
            c.config = cfg;
            check_case(c);
        }
        for (int budget : {1, 2, 3, 7}) {
            Case c{520, 1100, 456};
            c.out = cfg.out_dtype;
            c.layout = cfg.b_layout;
            c.config = cfg;
            c.sm_budget = budget;
            check_case(c);
        }
        Case padded{129, 257, 136};
        padded.out = cfg.out_dtype;
        padded.layout = cfg.b_layout;
        padded.pad_a = 8;
        padded.pad_b = 24;
        padded.pad_d = 16;
        padded.config = cfg;
        check_case(padded);
    }
}

// A few small cases, for compute-sanitizer (memcheck / synccheck) runs: every kernel flavour once (split-K too).
TEST(GemmTiled, SanitizerSmoke) {
    REQUIRE_SM90();
    for (int idx : {0, 1, 2, 4}) {
        Case c{129, 257, 136};
        c.config = gemm_candidate(idx, DType::kBF16, DType::kBF16, idx == 2 ? BLayout::kKN : BLayout::kNK);
        c.layout = c.config->b_layout;
        check_case(c);
    }
    Case f32{100, 72, 200, DType::kF16, DType::kF32, BLayout::kKN};
    f32.allow_small_m = false;
    check_case(f32);
    for (int idx : {6, 12}) {  // split-K: cooperative 128x128 in 2 splits, ping-pong 64x128 in 4
        Case split{77, 1000, 1000};
        split.config = gemm_candidate(idx, DType::kBF16, DType::kBF16, BLayout::kNK);
        split.config->splits = idx == 6 ? 2 : 4;
        check_case(split);
    }
    Case small{17, 1000, 1000};
    small.small_m_splits = 3;
    small.small_m_max_m = kGemvMaxM;
    check_case(small);
    for (int64_t m : {1, 5}) {  // small-M variant 4: whole rows (M = 1), row groups (M = 5)
        Case rows{m, 300, 2048};
        rows.small_m_variant = GemvVariant::kBulkRows;
        check_case(rows);
    }
}

// The small-M path's split-K kernel, variant 3 (the shared-memory ring filled by TMA, kernels/gemm/gemv_tma_sm90.cuh),
// with its deterministic last-CTA reduction: every row-tile count (its ring changes with it), N below one n8 tile and
// ragged inside a CTA's columns, K below one chunk, not a multiple of a 32-wide chunk or of a 256-wide stage, forced
// split counts (a shorter last split), strides, every dtype pair.
void check_tma_ring_variant() {
    constexpr GemvVariant variant = GemvVariant::kTmaRing;
    const int64_t ms[] = {1, 3, 16, 17, 33, 64};
    const std::array<int64_t, 2> nk[] = {{3, 8}, {100, 72}, {1000, 1000}, {520, 8200}, {4104, 4096}};
    for (int64_t m : ms) {
        for (const auto& s : nk) {
            if (m * s[0] * s[1] > 300'000'000) continue;  // keep the CPU reference quick
            for (int splits : {0, 1, 3, 5}) {
                Case c{m, s[0], s[1]};
                c.small_m_splits = splits;
                c.small_m_variant = variant;
                c.small_m_max_m = kGemvMaxM;
                c.pad_a = 8;
                c.pad_d = 8;
                check_case(c);
            }
        }
    }
    for (const auto& io : kOtherIoPairs) {
        for (int64_t m : {1, 16, 64}) {
            Case c{m, 1000, 1000, io[0], io[1]};
            c.small_m_variant = variant;
            c.small_m_max_m = kGemvMaxM;
            check_case(c);
        }
    }
    for (int64_t m : {16, 64}) {
        Case big{m, 8192, 8192};  // the decode shapes it is for (default splits)
        big.small_m_variant = variant;
        big.small_m_max_m = kGemvMaxM;
        check_case(big, 4);
    }
}

TEST(GemmSmallM, Variant3MatchesFp64ForEveryRowCountAndSplit) {
    REQUIRE_SM90();
    check_tma_ring_variant();
}

// Variant 4 (whole rows, kernels/gemm/gemv_rows_sm90.cuh detail::gemv_rows_body): M = 1, 2; every row length it takes
// (K = 2048, 4096, 8192, 16384: 1, 2, 4, 8 spans per row, so 8 to 1 rows per stage); one CTA with a few rows (N = 8)
// or many (250: 32 stages, a partial last one; 40000 rows on the whole GPU: 304 per CTA); SM budgets that leave a
// short last CTA; strided A and D (B's rows must be back to back); every dtype pair; the decode shapes.
// One variant-4 case: M x N x K under an SM budget (0: the whole GPU), A and D with padded rows.
struct Variant4Case {
    int64_t m, n, k;
    int budget;
};

void check_variant4(const Variant4Case& vc, DType in = DType::kBF16, DType out = DType::kBF16) {
    Case c{vc.m, vc.n, vc.k, in, out};
    c.small_m_variant = GemvVariant::kBulkRows;
    c.sm_budget = vc.budget;
    c.pad_a = 8;
    c.pad_d = 8;
    check_case(c);
}

TEST(GemmSmallM, Variant4WholeRowsMatchesFp64) {
    REQUIRE_SM90();
    const Variant4Case cases[] = {{1, 8, 2048, 1},     {2, 8, 2048, 1},    {1, 250, 2048, 1},  {2, 101, 4096, 1},
                                  {1, 1000, 4096, 7},  {2, 1000, 8192, 5}, {1, 520, 16384, 3}, {2, 777, 16384, 4},
                                  {2, 4104, 4096, 0},  {1, 8192, 8192, 0}, {2, 8192, 8192, 0}, {1, 28672, 4096, 0},
                                  {2, 40000, 4096, 0}};
    for (const auto& wc : cases) {
        ASSERT_TRUE(gemv_rows_uses_ffma(wc.m, wc.k)) << "M = " << wc.m << ", K = " << wc.k;
        check_variant4(wc);
    }
    for (const auto& io : kOtherIoPairs) {
        for (int64_t m : {1, 2}) check_variant4({m, 1000, 4096, 4}, io[0], io[1]);
    }
    // B with a padded row stride cannot be streamed whole: the op says so instead of reading the padding.
    const int64_t ldb = 4096 + 8;
    HostMatrix a(1, 4096, 4096, DType::kBF16), b(1000, 4096, ldb, DType::kBF16), d(1, 1000, 1000, DType::kBF16);
    DeviceBuffer da(a.bytes.size()), db(b.bytes.size()), dd(d.bytes.size());
    ops::GemmOptions o;
    o.small_m_variant = GemvVariant::kBulkRows;
    o.sm_budget = 1;
    try {
        ops::gemm(view(a, da), view(b, db), view(d, dd), BLayout::kNK, nullptr, o);
        ADD_FAILURE() << "variant 4 accepted a B with padded rows";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("contiguous, 16-byte aligned rows"), std::string::npos) << e.what();
    }
}

// Variant 4's row-group body (tensor cores; M 3..16, or K the whole-row body cannot hold: K not 2048 x 1, 2, 4,
// 8): M on both sides of 8 (one or two 8-row halves of A), M = 3, 4 with every K, M = 1 with such K;
// one CTA with one partial group (N = 8, 5), a block edge (63, 64, 65 rows), several blocks per CTA with a partial
// last group (1000 rows on 5 SMs: 200 per CTA, 4 blocks; 40000 on the whole GPU), short last CTAs; K = 2048 to 16384
// (1 to 8 chunks); strided A and D; every dtype pair; the decode shapes.
TEST(GemmSmallM, Variant4RowGroupsMatchFp64) {
    REQUIRE_SM90();
    const Variant4Case cases[] = {{5, 8, 2048, 1},      {16, 5, 4096, 1},     {8, 63, 2048, 1},     {9, 64, 8192, 1},
                                  {16, 65, 6144, 1},    {12, 1000, 4096, 5},  {16, 1000, 16384, 3}, {7, 777, 8192, 4},
                                  {1, 520, 6144, 3},    {3, 700, 16384, 2},   {16, 8192, 8192, 0},  {8, 8192, 8192, 0},
                                  {13, 40000, 4096, 0}, {16, 28672, 4096, 0}, {5, 4104, 2048, 0},  {3, 8, 2048, 1},
                                  {3, 1000, 8192, 5},   {4, 250, 2048, 1},    {4, 777, 4096, 4},    {4, 8192, 8192, 0},
                                  {3, 8192, 8192, 0}};
    for (const auto& gc : cases) {
        ASSERT_FALSE(gemv_rows_uses_ffma(gc.m, gc.k)) << "M = " << gc.m << ", K = " << gc.k;
        check_variant4(gc);
    }
    for (const auto& io : kOtherIoPairs) {
        for (int64_t m : {4, 5, 16}) check_variant4({m, 1000, 4096, 4}, io[0], io[1]);
    }
}

// Calls on one stream back to back reuse the small-M workspace: counters must be back at zero, also when
// consecutive calls alternate the variants and when split-K calls have different column blocks (and so different
// counter counts).
TEST(GemmSmallM, RepeatedCallsStayCorrect) {
    REQUIRE_SM90();
    const GemvVariant variants[] = {GemvVariant::kTmaRing, GemvVariant::kBulkRows};
    for (int i = 0; i < 4; ++i) {
        const GemvVariant variant = variants[i % 2];
        const bool whole_rows = variant == GemvVariant::kBulkRows;  // M <= 16 only (both of its bodies)
        Case c{whole_rows ? (i < 2 ? 1 : 16) : (i < 2 ? 3 : 40), 2000, 4096};
        c.small_m_variant = variant;
        c.small_m_max_m = kGemvMaxM;
        if (whole_rows) c.sm_budget = 8;  // 250 rows per CTA: within variant 4's 256 (it has no split-K)
        check_case(c);
    }
    check_case(Case{1, 8192, 8192});  // a larger shape after smaller ones on the same workspace
    Case wider{1, 4096, 8192};  // variant 3 over 64 column blocks (the calls above: 32), 2 splits on 132 SMs
    wider.small_m_variant = GemvVariant::kTmaRing;
    check_case(wider);
}

// A budget below the device's SMs, the small-M path left to the op: variant 4 within the budget where it serves
// (K = 8192, B's rows back to back), the tiled kernel where variant 3 would have served (K = 2048, or B's rows padded),
// every element against fp64 (GemmPlan.ABudgetBelowTheDeviceBoundsTheSmallMPicks checks the plans).
TEST(GemmSmallM, ABudgetBelowTheDeviceKeepsTheOpsOwnPickWithinIt) {
    REQUIRE_SM90();
    for (const Case& base : {Case{1, 8192, 2048}, Case{3, 4096, 8192}, Case{16, 1000, 2048}, Case{32, 777, 4096}}) {
        for (int budget : {1, 8}) {
            Case c = base;
            c.sm_budget = budget;
            check_case(c);
            c.pad_b = 8;  // B's rows padded: variant 4 cannot serve
            check_case(c);
        }
    }
}

/// Captures `calls` on `s` in global mode and instantiates the graph: null (with gtest failures) when a call throws or
/// the capture or the instantiation fails. The caller destroys `*graph` and the result.
cudaGraphExec_t capture_global(cudaStream_t s, const std::function<void()>& calls, cudaGraph_t* graph) {
    *graph = nullptr;
    const cudaError_t began = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    if (began != cudaSuccess) {
        ADD_FAILURE() << "cudaStreamBeginCapture: " << cudaGetErrorString(began);
        return nullptr;
    }
    std::string error;
    try {
        calls();
    } catch (const Error& e) {
        error = e.what();
    }
    const cudaError_t ended = cudaStreamEndCapture(s, graph);
    EXPECT_EQ(error, "");
    if (ended != cudaSuccess) {
        ADD_FAILURE() << "cudaStreamEndCapture: " << cudaGetErrorString(ended);
        return nullptr;
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t made = cudaGraphInstantiate(&exec, *graph, 0);
    if (made != cudaSuccess) {
        ADD_FAILURE() << "cudaGraphInstantiate: " << cudaGetErrorString(made);
        return nullptr;
    }
    return exec;
}

// Split-K scratch under CUDA graph capture (the per-stream workspace, ops/stream_key): a call captured on a stream
// never used outside a capture, and one on a stream that was, both replay to the bits of the same call made eagerly
// (split sums are deterministic), and neither capture is invalidated (asking a capturing stream for its id was).
TEST(GemmSmallM, CapturedSplitKCallsReplayToTheEagerResult) {
    REQUIRE_SM90();
    std::mt19937_64 rng(fresh_seed());
    HostMatrix a(3, 4096, 4096, DType::kBF16), b(2000, 4096, 4096, DType::kBF16), d(3, 2000, 2000, DType::kBF16);
    a.fill_random(rng);
    b.fill_random(rng);
    DeviceBuffer da(a.bytes.size()), db(b.bytes.size()), eager(d.bytes.size()), captured(d.bytes.size());
    ASSERT_TRUE(da.ptr && db.ptr && eager.ptr && captured.ptr);
    upload(a, da);
    upload(b, db);
    ops::GemmOptions o;
    o.small_m_variant = GemvVariant::kTmaRing;
    o.small_m_splits = 4;
    o.small_m_max_m = kGemvMaxM;
    cudaStream_t used = nullptr, fresh = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&used, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&fresh, cudaStreamNonBlocking), cudaSuccess);
    poison(d);
    upload(d, eager);
    ops::gemm(view(a, da), view(b, db), view(d, eager), BLayout::kNK, used, o);  // loads the kernels, sizes `used`'s
    ASSERT_EQ(cudaStreamSynchronize(used), cudaSuccess);
    HostMatrix want = d;
    download(want, eager);
    for (cudaStream_t s : {fresh, used}) {
        SCOPED_TRACE(s == fresh ? "a stream first used under capture" : "a stream used before");
        poison(d);
        upload(d, captured);
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = capture_global(
            s, [&] { ops::gemm(view(a, da), view(b, db), view(d, captured), BLayout::kNK, s, o); }, &graph);
        ASSERT_NE(exec, nullptr);
        for (int replay = 0; replay < 2; ++replay) ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        HostMatrix got = d;
        download(got, captured);
        EXPECT_TRUE(got.bytes == want.bytes) << "the replays differ from the eager call";
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
    }
    cudaStreamDestroy(used);
    cudaStreamDestroy(fresh);
}

// A process's very first GEMM calls made inside a global-mode capture: their kernels are compiled (or read from the
// cache) and loaded while the stream captures. The capture must stay valid, and its replay must give the bits of the
// same calls made eagerly afterwards (one small-M split-K call, one tiled call). Meaningful only as the first test
// of its process (tools/gpu_run.sh runs each case in a process of its own); run later it still passes.
TEST(GemmCapture, FirstCallsOfTheProcessInsideAGlobalCaptureReplayToTheEagerResult) {
    REQUIRE_SM90();
    std::mt19937_64 rng(fresh_seed());
    struct Call {
        int64_t m, n, k;
        ops::GemmOptions o;
    };
    ops::GemmOptions split;
    split.small_m_variant = GemvVariant::kTmaRing;
    split.small_m_splits = 3;
    const std::vector<Call> calls = {{5, 1536, 3072, split}, {200, 384, 1024, ops::GemmOptions{}}};
    std::vector<HostMatrix> as, bs, ds;
    std::deque<DeviceBuffer> da, db, captured, eager;  // not movable: built in place
    for (const Call& c : calls) {
        as.emplace_back(c.m, c.k, c.k, DType::kBF16);
        bs.emplace_back(c.n, c.k, c.k, DType::kBF16);
        ds.emplace_back(c.m, c.n, c.n, DType::kBF16);
        as.back().fill_random(rng);
        bs.back().fill_random(rng);
        poison(ds.back());
        da.emplace_back(as.back().bytes.size());
        db.emplace_back(bs.back().bytes.size());
        captured.emplace_back(ds.back().bytes.size());
        eager.emplace_back(ds.back().bytes.size());
        ASSERT_TRUE(da.back().ptr && db.back().ptr && captured.back().ptr && eager.back().ptr);
        upload(as.back(), da.back());
        upload(bs.back(), db.back());
        upload(ds.back(), captured.back());
        upload(ds.back(), eager.back());
    }
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = capture_global(
        s,
        [&] {
            for (size_t i = 0; i < calls.size(); ++i)
                ops::gemm(view(as[i], da[i]), view(bs[i], db[i]), view(ds[i], captured[i]), BLayout::kNK, s,
                          calls[i].o);
        },
        &graph);
    ASSERT_NE(exec, nullptr);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    for (size_t i = 0; i < calls.size(); ++i)
        ops::gemm(view(as[i], da[i]), view(bs[i], db[i]), view(ds[i], eager[i]), BLayout::kNK, s, calls[i].o);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    for (size_t i = 0; i < calls.size(); ++i) {
        HostMatrix got = ds[i], want = ds[i];
        download(got, captured[i]);
        download(want, eager[i]);
        EXPECT_TRUE(got.bytes == want.bytes) << "call " << i << ": the replay differs from the eager call";
        EXPECT_TRUE(want.bytes != ds[i].bytes) << "call " << i << ": the eager call wrote nothing";
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
}

// ---- programmatic dependent launch (GemmOptions::programmatic_launch) -----------------------------------

/// Lets the next kernel start at once, then waits `delay_ns` (bounded: the clock always advances) and only then
/// copies `bytes` (a multiple of 16) from src to dst: a kernel after it that reads dst before it completes reads
/// what was there before. Records its end time in *end_ns.
__global__ void late_writer_kernel(uint4* dst, const uint4* src, size_t bytes, uint64_t delay_ns, uint64_t* end_ns) {
    ptx::launch_dependents();
    const uint64_t start = ptx::globaltimer();
    while (ptx::globaltimer() - start < delay_ns) {
    }
    for (size_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) dst[i] = src[i];
    __syncthreads();
    if (threadIdx.x == 0) *end_ns = ptx::globaltimer();
}

/// Records when it started, touching nothing of the kernel before it (so it needs no wait).
__global__ void start_probe_kernel(uint64_t* start_ns) {
    if (threadIdx.x == 0) *start_ns = ptx::globaltimer();
}

constexpr uint64_t kLateWriterDelayNs = 200'000;

/// One M x N x K GEMM (bf16, B [N,K]) launched with `o` (programmatic) right after late_writer_kernel, which writes
/// A only at its end (NaNs before): the plan must be the small-M `want` variant and launch programmatically, and
/// D's `rows` must match the fp64 reference of the new A. `t`: late_writer_kernel's end time.
void check_after_late_writer(int64_t m, int64_t n, int64_t k, const ops::GemmOptions& o, GemvVariant want,
                             const std::vector<int64_t>& rows, uint64_t* t) {
    const uint64_t seed = fresh_seed();
    std::ostringstream what;
    what << m << "x" << n << "x" << k << " seed " << seed;
    SCOPED_TRACE(what.str());
    std::mt19937_64 rng(seed);
    HostMatrix a(m, k, k, DType::kBF16), b(n, k, k, DType::kBF16), d(m, n, n, DType::kBF16);
    a.fill_random(rng);
    b.fill_random(rng);
    poison(d);
    HostMatrix a_nan(m, k, k, DType::kBF16);
    for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < k; ++c) a_nan.set(r, c, NAN);
    DeviceBuffer da(a.bytes.size()), staged(a.bytes.size()), db(b.bytes.size()), dd(d.bytes.size());
    ASSERT_TRUE(da.ptr && staged.ptr && db.ptr && dd.ptr);
    upload(a_nan, da);
    upload(a, staged);
    upload(b, db);
    upload(d, dd);
    const ops::GemmPlan plan =
        ops::plan_gemm(ops::validate_gemm_args(view(a, da), view(b, db), view(d, dd), BLayout::kNK), num_sms(), o);
    ASSERT_TRUE(ops::gemm_launches_programmatically(plan, o));
    ASSERT_EQ(plan.small_m_variant, want);
    late_writer_kernel<<<1, 128>>>(static_cast<uint4*>(da.ptr), static_cast<const uint4*>(staged.ptr), a.bytes.size(),
                                   kLateWriterDelayNs, t);
    CK(cudaGetLastError());
    ops::gemm(view(a, da), view(b, db), view(d, dd), BLayout::kNK, nullptr, o);
    CK(cudaDeviceSynchronize());
    download(d, dd);
    expect_matches(d, reference(a, b, BLayout::kNK, n, rows), rows, tolerance_for(DType::kBF16), what.str());
}

// Nothing here would fail if the second kernel simply started after the first: so first check that a kernel
// launched programmatically after late_writer_kernel does start while it still waits (this GPU and driver
// overlap them), then that the GEMM launched the same way reads the A written at the end of that kernel, not the
// NaNs A held before, for both of variant 4's bodies (M = 1: whole rows; M = 5, 16: row groups) and variant 3
// (M = 40, and M = 8 with a K variant 4 does not take; split-K, so partials and counters come after the wait).
TEST(GemmSmallM, ProgrammaticLaunchWaitsForTheKernelBefore) {
    REQUIRE_SM90();
    DeviceBuffer times(2 * sizeof(uint64_t));
    ASSERT_TRUE(times.ptr);
    auto* t = static_cast<uint64_t*>(times.ptr);
    {
        DeviceBuffer scratch(256);
        ASSERT_TRUE(scratch.ptr);
        late_writer_kernel<<<1, 128>>>(static_cast<uint4*>(scratch.ptr), static_cast<const uint4*>(scratch.ptr), 256,
                                       kLateWriterDelayNs, t);
        cudaLaunchConfig_t cfg{};
        cfg.gridDim = dim3(1);
        cfg.blockDim = dim3(32);
        cudaLaunchAttribute attribute{};
        attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attribute.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &attribute;
        cfg.numAttrs = 1;
        CK(cudaLaunchKernelEx(&cfg, start_probe_kernel, t + 1));
        CK(cudaDeviceSynchronize());
        uint64_t host[2] = {};
        CK(cudaMemcpy(host, t, sizeof(host), cudaMemcpyDeviceToHost));
        ASSERT_LT(host[1], host[0]) << "the programmatically launched kernel started " << (host[1] - host[0])
                                    << " ns after the one before it ended: nothing would test the GEMM's wait";
    }
    for (const auto& [m, n, k] : {std::array<int64_t, 3>{1, 8192, 4096},
                                  {16, 8192, 4096},
                                  {5, 3000, 8192},
                                  {40, 3000, 4096},
                                  {8, 1000, 1000}}) {
        ops::GemmOptions o;
        o.programmatic_launch = true;
        o.small_m_max_m = kGemvMaxM;  // the small-M kernels (the only programmatic ones) up to their limit
        o.small_m_wgmma_max_m = 0;    // variants 3 / 4 here (variant 5: Variant5ProgrammaticLaunch...)
        const GemvVariant want = m <= kGemvGroupsMaxM && k % 2048 == 0 ? GemvVariant::kBulkRows : GemvVariant::kTmaRing;
        std::vector<int64_t> rows;
        for (int64_t r = 0; r < m; ++r) rows.push_back(r);
        ASSERT_NO_FATAL_FAILURE(check_after_late_writer(m, n, k, o, want, rows, t));
    }
}

// ---- decode chains: each layer's output is the next layer's A (N = K) --------------------------------------

constexpr int kChainLayers = 4;
constexpr int64_t kChainDim = 4096;
constexpr int kChainRuns = 3;
const char* const kChainRunNames[kChainRuns] = {"plain", "programmatic", "programmatic, graph"};

/// A chain of kChainLayers GEMMs of M rows at N = K = kChainDim (bf16), run three times on one stream: launched
/// plainly, programmatically right after one another, and programmatically captured into a CUDA graph then
/// replayed (the launches become programmatic edges). `base`: the options of every call (programmatic_launch is set
/// per run); where it names a small-M variant, every plan must be it.
struct DecodeChain {
    std::vector<HostMatrix> weights;       // the layers' B, host copies
    std::vector<uint8_t> out[kChainRuns];  // the last layer's output of each run
    std::vector<uint8_t> before_last;      // the plain run's input of its last layer
};

void run_decode_chain(int64_t m, uint64_t seed, const ops::GemmOptions& base, DecodeChain* chain) {
    std::mt19937_64 rng(seed);
    HostMatrix x(m, kChainDim, kChainDim, DType::kBF16);
    x.fill_random(rng);
    std::vector<std::unique_ptr<DeviceBuffer>> weights;
    for (int l = 0; l < kChainLayers; ++l) {
        HostMatrix w(kChainDim, kChainDim, kChainDim, DType::kBF16);
        w.fill_random(rng);
        for (int64_t r = 0; r < kChainDim; ++r)  // keep the activations near 1 layer after layer
            for (int64_t c = 0; c < kChainDim; ++c) w.set(r, c, w.get(r, c) / 32.f);
        weights.push_back(std::make_unique<DeviceBuffer>(w.bytes.size()));
        ASSERT_TRUE(weights.back()->ptr);
        upload(w, *weights.back());
        chain->weights.push_back(std::move(w));
    }
    cudaStream_t stream = nullptr;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int run = 0; run < kChainRuns; ++run) {
        SCOPED_TRACE(kChainRunNames[run]);
        const bool programmatic = run > 0;
        std::vector<std::unique_ptr<DeviceBuffer>> acts;
        for (int l = 0; l <= kChainLayers; ++l) {
            acts.push_back(std::make_unique<DeviceBuffer>(x.bytes.size()));
            ASSERT_TRUE(acts.back()->ptr);
            CK(cudaMemset(acts.back()->ptr, 0xff, x.bytes.size()));  // NaN until written
        }
        upload(x, *acts[0]);
        CK(cudaDeviceSynchronize());  // the memsets above ran on the legacy stream; the chain runs on `stream`
        ops::GemmOptions o = base;
        o.programmatic_launch = programmatic;
        auto act = [&](int l) { return TensorView(acts[l]->ptr, DType::kBF16, {m, kChainDim}); };
        const bool graph = run == 2;
        if (graph) CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        for (int l = 0; l < kChainLayers; ++l) {
            const TensorView w(weights[l]->ptr, DType::kBF16, {kChainDim, kChainDim});
            const ops::GemmPlan plan =
                ops::plan_gemm(ops::validate_gemm_args(act(l), w, act(l + 1), BLayout::kNK), num_sms(), o);
            if (base.small_m_variant) EXPECT_EQ(plan.small_m_variant, *base.small_m_variant);
            EXPECT_EQ(ops::gemm_launches_programmatically(plan, o), programmatic);
            ops::gemm(act(l), w, act(l + 1), BLayout::kNK, stream, o);
        }
        if (graph) {
            cudaGraph_t g = nullptr;
            CK(cudaStreamEndCapture(stream, &g));
            cudaGraphExec_t exec = nullptr;
            CK(cudaGraphInstantiate(&exec, g, 0));
            CK(cudaGraphLaunch(exec, stream));
            CK(cudaStreamSynchronize(stream));
            CK(cudaGraphExecDestroy(exec));
            CK(cudaGraphDestroy(g));
        }
        CK(cudaStreamSynchronize(stream));
        chain->out[run].resize(x.bytes.size());
        CK(cudaMemcpy(chain->out[run].data(), acts[kChainLayers]->ptr, x.bytes.size(), cudaMemcpyDeviceToHost));
        if (run == 0) {
            chain->before_last.resize(x.bytes.size());
            CK(cudaMemcpy(chain->before_last.data(), acts[kChainLayers - 1]->ptr, x.bytes.size(),
                          cudaMemcpyDeviceToHost));
        }
    }
    CK(cudaStreamDestroy(stream));
}

/// The plain run's output is finite everywhere and the other runs' are bit for bit the plain one's.
void expect_chain_runs_agree(int64_t m, const DecodeChain& chain) {
    HostMatrix last(m, kChainDim, kChainDim, DType::kBF16);
    last.bytes = chain.out[0];
    for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < kChainDim; ++c)
            ASSERT_TRUE(std::isfinite(last.get(r, c))) << "plain chain, row " << r << ", column " << c;
    for (int run = 1; run < kChainRuns; ++run) {
        EXPECT_EQ(chain.out[0], chain.out[run])
            << "the chain launched " << kChainRunNames[run] << " differs from the plain chain";
    }
}

// A decode chain launched plainly, programmatically and programmatically in a graph: each result must be bit for bit
// the chain launched plainly (the kernels are deterministic), which the fp64 tests above vouch for layer by layer.
// M = 1 and 2 (whole rows), 3 and 16 (row groups), 32 and 64 (variant 3, split-K: consecutive calls share the
// stream's partials and counters).
TEST(GemmSmallM, ProgrammaticChainMatchesThePlainChain) {
    REQUIRE_SM90();
    for (int64_t m : {1, 2, 3, 16, 32, 64}) {
        const uint64_t seed = fresh_seed();
        SCOPED_TRACE("M = " + std::to_string(m) + ", seed " + std::to_string(seed));
        ops::GemmOptions o;
        o.small_m_max_m = kGemvMaxM;  // M up to 64 on the small-M kernels, the programmatic ones
        DecodeChain chain;
        ASSERT_NO_FATAL_FAILURE(run_decode_chain(m, seed, o, &chain));
        ASSERT_NO_FATAL_FAILURE(expect_chain_runs_agree(m, chain));
    }
}

// With the default options, M <= small_m_max_m takes the small-M path and larger M the tiled kernel (B [N,K]
// only): both right, on both sides of the default bound, for both layouts and every dtype pair.
TEST(GemmSmallM, DefaultOptionsRouteMAboveTheBoundToTheTiledKernel) {
    REQUIRE_SM90();
    int device = 0;
    ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
    int num_sms = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
    const DType pairs[][2] = {{DType::kBF16, DType::kBF16}, {DType::kBF16, DType::kF32},
                              {DType::kF16, DType::kF16}, {DType::kF16, DType::kF32}};
    const int64_t bound = ops::GemmOptions{}.small_m_max_m;
    ASSERT_GT(bound, 1);
    for (int64_t m : {bound - 1, bound, bound + 1}) {  // bound + 1 > kGemvMaxM = 64 is tiled as well
        for (const auto& io : pairs) {
            for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
                Case c{m, 1000, 1000, io[0], io[1], layout};
                c.small_m_variant = ops::GemmOptions{}.small_m_variant;
                const ops::GemmPlan plan = ops::plan_gemm(ops::GemmProblem{m, 1000, 1000, layout, io[0], io[1]}, num_sms);
                const bool small = m <= bound && layout == BLayout::kNK;
                EXPECT_EQ(plan.path, small ? ops::GemmPath::kSmallM : ops::GemmPath::kTiled) << "M = " << m;
                check_case(c);
            }
        }
    }
}

// ---- small-M variant 5 (GemvVariant::kTmaWgmma: A and B swapped on wgmma) --------------------------------

/// One variant-5 case through check_case, after checking that the op plans it as asked: variant 5, ceil(M / 16) row
/// tiles, `want_splits` splits (0: any), whole 64-k stages per split. `sample_rows` as check_case.
void check_variant5(Case c, int want_splits, int sample_rows = 0) {
    c.small_m_variant = GemvVariant::kTmaWgmma;
    ops::GemmOptions o;
    o.small_m_variant = c.small_m_variant;
    o.small_m_splits = c.small_m_splits;
    o.sm_budget = c.sm_budget;
    const ops::GemmPlan plan = ops::plan_gemm(ops::GemmProblem{c.m, c.n, c.k, BLayout::kNK, c.in, c.out}, num_sms(), o);
    ASSERT_EQ(plan.path, ops::GemmPath::kSmallM) << c.m << "x" << c.n << "x" << c.k;
    ASSERT_EQ(plan.small_m_variant, GemvVariant::kTmaWgmma);
    ASSERT_EQ(plan.small_m_tiles, (c.m + 15) / 16);
    ASSERT_EQ(plan.small_m_k_per_split % kGemvWgmmaStageK, 0);
    if (want_splits > 0) {
        ASSERT_EQ(plan.small_m_splits, want_splits)
            << c.m << "x" << c.n << "x" << c.k << " forced " << c.small_m_splits;
    }
    check_case(c, sample_rows);
}

// Variant 5 against the fp64 reference, outputs poisoned (NaN in D, a sentinel in the row padding): every M the
// issue's sweep meets on both sides of each 16-row tile (M = 1, 7, 16, 17, 33, 64, 77, 96, 127, 128, 200, 256: row
// tiles 1, 2, 3, 4, 5, 6, 8, 13, 16), N of one column block (64), ragged (4104: the last block has 8 columns) and the
// decode widths 4096 / 8192, K of one 64-k stage, not a multiple of 64 (200: the last stage zero-filled past K) and
// 4096 (64 stages, the ring wrapping several times), one split and forced 2, 3, 4 and 8 (K = 200 at 4 splits: 64, 64,
// 64, 8; 8 splits of N = 4104: 65 clusters of 8 CTAs, more than one wave) and the op's rule (N = 64, K = 4096: 8
// splits; N = 4096 / 4104: 2): the splits of a column block are one cluster, each CTA writing its share of the rows
// (none at M = 1 for all but the first); A and D with padded rows (lda > K, ldd > N), B padded too in some. Every row
// is checked where the reference is quick, sampled rows (all columns) elsewhere.
TEST(GemmSmallM, Variant5MatchesFp64ForEveryRowTileAndSplit) {
    REQUIRE_SM90();
    const int64_t ms[] = {1, 7, 16, 17, 33, 64, 77, 96, 127, 128, 200, 256};
    struct Shape {
        int64_t n, k;
        std::vector<int> splits;  // forced counts; 0: the op's rule
    };
    const Shape shapes[] = {
        {64, 64, {0, 2}}, {64, 200, {0, 1, 2, 4}}, {4104, 200, {0, 2}}, {64, 4096, {0, 1, 3, 4}}, {4104, 4096, {0, 8}}};
    for (int64_t m : ms) {
        for (const Shape& s : shapes) {
            for (int splits : s.splits) {
                Case c{m, s.n, s.k};
                c.small_m_splits = splits;
                c.pad_a = 8;
                c.pad_d = 8;
                c.pad_b = s.n == 4104 ? 8 : 0;
                // The splits the plan must make: a forced count of whole 64-k stages each (fewer where K is
                // short), else the op's rule.
                const int64_t per_split = splits > 0 ? ((s.k + 63) / 64 + splits - 1) / splits * 64 : 0;
                const int want = splits > 0 ? static_cast<int>((s.k + per_split - 1) / per_split)
                                            : ops::gemv_wgmma_splits(s.n, s.k, num_sms());
                check_variant5(c, want, m * s.n * s.k > 300'000'000 ? 24 : 0);
            }
        }
    }
    // The decode widths at a few M: N = 4096 (2 splits by the rule on 132 SMs) and 8192 (1), sampled rows.
    for (int64_t m : {1, 77, 128, 256}) {
        for (int64_t n : {4096, 8192}) {
            Case c{m, n, 4096};
            c.pad_d = 8;
            check_variant5(c, ops::gemv_wgmma_splits(n, 4096, num_sms()), 24);
        }
    }
}

// Variant 5 for every other dtype pair (bf16 -> f32, f16 -> f16, f16 -> f32), single split and split-K, ragged N.
__global__ void cluster_capacity_probe(int* out) {
    extern __shared__ unsigned char probe_smem[];
    if (out != nullptr) out[blockIdx.x] = probe_smem[threadIdx.x];
}

// gemv_wgmma_max_clusters (the split rule's cluster limit) against cudaOccupancyMaxActiveClusters for a kernel of
// variant 5's block and shared memory, clusters shaped as its splits (1 x S): never more than the device runs, and
// exactly the device's figures on a 132-SM part.
TEST(GemmSmallM, Variant5ClusterCapacityModelMatchesTheDevice) {
    REQUIRE_SM90();
    for (int m_tiles : {1, 5, 16}) {
        const int smem = gemv_smem_bytes(GemvConfig{.variant = GemvVariant::kTmaWgmma, .m_tiles = m_tiles});
        ASSERT_EQ(cudaFuncSetAttribute(cluster_capacity_probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                  cudaSuccess);
        for (int size = 1; size <= kGemvWgmmaMaxSplits; ++size) {
            cudaLaunchConfig_t cfg{};
            cfg.gridDim = dim3(64, static_cast<unsigned>(size), 1);
            cfg.blockDim = dim3(kGemvWgmmaThreads, 1, 1);
            cfg.dynamicSmemBytes = static_cast<size_t>(smem);
            cudaLaunchAttribute attr{};
            attr.id = cudaLaunchAttributeClusterDimension;
            attr.val.clusterDim.x = 1;
            attr.val.clusterDim.y = static_cast<unsigned>(size);
            attr.val.clusterDim.z = 1;
            cfg.attrs = &attr;
            cfg.numAttrs = 1;
            int device_clusters = 0;
            ASSERT_EQ(cudaOccupancyMaxActiveClusters(&device_clusters, cluster_capacity_probe, &cfg), cudaSuccess);
            const int model = ops::gemv_wgmma_max_clusters(size, num_sms());
            EXPECT_LE(model, device_clusters) << "clusters of " << size << ", m_tiles " << m_tiles;
            if (num_sms() == 132) EXPECT_EQ(model, device_clusters) << "clusters of " << size;
        }
    }
}

TEST(GemmSmallM, Variant5EveryDtypePairMatchesFp64) {
    REQUIRE_SM90();
    for (const auto& io : kOtherIoPairs) {
        for (int64_t m : {7, 77, 256}) {
            for (int splits : {1, 2}) {
                Case c{m, 4104, 200, io[0], io[1]};
                c.small_m_splits = splits;
                c.pad_a = 8;
                c.pad_d = 8;
                check_variant5(c, splits);
            }
        }
    }
}

// Variant 5 writes nothing outside D: D is the first M rows of a larger poisoned buffer (ldd > N), whose rows past M
// must come back byte for byte unchanged and whose row padding past column N must keep its sentinel (expect_matches);
// single split and split-K (the last CTA's reduction), M not a multiple of 16 (the padded rows of the wgmma's N side
// are computed, never stored), N = 8 to 4104, not a multiple of 64.
TEST(GemmSmallM, Variant5WritesNothingPastMOrN) {
    REQUIRE_SM90();
    for (const auto& [m, n, splits] :
         {std::array<int64_t, 3>{77, 4104, 1}, {77, 4104, 2}, {1, 100, 1}, {250, 130, 4}, {7, 8, 2}, {256, 64, 2}}) {
        const uint64_t seed = fresh_seed();
        std::ostringstream what;
        what << m << "x" << n << "x1024 splits " << splits << " seed " << seed;
        SCOPED_TRACE(what.str());
        std::mt19937_64 rng(seed);
        constexpr int64_t k = 1024, kGuardRows = 16, kLdd = 4160;  // ldd > N: padding columns on every row
        HostMatrix a(m, k, k, DType::kBF16), b(n, k, k, DType::kBF16);
        // D's M rows and kGuardRows more, poisoned: NaN in the N columns, the sentinel in the padding.
        HostMatrix big(m + kGuardRows, n, kLdd, DType::kBF16);
        a.fill_random(rng);
        b.fill_random(rng);
        poison(big);
        const HostMatrix before = big;
        DeviceBuffer da(a.bytes.size()), db(b.bytes.size()), dd(big.bytes.size());
        ASSERT_TRUE(da.ptr && db.ptr && dd.ptr);
        upload(a, da);
        upload(b, db);
        upload(big, dd);
        ops::GemmOptions o;
        o.small_m_variant = GemvVariant::kTmaWgmma;
        o.small_m_splits = static_cast<int>(splits);
        const TensorView d(dd.ptr, DType::kBF16, {m, n}, {kLdd, 1});
        ops::gemm(view(a, da), view(b, db), d, BLayout::kNK, nullptr, o);
        CK(cudaDeviceSynchronize());
        download(big, dd);
        // The guard rows past M, every byte (the padding of D's own rows: expect_matches below).
        const size_t d_bytes = static_cast<size_t>(m * kLdd * 2);
        size_t changed = 0;
        for (size_t i = d_bytes; i < big.bytes.size(); ++i) changed += big.bytes[i] != before.bytes[i];
        EXPECT_EQ(changed, 0u) << "bytes past row M written";
        HostMatrix got(m, n, kLdd, DType::kBF16);
        got.bytes.assign(big.bytes.begin(), big.bytes.begin() + static_cast<std::ptrdiff_t>(d_bytes));
        std::vector<int64_t> rows;
        for (int64_t r = 0; r < m; ++r) rows.push_back(r);
        expect_matches(got, reference(a, b, BLayout::kNK, n, rows), rows, tolerance_for(DType::kBF16), what.str());
    }
}

// Forced on a call it cannot serve, variant 5 is an error naming why (M > 256; B [K,N]), before the device is
// touched; M = 256 is served.
TEST(GemmSmallM, Variant5RefusesWhatItCannotServe) {
    REQUIRE_SM90();
    HostMatrix a(257, 64, 64, DType::kBF16), b(128, 64, 64, DType::kBF16), d(257, 128, 128, DType::kBF16);
    DeviceBuffer da(a.bytes.size()), db(b.bytes.size()), dd(d.bytes.size());
    ASSERT_TRUE(da.ptr && db.ptr && dd.ptr);
    ops::GemmOptions o;
    o.small_m_variant = GemvVariant::kTmaWgmma;
    try {
        ops::gemm(view(a, da), view(b, db), view(d, dd), BLayout::kNK, nullptr, o);
        ADD_FAILURE() << "variant 5 accepted M = 257";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("serves M <= 256"), std::string::npos) << e.what();
    }
    HostMatrix bkn(64, 128, 128, DType::kBF16);
    HostMatrix a16(16, 64, 64, DType::kBF16), d16(16, 128, 128, DType::kBF16);
    try {
        ops::gemm(view(a16, da), view(bkn, db), view(d16, dd), BLayout::kKN, nullptr, o);
        ADD_FAILURE() << "variant 5 accepted B [K,N]";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("needs B [N,K]"), std::string::npos) << e.what();
    }
    Case ok{256, 128, 64};
    check_variant5(ok, 0);
}

// Variant 5 launched programmatically right after a kernel that writes A only at its end (late_writer_kernel, which
// lets its dependents start at once): the GEMM must read the new A, not the NaNs before, with one split (N = 8192)
// and with split-K (N = 4096: one cluster per column block), M = 16, 77, 256.
TEST(GemmSmallM, Variant5ProgrammaticLaunchWaitsForTheKernelBefore) {
    REQUIRE_SM90();
    DeviceBuffer times(2 * sizeof(uint64_t));
    ASSERT_TRUE(times.ptr);
    auto* t = static_cast<uint64_t*>(times.ptr);
    for (const auto& [m, n, k] : {std::array<int64_t, 3>{16, 8192, 4096}, {77, 4096, 4096}, {256, 4096, 2048}}) {
        ops::GemmOptions o;
        o.programmatic_launch = true;
        o.small_m_variant = GemvVariant::kTmaWgmma;
        ASSERT_NO_FATAL_FAILURE(check_after_late_writer(m, n, k, o, GemvVariant::kTmaWgmma, {0, m / 2, m - 1}, t));
    }
}

// A decode chain on variant 5 (as ProgrammaticChainMatchesThePlainChain), N = K = 4096 (2 splits, one cluster per
// column block): the three runs bit for bit equal (deterministic split-K) and finite,
// and the plain chain's last layer must match the fp64 reference of that layer on sampled rows.
TEST(GemmSmallM, Variant5ProgrammaticChainMatchesThePlainChain) {
    REQUIRE_SM90();
    for (int64_t m : {77, 256}) {
        const uint64_t seed = fresh_seed();
        SCOPED_TRACE("M = " + std::to_string(m) + ", seed " + std::to_string(seed));
        ops::GemmOptions o;
        o.small_m_variant = GemvVariant::kTmaWgmma;
        DecodeChain chain;
        ASSERT_NO_FATAL_FAILURE(run_decode_chain(m, seed, o, &chain));
        ASSERT_NO_FATAL_FAILURE(expect_chain_runs_agree(m, chain));
        // The last layer of the plain chain against fp64 from its own input.
        HostMatrix last(m, kChainDim, kChainDim, DType::kBF16), in(m, kChainDim, kChainDim, DType::kBF16);
        last.bytes = chain.out[0];
        in.bytes = chain.before_last;
        const std::vector<int64_t> rows = {0, 1, m / 2, m - 2, m - 1};
        expect_matches(last, reference(in, chain.weights[kChainLayers - 1], BLayout::kNK, kChainDim, rows), rows,
                       tolerance_for(DType::kBF16), "the chain's last layer");
    }
}

// Calls on one stream alternating variant 5 (split-K in a cluster, no workspace) and variant 3 (split-K through the
// stream's counters and partials) with different column-block counts: every call stays correct (variant 3's counters
// back at zero after each of its calls; variant 5 touches none).
TEST(GemmSmallM, Variant5RepeatedCallsBesideVariant3StayCorrect) {
    REQUIRE_SM90();
    for (int i = 0; i < 6; ++i) {
        Case c{i % 2 == 0 ? 77 : 40, i < 3 ? 2048 : 1000, 4096};
        c.small_m_variant = i % 2 == 0 ? GemvVariant::kTmaWgmma : GemvVariant::kTmaRing;
        c.small_m_max_m = kGemvMaxM;
        c.small_m_splits = 3;
        check_case(c);
    }
}

// ---- cuBLASLt on large shapes ---------------------------------------------------------------------------

cudaDataType cuda_type(DType t) {
    return t == DType::kBF16 ? CUDA_R_16BF : t == DType::kF16 ? CUDA_R_16F : CUDA_R_32F;
}

/// D = A * B through cuBLASLt (column-major view: D^T = op(B) * A^T), first heuristic algorithm.
void cublaslt_gemm(cublasLtHandle_t h, const TensorView& a, const TensorView& b, const TensorView& d, BLayout layout,
                   void* ws, size_t ws_bytes) {
    const uint64_t m = static_cast<uint64_t>(a.dim(0)), k = static_cast<uint64_t>(a.dim(1));
    const uint64_t n = static_cast<uint64_t>(d.dim(1));
    cublasLtMatmulDesc_t desc;
    ASSERT_EQ(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
    const cublasOperation_t ta = layout == BLayout::kNK ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    cublasLtMatrixLayout_t la, lb, ld;
    if (layout == BLayout::kNK) {
        cublasLtMatrixLayoutCreate(&la, cuda_type(b.dtype), k, n, b.stride(0));
    } else {
        cublasLtMatrixLayoutCreate(&la, cuda_type(b.dtype), n, k, b.stride(0));
    }
    cublasLtMatrixLayoutCreate(&lb, cuda_type(a.dtype), k, m, a.stride(0));
    cublasLtMatrixLayoutCreate(&ld, cuda_type(d.dtype), n, m, d.stride(0));
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    ASSERT_EQ(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 1, &result, &found),
              CUBLAS_STATUS_SUCCESS);
    ASSERT_GT(found, 0);
    const float alpha = 1.f, beta = 0.f;
    ASSERT_EQ(cublasLtMatmul(h, desc, &alpha, b.data, la, a.data, lb, &beta, d.data, ld, d.data, ld, &result.algo, ws,
                             ws_bytes, nullptr),
              CUBLAS_STATUS_SUCCESS);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
}

TEST(GemmVsCublas, LargeShapesAgreeWithCublasAndFp64Rows) {
    REQUIRE_SM90();
    cublasLtHandle_t h;
    ASSERT_EQ(cublasLtCreate(&h), CUBLAS_STATUS_SUCCESS);
    const size_t ws_bytes = 64u << 20;
    DeviceBuffer ws(ws_bytes);
    struct Large {
        int64_t m, n, k;
        BLayout layout;
        DType out;
    };
    const Large shapes[] = {{4096, 4096, 4096, BLayout::kNK, DType::kBF16}, {4096, 4096, 4096, BLayout::kKN, DType::kBF16},
                            {8192, 1376, 4096, BLayout::kNK, DType::kBF16}, {2048, 3696, 8192, BLayout::kNK, DType::kBF16},
                            {1024, 4096, 1792, BLayout::kKN, DType::kF32},  {128, 8192, 8192, BLayout::kNK, DType::kBF16},
                            {16, 8192, 8192, BLayout::kNK, DType::kBF16},   {1, 8192, 8192, BLayout::kNK, DType::kF32}};
    for (const Large& s : shapes) {
        const uint64_t seed = fresh_seed();
        std::ostringstream os;
        os << s.m << "x" << s.n << "x" << s.k << (s.layout == BLayout::kNK ? " B[N,K]" : " B[K,N]") << " out "
           << dtype_name(s.out) << " seed " << seed;
        SCOPED_TRACE(os.str());
        std::mt19937_64 rng(seed);
        HostMatrix a(s.m, s.k, s.k, DType::kBF16);
        HostMatrix b = s.layout == BLayout::kNK ? HostMatrix(s.n, s.k, s.k, DType::kBF16)
                                                : HostMatrix(s.k, s.n, s.n, DType::kBF16);
        HostMatrix d(s.m, s.n, s.n, s.out), d_ref(s.m, s.n, s.n, s.out);
        a.fill_random(rng);
        b.fill_random(rng);
        poison(d);
        poison(d_ref);
        DeviceBuffer da(a.bytes.size()), db(b.bytes.size()), dd(d.bytes.size()), dr(d_ref.bytes.size());
        ASSERT_TRUE(da.ptr && db.ptr && dd.ptr && dr.ptr);
        upload(a, da);
        upload(b, db);
        upload(d, dd);
        upload(d_ref, dr);
        try {
            ops::gemm(view(a, da), view(b, db), view(d, dd), s.layout, nullptr);
        } catch (const Error& e) {
            FAIL() << e.what();
        }
        cublaslt_gemm(h, view(a, da), view(b, db), view(d_ref, dr), s.layout, ws.ptr, ws_bytes);
        const cudaError_t err = cudaDeviceSynchronize();
        ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
        download(d, dd);
        download(d_ref, dr);
        double num = 0, den = 0;
        int64_t nonfinite = 0;
        for (int64_t r = 0; r < s.m; ++r)
            for (int64_t c = 0; c < s.n; ++c) {
                const double x = d.get(r, c), y = d_ref.get(r, c);
                if (!std::isfinite(x)) {
                    ++nonfinite;
                    continue;
                }
                num += (x - y) * (x - y);
                den += y * y;
            }
        EXPECT_EQ(nonfinite, 0);
        const double rel = std::sqrt(num / den);
        EXPECT_LE(rel, tolerance_for(s.out).frob * 1.5) << "weft vs cuBLASLt relative error " << rel;
        // An independent fp64 check of sampled rows (cuBLAS could share a bug with nothing, but be sure).
        std::vector<int64_t> rows = {0, s.m - 1};
        std::uniform_int_distribution<int64_t> u(0, s.m - 1);
        while (rows.size() < std::min<size_t>(12, static_cast<size_t>(s.m))) rows.push_back(u(rng));
        expect_matches(d, reference(a, b, s.layout, s.n, rows), rows, tolerance_for(s.out), os.str());
    }
    cublasLtDestroy(h);
}

// ---- communication hooks --------------------------------------------------------------------------------

__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;\n" : "=l"(t));
    return t;
}

/// Writes A chunk by chunk (in `order`), waiting `delay_ns` before each, then raises flags[chunk] = epoch
/// with release semantics: what an AllGather's copy engine or a peer would do.
__global__ void chunk_producer_kernel(const uint16_t* src, uint16_t* a, int64_t chunk_elems, int64_t total_elems,
                                      const int* order, int num_chunks, uint64_t* flags, uint64_t epoch,
                                      uint64_t delay_ns) {
    for (int i = 0; i < num_chunks; ++i) {
        const int c = order[i];
        if (threadIdx.x == 0) {
            const uint64_t start = now_ns();
            while (now_ns() - start < delay_ns) {
            }
        }
        __syncthreads();
        const int64_t begin = c * chunk_elems;
        const int64_t end = min(total_elems, begin + chunk_elems);
        for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) a[j] = src[j];
        __syncthreads();
        if (threadIdx.x == 0) st_release_sys_u64(flags + c, epoch);
    }
}

/// Waits (bounded) for each tile's signal, then snapshots the tile of D: if the hook fired before the TMA
/// store completed, the snapshot holds poison.
__global__ void tile_checker_kernel(const uint64_t* tile_flags, uint64_t expected, int num_m_tiles, int num_n_tiles,
                                    int tile_m, int tile_n, const uint16_t* d, uint16_t* snapshot, int m, int n,
                                    int64_t ldd, uint64_t timeout_ns, int* timed_out) {
    __shared__ int ok;
    for (int t = 0; t < num_m_tiles * num_n_tiles; ++t) {
        if (threadIdx.x == 0) {
            const uint64_t start = now_ns();
            ok = 1;
            while (ld_acquire_sys_u64(tile_flags + t) < expected) {
                if (now_ns() - start > timeout_ns) {
                    ok = 0;
                    atomicAdd(timed_out, 1);
                    break;
                }
                __nanosleep(100);
            }
        }
        __syncthreads();
        if (ok) {
            const int m0 = (t / num_n_tiles) * tile_m, n0 = (t % num_n_tiles) * tile_n;
            for (int i = threadIdx.x; i < tile_m * tile_n; i += blockDim.x) {
                const int r = m0 + i / tile_n, c = n0 + i % tile_n;
                if (r < m && c < n) snapshot[r * ldd + c] = __ldcg(d + r * ldd + c);
            }
        }
        __syncthreads();
    }
}

// The hooked kernels: candidate kIndex (bf16 -> bf16, B [N,K]) with the chunk-wait scheduler and the tile-signal
// hook, compiled by weft::jit.
template <int kIndex>
constexpr GemmConfig kHookedCfg = gemm_candidate(kIndex, DType::kBF16, DType::kBF16, BLayout::kNK);

constexpr int kHookPlain = 6;      // 128x128
constexpr int kHookAPairs = 2;     // A multicast (cluster along N)
constexpr int kHookBPairs = 1;     // B multicast (cluster along M)
constexpr int kHookPingPong = 9;   // ping-pong 128x192 s4: each consumer warpgroup stores and signals its own tiles
constexpr int kHookPingPong64 = 12;  // ping-pong 64x128 s8
static_assert(kHookedCfg<kHookPlain>.tile_m == 128 && kHookedCfg<kHookPlain>.tile_n == 128 &&
              !kHookedCfg<kHookPlain>.pingpong &&
              kHookedCfg<kHookPlain>.cluster_m * kHookedCfg<kHookPlain>.cluster_n == 1);
static_assert(kHookedCfg<kHookAPairs>.cluster_n == 2 && kHookedCfg<kHookBPairs>.cluster_m == 2);
static_assert(kHookedCfg<kHookPingPong>.pingpong && kHookedCfg<kHookPingPong64>.pingpong &&
              kHookedCfg<kHookPingPong64>.tile_m == 64);

void run_hook_test(const GemmConfig& cfg, int64_t m, int64_t n, int64_t k, int rows_per_chunk) {
    const uint64_t seed = fresh_seed();
    std::ostringstream os;
    os << m << "x" << n << "x" << k << " rows/chunk " << rows_per_chunk << " " << ops::format_gemm_config(cfg)
       << " seed " << seed;
    SCOPED_TRACE(os.str());
    std::mt19937_64 rng(seed);
    const int num_chunks = static_cast<int>((m + rows_per_chunk - 1) / rows_per_chunk);
    const GemmTileGrid grid(cfg, static_cast<int32_t>(m), static_cast<int32_t>(n));
    const int num_tiles = grid.num_tiles();

    const int64_t ldd = (n + 7) / 8 * 8;  // TMA needs 16-byte row strides; a ragged N takes the tail path
    HostMatrix a(m, k, k, DType::kBF16), b(n, k, k, DType::kBF16), d(m, n, ldd, DType::kBF16);
    HostMatrix a_poison(m, k, k, DType::kBF16);
    std::memset(a_poison.bytes.data(), 0xFF, a_poison.bytes.size());  // NaN until the producer writes
    DeviceBuffer d_src(a.bytes.size()), d_a(a.bytes.size()), d_b(b.bytes.size()), d_d(d.bytes.size()),
        d_snap(d.bytes.size()), d_order(sizeof(int) * num_chunks), d_chunk_flags(8 * num_chunks),
        d_tile_flags(8 * num_tiles), d_row_flags(8 * grid.num_m_tiles), d_timeouts(sizeof(int));
    ASSERT_TRUE(d_src.ptr && d_a.ptr && d_b.ptr && d_d.ptr && d_snap.ptr && d_chunk_flags.ptr && d_tile_flags.ptr);
    std::vector<int> order(num_chunks);
    for (int i = 0; i < num_chunks; ++i) order[i] = num_chunks - 1 - i;  // the rows the GEMM wants first come last
    CK(cudaMemcpy(d_order.ptr, order.data(), order.size() * sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMemset(d_chunk_flags.ptr, 0, d_chunk_flags.bytes));
    CK(cudaMemset(d_tile_flags.ptr, 0, d_tile_flags.bytes));
    CK(cudaMemset(d_row_flags.ptr, 0, d_row_flags.bytes));

    // Load every kernel before anything spins (lazy loading could deadlock otherwise; weft::jit loads eagerly).
    const jit::Kernel* kernel = nullptr;
    ASSERT_NO_THROW(kernel = &ops::detail::gemm_jit_kernel(ops::gemm_kernel_spec(
                        cfg, "weft::kernels::gemm::ChunkWaitScheduler", "weft::kernels::gemm::TileSignalHook")));
    cudaFuncAttributes attr;
    CK(cudaFuncGetAttributes(&attr, chunk_producer_kernel));
    CK(cudaFuncGetAttributes(&attr, tile_checker_kernel));

    cudaStream_t s_gemm, s_prod, s_check;
    CK(cudaStreamCreateWithFlags(&s_gemm, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s_prod, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s_check, cudaStreamNonBlocking));
    const int cluster = cfg.cluster_m * cfg.cluster_n;
    const int grid_ctas = std::min((num_sms() - 4) / cluster, grid.num_cluster_tiles()) * cluster;

    for (int round = 1; round <= 3; ++round) {
        SCOPED_TRACE("round " + std::to_string(round));
        a.fill_random(rng);  // fresh A every generation
        b.fill_random(rng);
        poison(d);
        upload(a, d_src);
        upload(a_poison, d_a);
        upload(b, d_b);
        upload(d, d_d);
        upload(d, d_snap);
        CK(cudaMemset(d_timeouts.ptr, 0, sizeof(int)));
        CK(cudaDeviceSynchronize());

        const TensorView va(d_a.ptr, DType::kBF16, {m, k}), vb(d_b.ptr, DType::kBF16, {n, k}),
            vd(d_d.ptr, DType::kBF16, {m, n}, {ldd, 1});
        const auto maps = ops::detail::make_gemm_tensor_maps(cfg, va, vb, vd);
        const GemmArgs args = ops::detail::make_gemm_args(va, vd, 10'000'000'000ull);
        gemm::ChunkWaitParams sp{};
        sp.flags = static_cast<const uint64_t*>(d_chunk_flags.ptr);
        sp.rows_per_chunk = rows_per_chunk;
        sp.expected = static_cast<uint64_t>(round);  // generations: no reset between rounds
        sp.timeout_ns = 10'000'000'000ull;
        sp.diag = nullptr;
        gemm::TileSignalParams hp{};
        // Round 1 and 3: a generation per tile; round 2: a counter per tile row.
        const bool per_tile = round != 2;
        hp.flags = static_cast<uint64_t*>(per_tile ? d_tile_flags.ptr : d_row_flags.ptr);
        hp.value = per_tile ? static_cast<uint64_t>(round) : 1u;
        hp.num_n_tiles = grid.num_n_tiles;
        hp.mode = per_tile ? gemm::TileSignalMode::kSetPerTile : gemm::TileSignalMode::kAddPerTileRow;

        ASSERT_NO_THROW(ops::detail::launch_gemm_kernel(*kernel, cfg, maps, args, grid_ctas, sp, hp, s_gemm));
        if (per_tile) {
            tile_checker_kernel<<<1, 256, 0, s_check>>>(
                static_cast<const uint64_t*>(d_tile_flags.ptr), static_cast<uint64_t>(round), grid.num_m_tiles,
                grid.num_n_tiles, cfg.tile_m, cfg.tile_n, static_cast<const uint16_t*>(d_d.ptr),
                static_cast<uint16_t*>(d_snap.ptr), static_cast<int>(m), static_cast<int>(n), ldd, 10'000'000'000ull,
                static_cast<int*>(d_timeouts.ptr));
            CK(cudaGetLastError());
        }
        chunk_producer_kernel<<<1, 256, 0, s_prod>>>(
            static_cast<const uint16_t*>(d_src.ptr), static_cast<uint16_t*>(d_a.ptr), rows_per_chunk * k, m * k,
            static_cast<const int*>(d_order.ptr), num_chunks, static_cast<uint64_t*>(d_chunk_flags.ptr),
            static_cast<uint64_t>(round), 20'000);
        CK(cudaGetLastError());
        const cudaError_t err = cudaDeviceSynchronize();
        ASSERT_EQ(err, cudaSuccess) << "hooked GEMM / producer / checker failed: " << cudaGetErrorString(err);

        download(d, d_d);
        std::vector<int64_t> rows;
        for (int64_t r = 0; r < m; ++r) rows.push_back(r);
        const auto ref = reference(a, b, BLayout::kNK, n, rows);
        expect_matches(d, ref, rows, tolerance_for(DType::kBF16), "hooked GEMM");
        {
            // Where it went wrong, if it did: per tile, elements off by > 5% of rms, and how many are exactly 0.
            double den = 0;
            for (double v : ref) den += v * v;
            const double rms = std::sqrt(den / ref.size());
            int64_t any_wrong = 0;
            std::ostringstream map;
            for (int tm = 0; tm < grid.num_m_tiles; ++tm) {
                map << "\n  tile row " << tm << ":";
                for (int tn = 0; tn < grid.num_n_tiles; ++tn) {
                    int64_t wrong = 0, zeros = 0, total = 0;
                    for (int64_t r = tm * cfg.tile_m; r < std::min<int64_t>(m, (tm + 1) * cfg.tile_m); ++r)
                        for (int64_t c = tn * cfg.tile_n; c < std::min<int64_t>(n, (tn + 1) * cfg.tile_n); ++c) {
                            ++total;
                            const double got = d.get(r, c);
                            if (got == 0) ++zeros;  // (ref is [m][n], d has row stride ldd)
                            if (!(std::fabs(got - ref[r * n + c]) <= 0.05 * rms)) ++wrong;
                        }
                    map << " " << wrong << "/" << total << "(z" << zeros << ")";
                    any_wrong += wrong;
                }
            }
            if (any_wrong > 0) {
                ADD_FAILURE() << "per-tile wrong/total (zeros):" << map.str();
                return;
            }
        }

        if (per_tile) {
            std::vector<uint64_t> flags(num_tiles);
            CK(cudaMemcpy(flags.data(), d_tile_flags.ptr, 8 * num_tiles, cudaMemcpyDeviceToHost));
            for (int t = 0; t < num_tiles; ++t) {
                EXPECT_EQ(flags[t], static_cast<uint64_t>(round)) << "tile " << t << " signal";
            }
            int timeouts = 0;
            CK(cudaMemcpy(&timeouts, d_timeouts.ptr, sizeof(int), cudaMemcpyDeviceToHost));
            EXPECT_EQ(timeouts, 0) << "the checker timed out waiting for tile signals";
            // The snapshot taken right after each signal must already hold the final tile.
            HostMatrix snap(m, n, ldd, DType::kBF16);
            download(snap, d_snap);
            int64_t mismatches = 0;
            for (int64_t r = 0; r < m; ++r)
                for (int64_t c = 0; c < n; ++c) {
                    if (std::memcmp(snap.bytes.data() + snap.offset(r, c), d.bytes.data() + d.offset(r, c), 2) != 0) {
                        ++mismatches;
                    }
                }
            EXPECT_EQ(mismatches, 0) << "tile data read right after its signal differs from the final output: "
                                        "the signal was raised before the TMA store completed";
        } else {
            std::vector<uint64_t> rowf(grid.num_m_tiles);
            CK(cudaMemcpy(rowf.data(), d_row_flags.ptr, 8 * grid.num_m_tiles, cudaMemcpyDeviceToHost));
            for (int r = 0; r < grid.num_m_tiles; ++r) {
                EXPECT_EQ(rowf[r], static_cast<uint64_t>(grid.num_n_tiles)) << "tile row " << r << " counter";
            }
        }
    }
    cudaStreamDestroy(s_gemm);
    cudaStreamDestroy(s_prod);
    cudaStreamDestroy(s_check);
}

/// run_hook_test with candidate kIndex's config.
template <int kIndex>
void run_hooked(int64_t m, int64_t n, int64_t k, int rows_per_chunk) {
    run_hook_test(kHookedCfg<kIndex>, m, n, k, rows_per_chunk);
}

TEST(GemmHooks, WaitsForChunksFromAnotherStreamAndSignalsStoredTiles) {
    REQUIRE_SM90();
    run_hooked<kHookPlain>(1000, 1024, 512, 96);
}

TEST(GemmHooks, ClusterMulticastVariantWaitsAndSignals) {
    REQUIRE_SM90();
    // The same shape and config without hooks first: separates a cluster bug from a hook bug.
    Case plain{777, 1100, 256};
    plain.config = kHookedCfg<kHookAPairs>;
    check_case(plain);
    run_hooked<kHookAPairs>(777, 1100, 256, 64);
}

TEST(GemmHooks, ClusterBPairVariantWaitsAndSignals) {
    REQUIRE_SM90();
    run_hooked<kHookBPairs>(777, 1100, 256, 64);
}

// More tiles than CTAs, so both warpgroups of a CTA store and signal tiles (ragged M and N: tail stores too).
TEST(GemmHooks, PingPongWarpgroupsEachWaitAndSignalTheirTiles) {
    REQUIRE_SM90();
    run_hooked<kHookPingPong>(2000, 2300, 256, 96);
    run_hooked<kHookPingPong64>(1500, 1100, 256, 64);
}

}  // namespace
}  // namespace weft
