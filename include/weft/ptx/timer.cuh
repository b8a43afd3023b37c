// SPDX-License-Identifier: MIT
// Time on the device: nanosleep (spin backoff) and %globaltimer (nanoseconds, shared by all SMs).
#pragma once

#include "weft/common/macros.hpp"

namespace weft::ptx {

/// Suspends the calling thread for about `ns` nanoseconds (the hardware picks a delay in [0, 2*ns]);
/// the backoff of every weft spin.
__device__ __forceinline__ void nanosleep(uint32_t ns) { asm volatile("nanosleep.u32 %0;" ::"r"(ns)); }

/// `%globaltimer`: a nanosecond clock common to all SMs of a GPU (it advances in steps of tens of
/// nanoseconds on current GPUs, so time short intervals by averaging many iterations).
__device__ __forceinline__ uint64_t globaltimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

}  // namespace weft::ptx
