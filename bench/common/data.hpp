// SPDX-License-Identifier: MIT
// Benchmark data: device buffers, random device inputs (never zeros: a GEMM on zeros runs faster than on data) and
// the relative difference of two device matrices.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "weft/common/dtype.hpp"
#include "weft/runtime/error.hpp"

namespace weft::bench {

/// A cudaMalloc'd buffer of at least `bytes` (256 when `bytes` is smaller, so that an empty one is still a valid
/// aligned pointer) on the current device, freed with it.
struct DeviceBuffer {
    void* ptr = nullptr;
    explicit DeviceBuffer(size_t bytes) { WEFT_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(bytes, 256))); }
    ~DeviceBuffer() { cudaFree(ptr); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

/// Fills `elems` elements of dtype `t` (bf16, f16 or f32) with values uniform in [-1, 1) from a hash of (seed,
/// index), on `stream`, and waits for it: peers may read the buffer once the caller's next barrier is passed.
void fill_random(void* p, int64_t elems, DType t, uint64_t seed, cudaStream_t stream);

/// The value of one host element of dtype `t` (bf16, f16 or f32) at `p`.
double host_value(const void* p, DType t);

/// softmax(q . k_j / sqrt(dim)) v over `keys` keys, in fp64: one attention output row from host rows of dtype `t`
/// (bf16 or f16): q [dim], k and v [keys, dim] row-major.
std::vector<double> attention_row_reference(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t keys,
                                            int64_t dim, DType t);

/// ||x - y||_F / ||y||_F over rows x cols elements of dtype `t` (bf16, f16 or f32), row pitches ldx and ldy in
/// elements; copies both to the host on `stream`. +infinity when x holds a NaN or an infinity.
double relative_error(const void* x, int64_t ldx, const void* y, int64_t ldy, int64_t rows, int64_t cols, DType t,
                      cudaStream_t stream);

}  // namespace weft::bench
