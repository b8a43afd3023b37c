// SPDX-License-Identifier: MIT
// Host-side pieces shared by the GEMM GPU tests (see gemm_testing.hpp).
#include "support/gemm_testing.hpp"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "support/tp_reference.hpp"
#include "weft/runtime/error.hpp"

namespace weft::gemm_test {

bool have_sm90(std::string* why) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        *why = "no CUDA device";
        return false;
    }
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    if (prop.major != 9) {
        *why = std::string("needs an sm_90 GPU, found ") + prop.name;
        return false;
    }
    return true;
}

int num_sms() {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n;
}

uint64_t fresh_seed() {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

std::string error_message(const std::function<void()>& fn) {
    try {
        fn();
    } catch (const Error& e) {
        return e.what();
    }
    return {};
}

int64_t RandomDraw::log_uniform(int64_t lo, int64_t hi) {
    const double x = std::uniform_real_distribution<double>(std::log(static_cast<double>(lo)), std::log(hi + 1.0))(rng);
    return std::clamp<int64_t>(static_cast<int64_t>(std::exp(x)), lo, hi);
}

HostMatrix::HostMatrix(int64_t r, int64_t c, int64_t l, DType t) : rows(r), cols(c), ld(l), dtype(t) {
    bytes.assign(static_cast<size_t>(std::max<int64_t>(1, r) * l * dtype_bytes(t)), 0);
}

float HostMatrix::get(int64_t r, int64_t c) const {
    if (dtype == DType::kF32) {
        float v;
        std::memcpy(&v, bytes.data() + offset(r, c), 4);
        return v;
    }
    uint16_t b;
    std::memcpy(&b, bytes.data() + offset(r, c), 2);
    return tp_test::bits_to_float(dtype, b);
}

void HostMatrix::set(int64_t r, int64_t c, float v) {
    if (dtype == DType::kF32) {
        std::memcpy(bytes.data() + offset(r, c), &v, 4);
    } else {
        const uint16_t b = tp_test::float_to_bits(dtype, v);
        std::memcpy(bytes.data() + offset(r, c), &b, 2);
    }
}

void HostMatrix::fill_random(std::mt19937_64& rng) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) set(r, c, u(rng));
}

DeviceBuffer::DeviceBuffer(size_t n) : bytes(n) {
    if (cudaMalloc(&ptr, std::max<size_t>(n, 256)) != cudaSuccess) ptr = nullptr;
}

DeviceBuffer::~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
}

void upload(const HostMatrix& h, const DeviceBuffer& d) {
    ASSERT_EQ(cudaMemcpy(d.ptr, h.bytes.data(), h.bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
}

void download(HostMatrix& h, const DeviceBuffer& d) {
    ASSERT_EQ(cudaMemcpy(h.bytes.data(), d.ptr, h.bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
}

TensorView view(const HostMatrix& h, const DeviceBuffer& d) {
    return TensorView(d.ptr, h.dtype, {h.rows, h.cols}, {h.ld, 1});
}

void poison(HostMatrix& d) {
    const int64_t esize = dtype_bytes(d.dtype);
    for (int64_t r = 0; r < d.rows; ++r) {
        for (int64_t c = 0; c < d.ld; ++c) {
            uint8_t* p = d.bytes.data() + d.offset(r, c);
            if (c < d.cols) {
                std::memset(p, 0xFF, static_cast<size_t>(esize));  // NaN in bf16, f16 and f32
            } else if (esize == 2) {
                std::memcpy(p, &kSentinel16, 2);
            } else {
                std::memcpy(p, &kSentinel32, 4);
            }
        }
    }
}

Tolerance tolerance_for(DType out) {
    switch (out) {
        case DType::kBF16:
            return {4e-3, 1.0 / 128, 1.0 / 256};
        case DType::kF16:
            return {1e-3, 1.0 / 1024, 1.0 / 2048};
        default:
            return {1e-4, 1e-4, 1e-4};
    }
}

std::vector<double> reference(const HostMatrix& a, const HostMatrix& b, BLayout layout, int64_t n,
                              const std::vector<int64_t>& rows) {
    const int64_t k = a.cols;
    std::vector<double> bt(static_cast<size_t>(n * k));  // [n][k]
    for (int64_t j = 0; j < n; ++j)
        for (int64_t kk = 0; kk < k; ++kk) bt[j * k + kk] = layout == BLayout::kNK ? b.get(j, kk) : b.get(kk, j);
    std::vector<double> out(rows.size() * static_cast<size_t>(n));
    std::vector<double> arow(static_cast<size_t>(k));
    for (size_t ri = 0; ri < rows.size(); ++ri) {
        for (int64_t kk = 0; kk < k; ++kk) arow[kk] = a.get(rows[ri], kk);
        for (int64_t j = 0; j < n; ++j) {
            double s = 0;
            const double* bj = bt.data() + j * k;
            for (int64_t kk = 0; kk < k; ++kk) s += arow[kk] * bj[kk];
            out[ri * n + j] = s;
        }
    }
    return out;
}

void expect_matches(const HostMatrix& d, const std::vector<double>& ref, const std::vector<int64_t>& rows,
                    const Tolerance& tol, const std::string& what) {
    const int64_t n = d.cols;
    double num = 0, den = 0;
    for (double v : ref) den += v * v;
    const double rms = std::sqrt(den / static_cast<double>(std::max<size_t>(1, ref.size())));
    int64_t bad = 0, nan = 0, padding_hits = 0;
    std::string first_bad, first_padding;
    for (size_t ri = 0; ri < rows.size(); ++ri) {
        for (int64_t j = 0; j < n; ++j) {
            const double got = d.get(rows[ri], j);
            const double want = ref[ri * n + j];
            if (!std::isfinite(got)) {
                if (nan++ == 0 && first_bad.empty()) {
                    std::ostringstream os;
                    os << "non-finite at (" << rows[ri] << ", " << j << ")";
                    first_bad = os.str();
                }
                continue;
            }
            num += (got - want) * (got - want);
            if (std::fabs(got - want) > tol.elem_rel * std::fabs(want) + tol.elem_abs * rms) {
                if (bad++ == 0 && first_bad.empty()) {
                    std::ostringstream os;
                    os << "(" << rows[ri] << ", " << j << "): got " << got << ", want " << want;
                    first_bad = os.str();
                }
            }
        }
        for (int64_t j = n; j < d.ld; ++j) {  // the row padding past N must be untouched
            const uint8_t* p = d.bytes.data() + d.offset(rows[ri], j);
            const bool intact =
                dtype_bytes(d.dtype) == 2 ? std::memcmp(p, &kSentinel16, 2) == 0 : std::memcmp(p, &kSentinel32, 4) == 0;
            if (!intact && padding_hits++ == 0) {
                std::ostringstream os;
                os << "(" << rows[ri] << ", " << j << ")";
                first_padding = os.str();
            }
        }
    }
    EXPECT_EQ(padding_hits, 0) << what << ": row padding past N overwritten, first at " << first_padding;
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    EXPECT_EQ(nan, 0) << what << ": " << nan << " non-finite outputs (unwritten poison?), first " << first_bad;
    EXPECT_EQ(bad, 0) << what << ": " << bad << " elements out of tolerance, first " << first_bad << ", rel " << rel;
    EXPECT_LE(rel, tol.frob) << what << ": relative Frobenius error " << rel;
}

}  // namespace weft::gemm_test
