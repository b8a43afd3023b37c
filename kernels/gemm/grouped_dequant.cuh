// SPDX-License-Identifier: MIT
// The fp8 front of the masked grouped GEMM: e4m3 rows with one fp32 scale per 128 channels (what the expert-parallel
// low-latency dispatch produces) to bf16 rows, only the rows [0, counts[g]) of each group, which the bf16 grouped GEMM
// (gemm_sm90.cuh + GroupedScheduler) then multiplies.
//
//   codes  [G, capacity, K] e4m3 (row stride lda_codes bytes)   scales [G, capacity, K / 128] fp32 (row stride lds)
//   out    [G, capacity, K] bf16 (row stride ldo elements): out = bf16_rn(float(code) * scale), rows past a group's
//          count (clamped to [0, capacity]) untouched
#pragma once

#include "weft/common/gemm_hook_params.hpp"
#include "weft/common/macros.hpp"
#include "weft/ptx/cvt.cuh"

namespace weft::kernels::gemm {

using weft::gemm::GroupedDequantArgs;
using weft::gemm::kGroupedDequantThreads;

namespace detail {

/// 16 bytes to global memory (st.global.v4.b32). Plain uint4 assignments were split into 4-byte stores, and the generic
/// ptx::st form is a generic-space store (ST.E.128): this one is STG.E.128 (GroupedGemmNvrtc checks the SASS).
__device__ __forceinline__ void st_global_v4(void* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

/// 16 bytes from global memory (ld.global.v4.b32): LDG.E.128.
__device__ __forceinline__ uint4 ld_global_v4(const void* p) {
    uint4 v;
    asm volatile("ld.global.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

}  // namespace detail

/// One warp per row (grid-stride over the G x capacity rows, those past a group's count skipped); each lane converts
/// 16 codes (one 16-byte load, two 16-byte stores) per step. Memory-bound: launch about 4 CTAs per SM.
template <int kUnused>
__global__ void __launch_bounds__(kGroupedDequantThreads) grouped_dequant_fp8_kernel(const GroupedDequantArgs a) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * (kGroupedDequantThreads / 32);
    const int64_t rows = static_cast<int64_t>(a.groups) * a.capacity;
    for (int64_t row = static_cast<int64_t>(blockIdx.x) * (kGroupedDequantThreads / 32) + threadIdx.x / 32; row < rows;
         row += warps) {
        const int32_t g = static_cast<int32_t>(row / a.capacity);
        const int32_t r = static_cast<int32_t>(row - static_cast<int64_t>(g) * a.capacity);
        const int32_t raw = a.counts[g];
        const int32_t count = raw < 0 ? 0 : (raw > a.capacity ? a.capacity : raw);
        if (r >= count) continue;
        const unsigned char* src = a.codes + row * a.lda_codes;
        const float* scale_row = a.scales + row * a.lds;
        unsigned short* dst = a.out + row * a.ldo;
        for (int32_t k0 = lane * 16; k0 < a.k; k0 += 32 * 16) {
            const uint4 v = detail::ld_global_v4(src + k0);
            const float scale = scale_row[k0 / 128];  // 16 codes never straddle a 128-channel group
            const uint32_t words[4] = {v.x, v.y, v.z, v.w};
            uint32_t packed[8];
#pragma unroll
            for (int w = 0; w < 4; ++w) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint32_t f16x2 = ptx::cvt_rn_f16x2_e4m3x2(static_cast<uint16_t>(words[w] >> (16 * h)));
                    const float lo = ptx::f16_bits_to_f32(static_cast<uint16_t>(f16x2 & 0xFFFFu)) * scale;
                    const float hi = ptx::f16_bits_to_f32(static_cast<uint16_t>(f16x2 >> 16)) * scale;
                    packed[2 * w + h] = ptx::cvt_rn_bf16x2(lo, hi);
                }
            }
            detail::st_global_v4(dst + k0, packed[0], packed[1], packed[2], packed[3]);
            detail::st_global_v4(dst + k0 + 8, packed[4], packed[5], packed[6], packed[7]);
        }
    }
}

}  // namespace weft::kernels::gemm
