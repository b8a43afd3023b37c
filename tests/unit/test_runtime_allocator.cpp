// SPDX-License-Identifier: MIT
// Unit tests for the symmetric heap's offset allocator, against a brute-force reference model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
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

// The lowest aligned offset that is free in every byte map, the slow way.
std::optional<uint64_t> reference_common_fit(const std::vector<std::vector<bool>>& used, uint64_t capacity,
                                             uint64_t bytes, uint64_t align) {
    if (used.empty()) return std::nullopt;
    for (uint64_t a = 0; a + bytes <= capacity; a += align) {
        bool free = true;
        for (const auto& map : used) {
            for (uint64_t i = a; i < a + bytes && free; ++i) free = !map[i];
        }
        if (free) return a;
    }
    return std::nullopt;
}

std::vector<bool> byte_map(const OffsetAllocator& alloc) {
    std::vector<bool> used(alloc.capacity(), true);
    for (const auto& [offset, size] : alloc.free_blocks()) {
        for (uint64_t i = offset; i < offset + size; ++i) used[i] = false;
    }
    return used;
}

TEST(RuntimeOffsetAllocator, AllocateIsTheLowestFitOfItsOwnFreeListThenReserve) {
    const uint32_t seed = std::random_device{}();
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    OffsetAllocator first_fit(5000);
    OffsetAllocator by_reserve(5000);
    std::vector<uint64_t> live;
    for (int step = 0; step < 2000; ++step) {
        if (!live.empty() && rng() % 100 < 40) {
            const size_t k = rng() % live.size();
            first_fit.release(live[k]);
            by_reserve.release(live[k]);
            live.erase(live.begin() + static_cast<long>(k));
        } else {
            const uint64_t bytes = 1 + rng() % 300;
            const uint64_t align = 1ull << (rng() % 8);
            const auto want = first_fit.allocate(bytes, align);
            // Only blocks of `bytes` or more are posted, as the heap does.
            const auto got = lowest_common_fit({by_reserve.free_list(bytes)}, bytes, align);
            ASSERT_EQ(got, want) << "step " << step;
            if (got) {
                by_reserve.reserve(*got, bytes);
                live.push_back(*got);
            }
        }
        ASSERT_EQ(by_reserve.free_blocks(), first_fit.free_blocks()) << "step " << step;
        ASSERT_EQ(by_reserve.bytes_in_use(), first_fit.bytes_in_use());
    }
}

// Eight heaps; random teams (subsets) allocate together by posting free lists and reserving the agreed offset,
// and free together. Every result must be the lowest aligned offset free on every member (reference: byte maps),
// and non-members' heaps must not change.
TEST(RuntimeOffsetAllocator, TeamAllocationsAgreeOnTheLowestOffsetFreeOnEveryMember) {
    const uint32_t base_seed = std::random_device{}();
    for (int round = 0; round < 20; ++round) {
        const uint32_t seed = base_seed + static_cast<uint32_t>(round);
        SCOPED_TRACE("seed " + std::to_string(seed));
        std::mt19937 rng(seed);
        constexpr int kRanks = 8;
        const uint64_t capacity = 2000 + rng() % 2000;
        std::vector<OffsetAllocator> heaps(kRanks, OffsetAllocator(capacity));
        struct Live {
            uint64_t offset;
            std::vector<int> members;
        };
        std::vector<Live> live;
        for (int step = 0; step < 300; ++step) {
            if (!live.empty() && rng() % 100 < 35) {
                const size_t k = rng() % live.size();
                for (int m : live[k].members) heaps[static_cast<size_t>(m)].release(live[k].offset);
                live.erase(live.begin() + static_cast<long>(k));
                continue;
            }
            std::vector<int> members;
            if (rng() % 4 == 0) {
                for (int r = 0; r < kRanks; ++r) members.push_back(r);  // the world team
            } else {
                for (int r = 0; r < kRanks; ++r) {
                    if (rng() % 2 == 0) members.push_back(r);
                }
                if (members.empty()) members.push_back(static_cast<int>(rng() % kRanks));
            }
            const uint64_t bytes = 1 + rng() % (rng() % 5 == 0 ? 400 : 60);
            const uint64_t align = 1ull << (rng() % 7);
            std::vector<FreeBlocks> lists;
            std::vector<std::vector<bool>> maps;
            for (int m : members) {
                lists.push_back(heaps[static_cast<size_t>(m)].free_list(bytes));
                maps.push_back(byte_map(heaps[static_cast<size_t>(m)]));
            }
            const auto got = lowest_common_fit(lists, bytes, align);
            ASSERT_EQ(got, reference_common_fit(maps, capacity, bytes, align)) << "step " << step;
            if (!got) continue;
            std::vector<std::map<uint64_t, uint64_t>> before;
            for (const auto& h : heaps) before.push_back(h.free_blocks());
            for (int m : members) heaps[static_cast<size_t>(m)].reserve(*got, bytes);
            for (int r = 0; r < kRanks; ++r) {
                const bool member = std::find(members.begin(), members.end(), r) != members.end();
                if (!member) ASSERT_EQ(heaps[static_cast<size_t>(r)].free_blocks(), before[static_cast<size_t>(r)]);
            }
            live.push_back({*got, members});
        }
    }
}

TEST(RuntimeOffsetAllocator, LowestCommonFitCases) {
    // Two lists whose free blocks overlap only in [300, 400).
    const FreeBlocks a{{0, 100}, {200, 200}};
    const FreeBlocks b{{100, 50}, {300, 500}};
    EXPECT_EQ(lowest_common_fit({a, b}, 100, 1), 300u);
    EXPECT_EQ(lowest_common_fit({a, b}, 100, 256), std::nullopt);  // 256 is free in neither
    EXPECT_EQ(lowest_common_fit({a, b}, 64, 64), 320u);
    EXPECT_EQ(lowest_common_fit({a, b}, 101, 1), std::nullopt);
    EXPECT_EQ(lowest_common_fit({a}, 100, 1), 0u);
    EXPECT_EQ(lowest_common_fit({a, {}}, 1, 1), std::nullopt);
    EXPECT_EQ(lowest_common_fit({}, 1, 1), std::nullopt);
    // A block at the very top of the address range does not overflow.
    const FreeBlocks top{{UINT64_MAX - 1000, 1000}};
    EXPECT_EQ(lowest_common_fit({top}, 500, 256), (UINT64_MAX - 1000 + 255) / 256 * 256);
    EXPECT_EQ(lowest_common_fit({top}, 1000, 1ull << 63), std::nullopt);
    EXPECT_THROW(lowest_common_fit({a}, 0, 1), Error);
    EXPECT_THROW(lowest_common_fit({a}, 1, 3), Error);
    EXPECT_THROW(lowest_common_fit({FreeBlocks{{200, 10}, {100, 10}}}, 1, 1), Error);  // not sorted
    EXPECT_THROW(lowest_common_fit({FreeBlocks{{100, 20}, {110, 10}}}, 1, 1), Error);  // overlapping
    EXPECT_THROW(lowest_common_fit({FreeBlocks{{100, 0}}}, 1, 1), Error);              // empty block
}

TEST(RuntimeOffsetAllocator, ReserveTakesExactlyTheRangeOrNothing) {
    OffsetAllocator alloc(1024);
    alloc.reserve(100, 50);
    EXPECT_EQ(alloc.allocation_size(100), 50u);
    EXPECT_EQ(alloc.bytes_in_use(), 50u);
    EXPECT_EQ(alloc.free_blocks(), (std::map<uint64_t, uint64_t>{{0, 100}, {150, 874}}));
    const auto before = alloc.free_blocks();
    EXPECT_THROW(alloc.reserve(120, 10), Error);   // inside a live allocation
    EXPECT_THROW(alloc.reserve(90, 20), Error);    // straddles a free block and an allocation
    EXPECT_THROW(alloc.reserve(1000, 25), Error);  // past the end
    EXPECT_THROW(alloc.reserve(0, 0), Error);
    EXPECT_EQ(alloc.free_blocks(), before);
    alloc.reserve(0, 100);  // a whole block
    alloc.reserve(1023, 1);
    EXPECT_EQ(alloc.free_blocks(), (std::map<uint64_t, uint64_t>{{150, 873}}));
    alloc.release(100);
    alloc.release(0);
    alloc.release(1023);
    EXPECT_EQ(alloc.free_blocks(), (std::map<uint64_t, uint64_t>{{0, 1024}}));
    EXPECT_EQ(alloc.free_list(1000), (FreeBlocks{{0, 1024}}));
    EXPECT_TRUE(alloc.free_list(1025).empty());
}

}  // namespace
}  // namespace weft::detail
