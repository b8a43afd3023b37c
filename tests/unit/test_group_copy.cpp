// SPDX-License-Identifier: MIT
// Unit tests for the group copy schedule (weft/common/group_copy.hpp), run on the CPU with a model of
// the device's memory accesses that checks alignment, bounds and that every byte is written once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "weft/common/group_copy.hpp"

namespace weft {
namespace {

struct Vec {
    uint32_t x, y, z, w;
};

// Memory model of one copy: the source and destination arenas, and what the schedule touched.
struct Arena {
    std::vector<uint8_t> src, dst;
    std::vector<int> writes;           // per dst byte
    uintptr_t src_begin = 0, src_end = 0;  // the bytes being copied (absolute addresses)
    uintptr_t dst_begin = 0, dst_end = 0;
    int word_loads = 0, word_stores = 0;  // small_copy's accesses (load_word / store_word)
    int max_word_loads_per_rank = 0;      // the most word loads one rank made
    int rank_word_loads = 0;              // ... by the rank being run
    bool rank_stored = false;             // the rank being run has stored a word
    int errors = 0;
    std::string first_error;
    void error(const std::string& what) {
        if (errors++ == 0) {
            first_error = what;
        }
    }
};
thread_local Arena* g_arena = nullptr;

struct HostMem {
    using Vec = weft::Vec;
    static Vec load16(const void* p) {
        const auto a = reinterpret_cast<uintptr_t>(p);
        Arena& ar = *g_arena;
        if (a % 16 != 0) {
            ar.error("unaligned 16-byte load");
        }
        // The granule must contain at least one source byte (so it cannot fault on the device).
        if (a + 16 <= ar.src_begin || a >= ar.src_end) {
            ar.error("16-byte load of a granule without source bytes");
        }
        const auto arena_begin = reinterpret_cast<uintptr_t>(ar.src.data());
        if (a < arena_begin || a + 16 > arena_begin + ar.src.size()) {
            ar.error("16-byte load outside the arena");
            return Vec{0, 0, 0, 0};
        }
        Vec v;
        std::memcpy(&v, p, 16);
        return v;
    }
    static void store16(void* p, Vec v) {
        const auto a = reinterpret_cast<uintptr_t>(p);
        Arena& ar = *g_arena;
        if (a % 16 != 0) {
            ar.error("unaligned 16-byte store");
        }
        if (a < ar.dst_begin || a + 16 > ar.dst_end) {
            ar.error("16-byte store outside the destination");
            return;
        }
        std::memcpy(p, &v, 16);
        for (uintptr_t i = 0; i < 16; ++i) {
            ++ar.writes[a + i - ar.dst_begin];
        }
    }
    static uint8_t load8(const void* p) {
        const auto a = reinterpret_cast<uintptr_t>(p);
        Arena& ar = *g_arena;
        if (a < ar.src_begin || a >= ar.src_end) {
            ar.error("byte load outside the source");
            return 0;
        }
        return *static_cast<const uint8_t*>(p);
    }
    static void store8(void* p, uint8_t v) {
        const auto a = reinterpret_cast<uintptr_t>(p);
        Arena& ar = *g_arena;
        if (a < ar.dst_begin || a >= ar.dst_end) {
            ar.error("byte store outside the destination");
            return;
        }
        *static_cast<uint8_t*>(p) = v;
        ++ar.writes[a - ar.dst_begin];
    }
};

// One word of a small copy: aligned to its size, wholly inside the source (or destination), and every
// load of a rank before its first store.
struct HostWordMem : HostMem {
    template <class W>
    static W load_word(const void* p) {
        const auto a = reinterpret_cast<uintptr_t>(p);
        Arena& ar = *g_arena;
        ++ar.word_loads;
        ++ar.rank_word_loads;
        if (a % sizeof(W) != 0) {
            ar.error("unaligned " + std::to_string(sizeof(W)) + "-byte word load");
        }
        if (ar.rank_stored) {
            ar.error("a word load after a word store of the same rank");
        }
        if (a < ar.src_begin || a + sizeof(W) > ar.src_end) {
            ar.error("word load outside the source");
            return W{};
        }
        W v;
        std::memcpy(&v, p, sizeof(W));
        return v;
    }
    template <class W>
    static void store_word(void* p, W v) {
        const auto a = reinterpret_cast<uintptr_t>(p);
        Arena& ar = *g_arena;
        ++ar.word_stores;
        ar.rank_stored = true;
        if (a % sizeof(W) != 0) {
            ar.error("unaligned " + std::to_string(sizeof(W)) + "-byte word store");
        }
        if (a < ar.dst_begin || a + sizeof(W) > ar.dst_end) {
            ar.error("word store outside the destination");
            return;
        }
        std::memcpy(p, &v, sizeof(W));
        for (uintptr_t i = 0; i < sizeof(W); ++i) {
            ++ar.writes[a + i - ar.dst_begin];
        }
    }
};

// Copies with every rank of a simulated group in turn and checks the result byte by byte.
void check_copy(uint64_t bytes, uint32_t src_off, uint32_t dst_off, uint32_t group, std::mt19937& rng) {
    Arena ar;
    const size_t arena = bytes + 64;
    // 16-byte aligned arenas (std::vector of uint8_t is at least 16-aligned on this platform via new).
    ar.src.resize(arena);
    ar.dst.resize(arena, 0xA5);
    for (auto& b : ar.src) {
        b = static_cast<uint8_t>(rng());
    }
    ASSERT_EQ(reinterpret_cast<uintptr_t>(ar.src.data()) % 16, 0u);
    ASSERT_EQ(reinterpret_cast<uintptr_t>(ar.dst.data()) % 16, 0u);
    uint8_t* dst = ar.dst.data() + 16 + dst_off;
    const uint8_t* src = ar.src.data() + 16 + src_off;
    ar.src_begin = reinterpret_cast<uintptr_t>(src);
    ar.src_end = ar.src_begin + bytes;
    ar.dst_begin = reinterpret_cast<uintptr_t>(dst);
    ar.dst_end = ar.dst_begin + bytes;
    ar.writes.assign(bytes + 16, 0);
    g_arena = &ar;
    for (uint32_t rank = 0; rank < group; ++rank) {
        ar.rank_word_loads = 0;
        ar.rank_stored = false;
        detail::group_copy<HostWordMem>(rank, group, dst, src, bytes);
        ar.max_word_loads_per_rank = std::max(ar.max_word_loads_per_rank, ar.rank_word_loads);
    }
    g_arena = nullptr;
    ASSERT_EQ(ar.errors, 0) << ar.first_error << " (bytes=" << bytes << " src_off=" << src_off
                            << " dst_off=" << dst_off << " group=" << group << ")";
    for (uint64_t i = 0; i < bytes; ++i) {
        ASSERT_EQ(ar.writes[i], 1) << "byte " << i << " written " << ar.writes[i] << " times (bytes=" << bytes
                                   << " src_off=" << src_off << " dst_off=" << dst_off << " group=" << group << ")";
        ASSERT_EQ(dst[i], src[i]) << "byte " << i << " (bytes=" << bytes << " src_off=" << src_off
                                  << " dst_off=" << dst_off << " group=" << group << ")";
    }
    // Poison around the destination is untouched.
    for (uint8_t* p = ar.dst.data(); p < dst; ++p) {
        ASSERT_EQ(*p, 0xA5) << "byte before the destination overwritten";
    }
    for (uint8_t* p = dst + bytes; p < ar.dst.data() + arena; ++p) {
        ASSERT_EQ(*p, 0xA5) << "byte after the destination overwritten";
    }
    // Small copies: one load and one store per word of the widest size that divides both addresses and the
    // size, shared round-robin (a rank of a group at least as large as the word count makes one access).
    const std::string what = " (bytes=" + std::to_string(bytes) + " src_off=" + std::to_string(src_off) +
                             " dst_off=" + std::to_string(dst_off) + " group=" + std::to_string(group) + ")";
    if (bytes > detail::kSmallCopyMaxBytes) {
        ASSERT_EQ(ar.word_loads + ar.word_stores, 0) << "a copy over 16 bytes took the small path" << what;
        return;
    }
    uint64_t width = 16;
    while ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) % width != 0) {
        width /= 2;
    }
    const auto words = static_cast<int>(bytes / width);
    ASSERT_EQ(ar.word_loads, words) << "word loads of width " << width << what;
    ASSERT_EQ(ar.word_stores, words) << "word stores of width " << width << what;
    ASSERT_EQ(ar.max_word_loads_per_rank, (words + static_cast<int>(group) - 1) / static_cast<int>(group)) << what;
}

TEST(GroupCopy, EverySizeAndAlignmentSmall) {
    std::mt19937 rng(std::random_device{}());
    for (uint64_t bytes = 0; bytes <= 70; ++bytes) {
        for (uint32_t so = 0; so < 16; ++so) {
            for (uint32_t d = 0; d < 16; ++d) {
                for (uint32_t group : {1u, 3u, 32u}) {
                    check_copy(bytes, so, d, group, rng);
                    if (HasFatalFailure()) {
                        return;
                    }
                }
            }
        }
    }
}

TEST(GroupCopy, LargerSizesEveryRelativeShift) {
    std::mt19937 rng(std::random_device{}());
    for (uint64_t bytes : {255ull, 256ull, 1000ull, 4097ull, 20011ull}) {
        for (uint32_t so = 0; so < 16; ++so) {
            for (uint32_t d : {0u, 1u, 7u, 8u, 15u}) {
                for (uint32_t group : {1u, 2u, 33u, 128u, 1024u}) {
                    check_copy(bytes, so, d, group, rng);
                    if (HasFatalFailure()) {
                        return;
                    }
                }
            }
        }
    }
}

TEST(GroupCopy, SmallCopyWidthIsTheWidestCommonAlignment) {
    static_assert(detail::small_copy_width(0x1000, 0x2040, 16) == 16);
    static_assert(detail::small_copy_width(0x1000, 0x2040, 8) == 8);
    static_assert(detail::small_copy_width(0x1008, 0x2040, 16) == 8);
    static_assert(detail::small_copy_width(0x1004, 0x2040, 12) == 4);
    static_assert(detail::small_copy_width(0x1002, 0x2046, 6) == 2);
    static_assert(detail::small_copy_width(0x1000, 0x2040, 3) == 1);
    static_assert(detail::small_copy_width(0x1001, 0x2040, 8) == 1);
    static_assert(detail::small_copy_width(0x1000, 0x2003, 4) == 1);
    static_assert(detail::small_copy_width(0x1000, 0x2000, 1) == 1);
    static_assert(detail::small_copy_width(0x1000, 0x2000, 0) == 16);  // nothing to copy: no word at all
    SUCCEED();
}

TEST(GroupCopy, PlanSplitsHeadBodyTail) {
    constexpr auto p = detail::CopyPlan::make(0x1003, 0x2005, 100);
    static_assert(p.head_bytes == 13 && p.num_granules == 5 && p.tail_bytes == 7 && p.src_shift == 2);
    constexpr auto q = detail::CopyPlan::make(0x1003, 0x2003, 5);
    static_assert(q.head_bytes == 5 && q.num_granules == 0 && q.tail_bytes == 0);
    EXPECT_EQ(p.head_bytes + 16 * p.num_granules + p.tail_bytes, 100u);
}

TEST(GroupCopy, FunnelShiftTakesTheRightBytes) {
    Vec lo{0x03020100u, 0x07060504u, 0x0b0a0908u, 0x0f0e0d0cu};
    Vec hi{0x13121110u, 0x17161514u, 0x1b1a1918u, 0x1f1e1d1cu};
    for (uint32_t s = 0; s < 16; ++s) {
        const Vec v = detail::funnel16(lo, hi, s);
        uint8_t out[16];
        std::memcpy(out, &v, 16);
        for (uint32_t i = 0; i < 16; ++i) {
            ASSERT_EQ(out[i], s + i) << "shift " << s << " byte " << i;
        }
    }
}

}  // namespace
}  // namespace weft
