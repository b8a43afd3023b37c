// SPDX-License-Identifier: MIT
// wgmma (sm_90a): shared-memory matrix descriptors, fences, commit/wait groups and the m64nNk16 MMA (A from shared
// memory or from registers).
//
// Contract: every function here is warpgroup-collective (.sync.aligned): all 128 threads of a warpgroup
// (4 consecutive warps starting at a warp index divisible by 4) call it together, with the same operands.
// Typical use (one k-block):
//     wgmma_fence();                                     // order earlier register writes before the MMAs
//     for (kk) wgmma<N, true, 0>(acc, desc_a(kk), desc_b(kk), kk > 0 || kb > 0);
//     wgmma_commit_group();
//     wgmma_wait_group<1>();                             // at most one group still in flight
#pragma once

#include "weft/ptx/detail/wgmma_ops.cuh"
#include "weft/ptx/detail/wgmma_rs_ops.cuh"

namespace weft::ptx {

/// Shared-memory layouts a descriptor can name (bits 62-63 of the descriptor).
enum class SmemSwizzle : unsigned { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };

/// Builds a wgmma shared-memory matrix descriptor. `smem_byte_addr` is a shared-window address (see
/// shared_address()), 16-byte aligned; with a swizzle, the swizzle atom (8 rows x swizzle width) must be
/// aligned to its size (1024 bytes for 128B) so that the base-offset field can stay 0.
///   K-major operand, 128B swizzle:  lbo unused (pass 16), sbo = byte stride between 8-row groups (1024).
///   MN-major operand, 128B swizzle: lbo = byte stride between 64-element (128-byte) MN chunks,
///                                   sbo = byte stride between 8-row K groups (1024 when rows are 128 B).
__device__ __forceinline__ unsigned long long make_smem_desc(unsigned smem_byte_addr, unsigned lbo_bytes,
                                                             unsigned sbo_bytes, SmemSwizzle swizzle) {
    unsigned long long desc = 0;
    desc |= static_cast<unsigned long long>((smem_byte_addr & 0x3FFFFu) >> 4);
    desc |= static_cast<unsigned long long>((lbo_bytes & 0x3FFFFu) >> 4) << 16;
    desc |= static_cast<unsigned long long>((sbo_bytes & 0x3FFFFu) >> 4) << 32;
    desc |= static_cast<unsigned long long>(static_cast<unsigned>(swizzle)) << 62;
    return desc;
}

/// wgmma.fence: registers written by ordinary instructions (accumulators read or zeroed, A fragments)
/// are ordered before the wgmma operations that follow. Required before the first wgmma of a batch.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

/// Groups every wgmma issued since the last commit into one wgmma-group.
__device__ __forceinline__ void wgmma_commit_group() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/// Waits until at most kPending wgmma-groups of this warpgroup are still in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
    static_assert(kPending >= 0 && kPending <= 7, "wgmma.wait_group takes 0..7");
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

/// Keeps the compiler from moving reads/writes of an accumulator register across a wgmma boundary.
__device__ __forceinline__ void wgmma_fence_operand(float& reg) { asm volatile("" : "+f"(reg)::"memory"); }

template <int kCount>
__device__ __forceinline__ void wgmma_fence_operands(float (&regs)[kCount]) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) wgmma_fence_operand(regs[i]);
}

/// True when wgmma<kN, ...> exists (N of the m64nNk16 shape).
__host__ __device__ constexpr bool wgmma_supports_n(int n) { return detail::wgmma_has_n(n); }

/// One m64nNk16 MMA, A and B from shared memory, f32 accumulators in registers:
///   d[64 x kN] = (scale_d ? d : 0) + A[64 x 16] * B[16 x kN]
/// kIsBF16 selects bf16 (true) or f16 (false) inputs. kTransB = 0: B is K-major in shared memory;
/// kTransB = 1: B is N-major (transposed). A is always K-major here. Accumulator fragment layout (thread
/// t of the warpgroup, warp w = t / 32, lane l): d[4j + 0..1] hold row 16w + l/4, columns 8j + 2(l%4) + {0,1};
/// d[4j + 2..3] hold row 16w + l/4 + 8, the same columns.
template <int kN, bool kIsBF16, int kTransB>
__device__ __forceinline__ void wgmma(float (&d)[kN / 2], unsigned long long desc_a, unsigned long long desc_b,
                                      int scale_d) {
    static_assert(kTransB == 0 || kTransB == 1, "kTransB is 0 (K-major B) or 1 (N-major B)");
    detail::wgmma_dispatch<kN, kIsBF16, kTransB>(d, desc_a, desc_b, scale_d);
}

/// As wgmma, with A (64 x 16) from registers: thread t (warp w = t / 32 of the warpgroup, lane l, g = l / 4,
/// c = 2 (l % 4)) holds a[0] = A[16w + g][c, c+1], a[1] = A[16w + g + 8][c, c+1], a[2] = A[16w + g][c+8, c+9],
/// a[3] = A[16w + g + 8][c+8, c+9] (two 16-bit elements per register, lower column in the low half): the layout of
/// an m64nNk16 accumulator's columns 16k..16k+15 (d[8k..8k+7]) packed in pairs, so a score tile turns into the A
/// operand of the next MMA without leaving the registers. The registers must not change until the wgmma-group
/// has completed (wgmma_wait_group).
template <int kN, bool kIsBF16, int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN / 2], const unsigned (&a)[4], unsigned long long desc_b,
                                         int scale_d) {
    static_assert(kTransB == 0 || kTransB == 1, "kTransB is 0 (K-major B) or 1 (N-major B)");
    detail::wgmma_rs_dispatch<kN, kIsBF16, kTransB>(d, a, desc_b, scale_d);
}

}  // namespace weft::ptx
