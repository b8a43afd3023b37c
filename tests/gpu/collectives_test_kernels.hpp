// SPDX-License-Identifier: MIT
// Test data for the collective GPU tests: an integer-valued pattern (host and device), and kernels that fill
// inputs, check outputs against the pattern's sums, and delay a rank (host launchers; kernels built by nvcc).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "weft/common/dtype.hpp"

#ifdef __CUDACC__
#define WEFT_COLL_TEST_HD __host__ __device__
#else
#define WEFT_COLL_TEST_HD
#endif

namespace weft::test {

/// Element i of rank `rank`'s input under `seed`: an integer in [-8, 8], so any sum over <= 8 ranks is exact in
/// bf16, f16 and f32 (whatever the order of addition).
WEFT_COLL_TEST_HD inline int32_t pattern_value(uint64_t seed, int rank, uint64_t i) {
    uint64_t x = seed * 0x9e3779b97f4a7c15ull ^ (static_cast<uint64_t>(rank) << 44) ^ (i * 0xd1342543de82ef95ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    return static_cast<int32_t>(x % 17) - 8;
}

/// The bits of the small integer `v` (|v| <= 2048) in `dtype` (bf16, f16, f32; u8 and others: the low byte/word).
WEFT_COLL_TEST_HD inline uint32_t int_bits(int32_t v, DType dtype) {
    if (dtype == DType::kF32 || dtype == DType::kBF16) {
        const float f = static_cast<float>(v);
        uint32_t b = 0;
        static_assert(sizeof(b) == sizeof(f));
        __builtin_memcpy(&b, &f, 4);
        return dtype == DType::kF32 ? b : (b >> 16);  // exact: small integers have no low mantissa bits
    }
    if (dtype == DType::kF16) {
        if (v == 0) return 0;
        const uint32_t sign = v < 0 ? 0x8000u : 0u;
        uint32_t a = static_cast<uint32_t>(v < 0 ? -v : v);
        int e = 0;
        while ((a >> (e + 1)) != 0) ++e;
        const uint32_t mantissa = ((a << (10 - e)) & 0x3ffu);
        return sign | (static_cast<uint32_t>(e + 15) << 10) | mantissa;
    }
    return static_cast<uint32_t>(v) & (dtype_bytes(dtype) == 1 ? 0xffu : dtype_bytes(dtype) == 2 ? 0xffffu : ~0u);
}

/// Writes pattern_value(seed, rank, index_offset + i) as `dtype` to dst[i], i < count.
void launch_fill_pattern(cudaStream_t stream, void* dst, DType dtype, uint64_t count, uint64_t seed, int rank,
                         uint64_t index_offset);
/// Adds to *errors the number of i < count where out[i] != sum over ranks r < num_ranks of
/// pattern_value(seed, r, index_offset + i) (all-reduce; reduce-scatter with index_offset = rank * count).
void launch_check_sum(cudaStream_t stream, const void* out, DType dtype, uint64_t count, uint64_t seed, int num_ranks,
                      uint64_t index_offset, unsigned long long* errors);
/// Adds to *errors the number of (r, i) where out[r * shard + i] != pattern_value(seed, r, i) (all-gather).
void launch_check_gather(cudaStream_t stream, const void* out, DType dtype, uint64_t shard, uint64_t seed,
                         int num_ranks, unsigned long long* errors);
/// One thread spins for about `ns` nanoseconds (a straggling rank).
void launch_delay(cudaStream_t stream, uint64_t ns);

}  // namespace weft::test
