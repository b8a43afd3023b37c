// SPDX-License-Identifier: MIT
// Ahead-of-time (nvcc) instances of the GEMM kernels for weft::ops::gemm's registry: every candidate config
// for every supported dtype pair and B layout, and every small-M kernel. Include from ONE .cu of a program
// and call weft::gemm::register_gemm_instances() before the first gemm (until weft::jit compiles on demand).
#pragma once

#include "gemm/gemm_sm90.cuh"
#include "gemm/gemv_sm90.cuh"
#include "weft/detail/gemm_launch.hpp"

namespace weft::gemm {
namespace detail {

template <DType kIn, DType kOut, BLayout kLayout, int kIndex>
void register_tiled_instances() {
    if constexpr (kIndex < kGemmNumCandidates) {
        constexpr GemmConfig kCfg = gemm_candidate(kIndex, kIn, kOut, kLayout);
        if constexpr (is_valid(kCfg)) {
            ops::detail::register_gemm_kernel(
                kCfg, reinterpret_cast<const void*>(&gemm_candidate_kernel<kIndex, kIn, kOut, kLayout>));
        }
        register_tiled_instances<kIn, kOut, kLayout, kIndex + 1>();
    }
}

template <DType kIn, DType kOut, int kVariant, int kMTiles>
void register_gemv_instance() {
    constexpr GemvShape kShape = gemv_shape(kVariant, kMTiles);
    ops::detail::register_gemv_kernel(
        kMTiles, kIn, kOut, kVariant,
        reinterpret_cast<const void*>(
            &gemv_kernel<kMTiles, kIn, kOut, kShape.n_tiles, kShape.stages, kShape.bulk, kShape.whole_rows>));
}

template <DType kIn, DType kOut, int kVariant>
void register_gemv_instances() {
    register_gemv_instance<kIn, kOut, kVariant, 1>();
    register_gemv_instance<kIn, kOut, kVariant, 2>();
    register_gemv_instance<kIn, kOut, kVariant, 3>();
    register_gemv_instance<kIn, kOut, kVariant, 4>();
}

template <DType kIn, DType kOut>
void register_dtype_instances() {
    register_tiled_instances<kIn, kOut, BLayout::kNK, 0>();
    register_tiled_instances<kIn, kOut, BLayout::kKN, 0>();
    register_gemv_instances<kIn, kOut, 0>();
    register_gemv_instances<kIn, kOut, 1>();
    register_gemv_instances<kIn, kOut, 2>();
    register_gemv_instances<kIn, kOut, 3>();
    register_gemv_instance<kIn, kOut, 4, 1>();  // bulk-copied rows: one row tile (M <= 16) only
}

}  // namespace detail

/// Registers every instance above with weft::ops::gemm (idempotent).
inline void register_gemm_instances() {
    detail::register_dtype_instances<DType::kBF16, DType::kBF16>();
    detail::register_dtype_instances<DType::kBF16, DType::kF32>();
    detail::register_dtype_instances<DType::kF16, DType::kF16>();
    detail::register_dtype_instances<DType::kF16, DType::kF32>();
}

}  // namespace weft::gemm
