// SPDX-License-Identifier: MIT
// Unit tests of the GEMM's host side: config validity, tile grid and raster order, argument validation,
// path/config heuristics and config printing (CPU only).
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <climits>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "weft/common/gemm_config.hpp"
#include "weft/common/gemv_config.hpp"
#include "weft/detail/gemm_launch.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

constexpr DType kInOut[][2] = {{DType::kBF16, DType::kBF16},
                               {DType::kBF16, DType::kF32},
                               {DType::kF16, DType::kF16},
                               {DType::kF16, DType::kF32}};

TEST(GemmConfig, EveryCandidateIsValidAndFitsSharedMemory) {
    for (const auto& io : kInOut) {
        for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
            size_t valid = 0, partial_boxes = 0;
            for (int i = 0; i < kGemmNumCandidates; ++i) {
                const GemmConfig c = gemm_candidate(i, io[0], io[1], layout);
                if (c.tile_n % 64 != 0) ++partial_boxes;
                // Tiles of partial 64-column blocks exist for B [N,K] only.
                EXPECT_EQ(is_valid(c), layout == BLayout::kNK || c.tile_n % 64 == 0) << ops::format_gemm_config(c);
                if (!is_valid(c)) continue;
                ++valid;
                EXPECT_LE(gemm_smem_plan(c).alloc_bytes, kGemmMaxSmemBytes) << ops::format_gemm_config(c);
                EXPECT_EQ(gemm_smem_plan(c).bar_offset % 8, 0);
                // The tile ring's slots are written and read with 16-byte shared-memory accesses.
                EXPECT_EQ(gemm_smem_plan(c).tile_ring_offset % 16, 0);
                EXPECT_EQ(gemm_smem_plan(c).used_bytes,
                          gemm_smem_plan(c).tile_ring_offset + gemm_tile_slots(c) * kGemmTileSlotBytes);
                EXPECT_EQ(gemm_smem_plan(c).stage_bytes % 1024, 0) << "stages must keep 1024-byte alignment";
            }
            EXPECT_EQ(ops::gemm_candidate_configs(io[0], io[1], layout).size(), valid);
            EXPECT_EQ(valid, static_cast<size_t>(kGemmNumCandidates) - (layout == BLayout::kNK ? 0 : partial_boxes));
        }
    }
}

TEST(GemmConfig, RejectsWhatTheKernelCannotDo) {
    GemmConfig c{};
    EXPECT_TRUE(is_valid(c));
    auto with = [&](auto mutate) {
        GemmConfig x = c;
        mutate(x);
        return is_valid(x);
    };
    EXPECT_FALSE(with([](GemmConfig& x) { x.tile_k = 32; }));
    EXPECT_FALSE(with([](GemmConfig& x) { x.tile_m = 64; }));
    EXPECT_FALSE(with([](GemmConfig& x) { x.tile_n = 88; }));                     // no m64n88k16 wrapper
    EXPECT_TRUE(with([](GemmConfig& x) { x.tile_n = 176; }));                     // partial last store box
    EXPECT_FALSE(with([](GemmConfig& x) { x.tile_n = 176; x.b_layout = BLayout::kKN; }));
    EXPECT_FALSE(with([](GemmConfig& x) { x.tile_n = 176; x.cluster_m = 2; }));
    // Ping-pong: one warpgroup holds a whole tile (64 or 128 rows, <= 192 accumulators per thread).
    EXPECT_TRUE(with([](GemmConfig& x) { x.pingpong = true; x.tile_m = 64; }));
    EXPECT_TRUE(with([](GemmConfig& x) { x.pingpong = true; x.tile_n = 128; x.stages = 6; }));
    EXPECT_FALSE(with([](GemmConfig& x) { x.pingpong = true; }));                 // 128x256: 256 accumulators
    EXPECT_TRUE(with([](GemmConfig& x) { x.pingpong = true; x.tile_n = 192; }));  // 192 accumulators: the most
    EXPECT_FALSE(with([](GemmConfig& x) { x.pingpong = true; x.tile_n = 208; x.stages = 3; }));
    EXPECT_TRUE(with([](GemmConfig& x) { x.tile_m = 256; x.tile_n = 192; x.stages = 3; }));
    EXPECT_FALSE(with([](GemmConfig& x) { x.pingpong = true; x.tile_m = 256; x.tile_n = 64; }));
    // Ping-pong in cluster pairs (each warpgroup releases a stage in both CTAs): whole 64-column store boxes only.
    EXPECT_TRUE(with([](GemmConfig& x) { x.pingpong = true; x.tile_n = 128; x.stages = 6; x.cluster_m = 2; }));
    EXPECT_TRUE(with([](GemmConfig& x) { x.pingpong = true; x.tile_n = 192; x.cluster_n = 2; }));
    EXPECT_FALSE(with([](GemmConfig& x) { x.pingpong = true; x.tile_n = 176; x.stages = 5; x.cluster_m = 2; }));
    EXPECT_FALSE(gemm_whole_store_boxes([] { GemmConfig x{}; x.tile_n = 176; return x; }()));
    EXPECT_TRUE(gemm_whole_store_boxes(c));
    EXPECT_FALSE(with([](GemmConfig& x) { x.tile_n = 320; }));
    EXPECT_FALSE(with([](GemmConfig& x) { x.tile_m = 256; x.tile_n = 256; }));  // 256 accumulators
    EXPECT_FALSE(with([](GemmConfig& x) { x.stages = 5; }));                      // > 227 KiB
    EXPECT_FALSE(with([](GemmConfig& x) { x.stages = 1; }));
    EXPECT_FALSE(with([](GemmConfig& x) { x.cluster_m = 2; x.cluster_n = 2; }));
    EXPECT_FALSE(with([](GemmConfig& x) { x.cluster_m = 4; }));
    EXPECT_FALSE(with([](GemmConfig& x) { x.in_dtype = DType::kF32; }));
    EXPECT_FALSE(with([](GemmConfig& x) { x.out_dtype = DType::kI32; }));
    EXPECT_FALSE(with([](GemmConfig& x) {  // kKN multicast splits 64-column boxes between the pair
        x.b_layout = BLayout::kKN;
        x.tile_n = 192;
        x.cluster_m = 2;
    }));
    EXPECT_TRUE(with([](GemmConfig& x) { x.tile_n = 128; x.stages = 6; }));
}

// Every tile of D is computed exactly once; padding tiles only appear inside clusters; the CTAs of a
// cluster share the operand they multicast.
// Swapped configs (GemmConfig::swap_ab): what is_valid takes and refuses, the accumulator count (wgmma N = tile_m), the
// store box, the name and the printed kernel argument, and that grouped and fused GEMMs refuse them.
TEST(GemmConfig, SwappedConfigsTakeRowTilesOf16AndServeThePlainGemmOnly) {
    GemmConfig c = gemm_candidate(6, DType::kBF16, DType::kBF16, BLayout::kNK);
    c.swap_ab = true;
    c.tile_m = 80;
    c.tile_n = 128;
    c.stages = 7;
    ASSERT_TRUE(is_valid(c));
    EXPECT_EQ(gemm_slabs_per_consumer(c), 1);
    EXPECT_EQ(gemm_acc_regs(c), 40);
    EXPECT_EQ(gemm_wgmma_n(c), 80);
    EXPECT_EQ(gemm_store_box_rows(c), kGemmSwapStoreRows);
    EXPECT_FALSE(is_valid_grouped(c));
    EXPECT_NE(ops::gemm_candidate_name(c).find("_sw"), std::string::npos);
    EXPECT_NE(ops::format_gemm_config(c).find(".swap_ab = true"), std::string::npos);
    EXPECT_THROW(ops::check_fused_gemm_config(c), Error);
    {  // split-K serves the plain GEMM only, too: a hook sees each tile once, whole
        const auto splits = ops::gemm_split_k_configs(DType::kBF16, DType::kBF16, BLayout::kNK);
        ASSERT_FALSE(splits.empty());
        const GemmConfig split = splits.front();
        ASSERT_TRUE(is_valid(split));
        ASSERT_GT(split.splits, 1);
        EXPECT_FALSE(is_valid_grouped(split));
        EXPECT_THROW(ops::check_fused_gemm_config(split), Error);
    }
    auto with = [&](auto edit) {
        GemmConfig v = c;
        edit(v);
        return is_valid(v);
    };
    EXPECT_TRUE(with([](GemmConfig& v) { v.tile_m = 16; }));
    EXPECT_TRUE(with([](GemmConfig& v) { v.tile_m = 256, v.stages = 4; }));
    EXPECT_TRUE(with([](GemmConfig& v) { v.cluster_m = 2; }));
    EXPECT_TRUE(with([](GemmConfig& v) { v.pingpong = true, v.tile_n = 64; }));
    EXPECT_TRUE(with([](GemmConfig& v) { v.out_dtype = DType::kF32; }));
    EXPECT_FALSE(with([](GemmConfig& v) { v.tile_m = 72; }));                 // not whole 16-row store boxes
    EXPECT_FALSE(with([](GemmConfig& v) { v.tile_m = 272; }));                // past the wgmma's N
    EXPECT_FALSE(with([](GemmConfig& v) { v.tile_n = 192; }));                // not a slab per warpgroup
    EXPECT_FALSE(with([](GemmConfig& v) { v.tile_n = 64; }));                 // cooperative: a slab each
    EXPECT_FALSE(with([](GemmConfig& v) { v.b_layout = BLayout::kKN; }));     // B's rows are the wgmma's M side
    EXPECT_FALSE(with([](GemmConfig& v) { v.splits = 2; }));                  // no split of K
    EXPECT_FALSE(with([](GemmConfig& v) { v.tile_m = 256, v.stages = 8; }));  // past shared memory
    GemmConfig plain = c;
    plain.swap_ab = false;
    EXPECT_FALSE(is_valid(plain));  // 80 rows are the swapped kernel's alone
}

// Unrounded waves (a grouped call's even spread): tiles / concurrent tiles, never more than the whole waves, equal to
// them when the tiles fill their last wave, and without the step a whole-wave count takes at one tile past a wave.
TEST(GemmPlan, UnroundedWavesCostTheTilesWithoutTheLastWavesStep) {
    ops::GemmProblem p;
    p.n = 4096;
    p.k = 7168;
    const GemmConfig c = gemm_candidate(0, DType::kBF16, DType::kBF16, BLayout::kNK);  // 128x256: 16 tiles per 128 rows
    const auto cost = [&](int64_t m, ops::GemmWaves w) { return ops::gemm_config_cost(p, c, 132, 0, w); };
    for (int64_t m : {128, 1000, 4096, 11131, 32768}) {
        p.m = m;
        EXPECT_LE(cost(m, ops::GemmWaves::kUnrounded), cost(m, ops::GemmWaves::kWhole)) << m;
    }
    p.m = 33 * 128;  // 33 x 16 = 528 tiles = 4 waves of 132
    EXPECT_DOUBLE_EQ(cost(p.m, ops::GemmWaves::kUnrounded), cost(p.m, ops::GemmWaves::kWhole));
    const double full = cost(p.m, ops::GemmWaves::kUnrounded);
    p.m = 34 * 128;  // 16 tiles past 4 waves: a 5th whole wave, 16/132 of one unrounded
    EXPECT_DOUBLE_EQ(cost(p.m, ops::GemmWaves::kWhole), full * 5 / 4);
    EXPECT_NEAR(cost(p.m, ops::GemmWaves::kUnrounded), full * (4 + 16.0 / 132) / 4, full * 1e-12);
}

// The autotuner's swapped set: tile_m = M / t rounded up to 16, tiles filling half a wave to two waves, B [N,K], M <=
// 512.
TEST(GemmPlan, SwappedConfigsFillHalfAWaveToTwoWaves) {
    const ops::GemmProblem p{.m = 320, .n = 4096, .k = 4096};
    const std::vector<GemmConfig> v = ops::gemm_swap_ab_configs(p, 132);
    std::set<std::pair<int, int>> got;
    for (const GemmConfig& c : v) {
        EXPECT_TRUE(is_valid(c) && c.swap_ab && c.tile_n == (c.pingpong ? 64 : 128)) << ops::format_gemm_config(c);
        const GemmTileGrid g(c, 320, 4096);
        const int ctas = g.num_cluster_tiles() * c.cluster_m;
        EXPECT_TRUE(2 * g.num_tiles() >= 132 && ctas <= 2 * 132)
            << ops::format_gemm_config(c) << ": " << ctas << " CTAs";
        if (!c.pingpong) got.insert({c.tile_m, c.cluster_m});
    }
    EXPECT_TRUE(got.count({80, 1}) && got.count({80, 2}) && got.count({112, 1})) << v.size() << " configs";
    EXPECT_TRUE(ops::gemm_swap_ab_configs(ops::GemmProblem{.m = 600, .n = 4096, .k = 4096}, 132).empty());
    EXPECT_TRUE(
        ops::gemm_swap_ab_configs(ops::GemmProblem{.m = 320, .n = 4096, .k = 4096, .b_layout = BLayout::kKN}, 132)
            .empty());
    // The op's rule: kGemmSwapRuleMinM < M <= 512 with the whole device, where small-M variant 5 does not serve, the
    // cluster-free swapped config whose whole waves hold the most of D, where it beats the pick.
    auto pick = [](int64_t m, int64_t n, ops::GemmOptions o = {}) {
        return ops::plan_gemm(ops::GemmProblem{.m = m, .n = n, .k = 4096}, 132, o).config;
    };
    for (auto [m, n, tile_m] : {std::array<int64_t, 3>{320, 4096, 80},
                                {257, 4096, 80},
                                {384, 4096, 96},
                                {448, 4096, 112},
                                {320, 8192, 160},
                                {300, 8192, 160},
                                {320, 14336, 160},
                                {448, 7168, 224},
                                {160, 28672, 160},
                                {192, 28672, 192}}) {
        const GemmConfig c = pick(m, n);
        EXPECT_TRUE(c.swap_ab && c.tile_m == tile_m && c.cluster_m == 1 && !c.pingpong)
            << m << "x" << n << ": " << ops::gemm_candidate_name(c);
        EXPECT_EQ(c, ops::gemm_swap_ab_config_of(static_cast<int>(tile_m), DType::kBF16, DType::kBF16));
    }
    EXPECT_FALSE(pick(256, 4096).swap_ab);  // the 64-row ping-pong tile has no padding there
    EXPECT_FALSE(pick(256, 28672).swap_ab);  // 2 x 180 128x160 tiles in 3 waves hold more of D than 224 swapped in 2
    EXPECT_FALSE(pick(128, 28672).swap_ab);  // M <= kGemmSwapRuleMinM
    // Variant 5's band is weighed against the unswapped pick, before the rule: its split calls stay with it; above
    // kGemmSwapRuleMinM its unsplit ones (N = 8192, K = 4096: 128 column blocks) go to the rule's swapped tiles.
    for (auto [m, n] : {std::array<int64_t, 2>{160, 4096}, {144, 4096}}) {
        EXPECT_EQ(ops::plan_gemm(ops::GemmProblem{.m = m, .n = n, .k = 4096}, 132).path, ops::GemmPath::kSmallM)
            << m << "x" << n;
    }
    for (auto [m, n, tile_m] : {std::array<int64_t, 3>{160, 8192, 80}, {192, 8192, 96}, {144, 7168, 80}}) {
        const GemmConfig c = pick(m, n);
        EXPECT_TRUE(c.swap_ab && c.tile_m == tile_m) << m << "x" << n << ": " << ops::gemm_candidate_name(c);
    }
    EXPECT_EQ(ops::plan_gemm(ops::GemmProblem{.m = 129, .n = 7168, .k = 4096}, 132).path, ops::GemmPath::kSmallM)
        << "80-row swapped tiles fill 0.68 of their wave at M = 129: variant 5 keeps it";
    EXPECT_FALSE(pick(512, 4096).swap_ab);  // 4 x 32 whole 128x128 tiles fill the wave as well
    EXPECT_FALSE(pick(384, 8192).swap_ab);  // 3 x 43 128x192 tiles: as full as 2 x 64 swapped 192-row ones
    EXPECT_FALSE(pick(512, 8192, {}).swap_ab);
    EXPECT_FALSE(pick(513, 4096).swap_ab);   // past the rule's band
    EXPECT_FALSE(pick(320, 1024).swap_ab);   // 48-row tiles x 8 fill half a wave
    EXPECT_FALSE(pick(384, 2048).swap_ab);  // 48-row tiles x 16 fill the wave but read B for too few rows
    EXPECT_FALSE(pick(320, 28672).swap_ab);  // no swapped tiling fits two waves
    ops::GemmOptions budget;
    budget.sm_budget = 100;
    EXPECT_FALSE(pick(320, 4096, budget).swap_ab);
    // Every config the rule can pick is in the AOT list (weft-compile --builtin warms it).
    std::set<std::string> aot;
    for (const auto& spec : ops::gemm_aot_specs()) aot.insert(spec.instantiation);
    for (int64_t m = ops::kGemmSwapRuleMinM + 1; m <= 512; m += 17) {
        for (int64_t n : {2048, 4096, 5120, 8192, 14336, 28672}) {
            const GemmConfig c = pick(m, n);
            if (!c.swap_ab) continue;
            EXPECT_TRUE(aot.count(ops::gemm_kernel_spec(c).instantiation)) << ops::gemm_candidate_name(c);
            EXPECT_GE(c.tile_m, ops::kGemmSwapRuleMinRows);
        }
    }
    // The autotuner tries them beside the unswapped candidates.
    bool tried = false;
    for (const auto& cand : ops::gemm_tune_candidates(p, 132, ops::GemmOptions{})) {
        tried = tried || cand.name.find("_sw") != std::string::npos;
    }
    EXPECT_TRUE(tried);
}

TEST(GemmTileGrid, CoversEveryTileOnceInEveryRasterAndCluster) {
    const int shapes[][2] = {{1, 8}, {127, 129}, {128, 256}, {1000, 3000}, {8192, 1376}, {4096, 4096}, {777, 64}};
    for (const auto& s : shapes) {
        for (int idx = 0; idx < kGemmNumCandidates; ++idx) {
            for (Raster raster : {Raster::kAlongN, Raster::kAlongM}) {
                for (int group : {1, 3, 8}) {
                    GemmConfig c = gemm_candidate(idx, DType::kBF16, DType::kBF16, BLayout::kNK);
                    c.raster = raster;
                    c.raster_group = group;
                    const GemmTileGrid g(c, s[0], s[1]);
                    const int cluster = c.cluster_m * c.cluster_n;
                    std::set<std::pair<int, int>> seen;
                    for (int t = 0; t < g.num_cluster_tiles(); ++t) {
                        GemmTile first{};
                        for (int r = 0; r < cluster; ++r) {
                            const GemmTile tile = g.tile(t, r);
                            if (r == 0) first = tile;
                            if (c.cluster_m == 2) {
                                EXPECT_EQ(tile.n_idx, first.n_idx);
                            }
                            if (c.cluster_n == 2) {
                                EXPECT_EQ(tile.m_idx, first.m_idx);
                            }
                            EXPECT_EQ(tile.m0, tile.m_idx * c.tile_m);
                            EXPECT_EQ(tile.n0, tile.n_idx * c.tile_n);
                            if (!tile.valid) {
                                EXPECT_GT(cluster, 1) << "padding tile without a cluster";
                                continue;
                            }
                            ASSERT_LT(tile.m_idx, g.num_m_tiles);
                            ASSERT_LT(tile.n_idx, g.num_n_tiles);
                            EXPECT_TRUE(seen.insert({tile.m_idx, tile.n_idx}).second)
                                << "tile (" << tile.m_idx << ", " << tile.n_idx << ") twice, shape " << s[0] << "x"
                                << s[1] << " " << ops::format_gemm_config(c);
                        }
                    }
                    EXPECT_EQ(seen.size(), static_cast<size_t>(g.num_tiles()))
                        << s[0] << "x" << s[1] << " " << ops::format_gemm_config(c);
                }
            }
        }
    }
}

TEST(GemmTileGrid, ConsecutiveTilesStayInsideASwizzleGroup) {
    GemmConfig c{};
    c.raster_group = 8;
    const GemmTileGrid g(c, 8192, 8192);  // 64 x 32 tiles
    // The first 8 * 32 tiles in order cover tile rows 0..7 only: A rows stay hot in L2.
    for (int t = 0; t < 8 * 32; ++t) EXPECT_LT(g.tile(t, 0).m_idx, 8);
    EXPECT_EQ(g.tile(8 * 32, 0).m_idx, 8);
}

TensorView mat(uintptr_t addr, DType t, int64_t rows, int64_t cols, int64_t ld) {
    return TensorView(reinterpret_cast<void*>(addr), t, {rows, cols}, {ld, 1});
}

void expect_error_mentions(const std::function<void()>& fn, const std::string& needle) {
    try {
        fn();
        ADD_FAILURE() << "expected weft::Error mentioning '" << needle << "'";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
}

TEST(GemmValidate, AcceptsBothLayoutsAndStrides) {
    const auto p = ops::validate_gemm_args(mat(0x10000, DType::kBF16, 100, 64, 72), mat(0x20000, DType::kBF16, 30, 64, 64),
                                           mat(0x30000, DType::kF32, 100, 30, 32), BLayout::kNK);
    EXPECT_EQ(p.m, 100);
    EXPECT_EQ(p.n, 30);
    EXPECT_EQ(p.k, 64);
    EXPECT_EQ(p.out_dtype, DType::kF32);
    const auto q = ops::validate_gemm_args(mat(0x10000, DType::kF16, 1, 8, 8), mat(0x20000, DType::kF16, 8, 24, 24),
                                           mat(0x30000, DType::kF16, 1, 24, 24), BLayout::kKN);
    EXPECT_EQ(q.n, 24);
    EXPECT_EQ(q.k, 8);
}

TEST(GemmValidate, NamesTheBadArgument) {
    const auto a = mat(0x10000, DType::kBF16, 64, 64, 64);
    const auto b = mat(0x20000, DType::kBF16, 128, 64, 64);
    const auto d = mat(0x30000, DType::kBF16, 64, 128, 128);
    EXPECT_NO_THROW(ops::validate_gemm_args(a, b, d, BLayout::kNK));
    expect_error_mentions([&] { ops::validate_gemm_args(mat(0x10008, DType::kBF16, 64, 64, 64), b, d, BLayout::kNK); },
                          "a's base address must be 16-byte aligned");
    expect_error_mentions([&] { ops::validate_gemm_args(a, mat(0x20000, DType::kBF16, 128, 64, 68), d, BLayout::kNK); },
                          "b's row stride must be a multiple of 16 bytes");
    // Every path (the small-M kernels too) takes D's rows 16-byte aligned: an odd ldd is refused, not served slowly.
    expect_error_mentions([&] { ops::validate_gemm_args(mat(0x10000, DType::kBF16, 7, 64, 64), b,
                                                        mat(0x30000, DType::kBF16, 7, 128, 129), BLayout::kNK); },
                          "d's row stride must be a multiple of 16 bytes");
    expect_error_mentions([&] { ops::validate_gemm_args(a, mat(0x20000, DType::kBF16, 128, 32, 32), d, BLayout::kNK); },
                          "b ([N,K] row-major) must have K = 64");
    expect_error_mentions([&] { ops::validate_gemm_args(a, mat(0x20000, DType::kF16, 128, 64, 64), d, BLayout::kNK); },
                          "b must have a's dtype bf16");
    expect_error_mentions([&] { ops::validate_gemm_args(a, b, mat(0x30000, DType::kF16, 64, 128, 128), BLayout::kNK); },
                          "d must be bf16");
    expect_error_mentions([&] { ops::validate_gemm_args(a, b, mat(0x30000, DType::kBF16, 64, 120, 128), BLayout::kNK); },
                          "d must be [M,N] = [64, 128]");
    expect_error_mentions(
        [&] { ops::validate_gemm_args(mat(0x10000, DType::kBF16, 64, 12, 16), mat(0x20000, DType::kBF16, 128, 12, 16), d,
                                      BLayout::kNK); },
        "K (a's columns) must be a positive multiple of 8, got 12");
    expect_error_mentions(
        [&] {
            TensorView a3(reinterpret_cast<void*>(0x10000), DType::kBF16, {2, 64, 64});
            ops::validate_gemm_args(a3, b, d, BLayout::kNK);
        },
        "a must be a 2-D matrix");
    expect_error_mentions([&] { ops::validate_gemm_args(a, b, mat(0x30000, DType::kBF16, 64, 128, 100), BLayout::kNK); },
                          "d's row stride must be >= its row length 128");
    expect_error_mentions(
        [&] { ops::validate_gemm_args(TensorView(reinterpret_cast<void*>(0x10000), DType::kBF16, {64, 64}, {1, 64}), b, d,
                                      BLayout::kNK); },
        "a must be row-major");
    expect_error_mentions([&] { ops::validate_gemm_args(mat(0, DType::kBF16, 64, 64, 64), b, d, BLayout::kNK); },
                          "a has a null data pointer");
}

// Extents near 2^31 overflow the kernels' int32 tile arithmetic ((k + tile_k - 1) / tile_k, (m + tile_m - 1) / tile_m):
// K = 2^31 - 8 (A and B of one row each: 8 GiB) would run no k block and leave D unwritten. Refused with a margin.
TEST(GemmValidate, ExtentsLeaveTheKernelsInt32TileArithmeticAMargin) {
    const int64_t max = ops::kGemmMaxExtent;
    EXPECT_EQ(max, (int64_t{1} << 31) - (int64_t{1} << 24));
    const int64_t big_k = (int64_t{1} << 31) - 8;
    expect_error_mentions(
        [&] {
            ops::validate_gemm_args(mat(0x10000, DType::kBF16, 1, big_k, big_k),
                                    mat(0x20000, DType::kBF16, 8, big_k, big_k), mat(0x30000, DType::kBF16, 1, 8, 8),
                                    BLayout::kNK);
        },
        "a's extents must be at most 2^31 - 2^24");
    expect_error_mentions(
        [&] {
            ops::validate_gemm_args(mat(0x10000, DType::kBF16, (int64_t{1} << 31) - 1, 8, 8),
                                    mat(0x20000, DType::kBF16, 8, 8, 8),
                                    mat(0x30000, DType::kBF16, (int64_t{1} << 31) - 1, 8, 8), BLayout::kNK);
        },
        "a's extents must be at most 2^31 - 2^24");
    const auto p =
        ops::validate_gemm_args(mat(0x10000, DType::kBF16, max, max, max), mat(0x20000, DType::kBF16, 8, max, max),
                                mat(0x30000, DType::kBF16, max, 8, 8), BLayout::kNK);
    EXPECT_EQ(p.m, max);
    EXPECT_EQ(p.k, max);
    // The tile arithmetic of the largest extents stays positive and in int32.
    const GemmConfig c = gemm_candidate(0, DType::kBF16, DType::kBF16, BLayout::kNK);
    const GemmTileGrid g(c, static_cast<int32_t>(max), 8);
    EXPECT_GT(g.num_m_tiles, 0);
    EXPECT_EQ(int64_t{g.num_m_tiles}, (max + c.tile_m - 1) / c.tile_m);
    EXPECT_LE(int64_t{max} + 256 + 64, int64_t{INT32_MAX});  // a tile's rows (<= 256) and a k block past the last
    // The small-M split-K ranges: the last split ends at most 32 x splits past K (k_per_split a multiple of 32), which
    // the kernel adds in int32 (k_begin + k_per_split).
    ops::GemmOptions forced;
    forced.small_m_splits = ops::kGemmMaxSmallMSplits;
    for (int64_t splits : {int64_t{2}, int64_t{3}, int64_t{10000}, int64_t{ops::kGemmMaxSmallMSplits}}) {
        forced.small_m_splits = static_cast<int>(splits);
        const ops::GemmPlan plan = ops::plan_gemm({1, 8, max, BLayout::kNK, DType::kBF16, DType::kBF16}, 132, forced);
        ASSERT_EQ(plan.path, ops::GemmPath::kSmallM);
        EXPECT_LE(int64_t{plan.small_m_splits} * plan.small_m_k_per_split, int64_t{INT32_MAX}) << splits;
        EXPECT_GE(int64_t{plan.small_m_splits} * plan.small_m_k_per_split, max) << splits;
    }
}

// weft::ops::gemm and select_gemm check their options before anything touches the device, at every problem size
// (these run without a GPU: a CUDA call would fail with the runtime's error); an empty problem is a no-op.
TEST(GemmValidate, PublicCallsCheckOptionsBeforeTheDeviceAtEverySize) {
    const auto a = mat(0x10000, DType::kBF16, 64, 64, 64);
    const auto b = mat(0x20000, DType::kBF16, 128, 64, 64);
    const auto d = mat(0x30000, DType::kBF16, 64, 128, 128);
    const auto a0 = mat(0x10000, DType::kBF16, 0, 64, 64);
    const auto d0 = mat(0x30000, DType::kBF16, 0, 128, 128);
    EXPECT_NO_THROW(ops::gemm(a0, b, d0, BLayout::kNK, nullptr));  // M = 0: nothing to write, no CUDA call
    EXPECT_NO_THROW(ops::gemm(a, mat(0x20000, DType::kBF16, 0, 64, 64), mat(0x30000, DType::kBF16, 64, 0, 0),
                              BLayout::kNK, nullptr));  // N = 0
    // K = 0 is refused (a positive multiple of 8), whatever M and N.
    expect_error_mentions(
        [&] {
            ops::gemm(mat(0x10000, DType::kBF16, 0, 0, 0), mat(0x20000, DType::kBF16, 128, 0, 0), d0, BLayout::kNK,
                      nullptr);
        },
        "K (a's columns) must be a positive multiple of 8, got 0");
    struct Bad {
        const char* what;
        ops::GemmOptions options;
    };
    std::vector<Bad> bad(9);
    bad[0] = {"options.sm_budget must be >= 0", {}};
    bad[0].options.sm_budget = -4;
    bad[1] = {"options.split_k must be in [0, 16]", {}};
    bad[1].options.split_k = 17;
    bad[2] = {"options.small_m_splits must be in [0, 65535]", {}};
    bad[2].options.small_m_splits = -1;
    bad[3] = {"options.small_m_splits must be in [0, 65535]", {}};
    bad[3].options.small_m_splits = 1 << 20;
    bad[4] = {
        "options.small_m_variant must be GemvVariant::kTmaRing (3), GemvVariant::kBulkRows (4) or "
        "GemvVariant::kTmaWgmma (5)",
        {}};
    bad[4].options.small_m_variant = static_cast<GemvVariant>(9);
    bad[5] = {"options.timeout must not be negative", {}};
    bad[5].options.timeout = std::chrono::milliseconds(-5);
    {
        Bad huge = {"at most 30 days", {}};  // milliseconds::max() would wrap the device's nanosecond bound
        huge.options.timeout = std::chrono::milliseconds::max();
        expect_error_mentions([&] { ops::gemm(a, b, d, BLayout::kNK, nullptr, huge.options); }, huge.what);
    }
    bad[6] = {"options.workspace must be 256-byte aligned", {}};
    bad[6].options.workspace = reinterpret_cast<void*>(uintptr_t{0x40010});
    bad[7] = {"options.config's dtypes/layout must match the call", {}};
    bad[7].options.config = gemm_candidate(0, DType::kF16, DType::kF16, BLayout::kNK);
    bad[8] = {"options.small_m_max_m must be in [0, 64]", {}};
    bad[8].options.small_m_max_m = 65;
    for (const Bad& x : bad) {
        expect_error_mentions([&] { ops::gemm(a, b, d, BLayout::kNK, nullptr, x.options); }, x.what);
        expect_error_mentions([&] { ops::gemm(a0, b, d0, BLayout::kNK, nullptr, x.options); }, x.what);
        expect_error_mentions([&] { (void)ops::select_gemm(a, b, d, BLayout::kNK, nullptr, x.options); }, x.what);
    }
    // A forced small-M variant that cannot serve the call (B's rows not back to back) is refused up front too.
    ops::GemmOptions rows;
    rows.small_m_variant = GemvVariant::kBulkRows;
    expect_error_mentions(
        [&] {
            ops::gemm(mat(0x10000, DType::kBF16, 1, 4096, 4096), mat(0x20000, DType::kBF16, 128, 4096, 4160),
                      mat(0x30000, DType::kBF16, 1, 128, 128), BLayout::kNK, nullptr, rows);
        },
        "small-M variant 4 (bulk-copied rows) cannot serve this call");
    // Variant 5 forced on a call it cannot serve (M > 256, B [K,N]) is refused up front, at every size.
    ops::GemmOptions v5;
    v5.small_m_variant = GemvVariant::kTmaWgmma;
    expect_error_mentions(
        [&] {
            ops::gemm(mat(0x10000, DType::kBF16, 257, 64, 64), b, mat(0x30000, DType::kBF16, 257, 128, 128),
                      BLayout::kNK, nullptr, v5);
        },
        "small-M variant 5 (swapped wgmma) serves M <= 256 (kGemvWgmmaMaxM), got M = 257");
    expect_error_mentions(
        [&] {
            (void)ops::select_gemm(mat(0x10000, DType::kBF16, 300, 64, 64), b,
                                   mat(0x30000, DType::kBF16, 300, 128, 128), BLayout::kNK, nullptr, v5);
        },
        "got M = 300");
    expect_error_mentions(
        [&] { ops::gemm(a0, mat(0x20000, DType::kBF16, 64, 128, 128), d0, BLayout::kKN, nullptr, v5); },
        "small-M variant 5 (swapped wgmma) needs B [N,K]");
}

TEST(GemmPlan, SmallMTakesTheSplitKPathOnlyWhereItCan) {
    ops::GemmProblem p{1, 8192, 8192, BLayout::kNK, DType::kBF16, DType::kBF16};
    // The default: the op picks; here (B's rows not known to be contiguous) the TMA ring (variant 3).
    EXPECT_FALSE(ops::GemmOptions{}.small_m_variant.has_value());
    const auto plan3 = ops::plan_gemm(p, 132);
    EXPECT_EQ(plan3.path, ops::GemmPath::kSmallM);
    EXPECT_EQ(plan3.small_m_tiles, 1);
    EXPECT_EQ(plan3.small_m_variant, GemvVariant::kTmaRing);
    EXPECT_EQ(plan3.grid, 128);  // 64 columns per CTA
    EXPECT_EQ(plan3.small_m_splits, 1) << "N = K = 8192 on 132 SMs: 128 CTAs, 1 per SM, fill the SMs";
    EXPECT_EQ(plan3.workspace_bytes, 0u);
    ops::GemmOptions small_up_to_64;
    small_up_to_64.small_m_max_m = kGemvMaxM;
    EXPECT_EQ(ops::plan_gemm(ops::GemmProblem{64, 8192, 8192, BLayout::kNK, DType::kBF16, DType::kBF16}, 132,
                             small_up_to_64)
                  .grid,
              128);  // 64 columns per CTA at every row-tile count
    ops::GemmOptions bad;
    bad.small_m_variant = static_cast<GemvVariant>(2);
    expect_error_mentions([&] { ops::plan_gemm(p, 132, bad); },
                          "options.small_m_variant must be GemvVariant::kTmaRing (3), GemvVariant::kBulkRows (4) or "
                          "GemvVariant::kTmaWgmma (5), got 2");
    bad.small_m_variant = static_cast<GemvVariant>(6);
    expect_error_mentions([&] { ops::plan_gemm(p, 132, bad); }, "got 6");

    ops::GemmOptions up_to_64;
    up_to_64.small_m_max_m = kGemvMaxM;
    up_to_64.small_m_wgmma_max_m = 0;  // variants 3 / 4 and the tiled kernel only
    p.m = 64;
    EXPECT_EQ(ops::plan_gemm(p, 132, up_to_64).path, ops::GemmPath::kSmallM);
    EXPECT_EQ(ops::plan_gemm(p, 132, up_to_64).small_m_tiles, 4);
    p.m = 65;
    EXPECT_EQ(ops::plan_gemm(p, 132, up_to_64).path, ops::GemmPath::kTiled);
    p.m = 16;
    p.b_layout = BLayout::kKN;
    EXPECT_EQ(ops::plan_gemm(p, 132).path, ops::GemmPath::kTiled);
    p.b_layout = BLayout::kNK;
    ops::GemmOptions no_small;
    no_small.allow_small_m = false;
    EXPECT_EQ(ops::plan_gemm(p, 132, no_small).path, ops::GemmPath::kTiled);
    ops::GemmOptions forced_splits;
    forced_splits.small_m_splits = 3;
    EXPECT_EQ(ops::plan_gemm(p, 132, forced_splits).small_m_splits, 3);
    p.k = 8;  // tiny K: one split, no workspace
    const auto plan = ops::plan_gemm(p, 132);
    EXPECT_EQ(plan.small_m_splits, 1);
    EXPECT_EQ(plan.workspace_bytes, 0u);
}

// Variant 3's shared-memory plan (gemv_shape / gemv_smem_bytes): each row-tile count's ring fits the planned CTAs
// per SM on an H200 (228 KiB per SM, 227 KiB per block, 1 KiB reserved per resident block), holds whole stages
// of its B and A rows, and has room for the end's cross-warp sums.
TEST(GemmPlan, SmallMVariant3RingFitsItsPlannedCtasPerSm) {
    constexpr int kSmPerSm = 228 * 1024, kMaxPerBlock = 227 * 1024, kReservedPerBlock = 1024;
    for (int m_tiles = 1; m_tiles <= kGemvMaxM / 16; ++m_tiles) {
        SCOPED_TRACE("m_tiles " + std::to_string(m_tiles));
        const GemvConfig config{.variant = GemvVariant::kTmaRing, .m_tiles = m_tiles};
        ASSERT_TRUE(is_valid(config));
        const GemvShape shape = gemv_shape(config);
        const int smem = gemv_smem_bytes(config);
        const int stage = (32 * shape.n_tiles + 16 * m_tiles) * 2 * kGemvBulkStageK;
        EXPECT_LE(smem, kMaxPerBlock);
        EXPECT_LE(shape.ctas_per_sm * (smem + kReservedPerBlock), kSmPerSm);
        EXPECT_GE(smem, 128 + 1024 + shape.stages * stage) << "barriers, alignment slack, the ring";
        EXPECT_GE(smem, 128 + 1024 + 4 * m_tiles * 4 * shape.n_tiles * 4 * 32 * 4) << "the cross-warp sums";
        EXPECT_GE(shape.stages, 2);
        EXPECT_EQ(kGemvBulkStageK % kGemvBulkBoxK, 0);
    }
}

// A budget below the device's SMs bounds every launch the op picks itself: variant 4 spreads N over the budget's CTAs;
// where variant 3 would serve, the tiled kernel's persistent grid does (variant 3 launches a CTA per column block and
// split); the autotuner's candidates keep to it too. A forced variant 3 keeps its own grid (documented).
TEST(GemmPlan, ABudgetBelowTheDeviceBoundsTheSmallMPicks) {
    ops::GemmProblem p{1, 8192, 8192, BLayout::kNK, DType::kBF16, DType::kBF16};
    p.b_rows_contiguous = true;
    ops::GemmOptions budget;
    budget.sm_budget = 8;
    const ops::GemmPlan v4 = ops::plan_gemm(p, 132, budget);
    EXPECT_EQ(v4.path, ops::GemmPath::kSmallM);
    EXPECT_EQ(v4.small_m_variant, GemvVariant::kBulkRows);
    EXPECT_LE(v4.grid, 8);
    p.k = 2048;  // variant 3's: the whole device's grid
    EXPECT_EQ(ops::plan_gemm(p, 132).small_m_variant, GemvVariant::kTmaRing);
    EXPECT_GT(ops::plan_gemm(p, 132).grid, 8);
    const ops::GemmPlan tiled = ops::plan_gemm(p, 132, budget);
    EXPECT_EQ(tiled.path, ops::GemmPath::kTiled);
    EXPECT_LE(tiled.grid, 8);
    for (const ops::GemmCandidate& c : ops::gemm_tune_candidates(p, 132, budget)) {
        EXPECT_LE(c.plan.grid, 8) << c.name;
    }
    ops::GemmOptions forced = budget;
    forced.small_m_variant = GemvVariant::kTmaRing;
    EXPECT_EQ(ops::plan_gemm(p, 132, forced).path, ops::GemmPath::kSmallM);
    ops::GemmOptions whole = budget;
    whole.sm_budget = 132;  // the whole device: no bound to keep
    EXPECT_EQ(ops::plan_gemm(p, 132, whole).small_m_variant, GemvVariant::kTmaRing);
}

// Variant 4 (bulk-copied rows) serves only M <= 16 with B's rows back to back and K a multiple of 2048 (its
// whole-row FMA body: M <= 2, K = 2048 x 1, 2, 4 or 8; its row-group MMA body elsewhere), no split-K;
// forced elsewhere, the plan names what is missing. Where it serves: one split, no workspace, one CTA per SM with N
// spread evenly (8192 rows on 132 SMs: 63 rows each, 131 CTAs), and the launch takes the ring's shared memory. Left
// to the op (small_m_variant unset), it is picked where it serves and K >= 4096; variant 3 elsewhere.
TEST(GemmPlan, SmallMVariant4WholeRowsNamesWhatItNeeds) {
    constexpr GemvVariant k3 = GemvVariant::kTmaRing, k4 = GemvVariant::kBulkRows;
    ops::GemmOptions v4;
    v4.small_m_variant = k4;
    ops::GemmProblem p{1, 8192, 8192, BLayout::kNK, DType::kBF16, DType::kBF16};
    p.b_rows_contiguous = true;
    EXPECT_EQ(ops::gemv_rows_unsupported(p), "");
    const auto plan = ops::plan_gemm(p, 132, v4);
    EXPECT_EQ(plan.path, ops::GemmPath::kSmallM);
    EXPECT_EQ(plan.small_m_variant, k4);
    EXPECT_EQ(plan.grid, 131);
    EXPECT_EQ(plan.small_m_splits, 1);
    EXPECT_EQ(plan.workspace_bytes, 0u);
    const auto with = [&](auto change) {
        ops::GemmProblem q = p;
        change(q);
        return q;
    };
    EXPECT_EQ(ops::plan_gemm(p, 132).small_m_variant, k4);
    EXPECT_EQ(ops::plan_gemm(with([](auto& q) { q.m = 2; q.k = 4096; }), 132).small_m_variant, k4);
    EXPECT_EQ(ops::plan_gemm(with([](auto& q) { q.k = 2048; }), 132).small_m_variant, k3);
    EXPECT_EQ(ops::plan_gemm(with([](auto& q) { q.m = 4; }), 132).small_m_variant, k4);
    EXPECT_EQ(ops::plan_gemm(with([](auto& q) { q.m = 5; }), 132).small_m_variant, k4);
    EXPECT_EQ(ops::plan_gemm(with([](auto& q) { q.m = 16; }), 132).small_m_variant, k4);
    ops::GemmOptions no_v5;
    no_v5.small_m_wgmma_max_m = 0;
    EXPECT_EQ(ops::plan_gemm(with([](auto& q) { q.m = 17; }), 132, no_v5).small_m_variant, k3);
    EXPECT_EQ(ops::plan_gemm(with([](auto& q) { q.m = 4; q.k = 16384; }), 132).small_m_variant, k4);
    EXPECT_EQ(ops::plan_gemm(with([](auto& q) { q.b_rows_contiguous = false; }), 132).small_m_variant, k3);
    EXPECT_EQ(ops::plan_gemm(with([](auto& q) { q.k = 6144; }), 132).small_m_variant, k4);
    EXPECT_EQ(ops::plan_gemm(with([](auto& q) { q.k = 6656; }), 132).small_m_variant, k3);
    expect_error_mentions([&] { ops::plan_gemm(with([](auto& q) { q.m = 17; }), 132, v4); }, "M = 17 > 16");
    // The body: FMAs with A in registers where it fits, else the row groups on the tensor cores.
    EXPECT_TRUE(gemv_rows_uses_ffma(2, 8192));
    EXPECT_TRUE(gemv_rows_uses_ffma(2, 16384));
    EXPECT_FALSE(gemv_rows_uses_ffma(3, 8192));
    EXPECT_FALSE(gemv_rows_uses_ffma(4, 4096));
    EXPECT_TRUE(gemv_rows_uses_ffma(1, 16384));
    EXPECT_FALSE(gemv_rows_uses_ffma(3, 16384));
    EXPECT_FALSE(gemv_rows_uses_ffma(5, 8192));
    EXPECT_FALSE(gemv_rows_uses_ffma(1, 6144));
    for (int64_t m : {1, 4, 5, 8, 9, 16}) EXPECT_EQ(ops::gemv_rows_unsupported(with([&](auto& q) { q.m = m; })), "");
    expect_error_mentions([&] { ops::plan_gemm(with([](auto& q) { q.b_rows_contiguous = false; }), 132, v4); },
                          "contiguous, 16-byte aligned rows");
    expect_error_mentions([&] { ops::plan_gemm(with([](auto& q) { q.k = 8200; }), 132, v4); },
                          "K = 8200 is not a multiple of 2048");
    expect_error_mentions([&] { ops::plan_gemm(with([](auto& q) { q.m = 8; q.k = 3584; }), 132, v4); },
                          "K = 3584 is not a multiple of 2048");
    for (int64_t k : {2048, 4096, 6144, 16384, 32768}) {
        EXPECT_EQ(ops::gemv_rows_unsupported(with([&](auto& q) { q.k = k; })), "");
        EXPECT_EQ(ops::gemv_rows_unsupported(with([&](auto& q) { q.k = k; q.m = 16; })), "");
    }
    // Any N: 128256 rows on 132 SMs are 972 rows per CTA, 132 CTAs.
    EXPECT_EQ(ops::plan_gemm(with([](auto& q) { q.n = 128256; }), 132, v4).grid, 132);
    // Few rows: every CTA still gets at least one (N = 200 on 132 SMs: 2 rows each, 100 CTAs).
    EXPECT_EQ(ops::plan_gemm(with([](auto& q) { q.n = 200; }), 132, v4).grid, 100);
    ops::GemmOptions split = v4;
    split.small_m_splits = 2;
    expect_error_mentions([&] { ops::plan_gemm(p, 132, split); }, "has no split-K");
    // The views decide contiguity: ldb = K and a 16-byte aligned base.
    const TensorView a = mat(0x10000, DType::kBF16, 1, 8192, 8192);
    const TensorView d = mat(0x200000, DType::kBF16, 1, 8192, 8192);
    EXPECT_TRUE(ops::validate_gemm_args(a, mat(0x100000, DType::kBF16, 8192, 8192, 8192), d, BLayout::kNK).b_rows_contiguous);
    EXPECT_FALSE(ops::validate_gemm_args(a, mat(0x100000, DType::kBF16, 8192, 8192, 8200), d, BLayout::kNK).b_rows_contiguous);
    const auto launch = ops::detail::make_gemv_launch(plan, a, mat(0x100000, DType::kBF16, 8192, 8192, 8192), d);
    EXPECT_EQ(launch.args.rows_per_cta, 63);
    EXPECT_EQ(launch.smem_bytes, gemv_rows_smem_bytes(kGemvRowsStages));
    EXPECT_EQ(gemv_smem_bytes(GemvConfig{.variant = k4}), gemv_rows_smem_bytes(kGemvRowsStages));
    EXPECT_LE(gemv_smem_bytes(GemvConfig{.variant = k4}), 227 * 1024);
    EXPECT_EQ(launch.block.x, static_cast<unsigned>(kGemvBulkThreads));
    // The row-group body (M = 16 here) runs two producer warps (B, A) beside 8 consumer warps; the kernel traps on any
    // other block, so the launch must follow the body: 320 threads, the same shared memory (its ring, sums and A slot).
    const TensorView a16 = mat(0x10000, DType::kBF16, 16, 8192, 8192);
    const TensorView d16 = mat(0x200000, DType::kBF16, 16, 8192, 8192);
    const auto plan16 = ops::plan_gemm(with([](auto& q) { q.m = 16; }), 132, v4);
    const auto launch16 = ops::detail::make_gemv_launch(plan16, a16, mat(0x100000, DType::kBF16, 8192, 8192, 8192), d16);
    EXPECT_EQ(launch16.block.x, static_cast<unsigned>(kGemvGroupsThreads));
    EXPECT_EQ(launch16.smem_bytes, gemv_rows_smem_bytes(kGemvRowsStages));
    EXPECT_EQ(kGemvGroupsThreads, 10 * 32);
    EXPECT_EQ(gemv_rows_threads(16, 8192), kGemvGroupsThreads);
    EXPECT_EQ(gemv_rows_threads(1, 8192), kGemvBulkThreads);
    EXPECT_EQ(gemv_rows_threads(1, 6144), kGemvGroupsThreads);  // K = 2048 x 3: the whole-row body cannot take it
    // Ring, the block sums [8 warps][8 groups][32][4] fp32, A's slot (16 rows x 4 KiB), after barriers and alignment.
    EXPECT_EQ(gemv_rows_smem_bytes(kGemvRowsStages),
              128 + 1024 + kGemvRowsStages * kGemvRowsStageBytes + 8 * 8 * 32 * 4 * 4 + 16 * 4096);
    expect_error_mentions([&] { ops::detail::make_gemv_launch(plan, mat(0x10002, DType::kBF16, 1, 8192, 8192),
                                                              mat(0x100000, DType::kBF16, 8192, 8192, 8192), d); },
                          "a's base and row stride 16-byte aligned");
}

// Variant 4's rows over CTAs (plan grid, launch rows_per_cta): for every N and SM budget, the CTAs cover all N rows,
// none is empty (the kernel's last CTA takes the rest), and there are never more CTAs than the budget's SMs.
TEST(GemmPlan, SmallMVariant4SpreadsEveryRowOverNonEmptyCtas) {
    ops::GemmOptions v4;
    v4.small_m_variant = GemvVariant::kBulkRows;
    const TensorView a = mat(0x10000, DType::kBF16, 1, 2048, 2048);
    for (int budget : {1, 2, 3, 7, 64, 131, 132}) {
        v4.sm_budget = budget;
        for (int64_t n = 1; n <= 1200; n += (n < 300 ? 1 : 37)) {
            ops::GemmProblem p{1, n, 2048, BLayout::kNK, DType::kBF16, DType::kBF16};
            p.b_rows_contiguous = true;
            const auto plan = ops::plan_gemm(p, 132, v4);
            const auto launch = ops::detail::make_gemv_launch(plan, a, mat(0x100000, DType::kBF16, n, 2048, 2048),
                                                              mat(0x4000000, DType::kBF16, 1, n, n));
            const int64_t rows = launch.args.rows_per_cta;
            const int64_t grid = launch.grid.x;
            ASSERT_LE(grid, std::min<int64_t>(budget, n)) << "N " << n << " budget " << budget;
            ASSERT_GE(grid * rows, n) << "N " << n << " budget " << budget << ": rows left over";
            ASSERT_LT((grid - 1) * rows, n) << "N " << n << " budget " << budget << ": an empty CTA";
        }
    }
}

// A small-M split count the caller asked for keeps the op's own pick to the variants that split K: variant 4 (no
// split-K) where it would otherwise be picked, variant 5 beyond its 8 splits. Autotuning then times only those.
TEST(GemmPlan, AskedSmallMSplitsKeepThePickToVariantsThatSplit) {
    ops::GemmProblem p{1, 4096, 4096, BLayout::kNK, DType::kBF16, DType::kBF16};
    p.b_rows_contiguous = true;
    ASSERT_EQ(ops::plan_gemm(p, 132).small_m_variant, GemvVariant::kBulkRows) << "variant 4 serves this call unasked";
    for (int splits : {2, 4}) {
        ops::GemmOptions o;
        o.small_m_splits = splits;
        const ops::GemmPlan plan = ops::plan_gemm(p, 132, o);
        EXPECT_EQ(plan.path, ops::GemmPath::kSmallM);
        EXPECT_EQ(plan.small_m_variant, GemvVariant::kTmaRing) << splits;
        EXPECT_EQ(plan.small_m_splits, splits);
        for (const auto& cand : ops::gemm_tune_candidates(p, 132, o)) {
            EXPECT_FALSE(cand.plan.path == ops::GemmPath::kSmallM &&
                         cand.plan.small_m_variant == GemvVariant::kBulkRows)
                << cand.name;
        }
    }
    // M = 24 on 132 SMs: variant 5 is the op's pick; 16 splits are more than one cluster holds.
    ops::GemmProblem q{24, 4096, 4096, BLayout::kNK, DType::kBF16, DType::kBF16};
    q.b_rows_contiguous = true;
    ops::GemmOptions many;
    many.small_m_splits = 16;
    many.small_m_max_m = 64;
    const ops::GemmPlan plan = ops::plan_gemm(q, 132, many);
    EXPECT_FALSE(plan.path == ops::GemmPath::kSmallM && plan.small_m_variant == GemvVariant::kTmaWgmma);
    for (const auto& cand : ops::gemm_tune_candidates(q, 132, many)) {
        EXPECT_FALSE(cand.plan.path == ops::GemmPath::kSmallM && cand.plan.small_m_variant == GemvVariant::kTmaWgmma)
            << cand.name;
    }
}

// An empty problem (M = 0 or N = 0: gemm() returns before launching) plans nothing, whatever path its shape suggests.
TEST(GemmPlan, EmptyProblemsPlanNothing) {
    for (const auto& [m, n] : {std::pair<int64_t, int64_t>{1, 0}, {0, 4096}, {0, 0}, {24, 0}}) {
        ops::GemmProblem p{m, n, 4096, BLayout::kNK, DType::kBF16, DType::kBF16};
        p.b_rows_contiguous = true;
        const ops::GemmPlan plan = ops::plan_gemm(p, 132);
        EXPECT_EQ(plan.grid, 0) << m << " x " << n;
        EXPECT_EQ(plan.workspace_bytes, 0u);
    }
}

// GemmOptions::programmatic_launch reaches only the kernels that wait for the previous one inside (the small-M
// kernels, both with a shared-memory ring: variant 4 for M <= 16, 3 up to small_m_max_m, forced or picked), and only
// when asked for: the tiled kernel launches as usual.
TEST(GemmPlan, OnlyTheRingKernelsLaunchProgrammatically) {
    ops::GemmOptions on;
    on.programmatic_launch = true;
    on.small_m_max_m = kGemvMaxM;
    on.small_m_wgmma_max_m = 0;  // variant 5 (which launches programmatically too): SmallMVariant5PlansWhenForced
    for (int64_t m : {1, 2, 3, 16, 17, 64, 65, 128}) {
        ops::GemmProblem p{m, 8192, 8192, BLayout::kNK, DType::kBF16, DType::kBF16};
        p.b_rows_contiguous = true;
        const auto plan = ops::plan_gemm(p, 132, on);
        const bool small_m = plan.path == ops::GemmPath::kSmallM;
        EXPECT_EQ(small_m, m <= kGemvMaxM) << "M " << m;
        if (small_m) {
            EXPECT_EQ(plan.small_m_variant, m <= kGemvGroupsMaxM ? GemvVariant::kBulkRows : GemvVariant::kTmaRing)
                << "M " << m;
        }
        EXPECT_EQ(ops::gemm_launches_programmatically(plan, on), small_m) << "M " << m;
        EXPECT_FALSE(ops::gemm_launches_programmatically(plan, ops::GemmOptions{})) << "M " << m << ", option off";
    }
    for (GemvVariant variant : {GemvVariant::kTmaRing, GemvVariant::kBulkRows}) {
        ops::GemmOptions forced = on;
        forced.small_m_variant = variant;
        ops::GemmProblem p{16, 8192, 8192, BLayout::kNK, DType::kBF16, DType::kBF16};
        p.b_rows_contiguous = true;
        const auto plan = ops::plan_gemm(p, 132, forced);
        ASSERT_EQ(plan.small_m_variant, variant);
        EXPECT_TRUE(ops::gemm_launches_programmatically(plan, forced)) << "variant " << static_cast<int>(variant);
        EXPECT_FALSE(ops::gemm_launches_programmatically(plan, ops::GemmOptions{}));
    }
}

// Variant 3's split count (gemv_auto_splits): none while its column blocks occupy more than a third of the SMs, else
// one wave of gemv_shape(config).ctas_per_sm CTAs per SM with at least 256 k per split; its workspace is the counters
// (one per 64-column block, rounded to 256 bytes) then fp32 partials [splits][M][N].
TEST(GemmPlan, SmallMVariant3FillsOneWave) {
    ops::GemmOptions up_to_64;
    up_to_64.small_m_max_m = kGemvMaxM;  // M 17..64 too
    up_to_64.small_m_wgmma_max_m = 0;    // variant 3 there, not 5
    struct Expect {
        int64_t m, n, k;
        int m_tiles, grid, splits;
    };
    // 132 SMs: N = 4096: 64 column blocks (more than a third of the SMs) -> 1 split; N = 2048: 32 -> 4; N = 1000:
    // 16 -> 8; N = 8192: 128 -> 1; K = 512 allows at most 2 splits of 256.
    for (const Expect& e : {Expect{1, 4096, 8192, 1, 64, 1}, Expect{16, 2048, 8192, 1, 32, 4},
                            Expect{17, 1000, 4096, 2, 16, 8}, Expect{64, 8192, 8192, 4, 128, 1},
                            Expect{40, 1000, 512, 3, 16, 2}}) {
        SCOPED_TRACE("M x N x K = " + std::to_string(e.m) + " x " + std::to_string(e.n) + " x " + std::to_string(e.k));
        const ops::GemmProblem p{e.m, e.n, e.k, BLayout::kNK, DType::kBF16, DType::kBF16};
        const GemvShape shape = gemv_shape(GemvConfig{.variant = GemvVariant::kTmaRing, .m_tiles = e.m_tiles});
        EXPECT_EQ(gemv_cols_per_cta(shape.n_tiles), 64);
        EXPECT_EQ(shape.ctas_per_sm, 1);
        const auto plan = ops::plan_gemm(p, 132, up_to_64);
        EXPECT_EQ(plan.path, ops::GemmPath::kSmallM);
        EXPECT_EQ(plan.small_m_variant, GemvVariant::kTmaRing);
        EXPECT_EQ(plan.small_m_tiles, e.m_tiles);
        EXPECT_EQ(plan.grid, e.grid);
        EXPECT_EQ(plan.small_m_splits, e.splits);
        EXPECT_LE(plan.grid * plan.small_m_splits, 132) << "more than one wave";
        EXPECT_EQ(plan.small_m_k_per_split % 32, 0);
        EXPECT_GE(static_cast<int64_t>(plan.small_m_splits) * plan.small_m_k_per_split, p.k);
        EXPECT_LT(static_cast<int64_t>(plan.small_m_splits - 1) * plan.small_m_k_per_split, p.k) << "an empty split";
        const size_t counters = (static_cast<size_t>(plan.grid) * 4 + 255) / 256 * 256;
        const size_t partials = static_cast<size_t>(plan.small_m_splits) * e.m * e.n * 4;
        EXPECT_EQ(plan.workspace_bytes, plan.small_m_splits > 1 ? counters + (partials + 255) / 256 * 256 : 0u);
        EXPECT_EQ(plan.workspace_bytes, ops::gemm_workspace_bytes(p, plan.small_m_splits));
    }
    // Small N and K: at least 256 k per split, at least one column block; N not a multiple of the block.
    const ops::GemmProblem tiny{3, 100, 264, BLayout::kNK, DType::kF16, DType::kF32};
    const auto plan = ops::plan_gemm(tiny, 132);
    EXPECT_EQ(plan.grid, 2);  // ceil(100 / 64)
    EXPECT_EQ(plan.small_m_splits, 1);
    EXPECT_EQ(plan.workspace_bytes, 0u);
    EXPECT_EQ(ops::gemm_workspace_bytes(tiny, 2, GemvVariant::kBulkRows), ops::gemm_workspace_bytes(tiny, 2));
    expect_error_mentions([&] { (void)ops::gemm_workspace_bytes(tiny, 2, static_cast<GemvVariant>(1)); },
                          "variant must be GemvVariant::kTmaRing (3), GemvVariant::kBulkRows (4) or "
                          "GemvVariant::kTmaWgmma (5), got 1");
}

// small_m_max_m bounds the M the small-M path takes (default 32: the small-M kernels beat the tiled kernel up to
// there, the ping-pong 64x128 tile from M = 48); out-of-range values are an error.
TEST(GemmPlan, SmallMMaxMBoundsTheSmallMPath) {
    EXPECT_EQ(ops::GemmOptions{}.small_m_max_m, 32);
    ops::GemmOptions no_v5;
    no_v5.small_m_wgmma_max_m = 0;  // variant 5's own band: SmallMVariant5BandBeatsVariant3AndTheTiledKernel
    ops::GemmProblem p{32, 8192, 8192, BLayout::kNK, DType::kBF16, DType::kBF16};
    EXPECT_EQ(ops::plan_gemm(p, 132, no_v5).path, ops::GemmPath::kSmallM);
    EXPECT_TRUE(ops::gemm_allows_small_m(p, {}));
    p.m = 33;
    EXPECT_EQ(ops::plan_gemm(p, 132, no_v5).path, ops::GemmPath::kTiled);
    EXPECT_FALSE(ops::gemm_allows_small_m(p, {}));

    ops::GemmOptions o = no_v5;
    o.small_m_max_m = 32;
    for (int64_t m : {1, 17, 32}) {
        p.m = m;
        const auto plan = ops::plan_gemm(p, 132, o);
        EXPECT_EQ(plan.path, ops::GemmPath::kSmallM) << "M = " << m;
        EXPECT_EQ(plan.small_m_tiles, (m + 15) / 16) << "M = " << m;
    }
    p.m = 33;
    EXPECT_EQ(ops::plan_gemm(p, 132, o).path, ops::GemmPath::kTiled);
    o.small_m_max_m = 0;  // never the small-M path
    p.m = 1;
    EXPECT_EQ(ops::plan_gemm(p, 132, o).path, ops::GemmPath::kTiled);
    o.small_m_max_m = kGemvMaxM;
    p.m = 64;
    EXPECT_EQ(ops::plan_gemm(p, 132, o).path, ops::GemmPath::kSmallM);
    p.m = 16;
    p.b_layout = BLayout::kKN;  // still only B [N,K]
    EXPECT_EQ(ops::plan_gemm(p, 132, o).path, ops::GemmPath::kTiled);
    p.b_layout = BLayout::kNK;

    for (int bad : {-1, 65, 1000}) {
        o.small_m_max_m = bad;
        const std::string msg = "options.small_m_max_m must be in [0, 64] (kGemvMaxM), got " + std::to_string(bad);
        expect_error_mentions([&] { ops::plan_gemm(p, 132, o); }, msg);
        expect_error_mentions([&] { (void)ops::gemm_tune_candidates(p, 132, o); }, msg);
        p.m = 1000;  // rejected whatever the path
        expect_error_mentions([&] { ops::plan_gemm(p, 132, o); }, msg);
        p.m = 16;
    }
}

// gemv_auto_splits: no split-K while the column blocks occupy more than a third of the SMs (N = K = 4096: one split
// ran 13-18% faster than two at M = 24..64); else one wave, at least 256 k per split, at most 32.
TEST(GemmPlan, SmallMSplitsOnlyWhereFewColumnBlocks) {
    EXPECT_EQ(ops::gemv_auto_splits(64, 1, 132, 4096), 1);   // N = 4096
    EXPECT_EQ(ops::gemv_auto_splits(128, 1, 132, 8192), 1);  // N = 8192
    EXPECT_EQ(ops::gemv_auto_splits(44, 1, 132, 8192), 3);   // a third exactly: split
    EXPECT_EQ(ops::gemv_auto_splits(45, 1, 132, 8192), 1);
    EXPECT_EQ(ops::gemv_auto_splits(32, 1, 132, 8192), 4);
    EXPECT_EQ(ops::gemv_auto_splits(1, 1, 132, 1 << 20), 32);
    EXPECT_EQ(ops::gemv_auto_splits(2, 1, 132, 512), 2);  // 256 k per split at least
    EXPECT_EQ(ops::gemv_auto_splits(2, 1, 132, 8), 1);
    EXPECT_EQ(ops::gemv_auto_splits(16, 2, 132, 8192), 16);  // two CTAs per SM
    expect_error_mentions([] { (void)ops::gemv_auto_splits(0, 1, 132, 8); }, "must be positive");
}

// Variant 5 (GemvVariant::kTmaWgmma, swapped wgmma): a valid config for m_tiles 1..16 (M <= 256) only, each with a
// wgmma N of 16 m_tiles; its ring holds at least 2 whole stages of 64 B rows + 16 m_tiles A rows x 64 k (1024-byte
// multiples: every TMA box starts on a swizzle atom), at most 16, within kGemvWgmmaRingBytes; the epilogue's staging
// tile fits in it; one CTA per SM fits an H200's shared memory for every m_tiles.
TEST(GemmPlan, SmallMVariant5ConfigsAndRingFitTheSm) {
    constexpr int kSmPerSm = 228 * 1024, kMaxPerBlock = 227 * 1024, kReservedPerBlock = 1024;
    EXPECT_EQ(static_cast<int>(GemvVariant::kTmaWgmma), 5);
    for (int m_tiles = 1; m_tiles <= 16; ++m_tiles) {
        SCOPED_TRACE("m_tiles " + std::to_string(m_tiles));
        const GemvConfig config{.variant = GemvVariant::kTmaWgmma, .m_tiles = m_tiles};
        ASSERT_TRUE(is_valid(config));
        for (DType in : {DType::kBF16, DType::kF16}) {
            for (DType out : {DType::kBF16, DType::kF16, DType::kF32}) {
                EXPECT_TRUE(is_valid(GemvConfig{
                    .variant = GemvVariant::kTmaWgmma, .m_tiles = m_tiles, .in_dtype = in, .out_dtype = out}));
            }
        }
        const GemvShape shape = gemv_shape(config);
        const int smem = gemv_smem_bytes(config);
        const int stage = gemv_wgmma_stage_bytes(m_tiles);
        EXPECT_EQ(stage, (64 + 16 * m_tiles) * 64 * 2);
        EXPECT_EQ(stage % 1024, 0);
        EXPECT_EQ(gemv_cols_per_cta(shape.n_tiles), kGemvWgmmaCols);
        EXPECT_EQ(shape.ctas_per_sm, 1);
        EXPECT_GE(shape.stages, 2);
        EXPECT_LE(shape.stages, kGemvWgmmaMaxStages);
        EXPECT_LE(shape.stages * stage, kGemvWgmmaRingBytes);
        EXPECT_TRUE(shape.stages == kGemvWgmmaMaxStages || (shape.stages + 1) * stage > kGemvWgmmaRingBytes)
            << "as many stages as fit";
        EXPECT_GE(smem, kGemvWgmmaBarrierBytes + 1024 + shape.stages * stage) << "barriers, alignment, the ring";
        EXPECT_GE(smem, kGemvWgmmaBarrierBytes + 1024 + 16 * m_tiles * kGemvWgmmaStagePitch * 4) << "the staging tile";
        EXPECT_GE(kGemvWgmmaBarrierBytes, 2 * 8 * shape.stages);
        EXPECT_LE(smem, kMaxPerBlock);
        EXPECT_LE(shape.ctas_per_sm * (smem + kReservedPerBlock), kSmPerSm);
    }
    EXPECT_EQ(gemv_shape(GemvConfig{.variant = GemvVariant::kTmaWgmma, .m_tiles = 1}).stages, 16);
    EXPECT_EQ(gemv_shape(GemvConfig{.variant = GemvVariant::kTmaWgmma, .m_tiles = 5}).stages, 11);
    EXPECT_EQ(gemv_shape(GemvConfig{.variant = GemvVariant::kTmaWgmma, .m_tiles = 16}).stages, 5);
    EXPECT_FALSE(is_valid(GemvConfig{.variant = GemvVariant::kTmaWgmma, .m_tiles = 0}));
    EXPECT_FALSE(is_valid(GemvConfig{.variant = GemvVariant::kTmaWgmma, .m_tiles = 17}));
    EXPECT_FALSE(is_valid(GemvConfig{.variant = GemvVariant::kTmaWgmma, .in_dtype = DType::kF32}));
    EXPECT_FALSE(is_valid(GemvConfig{.variant = GemvVariant::kTmaWgmma, .out_dtype = DType::kI32}));
    EXPECT_FALSE(is_valid(GemvConfig{.variant = GemvVariant::kTmaRing, .m_tiles = 5})) << "variant 3 stays M <= 64";
    EXPECT_EQ(kGemvWgmmaThreads, 5 * 32);
    EXPECT_EQ(kGemvWgmmaStageK * 2, 128) << "a box row is one 128-byte swizzle row";
}

// Variant 5's split rule (gemv_wgmma_splits): ceil(N / 64) column blocks x splits fill at most one wave of the SMs,
// every cluster of splits runs at once, at least 8 k-blocks of 64 per split, at most 8 splits (one cluster of CTAs),
// at least 1.
TEST(GemmPlan, SmallMVariant5SplitsFillOneWave) {
    EXPECT_EQ(ops::gemv_wgmma_splits(4096, 4096, 132), 2);    // 64 blocks
    EXPECT_EQ(ops::gemv_wgmma_splits(4104, 4096, 132), 2);    // 65 blocks
    EXPECT_EQ(ops::gemv_wgmma_splits(8192, 8192, 132), 1);    // 128 blocks
    EXPECT_EQ(ops::gemv_wgmma_splits(2048, 8192, 132), 3);    // 32 blocks: 32 clusters of 4 do not fit (30)
    EXPECT_EQ(ops::gemv_wgmma_splits(2048, 7168, 132), 3);
    EXPECT_EQ(ops::gemv_wgmma_splits(1024, 8192, 132), 6);  // 16 blocks: 16 clusters of 8 or 7 do not (15)
    EXPECT_EQ(ops::gemv_wgmma_splits(1024, 4096, 132), 6);
    EXPECT_EQ(ops::gemv_wgmma_splits(128, 8192, 132), 8);     // 2 blocks
    EXPECT_EQ(ops::gemv_wgmma_splits(64, 4096, 132), 8);      // 1 block: 64 k-blocks / 8
    EXPECT_EQ(ops::gemv_wgmma_splits(64, 1 << 20, 132), 8);   // at most 8: one cluster
    EXPECT_EQ(ops::gemv_wgmma_splits(4096, 1024, 132), 2);    // 16 k-blocks of 64: 2 x 8
    EXPECT_EQ(ops::gemv_wgmma_splits(4096, 200, 132), 1);     // 4 k-blocks: no split
    EXPECT_EQ(ops::gemv_wgmma_splits(100000, 4096, 132), 1);  // more blocks than SMs
    EXPECT_EQ(ops::gemv_wgmma_splits(4096, 4096, 64), 1);     // the SM budget: 64 blocks fill it
    EXPECT_EQ(ops::gemv_wgmma_splits(4096, 4096, 128), 2);
    expect_error_mentions([] { (void)ops::gemv_wgmma_splits(0, 8, 132); }, "must be positive");
    for (int64_t n : {1, 63, 64, 65, 1000, 4096, 4104, 8192, 28672}) {
        for (int64_t k : {8, 64, 200, 512, 1024, 4096, 8192, 16384}) {
            const int s = ops::gemv_wgmma_splits(n, k, 132);
            const int64_t blocks = (n + 63) / 64;
            ASSERT_GE(s, 1);
            ASSERT_LE(s, kGemvWgmmaMaxSplits);
            if (s > 1) {
                EXPECT_LE(blocks * s, 132) << n << " " << k;
                EXPECT_GE((k + 63) / 64, int64_t{8} * s) << n << " " << k;
                EXPECT_LE(blocks, ops::gemv_wgmma_max_clusters(s, 132)) << n << " " << k;
            }
        }
    }
}

// The clusters that run at once at one CTA per SM: the H200's measured figures at 132 SMs; elsewhere a bound below
// num_sms / size that clusters of one or two CTAs always reach.
TEST(GemmPlan, SmallMVariant5ClusterCapacity) {
    const int measured[] = {132, 66, 39, 30, 22, 17, 15, 15};
    for (int size = 1; size <= kGemvWgmmaMaxSplits; ++size) {
        EXPECT_EQ(ops::gemv_wgmma_max_clusters(size, 132), measured[size - 1]) << size;
        for (int sms : {1, 16, 78, 114, 144}) {
            const int c = ops::gemv_wgmma_max_clusters(size, sms);
            EXPECT_GE(c, 0);
            EXPECT_LE(c * size, sms) << size << " " << sms;
            if (size <= 2) {
                EXPECT_EQ(c, sms / size) << sms;
            }
        }
    }
    expect_error_mentions([] { (void)ops::gemv_wgmma_max_clusters(9, 132); }, "cluster_size must be in [1, 8]");
}

// The heuristic's variant-5 band (gemm_prefers_wgmma_small_m) on the shapes it was fitted to (one H200, 132 SMs,
// bf16, 2026-12-04: kernels/gemm/README.md, "Which M takes the small-M path"): variant 5 where it ran faster than
// variant 3 / the tiled kernel's pick, the others where they did; never with an SM budget, a forced config, variant
// or split_k, B [K,N], M <= 16 or M > small_m_wgmma_max_m.
TEST(GemmPlan, SmallMVariant5BandBeatsVariant3AndTheTiledKernel) {
    EXPECT_EQ(ops::GemmOptions{}.small_m_wgmma_max_m, 192);
    const auto picks_v5 = [](int64_t m, int64_t n, int64_t k, const ops::GemmOptions& o = {}) {
        const auto plan = ops::plan_gemm(ops::GemmProblem{m, n, k, BLayout::kNK, DType::kBF16, DType::kBF16}, 132, o);
        return plan.path == ops::GemmPath::kSmallM && plan.small_m_variant == GemvVariant::kTmaWgmma;
    };
    struct Row {
        int64_t n, k;
        std::vector<int64_t> v5, other;
    };
    const Row rows[] = {
        {4096, 4096, {17, 24, 32, 48, 64, 77, 96, 128, 160, 192}, {1, 16, 193, 256}},
        {8192, 8192, {17, 24, 32, 48, 64, 77, 96}, {16, 128, 160, 176, 192, 256}},
        {4096, 14336, {17, 32, 48, 77, 128, 192}, {256}},
        {7168, 2048, {17, 32, 48, 64, 77, 136}, {128, 144, 160, 176, 192, 256}},
        {2048, 7168, {17, 24, 32, 48, 64, 77, 96, 128, 160, 192}, {16, 256}},
        {1024, 4096, {17, 24, 32, 48, 64, 77, 96, 128, 160, 192}, {16, 256}},
        {1024, 8192, {17, 48, 128, 192}, {16, 256}},
        {2048, 2048, {17, 64, 192}, {16, 256}},
        {28672, 4096, {}, {17, 24, 32, 48, 64, 77, 96, 128, 160, 192, 256}},
    };
    for (const Row& r : rows) {
        for (int64_t m : r.v5) EXPECT_TRUE(picks_v5(m, r.n, r.k)) << m << "x" << r.n << "x" << r.k;
        for (int64_t m : r.other) EXPECT_FALSE(picks_v5(m, r.n, r.k)) << m << "x" << r.n << "x" << r.k;
    }
    // A grid of fewer than half the SMs (N = 1000, K = 512: 16 column blocks, one split) or of more than one wave
    // (N = 28672: 448 column blocks) stays with the others.
    EXPECT_FALSE(picks_v5(40, 1000, 512));
    EXPECT_FALSE(picks_v5(77, 9000, 4096));
    ops::GemmOptions o;
    o.sm_budget = 100;
    EXPECT_FALSE(picks_v5(77, 4096, 4096, o));
    o = {};
    o.split_k = 1;
    EXPECT_FALSE(picks_v5(77, 4096, 4096, o));
    o = {};
    o.small_m_variant = GemvVariant::kTmaRing;
    o.small_m_max_m = kGemvMaxM;
    EXPECT_FALSE(picks_v5(24, 4096, 4096, o));
    o = {};
    o.small_m_wgmma_max_m = 64;
    EXPECT_TRUE(picks_v5(64, 4096, 4096, o));
    EXPECT_FALSE(picks_v5(77, 4096, 4096, o));
    o.small_m_wgmma_max_m = kGemvWgmmaMaxM + 1;
    expect_error_mentions([&] { picks_v5(77, 4096, 4096, o); }, "options.small_m_wgmma_max_m must be in [0, 256]");
    EXPECT_FALSE(ops::plan_gemm(ops::GemmProblem{77, 4096, 4096, BLayout::kKN, DType::kBF16, DType::kBF16}, 132).path ==
                 ops::GemmPath::kSmallM);
    // The band's plan is variant 5's own: its split rule, no workspace; f16 / f32 out alike.
    const auto plan = ops::plan_gemm(ops::GemmProblem{77, 4096, 4096, BLayout::kNK, DType::kF16, DType::kF32}, 132);
    EXPECT_EQ(plan.small_m_variant, GemvVariant::kTmaWgmma);
    EXPECT_EQ(plan.small_m_splits, 2);
    EXPECT_EQ(plan.small_m_tiles, 5);
    EXPECT_EQ(plan.workspace_bytes, 0u);
}

// Variant 5 through plan_gemm when forced (GemmOptions::small_m_variant; the heuristic picks it by its own rule,
// gemm_prefers_wgmma_small_m), past small_m_max_m up to M = 256 with B [N,K]; 64 columns per CTA, ceil(M / 16) row
// tiles, its split rule on the SM budget or the forced count, each split a whole number of 64-k stages and none empty;
// no workspace (the splits add through distributed shared memory), a cluster of 1 x splits CTAs where it splits. A
// forced small-M variant 3 or 4 runs where it serves, past the heuristic's small_m_max_m, and is refused where it
// cannot serve; never the tiled kernel in its place (as variant 5).
TEST(GemmPlan, AForcedSmallMVariantRunsOrIsRefused) {
    ops::GemmOptions v3;
    v3.small_m_variant = GemvVariant::kTmaRing;
    for (int64_t m : {1, 33, 48, 64}) {  // small_m_max_m is 32 by default
        const ops::GemmProblem p{m, 4096, 4096, BLayout::kNK, DType::kBF16, DType::kBF16};
        const auto plan = ops::plan_gemm(p, 132, v3);
        EXPECT_EQ(plan.path, ops::GemmPath::kSmallM) << m;
        EXPECT_EQ(plan.small_m_variant, GemvVariant::kTmaRing) << m;
    }
    expect_error_mentions(
        [&] {
            (void)ops::plan_gemm(ops::GemmProblem{65, 4096, 4096, BLayout::kNK, DType::kBF16, DType::kBF16}, 132, v3);
        },
        "small-M variant 3 (TMA ring) serves M <= 64");
    expect_error_mentions(
        [&] {
            (void)ops::plan_gemm(ops::GemmProblem{16, 4096, 4096, BLayout::kKN, DType::kBF16, DType::kBF16}, 132, v3);
        },
        "small-M variant 3 (TMA ring) needs B [N,K]");
    ops::GemmOptions v4;
    v4.small_m_variant = GemvVariant::kBulkRows;
    ops::GemmProblem rows{16, 4096, 4096, BLayout::kNK, DType::kBF16, DType::kBF16};
    rows.b_rows_contiguous = true;
    EXPECT_EQ(ops::plan_gemm(rows, 132, v4).small_m_variant, GemvVariant::kBulkRows);
    rows.m = 20;
    expect_error_mentions([&] { (void)ops::plan_gemm(rows, 132, v4); }, "small-M variant 4 (bulk-copied rows) cannot");
    // options.config and allow_small_m = false take precedence: the tiled kernel, as asked.
    ops::GemmOptions off = v3;
    off.allow_small_m = false;
    EXPECT_EQ(ops::plan_gemm(ops::GemmProblem{65, 4096, 4096, BLayout::kNK, DType::kBF16, DType::kBF16}, 132, off).path,
              ops::GemmPath::kTiled);
}

TEST(GemmPlan, SmallMVariant5PlansWhenForced) {
    ops::GemmOptions v5;
    v5.small_m_variant = GemvVariant::kTmaWgmma;
    for (int64_t m : {1, 16, 32, 33, 77, 128, 200, 256}) {
        for (const auto& [n, k] : {std::pair<int64_t, int64_t>{4096, 4096}, {8192, 8192}, {4104, 200}, {64, 4096}}) {
            SCOPED_TRACE(std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k));
            const ops::GemmProblem p{m, n, k, BLayout::kNK, DType::kBF16, DType::kBF16};
            const auto dflt = ops::plan_gemm(p, 132);
            const bool band = dflt.path == ops::GemmPath::kSmallM && dflt.small_m_variant == GemvVariant::kTmaWgmma;
            ops::GemmOptions no_v5;
            no_v5.small_m_wgmma_max_m = 0;
            const auto other = ops::plan_gemm(p, 132, no_v5);
            EXPECT_EQ(band, ops::gemm_prefers_wgmma_small_m(
                                p, {}, other.path == ops::GemmPath::kTiled ? &other : nullptr, 132))
                << "the default takes variant 5 by its rule only";
            const auto plan = ops::plan_gemm(p, 132, v5);
            ASSERT_EQ(plan.path, ops::GemmPath::kSmallM);
            EXPECT_EQ(plan.small_m_variant, GemvVariant::kTmaWgmma);
            EXPECT_EQ(plan.small_m_tiles, (m + 15) / 16);
            EXPECT_TRUE(is_valid(ops::gemv_config(plan, p)));
            EXPECT_EQ(plan.grid, (n + 63) / 64);
            EXPECT_EQ(plan.small_m_splits, ops::gemv_wgmma_splits(n, k, 132));
            EXPECT_EQ(plan.small_m_k_per_split % 64, 0);
            EXPECT_GE(int64_t{plan.small_m_splits} * plan.small_m_k_per_split, k);
            EXPECT_LT(int64_t{plan.small_m_splits - 1} * plan.small_m_k_per_split, k) << "an empty split";
            EXPECT_EQ(plan.workspace_bytes, 0u);
            EXPECT_EQ(ops::gemm_workspace_bytes(p, plan.small_m_splits, GemvVariant::kTmaWgmma), 0u);
            EXPECT_TRUE(ops::gemm_allows_small_m(p, v5));
        }
    }
    // Forced split counts: whole 64-k stages per split (K = 200, 4 splits: 64, 64, 64, 8), fewer where K is short
    // (3 asked: 67 k each, rounded to 128, so 2 splits).
    ops::GemmOptions forced = v5;
    const ops::GemmProblem p200{77, 4104, 200, BLayout::kNK, DType::kF16, DType::kF32};
    for (const auto& [asked, splits, per] :
         {std::array<int, 3>{1, 1, 256}, {2, 2, 128}, {3, 2, 128}, {4, 4, 64}, {8, 4, 64}}) {
        forced.small_m_splits = asked;
        const auto plan = ops::plan_gemm(p200, 132, forced);
        EXPECT_EQ(plan.small_m_splits, splits) << asked;
        EXPECT_EQ(plan.small_m_k_per_split, per) << asked;
    }
    // More splits than one cluster holds: an error naming the limit and the ask, before anything runs.
    forced.small_m_splits = 16;
    expect_error_mentions(
        [&] {
            (void)ops::plan_gemm(ops::GemmProblem{77, 4096, 4096, BLayout::kNK, DType::kBF16, DType::kBF16}, 132,
                                 forced);
        },
        "at most 8 CTAs per column block, got 16 splits (options.small_m_splits 16");
    forced.small_m_splits = 9;  // K = 9 x 64: nine one-stage splits (at K = 4096 nine asked make 8 of 512 k)
    expect_error_mentions(
        [&] {
            (void)ops::plan_gemm(ops::GemmProblem{77, 4096, 576, BLayout::kNK, DType::kBF16, DType::kBF16}, 132,
                                 forced);
        },
        "got 9 splits");
    EXPECT_EQ(ops::plan_gemm(ops::GemmProblem{77, 4096, 4096, BLayout::kNK, DType::kBF16, DType::kBF16}, 132, forced)
                  .small_m_splits,
              8);
    // The SM budget bounds the split rule's wave.
    ops::GemmOptions half = v5;
    half.sm_budget = 64;
    EXPECT_EQ(ops::plan_gemm(ops::GemmProblem{77, 4096, 4096, BLayout::kNK, DType::kBF16, DType::kBF16}, 132, half)
                  .small_m_splits,
              1);
    // Not forced, with the band off: M 65..256 stays on the tiled path; forced with allow_small_m off or a config:
    // the tiled path too.
    const ops::GemmProblem p77{77, 4096, 4096, BLayout::kNK, DType::kBF16, DType::kBF16};
    ops::GemmOptions no_band;
    no_band.small_m_wgmma_max_m = 0;
    EXPECT_EQ(ops::plan_gemm(p77, 132, no_band).path, ops::GemmPath::kTiled);
    EXPECT_FALSE(ops::gemm_allows_small_m(p77, {}));
    EXPECT_TRUE(ops::gemm_allows_small_m_v5(p77, {}));
    ops::GemmOptions off = v5;
    off.allow_small_m = false;
    EXPECT_EQ(ops::plan_gemm(p77, 132, off).path, ops::GemmPath::kTiled);
    EXPECT_FALSE(ops::gemm_allows_small_m_v5(p77, off));
    ops::GemmOptions with_config = v5;
    with_config.config = gemm_candidate(12, DType::kBF16, DType::kBF16, BLayout::kNK);
    EXPECT_EQ(ops::plan_gemm(p77, 132, with_config).path, ops::GemmPath::kTiled);
    // small_m_max_m does not bound a forced variant 5.
    ops::GemmOptions zero = v5;
    zero.small_m_max_m = 0;
    EXPECT_EQ(ops::plan_gemm(p77, 132, zero).path, ops::GemmPath::kSmallM);
    // Refused where it cannot serve, naming why.
    expect_error_mentions(
        [&] {
            ops::plan_gemm(ops::GemmProblem{257, 4096, 4096, BLayout::kNK, DType::kBF16, DType::kBF16}, 132, v5);
        },
        "small-M variant 5 (swapped wgmma) serves M <= 256 (kGemvWgmmaMaxM), got M = 257");
    expect_error_mentions(
        [&] {
            ops::plan_gemm(ops::GemmProblem{16, 4096, 4096, BLayout::kKN, DType::kBF16, DType::kBF16}, 132, v5);
        },
        "needs B [N,K]");
    EXPECT_FALSE(
        ops::gemm_allows_small_m_v5(ops::GemmProblem{257, 4096, 4096, BLayout::kNK, DType::kBF16, DType::kBF16}, {}));
    EXPECT_FALSE(
        ops::gemm_allows_small_m_v5(ops::GemmProblem{16, 4096, 4096, BLayout::kKN, DType::kBF16, DType::kBF16}, {}));
    // Launched programmatically when asked, like the other ring kernels.
    ops::GemmOptions pdl = v5;
    pdl.programmatic_launch = true;
    EXPECT_TRUE(ops::gemm_launches_programmatically(ops::plan_gemm(p77, 132, pdl), pdl));
}

// gemm_few_rows_config: 129..192 rows with the pick's tiles in one wave take the cooperative 128x192 where its tiles
// fill at least half a wave (N = K = 8192: 1.2x the 128x128 at M = 160); elsewhere the pick stands.
TEST(GemmPlan, FewRowsTakeTheTileThatFillsTheWave) {
    const GemmConfig c128 = gemm_candidate(6, DType::kBF16, DType::kBF16, BLayout::kNK);
    const GemmConfig c192 = gemm_candidate(5, DType::kBF16, DType::kBF16, BLayout::kNK);
    const GemmConfig pp64 = gemm_candidate(12, DType::kBF16, DType::kBF16, BLayout::kNK);
    auto rule = [](int64_t m, int64_t n, const GemmConfig& picked, int budget = 132) {
        return ops::gemm_few_rows_config(ops::GemmProblem{m, n, n, BLayout::kNK, DType::kBF16, DType::kBF16}, picked,
                                         budget);
    };
    EXPECT_EQ(rule(160, 8192, c128), c192);
    EXPECT_EQ(rule(192, 8192, c128), c192);
    EXPECT_EQ(rule(128, 8192, c128), c128);
    EXPECT_EQ(rule(193, 8192, c128), c128);
    EXPECT_EQ(rule(160, 4096, pp64), pp64) << "128x192: 44 tiles, a third of the SMs";
    EXPECT_EQ(rule(160, 8192, c128, 64), c128) << "the pick's tiles are more than one wave";
    EXPECT_EQ(rule(160, 8192 * 2, c128), c128);
    const GemmConfig pair = gemm_candidate(13, DType::kBF16, DType::kBF16, BLayout::kNK);
    EXPECT_EQ(rule(160, 8192, pair), pair) << "cluster picks stand";
    // Through plan_gemm (132 SMs, the cost model's pick first; without split-K, which takes these shapes further).
    ops::GemmOptions no_split;
    no_split.split_k = 1;
    for (int64_t m : {160, 192}) {
        const ops::GemmProblem p{m, 8192, 8192, BLayout::kNK, DType::kBF16, DType::kBF16};
        EXPECT_EQ(ops::gemm_candidate_name(ops::plan_gemm(p, 132, no_split).config), "128x192x64_s4_c1x1")
            << "M " << m;
    }
}

// The heuristic on 132 SMs picks, for the benchmark's GEMM shapes (docs/performance.md), the candidate measured fastest
// there or one within 1% (`weft_bench_gemm --all-configs`; the runs: kernels/gemm/README.md, variant log).
TEST(GemmPlan, PicksTheMeasuredFastestTiles) {
    struct Pick {
        int64_t m, n, k;
        const char* name;
    };
    const Pick picks[] = {
        {8192, 8192, 8192, "128x192x64_s4_c1x1_pp"}, {8192, 1376, 4096, "128x176x64_s5_c1x1_pp"},
        {8192, 1792, 4096, "128x128x64_s6_c2x1_pp"}, {8192, 3584, 8192, "128x256x64_s4_c1x1"},
        {8192, 6656, 16384, "128x192x64_s4_c1x1_pp"}, {8192, 3696, 8192, "128x192x64_s4_c1x1_pp"},
        {8192, 4096, 1376, "128x192x64_s4_c1x1_pp"}, {8192, 4096, 1792, "128x192x64_s4_c1x1_pp"},
        {8192, 8192, 3584, "128x192x64_s4_c1x1_pp"}, {8192, 16384, 6656, "128x192x64_s4_c1x1_pp"},
        {8192, 8192, 3696, "128x192x64_s4_c1x1_pp"}, {4096, 4096, 4096, "128x256x64_s4_c1x1"},
        {1024, 8192, 8192, "128x256x64_s4_c1x1"},     {128, 8192, 8192, "64x128x64_s8_c1x1_pp"},
        {256, 8192, 8192, "128x128x64_s6_c1x1"},      {128, 8192, 4096, "64x128x64_s8_c1x1_pp"},
        {128, 8192, 1024, "64x128x64_s8_c1x1_pp"},
        {128, 28672, 4096, "128x256x64_s4_c1x1"},     {512, 8192, 8192, "128x256x64_s4_c1x1"},
    };
    for (const Pick& pk : picks) {
        const ops::GemmProblem p{pk.m, pk.n, pk.k, BLayout::kNK, DType::kBF16, DType::kBF16};
        EXPECT_EQ(ops::gemm_candidate_name(ops::plan_gemm(p, 132).config), pk.name)
            << pk.m << "x" << pk.n << "x" << pk.k;
    }
}

// Split-K (GemmConfig::splits): the configs the op adds, how many splits fill a wave, and the op's rule by M
// (gemm_split_k_config; kernels/gemm/README.md, "Few rows") on 132 SMs, with the plan's grid and workspace.
TEST(GemmPlan, SplitKFillsTheSmsForFewRows) {
    const auto split_configs = ops::gemm_split_k_configs(DType::kBF16, DType::kBF16, BLayout::kNK);
    ASSERT_EQ(split_configs.size(), 8u);
    for (const GemmConfig& c : split_configs) {
        EXPECT_TRUE(is_valid(c)) << ops::format_gemm_config(c);
        EXPECT_TRUE(c.splits == 2 || c.splits == 4);
        EXPECT_EQ(c.cluster_m * c.cluster_n, 1);
        for (const GemmConfig& plain : ops::gemm_candidate_configs(DType::kBF16, DType::kBF16, BLayout::kNK)) {
            EXPECT_NE(c, plain) << "the fused ops' candidates never split K";
        }
    }
    GemmConfig bad = split_configs[0];
    bad.cluster_m = 2;
    EXPECT_FALSE(is_valid(bad)) << "split-K without clusters";
    bad = split_configs[0];
    bad.splits = kGemmMaxSplits + 1;
    EXPECT_FALSE(is_valid(bad));
    bad.splits = 0;
    EXPECT_FALSE(is_valid(bad));

    const auto problem = [](int64_t m, int64_t n, int64_t k) {
        return ops::GemmProblem{m, n, k, BLayout::kNK, DType::kBF16, DType::kBF16};
    };
    const GemmConfig pp64 = gemm_candidate(12, DType::kBF16, DType::kBF16, BLayout::kNK);
    EXPECT_EQ(ops::gemm_fill_splits(problem(64, 4096, 4096), pp64, 132), 4);   // 32 tiles
    EXPECT_EQ(ops::gemm_fill_splits(problem(64, 8192, 8192), pp64, 132), 2);   // 64 tiles
    EXPECT_EQ(ops::gemm_fill_splits(problem(128, 8192, 8192), pp64, 132), 1);  // 128 tiles
    EXPECT_EQ(ops::gemm_fill_splits(problem(64, 4096, 4096), pp64, 64), 2);
    EXPECT_EQ(ops::gemm_fill_splits(problem(64, 4096, 1024), pp64, 132), 2) << "8 k-blocks per split at least";
    EXPECT_EQ(ops::gemm_fill_splits(problem(64, 4096, 960), pp64, 132), 1);

    struct Pick {
        int64_t m, n, k;
        const char* name;
    };
    // The op's plan (tiled path: small-M off) by M at N = K = 4096 and 8192, and the shapes it leaves alone.
    const Pick picks[] = {
        {33, 4096, 4096, "64x128x64_s8_c1x1_pp_k4"}, {64, 4096, 4096, "64x128x64_s8_c1x1_pp_k4"},
        {65, 4096, 4096, "64x128x64_s8_c1x1_pp"},    {96, 4096, 4096, "64x128x64_s8_c1x1_pp"},
        {97, 4096, 4096, "64x128x64_s8_c1x1_pp"},    {128, 4096, 4096, "64x128x64_s8_c1x1_pp"},
        {160, 4096, 4096, "64x128x64_s8_c1x1_pp"},   {192, 4096, 4096, "64x128x64_s8_c1x1_pp"},
        {320, 4096, 4096, "80x128x64_s7_c1x1_sw"},   {384, 4096, 4096, "96x128x64_s6_c1x1_sw"},
        {24, 8192, 8192, "64x128x64_s8_c1x1_pp_k2"}, {64, 8192, 8192, "64x128x64_s8_c1x1_pp_k2"},
        {65, 8192, 8192, "64x128x64_s8_c1x1_pp"},    {96, 8192, 8192, "64x128x64_s8_c1x1_pp"},
        {112, 8192, 8192, "64x128x64_s8_c1x1_pp"},   {160, 8192, 8192, "80x128x64_s7_c1x1_sw"},
        {192, 8192, 8192, "96x128x64_s6_c1x1_sw"},   {256, 8192, 8192, "128x128x64_s6_c1x1"},
        {130, 6144, 8192, "128x256x64_s4_c1x1_k2"},  // swapped 80-row tiles would fill 0.59 of their wave
        {320, 8192, 8192, "160x128x64_s5_c1x1_sw"},  {513, 4096, 4096, "128x160x64_s5_c1x1_pp"},
        {128, 28672, 4096, "128x256x64_s4_c1x1"},
    };
    ops::GemmOptions tiled;
    tiled.allow_small_m = false;
    for (const Pick& pk : picks) {
        const ops::GemmProblem p = problem(pk.m, pk.n, pk.k);
        const ops::GemmPlan plan = ops::plan_gemm(p, 132, tiled);
        EXPECT_EQ(ops::gemm_candidate_name(plan.config), pk.name) << pk.m << "x" << pk.n << "x" << pk.k;
        const GemmTileGrid g(plan.config, static_cast<int32_t>(p.m), static_cast<int32_t>(p.n));
        EXPECT_LE(plan.grid, 132);
        if (plan.config.splits > 1) {
            EXPECT_EQ(plan.grid, std::min(132, g.num_tiles() * plan.config.splits));
            const size_t counters = (static_cast<size_t>(g.num_tiles()) * 4 + 255) / 256 * 256;
            const size_t partials = static_cast<size_t>(g.num_tiles()) * plan.config.splits * plan.config.tile_m *
                                    plan.config.tile_n * 4;
            EXPECT_EQ(plan.workspace_bytes, counters + (partials + 255) / 256 * 256);
        } else {
            EXPECT_EQ(plan.workspace_bytes, 0u);
        }
    }
    // split_k = 1: never; S: S splits of the heuristic's tile without its pair; out of range: an error.
    ops::GemmOptions none = tiled;
    none.split_k = 1;
    EXPECT_EQ(ops::plan_gemm(problem(64, 4096, 4096), 132, none).config.splits, 1);
    ops::GemmOptions three = tiled;
    three.split_k = 3;
    const auto forced = ops::plan_gemm(problem(513, 4096, 4096), 132, three);
    EXPECT_EQ(ops::gemm_candidate_name(forced.config), "128x160x64_s5_c1x1_pp_k3");
    three.config = gemm_candidate(13, DType::kBF16, DType::kBF16, BLayout::kNK);  // a forced config keeps its splits
    EXPECT_EQ(ops::plan_gemm(problem(513, 4096, 4096), 132, three).config, *three.config);
    ops::GemmOptions pair_then_split = tiled;
    pair_then_split.split_k = 2;
    const auto dropped = ops::plan_gemm(problem(8192, 1792, 4096), 132, pair_then_split);
    EXPECT_EQ(ops::gemm_candidate_name(dropped.config), "128x128x64_s6_c1x1_pp_k2") << "the pair is dropped";
    EXPECT_GT(forced.workspace_bytes, 0u);
    ops::GemmOptions too_many = tiled;
    too_many.split_k = kGemmMaxSplits + 1;
    expect_error_mentions([&] { ops::plan_gemm(problem(64, 4096, 4096), 132, too_many); },
                          "options.split_k must be in [0, 16]");
    // A budget of 64 SMs: half the splits.
    ops::GemmOptions half = tiled;
    half.sm_budget = 64;
    EXPECT_EQ(ops::gemm_candidate_name(ops::plan_gemm(problem(64, 4096, 4096), 132, half).config),
              "64x128x64_s8_c1x1_pp_k2");
}

TEST(GemmPlan, TiledGridRespectsBudgetAndCluster) {
    ops::GemmProblem p{8192, 8192, 8192, BLayout::kNK, DType::kBF16, DType::kBF16};
    for (int budget : {0, 1, 7, 64, 131, 132, 500}) {
        ops::GemmOptions o;
        o.sm_budget = budget;
        const auto plan = ops::plan_gemm(p, 132, o);
        const int cluster = plan.config.cluster_m * plan.config.cluster_n;
        EXPECT_EQ(plan.path, ops::GemmPath::kTiled);
        EXPECT_TRUE(is_valid(plan.config));
        EXPECT_GT(plan.grid, 0);
        EXPECT_EQ(plan.grid % cluster, 0);
        EXPECT_LE(plan.grid, std::max(cluster, budget == 0 ? 132 : std::min(budget, 132)));
        EXPECT_EQ(plan.smem_bytes, gemm_smem_plan(plan.config).alloc_bytes);
    }
    // Large square problems use a ping-pong 128x192 tile (the fastest measured there).
    const auto big = ops::plan_gemm(p, 132);
    EXPECT_TRUE(big.config.pingpong && big.config.tile_m * big.config.tile_n == 128 * 192)
        << ops::format_gemm_config(big.config);
    // A tiny problem never launches more CTAs than tiles.
    ops::GemmProblem tiny{100, 100, 64, BLayout::kKN, DType::kF16, DType::kF32};
    const auto t = ops::plan_gemm(tiny, 132);
    EXPECT_LE(t.grid, 2);
    EXPECT_EQ(t.config.b_layout, BLayout::kKN);
    EXPECT_EQ(t.config.out_dtype, DType::kF32);
}

TEST(GemmPlan, ForcedConfigMustMatchTheCall) {
    ops::GemmProblem p{512, 512, 512, BLayout::kNK, DType::kBF16, DType::kBF16};
    ops::GemmOptions o;
    o.config = gemm_candidate(6, DType::kBF16, DType::kBF16, BLayout::kNK);
    EXPECT_EQ(ops::plan_gemm(p, 132, o).config, *o.config);
    o.config = gemm_candidate(6, DType::kF16, DType::kF16, BLayout::kNK);
    expect_error_mentions([&] { ops::plan_gemm(p, 132, o); }, "options.config's dtypes/layout must match the call");
    GemmConfig bad{};
    bad.stages = 7;
    o.config = bad;
    expect_error_mentions([&] { ops::plan_gemm(p, 132, o); }, "options.config is not a valid GemmConfig");
    // A swapped 16-row tile with raster groups of 64 along M over about 2^30 rows: the kernel's int32 tile order
    // would wrap (rows unwritten or written twice); refused. The same config on an ordinary M is taken.
    GemmConfig fine = ops::gemm_swap_ab_config_of(16, DType::kBF16, DType::kBF16);
    fine.raster = Raster::kAlongM;
    fine.raster_group = 64;
    ASSERT_TRUE(is_valid(fine)) << ops::format_gemm_config(fine);
    o.config = fine;
    const ops::GemmProblem huge{int64_t{1} << 30, 8, 8, BLayout::kNK, DType::kBF16, DType::kBF16};
    expect_error_mentions([&] { ops::validate_gemm_options(huge, o); }, "pass the kernel's int32 tile order");
    EXPECT_NO_THROW(
        ops::validate_gemm_options(ops::GemmProblem{4096, 8, 8, BLayout::kNK, DType::kBF16, DType::kBF16}, o));
    // Along N the groups span N's few tiles: the same rows are fine.
    fine.raster = Raster::kAlongN;
    o.config = fine;
    EXPECT_NO_THROW(ops::validate_gemm_options(huge, o));
}

TEST(GemmFormat, PrintsDesignatedInitialisers) {
    const std::string s = ops::format_gemm_config(gemm_candidate(1, DType::kF16, DType::kF32, BLayout::kKN));
    EXPECT_EQ(s,
              "weft::GemmConfig{.tile_m = 128, .tile_n = 256, .tile_k = 64, .stages = 4, .cluster_m = 2, "
              ".cluster_n = 1, .raster = weft::Raster::kAlongN, .raster_group = 8, .b_layout = weft::BLayout::kKN, "
              ".in_dtype = weft::DType::kF16, .out_dtype = weft::DType::kF32}");
    GemmConfig pp{};
    pp.tile_m = 64;
    pp.pingpong = true;
    EXPECT_NE(ops::format_gemm_config(pp).find(".out_dtype = weft::DType::kBF16, .pingpong = true}"), std::string::npos)
        << ops::format_gemm_config(pp);
    EXPECT_EQ(ops::gemm_candidate_name(pp), "64x256x64_s4_c1x1_pp");
    const std::string k = ops::gemm_kernel_instantiation(GemmConfig{});
    EXPECT_EQ(k.rfind("weft::kernels::gemm::gemm_kernel<weft::GemmConfig{", 0), 0u) << k;
    EXPECT_NE(k.find("weft::kernels::gemm::PersistentScheduler<weft::GemmConfig{"), std::string::npos) << k;
}

// D is written while A and B are read: an output whose bytes meet an input's is refused before the device.
TEST(GemmValidate, AnOutputOverlappingAnInputIsRefused) {
    const auto a = mat(0x10000, DType::kBF16, 64, 64, 64);   // bytes [0x10000, 0x12000)
    const auto b = mat(0x20000, DType::kBF16, 128, 64, 64);  // bytes [0x20000, 0x24000)
    const auto d_on_a = mat(0x11000, DType::kBF16, 64, 128, 128);
    const auto d_on_b = mat(0x1c100, DType::kBF16, 64, 128, 128);  // its last 256 bytes inside b
    for (const TensorView& d : {d_on_a, d_on_b}) {
        expect_error_mentions([&] { ops::gemm(a, b, d, BLayout::kNK, nullptr); }, "must not overlap a's or b's");
        expect_error_mentions([&] { (void)ops::select_gemm(a, b, d, BLayout::kNK, nullptr); },
                              "must not overlap a's or b's");
    }
    // A caller's workspace (split-K counters and partials) must meet none of a, b and d.
    const auto d = mat(0x30000, DType::kBF16, 64, 128, 128);
    for (const auto& [addr, name] : {std::pair<uintptr_t, const char*>{0x11000, "a"}, {0x23000, "b"}, {0x31000, "d"}}) {
        ops::GemmOptions o;
        o.workspace = reinterpret_cast<void*>(addr);
        o.workspace_bytes = 8192;
        expect_error_mentions([&] { ops::gemm(a, b, d, BLayout::kNK, nullptr, o); },
                              std::string("options.workspace must not overlap ") + name);
        expect_error_mentions([&] { (void)ops::select_gemm(a, b, d, BLayout::kNK, nullptr, o); },
                              std::string("options.workspace must not overlap ") + name);
    }
    // An empty D touches nothing (M = 0: nothing to write, no CUDA call).
    EXPECT_NO_THROW(ops::gemm(mat(0x10000, DType::kBF16, 0, 64, 64), b, mat(0x20000, DType::kBF16, 0, 128, 128),
                              BLayout::kNK, nullptr));
}

}  // namespace
}  // namespace weft
