// SPDX-License-Identifier: MIT
// Expert parallelism: limits, the workspace (where every array of every allocation lives), kernel arguments, device
// state, status record and shared-memory plans shared by the op and its kernels.
//
// The host op (weft/ops/ep.hpp, weft::ops::ep, src/ops/ep_*.cpp) fills these structs; the kernels
// (kernels/ep/*.cuh, weft::kernels::ep, compiled by NVRTC) read them. Both sides compute sizes and offsets with
// the same constexpr functions, so they cannot disagree. Plain structs of fixed-width fields: the same layout
// under g++ and NVRTC. The namespace weft::ep holds what both sides share; weft::ops::ep re-exports it.
#pragma once

#include "weft/common/macros.hpp"  // fixed-width integers under g++, nvcc and NVRTC
#include "weft/common/math.hpp"

namespace weft {
struct TraceBuffer;  // weft/common/trace.hpp
}  // namespace weft

namespace weft::ep {

inline constexpr int kMaxRanks = 64;               ///< ranks of one expert-parallel group
inline constexpr int kMaxExperts = 1024;           ///< experts in all
inline constexpr int kMaxTopk = 32;                ///< experts per token
inline constexpr int kMaxExpertAlignment = 1024;   ///< largest padding multiple of an expert segment
inline constexpr int kMaxLowLatencyTokens = 1024;  ///< low-latency max tokens per rank (route table in smem)
inline constexpr int kFp8GroupSize = 128;          ///< channels sharing one fp32 scale
inline constexpr float kFp8Max = 448.0f;           ///< largest finite e4m3 value
/// A group's absolute maximum is clamped to at least this before computing its scale, so that
/// 448 / amax stays finite: an all-zero group gets a tiny finite scale and zero codes, never NaN/inf.
inline constexpr float kFp8MinAmax = 1e-10f;

/// What a kernel found wrong. Input and capacity errors are reported here (never by truncation or
/// silence); the host turns them into a weft::Error (Buffer::check).
enum class StatusCode : uint32_t {
    kOk = 0,
    kRecvTokensOverflow = 1,  ///< normal dispatch: a rank would receive more tokens than max_recv_tokens
    kRecvRowsOverflow = 2,    ///< normal dispatch: a rank's expert-contiguous rows exceed max_recv_rows
    kInvalidExpert = 3,       ///< an expert id outside [-1, num_experts): the route is dropped
    kDuplicateExpert = 4,     ///< an expert id repeated within one token's top-k: the repeat is dropped
    /// low-latency dispatch: a source's call differs from this rank's (fp8 against bf16, or another Buffer
    /// geometry): value = this rank's call signature, limit = the source's (ll_call_signature), culprit = the source;
    /// nothing was received (counts 0; the handle's combine writes zeros)
    kCallMismatch = 5,
    /// low-latency combine: the topk_idx row of token `token` differs from the one its dispatch sent (value = the
    /// combine's row digest, limit = the dispatch's); that token's row of out is written as zeros
    kCombineRoutingMismatch = 6,
};

/// One rank's status record, in host-mapped pinned memory (readable by the host without a
/// synchronisation). The first error wins (claimed 0 -> 1, fields, system fence, 1 -> 2); later ones
/// are dropped until the host clears it.
struct Status {
    uint32_t claimed;  ///< 0 = no error; 2 = the fields below are complete
    StatusCode code;
    int32_t rank;          ///< rank whose kernel wrote the record
    int32_t culprit_rank;  ///< rank whose capacity or input it concerns
    int64_t value;         ///< required rows/tokens, or the offending expert id
    int64_t limit;         ///< the capacity, or the number of experts
    int64_t token;         ///< token index for input errors, -1 otherwise
    int64_t slot;          ///< top-k slot for input errors, -1 otherwise
    uint64_t call;         ///< 1-based call number of the kernel on this buffer
    uint32_t kernel;       ///< KernelId of the reporting kernel
    uint32_t pad;
};

/// Which kernel reported a status.
enum class KernelId : uint32_t {
    kLayout = 1,
    kNormalDispatch = 2,
    kNormalCombine = 3,
    kLowLatencyDispatch = 4,
    kLowLatencyCombine = 5
};

/// The modes a Buffer serves (bit set): each mode's arrays exist only when its bit is set.
enum Modes : int32_t { kNormalMode = 1, kLowLatencyMode = 2 };

/// The limits of one Buffer, validated on the host. Every size below derives from these.
struct Geometry {
    int32_t num_ranks;
    int32_t rank;
    int32_t num_experts;
    int32_t hidden;  ///< channels per token (bf16)
    int32_t topk;
    int32_t max_tokens;        ///< tokens per rank per call
    int32_t expert_alignment;  ///< normal mode: each expert segment starts at a multiple of this
    int32_t modes;             ///< Modes bits
    int64_t max_recv_tokens;   ///< normal mode: distinct (source rank, token) pairs one rank receives
    int64_t max_recv_rows;     ///< normal mode: expert-contiguous rows one rank receives, padding included

    WEFT_HOST_DEVICE constexpr bool normal() const { return (modes & kNormalMode) != 0; }
    WEFT_HOST_DEVICE constexpr bool low_latency() const { return (modes & kLowLatencyMode) != 0; }
    WEFT_HOST_DEVICE constexpr int32_t local_experts() const { return num_experts / num_ranks; }
    WEFT_HOST_DEVICE constexpr int32_t owner(int32_t expert) const { return expert / local_experts(); }
    WEFT_HOST_DEVICE constexpr int64_t row_bytes() const { return int64_t{hidden} * 2; }
    /// Normal mode: int32 words of one receive record (header of 4 + a (position, weight) pair per slot).
    WEFT_HOST_DEVICE constexpr int32_t meta_ints() const { return static_cast<int32_t>(round_up(4 + 2 * topk, 4)); }
    /// Normal mode: partial rows one rank can get back in a combine (one per token and destination).
    WEFT_HOST_DEVICE constexpr int64_t max_send_rows() const {
        return int64_t{max_tokens} * (topk < num_ranks ? topk : num_ranks);
    }
    /// Normal mode: the rows of the mailbox one source writes (per-expert route counts, then per-rank
    /// token counts, then the ordinal of the handle it dispatches on: NormalArgs::handle_ordinal).
    WEFT_HOST_DEVICE constexpr int32_t mailbox_ints() const { return num_experts + num_ranks + 1; }
    /// Low-latency mode: bytes of one receive slot (payload, then a 16-byte trailer {token, slot}).
    WEFT_HOST_DEVICE constexpr int64_t ll_slot_bytes() const { return round_up(row_bytes(), 16) + 16; }
    /// Low-latency fp8 payload: H codes, then H / 128 fp32 scales.
    WEFT_HOST_DEVICE constexpr int64_t ll_fp8_scales() const { return hidden / kFp8GroupSize; }
    /// Low-latency output rows per local expert.
    WEFT_HOST_DEVICE constexpr int64_t ll_rows_per_expert() const { return int64_t{num_ranks} * max_tokens; }
};

/// Normal mode device state (private to each rank, zeroed once). Advanced by the kernels themselves:
/// nothing is reset between calls or CUDA-graph replays.
struct NormalState {
    uint64_t dispatch_calls;     ///< dispatches completed on this buffer
    uint64_t combine_calls;      ///< combines completed (of valid dispatches)
    uint32_t dispatch_arrivals;  ///< blocks of the running dispatch that finished
    uint32_t combine_arrivals;
    uint64_t data_expected[kMaxRanks];     ///< rows received from each source so far (its signal's value)
    uint64_t partial_expected[kMaxRanks];  ///< partial rows received from each rank so far
};

// ---- low-latency mailbox words: a count and the sender's call signature ----
//
// Each (source, local expert) word of the low-latency mailbox, which every receiving block reads before it copies a
// row, carries the route count in its low bits and the sender's call signature in the others. A receiver compares
// every source's signature with its own: the arguments that must agree across ranks (fp8 or bf16, the Buffer's
// geometry) are checked with no word and no wait added.
//
//   31..12 digest of the geometry (hidden, num_experts, topk, max_tokens, num_ranks; 20 bits)   11 fp8   10..0 count

inline constexpr uint32_t kLlCountBits = 11;  ///< counts up to kMaxLowLatencyTokens (1024) fit
inline constexpr uint32_t kLlCountMask = (1u << kLlCountBits) - 1u;
inline constexpr uint32_t kLlFp8Bit = 1u << kLlCountBits;
static_assert(kMaxLowLatencyTokens <= static_cast<int>(kLlCountMask), "a low-latency count must fit its bits");

/// The mailbox word's signature of a low-latency dispatch on a Buffer of geometry `g` (count bits zero; never 0).
WEFT_HOST_DEVICE constexpr uint32_t ll_call_signature(const Geometry& g, bool fp8) {
    uint64_t h = 0x243f6a8885a308d3ull;
    const int64_t words[5] = {g.hidden, g.num_experts, g.topk, g.max_tokens, g.num_ranks};
    for (int i = 0; i < 5; ++i) {
        h ^= static_cast<uint64_t>(words[i]) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
        h = (h ^ (h >> 31)) * 0xbf58476d1ce4e5b9ull;
    }
    uint32_t digest = static_cast<uint32_t>((h ^ (h >> 20) ^ (h >> 40)) & 0xFFFFFull);
    digest = digest == 0 ? 1u : digest;  // a zeroed word never matches
    return digest << (kLlCountBits + 1) | (fp8 ? kLlFp8Bit : 0u);
}
/// The word a source writes: its signature and a route count (0..kMaxLowLatencyTokens).
WEFT_HOST_DEVICE constexpr uint32_t ll_mailbox_word(uint32_t signature, int32_t count) {
    return signature | (static_cast<uint32_t>(count) & kLlCountMask);
}
WEFT_HOST_DEVICE constexpr int32_t ll_mailbox_count(uint32_t word) { return static_cast<int32_t>(word & kLlCountMask); }
WEFT_HOST_DEVICE constexpr uint32_t ll_mailbox_signature(uint32_t word) { return word & ~kLlCountMask; }
WEFT_HOST_DEVICE constexpr bool ll_signature_fp8(uint32_t signature) { return (signature & kLlFp8Bit) != 0; }
WEFT_HOST_DEVICE constexpr uint32_t ll_signature_digest(uint32_t signature) { return signature >> (kLlCountBits + 1); }

/// Low-latency device state (private, zeroed once, advanced by the kernels).
struct LowLatencyState {
    uint64_t dispatch_send_calls;
    uint64_t dispatch_recv_calls;
    uint64_t combine_send_calls;
    uint64_t combine_recv_calls;
    uint32_t arrivals[4];  ///< per phase: dispatch send, dispatch recv, combine send, combine recv
};

/// Words of a normal handle's `info` array.
enum NormalInfo : int32_t {
    kInfoValid = 0,       ///< 1 when the dispatch moved data (no capacity error anywhere)
    kInfoNumTokens = 1,   ///< T of this rank in that dispatch
    kInfoRecvTokens = 2,  ///< distinct (source, token) pairs received
    kInfoRecvRows = 3,    ///< expert-contiguous rows incl. padding
    kInfoCall = 4,        ///< the dispatch's call number on the buffer
    kInfoInts = 8,
};

// ---- the workspace: every array of every allocation, placed once ----
//
// An EP Buffer and its handles own five allocations (the Footprint's five sizes). Workspace::make computes, from
// the Geometry alone, the offset and size of every array in each of them; the pointer views below are then built
// from an allocation's base address in one call. Symmetric allocations sit at the same heap offset on every rank
// and hold their arrays at the same offsets, so a view built from a peer's mapped base points at that peer's
// arrays. Nothing is rebased field by field.

/// Alignment of every array in an EP allocation (SymmetricHeap::alloc's default alignment; cudaMallocAsync's is
/// at least as large).
inline constexpr int64_t kArrayAlign = 256;

/// `count` elements of T at byte `offset` of an allocation.
template <class T>
struct Array {
    int64_t offset;
    int64_t count;
    WEFT_HOST_DEVICE constexpr int64_t bytes() const { return count * static_cast<int64_t>(sizeof(T)); }
    WEFT_HOST_DEVICE constexpr int64_t end() const { return offset + bytes(); }
    /// The array in the allocation mapped at `base` (this rank's, or a peer's mapping of a symmetric one).
    WEFT_HOST_DEVICE T* at(uint8_t* base) const { return reinterpret_cast<T*>(base + offset); }
};

/// Places arrays one after another, each at a multiple of kArrayAlign; `bytes` ends as the allocation's size.
struct ArrayPlan {
    int64_t bytes = 0;
    template <class T>
    WEFT_HOST_DEVICE constexpr Array<T> take(int64_t count) {
        const Array<T> a{bytes, count};
        bytes += round_up(a.bytes(), kArrayAlign);
        return a;
    }
};

/// The signal arrays of a Buffer, [W] words each, in this order inside BufferSymmetricLayout::signals.
enum SignalArray : int32_t {
    kCountSignal = 0,        ///< normal: per source, mailboxes written (one per dispatch)
    kDataSignal = 1,         ///< normal: per source, rows written into this rank (cumulative)
    kPartialSignal = 2,      ///< normal: per rank, partial rows written into this rank (cumulative)
    kCombineDone = 3,        ///< normal: per rank, combines that finished reading their landing
    kLlDispatchSignal = 4,   ///< low-latency: per source, dispatch sends completed into this rank
    kLlDispatchCredit = 5,   ///< low-latency: per destination, receives it completed of this rank's data
    kLlCombineSignal = 6,    ///< low-latency: per expert rank, combine sends completed into this rank
    kLlCombineCredit = 7,    ///< low-latency: per source, combine receives it completed
    kCombineHandle = 8,      ///< normal: per rank, 1 + the ordinal of the handle whose combine last sent partials here
    kLlCombineCall = 9,      ///< low-latency, even combine calls: per expert rank, the dispatch call its rows are of
    kLlCombineCallOdd = 10,  ///< low-latency, odd combine calls: the same (kLlCombineCall's second half)
    kNumSignalArrays = 11,
};

/// The Buffer's symmetric allocation (one per rank, at the same heap offset on every rank). Only `signals` is
/// zeroed, once, before any rank launches: everything else is written before it is read in every call.
struct BufferSymmetricLayout {
    Array<uint64_t> signals;        ///< [kNumSignalArrays][W] (SignalArray order)
    Array<int32_t> normal_mailbox;  ///< normal: [2][W][mailbox_ints] per call parity, per source
    Array<uint8_t> ll_recv_slots;   ///< low-latency: [2][E_local][W][max_tokens][ll_slot_bytes]
    Array<int32_t> ll_mailbox;      ///< low-latency: [2][W][E_local] routes per (source, local expert)
    Array<uint16_t> ll_landing;     ///< low-latency: [2][max_tokens][k][H] combine rows coming back
    int64_t bytes;
};

/// The Buffer's private device allocation, zeroed once: the kernels' state.
struct BufferDeviceLayout {
    Array<NormalState> normal_state;  ///< [1] (normal)
    Array<LowLatencyState> ll_state;  ///< [1] (low-latency)
    int64_t bytes;
};

/// A NormalHandle's symmetric allocation (same heap offset on every rank).
struct NormalHandleSymmetricLayout {
    Array<uint16_t> recv_x;    ///< [max_recv_rows, H] bf16, expert-contiguous
    Array<int32_t> recv_meta;  ///< [max_recv_tokens, meta_ints] receive records
    Array<uint16_t> landing;   ///< [max_send_rows, H] partial sums coming back in combine
    int64_t bytes;
};

/// A NormalHandle's private device allocation, zeroed once.
struct NormalHandleDeviceLayout {
    Array<int32_t> tokens_per_expert;  ///< [E]
    Array<int32_t> tokens_per_rank;    ///< [W]
    Array<uint8_t> token_in_rank;      ///< [max_tokens, W]
    Array<int32_t> send_idx;           ///< [max_tokens, W]
    Array<int32_t> route_pos;          ///< [max_tokens, k]
    Array<int32_t> expert_counts;      ///< [E_local]
    Array<int32_t> expert_offsets;     ///< [E_local + 1]
    Array<int32_t> source_offsets;     ///< [W + 1]
    Array<int32_t> info;               ///< [kInfoInts]
    int64_t bytes;
};

/// A LowLatencyHandle's private device allocation, zeroed once.
struct LowLatencyHandleDeviceLayout {
    Array<uint8_t> recv_x;         ///< [E_local, W * max_tokens, H] bf16 (2 bytes a channel; e4m3 uses the first half)
    Array<float> recv_scales;      ///< [E_local, W * max_tokens, H / 128]
    Array<int32_t> recv_src_info;  ///< [E_local, W * max_tokens]
    Array<int32_t> recv_src_slot;  ///< [E_local, W * max_tokens]
    Array<int32_t> expert_counts;  ///< [E_local]
    Array<uint64_t> dispatch_call;  ///< [1] the Buffer's dispatch call (its send) whose rows the handle holds
    Array<int32_t> mismatch;        ///< [1] 1 when the last dispatch received found a call mismatch
    Array<uint32_t> route_digest;   ///< [max_tokens] the last dispatch's digest of each token's topk_idx row
    int64_t bytes;
};

/// The Buffer's arrays the normal kernels use (pointers into the Buffer's two allocations).
struct NormalBufferView {
    int32_t* mailbox;          ///< symmetric [2][W][mailbox_ints]
    uint64_t* count_signal;    ///< symmetric [W] per source: mailboxes written (one per dispatch)
    uint64_t* data_signal;     ///< symmetric [W] per source: rows written into this rank (cumulative)
    uint64_t* partial_signal;  ///< symmetric [W] per rank: partial rows written into this rank (cumulative)
    uint64_t* combine_done;    ///< symmetric [W] per rank: combines that finished reading their landing
    uint64_t* combine_handle;  ///< symmetric [W] per rank: 1 + ordinal of the handle its last combine here was on
    NormalState* state;        ///< private
};

/// The Buffer's arrays the low-latency kernels use.
struct LowLatencyBufferView {
    uint8_t* recv_slots;        ///< symmetric [2][E_local][W][max_tokens][ll_slot_bytes]
    int32_t* mailbox;           ///< symmetric [2][W][E_local] routes per (source, local expert)
    uint16_t* landing;          ///< symmetric [2][max_tokens][k][H]
    uint64_t* dispatch_signal;  ///< symmetric [W] per source: dispatch sends completed into this rank
    uint64_t* dispatch_credit;  ///< symmetric [W] per destination: receives it completed of this rank's data
    uint64_t* combine_signal;   ///< symmetric [W] per expert rank: combine sends completed into this rank
    uint64_t* combine_credit;   ///< symmetric [W] per source: combine receives it completed
    /// symmetric [2][W] per expert rank, by combine call parity: the dispatch call whose rows its combine sent here
    /// (its handle's dispatch_call), set before its combine_signal add; the receiver compares it with its handle's
    uint64_t* combine_call;
    LowLatencyState* state;     ///< private
};

/// A NormalHandle's arrays (its two allocations).
struct NormalHandleView {
    // symmetric
    uint16_t* recv_x;    ///< [max_recv_rows, H] bf16, expert-contiguous
    int32_t* recv_meta;  ///< [max_recv_tokens, meta_ints] receive records
    uint16_t* landing;   ///< [max_send_rows, H] partial sums coming back in combine
    // private: the layout
    int32_t* tokens_per_expert;  ///< [E] routes of this rank per expert
    int32_t* tokens_per_rank;    ///< [W] distinct tokens this rank sends to each rank
    uint8_t* token_in_rank;      ///< [max_tokens, W] 1 when the token goes to the rank
    int32_t* send_idx;           ///< [max_tokens, W] index among this rank's tokens for that rank, or -1
    int32_t* route_pos;          ///< [max_tokens, k] index among this rank's routes to the expert, or -1
    // private: the dispatch's results
    int32_t* expert_counts;   ///< [E_local] rows per local expert (unpadded)
    int32_t* expert_offsets;  ///< [E_local + 1] padded segment starts; last = total rows
    int32_t* source_offsets;  ///< [W + 1] first received token of each source
    int32_t* info;            ///< [kInfoInts] (NormalInfo)
};

/// A LowLatencyHandle's arrays (one private allocation).
struct LowLatencyHandleView {
    uint8_t* recv_x;         ///< [E_local, W * max_tokens, H] bf16, or e4m3 codes (H bytes a row)
    float* recv_scales;      ///< [E_local, W * max_tokens, H / 128] (fp8 only)
    int32_t* recv_src_info;  ///< [E_local, W * max_tokens] source rank * max_tokens + token
    int32_t* recv_src_slot;  ///< [E_local, W * max_tokens] the token's top-k slot
    int32_t* expert_counts;  ///< [E_local] valid rows of each local expert
    /// [1] written by every dispatch send (one node): the Buffer's dispatch call number of that send, the same on
    /// every rank for one dispatch; its combine sends it with its rows, and the receiving rank compares
    uint64_t* dispatch_call;
    /// [1] written by every dispatch receive: 1 when a source's call differed (kCallMismatch: nothing received, the
    /// combine writes zeros), else 0
    int32_t* mismatch;
    /// [max_tokens] written by every dispatch send: the digest of each of its tokens' topk_idx row, which the combine
    /// compares with the topk_idx it is given (kCombineRoutingMismatch)
    uint32_t* route_digest;
};

/// Where every array of a Buffer and its handles lives, from the Geometry alone (the same on every rank).
/// The arrays of a mode the Geometry does not serve are empty (and its handle allocations 0 bytes).
struct Workspace {
    int32_t num_ranks;
    int32_t pad0;
    BufferSymmetricLayout buffer_symmetric;
    BufferDeviceLayout buffer_device;
    NormalHandleSymmetricLayout normal_handle_symmetric;
    NormalHandleDeviceLayout normal_handle_device;
    LowLatencyHandleDeviceLayout low_latency_handle_device;

    WEFT_HOST_DEVICE static constexpr Workspace make(const Geometry& g) {
        const int64_t w = g.num_ranks;
        const int64_t t = g.max_tokens;
        const int64_t k = g.topk;
        const int64_t h = g.hidden;
        const int64_t e = g.num_experts;
        const int64_t el = g.local_experts();
        const int64_t n = g.normal() ? 1 : 0;  // multiplies the normal mode's counts
        const int64_t l = g.low_latency() ? 1 : 0;
        Workspace ws{};
        ws.num_ranks = g.num_ranks;
        {
            ArrayPlan p;
            BufferSymmetricLayout& b = ws.buffer_symmetric;
            b.signals = p.take<uint64_t>(kNumSignalArrays * w);
            b.normal_mailbox = p.take<int32_t>(n * 2 * w * g.mailbox_ints());
            b.ll_recv_slots = p.take<uint8_t>(l * 2 * el * w * t * g.ll_slot_bytes());
            b.ll_mailbox = p.take<int32_t>(l * 2 * w * el);
            b.ll_landing = p.take<uint16_t>(l * 2 * t * k * h);
            b.bytes = p.bytes;
        }
        {
            ArrayPlan p;
            BufferDeviceLayout& b = ws.buffer_device;
            b.normal_state = p.take<NormalState>(n);
            b.ll_state = p.take<LowLatencyState>(l);
            b.bytes = p.bytes;
        }
        {
            ArrayPlan p;
            NormalHandleSymmetricLayout& s = ws.normal_handle_symmetric;
            s.recv_x = p.take<uint16_t>(n * g.max_recv_rows * h);
            s.recv_meta = p.take<int32_t>(n * g.max_recv_tokens * g.meta_ints());
            s.landing = p.take<uint16_t>(n * g.max_send_rows() * h);
            s.bytes = p.bytes;
        }
        {
            ArrayPlan p;
            NormalHandleDeviceLayout& d = ws.normal_handle_device;
            d.tokens_per_expert = p.take<int32_t>(n * e);
            d.tokens_per_rank = p.take<int32_t>(n * w);
            d.token_in_rank = p.take<uint8_t>(n * t * w);
            d.send_idx = p.take<int32_t>(n * t * w);
            d.route_pos = p.take<int32_t>(n * t * k);
            d.expert_counts = p.take<int32_t>(n * el);
            d.expert_offsets = p.take<int32_t>(n * (el + 1));
            d.source_offsets = p.take<int32_t>(n * (w + 1));
            d.info = p.take<int32_t>(n * kInfoInts);
            d.bytes = p.bytes;
        }
        {
            ArrayPlan p;
            LowLatencyHandleDeviceLayout& d = ws.low_latency_handle_device;
            const int64_t rows = l * el * g.ll_rows_per_expert();
            d.recv_x = p.take<uint8_t>(rows * g.row_bytes());
            d.recv_scales = p.take<float>(rows * g.ll_fp8_scales());
            d.recv_src_info = p.take<int32_t>(rows);
            d.recv_src_slot = p.take<int32_t>(rows);
            d.expert_counts = p.take<int32_t>(l * el);
            d.dispatch_call = p.take<uint64_t>(l);
            d.mismatch = p.take<int32_t>(l);
            d.route_digest = p.take<uint32_t>(l * t);
            d.bytes = p.bytes;
        }
        return ws;
    }

    /// Signal array `which` ([W] words) of the Buffer's symmetric allocation at `symmetric`.
    WEFT_HOST_DEVICE uint64_t* signal(uint8_t* symmetric, SignalArray which) const {
        return buffer_symmetric.signals.at(symmetric) + static_cast<int64_t>(which) * num_ranks;
    }

    /// The normal kernels' Buffer arrays, from the Buffer's symmetric and device allocations.
    WEFT_HOST_DEVICE NormalBufferView normal_buffer(uint8_t* symmetric, uint8_t* device) const {
        return NormalBufferView{.mailbox = buffer_symmetric.normal_mailbox.at(symmetric),
                                .count_signal = signal(symmetric, kCountSignal),
                                .data_signal = signal(symmetric, kDataSignal),
                                .partial_signal = signal(symmetric, kPartialSignal),
                                .combine_done = signal(symmetric, kCombineDone),
                                .combine_handle = signal(symmetric, kCombineHandle),
                                .state = buffer_device.normal_state.at(device)};
    }

    /// The low-latency kernels' Buffer arrays.
    WEFT_HOST_DEVICE LowLatencyBufferView low_latency_buffer(uint8_t* symmetric, uint8_t* device) const {
        return LowLatencyBufferView{.recv_slots = buffer_symmetric.ll_recv_slots.at(symmetric),
                                    .mailbox = buffer_symmetric.ll_mailbox.at(symmetric),
                                    .landing = buffer_symmetric.ll_landing.at(symmetric),
                                    .dispatch_signal = signal(symmetric, kLlDispatchSignal),
                                    .dispatch_credit = signal(symmetric, kLlDispatchCredit),
                                    .combine_signal = signal(symmetric, kLlCombineSignal),
                                    .combine_credit = signal(symmetric, kLlCombineCredit),
                                    .combine_call = signal(symmetric, kLlCombineCall),
                                    .state = buffer_device.ll_state.at(device)};
    }

    /// A NormalHandle's arrays, from its symmetric and device allocations.
    WEFT_HOST_DEVICE NormalHandleView normal_handle(uint8_t* symmetric, uint8_t* device) const {
        const NormalHandleSymmetricLayout& s = normal_handle_symmetric;
        const NormalHandleDeviceLayout& d = normal_handle_device;
        return NormalHandleView{.recv_x = s.recv_x.at(symmetric),
                                .recv_meta = s.recv_meta.at(symmetric),
                                .landing = s.landing.at(symmetric),
                                .tokens_per_expert = d.tokens_per_expert.at(device),
                                .tokens_per_rank = d.tokens_per_rank.at(device),
                                .token_in_rank = d.token_in_rank.at(device),
                                .send_idx = d.send_idx.at(device),
                                .route_pos = d.route_pos.at(device),
                                .expert_counts = d.expert_counts.at(device),
                                .expert_offsets = d.expert_offsets.at(device),
                                .source_offsets = d.source_offsets.at(device),
                                .info = d.info.at(device)};
    }

    /// A LowLatencyHandle's arrays, from its device allocation.
    WEFT_HOST_DEVICE LowLatencyHandleView low_latency_handle(uint8_t* device) const {
        const LowLatencyHandleDeviceLayout& d = low_latency_handle_device;
        return LowLatencyHandleView{.recv_x = d.recv_x.at(device),
                                    .recv_scales = d.recv_scales.at(device),
                                    .recv_src_info = d.recv_src_info.at(device),
                                    .recv_src_slot = d.recv_src_slot.at(device),
                                    .expert_counts = d.expert_counts.at(device),
                                    .dispatch_call = d.dispatch_call.at(device),
                                    .mismatch = d.mismatch.at(device),
                                    .route_digest = d.route_digest.at(device)};
    }
};

// ---- kernel arguments ----

/// A normal dispatch and combine fused with the expert GEMMs that run alongside them (weft::ops::ep::MoeBlock): device
/// words of this rank, in private device memory. Every pointer null: not fused (the kernels touch none of them).
/// Dispatch (all three or none):
///   counts_ready   += 1 once the handle's expert_counts / expert_offsets hold this call's values (release, system
///   scope); expert_ready   [E_local] += 1 once every row of local expert e is in recv_x (its direct rows arrived and
///   its
///                  local copies stored): exactly once per dispatch for every local expert, empty ones included, so
///                  after n fused dispatches each word is n (what a GroupedWaitScheduler waits for, epoch-counted);
///   expert_rows    [E_local] scratch: the rows completed so far; zero before the call, returned to zero by its last
///                  block.
/// Combine (tile_done null or not):
///   tile_done      [E_local * tile_stride]: counter of finished tiles per (local expert, row of tiles of tile_m rows
///                  of y, from the expert's offset) raised by the GEMM that writes y (GroupedTileSignalHook,
///                  kAddPerGroupTileRow); a received token's weighted sum waits until the counters of its rows reach
///                  tile_target (y's tiles per row of tiles); the combine's last block returns the ones it used to
///                  zero.
struct NormalFused {
    uint64_t* counts_ready;
    uint64_t* expert_ready;
    uint32_t* expert_rows;
    uint64_t* tile_done;
    int32_t tile_stride;
    int32_t tile_m;
    uint64_t tile_target;
};

/// Arguments of the layout, normal dispatch and normal combine kernels (one struct for the three).
struct NormalArgs {
    Geometry geo;
    int32_t num_tokens;  ///< T of this rank for this call
    /// The handle's creation index on its Buffer (make_normal_handle is collective: the same on every rank); a
    /// dispatch whose sources dispatch on another handle moves nothing and reports kCallMismatch
    int32_t handle_ordinal;
    const uint16_t* x;        ///< [T, H] bf16
    int64_t x_stride;         ///< elements between rows
    const int32_t* topk_idx;  ///< [T, k], -1 = dropped
    int64_t idx_stride;
    const float* topk_weights;  ///< [T, k]
    int64_t weight_stride;
    const uint16_t* y;  ///< combine input [rows, H] bf16, same rows as recv_x
    int64_t y_stride;
    uint16_t* out;  ///< combine output [T, H] bf16
    int64_t out_stride;
    NormalHandleView handle;  ///< Workspace::normal_handle of the handle's allocations
    NormalBufferView buffer;  ///< Workspace::normal_buffer of the Buffer's allocations
    Status* status;           ///< host-mapped
    NormalFused fused;        ///< expert GEMMs running alongside (all null: none)
};

/// Arguments of the SwiGLU between a MoE block's two expert GEMMs (kernels/ep/moe.cuh): for the rows
/// [0, *rows_end) of `gate_up` ([rows, 2F] bf16: gate in columns [0, F), up in [F, 2F)),
/// out[r][j] = bf16(silu(gate) * up) computed in fp32 from the bf16 inputs (silu(g) = g / (1 + exp(-g))).
struct MoeSwigluArgs {
    const uint16_t* gate_up;
    int64_t gate_up_stride;  ///< elements between rows
    uint16_t* out;           ///< [rows, F] bf16
    int64_t out_stride;
    const int32_t* rows_end;  ///< device word: the rows to compute (a normal handle's expert_offsets[E_local])
    int32_t max_rows;         ///< bound on *rows_end (the views' rows)
    int32_t ffn;              ///< F, a multiple of 8
};

/// Phases of a low-latency kernel (bit set): the send half returns without waiting for anyone; the
/// receive half can be launched later.
enum LowLatencyPhase : int32_t { kPhaseSend = 1, kPhaseRecv = 2 };

/// Arguments of the low-latency dispatch and combine kernels.
struct LowLatencyArgs {
    Geometry geo;
    int32_t num_tokens;
    int32_t phases;      ///< LowLatencyPhase bits
    int32_t fp8;         ///< dispatch: 1 = quantise to e4m3 with one scale per 128 channels
    uint32_t signature;  ///< dispatch: ll_call_signature(geo, fp8), sent in and compared with every mailbox word
    const uint16_t* x;   ///< [T, H] bf16
    int64_t x_stride;
    const int32_t* topk_idx;  ///< [T, k]
    int64_t idx_stride;
    const float* topk_weights;  ///< [T, k] (combine)
    int64_t weight_stride;
    const uint16_t* y;        ///< combine input [E_local, W * max_tokens, H]
    int64_t y_expert_stride;  ///< elements between experts
    int64_t y_row_stride;     ///< elements between rows
    uint16_t* out;            ///< combine output [T, H]
    int64_t out_stride;
    LowLatencyHandleView handle;  ///< Workspace::low_latency_handle of the handle's allocation
    LowLatencyBufferView buffer;  ///< Workspace::low_latency_buffer of the Buffer's allocations
    Status* status;               ///< host-mapped
    TraceBuffer* trace;           ///< this rank's trace buffer (device memory) when the World traces, else nullptr:
                                  ///< traced builds claim their trace slots with it (weft/device/trace.cuh)
};

/// Where each trace event of a block of a low-latency launch goes in its block log (traced builds,
/// weft/device/trace.cuh: every site writes its own slot, so a defer takes no atomic). The spans first, at slots that
/// depend on the phases only (always within the log's 64): the send phase's "send", the receive phase's "recv" or
/// "combine"; then a run of num_ranks slots per per-rank event: the send phase's credit waits, the receive phase's
/// waits, and last the send phase's "notify" per rank, which only the last block writes (after its signals): past the
/// log's 64 slots (recorded at once) those go first. count() slots in all, each with one site: a block claims them all.
struct LlTraceSlots {
    int32_t phases;  ///< LowLatencyPhase bits of the launch
    int32_t num_ranks;

    WEFT_HOST_DEVICE constexpr int send() const { return (phases & kPhaseSend) != 0 ? 1 : 0; }
    WEFT_HOST_DEVICE constexpr int recv() const { return (phases & kPhaseRecv) != 0 ? 1 : 0; }
    /// The send phase's "send" span.
    WEFT_HOST_DEVICE constexpr int send_span() const { return 0; }
    /// The receive phase's "recv" (dispatch) or "combine" span.
    WEFT_HOST_DEVICE constexpr int recv_span() const { return send(); }
    /// The send phase's wait for rank r's credit.
    WEFT_HOST_DEVICE constexpr int credit_wait(int r) const { return send() + recv() + r; }
    /// The receive phase's wait for rank r's signal.
    WEFT_HOST_DEVICE constexpr int recv_wait(int r) const { return send() + recv() + send() * num_ranks + r; }
    /// The send phase's "notify" of rank r (the last block).
    WEFT_HOST_DEVICE constexpr int notify(int r) const { return send() + recv() + (send() + recv()) * num_ranks + r; }
    /// Slots in all.
    WEFT_HOST_DEVICE constexpr int count() const { return send() * (2 * num_ranks + 1) + recv() * (num_ranks + 1); }
};

/// The trace slots a block of a low-latency launch claims at its start (LlTraceSlots::count).
WEFT_HOST_DEVICE constexpr int ll_trace_events_per_block(int32_t phases, int32_t num_ranks) {
    return LlTraceSlots{phases, num_ranks}.count();
}

/// Carves one dynamic shared-memory allocation into 16-byte aligned arrays, identically on host and
/// device (the host sizes the launch with total(), the kernel takes the pointers).
struct SmemPlan {
    int64_t bytes = 0;
    WEFT_HOST_DEVICE constexpr int64_t take(int64_t n_bytes) {
        const int64_t at = bytes;
        bytes += round_up(n_bytes, 16);
        return at;
    }
};

/// Layout kernel (one block of `threads`): per-warp expert and rank histograms.
struct LayoutSmem {
    int64_t hist, rank_hist, total;
    WEFT_HOST_DEVICE static constexpr LayoutSmem make(const Geometry& g, int threads) {
        SmemPlan p;
        LayoutSmem s{};
        const int64_t warps = threads / 32;
        s.hist = p.take(warps * g.num_experts * 4);
        s.rank_hist = p.take(warps * g.num_ranks * 4);
        s.total = p.bytes;
        return s;
    }
};

/// Normal dispatch and combine kernels.
struct NormalSmem {
    int64_t peer_base;    ///< [W] uint8_t* peer heap bases
    int64_t exp_base;     ///< [E] this rank's first row on the expert's owner
    int64_t exp_start;    ///< [E] padded segment start of each expert on its owner
    int64_t exp_total;    ///< [E] rows of each expert (all sources)
    int64_t tok_base;     ///< [W] this rank's first received-token index on each rank
    int64_t rank_tokens;  ///< [W] tokens each rank receives
    int64_t rank_rows;    ///< [W] rows each rank receives (padded)
    int64_t recv_from;    ///< [W] tokens this rank receives from each source
    int64_t src_offset;   ///< [W + 1] first received token of each source on this rank
    int64_t send_base;    ///< [W] this rank's first landing row for each rank
    int64_t sent;         ///< [W] rows/partials this block sent to each rank
    int64_t dests;        ///< [warps][W] per warp: destination ranks of the current token
    int64_t dest_rows;    ///< [warps][W] per warp: first row on each destination
    int64_t dest_meta;    ///< [warps][W] per warp: receive record index on each destination
    int64_t flags;        ///< [4] block-wide flags
    int64_t exp_rows;     ///< [E_local] fused dispatch: rows of each local expert this block completed
    int64_t total;
    WEFT_HOST_DEVICE static constexpr NormalSmem make(const Geometry& g, int threads) {
        SmemPlan p;
        NormalSmem s{};
        const int64_t warps = threads / 32;
        const int64_t w = g.num_ranks;
        const int64_t e = g.num_experts;
        s.peer_base = p.take(w * 8);
        s.exp_base = p.take(e * 4);
        s.exp_start = p.take(e * 4);
        s.exp_total = p.take(e * 4);
        s.tok_base = p.take(w * 4);
        s.rank_tokens = p.take(w * 8);
        s.rank_rows = p.take(w * 8);
        s.recv_from = p.take(w * 4);
        s.src_offset = p.take((w + 1) * 4);
        s.send_base = p.take(w * 4);
        s.sent = p.take(w * 4);
        s.dests = p.take(warps * w * 4);
        s.dest_rows = p.take(warps * w * 4);
        s.dest_meta = p.take(warps * w * 4);
        s.flags = p.take(4 * 4);
        s.exp_rows = p.take(int64_t{g.local_experts()} * 4);
        s.total = p.bytes;
        return s;
    }
};

/// Low-latency dispatch and combine kernels.
struct LowLatencySmem {
    int64_t peer_base;     ///< [W] uint8_t*
    int64_t hist;          ///< [warps][E] route histograms (send phase)
    int64_t route_slot;    ///< [max_tokens * k] slot of each route in its (expert, source) area, or -1
    int64_t expert_count;  ///< [E] routes of this rank per expert
    int64_t unit_count;    ///< [E_local * W] rows per (local expert, source) (receive phase)
    int64_t unit_prefix;   ///< [E_local * W + 1] flattened prefix of unit_count
    int64_t expert_base;   ///< [E_local * W] first output row of each unit within its expert
    int64_t total;
    WEFT_HOST_DEVICE static constexpr LowLatencySmem make(const Geometry& g, int threads) {
        SmemPlan p;
        LowLatencySmem s{};
        const int64_t warps = threads / 32;
        const int64_t units = int64_t{g.local_experts()} * g.num_ranks;
        s.peer_base = p.take(int64_t{g.num_ranks} * 8);
        s.hist = p.take(warps * g.num_experts * 4);
        s.route_slot = p.take(int64_t{g.max_tokens} * g.topk * 4);
        s.expert_count = p.take(int64_t{g.num_experts} * 4);
        s.unit_count = p.take(units * 4);
        s.unit_prefix = p.take((units + 1) * 4);
        s.expert_base = p.take(units * 4);
        s.total = p.bytes;
        return s;
    }
};

}  // namespace weft::ep
