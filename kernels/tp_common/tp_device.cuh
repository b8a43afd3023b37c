// SPDX-License-Identifier: MIT
// Device helpers shared by the tensor-parallel fused kernels (ag_gemm, gemm_rs, gemm_ar): element conversion by
// dtype (the instructions are weft/ptx/cvt.cuh's), 8-element vector loads/stores as fp32, and the "last block /
// last tile to finish" election.
#pragma once

#include "weft/common/dtype.hpp"
#include "weft/ptx/atom.cuh"
#include "weft/ptx/cvt.cuh"
#include "weft/ptx/ld_st.cuh"

namespace weft::kernels::tp_common {

/// One 16-bit element (bf16 or f16 bits) to fp32 (exact).
template <DType kT>
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
    if constexpr (kT == DType::kBF16) {
        return ptx::bf16_bits_to_f32(h);
    } else {
        return ptx::f16_bits_to_f32(h);
    }
}

/// fp32 to one 16-bit element, round to nearest even.
template <DType kT>
__device__ __forceinline__ unsigned short float_to_half_bits(float f) {
    if constexpr (kT == DType::kBF16) {
        return ptx::cvt_rn_bf16(f);
    } else {
        return ptx::cvt_rn_f16(f);
    }
}

/// Loads element `i` of a row of dtype kT as fp32 (plain load: the data was acquired before).
template <DType kT>
__device__ __forceinline__ float load_elem(const void* row, int64_t i) {
    if constexpr (kT == DType::kF32) {
        return ptx::ld(static_cast<const float*>(row) + i);
    } else {
        return half_bits_to_float<kT>(ptx::ld(static_cast<const uint16_t*>(row) + i));
    }
}

template <DType kT>
__device__ __forceinline__ void store_elem(void* row, int64_t i, float v) {
    if constexpr (kT == DType::kF32) {
        static_cast<float*>(row)[i] = v;
    } else {
        static_cast<unsigned short*>(row)[i] = float_to_half_bits<kT>(v);
    }
}

/// 8 consecutive elements of dtype kT as loaded: one 16-byte word for 16-bit types, two for fp32.
template <DType kT>
struct Raw8 {
    uint4 q[kT == DType::kF32 ? 2 : 1];
};

/// Loads 8 consecutive elements (aligned) without converting them: loads whose values are used later stay in
/// flight together (a conversion right after each load makes the next one wait for it).
template <DType kT>
__device__ __forceinline__ Raw8<kT> load_raw8(const void* p) {
    Raw8<kT> r;
    r.q[0] = ptx::ld(static_cast<const uint4*>(p));
    if constexpr (kT == DType::kF32) r.q[1] = ptx::ld(static_cast<const uint4*>(p) + 1);
    return r;
}

/// The 8 elements of `r` as fp32.
template <DType kT>
__device__ __forceinline__ void unpack8(const Raw8<kT>& r, float (&v)[8]) {
    if constexpr (kT == DType::kF32) {
        const uint4 a = r.q[0], b = r.q[1];
        v[0] = __uint_as_float(a.x), v[1] = __uint_as_float(a.y), v[2] = __uint_as_float(a.z);
        v[3] = __uint_as_float(a.w), v[4] = __uint_as_float(b.x), v[5] = __uint_as_float(b.y);
        v[6] = __uint_as_float(b.z), v[7] = __uint_as_float(b.w);
    } else {
        const unsigned w[4] = {r.q[0].x, r.q[0].y, r.q[0].z, r.q[0].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = half_bits_to_float<kT>(static_cast<unsigned short>(w[i] & 0xffffu));
            v[2 * i + 1] = half_bits_to_float<kT>(static_cast<unsigned short>(w[i] >> 16));
        }
    }
}

/// Loads 8 consecutive elements (16 bytes for 16-bit types, 32 for fp32; aligned) as fp32.
template <DType kT>
__device__ __forceinline__ void load8(const void* p, float (&v)[8]) {
    unpack8<kT>(load_raw8<kT>(p), v);
}

/// Stores 8 fp32 values as 8 consecutive elements of dtype kT (aligned).
template <DType kT>
__device__ __forceinline__ void store8(void* p, const float (&v)[8]) {
    if constexpr (kT == DType::kF32) {
        ptx::st(static_cast<uint4*>(p),
                make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3])));
        ptx::st(static_cast<uint4*>(p) + 1,
                make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7])));
    } else {
        unsigned w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = ptx::cvt_rn_16x2<kT>(v[2 * i], v[2 * i + 1]);
        ptx::st(static_cast<uint4*>(p), make_uint4(w[0], w[1], w[2], w[3]));
    }
}

/// Called by one thread per participant (a block, or a finished tile) after its work; returns true in the
/// one caller that arrives last (`expected` arrivals in all) and resets the counter for the next call. The
/// acq_rel chain makes every earlier participant's work visible to the last one, which may then release it
/// further (e.g. with a system-scope notify).
__device__ __forceinline__ bool arrive_last(uint32_t* counter, uint32_t expected) {
    const uint32_t old = ptx::atom_add<ptx::Sem::kAcqRel, ptx::Scope::kGpu>(counter, 1u);
    if (old + 1u != expected) return false;
    ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(counter, 0u);
    return true;
}

}  // namespace weft::kernels::tp_common
