// SPDX-License-Identifier: MIT
// Tile maps: which chunk of which rank a compute tile needs, its signal index, and rank-rotated orders.
//
// A tile map describes a tensor sharded by rows over the ranks and split into chunks (the unit of
// communication, one signal each), and the compute tiles of a kernel over it. The same constexpr
// object, evaluated on the host and on the device, answers both sides' questions, so a producer and
// a consumer agree on signal indices by construction:
//  - AllGatherTileMap     AllGather into GEMM: M-tiles of a gathered A[M, K]; which chunks (signals)
//                         a tile waits for; tiles ordered local data first; chunks in arrival order.
//  - ReduceScatterTileMap GEMM into ReduceScatter: output tiles grouped by the rank that owns their
//                         rows; next rank's tiles first, local last; how many tiles each signal counts.
// Signal values are epochs: a chunk's signal is raised by one add per call, a reduce-scatter signal
// by one add per finished tile, so a consumer of call number `epoch` (1, 2, ...) waits for
// `>= epoch` (all-gather) or `>= epoch * expected_count(signal)` (reduce-scatter); nothing is reset.
// Plain constexpr index arithmetic (no allocation, no exceptions): check invalid_reason() first.
#pragma once

#include "weft/common/macros.hpp"
#include "weft/common/math.hpp"

namespace weft {

/// An inclusive range of signal indices [first, last].
struct SignalRange {
    int32_t first;
    int32_t last;
    WEFT_HOST_DEVICE constexpr int32_t count() const { return last - first + 1; }
};

/// One chunk of one rank's shard: where its rows are in the full tensor, and its signal.
struct ChunkInfo {
    int32_t rank;        ///< rank that owns the chunk's rows
    int32_t chunk;       ///< index of the chunk within that rank's shard
    int32_t signal_idx;  ///< rank * chunks_per_rank() + chunk
    int64_t row_begin;   ///< first row in the full (gathered / unreduced) tensor
    int64_t num_rows;    ///< rows in this chunk (the last chunk of a shard may be short)
};

/// AllGather into GEMM: A[M, K] with M = rows_per_rank * num_ranks is gathered from the ranks (rank r
/// owns rows [r * rows_per_rank, (r + 1) * rows_per_rank)); every shard is split into chunks of
/// chunk_rows rows (one signal each, numbered rank-major); the GEMM computes M-tiles of tile_m rows. A
/// tile may straddle chunks and ranks: it needs the contiguous signal range signals_for_tile(t).
struct AllGatherTileMap {
    int64_t rows_per_rank;  ///< rows of A each rank owns (M / num_ranks)
    int32_t num_ranks;
    int64_t chunk_rows;     ///< rows per chunk (>= 1; >= rows_per_rank means one chunk per rank)
    int64_t tile_m;         ///< rows per compute tile

    /// nullptr when the map is usable, else what is wrong.
    WEFT_HOST_DEVICE constexpr const char* invalid_reason() const {
        if (num_ranks < 1) return "num_ranks must be >= 1";
        if (rows_per_rank < 1) return "rows_per_rank must be >= 1";
        if (chunk_rows < 1) return "chunk_rows must be >= 1";
        if (tile_m < 1) return "tile_m must be >= 1";
        if (rows_per_rank > (int64_t{1} << 40) / num_ranks) return "rows_per_rank * num_ranks is too large";
        if (ceil_div(rows_per_rank, chunk_rows) * num_ranks > int64_t{0x7fffffff}) return "too many signals";
        if (ceil_div(rows_per_rank * num_ranks, tile_m) > int64_t{0x7fffffff}) return "too many tiles";
        return nullptr;
    }
    WEFT_HOST_DEVICE constexpr bool is_valid() const { return invalid_reason() == nullptr; }

    WEFT_HOST_DEVICE constexpr int64_t total_rows() const { return rows_per_rank * num_ranks; }
    WEFT_HOST_DEVICE constexpr int32_t chunks_per_rank() const {
        return static_cast<int32_t>(ceil_div(rows_per_rank, chunk_rows));
    }
    /// Signal words the map uses (rank-major: signal = rank * chunks_per_rank() + chunk).
    WEFT_HOST_DEVICE constexpr int32_t num_signals() const { return num_ranks * chunks_per_rank(); }
    WEFT_HOST_DEVICE constexpr int32_t num_tiles() const { return static_cast<int32_t>(ceil_div(total_rows(), tile_m)); }

    WEFT_HOST_DEVICE constexpr int32_t signal_index(int32_t rank, int32_t chunk) const {
        return rank * chunks_per_rank() + chunk;
    }
    /// The chunk behind a signal index.
    WEFT_HOST_DEVICE constexpr ChunkInfo chunk(int32_t signal_idx) const {
        const int32_t r = signal_idx / chunks_per_rank();
        const int32_t c = signal_idx % chunks_per_rank();
        const int64_t begin_in_shard = c * chunk_rows;
        const int64_t end_in_shard = min64(begin_in_shard + chunk_rows, rows_per_rank);
        return ChunkInfo{r, c, signal_idx, r * rows_per_rank + begin_in_shard, end_in_shard - begin_in_shard};
    }
    /// The chunk that holds row `row` of the full tensor.
    WEFT_HOST_DEVICE constexpr ChunkInfo chunk_of_row(int64_t row) const {
        const auto r = static_cast<int32_t>(row / rows_per_rank);
        const auto c = static_cast<int32_t>((row % rows_per_rank) / chunk_rows);
        return chunk(signal_index(r, c));
    }

    /// First row of tile `t` and its number of rows (the last tile may be short).
    WEFT_HOST_DEVICE constexpr int64_t tile_row_begin(int32_t t) const { return t * tile_m; }
    WEFT_HOST_DEVICE constexpr int64_t tile_rows(int32_t t) const {
        return min64(tile_m, total_rows() - tile_row_begin(t));
    }
    /// The signals tile `t` must wait for: every chunk that holds one of its rows (contiguous because
    /// signals are numbered in row order).
    WEFT_HOST_DEVICE constexpr SignalRange signals_for_tile(int32_t t) const {
        const int64_t first_row = tile_row_begin(t);
        const int64_t last_row = first_row + tile_rows(t) - 1;
        return SignalRange{chunk_of_row(first_row).signal_idx, chunk_of_row(last_row).signal_idx};
    }
    /// The ranks whose data tile `t` needs: [first_rank_for_tile(t), last_rank_for_tile(t)].
    WEFT_HOST_DEVICE constexpr int32_t first_rank_for_tile(int32_t t) const {
        return static_cast<int32_t>(tile_row_begin(t) / rows_per_rank);
    }
    WEFT_HOST_DEVICE constexpr int32_t last_rank_for_tile(int32_t t) const {
        return static_cast<int32_t>((tile_row_begin(t) + tile_rows(t) - 1) / rows_per_rank);
    }

    /// The consumer's tile order on rank `rank`: the i-th tile to compute, i in [0, num_tiles()). A
    /// rotation that starts at the first tile beginning inside the local shard: local tiles first, then
    /// those needing rank+1, rank+2, ... (matching chunk_at's arrival order); a tile straddling ranks
    /// r-1 and r comes last, after rank r-1's data.
    WEFT_HOST_DEVICE constexpr int32_t tile_at(int32_t rank, int32_t i) const {
        const int64_t start = ceil_div(rank * rows_per_rank, tile_m) % num_tiles();
        return static_cast<int32_t>((start + i) % num_tiles());
    }

    /// The producer's chunk order for rank `rank` (what it copies or receives first): the i-th chunk,
    /// i in [0, num_signals()): its own shard first, then rank+1's, rank+2's, ..., each in row order.
    WEFT_HOST_DEVICE constexpr ChunkInfo chunk_at(int32_t rank, int32_t i) const {
        const int32_t source = (rank + i / chunks_per_rank()) % num_ranks;
        return chunk(signal_index(source, i % chunks_per_rank()));
    }

    WEFT_HOST_DEVICE static constexpr int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
};

/// One output tile of a GEMM whose result is reduce-scattered by rows.
struct RsTile {
    int32_t dest;        ///< rank that owns (and reduces) the tile's rows
    int32_t m_tile;      ///< M-tile index within dest's segment
    int32_t n_tile;      ///< N-tile index
    int32_t signal_idx;  ///< the counter this tile raises when finished
    int64_t row_begin;   ///< first row in the full output C[M, N]
    int64_t num_rows;
    int64_t col_begin;
    int64_t num_cols;
};

/// GEMM into ReduceScatter: every rank computes a partial C[M, N] with M = rows_per_rank * num_ranks;
/// rank d owns (reduces) rows [d * rows_per_rank, (d + 1) * rows_per_rank). Output tiles are tile_m x
/// tile_n and never straddle a destination (each segment is tiled separately; its last M-tile may be
/// short). Each segment is split into chunks of chunk_rows rows, one counter signal each (rank-major:
/// signal = dest * chunks_per_rank() + chunk); every finished tile adds 1 to its chunk's counter, and
/// the chunk is complete when the counter reaches epoch * expected_count(signal).
struct ReduceScatterTileMap {
    int64_t rows_per_rank;  ///< output rows each rank owns (M / num_ranks)
    int32_t num_ranks;
    int64_t cols;           ///< N
    int64_t tile_m;
    int64_t tile_n;
    int64_t chunk_rows;     ///< rows per counter: a multiple of tile_m, or >= rows_per_rank (one per rank)

    WEFT_HOST_DEVICE constexpr const char* invalid_reason() const {
        if (num_ranks < 1) return "num_ranks must be >= 1";
        if (rows_per_rank < 1) return "rows_per_rank must be >= 1";
        if (cols < 1) return "cols must be >= 1";
        if (tile_m < 1 || tile_n < 1) return "tile_m and tile_n must be >= 1";
        if (chunk_rows < 1) return "chunk_rows must be >= 1";
        if (chunk_rows < rows_per_rank && chunk_rows % tile_m != 0) {
            return "chunk_rows must be a multiple of tile_m (or >= rows_per_rank) so that no tile straddles two counters";
        }
        if (rows_per_rank > (int64_t{1} << 40) / num_ranks) return "rows_per_rank * num_ranks is too large";
        if (ceil_div(rows_per_rank, tile_m) * ceil_div(cols, tile_n) * num_ranks > int64_t{0x7fffffff}) {
            return "too many tiles";
        }
        return nullptr;
    }
    WEFT_HOST_DEVICE constexpr bool is_valid() const { return invalid_reason() == nullptr; }

    WEFT_HOST_DEVICE constexpr int32_t m_tiles_per_rank() const {
        return static_cast<int32_t>(ceil_div(rows_per_rank, tile_m));
    }
    WEFT_HOST_DEVICE constexpr int32_t n_tiles() const { return static_cast<int32_t>(ceil_div(cols, tile_n)); }
    /// Tiles whose rows belong to one destination (the same for every destination).
    WEFT_HOST_DEVICE constexpr int32_t tiles_per_rank() const { return m_tiles_per_rank() * n_tiles(); }
    WEFT_HOST_DEVICE constexpr int32_t num_tiles() const { return num_ranks * tiles_per_rank(); }
    WEFT_HOST_DEVICE constexpr int32_t chunks_per_rank() const {
        return static_cast<int32_t>(ceil_div(rows_per_rank, effective_chunk_rows()));
    }
    WEFT_HOST_DEVICE constexpr int32_t num_signals() const { return num_ranks * chunks_per_rank(); }

    /// The destination rank of row `row` of the full output.
    WEFT_HOST_DEVICE constexpr int32_t dest_of_row(int64_t row) const {
        return static_cast<int32_t>(row / rows_per_rank);
    }
    WEFT_HOST_DEVICE constexpr int32_t signal_index(int32_t dest, int32_t m_tile) const {
        return dest * chunks_per_rank() + static_cast<int32_t>(m_tile * tile_m / effective_chunk_rows());
    }

    /// Tile `local_idx` (in [0, tiles_per_rank()), M-major) of destination `dest`.
    WEFT_HOST_DEVICE constexpr RsTile tile(int32_t dest, int32_t local_idx) const {
        const int32_t m = local_idx / n_tiles();
        const int32_t n = local_idx % n_tiles();
        const int64_t row_in_segment = m * tile_m;
        return RsTile{dest,
                      m,
                      n,
                      signal_index(dest, m),
                      dest * rows_per_rank + row_in_segment,
                      min64(tile_m, rows_per_rank - row_in_segment),
                      n * tile_n,
                      min64(tile_n, cols - n * tile_n)};
    }

    /// The producer's (GEMM's) tile order on rank `rank`: the i-th tile, i in [0, num_tiles()). Tiles
    /// for rank+1 first (their reduction can start earliest), then rank+2, ..., this rank's own last.
    WEFT_HOST_DEVICE constexpr RsTile tile_at(int32_t rank, int32_t i) const {
        const int32_t dest = (rank + 1 + i / tiles_per_rank()) % num_ranks;
        return tile(dest, i % tiles_per_rank());
    }

    /// Rows of the chunk behind counter `signal_idx`, in the full output.
    WEFT_HOST_DEVICE constexpr ChunkInfo chunk(int32_t signal_idx) const {
        const int32_t d = signal_idx / chunks_per_rank();
        const int32_t c = signal_idx % chunks_per_rank();
        const int64_t begin_in_segment = c * effective_chunk_rows();
        const int64_t end_in_segment = min64(begin_in_segment + effective_chunk_rows(), rows_per_rank);
        return ChunkInfo{d, c, signal_idx, d * rows_per_rank + begin_in_segment, end_in_segment - begin_in_segment};
    }

    /// How many finished tiles raise counter `signal_idx` once per call (multiply by the epoch).
    WEFT_HOST_DEVICE constexpr int32_t expected_count(int32_t signal_idx) const {
        return static_cast<int32_t>(ceil_div(chunk(signal_idx).num_rows, tile_m)) * n_tiles();
    }

    /// The order in which rank `rank` consumes (reduces) its own chunks: counters of its segment, in
    /// row order; the i-th, i in [0, chunks_per_rank()).
    WEFT_HOST_DEVICE constexpr int32_t local_signal_at(int32_t rank, int32_t i) const {
        return rank * chunks_per_rank() + i;
    }

    /// chunk_rows clamped to the segment (a chunk never spans two destinations).
    WEFT_HOST_DEVICE constexpr int64_t effective_chunk_rows() const {
        return chunk_rows < rows_per_rank ? chunk_rows : rows_per_rank;
    }
    WEFT_HOST_DEVICE static constexpr int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
};

}  // namespace weft
