// SPDX-License-Identifier: MIT
// Unit tests (CPU): tile orders and signal maths of the tensor-parallel fused GEMMs (AgGemmOrder, RsGemmOrder,
// rs_source_at) checked against the tile maps and against brute-force enumeration, a CPU replay of the
// GEMM+ReduceScatter counting protocol, the chunk heuristics, and argument validation of the three ops.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "weft/common/tp_params.hpp"
#include "weft/common/tp_schedule.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

GemmConfig cfg(int tile_m, int tile_n, int cluster_m = 1, int cluster_n = 1, int group = 8) {
    GemmConfig c;
    c.tile_m = tile_m;
    c.tile_n = tile_n;
    c.cluster_m = cluster_m;
    c.cluster_n = cluster_n;
    c.raster_group = group;
    return c;
}

struct AgCase {
    GemmConfig c;
    int64_t rows_per_rank;
    int32_t num_ranks;
    int64_t chunk_rows;
    int32_t n;
};

std::vector<AgCase> ag_cases() {
    std::vector<AgCase> v;
    for (int32_t w : {1, 2, 3, 4, 8}) {
        for (int64_t rpr : {int64_t{1}, int64_t{100}, int64_t{128}, int64_t{300}, int64_t{1024}}) {
            for (int64_t chunk : {int64_t{64}, int64_t{128}, int64_t{100000}}) {
                v.push_back({cfg(128, 256), rpr, w, chunk, 1000});
                v.push_back({cfg(256, 128, 1, 1, 3), rpr, w, chunk, 129});
                v.push_back({cfg(128, 128, 2, 1, 2), rpr, w, chunk, 300});  // a B-multicast pair along M
                v.push_back({cfg(128, 64, 1, 2, 1), rpr, w, chunk, 72});    // an A-multicast pair along N
            }
        }
    }
    return v;
}

std::string describe(const AgCase& a) {
    return "tile " + std::to_string(a.c.tile_m) + "x" + std::to_string(a.c.tile_n) + " cluster " +
           std::to_string(a.c.cluster_m) + "x" + std::to_string(a.c.cluster_n) + " group " +
           std::to_string(a.c.raster_group) + " rows/rank " + std::to_string(a.rows_per_rank) + " W " +
           std::to_string(a.num_ranks) + " chunk " + std::to_string(a.chunk_rows) + " n " + std::to_string(a.n);
}

TEST(TpSchedule, AgOrderCoversEveryTileOncePerRank) {
    for (const AgCase& a : ag_cases()) {
        for (int32_t rank = 0; rank < a.num_ranks; ++rank) {
            SCOPED_TRACE(describe(a) + " rank " + std::to_string(rank));
            const AgGemmOrder o(a.c, a.rows_per_rank, a.num_ranks, a.chunk_rows, a.n, rank);
            const int64_t m = a.rows_per_rank * a.num_ranks;
            ASSERT_EQ(o.m, m);
            ASSERT_EQ(o.num_m_tiles, (m + a.c.tile_m - 1) / a.c.tile_m);
            std::set<std::pair<int, int>> seen;
            int valid = 0;
            for (int32_t t = 0; t < o.num_cluster_tiles(); ++t) {
                for (int32_t cta = 0; cta < a.c.cluster_m * a.c.cluster_n; ++cta) {
                    const GemmTile g = o.tile(t, cta);
                    if (!g.valid) continue;  // padding tile of a cluster pair past the edge
                    ++valid;
                    EXPECT_TRUE(seen.insert({g.m_idx, g.n_idx}).second) << "tile repeated: " << g.m_idx << "," << g.n_idx;
                    EXPECT_EQ(g.m0, g.m_idx * a.c.tile_m);
                    EXPECT_EQ(g.n0, g.n_idx * a.c.tile_n);
                }
            }
            EXPECT_EQ(valid, o.num_m_tiles * o.num_n_tiles);
        }
    }
}

TEST(TpSchedule, AgOrderFollowsTheTileMapRotation) {
    for (const AgCase& a : ag_cases()) {
        for (int32_t rank = 0; rank < a.num_ranks; ++rank) {
            SCOPED_TRACE(describe(a) + " rank " + std::to_string(rank));
            const AgGemmOrder o(a.c, a.rows_per_rank, a.num_ranks, a.chunk_rows, a.n, rank);
            const AllGatherTileMap map = o.rows();
            ASSERT_TRUE(map.is_valid());
            EXPECT_EQ(o.rotation_start, map.tile_at(rank, 0));
            // The cluster rows appear in tile_at order, group by group: position p's row is tile_at(rank, p).
            std::vector<int32_t> rows_in_order;
            for (int32_t t = 0; t < o.num_cluster_tiles(); ++t) {
                const int32_t mc = o.tile(t, 0).m_idx / a.c.cluster_m;
                if (std::find(rows_in_order.begin(), rows_in_order.end(), mc) == rows_in_order.end()) {
                    rows_in_order.push_back(mc);
                }
            }
            ASSERT_EQ(static_cast<int32_t>(rows_in_order.size()), map.num_tiles());
            for (int32_t p = 0; p < map.num_tiles(); ++p) EXPECT_EQ(rows_in_order[p], map.tile_at(rank, p)) << p;
            // The first tile needs no peer's data when this rank's shard begins a cluster row of its own.
            const int64_t first_row = static_cast<int64_t>(map.tile_at(rank, 0)) * map.tile_m;
            if (a.num_ranks > 1 && first_row >= rank * a.rows_per_rank &&
                first_row + map.tile_m <= (rank + 1) * a.rows_per_rank) {
                const SignalRange r = o.signals_for(o.tile(0, 0));
                for (int32_t s = r.first; s <= r.last; ++s) EXPECT_TRUE(o.is_local_signal(s)) << s;
            }
        }
    }
}

TEST(TpSchedule, AgSignalsMatchTheTileMapChunks) {
    for (const AgCase& a : ag_cases()) {
        SCOPED_TRACE(describe(a));
        const AgGemmOrder o(a.c, a.rows_per_rank, a.num_ranks, a.chunk_rows, a.n, 0);
        const AllGatherTileMap map = o.rows();
        EXPECT_EQ(o.chunks_per_rank, map.chunks_per_rank());
        EXPECT_EQ(o.num_signals(), map.num_signals());
        for (int32_t row = 0; row < o.m; ++row) {
            ASSERT_EQ(o.signal_of_row(row), map.chunk_of_row(row).signal_idx) << "row " << row;
        }
        for (int32_t mt = 0; mt < o.num_m_tiles; ++mt) {
            GemmTile t{};
            t.m_idx = mt;
            t.m0 = mt * a.c.tile_m;
            t.valid = true;
            const SignalRange r = o.signals_for(t);
            std::set<int32_t> want;
            for (int64_t row = t.m0; row < std::min<int64_t>(o.m, t.m0 + a.c.tile_m); ++row) {
                want.insert(map.chunk_of_row(row).signal_idx);
            }
            ASSERT_FALSE(want.empty());
            EXPECT_EQ(r.first, *want.begin());
            EXPECT_EQ(r.last, *want.rbegin());
            EXPECT_EQ(static_cast<size_t>(r.count()), want.size()) << "the range must be contiguous";
            for (int32_t s = r.first; s <= r.last; ++s) {
                EXPECT_EQ(o.is_local_signal(s), map.chunk(s).rank == 0);
            }
        }
        GemmTile invalid{};
        invalid.valid = false;
        EXPECT_EQ(o.signals_for(invalid).count(), 0);
    }
}

TEST(TpSchedule, AgCopyOrderIsOwnShardThenRankPlusOne) {
    const AllGatherTileMap map{300, 4, 128, 128};
    for (int32_t rank = 0; rank < 4; ++rank) {
        for (int32_t i = 0; i < map.num_signals(); ++i) {
            const ChunkInfo c = map.chunk_at(rank, i);
            EXPECT_EQ(c.rank, (rank + i / map.chunks_per_rank()) % 4);
            EXPECT_EQ(c.chunk, i % map.chunks_per_rank());
        }
    }
}

TEST(TpSchedule, AgDefaultChunkRows) {
    // Small shards: one chunk per rank.
    EXPECT_EQ(ops::ag_gemm_default_chunk_rows(1024, 4096, 2), 1024);
    EXPECT_EQ(ops::ag_gemm_default_chunk_rows(1, 8, 2), 1);
    for (int64_t rows : {int64_t{4096}, int64_t{8191}, int64_t{1000}, int64_t{65536}}) {
        for (int64_t k : {int64_t{4096}, int64_t{16384}}) {
            const int64_t c = ops::ag_gemm_default_chunk_rows(rows, k, 2);
            EXPECT_GE(c, 1);
            EXPECT_LE(c, rows);
            EXPECT_TRUE(c == rows || c % 128 == 0) << rows << " " << k << " -> " << c;
            if (c < rows) {
                EXPECT_LE(c * k * 2, int64_t{9} << 20) << "chunks of ~8 MiB";
            }
        }
    }
}

struct RsCase {
    GemmConfig c;
    int64_t rows_per_rank;
    int32_t num_ranks;
    int64_t chunk_rows;
    int32_t n;
};

std::vector<RsCase> rs_cases() {
    std::vector<RsCase> v;
    for (int32_t w : {1, 2, 3, 4, 8}) {
        for (int64_t rpr : {int64_t{1}, int64_t{100}, int64_t{128}, int64_t{300}, int64_t{1000}}) {
            v.push_back({cfg(128, 256), rpr, w, 128, 1000});
            v.push_back({cfg(128, 128, 1, 1, 3), rpr, w, 256, 129});
            v.push_back({cfg(256, 128, 1, 1, 1), rpr, w, 1 << 20, 64});
        }
    }
    return v;
}

std::string describe(const RsCase& a) {
    return "tile " + std::to_string(a.c.tile_m) + "x" + std::to_string(a.c.tile_n) + " group " +
           std::to_string(a.c.raster_group) + " rows/rank " + std::to_string(a.rows_per_rank) + " W " +
           std::to_string(a.num_ranks) + " chunk " + std::to_string(a.chunk_rows) + " n " + std::to_string(a.n);
}

TEST(TpSchedule, RsOrderVisitsEverySegmentTileOnceNextRankFirst) {
    for (const RsCase& a : rs_cases()) {
        for (int32_t rank = 0; rank < a.num_ranks; ++rank) {
            SCOPED_TRACE(describe(a) + " rank " + std::to_string(rank));
            const RsGemmOrder o(a.c, a.rows_per_rank, a.num_ranks, a.chunk_rows, a.n, rank);
            ASSERT_TRUE(o.map.is_valid()) << o.map.invalid_reason();
            std::set<std::tuple<int, int, int>> seen;
            const int32_t per_rank = o.map.tiles_per_rank();
            for (int32_t t = 0; t < o.num_tiles(); ++t) {
                const RsTile r = o.rs_tile(t);
                EXPECT_EQ(r.dest, (rank + 1 + t / per_rank) % a.num_ranks) << "destination order";
                EXPECT_TRUE(seen.insert({r.dest, r.m_tile, r.n_tile}).second);
                // Rows inside the destination's segment; columns inside N.
                EXPECT_GE(r.row_begin, r.dest * a.rows_per_rank);
                EXPECT_LE(r.row_begin + r.num_rows, (r.dest + 1) * a.rows_per_rank);
                EXPECT_LE(r.col_begin + r.num_cols, a.n);
                // The GEMM's view of the tile, and back.
                const GemmTile g = o.tile(t);
                EXPECT_TRUE(g.valid);
                EXPECT_EQ(g.m0, r.row_begin);
                EXPECT_EQ(g.n0, r.col_begin);
                EXPECT_EQ(o.dest_of(g), r.dest);
                EXPECT_EQ(o.chunk_of(g), r.signal_idx - r.dest * o.map.chunks_per_rank());
            }
            EXPECT_EQ(static_cast<int32_t>(seen.size()), a.num_ranks * per_rank);
            EXPECT_EQ(o.rs_tile(o.num_tiles() - 1).dest, rank) << "own segment last";
        }
    }
}

// Replays the counting protocol: every source raises (on the destination) counter [source][chunk] once per
// tile; the destination's reduction waits for epoch * expected_count. Both must agree for every chunk.
TEST(TpSchedule, RsCountersReachExactlyTheExpectedCounts) {
    for (const RsCase& a : rs_cases()) {
        SCOPED_TRACE(describe(a));
        const int32_t w = a.num_ranks;
        std::map<std::tuple<int, int, int>, int> counters;  // (dest, source, chunk) -> count
        for (int32_t source = 0; source < w; ++source) {
            const RsGemmOrder o(a.c, a.rows_per_rank, w, a.chunk_rows, a.n, source);
            for (int32_t t = 0; t < o.num_tiles(); ++t) {
                const GemmTile g = o.tile(t);
                ++counters[{o.dest_of(g), source, o.chunk_of(g)}];
            }
        }
        const ReduceScatterTileMap map{a.rows_per_rank, w, a.n, a.c.tile_m, a.c.tile_n, a.chunk_rows};
        for (int32_t dest = 0; dest < w; ++dest) {
            for (int32_t source = 0; source < w; ++source) {
                for (int32_t c = 0; c < map.chunks_per_rank(); ++c) {
                    EXPECT_EQ((counters[{dest, source, c}]), map.expected_count(map.local_signal_at(dest, c)))
                        << "dest " << dest << " source " << source << " chunk " << c;
                }
            }
        }
        EXPECT_LT(rs_counter_index(w - 1, map.chunks_per_rank() - 1, map.chunks_per_rank()), map.num_signals());
    }
}

TEST(TpSchedule, RsReductionVisitsEverySourceOncePreviousRankFirstItselfLast) {
    for (int32_t w : {1, 2, 3, 5, 8}) {
        for (int32_t dest = 0; dest < w; ++dest) {
            std::set<int32_t> sources;
            for (int32_t phase = 0; phase < w; ++phase) sources.insert(rs_source_at(dest, phase, w));
            EXPECT_EQ(static_cast<int32_t>(sources.size()), w);
            EXPECT_EQ(rs_source_at(dest, 0, w), (dest + w - 1) % w);
            EXPECT_EQ(rs_source_at(dest, w - 1, w), dest);
            // Source s finishes dest's tiles at its own phase (dest - s - 1) mod w: the reduction's phase.
            for (int32_t phase = 0; phase < w; ++phase) {
                const int32_t s = rs_source_at(dest, phase, w);
                EXPECT_EQ(((dest - s - 1) % w + w) % w, phase);
            }
        }
    }
}

// ---- argument validation --------------------------------------------------------------------------------

void expect_error(const std::function<void()>& fn, const std::string& needle) {
    try {
        fn();
        ADD_FAILURE() << "expected a weft::Error mentioning \"" << needle << "\"";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
}

// Never dereferenced: validation only looks at shapes, strides and alignment.
void* fake(uintptr_t addr) { return reinterpret_cast<void*>(addr); }

TEST(TpValidation, AgGemmShapeAndOptions) {
    const ops::AgGemmShape ok{1024, 256, 512, DType::kBF16};
    EXPECT_NO_THROW(ops::validate_ag_gemm_shape(ok, 4));
    expect_error([&] { ops::validate_ag_gemm_shape({1022, 256, 512, DType::kBF16}, 4); }, "shape.max_m");
    expect_error([&] { ops::validate_ag_gemm_shape({1024, 0, 512, DType::kBF16}, 4); }, "shape.n");
    expect_error([&] { ops::validate_ag_gemm_shape({1024, 256, 500, DType::kBF16}, 4); }, "shape.k");
    expect_error([&] { ops::validate_ag_gemm_shape({1024, 256, 512, DType::kF32}, 4); }, "shape.dtype");
    // The GEMM's extents keep a margin below 2^31 (its int32 tile arithmetic).
    expect_error([&] { ops::validate_ag_gemm_shape({1024, 256, (int64_t{1} << 31) - 8, DType::kBF16}, 4); }, "shape.k");
    expect_error(
        [&] {
            ops::validate_ag_gemm_shape({(int64_t{1} << 31) - 4, 256, 512, DType::kBF16}, 4);
        },
        "shape.max_m must be at most 2^31 - 2^24");
    EXPECT_NO_THROW(ops::validate_ag_gemm_shape({ops::kGemmMaxExtent, 256, ops::kGemmMaxExtent, DType::kBF16}, 4));
    ops::AgGemmOptions o;
    o.copy_streams = 4;
    expect_error([&] { ops::validate_ag_gemm_shape(ok, 4, o); }, "copy_streams");
    o = {};
    o.chunk_rows = -1;
    expect_error([&] { ops::validate_ag_gemm_shape(ok, 4, o); }, "chunk_rows");
    o = {};
    o.config = gemm_candidate(1, DType::kBF16, DType::kBF16, BLayout::kNK);  // a cluster pair
    expect_error([&] { ops::validate_ag_gemm_shape(ok, 4, o); }, "cluster-free");
    o.config = gemm_candidate(0, DType::kF16, DType::kF16, BLayout::kNK);
    expect_error([&] { ops::validate_ag_gemm_shape(ok, 4, o); }, "options.config");
    o.config = gemm_candidate(0, DType::kBF16, DType::kBF16, BLayout::kNK);
    EXPECT_NO_THROW(ops::validate_ag_gemm_shape(ok, 4, o));
}

TEST(TpValidation, AgGemmCall) {
    const ops::AgGemmShape s{1024, 256, 512, DType::kBF16};
    const TensorView a(fake(0x1000000), DType::kBF16, {256, 512});
    const TensorView b(fake(0x2000000), DType::kBF16, {256, 512});
    const TensorView c(fake(0x3000000), DType::kBF16, {1024, 256});
    EXPECT_EQ(ops::validate_ag_gemm_call(s, 4, a, b, c), 1024);
    EXPECT_EQ(ops::validate_ag_gemm_call(s, 4, TensorView(fake(0x1000000), DType::kBF16, {3, 512}), b,
                                         TensorView(fake(0x3000000), DType::kBF16, {12, 256})),
              12);
    expect_error(
        [&] {
            ops::validate_ag_gemm_call(s, 4, TensorView(fake(0x1000000), DType::kBF16, {257, 512}), b, c);
        },
        "a_local must have 1 .. max_m/W");
    expect_error(
        [&] {
            ops::validate_ag_gemm_call(s, 4, TensorView(fake(0x1000000), DType::kBF16, {256, 256}), b, c);
        },
        "a_local must have K");
    expect_error(
        [&] {
            ops::validate_ag_gemm_call(s, 4, a, TensorView(fake(0x2000000), DType::kBF16, {255, 512}), c);
        },
        "b must be [N, K]");
    expect_error(
        [&] {
            ops::validate_ag_gemm_call(s, 4, a, b, TensorView(fake(0x3000000), DType::kBF16, {1000, 256}));
        },
        "c must be [M, N]");
    expect_error(
        [&] {
            ops::validate_ag_gemm_call(s, 4, a, b, TensorView(fake(0x3000000), DType::kF16, {1024, 256}));
        },
        "must be bf16");
    expect_error(
        [&] {
            ops::validate_ag_gemm_call(s, 4, TensorView(fake(0x1000008), DType::kBF16, {256, 512}), b, c);
        },
        "ag_gemm: gemm: a's base address must be 16-byte aligned");
    expect_error(
        [&] {
            ops::validate_ag_gemm_call(s, 4, a, b, TensorView(fake(0x3000000), DType::kBF16, {1024, 256}, {260, 1}));
        },
        "ag_gemm: gemm: d's row stride must be a multiple of 16 bytes");
    expect_error(
        [&] { ops::validate_ag_gemm_call(s, 4, TensorView(fake(0x1000000), DType::kBF16, {256 * 512}), b, c); },
        "a_local must be a 2-D");
    // One row per rank: a_local's row stride is free (one row), c's is checked over all of c's W rows.
    EXPECT_EQ(ops::validate_ag_gemm_call(s, 4, TensorView(fake(0x1000000), DType::kBF16, {1, 512}, {0, 1}), b,
                                         TensorView(fake(0x3000000), DType::kBF16, {4, 256})),
              4);
    expect_error(
        [&] {
            ops::validate_ag_gemm_call(s, 4, TensorView(fake(0x1000000), DType::kBF16, {1, 512}), b,
                                       TensorView(fake(0x3000000), DType::kBF16, {4, 256}, {100, 1}));
        },
        "ag_gemm: gemm: d's row stride must be >= its row length");
    // c is written while a_local and b are read.
    expect_error(
        [&] {
            ops::validate_ag_gemm_call(s, 4, a, b, TensorView(fake(0x1000000 + 1024), DType::kBF16, {1024, 256}));
        },
        "ag_gemm: c must not overlap a_local");
    expect_error(
        [&] {
            ops::validate_ag_gemm_call(s, 4, a, b, TensorView(fake(0x2000000 - 512), DType::kBF16, {1024, 256}));
        },
        "ag_gemm: c must not overlap b");
    // Column slices of one buffer, side by side with the same row pitch ([.., 512] and [.., 256] of a [1024, 768]):
    // their address spans interleave, their bytes do not meet. One element into a_local's columns, they do.
    const auto side_by_side = [&](uintptr_t c_at) {
        return ops::validate_ag_gemm_call(s, 4, TensorView(fake(0x1000000), DType::kBF16, {256, 512}, {768, 1}), b,
                                          TensorView(fake(c_at), DType::kBF16, {1024, 256}, {768, 1}));
    };
    EXPECT_EQ(side_by_side(0x1000000 + 512 * 2), 1024);
    expect_error([&] { side_by_side(0x1000000 + 512 * 2 - 16); }, "ag_gemm: c must not overlap a_local");
    expect_error([&] { side_by_side(0x1000000 - 768 * 2 + 16); }, "ag_gemm: c must not overlap a_local");
    // A row count whose product with the team size overflows int64 is refused, not wrapped into range.
    TensorView huge = a;
    huge.shape[0] = int64_t{1} << 62;
    expect_error([&] { ops::validate_ag_gemm_call(s, 4, huge, b, c); }, "a_local must have 1 .. max_m/W = 256 rows");
}

TEST(TpValidation, GemmRsShapeAndCall) {
    const ops::GemmRsShape s{1024, 300, 512, DType::kF16};
    EXPECT_NO_THROW(ops::validate_gemm_rs_shape(s, 4));
    expect_error([&] { ops::validate_gemm_rs_shape({1025, 300, 512, DType::kF16}, 4); }, "shape.max_m");
    ops::GemmRsOptions o;
    o.partial_dtype = DType::kBF16;
    expect_error([&] { ops::validate_gemm_rs_shape(s, 4, o); }, "partial_dtype");
    o.partial_dtype = DType::kF32;
    EXPECT_NO_THROW(ops::validate_gemm_rs_shape(s, 4, o));
    o.config = gemm_candidate(6, DType::kF16, DType::kF32, BLayout::kNK);
    o.chunk_rows = 100;
    expect_error([&] { ops::validate_gemm_rs_shape(s, 4, o); }, "chunk_rows must be a multiple");
    o.chunk_rows = 256;
    EXPECT_NO_THROW(ops::validate_gemm_rs_shape(s, 4, o));
    o.config = gemm_candidate(6, DType::kF16, DType::kF16, BLayout::kNK);  // writes f16, partials are f32
    expect_error([&] { ops::validate_gemm_rs_shape(s, 4, o); }, "options.config");
    o = {};
    o.mode = static_cast<ops::GemmRsMode>(7);
    expect_error([&] { ops::validate_gemm_rs_shape(s, 4, o); },
                 "options.mode must be GemmRsMode::kAuto, kPull or kPush");

    const TensorView a(fake(0x1000000), DType::kF16, {1024, 512});
    const TensorView b(fake(0x2000000), DType::kF16, {300, 512});
    const TensorView c(fake(0x3000000), DType::kF16, {256, 300}, {304, 1});
    EXPECT_EQ(ops::validate_gemm_rs_call(s, 4, a, b, c), 1024);
    expect_error(
        [&] {
            ops::validate_gemm_rs_call(s, 4, TensorView(fake(0x1000000), DType::kF16, {1022, 512}), b, c);
        },
        "multiple of the team's num_ranks");
    expect_error(
        [&] {
            ops::validate_gemm_rs_call(s, 4, a, b, TensorView(fake(0x3000000), DType::kF16, {1024, 300}));
        },
        "c must be [M/W, N]");
    expect_error(
        [&] {
            ops::validate_gemm_rs_call(s, 4, a, b, TensorView(fake(0x3000000), DType::kF16, {256, 300}));
        },
        "row stride must be a multiple of 16 bytes");
    // c is written while a and b are read: their bytes must not meet.
    expect_error(
        [&] {
            ops::validate_gemm_rs_call(s, 4, a, b,
                                       TensorView(fake(0x1000000 + 4096), DType::kF16, {256, 300}, {304, 1}));
        },
        "gemm_rs: c must not overlap a");
    expect_error(
        [&] {
            ops::validate_gemm_rs_call(s, 4, a, b, TensorView(fake(0x2000000), DType::kF16, {256, 300}, {304, 1}));
        },
        "gemm_rs: c must not overlap b");
}

// An explicit chunk_rows must steer the config choice, not make the op throw when the heuristic alone would pick a
// taller tile (TpGemmRs at W = 8 on one GPU: a GEMM budget of 15 SMs, chunk_rows 128, a 256-row pick): 64 rows leave
// only the 64-row tile (ping-pong 64x128), 128 rows the tiles of 64 or 128 rows.
TEST(TpPlan, GemmRsExplicitChunkRowsSteersTheConfig) {
    const ops::GemmRsShape s{2400, 1100, 256, DType::kBF16};
    ops::GemmRsOptions o;
    const ops::detail::GemmRsPlan heuristic = ops::detail::plan_gemm_rs(s, 8, 15, o);
    ASSERT_EQ(heuristic.configs.size(), 1u);
    EXPECT_NE(heuristic.configs[0].tile_m, 64) << "the case no longer exercises a pick the chunk must override";
    EXPECT_EQ(heuristic.chunk_rows % heuristic.configs[0].tile_m, 0);
    o.chunk_rows = 64;
    const ops::detail::GemmRsPlan p = ops::detail::plan_gemm_rs(s, 8, 15, o);
    ASSERT_EQ(p.configs.size(), 1u);
    EXPECT_EQ(p.chunk_rows, 64);
    EXPECT_EQ(p.configs[0].tile_m, 64);
    EXPECT_EQ(p.configs[0].cluster_m * p.configs[0].cluster_n, 1);
    EXPECT_EQ(p.max_chunks_per_rank, 5);  // 300 rows per rank in chunks of 64
    o.autotune = true;
    for (const GemmConfig& c : ops::detail::plan_gemm_rs(s, 8, 15, o).configs) EXPECT_EQ(c.tile_m, 64);
    o.chunk_rows = 128;
    bool saw_128 = false;
    for (const GemmConfig& c : ops::detail::plan_gemm_rs(s, 8, 15, o).configs) {
        EXPECT_EQ(128 % c.tile_m, 0) << ops::format_gemm_config(c);
        saw_128 = saw_128 || c.tile_m == 128;
    }
    EXPECT_TRUE(saw_128);
}

// The fused kernels run cluster-free tiles of whole store boxes (their hooks route or signal every store),
// cooperative or ping-pong (each warpgroup adds to, stores and signals its own tiles). Every tuning list holds both
// schedules and nothing else.
TEST(TpPlan, FusedOpsRunClusterFreeWholeBoxTiles) {
    for (const int64_t n : {1376, 1792, 3584, 3696, 6656}) {
        ops::GemmRsOptions tuned;
        tuned.autotune = true;
        bool pingpong = false, cooperative = false;
        for (const GemmConfig& c : ops::detail::plan_gemm_rs({8192, n, 4096, DType::kBF16}, 2, 132, tuned).configs) {
            EXPECT_TRUE(gemm_whole_store_boxes(c)) << "N " << n << ": " << ops::format_gemm_config(c);
            EXPECT_EQ(c.cluster_m * c.cluster_n, 1) << "N " << n;
            pingpong = pingpong || c.pingpong;
            cooperative = cooperative || !c.pingpong;
        }
        EXPECT_TRUE(pingpong && cooperative) << "N " << n;
    }
}

// GEMM+RS on two GPUs (push mode, 132 SMs for the GEMM), every candidate timed by the autotuner in one run
// (`weft_bench_tp --world 2 --op rs --tune`): the heuristic picks the fastest on each benchmark shape (the figures:
// docs/performance_archive.md, "AG+GEMM and GEMM+RS with ping-pong tiles").
TEST(TpPlan, GemmRsPicksTheMeasuredFastestTiles) {
    const std::pair<int64_t, int64_t> shapes[] = {
        {4096, 5504}, {4096, 7168}, {8192, 14336}, {16384, 26624}, {8192, 14784}};
    const char* want[] = {"128x256x64_s4_c1x1", "128x256x64_s4_c1x1", "128x192x64_s4_c1x1_pp", "128x192x64_s4_c1x1_pp",
                          "128x192x64_s4_c1x1_pp"};
    for (size_t i = 0; i < std::size(shapes); ++i) {
        const auto [n, k] = shapes[i];
        ops::GemmRsOptions o;
        o.mode = ops::GemmRsMode::kPush;
        const ops::detail::GemmRsPlan p = ops::detail::plan_gemm_rs({8192, n, k, DType::kBF16}, 2, 132, o);
        ASSERT_EQ(p.configs.size(), 1u);
        EXPECT_EQ(ops::gemm_candidate_name(p.configs[0]), want[i]) << "N " << n << " K " << k;
    }
}

TEST(TpPlan, GemmRsEveryConfigFitsItsChunk) {
    // Every world size, budget, dtype, partial dtype, chunk (heuristic or explicit) and autotune setting.
    for (int w : {1, 2, 3, 4, 5, 8}) {
        for (int64_t rows : {1, 100, 128, 300, 700, 2048}) {
            for (int budget : {1, 3, 15, 29, 66, 131}) {
                for (DType dt : {DType::kBF16, DType::kF16}) {
                    for (bool f32 : {false, true}) {
                        for (int64_t chunk : {0, 128, 256, 384, 512}) {
                            for (bool tune : {false, true}) {
                                const ops::GemmRsShape s{rows * w, 1100, 136, dt};
                                ops::GemmRsOptions o;
                                if (f32) o.partial_dtype = DType::kF32;
                                o.chunk_rows = chunk;
                                o.autotune = tune;
                                const ops::detail::GemmRsPlan p = ops::detail::plan_gemm_rs(s, w, budget, o);
                                SCOPED_TRACE(::testing::Message() << "W " << w << " rows " << rows << " budget "
                                                                  << budget << " chunk " << chunk << " tune " << tune);
                                ASSERT_FALSE(p.configs.empty());
                                if (chunk > 0) {
                                    EXPECT_EQ(p.chunk_rows, chunk);
                                }
                                for (const GemmConfig& c : p.configs) {
                                    EXPECT_TRUE(is_valid(c));
                                    EXPECT_EQ(c.cluster_m * c.cluster_n, 1);
                                    EXPECT_EQ(p.chunk_rows % c.tile_m, 0) << "tile_m " << c.tile_m;
                                    EXPECT_EQ(c.out_dtype, w == 1 ? dt : (f32 ? DType::kF32 : dt));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

// Autotuned GemmRs (TpGemmRs.AutotunedConfigStaysCorrect's shape: W=2, 300 rows per rank, N=1100, a GEMM budget of
// 58 SMs, where chunk 0 of the first candidate, 128x128 under the shared 256-row chunk, waits for 18 arrivals, and
// others): for every candidate of the plan, at the planned M and a smaller one, every source's tiles raise exactly
// the counts the destination waits for, at indices inside the counters the op allocates (W * max_chunks_per_rank).
TEST(TpPlan, GemmRsEveryTuningCandidateCountsInsideItsCounters) {
    struct Shape {
        int w;
        int64_t rows, n;
        int budget;
    };
    for (const Shape& sh : {Shape{2, 300, 1100, 58}, Shape{2, 300, 1100, 65}, Shape{3, 300, 1100, 43},
                            Shape{4, 256, 264, 29}, Shape{8, 300, 1100, 15}, Shape{2, 2048, 4096, 58}}) {
        const ops::GemmRsShape s{sh.rows * sh.w, sh.n, 256, DType::kBF16};
        ops::GemmRsOptions o;
        o.autotune = true;
        const ops::detail::GemmRsPlan p = ops::detail::plan_gemm_rs(s, sh.w, sh.budget, o);
        ASSERT_GT(p.configs.size(), 1u);
        if (sh.w == 2 && sh.rows == 300 && sh.budget == 58) {
            EXPECT_EQ(p.configs[0].tile_m, 128);
            EXPECT_EQ(p.configs[0].tile_n, 128);
            EXPECT_EQ(p.chunk_rows, 256) << "the case no longer has two tile rows per chunk";
            EXPECT_EQ((ReduceScatterTileMap{300, 2, 1100, 128, 128, 256}.expected_count(0)), 18);
        }
        for (const GemmConfig& c : p.configs) {
            for (int64_t rows : {sh.rows, std::max<int64_t>(1, sh.rows * 2 / 3)}) {
                SCOPED_TRACE(::testing::Message() << "W " << sh.w << " rows " << rows << " tile " << c.tile_m << "x"
                                                  << c.tile_n << " chunk " << p.chunk_rows);
                const ReduceScatterTileMap map{rows, sh.w, sh.n, c.tile_m, c.tile_n, p.chunk_rows};
                ASSERT_TRUE(map.is_valid()) << map.invalid_reason();
                ASSERT_LE(map.chunks_per_rank(), p.max_chunks_per_rank);
                std::map<std::tuple<int, int, int>, int> counts;  // (dest, source, chunk)
                for (int32_t source = 0; source < sh.w; ++source) {
                    const RsGemmOrder order(c, rows, sh.w, p.chunk_rows, static_cast<int32_t>(sh.n), source);
                    for (int32_t t = 0; t < order.num_tiles(); ++t) {
                        const GemmTile g = order.tile(t);
                        const int32_t chunk = order.chunk_of(g);
                        ASSERT_LT(rs_counter_index(source, chunk, map.chunks_per_rank()),
                                  sh.w * static_cast<int32_t>(p.max_chunks_per_rank));
                        ++counts[{order.dest_of(g), source, chunk}];
                    }
                }
                for (int32_t dest = 0; dest < sh.w; ++dest) {
                    for (int32_t phase = 0; phase < sh.w; ++phase) {
                        const int32_t source = rs_source_at(dest, phase, sh.w);
                        for (int32_t ch = 0; ch < map.chunks_per_rank(); ++ch) {
                            EXPECT_EQ((counts[{dest, source, ch}]), map.expected_count(map.local_signal_at(dest, ch)))
                                << "dest " << dest << " source " << source << " chunk " << ch;
                        }
                    }
                }
            }
        }
    }
}

TEST(TpPlan, GemmRsChunkThatFitsNoConfigIsAnError) {
    const ops::GemmRsShape s{1024, 300, 512, DType::kBF16};
    ops::GemmRsOptions o;
    o.chunk_rows = 32;  // below every tile_m
    expect_error([&] { ops::detail::plan_gemm_rs(s, 4, 30, o); }, "options.chunk_rows must be a multiple");
    o.chunk_rows = 128;  // a forced 256-row config does not fit: the caller's contradiction is reported
    o.config = gemm_candidate(3, DType::kBF16, DType::kBF16, BLayout::kNK);
    ASSERT_EQ(o.config->tile_m, 256);
    expect_error([&] { ops::detail::plan_gemm_rs(s, 4, 30, o); }, "chunk_rows must be a multiple of the config's tile_m");
    o.chunk_rows = 512;
    const ops::detail::GemmRsPlan p = ops::detail::plan_gemm_rs(s, 4, 30, o);
    ASSERT_EQ(p.configs.size(), 1u);
    EXPECT_EQ(p.configs[0], *o.config);
}

// A team of one runs the plain GEMM into c: the options documented for the partials (kF32 with a config writing f32,
// push with f32 partials or n % 8 != 0) are accepted there, not refused by the partials' rules.
TEST(TpPlan, GemmRsTeamOfOneTakesThePartialOptions) {
    using ops::GemmRsMode;
    const ops::GemmRsShape s{1024, 300, 512, DType::kBF16};
    ops::GemmRsOptions o;
    o.partial_dtype = DType::kF32;
    GemmConfig forced = gemm_candidate(0, DType::kBF16, DType::kF32, BLayout::kNK);
    forced.cluster_m = forced.cluster_n = 1;
    o.config = forced;
    ops::validate_gemm_rs_shape(s, 1, o);
    const ops::detail::GemmRsPlan p = ops::detail::plan_gemm_rs(s, 1, 30, o);
    ASSERT_EQ(p.configs.size(), 1u);
    EXPECT_EQ(p.configs[0].tile_m, forced.tile_m);
    EXPECT_EQ(p.configs[0].out_dtype, DType::kBF16);  // c's dtype
    // The same options at two ranks keep the f32 partials.
    EXPECT_EQ(ops::detail::plan_gemm_rs(s, 2, 30, o).configs[0].out_dtype, DType::kF32);
    o.mode = GemmRsMode::kPush;
    EXPECT_EQ(ops::detail::resolve_gemm_rs_mode(s, 1, o), GemmRsMode::kPush);
    expect_error([&] { ops::detail::resolve_gemm_rs_mode(s, 2, o); }, "partials in f32");
}

TEST(TpPlan, GemmRsModeIsPushWhereItAppliesElsePull) {
    using ops::GemmRsMode;
    const ops::GemmRsShape s{1024, 304, 512, DType::kBF16};
    ops::GemmRsOptions o;
    EXPECT_EQ(ops::detail::resolve_gemm_rs_mode(s, 4, o), GemmRsMode::kPush);
    EXPECT_EQ(ops::detail::resolve_gemm_rs_mode(s, 8, o), GemmRsMode::kPush);
    EXPECT_EQ(ops::detail::resolve_gemm_rs_mode(s, 4, o, /*ranks_share_a_gpu=*/true), GemmRsMode::kPull);
    EXPECT_EQ(ops::detail::resolve_gemm_rs_mode({1024, 300, 512, DType::kBF16}, 4, o), GemmRsMode::kPull);  // n % 8
    EXPECT_EQ(ops::detail::resolve_gemm_rs_mode({1008, 304, 512, DType::kBF16}, 9, o), GemmRsMode::kPull);  // > 8 ranks
    o.mode = GemmRsMode::kPull;
    EXPECT_EQ(ops::detail::resolve_gemm_rs_mode(s, 4, o), GemmRsMode::kPull);
    o.mode = GemmRsMode::kAuto;
    o.partial_dtype = DType::kF32;
    EXPECT_EQ(ops::detail::resolve_gemm_rs_mode(s, 4, o), GemmRsMode::kPull);
    o.mode = GemmRsMode::kPush;  // asked for and impossible: an error naming why, never a silent pull
    expect_error([&] { ops::detail::resolve_gemm_rs_mode(s, 4, o); }, "partials in f32");
    o.partial_dtype.reset();
    o.reduce_ctas = 8;
    expect_error([&] { ops::detail::resolve_gemm_rs_mode(s, 4, o); }, "reduction CTAs belong to the pull mode");
    o.reduce_ctas = 0;
    expect_error([&] { ops::detail::resolve_gemm_rs_mode({1024, 300, 512, DType::kBF16}, 4, o); },
                 "n = 300 is not a multiple of 8");
    EXPECT_EQ(ops::detail::resolve_gemm_rs_mode(s, 4, o), GemmRsMode::kPush);
    // Asked for where ranks share a GPU: refused, saying why, unless the caller accepts the risk (weft's own tests).
    expect_error([&] { ops::detail::resolve_gemm_rs_mode(s, 4, o, /*ranks_share_a_gpu=*/true); },
                 "push is refused where ranks share a GPU");
    o.push_on_shared_gpus = true;
    EXPECT_EQ(ops::detail::resolve_gemm_rs_mode(s, 4, o, /*ranks_share_a_gpu=*/true), GemmRsMode::kPush);
    // The push kernel names its hook; the pull kernel keeps its own.
    const GemmConfig c = [] {
        GemmConfig g = gemm_candidate(0, DType::kBF16, DType::kBF16, BLayout::kNK);
        g.cluster_m = g.cluster_n = 1;
        return g;
    }();
    EXPECT_NE(ops::detail::gemm_rs_kernel_spec(c, "sm_90a", GemmRsMode::kPush).instantiation.find("RsPushHook"),
              std::string::npos);
    EXPECT_NE(ops::detail::gemm_rs_kernel_spec(c, "sm_90a").instantiation.find("RsGemmHook"), std::string::npos);
}

TEST(TpValidation, GemmArShapeAndCall) {
    const ops::GemmArShape s{128, 1000, 256, DType::kBF16};
    EXPECT_NO_THROW(ops::validate_gemm_ar_shape(s, 8));
    expect_error([&] { ops::validate_gemm_ar_shape(s, 9); }, "num_ranks must be in [1, 8]");
    expect_error([&] { ops::validate_gemm_ar_shape({0, 1000, 256, DType::kBF16}, 2); }, "shape.max_m");
    const TensorView a(fake(0x1000000), DType::kBF16, {5, 256});
    const TensorView b(fake(0x2000000), DType::kBF16, {1000, 256});
    const TensorView c(fake(0x3000000), DType::kBF16, {5, 1000});
    EXPECT_EQ(ops::validate_gemm_ar_call(s, a, b, c), 5);
    expect_error(
        [&] {
            ops::validate_gemm_ar_call(s, TensorView(fake(0x1000000), DType::kBF16, {129, 256}), b, c);
        },
        "1 .. max_m");
    expect_error(
        [&] {
            ops::validate_gemm_ar_call(s, a, b, TensorView(fake(0x3000000), DType::kBF16, {5, 999}));
        },
        "c must be [M, N]");
    expect_error(
        [&] {
            ops::validate_gemm_ar_call(s, a, b, TensorView(fake(0x1000000), DType::kBF16, {5, 1000}));
        },
        "gemm_ar: c must not overlap a");
    expect_error(
        [&] {
            ops::validate_gemm_ar_call(s, a, b, TensorView(fake(0x2000000 + 512), DType::kBF16, {5, 1000}));
        },
        "gemm_ar: c must not overlap b");
}

// Kernel parameters are copied byte for byte into the launch: checked where they are compiled, not at run time.
static_assert(std::is_trivially_copyable_v<AgGemmParams>);
static_assert(std::is_trivially_copyable_v<AgGemmHookParams>);
static_assert(std::is_trivially_copyable_v<RsGemmParams>);
static_assert(std::is_trivially_copyable_v<RsGemmHookParams>);
static_assert(std::is_trivially_copyable_v<RsReduceParams>);
static_assert(std::is_trivially_copyable_v<RsPushHookParams>);
static_assert(sizeof(RsPushHookParams) < 2048, "RsPushHookParams ride in the kernel's 4 KiB of parameters");
static_assert(std::is_trivially_copyable_v<ArReduceParams>);

}  // namespace
}  // namespace weft
