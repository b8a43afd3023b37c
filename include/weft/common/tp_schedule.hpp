// SPDX-License-Identifier: MIT
// Tile orders of the tensor-parallel fused GEMMs (AllGather+GEMM, GEMM+ReduceScatter): the i-th output tile a
// persistent CTA computes and the signals it waits for or raises, derived from the tile maps. Shared by the
// kernels' schedulers (device) and by host planning and unit tests (CPU).
//
// Both orders are linear sequences of (cluster) tiles: CTA cluster c of a persistent grid of C clusters takes
// positions c, c + C, c + 2C, ... so the tiles in flight at any moment are consecutive positions of the order.
//  - AgGemmOrder: M-rows of tiles in AllGatherTileMap::tile_at order (this rank's rows first, then rank+1's,
//    ...: the order in which the copy engines deliver them), grouped by `raster_group` rows; inside a group,
//    down the rows then across N (the rows of one group share B columns in L2).
//  - RsGemmOrder: destination segments in ReduceScatterTileMap::tile_at order (rank+1's rows first, this
//    rank's own last), grouped rasterisation inside each segment. Tiles never straddle segments (the last
//    M-tile of a segment may be short: its TMA store also covers the first rows of the next segment with the
//    same values, which is harmless; see kernels/gemm_rs/README.md).
#pragma once

#include "weft/common/gemm_config.hpp"
#include "weft/common/tile_map.hpp"

namespace weft {

/// AllGather+GEMM on one rank: D[M, N] = gathered A[M, K] * B, M = rows_per_rank * num_ranks. Built on the
/// host (it is part of the kernel's parameters, read from the constant bank: the GEMM's producer runs with 40
/// registers) from an AllGatherTileMap over cluster rows; the device-side methods use 32-bit arithmetic
/// (validated: M < 2^31) and agree with the map's (unit-tested).
struct AgGemmOrder {
    int32_t rank, num_ranks;
    int32_t rows_per_rank, chunk_rows, chunks_per_rank;
    int32_t m;  ///< rows of the gathered A
    int32_t tile_m, tile_n, cluster_m, cluster_n, group;
    int32_t num_m_tiles, num_n_tiles;        ///< CTA tiles of D
    int32_t num_m_clusters, num_n_clusters;  ///< cluster tiles of D
    int32_t rotation_start;                  ///< rows().tile_at(rank, 0): this rank's first cluster row

    AgGemmOrder() = default;
    WEFT_HOST_DEVICE constexpr AgGemmOrder(const GemmConfig& c, int64_t rows_per_rank_, int32_t num_ranks_,
                                           int64_t chunk_rows_, int32_t n, int32_t rank_)
        : rank(rank_),
          num_ranks(num_ranks_),
          rows_per_rank(static_cast<int32_t>(rows_per_rank_)),
          chunk_rows(static_cast<int32_t>(chunk_rows_ < rows_per_rank_ ? chunk_rows_ : rows_per_rank_)),
          chunks_per_rank(0),
          m(static_cast<int32_t>(rows_per_rank_ * num_ranks_)),
          tile_m(c.tile_m),
          tile_n(c.tile_n),
          cluster_m(c.cluster_m),
          cluster_n(c.cluster_n),
          group(c.raster_group),
          num_m_tiles(0),
          num_n_tiles((n + c.tile_n - 1) / c.tile_n),
          num_m_clusters(0),
          num_n_clusters(0),
          rotation_start(0) {
        const AllGatherTileMap map = rows();
        chunks_per_rank = map.chunks_per_rank();
        num_m_tiles = (m + tile_m - 1) / tile_m;
        num_m_clusters = map.num_tiles();
        num_n_clusters = (num_n_tiles + cluster_n - 1) / cluster_n;
        rotation_start = map.tile_at(rank, 0);
    }

    /// The tile map this order follows: rows chunked for signals, tiles = cluster rows.
    WEFT_HOST_DEVICE constexpr AllGatherTileMap rows() const {
        return AllGatherTileMap{rows_per_rank, num_ranks, chunk_rows, static_cast<int64_t>(tile_m) * cluster_m};
    }
    WEFT_HOST_DEVICE constexpr int32_t num_cluster_tiles() const { return num_m_clusters * num_n_clusters; }
    WEFT_HOST_DEVICE constexpr int32_t num_signals() const { return num_ranks * chunks_per_rank; }

    /// The tile that CTA `cta_rank` of a cluster computes at position `t` of this rank's order.
    WEFT_HOST_DEVICE constexpr GemmTile tile(int32_t t, int32_t cta_rank) const {
        const int32_t per_group = group * num_n_clusters;
        const int32_t g = t / per_group;
        const int32_t first = g * group;
        const int32_t rows_in_group = (num_m_clusters - first) < group ? (num_m_clusters - first) : group;
        const int32_t local = t - g * per_group;
        const int32_t pos = first + local % rows_in_group;
        const int32_t nc = local / rows_in_group;
        const int32_t mc = (rotation_start + pos) % num_m_clusters;  // == rows().tile_at(rank, pos)
        GemmTile out{};
        out.m_idx = mc * cluster_m + cta_rank % cluster_m;
        out.n_idx = nc * cluster_n + cta_rank / cluster_m;
        out.m0 = out.m_idx * tile_m;
        out.n0 = out.n_idx * tile_n;
        out.valid = out.m_idx < num_m_tiles && out.n_idx < num_n_tiles;
        return out;
    }

    /// The signal of the chunk holding row `row` (== rows().chunk_of_row(row).signal_idx).
    WEFT_HOST_DEVICE constexpr int32_t signal_of_row(int32_t row) const {
        const int32_t r = row / rows_per_rank;
        return r * chunks_per_rank + (row - r * rows_per_rank) / chunk_rows;
    }

    /// The chunk signals the A rows of `t` depend on: every chunk holding one of its rows (a contiguous
    /// range, possibly spanning ranks). count() == 0 for a tile without rows (padding of a cluster).
    WEFT_HOST_DEVICE constexpr SignalRange signals_for(const GemmTile& t) const {
        if (!t.valid || t.m0 >= m) return SignalRange{0, -1};
        const int32_t last = (t.m0 + tile_m < m ? t.m0 + tile_m : m) - 1;
        return SignalRange{signal_of_row(t.m0), signal_of_row(last)};
    }

    /// Whether signal `s` belongs to this rank's own shard (already in place: never waited for).
    WEFT_HOST_DEVICE constexpr bool is_local_signal(int32_t s) const { return s / chunks_per_rank == rank; }
};

/// GEMM+ReduceScatter on one rank: the partial P[M, N] = A_rank[M, K_local] * B_rank, M = rows_per_rank *
/// num_ranks, computed in segments by destination. Cluster-free configs only (one CTA per tile).
struct RsGemmOrder {
    ReduceScatterTileMap map;  ///< tile_m x tile_n tiles, counters per chunk of chunk_rows rows
    int32_t rank;
    int32_t group;  ///< tile rows per raster group inside a segment

    WEFT_HOST_DEVICE constexpr RsGemmOrder(const GemmConfig& c, int64_t rows_per_rank, int32_t num_ranks,
                                           int64_t chunk_rows, int32_t n, int32_t rank_)
        : map{rows_per_rank, num_ranks, n, c.tile_m, c.tile_n, chunk_rows}, rank(rank_), group(c.raster_group) {}

    WEFT_HOST_DEVICE constexpr int32_t num_tiles() const { return map.num_tiles(); }

    /// Segment-local tile index (M-major, as ReduceScatterTileMap::tile takes it) of position `local` of the
    /// grouped raster inside one segment.
    WEFT_HOST_DEVICE constexpr int32_t segment_tile(int32_t local) const {
        const int32_t n_tiles = map.n_tiles();
        const int32_t m_tiles = map.m_tiles_per_rank();
        const int32_t per_group = group * n_tiles;
        const int32_t g = local / per_group;
        const int32_t first = g * group;
        const int32_t rows_in_group = (m_tiles - first) < group ? (m_tiles - first) : group;
        const int32_t l = local - g * per_group;
        const int32_t m = first + l % rows_in_group;
        const int32_t n = l / rows_in_group;
        return m * n_tiles + n;
    }

    /// The tile at position `t` of this rank's order (destination rank+1's segment first).
    WEFT_HOST_DEVICE constexpr RsTile rs_tile(int32_t t) const {
        const int32_t per_rank = map.tiles_per_rank();
        const int32_t dest = (rank + 1 + t / per_rank) % map.num_ranks;
        return map.tile(dest, segment_tile(t % per_rank));
    }

    /// The same tile as the GEMM kernel sees it (m_idx: global M-tile index dest * m_tiles_per_rank + m).
    WEFT_HOST_DEVICE constexpr GemmTile tile(int32_t t) const { return to_gemm_tile(rs_tile(t)); }

    WEFT_HOST_DEVICE constexpr GemmTile to_gemm_tile(const RsTile& r) const {
        GemmTile out{};
        out.m_idx = r.dest * map.m_tiles_per_rank() + r.m_tile;
        out.n_idx = r.n_tile;
        out.m0 = static_cast<int32_t>(r.row_begin);
        out.n0 = static_cast<int32_t>(r.col_begin);
        out.valid = true;
        return out;
    }

    /// Destination rank and counter chunk of a tile the GEMM finished (inverse of to_gemm_tile).
    WEFT_HOST_DEVICE constexpr int32_t dest_of(const GemmTile& t) const { return t.m_idx / map.m_tiles_per_rank(); }
    WEFT_HOST_DEVICE constexpr int32_t chunk_of(const GemmTile& t) const {
        const int32_t dest = dest_of(t);
        return map.signal_index(dest, t.m_idx - dest * map.m_tiles_per_rank()) - dest * map.chunks_per_rank();
    }
};

/// GEMM+ReduceScatter's reduction on destination `dest`: the source whose partial it adds at phase `phase`
/// (0 .. num_ranks-1). Source s computes destination d's tiles at its own phase (d - s - 1) mod num_ranks,
/// so the destination visits rank dest-1 first and itself last: the order in which the partials complete.
WEFT_HOST_DEVICE constexpr int32_t rs_source_at(int32_t dest, int32_t phase, int32_t num_ranks) {
    return ((dest - 1 - phase) % num_ranks + num_ranks) % num_ranks;
}

/// Where GEMM+ReduceScatter's counters live: on the destination, one word per (source rank, chunk), so a
/// destination waits only on its own memory.
WEFT_HOST_DEVICE constexpr int32_t rs_counter_index(int32_t source, int32_t chunk, int32_t chunks_per_rank) {
    return source * chunks_per_rank + chunk;
}

}  // namespace weft
