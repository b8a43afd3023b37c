// SPDX-License-Identifier: MIT
// The physical limits the benchmarks print beside their figures, measured on the GPU at start-up rather than
// taken from a datasheet: device-to-device copy bandwidth, streaming read bandwidth, and the dense tensor-core
// rate cuBLASLt reaches on a large random GEMM.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "weft/common/dtype.hpp"

namespace weft::bench {

class Json;

/// Which limits measure_peaks measures (bits, or-ed).
enum PeakKind : unsigned {
    kPeakCopy = 1u,    // cudaMemcpyAsync device to device, 1 GiB
    kPeakRead = 2u,    // a streaming read kernel (16-byte loads) over 4 GiB
    kPeakTensor = 4u,  // cuBLASLt on a random 8192 x 8192 x 8192 GEMM, its fastest heuristic algorithm
};

/// Measured limits of one GPU; 0 where not measured.
struct Peaks {
    int device = 0;
    std::string gpu;           // the device's name
    double copy_tbs = 0;       // device-to-device copy, bytes read + bytes written per second / 1e12
    double read_tbs = 0;       // streaming reads, bytes read per second / 1e12
    double tensor_tflops = 0;  // 2 M N K / time / 1e12
    DType tensor_dtype = DType::kBF16;
    unsigned given = 0;  // the kinds taken from WEFT_BENCH_PEAKS instead of measured
};

/// Measures the limits in `which` on `device` (made current; it stays current), each the median of ten timed runs
/// after warm-up; those that WEFT_BENCH_PEAKS gives ("copy=4.1,read=4.5,tensor=824": TB/s, TB/s, TFLOP/s, any subset)
/// are taken from it instead, so that a profiler sees only the benchmark's own kernels. Allocates up to 4 GiB of device
/// memory for the duration: call it before the benchmark's own allocations. `tensor_dtype`: bf16 or f16 inputs and
/// output, fp32 accumulation.
Peaks measure_peaks(unsigned which, DType tensor_dtype = DType::kBF16, int device = 0);

/// The median rate of cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault) on `stream`, in bytes copied per
/// second (count each byte once; a device-local copy also reads it, so it moves twice that through memory).
double copy_bytes_per_s(void* dst, const void* src, size_t bytes, cudaStream_t stream, int warmup = 2, int iters = 10);

/// Microseconds per call of a streaming read of `bytes` at `a` plus `bytes` at `b` (16-byte loads, one kernel per
/// call, calls back to back between one pair of events as time_batch_ms times them): what a kernel that must read
/// those 2 x `bytes` costs at best, launch and ramp included, where the 4 GiB figure of measure_peaks hides both.
/// Call i reads at byte offset (i % rotations) x `stride` of both, so consecutive calls miss in L2 as the
/// benchmark's own rotated inputs do. `bytes` and `stride` must be multiples of 16.
double read_pair_us(const void* a, const void* b, size_t bytes, size_t stride, int rotations, cudaStream_t stream,
                    int warmup, int iters);

/// One line for a table's header: "measured on GPU 0: D2D copy 4.15 TB/s (read + write), ...".
std::string describe(const Peaks& p);

/// Adds "peaks": {"device", "gpu", "copy_tbs", "read_tbs", "tensor_tflops", "tensor_dtype"} to the object being
/// written (the measured ones only).
void add_peaks(Json& j, const Peaks& p);

}  // namespace weft::bench
