// SPDX-License-Identifier: MIT
// Unit tests for the symmetric heap's offset allocator, against a brute-force reference model.
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <random>
#include <vector>

#include "weft/detail/offset_allocator.hpp"
#include "weft/runtime/error.hpp"

namespace weft::detail {
namespace {

// The specification, computed the slow way: a byte map; allocate = lowest aligned offset starting a
// free run of `bytes`.
class ReferenceHeap {
public:
    explicit ReferenceHeap(uint64_t capacity) : used_(capacity, false) {}
    std::optional<uint64_t> allocate(uint64_t bytes, uint64_t align) {
        for (uint64_t a = 0; a + bytes <= used_.size(); a += align) {
            bool free = true;
            for (uint64_t i = a; i < a + bytes && free; ++i) free = !used_[i];
            if (!free) continue;
            for (uint64_t i = a; i < a + bytes; ++i) used_[i] = true;
            sizes_[a] = bytes;
            return a;
        }
        return std::nullopt;
    }
    void release(uint64_t offset) {
        for (uint64_t i = offset; i < offset + sizes_.at(offset); ++i) used_[i] = false;
        sizes_.erase(offset);
    }
    // Maximal free runs: what a fully coalesced free list must hold.
    std::map<uint64_t, uint64_t> free_runs() const {
        std::map<uint64_t, uint64_t> runs;
        uint64_t i = 0;
        while (i < used_.size()) {
            if (used_[i]) {
                ++i;
                continue;
            }
            uint64_t start = i;
            while (i < used_.size() && !used_[i]) ++i;
            runs[start] = i - start;
        }
        return runs;
    }
    uint64_t in_use() const {
        uint64_t n = 0;
        for (const auto& [o, s] : sizes_) n += s;
        return n;
    }
    const std::map<uint64_t, uint64_t>& live() const { return sizes_; }

private:
    std::vector<bool> used_;
    std::map<uint64_t, uint64_t> sizes_;
};

TEST(RuntimeOffsetAllocator, RandomSequencesMatchTheReferenceModel) {
    const uint32_t base_seed = std::random_device{}();
    for (int round = 0; round < 40; ++round) {
        const uint32_t seed = base_seed + static_cast<uint32_t>(round);
        SCOPED_TRACE("seed " + std::to_string(seed));
        std::mt19937 rng(seed);
        const uint64_t capacity = 1000 + rng() % 3000;  // not a power of two on purpose
        OffsetAllocator alloc(capacity);
        ReferenceHeap ref(capacity);
        for (int step = 0; step < 400; ++step) {
            const bool do_free = !ref.live().empty() && rng() % 100 < 40;
            if (do_free) {
                auto it = ref.live().begin();
                std::advance(it, static_cast<long>(rng() % ref.live().size()));
                const uint64_t offset = it->first;
                ASSERT_EQ(alloc.allocation_size(offset), it->second);
                alloc.release(offset);
                ref.release(offset);
            } else {
                const uint64_t bytes = 1 + rng() % (rng() % 4 == 0 ? 700 : 90);
                const uint64_t align = 1ull << (rng() % 9);
                auto got = alloc.allocate(bytes, align);
                auto want = ref.allocate(bytes, align);
                ASSERT_EQ(got, want) << "step " << step << ": allocate(" << bytes << ", " << align << ")";
                if (got) {
                    ASSERT_EQ(*got % align, 0u);
                }
            }
            ASSERT_EQ(alloc.free_blocks(), ref.free_runs()) << "step " << step << ": free list not coalesced";
            ASSERT_EQ(alloc.bytes_in_use(), ref.in_use());
            ASSERT_EQ(alloc.num_allocations(), ref.live().size());
        }
    }
}

TEST(RuntimeOffsetAllocator, CoalescesBackToOneBlockInAnyFreeOrder) {
    std::mt19937 rng(std::random_device{}());
    OffsetAllocator alloc(1 << 20);
    std::vector<uint64_t> offsets;
    for (int i = 0; i < 64; ++i) {
        auto o = alloc.allocate(1000 + static_cast<uint64_t>(i) * 37, 256);
        ASSERT_TRUE(o.has_value());
        offsets.push_back(*o);
    }
    std::shuffle(offsets.begin(), offsets.end(), rng);
    for (uint64_t o : offsets) alloc.release(o);
    ASSERT_EQ(alloc.num_free_blocks(), 1u);
    EXPECT_EQ(alloc.free_blocks().begin()->first, 0u);
    EXPECT_EQ(alloc.largest_free_block(), 1u << 20);
    EXPECT_EQ(alloc.bytes_in_use(), 0u);
}

TEST(RuntimeOffsetAllocator, AlignmentAndFirstFit) {
    OffsetAllocator alloc(4096);
    EXPECT_EQ(alloc.allocate(10, 1), 0u);
    EXPECT_EQ(alloc.allocate(10, 256), 256u);  // the gap [10, 256) stays free
    EXPECT_EQ(alloc.allocate(100, 2), 10u);    // first fit reuses the gap
    EXPECT_EQ(alloc.allocate(4096, 1), std::nullopt);
    alloc.release(0);
    EXPECT_EQ(alloc.allocate(10, 1), 0u);  // same call sequence, same offsets
}

TEST(RuntimeOffsetAllocator, ExhaustionLeavesStateUnchanged) {
    OffsetAllocator alloc(1024);
    ASSERT_EQ(alloc.allocate(1000, 8), 0u);
    auto before = alloc.free_blocks();
    EXPECT_EQ(alloc.allocate(25, 1), std::nullopt);
    EXPECT_EQ(alloc.allocate(24, 1), 1000u);
    EXPECT_EQ(alloc.allocate(1, 1), std::nullopt);
    EXPECT_EQ(alloc.bytes_in_use(), 1024u);
    EXPECT_NE(before, alloc.free_blocks());
    // Huge sizes and alignments fail cleanly instead of overflowing.
    OffsetAllocator big(1 << 20);
    ASSERT_EQ(big.allocate(1, 1), 0u);
    EXPECT_EQ(big.allocate(UINT64_MAX, 1), std::nullopt);
    EXPECT_EQ(big.allocate(1, 1ull << 63), std::nullopt);
    EXPECT_EQ(big.allocate(16, 1ull << 19), 1u << 19);
}

TEST(RuntimeOffsetAllocator, RejectsBadArguments) {
    OffsetAllocator alloc(1024);
    EXPECT_THROW(alloc.allocate(0, 8), Error);
    EXPECT_THROW(alloc.allocate(8, 0), Error);
    EXPECT_THROW(alloc.allocate(8, 24), Error);
    auto o = alloc.allocate(64, 64);
    ASSERT_TRUE(o.has_value());
    EXPECT_THROW(alloc.release(*o + 1), Error);  // not the start of an allocation
    alloc.release(*o);
    try {
        alloc.release(*o);  // double free
        FAIL() << "double release did not throw";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("not the start of a live allocation"), std::string::npos) << e.what();
    }
}

}  // namespace
}  // namespace weft::detail
