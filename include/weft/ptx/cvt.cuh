// SPDX-License-Identifier: MIT
// cvt: float conversions to bf16 / f16 (one value, or two packed) and fp8 e4m3x2 (round to nearest even), and
// back (e4m3x2 to f16x2, bf16 / f16 bits to f32).
//
//     uint32_t two_bf16 = ptx::cvt_rn_bf16x2(lo, hi);                 // lo -> bits 0..15, hi -> 16..31
//     uint32_t two_f16  = ptx::cvt_rn_f16x2(lo, hi);                  // the same for f16
//     uint32_t two      = ptx::cvt_rn_16x2<kT>(lo, hi);               // either, by DType (kBF16 or kF16)
//     uint16_t one_bf16 = ptx::cvt_rn_bf16(x);                        // one value: cvt_rn_f16 for f16
//     uint16_t two_fp8  = ptx::cvt_rn_satfinite_e4m3x2(lo, hi);       // lo -> bits 0..7,  hi -> 8..15
//     uint32_t two_f16e = ptx::cvt_rn_f16x2_e4m3x2(two_fp8);          // exact
//     float f           = ptx::bf16_bits_to_f32(bits);               // exact, no instruction
//
// PTX packs the value converted from its FIRST source operand into the UPPER half of the result; these
// wrappers take (lo, hi) in memory order instead, so that storing the result little-endian puts `lo`
// at the lower address. e4m3 is the "fn" flavour (no infinities, max finite 448, NaN = 0x7f/0xff);
// `.satfinite` clamps finite values beyond +-448 (and infinities) to +-448 and keeps NaN a NaN. bf16 and f16
// conversions without .satfinite keep infinities and round values beyond the largest finite one to infinity
// (f16: from 65520 on). bf16 and bf16x2 need sm_80 (f16 sm_53); the e4m3 conversions need sm_89 (PTX 7.8). Pure
// register operations: no memory clobber, the compiler may schedule them freely.
#pragma once

#include "weft/common/dtype.hpp"
#include "weft/common/macros.hpp"

namespace weft::ptx {

/// Two floats to two bf16 (round to nearest, ties to even; NaN stays NaN), packed little-endian:
/// `lo` in bits 0..15, `hi` in bits 16..31. `cvt.rn.bf16x2.f32`.
__device__ __forceinline__ uint32_t cvt_rn_bf16x2(float lo, float hi) {
    uint32_t d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

/// Two floats to two f16 (round to nearest, ties to even; NaN stays NaN), packed little-endian: `lo` in bits
/// 0..15, `hi` in bits 16..31. `cvt.rn.f16x2.f32`.
__device__ __forceinline__ uint32_t cvt_rn_f16x2(float lo, float hi) {
    uint32_t d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

/// Two floats to two 16-bit values of dtype kT (kBF16 or kF16), packed as cvt_rn_bf16x2 / cvt_rn_f16x2 pack them.
template <DType kT>
__device__ __forceinline__ uint32_t cvt_rn_16x2(float lo, float hi) {
    static_assert(kT == DType::kBF16 || kT == DType::kF16, "cvt_rn_16x2: kT must be bf16 or f16");
    if constexpr (kT == DType::kBF16) {
        return cvt_rn_bf16x2(lo, hi);
    } else {
        return cvt_rn_f16x2(lo, hi);
    }
}

/// One float to bf16 bits (round to nearest, ties to even; NaN stays NaN). `cvt.rn.bf16.f32`.
__device__ __forceinline__ uint16_t cvt_rn_bf16(float x) {
    unsigned short d;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(d) : "f"(x));
    return static_cast<uint16_t>(d);
}

/// One float to f16 bits (round to nearest, ties to even; NaN stays NaN). `cvt.rn.f16.f32`.
__device__ __forceinline__ uint16_t cvt_rn_f16(float x) {
    unsigned short d;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(d) : "f"(x));
    return static_cast<uint16_t>(d);
}

/// Two floats to two fp8 e4m3 (round to nearest, ties to even, saturating to +-448), packed
/// little-endian: `lo` in bits 0..7, `hi` in bits 8..15. `cvt.rn.satfinite.e4m3x2.f32`.
__device__ __forceinline__ uint16_t cvt_rn_satfinite_e4m3x2(float lo, float hi) {
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return static_cast<uint16_t>(d);
}

/// Two fp8 e4m3 (bits 0..7 and 8..15) to two f16 (bits 0..15 and 16..31), exactly (every e4m3 value
/// is an f16 value). `cvt.rn.f16x2.e4m3x2`.
__device__ __forceinline__ uint32_t cvt_rn_f16x2_e4m3x2(uint16_t two_fp8) {
    uint32_t d;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(static_cast<unsigned short>(two_fp8)));
    return d;
}

/// The float a bf16 bit pattern denotes (exact: bf16 is the upper half of an f32).
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t bits) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

/// The float an f16 bit pattern denotes (exact). `cvt.f32.f16`.
__device__ __forceinline__ float f16_bits_to_f32(uint16_t bits) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<unsigned short>(bits)));
    return f;
}

/// The two floats a packed bf16 pair denotes (exact, no instruction): bits 0..15 -> `lo`, bits 16..31 -> `hi`.
__device__ __forceinline__ void bf16x2_bits_to_f32x2(uint32_t two_bf16, float& lo, float& hi) {
    lo = __uint_as_float(two_bf16 << 16);
    hi = __uint_as_float(two_bf16 & 0xffff0000u);
}

}  // namespace weft::ptx
