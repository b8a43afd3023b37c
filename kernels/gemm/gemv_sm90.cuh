// SPDX-License-Identifier: MIT
// Small-M GEMM (decode, M <= 64) for B [N,K] row-major: memory-bound, so B is streamed exactly once with
// 16-byte loads spread over many CTAs (split-K), multiplied on the tensor cores with mma.sync m16n8k16,
// and the split-K partial sums are reduced deterministically by the last CTA of each column block.
//
// Layout of the work: CTA (x, y) owns columns [128x, 128x + 128) of D and k-range y of num_splits; each of
// its 4 warps owns 32 columns (4 n8 tiles) and walks its k-range 32 at a time. Lane (g = l/4, t = l%4)
// loads B[n = tile + g][k + 8t .. k + 8t + 7] (16 bytes). The k order inside each 32-wide chunk is
// permuted so that these 8 elements are exactly the B fragments of two m16n8k16 MMAs; A is read with the
// same permutation (A[row][k + 8t .. k + 8t + 7]), which leaves the dot products unchanged.
#pragma once

#include "weft/common/gemm_config.hpp"

namespace weft::gemm {

namespace detail {

// NOTE: not volatile, and never under a branch: each load is a pure function of its address, so the
// compiler issues a whole iteration's loads before the first MMA that needs them. (Volatile loads under
// `ok ? load : 0` became one basic block each, and ptxas interleaved them with the MMAs: one 16-byte load
// in flight per warp.)
__device__ __forceinline__ uint4 ld_stream_16(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ uint4 ld_16(const void* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

/// v where ok, else zeros (a select, not a branch).
__device__ __forceinline__ uint4 keep_if(bool ok, uint4 v) {
    return make_uint4(ok ? v.x : 0u, ok ? v.y : 0u, ok ? v.z : 0u, ok ? v.w : 0u);
}

template <bool kIsBF16>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                             unsigned b0, unsigned b1) {
    if constexpr (kIsBF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

template <DType kOut>
__device__ __forceinline__ void store_out(void* d, int64_t idx, float v) {
    if constexpr (kOut == DType::kF32) {
        static_cast<float*>(d)[idx] = v;
    } else if constexpr (kOut == DType::kBF16) {
        unsigned short h;
        asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(v));
        static_cast<unsigned short*>(d)[idx] = h;
    } else {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(v));
        static_cast<unsigned short*>(d)[idx] = h;
    }
}

}  // namespace detail

/// Split-K small-M GEMM. kMTiles = ceil(M / 16) (1..4). Grid (ceil(N / gemv_cols_per_cta(kNTiles)), num_splits),
/// kGemvThreads threads, no dynamic shared memory.
///   kNTiles = 4 (variant 0): a warp owns 32 columns and loads 4 (or 2) 32-wide k chunks per iteration:
///            256 contiguous bytes per row; A is loaded with them.
///   kNTiles = 1 (variant 1): a warp owns 8 columns and loads 16 (or 8) chunks per iteration: 1 KiB
///            contiguous per row (longer DRAM bursts, same bytes in flight); A is loaded chunk by chunk.
template <int kMTiles, DType kIn, DType kOut, int kNTiles = 4>
__global__ void __launch_bounds__(kGemvThreads) gemv_kernel(const GemvArgs args) {
    static_assert(kMTiles >= 1 && kMTiles <= 4, "gemv_kernel covers M <= 64");
    static_assert(kIn == DType::kBF16 || kIn == DType::kF16, "gemv_kernel takes bf16 or f16 inputs");
    static_assert(kNTiles == 1 || kNTiles == 4, "gemv_kernel: 1 or 4 n8 tiles per warp");
    constexpr bool kIsBF16 = kIn == DType::kBF16;
    constexpr bool kLongRows = kNTiles == 1;
    constexpr int kUnroll = kLongRows ? (kMTiles <= 2 ? 16 : 8) : (kMTiles <= 2 ? 4 : 2);  // 32-wide k chunks
    constexpr int kColsPerCta = gemv_cols_per_cta(kNTiles);

    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int g = lane / 4, t = lane % 4;
    const int n_warp = static_cast<int>(blockIdx.x) * kColsPerCta + warp * 8 * kNTiles;
    const int split = static_cast<int>(blockIdx.y);
    const int k_begin = split * args.k_per_split;
    const int k_end = min(args.k, k_begin + args.k_per_split);

    const unsigned short* a = static_cast<const unsigned short*>(args.a);
    const unsigned short* b = static_cast<const unsigned short*>(args.b);

    float acc[kMTiles][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

    // Row pointers (clamped: out-of-range rows and columns load nothing and contribute zero).
    const unsigned short* b_row[kNTiles];
    bool b_ok[kNTiles];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
        const int n = n_warp + nt * 8 + g;
        b_ok[nt] = n < args.n;
        b_row[nt] = b + static_cast<int64_t>(b_ok[nt] ? n : 0) * args.ldb;
    }
    const unsigned short* a_row[kMTiles][2];
    bool a_ok[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int m = mt * 16 + h * 8 + g;
            a_ok[mt][h] = m < args.m;
            a_row[mt][h] = a + static_cast<int64_t>(a_ok[mt][h] ? m : 0) * args.lda;
        }

    for (int k0 = k_begin; k0 < k_end; k0 += 32 * kUnroll) {
        // Lane t of a row reads k0 + u*32 + 8t .. +8 (long rows: k0 + 8*(4u + t) .. +8, the same set of
        // 16-byte pieces per chunk, u-major); K % 8 == 0, so a piece is all in or all out.
        uint4 bv[kUnroll][kNTiles];
        uint4 av[kLongRows ? 1 : kUnroll][kMTiles][2];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int k = k0 + u * 32 + 8 * t;
            const bool k_ok = k < k_end;
            const int kc = k_ok ? k : k_begin;  // a valid address whose value is then dropped
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
                bv[u][nt] = detail::keep_if(k_ok && b_ok[nt], detail::ld_stream_16(b_row[nt] + kc));
            }
            if constexpr (!kLongRows) {
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        av[u][mt][h] = detail::keep_if(k_ok && a_ok[mt][h], detail::ld_16(a_row[mt][h] + kc));
                    }
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int au = kLongRows ? 0 : u;
            if constexpr (kLongRows) {
                // A is small and L1-resident: fetch it chunk by chunk, next to its use.
                const int k = k0 + u * 32 + 8 * t;
                const bool k_ok = k < k_end;
                const int kc = k_ok ? k : k_begin;
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        av[0][mt][h] = detail::keep_if(k_ok && a_ok[mt][h], detail::ld_16(a_row[mt][h] + kc));
                    }
            }
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) {
                    const uint4& lo = av[au][mt][0];
                    const uint4& hi = av[au][mt][1];
                    const uint4& bb = bv[u][nt];
                    detail::mma_m16n8k16<kIsBF16>(acc[mt][nt], lo.x, hi.x, lo.y, hi.y, bb.x, bb.y);
                    detail::mma_m16n8k16<kIsBF16>(acc[mt][nt], lo.z, hi.z, lo.w, hi.w, bb.z, bb.w);
                }
        }
    }

    // Accumulator (mt, nt): c0,c1 at row mt*16 + g, columns n_warp + nt*8 + 2t, +1; c2,c3 at row + 8.
    if (args.num_splits == 1) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int m = mt * 16 + g + (i >= 2 ? 8 : 0);
                    const int n = n_warp + nt * 8 + 2 * t + (i & 1);
                    if (m < args.m && n < args.n) detail::store_out<kOut>(args.d, m * args.ldd + n, acc[mt][nt][i]);
                }
        return;
    }

    // Split-K: write this split's partial sums, then the last CTA of the column block reduces them in split
    // order (deterministic) and writes D.
    float* part = args.partials + static_cast<int64_t>(split) * args.m * args.n;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = mt * 16 + g + (i >= 2 ? 8 : 0);
                const int n = n_warp + nt * 8 + 2 * t + (i & 1);
                if (m < args.m && n < args.n) part[static_cast<int64_t>(m) * args.n + n] = acc[mt][nt][i];
            }
    __threadfence();  // release the partials at GPU scope before counting this CTA in
    __syncthreads();
    __shared__ int is_last;
    if (threadIdx.x == 0) {
        const unsigned done = atomicAdd(args.counters + blockIdx.x, 1u);
        is_last = done == static_cast<unsigned>(args.num_splits - 1);
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();  // acquire: every other split's partials are visible
    const int n_begin = static_cast<int>(blockIdx.x) * kColsPerCta;
    const int cols = min(kColsPerCta, args.n - n_begin);
    for (int idx = static_cast<int>(threadIdx.x); idx < args.m * cols; idx += kGemvThreads) {
        const int m = idx / cols;
        const int n = n_begin + idx % cols;
        float sum = 0.f;
        for (int s = 0; s < args.num_splits; ++s) {
            sum += __ldcg(args.partials + (static_cast<int64_t>(s) * args.m + m) * args.n + n);
        }
        detail::store_out<kOut>(args.d, m * args.ldd + n, sum);
    }
    if (threadIdx.x == 0) args.counters[blockIdx.x] = 0u;  // ready for the next launch on this stream
}

}  // namespace weft::gemm
