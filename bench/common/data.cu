// SPDX-License-Identifier: MIT
// Benchmark data (data.hpp).
#include "common/data.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/timing.hpp"
#include "weft/runtime/error.hpp"

namespace weft::bench {
namespace {

template <class T>
__device__ T from_float(float x) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        return __float2bfloat16_rn(x);
    } else if constexpr (std::is_same_v<T, __half>) {
        return __float2half_rn(x);
    } else {
        return x;
    }
}

template <class T>
__global__ void fill_random_kernel(T* p, int64_t n, uint64_t seed) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        uint64_t x = seed ^ (static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull);
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdull;
        x ^= x >> 33;
        x *= 0xc4ceb9fe1a85ec53ull;
        x ^= x >> 33;
        const float u = static_cast<float>(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
        p[i] = from_float<T>(u);
    }
}

void check_dtype(DType t, const char* what) {
    WEFT_CHECK(t == DType::kBF16 || t == DType::kF16 || t == DType::kF32,
               what << ": dtype " << dtype_name(t) << " is not one of bf16, f16, f32");
}

}  // namespace

double host_value(const void* p, DType t) {
    if (t == DType::kF32) {
        float f = 0;
        std::memcpy(&f, p, 4);
        return f;
    }
    uint16_t bits = 0;
    std::memcpy(&bits, p, 2);
    if (t == DType::kBF16) {
        const uint32_t u = static_cast<uint32_t>(bits) << 16;
        float f = 0;
        std::memcpy(&f, &u, 4);
        return f;
    }
    __half_raw raw;
    raw.x = bits;
    return static_cast<double>(__half2float(__half(raw)));
}

std::vector<double> attention_row_reference(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t keys,
                                            int64_t dim, DType t) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
    std::vector<double> s(static_cast<size_t>(keys));
    double m = -INFINITY;
    for (int64_t j = 0; j < keys; ++j) {
        double dot = 0;
        for (int64_t e = 0; e < dim; ++e) dot += host_value(q + e, t) * host_value(k + j * dim + e, t);
        s[static_cast<size_t>(j)] = dot * scale;
        m = std::max(m, s[static_cast<size_t>(j)]);
    }
    std::vector<double> out(static_cast<size_t>(dim), 0.0);
    double l = 0;
    for (int64_t j = 0; j < keys; ++j) {
        const double p = std::exp(s[static_cast<size_t>(j)] - m);
        l += p;
        for (int64_t e = 0; e < dim; ++e) out[static_cast<size_t>(e)] += p * host_value(v + j * dim + e, t);
    }
    for (double& x : out) x /= l;
    return out;
}

void fill_random(void* p, int64_t elems, DType t, uint64_t seed, cudaStream_t stream) {
    check_dtype(t, "fill_random");
    if (t == DType::kBF16) {
        fill_random_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), elems, seed);
    } else if (t == DType::kF16) {
        fill_random_kernel<<<1024, 256, 0, stream>>>(static_cast<__half*>(p), elems, seed);
    } else {
        fill_random_kernel<<<1024, 256, 0, stream>>>(static_cast<float*>(p), elems, seed);
    }
    BENCH_CUDA(cudaGetLastError());
    BENCH_CUDA(cudaStreamSynchronize(stream));
}

double relative_error(const void* x, int64_t ldx, const void* y, int64_t ldy, int64_t rows, int64_t cols, DType t,
                      cudaStream_t stream) {
    check_dtype(t, "relative_error");
    const size_t es = static_cast<size_t>(dtype_bytes(t));
    std::vector<unsigned char> hx(static_cast<size_t>(rows * ldx) * es), hy(static_cast<size_t>(rows * ldy) * es);
    BENCH_CUDA(cudaMemcpyAsync(hx.data(), x, hx.size(), cudaMemcpyDeviceToHost, stream));
    BENCH_CUDA(cudaMemcpyAsync(hy.data(), y, hy.size(), cudaMemcpyDeviceToHost, stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    double num = 0, den = 0;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
            const double a = host_value(hx.data() + static_cast<size_t>(r * ldx + c) * es, t);
            const double b = host_value(hy.data() + static_cast<size_t>(r * ldy + c) * es, t);
            num += (a - b) * (a - b);
            den += b * b;
        }
    }
    return std::isfinite(num) ? std::sqrt(num / std::max(den, 1e-30)) : std::numeric_limits<double>::infinity();
}

}  // namespace weft::bench
