// SPDX-License-Identifier: MIT
// Prefill attention on the CPU: the work and chunk orders, argument checks of flash_attention and AgAttention, and
// NVRTC compilation of every prefill kernel specialisation with the SASS it depends on (mma.sync kernel: 16-byte
// cp.async, ldmatrix, tensor-core mma; wgmma kernel: HGMMA with A from registers and a transposed V, register
// reallocation between warpgroups; both: no local memory).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "support/jit_testing.hpp"
#include "support/sass_testing.hpp"
#include "weft/common/attention_prefill.hpp"
#include "weft/jit/aot.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/ag_attention.hpp"
#include "weft/runtime/error.hpp"

namespace weft::ops {
namespace {

// ------------------------------------------------------------------------------------------------
// Orders

TEST(AttentionPrefillOrder, ChunksVisitOwnFirstThenBelowNearestFirst) {
    EXPECT_EQ(attention_prefill_chunk_at(2, 4, 0), 2);
    EXPECT_EQ(attention_prefill_chunk_at(2, 4, 1), 1);
    EXPECT_EQ(attention_prefill_chunk_at(2, 4, 2), 0);
    EXPECT_EQ(attention_prefill_chunk_at(2, 4, 3), 3);
    for (int32_t w = 1; w <= 9; ++w) {
        for (int32_t r = 0; r < w; ++r) {
            std::set<int32_t> seen;
            for (int32_t i = 0; i < w; ++i) {
                const int32_t c = attention_prefill_chunk_at(r, w, i);
                ASSERT_TRUE(c >= 0 && c < w);
                seen.insert(c);
                // The first r + 1 steps are exactly the chunks a causal rank r needs.
                EXPECT_EQ(i <= r, c <= r) << "w " << w << " r " << r << " i " << i;
            }
            EXPECT_EQ(static_cast<int32_t>(seen.size()), w);
        }
    }
}

TEST(AttentionPrefillOrder, ItemsCoverEveryTileAndHeadOnceLongestFirst) {
    for (int32_t seq : {1, 63, 64, 65, 1000}) {
        for (int32_t bm : {64, 128}) {
            const int32_t m_tiles = attention_prefill_num_m_tiles(seq, bm);
            EXPECT_EQ(m_tiles, (seq + bm - 1) / bm);
            const int32_t heads = 3;
            std::set<std::pair<int32_t, int32_t>> seen;
            for (int32_t i = 0; i < m_tiles * heads; ++i) {
                const AttentionPrefillItem it = attention_prefill_item(i, m_tiles);
                ASSERT_TRUE(it.q_head >= 0 && it.q_head < heads && it.m_tile >= 0 && it.m_tile < m_tiles);
                seen.insert({it.q_head, it.m_tile});
                if (i % m_tiles == 0) {
                    EXPECT_EQ(it.m_tile, m_tiles - 1);
                }
            }
            EXPECT_EQ(static_cast<int32_t>(seen.size()), m_tiles * heads);
        }
    }
}

// The kernel's tile walk, run on the CPU: every key below key_end exactly once, in tiles of at most 64 keys inside
// one chunk, chunks in attention_prefill_chunk_at order, first_of_chunk on each chunk's first tile only; chunks with
// no visible key never entered (so never awaited): under a causal mask, rank r's items never enter chunks above r.
TEST(AttentionPrefillOrder, TileWalkVisitsEveryVisibleKeyOnce) {
    for (int32_t w : {1, 2, 3, 4, 8}) {
        for (int32_t chunk_keys : {1, 17, 64, 65, 130}) {
            for (bool causal : {false, true}) {
                for (int32_t r = 0; r < w; ++r) {
                    AttentionPrefillParams p;
                    p.seq_q = chunk_keys;
                    p.seq_kv = w * chunk_keys;
                    p.chunk_keys = chunk_keys;
                    p.num_chunks = w;
                    p.local_chunk = r;
                    p.q_position = static_cast<int64_t>(r) * chunk_keys;
                    p.mask = static_cast<int32_t>(causal ? AttentionMask::kCausal : AttentionMask::kNone);
                    for (int32_t bm : {64, 128}) {
                        for (int32_t m0 = 0; m0 < p.seq_q; m0 += bm) {
                            const int32_t rows = std::min(bm, p.seq_q - m0);
                            const int32_t key_end = attention_prefill_key_end(p, m0, rows);
                            ASSERT_EQ(key_end,
                                      causal ? std::min<int64_t>(p.seq_kv, p.q_position + m0 + rows) : p.seq_kv);
                            std::vector<int> seen(static_cast<size_t>(p.seq_kv), 0);
                            std::vector<int32_t> chunks;
                            AttentionPrefillTileCursor c;
                            for (c.start(p, key_end); c.valid(p); c.next(p, key_end)) {
                                ASSERT_TRUE(c.begin >= c.chunk * chunk_keys && c.begin < c.stop);
                                ASSERT_LE(c.stop, std::min((c.chunk + 1) * chunk_keys, key_end));
                                ASSERT_EQ(c.chunk, attention_prefill_chunk_at(r, w, c.step));
                                ASSERT_EQ(c.first_of_chunk, chunks.empty() || chunks.back() != c.chunk);
                                if (c.first_of_chunk) chunks.push_back(c.chunk);
                                for (int32_t k = c.begin; k < std::min(c.begin + kPrefillTileKeys, c.stop); ++k) {
                                    ++seen[static_cast<size_t>(k)];
                                }
                            }
                            for (int32_t k = 0; k < p.seq_kv; ++k) {
                                ASSERT_EQ(seen[static_cast<size_t>(k)], k < key_end ? 1 : 0)
                                    << "w " << w << " chunk_keys " << chunk_keys << " r " << r << " key " << k;
                            }
                            EXPECT_EQ(chunks.front(), r);  // the own chunk first
                            for (int32_t ch : chunks) EXPECT_TRUE(!causal || ch <= r);
                            // The last query tile needs every chunk a rank pulls (AgAttention relies on it).
                            if (m0 + bm >= p.seq_q) {
                                EXPECT_EQ(static_cast<int32_t>(chunks.size()), causal ? r + 1 : w);
                            }
                        }
                    }
                }
            }
        }
    }
    // One GPU: a single chunk of seq_kv keys; no keys at all visits nothing.
    AttentionPrefillParams one;
    one.seq_q = 10;
    one.seq_kv = 0;
    one.chunk_keys = 1;
    AttentionPrefillTileCursor c;
    c.start(one, attention_prefill_key_end(one, 0, 10));
    EXPECT_FALSE(c.valid(one));
}

TEST(AttentionPrefillConfigs, ValidityAndSharedMemory) {
    for (DType t : {DType::kBF16, DType::kF16}) {
        for (int32_t d : {64, 128}) {
            const AttentionPrefillConfig c = attention_prefill_default_config(t, d);
            EXPECT_TRUE(is_valid(c));
            EXPECT_EQ(attention_prefill_threads(c), c.block_m * 2);
            EXPECT_EQ(attention_prefill_smem_bytes(c), (c.block_m + 2 * c.stages * 64) * d * 2);
        }
    }
    AttentionPrefillConfig c;
    c.head_dim = 256;
    EXPECT_FALSE(is_valid(c));
    c.head_dim = 128;
    c.block_m = 32;
    EXPECT_FALSE(is_valid(c));
    c.block_m = 64;
    c.stages = 4;
    EXPECT_FALSE(is_valid(c));
    c.stages = 3;
    c.dtype = DType::kF32;
    EXPECT_FALSE(is_valid(c));
}

TEST(AttentionPrefillConfigs, WgmmaKernelValidityAndSharedMemory) {
    for (DType t : {DType::kBF16, DType::kF16}) {
        for (int32_t d : {64, 128}) {
            const AttentionPrefillConfig c = attention_prefill_default_config(t, d, AttentionPrefillKernel::kWgmma);
            EXPECT_EQ(c.kernel, AttentionPrefillKernel::kWgmma);
            EXPECT_TRUE(is_valid(c)) << attention_prefill_invalid_reason(c);
            EXPECT_EQ(attention_prefill_tile_keys(c), 128);
            // A producer and two consumer warpgroups (three of 64 rows each at head_dim 64).
            EXPECT_EQ(c.block_m, d == 64 ? 192 : 128);
            EXPECT_EQ(attention_prefill_threads(c), 128 * (d == 64 ? 4 : 3));
            EXPECT_EQ(attention_prefill_smem_bytes(c),
                      (c.block_m + 2 * c.stages * 128) * d * 2 + kPrefillWgmmaBarrierBytes + kPrefillWgmmaAlignSlack);
        }
    }
    AttentionPrefillConfig c = attention_prefill_default_config(DType::kBF16, 128, AttentionPrefillKernel::kWgmma);
    c.block_m = 64;
    EXPECT_TRUE(is_valid(c));
    EXPECT_EQ(attention_prefill_threads(c), 128 * 2);
    c.stages = 3;  // 64 + 3 x 2 x 128 rows of 256 bytes: 208 KiB and the barriers
    EXPECT_TRUE(is_valid(c)) << attention_prefill_invalid_reason(c);
    c.block_m = 128;  // 224 KiB of tiles and the barriers: still fits 227 KiB
    EXPECT_TRUE(is_valid(c)) << attention_prefill_invalid_reason(c);
    c.stages = 4;
    EXPECT_FALSE(is_valid(c));
    EXPECT_NE(std::string(attention_prefill_invalid_reason(c)).find("stages"), std::string::npos);
    c.stages = 2;
    c.kernel = static_cast<AttentionPrefillKernel>(7);
    EXPECT_NE(std::string(attention_prefill_invalid_reason(c)).find("kernel"), std::string::npos);
    // block_m 192: three consumer warpgroups, the wgmma kernel at head_dim 64 only.
    c = attention_prefill_default_config(DType::kBF16, 64, AttentionPrefillKernel::kWgmma);
    c.block_m = 192;
    EXPECT_TRUE(is_valid(c)) << attention_prefill_invalid_reason(c);
    EXPECT_EQ(attention_prefill_threads(c), 128 * 4);
    EXPECT_EQ(attention_prefill_smem_bytes(c),
              (192 + 2 * c.stages * 128) * 64 * 2 + kPrefillWgmmaBarrierBytes + kPrefillWgmmaAlignSlack);
    c.head_dim = 128;
    EXPECT_NE(std::string(attention_prefill_invalid_reason(c)).find("block_m 192 is the wgmma kernel's at head_dim 64"),
              std::string::npos);
    c = attention_prefill_default_config(DType::kBF16, 64);
    c.block_m = 192;
    EXPECT_FALSE(is_valid(c)) << "the mma.sync kernel has no 192-row items";
    // The old kernel's tiles are unchanged by the new field.
    EXPECT_EQ(attention_prefill_tile_keys(attention_prefill_default_config(DType::kBF16, 128)), kPrefillTileKeys);
}

// A call's config: the 192-row items of head_dim 64 where they give every SM one, else 128 rows; other defaults as is.
TEST(AttentionPrefillConfigs, CallConfigKeepsEverySmBusy) {
    const auto rows = [](int32_t d, AttentionPrefillKernel k, int64_t seq, int64_t heads) {
        return attention_prefill_call_config(DType::kBF16, d, k, seq, heads, 132).block_m;
    };
    constexpr auto kW = AttentionPrefillKernel::kWgmma;
    EXPECT_EQ(rows(64, kW, 4096, 32), 192);  // 22 x 32 items
    EXPECT_EQ(rows(64, kW, 16384, 1), 128);  // 86 items of 192 rows on 132 SMs
    EXPECT_EQ(rows(64, kW, 192 * 132, 1), 192);
    EXPECT_EQ(rows(64, kW, 192 * 131, 1), 128);
    EXPECT_EQ(rows(64, kW, 192 * 131 + 1, 1), 192);
    EXPECT_EQ(rows(64, kW, 100, 8), 128);
    EXPECT_EQ(rows(128, kW, 100, 8), 128);
    EXPECT_EQ(rows(64, AttentionPrefillKernel::kMmaSync, 1 << 20, 64), 128);
    EXPECT_TRUE(is_valid(attention_prefill_call_config(DType::kF16, 64, kW, 1, 1, 132)));
}

// The resident grid's waves hand every item to exactly one block, in every grid size; every other wave reversed.
TEST(AttentionPrefillConfigs, WavesCoverEveryItemOnce) {
    for (uint32_t items : {1u, 7u, 132u, 133u, 704u, 1000u}) {
        for (uint32_t blocks : {1u, 5u, 132u, 264u, 1000u}) {
            std::vector<int> seen(items, 0);
            for (uint32_t b = 0; b < blocks; ++b) {
                bool reverse = false;
                for (uint32_t wave = 0; wave < items; wave += blocks, reverse = !reverse) {
                    const uint32_t i = attention_prefill_wave_item(wave, reverse, b, blocks);
                    ASSERT_GE(i, wave);
                    ASSERT_LT(i, wave + blocks);
                    if (i < items) ++seen[i];
                }
            }
            for (uint32_t i = 0; i < items; ++i) ASSERT_EQ(seen[i], 1) << items << " items, " << blocks << " blocks";
        }
    }
    EXPECT_EQ(attention_prefill_wave_item(0, false, 3, 132), 3u);
    EXPECT_EQ(attention_prefill_wave_item(132, true, 3, 132), 132u + 128u);
    // A resident grid up to 8 waves of resident blocks, then one block per item.
    EXPECT_EQ(attention_prefill_grid(704, 132), 132);
    EXPECT_EQ(attention_prefill_grid(8 * 132, 132), 132);
    EXPECT_EQ(attention_prefill_grid(8 * 132 + 1, 132), 8 * 132 + 1);
    EXPECT_EQ(attention_prefill_grid(40, 132), 40);
    EXPECT_EQ(attention_prefill_grid(5, 0), 1);
}

// The work counter's order: every item once; the heads that whole groups leave over first, then whole groups; within
// a group the query tiles from the last to the first, the group's heads side by side.
TEST(AttentionPrefillConfigs, GroupedOrderVisitsEveryItemOnceLongestFirstPerGroup) {
    for (uint32_t tiles : {1u, 2u, 7u, 22u}) {
        for (uint32_t heads : {1u, 3u, 8u, 32u, 33u}) {
            for (uint32_t group : {1u, 2u, 5u, 8u, 25u, 32u}) {
                if (group > heads) continue;
                const uint32_t lead = heads % group == 0 ? group : heads % group;
                const auto group_of = [&](int32_t h) {
                    return static_cast<uint32_t>(h) < lead ? 0u : 1u + (static_cast<uint32_t>(h) - lead) / group;
                };
                std::vector<int> seen(tiles * heads, 0);
                AttentionPrefillItem prev{};
                for (uint32_t idx = 0; idx < tiles * heads; ++idx) {
                    const AttentionPrefillItem it = attention_prefill_grouped_item(idx, tiles, heads, group);
                    ASSERT_GE(it.q_head, 0);
                    ASSERT_LT(it.q_head, static_cast<int32_t>(heads));
                    ASSERT_GE(it.m_tile, 0);
                    ASSERT_LT(it.m_tile, static_cast<int32_t>(tiles));
                    ++seen[it.q_head * tiles + it.m_tile];
                    if (idx == 0) {
                        ASSERT_EQ(it.q_head, 0);
                        ASSERT_EQ(it.m_tile, static_cast<int32_t>(tiles) - 1);
                    } else if (group_of(it.q_head) == group_of(prev.q_head)) {
                        // Same group: the tile never grows; at one tile, the next head.
                        ASSERT_LE(it.m_tile, prev.m_tile) << idx;
                        if (it.m_tile == prev.m_tile) {
                            ASSERT_EQ(it.q_head, prev.q_head + 1) << idx;
                        }
                    } else {
                        // The next group, from its first head's last tile.
                        ASSERT_EQ(group_of(it.q_head), group_of(prev.q_head) + 1) << idx;
                        ASSERT_EQ(it.m_tile, static_cast<int32_t>(tiles) - 1);
                        ASSERT_EQ(it.q_head, prev.q_head + 1);
                    }
                    prev = it;
                }
                for (int n : seen) ASSERT_EQ(n, 1) << tiles << " tiles, " << heads << " heads, group " << group;
            }
        }
    }
    // 33 heads in groups of 8: head 0 alone first, then four groups of 8.
    EXPECT_EQ(attention_prefill_grouped_item(21, 22, 33, 8).q_head, 0);
    EXPECT_EQ(attention_prefill_grouped_item(21, 22, 33, 8).m_tile, 0);
    EXPECT_EQ(attention_prefill_grouped_item(22, 22, 33, 8).q_head, 1);
    EXPECT_EQ(attention_prefill_grouped_item(22 + 8, 22, 33, 8).q_head, 1);
    EXPECT_EQ(attention_prefill_grouped_item(22 + 8, 22, 33, 8).m_tile, 20);
    EXPECT_EQ(attention_prefill_grouped_item(33 * 22 - 1, 22, 33, 8).q_head, 32);
}

TEST(AttentionPrefillConfigs, HeadGroupFillsHalfTheL2AndKeepsEveryBlockBusy) {
    constexpr int64_t kL2 = 50 * 1024 * 1024;  // an H200's
    // K and V of one KV head: 4 x seq_kv x head_dim bytes. 16K x 128: 8 MiB, 3 heads fit in 25 MiB; with 128 query
    // tiles 3 heads hold 384 items, under 4 per block of 132: 5 heads (660 items).
    EXPECT_EQ(attention_prefill_head_group(16384, 128, 1, 32, 1, 0, kL2), 3);
    EXPECT_EQ(attention_prefill_head_group(16384, 128, 1, 32, 128, 132, kL2), 5);
    EXPECT_EQ(attention_prefill_head_group(16384, 128, 4, 32, 128, 132, kL2), 12);    // GQA: 3 whole KV heads
    EXPECT_EQ(attention_prefill_head_group(16384, 128, 4, 32, 64, 132, kL2), 12);     // 9 q-heads: 3 KV heads
    EXPECT_EQ(attention_prefill_head_group(16384, 128, 4, 32, 32, 132, kL2), 20);     // 17 q-heads: 5 KV heads
    EXPECT_EQ(attention_prefill_head_group(4096, 64, 1, 32, 22, 132, kL2), 25);       // 1 MiB per head
    EXPECT_EQ(attention_prefill_head_group(4096, 64, 1, 16, 22, 132, kL2), 16);       // at most the heads
    EXPECT_EQ(attention_prefill_head_group(2048, 128, 1, 32, 16, 132, kL2), 32);      // 33 for the items
    EXPECT_EQ(attention_prefill_head_group(1 << 20, 128, 1, 32, 8192, 132, kL2), 1);  // at least one
    EXPECT_EQ(attention_prefill_head_group(1 << 20, 128, 8, 32, 8192, 132, kL2), 8);
    EXPECT_EQ(attention_prefill_head_group(0, 64, 1, 4, 1, 132, kL2), 4);  // no keys
}

TEST(AttentionPrefillConfigs, DefaultKernelPerComputeCapability) {
    EXPECT_EQ(attention_prefill_default_kernel(9, 0), AttentionPrefillKernel::kWgmma);
    EXPECT_EQ(attention_prefill_default_kernel(8, 0), AttentionPrefillKernel::kMmaSync);
    EXPECT_EQ(attention_prefill_default_kernel(8, 9), AttentionPrefillKernel::kMmaSync);
    EXPECT_EQ(attention_prefill_default_kernel(10, 0), AttentionPrefillKernel::kMmaSync);
    EXPECT_EQ(attention_prefill_default_kernel(12, 0), AttentionPrefillKernel::kMmaSync);
}

TEST(AttentionPrefillOrder, TilesOfTheWgmmaKernelSpan128KeysAndNeverStraddleChunks) {
    AttentionPrefillParams p;
    p.seq_kv = 300;
    p.chunk_keys = 100;
    p.num_chunks = 3;
    p.local_chunk = 1;
    AttentionPrefillTileCursor c;
    c.keys = kPrefillWgmmaTileKeys;
    c.start(p, 300);
    std::vector<std::pair<int32_t, int32_t>> tiles;
    for (; c.valid(p); c.next(p, 300)) tiles.emplace_back(c.begin, c.stop);
    // Chunk 1, then 0, then 2: one short tile each (100 keys < 128).
    const std::vector<std::pair<int32_t, int32_t>> want = {{100, 200}, {0, 100}, {200, 300}};
    EXPECT_EQ(tiles, want);
    p.chunk_keys = 300;
    p.num_chunks = 1;
    p.local_chunk = 0;
    tiles.clear();
    for (c.start(p, 290); c.valid(p); c.next(p, 290)) tiles.emplace_back(c.begin, c.stop);
    const std::vector<std::pair<int32_t, int32_t>> one = {{0, 290}, {128, 290}, {256, 290}};
    EXPECT_EQ(tiles, one);
}

// ------------------------------------------------------------------------------------------------
// Arguments (fake, never dereferenced device addresses)

struct Args {
    static void* at(uintptr_t a) { return reinterpret_cast<void*>(a); }
    TensorView q = TensorView(at(0x10000), DType::kBF16, {100, 32, 128});
    TensorView k = TensorView(at(0x1000000), DType::kBF16, {300, 8, 128});
    TensorView v = TensorView(at(0x2000000), DType::kBF16, {300, 8, 128});
    TensorView out = TensorView(at(0x3000000), DType::kBF16, {100, 32, 128});
    TensorView lse = TensorView(at(0x4000000), DType::kF32, {100, 32});
    FlashAttentionOptions options;
    detail::FlashAttentionPlan plan() const { return detail::plan_flash_attention(q, k, v, out, lse, options); }
};

void expect_rejected(const Args& a, const std::vector<std::string>& words) {
    try {
        (void)a.plan();
        ADD_FAILURE() << "accepted; expected an error naming: " << words.front();
    } catch (const Error& e) {
        const std::string msg = e.what();
        for (const std::string& w : words)
            EXPECT_NE(msg.find(w), std::string::npos) << msg << "\n(missing " << w << ")";
    }
}

TEST(AttentionPrefillArgs, ValidArgumentsPlanTheLaunch) {
    Args a;
    a.options.mask = AttentionMask::kCausal;
    a.options.q_position = 200;
    const detail::FlashAttentionPlan p = a.plan();
    EXPECT_EQ(p.params.group, 4);
    EXPECT_EQ(p.params.seq_q, 100);
    EXPECT_EQ(p.params.seq_kv, 300);
    EXPECT_EQ(p.params.q_row_stride, 32 * 128);
    EXPECT_EQ(p.params.q_head_stride, 128);
    EXPECT_EQ(p.params.kv_row_stride, 8 * 128);
    EXPECT_EQ(p.params.kv_head_stride, 128);
    EXPECT_EQ(p.params.q_position, 200);
    EXPECT_EQ(p.params.mask, static_cast<int32_t>(AttentionMask::kCausal));
    EXPECT_EQ(p.params.num_chunks, 1);
    EXPECT_EQ(p.params.chunk_keys, 300);
    EXPECT_EQ(p.params.chunk_signals, nullptr);
    EXPECT_EQ(p.params.finish.block_counter, nullptr);
    EXPECT_NEAR(p.params.scale_log2, 1.4426950408889634 / std::sqrt(128.0), 1e-6);
    EXPECT_EQ(p.params.lse, Args::at(0x4000000));
    EXPECT_EQ(p.num_items, 1 * 32);  // one 128-row tile per head
    // Strided K/V (a slice of a wider buffer), no lse, an explicit scale, a forced config.
    Args s;
    s.k = TensorView(Args::at(0x1000000), DType::kBF16, {300, 8, 128}, {3 * 8 * 128, 128, 1});
    s.v = TensorView(Args::at(0x2000000), DType::kBF16, {300, 8, 128}, {3 * 8 * 128, 128, 1});
    s.lse = TensorView();
    s.options.scale = 0.25f;
    s.options.config = AttentionPrefillConfig{.dtype = DType::kBF16, .head_dim = 128, .block_m = 64, .stages = 3};
    const detail::FlashAttentionPlan q = s.plan();
    EXPECT_EQ(q.params.lse, nullptr);
    EXPECT_EQ(q.params.kv_row_stride, 3 * 8 * 128);
    EXPECT_FLOAT_EQ(q.params.scale_log2, 0.25f * 1.4426950408889634f);
    EXPECT_EQ(q.num_items, 2 * 32);
    // seq_q 0 plans nothing; seq_kv 0 is allowed (rows see no key).
    Args e;
    e.q = TensorView(Args::at(0x10000), DType::kBF16, {0, 32, 128});
    e.out = TensorView(Args::at(0x3000000), DType::kBF16, {0, 32, 128});
    e.lse = TensorView();
    EXPECT_EQ(e.plan().num_items, 0);
    Args z;
    z.k = TensorView(Args::at(0x1000000), DType::kBF16, {0, 8, 128});
    z.v = TensorView(Args::at(0x2000000), DType::kBF16, {0, 8, 128});
    EXPECT_EQ(z.plan().params.seq_kv, 0);
}

TEST(AttentionPrefillArgs, OutputsOverlappingTheInputsAreRefusedButOutMayBeQ) {
    {
        Args a;
        a.out = TensorView(Args::at(0x1000000 + 1024), DType::kBF16, {100, 32, 128});  // over k
        expect_rejected(a, {"out must not overlap k"});
    }
    {
        Args a;
        a.out = TensorView(Args::at(0x10000 + 256), DType::kBF16, {100, 32, 128});  // a shifted q
        expect_rejected(a, {"out must not overlap q"});
    }
    {
        Args a;
        a.lse = TensorView(Args::at(0x3000000), DType::kF32, {100, 32});  // over out
        expect_rejected(a, {"lse must not overlap"});
    }
    Args in_place;
    in_place.out = in_place.q;  // each block reads its Q tile before it writes those rows
    EXPECT_NO_THROW((void)in_place.plan());
}

TEST(AttentionPrefillArgs, BadArgumentsNameTheArgument) {
    {
        Args a;
        a.q.dtype = DType::kF32;
        expect_rejected(a, {"q", "bf16 or f16"});
    }
    {
        Args a;
        a.q = TensorView(Args::at(0x10000), DType::kBF16, {100, 32, 256});
        expect_rejected(a, {"head_dim", "64 or 128"});
    }
    {
        Args a;
        a.q = TensorView(Args::at(0x10008), DType::kBF16, {100, 32, 128});
        expect_rejected(a, {"q", "16-byte aligned"});
    }
    {
        Args a;
        a.q = TensorView(Args::at(0x10000), DType::kBF16, {100, 32, 128}, {32 * 128 + 4, 128, 1});
        expect_rejected(a, {"q", "multiple of 8"});
    }
    {
        Args a;
        a.k.dtype = DType::kF16;
        expect_rejected(a, {"k", "dtype"});
    }
    {
        Args a;
        a.v = TensorView(Args::at(0x2000000), DType::kBF16, {299, 8, 128});
        expect_rejected(a, {"v", "k's shape"});
    }
    {
        Args a;
        a.k = TensorView(Args::at(0x1000000), DType::kBF16, {300, 6, 128});
        a.v = TensorView(Args::at(0x2000000), DType::kBF16, {300, 6, 128});
        expect_rejected(a, {"num_q_heads", "multiple of num_kv_heads"});
    }
    {
        Args a;
        a.k = TensorView(Args::at(0x1000000), DType::kBF16, {300, 1, 128});
        a.v = TensorView(Args::at(0x2000000), DType::kBF16, {300, 1, 128});
        expect_rejected(a, {"16 q-heads per KV head"});
    }
    {
        Args a;
        a.out = TensorView(Args::at(0x3000000), DType::kBF16, {100, 32, 128}, {32 * 128 * 2, 128, 1});
        expect_rejected(a, {"out", "contiguous"});
    }
    {
        Args a;
        a.lse = TensorView(Args::at(0x4000000), DType::kF32, {100, 16});
        expect_rejected(a, {"lse", "[100, 32]"});
    }
    {
        Args a;
        a.lse = TensorView(Args::at(0x4000000), DType::kBF16, {100, 32});
        expect_rejected(a, {"lse", "f32"});
    }
    {
        Args a;
        a.options.scale = std::nanf("");
        expect_rejected(a, {"scale", "finite"});
    }
    {
        Args a;
        a.options.q_position = -1;
        expect_rejected(a, {"q_position"});
    }
    {
        Args a;
        a.options.config = AttentionPrefillConfig{.dtype = DType::kBF16, .head_dim = 64, .block_m = 128, .stages = 2};
        expect_rejected(a, {"options.config", "head_dim 128"});
    }
    {
        Args a;
        a.options.config = AttentionPrefillConfig{.dtype = DType::kBF16, .head_dim = 128, .block_m = 96, .stages = 2};
        expect_rejected(a, {"options.config", "block_m"});
    }
    {
        Args a;
        a.options.config = AttentionPrefillConfig{.dtype = DType::kBF16,
                                                  .head_dim = 128,
                                                  .block_m = 128,
                                                  .stages = 4,
                                                  .kernel = AttentionPrefillKernel::kWgmma};
        expect_rejected(a, {"options.config", "stages must be 2 or 3"});
    }
    {
        Args a;  // a valid wgmma config plans like any other
        a.options.config = attention_prefill_default_config(DType::kBF16, 128, AttentionPrefillKernel::kWgmma);
        EXPECT_EQ(a.plan().config.kernel, AttentionPrefillKernel::kWgmma);
        EXPECT_EQ(a.plan().num_items, 32);
    }
}

// The wgmma kernel reads Q, K and V through tensor maps, which take no zero stride: a broadcast view (K/V shared by
// every KV head, stride 0) is refused when the plan is made, naming the argument and the stride, and runs on mma.sync.
TEST(AttentionPrefillArgs, WgmmaRefusesStridesItsTensorMapsCannotHold) {
    const AttentionPrefillConfig wgmma =
        attention_prefill_default_config(DType::kBF16, 128, AttentionPrefillKernel::kWgmma);
    const AttentionPrefillConfig mma = attention_prefill_default_config(DType::kBF16, 128);
    ASSERT_EQ(mma.kernel, AttentionPrefillKernel::kMmaSync);
    Args heads;  // one KV head's rows seen as 8 heads
    heads.k = TensorView(Args::at(0x1000000), DType::kBF16, {300, 8, 128}, {128, 0, 1});
    heads.v = TensorView(Args::at(0x2000000), DType::kBF16, {300, 8, 128}, {128, 0, 1});
    heads.options.config = wgmma;
    expect_rejected(heads, {"flash_attention: k stride 1 must be positive", "wgmma kernel's tensor maps", "kMmaSync"});
    heads.options.config = mma;
    EXPECT_EQ(heads.plan().params.kv_head_stride, 0);
    Args rows;  // one key repeated over the sequence
    rows.k = TensorView(Args::at(0x1000000), DType::kBF16, {300, 8, 128}, {0, 128, 1});
    rows.v = TensorView(Args::at(0x2000000), DType::kBF16, {300, 8, 128}, {0, 128, 1});
    rows.options.config = wgmma;
    expect_rejected(rows, {"k stride 0 must be positive"});
    Args q;  // one query row broadcast over seq_q
    q.q = TensorView(Args::at(0x10000), DType::kBF16, {100, 32, 128}, {0, 128, 1});
    q.options.config = wgmma;
    expect_rejected(q, {"q stride 0 must be positive"});
    // A stride of 2^40 bytes or more is past what a tensor map holds.
    Args far;
    far.k = TensorView(Args::at(0x1000000), DType::kBF16, {300, 8, 128}, {int64_t{1} << 39, 128, 1});
    far.v = TensorView(Args::at(0x2000000), DType::kBF16, {300, 8, 128}, {int64_t{1} << 39, 128, 1});
    far.options.config = wgmma;
    expect_rejected(far, {"k stride 0", "below 2^40 bytes"});
    // A stride of an extent-1 dimension is never followed: one KV head with stride 0 plans on wgmma.
    Args one;
    one.q = TensorView(Args::at(0x10000), DType::kBF16, {100, 16, 128});
    one.out = TensorView(Args::at(0x3000000), DType::kBF16, {100, 16, 128});
    one.lse = TensorView();
    one.k = TensorView(Args::at(0x1000000), DType::kBF16, {300, 1, 128}, {128, 0, 1});
    one.v = TensorView(Args::at(0x2000000), DType::kBF16, {300, 1, 128}, {128, 0, 1});
    one.options.config = wgmma;
    EXPECT_EQ(one.plan().config.kernel, AttentionPrefillKernel::kWgmma);
}

// flash_attention checks every argument before it asks the device which kernel it runs by default: without a GPU a bad
// k is still k's error.
TEST(AttentionPrefillArgs, PublicCallChecksArgumentsBeforeTheDevice) {
    Args a;
    a.k.dtype = DType::kF16;
    a.v.dtype = DType::kF16;
    try {
        flash_attention(a.q, a.k, a.v, a.out, a.lse, nullptr, a.options);
        ADD_FAILURE() << "flash_attention accepted f16 keys for bf16 queries";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("k must have q's dtype bf16"), std::string::npos) << e.what();
    }
    Args b;
    b.out = TensorView(Args::at(0x3000000), DType::kBF16, {100, 32, 64});
    try {
        flash_attention(b.q, b.k, b.v, b.out, b.lse, nullptr, b.options);
        ADD_FAILURE() << "flash_attention accepted an out of the wrong shape";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("out must be contiguous [100, 32, 128]"), std::string::npos) << e.what();
    }
}

TEST(AgAttentionShape, BadShapesNameTheArgument) {
    const AgAttentionShape good{.max_seq = 4096, .num_q_heads = 32, .num_kv_heads = 8, .head_dim = 128};
    EXPECT_NO_THROW(validate_ag_attention_shape(good, 4));
    auto rejected = [&](AgAttentionShape s, int w, const std::string& word, AgAttentionOptions o = {}) {
        try {
            validate_ag_attention_shape(s, w, o);
            ADD_FAILURE() << "accepted; expected an error naming " << word;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
        }
    };
    AgAttentionShape s = good;
    s.max_seq = 4098;
    rejected(s, 4, "uneven shards are not supported");
    s = good;
    s.head_dim = 256;
    rejected(s, 4, "shape.head_dim");
    s = good;
    s.num_kv_heads = 3;
    rejected(s, 4, "shape.num_q_heads");
    s = good;
    s.dtype = DType::kF32;
    rejected(s, 4, "shape.dtype");
    AgAttentionOptions o;
    o.sm_budget = -1;
    rejected(good, 4, "options.sm_budget", o);
    o = {};
    o.config = AttentionPrefillConfig{.dtype = DType::kF16, .head_dim = 128, .block_m = 128, .stages = 2};
    rejected(good, 4, "options.config", o);
}

// ------------------------------------------------------------------------------------------------
// NVRTC: every specialisation compiles for sm_90a without spills or local memory; it copies with 16-byte cp.async
// (LDGSTS.E.BYPASS.128), reads shared memory with ldmatrix (LDSM, .trans for V) and multiplies on the tensor cores
// (HMMA.16816.F32).

// Compiles `config` for sm_90a and checks what every specialisation must show: a cubin, a clean ptxas report, no
// spill and no stack frame, and no local memory in its SASS; a config given `max_spill_bytes` (the wgmma kernel's three
// consumer warpgroups, whose producer warpgroup keeps 32 registers and consumers 160: kernels/attention/README.md) may
// spill that much. Returns the kernel's SASS: empty when no disassembler is here (`why_not` says why), nullopt when the
// compile failed (reported).
std::optional<std::string> compile_without_spills(jit::Compiler& c, const AttentionPrefillConfig& config,
                                                  std::string* why_not, int max_spill_bytes = 0) {
    const jit::KernelSpec spec = attention_prefill_kernel_spec(config, "sm_90a");
    const jit::CompileResult r = c.compile(spec);
    if (!r.cubin || r.cubin->empty()) {
        ADD_FAILURE() << "no cubin: " << r.log;
        return std::nullopt;
    }
    weft::testing::expect_clean_ptxas_report(r.log, spec.describe(), max_spill_bytes);
    EXPECT_LE(r.ptxas_info.spill_store_bytes, max_spill_bytes) << r.ptxas_info.text;
    EXPECT_LE(r.ptxas_info.stack_frame_bytes, max_spill_bytes) << r.ptxas_info.text;
    std::printf("[ PTXAS    ] %s: %d registers\n", spec.describe().c_str(), r.ptxas_info.registers);
    std::string tool;
    const auto sass = weft::testing::disassemble(*r.cubin, &tool, why_not);
    if (sass.empty()) return std::string();
    const auto fn = sass.find(r.lowered_name);
    if (fn == sass.end()) {
        ADD_FAILURE() << "no SASS for " << r.lowered_name << " (" << tool << ")";
        return std::nullopt;
    }
    if (max_spill_bytes == 0) {
        EXPECT_EQ(fn->second.find("LDL"), std::string::npos) << "local memory loads";
        EXPECT_EQ(fn->second.find("STL"), std::string::npos) << "local memory stores";
    }
    return fn->second;
}

TEST(AttentionPrefillNvrtc, EverySpecialisationCompilesWithTheExpectedSass) {
    weft::testing::TempDir cache("weft_attention_prefill_nvrtc");
    jit::Compiler c(weft::testing::isolated_compiler_config(cache.path()));
    int checked_sass = 0;
    int compiled = 0;
    std::string why_not;
    for (DType t : {DType::kBF16, DType::kF16}) {
        for (int32_t d : {64, 128}) {
            for (int32_t bm : {64, 128}) {
                AttentionPrefillConfig config = attention_prefill_default_config(t, d);
                config.block_m = bm;
                // f16 differs only in its mma and conversions: its default block_m is enough.
                if (t == DType::kF16 && bm != 128) continue;
                SCOPED_TRACE(attention_prefill_kernel_spec(config, "sm_90a").describe());
                const std::optional<std::string> sass = compile_without_spills(c, config, &why_not);
                if (!sass) return;
                ++compiled;
                if (sass->empty()) continue;
                const std::string& text = *sass;
                EXPECT_NE(text.find("LDGSTS.E.BYPASS.128"), std::string::npos) << "16-byte cp.async.cg";
                EXPECT_NE(text.find("LDSM.16.M88.4"), std::string::npos) << "ldmatrix.x4";
                EXPECT_NE(text.find("LDSM.16.MT88.4"), std::string::npos) << "ldmatrix.x4.trans (V)";
                EXPECT_NE(text.find(t == DType::kBF16 ? "HMMA.16816.F32.BF16" : "HMMA.16816.F32"), std::string::npos)
                    << "tensor-core mma";
                ++checked_sass;
            }
        }
    }
    EXPECT_EQ(compiled, 6);
    if (checked_sass == 0) GTEST_SKIP() << "SKIPPED: SASS not checked: " << why_not;
    EXPECT_EQ(checked_sass, 6);
}

// The wgmma kernel: S = Q K^T as HGMMA 64x128x16 from shared memory, O += P V as HGMMA with A from registers and a
// transposed (MN-major) V, the QK^T of the next tile issued ahead of the P V (a wait that leaves one group in flight),
// registers moved from the producer warpgroup to the consumers (two or three consumer warpgroups), no local memory
// (three consumer warpgroups: at most 256 bytes, nearly all in the two producer loops at 32 registers).
TEST(AttentionPrefillNvrtc, EveryWgmmaSpecialisationCompilesWithTheExpectedSass) {
    weft::testing::TempDir cache("weft_attention_prefill_wgmma_nvrtc");
    jit::Compiler c(weft::testing::isolated_compiler_config(cache.path()));
    int checked_sass = 0;
    int compiled = 0;
    std::string why_not;
    for (DType t : {DType::kBF16, DType::kF16}) {
        for (int32_t d : {64, 128}) {
            for (int32_t bm : {64, 128, 192}) {
                for (int32_t stages : {2, 3}) {
                    AttentionPrefillConfig config =
                        attention_prefill_default_config(t, d, AttentionPrefillKernel::kWgmma);
                    // f16 differs only in its wgmma and conversions: its default config is enough.
                    if (t == DType::kF16 && (bm != config.block_m || stages != config.stages)) continue;
                    if (bm == 192 && d != 64) continue;
                    config.block_m = bm;
                    config.stages = stages;
                    SCOPED_TRACE(attention_prefill_kernel_spec(config, "sm_90a").describe());
                    const std::optional<std::string> sass =
                        compile_without_spills(c, config, &why_not, bm == 192 ? 256 : 0);
                    if (!sass) return;
                    ++compiled;
                    if (sass->empty()) continue;
                    const std::string& text = *sass;
                    const std::string type = t == DType::kBF16 ? ".F32.BF16" : ".F32";  // f16 has no suffix
                    EXPECT_NE(text.find("HGMMA.64x128x16" + type + " R"), std::string::npos) << "S = Q K^T";
                    EXPECT_NE(text.find(".tnspB"), std::string::npos) << "O += P V with V MN-major";
                    EXPECT_NE(text.find("HGMMA.64x" + std::to_string(d) + "x16" + type + " R"), std::string::npos)
                        << "O += P V, N = head_dim";
                    EXPECT_NE(text.find("WARPGROUP.DEPBAR.LE gsb0, 0x1"), std::string::npos)
                        << "the next tile's S in flight during the softmax";
                    EXPECT_NE(text.find("UTMALDG.3D"), std::string::npos) << "3-D TMA loads";
                    if (bm >= 128) {
                        EXPECT_NE(text.find("USETMAXREG.DEALLOC"), std::string::npos) << "producer gives registers";
                        EXPECT_NE(text.find("USETMAXREG.TRY_ALLOC"), std::string::npos) << "consumers take them";
                    }
                    ++checked_sass;
                }
            }
        }
    }
    EXPECT_EQ(compiled, 12);
    if (checked_sass == 0) GTEST_SKIP() << "SKIPPED: SASS not checked: " << why_not;
    EXPECT_EQ(checked_sass, 12);
}

TEST(AttentionPrefillNvrtc, AotRegistrationListsTheDefaultSpecialisationsOnce) {
    register_prefill_attention_aot_specs();
    register_prefill_attention_aot_specs();  // idempotent
    std::set<std::string> seen;
    int count = 0;
    for (const jit::KernelSpec& s : jit::aot_specs()) {
        if (s.header != "attention/prefill.cuh") continue;
        EXPECT_TRUE(seen.insert(s.instantiation).second) << "listed twice: " << s.instantiation;
        ++count;
    }
    EXPECT_EQ(count, 4);
    int wgmma_count = 0;
    for (const jit::KernelSpec& s : jit::aot_specs()) {
        if (s.header != "attention/prefill_sm90.cuh") continue;
        EXPECT_TRUE(seen.insert(s.instantiation).second) << "listed twice: " << s.instantiation;
        ++wgmma_count;
    }
    EXPECT_EQ(wgmma_count, 6);  // the defaults, and the 128-row items of head_dim 64 (attention_prefill_call_config)
    for (DType t : {DType::kBF16, DType::kF16}) {
        for (int32_t d : {64, 128}) {
            EXPECT_EQ(seen.count(attention_prefill_kernel_spec(attention_prefill_default_config(t, d)).instantiation),
                      1u);
            EXPECT_EQ(seen.count(attention_prefill_kernel_spec(
                                     attention_prefill_default_config(t, d, AttentionPrefillKernel::kWgmma))
                                     .instantiation),
                      1u);
        }
    }
}

}  // namespace
}  // namespace weft::ops
