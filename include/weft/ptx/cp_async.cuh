// SPDX-License-Identifier: MIT
// cp.async (sm_80+): asynchronous 16-byte copies from global to shared memory, tracked per thread in commit groups.
//
// A copy issued by a thread is complete for that thread after cp.async.wait_group; other threads of the block see
// the data only after a barrier (__syncthreads) that follows the wait. Never use it on memory another agent writes
// concurrently: it reads through the non-coherent path like any other load of data the kernel does not own.
#pragma once

namespace weft::ptx {

/// Copies 16 bytes from `gmem` (16-byte aligned) to shared address `smem_addr` (16-byte aligned), bypassing L1
/// (.cg). When `valid` is false nothing is read and the 16 bytes are zero-filled (`gmem` must still be a valid
/// address expression; it is not dereferenced).
__device__ __forceinline__ void cp_async_16_zfill(unsigned smem_addr, const void* gmem, bool valid) {
    const unsigned src_bytes = valid ? 16u : 0u;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes)
                 : "memory");
}

/// Closes the calling thread's current group of cp.async copies.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

/// Waits until at most `kPending` of the calling thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace weft::ptx
