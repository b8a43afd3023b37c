// SPDX-License-Identifier: MIT
// Pieces shared by the small-M GEMM kernels (kernels/gemm/gemv_tma_sm90.cuh, gemv_rows_sm90.cuh, gemv_wgmma_sm90.cuh):
// their tensor-map parameter, the m16n8k16 tensor-core MMA, guarded shared-memory reads, the stage-wait bound, the
// four-value output store (on gemm/store_out.cuh's) and kTmaRing's split-K reduction by the last CTA of a column block.
//
// Both kernels multiply with mma.sync m16n8k16 on a permuted k order: lane (g = l/4, t = l%4) reads the 16 bytes at
// k + 8t .. k + 8t + 7 of a row, which are exactly the B fragments of two m16n8k16 MMAs when A is read with the
// same permutation (A[row][k + 8t .. k + 8t + 7]); the dot products are unchanged.
#pragma once

#include "gemm/store_out.cuh"
#include "weft/common/gemv_config.hpp"
#include "weft/ptx/cvt.cuh"
#include "weft/ptx/tma.cuh"

namespace weft::kernels::gemm {

/// kTmaRing's tensor maps (A [M,K] with kGemvBulkBoxK x 16 m_tiles boxes, B [N,K] with kGemvBulkBoxK x 32 n_tiles
/// boxes; 128-byte swizzled when the boxes are 64 wide), kTmaWgmma's (A with {64, 16 m_tiles} boxes, B with {64, 64},
/// both 128-byte swizzled); kBulkRows takes them too (one launch signature for every kernel) and ignores them.
struct GemvMaps {
    ptx::TmaDescriptor a;
    ptx::TmaDescriptor b;
};

namespace detail {

/// c += A * B for one m16n8k16 tile on the tensor cores (bf16 or f16 fragments a0..a3 of A, b0, b1 of B; fp32).
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

/// Stores the first `count` (1..4) of v's values, converted to kOut, at d[idx ..] in pairs: idx even (the op takes
/// D's rows 16-byte aligned and runs start at multiples of 4 columns).
template <DType kOut>
__device__ __forceinline__ void store_out_run(void* d, int64_t idx, float4 v, int count) {
    if (count >= 2) {
        store_out2<kOut>(d, idx, v.x, v.y);
    } else {
        store_out<kOut>(d, idx, v.x);
    }
    if (count >= 4) {
        store_out2<kOut>(d, idx + 2, v.z, v.w);
    } else if (count == 3) {
        store_out<kOut>(d, idx + 2, v.z);
    }
}

/// A stage that has not landed after this long is a kernel bug (bad tensor map, wrong byte count): trap.
inline constexpr unsigned long long kGemvStageWaitNs = 2000ull * 1000 * 1000;

/// 16 bytes of shared memory where ok, else zeros.
__device__ __forceinline__ uint4 lds_16_if(bool ok, const unsigned char* p) {
    return ok ? *reinterpret_cast<const uint4*>(p) : make_uint4(0u, 0u, 0u, 0u);
}

/// The split-K end of small-M kernel kTmaRing, called by all kThreads threads of the CTA once each
/// has stored its share of this split's partial sums (args.partials [split][M][N] fp32) of the column block blockIdx.x
/// (columns n_begin .. n_begin + cols - 1): counts the CTA in on args.counters[blockIdx.x]; the block's last CTA sums
/// every split's partials in split order (deterministic: the same bits whichever CTA comes last), writes D and resets
/// the counter to zero for the next launch on the stream. No CTA waits for another (nothing to bound).
template <DType kOut, int kThreads>
__device__ __forceinline__ void gemv_split_k_reduce(const GemvArgs& args, int n_begin, int cols) {
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
    for (int idx = static_cast<int>(threadIdx.x); idx < args.m * cols; idx += kThreads) {
        const int m = idx / cols;
        const int n = n_begin + idx % cols;
        float sum = 0.f;
        for (int s = 0; s < args.num_splits; ++s) {
            sum += __ldcg(args.partials + (static_cast<int64_t>(s) * args.m + m) * args.n + n);
        }
        store_out<kOut>(args.d, m * args.ldd + n, sum);
    }
    if (threadIdx.x == 0) args.counters[blockIdx.x] = 0u;  // ready for the next launch on this stream
}

}  // namespace detail
}  // namespace weft::kernels::gemm
