// SPDX-License-Identifier: MIT
// OffsetAllocator: the deterministic first-fit allocator behind the symmetric heap (pure; no CUDA).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace weft::detail {

/// A free list: (offset, size) of free blocks, sorted by offset, non-overlapping.
using FreeBlocks = std::vector<std::pair<uint64_t, uint64_t>>;

/// Hands out offsets in [0, capacity). First fit over a free list kept sorted by offset; freed blocks
/// coalesce with their neighbours, so the free list always holds maximal free intervals.
///
/// NOTE: the result depends only on the sequence of calls, never on addresses or timing: every rank
/// that replays the same sequence gets the same offsets. That is what makes the heap symmetric.
/// Equivalent specification (used by the tests): `allocate` returns the lowest offset that is a
/// multiple of `align` and starts a free run of at least `bytes`.
class OffsetAllocator {
public:
    explicit OffsetAllocator(uint64_t capacity);

    /// The lowest aligned offset with `bytes` free, or nullopt when none fits (the state is then
    /// unchanged). Throws weft::Error when `bytes` is 0 or `align` is not a power of two.
    std::optional<uint64_t> allocate(uint64_t bytes, uint64_t align);
    /// Marks [offset, offset + bytes) used, as an allocation that starts at `offset` (release frees it). Throws
    /// weft::Error, leaving the state unchanged, when `bytes` is 0 or the range is not inside one free block.
    /// allocate(bytes, align) is lowest_common_fit({free_list()}, bytes, align) followed by reserve.
    void reserve(uint64_t offset, uint64_t bytes);
    /// Returns the block that starts at `offset`. Throws weft::Error when no live allocation starts there.
    void release(uint64_t offset);

    /// Size of the live allocation that starts at `offset`, or nullopt.
    std::optional<uint64_t> allocation_size(uint64_t offset) const;
    uint64_t capacity() const { return capacity_; }
    uint64_t bytes_in_use() const { return bytes_in_use_; }
    uint64_t largest_free_block() const;
    size_t num_free_blocks() const { return free_.size(); }
    size_t num_allocations() const { return used_.size(); }
    /// Free blocks (offset -> size), sorted by offset; for tests and diagnostics.
    const std::map<uint64_t, uint64_t>& free_blocks() const { return free_; }
    /// The free blocks of at least `min_bytes` (the only ones an allocation of that size can use), by offset.
    FreeBlocks free_list(uint64_t min_bytes = 1) const;

private:
    uint64_t capacity_;
    uint64_t bytes_in_use_ = 0;
    std::map<uint64_t, uint64_t> free_;  // offset -> size, maximal intervals
    std::map<uint64_t, uint64_t> used_;  // offset -> size
};

/// The lowest offset that is a multiple of `align` and starts `bytes` free bytes in every one of `lists` (each
/// sorted by offset, blocks not overlapping), or nullopt when there is none (or `lists` is empty). The
/// symmetric heap's team allocation: each member posts its free list and all reserve the same result.
/// Throws weft::Error when `bytes` is 0, `align` is not a power of two, or a list is not sorted and disjoint.
std::optional<uint64_t> lowest_common_fit(const std::vector<FreeBlocks>& lists, uint64_t bytes, uint64_t align);

}  // namespace weft::detail
