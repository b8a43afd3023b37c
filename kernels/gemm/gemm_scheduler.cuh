// SPDX-License-Identifier: MIT
// Tile schedulers of the persistent GEMM: which tiles a CTA computes, in which order, and what the
// producer waits for before it loads a tile's rows of A.
//
// Interface (a type S, the kernel's Scheduler template argument; the contract in full, for schedulers written
// outside weft too, is weft/ops/fused_gemm.hpp's):
//   using Params = P;                                      trivially copyable kernel argument
//   __device__ S(const Params&, const GemmArgs&);          built by every thread of the CTA
//   __device__ int32_t num_tiles() const;                  tiles this CTA computes
//   __device__ GemmTile tile(int32_t i) const;             its i-th tile (same answer in every warp role)
//   __device__ device::WaitResult wait_before_load(const GemmTile&) const;
//        (or a device::Token: a wait that cannot fail)
//        called by the producer thread before it TMA-loads the A rows of tile `tile`; returns the result of a
//        device-layer wait (tile::wait_checked), whose Token the A loads take (device::tile::tma_load_2d), on n = 0
//        signals when the tile waits on nothing. A result that is not ok() (the wait gave up: its Diagnostic recorded)
//        stops the CTA's waiting: its later tiles load without waiting and the kernel runs to its end, storing and
//        signalling tiles whose data is not defined (kSchedulerWaitMayFail, gemm_sm90.cuh). Return it only where no
//        hook publishes those tiles to another rank before that rank learns of the failure (weft's ops); otherwise
//        trap (`.token_or_trap()`), as ChunkWaitScheduler does.
// CTAs of a cluster must get tiles of the same cluster tile in the same order (GemmTileGrid does this).
// The kernel calls tile(i) with increasing i in each thread (the producer i = 0, 1, ...; a consumer warpgroup its own
// subsequence), so a scheduler may walk a cursor forward (GroupedScheduler does).
// Optional: `static constexpr bool kGrouped = true` (kSchedulerGrouped) makes the tile's `group` select B's slice
// (a 3D tensor map [groups, ...]) and its `m_end` bound the rows the epilogue stores (GroupedScheduler).
// Optional: `__device__ bool dropped(int32_t i) const` (kSchedulerDropsTiles) makes the producer call
// `wait_before_load(tile, i)` instead, and the consumers store nothing of a tile i it calls dropped (the hook still
// hears of the tile); every consumer thread must get the same answer once the tile's stages landed
// (AgGemmScheduler: a differing call descriptor found by the producer).
#pragma once

#include "gemm/gemm_hooks.cuh"
#include "weft/common/gemm_config.hpp"
#include "weft/common/gemm_hook_params.hpp"
#include "weft/device/tile.cuh"
#include "weft/device/token.cuh"
#include "weft/ptx/mbarrier.cuh"
#include "weft/ptx/tma.cuh"

namespace weft::kernels::gemm {

// Parameter structs (PersistentSchedulerParams, ChunkWaitParams): weft/common/gemm_hook_params.hpp, which
// host-only code includes to fill them.

using weft::gemm::GroupedSchedulerParams;
using weft::gemm::GroupedStatus;
using weft::gemm::GroupedStatusCode;

/// Whether a scheduler hands out grouped tiles (GemmTile::group, GemmTile::m_end; GroupedScheduler).
template <class Scheduler>
inline constexpr bool kSchedulerGrouped = requires { requires Scheduler::kGrouped; };

/// Persistent striding over the swizzled tile grid: cluster c takes cluster tiles c, c + C, c + 2C, ...
/// where C is the number of clusters in the grid. Waits for nothing.
/// Split-K (kCfg.splits > 1, no clusters): S = min(kCfg.splits, k-blocks) splits, so none is empty; the work units are
/// (tile, split) pairs, T x S of them for T tiles, unit u = tile u % T in swizzled order, split u / T (the units
/// running at once share A's and B's k ranges in L2); CTA c takes units c, c + C, ... as above; `split(i)` names its
/// i-th unit's split and `num_splits()` S (the optional scheduler capability the kernel's split-K path needs:
/// gemm_sm90.cuh).
template <GemmConfig kCfg>
class PersistentScheduler {
public:
    using Params = PersistentSchedulerParams;
    static constexpr int32_t kClusterSize = kCfg.cluster_m * kCfg.cluster_n;

    __device__ PersistentScheduler(const Params&, const GemmArgs& args)
        : grid_(kCfg, args.m, args.n),
          cluster_idx_(static_cast<int32_t>(blockIdx.x) / kClusterSize),
          num_clusters_(static_cast<int32_t>(gridDim.x) / kClusterSize),
          cta_rank_(kClusterSize == 1 ? 0 : static_cast<int32_t>(ptx::cluster_cta_rank())),
          splits_(min(kCfg.splits, (args.k + kCfg.tile_k - 1) / kCfg.tile_k)) {}

    __device__ int32_t num_tiles() const {
        const int32_t total = grid_.num_cluster_tiles() * splits_;
        return cluster_idx_ < total ? (total - 1 - cluster_idx_) / num_clusters_ + 1 : 0;
    }
    __device__ GemmTile tile(int32_t i) const {
        const int32_t u = cluster_idx_ + i * num_clusters_;
        return grid_.tile(kCfg.splits == 1 ? u : u % grid_.num_cluster_tiles(), cta_rank_);
    }
    /// The split of this CTA's i-th work unit (0 without split-K), and how many splits each tile has.
    __device__ int32_t split(int32_t i) const {
        return kCfg.splits == 1 ? 0 : (cluster_idx_ + i * num_clusters_) / grid_.num_cluster_tiles();
    }
    __device__ int32_t num_splits() const { return splits_; }
    // NOTE: A was written before the launch, in stream order, so there is nothing to wait for or fence.
    __device__ device::Token wait_before_load(const GemmTile&) const { return device::Token::assume_local_data(); }

    __device__ const GemmTileGrid& grid() const { return grid_; }

private:
    GemmTileGrid grid_;
    int32_t cluster_idx_, num_clusters_, cta_rank_;
    int32_t splits_;
};

/// Persistent striding as above, but before loading the A rows of a tile the producer waits until the
/// signal of every chunk of `rows_per_chunk` rows that the tile touches is >= `expected` (another kernel,
/// stream or GPU writes A chunk by chunk and raises flags[chunk] with release semantics). This is the hook
/// an AllGather+GEMM uses; here it is generic over who writes the chunks. With value_mode kEpoch the value
/// awaited is *epoch * expected, read when the tile is scheduled (graph-safe: see SignalValueMode). The wait is
/// tile::wait's (one thread, ld.acquire.sys polls, fence.proxy.async.global after them), bounded by
/// Params::timeout_ns; a timeout records a kTileWait Diagnostic naming Params::world_rank in Params::diag (when
/// given) and traps, inline (the checked form: no call may sit in a kernel that issues wgmma). It traps rather than
/// run on: the hook of a custom fused GEMM may publish the tiles to another rank, and these waits carry no abort word
/// that would tell that rank in time.
template <GemmConfig kCfg>
class ChunkWaitScheduler {
public:
    using Params = ChunkWaitParams;

    __device__ ChunkWaitScheduler(const Params& p, const GemmArgs& args) : base_({}, args), p_(p), m_(args.m) {}

    __device__ int32_t num_tiles() const { return base_.num_tiles(); }
    __device__ GemmTile tile(int32_t i) const { return base_.tile(i); }

    __device__ device::Token wait_before_load(const GemmTile& t) const {
        const uint64_t expected = detail::signal_value(p_.value_mode, p_.epoch, p_.expected);
        const int32_t last_row = (t.m0 + kCfg.tile_m < m_ ? t.m0 + kCfg.tile_m : m_) - 1;
        const int32_t first_chunk = t.m0 / p_.rows_per_chunk;
        const int32_t num_chunks = t.m0 < m_ ? last_row / p_.rows_per_chunk - first_chunk + 1 : 0;
        // The chunks were written through the generic proxy; the wait's proxy fence lets the TMA loads see them.
        return device::tile::wait_checked(device::Thread{}, wait_ctx(), p_.flags + first_chunk, num_chunks, Cmp::kGe,
                                          expected)
            .token_or_trap();
    }

private:
    /// The device layer's view of this scheduler's bound and diagnostics: no team and no heap (a diagnostic names
    /// no owner of the flag).
    __device__ DeviceCtx wait_ctx() const {
        DeviceCtx ctx{};
        ctx.world_rank = p_.world_rank;
        ctx.timeout_ns = p_.timeout_ns;
        ctx.diag = p_.diag;
        return ctx;
    }

    PersistentScheduler<kCfg> base_;
    Params p_;
    int32_t m_;
};

/// Grouped GEMM (MoE experts): one persistent walk over every group's tiles. The groups' row counts (and, contiguous,
/// row offsets) are read from device memory when the kernel starts, so a kernel on the device (an expert-parallel
/// dispatch) may produce them and a captured launch replays with the counts of its replay. Group g has
/// ceil(count_g / tile_m) x ceil(N / tile_n) tiles; the tiles of all groups form one linear sequence (group 0's in
/// GemmTileGrid's swizzled order over its own rows, then group 1's, ...) and CTA c takes tiles c, c + C, c + 2C, ...
/// of it: a hot group is spread over every CTA, an empty group has no tile (its B is never read). The constructor is
/// warp-collective (every thread of the CTA builds the scheduler, converged, as the kernel does): each warp reads 32
/// groups' counts per round of loads and sums their tiles with a warp scan, which also places the
/// cursor on the group of the CTA's first tile, so that tile costs no further load (a CTA of a one-wave launch then
/// starts its loads after one round, wherever its group sits). Each thread then walks the cursor forward as it asks
/// for tiles in increasing order (the kernel's contract), reading kLookahead groups per round of loads: the memory
/// latencies of a launch are about groups / 32 + groups / kLookahead per thread, not 2 x groups.
/// Cluster-free (is_valid_grouped). A bad count (negative, over capacity, rows outside A) is clamped into its bounds,
/// never read or written past them, and block 0 records the first one in Params::status (when given). Waits for
/// nothing (A was written in stream order before the launch).
template <GemmConfig kCfg>
class GroupedScheduler {
public:
    using Params = GroupedSchedulerParams;
    static constexpr bool kGrouped = true;
    // Groups whose counts one step of the cursor's walk reads at once. NOTE: 8 spilled in the producer's 40 registers
    // under the wait schedulers (GroupedWaitScheduler, GatheredWaitScheduler).
    static constexpr int32_t kLookahead = 4;
    static_assert(kCfg.cluster_m == 1 && kCfg.cluster_n == 1, "GroupedScheduler: cluster-free configs only");

    /// Warp-collective: every lane of every warp of the CTA must call it, converged.
    __device__ GroupedScheduler(const Params& p, const GemmArgs& args)
        : p_(p),
          rows_(args.m),
          n_tiles_((args.n + kCfg.tile_n - 1) / kCfg.tile_n),
          cta_(static_cast<int32_t>(blockIdx.x)),
          num_ctas_(static_cast<int32_t>(gridDim.x)) {
        constexpr unsigned kAll = 0xffffffffu;
        const int32_t lane = static_cast<int32_t>(threadIdx.x % 32);
        int32_t total = 0;
        for (int32_t g0 = 0; g0 < p_.num_groups; g0 += 32) {
            const int32_t g = g0 + lane;
            int32_t count = 0, offset = 0;
            if (g < p_.num_groups) count = group_rows(g, p_.counts[g], p_.offsets != nullptr ? p_.offsets[g] : 0, &offset);
            const int32_t tiles = group_tiles(count);
            // The cursor onto the group of this CTA's first tile (cta_), from the counts in the lanes: an inclusive
            // scan of the round's tiles, then the lane whose range holds it hands over its group.
            int32_t incl = tiles;
#pragma unroll
            for (int32_t d = 1; d < 32; d *= 2) {
                const int32_t v = __shfl_up_sync(kAll, incl, d);
                if (lane >= d) incl += v;
            }
            const int32_t rel = cta_ - total;
            const unsigned holds = __ballot_sync(kAll, tiles > 0 && rel >= incl - tiles && rel < incl);
            if (holds != 0) {
                const int32_t src = __ffs(holds) - 1;
                group_ = g0 + src;
                base_ = total + __shfl_sync(kAll, incl - tiles, src);
                group_tiles_ = __shfl_sync(kAll, tiles, src);
                group_count_ = __shfl_sync(kAll, count, src);
                group_offset_ = __shfl_sync(kAll, offset, src);
            }
            total += __shfl_sync(kAll, incl, 31);
        }
        total_ = total;
        if (p_.status != nullptr && blockIdx.x == 0 && threadIdx.x == 0) report_first_bad_group();
    }

    __device__ int32_t num_tiles() const { return cta_ < total_ ? (total_ - 1 - cta_) / num_ctas_ + 1 : 0; }

    __device__ GemmTile tile(int32_t i) const {
        const int32_t t = cta_ + i * num_ctas_;
        while (t >= base_ + group_tiles_) {  // t < total_: stops at a group that holds it
            // The next kLookahead groups' counts (and offsets) in one round of independent loads; the cursor then
            // moves over them up to the group that holds t.
            int32_t raw[kLookahead], first[kLookahead];
#pragma unroll
            for (int32_t j = 0; j < kLookahead; ++j) {
                const int32_t g = group_ + 1 + j;
                raw[j] = g < p_.num_groups ? p_.counts[g] : 0;
                first[j] = g < p_.num_groups && p_.offsets != nullptr ? p_.offsets[g] : 0;
            }
#pragma unroll
            for (int32_t j = 0; j < kLookahead; ++j) {
                if (t >= base_ + group_tiles_) {
                    base_ += group_tiles_;
                    ++group_;
                    int32_t value = 0, limit = 0;
                    GroupedStatusCode code = GroupedStatusCode::kOk;
                    group_count_ = clamp_rows(group_, raw[j], first[j], &group_offset_, &code, &value, &limit);
                    group_tiles_ = group_tiles(group_count_);
                }
            }
        }
        const GemmTileGrid grid(kCfg, group_count_, n_tiles_ * kCfg.tile_n);
        GemmTile out = grid.tile(t - base_, 0);
        out.m0 += group_offset_;
        out.group = group_;
        out.m_end = group_offset_ + group_count_;
        return out;
    }

    __device__ device::Token wait_before_load(const GemmTile&) const { return device::Token::assume_local_data(); }

private:
    __device__ __forceinline__ int32_t group_tiles(int32_t count) const {
        return (count + kCfg.tile_m - 1) / kCfg.tile_m * n_tiles_;
    }

    /// Group g's rows from its count `raw` (and, contiguous, its first row `first`), clamped into its bounds; its
    /// first row in *offset; a bad count's code, value and bound in the rest (unchanged when the count is good).
    __device__ __forceinline__ int32_t clamp_rows(int32_t g, int32_t raw, int32_t first, int32_t* offset,
                                                  GroupedStatusCode* code, int32_t* value, int32_t* limit) const {
        int32_t count = raw < 0 ? 0 : raw;
        if (raw < 0) {
            *code = GroupedStatusCode::kCountNegative;
            *value = raw;
        }
        if (p_.offsets == nullptr) {
            *offset = g * p_.capacity;
            if (count > p_.capacity) {
                *code = GroupedStatusCode::kCountOverCapacity;
                *value = raw;
                *limit = p_.capacity;
                count = p_.capacity;
            }
        } else {
            *offset = first < 0 ? 0 : (first > rows_ ? rows_ : first);
            const int32_t room = rows_ - *offset;
            if (first < 0 || count > room) {
                if (*code == GroupedStatusCode::kOk) {
                    *code = GroupedStatusCode::kRowsOutOfRange;
                    *value = first < 0 ? first : first + count;
                    *limit = rows_;
                }
                count = first < 0 ? 0 : room;
            }
        }
        return count;
    }

    /// Group g's rows from its count and first row, clamped, and its first row in *offset (clamp_rows without the
    /// report).
    __device__ __forceinline__ int32_t group_rows(int32_t g, int32_t raw, int32_t first, int32_t* offset) const {
        int32_t value = 0, limit = 0;
        GroupedStatusCode code = GroupedStatusCode::kOk;
        return clamp_rows(g, raw, first, offset, &code, &value, &limit);
    }

    /// Records the first bad group (one thread, when Params::status is given): kReportBatch groups per round of loads.
    // NOTE: one thread, apart from the warps' sum: a warp-collective report (ballot, then one lane's record) left a
    // word of the kernel's state spilled across the warp-role split (CUDA 13).
    __device__ void report_first_bad_group() const {
        constexpr int32_t kReportBatch = 8;
        for (int32_t g0 = 0; g0 < p_.num_groups; g0 += kReportBatch) {
            int32_t raw[kReportBatch], first[kReportBatch];
#pragma unroll
            for (int32_t j = 0; j < kReportBatch; ++j) {
                const int32_t g = g0 + j;
                raw[j] = g < p_.num_groups ? p_.counts[g] : 0;
                first[j] = g < p_.num_groups && p_.offsets != nullptr ? p_.offsets[g] : 0;
            }
#pragma unroll
            for (int32_t j = 0; j < kReportBatch; ++j) {
                int32_t offset = 0, value = 0, limit = 0;
                GroupedStatusCode code = GroupedStatusCode::kOk;
                (void)clamp_rows(g0 + j, raw[j], first[j], &offset, &code, &value, &limit);
                if (g0 + j < p_.num_groups && code != GroupedStatusCode::kOk) {
                    record(g0 + j, code, value, limit);
                    return;
                }
            }
        }
    }

    __device__ void record(int32_t g, GroupedStatusCode code, int32_t value, int32_t limit) const {
        // The first bad group of the first launch that finds one claims the record.
        if (atomicCAS(&p_.status->code, 0, -1) == 0) {
            p_.status->group = g;
            p_.status->value = value;
            p_.status->limit = limit;
            __threadfence_system();
            atomicExch(&p_.status->code, static_cast<int32_t>(code));
        }
    }

    const Params& p_;
    int32_t rows_, n_tiles_, cta_, num_ctas_, total_ = 0;
    // The cursor: the group holding the last tile asked for, the index of its first tile, its tiles and rows.
    mutable int32_t group_ = -1, base_ = 0, group_tiles_ = 0, group_count_ = 0, group_offset_ = 0;
};

/// GroupedScheduler whose producer waits, before loading a tile's rows of A, until its group's signal reaches the
/// expected value (GroupedWaitParams): a fused MoE layer starts an expert's tiles as soon as its rows have arrived.
/// With Params::groups_ready, the counts themselves come from a kernel running alongside: the constructor (every
/// thread of the CTA, right after the kernel's barrier) first waits for that word, then reads them. That wait comes
/// before any role starts (no mbarrier has an arrival or a TMA load pending), so a CTA whose wait gives up ends there,
/// every thread together, with `exit` (Diagnostic recorded, abort word raised; no trap). The producer's per-group
/// wait, inside the pipeline, stops the CTA's waiting when it gives up (the pipeline runs to its end), or traps when
/// Params::diag is null (nothing would record the failure).
template <GemmConfig kCfg>
class GroupedWaitScheduler {
public:
    using Params = weft::gemm::GroupedWaitParams;
    static constexpr bool kGrouped = true;

    __device__ GroupedWaitScheduler(const Params& p, const GemmArgs& args) : base_(counts_ready(p), args), p_(p) {}

    __device__ int32_t num_tiles() const { return base_.num_tiles(); }
    __device__ GemmTile tile(int32_t i) const { return base_.tile(i); }

    __device__ device::WaitResult wait_before_load(const GemmTile& t) const {
        const device::WaitResult r =
            device::tile::wait_checked(device::Thread{}, wait_ctx(p_), p_.flags + t.group, 1, Cmp::kGe, expected(p_));
        if (!r.ok() && p_.diag == nullptr) __trap();  // no record of the failure: the kernel must not end normally
        return r;
    }

private:
    __device__ static uint64_t expected(const Params& p) {
        return detail::signal_value(p.value_mode, p.epoch, p.expected);
    }
    __device__ static DeviceCtx wait_ctx(const Params& p) {
        DeviceCtx ctx{};
        ctx.world_rank = p.world_rank;
        ctx.timeout_ns = p.timeout_ns;
        ctx.diag = p.diag;
        ctx.abort_flag = p.abort_flag;
        return ctx;
    }
    /// The groups, once their counts may be read (a bounded whole-CTA wait on groups_ready when it is given). A wait
    /// that gives up ends the CTA here (ok() is the same in every thread: they exit together, before the pipeline).
    __device__ static const GroupedSchedulerParams& counts_ready(const Params& p) {
        if (p.groups_ready != nullptr) {
            device::tile::wait_checked(device::Block{}, wait_ctx(p), p.groups_ready, 1, Cmp::kGe, expected(p))
                .token_or_exit();
        }
        return p.groups;
    }

    GroupedScheduler<kCfg> base_;
    const Params& p_;
};

}  // namespace weft::kernels::gemm
