// SPDX-License-Identifier: MIT
// Kernels of the collective GPU tests: fill inputs with the pattern, count output mismatches, delay a rank.
#include "gpu/collectives_test_kernels.hpp"

#include "weft/runtime/error.hpp"

namespace weft::test {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocks = 264;

__device__ uint32_t load_bits(const void* p, DType dtype, uint64_t i) {
    switch (dtype_bytes(dtype)) {
        case 1:
            return static_cast<const uint8_t*>(p)[i];
        case 2:
            return static_cast<const uint16_t*>(p)[i];
        default:
            return static_cast<const uint32_t*>(p)[i];
    }
}

__device__ void store_bits(void* p, DType dtype, uint64_t i, uint32_t v) {
    switch (dtype_bytes(dtype)) {
        case 1:
            static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v);
            break;
        case 2:
            static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(v);
            break;
        default:
            static_cast<uint32_t*>(p)[i] = v;
            break;
    }
}

__global__ void fill_kernel(void* dst, DType dtype, uint64_t count, uint64_t seed, int rank, uint64_t offset) {
    for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count;
         i += gridDim.x * uint64_t{blockDim.x}) {
        store_bits(dst, dtype, i, int_bits(pattern_value(seed, rank, offset + i), dtype));
    }
}

__global__ void check_sum_kernel(const void* out, DType dtype, uint64_t count, uint64_t seed, int num_ranks,
                                 uint64_t offset, unsigned long long* errors) {
    unsigned long long bad = 0;
    for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count;
         i += gridDim.x * uint64_t{blockDim.x}) {
        int32_t sum = 0;
        for (int r = 0; r < num_ranks; ++r) sum += pattern_value(seed, r, offset + i);
        bad += load_bits(out, dtype, i) != int_bits(sum, dtype);
    }
    if (bad != 0) atomicAdd(errors, bad);
}

__global__ void check_gather_kernel(const void* out, DType dtype, uint64_t shard, uint64_t seed, int num_ranks,
                                    unsigned long long* errors) {
    unsigned long long bad = 0;
    const uint64_t total = shard * static_cast<uint64_t>(num_ranks);
    for (uint64_t k = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; k < total;
         k += gridDim.x * uint64_t{blockDim.x}) {
        const int r = static_cast<int>(k / shard);
        bad += load_bits(out, dtype, k) != int_bits(pattern_value(seed, r, k % shard), dtype);
    }
    if (bad != 0) atomicAdd(errors, bad);
}

__global__ void delay_kernel(uint64_t ns) {
    uint64_t start = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    uint64_t now = start;
    while (now - start < ns) {
        asm volatile("nanosleep.u32 1000;");
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    }
}

int blocks_for(uint64_t count) {
    const uint64_t b = (count + kThreads - 1) / kThreads;
    return static_cast<int>(b < 1 ? 1 : b > kBlocks ? kBlocks : b);
}

}  // namespace

void launch_fill_pattern(cudaStream_t stream, void* dst, DType dtype, uint64_t count, uint64_t seed, int rank,
                         uint64_t index_offset) {
    if (count == 0) return;
    fill_kernel<<<blocks_for(count), kThreads, 0, stream>>>(dst, dtype, count, seed, rank, index_offset);
    WEFT_CUDA_CHECK(cudaGetLastError());
}

void launch_check_sum(cudaStream_t stream, const void* out, DType dtype, uint64_t count, uint64_t seed, int num_ranks,
                      uint64_t index_offset, unsigned long long* errors) {
    if (count == 0) return;
    check_sum_kernel<<<blocks_for(count), kThreads, 0, stream>>>(out, dtype, count, seed, num_ranks, index_offset,
                                                                 errors);
    WEFT_CUDA_CHECK(cudaGetLastError());
}

void launch_check_gather(cudaStream_t stream, const void* out, DType dtype, uint64_t shard, uint64_t seed,
                         int num_ranks, unsigned long long* errors) {
    if (shard == 0) return;
    check_gather_kernel<<<blocks_for(shard * num_ranks), kThreads, 0, stream>>>(out, dtype, shard, seed, num_ranks,
                                                                                errors);
    WEFT_CUDA_CHECK(cudaGetLastError());
}

void launch_delay(cudaStream_t stream, uint64_t ns) {
    delay_kernel<<<1, 1, 0, stream>>>(ns);
    WEFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace weft::test
