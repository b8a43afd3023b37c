// SPDX-License-Identifier: MIT
// The two qualifiers of every synchronising PTX memory instruction: its semantic and its scope.
#pragma once

#include "weft/common/macros.hpp"

namespace weft::ptx {

/// Which threads an operation synchronises with (PTX `.cta`, `.gpu`, `.sys`). Threads on different
/// GPUs, and the host, synchronise only at `kSys`; threads of one GPU at `kGpu` or wider.
enum class Scope : int { kCta = 0, kGpu = 1, kSys = 2 };

/// The memory-ordering semantic (PTX `.weak`, `.relaxed`, `.acquire`, `.release`, `.acq_rel`, `.sc`,
/// `.volatile`). Each instruction family accepts the subset PTX allows and rejects the rest at compile
/// time. `kWeak` is a plain access (no ordering, not for words another agent writes concurrently);
/// `kVolatile` is PTX's `.volatile` (relaxed at system scope, kept for legacy protocols).
enum class Sem : int { kWeak = 0, kRelaxed = 1, kAcquire = 2, kRelease = 3, kAcqRel = 4, kSc = 5, kVolatile = 6 };

namespace detail {
template <class T>
struct TypeIdentity {
    using type = T;
};
}  // namespace detail

/// A parameter of this type does not take part in template argument deduction: the pointer decides T,
/// so `st(p, 1ull)` works whether uint64_t is `unsigned long` (g++, nvcc) or `unsigned long long` (NVRTC).
template <class T>
using NoDeduce = typename detail::TypeIdentity<T>::type;

/// Stops the compiler (not the hardware) from moving memory accesses across this point.
__device__ __forceinline__ void compiler_barrier() { asm volatile("" ::: "memory"); }

}  // namespace weft::ptx

// Expands EMIT(q) for a (semantic, scope) pair with q the PTX qualifier string (".relaxed.gpu", ...).
// Shared by ld_st.cuh and atom.cuh; the caller restricts which semantics are legal with static_assert.
#define WEFT_PTX_DISPATCH_SEM_SCOPE(S, C, EMIT)                                                     \
    if constexpr ((S) == ::weft::ptx::Sem::kWeak) {                                                 \
        EMIT("");                                                                                   \
    } else if constexpr ((S) == ::weft::ptx::Sem::kVolatile) {                                      \
        EMIT(".volatile");                                                                          \
    } else if constexpr ((S) == ::weft::ptx::Sem::kRelaxed && (C) == ::weft::ptx::Scope::kCta) {    \
        EMIT(".relaxed.cta");                                                                       \
    } else if constexpr ((S) == ::weft::ptx::Sem::kRelaxed && (C) == ::weft::ptx::Scope::kGpu) {    \
        EMIT(".relaxed.gpu");                                                                       \
    } else if constexpr ((S) == ::weft::ptx::Sem::kRelaxed && (C) == ::weft::ptx::Scope::kSys) {    \
        EMIT(".relaxed.sys");                                                                       \
    } else if constexpr ((S) == ::weft::ptx::Sem::kAcquire && (C) == ::weft::ptx::Scope::kCta) {    \
        EMIT(".acquire.cta");                                                                       \
    } else if constexpr ((S) == ::weft::ptx::Sem::kAcquire && (C) == ::weft::ptx::Scope::kGpu) {    \
        EMIT(".acquire.gpu");                                                                       \
    } else if constexpr ((S) == ::weft::ptx::Sem::kAcquire && (C) == ::weft::ptx::Scope::kSys) {    \
        EMIT(".acquire.sys");                                                                       \
    } else if constexpr ((S) == ::weft::ptx::Sem::kRelease && (C) == ::weft::ptx::Scope::kCta) {    \
        EMIT(".release.cta");                                                                       \
    } else if constexpr ((S) == ::weft::ptx::Sem::kRelease && (C) == ::weft::ptx::Scope::kGpu) {    \
        EMIT(".release.gpu");                                                                       \
    } else if constexpr ((S) == ::weft::ptx::Sem::kRelease && (C) == ::weft::ptx::Scope::kSys) {    \
        EMIT(".release.sys");                                                                       \
    } else if constexpr ((S) == ::weft::ptx::Sem::kAcqRel && (C) == ::weft::ptx::Scope::kCta) {     \
        EMIT(".acq_rel.cta");                                                                       \
    } else if constexpr ((S) == ::weft::ptx::Sem::kAcqRel && (C) == ::weft::ptx::Scope::kGpu) {     \
        EMIT(".acq_rel.gpu");                                                                       \
    } else if constexpr ((S) == ::weft::ptx::Sem::kAcqRel && (C) == ::weft::ptx::Scope::kSys) {     \
        EMIT(".acq_rel.sys");                                                                       \
    }
