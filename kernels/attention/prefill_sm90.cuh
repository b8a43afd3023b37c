// SPDX-License-Identifier: MIT
// Flash-attention forward (prefill) for sm_90a on wgmma: a producer warpgroup (one warp issues TMA loads of Q and
// of the K/V tiles into an mbarrier ring) and one or two consumer warpgroups of 64 query rows each. Per K/V tile a
// consumer computes S = Q K^T with wgmma (A = Q, B = K, both K-major from 128B-swizzled shared memory), the online
// softmax in fp32 registers (base 2, running max and sum per row), and O += P V with P straight from the S
// accumulators (converted to 16-bit A fragments) and V as an MN-major B operand. The QK^T of tile j + 1 is issued
// before the PV of tile j, so tile j + 1's softmax runs while the tensor cores work on tile j's PV.
//
// Same parameters and semantics as prefill.cuh (causal / none, GQA, q_position, chunk waits and the end-of-call
// protocol of all-gather attention): README.md here. Launched by weft::ops::flash_attention and AgAttention through
// the JIT with three tensor maps built by the host (3-D: head_dim x heads x rows, box 64 x 1 x rows, 128B swizzle):
//   weft::kernels::attention::prefill_forward_sm90<AttentionPrefillConfig{..., .kernel = kWgmma}>
#pragma once

#include "attention/prefill.cuh"
#include "weft/ptx/cp_async.cuh"
#include "weft/ptx/fence.cuh"
#include "weft/ptx/ld_st.cuh"
#include "weft/ptx/mbarrier.cuh"
#include "weft/ptx/setmaxnreg.cuh"
#include "weft/ptx/tma.cuh"
#include "weft/ptx/wgmma.cuh"

namespace weft::kernels::attention {

namespace prefill_sm90_detail {

/// Registers per thread after setmaxnreg: the producer warpgroup gives up what the consumers take (two consumer
/// warpgroups: 56 + 2 x 224; three: 32 + 3 x 160, within the 64 Ki registers of an SM).
template <int kConsumers>
inline constexpr int kProducerRegs = kConsumers == 3 ? 32 : 56;
template <int kConsumers>
inline constexpr int kConsumerRegs = kConsumers == 3 ? 160 : 224;
/// Named barriers (0 is __syncthreads) of the consumer warpgroups' turns at the tensor cores: warpgroup w syncs on
/// kBarTurn0 + w before issuing a tile's wgmma and, once issued, arrives on the next one's (w + 1 mod their count).
inline constexpr int kBarTurn0 = 1;

/// Keeps the compiler from reusing an A-fragment register before the wgmma that reads it has completed.
__device__ __forceinline__ void fence_fragment(unsigned& reg) { asm volatile("" : "+r"(reg)::"memory"); }

/// A pipeline wait's bound: twice the context's (a consumer waits behind the producer's chunk waits, which report
/// their own timeout first); ten seconds when the context names none (a one-GPU launch, whose stages land within
/// microseconds: a stall that long is a kernel bug, which traps).
__device__ __forceinline__ uint64_t pipeline_timeout(const AttentionPrefillParams& p) {
    return p.ctx.timeout_ns != 0 ? 2 * p.ctx.timeout_ns : 10ull * 1000 * 1000 * 1000;
}

/// Compile-time facts of a config.
template <AttentionPrefillConfig C>
struct Sm90Traits {
    static constexpr int kDim = C.head_dim;
    static constexpr int kBM = C.block_m;
    static constexpr int kBN = kPrefillWgmmaTileKeys;
    static constexpr int kConsumers = kBM / 64;            // consumer warpgroups
    static constexpr int kConsumerWarps = 4 * kConsumers;  // arrivals that free a buffer
    static constexpr int kDimBlocks = kDim / 64;           // 128-byte column blocks (one TMA box each)
    static constexpr int kQBytes = kBM * kDim * 2;         // Q tile: kDimBlocks x [kBM rows][128 B]
    static constexpr int kKVBytes = kBN * kDim * 2;        // one K (or V) tile: kDimBlocks x [kBN rows][128 B]
    static constexpr int kQOffset = 0;
    static constexpr int kKOffset = kQBytes;
    static constexpr int kVOffset = kKOffset + C.stages * kKVBytes;
    static constexpr int kBarOffset = kVOffset + C.stages * kKVBytes;
    // Barriers (8 bytes each): full_q, empty_q, then per stage full_k, full_v, empty_k, empty_v.
    static constexpr int kBarBytes = 8 * (2 + 4 * C.stages);
    // Then the item whose Q tile full_q announces (pack_item), written by the producer before its arrival.
    static constexpr int kItemOffset = kBarOffset + kBarBytes;
    // Then one word: set by the producer when a peer's chunk never arrived (AgAttention): the block stops loading and
    // writing, and ends without a trap.
    static constexpr int kAbortOffset = kItemOffset + 8;
    static_assert(kBarBytes + 8 + 4 <= kPrefillWgmmaBarrierBytes, "the barriers outgrow their reserved bytes");
    static_assert(kBarOffset + kPrefillWgmmaBarrierBytes + kPrefillWgmmaAlignSlack == attention_prefill_smem_bytes(C),
                  "shared-memory plan and attention_prefill_smem_bytes disagree");
    static constexpr bool kIsBF16 = C.dtype == DType::kBF16;
};

/// The item the producer hands the consumers with each full_q phase, as one 8-byte word at Sm90Traits::kItemOffset:
/// q-head in the low half (-1: no more items), query tile in the high half.
__device__ __forceinline__ uint64_t pack_item(int32_t q_head, int32_t m_tile) {
    return static_cast<uint64_t>(static_cast<uint32_t>(m_tile)) << 32 | static_cast<uint32_t>(q_head);
}

/// The producer's source of work items (kCounter: claimed from p.item_counter, the next item to the first block that
/// asks, in attention_prefill_grouped_item order; else this block's share of waves of gridDim.x items, every other
/// wave reversed, in attention_prefill_item order). next() returns false when the block has no more.
template <bool kCounter>
struct ItemSource;

template <>
struct ItemSource<true> {
    __device__ __forceinline__ bool next(const AttentionPrefillParams& p, uint32_t num_m_tiles, int lane,
                                         AttentionPrefillItem& item) {
        const uint32_t num_items = num_m_tiles * static_cast<uint32_t>(p.num_q_heads);
        uint32_t claim = 0;
        if (lane == 0) {
            claim = atomicAdd(p.item_counter, 1u);
            // Every block claims once past the items, then stops: the last such claim is the launch's last use of the
            // counter, and its block leaves the counter at zero for the next launch.
            if (claim == num_items + gridDim.x - 1) atomicExch(p.item_counter, 0u);
        }
        claim = __shfl_sync(0xffffffffu, claim, 0);
        if (claim >= num_items) return false;
        item = attention_prefill_grouped_item(claim, num_m_tiles, static_cast<uint32_t>(p.num_q_heads),
                                              static_cast<uint32_t>(p.head_group));
        return true;
    }
};

template <>
struct ItemSource<false> {
    uint32_t wave = 0;
    bool reverse = false;

    __device__ __forceinline__ bool next(const AttentionPrefillParams& p, uint32_t num_m_tiles, int /*lane*/,
                                         AttentionPrefillItem& item) {
        // num_items < 2^31 (the host checks): wave + gridDim.x stays below 2^32.
        const uint32_t num_items = num_m_tiles * static_cast<uint32_t>(p.num_q_heads);
        while (wave < num_items) {
            const uint32_t idx = attention_prefill_wave_item(wave, reverse, blockIdx.x, gridDim.x);
            wave += gridDim.x;
            reverse = !reverse;
            if (idx < num_items) {  // else the last wave's share of another block
                item = attention_prefill_item(static_cast<int32_t>(idx), static_cast<int32_t>(num_m_tiles));
                return true;
            }
        }
        return false;
    }
};

/// The producer warp: for every work item of this block, the Q tile (after the consumers freed the previous one),
/// then every K/V tile the item sees into the ring; the item itself goes to the consumers with the Q tile's barrier
/// (an item with no visible key: the barrier alone, then no tiles; after the last item: q_head -1). Before the first
/// load from a peer's chunk the warp waits for the chunk's flag. A V tile that ends inside the keys (short: its chunk,
/// or the causal limit, ends first) is copied by the warp (cp.async) with the keys past its end zero-filled, so that no
/// unarrived or unseen row reaches P V (0 x NaN would); every other tile, and every K tile (whose invisible scores are
/// masked by selection), by TMA.
template <AttentionPrefillConfig C, bool kCounter>
__device__ __forceinline__ void producer_warp(const AttentionPrefillParams& p, const ptx::TmaDescriptor* tma_q,
                                              const ptx::TmaDescriptor* tma_k, const ptx::TmaDescriptor* tma_v,
                                              unsigned base, unsigned bars, volatile uint32_t* abort_word) {
    using T = Sm90Traits<C>;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const uint64_t timeout = pipeline_timeout(p);
    const unsigned full_q = bars;
    const unsigned empty_q = bars + 8;
    const auto full_k = [&](int s) { return bars + 16 + 32 * s; };
    const auto full_v = [&](int s) { return bars + 24 + 32 * s; };
    const auto empty_k = [&](int s) { return bars + 32 + 32 * s; };
    const auto empty_v = [&](int s) { return bars + 40 + 32 * s; };
    const int32_t num_m_tiles = attention_prefill_num_m_tiles(p.seq_q, T::kBM);
    uint64_t arrived = 0;  // chunks this block has seen arrive (bit c; chunks >= 64 are awaited every time)
    int stage = 0;
    unsigned phase = 0;
    unsigned q_phase = 0;
    bool stuck = false;
    // A peer's chunk that never arrived (its wait failed, the Diagnostic recorded): from then on the warp loads
    // nothing and completes each full barrier with a plain arrival, so that the consumers run through their tiles
    // without data and without waiting out their bound; they see the abort word and write nothing.
    bool failed = false;
    ItemSource<kCounter> source;
    while (!stuck) {
        AttentionPrefillItem item;
        const bool done = !source.next(p, static_cast<uint32_t>(num_m_tiles), lane, item);
        const int kv_head = item.q_head / p.group;
        const int m0 = item.m_tile * T::kBM;
        const int rows = p.seq_q - m0 < T::kBM ? p.seq_q - m0 : T::kBM;
        const int32_t key_end = attention_prefill_key_end(p, m0, rows);
        AttentionPrefillTileCursor tile;
        tile.keys = T::kBN;
        tile.start(p, key_end);

        // The item, and its Q tile once the consumers freed the last one (rows past seq_q lie outside the map and
        // arrive as zeros); no Q for an item without keys (the consumers write zeros) or past the last.
        stuck = !ptx::mbarrier_wait_parity_bounded(empty_q, q_phase ^ 1u, timeout);
        q_phase ^= 1u;
        if (stuck) break;
        if (lane == 0) ptx::st_shared(base + T::kItemOffset, pack_item(done ? -1 : item.q_head, item.m_tile));
        if (done || !tile.valid(p)) {
            if (lane == 0) ptx::mbarrier_arrive(full_q);  // release: the consumers' wait sees the item
            if (done) break;
            continue;
        }
        if (lane == 0 && failed) ptx::mbarrier_arrive(full_q);
        if (lane == 0 && !failed) {
            ptx::mbarrier_arrive_expect_tx(full_q, T::kQBytes);
#pragma unroll
            for (int cb = 0; cb < T::kDimBlocks; ++cb) {
                ptx::tma_load_3d(base + T::kQOffset + cb * T::kBM * 128, tma_q, full_q, cb * 64, item.q_head, m0);
            }
        }

        for (; tile.valid(p) && !stuck; tile.next(p, key_end)) {
            device::Token token = device::Token::assume_local_data();
            if (!failed && tile.first_of_chunk && p.chunk_signals != nullptr && tile.chunk != p.local_chunk &&
                (tile.chunk >= 64 || (arrived >> tile.chunk & 1u) == 0)) {
                const device::WaitResult r =
                    device::tile::wait_checked(device::Warp{}, p.ctx, p.chunk_signals + tile.chunk, 1, Cmp::kGe, 1ull);
                if (r.ok()) {  // uniform over the warp
                    token = r.token();
                    if (tile.chunk < 64) arrived |= uint64_t{1} << tile.chunk;
                } else {
                    failed = true;
                    if (lane == 0) *abort_word = 1u;  // before the arrivals below (release), seen after their waits
                }
            }
            const unsigned k_dst = base + T::kKOffset + stage * T::kKVBytes;
            const unsigned v_dst = base + T::kVOffset + stage * T::kKVBytes;
            stuck = !ptx::mbarrier_wait_parity_bounded(empty_k(stage), phase ^ 1u, timeout);
            if (stuck) break;
            if (failed) {
                if (lane == 0) ptx::mbarrier_arrive(full_k(stage));
            } else if (lane == 0) {
                ptx::mbarrier_arrive_expect_tx(full_k(stage), T::kKVBytes);
#pragma unroll
                for (int cb = 0; cb < T::kDimBlocks; ++cb) {
                    device::tile::tma_load_3d(token, k_dst + cb * T::kBN * 128, tma_k, full_k(stage), cb * 64, kv_head,
                                              tile.begin);
                }
            }
            stuck = !ptx::mbarrier_wait_parity_bounded(empty_v(stage), phase ^ 1u, timeout);
            if (stuck) break;
            if (failed) {
                if (lane == 0) ptx::mbarrier_arrive(full_v(stage));
            } else if (tile.begin + T::kBN <= tile.stop || tile.stop >= p.seq_kv) {
                if (lane == 0) {
                    ptx::mbarrier_arrive_expect_tx(full_v(stage), T::kKVBytes);
#pragma unroll
                    for (int cb = 0; cb < T::kDimBlocks; ++cb) {
                        device::tile::tma_load_3d(token, v_dst + cb * T::kBN * 128, tma_v, full_v(stage), cb * 64,
                                                  kv_head, tile.begin);
                    }
                }
            } else {
                // cp.async of every 16-byte chunk (zero-filled past the tile's end: nothing read there), all in
                // flight together. Chunk c of row r lands where TMA's 128B swizzle puts it: column block c / 8, then
                // r * 128 + ((c % 8) ^ (r % 8)) * 16.
                const uint16_t* v_gmem = device::tile::consume_token(static_cast<const uint16_t*>(p.v), token) +
                                         static_cast<int64_t>(kv_head) * p.kv_head_stride;
                const int valid_rows = tile.stop - tile.begin;
                constexpr int kRowChunks = T::kDim / 8;
                for (int i = lane; i < T::kBN * kRowChunks; i += 32) {
                    const int r = i / kRowChunks;
                    const int c = i % kRowChunks;
                    const bool valid = r < valid_rows;
                    const uint16_t* src =
                        v_gmem + (valid ? static_cast<int64_t>(tile.begin + r) * p.kv_row_stride : 0) + c * 8;
                    const unsigned dst =
                        v_dst + (c / 8) * T::kBN * 128 + r * 128 + static_cast<unsigned>(((c % 8) ^ (r % 8)) * 16);
                    ptx::cp_async_16_zfill(dst, src, valid);
                }
                ptx::cp_async_commit();
                ptx::cp_async_wait<0>();
                ptx::fence_proxy_async_shared_cta();  // generic-proxy writes -> the consumers' wgmma (async proxy)
                __syncwarp();
                if (lane == 0) ptx::mbarrier_arrive(full_v(stage));
            }
            if (++stage == C.stages) {
                stage = 0;
                phase ^= 1u;
            }
        }
    }
    if (stuck) __trap();
}

/// Frees a buffer: one arrival per consumer warp.
__device__ __forceinline__ void release(unsigned bar, int lane) {
    if (lane == 0) ptx::mbarrier_arrive(bar);
}

/// One consumer warpgroup (`wg`: its 64 rows of the block's query tile).
template <AttentionPrefillConfig C>
__device__ __forceinline__ void consumer_warpgroup(const AttentionPrefillParams& p, unsigned base, unsigned bars,
                                                   volatile const uint32_t* abort_word, int wg) {
    using T = Sm90Traits<C>;
    using E = Elem<C.dtype>;
    constexpr int kBN = T::kBN;
    constexpr int kDim = T::kDim;
    constexpr int kSRegs = kBN / 2;   // S accumulators per thread (64 x kBN per warpgroup)
    constexpr int kORegs = kDim / 2;  // O accumulators per thread
    constexpr int kPSteps = kBN / 16;
    const int tid = static_cast<int>(threadIdx.x) % 128;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t4 = lane % 4;
    const bool causal = p.mask == static_cast<int32_t>(AttentionMask::kCausal);
    const uint64_t timeout = pipeline_timeout(p);
    const unsigned full_q = bars;
    const unsigned empty_q = bars + 8;
    const auto full_k = [&](int s) { return bars + 16 + 32 * s; };
    const auto full_v = [&](int s) { return bars + 24 + 32 * s; };
    const auto empty_k = [&](int s) { return bars + 32 + 32 * s; };
    const auto empty_v = [&](int s) { return bars + 40 + 32 * s; };
    const unsigned q_slab = base + T::kQOffset + wg * 64 * 128;
    int stage = 0;
    unsigned phase = 0;
    unsigned q_phase = 0;
    // A full-barrier wait that expires marks the pipeline stuck: the warpgroup stops waiting and traps after its
    // loops (no trap inside them: a reachable trap next to live accumulators costs spills).
    bool stuck = false;

    float o[kORegs];
    float s[kSRegs];
    unsigned pf[kPSteps][4];

    // The consumer warpgroups take turns issuing their wgmma (FA3's ping-pong, round robin with three): one's softmax
    // runs under the others' matrix products. All walk the same items and tiles, so their turns line up; the last
    // warpgroup's first arrival gives the first warpgroup the first turn, and the first warpgroup's last sync (after
    // the items) takes the surplus arrival so that no barrier is left half-way at exit.
    constexpr bool kPingPong = T::kConsumers >= 2;
    const auto turn_begin = [&]() {
        if constexpr (kPingPong) ptx::named_barrier_sync(kBarTurn0 + wg, 256);
    };
    const auto turn_end = [&]() {
        if constexpr (kPingPong) ptx::named_barrier_arrive(kBarTurn0 + (wg + 1) % T::kConsumers, 256);
    };
    if constexpr (kPingPong) {
        if (wg == T::kConsumers - 1) ptx::named_barrier_arrive(kBarTurn0, 256);
    }

    // The items the producer hands out, one per full_q phase, until one with q_head < 0.
    for (;;) {
        if (stuck || !ptx::mbarrier_wait_parity_bounded(full_q, q_phase, timeout)) {
            stuck = true;
            break;
        }
        q_phase ^= 1u;
        const uint64_t item = ptx::ld_shared<uint64_t>(base + T::kItemOffset);
        const int head = static_cast<int32_t>(static_cast<uint32_t>(item));
        if (head < 0) break;
        const int m0 = static_cast<int32_t>(item >> 32) * T::kBM;
        const int rows = p.seq_q - m0 < T::kBM ? p.seq_q - m0 : T::kBM;
        const int32_t key_end = attention_prefill_key_end(p, m0, rows);
        AttentionPrefillTileCursor tile;
        tile.keys = kBN;
        tile.start(p, key_end);
        const int64_t warp_pos = p.q_position + m0 + wg * 64 + warp * 16;
        const int64_t pos[2] = {warp_pos + g, warp_pos + g + 8};
        float row_max[2] = {neg_inf(), neg_inf()};
        float row_sum[2] = {0.f, 0.f};  // this lane's share; summed over the quad at the end
#pragma unroll
        for (int i = 0; i < kORegs; ++i) o[i] = 0.f;

        // S = Q K^T of the tile at `cur` in `st` (issued, not waited for).
        const auto issue_qk = [&](int st) {
            const unsigned k_base = base + T::kKOffset + st * T::kKVBytes;
#pragma unroll
            for (int kk = 0; kk < kDim / 16; ++kk) {
                const unsigned off = static_cast<unsigned>((kk % 4) * 32);  // 16 dims = 32 bytes of a 128-byte row
                const unsigned long long da =
                    ptx::make_smem_desc(q_slab + (kk / 4) * T::kBM * 128 + off, 16, 1024, ptx::SmemSwizzle::k128B);
                const unsigned long long db =
                    ptx::make_smem_desc(k_base + (kk / 4) * kBN * 128 + off, 16, 1024, ptx::SmemSwizzle::k128B);
                ptx::wgmma<kBN, T::kIsBF16, 0>(s, da, db, kk > 0 ? 1 : 0);
            }
        };
        // O += P V of the tile in `st` (issued, not waited for).
        const auto issue_pv = [&](int st) {
            const unsigned v_base = base + T::kVOffset + st * T::kKVBytes;
#pragma unroll
            for (int kk = 0; kk < kPSteps; ++kk) {
                const unsigned long long db =
                    ptx::make_smem_desc(v_base + kk * 16 * 128, kBN * 128, 1024, ptx::SmemSwizzle::k128B);
                ptx::wgmma_rs<kDim, T::kIsBF16, 1>(o, pf[kk], db, 1);
            }
        };
        // The online softmax of the scores in `s` (tile `cur`): masked, exponentiated in place in base 2; returns the
        // factor by which O and the sums so far shrink, per row. With a positive scale the maximum is taken over the
        // raw scores (scaling preserves their order) and the scale goes into the exponent's FFMA (s * scale - max):
        // one instruction per score fewer than scaling first, which any other scale needs (it reorders or zeroes).
        const auto softmax = [&](const AttentionPrefillTileCursor& cur, float(&correction)[2]) {
            const bool needs_mask =
                cur.begin + kBN > cur.stop || (causal && static_cast<int64_t>(cur.begin) + kBN - 1 > warp_pos);
            const bool fused = p.scale_log2 > 0.f;
            if (!fused) {
#pragma unroll
                for (int i = 0; i < kSRegs; ++i) s[i] *= p.scale_log2;
            }
            float tile_max[2] = {neg_inf(), neg_inf()};
            if (needs_mask) {
                // Score i of this lane is key cur.begin + 2 t4 + key_of(i); it is visible below limit[r] (relative to
                // cur.begin + 2 t4, clamped to the tile), so the mask is one compare with a constant per score.
                int32_t limit[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    int64_t end = cur.stop;
                    if (causal && pos[r] + 1 < end) end = pos[r] + 1;
                    const int64_t rel = end - cur.begin - 2 * t4;
                    limit[r] = static_cast<int32_t>(rel < 0 ? 0 : (rel > kBN ? kBN : rel));
                }
#pragma unroll
                for (int i = 0; i < kSRegs; ++i) {
                    const int key_of = (i / 4) * 8 + (i & 1);
                    const int r = (i >> 1) & 1;
                    s[i] = key_of < limit[r] ? s[i] : neg_inf();
                    tile_max[r] = fmaxf(tile_max[r], s[i]);
                }
            } else {
#pragma unroll
                for (int i = 0; i < kSRegs; ++i) tile_max[(i >> 1) & 1] = fmaxf(tile_max[(i >> 1) & 1], s[i]);
            }
            if (fused) {
                tile_max[0] *= p.scale_log2;
                tile_max[1] *= p.scale_log2;
            }
            float base_exp[2];
            online_max_step(row_max, tile_max, base_exp, correction);
            const float mul = fused ? p.scale_log2 : 1.f;
            float tile_sum[2] = {0.f, 0.f};
#pragma unroll
            for (int i = 0; i < kSRegs; ++i) {
                s[i] = fast_exp2(fmaf(s[i], mul, -base_exp[(i >> 1) & 1]));
                tile_sum[(i >> 1) & 1] += s[i];
            }
            row_sum[0] = row_sum[0] * correction[0] + tile_sum[0];
            row_sum[1] = row_sum[1] * correction[1] + tile_sum[1];
        };
        // P (16-bit A fragments) from the exponentiated scores.
        const auto convert_p = [&]() {
#pragma unroll
            for (int kk = 0; kk < kPSteps; ++kk) {
                pf[kk][0] = E::pack(s[8 * kk + 0], s[8 * kk + 1]);
                pf[kk][1] = E::pack(s[8 * kk + 2], s[8 * kk + 3]);
                pf[kk][2] = E::pack(s[8 * kk + 4], s[8 * kk + 5]);
                pf[kk][3] = E::pack(s[8 * kk + 6], s[8 * kk + 7]);
            }
        };
        const auto advance = [&]() {
            if (++stage == C.stages) {
                stage = 0;
                phase ^= 1u;
            }
        };

        // Q is read by the Q K^T products only: freed once the item's last one is done (the next item's Q then
        // loads under this item's last softmax, P V and epilogue).
        const auto release_q_after = [&](const AttentionPrefillTileCursor& cur) {
            AttentionPrefillTileCursor after = cur;
            after.next(p, key_end);
            if (!after.valid(p)) release(empty_q, lane);
        };

        if (!tile.valid(p)) {
            release(empty_q, lane);  // no Q was loaded: the item is read
        } else {
            // The first tile: S, softmax, P.
            if (!stuck) stuck = !ptx::mbarrier_wait_parity_bounded(full_k(stage), phase, timeout);
            turn_begin();
            ptx::wgmma_fence_operands(s);
            ptx::wgmma_fence();
            issue_qk(stage);
            ptx::wgmma_commit_group();
            turn_end();
            ptx::wgmma_wait_group<0>();
            ptx::wgmma_fence_operands(s);
            release(empty_k(stage), lane);
            release_q_after(tile);
            float correction[2];
            softmax(tile, correction);
            convert_p();
            int prev_stage = stage;
            unsigned prev_phase = phase;
            advance();
            tile.next(p, key_end);
            // Every further tile: issue its S and the previous tile's P V, softmax under the P V, rescale O.
            for (; tile.valid(p); tile.next(p, key_end)) {
                if (!stuck) stuck = !ptx::mbarrier_wait_parity_bounded(full_k(stage), phase, timeout);
                if (!stuck) {
                    stuck = !ptx::mbarrier_wait_parity_bounded(full_v(prev_stage), prev_phase, timeout);
                }
                turn_begin();
                ptx::wgmma_fence_operands(s);
                ptx::wgmma_fence_operands(o);
                ptx::wgmma_fence();
                issue_qk(stage);
                ptx::wgmma_commit_group();
                issue_pv(prev_stage);
                ptx::wgmma_commit_group();
                turn_end();
                ptx::wgmma_wait_group<1>();  // S of this tile
                ptx::wgmma_fence_operands(s);
                release(empty_k(stage), lane);
                release_q_after(tile);
                softmax(tile, correction);
                ptx::wgmma_wait_group<0>();  // P V of the previous tile
                ptx::wgmma_fence_operands(o);
#pragma unroll
                for (int kk = 0; kk < kPSteps; ++kk) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) fence_fragment(pf[kk][e]);
                }
                release(empty_v(prev_stage), lane);
#pragma unroll
                for (int i = 0; i < kORegs; ++i) o[i] *= correction[(i >> 1) & 1];
                convert_p();
                prev_stage = stage;
                prev_phase = phase;
                advance();
            }
            // The last tile's P V.
            if (!stuck) {
                stuck = !ptx::mbarrier_wait_parity_bounded(full_v(prev_stage), prev_phase, timeout);
            }
            turn_begin();
            ptx::wgmma_fence_operands(o);
            ptx::wgmma_fence();
            issue_pv(prev_stage);
            ptx::wgmma_commit_group();
            turn_end();
            ptx::wgmma_wait_group<0>();
            ptx::wgmma_fence_operands(o);
#pragma unroll
            for (int kk = 0; kk < kPSteps; ++kk) {
#pragma unroll
                for (int e = 0; e < 4; ++e) fence_fragment(pf[kk][e]);
            }
            release(empty_v(prev_stage), lane);
        }

        // Epilogue: O / sum per row, straight from the accumulators (4 lanes write a row's 16 contiguous bytes).
        // Nothing when a peer's chunk never arrived (the producer set the word before the arrivals waited on above).
        const bool aborted = *abort_word != 0u;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float sum = quad_sum(row_sum[r]);
            const int row = m0 + wg * 64 + warp * 16 + g + 8 * r;
            if (row < p.seq_q && !aborted) {
                const float inv = sum > 0.f ? 1.f / sum : 0.f;
                auto* dst =
                    static_cast<uint16_t*>(p.out) + (static_cast<int64_t>(row) * p.num_q_heads + head) * kDim + 2 * t4;
#pragma unroll
                for (int n = 0; n < kDim / 8; ++n) {
                    *reinterpret_cast<unsigned*>(dst + n * 8) =
                        E::pack(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
                }
                if (p.lse != nullptr && t4 == 0) {
                    p.lse[static_cast<int64_t>(row) * p.num_q_heads + head] =
                        sum > 0.f ? (row_max[r] + __log2f(sum)) * 0.6931471805599453f : neg_inf();
                }
            }
        }
    }
    if (stuck) __trap();
    if constexpr (kPingPong) {
        if (wg == 0) ptx::named_barrier_sync(kBarTurn0, 256);
    }
}

}  // namespace prefill_sm90_detail

/// The wgmma prefill kernel. Persistent: each block's producer claims its items from p.item_counter or, without one,
/// walks its share of waves of gridDim.x items (attention_prefill_wave_item); grid at most the items,
/// attention_prefill_threads(C) threads (a producer warpgroup, then C.block_m / 64 consumer warpgroups),
/// attention_prefill_smem_bytes(C) of dynamic shared memory. Tensor maps (3-D, innermost first, 128B swizzle, box {64,
/// 1, rows}): tma_q over q [head_dim, num_q_heads, seq_q] with box rows C.block_m; tma_k and tma_v over k and v
/// [head_dim, num_kv_heads, seq_kv] with box rows kPrefillWgmmaTileKeys.
template <AttentionPrefillConfig C>
__global__ void __launch_bounds__(attention_prefill_threads(C), 1)
    prefill_forward_sm90(const __grid_constant__ ptx::TmaDescriptor tma_q,
                         const __grid_constant__ ptx::TmaDescriptor tma_k,
                         const __grid_constant__ ptx::TmaDescriptor tma_v, const AttentionPrefillParams p) {
    static_assert(is_valid(C), "AttentionPrefillConfig: see is_valid() in weft/common/attention_prefill.hpp");
    static_assert(C.kernel == AttentionPrefillKernel::kWgmma, "prefill_forward_sm90 runs kWgmma configs");
    using T = prefill_sm90_detail::Sm90Traits<C>;
    extern __shared__ __align__(1024) uint8_t smem_sm90[];
    const unsigned base = (ptx::shared_address(smem_sm90) + 1023u) & ~1023u;
    const unsigned bars = base + T::kBarOffset;
    uint8_t* const aligned = smem_sm90 + (base - ptx::shared_address(smem_sm90));
    auto* const abort_word = reinterpret_cast<volatile uint32_t*>(aligned + T::kAbortOffset);

    if (threadIdx.x == 0) {
        *abort_word = 0u;
        ptx::mbarrier_init(bars, 1);                      // full_q
        ptx::mbarrier_init(bars + 8, T::kConsumerWarps);  // empty_q
        for (int s = 0; s < C.stages; ++s) {
            ptx::mbarrier_init(bars + 16 + 32 * s, 1);                  // full_k
            ptx::mbarrier_init(bars + 24 + 32 * s, 1);                  // full_v
            ptx::mbarrier_init(bars + 32 + 32 * s, T::kConsumerWarps);  // empty_k
            ptx::mbarrier_init(bars + 40 + 32 * s, T::kConsumerWarps);  // empty_v
        }
        ptx::fence_mbarrier_init();
    }
    __syncthreads();

    const int wg = static_cast<int>(threadIdx.x) / 128;
    if (wg == 0) {
        if constexpr (T::kConsumers > 1) ptx::setmaxnreg_dec<prefill_sm90_detail::kProducerRegs<T::kConsumers>>();
        if (threadIdx.x < 32) {
            if (threadIdx.x == 0) {
                ptx::tma_prefetch_descriptor(&tma_q);
                ptx::tma_prefetch_descriptor(&tma_k);
                ptx::tma_prefetch_descriptor(&tma_v);
            }
            if (p.item_counter != nullptr) {
                prefill_sm90_detail::producer_warp<C, true>(p, &tma_q, &tma_k, &tma_v, base, bars, abort_word);
            } else {
                prefill_sm90_detail::producer_warp<C, false>(p, &tma_q, &tma_k, &tma_v, base, bars, abort_word);
            }
        }
    } else {
        if constexpr (T::kConsumers > 1) ptx::setmaxnreg_inc<prefill_sm90_detail::kConsumerRegs<T::kConsumers>>();
        prefill_sm90_detail::consumer_warpgroup<C>(p, base, bars, abort_word, wg - 1);
    }

    if (p.finish.block_counter != nullptr) {
        __syncthreads();  // every thread of the block is past its waits and loads
        // A block whose chunk wait failed does not count itself done, so the call does not end (as a block that
        // exits): its Diagnostic stands and the op reports it.
        if (threadIdx.x == 0 && *abort_word == 0u) prefill_detail::finish_call(p);
    }
}

}  // namespace weft::kernels::attention
