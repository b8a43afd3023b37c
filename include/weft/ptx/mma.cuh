// SPDX-License-Identifier: MIT
// mma.sync (sm_80+): warp-level m16n8k16 matrix multiply-accumulate, 16-bit inputs, fp32 accumulators.
//
// Fragments (lane l, g = l / 4, t = l % 4; each 32-bit register packs two 16-bit elements, low half first):
//   A (16 x 16, row-major): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B (16 x 8, "col"):      b0 = B[2t..2t+1][g],  b1 = B[2t+8..2t+9][g]
//   C/D (16 x 8, fp32):     c0, c1 = C[g][2t], C[g][2t+1];  c2, c3 = C[g+8][2t], C[g+8][2t+1]
// ldmatrix (weft/ptx/matrix.cuh) of a row-major 8x8 block gives exactly these A and B registers.
#pragma once

namespace weft::ptx {

/// d = A x B + d, bf16 inputs. A pure register operation (no memory clobber): the compiler may schedule it freely.
__device__ __forceinline__ void mma_m16n8k16_f32_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// d = A x B + d, f16 inputs.
__device__ __forceinline__ void mma_m16n8k16_f32_f16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace weft::ptx
