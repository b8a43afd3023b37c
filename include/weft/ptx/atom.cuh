// SPDX-License-Identifier: MIT
// atom / red (add, cas, exch) on 32- and 64-bit words with an explicit PTX semantic and scope.
//
//     uint64_t old = ptx::atom_add<Sem::kAcqRel, Scope::kSys>(counter, 1ull);
//     ptx::red_add<Sem::kRelease, Scope::kSys>(signal, 1ull);   // no return value: cheaper
//
// atom accepts kRelaxed, kAcquire, kRelease, kAcqRel; red accepts kRelaxed and kRelease (a `red` never
// forms an acquire: wait with ld.acquire instead). T is any 4- or 8-byte integer (add wraps in two's
// complement, so signed and unsigned add agree); cas and exch also take any 4- or 8-byte value.
// Addresses are generic; every call is `asm volatile` with a "memory" clobber.
#pragma once

#include "weft/ptx/memory_order.cuh"

namespace weft::ptx {
namespace detail {

template <Sem S>
inline constexpr bool kIsAtomSem = S == Sem::kRelaxed || S == Sem::kAcquire || S == Sem::kRelease || S == Sem::kAcqRel;
template <Sem S>
inline constexpr bool kIsRedSem = S == Sem::kRelaxed || S == Sem::kRelease;

template <Sem S, Scope C>
__device__ __forceinline__ uint32_t atom_add_u32(void* p, uint32_t v) {
    uint32_t old;
#define WEFT_EMIT(q) asm volatile("atom" q ".add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
    return old;
}

template <Sem S, Scope C>
__device__ __forceinline__ uint64_t atom_add_u64(void* p, uint64_t v) {
    uint64_t old;
#define WEFT_EMIT(q) asm volatile("atom" q ".add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
    return old;
}

template <Sem S, Scope C>
__device__ __forceinline__ void red_add_u32(void* p, uint32_t v) {
#define WEFT_EMIT(q) asm volatile("red" q ".add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
}

template <Sem S, Scope C>
__device__ __forceinline__ void red_add_u64(void* p, uint64_t v) {
#define WEFT_EMIT(q) asm volatile("red" q ".add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
}

template <Sem S, Scope C>
__device__ __forceinline__ uint32_t atom_cas_b32(void* p, uint32_t expected, uint32_t desired) {
    uint32_t old;
#define WEFT_EMIT(q) \
    asm volatile("atom" q ".cas.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(expected), "r"(desired) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
    return old;
}

template <Sem S, Scope C>
__device__ __forceinline__ uint64_t atom_cas_b64(void* p, uint64_t expected, uint64_t desired) {
    uint64_t old;
#define WEFT_EMIT(q) \
    asm volatile("atom" q ".cas.b64 %0, [%1], %2, %3;" : "=l"(old) : "l"(p), "l"(expected), "l"(desired) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
    return old;
}

template <Sem S, Scope C>
__device__ __forceinline__ uint32_t atom_exch_b32(void* p, uint32_t v) {
    uint32_t old;
#define WEFT_EMIT(q) asm volatile("atom" q ".exch.b32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
    return old;
}

template <Sem S, Scope C>
__device__ __forceinline__ uint64_t atom_exch_b64(void* p, uint64_t v) {
    uint64_t old;
#define WEFT_EMIT(q) asm volatile("atom" q ".exch.b64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory")
    WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, WEFT_EMIT)
#undef WEFT_EMIT
    return old;
}

template <class T>
inline constexpr bool kIsAtomInt = (sizeof(T) == 4 || sizeof(T) == 8) && static_cast<T>(-1) != static_cast<T>(0) &&
                                   static_cast<T>(3) / static_cast<T>(2) == static_cast<T>(1);

}  // namespace detail

/// Atomically adds `value` to `*p`; returns the previous value.
template <Sem S = Sem::kRelaxed, Scope C = Scope::kGpu, class T>
__device__ __forceinline__ T atom_add(T* p, NoDeduce<T> value) {
    static_assert(detail::kIsAtomSem<S>, "atom_add: semantic must be kRelaxed, kAcquire, kRelease or kAcqRel");
    static_assert(detail::kIsAtomInt<T>, "atom_add: T must be a 4- or 8-byte integer");
    if constexpr (sizeof(T) == 4) {
        return static_cast<T>(detail::atom_add_u32<S, C>(p, static_cast<uint32_t>(value)));
    } else {
        return static_cast<T>(detail::atom_add_u64<S, C>(p, static_cast<uint64_t>(value)));
    }
}

/// Atomically adds `value` to `*p` without returning the old value.
template <Sem S = Sem::kRelaxed, Scope C = Scope::kGpu, class T>
__device__ __forceinline__ void red_add(T* p, NoDeduce<T> value) {
    static_assert(detail::kIsRedSem<S>, "red_add: semantic must be kRelaxed or kRelease (red never acquires)");
    static_assert(detail::kIsAtomInt<T>, "red_add: T must be a 4- or 8-byte integer");
    if constexpr (sizeof(T) == 4) {
        detail::red_add_u32<S, C>(p, static_cast<uint32_t>(value));
    } else {
        detail::red_add_u64<S, C>(p, static_cast<uint64_t>(value));
    }
}

/// Compare-and-swap: if `*p == expected` stores `desired`. Returns the previous value either way.
template <Sem S = Sem::kRelaxed, Scope C = Scope::kGpu, class T>
__device__ __forceinline__ T atom_cas(T* p, NoDeduce<T> expected, NoDeduce<T> desired) {
    static_assert(detail::kIsAtomSem<S>, "atom_cas: semantic must be kRelaxed, kAcquire, kRelease or kAcqRel");
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atom_cas: 4- or 8-byte values only");
    if constexpr (sizeof(T) == 4) {
        return __builtin_bit_cast(T, detail::atom_cas_b32<S, C>(p, __builtin_bit_cast(uint32_t, expected),
                                                                __builtin_bit_cast(uint32_t, desired)));
    } else {
        return __builtin_bit_cast(T, detail::atom_cas_b64<S, C>(p, __builtin_bit_cast(uint64_t, expected),
                                                                __builtin_bit_cast(uint64_t, desired)));
    }
}

/// Atomically replaces `*p` with `value`; returns the previous value.
template <Sem S = Sem::kRelaxed, Scope C = Scope::kGpu, class T>
__device__ __forceinline__ T atom_exch(T* p, NoDeduce<T> value) {
    static_assert(detail::kIsAtomSem<S>, "atom_exch: semantic must be kRelaxed, kAcquire, kRelease or kAcqRel");
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atom_exch: 4- or 8-byte values only");
    if constexpr (sizeof(T) == 4) {
        return __builtin_bit_cast(T, detail::atom_exch_b32<S, C>(p, __builtin_bit_cast(uint32_t, value)));
    } else {
        return __builtin_bit_cast(T, detail::atom_exch_b64<S, C>(p, __builtin_bit_cast(uint64_t, value)));
    }
}

}  // namespace weft::ptx
