// SPDX-License-Identifier: MIT
// Flash-attention forward (prefill) on the tensor cores: FA2-style, a warp per 16 query rows, m16n8k16 mma.sync with
// fp32 accumulators and fp32 online-softmax statistics, K and V streamed through a cp.async pipeline, causal or no
// mask, grouped-query attention. The keys are cut into chunks (a rank's shard each, for all-gather attention): a block
// waits for a chunk's arrival flag before its first load from it, visiting its own chunk first; the last block to
// finish ends an all-gather call (AttentionPrefillFinish).
//
// Launched by weft::ops::flash_attention and weft::ops::AgAttention (src/ops/ag_attention.cpp) through the JIT:
//   weft::kernels::attention::prefill_forward<AttentionPrefillConfig{...}>
// Schedule, protocol, knobs and pitfalls: README.md here.
#pragma once

#include "attention/decode.cuh"
#include "weft/common/attention_prefill.hpp"
#include "weft/device/tile.cuh"
#include "weft/ptx/atom.cuh"

namespace weft::kernels::attention {

namespace prefill_detail {

/// The end of an all-gather call, by thread 0 of the last block to finish: every block is past all its waits, so
/// every chunk signal and every ready flag of this call has been consumed: reset them (stream order puts the next
/// call's copies after this kernel), tell every rank this one is done, wait until every rank is done (no peer still
/// reads this rank's shard when the next call overwrites it), advance the epoch. A failed wait or an unreachable peer
/// ends the thread with its Diagnostic recorded.
__device__ __forceinline__ void finish_call(const AttentionPrefillParams& p) {
    const AttentionPrefillFinish& f = p.finish;
    const device::Thread me{};
    // acq_rel at GPU scope: the other blocks' waits (and the resets below) are ordered after them.
    const uint64_t before = ptx::atom_add<ptx::Sem::kAcqRel, ptx::Scope::kGpu>(f.block_counter, 1ull);
    if (before + 1 != static_cast<uint64_t>(gridDim.x)) return;
    ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(f.block_counter, 0ull);
    for (int32_t c = 0; c < p.num_chunks; ++c) ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(f.chunk_signals + c, 0ull);
    for (int32_t s = 0; s < p.ctx.num_ranks; ++s) {
        if (s != p.ctx.rank) ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(f.ready + s, 0ull);
    }
    const uint64_t e = ptx::ld(f.epoch) + 1;
    for (int32_t pe = 0; pe < p.ctx.num_ranks; ++pe) {  // release: the resets above come first
        device::exit_unless(
            device::tile::notify_checked(me, p.ctx, f.done + p.ctx.rank, pe, 1ull, device::SignalOp::kAdd));
    }
    device::exit_unless(device::tile::wait_checked(me, p.ctx, f.done, p.ctx.num_ranks, Cmp::kGe, e).ok());
    ptx::st(f.epoch, e);
}

}  // namespace prefill_detail

/// The prefill kernel. Persistent: block b takes work items b, b + gridDim.x, ... (attention_prefill_item); grid at
/// most the items, attention_prefill_threads(C) threads, attention_prefill_smem_bytes(C) of dynamic shared memory.
/// Per item (query tile m, q-head h): the Q tile is loaded once (cp.async, kept in registers as mma fragments), then
/// for every K/V tile the item sees, S = Q K^T (16 rows per warp), masked and scaled to base 2, the online softmax
/// (running max and sum per row, fp32), O += P V with P's accumulators as the A operand; at the end O / sum goes to
/// `out` and, when asked, the natural-log LSE to `lse`. Rows past seq_q are neither read nor written; a row with no
/// visible key gets zeros and lse = -inf.
template <AttentionPrefillConfig C>
__global__ void __launch_bounds__(attention_prefill_threads(C)) prefill_forward(const AttentionPrefillParams p) {
    static_assert(is_valid(C), "AttentionPrefillConfig: see is_valid() in weft/common/attention_prefill.hpp");
    static_assert(C.kernel == AttentionPrefillKernel::kMmaSync, "prefill_forward runs kMmaSync configs");
    using E = Elem<C.dtype>;
    using TileCursor = AttentionPrefillTileCursor;
    constexpr int kDim = C.head_dim;
    constexpr int kBM = C.block_m;
    constexpr int kBN = kPrefillTileKeys;
    constexpr int kThreads = attention_prefill_threads(C);
    constexpr int kRowBytes = kDim * 2;
    constexpr int kChunks = kDim / 8;  // 16-byte chunks per row
    constexpr int kStageBytes = kBN * kRowBytes;
    constexpr int kRowsPerPass = kThreads / kChunks;
    constexpr int kLoadsPerThread = kBN / kRowsPerPass;  // per tensor and tile
    constexpr int kKSteps = kDim / 16;                   // k-steps of Q K^T
    constexpr int kNTiles = kDim / 8;                    // 8-column output tiles per row block
    constexpr int kSTiles = kBN / 8;                     // 8-key score tiles per row block
    static_assert(kThreads % kChunks == 0 && kBN % kRowsPerPass == 0, "tile loads must divide evenly");

    extern __shared__ __align__(128) uint8_t smem[];
    const unsigned q_base = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const unsigned k_base = q_base + kBM * kRowBytes;
    const unsigned v_base = k_base + C.stages * kStageBytes;

    const int tid = static_cast<int>(threadIdx.x);
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t4 = lane % 4;
    const int my_chunk = tid % kChunks;
    const int my_row = tid / kChunks;
    const bool causal = p.mask == static_cast<int32_t>(AttentionMask::kCausal);
    const int32_t num_m_tiles = attention_prefill_num_m_tiles(p.seq_q, kBM);
    const int32_t num_items = num_m_tiles * p.num_q_heads;
    // Chunks this block has already seen arrive (bit c; chunks >= 64 are awaited every time).
    uint64_t arrived = 0;

    for (int32_t item_idx = static_cast<int32_t>(blockIdx.x); item_idx < num_items;
         item_idx += static_cast<int32_t>(gridDim.x)) {
        const AttentionPrefillItem item = attention_prefill_item(item_idx, num_m_tiles);
        const int head = item.q_head;
        const int kv_head = head / p.group;
        const int m0 = item.m_tile * kBM;
        const int rows = p.seq_q - m0 < kBM ? p.seq_q - m0 : kBM;
        const int32_t key_end = attention_prefill_key_end(p, m0, rows);
        __syncthreads();  // the previous item's shared-memory reads are done

        // The Q tile (rows past seq_q are zero), its own commit group ahead of the K/V tiles'.
        const auto* q_gmem = static_cast<const uint16_t*>(p.q) + head * p.q_head_stride;
        for (int i = tid; i < kBM * kChunks; i += kThreads) {
            const int row = i / kChunks;
            const int chunk = i % kChunks;
            const bool valid = row < rows;
            const uint16_t* src = q_gmem + (valid ? (m0 + row) * p.q_row_stride : 0) + chunk * 8;
            ptx::cp_async_16_zfill(q_base + swizzled<kRowBytes>(row, chunk), src, valid);
        }
        ptx::cp_async_commit();

        const uint16_t* k_gmem = static_cast<const uint16_t*>(p.k) + kv_head * p.kv_head_stride + my_chunk * 8;
        const uint16_t* v_gmem = static_cast<const uint16_t*>(p.v) + kv_head * p.kv_head_stride + my_chunk * 8;
        // Issues the copies of the tile at `cur` into `stage`; before the first tile of a peer's chunk, the block waits
        // for the chunk's flag (every thread gets here together: the issue is block-uniform).
        auto issue = [&](const TileCursor& cur, int stage) {
            const uint16_t* kg = k_gmem;
            const uint16_t* vg = v_gmem;
            if (cur.first_of_chunk && p.chunk_signals != nullptr && cur.chunk != p.local_chunk &&
                (cur.chunk >= 64 || (arrived >> cur.chunk & 1u) == 0)) {
                const device::Token token =
                    device::tile::wait_checked(device::Block{}, p.ctx, p.chunk_signals + cur.chunk, 1, Cmp::kGe, 1ull)
                        .token_or_exit();
                kg = device::tile::consume_token(kg, token);
                vg = device::tile::consume_token(vg, token);
                if (cur.chunk < 64) arrived |= uint64_t{1} << cur.chunk;
            }
#pragma unroll
            for (int i = 0; i < kLoadsPerThread; ++i) {
                const int row = my_row + i * kRowsPerPass;
                const int key = cur.begin + row;
                const bool valid = key < cur.stop;
                const int64_t at = valid ? static_cast<int64_t>(key) * p.kv_row_stride : 0;
                const unsigned dst = static_cast<unsigned>(stage * kStageBytes) + swizzled<kRowBytes>(row, my_chunk);
                ptx::cp_async_16_zfill(k_base + dst, kg + at, valid);
                ptx::cp_async_16_zfill(v_base + dst, vg + at, valid);
            }
        };

        TileCursor loads;
        loads.start(p, key_end);
        TileCursor tile = loads;
#pragma unroll
        for (int s = 0; s < C.stages - 1; ++s) {
            if (loads.valid(p)) {
                issue(loads, s);
                loads.next(p, key_end);
            }
            ptx::cp_async_commit();
        }

        float acc[kNTiles][4];
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
        float row_max[2] = {neg_inf(), neg_inf()};  // rows g and g + 8 of the warp, base-2 scaled scores
        float row_sum[2] = {0.f, 0.f};              // this lane's share; summed over the quad at the end
        unsigned qf[kKSteps][4];
        // Global positions of this lane's two rows and the warp's first row.
        const int64_t warp_pos = p.q_position + m0 + warp * 16;
        const int64_t pos[2] = {warp_pos + g, warp_pos + g + 8};

        for (int n_tile = 0; tile.valid(p); ++n_tile) {
            ptx::cp_async_wait<C.stages - 2>();
            __syncthreads();  // this tile (and at first the Q tile) is visible; every warp is done with the stage below
            if (n_tile == 0) {
#pragma unroll
                for (int kk = 0; kk < kKSteps; ++kk) {
                    const int q_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    ptx::ldmatrix_x4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3],
                                     q_base + swizzled<kRowBytes>(q_row, kk * 2 + (lane >> 4)));
                }
            }
            if (loads.valid(p)) {
                issue(loads, (n_tile + C.stages - 1) % C.stages);
                loads.next(p, key_end);
            }
            ptx::cp_async_commit();

            const unsigned stage = static_cast<unsigned>((n_tile % C.stages) * kStageBytes);
            // S = Q K^T: 16 rows x kBN keys per warp.
            float s[kSTiles][4];
#pragma unroll
            for (int n = 0; n < kSTiles; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
                for (int j = 0; j < kBN / 16; ++j) {
                    unsigned b0, b1, b2, b3;
                    const int k_row = j * 16 + (lane & 7) + (lane >> 4) * 8;
                    ptx::ldmatrix_x4(b0, b1, b2, b3,
                                     k_base + stage + swizzled<kRowBytes>(k_row, kk * 2 + ((lane >> 3) & 1)));
                    E::mma(s[2 * j], qf[kk], b0, b1);
                    E::mma(s[2 * j + 1], qf[kk], b2, b3);
                }
            }
            // Scale to base 2; mask keys past the chunk's visible end and, causally, past each row's position (only in
            // tiles that need it: warp-uniform test).
            const bool needs_mask =
                tile.begin + kBN > tile.stop || (causal && static_cast<int64_t>(tile.begin) + kBN - 1 > warp_pos);
            float tile_max[2] = {neg_inf(), neg_inf()};
            if (needs_mask) {
#pragma unroll
                for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = tile.begin + n * 8 + 2 * t4 + (e & 1);
                        const bool visible = key < tile.stop && (!causal || key <= pos[e >> 1]);
                        s[n][e] = visible ? s[n][e] * p.scale_log2 : neg_inf();
                        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
                    }
                }
            } else {
#pragma unroll
                for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[n][e] *= p.scale_log2;
                        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
                    }
                }
            }
            online_softmax_step(s, tile_max, row_max, row_sum, acc);
            // O += P V: P's accumulator registers are the A operand of each 16-key step.
#pragma unroll
            for (int j = 0; j < kBN / 16; ++j) {
                const unsigned pa[4] = {E::pack(s[2 * j][0], s[2 * j][1]), E::pack(s[2 * j][2], s[2 * j][3]),
                                        E::pack(s[2 * j + 1][0], s[2 * j + 1][1]),
                                        E::pack(s[2 * j + 1][2], s[2 * j + 1][3])};
                const int v_row = j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
                for (int d = 0; d < kDim / 16; ++d) {
                    unsigned b0, b1, b2, b3;
                    ptx::ldmatrix_x4_trans(b0, b1, b2, b3,
                                           v_base + stage + swizzled<kRowBytes>(v_row, d * 2 + (lane >> 4)));
                    E::mma(acc[2 * d], pa, b0, b1);
                    E::mma(acc[2 * d + 1], pa, b2, b3);
                }
            }
            tile.next(p, key_end);
        }
        ptx::cp_async_wait<0>();  // the Q group of an item with no visible key, and the empty groups

        // Epilogue: O / sum per row, straight from the accumulators (4 lanes write a row's 16 contiguous bytes).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float sum = quad_sum(row_sum[r]);
            const int row = m0 + warp * 16 + g + 8 * r;
            if (row < p.seq_q) {
                const float inv = sum > 0.f ? 1.f / sum : 0.f;
                auto* dst =
                    static_cast<uint16_t*>(p.out) + (static_cast<int64_t>(row) * p.num_q_heads + head) * kDim + 2 * t4;
#pragma unroll
                for (int n = 0; n < kNTiles; ++n) {
                    *reinterpret_cast<unsigned*>(dst + n * 8) = E::pack(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
                }
                if (p.lse != nullptr && t4 == 0) {
                    p.lse[static_cast<int64_t>(row) * p.num_q_heads + head] =
                        sum > 0.f ? (row_max[r] + __log2f(sum)) * 0.6931471805599453f : neg_inf();
                }
            }
        }
    }

    if (p.finish.block_counter != nullptr) {
        __syncthreads();  // every thread of the block is past its waits and loads
        if (tid == 0) prefill_detail::finish_call(p);
    }
}

}  // namespace weft::kernels::attention
