// SPDX-License-Identifier: MIT
// weft_bench_gemm: TFLOP/s of weft::ops::gemm and of cuBLASLt (best of its heuristic algorithms) on the same
// random inputs in the same run, rotating input buffers to keep L2 cold, CUDA events, median; a fixed table
// with the roofline, and JSON.
//
//   weft_bench_gemm [--sizes MxNxK,...] [--iters N] [--warmup N] [--dtype bf16|f16] [--out same|f32]
//                   [--layout nk|kn|both] [--all-configs] [--check] [--json FILE]
//                   [--small-m-variant 3|4] [--small-m-splits S] [--small-m-max-m M] [--chain L]
// --small-m-variant / --small-m-splits / --small-m-max-m set GemmOptions for the op's own row (the one --check
// compares with cuBLAS); forcing a variant or a split count also sets small_m_max_m to 64 (unless
// --small-m-max-m says otherwise), so that M 17..64 measure the small-M kernels (3: GemvVariant::kTmaRing, 4:
// kBulkRows); --all-configs adds a row per tiled candidate and, for M <= 64 with B [N,K], per small-M kernel that
// can serve the shape (variant 3 at every split count listed, variant 4). The kernels come from weft::jit: from the
// headers that WEFT_HOME names (cached in WEFT_CACHE_DIR), so kernels edited in another source tree run against the
// same host code and the same cuBLASLt.
// --chain L adds, for every shape the op may launch programmatically (the small-M variants 3 and 4), the time per
// call of chains of L calls back to back on one stream (a decode step's layers), each call on the next input set,
// with no event between them: weft launched plainly, weft with GemmOptions::programmatic_launch, and cuBLASLt; the
// three chains alternate round by round.
#include <cublasLt.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_timing.cuh"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/runtime/error.hpp"

namespace {

using weft::BLayout;
using weft::DType;
using weft::GemmConfig;
using weft::bench::time_median_ms;
using weft::bench::time_rounds_ms;

#define BENCH_LT(call)                                                                                     \
    do {                                                                                                   \
        cublasStatus_t s_ = (call);                                                                        \
        if (s_ != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(#call) + ": status " +        \
                                                                  std::to_string(static_cast<int>(s_))); \
    } while (0)

struct Shape {
    int64_t m, n, k;
};

struct Options {
    std::vector<Shape> sizes;
    int iters = 30;
    int warmup = 5;
    DType in = DType::kBF16;
    bool out_f32 = false;
    std::vector<BLayout> layouts = {BLayout::kNK};
    bool all_configs = false;
    bool check = false;
    std::string json;
    std::optional<weft::GemvVariant> small_m_variant;  // unset: the op's default
    int small_m_splits = 0;    // 0: the op's heuristic
    int small_m_max_m = -1;    // -1: the op's default (kGemvMaxM when a variant or split count is forced)
    int chain = 0;  // --chain L: also time chains of L calls (0: no chains)
};

std::vector<Shape> default_sizes() {
    std::vector<Shape> s = {{8192, 8192, 8192}, {4096, 4096, 4096}};
    for (auto nk : {Shape{0, 1376, 4096}, Shape{0, 1792, 4096}, Shape{0, 3584, 8192}, Shape{0, 6656, 16384},
                    Shape{0, 3696, 8192}, Shape{0, 4096, 1376}, Shape{0, 4096, 1792}, Shape{0, 8192, 3584},
                    Shape{0, 16384, 6656}, Shape{0, 8192, 3696}}) {
        s.push_back({8192, nk.n, nk.k});
    }
    for (int64_t m : {1, 16, 128, 1024}) s.push_back({m, 8192, 8192});
    return s;
}

Options parse(int argc, char** argv) {
    Options o;
    o.sizes = default_sizes();
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto next = [&]() -> std::string {
            if (i + 1 >= argc) throw std::runtime_error("missing value after " + a);
            return argv[++i];
        };
        if (a == "--sizes") {
            o.sizes.clear();
            std::stringstream ss(next());
            std::string item;
            while (std::getline(ss, item, ',')) {
                Shape s{};
                if (std::sscanf(item.c_str(), "%ldx%ldx%ld", &s.m, &s.n, &s.k) != 3) {
                    throw std::runtime_error("--sizes takes MxNxK[,MxNxK...], got " + item);
                }
                o.sizes.push_back(s);
            }
        } else if (a == "--iters") {
            o.iters = std::max(1, std::stoi(next()));
        } else if (a == "--warmup") {
            o.warmup = std::max(0, std::stoi(next()));
        } else if (a == "--dtype") {
            const std::string v = next();
            if (v == "bf16") o.in = DType::kBF16;
            else if (v == "f16") o.in = DType::kF16;
            else throw std::runtime_error("--dtype takes bf16 or f16, got " + v);
        } else if (a == "--out") {
            const std::string v = next();
            if (v != "same" && v != "f32") throw std::runtime_error("--out takes same or f32, got " + v);
            o.out_f32 = v == "f32";
        } else if (a == "--layout") {
            const std::string v = next();
            if (v == "nk") o.layouts = {BLayout::kNK};
            else if (v == "kn") o.layouts = {BLayout::kKN};
            else if (v == "both") o.layouts = {BLayout::kNK, BLayout::kKN};
            else throw std::runtime_error("--layout takes nk, kn or both, got " + v);
        } else if (a == "--all-configs") {
            o.all_configs = true;
        } else if (a == "--check") {
            o.check = true;
        } else if (a == "--json") {
            o.json = next();
        } else if (a == "--small-m-variant") {
            const std::string v = next();
            if (v == "3") o.small_m_variant = weft::GemvVariant::kTmaRing;
            else if (v == "4") o.small_m_variant = weft::GemvVariant::kBulkRows;
            else throw std::runtime_error("--small-m-variant takes 3 (TMA ring) or 4 (bulk-copied rows), got " + v);
        } else if (a == "--small-m-splits") {
            o.small_m_splits = std::stoi(next());
            if (o.small_m_splits < 0) throw std::runtime_error("--small-m-splits takes a count >= 0 (0 = heuristic)");
        } else if (a == "--small-m-max-m") {
            o.small_m_max_m = std::stoi(next());
            if (o.small_m_max_m < 0 || o.small_m_max_m > weft::kGemvMaxM) {
                throw std::runtime_error("--small-m-max-m takes 0.." + std::to_string(weft::kGemvMaxM) + ", got " +
                                         std::to_string(o.small_m_max_m));
            }
        } else if (a == "--chain") {
            o.chain = std::stoi(next());
            if (o.chain < 0) throw std::runtime_error("--chain takes a call count >= 0 (0 = no chains)");
        } else if (a == "--world") {
            (void)next();  // shared command line: a single-GPU GEMM ignores the world size
        } else if (a == "--help" || a == "-h") {
            std::printf(
                "weft_bench_gemm [--sizes MxNxK,...] [--iters N] [--warmup N] [--dtype bf16|f16] [--out same|f32]\n"
                "                [--layout nk|kn|both] [--all-configs] [--check] [--json FILE]\n"
                "                [--small-m-variant 3|4] [--small-m-splits S] [--small-m-max-m M]\n"
                "                [--chain L]\n");
            std::exit(0);
        } else {
            throw std::runtime_error("unknown option " + a + " (see --help)");
        }
    }
    return o;
}

// Uniform [-1, 1) in bf16/f16 from a hash of (seed, index): random data, never zeros.
__global__ void fill_random_kernel(uint16_t* p, int64_t n, uint64_t seed, int is_bf16) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        uint64_t x = (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull ^ seed;
        x ^= x >> 31;
        x *= 0xBF58476D1CE4E5B9ull;
        x ^= x >> 29;
        const float u = static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
        uint16_t h;
        if (is_bf16) {
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(u));
        } else {
            asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(u));
        }
        p[i] = h;
    }
}

__global__ void read_bw_kernel(const uint4* p, int64_t n, uint32_t* sink) {
    uint32_t acc = 0;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const uint4 v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads alive
}

struct Buffer {
    void* ptr = nullptr;
    explicit Buffer(size_t bytes) { BENCH_CUDA(cudaMalloc(&ptr, std::max<size_t>(bytes, 256))); }
    ~Buffer() { cudaFree(ptr); }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
};

double measure_read_bw_tbs() {
    const size_t bytes = size_t{4} << 30;
    Buffer buf(bytes), sink(256);
    BENCH_CUDA(cudaMemset(buf.ptr, 1, bytes));
    int sms = 0;
    BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int64_t n = static_cast<int64_t>(bytes / 16);
    const double ms = time_median_ms(2, 10, [&](int) {
        read_bw_kernel<<<sms * 8, 512>>>(static_cast<const uint4*>(buf.ptr), n, static_cast<uint32_t*>(sink.ptr));
    });
    return static_cast<double>(bytes) / (ms * 1e-3) / 1e12;
}

cudaDataType cuda_type(DType t) { return t == DType::kBF16 ? CUDA_R_16BF : t == DType::kF16 ? CUDA_R_16F : CUDA_R_32F; }

/// cuBLASLt's D^T = op(B) * A^T (column-major view of row-major D = A * B), best algorithm by measurement.
class LtGemm {
public:
    LtGemm(cublasLtHandle_t h, const Shape& s, BLayout layout, DType in, DType out, void* ws, size_t ws_bytes)
        : h_(h), ws_(ws), ws_bytes_(ws_bytes) {
        BENCH_LT(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const cublasOperation_t ta = layout == BLayout::kNK ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
        BENCH_LT(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
        BENCH_LT(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
        const uint64_t m = s.m, n = s.n, k = s.k;
        if (layout == BLayout::kNK) {
            BENCH_LT(cublasLtMatrixLayoutCreate(&la_, cuda_type(in), k, n, k));
        } else {
            BENCH_LT(cublasLtMatrixLayoutCreate(&la_, cuda_type(in), n, k, n));
        }
        BENCH_LT(cublasLtMatrixLayoutCreate(&lb_, cuda_type(in), k, m, k));
        BENCH_LT(cublasLtMatrixLayoutCreate(&ld_, cuda_type(out), n, m, n));
        cublasLtMatmulPreference_t pref;
        BENCH_LT(cublasLtMatmulPreferenceCreate(&pref));
        BENCH_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes_,
                                                      sizeof(ws_bytes_)));
        int found = 0;
        BENCH_LT(cublasLtMatmulAlgoGetHeuristic(h_, desc_, la_, lb_, ld_, ld_, pref, kMaxAlgos, algos_, &found));
        num_algos_ = static_cast<size_t>(found);
        cublasLtMatmulPreferenceDestroy(pref);
        if (num_algos_ == 0) throw std::runtime_error("cuBLASLt found no algorithm");
    }
    ~LtGemm() {
        cublasLtMatrixLayoutDestroy(la_);
        cublasLtMatrixLayoutDestroy(lb_);
        cublasLtMatrixLayoutDestroy(ld_);
        cublasLtMatmulDescDestroy(desc_);
    }
    size_t num_algos() const { return num_algos_; }
    /// The algorithm's configuration as cuBLASLt reports it (cublasLtMatmulAlgoConfigAttributes_t ids; tile and
    /// cluster shape are the enums cublasLtMatmulTile_t and cublasLtClusterShape_t).
    std::string describe(size_t algo) const {
        // Each attribute is read at its documented width (the tile, stages and cluster ids are uint16_t).
        auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr, size_t bytes) {
            uint32_t v = 0;
            size_t written = 0;
            if (cublasLtMatmulAlgoConfigGetAttribute(&algos_[algo].algo, attr, &v, bytes, &written) !=
                CUBLAS_STATUS_SUCCESS) {
                return std::string("?");
            }
            return std::to_string(bytes == 2 ? (v & 0xffffu) : v);
        };
        return "id " + get(CUBLASLT_ALGO_CONFIG_ID, 4) + " tile " + get(CUBLASLT_ALGO_CONFIG_TILE_ID, 2) + " stages " +
               get(CUBLASLT_ALGO_CONFIG_STAGES_ID, 2) + " cluster " + get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 2) +
               " splitk " + get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 4) + " reduction " +
               get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, 4) + " swizzle " + get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, 4) +
               " waves " + std::to_string(algos_[algo].wavesCount);
    }
    void run(size_t algo, const void* a, const void* b, void* d) const {
        const float alpha = 1.f, beta = 0.f;
        BENCH_LT(cublasLtMatmul(h_, desc_, &alpha, b, la_, a, lb_, &beta, d, ld_, d, ld_, &algos_[algo].algo, ws_,
                                ws_bytes_, nullptr));
    }

private:
    cublasLtHandle_t h_;
    void* ws_;
    size_t ws_bytes_;
    cublasLtMatmulDesc_t desc_{};
    cublasLtMatrixLayout_t la_{}, lb_{}, ld_{};
    // WAR(CUDA 13.0): nvcc's front end crashes on std::vector<cublasLtMatmulHeuristicResult_t>.
    static constexpr int kMaxAlgos = 8;
    cublasLtMatmulHeuristicResult_t algos_[kMaxAlgos] = {};
    size_t num_algos_ = 0;
};

std::string config_label(const GemmConfig& c) {
    std::ostringstream os;
    os << c.tile_m << "x" << c.tile_n << "s" << c.stages;
    if (c.cluster_m > 1) os << "cm" << c.cluster_m;
    if (c.cluster_n > 1) os << "cn" << c.cluster_n;
    if (c.pingpong) os << "pp";
    return os.str();
}

struct Views {
    weft::TensorView a, b, d;
};

struct Row {
    Shape s;
    BLayout layout;
    std::string path;
    double weft_us = 0, cublas_us = 0, roof_us = 0;
    double rel_err = -1;
    bool best = false;   // the op's own choice (auto)
    bool chain = false;  // time per call of a chain (--chain), in the summary beside the op's row
};

double tflops(const Shape& s, double us) { return 2.0 * s.m * s.n * s.k / (us * 1e-6) / 1e12; }

}  // namespace

int main(int argc, char** argv) {
    try {
        const Options opt = parse(argc, argv);
        cudaDeviceProp prop{};
        BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
        const DType out = opt.out_f32 ? DType::kF32 : opt.in;
        const int out_bytes = weft::dtype_bytes(out);
        const double read_bw = measure_read_bw_tbs();
        const double peak_tflops = 989.0;  // dense bf16/f16 datasheet rate (H100/H200 SXM): a lead, not a measurement
        char date[32];
        const std::time_t now = std::time(nullptr);
        std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
        std::printf("# weft_bench_gemm %s  GPU %s (%d SMs, %.0f MB L2)  in %s out %s  iters %d warmup %d\n", date,
                    prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, weft::dtype_name(opt.in),
                    weft::dtype_name(out), opt.iters, opt.warmup);
        std::printf("# measured read bandwidth %.2f TB/s; roofline = max(2MNK / %.0f TFLOP/s, bytes / read BW)\n",
                    read_bw, peak_tflops);
        std::printf("# weft and cuBLASLt (best of its heuristic algorithms) alternate launch by launch; medians\n");

        cublasLtHandle_t lt;
        BENCH_LT(cublasLtCreate(&lt));
        const size_t ws_bytes = size_t{64} << 20;
        Buffer lt_ws(ws_bytes);
        std::vector<Row> rows;
        for (BLayout layout : opt.layouts) {
            for (const Shape& s : opt.sizes) {
                const size_t in_bytes = weft::dtype_bytes(opt.in);
                const size_t a_bytes = static_cast<size_t>(s.m * s.k) * in_bytes;
                const size_t b_bytes = static_cast<size_t>(s.n * s.k) * in_bytes;
                const size_t d_bytes = static_cast<size_t>(s.m * s.n) * out_bytes;
                // Enough input sets that one pass over them is > 3x the L2: every iteration reads from DRAM.
                const size_t set_bytes = a_bytes + b_bytes;
                const int sets = static_cast<int>(
                    std::clamp<size_t>((3 * static_cast<size_t>(prop.l2CacheSize) + set_bytes - 1) / set_bytes, 2, 32));
                std::vector<std::unique_ptr<Buffer>> as, bs;
                for (int i = 0; i < sets; ++i) {
                    as.push_back(std::make_unique<Buffer>(a_bytes));
                    bs.push_back(std::make_unique<Buffer>(b_bytes));
                    fill_random_kernel<<<1024, 256>>>(static_cast<uint16_t*>(as.back()->ptr), s.m * s.k,
                                                      0x1234567ull + 977ull * i, opt.in == DType::kBF16);
                    fill_random_kernel<<<1024, 256>>>(static_cast<uint16_t*>(bs.back()->ptr), s.n * s.k,
                                                      0xABCDEFull + 131ull * i, opt.in == DType::kBF16);
                }
                BENCH_CUDA(cudaGetLastError());
                Buffer d_weft(d_bytes), d_lt(d_bytes);
                BENCH_CUDA(cudaDeviceSynchronize());
                auto views = [&](int i, void* d) {
                    const int set = i % sets;
                    Views v;
                    v.a = weft::TensorView(as[set]->ptr, opt.in, {s.m, s.k});
                    v.b = layout == BLayout::kNK ? weft::TensorView(bs[set]->ptr, opt.in, {s.n, s.k})
                                                 : weft::TensorView(bs[set]->ptr, opt.in, {s.k, s.n});
                    v.d = weft::TensorView(d, out, {s.m, s.n});
                    return v;
                };
                const double flops = 2.0 * s.m * s.n * s.k;
                const double bytes = static_cast<double>(a_bytes + b_bytes + d_bytes);
                const double roof_us = std::max(flops / (peak_tflops * 1e12), bytes / (read_bw * 1e12)) * 1e6;

                // cuBLASLt: time each heuristic algorithm briefly, keep the best, then time it fully.
                LtGemm g(lt, s, layout, opt.in, out, lt_ws.ptr, ws_bytes);
                size_t best_algo = 0;
                double best_ms = 1e30;
                for (size_t al = 0; al < g.num_algos(); ++al) {
                    double ms = 1e30;
                    try {
                        ms = time_median_ms(2, std::min(opt.iters, 7), [&](int i) {
                            const Views v = views(i, d_lt.ptr);
                            g.run(al, v.a.data, v.b.data, v.d.data);
                        });
                    } catch (const std::exception&) {
                        continue;  // an algorithm that fails to run is skipped
                    }
                    if (ms < best_ms) {
                        best_ms = ms;
                        best_algo = al;
                    }
                }

                std::printf("# cuBLASLt %ldx%ldx%ld %s: algorithm %zu of %zu, %s\n", s.m, s.n, s.k,
                            layout == BLayout::kNK ? "NK" : "KN", best_algo, g.num_algos(), g.describe(best_algo).c_str());
                auto run_weft = [&](weft::ops::GemmOptions o, const std::string& label, bool is_auto) {
                    Row r;
                    r.s = s;
                    r.layout = layout;
                    r.path = label;
                    r.best = is_auto;
                    r.roof_us = roof_us;
                    // Launch j (weft and cuBLAS alternate) reads input set j % sets: no launch finds the
                    // previous launch's inputs in L2.
                    const auto [weft_ms, lt_ms] = time_rounds_ms(
                        opt.warmup, opt.iters,
                        [&](int i) {
                            const Views v = views(2 * i, d_weft.ptr);
                            weft::ops::gemm(v.a, v.b, v.d, layout, nullptr, o);
                        },
                        [&](int i) {
                            const Views v = views(2 * i + 1, d_lt.ptr);
                            g.run(best_algo, v.a.data, v.b.data, v.d.data);
                        });
                    r.weft_us = 1e3 * weft_ms;
                    r.cublas_us = 1e3 * lt_ms;
                    BENCH_CUDA(cudaGetLastError());
                    if (opt.check && is_auto) {
                        const Views v = views(0, d_weft.ptr);
                        weft::ops::gemm(v.a, v.b, v.d, layout, nullptr, o);
                        const Views w = views(0, d_lt.ptr);
                        g.run(best_algo, w.a.data, w.b.data, w.d.data);
                        BENCH_CUDA(cudaDeviceSynchronize());
                        const size_t count = static_cast<size_t>(s.m * s.n);
                        std::vector<uint16_t> x16, y16;
                        std::vector<float> x32, y32;
                        double num = 0, den = 0;
                        if (out == DType::kF32) {
                            x32.resize(count);
                            y32.resize(count);
                            BENCH_CUDA(cudaMemcpy(x32.data(), d_weft.ptr, d_bytes, cudaMemcpyDeviceToHost));
                            BENCH_CUDA(cudaMemcpy(y32.data(), d_lt.ptr, d_bytes, cudaMemcpyDeviceToHost));
                            for (size_t i = 0; i < count; ++i) {
                                num += (x32[i] - y32[i]) * static_cast<double>(x32[i] - y32[i]);
                                den += y32[i] * static_cast<double>(y32[i]);
                            }
                        } else {
                            x16.resize(count);
                            y16.resize(count);
                            BENCH_CUDA(cudaMemcpy(x16.data(), d_weft.ptr, d_bytes, cudaMemcpyDeviceToHost));
                            BENCH_CUDA(cudaMemcpy(y16.data(), d_lt.ptr, d_bytes, cudaMemcpyDeviceToHost));
                            auto f = [&](uint16_t h) {
                                if (opt.in == DType::kBF16) {
                                    const uint32_t u = static_cast<uint32_t>(h) << 16;
                                    float v;
                                    std::memcpy(&v, &u, 4);
                                    return static_cast<double>(v);
                                }
                                __half hh;
                                std::memcpy(&hh, &h, 2);
                                return static_cast<double>(__half2float(hh));
                            };
                            for (size_t i = 0; i < count; ++i) {
                                const double xv = f(x16[i]), yv = f(y16[i]);
                                num += (xv - yv) * (xv - yv);
                                den += yv * yv;
                            }
                        }
                        r.rel_err = std::isfinite(num) ? std::sqrt(num / den) : INFINITY;
                    }
                    rows.push_back(r);
                };
                // The op as a user calls it (heuristic path and config).
                {
                    const Views v0 = views(0, d_weft.ptr);
                    const weft::ops::GemmProblem p = weft::ops::validate_gemm_args(v0.a, v0.b, v0.d, layout);
                    weft::ops::GemmOptions o;
                    o.small_m_variant = opt.small_m_variant;
                    o.small_m_splits = opt.small_m_splits;
                    const bool forced = opt.small_m_variant.has_value() || opt.small_m_splits > 0;
                    if (forced) o.small_m_max_m = weft::kGemvMaxM;
                    if (opt.small_m_max_m >= 0) o.small_m_max_m = opt.small_m_max_m;
                    const auto plan = weft::ops::plan_gemm(p, prop.multiProcessorCount, o);
                    const std::string label = plan.path == weft::ops::GemmPath::kSmallM
                                                  ? std::string(forced ? "opt:" : "auto:") + "smallM.v" +
                                                        std::to_string(static_cast<int>(plan.small_m_variant)) + "/s" +
                                                        std::to_string(plan.small_m_splits)
                                                  : "auto:" + config_label(plan.config);
                    run_weft(o, label, true);
                    weft::ops::GemmOptions pdl = o;
                    pdl.programmatic_launch = true;
                    if (opt.chain > 0 && weft::ops::gemm_launches_programmatically(plan, pdl)) {
                        // Chains of opt.chain calls, each on the next input set: plain, programmatic, cuBLASLt.
                        const int L = opt.chain;
                        const auto [plain_ms, pdl_ms, lt_ms] = time_rounds_ms(
                            std::max(1, opt.warmup / 2), opt.iters,
                            [&](int i) {
                                for (int j = 0; j < L; ++j) {
                                    const Views v = views(3 * L * i + j, d_weft.ptr);
                                    weft::ops::gemm(v.a, v.b, v.d, layout, nullptr, o);
                                }
                            },
                            [&](int i) {
                                for (int j = 0; j < L; ++j) {
                                    const Views v = views(3 * L * i + L + j, d_weft.ptr);
                                    weft::ops::gemm(v.a, v.b, v.d, layout, nullptr, pdl);
                                }
                            },
                            [&](int i) {
                                for (int j = 0; j < L; ++j) {
                                    const Views v = views(3 * L * i + 2 * L + j, d_lt.ptr);
                                    g.run(best_algo, v.a.data, v.b.data, v.d.data);
                                }
                            });
                        BENCH_CUDA(cudaGetLastError());
                        using Tagged = std::pair<const char*, double>;
                        for (const auto& [tag, ms] : {Tagged{"plain", plain_ms}, Tagged{"pdl", pdl_ms}}) {
                            Row r;
                            r.s = s;
                            r.layout = layout;
                            r.path = "chain" + std::to_string(L) + ":" + tag;
                            r.chain = true;
                            r.roof_us = roof_us;
                            r.weft_us = 1e3 * ms / L;
                            r.cublas_us = 1e3 * lt_ms / L;
                            rows.push_back(r);
                        }
                    }
                }
                if (opt.all_configs) {
                    for (const GemmConfig& c : weft::ops::gemm_candidate_configs(opt.in, out, layout)) {
                        weft::ops::GemmOptions o;
                        o.config = c;
                        run_weft(o, config_label(c), false);
                    }
                    if (s.m <= weft::kGemvMaxM && layout == BLayout::kNK) {
                        for (int splits : {1, 2, 3, 4, 8, 16}) {
                            weft::ops::GemmOptions o;
                            o.small_m_splits = splits;
                            o.small_m_variant = weft::GemvVariant::kTmaRing;
                            o.small_m_max_m = weft::kGemvMaxM;
                            run_weft(o, "smallM.v3/s" + std::to_string(splits), false);
                        }
                        const Views v0 = views(0, d_weft.ptr);
                        const auto p = weft::ops::validate_gemm_args(v0.a, v0.b, v0.d, layout);
                        if (weft::ops::gemv_rows_unsupported(p).empty()) {
                            weft::ops::GemmOptions o;
                            o.small_m_variant = weft::GemvVariant::kBulkRows;
                            run_weft(o, "smallM.v4/s1", false);
                        }
                    }
                }
                // Print this shape's rows now (a killed run still shows what it measured).
                for (const Row& r : rows) {
                    if (r.s.m != s.m || r.s.n != s.n || r.s.k != s.k || r.layout != layout) continue;
                    char shape[48];
                    std::snprintf(shape, sizeof(shape), "%ldx%ldx%ld", r.s.m, r.s.n, r.s.k);
                    const double b_gbs = static_cast<double>(b_bytes) / (r.weft_us * 1e-6) / 1e9;
                    std::printf("%-20s %-3s %-22s %9.1f %9.1f %7.3f %9.1f %9.2f %9.2f %8.0f %6.1f%% %s\n", shape,
                                layout == BLayout::kNK ? "NK" : "KN", r.path.c_str(), tflops(r.s, r.weft_us),
                                tflops(r.s, r.cublas_us), r.cublas_us / r.weft_us, tflops(r.s, r.roof_us), r.weft_us,
                                r.cublas_us, b_gbs, 100.0 * b_gbs / (read_bw * 1e3),
                                r.rel_err >= 0 ? ("err " + std::to_string(r.rel_err)).c_str() : "");
                }
                std::fflush(stdout);
            }
        }
        // The fixed summary table: the op's own choice per shape.
        std::printf("\n%-20s %-3s %-22s %9s %9s %7s %9s %9s %9s %8s %7s\n", "shape (MxNxK)", "B", "path/config",
                    "weft TF/s", "cuBLAS", "ratio", "roof TF/s", "weft us", "cuBLAS us", "B GB/s", "%readBW");
        for (const Row& r : rows) {
            if (!r.best && !r.chain) continue;
            char shape[48];
            std::snprintf(shape, sizeof(shape), "%ldx%ldx%ld", r.s.m, r.s.n, r.s.k);
            const double b_gbs = static_cast<double>(r.s.n * r.s.k * weft::dtype_bytes(opt.in)) / (r.weft_us * 1e-6) / 1e9;
            std::printf("%-20s %-3s %-22s %9.1f %9.1f %7.3f %9.1f %9.2f %9.2f %8.0f %6.1f%%\n", shape,
                        r.layout == BLayout::kNK ? "NK" : "KN", r.path.c_str(), tflops(r.s, r.weft_us),
                        tflops(r.s, r.cublas_us), r.cublas_us / r.weft_us, tflops(r.s, r.roof_us), r.weft_us,
                        r.cublas_us, b_gbs, 100.0 * b_gbs / (read_bw * 1e3));
        }
        if (!opt.json.empty()) {
            std::ofstream f(opt.json);
            f << "{\n  \"bench\": \"gemm\", \"date\": \"" << date << "\", \"gpu\": \"" << prop.name
              << "\", \"sms\": " << prop.multiProcessorCount << ", \"in\": \"" << weft::dtype_name(opt.in)
              << "\", \"out\": \"" << weft::dtype_name(out) << "\", \"iters\": " << opt.iters
              << ", \"read_bw_tbs\": " << read_bw << ", \"peak_tflops_assumed\": " << peak_tflops
              << ",\n  \"results\": [\n";
            for (size_t i = 0; i < rows.size(); ++i) {
                const Row& r = rows[i];
                f << "    {\"m\": " << r.s.m << ", \"n\": " << r.s.n << ", \"k\": " << r.s.k << ", \"layout\": \""
                  << (r.layout == BLayout::kNK ? "nk" : "kn") << "\", \"path\": \"" << r.path
                  << "\", \"auto\": " << (r.best ? "true" : "false") << ", \"chain\": " << (r.chain ? "true" : "false")
                  << ", \"weft_us\": " << r.weft_us
                  << ", \"cublas_us\": " << r.cublas_us << ", \"weft_tflops\": " << tflops(r.s, r.weft_us)
                  << ", \"cublas_tflops\": " << tflops(r.s, r.cublas_us) << ", \"ratio\": " << r.cublas_us / r.weft_us
                  << ", \"roof_tflops\": " << tflops(r.s, r.roof_us) << ", \"rel_err_vs_cublas\": " << r.rel_err
                  << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
            }
            f << "  ]\n}\n";
        }
        cublasLtDestroy(lt);
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "weft_bench_gemm: %s\n", e.what());
        return 1;
    }
}
