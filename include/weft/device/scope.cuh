// SPDX-License-Identifier: MIT
// Thread groups that perform a device operation together: Thread, Warp, Warpgroup, Block.
//
// Every weft device call that can be shared by several threads takes the group as its first argument
// (`shmem::putmem(Block{}, ctx, ...)`). The contract is OpenSHMEM's `_warp`/`_block` variants: every
// thread of the group calls with the same arguments, converged, and the work is split among them.
//  - Thread: the calling thread alone.
//  - Warp:   all 32 lanes of the calling warp (the block's thread count must be a multiple of 32).
//  - Warpgroup: the 128 threads of four consecutive warps (warps 4w .. 4w+3), synchronised by a named barrier.
//  - Block:  every thread of the thread block.
// Each group has rank(), size(), is_leader(), sync() (a barrier that orders memory among its threads), all(pred)
// (the same barrier, also returning whether pred holds in every thread) and broadcast(value).
#pragma once

#include "weft/common/macros.hpp"
#include "weft/ptx/mbarrier.cuh"  // named barriers

namespace weft::device {

/// The calling thread alone.
struct Thread {
    /// The block's thread count must be a multiple of this (1: any block).
    static constexpr uint32_t kBlockMultiple = 1;
    __device__ __forceinline__ uint32_t rank() const { return 0; }
    __device__ __forceinline__ uint32_t size() const { return 1; }
    __device__ __forceinline__ bool is_leader() const { return true; }
    /// No-op: a thread is always in sync with itself.
    __device__ __forceinline__ void sync() const {}
    /// `pred`.
    __device__ __forceinline__ bool all(bool pred) const { return pred; }
    /// Returns `value` (the leader is the caller). Every group's broadcast is also a group barrier.
    template <class T>
    __device__ __forceinline__ T broadcast(T value) const {
        return value;
    }
};

/// The 32 lanes of the calling warp.
struct Warp {
    static constexpr uint32_t kBlockMultiple = 32;
    __device__ __forceinline__ uint32_t rank() const {
        return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) & 31u;
    }
    __device__ __forceinline__ uint32_t size() const { return 32; }
    __device__ __forceinline__ bool is_leader() const { return rank() == 0; }
    /// `__syncwarp()`: a warp-wide execution barrier that also orders memory among the lanes.
    __device__ __forceinline__ void sync() const { __syncwarp(); }
    /// sync(), then true in every lane when `pred` is true in all 32 (`__all_sync`, which alone orders no memory).
    __device__ __forceinline__ bool all(bool pred) const {
        __syncwarp();
        return __all_sync(0xffffffffu, pred) != 0;
    }
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

/// The 128 threads of the calling warpgroup: warps 4w .. 4w+3 of the block, for the w of the calling thread (the
/// block's thread count must be a multiple of 128). They synchronise through named barrier `barrier_id` (1..15; 0
/// is the block's __syncthreads barrier), which no other threads may use while they do.
struct Warpgroup {
    static constexpr uint32_t kBlockMultiple = 128;
    uint32_t barrier_id;

    /// No default: barrier 0 is __syncthreads' own, and two warpgroups on one id meet each other's warps. `id` in
    /// 1..15, one per warpgroup that synchronises at once.
    __device__ __forceinline__ explicit Warpgroup(uint32_t id) : barrier_id(id) {}
    __device__ __forceinline__ explicit Warpgroup(int id) : barrier_id(static_cast<uint32_t>(id)) {}

    __device__ __forceinline__ uint32_t rank() const {
        return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) & 127u;
    }
    __device__ __forceinline__ uint32_t size() const { return 128; }
    __device__ __forceinline__ bool is_leader() const { return rank() == 0; }
    /// `bar.sync barrier_id, 128`: an execution barrier of the warpgroup that also orders memory among its threads.
    __device__ __forceinline__ void sync() const { ptx::named_barrier_sync(static_cast<int>(barrier_id), 128); }
    /// `bar.red.and.pred barrier_id, 128`: sync(), and true in every thread when `pred` is true in all 128.
    __device__ __forceinline__ bool all(bool pred) const {
        return ptx::named_barrier_sync_and(static_cast<int>(barrier_id), 128, pred);
    }
    /// The warpgroup leader's `value`, returned to every thread (through one shared-memory slot per warpgroup of
    /// the block; two barriers, so also a barrier that orders memory like sync()).
    template <class T>
    __device__ __forceinline__ T broadcast(T value) const {
        __shared__ T slots[8];  // a block has at most 1024 threads: 8 warpgroups
        const uint32_t wg = (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) >> 7;
        sync();  // NOTE: every reader of the previous broadcast has read the slot
        if (rank() == 0) {
            slots[wg] = value;
        }
        sync();
        return slots[wg];
    }
};

/// Every thread of the calling thread block.
struct Block {
    static constexpr uint32_t kBlockMultiple = 1;
    __device__ __forceinline__ uint32_t rank() const {
        return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    }
    __device__ __forceinline__ uint32_t size() const { return blockDim.x * blockDim.y * blockDim.z; }
    __device__ __forceinline__ bool is_leader() const { return rank() == 0; }
    /// `__syncthreads()`: a block-wide execution barrier that also orders memory among the threads.
    __device__ __forceinline__ void sync() const { __syncthreads(); }
    /// `__syncthreads_and(pred)`: sync(), and true in every thread when `pred` is true in all of them.
    __device__ __forceinline__ bool all(bool pred) const { return __syncthreads_and(pred) != 0; }
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

/// True for the group types above (used to constrain templates).
template <class G>
inline constexpr bool kIsGroup = false;
template <>
inline constexpr bool kIsGroup<Thread> = true;
template <>
inline constexpr bool kIsGroup<Warp> = true;
template <>
inline constexpr bool kIsGroup<Warpgroup> = true;
template <>
inline constexpr bool kIsGroup<Block> = true;

}  // namespace weft::device
