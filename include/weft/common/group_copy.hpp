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

/// Thread `rank` of a group of `size` threads copies its share of `bytes` bytes. Mem provides
/// `Vec` (x, y, z, w), `load16(const void*)`, `store16(void*, Vec)`, `load8(const void*)` (one byte)
/// and `store8(void*, uint8_t)`. No synchronisation: the caller syncs the group if it needs to.
template <class Mem>
WEFT_HOST_DEVICE void group_copy(uint32_t rank, uint32_t size, void* dst_ptr, const void* src_ptr, uint64_t bytes) {
    using Vec = typename Mem::Vec;
    auto* dst = static_cast<uint8_t*>(dst_ptr);
    const auto* src = static_cast<const uint8_t*>(src_ptr);
    const CopyPlan plan = CopyPlan::make(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src), bytes);

    for (uint64_t i = rank; i < plan.head_bytes; i += size) {
        Mem::store8(dst + i, Mem::load8(src + i));
    }
    uint8_t* body_dst = dst + plan.head_bytes;
    const uint8_t* body_src = src + plan.head_bytes;
    const uint64_t n = plan.num_granules;
    constexpr uint32_t kUnroll = 4;  // independent 16-byte loads in flight per thread
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
        for (; k + (kUnroll - 1) * uint64_t{size} < n; k += kUnroll * uint64_t{size}) {
            Vec lo[kUnroll];
            Vec hi[kUnroll];
            for (uint32_t u = 0; u < kUnroll; ++u) {
                const uint8_t* g = aligned_src + 16 * (k + u * uint64_t{size});
                lo[u] = Mem::load16(g);
                hi[u] = Mem::load16(g + 16);
            }
            for (uint32_t u = 0; u < kUnroll; ++u) {
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
