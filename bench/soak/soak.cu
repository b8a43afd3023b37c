// SPDX-License-Identifier: MIT
// weft_soak: thousands of mixed calls on ranks sharing one GPU, every result checked, counting wrong results, hangs
// and leaks (device memory, file descriptors). How to run it and what it prints: README.md here.
//
//   weft_soak [--world 3,5,8] [--calls 10000] [--seconds 0] [--seed S] [--delay-prob 0.02] [--max-delay-ms 50]
//             [--hang-ms 60000] [--verbose]
//
// Every rank draws the same sequence of calls from the shared seed (call c's plan depends on the seed and c only):
// all_reduce (ll, one_shot, two_shot; bf16, f16, f32), all_gather (ll, sm_push, ce_pull, ce_push), reduce_scatter
// (ll, sm_pull), all_to_all, AgGemm, GemmRs, GemmAr (through ops::all_reduce and through its own kernel), EP normal
// and low-latency dispatch + combine, with random sizes, symmetric or private buffers, in place or not. Before a
// call each rank sleeps 0-50 ms with a small probability drawn from its own generator, so ranks arrive late at
// random. Inputs are generated on the device from (seed, rank, index); the host recomputes any element of any rank's
// input, so every check is against an independent host reference: collectives on small integers (exact in bf16, f16
// and f32), GEMMs on inputs in {-1, 0, 1} at sampled entries in fp32, EP with an identity expert (out = x times the
// sum of the token's weights). The ops are made once per World (one object per shape class), not per call.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <dirent.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/cli.hpp"
#include "common/report.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/ops/ep.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/world.hpp"

namespace weft::bench {
namespace {

namespace ep = weft::ops::ep;
using ops::AllGatherAlgo;
using ops::AllReduceAlgo;
using ops::ReduceScatterAlgo;

// ------------------------------------------------------------------------------------------------
// Inputs: a pure function of (salt, rank, index), on the device and on the host alike.

__host__ __device__ inline uint32_t mix32(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return static_cast<uint32_t>(x);
}

/// An integer in [-range, range].
__host__ __device__ inline int small_int(uint64_t salt, int rank, uint64_t i, int range) {
    const uint32_t h = mix32(salt * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(rank) << 52) ^ i);
    return static_cast<int>(h % static_cast<uint32_t>(2 * range + 1)) - range;
}

__host__ __device__ inline uint8_t byte_of(uint64_t salt, int rank, uint64_t i) {
    return static_cast<uint8_t>(mix32(~salt * 0xD1B54A32D192ED03ull ^ (static_cast<uint64_t>(rank) << 52) ^ i) >> 7);
}

__global__ void fill_small_kernel(void* p, int dtype, uint64_t n, uint64_t salt, int rank, int range) {
    for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
        const float v = static_cast<float>(small_int(salt, rank, i, range));
        if (dtype == static_cast<int>(DType::kBF16)) {
            static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(v);
        } else if (dtype == static_cast<int>(DType::kF16)) {
            static_cast<__half*>(p)[i] = __float2half(v);
        } else {
            static_cast<float*>(p)[i] = v;
        }
    }
}

__global__ void fill_bytes_kernel(uint8_t* p, uint64_t n, uint64_t salt, int rank) {
    for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
        p[i] = byte_of(salt, rank, i);
    }
}

unsigned grid_for(uint64_t n) { return static_cast<unsigned>(std::clamp<uint64_t>((n + 255) / 256, 1, 256)); }

void fill_small(void* p, DType dt, uint64_t n, uint64_t salt, int rank, int range, cudaStream_t s) {
    if (n == 0) return;
    fill_small_kernel<<<grid_for(n), 256, 0, s>>>(p, static_cast<int>(dt), n, salt, rank, range);
    WEFT_CUDA_CHECK(cudaGetLastError());
}

void fill_bytes(void* p, uint64_t n, uint64_t salt, int rank, cudaStream_t s) {
    if (n == 0) return;
    fill_bytes_kernel<<<grid_for(n), 256, 0, s>>>(static_cast<uint8_t*>(p), n, salt, rank);
    WEFT_CUDA_CHECK(cudaGetLastError());
}

float bits_to_float(DType dt, const uint8_t* at) {
    if (dt == DType::kF32) {
        float f = 0;
        std::memcpy(&f, at, 4);
        return f;
    }
    uint16_t b = 0;
    std::memcpy(&b, at, 2);
    if (dt == DType::kBF16) {
        const uint32_t u = static_cast<uint32_t>(b) << 16;
        float f = 0;
        std::memcpy(&f, &u, 4);
        return f;
    }
    const int exp = (b >> 10) & 0x1f;
    const int mant = b & 0x3ff;
    const float sign = (b & 0x8000) != 0 ? -1.0f : 1.0f;
    if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -24);
    if (exp == 31) return mant != 0 ? NAN : sign * INFINITY;
    return sign * std::ldexp(static_cast<float>(mant + 1024), exp - 25);
}

// ------------------------------------------------------------------------------------------------
// What the process holds: free device memory and open file descriptors.

struct Usage {
    size_t free_bytes = 0;
    int fds = 0;
};

Usage usage_now() {
    Usage u;
    size_t total = 0;
    WEFT_CUDA_CHECK(cudaMemGetInfo(&u.free_bytes, &total));
    if (DIR* d = opendir("/proc/self/fd")) {
        while (const dirent* e = readdir(d)) {
            if (e->d_name[0] != '.') ++u.fds;
        }
        closedir(d);
    }
    return u;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

// ------------------------------------------------------------------------------------------------
// The calls.

enum class Kind : int {
    kAllReduce,
    kAllGather,
    kReduceScatter,
    kAllToAll,
    kAgGemm,
    kGemmRs,
    kGemmAr,
    kEpNormal,
    kEpLowLatency,
    kCount
};
constexpr int kKinds = static_cast<int>(Kind::kCount);
constexpr const char* kKindNames[kKinds] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ag_gemm",
                                            "gemm_rs",    "gemm_ar",    "ep_normal",      "ep_low_latency"};
// How often each kind is drawn (out of the sum): collectives are the cheap, many-algorithm part.
constexpr int kKindWeights[kKinds] = {4, 3, 3, 2, 1, 1, 1, 1, 1};

constexpr uint64_t kBufferBytes = 16ull << 20;  // each of a rank's four collective buffers
constexpr int64_t kGemmN = 256, kGemmK = 256, kGemmRowsPerRank = 64, kGemmArMaxM = 64;
constexpr int kEpHidden = 512, kEpTopk = 4, kEpMaxTokens = 64;
constexpr int kSamples = 2048;  // elements checked per collective call (plus the last one)
constexpr int kGemmSamples = 96;

struct Plan {
    Kind kind = Kind::kAllReduce;
    int algo = 0;
    DType dtype = DType::kBF16;
    uint64_t count = 0;  // elements (reducing), bytes (moving); GEMMs: M
    bool in_sym = false, out_sym = false, in_place = false;
    std::vector<int> tokens;  // EP: per rank
    uint64_t salt = 0;
};

uint64_t log_uniform(std::mt19937_64& rng, uint64_t lo, uint64_t hi) {
    std::uniform_real_distribution<double> u(std::log(static_cast<double>(lo)), std::log(static_cast<double>(hi) + 1));
    return std::clamp<uint64_t>(static_cast<uint64_t>(std::exp(u(rng))), lo, hi);
}

/// Call `call`'s plan: a function of (seed, call, world size) only, so every rank draws the same sequence.
Plan draw_plan(uint64_t seed, uint64_t call, int w, int forced_kind = -1) {
    std::mt19937_64 rng(seed ^ ((call + 1) * 0x9E3779B97F4A7C15ull));
    Plan p;
    p.salt = rng();
    if (forced_kind >= 0) {
        p.kind = static_cast<Kind>(forced_kind);
    } else {
        int total = 0;
        for (int k : kKindWeights) total += k;
        int pick = std::uniform_int_distribution<int>(0, total - 1)(rng);
        int k = 0;
        while (pick >= kKindWeights[k]) pick -= kKindWeights[k++];
        p.kind = static_cast<Kind>(k);
    }
    const auto coin = [&] { return (rng() & 1) != 0; };
    const auto pick = [&](int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); };
    const uint64_t per_rank_cap = kBufferBytes / static_cast<uint64_t>(w);
    static constexpr DType kReducing[] = {DType::kBF16, DType::kF16, DType::kF32};
    switch (p.kind) {
        case Kind::kAllReduce:
            p.algo = 1 + pick(3);  // ll, one_shot, two_shot
            p.dtype = kReducing[pick(3)];
            p.count = log_uniform(rng, 2, 4ull << 20) / static_cast<uint64_t>(dtype_bytes(p.dtype)) + 1;
            p.in_sym = coin();
            p.out_sym = coin();
            p.in_place = pick(4) == 0;
            break;
        case Kind::kAllGather:
            p.algo = 1 + pick(4);  // ll, sm_push, ce_pull, ce_push
            p.count = log_uniform(rng, 1, std::min<uint64_t>(per_rank_cap, 2ull << 20));
            p.in_sym = coin();
            p.out_sym = p.algo == static_cast<int>(AllGatherAlgo::kSmPush) ||
                        p.algo == static_cast<int>(AllGatherAlgo::kCopyEnginePush) || coin();
            p.in_place = pick(4) == 0;
            break;
        case Kind::kReduceScatter:
            p.algo = 1 + pick(2);  // sm_pull, ll
            p.dtype = kReducing[pick(3)];
            p.count = log_uniform(rng, 2, std::min<uint64_t>(per_rank_cap - 64, 2ull << 20)) /
                          static_cast<uint64_t>(dtype_bytes(p.dtype)) +
                      1;
            p.in_sym = coin();
            p.out_sym = coin();
            p.in_place = pick(4) == 0;
            break;
        case Kind::kAllToAll:
            p.count = log_uniform(rng, 1, std::min<uint64_t>(per_rank_cap, 1ull << 20));  // bytes per chunk
            p.in_sym = coin();
            p.out_sym = coin();
            break;
        case Kind::kAgGemm:
        case Kind::kGemmRs:
            p.count = static_cast<uint64_t>(w) * (1 + static_cast<uint64_t>(pick(kGemmRowsPerRank)));
            break;
        case Kind::kGemmAr:
            p.algo = pick(2);  // 0: through ops::all_reduce, 1: the op's own kernel
            p.count = 1 + static_cast<uint64_t>(pick(kGemmArMaxM));
            break;
        case Kind::kEpNormal:
            for (int r = 0; r < w; ++r) p.tokens.push_back(1 + pick(kEpMaxTokens));
            break;
        case Kind::kEpLowLatency:
            p.tokens.assign(static_cast<size_t>(w), 1 + pick(kEpMaxTokens));
            break;
        case Kind::kCount:
            break;
    }
    return p;
}

std::string describe(const Plan& p) {
    std::string s = kKindNames[static_cast<int>(p.kind)];
    switch (p.kind) {
        case Kind::kAllReduce:
            s += std::string(" ") + ops::algo_name(static_cast<AllReduceAlgo>(p.algo)) + " " + dtype_name(p.dtype) +
                 " x " + std::to_string(p.count);
            break;
        case Kind::kAllGather:
            s += std::string(" ") + ops::algo_name(static_cast<AllGatherAlgo>(p.algo)) + " shard " +
                 std::to_string(p.count) + " B";
            break;
        case Kind::kReduceScatter:
            s += std::string(" ") + ops::algo_name(static_cast<ReduceScatterAlgo>(p.algo)) + " " +
                 dtype_name(p.dtype) + " x " + std::to_string(p.count);
            break;
        case Kind::kAllToAll:
            s += " chunk " + std::to_string(p.count) + " B";
            break;
        case Kind::kAgGemm:
        case Kind::kGemmRs:
        case Kind::kGemmAr:
            s += " M " + std::to_string(p.count) + (p.kind == Kind::kGemmAr && p.algo == 1 ? " own kernel" : "");
            break;
        case Kind::kEpNormal:
        case Kind::kEpLowLatency:
            s += " tokens";
            for (int t : p.tokens) s += " " + std::to_string(t);
            break;
        case Kind::kCount:
            break;
    }
    if (p.kind <= Kind::kAllToAll) {
        s += std::string(p.in_sym ? " sym-in" : "") + (p.out_sym ? " sym-out" : "") + (p.in_place ? " in-place" : "");
    }
    return s;
}

/// Every rank's routing of an EP call: k distinct experts per token and weights in [0.05, 1].
struct Routing {
    std::vector<int32_t> idx;
    std::vector<float> weights;
};

Routing routing_of(uint64_t salt, int rank, int tokens, int experts) {
    std::mt19937 rng(static_cast<uint32_t>(mix32(salt ^ (static_cast<uint64_t>(rank) << 40))));
    std::vector<int> pool(static_cast<size_t>(experts));
    for (int e = 0; e < experts; ++e) pool[static_cast<size_t>(e)] = e;
    std::uniform_real_distribution<float> weight(0.05f, 1.0f);
    Routing r;
    for (int t = 0; t < tokens; ++t) {
        for (int j = 0; j < kEpTopk; ++j) {
            std::swap(pool[static_cast<size_t>(j)],
                      pool[static_cast<size_t>(std::uniform_int_distribution<int>(j, experts - 1)(rng))]);
            r.idx.push_back(pool[static_cast<size_t>(j)]);
            r.weights.push_back(weight(rng));
        }
    }
    return r;
}

// ------------------------------------------------------------------------------------------------
// One rank's ops and buffers, made once per World.

struct DeviceBuffer {
    void* ptr = nullptr;
    explicit DeviceBuffer(size_t bytes) { WEFT_CUDA_CHECK(cudaMalloc(&ptr, bytes)); }
    ~DeviceBuffer() { cudaFree(ptr); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    uint8_t* bytes() const { return static_cast<uint8_t*>(ptr); }
};

ep::Config ep_config(int w) {
    ep::Config c;
    c.num_experts = 4 * w;
    c.hidden = kEpHidden;
    c.topk = kEpTopk;
    c.max_tokens_per_rank = kEpMaxTokens;
    c.normal = true;
    c.low_latency = true;
    return c;
}

class RankOps {
public:
    explicit RankOps(World& w)
        : w_(w),
          me_(w.rank()),
          n_(w.num_ranks()),
          dev_in_(kBufferBytes),
          dev_out_(kBufferBytes),
          gemm_a_(static_cast<size_t>(kGemmRowsPerRank * n_ * kGemmK * 2)),
          gemm_b_(static_cast<size_t>(kGemmN * kGemmK * 2)),
          gemm_c_(static_cast<size_t>(kGemmRowsPerRank * n_ * kGemmN * 2)),
          ep_x_(static_cast<size_t>(kEpMaxTokens * kEpHidden * 2)),
          ep_idx_(static_cast<size_t>(kEpMaxTokens * kEpTopk * 4)),
          ep_weights_(static_cast<size_t>(kEpMaxTokens * kEpTopk * 4)),
          ep_out_(static_cast<size_t>(kEpMaxTokens * kEpHidden * 2)) {
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
        ops::prepare_collectives(w);
        sym_in_ = static_cast<uint8_t*>(w.heap().alloc(kBufferBytes));
        sym_out_ = static_cast<uint8_t*>(w.heap().alloc(kBufferBytes));
        const int64_t max_m = kGemmRowsPerRank * n_;
        ag_ = std::make_unique<ops::AgGemm>(w, ops::AgGemmShape{max_m, kGemmN, kGemmK, DType::kBF16});
        rs_ = std::make_unique<ops::GemmRs>(w, ops::GemmRsShape{max_m, kGemmN, kGemmK, DType::kBF16});
        ar_ = std::make_unique<ops::GemmAr>(w, ops::GemmArShape{kGemmArMaxM, kGemmN, kGemmK, DType::kBF16});
        ops::GemmArOptions own;
        own.collective_all_reduce = false;
        ar_own_ = std::make_unique<ops::GemmAr>(w, ops::GemmArShape{kGemmArMaxM, kGemmN, kGemmK, DType::kBF16}, own);
        ep_ = std::make_unique<ep::Buffer>(w, ep_config(n_));
        normal_ = std::make_unique<ep::NormalHandle>(ep_->make_normal_handle());
        low_latency_ = std::make_unique<ep::LowLatencyHandle>(ep_->make_low_latency_handle());
    }

    ~RankOps() {
        low_latency_.reset();
        normal_.reset();
        ep_.reset();
        ar_own_.reset();
        ar_.reset();
        rs_.reset();
        ag_.reset();
        // Collective: after a failed call (an aborted World, ranks leaving at different calls) it can throw, which a
        // destructor must not let out.
        try {
            w_.heap().free(sym_out_);
            w_.heap().free(sym_in_);
        } catch (const std::exception& e) {
            std::fprintf(stderr, "weft_soak: rank %d: releasing the heap buffers failed: %s\n", me_, e.what());
        }
        cudaStreamDestroy(s_);
    }

    cudaStream_t stream() const { return s_; }

    /// Runs the call and checks this rank's result: "" when right, else what was wrong. Throws weft::Error when the
    /// call fails (a diagnosed device wait, an abort).
    std::string run(const Plan& p) {
        switch (p.kind) {
            case Kind::kAllReduce: return all_reduce(p);
            case Kind::kAllGather: return all_gather(p);
            case Kind::kReduceScatter: return reduce_scatter(p);
            case Kind::kAllToAll: return all_to_all(p);
            case Kind::kAgGemm: return ag_gemm(p);
            case Kind::kGemmRs: return gemm_rs(p);
            case Kind::kGemmAr: return gemm_ar(p);
            case Kind::kEpNormal: return ep_call(p, false);
            case Kind::kEpLowLatency: return ep_call(p, true);
            case Kind::kCount: break;
        }
        return "unknown kind";
    }

private:
    uint8_t* in_buffer(const Plan& p) const { return p.in_sym ? sym_in_ : dev_in_.bytes(); }
    uint8_t* out_buffer(const Plan& p) const { return p.out_sym ? sym_out_ : dev_out_.bytes(); }

    const std::vector<uint8_t>& download(const void* src, uint64_t bytes) {
        host_.resize(bytes);
        WEFT_CUDA_CHECK(cudaMemcpyAsync(host_.data(), src, bytes, cudaMemcpyDeviceToHost, s_));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(s_));
        return host_;
    }

    /// Sampled indices of [0, n): kSamples random ones and the last.
    std::vector<uint64_t> samples(uint64_t salt, uint64_t n) const {
        std::vector<uint64_t> v;
        if (n <= kSamples) {
            for (uint64_t i = 0; i < n; ++i) v.push_back(i);
            return v;
        }
        std::mt19937_64 rng(salt ^ static_cast<uint64_t>(me_));
        for (int i = 0; i < kSamples; ++i) v.push_back(rng() % n);
        v.push_back(n - 1);
        return v;
    }

    static std::string wrong(const char* what, uint64_t i, double got, double want) {
        char buf[160];
        std::snprintf(buf, sizeof(buf), "%s[%llu] = %g, expected %g", what, static_cast<unsigned long long>(i), got,
                      want);
        return buf;
    }

    std::string all_reduce(const Plan& p) {
        const uint64_t elem = static_cast<uint64_t>(dtype_bytes(p.dtype));
        uint8_t* in = in_buffer(p);
        uint8_t* out = p.in_place ? in : out_buffer(p);
        fill_small(in, p.dtype, p.count, p.salt, me_, 4, s_);
        const auto n = static_cast<int64_t>(p.count);
        ops::all_reduce(w_, TensorView(in, p.dtype, {n}), TensorView(out, p.dtype, {n}), s_,
                        {.algo = static_cast<AllReduceAlgo>(p.algo)});
        w_.sync_and_check(s_);
        const std::vector<uint8_t>& h = download(out, p.count * elem);
        for (uint64_t i : samples(p.salt, p.count)) {
            int want = 0;
            for (int q = 0; q < n_; ++q) want += small_int(p.salt, q, i, 4);
            const float got = bits_to_float(p.dtype, h.data() + i * elem);
            if (got != static_cast<float>(want)) return wrong("out", i, got, want);
        }
        return "";
    }

    std::string all_gather(const Plan& p) {
        const uint64_t shard = p.count;
        uint8_t* out = out_buffer(p);
        uint8_t* in = p.in_place ? out + static_cast<uint64_t>(me_) * shard : in_buffer(p);
        fill_bytes(in, shard, p.salt, me_, s_);
        ops::all_gather(w_, TensorView(in, DType::kU8, {static_cast<int64_t>(shard)}),
                        TensorView(out, DType::kU8, {static_cast<int64_t>(shard) * n_}), s_,
                        {.algo = static_cast<AllGatherAlgo>(p.algo)});
        w_.sync_and_check(s_);
        const std::vector<uint8_t>& h = download(out, shard * static_cast<uint64_t>(n_));
        for (uint64_t i : samples(p.salt, shard * static_cast<uint64_t>(n_))) {
            const uint8_t want = byte_of(p.salt, static_cast<int>(i / shard), i % shard);
            if (h[i] != want) return wrong("out", i, h[i], want);
        }
        return "";
    }

    std::string reduce_scatter(const Plan& p) {
        const uint64_t elem = static_cast<uint64_t>(dtype_bytes(p.dtype));
        const uint64_t count = p.count;
        uint8_t* in = in_buffer(p);
        uint8_t* out = p.in_place ? in + static_cast<uint64_t>(me_) * count * elem : out_buffer(p);
        fill_small(in, p.dtype, count * static_cast<uint64_t>(n_), p.salt, me_, 4, s_);
        ops::reduce_scatter(w_, TensorView(in, p.dtype, {static_cast<int64_t>(count) * n_}),
                            TensorView(out, p.dtype, {static_cast<int64_t>(count)}), s_,
                            {.algo = static_cast<ReduceScatterAlgo>(p.algo)});
        w_.sync_and_check(s_);
        const std::vector<uint8_t>& h = download(out, count * elem);
        for (uint64_t i : samples(p.salt, count)) {
            int want = 0;
            for (int q = 0; q < n_; ++q) want += small_int(p.salt, q, static_cast<uint64_t>(me_) * count + i, 4);
            const float got = bits_to_float(p.dtype, h.data() + i * elem);
            if (got != static_cast<float>(want)) return wrong("out", i, got, want);
        }
        return "";
    }

    std::string all_to_all(const Plan& p) {
        const uint64_t chunk = p.count;
        const uint64_t total = chunk * static_cast<uint64_t>(n_);
        uint8_t* in = in_buffer(p);
        uint8_t* out = out_buffer(p);
        fill_bytes(in, total, p.salt, me_, s_);
        ops::all_to_all(w_, TensorView(in, DType::kU8, {static_cast<int64_t>(total)}),
                        TensorView(out, DType::kU8, {static_cast<int64_t>(total)}), s_);
        w_.sync_and_check(s_);
        const std::vector<uint8_t>& h = download(out, total);
        for (uint64_t i : samples(p.salt, total)) {
            const int q = static_cast<int>(i / chunk);
            const uint8_t want = byte_of(p.salt, q, static_cast<uint64_t>(me_) * chunk + i % chunk);
            if (h[i] != want) return wrong("out", i, h[i], want);
        }
        return "";
    }

    // GEMM inputs: A of rank s is small_int(salt, s, row * K + k, 1), B of rank s small_int(salt + 1, s, col * K + k,
    // 1): every product and partial sum is an integer, exact in fp32.
    static double dot(uint64_t salt, int a_rank, int64_t a_row, int b_rank, int64_t b_col) {
        double acc = 0;
        for (int64_t k = 0; k < kGemmK; ++k) {
            acc += small_int(salt, a_rank, static_cast<uint64_t>(a_row * kGemmK + k), 1) *
                   small_int(salt + 1, b_rank, static_cast<uint64_t>(b_col * kGemmK + k), 1);
        }
        return acc;
    }

    void fill_gemm_inputs(const Plan& p, int64_t a_rows) {
        fill_small(gemm_a_.ptr, DType::kBF16, static_cast<uint64_t>(a_rows * kGemmK), p.salt, me_, 1, s_);
        fill_small(gemm_b_.ptr, DType::kBF16, static_cast<uint64_t>(kGemmN * kGemmK), p.salt + 1, me_, 1, s_);
        WEFT_CUDA_CHECK(cudaMemsetAsync(gemm_c_.ptr, 0xff, static_cast<size_t>(kGemmRowsPerRank * n_ * kGemmN * 2), s_));
    }

    /// Checks kGemmSamples entries of c [rows, N]; `ref(row, col, &abs_sum)` is the exact value and the sum of the
    /// partials' magnitudes (their bf16 roundings bound the error).
    template <class Ref>
    std::string check_gemm(const Plan& p, int64_t rows, Ref&& ref) {
        const std::vector<uint8_t>& h = download(gemm_c_.ptr, static_cast<uint64_t>(rows * kGemmN * 2));
        std::mt19937_64 rng(p.salt ^ 0xabcdefull ^ static_cast<uint64_t>(me_));
        for (int i = 0; i < kGemmSamples; ++i) {
            const int64_t r = i == 0 ? rows - 1 : static_cast<int64_t>(rng() % static_cast<uint64_t>(rows));
            const int64_t c = i == 0 ? kGemmN - 1 : static_cast<int64_t>(rng() % kGemmN);
            double partials = 0;
            const double want = ref(r, c, &partials);
            const float got = bits_to_float(DType::kBF16, h.data() + static_cast<uint64_t>(r * kGemmN + c) * 2);
            const double tol = (std::fabs(want) + partials) * std::ldexp(1.0, -8) + 1e-6;
            if (!(std::fabs(got - want) <= tol)) return wrong("c", static_cast<uint64_t>(r * kGemmN + c), got, want);
        }
        return "";
    }

    std::string ag_gemm(const Plan& p) {
        const auto m = static_cast<int64_t>(p.count);
        const int64_t rows = m / n_;
        fill_gemm_inputs(p, rows);
        ag_->run(TensorView(gemm_a_.ptr, DType::kBF16, {rows, kGemmK}),
                 TensorView(gemm_b_.ptr, DType::kBF16, {kGemmN, kGemmK}),
                 TensorView(gemm_c_.ptr, DType::kBF16, {m, kGemmN}), s_);
        w_.sync_and_check(s_);
        return check_gemm(p, m, [&](int64_t r, int64_t c, double* partials) {
            *partials = 0;
            return dot(p.salt, static_cast<int>(r / rows), r % rows, me_, c);
        });
    }

    std::string gemm_rs(const Plan& p) {
        const auto m = static_cast<int64_t>(p.count);
        const int64_t rows = m / n_;
        fill_gemm_inputs(p, m);
        rs_->run(TensorView(gemm_a_.ptr, DType::kBF16, {m, kGemmK}),
                 TensorView(gemm_b_.ptr, DType::kBF16, {kGemmN, kGemmK}),
                 TensorView(gemm_c_.ptr, DType::kBF16, {rows, kGemmN}), s_);
        w_.sync_and_check(s_);
        return check_gemm(p, rows, [&](int64_t r, int64_t c, double* partials) {
            double sum = 0;
            *partials = 0;
            for (int s = 0; s < n_; ++s) {
                const double v = dot(p.salt, s, me_ * rows + r, s, c);
                sum += v;
                *partials += std::fabs(v);
            }
            return sum;
        });
    }

    std::string gemm_ar(const Plan& p) {
        const auto m = static_cast<int64_t>(p.count);
        fill_gemm_inputs(p, m);
        ops::GemmAr& op = p.algo == 1 ? *ar_own_ : *ar_;
        op.run(TensorView(gemm_a_.ptr, DType::kBF16, {m, kGemmK}),
               TensorView(gemm_b_.ptr, DType::kBF16, {kGemmN, kGemmK}),
               TensorView(gemm_c_.ptr, DType::kBF16, {m, kGemmN}), s_);
        w_.sync_and_check(s_);
        return check_gemm(p, m, [&](int64_t r, int64_t c, double* partials) {
            double sum = 0;
            *partials = 0;
            for (int s = 0; s < n_; ++s) {
                const double v = dot(p.salt, s, r, s, c);
                sum += v;
                *partials += std::fabs(v);
            }
            return sum;
        });
    }

    std::string ep_call(const Plan& p, bool low_latency) {
        const int tokens = p.tokens[static_cast<size_t>(me_)];
        const Routing r = routing_of(p.salt, me_, tokens, 4 * n_);
        WEFT_CUDA_CHECK(cudaMemcpyAsync(ep_idx_.ptr, r.idx.data(), r.idx.size() * 4, cudaMemcpyHostToDevice, s_));
        WEFT_CUDA_CHECK(
            cudaMemcpyAsync(ep_weights_.ptr, r.weights.data(), r.weights.size() * 4, cudaMemcpyHostToDevice, s_));
        fill_small(ep_x_.ptr, DType::kBF16, static_cast<uint64_t>(tokens) * kEpHidden, p.salt, me_, 2, s_);
        WEFT_CUDA_CHECK(cudaMemsetAsync(ep_out_.ptr, 0xff, static_cast<size_t>(tokens) * kEpHidden * 2, s_));
        const TensorView x(ep_x_.ptr, DType::kBF16, {tokens, kEpHidden});
        const TensorView idx(ep_idx_.ptr, DType::kI32, {tokens, kEpTopk});
        const TensorView weights(ep_weights_.ptr, DType::kF32, {tokens, kEpTopk});
        const TensorView out(ep_out_.ptr, DType::kBF16, {tokens, kEpHidden});
        if (low_latency) {
            ep_->low_latency_dispatch(*low_latency_, x, idx, s_);
            ep_->low_latency_combine(*low_latency_, low_latency_->recv_x(), idx, weights, out, s_);
        } else {
            ep_->dispatch(*normal_, x, idx, weights, s_);
            ep_->combine(*normal_, normal_->recv_x(), out, s_);
        }
        ep_->sync_and_check(s_);
        const std::vector<uint8_t>& h = download(ep_out_.ptr, static_cast<uint64_t>(tokens) * kEpHidden * 2);
        for (int t = 0; t < tokens; ++t) {
            float sum = 0;
            for (int j = 0; j < kEpTopk; ++j) sum += r.weights[static_cast<size_t>(t * kEpTopk + j)];
            for (int ch = 0; ch < kEpHidden; ++ch) {
                const uint64_t i = static_cast<uint64_t>(t) * kEpHidden + static_cast<uint64_t>(ch);
                const float want = static_cast<float>(small_int(p.salt, me_, i, 2)) * sum;
                const float got = bits_to_float(DType::kBF16, h.data() + i * 2);
                if (!(std::fabs(got - want) <= 0.03f * std::fabs(want) + 0.02f)) return wrong("out", i, got, want);
            }
        }
        return "";
    }

    World& w_;
    int me_, n_;
    cudaStream_t s_ = nullptr;
    uint8_t* sym_in_ = nullptr;
    uint8_t* sym_out_ = nullptr;
    DeviceBuffer dev_in_, dev_out_, gemm_a_, gemm_b_, gemm_c_, ep_x_, ep_idx_, ep_weights_, ep_out_;
    std::unique_ptr<ops::AgGemm> ag_;
    std::unique_ptr<ops::GemmRs> rs_;
    std::unique_ptr<ops::GemmAr> ar_, ar_own_;
    std::unique_ptr<ep::Buffer> ep_;
    std::unique_ptr<ep::NormalHandle> normal_;
    std::unique_ptr<ep::LowLatencyHandle> low_latency_;
    std::vector<uint8_t> host_;
};

// ------------------------------------------------------------------------------------------------
// One World's run.

struct Options {
    std::vector<int> worlds = {3, 5, 8};
    int calls = 10000;
    int seconds = 0;  // 0: no time bound
    uint64_t seed = 0;
    double delay_prob = 0.02;
    int max_delay_ms = 50;
    int hang_ms = 60000;
    bool verbose = false;
};

struct KindStats {
    uint64_t calls = 0, wrong = 0;
    double seconds = 0;
    uint64_t min_count = ~0ull, max_count = 0;
};

struct WorldResult {
    int world = 0;
    uint64_t planned = 0, done = 0, wrong = 0, hangs = 0, errors = 0, delays = 0;
    std::array<KindStats, kKinds> kinds{};
    std::vector<std::string> first_problems;
    Usage warm, end;
    bool steady_measured = false;
    double seconds = 0;
};

struct Shared {
    const Options* o = nullptr;
    int calls = 0;
    std::mutex mutex;
    WorldResult result;
    std::atomic<bool> failed{false};
    std::atomic<bool> keep_going{true};
    std::atomic<bool> finished{false};
    std::vector<std::atomic<int64_t>> progress_ns;  // per rank: steady-clock time of its last finished call
    std::vector<std::atomic<int64_t>> at_call;      // per rank: the call it is in
    std::chrono::steady_clock::time_point start;
    explicit Shared(int w) : progress_ns(static_cast<size_t>(w)), at_call(static_cast<size_t>(w)) {}
    void problem(const std::string& text) {
        std::lock_guard<std::mutex> lock(mutex);
        if (result.first_problems.size() < 10) result.first_problems.push_back(text);
    }
};

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

void rank_main(World& w, Shared& sh) {
    const Options& o = *sh.o;
    const int me = w.rank();
    const int n = w.num_ranks();
    RankOps ops_here(w);
    std::mt19937_64 delay_rng(o.seed * 0x2545F4914F6CDD1Dull + static_cast<uint64_t>(me) + 1);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    const auto one_call = [&](int64_t call, const Plan& p, bool counted) {
        sh.at_call[static_cast<size_t>(me)] = call;
        if (counted && unit(delay_rng) < o.delay_prob) {
            const int ms = static_cast<int>(unit(delay_rng) * o.max_delay_ms);
            std::this_thread::sleep_for(std::chrono::milliseconds(ms));
            std::lock_guard<std::mutex> lock(sh.mutex);
            ++sh.result.delays;
        }
        const auto t0 = std::chrono::steady_clock::now();
        std::string bad;
        try {
            bad = ops_here.run(p);
        } catch (const std::exception& e) {
            const std::string m = e.what();
            const bool hang = m.find("timed out") != std::string::npos;
            sh.problem("rank " + std::to_string(me) + " call " + std::to_string(call) + " (" + describe(p) +
                       "): " + (hang ? "HANG: " : "ERROR: ") + m);
            std::lock_guard<std::mutex> lock(sh.mutex);
            (hang ? sh.result.hangs : sh.result.errors) += 1;
            sh.failed = true;
            return false;
        }
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        sh.progress_ns[static_cast<size_t>(me)] = now_ns();
        if (!bad.empty()) {
            sh.problem("rank " + std::to_string(me) + " call " + std::to_string(call) + " (" + describe(p) +
                       "): WRONG: " + bad);
        }
        if (counted) {
            std::lock_guard<std::mutex> lock(sh.mutex);
            KindStats& k = sh.result.kinds[static_cast<size_t>(p.kind)];
            if (me == 0) {
                ++k.calls;
                ++sh.result.done;
                k.seconds += secs;
                k.min_count = std::min(k.min_count, p.count);
                k.max_count = std::max(k.max_count, p.count);
            }
            if (!bad.empty()) {
                ++k.wrong;
                ++sh.result.wrong;
            }
        }
        if (o.verbose && me == 0 && counted) {
            std::printf("  call %lld: %s (%.2f ms)%s\n", static_cast<long long>(call), describe(p).c_str(), secs * 1e3,
                        bad.empty() ? "" : " WRONG");
        }
        return true;
    };
    // Every kind once (first calls, JIT loads and pools settle), then the steady-state snapshot.
    for (int k = 0; k < kKinds && !sh.failed; ++k) {
        if (!one_call(-1 - k, draw_plan(o.seed, ~static_cast<uint64_t>(k), n, k), false)) break;
    }
    if (!sh.failed && sh.calls > 0) {
        w.barrier();
        if (me == 0) {
            sh.result.warm = usage_now();
            sh.start = std::chrono::steady_clock::now();
        }
        w.barrier();
    }
    for (int64_t call = 0; call < sh.calls && !sh.failed; ++call) {
        if (call % 64 == 0) {
            // A collective decision to go on (the time bound), made by rank 0 between two host barriers.
            if (me == 0) {
                const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - sh.start).count();
                sh.keep_going = !sh.failed && (o.seconds <= 0 || elapsed < o.seconds);
            }
            try {
                w.barrier();
                const bool go = sh.keep_going;
                w.barrier();
                if (!go) break;
            } catch (const std::exception& e) {
                sh.problem("rank " + std::to_string(me) + " at call " + std::to_string(call) + ": " + e.what());
                sh.failed = true;
                break;
            }
        }
        if (!one_call(call, draw_plan(o.seed, static_cast<uint64_t>(call), n), true)) break;
    }
    if (!sh.failed && sh.calls > 0) {
        WEFT_CUDA_CHECK(cudaStreamSynchronize(ops_here.stream()));
        w.barrier();
        if (me == 0) {
            sh.result.end = usage_now();
            sh.result.steady_measured = true;
            sh.result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - sh.start).count();
        }
        w.barrier();
    }
}

WorldResult run_world(const Options& o, int w, int calls) {
    Shared sh(w);
    sh.o = &o;
    sh.calls = calls;
    sh.result.world = w;
    sh.result.planned = static_cast<uint64_t>(calls);
    for (auto& p : sh.progress_ns) p = now_ns();
    // The host's guard: no rank finished a call within the hang bound plus a margin (the device waits end at the
    // bound themselves, as a diagnosed error): report where every rank is and stop the process.
    std::thread guard([&] {
        const int64_t bound_ns = (static_cast<int64_t>(o.hang_ms) + 30000) * 1000000;
        while (!sh.finished) {
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
            for (int r = 0; r < w && !sh.finished; ++r) {
                if (now_ns() - sh.progress_ns[static_cast<size_t>(r)] > bound_ns && sh.calls > 0) {
                    std::printf("weft_soak: HANG: world %d, rank %d has finished no call for %d ms; ranks at calls:",
                                w, r, o.hang_ms + 30000);
                    for (int q = 0; q < w; ++q) std::printf(" %lld", static_cast<long long>(sh.at_call[static_cast<size_t>(q)]));
                    std::printf(" (seed 0x%llx)\n", static_cast<unsigned long long>(o.seed));
                    std::fflush(stdout);
                    std::_Exit(3);
                }
            }
        }
    });
    WorldOptions wo;
    wo.heap_bytes = (1ull << 30) + ep::footprint(ep_config(w), w).heap_bytes(1);
    // The first World of a world size may compile kernels (a cold JIT cache) while its peers wait in a store barrier:
    // it gets ten minutes; the measured World (every kernel cached by then) the hang bound.
    wo.timeout = std::chrono::milliseconds(calls == 0 ? std::max(o.hang_ms, 600000) : o.hang_ms);
    try {
        run_local(w, [&](World& world) {
            // Construction and the warm-up pass are not timed by the guard.
            sh.progress_ns[static_cast<size_t>(world.rank())] = now_ns() + 600'000'000'000;
            rank_main(world, sh);
        }, wo);
    } catch (const std::exception& e) {
        sh.problem(std::string("the World failed: ") + e.what());
        if (!sh.failed) ++sh.result.errors;
        sh.failed = true;
    }
    sh.finished = true;
    guard.join();
    return sh.result;
}

Options parse_options(int argc, char** argv) {
    Options o;
    o.seed = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
    Cli cli("weft_soak", "mixed calls on ranks sharing one GPU, every result checked: wrong results, hangs, leaks");
    cli.world(&o.worlds, 2, 64);
    cli.int_option("--calls", "mixed calls per world size", &o.calls, 0, 100000000);
    cli.int_option("--seconds", "stop each world size after this many seconds of calls (0: no bound)", &o.seconds, 0,
                   1000000);
    cli.option("--seed", "S", "the shared seed (default: the clock; printed)", [&](const std::string& v) {
        o.seed = static_cast<uint64_t>(parse_int(v, "--seed", 0, INT64_MAX));
    });
    cli.option("--delay-prob", "P", "probability that a rank sleeps before a call (default 0.02)",
               [&](const std::string& v) {
                   o.delay_prob = std::stod(v);
                   if (!(o.delay_prob >= 0 && o.delay_prob <= 1)) throw UsageError("--delay-prob must be in [0, 1]");
               });
    cli.int_option("--max-delay-ms", "longest sleep before a call, ms", &o.max_delay_ms, 0, 60000);
    cli.int_option("--hang-ms", "a call not done within this many ms is a hang", &o.hang_ms, 1000,
                   3600000);
    cli.flag("--verbose", "print every call", &o.verbose);
    cli.parse(argc, argv);
    return o;
}

int run(int argc, char** argv) {
    const Options o = parse_options(argc, argv);
    WEFT_CUDA_CHECK(cudaFree(nullptr));
    cudaDeviceProp prop{};
    WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("weft_soak: %s, %s, seed %llu, %d calls per world size%s, delays p=%.3f up to %d ms, hang bound %d ms\n",
                prop.name, utc_date().c_str(), static_cast<unsigned long long>(o.seed), o.calls,
                o.seconds > 0 ? (", at most " + std::to_string(o.seconds) + " s each").c_str() : "", o.delay_prob,
                o.max_delay_ms, o.hang_ms);
    std::fflush(stdout);
    constexpr int64_t kDeviceSlackBytes = 32ll << 20;  // the driver's own allocations move by a few MiB
    std::vector<WorldResult> results;
    std::vector<std::pair<int64_t, int>> process_leaks;  // per world: device bytes, file descriptors
    bool ok = true;
    for (int w : o.worlds) {
        WEFT_CHECK(4 * w <= ep::kMaxExperts && w <= ep::kMaxRanks, "--world " << w << " is too large for EP");
        // A first World that makes every op and runs every kind once: the JIT's loaded kernels and the allocators'
        // pools that outlive a World are there before the measurement starts.
        const WorldResult warmup = run_world(o, w, 0);
        if (warmup.errors + warmup.hangs > 0) {
            for (const std::string& p : warmup.first_problems) std::printf("  %s\n", p.c_str());
            results.push_back(warmup);
            process_leaks.emplace_back(0, 0);
            ok = false;
            break;
        }
        const Usage before = usage_now();
        WorldResult r = run_world(o, w, o.calls);
        const Usage after = usage_now();
        process_leaks.emplace_back(static_cast<int64_t>(before.free_bytes) - static_cast<int64_t>(after.free_bytes),
                                   after.fds - before.fds);
        std::printf("world %d: %llu of %llu calls in %.1f s, %llu wrong, %llu hangs, %llu errors, %llu delays\n", w,
                    static_cast<unsigned long long>(r.done), static_cast<unsigned long long>(r.planned), r.seconds,
                    static_cast<unsigned long long>(r.wrong), static_cast<unsigned long long>(r.hangs),
                    static_cast<unsigned long long>(r.errors), static_cast<unsigned long long>(r.delays));
        for (const std::string& p : r.first_problems) std::printf("  %s\n", p.c_str());
        std::fflush(stdout);
        results.push_back(std::move(r));
        if (results.back().hangs + results.back().errors > 0) {
            ok = false;
            break;  // stop at the first hang or failure: the state to look at is this one
        }
    }

    std::printf("\n%-6s %-15s %8s %7s %10s %12s %12s\n", "world", "op", "calls", "wrong", "ms/call", "min size",
                "max size");
    for (const WorldResult& r : results) {
        for (int k = 0; k < kKinds; ++k) {
            const KindStats& s = r.kinds[static_cast<size_t>(k)];
            if (s.calls == 0) continue;
            std::printf("%-6d %-15s %8llu %7llu %10.3f %12llu %12llu\n", r.world, kKindNames[k],
                        static_cast<unsigned long long>(s.calls), static_cast<unsigned long long>(s.wrong),
                        1e3 * s.seconds / static_cast<double>(s.calls), static_cast<unsigned long long>(s.min_count),
                        static_cast<unsigned long long>(s.max_count));
        }
    }
    std::printf("(sizes: elements for all_reduce and reduce_scatter, bytes per rank for all_gather and all_to_all, M "
                "for the GEMMs)\n\n%-6s %18s %18s %14s %14s\n",
                "world", "device leak (MiB)", "steady (MiB)", "fd leak", "steady fds");
    uint64_t done = 0, planned = 0, wrong = 0, hangs = 0, errors = 0, leaks = 0;
    for (size_t i = 0; i < results.size(); ++i) {
        const WorldResult& r = results[i];
        const int64_t steady_bytes = r.steady_measured ? static_cast<int64_t>(r.warm.free_bytes) -
                                                             static_cast<int64_t>(r.end.free_bytes)
                                                       : 0;
        const int steady_fds = r.steady_measured ? r.end.fds - r.warm.fds : 0;
        const auto [dev_leak, fd_leak] = process_leaks[i];
        std::printf("%-6d %18.1f %18.1f %14d %14d\n", r.world, mib(dev_leak), mib(steady_bytes), fd_leak, steady_fds);
        leaks += (dev_leak > kDeviceSlackBytes ? 1 : 0) + (steady_bytes > kDeviceSlackBytes ? 1 : 0) +
                 (fd_leak > 0 ? 1 : 0) + (steady_fds > 0 ? 1 : 0);
        done += r.done;
        planned += r.planned;
        wrong += r.wrong;
        hangs += r.hangs;
        errors += r.errors;
    }
    ok = ok && wrong == 0 && hangs == 0 && errors == 0 && leaks == 0;
    std::string worlds;
    for (const WorldResult& r : results) worlds += (worlds.empty() ? "" : ",") + std::to_string(r.world);
    std::printf("\nweft_soak: %s: worlds %s, seed %llu, %llu/%llu calls, %llu wrong, %llu hangs, %llu errors, %llu "
                "leaks (device slack %lld MiB)\n",
                ok ? "PASS" : "FAIL", worlds.c_str(), static_cast<unsigned long long>(o.seed),
                static_cast<unsigned long long>(done), static_cast<unsigned long long>(planned),
                static_cast<unsigned long long>(wrong), static_cast<unsigned long long>(hangs),
                static_cast<unsigned long long>(errors), static_cast<unsigned long long>(leaks),
                static_cast<long long>(kDeviceSlackBytes >> 20));
    return ok ? 0 : 1;
}

}  // namespace
}  // namespace weft::bench

int main(int argc, char** argv) {
    return weft::bench::run_main("weft_soak", [&] { return weft::bench::run(argc, argv); });
}
