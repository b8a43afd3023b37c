// SPDX-License-Identifier: MIT
// The schedule of a copy shared by a group of threads: 16-byte accesses for any size and alignment.
//
// Host and device share this code so that the schedule is unit-tested on the CPU; the device layer
// (weft/device/copy.cuh) supplies the memory accesses. Thread `rank` of `size` threads copies:
//   head  bytes before `dst` reaches 16-byte alignment        one byte per thread per access
//   body  whole 16-byte granules of `dst`                      16 bytes per thread per access
//   tail  the last (bytes - head) % 16 bytes                   one byte per thread per access
// When `src` and `dst` are equally misaligned the body loads 16-byte granules of `src` directly. When
// they are not, every body store combines two aligned 16-byte loads of `src` (a funnel shift), so the
// stores are still 16-byte and aligned. NOTE: those loads read whole aligned granules that contain
// source bytes: up to 15 bytes just outside [src, src + bytes) are read (and discarded); a granule
// never crosses a page, so this never faults.
//
// A copy of at most kSmallCopyMaxBytes bytes (a flag, a header, a scalar put before a signal) takes
// small_copy instead: words of the widest size (16, 8, 4, 2 or 1 bytes) that divides both addresses and
// the size, word i to thread i % size, every load of a thread issued before its first store. A thread
// then waits for one load, where the byte loops above wait for one per byte (each store needs its load).
// It reads and writes exactly [src, src + bytes) and [dst, dst + bytes).
#pragma once

#include "weft/common/macros.hpp"

namespace weft::detail {

/// How a copy of `bytes` bytes to `dst` from `src` splits into head, 16-byte body and tail.
struct CopyPlan {
    uint64_t head_bytes;    ///< bytes copied one at a time before the body
    uint64_t num_granules;  ///< 16-byte stores of the body
    uint64_t tail_bytes;    ///< bytes copied one at a time after the body
    uint32_t src_shift;     ///< (src + head_bytes) % 16: 0 = direct 16-byte loads, else funnel-shifted

    WEFT_HOST_DEVICE static constexpr CopyPlan make(uintptr_t dst, uintptr_t src, uint64_t bytes) {
        uint64_t head = (16u - (dst & 15u)) & 15u;
        if (head > bytes) {
            head = bytes;
        }
        const uint64_t rest = bytes - head;
        return CopyPlan{head, rest / 16u, rest % 16u, static_cast<uint32_t>((src + head) & 15u)};
    }
};

/// The 16 bytes that start `shift` bytes (0..15) into `lo`, continuing into `hi` (`lo` and `hi` are
/// consecutive aligned 16-byte granules, little-endian words). V has members x, y, z, w (uint4).
template <class V>
WEFT_HOST_DEVICE constexpr V funnel16(const V& lo, const V& hi, uint32_t shift) {
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    const uint32_t q = shift >> 2;         // whole words to skip
    const uint32_t bits = (shift & 3u) * 8u;  // then bits within a word
    uint32_t out[4] = {0, 0, 0, 0};
    for (uint32_t j = 0; j < 4; ++j) {
        // Selects without a run-time-indexed register array (which would go to local memory).
        const uint32_t a = q == 0 ? w[j] : q == 1 ? w[j + 1] : q == 2 ? w[j + 2] : w[j + 3];
        const uint32_t b = q == 0 ? w[j + 1] : q == 1 ? w[j + 2] : q == 2 ? w[j + 3] : w[j + 4];
        const uint64_t pair = (static_cast<uint64_t>(b) << 32) | a;
        out[j] = static_cast<uint32_t>(pair >> bits);
    }
    V v{};
    v.x = out[0];
    v.y = out[1];
    v.z = out[2];
    v.w = out[3];
    return v;
}

/// Copies of at most this many bytes take small_copy.
inline constexpr uint64_t kSmallCopyMaxBytes = 16;

/// The word size of a small copy (bytes <= kSmallCopyMaxBytes): the widest of 16, 8, 4, 2 and 1 bytes
/// that divides `dst`, `src` and `bytes`.
WEFT_HOST_DEVICE constexpr uint32_t small_copy_width(uintptr_t dst, uintptr_t src, uint64_t bytes) {
    const uint64_t bits = static_cast<uint64_t>(dst | src) | bytes | 16u;
    return static_cast<uint32_t>(bits & (~bits + 1));  // the lowest set bit
}

/// Thread `rank` of `size` copies words rank, rank + size, ... of `num_words` words of type W: all its
/// loads, then all its stores (at most kSmallCopyMaxBytes / sizeof(W) of each, held in registers).
template <class Mem, class W>
WEFT_HOST_DEVICE void small_copy_words(uint32_t rank, uint32_t size, uint8_t* dst, const uint8_t* src,
                                       uint32_t num_words) {
    constexpr uint32_t kMaxWords = static_cast<uint32_t>(kSmallCopyMaxBytes / sizeof(W));
    W v[kMaxWords] = {};
    for (uint32_t k = 0; k < kMaxWords; ++k) {  // constant trip count: unrolled, v stays in registers
        const uint64_t i = rank + uint64_t{k} * size;
        if (i < num_words) {
            v[k] = Mem::template load_word<W>(src + i * sizeof(W));
        }
    }
    for (uint32_t k = 0; k < kMaxWords; ++k) {
        const uint64_t i = rank + uint64_t{k} * size;
        if (i < num_words) {
            Mem::template store_word<W>(dst + i * sizeof(W), v[k]);
        }
    }
}

/// Thread `rank` of `size` copies its share of a copy of at most kSmallCopyMaxBytes bytes (see the top
/// of this file).
template <class Mem>
WEFT_HOST_DEVICE void small_copy(uint32_t rank, uint32_t size, void* dst_ptr, const void* src_ptr, uint64_t bytes) {
    auto* dst = static_cast<uint8_t*>(dst_ptr);
    const auto* src = static_cast<const uint8_t*>(src_ptr);
    const uint32_t width = small_copy_width(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src), bytes);
    const auto num_words = static_cast<uint32_t>(bytes / width);
    switch (width) {
        case 16: small_copy_words<Mem, typename Mem::Vec>(rank, size, dst, src, num_words); break;
        case 8: small_copy_words<Mem, uint64_t>(rank, size, dst, src, num_words); break;
        case 4: small_copy_words<Mem, uint32_t>(rank, size, dst, src, num_words); break;
        case 2: small_copy_words<Mem, uint16_t>(rank, size, dst, src, num_words); break;
        default: small_copy_words<Mem, uint8_t>(rank, size, dst, src, num_words); break;
    }
}

/// Thread `rank` of a group of `size` threads copies its share of `bytes` bytes. Mem provides
/// `Vec` (x, y, z, w), `load16(const void*)`, `store16(void*, Vec)`, `load8(const void*)` (one byte),
/// `store8(void*, uint8_t)`, and for small_copy `load_word<W>(const void*)` / `store_word<W>(void*, W)`
/// (W: uint8_t, uint16_t, uint32_t, uint64_t or Vec; the address aligned to sizeof(W)). No
/// synchronisation: the caller syncs the group if it needs to.
template <class Mem>
WEFT_HOST_DEVICE void group_copy(uint32_t rank, uint32_t size, void* dst_ptr, const void* src_ptr, uint64_t bytes) {
    using Vec = typename Mem::Vec;
    if (bytes <= kSmallCopyMaxBytes) {  // a size known at compile time drops the other path
        small_copy<Mem>(rank, size, dst_ptr, src_ptr, bytes);
        return;
    }
    auto* dst = static_cast<uint8_t*>(dst_ptr);
    const auto* src = static_cast<const uint8_t*>(src_ptr);
    const CopyPlan plan = CopyPlan::make(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src), bytes);

    for (uint64_t i = rank; i < plan.head_bytes; i += size) {
        Mem::store8(dst + i, Mem::load8(src + i));
    }
    uint8_t* body_dst = dst + plan.head_bytes;
    const uint8_t* body_src = src + plan.head_bytes;
    const uint64_t n = plan.num_granules;
    // Eight independent 16-byte loads in flight per thread (the shifted path loads two per granule): with a block of
    // 256 threads per SM that is 32 KB, what one SM needs in flight to stream at its share of HBM bandwidth (four
    // reached about 0.8 of a device copy's bandwidth, eight about 0.92).
    constexpr uint32_t kUnroll = 8;
    uint64_t k = rank;
    if (plan.src_shift == 0) {
        for (; k + (kUnroll - 1) * uint64_t{size} < n; k += kUnroll * uint64_t{size}) {
            Vec v[kUnroll];
            for (uint32_t u = 0; u < kUnroll; ++u) {
                v[u] = Mem::load16(body_src + 16 * (k + u * uint64_t{size}));
            }
            for (uint32_t u = 0; u < kUnroll; ++u) {
                Mem::store16(body_dst + 16 * (k + u * uint64_t{size}), v[u]);
            }
        }
        for (; k < n; k += size) {
            Mem::store16(body_dst + 16 * k, Mem::load16(body_src + 16 * k));
        }
    } else {
        const uint8_t* aligned_src = body_src - plan.src_shift;
        constexpr uint32_t kShiftedUnroll = kUnroll / 2;  // two loads per granule: the same loads in flight
        for (; k + (kShiftedUnroll - 1) * uint64_t{size} < n; k += kShiftedUnroll * uint64_t{size}) {
            Vec lo[kShiftedUnroll];
            Vec hi[kShiftedUnroll];
            for (uint32_t u = 0; u < kShiftedUnroll; ++u) {
                const uint8_t* g = aligned_src + 16 * (k + u * uint64_t{size});
                lo[u] = Mem::load16(g);
                hi[u] = Mem::load16(g + 16);
            }
            for (uint32_t u = 0; u < kShiftedUnroll; ++u) {
                Mem::store16(body_dst + 16 * (k + u * uint64_t{size}), funnel16(lo[u], hi[u], plan.src_shift));
            }
        }
        for (; k < n; k += size) {
            const uint8_t* g = aligned_src + 16 * k;
            Mem::store16(body_dst + 16 * k, funnel16(Mem::load16(g), Mem::load16(g + 16), plan.src_shift));
        }
    }
    const uint64_t tail_begin = plan.head_bytes + 16 * n;
    for (uint64_t i = rank; i < plan.tail_bytes; i += size) {
        Mem::store8(dst + tail_begin + i, Mem::load8(src + tail_begin + i));
    }
}

}  // namespace weft::detail
