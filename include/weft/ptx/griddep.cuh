// SPDX-License-Identifier: MIT
// griddepcontrol (sm_90): programmatic dependent launch, seen from inside the kernels.
//
// A kernel launched with the programmatic-stream-serialization attribute
// (cudaLaunchAttributeProgrammaticStreamSerialization, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) may
// start while the kernel before it on the stream still runs: as soon as every CTA of that kernel has called
// launch_dependents() or exited. Until it calls wait_for_prior_grids() it may touch only memory that the earlier
// kernel neither writes nor reads-then-expects-unchanged (a decode GEMM's weights); after that call every
// earlier kernel on the stream has completed and its writes are visible. In a kernel launched without the
// attribute both instructions do nothing.
#pragma once

namespace weft::ptx {

/// Blocks the calling thread until the grids this one depends on have completed and their memory operations
/// are performed and visible to it. Every thread that reads their results or writes what they read calls it.
__device__ __forceinline__ void wait_for_prior_grids() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

/// Lets the next kernel on the stream (when launched programmatically) be scheduled once every CTA of this grid
/// has called it or exited. Harmless for correctness (that kernel still waits for this one to complete before it
/// reads what this one writes); it only moves the dependent's start earlier, onto SMs this grid frees.
__device__ __forceinline__ void launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

}  // namespace weft::ptx
