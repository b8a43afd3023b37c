// SPDX-License-Identifier: MIT
// Decode attention over a paged KV cache: the kernels' config, their parameter block, and the split plan, shared by
// the host op (src/ops/attention.cpp) and the kernels (kernels/attention/decode.cuh).
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/dtype.hpp"
#include "weft/common/macros.hpp"

namespace weft {

/// Tokens one block stages per pipeline step: 16 per warp (one m16n8k16 k-step of P x V), 4 warps.
inline constexpr int32_t kAttentionTileTokens = 64;
inline constexpr int32_t kAttentionWarps = 4;
inline constexpr int32_t kAttentionThreads = 32 * kAttentionWarps;
/// The q-heads of one KV head fill the 16 rows of an mma tile: at most 16 per KV head.
inline constexpr int32_t kAttentionMaxGroup = 16;
/// Upper bound on the KV splits of one (sequence, KV head); the combine kernel loops over them.
inline constexpr int32_t kAttentionMaxSplits = 256;
/// Threads of the combine kernel's block (one block per (sequence, q-head) row).
inline constexpr int32_t kAttentionCombineThreads = 128;

/// Compile-time knobs of the split kernel. One specialisation per (dtype, head_dim, stages, check_pages).
struct AttentionDecodeConfig {
    DType dtype = DType::kBF16;  ///< Q, K, V and the output: bf16 or f16; scores, softmax and sums in fp32
    int32_t head_dim = 128;      ///< 64, 128 or 256
    int32_t stages = 3;          ///< cp.async pipeline depth, in tiles of kAttentionTileTokens tokens (2..8)
    /// The split kernel checks every block-table entry it reads against [0, num_pages) (a call given a status);
    /// without, it is the kernel that trusts them (no instruction of the check in it).
    bool check_pages = false;
};

/// Bytes of shared memory the split kernel uses: the Q tile (16 rows) and `stages` K and V tiles.
WEFT_HOST_DEVICE constexpr int64_t attention_decode_smem_bytes(const AttentionDecodeConfig& c) {
    const int64_t row_bytes = static_cast<int64_t>(c.head_dim) * 2;
    return 16 * row_bytes + static_cast<int64_t>(c.stages) * 2 * kAttentionTileTokens * row_bytes;
}

/// Shared by host heuristics and the kernel's static_assert. The epilogue reuses the K/V stages as a
/// [warps][16][head_dim] fp32 buffer, so they must be at least that large.
WEFT_HOST_DEVICE constexpr bool is_valid(const AttentionDecodeConfig& c) {
    const bool dtype_ok = c.dtype == DType::kBF16 || c.dtype == DType::kF16;
    const bool dim_ok = c.head_dim == 64 || c.head_dim == 128 || c.head_dim == 256;
    const bool stages_ok = c.stages >= 2 && c.stages <= 8;
    const int64_t stage_bytes = static_cast<int64_t>(c.stages) * 2 * kAttentionTileTokens * c.head_dim * 2;
    const int64_t epilogue_bytes = static_cast<int64_t>(kAttentionWarps) * 16 * c.head_dim * 4;
    return dtype_ok && dim_ok && stages_ok && stage_bytes >= epilogue_bytes &&
           attention_decode_smem_bytes(c) <= 227 * 1024;
}

/// The default pipeline depth per head dimension: 2 blocks per SM at 64 and 128 (>= 64 KiB in flight per SM),
/// one at 256 (two 64 KiB tiles in flight).
WEFT_HOST_DEVICE constexpr int32_t attention_default_stages(int32_t head_dim) { return head_dim <= 64 ? 4 : 3; }

/// How the KV range of every (sequence, KV head) is cut: split s covers tokens
/// [s * tokens_per_split, (s + 1) * tokens_per_split), clipped to the sequence's length.
struct AttentionSplitPlan {
    int32_t num_splits = 1;
    int64_t tokens_per_split = 0;  ///< a multiple of kAttentionTileTokens
};

/// What a split block costs beyond its tiles, in tiles: the dependent loads before its first K/V bytes arrive
/// (sequence length, page table), the pipeline's fill and the epilogue's merge and stores. Fitted on an H200 to
/// `weft_bench_attention --splits` sweeps (kernels/attention/README.md, "Split plan").
inline constexpr int64_t kAttentionBlockOverheadTiles = 4;

/// The split plan for `batch` sequences of at most `max_seq_len` tokens with `num_kv_heads` KV heads on a GPU where
/// `resident_blocks` split blocks run at once (SMs x blocks per SM). `requested` > 0 asks for that many splits
/// (clamped to [1, kAttentionMaxSplits] and to one tile per split); 0 chooses the count with the least modelled time:
/// the blocks run in waves of `resident_blocks`, a wave lasts as long as its longest block (its tiles plus
/// kAttentionBlockOverheadTiles), so the plan trades the last wave's idle slots against per-block overhead; at least
/// two tiles per split (so that the pipeline overlaps), at most kAttentionMaxSplits; on a tie, fewer splits (less
/// for the combine to read).
WEFT_HOST_DEVICE constexpr AttentionSplitPlan plan_attention_splits(int64_t batch, int64_t num_kv_heads,
                                                                    int64_t max_seq_len, int64_t resident_blocks,
                                                                    int32_t requested) {
    AttentionSplitPlan plan;
    const int64_t tiles = (max_seq_len + kAttentionTileTokens - 1) / kAttentionTileTokens;
    if (tiles <= 1) {
        plan.num_splits = 1;
        plan.tokens_per_split = kAttentionTileTokens;
        return plan;
    }
    int64_t tiles_per_split = tiles;
    if (requested > 0) {
        int64_t want = requested > kAttentionMaxSplits ? kAttentionMaxSplits : requested;
        if (want > tiles) want = tiles;
        tiles_per_split = (tiles + want - 1) / want;
    } else {
        const int64_t base = batch * num_kv_heads > 0 ? batch * num_kv_heads : 1;
        const int64_t slots = resident_blocks > 0 ? resident_blocks : 1;
        int64_t most = tiles / 2 > 0 ? tiles / 2 : 1;
        if (most > kAttentionMaxSplits) most = kAttentionMaxSplits;
        int64_t best_cost = -1;
        for (int64_t want = 1; want <= most; ++want) {
            const int64_t per = (tiles + want - 1) / want;
            const int64_t splits = (tiles + per - 1) / per;
            const int64_t waves = (base * splits + slots - 1) / slots;
            const int64_t cost = waves * (per + kAttentionBlockOverheadTiles);
            if (best_cost < 0 || cost < best_cost) {
                best_cost = cost;
                tiles_per_split = per;
            }
        }
    }
    plan.tokens_per_split = tiles_per_split * kAttentionTileTokens;
    plan.num_splits = static_cast<int32_t>((tiles + tiles_per_split - 1) / tiles_per_split);
    return plan;
}

/// Where a sequence-parallel decode pushes this rank's final rows instead of writing `out` and `lse`: as LL lines
/// (weft/device/ll.cuh) into slot `rank` of every rank's LL buffer of the collective workspace, flagged with the
/// epoch the next collective kernel (the cross-rank combine) runs under. Row r (= b * num_q_heads + h of the call) is
/// attention_push_row_lines(head_dim) lines from line r * that: head_dim fp32 values (normalised), then its LSE
/// (natural log) and 4 bytes of padding.
struct AttentionPeerPush {
    DeviceCtx ctx{};                  ///< the World's context: rank, num_ranks, peer heap bases
    const uint64_t* epoch = nullptr;  ///< the workspace's epoch word (read here, advanced by the combine kernel)
    uint8_t* ll_buffer = nullptr;     ///< symmetric [2 parities][num_ranks senders][ll_slot_bytes]
    uint64_t ll_slot_bytes = 0;
    /// Bits 8..39 of the combine's call descriptor (the count's low 20 bits, up to 2^20 rows exact, and 12 bits of the
    /// digest: attention_push_tag), sent in every row's LSE line beside the LSE: the combine compares each rank's with
    /// its own (ranks whose calls differ are a kCollectiveMismatch, not merged rows).
    uint32_t tag = 0;
};

/// AttentionPeerPush::tag of a call descriptor, and the descriptor a peer's tag stands for (this call's, with the tag's
/// bits in place: its op and dtype are read as this call's).
WEFT_HOST_DEVICE constexpr uint32_t attention_push_tag(uint64_t descriptor) {
    return static_cast<uint32_t>(descriptor >> 8);
}
WEFT_HOST_DEVICE constexpr uint64_t attention_descriptor_of_tag(uint64_t mine, uint32_t tag) {
    return (mine & ~(0xFFFFFFFFull << 8)) | (static_cast<uint64_t>(tag) << 8);
}

/// LL lines (8 bytes of payload each) of one pushed row.
WEFT_HOST_DEVICE constexpr int64_t attention_push_row_lines(int64_t head_dim) { return (head_dim + 2) / 2; }

/// A decode call's first block-table entry outside [0, num_pages) (DecodeAttentionOptions::status: device or
/// host-mapped memory, 16 bytes, zeroed by the caller; the first bad entry found claims it).
struct AttentionStatus {
    int32_t code;      ///< 0: nothing found; 1: a block-table entry outside [0, num_pages)
    int32_t sequence;  ///< b: the sequence (row of block_table) of the entry, within the call (sp: within the call too)
    int32_t page;      ///< j: its logical page (column of block_table)
    int32_t value;     ///< block_table[b][j] as read
};

/// Everything the split and combine kernels read, by value. Strides are in elements. Layouts:
///   q            [batch, num_q_heads, head_dim]           (row strides q_batch_stride, q_head_stride)
///   k, v         [num_pages, page_size, num_kv_heads, head_dim] (strides page_stride, slot_stride, head_stride)
///   block_table  int32 [batch, block_table_stride]: physical page of logical page i of sequence b
///   seq_lens     int32 [batch]
///   out          [batch, num_q_heads, head_dim] contiguous, dtype of q
///   lse          fp32 [batch, num_q_heads] contiguous, or null
///   partial_o    fp32 [batch, num_q_heads, num_splits, head_dim], partial_lse fp32 [batch, num_q_heads, num_splits]
/// q-head h reads KV head h / group.
struct AttentionDecodeParams {
    const void* q = nullptr;
    const void* k = nullptr;
    const void* v = nullptr;
    const int32_t* block_table = nullptr;
    const int32_t* seq_lens = nullptr;
    void* out = nullptr;
    float* lse = nullptr;
    float* partial_o = nullptr;
    float* partial_lse = nullptr;
    int64_t q_batch_stride = 0;
    int64_t q_head_stride = 0;
    int64_t page_stride = 0;
    int64_t slot_stride = 0;
    int64_t head_stride = 0;
    int64_t block_table_stride = 0;
    int64_t max_seq_len = 0;  ///< lengths above it are clipped to it (the block table holds this many tokens)
    int64_t tokens_per_split = 0;
    int32_t batch = 0;
    int32_t num_q_heads = 0;
    int32_t num_kv_heads = 0;
    int32_t group = 1;  ///< num_q_heads / num_kv_heads, 1..16
    int32_t page_size = 1;
    int32_t page_shift = -1;   ///< log2(page_size) when it is a power of two (shift and mask), else -1 (divide)
    int32_t num_splits = 1;    ///< 1: the split kernel writes out and lse itself; no combine kernel
    float scale_log2 = 0.f;    ///< softmax scale x log2(e): scores are kept in base 2
    int32_t push_enabled = 0;  ///< 1: the final rows go to `push` (sequence-parallel), not to out / lse
    uint32_t num_pages = 0;    ///< k_cache's pages, at most 2^31 (check_pages: an entry outside is bad)
    AttentionPeerPush push{};
    // check_pages only (after the fields every build reads, which keep their offsets):
    AttentionStatus* status = nullptr;  ///< where the first bad block-table entry is recorded, or null
    int32_t sequence_base = 0;          ///< the call's index of this launch's sequence 0 (sp_decode_attention's rounds)
};

}  // namespace weft
