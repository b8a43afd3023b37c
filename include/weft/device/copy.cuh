// SPDX-License-Identifier: MIT
// copy(group, dst, src, bytes): the group's threads copy bytes with 16-byte accesses where alignment allows.
#pragma once

#include "weft/common/group_copy.hpp"
#include "weft/device/scope.cuh"
#include "weft/ptx/ld_st.cuh"

namespace weft::device {
namespace detail {

/// Plain (weak) generic-address accesses: the data path of puts and gets. Ordering against signals
/// comes from the release/acquire operations around the copy, never from the copy itself.
struct WeakMem {
    using Vec = uint4;
    __device__ __forceinline__ static uint4 load16(const void* p) { return ptx::ld(static_cast<const uint4*>(p)); }
    __device__ __forceinline__ static void store16(void* p, uint4 v) { ptx::st(static_cast<uint4*>(p), v); }
    __device__ __forceinline__ static uint8_t load8(const void* p) { return *static_cast<const volatile uint8_t*>(p); }
    __device__ __forceinline__ static void store8(void* p, uint8_t v) { *static_cast<volatile uint8_t*>(p) = v; }
    /// One 1-, 2-, 4-, 8- or 16-byte word (group_copy's small copies); `p` aligned to sizeof(W).
    template <class W>
    __device__ __forceinline__ static W load_word(const void* p) {
        if constexpr (sizeof(W) == 1) {
            return load8(p);
        } else {
            return ptx::ld(static_cast<const W*>(p));
        }
    }
    template <class W>
    __device__ __forceinline__ static void store_word(void* p, W v) {
        if constexpr (sizeof(W) == 1) {
            store8(p, v);
        } else {
            ptx::st(static_cast<W*>(p), v);
        }
    }
};

}  // namespace detail

/// Every thread of `g` calls with the same arguments; together they copy `bytes` bytes from `src` to
/// `dst` (any sizes and alignments; the ranges must not overlap). Returns without synchronising the
/// group: a thread's own part is done when it returns, the others' after `g.sync()`. Copies of at most
/// 16 bytes take one access per word of the widest size the addresses and size allow, every load of a
/// thread before its first store (weft/common/group_copy.hpp: small_copy).
template <class Group>
__device__ __forceinline__ void copy(Group g, void* dst, const void* src, uint64_t bytes) {
    weft::detail::group_copy<detail::WeakMem>(g.rank(), g.size(), dst, src, bytes);
}

}  // namespace weft::device
