// SPDX-License-Identifier: MIT
// setmaxnreg (sm_90a): move registers between warpgroups of a warp-specialised kernel.
//
// Contract: warpgroup-collective; the kernel must have a register cap at entry (__launch_bounds__(threads, 1)
// or -maxrregcount), and each role's call must sit in one branch of an if/else on the warpgroup index,
// otherwise ptxas ignores it (warning C7508). kRegs is a multiple of 8 in [24, 256].
#pragma once

namespace weft::ptx {

/// Raises this warpgroup's per-thread register limit to kRegs (blocks until registers are free).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

/// Lowers this warpgroup's per-thread register limit to kRegs, releasing the rest to the SM.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

}  // namespace weft::ptx
