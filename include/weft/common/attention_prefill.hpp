// SPDX-License-Identifier: MIT
// Flash-attention forward (prefill): the kernel's config, its parameter block, the work order and the chunk order,
// shared by the host ops (src/ops/ag_attention.cpp) and the kernel (kernels/attention/prefill.cuh).
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/dtype.hpp"
#include "weft/common/macros.hpp"

namespace weft {

/// Keys per K/V tile of the prefill kernel (one pipeline stage holds a K and a V tile of this many rows).
inline constexpr int32_t kPrefillTileKeys = 64;
/// q-heads per KV head the prefill ops accept (grouped-query attention).
inline constexpr int32_t kPrefillMaxGroup = 16;

/// Which keys a query sees.
enum class AttentionMask : int32_t {
    kNone = 0,    ///< every key
    kCausal = 1,  ///< keys at global positions <= the query's global position
};

/// Which prefill kernel runs a config.
enum class AttentionPrefillKernel : int32_t {
    kMmaSync = 0,  ///< kernels/attention/prefill.cuh: mma.sync m16n8k16, a warp per 16 query rows (sm_80+)
    kWgmma = 1,    ///< kernels/attention/prefill_sm90.cuh: wgmma, TMA and a producer warpgroup (sm_90a only)
};

/// Keys per K/V tile of the wgmma kernel.
inline constexpr int32_t kPrefillWgmmaTileKeys = 128;

/// Compile-time knobs of the prefill kernels. One specialisation per (dtype, head_dim, block_m, stages, kernel).
struct AttentionPrefillConfig {
    DType dtype = DType::kBF16;  ///< Q, K, V and the output: bf16 or f16; scores, softmax and sums in fp32
    int32_t head_dim = 128;      ///< 64 or 128
    int32_t block_m = 128;       ///< query rows per work item: 64 or 128 (mma.sync: 16 per warp; wgmma: 64 per
                                 ///< consumer warpgroup), or 192 (wgmma at head_dim 64: three consumer warpgroups)
    int32_t stages = 2;          ///< K/V pipeline depth in tiles: 2 or 3
    AttentionPrefillKernel kernel = AttentionPrefillKernel::kMmaSync;
};

/// Keys per K/V tile of a config's kernel.
WEFT_HOST_DEVICE constexpr int32_t attention_prefill_tile_keys(const AttentionPrefillConfig& c) {
    return c.kernel == AttentionPrefillKernel::kWgmma ? kPrefillWgmmaTileKeys : kPrefillTileKeys;
}

/// Threads of one block: mma.sync, a warp per 16 query rows; wgmma, a producer warpgroup and a consumer warpgroup
/// per 64 query rows.
WEFT_HOST_DEVICE constexpr int32_t attention_prefill_threads(const AttentionPrefillConfig& c) {
    return c.kernel == AttentionPrefillKernel::kWgmma ? 128 * (1 + c.block_m / 64) : c.block_m / 16 * 32;
}

/// Bytes of the wgmma kernel's barriers (after the tiles) and of the slack that aligns its tiles to 1024 bytes.
inline constexpr int64_t kPrefillWgmmaBarrierBytes = 128;
inline constexpr int64_t kPrefillWgmmaAlignSlack = 1024;

/// Dynamic shared memory of one block: the Q tile and `stages` K and V tiles (wgmma: plus its barriers and the
/// alignment slack).
WEFT_HOST_DEVICE constexpr int64_t attention_prefill_smem_bytes(const AttentionPrefillConfig& c) {
    const int64_t row_bytes = static_cast<int64_t>(c.head_dim) * 2;
    const int64_t tiles = static_cast<int64_t>(c.block_m) * row_bytes +
                          static_cast<int64_t>(c.stages) * 2 * attention_prefill_tile_keys(c) * row_bytes;
    return c.kernel == AttentionPrefillKernel::kWgmma ? tiles + kPrefillWgmmaBarrierBytes + kPrefillWgmmaAlignSlack
                                                      : tiles;
}

/// Why `c` is not a valid config, or null when it is. Shared by host checks (whose errors quote it) and is_valid.
WEFT_HOST_DEVICE constexpr const char* attention_prefill_invalid_reason(const AttentionPrefillConfig& c) {
    if (c.kernel != AttentionPrefillKernel::kMmaSync && c.kernel != AttentionPrefillKernel::kWgmma) {
        return "kernel must be kMmaSync or kWgmma";
    }
    if (c.dtype != DType::kBF16 && c.dtype != DType::kF16) return "dtype must be bf16 or f16";
    if (c.head_dim != 64 && c.head_dim != 128) return "head_dim must be 64 or 128";
    if (c.block_m == 192) {
        if (c.kernel != AttentionPrefillKernel::kWgmma || c.head_dim != 64) {
            return "block_m 192 is the wgmma kernel's at head_dim 64 only";
        }
    } else if (c.block_m != 64 && c.block_m != 128) {
        return "block_m must be 64 or 128 (or 192: the wgmma kernel at head_dim 64)";
    }
    if (c.stages < 2 || c.stages > 3) return "stages must be 2 or 3";
    if (attention_prefill_smem_bytes(c) > 227 * 1024) return "the tiles need more than 227 KiB of shared memory";
    return nullptr;
}

/// Shared by host heuristics and the kernels' static_asserts.
WEFT_HOST_DEVICE constexpr bool is_valid(const AttentionPrefillConfig& c) {
    return attention_prefill_invalid_reason(c) == nullptr;
}

/// The default config of a head dimension for a kernel (attention_prefill_default_kernel picks the kernel of a
/// device). The wgmma kernel at head_dim 64 takes 192-row items (three consumer warpgroups: measured 8-10% faster
/// than 128 rows at 8K-16K tokens, the same at 4K; kernels/attention/README.md).
WEFT_HOST_DEVICE constexpr AttentionPrefillConfig attention_prefill_default_config(
    DType dtype, int32_t head_dim, AttentionPrefillKernel kernel = AttentionPrefillKernel::kMmaSync) {
    AttentionPrefillConfig c;
    c.dtype = dtype;
    c.head_dim = head_dim;
    c.block_m = kernel == AttentionPrefillKernel::kWgmma && head_dim == 64 ? 192 : 128;
    c.stages = head_dim <= 64 ? 3 : 2;
    c.kernel = kernel;
    return c;
}

/// The config a call without options.config runs: the default config, except that 192-row items give way to 128-row
/// ones where they would not give every one of `num_sms` SMs one (ceil(seq_q / 192) x num_q_heads < num_sms).
WEFT_HOST_DEVICE constexpr AttentionPrefillConfig attention_prefill_call_config(DType dtype, int32_t head_dim,
                                                                                AttentionPrefillKernel kernel,
                                                                                int64_t seq_q, int64_t num_q_heads,
                                                                                int32_t num_sms) {
    AttentionPrefillConfig c = attention_prefill_default_config(dtype, head_dim, kernel);
    if (c.block_m == 192 && (seq_q + 191) / 192 * num_q_heads < num_sms) c.block_m = 128;
    return c;
}

/// The kernel a device of compute capability major.minor runs by default: wgmma on sm_90 (the JIT compiles sm_90a
/// for it), mma.sync elsewhere.
WEFT_HOST_DEVICE constexpr AttentionPrefillKernel attention_prefill_default_kernel(int32_t cc_major, int32_t cc_minor) {
    return cc_major == 9 && cc_minor == 0 ? AttentionPrefillKernel::kWgmma : AttentionPrefillKernel::kMmaSync;
}

/// Chunk visited (and, by AgAttention, pulled) at step `i` of `num_chunks` by the rank whose own chunk is `local`:
/// its own first, then the chunks below it nearest first (under a causal mask those are the ones it needs), then the
/// ones above it from the top down. A permutation of [0, num_chunks) for i in [0, num_chunks).
WEFT_HOST_DEVICE constexpr int32_t attention_prefill_chunk_at(int32_t local, int32_t num_chunks, int32_t i) {
    return ((local - i) % num_chunks + num_chunks) % num_chunks;
}

/// Work items of the kernel: (query tile, q-head) pairs, q-head-major, each head's query tiles from the last
/// (the most keys under a causal mask) to the first, so that the longest items start first.
struct AttentionPrefillItem {
    int32_t q_head = 0;
    int32_t m_tile = 0;
};
WEFT_HOST_DEVICE constexpr int32_t attention_prefill_num_m_tiles(int32_t seq_q, int32_t block_m) {
    return (seq_q + block_m - 1) / block_m;
}
WEFT_HOST_DEVICE constexpr AttentionPrefillItem attention_prefill_item(int32_t idx, int32_t num_m_tiles) {
    AttentionPrefillItem it;
    it.q_head = idx / num_m_tiles;
    it.m_tile = num_m_tiles - 1 - idx % num_m_tiles;
    return it;
}

/// The item at position `idx` of a work counter's order (the wgmma kernel's schedule with
/// AttentionPrefillParams::item_counter): the q-heads in groups, the first of the heads that whole groups of
/// `head_group` leave over (all `head_group` when none are), then whole groups; each group's items from the last query
/// tile to the first, the group's heads side by side. The longest items of a group start first, its shortest fill
/// its end, the blocks at work share the group's K and V in L2, and the last group is a whole one (a small last
/// group would start its longest items too late to even out).
WEFT_HOST_DEVICE constexpr AttentionPrefillItem attention_prefill_grouped_item(uint32_t idx, uint32_t num_m_tiles,
                                                                               uint32_t num_q_heads,
                                                                               uint32_t head_group) {
    const uint32_t lead = (num_q_heads - 1) % head_group + 1;  // heads of the first group
    uint32_t first = 0;
    uint32_t heads = lead;
    uint32_t r = idx;
    if (idx >= lead * num_m_tiles) {
        const uint32_t j = idx - lead * num_m_tiles;
        const uint32_t g = j / (head_group * num_m_tiles);
        first = lead + g * head_group;
        heads = head_group;
        r = j - g * head_group * num_m_tiles;
    }
    AttentionPrefillItem it;
    it.q_head = static_cast<int32_t>(first + r % heads);
    it.m_tile = static_cast<int32_t>(num_m_tiles - 1 - r / heads);
    return it;
}

/// Items of a group per resident block, at least, that attention_prefill_head_group keeps: the last group's work
/// then spans twice its longest item on every block (a causal group's items average half the longest).
inline constexpr int64_t kPrefillGroupItemsPerBlock = 4;

/// The q-heads per group of attention_prefill_grouped_item for a call: as many KV heads' K and V (2 x seq_kv x
/// head_dim 16-bit values each) as fill half of an L2 cache of `l2_bytes` (at least one), times `group` q-heads per KV
/// head; raised to whole KV heads' q-heads until a group holds kPrefillGroupItemsPerBlock items per `resident` block;
/// at most num_q_heads.
WEFT_HOST_DEVICE constexpr int32_t attention_prefill_head_group(int64_t seq_kv, int32_t head_dim, int32_t group,
                                                                int32_t num_q_heads, int64_t num_m_tiles,
                                                                int64_t resident, int64_t l2_bytes) {
    const int64_t gqa = group > 1 ? group : 1;
    const int64_t kv_bytes = 4 * (seq_kv > 1 ? seq_kv : 1) * head_dim;
    int64_t kv_heads = l2_bytes / 2 / kv_bytes;
    if (kv_heads < 1) kv_heads = 1;
    const int64_t tiles = num_m_tiles > 1 ? num_m_tiles : 1;
    const int64_t min_heads = (kPrefillGroupItemsPerBlock * resident + tiles - 1) / tiles;
    const int64_t min_kv_heads = (min_heads + gqa - 1) / gqa;
    if (kv_heads < min_kv_heads) kv_heads = min_kv_heads;
    const int64_t heads = kv_heads * gqa;
    return heads < num_q_heads ? static_cast<int32_t>(heads) : num_q_heads;
}

/// The wgmma kernel's work item of block b in the wave of `blocks` consecutive items that starts at `wave_start`:
/// every other wave (`reverse`) is handed out in reverse block order, so that a block's long and short items
/// alternate (items run longest first within each q-head) while a wave stays on a few q-heads (their K and V in L2).
/// Past the items: the last wave's share of another block (skipped). One block per item: item b.
WEFT_HOST_DEVICE constexpr uint32_t attention_prefill_wave_item(uint32_t wave_start, bool reverse, uint32_t b,
                                                                uint32_t blocks) {
    return wave_start + (reverse ? blocks - 1 - b : b);
}

/// The most waves of resident blocks a one-GPU call's items may fill for attention_prefill_grid to keep the grid
/// resident.
inline constexpr int64_t kPrefillResidentWaves = 8;

/// The grid of a one-GPU wgmma prefill call without a work counter (a flash_attention launch captured in a graph
/// that finds no spare counter): `resident` blocks (SMs x blocks per SM) walking the items in waves where the items
/// fill at most kPrefillResidentWaves waves of them (each block then loads its next item under its current one's last
/// tiles instead of starting afresh), else one block per item. Measured on an H200 (bf16, 32 heads, causal;
/// kernels/attention/README.md): 2K-6K tokens (2.7-7.8 waves) up to 22% faster resident (dim 64 at 2K the same), 8K
/// at dim 64 (10.4 waves) 13% slower and 16K 3-15% slower.
WEFT_HOST_DEVICE constexpr int64_t attention_prefill_grid(int64_t items, int64_t resident) {
    if (resident < 1) resident = 1;
    if (items > kPrefillResidentWaves * resident) return items;
    return items < resident ? items : resident;
}

/// The end of an all-gather attention call, run by the last block to finish (AgAttention's protocol,
/// kernels/attention/README.md): every chunk signal and the peers' ready flags are reset, the done-barrier across the
/// team is passed and the epoch advanced. All words symmetric except `block_counter` (local).
struct AttentionPrefillFinish {
    uint64_t* block_counter = nullptr;  ///< blocks of this launch that are done (reset to 0 by the last one); null:
                                        ///< no end of call (a one-GPU launch)
    uint64_t* chunk_signals = nullptr;  ///< [num_chunks], set to 1 by the copy engine when chunk c landed
    uint64_t* ready = nullptr;          ///< [num_ranks]: ready[s] = 1 when rank s's shard is in its gathered buffer
    uint64_t* done = nullptr;           ///< [num_ranks]: add-only, one add per call by rank s
    uint64_t* epoch = nullptr;          ///< calls this rank has finished
};

/// Everything the prefill kernel reads, by value. Strides in elements. Layouts:
///   q    [seq_q, num_q_heads, head_dim]   (strides q_row_stride, q_head_stride; innermost 1)
///   k, v [seq_kv, num_kv_heads, head_dim] (strides kv_row_stride, kv_head_stride; innermost 1; k and v alike)
///   out  [seq_q, num_q_heads, head_dim]   contiguous, dtype of q
///   lse  fp32 [seq_q, num_q_heads] contiguous (natural log), or null
/// q-head h reads KV head h / group. Query row i sits at global position q_position + i; key j at position j. The
/// keys are cut into num_chunks chunks of chunk_keys (the last may be shorter): chunk c = keys [c * chunk_keys, ...).
/// Before its first load from chunk c != local_chunk a block waits until chunk_signals[c] >= 1 (acquire, system
/// scope, bounded by ctx.timeout_ns); chunk_signals null: nothing is awaited.
struct AttentionPrefillParams {
    DeviceCtx ctx{};
    const void* q = nullptr;
    const void* k = nullptr;
    const void* v = nullptr;
    void* out = nullptr;
    float* lse = nullptr;
    int64_t q_row_stride = 0;
    int64_t q_head_stride = 0;
    int64_t kv_row_stride = 0;
    int64_t kv_head_stride = 0;
    int64_t q_position = 0;
    int32_t seq_q = 0;
    int32_t seq_kv = 0;
    int32_t num_q_heads = 0;
    int32_t num_kv_heads = 0;
    int32_t group = 1;
    int32_t mask = 0;        ///< AttentionMask
    float scale_log2 = 0.f;  ///< softmax scale x log2(e)
    int32_t chunk_keys = 0;
    int32_t num_chunks = 1;
    int32_t local_chunk = 0;
    const uint64_t* chunk_signals = nullptr;
    AttentionPrefillFinish finish{};
    /// wgmma kernel: a work counter (zero before the launch, and zero again after it: the block that claims last
    /// resets it); each block's producer claims its next item from it, in attention_prefill_grouped_item order with
    /// head_group q-heads per group. Null: block b walks the items in waves (attention_prefill_wave_item). The
    /// mma.sync kernel ignores both.
    uint32_t* item_counter = nullptr;
    int32_t head_group = 1;
};

/// One past the last key that some row of the query tile [m0, m0 + rows) sees.
WEFT_HOST_DEVICE constexpr int32_t attention_prefill_key_end(const AttentionPrefillParams& p, int32_t m0,
                                                             int32_t rows) {
    if (p.mask != static_cast<int32_t>(AttentionMask::kCausal)) return p.seq_kv;
    const int64_t last = p.q_position + m0 + rows;  // one past the last row's position
    return last < p.seq_kv ? static_cast<int32_t>(last < 0 ? 0 : last) : p.seq_kv;
}

/// Walks the K/V tiles of one work item: chunk by chunk in attention_prefill_chunk_at order, `keys` keys at a time
/// (kPrefillTileKeys unless the kernel sets it), every key below `key_end` once; chunks with no such key are skipped
/// (and never awaited). Tiles never straddle chunks: a chunk's last tile may be short. The kernel runs two (the loads
/// ahead, the tile computed).
struct AttentionPrefillTileCursor {
    int32_t step = 0;   ///< chunk ordinal; == p.num_chunks when done
    int32_t chunk = 0;  ///< attention_prefill_chunk_at(p.local_chunk, p.num_chunks, step)
    int32_t begin = 0;  ///< first key of this tile
    int32_t stop = 0;   ///< one past the chunk's last visible key
    bool first_of_chunk = false;
    int32_t keys = kPrefillTileKeys;  ///< keys per tile

    WEFT_HOST_DEVICE constexpr bool valid(const AttentionPrefillParams& p) const { return step < p.num_chunks; }
    WEFT_HOST_DEVICE constexpr void start(const AttentionPrefillParams& p, int32_t key_end) {
        step = 0;
        seek(p, key_end);
    }
    WEFT_HOST_DEVICE constexpr void next(const AttentionPrefillParams& p, int32_t key_end) {
        begin += keys;
        first_of_chunk = false;
        if (begin >= stop) {
            ++step;
            seek(p, key_end);
        }
    }

private:
    WEFT_HOST_DEVICE constexpr void seek(const AttentionPrefillParams& p, int32_t key_end) {
        for (; step < p.num_chunks; ++step) {
            chunk = attention_prefill_chunk_at(p.local_chunk, p.num_chunks, step);
            const int32_t lo = chunk * p.chunk_keys;
            const int32_t hi_chunk = lo + p.chunk_keys < p.seq_kv ? lo + p.chunk_keys : p.seq_kv;
            const int32_t hi = hi_chunk < key_end ? hi_chunk : key_end;
            if (lo < hi) {
                begin = lo;
                stop = hi;
                first_of_chunk = true;
                return;
            }
        }
    }
};

}  // namespace weft
