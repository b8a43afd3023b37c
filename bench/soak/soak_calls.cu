// SPDX-License-Identifier: MIT
// weft_soak's calls (soak_calls.hpp): the inputs, a pure function of (salt, rank, index) on the device and on the host
// alike, and per op the call and its check. The host recomputes any element of any rank's input, so no reference
// reads what the op wrote: collectives on small integers (exact in bf16, f16 and f32), GEMMs on inputs in {-1, 0, 1}
// at sampled entries in fp32, EP with an identity expert (out = x times the sum of the token's weights).
#include "soak_calls.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>

#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::bench::soak {
namespace {

// ------------------------------------------------------------------------------------------------
// Inputs: a pure function of (salt, rank, index), on the device and on the host alike.

// Inputs are small integers, so the references are exact.
constexpr int kCollectiveRange = 4;  // collective inputs in [-4, 4]: their sums are exact in every dtype
constexpr int kGemmRange = 1;        // GEMM inputs in {-1, 0, 1}: dot products exact in fp32
constexpr int kEpRange = 2;          // EP tokens in [-2, 2]

constexpr int kSamples = 2048;  // elements checked per collective call (plus the last one)
constexpr int kGemmSamples = 96;

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

/// p[i] = small_int(salt, rank, i, range) as dt, for i < n.
void fill_small(void* p, DType dt, uint64_t n, uint64_t salt, int rank, int range, cudaStream_t s) {
    if (n == 0) return;
    fill_small_kernel<<<grid_for(n), 256, 0, s>>>(p, static_cast<int>(dt), n, salt, rank, range);
    WEFT_CUDA_CHECK(cudaGetLastError());
}

/// p[i] = byte_of(salt, rank, i), for i < n.
void fill_bytes(void* p, uint64_t n, uint64_t salt, int rank, cudaStream_t s) {
    if (n == 0) return;
    fill_bytes_kernel<<<grid_for(n), 256, 0, s>>>(static_cast<uint8_t*>(p), n, salt, rank);
    WEFT_CUDA_CHECK(cudaGetLastError());
}

// ------------------------------------------------------------------------------------------------
// Host references.

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

/// Sampled indices of [0, n) that `rank` checks: all of them up to kSamples, else kSamples random ones and the last.
std::vector<uint64_t> samples(uint64_t salt, int rank, uint64_t n) {
    std::vector<uint64_t> v;
    if (n <= kSamples) {
        for (uint64_t i = 0; i < n; ++i) v.push_back(i);
        return v;
    }
    std::mt19937_64 rng(salt ^ static_cast<uint64_t>(rank));
    for (int i = 0; i < kSamples; ++i) v.push_back(rng() % n);
    v.push_back(n - 1);
    return v;
}

std::string wrong(const char* what, uint64_t i, double got, double want) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), "%s[%llu] = %g, expected %g", what, static_cast<unsigned long long>(i), got, want);
    return buf;
}

// GEMM inputs: A of rank s is small_int(salt, s, row * K + k, 1), B of rank s small_int(salt + 1, s, col * K + k, 1):
// every product and partial sum is an integer, exact in fp32.
double dot(uint64_t salt, int a_rank, int64_t a_row, int b_rank, int64_t b_col) {
    double acc = 0;
    for (int64_t k = 0; k < kGemmK; ++k) {
        acc += small_int(salt, a_rank, static_cast<uint64_t>(a_row * kGemmK + k), kGemmRange) *
               small_int(salt + 1, b_rank, static_cast<uint64_t>(b_col * kGemmK + k), kGemmRange);
    }
    return acc;
}

/// The sum over ranks s of A_s[a_row] . B_s[col] (a reduced GEMM's entry); *partials: the sum of their magnitudes.
double summed_dot(uint64_t salt, int num_ranks, int64_t a_row, int64_t col, double* partials) {
    double sum = 0;
    *partials = 0;
    for (int s = 0; s < num_ranks; ++s) {
        const double v = dot(salt, s, a_row, s, col);
        sum += v;
        *partials += std::fabs(v);
    }
    return sum;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// One rank's ops and buffers.

ops::ep::Config ep_config(int num_ranks) {
    ops::ep::Config c;
    c.num_experts = kEpExpertsPerRank * num_ranks;
    c.hidden = kEpHidden;
    c.topk = kEpTopk;
    c.max_tokens_per_rank = kEpMaxTokens;
    c.normal = true;
    c.low_latency = true;
    return c;
}

DeviceBuffer::DeviceBuffer(size_t bytes) { WEFT_CUDA_CHECK(cudaMalloc(&ptr, bytes)); }

DeviceBuffer::~DeviceBuffer() { cudaFree(ptr); }

PinnedBuffer::PinnedBuffer(size_t bytes) { WEFT_CUDA_CHECK(cudaHostAlloc(&ptr, bytes, cudaHostAllocDefault)); }

PinnedBuffer::~PinnedBuffer() { cudaFreeHost(ptr); }

RankOps::RankOps(World& w)
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
      ep_out_(static_cast<size_t>(kEpMaxTokens * kEpHidden * 2)),
      pinned_in_(static_cast<size_t>(kEpMaxTokens * kEpTopk * 4 * 2)),
      pinned_out_(kBufferBytes) {
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
    ep_ = std::make_unique<ops::ep::Buffer>(w, ep_config(n_));
    normal_ = std::make_unique<ops::ep::NormalHandle>(ep_->make_normal_handle());
    low_latency_ = std::make_unique<ops::ep::LowLatencyHandle>(ep_->make_low_latency_handle());
}

RankOps::~RankOps() {
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

std::string RankOps::run(const Plan& p) {
    set_phase(Phase::kLaunch);
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

// ------------------------------------------------------------------------------------------------
// Shared by the calls.

int64_t steady_now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

void RankOps::set_phase(Phase p) const {
    if (phase_since_ns_ != nullptr) phase_since_ns_->store(steady_now_ns());
    if (phase_ != nullptr) phase_->store(static_cast<int>(p));
}

void RankOps::sync() {
    set_phase(Phase::kDevice);
    w_.sync_and_check(s_);
}

const std::vector<uint8_t>& RankOps::download(const void* src, uint64_t bytes) {
    set_phase(Phase::kCheck);
    WEFT_CHECK(bytes <= kBufferBytes, "weft_soak: a download of " << bytes << " bytes exceeds " << kBufferBytes);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(pinned_out_.ptr, src, bytes, cudaMemcpyDeviceToHost, s_));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s_));
    host_.assign(pinned_out_.bytes(), pinned_out_.bytes() + bytes);
    return host_;
}

/// A reduction's output: element i of `out` (count of p.dtype) is the sum over ranks of input element first + i.
std::string RankOps::check_sums(const Plan& p, const void* out, uint64_t count, uint64_t first) {
    const uint64_t elem = static_cast<uint64_t>(dtype_bytes(p.dtype));
    const std::vector<uint8_t>& h = download(out, count * elem);
    for (uint64_t i : samples(p.salt, me_, count)) {
        int want = 0;
        for (int q = 0; q < n_; ++q) want += small_int(p.salt, q, first + i, kCollectiveRange);
        const float got = bits_to_float(p.dtype, h.data() + i * elem);
        if (got != static_cast<float>(want)) return wrong("out", i, got, want);
    }
    return "";
}

/// A gather's output: one block of bytes per rank q; byte j of block q is rank q's input byte first + j.
std::string RankOps::check_gathered(const Plan& p, const void* out, uint64_t block, uint64_t first) {
    const uint64_t total = block * static_cast<uint64_t>(n_);
    const std::vector<uint8_t>& h = download(out, total);
    for (uint64_t i : samples(p.salt, me_, total)) {
        const uint8_t want = byte_of(p.salt, static_cast<int>(i / block), first + i % block);
        if (h[i] != want) return wrong("out", i, h[i], want);
    }
    return "";
}

/// Fills A [a_rows, K] and B [N, K] of this rank, poisons C, runs `op` into C [c_rows, N] and waits.
template <class Op>
void RankOps::run_gemm(Op& op, const Plan& p, int64_t a_rows, int64_t c_rows) {
    fill_small(gemm_a_.ptr, DType::kBF16, static_cast<uint64_t>(a_rows * kGemmK), p.salt, me_, kGemmRange, s_);
    fill_small(gemm_b_.ptr, DType::kBF16, static_cast<uint64_t>(kGemmN * kGemmK), p.salt + 1, me_, kGemmRange, s_);
    WEFT_CUDA_CHECK(cudaMemsetAsync(gemm_c_.ptr, 0xff, static_cast<size_t>(kGemmRowsPerRank * n_ * kGemmN * 2), s_));
    op.run(TensorView(gemm_a_.ptr, DType::kBF16, {a_rows, kGemmK}),
           TensorView(gemm_b_.ptr, DType::kBF16, {kGemmN, kGemmK}),
           TensorView(gemm_c_.ptr, DType::kBF16, {c_rows, kGemmN}), s_);
    sync();
}

/// Checks kGemmSamples entries of C [rows, N] (the last one first); `ref(row, col, &partials)` is the exact value and
/// the sum of the partials' magnitudes (their bf16 roundings bound the error).
template <class Ref>
std::string RankOps::check_gemm(const Plan& p, int64_t rows, Ref&& ref) {
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

// ------------------------------------------------------------------------------------------------
// The calls.

std::string RankOps::all_reduce(const Plan& p) {
    uint8_t* in = in_buffer(p);
    uint8_t* out = p.in_place ? in : out_buffer(p);
    fill_small(in, p.dtype, p.count, p.salt, me_, kCollectiveRange, s_);
    const auto n = static_cast<int64_t>(p.count);
    ops::all_reduce(w_, TensorView(in, p.dtype, {n}), TensorView(out, p.dtype, {n}), s_,
                    {.algo = static_cast<ops::AllReduceAlgo>(p.algo)});
    sync();
    return check_sums(p, out, p.count, 0);
}

std::string RankOps::all_gather(const Plan& p) {
    const uint64_t shard = p.count;
    uint8_t* out = out_buffer(p);
    uint8_t* in = p.in_place ? out + static_cast<uint64_t>(me_) * shard : in_buffer(p);
    fill_bytes(in, shard, p.salt, me_, s_);
    ops::all_gather(w_, TensorView(in, DType::kU8, {static_cast<int64_t>(shard)}),
                    TensorView(out, DType::kU8, {static_cast<int64_t>(shard) * n_}), s_,
                    {.algo = static_cast<ops::AllGatherAlgo>(p.algo)});
    sync();
    return check_gathered(p, out, shard, 0);
}

std::string RankOps::reduce_scatter(const Plan& p) {
    const uint64_t elem = static_cast<uint64_t>(dtype_bytes(p.dtype));
    const uint64_t count = p.count;
    uint8_t* in = in_buffer(p);
    uint8_t* out = p.in_place ? in + static_cast<uint64_t>(me_) * count * elem : out_buffer(p);
    fill_small(in, p.dtype, count * static_cast<uint64_t>(n_), p.salt, me_, kCollectiveRange, s_);
    ops::reduce_scatter(w_, TensorView(in, p.dtype, {static_cast<int64_t>(count) * n_}),
                        TensorView(out, p.dtype, {static_cast<int64_t>(count)}), s_,
                        {.algo = static_cast<ops::ReduceScatterAlgo>(p.algo)});
    sync();
    return check_sums(p, out, count, static_cast<uint64_t>(me_) * count);
}

std::string RankOps::all_to_all(const Plan& p) {
    const uint64_t chunk = p.count;
    const uint64_t total = chunk * static_cast<uint64_t>(n_);
    uint8_t* in = in_buffer(p);
    uint8_t* out = out_buffer(p);
    fill_bytes(in, total, p.salt, me_, s_);
    ops::all_to_all(w_, TensorView(in, DType::kU8, {static_cast<int64_t>(total)}),
                    TensorView(out, DType::kU8, {static_cast<int64_t>(total)}), s_);
    sync();
    // Chunk q of the output is rank q's input chunk me.
    return check_gathered(p, out, chunk, static_cast<uint64_t>(me_) * chunk);
}

std::string RankOps::ag_gemm(const Plan& p) {
    const auto m = static_cast<int64_t>(p.count);
    const int64_t rows = m / n_;
    run_gemm(*ag_, p, rows, m);
    // Row r of C is rank r / rows's A row r % rows times this rank's B.
    return check_gemm(p, m, [&](int64_t r, int64_t c, double* partials) {
        *partials = 0;
        return dot(p.salt, static_cast<int>(r / rows), r % rows, me_, c);
    });
}

std::string RankOps::gemm_rs(const Plan& p) {
    const auto m = static_cast<int64_t>(p.count);
    const int64_t rows = m / n_;
    run_gemm(*rs_, p, m, rows);
    // This rank's rows of the sum over ranks of A_s B_s.
    return check_gemm(p, rows, [&](int64_t r, int64_t c, double* partials) {
        return summed_dot(p.salt, n_, me_ * rows + r, c, partials);
    });
}

std::string RankOps::gemm_ar(const Plan& p) {
    const auto m = static_cast<int64_t>(p.count);
    run_gemm(p.algo == 1 ? *ar_own_ : *ar_, p, m, m);
    return check_gemm(p, m, [&](int64_t r, int64_t c, double* partials) {
        return summed_dot(p.salt, n_, r, c, partials);
    });
}

std::string RankOps::ep_normal_ledger() const {
    if (ep_normal_dispatches_ == 0) return "";
    std::string s = "EP normal dispatch " + std::to_string(ep_normal_dispatches_) +
                    " launched; rows sent to ranks 0.." + std::to_string(n_ - 1) + " before it:";
    for (int64_t v : ep_rows_before_) s += " " + std::to_string(v);
    s += "; in it:";
    for (int64_t v : ep_rows_last_) s += " " + std::to_string(v);
    return s;
}

std::string RankOps::ep_call(const Plan& p, bool low_latency) {
    const int tokens = p.tokens[static_cast<size_t>(me_)];
    const Routing r = routing_of(p.salt, me_, tokens, kEpExpertsPerRank * n_);
    // Through the pinned buffer (free again: the previous call ended with its stream synchronised).
    auto* idx_host = reinterpret_cast<int32_t*>(pinned_in_.bytes());
    auto* weights_host = reinterpret_cast<float*>(pinned_in_.bytes() + kEpMaxTokens * kEpTopk * 4);
    std::copy(r.idx.begin(), r.idx.end(), idx_host);
    std::copy(r.weights.begin(), r.weights.end(), weights_host);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(ep_idx_.ptr, idx_host, r.idx.size() * 4, cudaMemcpyHostToDevice, s_));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(ep_weights_.ptr, weights_host, r.weights.size() * 4, cudaMemcpyHostToDevice, s_));
    fill_small(ep_x_.ptr, DType::kBF16, static_cast<uint64_t>(tokens) * kEpHidden, p.salt, me_, kEpRange, s_);
    WEFT_CUDA_CHECK(cudaMemsetAsync(ep_out_.ptr, 0xff, static_cast<size_t>(tokens) * kEpHidden * 2, s_));
    const TensorView x(ep_x_.ptr, DType::kBF16, {tokens, kEpHidden});
    const TensorView idx(ep_idx_.ptr, DType::kI32, {tokens, kEpTopk});
    const TensorView weights(ep_weights_.ptr, DType::kF32, {tokens, kEpTopk});
    const TensorView out(ep_out_.ptr, DType::kBF16, {tokens, kEpHidden});
    if (low_latency) {
        ep_->low_latency_dispatch(*low_latency_, x, idx, s_);
        ep_->low_latency_combine(*low_latency_, low_latency_->recv_x(), idx, weights, out, s_);
    } else {
        std::vector<int64_t> rows = rows_per_rank(r.idx, kEpTopk, kEpExpertsPerRank, n_);
        ep_->dispatch(*normal_, x, idx, weights, s_);
        // Launched: the device's counters now include this dispatch (whether or not it completes).
        ep_rows_before_.resize(static_cast<size_t>(n_), 0);
        for (size_t d = 0; d < ep_rows_last_.size(); ++d) ep_rows_before_[d] += ep_rows_last_[d];
        ep_rows_last_ = std::move(rows);
        ++ep_normal_dispatches_;
        ep_->combine(*normal_, normal_->recv_x(), out, s_);
    }
    set_phase(Phase::kDevice);
    ep_->sync_and_check(s_);
    // Every element: the identity expert gives x times the sum of the token's weights (bf16 tolerance).
    const std::vector<uint8_t>& h = download(ep_out_.ptr, static_cast<uint64_t>(tokens) * kEpHidden * 2);
    for (int t = 0; t < tokens; ++t) {
        float sum = 0;
        for (int j = 0; j < kEpTopk; ++j) sum += r.weights[static_cast<size_t>(t * kEpTopk + j)];
        for (int ch = 0; ch < kEpHidden; ++ch) {
            const uint64_t i = static_cast<uint64_t>(t) * kEpHidden + static_cast<uint64_t>(ch);
            const float want = static_cast<float>(small_int(p.salt, me_, i, kEpRange)) * sum;
            const float got = bits_to_float(DType::kBF16, h.data() + i * 2);
            if (!(std::fabs(got - want) <= 0.03f * std::fabs(want) + 0.02f)) return wrong("out", i, got, want);
        }
    }
    return "";
}

}  // namespace weft::bench::soak
