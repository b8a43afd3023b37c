// SPDX-License-Identifier: MIT
// MoE routing to the gathered layout: from a top-k index list [tokens, topk] to per-expert row counts and offsets, the
// token of each gathered row and the gathered row of each slot. Two launches, no atomics on the result: every expert's
// rows are in (token, k) order, the same on every rank and every run.
//
//   moe_routing_count_kernel<0>   grid E,     block kMoeThreads: counts[e] (and the record of a bad index)
//   moe_routing_place_kernel<0>   grid E + 1, block kMoeThreads: offsets, gather_index, slot_rows
#pragma once

#include "weft/common/moe_tp_params.hpp"

namespace weft::kernels::moe_tp {

using weft::moe::kMoeThreads;
using weft::moe::MoeRoutingArgs;

namespace detail {

/// The expert of slot `i`, -1 for a dropped slot (-1, or an index outside [0, E)).
__device__ __forceinline__ int32_t slot_expert(const MoeRoutingArgs& a, int32_t i) {
    const int32_t e = a.topk_idx[i];
    return e >= 0 && e < a.num_experts ? e : -1;
}

__device__ __forceinline__ int32_t round_up_rows(int32_t rows, int32_t align) {
    return (rows + align - 1) / align * align;
}

/// Sum of `v` over the block (every thread gets it). `scratch`: kMoeThreads / 32 ints of shared memory.
__device__ __forceinline__ int32_t block_sum(int32_t v, int32_t* scratch) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    int32_t total = 0;
    for (int w = 0; w < kMoeThreads / 32; ++w) total += scratch[w];
    return total;
}

}  // namespace detail

/// Block e counts the slots routed to expert e; block 0 also records the first bad index (outside [-1, E)).
template <int kUnused>
__global__ void __launch_bounds__(kMoeThreads) moe_routing_count_kernel(const MoeRoutingArgs a) {
    __shared__ int32_t scratch[kMoeThreads / 32];
    const int32_t e = static_cast<int32_t>(blockIdx.x);
    const int32_t slots = a.tokens * a.topk;
    int32_t mine = 0;
    for (int32_t i = static_cast<int32_t>(threadIdx.x); i < slots; i += kMoeThreads) {
        const int32_t raw = a.topk_idx[i];
        mine += detail::slot_expert(a, i) == e ? 1 : 0;
        if (e == 0 && a.status != nullptr && (raw < -1 || raw >= a.num_experts)) {
            if (atomicCAS(&a.status->code, 0, -1) == 0) {
                a.status->slot = i;
                a.status->value = raw;
                a.status->limit = a.num_experts;
                __threadfence_system();
                atomicExch(&a.status->code, 1);
            }
        }
    }
    const int32_t total = detail::block_sum(mine, scratch);
    if (threadIdx.x == 0) a.counts[e] = total;
}

/// Block e < E: offsets[e] (the padded counts of the experts before it), then its slots' rows in slot order (a
/// block-wide exclusive scan per 256 slots), then its padding rows -1. Block E: offsets[E], the rows past it -1, and
/// slot_rows -1 for every dropped slot.
template <int kUnused>
__global__ void __launch_bounds__(kMoeThreads) moe_routing_place_kernel(const MoeRoutingArgs a) {
    __shared__ int32_t scratch[kMoeThreads / 32];
    __shared__ int32_t warp_prefix[kMoeThreads / 32];
    const int32_t e = static_cast<int32_t>(blockIdx.x);
    const int32_t tid = static_cast<int32_t>(threadIdx.x);
    const int32_t lane = tid % 32, warp = tid / 32;
    int32_t offset = 0;
    for (int32_t j = 0; j < e; ++j) offset += detail::round_up_rows(a.counts[j], a.align);
    const int32_t slots = a.tokens * a.topk;
    if (e == a.num_experts) {
        if (tid == 0) a.offsets[e] = offset;
        for (int32_t r = offset + tid; r < a.rows_capacity; r += kMoeThreads) a.gather_index[r] = -1;
        for (int32_t i = tid; i < slots; i += kMoeThreads) {
            if (detail::slot_expert(a, i) < 0) a.slot_rows[i] = -1;
        }
        return;
    }
    if (tid == 0) a.offsets[e] = offset;
    int32_t placed = 0;  // rows of expert e placed so far (the same in every thread)
    for (int32_t base = 0; base < slots; base += kMoeThreads) {
        const int32_t i = base + tid;
        const bool hit = i < slots && detail::slot_expert(a, i) == e;
        const unsigned ballot = __ballot_sync(0xffffffffu, hit);
        __syncthreads();  // the previous round's readers of warp_prefix are done
        if (lane == 0) warp_prefix[warp] = __popc(ballot);
        __syncthreads();
        int32_t before = placed;
        for (int w = 0; w < warp; ++w) before += warp_prefix[w];
        before += __popc(ballot & ((1u << lane) - 1u));
        if (hit) {
            const int32_t row = offset + before;
            a.gather_index[row] = i / a.topk;
            a.slot_rows[i] = row;
        }
        for (int w = 0; w < kMoeThreads / 32; ++w) placed += warp_prefix[w];
    }
    const int32_t count = a.counts[e];
    for (int32_t r = offset + count + tid; r < offset + detail::round_up_rows(count, a.align); r += kMoeThreads) {
        a.gather_index[r] = -1;
    }
    (void)scratch;
}

}  // namespace weft::kernels::moe_tp
