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
//
// Two main loops share that layout and the epilogue (kStages, see gemv_shape in gemm_config.hpp):
//   kStages = 0 (variants 0, 1): each iteration issues all its loads, then its MMAs (in PTX). ptxas sinks
//            every B load down to the MMA that consumes it (48 registers for variant 1), so a warp has ~1
//            16-byte load in flight (SASS).
//   kStages > 0 (variant 2): a ring of kStages stages of B fragments in registers. The prologue fills it;
//            step i's MMAs consume slot i % kStages, which is refilled with step i + kStages right away.
//            Every refill is consumed only in the *next* trip of the k loop, so ptxas cannot sink it down to
//            its consumer (that would cross the loop's back edge; in SASS it places the refills at the end
//            of the trip): a full ring, kStages x stage_chunks x kNTiles loads, is in flight when the warp
//            waits for the first of them. __launch_bounds__ with a minimum of CTAs per
//            SM caps the registers, so the planned occupancy holds (tests/unit/test_gemm_nvrtc.cpp checks the
//            SASS: no spills, loads outstanding at the loop's first MMA).
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

/// ld_stream_16 where ok, else zeros; a predicated load (no memory access, no branch) when !ok.
__device__ __forceinline__ uint4 ld_stream_16_if(bool ok, const void* p) {
    uint4 v;
    asm("{\n"
        "  .reg .pred p;\n"
        "  setp.ne.b32 p, %5, 0;\n"
        "  mov.b32 %0, 0;\n"
        "  mov.b32 %1, 0;\n"
        "  mov.b32 %2, 0;\n"
        "  mov.b32 %3, 0;\n"
        "  @p ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        "}\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"(static_cast<int>(ok)));
    return v;
}

/// ld_16 where ok, else zeros (predicated, as ld_stream_16_if).
__device__ __forceinline__ uint4 ld_16_if(bool ok, const void* p) {
    uint4 v;
    asm("{\n"
        "  .reg .pred p;\n"
        "  setp.ne.b32 p, %5, 0;\n"
        "  mov.b32 %0, 0;\n"
        "  mov.b32 %1, 0;\n"
        "  mov.b32 %2, 0;\n"
        "  mov.b32 %3, 0;\n"
        "  @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        "}\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"(static_cast<int>(ok)));
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

/// Per-thread operand rows of gemv_kernel: B rows n_warp + nt*8 + g, A rows mt*16 + h*8 + g (clamped to a
/// valid row when out of range, with the flag false: such rows load nothing and contribute zero).
template <int kMTiles, int kNTiles>
struct GemvRows {
    const unsigned short* b_row[kNTiles];
    bool b_ok[kNTiles];
    const unsigned short* a_row[kMTiles][2];
    bool a_ok[kMTiles][2];
};

/// The batched main loop (variants 0 and 1): kUnroll chunks of loads per iteration, then their MMAs.
template <int kMTiles, int kNTiles, bool kIsBF16>
__device__ __forceinline__ void gemv_mainloop_batched(float (&acc)[kMTiles][kNTiles][4],
                                                      const GemvRows<kMTiles, kNTiles>& r, int k_begin, int k_end,
                                                      int t) {
    constexpr bool kLongRows = kNTiles == 1;
    constexpr int kUnroll = kLongRows ? (kMTiles <= 2 ? 16 : 8) : (kMTiles <= 2 ? 4 : 2);  // 32-wide k chunks
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
                bv[u][nt] = keep_if(k_ok && r.b_ok[nt], ld_stream_16(r.b_row[nt] + kc));
            }
            if constexpr (!kLongRows) {
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        av[u][mt][h] = keep_if(k_ok && r.a_ok[mt][h], ld_16(r.a_row[mt][h] + kc));
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
                        av[0][mt][h] = keep_if(k_ok && r.a_ok[mt][h], ld_16(r.a_row[mt][h] + kc));
                    }
            }
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) {
                    const uint4& lo = av[au][mt][0];
                    const uint4& hi = av[au][mt][1];
                    const uint4& bb = bv[u][nt];
                    mma_m16n8k16<kIsBF16>(acc[mt][nt], lo.x, hi.x, lo.y, hi.y, bb.x, bb.y);
                    mma_m16n8k16<kIsBF16>(acc[mt][nt], lo.z, hi.z, lo.w, hi.w, bb.z, bb.w);
                }
        }
    }
}

/// Variant 2's addressing for one trip of the k loop: lane t of a row covers k = k_lane + c .. + 8 for the
/// trip-relative offset c = stage * 32 * kChunks + 32 * u of chunk u (k_lane = trip start + 8t), so the row's
/// 64 * kChunks bytes of a stage are contiguous, and so are consecutive stages. Offsets are immediates and a
/// piece is loaded iff c < lim - k_lane (lim = k_end for a valid row, 0 for a clamped one; K % 8 == 0, so a
/// 16-byte piece is all in or all out).
template <int kChunks, int kNTiles, int kMTiles>
__device__ __forceinline__ void gemv_load_stage(uint4 (&slot)[kChunks][kNTiles], const unsigned short* const (&b)[kNTiles],
                                                const int (&b_rem)[kNTiles], int c0) {
#pragma unroll
    for (int u = 0; u < kChunks; ++u) {
        const int c = c0 + 32 * u;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) slot[u][nt] = ld_stream_16_if(c < b_rem[nt], b[nt] + c);
    }
}

template <int kChunks, int kNTiles, int kMTiles, bool kIsBF16>
__device__ __forceinline__ void gemv_mma_stage(float (&acc)[kMTiles][kNTiles][4], const uint4 (&slot)[kChunks][kNTiles],
                                               const unsigned short* const (&a)[kMTiles][2],
                                               const int (&a_rem)[kMTiles][2], int c0) {
#pragma unroll
    for (int u = 0; u < kChunks; ++u) {
        const int c = c0 + 32 * u;
        // A is small and L1-resident: fetched next to its use (the B ring covers the DRAM latency).
        uint4 av[kMTiles][2];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) av[mt][h] = ld_16_if(c < a_rem[mt][h], a[mt][h] + c);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
                const uint4& lo = av[mt][0];
                const uint4& hi = av[mt][1];
                const uint4& bb = slot[u][nt];
                mma_m16n8k16<kIsBF16>(acc[mt][nt], lo.x, hi.x, lo.y, hi.y, bb.x, bb.y);
                mma_m16n8k16<kIsBF16>(acc[mt][nt], lo.z, hi.z, lo.w, hi.w, bb.z, bb.w);
            }
    }
}

/// The pipelined main loop (variant 2): a ring of kStages stages of B fragments in registers.
///   prologue: load steps 0 .. kStages-1 into slots 0 .. kStages-1
///   trip j, slot s = 0 .. kStages-1 (unrolled, so slots are registers): MMAs of step j*kStages + s from slot s,
///            then refill slot s with step (j+1)*kStages + s, which only the next trip consumes.
/// Steps past the end (the last trip's padding, the final refills) load nothing (predicated) and add zeros.
template <int kMTiles, int kNTiles, int kStages, bool kIsBF16>
__device__ __forceinline__ void gemv_mainloop_pipelined(float (&acc)[kMTiles][kNTiles][4],
                                                        const GemvRows<kMTiles, kNTiles>& r, int k_begin, int k_end,
                                                        int t) {
    constexpr int kChunks = gemv_shape(2, kMTiles).stage_chunks;
    constexpr int kStepK = 32 * kChunks;
    constexpr int kTripK = kStepK * kStages;
    int b_lim[kNTiles];
    int a_lim[kMTiles][2];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) b_lim[nt] = r.b_ok[nt] ? k_end : 0;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) a_lim[mt][h] = r.a_ok[mt][h] ? k_end : 0;

    uint4 ring[kStages][kChunks][kNTiles];
    int k_lane = k_begin + 8 * t;
    {
        const unsigned short* b[kNTiles];
        int b_rem[kNTiles];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
            b[nt] = r.b_row[nt] + k_lane;
            b_rem[nt] = b_lim[nt] - k_lane;
        }
#pragma unroll
        for (int s = 0; s < kStages; ++s) gemv_load_stage<kChunks, kNTiles, kMTiles>(ring[s], b, b_rem, s * kStepK);
    }
    for (int k_trip = k_begin; k_trip < k_end; k_trip += kTripK, k_lane += kTripK) {
        const unsigned short* b[kNTiles];
        int b_rem[kNTiles];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
            b[nt] = r.b_row[nt] + k_lane;
            b_rem[nt] = b_lim[nt] - k_lane;
        }
        const unsigned short* a[kMTiles][2];
        int a_rem[kMTiles][2];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                a[mt][h] = r.a_row[mt][h] + k_lane;
                a_rem[mt][h] = a_lim[mt][h] - k_lane;
            }
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            gemv_mma_stage<kChunks, kNTiles, kMTiles, kIsBF16>(acc, ring[s], a, a_rem, s * kStepK);
            gemv_load_stage<kChunks, kNTiles, kMTiles>(ring[s], b, b_rem, (s + kStages) * kStepK);
        }
    }
}

/// __launch_bounds__ minimum of CTAs per SM: variant 2 caps registers so that its planned CTAs stay resident.
WEFT_HOST_DEVICE constexpr int gemv_min_ctas_per_sm(int m_tiles, int stages) {
    return stages > 0 ? gemv_shape(2, m_tiles).ctas_per_sm : 0;
}

}  // namespace detail

/// Split-K small-M GEMM. kMTiles = ceil(M / 16) (1..4). Grid (ceil(N / gemv_cols_per_cta(kNTiles)), num_splits),
/// kGemvThreads threads, no dynamic shared memory. gemv_shape(variant, kMTiles) gives kNTiles and kStages.
///   variant 0: kNTiles = 4, kStages = 0: a warp owns 32 columns and loads 4 (or 2) 32-wide k chunks per
///              iteration: 256 contiguous bytes per row; A is loaded with them.
///   variant 1: kNTiles = 1, kStages = 0: a warp owns 8 columns and loads 16 (or 8) chunks per iteration:
///              1 KiB contiguous per row (longer DRAM bursts, same bytes in flight); A chunk by chunk.
///   variant 2: kStages > 0: the register ring of gemv_mainloop_pipelined, kStages x stage_chunks x kNTiles
///              loads in flight per warp; A chunk by chunk from L1.
template <int kMTiles, DType kIn, DType kOut, int kNTiles = 4, int kStages = 0>
__global__ void __launch_bounds__(kGemvThreads, detail::gemv_min_ctas_per_sm(kMTiles, kStages))
    gemv_kernel(const GemvArgs args) {
    static_assert(kMTiles >= 1 && kMTiles <= 4, "gemv_kernel covers M <= 64");
    static_assert(kIn == DType::kBF16 || kIn == DType::kF16, "gemv_kernel takes bf16 or f16 inputs");
    static_assert(kNTiles == 1 || kNTiles == 2 || kNTiles == 4, "gemv_kernel: 1, 2 or 4 n8 tiles per warp");
    static_assert(kStages == 0 || (kStages >= 2 && kNTiles == gemv_shape(2, kMTiles).n_tiles &&
                                   kStages == gemv_shape(2, kMTiles).stages),
                  "gemv_kernel: a pipelined instance must have variant 2's shape (gemv_shape(2, kMTiles))");
    static_assert(kStages > 0 || kNTiles != 2, "gemv_kernel: the batched loop takes 1 or 4 n8 tiles per warp");
    constexpr bool kIsBF16 = kIn == DType::kBF16;
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
    detail::GemvRows<kMTiles, kNTiles> rows;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
        const int n = n_warp + nt * 8 + g;
        rows.b_ok[nt] = n < args.n;
        rows.b_row[nt] = b + static_cast<int64_t>(rows.b_ok[nt] ? n : 0) * args.ldb;
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int m = mt * 16 + h * 8 + g;
            rows.a_ok[mt][h] = m < args.m;
            rows.a_row[mt][h] = a + static_cast<int64_t>(rows.a_ok[mt][h] ? m : 0) * args.lda;
        }

    if constexpr (kStages == 0) {
        detail::gemv_mainloop_batched<kMTiles, kNTiles, kIsBF16>(acc, rows, k_begin, k_end, t);
    } else {
        detail::gemv_mainloop_pipelined<kMTiles, kNTiles, kStages, kIsBF16>(acc, rows, k_begin, k_end, t);
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
