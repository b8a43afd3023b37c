// SPDX-License-Identifier: MIT
// First-fit offset allocator with coalescing (see include/weft/detail/offset_allocator.hpp).
#include "weft/detail/offset_allocator.hpp"

#include <algorithm>

#include "weft/runtime/error.hpp"

namespace weft::detail {

OffsetAllocator::OffsetAllocator(uint64_t capacity) : capacity_(capacity) {
    if (capacity > 0) free_.emplace(0, capacity);
}

std::optional<uint64_t> OffsetAllocator::allocate(uint64_t bytes, uint64_t align) {
    WEFT_CHECK(bytes > 0, "allocation size must be positive, got 0 bytes");
    WEFT_CHECK(align > 0 && (align & (align - 1)) == 0, "alignment must be a power of two, got " << align);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
        const uint64_t start = it->first;
        const uint64_t end = start + it->second;
        const uint64_t pad = (align - start % align) % align;
        if (pad > end - start || end - start - pad < bytes) continue;  // written so nothing overflows
        const uint64_t aligned = start + pad;
        free_.erase(it);
        if (aligned > start) free_.emplace(start, aligned - start);
        if (aligned + bytes < end) free_.emplace(aligned + bytes, end - aligned - bytes);
        used_.emplace(aligned, bytes);
        bytes_in_use_ += bytes;
        return aligned;
    }
    return std::nullopt;
}

void OffsetAllocator::reserve(uint64_t offset, uint64_t bytes) {
    WEFT_CHECK(bytes > 0, "reserve: the size must be positive, got 0 bytes");
    auto it = free_.upper_bound(offset);  // the block that could hold `offset` starts at or before it
    WEFT_CHECK(it != free_.begin(), "reserve: offset " << offset << " is not in a free block");
    --it;
    const uint64_t start = it->first;
    const uint64_t end = start + it->second;
    WEFT_CHECK(offset < end && bytes <= end - offset, "reserve: [" << offset << ", +" << bytes
                                                                   << ") is not inside one free block (the block at "
                                                                   << start << " holds " << it->second << " bytes)");
    free_.erase(it);
    if (offset > start) free_.emplace(start, offset - start);
    if (offset + bytes < end) free_.emplace(offset + bytes, end - offset - bytes);
    used_.emplace(offset, bytes);
    bytes_in_use_ += bytes;
}

FreeBlocks OffsetAllocator::free_list(uint64_t min_bytes) const {
    FreeBlocks list;
    for (const auto& [offset, size] : free_) {
        if (size >= min_bytes) list.emplace_back(offset, size);
    }
    return list;
}

void OffsetAllocator::release(uint64_t offset) {
    auto used = used_.find(offset);
    WEFT_CHECK(used != used_.end(), "offset " << offset << " is not the start of a live allocation");
    uint64_t start = used->first;
    uint64_t size = used->second;
    used_.erase(used);
    bytes_in_use_ -= size;
    // Coalesce with the free block that ends at `start` and the one that begins at `start + size`.
    auto next = free_.lower_bound(start);
    if (next != free_.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == start) {
            start = prev->first;
            size += prev->second;
            free_.erase(prev);
        }
    }
    if (next != free_.end() && next->first == start + size) {
        size += next->second;
        free_.erase(next);
    }
    free_.emplace(start, size);
}

std::optional<uint64_t> OffsetAllocator::allocation_size(uint64_t offset) const {
    auto it = used_.find(offset);
    if (it == used_.end()) return std::nullopt;
    return it->second;
}

uint64_t OffsetAllocator::largest_free_block() const {
    uint64_t best = 0;
    for (const auto& [offset, size] : free_) best = std::max(best, size);
    return best;
}

namespace {

// The lowest multiple of `align` at or above `from` that starts `bytes` free bytes in `list`, or nullopt.
std::optional<uint64_t> next_fit(const FreeBlocks& list, uint64_t from, uint64_t bytes, uint64_t align) {
    // The first block that ends after `from`; blocks are sorted and disjoint, so their ends are sorted too.
    auto it = std::upper_bound(list.begin(), list.end(), from,
                               [](uint64_t value, const auto& block) { return value < block.first + block.second; });
    for (; it != list.end(); ++it) {
        const uint64_t start = std::max(from, it->first);
        const uint64_t end = it->first + it->second;
        const uint64_t pad = (align - start % align) % align;
        if (pad > end - start || end - start - pad < bytes) continue;  // written so nothing overflows
        return start + pad;
    }
    return std::nullopt;
}

}  // namespace

std::optional<uint64_t> lowest_common_fit(const std::vector<FreeBlocks>& lists, uint64_t bytes, uint64_t align) {
    WEFT_CHECK(bytes > 0, "allocation size must be positive, got 0 bytes");
    WEFT_CHECK(align > 0 && (align & (align - 1)) == 0, "alignment must be a power of two, got " << align);
    for (size_t l = 0; l < lists.size(); ++l) {
        uint64_t previous_end = 0;
        for (size_t i = 0; i < lists[l].size(); ++i) {
            const auto [offset, size] = lists[l][i];
            WEFT_CHECK(size > 0 && offset <= UINT64_MAX - size && (i == 0 || offset >= previous_end),
                       "free list " << l << ": block " << i << " [" << offset << ", +" << size
                                    << ") is empty, overflows, or is not after the block before it");
            previous_end = offset + size;
        }
    }
    if (lists.empty()) return std::nullopt;
    // A fixed point: raise the candidate to each list's next fit until one pass changes nothing. The candidate
    // only grows, and each raise passes at least one block of some list, so this ends.
    uint64_t candidate = 0;
    for (;;) {
        bool changed = false;
        for (const FreeBlocks& list : lists) {
            const auto fit = next_fit(list, candidate, bytes, align);
            if (!fit) return std::nullopt;
            if (*fit != candidate) {
                candidate = *fit;
                changed = true;
            }
        }
        if (!changed) return candidate;
    }
}

}  // namespace weft::detail
