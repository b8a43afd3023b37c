// SPDX-License-Identifier: MIT
// Thread groups that perform a device operation together: Thread, Warp, Block.
//
// Every weft device call that can be shared by several threads takes the group as its first argument
// (`shmem::putmem(Block{}, ctx, ...)`). The contract is OpenSHMEM's `_warp`/`_block` variants: every
// thread of the group calls with the same arguments, converged, and the work is split among them.
//  - Thread: the calling thread alone.
//  - Warp:   all 32 lanes of the calling warp (the block's thread count must be a multiple of 32).
//  - Block:  every thread of the thread block.
#pragma once

#include "weft/common/macros.hpp"

namespace weft::device {

/// The calling thread alone.
struct Thread {
    __device__ __forceinline__ uint32_t rank() const { return 0; }
    __device__ __forceinline__ uint32_t size() const { return 1; }
    __device__ __forceinline__ bool is_leader() const { return true; }
    /// No-op: a thread is always in sync with itself.
    __device__ __forceinline__ void sync() const {}
    /// Returns `value` (the leader is the caller). Every group's broadcast is also a group barrier.
    template <class T>
    __device__ __forceinline__ T broadcast(T value) const {
        return value;
    }
};

/// The 32 lanes of the calling warp.
struct Warp {
    __device__ __forceinline__ uint32_t rank() const {
        return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) & 31u;
    }
    __device__ __forceinline__ uint32_t size() const { return 32; }
    __device__ __forceinline__ bool is_leader() const { return rank() == 0; }
    /// `__syncwarp()`: a warp-wide execution barrier that also orders memory among the lanes.
    __device__ __forceinline__ void sync() const { __syncwarp(); }
    /// Lane 0's `value`, returned to every lane (4- or 8-byte T). Also a barrier that orders memory
    /// like sync() (a shuffle alone would not).
    template <class T>
    __device__ __forceinline__ T broadcast(T value) const {
        static_assert(sizeof(T) == 4 || sizeof(T) == 8, "Warp::broadcast: 4- or 8-byte values only");
        __syncwarp();
        if constexpr (sizeof(T) == 4) {
            return __builtin_bit_cast(T, __shfl_sync(0xffffffffu, __builtin_bit_cast(unsigned, value), 0));
        } else {
            return __builtin_bit_cast(
                T, __shfl_sync(0xffffffffu, __builtin_bit_cast(unsigned long long, value), 0));
        }
    }
};

/// Every thread of the calling thread block.
struct Block {
    __device__ __forceinline__ uint32_t rank() const {
        return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    }
    __device__ __forceinline__ uint32_t size() const { return blockDim.x * blockDim.y * blockDim.z; }
    __device__ __forceinline__ bool is_leader() const { return rank() == 0; }
    /// `__syncthreads()`: a block-wide execution barrier that also orders memory among the threads.
    __device__ __forceinline__ void sync() const { __syncthreads(); }
    /// Thread 0's `value`, returned to every thread (through one shared-memory slot; two barriers, so
    /// also a barrier that orders memory like sync()).
    template <class T>
    __device__ __forceinline__ T broadcast(T value) const {
        __shared__ T slot;
        __syncthreads();  // NOTE: every reader of the previous broadcast has read the slot
        if (rank() == 0) {
            slot = value;
        }
        __syncthreads();
        return slot;
    }
};

/// True for the three group types above (used to constrain templates).
template <class G>
inline constexpr bool kIsGroup = false;
template <>
inline constexpr bool kIsGroup<Thread> = true;
template <>
inline constexpr bool kIsGroup<Warp> = true;
template <>
inline constexpr bool kIsGroup<Block> = true;

}  // namespace weft::device
