// SPDX-License-Identifier: MIT
// GPU test of weft/ptx/cvt.cuh: bf16 and f16 (one value and packed pairs) and e4m3x2 conversions against host
// reference encoders, on every bf16 value and on ties and edges.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "support/ep_reference.hpp"
#include "weft/ptx/cvt.cuh"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

namespace ref = weft::test::ep;

__global__ void convert_pairs(const float* in, int pairs, uint32_t* bf16x2, uint16_t* e4m3x2, uint32_t* f16x2,
                              float* bf16_back) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += gridDim.x * blockDim.x) {
        const float lo = in[2 * i];
        const float hi = in[2 * i + 1];
        bf16x2[i] = ptx::cvt_rn_bf16x2(lo, hi);
        e4m3x2[i] = ptx::cvt_rn_satfinite_e4m3x2(lo, hi);
        f16x2[i] = ptx::cvt_rn_f16x2_e4m3x2(e4m3x2[i]);
        bf16_back[2 * i] = ptx::bf16_bits_to_f32(static_cast<uint16_t>(bf16x2[i] & 0xffffu));
        bf16_back[2 * i + 1] = ptx::bf16_bits_to_f32(static_cast<uint16_t>(bf16x2[i] >> 16));
    }
}

// Element i: bf16 and f16 of in[i] one at a time, the f16 pair (in[2j], in[2j+1]) packed, and f16 back to f32.
__global__ void convert_16bit(const float* in, int n, uint16_t* bf16, uint16_t* f16, uint32_t* f16x2, float* f16_back) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        bf16[i] = ptx::cvt_rn_bf16(in[i]);
        f16[i] = ptx::cvt_rn_f16(in[i]);
        f16_back[i] = ptx::f16_bits_to_f32(f16[i]);
        if (i % 2 == 0 && i + 1 < n) f16x2[i / 2] = ptx::cvt_rn_f16x2(in[i], in[i + 1]);
    }
}

float f16_to_f32(uint16_t h) {  // host decode of IEEE half
    const int sign = h >> 15;
    const int exp = (h >> 10) & 31;
    const int mant = h & 1023;
    double v;
    if (exp == 0) {
        v = std::ldexp(static_cast<double>(mant), -24);
    } else if (exp == 31) {
        v = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
    } else {
        v = std::ldexp(1.0 + mant / 1024.0, exp - 15);
    }
    return static_cast<float>(sign ? -v : v);
}

// Host reference f32 -> f16 bits, round to nearest even, from the exact values of the f16 encodings (decoded by
// f16_to_f32): positive finite encodings are ordered like their bits, and 0x7c00 (infinity) stands for 65536, the
// next step after the largest finite value, so that rounding there goes to infinity exactly as IEEE says.
uint16_t f32_to_f16_reference(float x) {
    if (std::isnan(x)) return 0x7e00;
    const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    const double a = std::fabs(static_cast<double>(x));
    const auto value = [](uint16_t bits) { return bits == 0x7c00 ? 65536.0 : static_cast<double>(f16_to_f32(bits)); };
    if (a >= 65536.0) return sign | 0x7c00;
    uint16_t lo = 0, hi = 0x7c00;  // value(lo) <= a < value(hi)
    while (hi - lo > 1) {
        const uint16_t mid = static_cast<uint16_t>((lo + hi) / 2);
        (value(mid) <= a ? lo : hi) = mid;
    }
    const double below = a - value(lo);
    const double above = value(hi) - a;
    const uint16_t bits = below < above ? lo : above < below ? hi : ((lo & 1) == 0 ? lo : hi);
    return sign | bits;
}

TEST(PtxCvtGpu, MatchesTheHostEncoders) {
    ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU";
    std::vector<float> in;
    for (uint32_t b = 0; b < 0x10000; ++b) in.push_back(ref::bf16_to_f32(static_cast<uint16_t>(b)));  // every bf16
    for (int c = 0; c < 127; ++c) {  // every e4m3 magnitude, and the midpoints to its neighbours (ties)
        const float v = ref::e4m3_to_f32(static_cast<uint8_t>(c));
        const float next = c < 126 ? ref::e4m3_to_f32(static_cast<uint8_t>(c + 1)) : 464.0f;
        for (float x : {v, -v, (v + next) / 2, -(v + next) / 2, std::nextafter((v + next) / 2, 0.0f),
                        std::nextafter((v + next) / 2, 1e9f)}) {
            in.push_back(x);
        }
    }
    for (float x : {0.0f, -0.0f, 448.0f, 464.0f, 465.0f, 1e30f, -1e30f, std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), 1e-10f,
                    std::ldexp(1.0f, -10), std::ldexp(1.0f, -11), 1.0f + 1.0f / 256, 1.0f + 3.0f / 256}) {
        in.push_back(x);
    }
    std::mt19937 rng(std::random_device{}());
    std::normal_distribution<float> normal(0.0f, 100.0f);
    for (int i = 0; i < 100000; ++i) in.push_back(normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20));
    if (in.size() % 2) in.push_back(1.0f);
    const int pairs = static_cast<int>(in.size() / 2);

    float* d_in = nullptr;
    uint32_t* d_bf16 = nullptr;
    uint16_t* d_fp8 = nullptr;
    uint32_t* d_f16 = nullptr;
    float* d_back = nullptr;
    WEFT_CUDA_CHECK(cudaMalloc(&d_in, in.size() * 4));
    WEFT_CUDA_CHECK(cudaMalloc(&d_bf16, pairs * 4ull));
    WEFT_CUDA_CHECK(cudaMalloc(&d_fp8, pairs * 2ull));
    WEFT_CUDA_CHECK(cudaMalloc(&d_f16, pairs * 4ull));
    WEFT_CUDA_CHECK(cudaMalloc(&d_back, in.size() * 4));
    WEFT_CUDA_CHECK(cudaMemcpy(d_in, in.data(), in.size() * 4, cudaMemcpyHostToDevice));
    convert_pairs<<<256, 256>>>(d_in, pairs, d_bf16, d_fp8, d_f16, d_back);
    WEFT_CUDA_CHECK(cudaGetLastError());
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint32_t> bf16(static_cast<size_t>(pairs)), f16(static_cast<size_t>(pairs));
    std::vector<uint16_t> fp8(static_cast<size_t>(pairs));
    std::vector<float> back(in.size());
    WEFT_CUDA_CHECK(cudaMemcpy(bf16.data(), d_bf16, bf16.size() * 4, cudaMemcpyDeviceToHost));
    WEFT_CUDA_CHECK(cudaMemcpy(fp8.data(), d_fp8, fp8.size() * 2, cudaMemcpyDeviceToHost));
    WEFT_CUDA_CHECK(cudaMemcpy(f16.data(), d_f16, f16.size() * 4, cudaMemcpyDeviceToHost));
    WEFT_CUDA_CHECK(cudaMemcpy(back.data(), d_back, back.size() * 4, cudaMemcpyDeviceToHost));
    cudaFree(d_in);
    cudaFree(d_bf16);
    cudaFree(d_fp8);
    cudaFree(d_f16);
    cudaFree(d_back);

    int bad = 0;
    for (size_t i = 0; i < in.size() && bad < 20; ++i) {
        const float x = in[i];
        const size_t p = i / 2;
        const int half = static_cast<int>(i % 2);
        const uint16_t got_bf16 = static_cast<uint16_t>(half ? bf16[p] >> 16 : bf16[p] & 0xffffu);
        const uint8_t got_fp8 = static_cast<uint8_t>(half ? fp8[p] >> 8 : fp8[p] & 0xffu);
        const uint16_t got_f16 = static_cast<uint16_t>(half ? f16[p] >> 16 : f16[p] & 0xffffu);
        if (std::isnan(x)) {
            EXPECT_TRUE(std::isnan(ref::bf16_to_f32(got_bf16))) << "bf16 of NaN";
            EXPECT_TRUE(std::isnan(ref::e4m3_to_f32(got_fp8))) << "e4m3 of NaN";
            continue;
        }
        const uint16_t want_bf16 = ref::f32_to_bf16(x);
        const float want_e4m3 = ref::e4m3_to_f32(ref::f32_to_e4m3(x));
        const float got_e4m3 = ref::e4m3_to_f32(got_fp8);
        if (got_bf16 != want_bf16) {
            ADD_FAILURE() << "bf16(" << x << "): got 0x" << std::hex << got_bf16 << ", want 0x" << want_bf16;
            ++bad;
        }
        if (!(got_e4m3 == want_e4m3)) {  // +0 and -0 compare equal
            ADD_FAILURE() << "e4m3(" << x << "): got " << got_e4m3 << " (0x" << std::hex << int{got_fp8} << "), want "
                          << want_e4m3;
            ++bad;
        }
        if (!(f16_to_f32(got_f16) == got_e4m3)) {
            ADD_FAILURE() << "f16 of e4m3 code 0x" << std::hex << int{got_fp8} << ": got " << f16_to_f32(got_f16);
            ++bad;
        }
        if (!(back[i] == ref::bf16_to_f32(got_bf16))) {
            ADD_FAILURE() << "bf16_bits_to_f32 of 0x" << std::hex << got_bf16;
            ++bad;
        }
    }
}

TEST(PtxCvtGpu, SingleAndPackedSixteenBitConversions) {
    ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU";
    std::vector<float> in;
    for (uint32_t b = 0; b < 0x10000; ++b) in.push_back(ref::bf16_to_f32(static_cast<uint16_t>(b)));  // every bf16
    for (uint32_t b = 0; b < 0x7c00; ++b) {  // every finite f16 magnitude, and the midpoints to its neighbour (ties)
        const float v = f16_to_f32(static_cast<uint16_t>(b));
        const float next = b < 0x7bff ? f16_to_f32(static_cast<uint16_t>(b + 1)) : 65536.0f;
        for (float x : {v, -v, (v + next) / 2, std::nextafter((v + next) / 2, 0.0f),
                        std::nextafter((v + next) / 2, 1e9f)}) {
            in.push_back(x);
        }
    }
    for (float x : {65504.0f, 65519.0f, 65520.0f, 1e30f, std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                    std::ldexp(1.0f, -24), std::ldexp(1.0f, -25), std::ldexp(1.5f, -25), 1e-10f}) {
        in.push_back(x);
    }
    std::mt19937 rng(std::random_device{}());
    std::normal_distribution<float> normal(0.0f, 100.0f);
    for (int i = 0; i < 100000; ++i) in.push_back(normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20));
    if (in.size() % 2) in.push_back(1.0f);
    const int n = static_cast<int>(in.size());

    float* d_in = nullptr;
    uint16_t* d_bf16 = nullptr;
    uint16_t* d_f16 = nullptr;
    uint32_t* d_f16x2 = nullptr;
    float* d_back = nullptr;
    WEFT_CUDA_CHECK(cudaMalloc(&d_in, n * 4ull));
    WEFT_CUDA_CHECK(cudaMalloc(&d_bf16, n * 2ull));
    WEFT_CUDA_CHECK(cudaMalloc(&d_f16, n * 2ull));
    WEFT_CUDA_CHECK(cudaMalloc(&d_f16x2, n / 2 * 4ull));
    WEFT_CUDA_CHECK(cudaMalloc(&d_back, n * 4ull));
    WEFT_CUDA_CHECK(cudaMemcpy(d_in, in.data(), n * 4ull, cudaMemcpyHostToDevice));
    convert_16bit<<<256, 256>>>(d_in, n, d_bf16, d_f16, d_f16x2, d_back);
    WEFT_CUDA_CHECK(cudaGetLastError());
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> bf16(static_cast<size_t>(n)), f16(static_cast<size_t>(n));
    std::vector<uint32_t> f16x2(static_cast<size_t>(n / 2));
    std::vector<float> back(static_cast<size_t>(n));
    WEFT_CUDA_CHECK(cudaMemcpy(bf16.data(), d_bf16, n * 2ull, cudaMemcpyDeviceToHost));
    WEFT_CUDA_CHECK(cudaMemcpy(f16.data(), d_f16, n * 2ull, cudaMemcpyDeviceToHost));
    WEFT_CUDA_CHECK(cudaMemcpy(f16x2.data(), d_f16x2, n / 2 * 4ull, cudaMemcpyDeviceToHost));
    WEFT_CUDA_CHECK(cudaMemcpy(back.data(), d_back, n * 4ull, cudaMemcpyDeviceToHost));
    cudaFree(d_in);
    cudaFree(d_bf16);
    cudaFree(d_f16);
    cudaFree(d_f16x2);
    cudaFree(d_back);

    int bad = 0;
    for (int i = 0; i < n && bad < 20; ++i) {
        const float x = in[i];
        const uint16_t packed = static_cast<uint16_t>(i % 2 ? f16x2[i / 2] >> 16 : f16x2[i / 2] & 0xffffu);
        if (std::isnan(x)) {
            EXPECT_TRUE(std::isnan(ref::bf16_to_f32(bf16[i]))) << "bf16 of NaN";
            EXPECT_TRUE(std::isnan(f16_to_f32(f16[i]))) << "f16 of NaN";
            EXPECT_TRUE(std::isnan(f16_to_f32(packed))) << "f16x2 of NaN";
            continue;
        }
        const uint16_t want_bf16 = ref::f32_to_bf16(x);
        const uint16_t want_f16 = f32_to_f16_reference(x);
        if (bf16[i] != want_bf16) {
            ADD_FAILURE() << "cvt_rn_bf16(" << x << "): got 0x" << std::hex << bf16[i] << ", want 0x" << want_bf16;
            ++bad;
        }
        if (f16[i] != want_f16) {
            ADD_FAILURE() << "cvt_rn_f16(" << x << "): got 0x" << std::hex << f16[i] << ", want 0x" << want_f16;
            ++bad;
        }
        if (packed != want_f16) {
            ADD_FAILURE() << "cvt_rn_f16x2 half " << i % 2 << " (" << x << "): got 0x" << std::hex << packed
                          << ", want 0x" << want_f16;
            ++bad;
        }
        if (!(back[i] == f16_to_f32(want_f16))) {
            ADD_FAILURE() << "f16_bits_to_f32 of 0x" << std::hex << want_f16 << ": got " << back[i];
            ++bad;
        }
    }
}

}  // namespace
}  // namespace weft
