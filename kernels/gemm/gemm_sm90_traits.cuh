// SPDX-License-Identifier: MIT
// weft's sm_90a GEMM (gemm_sm90.cuh): what its parts share, the compile-time facts of a config, the named barriers
// of the consumer warpgroups and the 16-bit packing and shared-memory stores of the epilogue.
#pragma once

#include "weft/common/gemm_config.hpp"
#include "weft/ptx/cvt.cuh"

namespace weft::kernels::gemm {
namespace detail {

/// Compile-time facts derived from a config.
template <GemmConfig kCfg>
struct GemmTraits {
    static constexpr GemmSmemPlan kPlan = gemm_smem_plan(kCfg);
    static constexpr int kClusterSize = kCfg.cluster_m * kCfg.cluster_n;
    static constexpr int kSlabs = gemm_slabs_per_consumer(kCfg);
    static constexpr int kAccPerSlab = gemm_wgmma_n(kCfg) / 2;
    static constexpr int kKSteps = kCfg.tile_k / 16;
    static constexpr bool kIsBF16 = kCfg.in_dtype == DType::kBF16;
    static constexpr int kTransB = kCfg.b_layout == BLayout::kKN ? 1 : 0;
    static constexpr int kEpiCols = gemm_epi_cols(kCfg);
    static constexpr int kEpiSubtiles = kCfg.tile_n / kEpiCols;  // whole store boxes
    static constexpr int kEpiTmaCols = kEpiSubtiles * kEpiCols;  // columns of a tile stored by TMA
    static constexpr bool kEpiTail = kEpiTmaCols < kCfg.tile_n;  // the rest by plain stores (gemm_epi_tail)
    // Warps that consume (and free) each stage: both consumer warpgroups, or one in ping-pong.
    static constexpr int kConsumerWarps = (kCfg.pingpong ? 1 : kGemmConsumerWarpgroups) * 4;
    static constexpr int kRowBytes = kCfg.tile_k * 2;  // 128: one swizzle row
    // Multicast split of the shared operand between the two CTAs of a cluster.
    static constexpr int kARowsPerCta = kCfg.tile_m / kCfg.cluster_n;
    static constexpr int kBRowsPerCta = kCfg.tile_n / kCfg.cluster_m;  // kNK: rows of B[N,K]
    static constexpr int kBChunks = kCfg.tile_n / 64;                  // kKN: 64-column boxes
    static constexpr int kBChunksPerCta = kBChunks / kCfg.cluster_m;
    static constexpr int kBChunkBytes = kCfg.tile_k * 128;  // kKN: 64 k-rows x 128 B
    static_assert(kRowBytes == 128, "tile_k must span one 128-byte swizzle row");
};

// Named barrier ids (0 is __syncthreads): one per consumer warpgroup, one for both, and (ping-pong) one per
// consumer warpgroup that the other arrives on when this one's mainloop may start.
inline constexpr int kBarConsumer0 = 1;
inline constexpr int kBarBothConsumers = 3;
inline constexpr int kBarMainloopTurn0 = 4;

__device__ __forceinline__ void st_shared_v2_f32(unsigned addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

__device__ __forceinline__ void st_shared_f32(unsigned addr, float x) {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(x) : "memory");
}

}  // namespace detail
}  // namespace weft::kernels::gemm
