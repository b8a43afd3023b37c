// SPDX-License-Identifier: MIT
// Measured physical limits (peaks.hpp).
#include "common/peaks.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>

#include "common/cublaslt.hpp"
#include "common/data.hpp"
#include "common/json.hpp"
#include "common/timing.hpp"
#include "weft/runtime/error.hpp"

namespace weft::bench {
namespace {

constexpr size_t kCopyBytes = size_t{1} << 30;
constexpr size_t kReadBytes = size_t{4} << 30;
constexpr int64_t kTensorExtent = 8192;
constexpr int kWarmup = 2, kIters = 10;

__global__ void read_kernel(const uint4* p, int64_t n, uint32_t* sink) {
    uint32_t acc = 0;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const uint4 v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads alive
}

double measure_copy_tbs(cudaStream_t s) {
    DeviceBuffer src(kCopyBytes), dst(kCopyBytes);
    BENCH_CUDA(cudaMemsetAsync(src.ptr, 1, kCopyBytes, s));
    return 2.0 * copy_bytes_per_s(dst.ptr, src.ptr, kCopyBytes, s, kWarmup, kIters) / 1e12;
}

double measure_read_tbs(cudaStream_t s, int sms) {
    DeviceBuffer buf(kReadBytes), sink(256);
    BENCH_CUDA(cudaMemsetAsync(buf.ptr, 1, kReadBytes, s));
    const auto n = static_cast<int64_t>(kReadBytes / 16);
    const double ms = time_median_ms(s, kWarmup, kIters, [&](int) {
        read_kernel<<<sms * 8, 512, 0, s>>>(static_cast<const uint4*>(buf.ptr), n, static_cast<uint32_t*>(sink.ptr));
    });
    return static_cast<double>(kReadBytes) / (ms * 1e-3) / 1e12;
}

double measure_tensor_tflops(cudaStream_t s, DType t) {
    WEFT_CHECK(t == DType::kBF16 || t == DType::kF16, "tensor peak: dtype " << dtype_name(t) << " (bf16 or f16)");
    const int64_t e = kTensorExtent;
    const size_t bytes = static_cast<size_t>(e * e) * static_cast<size_t>(dtype_bytes(t));
    DeviceBuffer a(bytes), b(bytes), d(bytes);
    fill_random(a.ptr, e * e, t, 0x5eed0001ull, s);
    fill_random(b.ptr, e * e, t, 0x5eed0002ull, s);
    CublasLt lt(size_t{64} << 20);
    const LtGemm g(lt.handle(), t, t, LtLayout::kNK, LtGemm::Shape{e, e, e, e, e, e}, lt.workspace(),
                   lt.workspace_bytes(), LtGemm::kMaxAlgos);
    double best_ms = 0;
    for (size_t algo = 0; algo < g.num_algos(); ++algo) {
        double ms = 0;
        try {
            ms = time_median_ms(s, kWarmup, kIters, [&](int) { g.run(algo, a.ptr, b.ptr, d.ptr, s); });
        } catch (const Error&) {
            (void)cudaGetLastError();
            continue;  // an algorithm that fails to run is skipped
        }
        if (best_ms == 0 || ms < best_ms) best_ms = ms;
    }
    WEFT_CHECK(best_ms > 0, "tensor peak: no cuBLASLt algorithm ran");
    return 2.0 * static_cast<double>(e) * static_cast<double>(e) * static_cast<double>(e) / (best_ms * 1e-3) / 1e12;
}

}  // namespace

double copy_bytes_per_s(void* dst, const void* src, size_t bytes, cudaStream_t stream, int warmup, int iters) {
    const double ms = time_median_ms(
        stream, warmup, iters, [&](int) { BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream)); });
    return static_cast<double>(bytes) / (ms * 1e-3);
}

namespace {
__global__ void read_pair_kernel(const uint4* a, const uint4* b, int64_t n, uint32_t* sink) {
    uint32_t acc = 0;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const uint4 v = a[i];
        const uint4 w = b[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w ^ w.x ^ w.y ^ w.z ^ w.w;
    }
    if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads alive
}
}  // namespace

double read_pair_us(const void* a, const void* b, size_t bytes, size_t stride, int rotations, cudaStream_t stream,
                    int warmup, int iters) {
    WEFT_CHECK(bytes % 16 == 0 && stride % 16 == 0 && rotations >= 1,
               "read_pair_us: bytes and stride must be multiples of 16, rotations >= 1");
    int device = 0, sms = 0;
    BENCH_CUDA(cudaGetDevice(&device));
    BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    DeviceBuffer sink(256);
    const auto n = static_cast<int64_t>(bytes / 16);
    // As many blocks as the read needs, up to 4 per SM of 512 threads: one wave, all resident (a second wave of
    // blocks would start late and leave a tail that a 4 GiB read hides but a small one does not).
    const int64_t blocks = std::min<int64_t>(static_cast<int64_t>(sms) * 4, std::max<int64_t>(1, (n + 511) / 512));
    const double ms = time_batch_ms(stream, warmup, iters, [&](int i) {
        const size_t at = static_cast<size_t>(i % rotations) * stride;
        read_pair_kernel<<<static_cast<unsigned>(blocks), 512, 0, stream>>>(
            reinterpret_cast<const uint4*>(static_cast<const char*>(a) + at),
            reinterpret_cast<const uint4*>(static_cast<const char*>(b) + at), n, static_cast<uint32_t*>(sink.ptr));
    });
    return ms * 1e3;
}

namespace {

/// WEFT_BENCH_PEAKS ("copy=4.1,read=4.5,tensor=824": TB/s, TB/s, TFLOP/s; any subset): limits given instead of
/// measured, so that a profiler sees only the benchmark's own kernels. Sets the given ones in `p` and returns the kinds
/// it set.
unsigned given_peaks(Peaks& p) {
    const char* env = std::getenv("WEFT_BENCH_PEAKS");
    if (env == nullptr || *env == '\0') return 0;
    unsigned given = 0;
    std::istringstream in(env);
    std::string item;
    while (std::getline(in, item, ',')) {
        const size_t eq = item.find('=');
        const std::string key = item.substr(0, eq);
        char* end = nullptr;
        const double v = eq == std::string::npos ? 0 : std::strtod(item.c_str() + eq + 1, &end);
        WEFT_CHECK(
            eq != std::string::npos && end != nullptr && *end == '\0' && v > 0,
            "WEFT_BENCH_PEAKS: expected copy=TB/s,read=TB/s,tensor=TFLOP/s (positive numbers), got '" << env << "'");
        if (key == "copy") {
            p.copy_tbs = v;
            given |= kPeakCopy;
        } else if (key == "read") {
            p.read_tbs = v;
            given |= kPeakRead;
        } else if (key == "tensor") {
            p.tensor_tflops = v;
            given |= kPeakTensor;
        } else {
            WEFT_FAIL("WEFT_BENCH_PEAKS: unknown limit '" << key << "' (copy, read or tensor), in '" << env << "'");
        }
    }
    return given;
}

}  // namespace

Peaks measure_peaks(unsigned which, DType tensor_dtype, int device) {
    Peaks p;
    p.device = device;
    p.tensor_dtype = tensor_dtype;
    p.given = given_peaks(p) & which;
    which &= ~p.given;
    BENCH_CUDA(cudaSetDevice(device));
    cudaDeviceProp prop{};
    BENCH_CUDA(cudaGetDeviceProperties(&prop, device));
    p.gpu = prop.name;
    cudaStream_t s = nullptr;
    BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    try {
        if (which & kPeakCopy) p.copy_tbs = measure_copy_tbs(s);
        if (which & kPeakRead) p.read_tbs = measure_read_tbs(s, prop.multiProcessorCount);
        if (which & kPeakTensor) p.tensor_tflops = measure_tensor_tflops(s, tensor_dtype);
    } catch (...) {
        cudaStreamDestroy(s);
        throw;
    }
    BENCH_CUDA(cudaStreamSynchronize(s));
    BENCH_CUDA(cudaStreamDestroy(s));
    return p;
}

std::string describe(const Peaks& p) {
    // Each limit names where it came from when WEFT_BENCH_PEAKS gave any.
    std::string out = (p.given != 0 ? "GPU " : "measured on GPU ") + std::to_string(p.device) + ":";
    constexpr const char* kGiven = "given by WEFT_BENCH_PEAKS";
    char buf[128];
    const char* sep = " ";
    if (p.copy_tbs > 0) {
        std::snprintf(buf, sizeof(buf), "%sD2D copy %.2f TB/s (%s)", sep, p.copy_tbs,
                      p.given & kPeakCopy ? kGiven : "read + write, cudaMemcpyAsync of 1 GiB");
        out += buf;
        sep = ", ";
    }
    if (p.read_tbs > 0) {
        std::snprintf(buf, sizeof(buf), "%sread %.2f TB/s (%s)", sep, p.read_tbs,
                      p.given & kPeakRead ? kGiven : "16-byte loads over 4 GiB");
        out += buf;
        sep = ", ";
    }
    if (p.tensor_tflops > 0) {
        std::snprintf(buf, sizeof(buf), "%s%s tensor peak %.0f TFLOP/s (%s)", sep, dtype_name(p.tensor_dtype),
                      p.tensor_tflops, p.given & kPeakTensor ? kGiven : "cuBLASLt, random 8192^3");
        out += buf;
    }
    return out;
}

void add_peaks(Json& j, const Peaks& p) {
    j.key("peaks").begin_object(true).field("device", p.device).field("gpu", p.gpu);
    if (p.copy_tbs > 0) j.field("copy_tbs", p.copy_tbs);
    if (p.read_tbs > 0) j.field("read_tbs", p.read_tbs);
    if (p.tensor_tflops > 0)
        j.field("tensor_tflops", p.tensor_tflops).field("tensor_dtype", dtype_name(p.tensor_dtype));
    j.end_object();
}

}  // namespace weft::bench
