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

}  // namespace weft::detail
