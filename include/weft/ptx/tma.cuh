// SPDX-License-Identifier: MIT
// TMA (sm_90 bulk tensor copies): 2D tile loads into shared memory completing on an mbarrier (optionally
// multicast to the CTAs of a cluster), 2D tile stores and reductions from shared memory, bulk-group
// commit/wait and tensor-map prefetch (the proxy fences they need are in ptx/fence.cuh); 1D bulk loads of
// contiguous bytes (no tensor map) completing on an mbarrier.
//
// Contract: a tensor map is a 128-byte, 64-byte-aligned CUtensorMap built on the host
// (cuTensorMapEncodeTiled) and passed to the kernel as a `const __grid_constant__` parameter; pass its
// address. Coordinates are in elements, innermost first; out-of-bounds parts of a load box are zero-filled
// (and still count towards the transaction bytes), out-of-bounds parts of a store box are not written,
// except that stores write whole 16-byte chunks: a chunk straddling the inner extent is written entirely
// (keep the stored extent a multiple of 16 bytes and write a ragged edge otherwise).
// Loads are issued by one thread. After a store, commit_group then wait_group<0> before anything else
// (another kernel, another GPU) may read the stored data; wait_group_read<N> only frees the shared source.
#pragma once

#include "weft/ptx/fence.cuh"  // fence_proxy_async_shared_cta / _global, which TMA users need

namespace weft::ptx {

/// Device-side view of a CUtensorMap (same size and alignment; NVRTC has no cuda.h).
struct alignas(64) TmaDescriptor {
    unsigned long long opaque[16];
};

/// Pulls the tensor map into the descriptor cache ahead of first use.
__device__ __forceinline__ void tma_prefetch_descriptor(const TmaDescriptor* desc) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(desc)) : "memory");
}

/// Loads the box at (c0, c1) into shared memory at `smem_dst` (shared-window address, 128-byte aligned,
/// 1024 for 128B swizzle); completion adds the box's bytes to the transaction count of barrier `bar`.
__device__ __forceinline__ void tma_load_2d(unsigned smem_dst, const TmaDescriptor* desc, unsigned bar, int c0,
                                            int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
        "[%2];\n" ::"r"(smem_dst),
        "l"(reinterpret_cast<unsigned long long>(desc)), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}

/// tma_load_2d with an L2 cache policy (l2_policy_evict_first / l2_policy_evict_last).
__device__ __forceinline__ void tma_load_2d_hint(unsigned smem_dst, const TmaDescriptor* desc, unsigned bar, int c0,
                                                 int c1, unsigned long long policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, "
        "{%3, %4}], [%2], %5;\n" ::"r"(smem_dst),
        "l"(reinterpret_cast<unsigned long long>(desc)), "r"(bar), "r"(c0), "r"(c1), "l"(policy)
        : "memory");
}

/// As tma_load_2d for a 3D tensor map: the box at (c0, c1, c2), innermost first.
__device__ __forceinline__ void tma_load_3d(unsigned smem_dst, const TmaDescriptor* desc, unsigned bar, int c0,
                                            int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
        "[%2];\n" ::"r"(smem_dst),
        "l"(reinterpret_cast<unsigned long long>(desc)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}

/// Copies `bytes` contiguous bytes from global memory at `src` into shared memory at `smem_dst` (1D bulk copy,
/// no tensor map); completion adds `bytes` to the transaction count of barrier `bar`. src, smem_dst and bytes
/// must be multiples of 16 (a destination that is not 128-byte aligned streams slower: weft_bench_stream).
__device__ __forceinline__ void bulk_load_1d(unsigned smem_dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_dst),
                 "l"(reinterpret_cast<unsigned long long>(src)), "r"(bytes), "r"(bar)
                 : "memory");
}

/// An L2 cache policy for the `.L2::cache_hint` forms (tma_load_2d_hint, bulk_load_1d_hint): lines a copy brings in
/// are evicted first (a stream read once), or last (data many CTAs read again, which a stream must not push out).
__device__ __forceinline__ unsigned long long l2_policy_evict_first() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
__device__ __forceinline__ unsigned long long l2_policy_evict_last() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}

/// bulk_load_1d with an L2 cache policy (l2_policy_evict_first / l2_policy_evict_last).
__device__ __forceinline__ void bulk_load_1d_hint(unsigned smem_dst, const void* src, unsigned bytes, unsigned bar,
                                                  unsigned long long policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(
            smem_dst),
        "l"(reinterpret_cast<unsigned long long>(src)), "r"(bytes), "r"(bar), "l"(policy)
        : "memory");
}

/// As tma_load_2d, but the box lands at the same shared offset in every CTA of the cluster named in
/// `cta_mask` (bit i = CTA rank i), and completes on the barrier at the same offset in each of them.
__device__ __forceinline__ void tma_load_2d_multicast(unsigned smem_dst, const TmaDescriptor* desc, unsigned bar,
                                                      int c0, int c1, unsigned short cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster "
        "[%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(smem_dst),
        "l"(reinterpret_cast<unsigned long long>(desc)), "r"(bar), "r"(c0), "r"(c1), "h"(cta_mask)
        : "memory");
}

/// Stores the box at (c0, c1) from shared memory at `smem_src`; part of the current bulk group.
__device__ __forceinline__ void tma_store_2d(const TmaDescriptor* desc, unsigned smem_src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                     reinterpret_cast<unsigned long long>(desc)),
                 "r"(smem_src), "r"(c0), "r"(c1)
                 : "memory");
}

/// Element-wise add of the shared box into global memory at (c0, c1) (atomic per element); bulk group.
__device__ __forceinline__ void tma_reduce_add_2d(const TmaDescriptor* desc, unsigned smem_src, int c0, int c1) {
    asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                     reinterpret_cast<unsigned long long>(desc)),
                 "r"(smem_src), "r"(c0), "r"(c1)
                 : "memory");
}

/// Closes the current bulk group (stores and reductions issued by this thread since the last commit).
__device__ __forceinline__ void tma_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

/// Waits until at most kPending bulk groups of this thread are incomplete: their writes are done and
/// visible (use before signalling that the data is ready).
template <int kPending>
__device__ __forceinline__ void tma_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

/// Waits until at most kPending bulk groups still read their shared-memory source (the source may then
/// be overwritten; the global writes may still be in flight).
template <int kPending>
__device__ __forceinline__ void tma_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace weft::ptx
