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
//   variant 3 (bulk): B's and A's rows of each 256-wide k stage come into a shared-memory ring by TMA (one
//            2D box per operand and stage, kGemvBulkBoxK wide; one thread issues them), completing on an
//            mbarrier per stage: the bytes in flight no longer depend on registers. Every warp covers all the
//            CTA's columns for its quarter of each stage's k (so shared memory is read once per byte), and the
//            warps' sums are added once at the end. (Tried and measured, kernels/gemm/README.md: one 1D bulk copy
//            per row and stage ran at half the speed of variant 2; four 64-wide swizzled boxes per stage were
//            up to 10% slower at M = 48..64.)
#pragma once

#include "weft/common/gemm_config.hpp"
#include "weft/ptx/cvt.cuh"
#include "weft/ptx/griddep.cuh"
#include "weft/ptx/mbarrier.cuh"
#include "weft/ptx/tma.cuh"

namespace weft::gemm {

/// Variant 3's tensor maps (A [M,K] with kGemvBulkBoxK x 16 kMTiles boxes, B [N,K] with kGemvBulkBoxK x
/// 32 kNTiles boxes; 128-byte swizzled when the boxes are 64 wide); the other variants take them too (one
/// signature) and ignore them.
struct GemvMaps {
    ptx::TmaDescriptor a;
    ptx::TmaDescriptor b;
};

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

/// Variants 0..2: the rows each lane reads straight from global memory (clamped: out-of-range rows and
/// columns load nothing and contribute zero), then the batched or the pipelined main loop.
template <int kMTiles, int kNTiles, int kStages, bool kIsBF16>
__device__ __forceinline__ void gemv_mainloop_registers(float (&acc)[kMTiles][kNTiles][4], const GemvArgs& args,
                                                        int n_warp, int k_begin, int k_end, int g, int t) {
    const auto* a = static_cast<const unsigned short*>(args.a);
    const auto* b = static_cast<const unsigned short*>(args.b);
    GemvRows<kMTiles, kNTiles> rows;
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
        gemv_mainloop_batched<kMTiles, kNTiles, kIsBF16>(acc, rows, k_begin, k_end, t);
    } else {
        gemv_mainloop_pipelined<kMTiles, kNTiles, kStages, kIsBF16>(acc, rows, k_begin, k_end, t);
    }
}

/// __launch_bounds__ minimum of CTAs per SM: variants 2 and 3 cap registers so that their planned CTAs stay
/// resident.
WEFT_HOST_DEVICE constexpr int gemv_min_ctas_per_sm(int m_tiles, int stages, bool bulk) {
    return stages > 0 ? gemv_shape(bulk ? 3 : 2, m_tiles).ctas_per_sm : 0;
}

/// A stage that has not landed after this long is a kernel bug (bad tensor map, wrong byte count): trap.
inline constexpr unsigned long long kGemvStageWaitNs = 2000ull * 1000 * 1000;

/// 16 bytes of shared memory where ok, else zeros.
__device__ __forceinline__ uint4 lds_16_if(bool ok, const unsigned char* p) {
    return ok ? *reinterpret_cast<const uint4*>(p) : make_uint4(0u, 0u, 0u, 0u);
}

/// Variant 3's main loop (gemv_kernel's header comment). Ring stage s (kStages of them, 1024-byte aligned,
/// after the barriers) holds k = k0 .. k0 + 255 as 256 / kGemvBulkBoxK TMA boxes of B (32 kNTiles rows: the
/// CTA's columns n_cta + r), then as many of A (16 kMTiles rows), each box rows x 2 kGemvBulkBoxK bytes (64-wide
/// boxes with the 128-byte swizzle: 16-byte piece c of row r at piece c ^ (r % 8)): rows past N or M and k past
/// K are zero-filled by TMA. Warp w of kWarps reads chunks w, w + kWarps, ... (32 k each) of every stage, lane (g, t) the 16
/// bytes at k 32 chunk + 8t of rows g, g + 8, ..., with the same k permutation as the register variants (the
/// unswizzled 512-byte rows put a read's 8 rows in the same 16 banks: 2 wavefronts more per read, which the
/// longer TMA requests pay for); k past this split's end (the next split's data) is dropped.
/// On return acc of warps 0..3 holds the warp's kNTiles n8 tiles (columns n_cta + 8 (w kNTiles + j)) summed
/// over all warps: the layout the other variants' epilogue takes (warps 4..7, when there are 8, own no columns).
template <int kMTiles, int kNTiles, int kStages, int kWarps, bool kIsBF16>
__device__ __forceinline__ void gemv_mainloop_bulk(float (&acc)[kMTiles][kNTiles][4], const GemvArgs& args,
                                                   const GemvMaps& maps, int n_cta, int k_begin, int k_end,
                                                   int warp, int lane) {
    constexpr int kBRows = 32 * kNTiles;
    constexpr int kARows = 16 * kMTiles;
    constexpr int kBoxes = kGemvBulkStageK / kGemvBulkBoxK;
    constexpr int kBoxRowBytes = 2 * kGemvBulkBoxK;
    constexpr bool kSwizzled = kGemvBulkBoxK == 64;
    constexpr int kStageBytes = kGemvBulkStageK * 2 * (kBRows + kARows);
    constexpr int kWarpTiles = 4 * kNTiles;  // every warp: all the CTA's n8 tiles
    constexpr int kChunksPerWarp = kGemvBulkStageK / 32 / kWarps;
    static_assert(kWarps == 4 || kWarps == 8, "gemv_mainloop_bulk: 4 or 8 warps share each stage's k");
    extern __shared__ __align__(1024) unsigned char gemv_smem[];
    const unsigned bars = ptx::shared_address(gemv_smem);
    // The ring starts at the first 1024-byte boundary past the barriers (static shared memory comes first).
    const unsigned ring = (bars + 128 + 1023) & ~1023u;
    unsigned char* const ring_ptr = gemv_smem + (ring - bars);
    const int g = lane / 4, t = lane % 4;
    const int steps = k_end > k_begin ? (k_end - k_begin + kGemvBulkStageK - 1) / kGemvBulkStageK : 0;
    const auto* map_a = reinterpret_cast<const ptx::TmaDescriptor*>(&maps.a);
    const auto* map_b = reinterpret_cast<const ptx::TmaDescriptor*>(&maps.b);

    if (threadIdx.x == 0) {
        ptx::tma_prefetch_descriptor(map_a);
        ptx::tma_prefetch_descriptor(map_b);
#pragma unroll
        for (int s = 0; s < kStages; ++s) ptx::mbarrier_init(bars + 8 * s, 1);
        ptx::fence_mbarrier_init();
    }
    __syncthreads();

    // Thread 0 fills the stage of `step`: whole boxes, so the byte count never changes. B's boxes are read once
    // (evict-first in L2), A's by every CTA (evict-last): 2-3% off 32x8192x8192 and 32x28672x4096, within the
    // spread elsewhere (kernels/gemm/README.md, v18).
    const unsigned long long stream_policy = ptx::l2_policy_evict_first();
    const unsigned long long shared_policy = ptx::l2_policy_evict_last();
    // A stage's B part arms its barrier for the whole stage; its A part may follow later (the prologue below).
    const auto fill = [&](int step, bool b_part, bool a_part) {
        const int s = step % kStages;
        const int k0 = k_begin + step * kGemvBulkStageK;
        const unsigned bar = bars + 8 * s;
        const unsigned stage = ring + static_cast<unsigned>(s * kStageBytes);
        if (b_part) ptx::mbarrier_arrive_expect_tx(bar, static_cast<unsigned>(kStageBytes));
#pragma unroll
        for (int q = 0; q < kBoxes; ++q) {
            if (b_part) {
                ptx::tma_load_2d_hint(stage + q * kBRows * kBoxRowBytes, map_b, bar, k0 + kGemvBulkBoxK * q, n_cta,
                                      stream_policy);
            }
            if (a_part) {
                ptx::tma_load_2d_hint(stage + (kBoxes * kBRows + q * kARows) * kBoxRowBytes, map_a, bar,
                                      k0 + kGemvBulkBoxK * q, 0, shared_policy);
            }
        }
    };

    float part[kMTiles][kWarpTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kWarpTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) part[mt][nt][i] = 0.f;

    // Launched programmatically (args.programmatic), the first stages' B boxes load while the kernel before this
    // one on the stream still runs; their A boxes, and everything after (partials, counters, D), wait for it to
    // complete. Launched plainly, the wait returns at once and each stage's A boxes follow its B boxes.
    const bool b_first = args.programmatic != 0;
    if (threadIdx.x == 0) {
        for (int i = 0; i < kStages && i < steps; ++i) fill(i, true, !b_first);
    }
    ptx::wait_for_prior_grids();
    if (threadIdx.x == 0) {
        ptx::launch_dependents();
        if (b_first) {
            for (int i = 0; i < kStages && i < steps; ++i) fill(i, false, true);
        }
    }
    for (int i = 0; i < steps; ++i) {
        const int s = i % kStages;
        if (!ptx::mbarrier_wait_parity_bounded(bars + 8 * s, static_cast<unsigned>(i / kStages) & 1u, kGemvStageWaitNs)) {
            __trap();
        }
        const int k0 = k_begin + i * kGemvBulkStageK;
        const unsigned char* stage = ring_ptr + s * kStageBytes;
        const unsigned char* a_boxes = stage + kBoxes * kBRows * kBoxRowBytes;
#pragma unroll
        for (int c = 0; c < kChunksPerWarp; ++c) {
            const int chunk = warp + kWarps * c;
            const int kl = 32 * chunk + 8 * t;  // the lane's 8 k of this chunk, stage-relative
            const bool k_ok = k0 + kl < k_end;
            const int q = kl / kGemvBulkBoxK;  // box
            // Byte offset in the box row; swizzled: 16-byte piece p of a 128-byte row r sits at p ^ (r % 8), and
            // every row read here has r % 8 = g.
            const int piece = kSwizzled ? ((((kl % 64) / 8) ^ g) * 16) : 2 * (kl % kGemvBulkBoxK);
            uint4 av[kMTiles][2];
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = mt * 16 + h * 8 + g;
                    av[mt][h] = lds_16_if(k_ok, a_boxes + (q * kARows + row) * kBoxRowBytes + piece);
                }
#pragma unroll
            for (int nt = 0; nt < kWarpTiles; ++nt) {
                const uint4 bb = lds_16_if(k_ok, stage + (q * kBRows + nt * 8 + g) * kBoxRowBytes + piece);
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) {
                    const uint4& lo = av[mt][0];
                    const uint4& hi = av[mt][1];
                    mma_m16n8k16<kIsBF16>(part[mt][nt], lo.x, hi.x, lo.y, hi.y, bb.x, bb.y);
                    mma_m16n8k16<kIsBF16>(part[mt][nt], lo.z, hi.z, lo.w, hi.w, bb.z, bb.w);
                }
            }
        }
        __syncthreads();  // every warp has read stage s
        if (threadIdx.x == 0 && i + kStages < steps) {
            ptx::fence_proxy_async_shared_cta();  // the generic reads above before TMA's writes
            fill(i + kStages, true, true);
        }
    }

    // The warps' sums: [warp][mt][nt][i][lane] in the (now idle) ring; every issued load was waited for. The
    // first four warps add them up (each its own kNTiles n8 tiles); the others' acc stays zero.
    __syncthreads();
    float* sums = reinterpret_cast<float*>(ring_ptr);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kWarpTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) sums[(((warp * kMTiles + mt) * kWarpTiles + nt) * 4 + i) * 32 + lane] = part[mt][nt][i];
    __syncthreads();
    if (warp >= 4) return;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int j = 0; j < kNTiles; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int nt = warp * kNTiles + j;
                float v = 0.f;
#pragma unroll
                for (int w = 0; w < kWarps; ++w) v += sums[(((w * kMTiles + mt) * kWarpTiles + nt) * 4 + i) * 32 + lane];
                acc[mt][j][i] = v;
            }
}

/// 8 bf16 or f16 values (16 bytes) as floats (exact).
template <bool kIsBF16>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if constexpr (kIsBF16) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        } else {
            f[2 * i] = ptx::f16_bits_to_f32(static_cast<unsigned short>(w[i] & 0xffffu));
            f[2 * i + 1] = ptx::f16_bits_to_f32(static_cast<unsigned short>(w[i] >> 16));
        }
    }
}

/// Variant 4's share of B for this CTA: rows [n0, n0 + rows) (rows <= 0 for a CTA past N; the op's grid has none).
struct GemvCtaRows {
    int n0;
    int rows;
};
__device__ __forceinline__ GemvCtaRows gemv_cta_rows(const GemvArgs& args) {
    const int n0 = static_cast<int>(blockIdx.x) * args.rows_per_cta;
    return {n0, min(args.rows_per_cta, args.n - n0)};
}

/// Variant 4 (gemv_shape's comment in gemm_config.hpp; the op checks M <= kGemvRowsMaxM, K = kGemvRowsSpanElems x
/// 1, 2, 4 or 8, ldb = K, one split, 16-byte aligned A rows): CTA c owns rows n0 = c rows_per_cta .. of B, one
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
        for (int j = 0; j < kSpansPerRow; ++j) unpack8<kIsBF16>(ld_16(a_row + 2 * (kGemvRowsSpanElems * j + 8 * tid)), a[m][j]);
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

/// Variant 4's entry: one body per row length (K / kGemvRowsSpanElems = 1, 2, 4 or 8 spans) and M (1, 2); the op
/// admits nothing else (A of every one fits in registers: kGemvRowsMaxMK, asserted in gemm_config.hpp).
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

/// Variant 4's row-group body (the op checks M <= kGemvGroupsMaxM, K a multiple of kGemvRowsSpanElems, ldb = K, one
/// split, 16-byte aligned A rows; gemv_rows_uses_ffma(M, K) false): tensor cores for the M the FFMA body cannot
/// carry. kGemvGroupsThreads threads: 8 consumer warps, a producer warp for B and one for A. CTA c owns rows
/// n0 = c rows_per_cta ..
/// of B and takes them in blocks of kGemvGroupsBlockRows (64): for each block, k chunk by k chunk
/// (kGemvRowsSpanElems = 2048 k), group by group (8 rows). A stage is one group's chunk: 8 row pieces of 4 KiB,
/// each one 1D bulk copy issued by B's producer (lane 0) into its own 4 KiB of the stage (rows past the CTA's end
/// are not copied: their stale pieces only reach columns of D that are not written). B's producer refills a
/// stage once all 8 consumer warps have arrived on its `empty` barrier (after their MMAs took the stage's values),
/// so no consumer waits for a copy to be issued (from one thread inside the consumers' stage barrier, the 8
/// copies per stage held every warp up: kernels/gemm/README.md, v14).
/// Warp w takes k = 256 w .. 256 w + 255 of every stage, lane (g, t) the 16 bytes at k 32 p + 8 t (p = 0..7) of
/// row g: with the k permutation of the other variants these are the B fragments of two m16n8k16 MMAs (n8 = the
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
    // every CTA: evict-last keeps them in L2 under the stream (ncu at M = 16 without the hints: L2 hit rate 5%, A
    // alone would make it 20%).
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
        // Its own warp: a chunk's copies (16 at M = 16) issued by B's producer held up B's stages (README, v25).
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
            // here instead, every warp stalled ~1.5 us per chunk for L2 behind the stream's traffic:
            // kernels/gemm/README.md, v14.)
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

/// Split-K small-M GEMM. kMTiles = ceil(M / 16) (1..4). Grid (ceil(N / gemv_cols_per_cta(kNTiles)), num_splits),
/// gemv_threads(kBulk) threads (128, or 256 for variant 3), no dynamic shared
/// memory but for variant 3. gemv_shape(variant, kMTiles) gives kNTiles and kStages.
///   variant 0: kNTiles = 4, kStages = 0: a warp owns 32 columns and loads 4 (or 2) 32-wide k chunks per
///              iteration: 256 contiguous bytes per row; A is loaded with them.
///   variant 1: kNTiles = 1, kStages = 0: a warp owns 8 columns and loads 16 (or 8) chunks per iteration:
///              1 KiB contiguous per row (longer DRAM bursts, same bytes in flight); A chunk by chunk.
///   variant 2: kStages > 0: the register ring of gemv_mainloop_pipelined, kStages x stage_chunks x kNTiles
///              loads in flight per warp; A chunk by chunk from L1.
///   variant 3: kBulk: the shared-memory ring of gemv_mainloop_bulk, kStages stages of 256 k, filled by TMA
///              through `maps`; gemv_smem_bytes(3, kMTiles) of dynamic shared memory.
///   variant 4: kBulk and kWholeRows (kMTiles 1): detail::gemv_rows, B's rows by 1D bulk copies (M <= 16, K a
///              multiple of 2048, ldb = K, one split, one CTA per SM with args.rows_per_cta rows; maps unused): whole
///              rows and FMAs where gemv_rows_uses_ffma (M <= 2, K = 2048 x 1, 2, 4 or 8; 256 threads),
///              else 8-row groups on the tensor cores (gemv_groups_body; 320 threads: gemv_rows_threads);
///              gemv_rows_smem_bytes(kStages).
/// Variants 3 and 4 may be launched programmatically (GemmOptions::programmatic_launch): the ring's first copies of
/// B are issued before griddepcontrol.wait, every read of A and write of D (and of the split-K partials and
/// counters) after it, and the next kernel is let go once the wait has returned.
template <int kMTiles, DType kIn, DType kOut, int kNTiles = 4, int kStages = 0, bool kBulk = false,
          bool kWholeRows = false>
__global__ void __launch_bounds__(kWholeRows ? kGemvGroupsThreads : gemv_threads(kBulk),
                                  detail::gemv_min_ctas_per_sm(kMTiles, kStages, kBulk))
    gemv_kernel(const GemvArgs args, const __grid_constant__ GemvMaps maps) {
    static_assert(kMTiles >= 1 && kMTiles <= 4, "gemv_kernel covers M <= 64");
    static_assert(kIn == DType::kBF16 || kIn == DType::kF16, "gemv_kernel takes bf16 or f16 inputs");
    static_assert(kNTiles == 1 || kNTiles == 2 || kNTiles == 4, "gemv_kernel: 1, 2 or 4 n8 tiles per warp");
    static_assert(kStages == 0 || (kStages >= 2 && kNTiles == gemv_shape(kBulk ? 3 + kWholeRows : 2, kMTiles).n_tiles &&
                                   kStages == gemv_shape(kBulk ? 3 + kWholeRows : 2, kMTiles).stages),
                  "gemv_kernel: a pipelined instance must have variant 2's or 3's shape (gemv_shape)");
    static_assert(!kBulk || kStages > 0, "gemv_kernel: the bulk variant needs its ring's stages");
    static_assert(kStages > 0 || kNTiles != 2, "gemv_kernel: the batched loop takes 1 or 4 n8 tiles per warp");
    static_assert(!kWholeRows || (kBulk && kMTiles == 1), "gemv_kernel: variant 4 serves M <= 16 (one row tile)");
    constexpr bool kIsBF16 = kIn == DType::kBF16;
    if constexpr (kWholeRows) {
        detail::gemv_rows<kOut, kIsBF16, kStages>(args);
        return;
    }
    constexpr int kColsPerCta = gemv_cols_per_cta(kNTiles);
    constexpr int kThreads = gemv_threads(kBulk);

    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int g = lane / 4, t = lane % 4;
    const int n_warp = static_cast<int>(blockIdx.x) * kColsPerCta + warp * 8 * kNTiles;
    const int split = static_cast<int>(blockIdx.y);
    const int k_begin = split * args.k_per_split;
    const int k_end = min(args.k, k_begin + args.k_per_split);

    float acc[kMTiles][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

    if constexpr (kBulk) {
        detail::gemv_mainloop_bulk<kMTiles, kNTiles, kStages, kThreads / 32, kIsBF16>(
            acc, args, maps, static_cast<int>(blockIdx.x) * kColsPerCta, k_begin, k_end, warp, lane);
    } else {
        detail::gemv_mainloop_registers<kMTiles, kNTiles, kStages, kIsBF16>(acc, args, n_warp, k_begin, k_end, g, t);
    }

    // Accumulator (mt, nt): c0,c1 at row mt*16 + g, columns n_warp + nt*8 + 2t, +1; c2,c3 at row + 8. Only
    // warps 0..3 own columns (with 8 warps the others stop here in a single split, or only join the count).
    const bool owns_columns = warp < 4;
    if (args.num_splits == 1) {
        if (!owns_columns) return;
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
    for (int mt = 0; mt < kMTiles && owns_columns; ++mt)
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
    for (int idx = static_cast<int>(threadIdx.x); idx < args.m * cols; idx += kThreads) {
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
