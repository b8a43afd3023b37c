// SPDX-License-Identifier: MIT
// Decode attention over a paged KV cache: a split-KV kernel (one block per (split, KV head, sequence), all q-heads
// of the KV head in the 16 rows of m16n8k16 mma tiles, K and V streamed once through a cp.async pipeline) and a
// combine kernel that merges the splits' partial outputs by their log-sum-exp.
//
// Launched by weft::ops::decode_attention (src/ops/attention.cpp) through the JIT, one specialisation per
// AttentionDecodeConfig{dtype, head_dim, stages, check_pages}. Schedule, knobs and pitfalls: README.md here.
#pragma once

#include "weft/common/attention.hpp"
#include "weft/common/collectives.hpp"
#include "weft/device/ll.cuh"
#include "weft/device/symmetric.cuh"
#include "weft/ptx/cp_async.cuh"
#include "weft/ptx/cvt.cuh"
#include "weft/ptx/griddep.cuh"
#include "weft/ptx/matrix.cuh"
#include "weft/ptx/mma.cuh"

namespace weft::kernels::attention {

template <DType T>
struct Elem;

template <>
struct Elem<DType::kBF16> {
    static __device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        ptx::mma_m16n8k16_f32_bf16(d, a, b0, b1);
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) { return ptx::cvt_rn_bf16x2(lo, hi); }
};

template <>
struct Elem<DType::kF16> {
    static __device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        ptx::mma_m16n8k16_f32_f16(d, a, b0, b1);
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) { return ptx::cvt_rn_f16x2(lo, hi); }
};

/// -infinity: the log-sum-exp of no token, the running max of a row that has seen none.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

/// 2^x, one MUFU instruction; 2^-inf = +0.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/// One online-softmax step for the two rows a quad of lanes holds (base-2 scores): folds the quad's tile maximum into
/// each row's running maximum and gives the exponent base of the tile's scores (0 for a row with no visible score yet,
/// so that exponents stay finite) and the factor that rescales the row's earlier sum and output.
__device__ __forceinline__ void online_max_step(float (&row_max)[2], const float (&tile_max)[2], float (&base)[2],
                                                float (&correction)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float m = fmaxf(row_max[r], quad_max(tile_max[r]));
        base[r] = m == neg_inf() ? 0.f : m;
        correction[r] = fast_exp2(row_max[r] - base[r]);
        row_max[r] = m;
    }
}

/// The softmax part of one key tile for the two rows a quad of lanes holds (mma.sync fragments of base-2 scores,
/// tile_max the lane's maxima per row): online_max_step, the scores exponentiated in place, their sum folded into each
/// row's running sum and the output accumulator rescaled by the correction.
template <int kSTiles, int kNTiles>
__device__ __forceinline__ void online_softmax_step(float (&s)[kSTiles][4], const float (&tile_max)[2],
                                                    float (&row_max)[2], float (&row_sum)[2],
                                                    float (&acc)[kNTiles][4]) {
    float base[2];
    float correction[2];
    online_max_step(row_max, tile_max, base, correction);
    float tile_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[n][e] = fast_exp2(s[n][e] - base[e >> 1]);
            tile_sum[e >> 1] += s[n][e];
        }
    }
    row_sum[0] = row_sum[0] * correction[0] + tile_sum[0];
    row_sum[1] = row_sum[1] * correction[1] + tile_sum[1];
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
        acc[n][0] *= correction[0];
        acc[n][1] *= correction[0];
        acc[n][2] *= correction[1];
        acc[n][3] *= correction[1];
    }
}

/// Sequence-parallel decode: sends columns col..col+3 of final row `row` (and, when `with_lse`, the row's LSE) as LL
/// lines to slot `rank` of every rank's LL buffer, flagged for the epoch the cross-rank combine kernel runs under
/// (AttentionPeerPush). Per thread; the receiver polls the lines, nothing else orders them.
template <int kDim>
__device__ __forceinline__ void push_row_part(const AttentionDecodeParams& p, int64_t row, int col, float4 v, float lse,
                                              bool with_lse) {
    const AttentionPeerPush& x = p.push;
    const uint64_t epoch = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(x.epoch);
    const uint32_t flag = low_latency_flag(epoch);
    const int n = x.ctx.num_ranks;
    const int me = x.ctx.rank;
    uint8_t* const slot =
        x.ll_buffer + ((epoch & 1u) * static_cast<uint64_t>(n) + static_cast<uint64_t>(me)) * x.ll_slot_bytes;
    const uint64_t line = static_cast<uint64_t>(row) * attention_push_row_lines(kDim);
    for (int k = 0; k < n; ++k) {
        const int q = (me + k) % n;
        // Checked without a trap (no call, no local memory in this kernel): an unreachable peer is recorded as a
        // diagnostic (the abort word raised) and skipped; the combine kernels' waits then stop at the abort.
        uint8_t* const remote = device::symm_at_checked(x.ctx, slot, q, __LINE__);
        if (remote == nullptr) continue;
        const uint64_t at = (line + static_cast<uint64_t>(col / 2)) * device::ll::kLineBytes;
        device::ll::store_line(remote + at, make_uint2(__float_as_uint(v.x), __float_as_uint(v.y)), flag);
        device::ll::store_line(remote + at + device::ll::kLineBytes,
                               make_uint2(__float_as_uint(v.z), __float_as_uint(v.w)), flag);
        if (with_lse) {
            device::ll::store_line(remote + (line + kDim / 2) * device::ll::kLineBytes,
                                   make_uint2(__float_as_uint(lse), x.tag), flag);
        }
    }
}

/// Records a block-table entry outside the cache in `status` (when given; the first one found claims it: a plain load
/// first, so that a record already made costs no atomic).
__device__ __forceinline__ void record_bad_page(AttentionStatus* status, int32_t sequence, int32_t page,
                                                int32_t value) {
    if (status == nullptr || *reinterpret_cast<volatile int32_t*>(&status->code) != 0) return;
    if (atomicCAS(&status->code, 0, -1) == 0) {
        status->sequence = sequence;
        status->page = page;
        status->value = value;
        __threadfence_system();
        atomicExch(&status->code, 1);
    }
}

/// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of `kRowBytes`-byte rows. Chunks are XOR-swizzled by
/// the row's low 3 bits so that the 8 rows an ldmatrix reads at one chunk index hit 8 different bank groups.
template <int kRowBytes>
__device__ __forceinline__ unsigned swizzled(int row, int chunk) {
    return static_cast<unsigned>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

/// Split kernel. Grid (num_splits, num_kv_heads, batch), kAttentionThreads threads, attention_decode_smem_bytes(C)
/// of dynamic shared memory. Block (s, h, b) reads tokens [s * tokens_per_split, ...) of sequence b, clipped to its
/// length, of KV head h, once, for the `group` q-heads of h. Warp w takes tokens 16w..16w+15 of every tile and keeps
/// its own running max, sum and output rows; the warps merge in shared memory at the end. With one split the block
/// writes `out` and `lse` (or, with p.push_enabled, pushes them to every rank: push_row_part); otherwise the
/// normalised partial output and its log-sum-exp (natural log) of the split, which decode_combine merges. A split
/// with no tokens writes zeros and -inf.
template <AttentionDecodeConfig C>
__global__ void __launch_bounds__(kAttentionThreads) decode_split(AttentionDecodeParams p) {
    static_assert(is_valid(C), "AttentionDecodeConfig: see is_valid() in weft/common/attention.hpp");
    using E = Elem<C.dtype>;
    constexpr int kDim = C.head_dim;
    constexpr int kRowBytes = kDim * 2;
    constexpr int kChunks = kDim / 8;  // 16-byte chunks per row
    constexpr int kTile = kAttentionTileTokens;
    constexpr int kStageBytes = kTile * kRowBytes;
    constexpr int kRowsPerPass = kAttentionThreads / kChunks;
    constexpr int kLoadsPerThread = kTile / kRowsPerPass;  // per tensor and tile
    constexpr int kNTiles = kDim / 8;                      // 8-column output tiles per row block
    static_assert(kAttentionThreads % kChunks == 0 && kTile % kRowsPerPass == 0, "tile loads must divide evenly");

    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t* const q_smem = smem;
    uint8_t* const k_smem = smem + 16 * kRowBytes;
    const unsigned q_base = static_cast<unsigned>(__cvta_generic_to_shared(q_smem));
    const unsigned k_base = static_cast<unsigned>(__cvta_generic_to_shared(k_smem));
    const unsigned v_base = k_base + C.stages * kStageBytes;

    // Launched programmatically (DecodeAttentionOptions::programmatic_launch): nothing is read or written before the
    // kernel before this one has completed; otherwise a no-op. The combine kernel (launched programmatically) may
    // then be scheduled once every split block has started; it waits for this grid to complete before it reads the
    // partials.
    ptx::wait_for_prior_grids();
    ptx::launch_dependents();
    const int split = static_cast<int>(blockIdx.x);
    const int kv_head = static_cast<int>(blockIdx.y);
    const int b = static_cast<int>(blockIdx.z);
    const int tid = static_cast<int>(threadIdx.x);
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int group = p.group;

    // Q rows 0..group-1 are the group's q-heads; rows group..15 are zero. Their loads are issued first, beside the
    // sequence length's, so that neither latency waits for the other.
    constexpr int kQPerThread = 16 * kChunks / kAttentionThreads;
    static_assert(16 * kChunks % kAttentionThreads == 0, "Q tile loads must divide evenly");
    uint4 q_regs[kQPerThread];
#pragma unroll
    for (int i = 0; i < kQPerThread; ++i) {
        const int idx = tid + i * kAttentionThreads;
        const int row = idx / kChunks;
        q_regs[i] = make_uint4(0u, 0u, 0u, 0u);
        if (row < group) {
            const auto* src = static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride +
                              static_cast<int64_t>(kv_head * group + row) * p.q_head_stride + (idx % kChunks) * 8;
            q_regs[i] = *reinterpret_cast<const uint4*>(src);
        }
    }

    int64_t len = p.seq_lens[b];
    len = len < 0 ? 0 : (len > p.max_seq_len ? p.max_seq_len : len);
    const int64_t begin = static_cast<int64_t>(split) * p.tokens_per_split;
    const int64_t end_64 = begin + p.tokens_per_split < len ? begin + p.tokens_per_split : len;
    // Token indices fit 32 bits (the host checks max_seq_len < 2^31): page arithmetic stays in 32-bit integers.
    const int first = static_cast<int>(begin);
    const int end = end_64 > begin ? static_cast<int>(end_64) : first;
    int num_tiles = (end - first + kTile - 1) / kTile;  // -1: a bad block-table entry (below)

    // Thread tid copies chunk (tid % kChunks) of rows tid / kChunks + kRowsPerPass * i of every K and V tile.
    const int my_chunk = tid % kChunks;
    const int my_row = tid / kChunks;
    const int32_t* table = p.block_table + b * p.block_table_stride;
    const auto* k_gmem = static_cast<const uint16_t*>(p.k) + kv_head * p.head_stride + my_chunk * 8;
    const auto* v_gmem = static_cast<const uint16_t*>(p.v) + kv_head * p.head_stride + my_chunk * 8;
    const unsigned page_size = static_cast<unsigned>(p.page_size);
    const int page_shift = p.page_shift;
    // Logical page of token t: a shift for power-of-two page sizes (the common ones), else a division.
    auto page_of = [&](int t) {
        return page_shift >= 0 ? static_cast<unsigned>(t) >> page_shift : static_cast<unsigned>(t) / page_size;
    };

    // The physical pages of this thread's rows of `tile`, read one tile ahead of their copies so that the block
    // table's latency does not stall the copies. At head_dim 256 (16 rows per thread, 128 accumulators) the pages are
    // read just before their copies instead: holding them a tile longer would spill.
    constexpr bool kPrefetchPages = kLoadsPerThread <= 8;
    // `clamp` (check_pages only): an entry outside [0, num_pages) reads page 0 (the prologue's tiles, copied before the
    // split's entries are checked below); the loop's entries are checked before it starts.
    auto lookup = [&](int tile, int32_t(&pages)[kLoadsPerThread], bool clamp) {
#pragma unroll
        for (int i = 0; i < kLoadsPerThread; ++i) {
            const int t = first + tile * kTile + my_row + i * kRowsPerPass;
            const int32_t entry = t < end ? table[page_of(t)] : 0;
            if constexpr (C.check_pages) {
                pages[i] = clamp && static_cast<uint32_t>(entry) >= p.num_pages ? 0 : entry;
            } else {
                pages[i] = entry;
            }
        }
    };
    auto issue = [&](int tile, int stage, int32_t(&pages)[kLoadsPerThread], bool clamp) {
        if constexpr (!kPrefetchPages) lookup(tile, pages, clamp);
#pragma unroll
        for (int i = 0; i < kLoadsPerThread; ++i) {
            const int row = my_row + i * kRowsPerPass;
            const int t = first + tile * kTile + row;
            const bool valid = t < end;
            const unsigned slot = static_cast<unsigned>(t) - page_of(t) * page_size;
            const int64_t at = valid ? pages[i] * p.page_stride + slot * p.slot_stride : 0;
            const unsigned dst = static_cast<unsigned>(stage * kStageBytes) + swizzled<kRowBytes>(row, my_chunk);
            ptx::cp_async_16_zfill(k_base + dst, k_gmem + at, valid);
            ptx::cp_async_16_zfill(v_base + dst, v_gmem + at, valid);
        }
    };

    float acc[kNTiles][4];
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float row_max[2] = {neg_inf(), neg_inf()};  // rows lane/4 and lane/4 + 8, base-2 scaled scores
    float row_sum[2] = {0.f, 0.f};              // this lane's share; summed over the quad at the end

    int32_t pages[kLoadsPerThread];
    if constexpr (kPrefetchPages) {
        // Every prologue tile's pages first: their loads overlap instead of chaining one latency per tile.
        int32_t first_pages[C.stages - 1][kLoadsPerThread];
#pragma unroll
        for (int s = 0; s < C.stages - 1; ++s) lookup(s, first_pages[s], true);
        lookup(C.stages - 1, pages, false);
#pragma unroll
        for (int s = 0; s < C.stages - 1; ++s) {
            if (s < num_tiles) issue(s, s, first_pages[s], true);
            ptx::cp_async_commit();
        }
    } else {
#pragma unroll
        for (int s = 0; s < C.stages - 1; ++s) {
            if (s < num_tiles) issue(s, s, pages, true);
            ptx::cp_async_commit();
        }
    }

    // Q (read at the kernel's start) into shared memory; the next barrier publishes it.
#pragma unroll
    for (int i = 0; i < kQPerThread; ++i) {
        const int idx = tid + i * kAttentionThreads;
        *reinterpret_cast<uint4*>(q_smem + swizzled<kRowBytes>(idx / kChunks, idx % kChunks)) = q_regs[i];
    }

    // With check_pages, every block-table entry of the split is checked while the prologue's copies are in flight (the
    // loop's lookups then need no compare). A split holding an entry outside [0, num_pages) reads nothing more and
    // poisons its rows (num_tiles = -1: NaN out; lse NaN, or +inf in a partial, which makes the merged row NaN); the
    // first entry found is recorded in p.status. Only a call given a status compiles this in: measured on one H100, it
    // made the kernel up to 4% slower (head_dim 256, batch 8, 128K tokens), though it runs before the loop.
    if constexpr (C.check_pages) {
        const unsigned first_page = page_of(first);
        const unsigned end_page = end > first ? page_of(end - 1) + 1 : first_page;
        bool bad = false;
#pragma unroll 4
        for (unsigned j = first_page + static_cast<unsigned>(tid); j < end_page; j += kAttentionThreads) {
            const int32_t entry = table[j];
            if (static_cast<uint32_t>(entry) >= p.num_pages) {
                if (!bad) record_bad_page(p.status, p.sequence_base + b, static_cast<int32_t>(j), entry);  // its first
                bad = true;
            }
        }
        if (__syncthreads_or(bad)) num_tiles = -1;
    }

    const int g = lane / 4;
    const int t4 = lane % 4;
    for (int tile = 0; tile < num_tiles; ++tile) {
        ptx::cp_async_wait<C.stages - 2>();
        __syncthreads();  // tile `tile` is visible to all; every warp is done with the stage refilled below
        const int next = tile + C.stages - 1;
        if (next < num_tiles) {
            issue(next, next % C.stages, pages, false);
            if constexpr (kPrefetchPages) lookup(next + 1, pages, false);
        }
        ptx::cp_async_commit();

        const unsigned stage = static_cast<unsigned>((tile % C.stages) * kStageBytes);
        // S = Q K^T for this warp's 16 tokens: two 8-token n-tiles.
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int kk = 0; kk < kDim / 16; ++kk) {
            unsigned a[4];
            const int q_row = (lane & 7) + ((lane >> 3) & 1) * 8;
            ptx::ldmatrix_x4(a[0], a[1], a[2], a[3], q_base + swizzled<kRowBytes>(q_row, kk * 2 + (lane >> 4)));
            unsigned b0, b1, b2, b3;
            const int k_row = warp * 16 + (lane & 7) + (lane >> 4) * 8;
            ptx::ldmatrix_x4(b0, b1, b2, b3, k_base + stage + swizzled<kRowBytes>(k_row, kk * 2 + ((lane >> 3) & 1)));
            E::mma(s[0], a, b0, b1);
            E::mma(s[1], a, b2, b3);
        }
        // Scale to base 2, mask tokens past the end, online softmax per row.
        const int tok0 = first + tile * kTile + warp * 16 + 2 * t4;
        float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = tok0 + n * 8 + (e & 1);
                s[n][e] = t < end ? s[n][e] * p.scale_log2 : neg_inf();
                tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
            }
        }
        online_softmax_step(s, tile_max, row_max, row_sum, acc);
        // O += P V: P's accumulator registers are the A operand of the k = 16-token step.
        const unsigned pa[4] = {E::pack(s[0][0], s[0][1]), E::pack(s[0][2], s[0][3]), E::pack(s[1][0], s[1][1]),
                                E::pack(s[1][2], s[1][3])};
#pragma unroll
        for (int j = 0; j < kDim / 16; ++j) {
            unsigned b0, b1, b2, b3;
            const int v_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            ptx::ldmatrix_x4_trans(b0, b1, b2, b3, v_base + stage + swizzled<kRowBytes>(v_row, j * 2 + (lane >> 4)));
            E::mma(acc[2 * j], pa, b0, b1);
            E::mma(acc[2 * j + 1], pa, b2, b3);
        }
    }

    // Merge the warps: per row, the block's max M and sum L; every warp's rows rescaled to M into an fp32 buffer
    // over the (now idle) K/V stages; then each output element sums its 4 warps' values.
    ptx::cp_async_wait<0>();
    __syncthreads();
    float* const warp_max = reinterpret_cast<float*>(q_smem);  // [warps][16]
    float* const warp_sum = warp_max + kAttentionWarps * 16;   // [warps][16]
    float* const block_max = warp_sum + kAttentionWarps * 16;  // [16]
    float* const block_sum = block_max + 16;                   // [16]
    float* const buf = reinterpret_cast<float*>(k_smem);       // [warps][16][kDim]
    row_sum[0] = quad_sum(row_sum[0]);
    row_sum[1] = quad_sum(row_sum[1]);
    if (t4 == 0) {
        warp_max[warp * 16 + g] = row_max[0];
        warp_max[warp * 16 + g + 8] = row_max[1];
        warp_sum[warp * 16 + g] = row_sum[0];
        warp_sum[warp * 16 + g + 8] = row_sum[1];
    }
    __syncthreads();
    float factor[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        float m = neg_inf();
#pragma unroll
        for (int w = 0; w < kAttentionWarps; ++w) m = fmaxf(m, warp_max[w * 16 + row]);
        factor[r] = m == neg_inf() ? 0.f : fast_exp2(row_max[r] - m);
    }
    if (tid < 16) {
        float m = neg_inf();
#pragma unroll
        for (int w = 0; w < kAttentionWarps; ++w) m = fmaxf(m, warp_max[w * 16 + tid]);
        float l = 0.f;
        if (m != neg_inf()) {
#pragma unroll
            for (int w = 0; w < kAttentionWarps; ++w)
                l += warp_sum[w * 16 + tid] * fast_exp2(warp_max[w * 16 + tid] - m);
        }
        block_max[tid] = m;
        block_sum[tid] = l;
    }
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
        const int col = n * 8 + 2 * t4;
        if (g < group) {
            *reinterpret_cast<float2*>(buf + (warp * 16 + g) * kDim + col) =
                make_float2(acc[n][0] * factor[0], acc[n][1] * factor[0]);
        }
        if (g + 8 < group) {
            *reinterpret_cast<float2*>(buf + (warp * 16 + g + 8) * kDim + col) =
                make_float2(acc[n][2] * factor[1], acc[n][3] * factor[1]);
        }
    }
    __syncthreads();

    const int num_q_heads = p.num_q_heads;
    for (int i = tid; i < group * (kDim / 4); i += kAttentionThreads) {
        const int row = i / (kDim / 4);
        const int col = (i % (kDim / 4)) * 4;
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < kAttentionWarps; ++w) {
            const float4 x = *reinterpret_cast<const float4*>(buf + (w * 16 + row) * kDim + col);
            sum.x += x.x;
            sum.y += x.y;
            sum.z += x.z;
            sum.w += x.w;
        }
        const float l = block_sum[row];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        sum.x *= inv;
        sum.y *= inv;
        sum.z *= inv;
        sum.w *= inv;
        // ln(sum of e^(scale q.k)) = (M + log2 L) ln 2, scores being scale x log2(e) x q.k.
        float lse = l > 0.f ? (block_max[row] + __log2f(l)) * 0.69314718055994531f : neg_inf();
        if (C.check_pages && num_tiles < 0) {
            const float nan = __int_as_float(0x7fffffff);
            sum = make_float4(nan, nan, nan, nan);
            lse = p.num_splits == 1 && p.push_enabled == 0 ? nan : -neg_inf();
        }
        const int64_t head_row = static_cast<int64_t>(b) * num_q_heads + kv_head * group + row;
        if (p.num_splits == 1 && p.push_enabled != 0) {
            push_row_part<kDim>(p, head_row, col, sum, lse, col == 0);
        } else if (p.num_splits == 1) {
            const uint2 packed = make_uint2(E::pack(sum.x, sum.y), E::pack(sum.z, sum.w));
            *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p.out) + head_row * kDim + col) = packed;
            if (p.lse != nullptr && col == 0) p.lse[head_row] = lse;
        } else {
            const int64_t slot = head_row * p.num_splits + split;
            *reinterpret_cast<float4*>(p.partial_o + slot * kDim + col) = sum;
            if (col == 0) p.partial_lse[slot] = lse;
        }
    }
}

/// Combine kernel. Grid batch * num_q_heads, kAttentionCombineThreads threads: block x merges row x (one (sequence,
/// q-head)) over its num_splits partials, weighting split s by e^(lse_s - max) / sum, and writes `out` and `lse`
/// (natural log; -inf and zeros when every split was empty), or pushes them to every rank (p.push_enabled,
/// sequence-parallel decode). The block's threads split the row's float4 columns x the splits, so that a row's loads
/// are all in flight at once (a warp looping over the splits waits one memory latency per few splits). The minimum
/// of one block per SM in its launch bounds lets ptxas use the registers the diagnostic path needs (without it, it
/// keeps to 32 and spills there).
template <AttentionDecodeConfig C>
__global__ void __launch_bounds__(kAttentionCombineThreads, 1) decode_combine(AttentionDecodeParams p) {
    static_assert(is_valid(C), "AttentionDecodeConfig: see is_valid() in weft/common/attention.hpp");
    using E = Elem<C.dtype>;
    constexpr int kDim = C.head_dim;
    constexpr int kVecs = kDim / 4;                           // float4 per row
    constexpr int kLanes = kAttentionCombineThreads / kVecs;  // splits read side by side
    constexpr int kWarps = kAttentionCombineThreads / 32;
    static_assert(kAttentionCombineThreads % kVecs == 0 && kLanes >= 1, "a row's columns must divide the block");
    __shared__ float weight[kAttentionMaxSplits];
    __shared__ float warp_red[kWarps];
    __shared__ float4 part_sum[kLanes][kVecs];
    // Launched programmatically behind the split kernel: its partials are complete and visible after this.
    ptx::wait_for_prior_grids();
    const int tid = static_cast<int>(threadIdx.x);
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int64_t row = blockIdx.x;
    if (row >= static_cast<int64_t>(p.batch) * p.num_q_heads) return;
    const int num_splits = p.num_splits;
    const float* lses = p.partial_lse + row * num_splits;
    const float* parts = p.partial_o + row * num_splits * kDim;

    // The row's max LSE and sum of e^(lse - max) over the splits, by the whole block.
    constexpr int kLsePerThread = (kAttentionMaxSplits + kAttentionCombineThreads - 1) / kAttentionCombineThreads;
    float my_lse[kLsePerThread];
    float m = neg_inf();
#pragma unroll
    for (int i = 0; i < kLsePerThread; ++i) {
        const int sp = tid + i * kAttentionCombineThreads;
        my_lse[i] = sp < num_splits ? lses[sp] : neg_inf();
        m = fmaxf(m, my_lse[i]);
    }
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
    if (lane == 0) warp_red[warp] = m;
    __syncthreads();
    m = warp_red[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m = fmaxf(m, warp_red[w]);
    __syncthreads();  // every thread has read warp_red before it is reused for the sums
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kLsePerThread; ++i) {
        const int sp = tid + i * kAttentionCombineThreads;
        const float w = m != neg_inf() && sp < num_splits ? __expf(my_lse[i] - m) : 0.f;  // 0 for an empty split
        if (sp < num_splits) weight[sp] = w;
        total += w;
    }
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) total += __shfl_xor_sync(0xffffffffu, total, x);
    if (lane == 0) warp_red[warp] = total;
    __syncthreads();
    total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += warp_red[w];
    const float inv = total > 0.f ? __frcp_rn(total) : 0.f;

    // Thread (j, c) sums column c of splits j, j + kLanes, ...; then the kLanes partial sums of each column meet.
    const int c = tid % kVecs;
    const int j = tid / kVecs;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m != neg_inf()) {
#pragma unroll 4
        for (int sp = j; sp < num_splits; sp += kLanes) {
            const float w = weight[sp] * inv;
            const float4 x = *reinterpret_cast<const float4*>(parts + static_cast<int64_t>(sp) * kDim + c * 4);
            sum.x += w * x.x;
            sum.y += w * x.y;
            sum.z += w * x.z;
            sum.w += w * x.w;
        }
    }
    part_sum[j][c] = sum;
    __syncthreads();
    if (j != 0) return;
#pragma unroll
    for (int i = 1; i < kLanes; ++i) {
        const float4 x = part_sum[i][c];
        sum.x += x.x;
        sum.y += x.y;
        sum.z += x.z;
        sum.w += x.w;
    }
    float lse = m != neg_inf() ? m + __logf(total) : neg_inf();
    // A poisoned partial's +inf (a bad block-table entry, check_pages) is pushed as it is: the ranks' merge then makes
    // the row NaN even where every other rank's share is empty (its -inf rows would otherwise hide a NaN LSE).
    if (p.push_enabled != 0 && m == -neg_inf()) lse = m;
    if (p.push_enabled != 0) {
        push_row_part<kDim>(p, row, c * 4, sum, lse, c == 0);
    } else {
        const uint2 packed = make_uint2(E::pack(sum.x, sum.y), E::pack(sum.z, sum.w));
        *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p.out) + row * kDim + c * 4) = packed;
        if (p.lse != nullptr && c == 0) p.lse[row] = lse;
    }
}

}  // namespace weft::kernels::attention
