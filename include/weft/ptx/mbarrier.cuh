// SPDX-License-Identifier: MIT
// mbarrier (sm_90): shared-memory barriers with transaction counts, as used by TMA pipelines; plus the
// few cluster-scope helpers a multicast pipeline needs (CTA rank, cluster barrier, remote arrive).
//
// Contract: a barrier lives in shared memory, 8-byte aligned, initialised by one thread before any other
// thread uses it (then fence_mbarrier_init() and a CTA/cluster barrier). Phases alternate parity 0,1,0,...;
// a waiter names the parity of the phase it waits to see completed. Every wait here is bounded: the
// *_bounded functions return false after `timeout_ns` (measured with %globaltimer) and the caller decides
// how to report it.
#pragma once

#include "weft/ptx/timer.cuh"

namespace weft::ptx {

/// Shared-window (32-bit) address of a generic pointer into this CTA's shared memory.
__device__ __forceinline__ unsigned shared_address(const void* ptr) {
    return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}

/// Initialises the barrier at `bar` for `arrivals` arrivals per phase (one thread).
__device__ __forceinline__ void mbarrier_init(unsigned bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

/// Makes barrier initialisation visible to the async proxy and to other CTAs of the cluster.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

/// Named barrier `id` (1..15; 0 is __syncthreads) for `threads` threads of this CTA (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/// named_barrier_sync that also reduces a predicate: true in every participating thread when `pred` is true in all
/// of them (`bar.red.and.pred`; memory ordered among the threads as by bar.sync).
__device__ __forceinline__ bool named_barrier_sync_and(int id, int threads, bool pred) {
    unsigned all;
    asm volatile(
        "{\n"
        ".reg .pred p, q;\n"
        "setp.ne.u32 q, %1, 0;\n"
        "bar.red.and.pred p, %2, %3, q;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(all)
        : "r"(static_cast<unsigned>(pred)), "r"(id), "r"(threads)
        : "memory");
    return all != 0;
}

/// named_barrier_sync that also reduces a predicate: true in every participating thread when `pred` is true in any
/// of them (`bar.red.or.pred`; memory ordered among the threads as by bar.sync).
__device__ __forceinline__ bool named_barrier_sync_or(int id, int threads, bool pred) {
    unsigned any;
    asm volatile(
        "{\n"
        ".reg .pred p, q;\n"
        "setp.ne.u32 q, %1, 0;\n"
        "bar.red.or.pred p, %2, %3, q;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(any)
        : "r"(static_cast<unsigned>(pred)), "r"(id), "r"(threads)
        : "memory");
    return any != 0;
}

/// Arrives on named barrier `id` without waiting: the barrier completes once `threads` threads have arrived or
/// synced (the producer side of a named-barrier hand-off; the consumer side calls named_barrier_sync).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/// One arrival on a barrier of this CTA (release at CTA scope).
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

/// One arrival on the barrier at the same shared offset in CTA `cta_rank` of this cluster. `bar` is this
/// CTA's address of the barrier. Default semantics (release at CTA scope): enough to tell a producer that
/// this thread's reads of a stage (wgmma, ldmatrix) are done. NOTE: `.release.cluster` would add a
/// MEMBAR.ALL.GPU before every arrive (seen in SASS) and cost ~40% of a multicast GEMM.
__device__ __forceinline__ void mbarrier_arrive_cluster(unsigned bar, unsigned cta_rank) {
    asm volatile(
        "{\n.reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
        "r"(cta_rank)
        : "memory");
}

/// One arrival that also raises the phase's expected transaction count by `bytes` (the producer's call
/// before issuing TMA loads that complete on this barrier).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

/// Raises the expected transaction count without arriving.
__device__ __forceinline__ void mbarrier_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

/// True when the phase with parity `parity` has completed (acquire at CTA scope). May suspend the thread
/// for a hardware-chosen time before returning false.
__device__ __forceinline__ bool mbarrier_try_wait_parity(unsigned bar, unsigned parity) {
    unsigned done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

/// As above with acquire at cluster scope (for barriers that remote CTAs arrive on).
__device__ __forceinline__ bool mbarrier_try_wait_parity_cluster(unsigned bar, unsigned parity) {
    unsigned done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

/// Waits for the phase with parity `parity`; false when `timeout_ns` passed first. Fully inline (a call
/// in a wgmma mainloop would force the accumulators out of registers): try_wait first, the timer is read
/// only after 64 failed tries. `timeout_ns` is taken as given: 0 gives up within ~128 tries (unlike
/// DeviceCtx::timeout_ns, where 0 means the 10-minute default); pass a resolved bound.
template <bool kClusterScope = false>
__device__ __forceinline__ bool mbarrier_wait_parity_bounded(unsigned bar, unsigned parity,
                                                             unsigned long long timeout_ns) {
    unsigned long long start = 0;
    for (unsigned tries = 0;; ++tries) {
        if (kClusterScope ? mbarrier_try_wait_parity_cluster(bar, parity) : mbarrier_try_wait_parity(bar, parity)) {
            return true;
        }
        if ((tries & 63u) == 63u) {
            const unsigned long long now = globaltimer();
            if (start == 0) {
                start = now;
            } else if (now - start > timeout_ns) {
                return false;
            }
        }
    }
}

// ---- cluster helpers (NOTE: move to a ptx/cluster.cuh when the device layer grows one) ----

/// This CTA's rank in its cluster (0 when launched without clusters).
__device__ __forceinline__ unsigned cluster_cta_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %cluster_ctarank;\n" : "=r"(r));
    return r;
}

/// Number of CTAs in this cluster (1 when launched without clusters).
__device__ __forceinline__ unsigned cluster_num_ctas() {
    unsigned n;
    asm volatile("mov.u32 %0, %cluster_nctarank;\n" : "=r"(n));
    return n;
}

/// The shared::cluster address of the byte at `smem_addr` (a shared::cta address in this CTA) in CTA `cta_rank` of
/// this cluster: its distributed-shared-memory twin, for ld.shared::cluster.
__device__ __forceinline__ unsigned cluster_map_shared(unsigned smem_addr, unsigned cta_rank) {
    unsigned remote;
    asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr), "r"(cta_rank));
    return remote;
}

/// 16 bytes (four floats) of distributed shared memory at a shared::cluster address (cluster_map_shared), 16-byte
/// aligned. Ordered after the writer's stores by a cluster barrier (cluster_sync) between them.
__device__ __forceinline__ float4 ld_shared_cluster_v4f32(unsigned addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

/// Barrier over every thread of every CTA in the cluster (release on arrive, acquire on wait).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

}  // namespace weft::ptx
