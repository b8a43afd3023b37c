// SPDX-License-Identifier: MIT
// Host-side pieces shared by the GEMM GPU tests (nvcc instances and JIT): host matrices in the device's byte
// layout, device buffers, poison, the fp64 reference and the element-wise comparison.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "weft/common/dtype.hpp"
#include "weft/common/gemm_config.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::gemm_test {

bool have_sm90(std::string* why);  ///< false (and why) unless device 0 is an sm_90 GPU
int num_sms();                     ///< SMs of the current device
uint64_t fresh_seed();             ///< a new random seed per call
/// What `fn` throws as weft::Error (its what()), or "" when it returns.
std::string error_message(const std::function<void()>& fn);

/// Random draws for the tests that pick their cases at random (from one printed seed).
struct RandomDraw {
    std::mt19937_64 rng;
    explicit RandomDraw(uint64_t seed) : rng(seed) {}
    int64_t uniform(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }
    /// log-uniform in [lo, hi], lo >= 1: as many draws per octave
    int64_t log_uniform(int64_t lo, int64_t hi);
};

/// A row-major matrix on the host in the device's byte layout (row stride `ld` elements; bf16, f16 or f32).
struct HostMatrix {
    int64_t rows = 0, cols = 0, ld = 0;
    DType dtype = DType::kBF16;
    std::vector<uint8_t> bytes;

    HostMatrix(int64_t r, int64_t c, int64_t l, DType t);
    size_t offset(int64_t r, int64_t c) const { return static_cast<size_t>((r * ld + c) * dtype_bytes(dtype)); }
    float get(int64_t r, int64_t c) const;
    void set(int64_t r, int64_t c, float v);  ///< rounded to nearest into dtype
    void fill_random(std::mt19937_64& rng);   ///< uniform in [-1, 1), then rounded
};

/// cudaMalloc'd memory of at least 256 bytes (`bytes` is the size asked for); ptr is null if it failed.
struct DeviceBuffer {
    void* ptr = nullptr;
    size_t bytes = 0;
    explicit DeviceBuffer(size_t n);
    ~DeviceBuffer();
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

void upload(const HostMatrix& h, const DeviceBuffer& d);  ///< gtest assertion on failure
void download(HostMatrix& h, const DeviceBuffer& d);      ///< gtest assertion on failure
TensorView view(const HostMatrix& h, const DeviceBuffer& d);

/// Output poison: NaN inside [rows, cols]; a recognisable sentinel in the row padding (must survive the GEMM).
constexpr uint16_t kSentinel16 = 0x1234;
constexpr uint32_t kSentinel32 = 0x12345678u;
void poison(HostMatrix& d);

/// Relative Frobenius error bound and per-element bound |d - ref| <= rel * |ref| + abs * rms(ref), by dtype.
struct Tolerance {
    double frob, elem_rel, elem_abs;
};
Tolerance tolerance_for(DType out);

/// Rows `rows` of A * B in fp64 from the (already rounded) inputs; b is [N,K] (kNK) or [K,N] (kKN).
std::vector<double> reference(const HostMatrix& a, const HostMatrix& b, BLayout layout, int64_t n,
                              const std::vector<int64_t>& rows);

/// Compares rows `rows` of d with ref (gtest expectations naming `what`): the tolerance, NaN-freedom (unwritten
/// poison) and the row padding's sentinel.
void expect_matches(const HostMatrix& d, const std::vector<double>& ref, const std::vector<int64_t>& rows,
                    const Tolerance& tol, const std::string& what);

}  // namespace weft::gemm_test
