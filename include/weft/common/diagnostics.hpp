// SPDX-License-Identifier: MIT
// The record a timed-out device spin leaves for the host (host and device agree on this layout).
#pragma once

#include "weft/common/macros.hpp"  // fixed-width integers under g++, nvcc and NVRTC

namespace weft {

/// What kind of spin gave up.
enum class SpinKind : uint32_t {
    kNone = 0,
    kSignalWait = 1,
    kBarrier = 2,
    kTileWait = 3,
    kOther = 4,
    kUnreachablePeer = 5,     ///< not a spin: a put/get/signal named a peer that is not load/store reachable
    kCollectiveMismatch = 6,  ///< not a spin: ranks called a collective with different arguments
                              ///< (expected = this rank's call descriptor, observed = the peer's)
    /// Not a spin: a collective kernel found this rank's collective state out of step at its start
    /// (check_collective_start) or end: expected = its call descriptor, waited_ns = the epoch it runs under << 16 |
    /// CollectiveState::done as found (at most 0xFFFF); cmp kNe (start): another kernel already finished under that
    /// epoch, observed = that kernel's claim (collective_epoch_claim); cmp kLt (start) / kGe (end): the done count
    /// was too large, observed = grid << 32 | the count.
    kCollectiveEpoch = 7,
    /// Not a spin: all_to_all_v's counts disagree across a pair of ranks: expected = the bytes this rank expects
    /// from `peer` (its recv count), observed = the bytes `peer` sends it (its send count).
    kAllToAllCounts = 8,
    /// Not a spin: a device-language call refused its arguments (waited_ns says which): kBadGroupSize (a Warp or
    /// Warpgroup in a block whose thread count is not a multiple of its size: expected = the group's size, observed =
    /// the block's threads), kBadBarrierId (a Warpgroup on named barrier 0, __syncthreads' own, or past 15: observed =
    /// the id), kBadWaitCount (tile::wait of a negative count: observed = the count as int64).
    kBadArgument = 9,
};

/// What a kBadArgument diagnostic refused (its waited_ns).
enum BadArgument : uint64_t {
    kBadGroupSize = 1,
    kBadBarrierId = 2,
    kBadWaitCount = 3,
};

/// Comparison a wait was waiting for (OpenSHMEM's SHMEM_CMP_*).
enum class Cmp : uint32_t { kEq = 0, kNe = 1, kGt = 2, kGe = 3, kLt = 4, kLe = 5 };

/// Values of a World's abort word (DeviceCtx::abort_flag): zero while the World runs; the first non-zero value
/// stays until World::clear_diagnostics. Every bounded device spin polls it (spin.cuh) and stops when it is set.
enum AbortCode : uint32_t {
    kAbortNone = 0,
    kAbortByDeviceWait = 1,  ///< a device wait on this rank gave up (its Diagnostic says which)
    kAbortByHost = 2,        ///< the host: World::abort, a dead peer, a peer's abort (World::check_diagnostics says)
};

/// Written by the first spin that gives up on a rank (claimed with an atomic on `claimed`), read by the host
/// after the kernel ends. Lives in host-mapped pinned memory so that the host can read it even after a trap
/// (symm_at_or_trap, the GEMM kernels) has made the CUDA context unusable.
struct Diagnostic {
    uint32_t claimed;       ///< 0 = empty; set to 1 by the writer before the fields, to 2 after them
    SpinKind kind;
    Cmp cmp;
    int32_t rank;           ///< rank whose kernel gave up
    int32_t block_x, block_y, block_z;
    int32_t thread_x;
    uint64_t signal_addr;   ///< device address of the word it spun on
    uint64_t expected;      ///< the value it compared against
    uint64_t observed;      ///< the last value it read
    uint64_t waited_ns;     ///< how long it spun
    int32_t peer;           ///< rank that owns the signal, or -1 when unknown
    int32_t line;           ///< source line of the spin (for weft's own kernels)
    uint32_t aborted;       ///< 1: the spin stopped because the World's abort word was set, not at its bound
    /// Not part of a diagnosis: the device address of this rank's TraceBuffer (weft/common/trace.hpp) when the World
    /// traces (WEFT_TRACE), else 0. Written by the host before any traced kernel runs; kept by clear_diagnostics.
    uint64_t trace_buffer;
};

}  // namespace weft
