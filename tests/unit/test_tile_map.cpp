// SPDX-License-Identifier: MIT
// Unit tests for the tile maps: exhaustive over shapes, chunk sizes, tile sizes and world sizes 1-8.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "weft/common/tile_map.hpp"

namespace weft {
namespace {

// The maps are usable in constant expressions (and so in kernels' static_asserts).
constexpr AllGatherTileMap kAg{100, 3, 7, 32};
static_assert(kAg.is_valid());
static_assert(kAg.num_signals() == 3 * 15);
static_assert(kAg.signals_for_tile(3).first == kAg.signal_index(0, 13));
static_assert(kAg.signals_for_tile(3).last == kAg.signal_index(1, 3));
constexpr ReduceScatterTileMap kRs{100, 3, 50, 16, 16, 32};
static_assert(kRs.is_valid());
static_assert(kRs.tile_at(0, 0).dest == 1);
static_assert(kRs.tile_at(0, kRs.num_tiles() - 1).dest == 0);

std::string describe(const AllGatherTileMap& m) {
    std::ostringstream os;
    os << "AllGatherTileMap{rows_per_rank=" << m.rows_per_rank << ", num_ranks=" << m.num_ranks
       << ", chunk_rows=" << m.chunk_rows << ", tile_m=" << m.tile_m << "}";
    return os.str();
}

std::string describe(const ReduceScatterTileMap& m) {
    std::ostringstream os;
    os << "ReduceScatterTileMap{rows_per_rank=" << m.rows_per_rank << ", num_ranks=" << m.num_ranks
       << ", cols=" << m.cols << ", tile_m=" << m.tile_m << ", tile_n=" << m.tile_n << ", chunk_rows=" << m.chunk_rows
       << "}";
    return os.str();
}

// Checks one all-gather map against a brute-force model built from the producer's enumeration.
void check_all_gather(const AllGatherTileMap& m) {
    SCOPED_TRACE(describe(m));
    ASSERT_TRUE(m.is_valid()) << m.invalid_reason();
    const int64_t total = m.total_rows();
    const int32_t w = m.num_ranks;
    const int32_t ns = m.num_signals();
    ASSERT_EQ(total, m.rows_per_rank * w);

    // Producer side, rank 0's enumeration: every row lands in exactly one chunk; record row -> signal.
    std::vector<int32_t> row_signal(static_cast<size_t>(total), -1);
    for (int32_t i = 0; i < ns; ++i) {
        const ChunkInfo c = m.chunk_at(0, i);
        ASSERT_GE(c.num_rows, 1);
        ASSERT_LE(c.num_rows, m.chunk_rows);
        ASSERT_EQ(c.signal_idx, m.signal_index(c.rank, c.chunk));
        // The chunk lies inside its owner's shard.
        ASSERT_GE(c.row_begin, c.rank * m.rows_per_rank);
        ASSERT_LE(c.row_begin + c.num_rows, (c.rank + 1) * m.rows_per_rank);
        for (int64_t r = c.row_begin; r < c.row_begin + c.num_rows; ++r) {
            ASSERT_EQ(row_signal[static_cast<size_t>(r)], -1) << "row " << r << " in two chunks";
            row_signal[static_cast<size_t>(r)] = c.signal_idx;
        }
    }
    for (int64_t r = 0; r < total; ++r) {
        ASSERT_NE(row_signal[static_cast<size_t>(r)], -1) << "row " << r << " in no chunk";
        ASSERT_EQ(m.chunk_of_row(r).signal_idx, row_signal[static_cast<size_t>(r)]) << "row " << r;
    }

    // Producer order on every rank: a permutation of the signals, own shard first, then rank+1, ...
    std::vector<std::vector<int32_t>> arrival(static_cast<size_t>(w), std::vector<int32_t>(static_cast<size_t>(ns), -1));
    for (int32_t rank = 0; rank < w; ++rank) {
        std::vector<int32_t>& pos = arrival[static_cast<size_t>(rank)];
        for (int32_t i = 0; i < ns; ++i) {
            const ChunkInfo c = m.chunk_at(rank, i);
            ASSERT_GE(c.signal_idx, 0);
            ASSERT_LT(c.signal_idx, ns);
            ASSERT_EQ(pos[static_cast<size_t>(c.signal_idx)], -1) << "rank " << rank << ": signal twice in chunk order";
            pos[static_cast<size_t>(c.signal_idx)] = i;
            ASSERT_EQ(c.rank, (rank + i / m.chunks_per_rank()) % w) << "rank " << rank << " position " << i;
            const ChunkInfo again = m.chunk(c.signal_idx);
            ASSERT_EQ(again.row_begin, c.row_begin);
            ASSERT_EQ(again.num_rows, c.num_rows);
        }
    }

    // Consumer side: each tile waits on exactly the chunks that hold its rows, as a contiguous range.
    const int32_t nt = m.num_tiles();
    int64_t covered = 0;
    const bool aligned = m.rows_per_rank % m.tile_m == 0 && m.chunk_rows % m.tile_m == 0;
    for (int32_t t = 0; t < nt; ++t) {
        const int64_t begin = m.tile_row_begin(t);
        const int64_t rows = m.tile_rows(t);
        ASSERT_GE(rows, 1);
        ASSERT_LE(rows, m.tile_m);
        ASSERT_EQ(begin, covered);
        covered += rows;
        std::set<int32_t> needed;
        for (int64_t r = begin; r < begin + rows; ++r) {
            needed.insert(row_signal[static_cast<size_t>(r)]);
        }
        const SignalRange range = m.signals_for_tile(t);
        ASSERT_EQ(range.first, *needed.begin()) << "tile " << t;
        ASSERT_EQ(range.last, *needed.rbegin()) << "tile " << t;
        ASSERT_EQ(range.count(), static_cast<int32_t>(needed.size())) << "tile " << t << ": range not contiguous";
        ASSERT_EQ(m.first_rank_for_tile(t), m.chunk(range.first).rank);
        ASSERT_EQ(m.last_rank_for_tile(t), m.chunk(range.last).rank);
        if (aligned) {
            ASSERT_EQ(range.count(), 1) << "tile " << t << " should map to exactly one chunk";
        }
    }
    ASSERT_EQ(covered, total);

    // Consumer order on every rank: a permutation of the tiles whose readiness (the arrival position
    // of the last chunk it needs, in that rank's producer order) never decreases; local tiles first.
    for (int32_t rank = 0; rank < w; ++rank) {
        std::vector<bool> seen(static_cast<size_t>(nt), false);
        int32_t prev_ready = -1;
        bool seen_remote = false;
        for (int32_t i = 0; i < nt; ++i) {
            const int32_t t = m.tile_at(rank, i);
            ASSERT_GE(t, 0);
            ASSERT_LT(t, nt);
            ASSERT_FALSE(seen[static_cast<size_t>(t)]) << "rank " << rank << ": tile " << t << " twice";
            seen[static_cast<size_t>(t)] = true;
            const SignalRange range = m.signals_for_tile(t);
            int32_t ready = 0;
            bool local_only = true;
            for (int32_t s = range.first; s <= range.last; ++s) {
                ready = std::max(ready, arrival[static_cast<size_t>(rank)][static_cast<size_t>(s)]);
                local_only = local_only && m.chunk(s).rank == rank;
            }
            ASSERT_GE(ready, prev_ready) << "rank " << rank << " position " << i << " (tile " << t
                                         << ") is ready before the tile computed ahead of it";
            prev_ready = ready;
            if (!local_only) {
                seen_remote = true;
            } else {
                ASSERT_FALSE(seen_remote) << "rank " << rank << ": local tile " << t << " after a remote one";
            }
        }
    }
}

TEST(AllGatherTileMap, ExhaustiveSmallShapes) {
    const int64_t rows[] = {1, 2, 3, 5, 7, 8, 13, 16, 31, 64, 100};
    const int64_t chunks[] = {1, 2, 3, 4, 7, 8, 16, 33, 64, 128};
    const int64_t tiles[] = {1, 2, 3, 5, 8, 16, 64, 128, 200};
    int checked = 0;
    for (int32_t w = 1; w <= 8; ++w) {
        for (int64_t r : rows) {
            for (int64_t c : chunks) {
                for (int64_t t : tiles) {
                    check_all_gather(AllGatherTileMap{r, w, c, t});
                    if (HasFatalFailure()) {
                        return;
                    }
                    ++checked;
                }
            }
        }
    }
    EXPECT_EQ(checked, 8 * 11 * 10 * 9);
}

TEST(AllGatherTileMap, RealisticShapes) {
    // AG+GEMM shapes: M = 8192 over 8 ranks, 128-row tiles, chunks of 1/2/4 tiles and a straddling case.
    for (int32_t w : {2, 3, 4, 5, 7, 8}) {
        for (int64_t chunk : {128, 256, 512, 1000}) {
            check_all_gather(AllGatherTileMap{8192 / w, w, chunk, 128});
            if (HasFatalFailure()) {
                return;
            }
        }
    }
}

TEST(AllGatherTileMap, InvalidInputsAreNamed) {
    EXPECT_STREQ(AllGatherTileMap({0, 2, 1, 1}).invalid_reason(), "rows_per_rank must be >= 1");
    EXPECT_STREQ(AllGatherTileMap({4, 0, 1, 1}).invalid_reason(), "num_ranks must be >= 1");
    EXPECT_STREQ(AllGatherTileMap({4, 2, 0, 1}).invalid_reason(), "chunk_rows must be >= 1");
    EXPECT_STREQ(AllGatherTileMap({4, 2, 1, 0}).invalid_reason(), "tile_m must be >= 1");
    EXPECT_NE(AllGatherTileMap({int64_t{1} << 40, 8, 1, 1}).invalid_reason(), nullptr);
    EXPECT_EQ(AllGatherTileMap({4, 2, 1, 1}).invalid_reason(), nullptr);
}

void check_reduce_scatter(const ReduceScatterTileMap& m) {
    SCOPED_TRACE(describe(m));
    ASSERT_TRUE(m.is_valid()) << m.invalid_reason();
    const int32_t w = m.num_ranks;
    const int32_t nt = m.num_tiles();
    const int32_t ns = m.num_signals();
    ASSERT_EQ(nt, w * m.tiles_per_rank());

    // Counters: chunks partition every segment.
    std::vector<int32_t> row_signal(static_cast<size_t>(m.rows_per_rank * w), -1);
    for (int32_t s = 0; s < ns; ++s) {
        const ChunkInfo c = m.chunk(s);
        ASSERT_EQ(c.signal_idx, s);
        ASSERT_GE(c.num_rows, 1);
        ASSERT_GE(c.row_begin, c.rank * m.rows_per_rank);
        ASSERT_LE(c.row_begin + c.num_rows, (c.rank + 1) * m.rows_per_rank);
        ASSERT_EQ(m.local_signal_at(c.rank, c.chunk), s);
        for (int64_t r = c.row_begin; r < c.row_begin + c.num_rows; ++r) {
            ASSERT_EQ(row_signal[static_cast<size_t>(r)], -1);
            row_signal[static_cast<size_t>(r)] = s;
        }
    }
    for (int64_t r = 0; r < m.rows_per_rank * w; ++r) {
        ASSERT_NE(row_signal[static_cast<size_t>(r)], -1) << "row " << r;
        ASSERT_EQ(m.dest_of_row(r), r / m.rows_per_rank);
    }

    for (int32_t rank = 0; rank < w; ++rank) {
        // Every (dest, m, n) exactly once; tiles cover each segment's rows x all columns exactly once.
        std::vector<int32_t> cell(static_cast<size_t>(w * m.m_tiles_per_rank() * m.n_tiles()), 0);
        std::vector<int32_t> count(static_cast<size_t>(ns), 0);
        std::vector<int64_t> rows_covered(static_cast<size_t>(w), 0);
        int32_t prev_dest = -1;
        int32_t dest_changes = 0;
        for (int32_t i = 0; i < nt; ++i) {
            const RsTile t = m.tile_at(rank, i);
            ASSERT_GE(t.dest, 0);
            ASSERT_LT(t.dest, w);
            ASSERT_GE(t.m_tile, 0);
            ASSERT_LT(t.m_tile, m.m_tiles_per_rank());
            ASSERT_GE(t.n_tile, 0);
            ASSERT_LT(t.n_tile, m.n_tiles());
            const size_t key = (static_cast<size_t>(t.dest) * static_cast<size_t>(m.m_tiles_per_rank()) +
                                static_cast<size_t>(t.m_tile)) * static_cast<size_t>(m.n_tiles()) +
                               static_cast<size_t>(t.n_tile);
            ASSERT_EQ(cell[key]++, 0) << "rank " << rank << ": tile twice";
            // Geometry: inside the destination's segment and the matrix.
            ASSERT_EQ(t.row_begin, t.dest * m.rows_per_rank + t.m_tile * m.tile_m);
            ASSERT_GE(t.num_rows, 1);
            ASSERT_LE(t.row_begin + t.num_rows, (t.dest + 1) * m.rows_per_rank);
            ASSERT_EQ(t.col_begin, t.n_tile * m.tile_n);
            ASSERT_GE(t.num_cols, 1);
            ASSERT_LE(t.col_begin + t.num_cols, m.cols);
            if (t.n_tile == 0) {
                rows_covered[static_cast<size_t>(t.dest)] += t.num_rows;
            }
            // All of the tile's rows are counted by its signal (no tile straddles two counters).
            for (int64_t r = t.row_begin; r < t.row_begin + t.num_rows; ++r) {
                ASSERT_EQ(row_signal[static_cast<size_t>(r)], t.signal_idx) << "rank " << rank << " tile " << i;
            }
            ++count[static_cast<size_t>(t.signal_idx)];
            // Grouped by destination: next rank first, this rank last.
            if (t.dest != prev_dest) {
                ++dest_changes;
                ASSERT_EQ(t.dest, (rank + dest_changes) % w) << "rank " << rank << " position " << i;
                prev_dest = t.dest;
            }
            ASSERT_EQ(t.dest, (rank + 1 + i / m.tiles_per_rank()) % w);
        }
        ASSERT_EQ(dest_changes, w);
        for (int32_t d = 0; d < w; ++d) {
            ASSERT_EQ(rows_covered[static_cast<size_t>(d)], m.rows_per_rank) << "dest " << d;
        }
        int64_t cols_covered = 0;
        for (int32_t n = 0; n < m.n_tiles(); ++n) {
            cols_covered += m.tile(0, n).num_cols;
        }
        ASSERT_EQ(cols_covered, m.cols);
        int32_t total = 0;
        for (int32_t s = 0; s < ns; ++s) {
            ASSERT_EQ(m.expected_count(s), count[static_cast<size_t>(s)]) << "signal " << s;
            total += count[static_cast<size_t>(s)];
        }
        ASSERT_EQ(total, nt);
    }
}

TEST(ReduceScatterTileMap, ExhaustiveSmallShapes) {
    const int64_t rows[] = {1, 3, 7, 16, 33, 64, 100};
    const int64_t cols[] = {1, 5, 16, 100};
    const int64_t tile_ms[] = {1, 4, 8, 16, 64};
    const int64_t tile_ns[] = {1, 8, 64};
    int checked = 0;
    for (int32_t w = 1; w <= 8; ++w) {
        for (int64_t r : rows) {
            for (int64_t n : cols) {
                for (int64_t tm : tile_ms) {
                    for (int64_t tn : tile_ns) {
                        for (int64_t chunk : {tm, 2 * tm, 3 * tm, r, r + 5}) {
                            check_reduce_scatter(ReduceScatterTileMap{r, w, n, tm, tn, chunk});
                            if (HasFatalFailure()) {
                                return;
                            }
                            ++checked;
                        }
                    }
                }
            }
        }
    }
    EXPECT_EQ(checked, 8 * 7 * 4 * 5 * 3 * 5);
}

TEST(ReduceScatterTileMap, RealisticShapes) {
    for (int32_t w : {2, 3, 4, 5, 7, 8}) {
        for (int64_t chunk : {128, 256, 8192}) {
            check_reduce_scatter(ReduceScatterTileMap{8192 / w, w, 1000, 128, 256, chunk});
            if (HasFatalFailure()) {
                return;
            }
        }
    }
}

TEST(ReduceScatterTileMap, InvalidInputsAreNamed) {
    EXPECT_NE(ReduceScatterTileMap({64, 2, 16, 16, 16, 24}).invalid_reason(), nullptr);  // 24 % 16 != 0
    EXPECT_EQ(ReduceScatterTileMap({64, 2, 16, 16, 16, 100}).invalid_reason(), nullptr);  // >= rows_per_rank
    EXPECT_STREQ(ReduceScatterTileMap({64, 2, 0, 16, 16, 16}).invalid_reason(), "cols must be >= 1");
    EXPECT_STREQ(ReduceScatterTileMap({64, 0, 8, 16, 16, 16}).invalid_reason(), "num_ranks must be >= 1");
    EXPECT_STREQ(ReduceScatterTileMap({64, 2, 8, 0, 16, 16}).invalid_reason(), "tile_m and tile_n must be >= 1");
}

}  // namespace
}  // namespace weft
