// SPDX-License-Identifier: MIT
// Test helpers for the expert-parallel kernels: a kernel that delays a stream (stragglers).
#pragma once

#include "weft/common/macros.hpp"
#include "weft/ptx/timer.cuh"

namespace weft::kernels::ep {

/// One thread spins for `ns` nanoseconds of %globaltimer, then returns: launched before a collective
/// kernel on one rank, it makes that rank a straggler. Bounded by its argument.
__global__ void delay(uint64_t ns) {
    const uint64_t start = ptx::globaltimer();
    while (ptx::globaltimer() - start < ns) {
        ptx::nanosleep(1000);
    }
}

}  // namespace weft::kernels::ep
