// SPDX-License-Identifier: MIT
// Kernel parameters of the GEMM's tile schedulers and epilogue hooks (kernels/gemm/gemm_scheduler.cuh,
// gemm_hooks.cuh), in a header that host-only code can include to fill them for a JIT launch.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/common/macros.hpp"

namespace weft::gemm {

// NOTE: parameter structs live at namespace scope (not nested in the class templates) so that host-only code
// names and fills them without the device templates. New fields go at the end, and zero means the behaviour
// that existed before the field: a value-initialised `Params{}` with the old fields set keeps working.

/// Where a hook's signal value (or awaited value) comes from.
enum class SignalValueMode : int32_t {
    /// The value is the kernel argument itself. A launch captured in a CUDA graph replays the captured value,
    /// so a replay signals (or waits for) the generation of the capture, not of the replay.
    kArgument = 0,
    /// The value is read at run time from a device word `epoch` (a uint64 call counter) times the argument:
    /// a captured launch reads the counter of its replay. The counter is advanced in stream order BEFORE
    /// the launch (weft::ops::gemm_advance_epoch, or any kernel ordered before it), never during it, so every
    /// CTA of a launch reads the same value.
    kEpoch = 1,
};

/// PersistentScheduler's parameters (none).
struct PersistentSchedulerParams {
    int32_t unused = 0;
};

/// ChunkWaitScheduler's parameters.
struct ChunkWaitParams {
    const uint64_t* flags;   ///< one signal per chunk of A rows
    int32_t rows_per_chunk;  ///< rows of A per signal
    int32_t world_rank;      ///< the rank a timeout's Diagnostic names (World::rank(), as DeviceCtx::world_rank)
    uint64_t expected;       ///< kArgument: the value to wait for (>=); kEpoch: the value per epoch (the wait
                             ///< is for >= *epoch * expected; 1 for a generation flag)
    uint64_t timeout_ns;     ///< bound on each wait
    Diagnostic* diag;        ///< where a timeout is recorded (host-mapped), or nullptr
    SignalValueMode value_mode;  ///< kArgument (default) or kEpoch
    int32_t reserved2;
    const uint64_t* epoch;   ///< kEpoch: the call counter (device memory); unused otherwise
};

/// What a grouped GEMM's device-side check of its group sizes found (GroupedScheduler). Zero-initialised by its
/// owner; the first launch that finds a bad size claims `code` (0 -> a GroupedStatusCode) and fills the rest.
enum class GroupedStatusCode : int32_t {
    kOk = 0,
    kCountNegative = 1,       ///< counts[group] < 0: clamped to 0
    kCountOverCapacity = 2,   ///< masked: counts[group] > capacity: clamped to capacity
    kRowsOutOfRange = 3,      ///< contiguous: offsets[group] < 0 or offsets[group] + counts[group] > rows of A
                              ///< (clamped to the rows inside A)
};

/// The record of GroupedStatusCode (device or host-mapped memory, 16 bytes, written once per claim).
struct GroupedStatus {
    int32_t code;   ///< GroupedStatusCode; 0 = nothing found
    int32_t group;  ///< the first group found bad (by the kernel's block 0)
    int32_t value;  ///< counts[group] as read (kRowsOutOfRange: offsets[group] + counts[group])
    int32_t limit;  ///< the bound it broke (capacity, or rows of A; 0 for kCountNegative)
};

/// GroupedScheduler's parameters: the groups (experts) of a grouped GEMM, read on the device at run time.
///   contiguous (offsets != nullptr): group g's rows of A and D are [offsets[g], offsets[g] + counts[g]) of the
///     [rows, K] / [rows, N] views;
///   masked (offsets == nullptr): group g's rows are [g * capacity, g * capacity + counts[g]) (A [groups, capacity,
///     K] seen as [groups * capacity, K]), counts clamped to [0, capacity].
/// B is [groups, N, K] (or [groups, K, N]) through a 3D tensor map: B's coordinate `group` is the tile's group.
struct GroupedSchedulerParams {
    const int32_t* counts;   ///< [num_groups] rows of each group (device memory, written before the launch)
    const int32_t* offsets;  ///< [num_groups] first row of each group (contiguous), or nullptr (masked)
    int32_t num_groups;
    int32_t capacity;        ///< masked: rows per group of A and D; contiguous: unused (0)
    GroupedStatus* status;   ///< where a bad count is recorded (device or host-mapped), or nullptr
};

/// NoEpilogueHook's parameters (none).
struct NoEpilogueHookParams {
    int32_t unused = 0;
};

/// How TileSignalHook raises its signal.
enum class TileSignalMode : int32_t {
    kSetPerTile = 0,     ///< flags[m_idx * num_n_tiles + n_idx] = value (st.release.sys)
    kAddPerTileRow = 1,  ///< flags[m_idx] += value (red.release.sys.add): a counter per row of tiles
};

/// TileSignalHook's parameters.
struct TileSignalParams {
    uint64_t* flags;      ///< kSetPerTile: [num_m_tiles * num_n_tiles]; kAddPerTileRow: [num_m_tiles]
    uint64_t value;       ///< generation (set) or increment (add); kEpoch with kSetPerTile: the generation
                          ///< per epoch (the tile's flag is set to *epoch * value)
    int32_t num_n_tiles;  ///< row length of the per-tile flag array
    TileSignalMode mode;
    SignalValueMode value_mode;  ///< kArgument (default) or kEpoch. kAddPerTileRow adds `value` in both modes
                                 ///< (a counter grows by num_n_tiles * value per call: a waiter in epoch mode
                                 ///< waits for *epoch * num_n_tiles * value)
    int32_t reserved;
    const uint64_t* epoch;  ///< kEpoch: the call counter (device memory); unused otherwise
};

/// How GroupedTileSignalHook raises its signal (add-only counters: nothing to reset between calls, graph-safe).
enum class GroupedSignalMode : int32_t {
    kAddPerGroup = 0,       ///< flags[group] += value per finished tile: a group's counter grows by
                            ///< ceil(count / tile_m) * ceil(N / tile_n) * value per call
    kAddPerGroupTileRow = 1,  ///< flags[group * group_stride + m_idx] += value: a counter per (group, row of tiles),
                              ///< growing by ceil(N / tile_n) * value per call
};

/// GroupedTileSignalHook's parameters.
struct GroupedTileSignalParams {
    uint64_t* flags;       ///< kAddPerGroup: [groups]; kAddPerGroupTileRow: [groups * group_stride]
    uint64_t value;        ///< the increment
    int32_t group_stride;  ///< kAddPerGroupTileRow: counters per group (>= the most tile rows a group can have)
    GroupedSignalMode mode;
    DeviceCtx ctx;  ///< traced builds (WEFT_TRACE) record a "tile (m, n)" event per stored tile in ctx's trace buffer;
                    ///< zero: none
};

/// GroupedWaitScheduler's parameters: per-group wait before a tile's rows of A are loaded (a fused MoE layer whose A
/// arrives on the device while the GEMM runs). The producer waits until flags[group] >= expected (kArgument) or
/// >= *epoch * expected (kEpoch), acquire at system scope then the proxy fence TMA needs, bounded by timeout_ns (and
/// stopped by the World's abort word when `abort_flag` is given); a wait that gives up records a kTileWait Diagnostic
/// in `diag` (when given) naming world_rank, raises the abort word and ends the CTA's waiting: the kernel runs to its
/// end (no trap; the CUDA context stays usable) and the call's output is not defined (the op reports the Diagnostic).
/// The wait for `groups_ready` comes before the pipeline starts: a CTA whose wait gives up ends there with `exit`
/// (every thread together, no trap: the CUDA context stays usable).
struct GroupedWaitParams {
    GroupedSchedulerParams groups;  ///< the groups (GroupedScheduler's parameters)
    const uint64_t* flags;          ///< [groups] one signal per group
    uint64_t expected;
    uint64_t timeout_ns;
    Diagnostic* diag;
    SignalValueMode value_mode;
    int32_t world_rank;
    const uint64_t* epoch;          ///< kEpoch: the call counter (device memory); unused otherwise
    /// nullptr: the counts (and offsets) were written before the launch, in stream order. Otherwise a kernel running
    /// alongside writes them and then raises this word: every CTA waits (its thread 0 polls, the CTA synchronises)
    /// until it reaches the value `flags` are waited for (expected, or *epoch * expected), before it reads any count.
    const uint64_t* groups_ready;
    /// The World's host-mapped abort word (DeviceCtx::abort_flag), or nullptr: the waits stop once it is non-zero
    /// (a peer's wait gave up, a peer died, World::abort), and a wait that gives up raises it.
    uint32_t* abort_flag;
};

/// Arguments of the fp8 front of the masked grouped GEMM (kernels/gemm/grouped_dequant.cuh, one kernel parameter).
struct GroupedDequantArgs {
    const unsigned char* codes;  ///< e4m3 [G, capacity, K]
    const float* scales;         ///< [G, capacity, K / 128]
    unsigned short* out;         ///< bf16 [G, capacity, K]
    const int32_t* counts;       ///< [G] valid rows per group (device memory, written before the launch)
    int64_t lda_codes;           ///< codes' row stride (bytes = elements), a multiple of 16
    int64_t lds;                 ///< scales' row stride (floats)
    int64_t ldo;                 ///< out's row stride (elements), a multiple of 8
    int32_t groups, capacity, k;  ///< k: a multiple of 128
};

/// Threads per CTA of the dequantisation kernel (one warp per row).
inline constexpr int kGroupedDequantThreads = 256;

}  // namespace weft::gemm
