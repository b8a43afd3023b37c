// SPDX-License-Identifier: MIT
// Plain global stores of D's elements, converted from fp32 to the output dtype (round to nearest): one element, or two
// adjacent ones as one store. Shared by the GEMM epilogue's tails and the small-M kernels.
#pragma once

#include "weft/common/dtype.hpp"
#include "weft/ptx/cvt.cuh"

namespace weft::kernels::gemm::detail {

/// Stores v, converted to kOut (round to nearest), at d[idx].
template <DType kOut>
__device__ __forceinline__ void store_out(void* d, int64_t idx, float v) {
    if constexpr (kOut == DType::kF32) {
        static_cast<float*>(d)[idx] = v;
    } else if constexpr (kOut == DType::kBF16) {
        static_cast<unsigned short*>(d)[idx] = ptx::cvt_rn_bf16(v);
    } else {
        static_cast<unsigned short*>(d)[idx] = ptx::cvt_rn_f16(v);
    }
}

/// Stores v0, v1, converted to kOut (round to nearest), at d[idx] and d[idx + 1] with one store; idx even and d
/// aligned to two elements.
template <DType kOut>
__device__ __forceinline__ void store_out2(void* d, int64_t idx, float v0, float v1) {
    if constexpr (kOut == DType::kF32) {
        *reinterpret_cast<float2*>(static_cast<float*>(d) + idx) = make_float2(v0, v1);
    } else {
        *reinterpret_cast<uint32_t*>(static_cast<unsigned short*>(d) + idx) = ptx::cvt_rn_16x2<kOut>(v0, v1);
    }
}

}  // namespace weft::kernels::gemm::detail
