// SPDX-License-Identifier: MIT
// Helpers for the tensor-parallel op tests (ranks as threads): host matrices in bf16/f16 with seeded random
// content that every rank can regenerate, device buffers on the rank's stream, an fp64 reference and a
// comparison that reports the first bad element.
//
// NOTE: no device-synchronising call (cudaFree, cudaDeviceSynchronize, legacy-stream copies) may run while a
// peer could be waiting for this rank inside an op: buffers are made before the op and freed after it.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "weft/runtime/error.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::tp_test {

inline uint16_t float_to_bits(DType t, float x) {
    if (t == DType::kBF16) {
        uint32_t u;
        std::memcpy(&u, &x, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
        u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
        return static_cast<uint16_t>(u >> 16);
    }
    const __half_raw r = __float2half_rn(x);
    return r.x;
}

inline float bits_to_float(DType t, uint16_t b) {
    if (t == DType::kBF16) {
        const uint32_t u = static_cast<uint32_t>(b) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    __half_raw r;
    r.x = b;
    return __half2float(__half(r));
}

/// A fresh base seed per test run (printed by the tests' traces).
inline uint64_t fresh_seed() {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

/// A seed for (base, role, rank, call): every rank regenerates every rank's data.
inline uint64_t seed_of(uint64_t base, int role, int rank, int call) {
    return base ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(1 + role * 1000003 + rank * 1009 + call * 7));
}

/// A row-major 16-bit matrix on the host, row stride `ld` elements.
struct HostMat {
    int64_t rows = 0, cols = 0, ld = 0;
    DType dtype = DType::kBF16;
    std::vector<uint16_t> bits;

    HostMat() = default;
    HostMat(int64_t r, int64_t c, int64_t l, DType t) : rows(r), cols(c), ld(l), dtype(t) {
        bits.assign(static_cast<size_t>(std::max<int64_t>(1, r) * l), 0);
    }
    float at(int64_t r, int64_t c) const { return bits_to_float(dtype, bits[static_cast<size_t>(r * ld + c)]); }
    void set(int64_t r, int64_t c, float v) { bits[static_cast<size_t>(r * ld + c)] = float_to_bits(dtype, v); }
    void fill_random(uint64_t seed) {
        std::mt19937_64 rng(seed);
        std::uniform_real_distribution<float> u(-1.f, 1.f);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c) set(r, c, u(rng));
    }
    size_t bytes() const { return bits.size() * 2; }
};

/// A row stride (elements) for `cols` columns plus `pad`, rounded up to 16 bytes.
inline int64_t ld_for(int64_t cols, int64_t pad = 0) { return (cols + pad + 7) / 8 * 8; }

/// Device memory made before the op and freed after it (see the NOTE above).
struct DevBuf {
    void* ptr = nullptr;
    size_t bytes = 0;
    explicit DevBuf(size_t n) : bytes(n) { WEFT_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 256))); }
    ~DevBuf() {
        if (ptr != nullptr) cudaFree(ptr);
    }
    DevBuf(const DevBuf&) = delete;
    DevBuf& operator=(const DevBuf&) = delete;
};

inline void upload(const HostMat& h, void* dst, cudaStream_t s) {
    WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, h.bits.data(), h.bytes(), cudaMemcpyHostToDevice, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
}

inline void download(HostMat& h, const void* src, cudaStream_t s) {
    WEFT_CUDA_CHECK(cudaMemcpyAsync(h.bits.data(), src, h.bytes(), cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
}

inline TensorView view(const HostMat& h, void* dev) {
    return TensorView(dev, h.dtype, {h.rows, h.cols}, {h.ld, 1});
}

/// Output poison: NaN bits inside [rows, cols]; a sentinel in the row padding that must survive.
constexpr uint16_t kSentinel = 0x1234;
inline void poison(HostMat& h) {
    for (int64_t r = 0; r < h.rows; ++r)
        for (int64_t c = 0; c < h.ld; ++c) h.bits[static_cast<size_t>(r * h.ld + c)] = c < h.cols ? 0xFFFF : kSentinel;
}

/// Accumulates sum_j a[a_row0 + rows[i], j] * b[c, j] (b is [N, K]) in fp64 into ref [rows.size(), N].
inline void add_a_bt(const HostMat& a, int64_t a_row0, const std::vector<int64_t>& rows, const HostMat& b,
                     std::vector<double>& ref) {
    const int64_t k = a.cols, n = b.rows;
    std::vector<double> bt(static_cast<size_t>(n * k));
    for (int64_t c = 0; c < n; ++c)
        for (int64_t j = 0; j < k; ++j) bt[static_cast<size_t>(c * k + j)] = b.at(c, j);
    std::vector<double> arow(static_cast<size_t>(k));
    for (size_t i = 0; i < rows.size(); ++i) {
        for (int64_t j = 0; j < k; ++j) arow[static_cast<size_t>(j)] = a.at(a_row0 + rows[i], j);
        for (int64_t c = 0; c < n; ++c) {
            const double* bc = bt.data() + c * k;
            double s = 0;
            for (int64_t j = 0; j < k; ++j) s += arow[static_cast<size_t>(j)] * bc[j];
            ref[i * static_cast<size_t>(n) + static_cast<size_t>(c)] += s;
        }
    }
}

/// The rows of an [m, ...] output to check: all of them when m * work_per_row is small, else the first and
/// last rows of every block of `block` rows (rank shards or segments) and some random rows.
inline std::vector<int64_t> rows_to_check(int64_t m, int64_t block, double work_per_row, uint64_t seed) {
    std::vector<int64_t> rows;
    if (static_cast<double>(m) * work_per_row <= 64e6) {
        for (int64_t r = 0; r < m; ++r) rows.push_back(r);
        return rows;
    }
    for (int64_t b0 = 0; b0 < m; b0 += block) {
        for (int64_t r : {b0, b0 + 1, std::min(m, b0 + block) - 1}) {
            if (r < m && (rows.empty() || rows.back() != r)) rows.push_back(r);
        }
    }
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int64_t> u(0, m - 1);
    for (int i = 0; i < 24; ++i) rows.push_back(u(rng));
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    return rows;
}

/// Tolerance for an output of dtype t that sums `terms` separately rounded partials (1: a plain GEMM).
struct Tol {
    double elem_rel, elem_abs, frob;
};
inline Tol tol_for(DType t, int terms) {
    const double scale = 1.0 + terms / 4.0;
    if (t == DType::kBF16) return {1.0 / 128, scale / 256, 4e-3 * scale};
    return {1.0 / 1024, scale / 2048, 1e-3 * scale};
}

/// Compares rows `rows` of got [.., cols] against ref [rows.size(), cols]; checks NaN-freedom and that the
/// row padding kept its sentinel. Returns "" when it matches, else a description of what is wrong.
inline std::string compare(const HostMat& got, const std::vector<int64_t>& rows, const std::vector<double>& ref,
                           const Tol& tol) {
    double num = 0, den = 0;
    for (double v : ref) den += v * v;
    const double rms = std::sqrt(den / std::max<size_t>(1, ref.size()));
    int64_t bad = 0, nonfinite = 0, padding = 0;
    std::string first;
    for (size_t i = 0; i < rows.size(); ++i) {
        const int64_t r = rows[i];
        for (int64_t c = 0; c < got.ld; ++c) {
            const uint16_t b = got.bits[static_cast<size_t>(r * got.ld + c)];
            std::ostringstream here;
            if (c >= got.cols) {
                if (b != kSentinel && padding++ == 0 && first.empty()) {
                    here << "padding (" << r << ", " << c << ") overwritten";
                    first = here.str();
                }
                continue;
            }
            const double g = bits_to_float(got.dtype, b);
            const double w = ref[i * static_cast<size_t>(got.cols) + static_cast<size_t>(c)];
            if (!std::isfinite(g)) {
                if (nonfinite++ == 0 && first.empty()) {
                    here << "non-finite at (" << r << ", " << c << ")";
                    first = here.str();
                }
                continue;
            }
            num += (g - w) * (g - w);
            if (std::fabs(g - w) > tol.elem_rel * std::fabs(w) + tol.elem_abs * rms) {
                if (bad++ == 0 && first.empty()) {
                    here << "(" << r << ", " << c << "): got " << g << ", want " << w;
                    first = here.str();
                }
            }
        }
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    if (bad == 0 && nonfinite == 0 && padding == 0 && rel <= tol.frob) return "";
    std::ostringstream os;
    os << bad << " out of tolerance, " << nonfinite << " non-finite (unwritten poison?), " << padding
       << " padding elements overwritten, relative Frobenius error " << rel << " (rows checked " << rows.size()
       << "); first: " << first;
    return os.str();
}

/// Rank-thread failures collected for the main thread (gtest assertions from rank threads are allowed, but
/// an early return from one rank would leave its peers waiting in a collective).
struct Failures {
    std::mutex mutex;
    std::vector<std::string> messages;
    void add(const std::string& m) {
        std::lock_guard<std::mutex> lock(mutex);
        messages.push_back(m);
    }
    void report() {
        for (const auto& m : messages) ADD_FAILURE() << m;
    }
};

}  // namespace weft::tp_test
