// SPDX-License-Identifier: MIT
// Small-M GEMM, GemvVariant::kBulkRows (decode, M <= 16, B [N,K] with its rows back to back, K a multiple of 2048):
// one CTA per SM owns a contiguous range of B's rows and streams it by 1D bulk copies (cp.async.bulk) through a
// shared-memory ring, no split-K. Two bodies (gemv_rows_uses_ffma decides, the op alike): whole rows on the CUDA
// cores with A in registers (M <= 2, K = 2048 x 1, 2, 4 or 8; gemv_rows_body), and groups of 8 rows on the tensor
// cores with a producer warp for B and one for A (gemv_groups_body).
#pragma once

#include "gemm/gemv_common.cuh"
#include "weft/common/gemv_config.hpp"
#include "weft/ptx/cvt.cuh"
#include "weft/ptx/griddep.cuh"
#include "weft/ptx/mbarrier.cuh"
#include "weft/ptx/tma.cuh"

namespace weft::kernels::gemm {
namespace detail {

/// 16 bytes of global memory that no one writes during the kernel (A), through the non-coherent path.
__device__ __forceinline__ uint4 ld_16(const void* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

/// 8 bf16 or f16 values (16 bytes) as floats (exact).
template <bool kIsBF16>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if constexpr (kIsBF16) {
            ptx::bf16x2_bits_to_f32x2(w[i], f[2 * i], f[2 * i + 1]);
        } else {
            f[2 * i] = ptx::f16_bits_to_f32(static_cast<unsigned short>(w[i] & 0xffffu));
            f[2 * i + 1] = ptx::f16_bits_to_f32(static_cast<unsigned short>(w[i] >> 16));
        }
    }
}

/// The CTA's share of B: rows [n0, n0 + rows) (rows <= 0 for a CTA past N; the op's grid has none).
struct GemvCtaRows {
    int n0;
    int rows;
};
__device__ __forceinline__ GemvCtaRows gemv_cta_rows(const GemvArgs& args) {
    const int n0 = static_cast<int>(blockIdx.x) * args.rows_per_cta;
    return {n0, min(args.rows_per_cta, args.n - n0)};
}

/// The whole-row body (kBulkRows' comment in gemv_config.hpp; the op checks M <= kGemvRowsMaxM, K =
/// kGemvRowsSpanElems x 1, 2, 4 or 8, ldb = K, one split, 16-byte aligned A rows): CTA c owns rows n0 = c rows_per_cta .. of B, one
/// contiguous range of spans (4 KiB, one 16-byte piece per thread), streamed through a ring of kStages stages
/// of 8 spans, each one 1D bulk copy issued by thread 0. A row is kSpansPerRow spans, which divides a stage's 8: span
/// j of a stage is span j % kSpansPerRow of row 8 i / kSpansPerRow + j / kSpansPerRow, all known at compile time. So
/// thread t always takes piece t of a span, and its 8 k are the same in every row (k = 2048 (j % kSpansPerRow) + 8 t):
/// its A values (M x kSpansPerRow x 8) sit in registers, converted to fp32 once, and shared memory carries B only.
/// Each thread keeps M x 2 fp32 partial dot products for the current row; at the row's last span every warp adds
/// them up (shuffles) into its slot sums[row % (2 rows per stage)][warp][m]; after the stage's barrier the first
/// threads add the 8 warps' slots of the stage's rows in warp order (deterministic) and write D, while the next
/// stage's rows use the other half of the slots.
template <DType kOut, bool kIsBF16, int kStages, int kSpansPerRow, int kM>
__device__ __forceinline__ void gemv_rows_body(const GemvArgs& args) {
    constexpr int kStageBytes = kGemvRowsStageBytes;
    constexpr int kThreads = kGemvBulkThreads;
    constexpr int kWarps = kThreads / 32;
    constexpr int kSpanBytes = kThreads * 16;
    constexpr int kSpans = kStageBytes / kSpanBytes;  // per stage
    constexpr int kRowsPerStage = kSpans / kSpansPerRow;
    static_assert(kSpanBytes == 2 * kGemvRowsSpanElems, "gemv_rows: a span is one 16-byte piece per thread");
    static_assert(kSpans % kSpansPerRow == 0, "gemv_rows: a stage holds whole rows");
    extern __shared__ __align__(1024) unsigned char gemv_smem[];
    const unsigned bars = ptx::shared_address(gemv_smem);
    const unsigned ring = (bars + 128 + 1023) & ~1023u;
    unsigned char* const ring_ptr = gemv_smem + (ring - bars);
    const int tid = static_cast<int>(threadIdx.x);
    const int warp = tid / 32;
    const int lane = tid % 32;
    const auto [n0, rows] = gemv_cta_rows(args);
    if (rows <= 0) return;  // CTA-uniform (the op's grid leaves none empty)
    const int spans = rows * kSpansPerRow;
    const int steps = (spans + kSpans - 1) / kSpans;
    const auto* b = static_cast<const unsigned char*>(args.b) + static_cast<long long>(n0) * args.k * 2;
    // [2 kRowsPerStage][kWarps][kM]: the rows of two consecutive stages.
    float* const sums = reinterpret_cast<float*>(ring_ptr + gemv_rows_sums_offset(kStages));

    if (tid == 0) {
        for (int s = 0; s < kStages; ++s) ptx::mbarrier_init(bars + 8 * s, 1);
        ptx::fence_mbarrier_init();
    }
    __syncthreads();
    const auto fill = [&](int step) {
        const unsigned bar = bars + 8 * (step % kStages);
        const int first = step * kSpans;
        const unsigned bytes = static_cast<unsigned>(min(kSpans, spans - first) * kSpanBytes);
        ptx::mbarrier_arrive_expect_tx(bar, bytes);
        ptx::bulk_load_1d(ring + static_cast<unsigned>((step % kStages) * kStageBytes),
                          b + static_cast<long long>(first) * kSpanBytes, bytes, bar);
    };
    if (tid == 0) {
        for (int i = 0; i < kStages && i < steps; ++i) fill(i);
    }
    // Launched programmatically (GemmOptions::programmatic_launch), the ring's first stages of B stream while the
    // kernel before this one on the stream still runs; A and D are that kernel's to write until it completes.
    ptx::wait_for_prior_grids();
    if (tid == 0) ptx::launch_dependents();
    // This thread's A: k = 2048 j + 8 t of every row m, as fp32.
    float a[kM][kSpansPerRow][8];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
        const auto* a_row = static_cast<const unsigned char*>(args.a) + static_cast<long long>(m) * args.lda * 2;
#pragma unroll
        for (int j = 0; j < kSpansPerRow; ++j) {
            unpack8<kIsBF16>(ld_16(a_row + 2 * (kGemvRowsSpanElems * j + 8 * tid)), a[m][j]);
        }
    }

    for (int i = 0; i < steps; ++i) {
        const int s = i % kStages;
        if (!ptx::mbarrier_wait_parity_bounded(bars + 8 * s, static_cast<unsigned>(i / kStages) & 1u,
                                               kGemvStageWaitNs)) {
            __trap();
        }
        const int n_spans = min(kSpans, spans - i * kSpans);  // whole rows: a multiple of kSpansPerRow
        const unsigned char* piece = ring_ptr + s * kStageBytes + 16 * tid;
        uint4 bv[kSpans];
#pragma unroll
        for (int j = 0; j < kSpans; ++j) bv[j] = lds_16_if(j < n_spans, piece + j * kSpanBytes);
        // The stage's rows, each with two partial sums per m (spans past n_spans are zeros).
        float acc[kRowsPerStage][kM][2] = {};
#pragma unroll
        for (int j = 0; j < kSpans; ++j) {
            float bf[8];
            unpack8<kIsBF16>(bv[j], bf);
            const int r = j / kSpansPerRow;
            const int js = j % kSpansPerRow;
#pragma unroll
            for (int m = 0; m < kM; ++m) {
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][m][e % 2] = fmaf(bf[e], a[m][js][e], acc[r][m][e % 2]);
            }
        }
        // Warp sums of every row of the stage, the rows' shuffle chains interleaved.
        float v[kRowsPerStage][kM];
#pragma unroll
        for (int r = 0; r < kRowsPerStage; ++r)
#pragma unroll
            for (int m = 0; m < kM; ++m) v[r][m] = acc[r][m][0] + acc[r][m][1];
#pragma unroll
        for (int off = 16; off > 0; off /= 2)
#pragma unroll
            for (int r = 0; r < kRowsPerStage; ++r)
#pragma unroll
                for (int m = 0; m < kM; ++m) v[r][m] += __shfl_xor_sync(0xffffffffu, v[r][m], off);
        const int slot0 = (i % 2) * kRowsPerStage;
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < kRowsPerStage; ++r)
#pragma unroll
                for (int m = 0; m < kM; ++m) sums[((slot0 + r) * kWarps + warp) * kM + m] = v[r][m];
        }
        __syncthreads();  // every warp has read stage s and written its sums of the stage's rows
        if (tid == 0 && i + kStages < steps) {
            ptx::fence_proxy_async_shared_cta();  // the generic reads above before the copy's writes
            fill(i + kStages);
        }
        // The last warp adds the warps' sums of the stage's rows in warp order and writes D; the next stage's
        // rows go to the other slots, and the barrier after it orders these reads before the slots' reuse.
        const int q = tid - (kThreads - kRowsPerStage * kM);
        if (q >= 0) {
            const int r = q / kM;
            const int m = q % kM;
            const int row = i * kRowsPerStage + r;
            if (row < rows) {
                float total = 0.f;
#pragma unroll
                for (int w = 0; w < kWarps; ++w) total += sums[((slot0 + r) * kWarps + w) * kM + m];
                store_out<kOut>(args.d, static_cast<int64_t>(m) * args.ldd + n0 + row, total);
            }
        }
    }
}

/// The whole-row body's entry: one body per row length (K / kGemvRowsSpanElems = 1, 2, 4 or 8 spans) and M (1, 2);
/// the op admits nothing else (A of every one fits in registers: kGemvRowsMaxMK, asserted in gemv_config.hpp).
template <DType kOut, bool kIsBF16, int kStages, int kM>
__device__ __forceinline__ void gemv_rows_m(const GemvArgs& args) {
    static_assert(kM >= 1 && kM <= kGemvRowsMaxM, "gemv_rows: M <= kGemvRowsMaxM");
    switch (args.k / kGemvRowsSpanElems) {
        case 1: gemv_rows_body<kOut, kIsBF16, kStages, 1, kM>(args); break;
        case 2: gemv_rows_body<kOut, kIsBF16, kStages, 2, kM>(args); break;
        case 4: gemv_rows_body<kOut, kIsBF16, kStages, 4, kM>(args); break;
        case 8: gemv_rows_body<kOut, kIsBF16, kStages, 8, kM>(args); break;
        default: __trap();
    }
}

/// The row-group body (the op checks M <= kGemvGroupsMaxM, K a multiple of kGemvRowsSpanElems, ldb = K, one
/// split, 16-byte aligned A rows; gemv_rows_uses_ffma(M, K) false): tensor cores for the M the FFMA body cannot
/// carry. kGemvGroupsThreads threads: 8 consumer warps, a producer warp for B and one for A. CTA c owns rows
/// n0 = c rows_per_cta ..
/// of B and takes them in blocks of kGemvGroupsBlockRows (64): for each block, k chunk by k chunk
/// (kGemvRowsSpanElems = 2048 k), group by group (8 rows). A stage is one group's chunk: 8 row pieces of 4 KiB,
/// each one 1D bulk copy issued by B's producer (lane 0) into its own 4 KiB of the stage (rows past the CTA's end
/// are not copied: their stale pieces only reach columns of D that are not written). B's producer refills a
/// stage once all 8 consumer warps have arrived on its `empty` barrier (after their MMAs took the stage's values),
/// so no consumer waits for a copy to be issued (issued from one thread inside the consumers' stage barrier, the 8
/// copies per stage would hold every warp up: kernels/gemm/README.md).
/// Warp w takes k = 256 w .. 256 w + 255 of every stage, lane (g, t) the 16 bytes at k 32 p + 8 t (p = 0..7) of
/// row g: with the k permutation of gemv_common.cuh these are the B fragments of two m16n8k16 MMAs (n8 = the
/// group's 8 rows), whose A fragments (rows g and g + 8 of A, zero past M) serve all the chunk's groups: A's producer
/// bulk-copies A's rows of the next chunk into a slot after the ring (evict-last in L2; the B copies evict-first)
/// and each warp moves its fragments into registers at the chunk's start (A is read once per block). Each warp
/// keeps one accumulator per group of the block (8 x 4 floats); at the block's end the consumers' partial sums meet
/// in shared memory (after the ring: [8 warps][8 groups][32 lanes][4]) and are added in warp order (deterministic)
/// while the ring already streams the next block.
template <DType kOut, bool kIsBF16, int kStages, bool kUpperHalf>
__device__ __forceinline__ void gemv_groups_body(const GemvArgs& args) {
    constexpr int kStageBytes = kGemvRowsStageBytes;
    constexpr int kGroupRows = 8;
    constexpr int kPieceBytes = kStageBytes / kGroupRows;
    constexpr int kChunkK = kGemvRowsSpanElems;
    constexpr int kConsumers = kGemvGroupsThreads - 64;  // the last two warps produce: B's stages, A's slot
    constexpr int kWarps = kConsumers / 32;
    constexpr int kWarpK = kChunkK / kWarps;
    constexpr int kPairs = kWarpK / 32;  // pairs of k16 steps per warp and stage
    constexpr int kGroups = kGemvGroupsBlockRows / kGroupRows;
    constexpr int kBarConsumers = 1;  // named barrier of the consumer warps (0 is __syncthreads)
    static_assert(kPieceBytes == 2 * kChunkK, "gemv_groups: a stage is 8 rows of one k chunk");
    static_assert(kWarpK % 32 == 0, "gemv_groups: each warp takes whole pairs of k16 steps");
    static_assert(kWarps * kGroups * 32 * 4 * 4 == kGemvGroupsSumsBytes, "gemv_groups: the block sums' layout");
    extern __shared__ __align__(1024) unsigned char gemv_smem[];
    // Barriers: [kStages] stage landed, [kStages] stage read, A's slot landed, A's slot read.
    const unsigned full = ptx::shared_address(gemv_smem);
    const unsigned empty = full + 8 * kStages;
    const unsigned a_full = empty + 8 * kStages;
    const unsigned a_empty = a_full + 8;
    const unsigned ring = (full + 128 + 1023) & ~1023u;
    unsigned char* const ring_ptr = gemv_smem + (ring - full);
    float* const red = reinterpret_cast<float*>(ring_ptr + gemv_rows_sums_offset(kStages));
    const unsigned a_slot = ring + static_cast<unsigned>(gemv_groups_a_offset(kStages));
    const int tid = static_cast<int>(threadIdx.x);
    const int warp = tid / 32;
    const int lane = tid % 32;
    const auto [n0, rows] = gemv_cta_rows(args);
    if (rows <= 0) return;  // CTA-uniform (the op's grid leaves none empty)
    const int chunks = args.k / kChunkK;
    const int blocks = (rows + kGemvGroupsBlockRows - 1) / kGemvGroupsBlockRows;
    const int last_groups = (rows - (blocks - 1) * kGemvGroupsBlockRows + kGroupRows - 1) / kGroupRows;
    const int steps = ((blocks - 1) * kGroups + last_groups) * chunks;

    static_assert((2 * kStages + 2) * 8 <= 128, "gemv_groups: the barriers fit before the ring");
    if (tid == 0) {
        for (int s = 0; s < kStages; ++s) {
            ptx::mbarrier_init(full + 8 * s, 1);
            ptx::mbarrier_init(empty + 8 * s, kWarps);
        }
        ptx::mbarrier_init(a_full, 1);
        ptx::mbarrier_init(a_empty, kWarps);
        ptx::fence_mbarrier_init();
    }
    __syncthreads();

    // A's slot holds chunk seq of the sequence (block, chunk) for the consumers' start of it; chunk seq + 1 goes in
    // once every consumer warp has chunk seq in registers (after the chunk's first group). A's chunks are read by
    // every CTA: evict-last keeps them in L2 under the stream, which would otherwise push them out (ncu,
    // kernels/gemm/README.md).
    const auto fill_a = [&](int seq) {
        if (seq > 0) {
            if (!ptx::mbarrier_wait_parity_bounded(a_empty, static_cast<unsigned>(seq - 1) & 1u, kGemvStageWaitNs)) {
                __trap();
            }
            ptx::fence_proxy_async_shared_cta();
        }
        const int a_rows = min(args.m, kGemvGroupsMaxM);
        const long long k0 = static_cast<long long>(seq % chunks) * kChunkK;
        ptx::mbarrier_arrive_expect_tx(a_full, static_cast<unsigned>(a_rows * kPieceBytes));
        for (int r = 0; r < a_rows; ++r) {
            const auto* src =
                static_cast<const unsigned char*>(args.a) + (static_cast<long long>(r) * args.lda + k0) * 2;
            ptx::bulk_load_1d_hint(a_slot + static_cast<unsigned>(r * kPieceBytes), src, kPieceBytes, a_full,
                                   ptx::l2_policy_evict_last());
        }
    };
    // Launched programmatically (GemmOptions::programmatic_launch), B's producer fills the ring while the kernel
    // before this one on the stream still runs; A's producer and the consumers (A, D) wait for it to complete.
    if (warp != kWarps) ptx::wait_for_prior_grids();
    if (tid == 0) ptx::launch_dependents();
    if (warp == kWarps + 1) {  // A's producer
        if (lane != 0) return;
        // Its own warp: a chunk's copies (16 at M = 16) issued by B's producer would hold up B's stages.
        for (int seq = 0; seq < blocks * chunks; ++seq) fill_a(seq);
        return;
    }
    if (warp == kWarps) {  // B's producer
        if (lane != 0) return;
        const auto* b = static_cast<const unsigned char*>(args.b) + static_cast<long long>(n0) * args.k * 2;
        const long long row_bytes = static_cast<long long>(args.k) * 2;
        const unsigned long long stream_policy = ptx::l2_policy_evict_first();  // B streams through L2 once
        for (int step = 0; step < steps; ++step) {
            const int s = step % kStages;
            if (step >= kStages) {
                // The consumers free a stage only after their own wait for the kernel before this one: its time must
                // not count against the bounded wait below (it may run for seconds after triggering this launch).
                if (step == kStages) ptx::wait_for_prior_grids();
                if (!ptx::mbarrier_wait_parity_bounded(empty + 8 * s, static_cast<unsigned>(step / kStages - 1) & 1u,
                                                       kGemvStageWaitNs)) {
                    __trap();
                }
                ptx::fence_proxy_async_shared_cta();  // the consumers' generic reads before the copy's writes
            }
            // Step: block step / (kGroups chunks) (earlier blocks are full), then chunk-major within the block.
            const int bl = step / (kGroups * chunks);
            const int rem = step - bl * kGroups * chunks;
            const int groups = bl == blocks - 1 ? last_groups : kGroups;
            const int c = rem / groups;
            const int r0 = bl * kGemvGroupsBlockRows + (rem - c * groups) * kGroupRows;
            const int n_rows = min(kGroupRows, rows - r0);
            const unsigned stage = ring + static_cast<unsigned>(s * kStageBytes);
            ptx::mbarrier_arrive_expect_tx(full + 8 * s, static_cast<unsigned>(n_rows * kPieceBytes));
            for (int j = 0; j < n_rows; ++j) {
                ptx::bulk_load_1d_hint(stage + static_cast<unsigned>(j * kPieceBytes),
                                       b + (r0 + j) * row_bytes + static_cast<long long>(c) * kPieceBytes, kPieceBytes,
                                       full + 8 * s, stream_policy);
            }
        }
        return;
    }

    const int g = lane / 4;
    const int t = lane % 4;
    const unsigned char* const piece = ring_ptr + g * kPieceBytes + (kWarpK * warp + 8 * t) * 2;
    const unsigned char* const a_lo = ring_ptr + gemv_groups_a_offset(kStages) + (piece - ring_ptr);
    const unsigned char* const a_hi = a_lo + 8 * kPieceBytes;
    float acc[kGroups][4] = {};
    int i = 0;
    int seq = 0;  // chunks started
    for (int bl = 0; bl < blocks; ++bl) {
        const int groups = bl == blocks - 1 ? last_groups : kGroups;
        for (int c = 0; c < chunks; ++c) {
            // A's fragments of chunk c (lo: row g, hi: row g + 8, zeros past M) from the slot into registers; the
            // slot goes back to the producer once the first group's MMAs have taken them. (Loaded from global memory
            // here instead, every warp would stall for L2 behind the stream's traffic: kernels/gemm/README.md.)
            if (!ptx::mbarrier_wait_parity_bounded(a_full, static_cast<unsigned>(seq) & 1u, kGemvStageWaitNs)) __trap();
            uint4 lo[kPairs], hi[kPairs];
#pragma unroll
            for (int p = 0; p < kPairs; ++p) {
                lo[p] = lds_16_if(g < args.m, a_lo + 64 * p);
                hi[p] = kUpperHalf ? lds_16_if(g + 8 < args.m, a_hi + 64 * p) : make_uint4(0u, 0u, 0u, 0u);
            }
            ++seq;
#pragma unroll
            for (int q = 0; q < kGroups; ++q) {
                if (q < groups) {
                    const int s = i % kStages;
                    if (!ptx::mbarrier_wait_parity_bounded(full + 8 * s, static_cast<unsigned>(i / kStages) & 1u,
                                                           kGemvStageWaitNs)) {
                        __trap();
                    }
                    uint4 w[kPairs];
#pragma unroll
                    for (int p = 0; p < kPairs; ++p) w[p] = lds_16_if(true, piece + s * kStageBytes + 64 * p);
#pragma unroll
                    for (int p = 0; p < kPairs; ++p) {
                        mma_m16n8k16<kIsBF16>(acc[q], lo[p].x, hi[p].x, lo[p].y, hi[p].y, w[p].x, w[p].y);
                        mma_m16n8k16<kIsBF16>(acc[q], lo[p].z, hi[p].z, lo[p].w, hi[p].w, w[p].z, w[p].w);
                    }
                    // The MMAs above have taken the stage's values (in-order issue): release it, and after the
                    // chunk's first group A's slot.
                    __syncwarp();
                    if (lane == 0) ptx::mbarrier_arrive(empty + 8 * s);
                    if (q == 0 && lane == 0) ptx::mbarrier_arrive(a_empty);
                    ++i;
                }
            }
        }
        // The block's sums: accumulator q of lane (g, t) holds rows m = g (c0, c1) and g + 8 (c2, c3) of D at
        // the group's columns 2t, 2t + 1.
#pragma unroll
        for (int q = 0; q < kGroups; ++q) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                red[((warp * kGroups + q) * 32 + lane) * 4 + e] = acc[q][e];
                acc[q][e] = 0.f;
            }
        }
        ptx::named_barrier_sync(kBarConsumers, kConsumers);
        for (int idx = tid; idx < kGroups * 32 * 4; idx += kConsumers) {
            const int q = idx / 128;
            const int l = (idx / 4) % 32;
            const int e = idx % 4;
            const int m = l / 4 + (e >= 2 ? 8 : 0);
            const int row = bl * kGemvGroupsBlockRows + q * kGroupRows + 2 * (l % 4) + (e & 1);
            if (m < args.m && row < rows) {
                float total = 0.f;
#pragma unroll
                for (int w = 0; w < kWarps; ++w) total += red[(w * kGroups * 32 * 4) + idx];
                store_out<kOut>(args.d, static_cast<int64_t>(m) * args.ldd + n0 + row, total);
            }
        }
        ptx::named_barrier_sync(kBarConsumers, kConsumers);  // the sums are read before the next block writes them
    }
}

template <DType kOut, bool kIsBF16, int kStages>
__device__ __forceinline__ void gemv_rows(const GemvArgs& args) {
    static_assert(kGemvRowsMaxM == 2, "gemv_rows: one body per M");
    if (blockDim.x != static_cast<unsigned>(gemv_rows_threads(args.m, args.k))) __trap();  // the op's launch
    if (!gemv_rows_uses_ffma(args.m, args.k)) {
        if (args.m <= 8) {
            gemv_groups_body<kOut, kIsBF16, kStages, false>(args);
        } else {
            gemv_groups_body<kOut, kIsBF16, kStages, true>(args);
        }
        return;
    }
    switch (args.m) {
        case 1: gemv_rows_m<kOut, kIsBF16, kStages, 1>(args); break;
        case 2: gemv_rows_m<kOut, kIsBF16, kStages, 2>(args); break;
        default: __trap();
    }
}

}  // namespace detail

/// The small-M GEMM of GemvVariant::kBulkRows for kConfig (m_tiles 1: M <= 16): one split, one CTA per SM of the
/// budget with args.rows_per_cta rows of B; gemv_rows_threads(M, K) threads (kGemvBulkThreads for the whole-row
/// body, kGemvGroupsThreads for the row groups: any other block traps), gemv_smem_bytes(kConfig) of dynamic shared
/// memory; `maps` is unused (the launch signature of gemv_tma_kernel). May be launched programmatically
/// (GemmOptions::programmatic_launch): the ring's first copies of B are issued before griddepcontrol.wait, every
/// read of A and write of D after it, and the next kernel is let go once the wait has returned.
template <GemvConfig kConfig>
__global__ void __launch_bounds__(kGemvGroupsThreads, gemv_shape(kConfig).ctas_per_sm)
    gemv_rows_kernel(const GemvArgs args, const __grid_constant__ GemvMaps maps) {
    static_assert(is_valid(kConfig) && kConfig.variant == GemvVariant::kBulkRows,
                  "gemv_rows_kernel: a valid GemvConfig of GemvVariant::kBulkRows (M <= 16)");
    (void)maps;
    detail::gemv_rows<kConfig.out_dtype, kConfig.in_dtype == DType::kBF16, gemv_shape(kConfig).stages>(args);
}

}  // namespace weft::kernels::gemm
