// SPDX-License-Identifier: MIT
// What host ops and collective kernels share: kernel configs, the argument block, the device state, partitions.
//
// Host (src/ops/*.cpp) and device (kernels/all_reduce, all_gather, reduce_scatter) include this file, so the
// partition of a message into blocks and slices is computed by one piece of code that is unit-tested on the CPU.
// NVRTC-compatible: no standard library beyond weft/common/macros.hpp.
#pragma once

#include "weft/common/dtype.hpp"
#include "weft/common/macros.hpp"

namespace weft {

/// Most thread blocks a collective kernel launches (per-block barrier slots and counters are sized by it).
inline constexpr uint32_t kMaxCollectiveBlocks = 256;
/// Block and slice boundaries fall on multiples of this many bytes (so 16-byte vectors never straddle them),
/// whatever each rank's buffer alignment is: the partition must be the same on every rank.
inline constexpr uint64_t kCollectiveGranuleBytes = 16;
/// Payload bytes per LL line (two 8-byte words, each {4 bytes of data, 4-byte flag}).
inline constexpr uint64_t kLowLatencyPayloadBytes = 8;
/// Bytes per LL line in the receive buffer.
inline constexpr uint64_t kLowLatencyLineBytes = 16;

/// A half-open range [begin, end) of elements (or bytes, or lines).
struct Span {
    uint64_t begin = 0;
    uint64_t end = 0;
    WEFT_HOST_DEVICE constexpr uint64_t size() const { return end - begin; }
    WEFT_HOST_DEVICE constexpr bool empty() const { return end <= begin; }
};

/// Part `idx` of `parts` of [0, count): the parts are contiguous, in order, cover [0, count) exactly, start on
/// multiples of `granule` (the last ends at `count`), and differ in size by at most one granule (trailing parts
/// may be empty when count is small). `parts` >= 1, `granule` >= 1.
WEFT_HOST_DEVICE constexpr Span split_span(uint64_t count, uint64_t parts, uint64_t idx, uint64_t granule) {
    const uint64_t units = (count + granule - 1) / granule;
    const uint64_t base = units / parts;
    const uint64_t extra = units % parts;
    const uint64_t first = idx * base + (idx < extra ? idx : extra);
    const uint64_t len = base + (idx < extra ? 1 : 0);
    uint64_t b = first * granule;
    uint64_t e = (first + len) * granule;
    b = b < count ? b : count;
    e = e < count ? e : count;
    return Span{b, e};
}

/// Part `part` (of `parts`) of slice `slice` (of `num_slices`) of [0, count): the two-level split the two-shot
/// all-reduce uses (slice q is reduced by rank q; block b of every rank handles part b of every slice).
WEFT_HOST_DEVICE constexpr Span split_slice_part(uint64_t count, uint64_t num_slices, uint64_t slice, uint64_t parts,
                                                 uint64_t part, uint64_t granule) {
    const Span s = split_span(count, num_slices, slice, granule);
    const Span p = split_span(s.size(), parts, part, granule);
    return Span{s.begin + p.begin, s.begin + p.end};
}

/// The LL flag of kernel epoch `epoch`: never 0 (so zeroed buffers never match) and different for consecutive
/// epochs (and for epochs two apart, which share a buffer parity).
WEFT_HOST_DEVICE constexpr uint32_t low_latency_flag(uint64_t epoch) {
    return static_cast<uint32_t>(epoch % 0xFFFFFFFFull) + 1u;
}

// ------------------------------------------------------------------------------------------------
// Call descriptors: every rank's kernel carries one 64-bit word describing its call, and every block that moves
// data compares the peers' words with its own before it does (the entry barrier's descriptor row, the LL header
// lines, the GEMM+AR's ready flags, the AG+GEMM's and AG attention's ready slots, the GEMM+RS's per-source slots). The
// high 32 bits say what the call is, so that a mismatch reads in words on the host (weft::format_diagnostic); the low
// 20 bits digest everything else (buffer offsets, flags, rounds):
//
//   63..60 op (CollectiveOp)   59..56 algorithm (the op's enum value)   55..52 dtype + 1 (0: bytes)
//   51..20 count (elements, or bytes with no dtype; saturates at 2^32 - 1)   19..0 digest of every field and word

/// The op a call descriptor names.
enum class CollectiveOp : uint32_t {
    kNone = 0,
    kAllGather = 1,
    kReduceScatter = 2,
    kAllReduce = 3,
    kAllToAll = 4,
    kAttentionCombine = 5,
    kAllToAllV = 6,
    kGemmAr = 7,
    kAgGemm = 8,        ///< count: the gathered M (every rank's rows); dtype: A's
    kGemmRs = 9,        ///< count: M (the partials' rows); dtype: the partials'
    kAgAttention = 10,  ///< count: S (every rank's rows); dtype: Q/K/V's
    kMoeAgGemm = 11,    ///< TP MoE layer 0; count: M (tokens); dtype: bf16; the routing in the digest
};

/// Count values at and above this read as "at least" in a descriptor.
inline constexpr uint64_t kCallDescriptorMaxCount = 0xFFFFFFFFull;

/// The digest of the words after the op's fields (a 64-bit mix, folded to 20 bits by make_call_descriptor).
WEFT_HOST_DEVICE constexpr uint64_t call_descriptor_mix(uint64_t h, uint64_t w) {
    h ^= w + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return (h ^ (h >> 31)) * 0xbf58476d1ce4e5b9ull;
}

/// The descriptor of a call: op, algorithm (0..15), dtype (or none: counts are bytes), count and the digest `mix`
/// of the other words (start from 0, fold each word in with call_descriptor_mix). Never 0.
WEFT_HOST_DEVICE constexpr uint64_t make_call_descriptor(CollectiveOp op, uint32_t algo, bool has_dtype, DType dtype,
                                                         uint64_t count, uint64_t mix) {
    const uint64_t dt = has_dtype ? static_cast<uint64_t>(dtype) + 1 : 0;
    const uint64_t shown = count < kCallDescriptorMaxCount ? count : kCallDescriptorMaxCount;
    uint64_t h = call_descriptor_mix(mix, static_cast<uint64_t>(op));
    h = call_descriptor_mix(h, algo);
    h = call_descriptor_mix(h, dt);
    h = call_descriptor_mix(h, count);
    const uint64_t digest = (h ^ (h >> 20) ^ (h >> 40)) & 0xFFFFFull;
    return (static_cast<uint64_t>(op) & 0xFull) << 60 | (static_cast<uint64_t>(algo) & 0xFull) << 56 |
           (dt & 0xFull) << 52 | shown << 20 | digest;
}

WEFT_HOST_DEVICE constexpr CollectiveOp call_descriptor_op(uint64_t d) { return static_cast<CollectiveOp>(d >> 60); }
WEFT_HOST_DEVICE constexpr uint32_t call_descriptor_algo(uint64_t d) { return static_cast<uint32_t>(d >> 56) & 0xFu; }
/// The dtype's value + 1, or 0 when the count is in bytes.
WEFT_HOST_DEVICE constexpr uint32_t call_descriptor_dtype_plus_one(uint64_t d) {
    return static_cast<uint32_t>(d >> 52) & 0xFu;
}
WEFT_HOST_DEVICE constexpr uint64_t call_descriptor_count(uint64_t d) { return (d >> 20) & 0xFFFFFFFFull; }

/// Compile-time knobs of the reducing kernels (all-reduce one-shot / two-shot / low-latency, reduce-scatter).
struct ReduceKernelConfig {
    DType dtype = DType::kBF16;   ///< bf16, f16 or f32; 16-bit types accumulate in fp32
    int32_t max_ranks = 8;        ///< world-size bucket (8, 16, 32, 64): rank loops unroll to min(max_ranks, 8)
    int32_t vec_bytes = 16;       ///< widest access (2..16 bytes); misaligned buffers step down at run time
    int32_t block_threads = 512;  ///< threads per block (a multiple of 32, >= max_ranks)
};

/// Shared by host heuristics and the kernels' static_assert.
WEFT_HOST_DEVICE constexpr bool is_valid(const ReduceKernelConfig& c) {
    const bool dtype_ok = c.dtype == DType::kBF16 || c.dtype == DType::kF16 || c.dtype == DType::kF32;
    const bool ranks_ok = c.max_ranks == 8 || c.max_ranks == 16 || c.max_ranks == 32 || c.max_ranks == 64;
    const bool vec_ok = (c.vec_bytes == 2 || c.vec_bytes == 4 || c.vec_bytes == 8 || c.vec_bytes == 16) &&
                        c.vec_bytes >= dtype_bytes(c.dtype);
    const bool threads_ok =
        c.block_threads >= 32 && c.block_threads <= 1024 && c.block_threads % 32 == 0 && c.block_threads >= c.max_ranks;
    return dtype_ok && ranks_ok && vec_ok && threads_ok;
}

/// Compile-time knobs of the data-moving kernels (all-gather push / low-latency, the copy-engine helpers).
struct CopyKernelConfig {
    int32_t max_ranks = 8;        ///< world-size bucket (8, 16, 32, 64)
    int32_t vec_bytes = 16;       ///< widest access; misaligned buffers step down at run time
    int32_t block_threads = 512;  ///< threads per block (a multiple of 32, >= max_ranks)
};

WEFT_HOST_DEVICE constexpr bool is_valid(const CopyKernelConfig& c) {
    const bool ranks_ok = c.max_ranks == 8 || c.max_ranks == 16 || c.max_ranks == 32 || c.max_ranks == 64;
    const bool vec_ok =
        c.vec_bytes == 1 || c.vec_bytes == 2 || c.vec_bytes == 4 || c.vec_bytes == 8 || c.vec_bytes == 16;
    const bool threads_ok =
        c.block_threads >= 32 && c.block_threads <= 1024 && c.block_threads % 32 == 0 && c.block_threads >= c.max_ranks;
    return ranks_ok && vec_ok && threads_ok;
}

/// Blocks of `block_threads` threads that a collective kernel must fit on one SM (its __launch_bounds__): two of
/// 256, so that the kernels of ranks sharing a GPU (grids <= their SM budgets) are always resident together.
WEFT_HOST_DEVICE constexpr int collective_min_blocks_per_sm(int block_threads) { return block_threads <= 256 ? 2 : 1; }

/// The world-size bucket of `num_ranks` (0 when above 64).
WEFT_HOST_DEVICE constexpr int32_t collective_rank_bucket(int32_t num_ranks) {
    return num_ranks <= 8 ? 8 : num_ranks <= 16 ? 16 : num_ranks <= 32 ? 32 : num_ranks <= 64 ? 64 : 0;
}

/// One rank's collective bookkeeping, in its own device memory (not symmetric), advanced by the kernels
/// themselves so that CUDA graph replays stay in step (a host counter would be frozen by capture).
struct CollectiveState {
    uint64_t epoch;  ///< kernels launched so far; picks the buffer parity and the LL flag
    uint32_t done;   ///< blocks of the running kernel that finished (the last one advances `epoch`)
    uint32_t pad;
    /// collective_epoch_claim of the last kernel a block of which finished here (0: none yet): what the next kernel's
    /// blocks compare their own epoch with (check_collective_start)
    uint64_t claim;
    uint64_t arrivals[kMaxCollectiveBlocks];  ///< barriers block slot b has completed (add-only counting)
};

/// The claim a collective kernel's blocks leave in CollectiveState::claim when they finish: bit 63 set (so that it is
/// never 0), the low 31 bits of the kernel's epoch in bits 62..32, the low 32 bits of its call descriptor (the digest
/// and the count's low bits) below.
WEFT_HOST_DEVICE constexpr uint64_t collective_epoch_claim(uint64_t epoch, uint64_t descriptor) {
    return 1ull << 63 | (epoch & 0x7FFFFFFFull) << 32 | (descriptor & 0xFFFFFFFFull);
}

/// What a collective kernel's block finds at its start (check_collective_start).
enum class CollectiveStart : uint32_t {
    kOk = 0,
    /// Another kernel (another descriptor) already finished blocks under this kernel's epoch: the epoch was not
    /// advanced between two kernels of this rank, whose lines and descriptors would then land in the slots its peers
    /// are still reading for the earlier one.
    kEpochReused = 1,
    /// CollectiveState::done counts at least as many finished blocks as this kernel has, or counts finished blocks
    /// under another kernel's claim: an earlier kernel's blocks were miscounted, so the last of them never advanced
    /// the epoch, or this kernel's count reaches its grid early and advances the epoch while blocks of it have yet to
    /// start (those would run under the next epoch).
    kDoneCount = 2,
};

/// The check every block of a collective kernel makes before it writes anything (BlockState): `claim` and `done` as
/// read from this rank's CollectiveState at the block's start (done first, with acquire: see below), next to the
/// `epoch` it runs under; `descriptor` and `grid` are the kernel's own. Pure: unit-tested on the CPU.
WEFT_HOST_DEVICE constexpr CollectiveStart check_collective_start(uint64_t claim, uint64_t epoch, uint64_t descriptor,
                                                                  uint64_t done, uint64_t grid) {
    if (done >= grid) return CollectiveStart::kDoneCount;
    const uint64_t mine = collective_epoch_claim(epoch, descriptor);
    // A block of this very kernel may have finished already (same claim); an earlier kernel of another epoch is the
    // normal case.
    if (claim != 0 && claim != mine && (claim >> 32) == (mine >> 32)) return CollectiveStart::kEpochReused;
    // NOTE: blocks counted done at a block's start are blocks of this very kernel (the last block of the kernel before
    // reset the count), and each stored this kernel's claim before counting itself with release; `done` read with
    // acquire before `claim` therefore shows them with this kernel's claim. A count under another claim was left by
    // another kernel: it would reach this grid early and advance the epoch while blocks of this kernel have yet to
    // start (CollectiveState::done, finish).
    if (done != 0 && claim != mine) return CollectiveStart::kDoneCount;
    return CollectiveStart::kOk;
}

/// Flags of CollectiveParams::flags.
enum CollectiveFlags : uint32_t {
    kCollectiveStageInput = 1u << 0,   ///< copy `in` into the staging half of this epoch before the entry barrier
    kCollectiveExitBarrier = 1u << 1,  ///< peers read a user buffer of this rank: meet again before returning
};

/// The argument block every collective kernel receives (by value, with the DeviceCtx). Counts are elements of
/// the kernel's unit (reducing kernels: elements of `dtype`; copy kernels: bytes).
struct CollectiveParams {
    const void* in;           ///< this rank's input (any device memory)
    void* out;                ///< this rank's output (symmetric for the push all-gather)
    void* src;                ///< symmetric data peers read (a user buffer), or nullptr: staging[epoch parity]
    void* res;                ///< symmetric home of reduced slices (two-shot), or nullptr: staging[epoch parity]
    uint64_t count;           ///< all-reduce: message; all-gather: shard; reduce-scatter: output
    uint64_t in_stride;       ///< reduce-scatter: elements between ranks' slices in `in`
    uint64_t src_stride;      ///< reduce-scatter: elements between ranks' slices in the source peers read
    uint64_t out_stride;      ///< all-gather: units between ranks' slots in `out`
    CollectiveState* state;   ///< this rank's device state
    uint64_t* barrier_flags;  ///< symmetric [kMaxCollectiveBlocks][num_ranks] arrival counters
    uint64_t* descriptors;    ///< symmetric [2][num_ranks] call descriptors (by epoch parity)
    uint64_t* ce_flags;  ///< symmetric [num_ranks] copy-engine flags (set to 1 by a stream write, reset by the waiter)
    uint8_t* staging;    ///< symmetric staging: [2 parities][staging_half_bytes]
    uint64_t staging_half_bytes;
    uint8_t* ll_buffer;  ///< symmetric LL receive buffer: [2 parities][num_ranks senders][ll_slot_bytes]
    uint64_t ll_slot_bytes;
    /// symmetric LL header lines: [2 parities][num_ranks senders][kMaxCollectiveBlocks] lines of
    /// kLowLatencyLineBytes; block b of an LL kernel sends its call descriptor to every peer in line b of its
    /// sender slot, with the epoch's flag (BlockState::send_ll_descriptor)
    uint8_t* ll_headers;
    /// this call's descriptor (make_call_descriptor); every rank's must match: every block compares it with the
    /// peers' after the entry barrier (barrier kernels) or before writing its output (LL kernels)
    uint64_t descriptor;
    uint32_t flags;       ///< CollectiveFlags
    uint32_t reserved;
};

}  // namespace weft
