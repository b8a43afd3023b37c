// SPDX-License-Identifier: MIT
// All-to-all: the per-peer byte layout one call hands its kernel (host and device).
#pragma once

#include "weft/common/macros.hpp"

namespace weft {

/// The collectives' world-size limit (64 ranks): the table below has a row per possible peer.
inline constexpr int kMaxAllToAllRanks = 64;

/// Bytes at the start of an epoch's staging half that the peers write before the entry barrier: slot q (uint64) the
/// heap offset of peer q's chunk for this rank, slot kMaxAllToAllRanks + q its size in bytes (the receiver checks it
/// against its own recv count before it reads); staged data follows.
inline constexpr uint64_t kAllToAllHeaderBytes = 16 * kMaxAllToAllRanks;

/// One call's byte layout, passed by value beside CollectiveParams. Entry q concerns peer q.
struct AllToAllTable {
    uint64_t send_offset[kMaxAllToAllRanks];    ///< where this rank's chunk for q starts in `in`
    uint64_t send_bytes[kMaxAllToAllRanks];     ///< its size
    uint64_t source_offset[kMaxAllToAllRanks];  ///< where peers read it: in `src` (direct) or after the staging header
    uint64_t recv_offset[kMaxAllToAllRanks];    ///< where q's chunk for this rank goes in `out`
    uint64_t recv_bytes[kMaxAllToAllRanks];     ///< its size (q's send_bytes for this rank)
};

}  // namespace weft
