// SPDX-License-Identifier: MIT
// Memory fences: fence.acq_rel / fence.sc at cta, gpu or sys scope, and the async-proxy fences TMA needs.
//
//     ptx::fence<Sem::kAcqRel, Scope::kSys>();   // release/acquire pattern with relaxed accesses
//     ptx::fence_proxy_async_global();            // generic-proxy writes seen, now TMA-load them
#pragma once

#include "weft/ptx/memory_order.cuh"

namespace weft::ptx {

/// `fence.acq_rel.<scope>` (S = kAcqRel) or `fence.sc.<scope>` (S = kSc). A relaxed store after an
/// acq_rel fence forms a release pattern; a relaxed load before one forms an acquire pattern.
/// fence.sc additionally orders all sc fences of the scope in one total order (what `__threadfence*`
/// compile to).
template <Sem S = Sem::kAcqRel, Scope C = Scope::kGpu>
__device__ __forceinline__ void fence() {
    static_assert(S == Sem::kAcqRel || S == Sem::kSc, "fence: semantic must be kAcqRel or kSc");
    if constexpr (S == Sem::kAcqRel && C == Scope::kCta) {
        asm volatile("fence.acq_rel.cta;" ::: "memory");
    } else if constexpr (S == Sem::kAcqRel && C == Scope::kGpu) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    } else if constexpr (S == Sem::kAcqRel && C == Scope::kSys) {
        asm volatile("fence.acq_rel.sys;" ::: "memory");
    } else if constexpr (S == Sem::kSc && C == Scope::kCta) {
        asm volatile("fence.sc.cta;" ::: "memory");
    } else if constexpr (S == Sem::kSc && C == Scope::kGpu) {
        asm volatile("fence.sc.gpu;" ::: "memory");
    } else {
        asm volatile("fence.sc.sys;" ::: "memory");
    }
}

/// `fence.proxy.async.global`: orders this thread's generic-proxy view of global memory with the async
/// proxy (TMA, cp.async.bulk). Issue it after acquiring data other agents wrote and before a TMA load
/// of that data, and after generic stores to global memory that a TMA operation will read.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

/// `fence.proxy.async.shared::cta`: after `st.shared`/`stmatrix` into a buffer a TMA store will read.
__device__ __forceinline__ void fence_proxy_async_shared_cta() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/// `fence.proxy.async`: both of the above, for every state space.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async;" ::: "memory"); }

}  // namespace weft::ptx
