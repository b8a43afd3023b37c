// SPDX-License-Identifier: MIT
// ld / st with an explicit PTX semantic and scope, for 16-bit, 32-bit, 64-bit and 16-byte (v4.b32, v2.b64) accesses.
//
//     uint64_t v = ptx::ld<Sem::kAcquire, Scope::kSys>(flag);
//     ptx::st<Sem::kRelease, Scope::kSys>(flag, v + 1);
//     uint4 q = ptx::ld(src4);                                  // weak (plain) 16-byte load
//
// Addresses are generic (global or shared). Every access is `asm volatile` with a "memory" clobber, so
// the compiler neither drops, merges nor moves memory accesses across it; the hardware ordering is the
// semantic's. Loads accept kWeak, kRelaxed, kAcquire, kVolatile; stores kWeak, kRelaxed, kRelease,
// kVolatile. The scope is ignored for kWeak and kVolatile. Never use `.nc` loads (`__ldg`) on memory
// another agent writes: nothing here emits them.
#pragma once

#include "weft/ptx/memory_order.cuh"

namespace weft::ptx {
namespace detail {

template <Sem S>
inline constexpr bool kIsLoadSem = S == Sem::kWeak || S == Sem::kRelaxed || S == Sem::kAcquire || S == Sem::kVolatile;
template <Sem S>
inline constexpr bool kIsStoreSem = S == Sem::kWeak || S == Sem::kRelaxed || S == Sem::kRelease || S == Sem::kVolatile;

template <Sem S, Scope C>
__device__ __forceinline__ uint16_t ld_b16(const void* p) {
    unsigned short v;
#define WEFT_EMIT(q) asm volatile("ld" q ".b16 %0, [%1];" : "=h"(v) : "l"(p) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
    return static_cast<uint16_t>(v);
}

template <Sem S, Scope C>
__device__ __forceinline__ uint32_t ld_b32(const void* p) {
    uint32_t v;
#define WEFT_EMIT(q) asm volatile("ld" q ".b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
    return v;
}

template <Sem S, Scope C>
__device__ __forceinline__ uint64_t ld_b64(const void* p) {
    uint64_t v;
#define WEFT_EMIT(q) asm volatile("ld" q ".b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
    return v;
}

template <Sem S, Scope C>
__device__ __forceinline__ uint4 ld_v4b32(const void* p) {
    uint4 v;
#define WEFT_EMIT(q)                                                                   \
    asm volatile("ld" q ".v4.b32 {%0, %1, %2, %3}, [%4];"                               \
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
    return v;
}

template <Sem S, Scope C>
__device__ __forceinline__ void st_b16(void* p, uint16_t v) {
#define WEFT_EMIT(q) asm volatile("st" q ".b16 [%0], %1;" ::"l"(p), "h"(static_cast<unsigned short>(v)) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
}

template <Sem S, Scope C>
__device__ __forceinline__ void st_b32(void* p, uint32_t v) {
#define WEFT_EMIT(q) asm volatile("st" q ".b32 [%0], %1;" ::"l"(p), "r"(v) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
}

template <Sem S, Scope C>
__device__ __forceinline__ void st_b64(void* p, uint64_t v) {
#define WEFT_EMIT(q) asm volatile("st" q ".b64 [%0], %1;" ::"l"(p), "l"(v) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
}

template <Sem S, Scope C>
__device__ __forceinline__ void st_v4b32(void* p, uint4 v) {
#define WEFT_EMIT(q)                                                                   \
    asm volatile("st" q ".v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), \
                 "r"(v.w)                                                              \
                 : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
}

template <Sem S, Scope C>
__device__ __forceinline__ ulonglong2 ld_v2b64(const void* p) {
    ulonglong2 v;
#define WEFT_EMIT(q) asm volatile("ld" q ".v2.b64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
    return v;
}

template <Sem S, Scope C>
__device__ __forceinline__ void st_v2b64(void* p, ulonglong2 v) {
#define WEFT_EMIT(q) asm volatile("st" q ".v2.b64 [%0], {%1, %2};" ::"l"(p), "l"(v.x), "l"(v.y) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
}

}  // namespace detail

/// Loads two 8-byte words with one 16-byte access (`ld<sem>.v2.b64`; `p` 16-byte aligned). PTX models a vector
/// access as one access per element: each 8-byte word is single-copy atomic on its own, the pair is not (the
/// LL protocol, weft/device/ll.cuh, relies on exactly this). Semantics as for ld().
template <Sem S = Sem::kWeak, Scope C = Scope::kGpu>
__device__ __forceinline__ ulonglong2 ld_pair_b64(const void* p) {
    static_assert(detail::kIsLoadSem<S>, "ld_pair_b64: semantic must be kWeak, kRelaxed, kAcquire or kVolatile");
    return detail::ld_v2b64<S, C>(p);
}

/// Stores two 8-byte words with one 16-byte access (`st<sem>.v2.b64`; `p` 16-byte aligned); each word is
/// single-copy atomic on its own. Semantics as for st().
template <Sem S = Sem::kWeak, Scope C = Scope::kGpu>
__device__ __forceinline__ void st_pair_b64(void* p, ulonglong2 v) {
    static_assert(detail::kIsStoreSem<S>, "st_pair_b64: semantic must be kWeak, kRelaxed, kRelease or kVolatile");
    detail::st_v2b64<S, C>(p, v);
}

/// Loads one 2-, 4-, 8- or 16-byte value (any trivially copyable T of that size, e.g. uint16_t, uint32_t,
/// int64_t, float, double, uint4) with semantic S at scope C. `p` must be aligned to sizeof(T).
template <Sem S = Sem::kWeak, Scope C = Scope::kGpu, class T>
__device__ __forceinline__ T ld(const T* p) {
    static_assert(detail::kIsLoadSem<S>, "ld: semantic must be kWeak, kRelaxed, kAcquire or kVolatile");
    static_assert(sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16,
                  "ld: 2-, 4-, 8- or 16-byte values only");
    if constexpr (sizeof(T) == 2) {
        return __builtin_bit_cast(T, detail::ld_b16<S, C>(p));
    } else if constexpr (sizeof(T) == 4) {
        return __builtin_bit_cast(T, detail::ld_b32<S, C>(p));
    } else if constexpr (sizeof(T) == 8) {
        return __builtin_bit_cast(T, detail::ld_b64<S, C>(p));
    } else {
        return __builtin_bit_cast(T, detail::ld_v4b32<S, C>(p));
    }
}

/// Stores one 2-, 4-, 8- or 16-byte value with semantic S at scope C. `p` must be aligned to sizeof(T).
template <Sem S = Sem::kWeak, Scope C = Scope::kGpu, class T>
__device__ __forceinline__ void st(T* p, NoDeduce<T> value) {
    static_assert(detail::kIsStoreSem<S>, "st: semantic must be kWeak, kRelaxed, kRelease or kVolatile");
    static_assert(sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16,
                  "st: 2-, 4-, 8- or 16-byte values only");
    if constexpr (sizeof(T) == 2) {
        detail::st_b16<S, C>(p, __builtin_bit_cast(uint16_t, value));
    } else if constexpr (sizeof(T) == 4) {
        detail::st_b32<S, C>(p, __builtin_bit_cast(uint32_t, value));
    } else if constexpr (sizeof(T) == 8) {
        detail::st_b64<S, C>(p, __builtin_bit_cast(uint64_t, value));
    } else {
        detail::st_v4b32<S, C>(p, __builtin_bit_cast(uint4, value));
    }
}

/// A plain 4-, 8- or 16-byte store / load (any trivially copyable T of that size) at a shared::cta address
/// (ptx::shared_address): one 32-bit register for the address where a generic pointer takes two; `addr` aligned to
/// sizeof(T). Ordered by what orders plain accesses (an mbarrier's arrive and wait, a barrier).
template <class T>
__device__ __forceinline__ void st_shared(unsigned addr, T value) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16, "st_shared: 4-, 8- or 16-byte values only");
    if constexpr (sizeof(T) == 4) {
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(__builtin_bit_cast(uint32_t, value)) : "memory");
    } else if constexpr (sizeof(T) == 8) {
        asm volatile("st.shared.b64 [%0], %1;" ::"r"(addr), "l"(__builtin_bit_cast(uint64_t, value)) : "memory");
    } else {
        const uint4 v = __builtin_bit_cast(uint4, value);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                     : "memory");
    }
}
template <class T>
__device__ __forceinline__ T ld_shared(unsigned addr) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16, "ld_shared: 4-, 8- or 16-byte values only");
    if constexpr (sizeof(T) == 4) {
        uint32_t v;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
        return __builtin_bit_cast(T, v);
    } else if constexpr (sizeof(T) == 8) {
        uint64_t v;
        asm volatile("ld.shared.b64 %0, [%1];" : "=l"(v) : "r"(addr) : "memory");
        return __builtin_bit_cast(T, v);
    } else {
        uint4 v;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(addr)
                     : "memory");
        return __builtin_bit_cast(T, v);
    }
}

}  // namespace weft::ptx
