// SPDX-License-Identifier: MIT
// weft's sm_90a GEMM (gemm_sm90.cuh): the epilogue, from the consumers' fp32 accumulators to D. Each 64-row slab goes
// through a 128B-swizzled staging buffer per warpgroup to TMA stores (stmatrix for 16-bit outputs); the columns a store
// box may not write (the last ones, under 16 bytes per row; a tile's tail past its whole boxes; a grouped tile's rows
// past its group) by plain stores; swapped-operand tiles transposed on the way; split-K partials summed in split order
// by the unit that arrives last; the hook raised once a tile's stores have completed.
#pragma once

#include "gemm/gemm_hooks.cuh"
#include "gemm/gemm_scheduler.cuh"
#include "gemm/gemm_sm90_traits.cuh"
#include "gemm/store_out.cuh"
#include "weft/common/gemm_config.hpp"
#include "weft/ptx/cvt.cuh"
#include "weft/ptx/ld_st.cuh"
#include "weft/ptx/matrix.cuh"
#include "weft/ptx/mbarrier.cuh"
#include "weft/ptx/tma.cuh"

namespace weft::kernels::gemm {
namespace detail {

/// Writes columns [j * kEpiCols, (j+1) * kEpiCols) of one 64-row accumulator slab into a staging buffer of
/// 64 rows x 128 bytes, 128B-swizzled (the layout the TMA store box reads).
template <GemmConfig kCfg, int kJ>
__device__ __forceinline__ void stage_subtile(const float (&acc)[GemmTraits<kCfg>::kAccPerSlab], unsigned buf,
                                              int warp_in_wg, int lane) {
    using T = GemmTraits<kCfg>;
    if constexpr (kCfg.out_dtype == DType::kF32) {
        // 32 columns = 4 groups of 8; each thread owns 2 adjacent columns in rows r and r + 8.
        const int row0 = warp_in_wg * 16 + lane / 4;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            constexpr int kGroupsPerSubtile = 4;
            const int g = kJ * kGroupsPerSubtile + q;
            const int col_byte = q * 32 + (lane % 4) * 8;
            const unsigned addr = buf + row0 * 128 + ((((col_byte >> 4) ^ (row0 & 7))) << 4) + (col_byte & 15);
            st_shared_v2_f32(addr, acc[4 * g + 0], acc[4 * g + 1]);
            st_shared_v2_f32(addr + 8 * 128, acc[4 * g + 2], acc[4 * g + 3]);
        }
    } else {
        // 64 columns = 8 groups of 8; one stmatrix.x4 stores two groups (rows 0-7 and 8-15 of this warp).
        const int mi = lane / 8;
        const int row = warp_in_wg * 16 + (mi & 1) * 8 + (lane % 8);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const int g = kJ * 8 + 2 * p;
            const unsigned r0 = ptx::cvt_rn_16x2<kCfg.out_dtype>(acc[4 * g + 0], acc[4 * g + 1]);
            const unsigned r1 = ptx::cvt_rn_16x2<kCfg.out_dtype>(acc[4 * g + 2], acc[4 * g + 3]);
            const unsigned r2 = ptx::cvt_rn_16x2<kCfg.out_dtype>(acc[4 * g + 4], acc[4 * g + 5]);
            const unsigned r3 = ptx::cvt_rn_16x2<kCfg.out_dtype>(acc[4 * g + 6], acc[4 * g + 7]);
            const int chunk = 2 * p + (mi >> 1);
            const unsigned addr = buf + row * 128 + ((chunk ^ (row & 7)) << 4);
            ptx::stmatrix_x4(addr, r0, r1, r2, r3);
        }
    }
    (void)T::kEpiCols;
}

/// Grouped tiles of 16-bit output: what a TMA store may not write of one staged store box (columns [c0, c0 + kEpiCols)
/// of rows row0..), by the warpgroup's plain stores from the staging buffer: its rows [row0, row_end) from column
/// c_from on, never a column from args.n on. For a slab that its group's rows end inside, c_from = c0 (a box would
/// write the next group's rows); for a whole slab, args.n_tma (the last columns, less than 16 bytes per row, past the
/// store map's width). From shared memory, not from the accumulators: they are not kept live for a second pass (with
/// 192 floats per thread and bf16 output that spilled 1388 bytes; with fp32 output the second pass is what spills
/// nothing, and copy_out_box's six boxes per slab spilled 24-44 bytes: store_slab_tail there).
template <GemmConfig kCfg>
__device__ __forceinline__ void copy_out_box(unsigned buf, int row0, int row_end, int c0, int c_from, int tid,
                                             const GemmArgs& args) {
    constexpr int kElemBytes = gemm_elem_bytes(kCfg.out_dtype);
    static_assert(kElemBytes == 2, "copy_out_box stores 16-bit outputs (fp32 slabs go out by store_slab_tail)");
    constexpr int kPerChunk = 16 / kElemBytes;  // elements per 16-byte chunk of a row
    const int rows = row_end - row0 < kGemmSlabRows ? row_end - row0 : kGemmSlabRows;
    for (int idx = tid; idx < rows * 8; idx += 128) {
        const int r = idx / 8, chunk = idx % 8;
        const int c = c0 + chunk * kPerChunk;
        if (c + kPerChunk <= c_from || c >= args.n) continue;
        const uint4 v = ptx::ld_shared<uint4>(buf + r * 128 + ((chunk ^ (r & 7)) << 4));
        unsigned char* const dst =
            static_cast<unsigned char*>(args.d) + ((static_cast<int64_t>(row0 + r) * args.ldd + c) * kElemBytes);
        if (c >= c_from && c + kPerChunk <= args.n) {
            *reinterpret_cast<uint4*>(dst) = v;  // D's rows are 16-byte aligned (TMA-stored)
            continue;
        }
        const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < kPerChunk; ++e) {
            if (c + e < c_from || c + e >= args.n) continue;
            reinterpret_cast<unsigned short*>(dst)[e] = static_cast<unsigned short>(words[e / 2] >> (16 * (e % 2)));
        }
    }
}

/// Epilogue of one 64-row slab: for each 128-byte-wide column block, registers -> swizzled shared buffer
/// (double-buffered per warpgroup) -> one TMA store issued by the warpgroup's first thread; with kCopyOut (grouped
/// tiles), then copy_out_box of its rows [row0, copy_row_end) from column copy_col_from on.
template <GemmConfig kCfg, bool kCopyOut = false, int kJ = 0>
__device__ __forceinline__ void store_slab(const float (&acc)[GemmTraits<kCfg>::kAccPerSlab],
                                           const ptx::TmaDescriptor* tma_d, unsigned epi_base, int wg, int tid,
                                           unsigned& epi_count, int row0, int col0, bool valid, int row_limit,
                                           const GemmArgs& args, int copy_row_end = 0, int copy_col_from = 0) {
    using T = GemmTraits<kCfg>;
    if constexpr (kJ < T::kEpiSubtiles) {
        const unsigned buf = epi_base + (wg * 2 + (epi_count & 1u)) * T::kPlan.epi_buf_bytes;
        if (tid == 0) ptx::tma_wait_group_read<1>();  // the store that last read this buffer is done reading
        ptx::named_barrier_sync(kBarConsumer0 + wg, 128);
        stage_subtile<kCfg, kJ>(acc, buf, tid / 32, tid % 32);
        ptx::fence_proxy_async_shared_cta();  // st.shared/stmatrix -> TMA (async proxy)
        ptx::named_barrier_sync(kBarConsumer0 + wg, 128);
        if (tid == 0) {
            const int c0 = col0 + kJ * T::kEpiCols;
            if (valid && c0 < args.n_tma && row0 < row_limit) ptx::tma_store_2d(tma_d, buf, c0, row0);
            ptx::tma_commit_group();
        }
        if constexpr (kCopyOut) {
            if (copy_row_end > row0) {
                const int c0 = col0 + kJ * T::kEpiCols;
                copy_out_box<kCfg>(buf, row0, copy_row_end, c0, copy_col_from, tid, args);
            }
        }
        ++epi_count;
        store_slab<kCfg, kCopyOut, kJ + 1>(acc, tma_d, epi_base, wg, tid, epi_count, row0, col0, valid, row_limit, args,
                                           copy_row_end, copy_col_from);
    }
}

/// With plain stores: columns [n_tma, N) of one slab (less than 16 bytes per row: a TMA store box would write the
/// whole 16-byte chunk and overwrite the row padding past N), and, for a tile width that is not a whole number of
/// store boxes (GemmTraits::kEpiTail), the tile's columns past its last whole box (a box there would overwrite the
/// next tile's columns); with `all_columns`, every column of the slab (a grouped tile's slab, fp32 output, that its
/// group's rows end inside: a box would write the next group's rows). Rows from `row_end` on are not stored.
template <GemmConfig kCfg>
__device__ __forceinline__ void store_slab_tail(const float (&acc)[GemmTraits<kCfg>::kAccPerSlab], int row0, int col0,
                                                int warp_in_wg, int lane, const GemmArgs& args, int row_end,
                                                bool all_columns = false) {
    const int r_lo = row0 + warp_in_wg * 16 + lane / 4;
    const int r_hi = r_lo + 8;
#pragma unroll
    for (int g = 0; g < kCfg.tile_n / 8; ++g) {
        const bool past_boxes = all_columns || 8 * g >= GemmTraits<kCfg>::kEpiTmaCols;
        const int c0 = col0 + 8 * g + 2 * (lane % 4);
        if (past_boxes && c0 + 1 < args.n) {
            // Both columns: one 4- or 8-byte store per row (D's row stride is a multiple of 16 bytes: TMA-stored).
            if (r_lo < row_end) store_out2<kCfg.out_dtype>(args.d, r_lo * args.ldd + c0, acc[4 * g], acc[4 * g + 1]);
            if (r_hi < row_end) {
                store_out2<kCfg.out_dtype>(args.d, r_hi * args.ldd + c0, acc[4 * g + 2], acc[4 * g + 3]);
            }
            continue;
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int c = c0 + e;
            if ((past_boxes || c >= args.n_tma) && c < args.n) {
                if (r_lo < row_end) store_out<kCfg.out_dtype>(args.d, r_lo * args.ldd + c, acc[4 * g + e]);
                if (r_hi < row_end) store_out<kCfg.out_dtype>(args.d, r_hi * args.ldd + c, acc[4 * g + 2 + e]);
            }
        }
    }
}

/// Swapped configs (GemmConfig::swap_ab): writes rows [64 kR, 64 kR + 64) of the tile (fewer in the last chunk) and
/// columns [kJ kEpiCols, (kJ + 1) kEpiCols) of one 64-column slab into a staging buffer of 64 rows x 128 bytes,
/// 128B-swizzled as stage_subtile's. The accumulators hold D^T (thread: warp w, lane l): acc[4j + e] is D's row
/// 8j + 2(l%4) + e, column 16w + l/4 of the slab, acc[4j + 2 + e] the same row at column + 8. 16-bit outputs: one
/// stmatrix.x4 .trans per 16 rows (matrix i: rows of j + i/2, columns 16w + 8(i%2), stored transposed into D's
/// layout); fp32: element stores by the two warps whose columns the subtile holds.
template <GemmConfig kCfg, int kJ, int kR>
__device__ __forceinline__ void stage_subtile_swapped(const float (&acc)[GemmTraits<kCfg>::kAccPerSlab], unsigned buf,
                                                      int warp_in_wg, int lane) {
    constexpr int kRows = kCfg.tile_m - 64 * kR < 64 ? kCfg.tile_m - 64 * kR : 64;
    static_assert(kRows % 16 == 0, "gemm (swapped): tile_m is a multiple of 16 (is_valid)");
    if constexpr (kCfg.out_dtype == DType::kF32) {
        if (warp_in_wg / 2 == kJ) {
#pragma unroll
            for (int jj = 0; jj < kRows / 8; ++jj) {
                const int j = 8 * kR + jj;
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int row = 8 * jj + 2 * (lane % 4) + e;
                        const int col_byte = (16 * (warp_in_wg % 2) + lane / 4 + 8 * h) * 4;
                        st_shared_f32(buf + row * 128 + ((((col_byte >> 4) ^ (row & 7))) << 4) + (col_byte & 15),
                                      acc[4 * j + 2 * h + e]);
                    }
            }
        }
    } else {
        const int mi = lane / 8;
#pragma unroll
        for (int p = 0; p < kRows / 16; ++p) {
            const int j = 8 * kR + 2 * p;
            const unsigned r0 = ptx::cvt_rn_16x2<kCfg.out_dtype>(acc[4 * j + 0], acc[4 * j + 1]);
            const unsigned r1 = ptx::cvt_rn_16x2<kCfg.out_dtype>(acc[4 * j + 2], acc[4 * j + 3]);
            const unsigned r2 = ptx::cvt_rn_16x2<kCfg.out_dtype>(acc[4 * j + 4], acc[4 * j + 5]);
            const unsigned r3 = ptx::cvt_rn_16x2<kCfg.out_dtype>(acc[4 * j + 6], acc[4 * j + 7]);
            const int row = 16 * p + 8 * (mi >> 1) + lane % 8;
            const int chunk = 2 * warp_in_wg + (mi & 1);
            ptx::stmatrix_x4_trans(buf + row * 128 + ((chunk ^ (row & 7)) << 4), r0, r1, r2, r3);
        }
    }
}

/// Swapped configs: the epilogue of one 64-column slab (columns col0 .., rows row0 .. row0 + tile_m - 1): for each
/// 128-byte column block and each 64 rows, registers -> staging buffer (double-buffered per warpgroup) -> TMA stores
/// of kGemmSwapStoreRows rows each (the map's box), issued by the warpgroup's first thread; rows from M on are not
/// stored.
template <GemmConfig kCfg, int kJ = 0, int kR = 0>
__device__ __forceinline__ void store_slab_swapped(const float (&acc)[GemmTraits<kCfg>::kAccPerSlab],
                                                   const ptx::TmaDescriptor* tma_d, unsigned epi_base, int wg, int tid,
                                                   unsigned& epi_count, int row0, int col0, bool valid,
                                                   const GemmArgs& args) {
    using T = GemmTraits<kCfg>;
    constexpr int kSubtiles = kGemmSlabRows / T::kEpiCols;
    constexpr int kChunks = (kCfg.tile_m + 63) / 64;
    if constexpr (kJ < kSubtiles && kR < kChunks) {
        constexpr int kRows = kCfg.tile_m - 64 * kR < 64 ? kCfg.tile_m - 64 * kR : 64;
        const unsigned buf = epi_base + (wg * 2 + (epi_count & 1u)) * T::kPlan.epi_buf_bytes;
        if (tid == 0) ptx::tma_wait_group_read<1>();  // the stores that last read this buffer are done reading
        ptx::named_barrier_sync(kBarConsumer0 + wg, 128);
        stage_subtile_swapped<kCfg, kJ, kR>(acc, buf, tid / 32, tid % 32);
        ptx::fence_proxy_async_shared_cta();  // st.shared/stmatrix -> TMA (async proxy)
        ptx::named_barrier_sync(kBarConsumer0 + wg, 128);
        if (tid == 0) {
            const int c0 = col0 + kJ * T::kEpiCols;
#pragma unroll
            for (int b = 0; b < kRows / kGemmSwapStoreRows; ++b) {
                const int r = row0 + 64 * kR + b * kGemmSwapStoreRows;
                if (valid && c0 < args.n_tma && r < args.m) {
                    ptx::tma_store_2d(tma_d, buf + b * kGemmSwapStoreRows * 128, c0, r);
                }
            }
            ptx::tma_commit_group();
        }
        ++epi_count;
        if constexpr (kR + 1 < kChunks) {
            store_slab_swapped<kCfg, kJ, kR + 1>(acc, tma_d, epi_base, wg, tid, epi_count, row0, col0, valid, args);
        } else {
            store_slab_swapped<kCfg, kJ + 1, 0>(acc, tma_d, epi_base, wg, tid, epi_count, row0, col0, valid, args);
        }
    }
}

/// Swapped configs, with plain stores: the slab's columns [n_tma, N) (less than 16 bytes per row, as store_slab_tail).
template <GemmConfig kCfg>
__device__ __forceinline__ void store_slab_tail_swapped(const float (&acc)[GemmTraits<kCfg>::kAccPerSlab], int row0,
                                                        int col0, int warp_in_wg, int lane, const GemmArgs& args) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int c = col0 + 16 * warp_in_wg + lane / 4 + 8 * h;
        if (c < args.n_tma || c >= args.n) continue;
#pragma unroll
        for (int j = 0; j < kCfg.tile_m / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int r = row0 + 8 * j + 2 * (lane % 4) + e;
                if (r < args.m) store_out<kCfg.out_dtype>(args.d, r * args.ldd + c, acc[4 * j + 2 * h + e]);
            }
    }
}

/// Every store of `tile` issued so far has completed: raise the hook. Cooperative (deferred by one tile): both
/// warpgroups stored halves of it; ping-pong (right after the tile's epilogue): this warpgroup stored all of it.
/// False in the thread that raised it when the hook failed (its diagnostic recorded).
template <class Hook, bool kPingPong>
__device__ __forceinline__ bool notify_stored(const typename Hook::Params& hook_params, const GemmTile& tile, int wg,
                                              int tid) {
    if (tid == 0) ptx::tma_wait_group<0>();
    if constexpr (kPingPong) {
        ptx::named_barrier_sync(kBarConsumer0 + wg, 128);  // the warpgroup's plain (tail) stores come first too
    } else {
        ptx::named_barrier_sync(kBarBothConsumers, kGemmConsumerWarpgroups * 128);
    }
    if ((kPingPong || wg == 0) && tid == 0 && tile.valid) return Hook::after_tile_stored(hook_params, tile);
    return true;
}

/// Split-K, after a unit's mainloop (`num_splits`: the scheduler's, at most kCfg.splits): stores its fp32 partial tile
/// into the workspace (GemmArgs::partials, gemm_split_k_layout) and counts it in (GemmArgs::counters); true in the unit
/// that arrived last, which then holds in `acc` the sum of the tile's partials added in split order 0, 1, ... (its own
/// read back too): the same bits whichever unit arrives last. Called by every thread that holds the tile (both consumer
/// warpgroups, cooperative; one, ping-pong), each for its own slabs; no thread waits for another CTA (nothing to
/// bound).
template <GemmConfig kCfg>
__device__ __forceinline__ bool split_k_reduce(float (&acc)[GemmTraits<kCfg>::kSlabs][GemmTraits<kCfg>::kAccPerSlab],
                                               const GemmArgs& args, const GemmTile& tile, int32_t split,
                                               int32_t num_splits, int wg, int tid, int slab0) {
    using T = GemmTraits<kCfg>;
    constexpr int kQuads = T::kAccPerSlab / 4;
    constexpr int64_t kTileFloats = static_cast<int64_t>(kCfg.tile_m) * kCfg.tile_n;
    constexpr int kThreads = (kCfg.pingpong ? 1 : kGemmConsumerWarpgroups) * 128;
    const int bar = kCfg.pingpong ? kBarConsumer0 + wg : kBarBothConsumers;
    const int32_t num_n_tiles = (args.n + kCfg.tile_n - 1) / kCfg.tile_n;
    const int64_t tile_idx = static_cast<int64_t>(tile.m_idx) * num_n_tiles + tile.n_idx;
    // Inside a split's tile: [slab][quad of accumulators][128 threads] float4, so a warp's accesses are contiguous;
    // (s, q) is a constant offset from this thread's first float4 (immediate offsets, no address per element).
    float* const first =
        args.partials + tile_idx * kCfg.splits * kTileFloats + (static_cast<int64_t>(slab0 * kQuads) * 128 + tid) * 4;
    constexpr int kQuadStride = 128 * 4;  // floats between a thread's consecutive float4s
    float4* const mine = reinterpret_cast<float4*>(first + split * kTileFloats);
#pragma unroll
    for (int s = 0; s < T::kSlabs; ++s) {
#pragma unroll
        for (int q = 0; q < kQuads; ++q) {
            __stcg(mine + (s * kQuads + q) * (kQuadStride / 4),
                   make_float4(acc[s][4 * q], acc[s][4 * q + 1], acc[s][4 * q + 2], acc[s][4 * q + 3]));
        }
    }
    __threadfence();  // release this thread's partials at GPU scope before the tile's count includes them
    ptx::named_barrier_sync(bar, kThreads);
    bool last = false;
    if (tid == 0 && (kCfg.pingpong || wg == 0)) {
        last = atomicAdd(args.counters + tile_idx, 1u) == static_cast<uint32_t>(num_splits - 1);
        if (last) args.counters[tile_idx] = 0;  // every split has arrived: zero again for the next launch
    }
    last = ptx::named_barrier_sync_or(bar, kThreads, last);
    if (!last) return false;
    __threadfence();  // acquire: every other split's partials are visible
    // Chunks of quads in flight per split (one round trip to L2 per split and chunk): 16 (64 floats) beside up to 64
    // accumulators, fewer beside more (at 8 quads beside 128 accumulators ptxas spilled, CUDA 13.0).
    constexpr int kAccFloats = T::kSlabs * T::kAccPerSlab;
    constexpr int kChunk = kAccFloats <= 64 ? 16 : kAccFloats <= 96 ? 8 : 4;
    constexpr int kAllQuads = T::kSlabs * kQuads;
    const float4* const first4 = reinterpret_cast<const float4*>(first);
    constexpr int64_t kSplitStride4 = kTileFloats / 4;
#pragma unroll
    for (int c0 = 0; c0 < kAllQuads; c0 += kChunk) {
#pragma unroll
        for (int c = c0; c < (c0 + kChunk < kAllQuads ? c0 + kChunk : kAllQuads); ++c) {
            const float4 v = __ldcg(first4 + c * (kQuadStride / 4));
            float* const a = &acc[c / kQuads][4 * (c % kQuads)];
            a[0] = v.x;
            a[1] = v.y;
            a[2] = v.z;
            a[3] = v.w;
        }
#pragma unroll 1
        for (int32_t t = 1; t < num_splits; ++t) {
            const float4* const split_first = first4 + t * kSplitStride4;
#pragma unroll
            for (int c = c0; c < (c0 + kChunk < kAllQuads ? c0 + kChunk : kAllQuads); ++c) {
                const float4 v = __ldcg(split_first + c * (kQuadStride / 4));
                float* const a = &acc[c / kQuads][4 * (c % kQuads)];
                a[0] += v.x;
                a[1] += v.y;
                a[2] += v.z;
                a[3] += v.w;
            }
        }
    }
    return true;
}

}  // namespace detail
}  // namespace weft::kernels::gemm
