// SPDX-License-Identifier: MIT
// Kernel parameters of the GEMM's tile schedulers and epilogue hooks (kernels/gemm/gemm_scheduler.cuh,
// gemm_hooks.cuh), in a header that host-only code can include to fill them for a JIT launch.
#pragma once

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

}  // namespace weft::gemm
