// SPDX-License-Identifier: MIT
// Reduce-scatter (sum) kernel: every rank pulls its slice from every rank's source and reduces it in fp32, once.
//
// Launched by weft::ops::reduce_scatter (src/ops/reduce_scatter.cpp) through the JIT, one specialisation per
// ReduceKernelConfig. Schedule and pitfalls: README.md here; shared protocol: kernels/common/collective.cuh.
#pragma once

#include "common/collective.cuh"

namespace weft::kernels::reduce_scatter {

using collective::BlockState;
using collective::Num;

/// SM pull: the input is num_ranks slices of p.count elements, slice q at element q * p.in_stride; rank q's output
/// is the sum of every rank's slice q. Block b: copy part b of every slice into this epoch's staging half (when
/// asked; there slice q starts at q * p.src_stride = q * p.count); meet block b of every rank; read part b of slice
/// `rank` from every rank's source, add in rank order in fp32, write `out` once; meet again only when peers read a
/// user buffer (kCollectiveExitBarrier).
template <ReduceKernelConfig C>
__global__ void __launch_bounds__(C.block_threads, collective_min_blocks_per_sm(C.block_threads))
    reduce_scatter_pull(DeviceCtx ctx, CollectiveParams p) {
    static_assert(is_valid(C), "ReduceKernelConfig: see is_valid() in weft/common/collectives.hpp");
    constexpr uint64_t kElem = sizeof(typename Num<C.dtype>::Bits);
    __shared__ const uint8_t* srcs[C.max_ranks];
    BlockState st(ctx, p);
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    const Span part = split_span(p.count, gridDim.x, blockIdx.x, kCollectiveGranuleBytes / kElem);
    uint8_t* src = p.src != nullptr ? static_cast<uint8_t*>(p.src) : st.staging();
    if ((p.flags & kCollectiveStageInput) != 0) {
        for (int q = 0; q < n; ++q) {
            device::copy(device::Block{}, src + (q * p.src_stride + part.begin) * kElem,
                         static_cast<const uint8_t*>(p.in) + (q * p.in_stride + part.begin) * kElem,
                         part.size() * kElem);
        }
    }
    st.enter();
    collective::peer_pointers(ctx, srcs, src, static_cast<uint64_t>(me) * p.src_stride * kElem);
    collective::reduce_elements<C.dtype, C.vec_bytes, C.max_ranks>(srcs, n, part.begin, part.end,
                                                                   static_cast<uint8_t*>(p.out), nullptr);
    if ((p.flags & kCollectiveExitBarrier) != 0) {
        st.barrier();
    }
    st.finish();
}

}  // namespace weft::kernels::reduce_scatter
