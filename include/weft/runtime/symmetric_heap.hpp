// SPDX-License-Identifier: MIT
// SymmetricHeap: one same-sized device heap per rank; collective allocations land at the same offset everywhere.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace weft {

class SymmetricHeap;
class Team;
namespace detail {
struct HeapImpl;
struct HeapSetup;
std::unique_ptr<SymmetricHeap> make_symmetric_heap(const HeapSetup& setup);
}  // namespace detail

/// Every rank maps a heap of bytes() bytes (WEFT_SYMMETRIC_HEAP_BYTES, default 1 GiB, rounded up to the
/// VMM granularity) and maps its host's peers' heaps, so that the object at offset o of this heap is at
/// offset o of every peer's heap. Owned by the World; one per rank.
///
/// Collectives (alloc, alloc_array, alloc_signals, free): every rank of the world calls them, with the
/// same arguments, in the same order. Each call first compares its arguments across ranks through the
/// store; a mismatch throws weft::Error on every rank, naming the ranks and what each asked for (the
/// heap stays consistent and usable). A missing rank is a weft::Error after the world's timeout.
/// Not thread-safe: a rank issues its collectives from one thread at a time.
///
/// Team collectives (the overloads taking a Team): the same, over the team's members only, in the same order
/// on each member (a sequence per team); non-members take no part and their heaps do not change. The members
/// agree on the lowest aligned offset that is free on every one of them (each posts its free list), so the
/// object lives at the same offset on every member; a non-member may later hold something else there, which is
/// fine since it never maps the team's objects. With the world team they are the world collectives above
/// (world allocations, too, pick the lowest offset free on every rank: plain first fit while every rank has
/// made the same calls). Errors name world ranks. Memory is freed with the team that allocated it.
class SymmetricHeap {
public:
    ~SymmetricHeap();
    SymmetricHeap(const SymmetricHeap&) = delete;
    SymmetricHeap& operator=(const SymmetricHeap&) = delete;

    /// Collective. `bytes` > 0; `align` a power of two, at most granularity(). The memory is NOT zeroed
    /// (it may hold a freed allocation's data). Throws weft::Error when the heap has no room, naming the
    /// heap size and WEFT_SYMMETRIC_HEAP_BYTES.
    void* alloc(uint64_t bytes, uint64_t align = 256);
    /// Collective. `ptr` must be a live allocation of this heap (the value alloc returned, with the world team).
    void free(void* ptr);
    /// count elements of T (a count whose bytes pass 2^64 asks for the most bytes there are: a no-room error).
    template <class T>
    T* alloc_array(uint64_t count) {
        return static_cast<T*>(alloc(array_bytes<T>(count), alignof(T) < 256 ? 256 : alignof(T)));
    }
    template <class T>
    static uint64_t array_bytes(uint64_t count) {
        return count > UINT64_MAX / sizeof(T) ? UINT64_MAX : count * sizeof(T);
    }
    /// Collective: `count` 64-bit signal words, zeroed on every rank before it returns on any rank (it ends
    /// with a barrier), so a peer's first notify can never be overwritten by the zeroing.
    uint64_t* alloc_signals(uint64_t count);

    /// Team collective (see above): alloc, free, alloc_array and alloc_signals over `team`'s members. Throws
    /// weft::Error on this rank when it is not a member of `team` or `team` belongs to another World; free
    /// throws when the allocation was made by another team.
    void* alloc(const Team& team, uint64_t bytes, uint64_t align = 256);
    void free(const Team& team, void* ptr);
    template <class T>
    T* alloc_array(const Team& team, uint64_t count) {
        return static_cast<T*>(alloc(team, array_bytes<T>(count), alignof(T) < 256 ? 256 : alignof(T)));
    }
    /// Zeroed on every member before it returns on any member (it ends with a barrier of the team).
    uint64_t* alloc_signals(const Team& team, uint64_t count);

    /// True when [ptr, ptr + bytes) lies inside this rank's heap.
    bool contains(const void* ptr, uint64_t bytes = 1) const;
    /// The address, mapped in this process, of the object at `local_ptr` on (world) `rank`'s heap; nullptr when
    /// that peer is not load/store reachable from here (another host, or no peer access). Throws
    /// weft::Error when `local_ptr` is not in this heap or `rank` is out of range.
    void* symm_at(const void* local_ptr, int rank) const;
    template <class T>
    T* symm_at(T* local_ptr, int rank) const {
        return static_cast<T*>(symm_at(static_cast<const void*>(local_ptr), rank));
    }

    uint8_t* base() const;
    uint64_t bytes() const;
    /// Offset of `ptr` in the heap; throws weft::Error when it is outside.
    uint64_t offset_of(const void* ptr) const;
    /// VMM granularity the heap is built from (the largest alignment alloc accepts).
    uint64_t granularity() const;
    uint64_t bytes_in_use() const;
    /// Host table: world rank -> that rank's heap base mapped here (own base at rank()), or nullptr.
    const std::vector<uint8_t*>& peer_bases() const;
    int rank() const;
    int num_ranks() const;

private:
    friend std::unique_ptr<SymmetricHeap> detail::make_symmetric_heap(const detail::HeapSetup& setup);
    explicit SymmetricHeap(std::unique_ptr<detail::HeapImpl> impl);
    std::unique_ptr<detail::HeapImpl> impl_;
};

}  // namespace weft
