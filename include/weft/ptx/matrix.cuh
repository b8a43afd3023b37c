// SPDX-License-Identifier: MIT
// ldmatrix / stmatrix (sm_75 / sm_90): warp-collective 8x8 b16 matrix moves between shared memory and registers.
//
// Fragment layout (each 8x8 matrix i of an .x1/.x2/.x4): lane l holds, in register r[i], the two b16 elements
// of row l/4 at columns 2(l%4) and 2(l%4)+1 (low half = lower column). Lanes 8i..8i+7 supply the shared
// addresses of rows 0..7 of matrix i (16-byte aligned). .trans swaps rows and columns.
#pragma once

namespace weft::ptx {

__device__ __forceinline__ void ldmatrix_x1(unsigned& r0, unsigned smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r0) : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned& r0, unsigned& r1, unsigned smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r0), "=r"(r1)
                 : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                            unsigned smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                                  unsigned smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr));
}

__device__ __forceinline__ void stmatrix_x1(unsigned smem_addr, unsigned r0) {
    asm volatile("stmatrix.sync.aligned.m8n8.x1.shared.b16 [%0], {%1};\n" ::"r"(smem_addr), "r"(r0) : "memory");
}
__device__ __forceinline__ void stmatrix_x2(unsigned smem_addr, unsigned r0, unsigned r1) {
    asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1, %2};\n" ::"r"(smem_addr), "r"(r0), "r"(r1)
                 : "memory");
}
__device__ __forceinline__ void stmatrix_x4(unsigned smem_addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}
__device__ __forceinline__ void stmatrix_x4_trans(unsigned smem_addr, unsigned r0, unsigned r1, unsigned r2,
                                                  unsigned r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

}  // namespace weft::ptx
