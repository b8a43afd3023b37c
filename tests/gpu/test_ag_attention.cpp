// SPDX-License-Identifier: MIT
// GPU tests of the prefill attention: weft::ops::flash_attention on one GPU and weft::ops::AgAttention with ranks as
// threads sharing the visible GPUs (worlds 1-8), against an fp64 host reference: causal and no mask,
// grouped-query attention, head dims 64 and 128, lengths that are not multiples of the tiles, strided K/V, outputs
// poisoned (NaN) before every call, repeated calls (the end-of-call protocol), a CUDA graph replayed and ranks that
// call with different row counts (diagnosed on both). Every test
// runs each prefill kernel (AttentionPrefillConfig::kernel: mma.sync and wgmma).
#include <gtest/gtest.h>

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "support/runtime_checks.hpp"
#include "weft/ops/ag_attention.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

bool have_sm90() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return false;
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    return prop.major == 9 && prop.minor == 0;
}

/// The tests of a kernel kind (the suites' parameter).
class PrefillKernel : public ::testing::TestWithParam<AttentionPrefillKernel> {};

std::string kernel_param_name(const ::testing::TestParamInfo<AttentionPrefillKernel>& info) {
    return info.param == AttentionPrefillKernel::kWgmma ? "wgmma" : "mma";
}

/// The config a test runs: the kernel's default for (dtype, dim), with block_m when non-zero.
AttentionPrefillConfig config_of(AttentionPrefillKernel kernel, DType dtype, int dim, int block_m = 0) {
    AttentionPrefillConfig cfg = attention_prefill_default_config(dtype, dim, kernel);
    if (block_m != 0) cfg.block_m = block_m;
    return cfg;
}

uint16_t to_bits(float x, DType t) {
    if (t == DType::kF16) {
        // Round to nearest even by hand (no host half type): the generators below give values in [-2, 2].
        const float a = std::fabs(x);
        uint32_t u;
        std::memcpy(&u, &x, 4);
        const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
        if (a < 6.1035156e-05f) return sign;  // subnormal range: zero (the reference reads the same bits)
        int e = 0;
        const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
        const int exp16 = e - 1 + 15;
        const float frac = (m * 2.f - 1.f) * 1024.f;
        auto mant = static_cast<uint32_t>(std::nearbyint(frac));
        uint32_t bits = (static_cast<uint32_t>(exp16) << 10) + mant;  // a carry into the exponent is correct
        return static_cast<uint16_t>(sign | bits);
    }
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

double to_value(uint16_t b, DType t) {
    if (t == DType::kF16) {
        const int e = (b >> 10) & 0x1f;
        const int m = b & 0x3ff;
        const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
        return (b & 0x8000) ? -mag : mag;
    }
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

/// A whole sequence: q [seq, hq, dim], k and v [seq_kv, hkv, dim], and the fp64 reference for queries at positions
/// q_position + i.
struct Problem {
    int seq_q = 0, seq_kv = 0, hq = 0, hkv = 0, dim = 0;
    int64_t q_position = 0;
    bool causal = false;
    DType dtype = DType::kBF16;
    std::vector<uint16_t> q, k, v;
    std::vector<double> out, lse;
};

/// `scale`: the softmax scale (nullopt: 1 / sqrt(dim), the op's default).
Problem make_problem(int seq_q, int seq_kv, int hq, int hkv, int dim, bool causal, int64_t q_position, DType dtype,
                     uint64_t seed, std::optional<float> scale = std::nullopt) {
    Problem pr;
    pr.seq_q = seq_q;
    pr.seq_kv = seq_kv;
    pr.hq = hq;
    pr.hkv = hkv;
    pr.dim = dim;
    pr.causal = causal;
    pr.q_position = q_position;
    pr.dtype = dtype;
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    pr.q.resize(static_cast<size_t>(seq_q) * hq * dim);
    pr.k.resize(static_cast<size_t>(seq_kv) * hkv * dim);
    pr.v.resize(pr.k.size());
    // Scores of a few units: softmax far from uniform, so that a wrong key or mask shows.
    for (auto& x : pr.q) x = to_bits(2.f * u(rng), dtype);
    for (auto& x : pr.k) x = to_bits(u(rng), dtype);
    for (auto& x : pr.v) x = to_bits(u(rng), dtype);
    pr.out.assign(pr.q.size(), 0.0);
    pr.lse.assign(static_cast<size_t>(seq_q) * hq, -INFINITY);
    const double sc = scale ? static_cast<double>(*scale) : 1.0 / std::sqrt(static_cast<double>(dim));
    const int group = hq / hkv;
    std::vector<double> qd(pr.q.size()), kd(pr.k.size()), vd(pr.v.size());
    for (size_t i = 0; i < qd.size(); ++i) qd[i] = to_value(pr.q[i], dtype);
    for (size_t i = 0; i < kd.size(); ++i) kd[i] = to_value(pr.k[i], dtype);
    for (size_t i = 0; i < vd.size(); ++i) vd[i] = to_value(pr.v[i], dtype);
    std::vector<double> s(static_cast<size_t>(seq_kv));
    for (int i = 0; i < seq_q; ++i) {
        const int64_t pos = q_position + i;
        const int visible =
            causal ? static_cast<int>(std::min<int64_t>(seq_kv, std::max<int64_t>(0, pos + 1))) : seq_kv;
        for (int h = 0; h < hq; ++h) {
            const size_t row = static_cast<size_t>(i) * hq + h;
            const int kvh = h / group;
            if (visible == 0) continue;
            double m = -INFINITY;
            for (int j = 0; j < visible; ++j) {
                double dot = 0;
                const size_t kb = (static_cast<size_t>(j) * hkv + kvh) * dim;
                for (int e = 0; e < dim; ++e) dot += qd[row * dim + e] * kd[kb + e];
                s[static_cast<size_t>(j)] = dot * sc;
                m = std::max(m, s[static_cast<size_t>(j)]);
            }
            double l = 0;
            for (int j = 0; j < visible; ++j) {
                const double p = std::exp(s[static_cast<size_t>(j)] - m);
                l += p;
                const size_t vb = (static_cast<size_t>(j) * hkv + kvh) * dim;
                for (int e = 0; e < dim; ++e) pr.out[row * dim + e] += p * vd[vb + e];
            }
            for (int e = 0; e < dim; ++e) pr.out[row * dim + e] /= l;
            pr.lse[row] = m + std::log(l);
        }
    }
    return pr;
}

/// Checks rows [row0, row0 + rows) of the reference against `out` / `lse` (which hold just those rows).
void check_rows(const Problem& pr, int row0, int rows, const std::vector<uint16_t>& out, const std::vector<float>& lse,
                const std::string& what) {
    int bad = 0;
    const size_t width = static_cast<size_t>(pr.hq) * pr.dim;
    for (int i = 0; i < rows && bad < 8; ++i) {
        for (int h = 0; h < pr.hq && bad < 8; ++h) {
            const size_t ref_row = static_cast<size_t>(row0 + i) * pr.hq + h;
            const size_t got_row = static_cast<size_t>(i) * pr.hq + h;
            const double want_lse = pr.lse[ref_row];
            const float got_lse = lse[got_row];
            const bool empty = std::isinf(want_lse);
            if (empty ? !(std::isinf(got_lse) && got_lse < 0) : !(std::fabs(got_lse - want_lse) <= 2e-3)) {
                ADD_FAILURE() << what << ": lse[" << row0 + i << ", " << h << "] = " << got_lse << ", want "
                              << want_lse;
                ++bad;
            }
            for (int e = 0; e < pr.dim; ++e) {
                const double want = pr.out[ref_row * pr.dim + e];
                const double got = to_value(out[static_cast<size_t>(i) * width + h * pr.dim + e], pr.dtype);
                if (!(std::fabs(got - want) <= 6e-3 + 1.6e-2 * std::fabs(want))) {
                    ADD_FAILURE() << what << ": out[" << row0 + i << ", " << h << ", " << e << "] = " << got
                                  << ", want " << want;
                    ++bad;
                    break;
                }
            }
        }
    }
}

uint64_t fresh_seed() {
    std::random_device rd;
    const uint64_t seed = (uint64_t{rd()} << 20) ^ rd();
    std::printf("[ seed     ] %llu\n", static_cast<unsigned long long>(seed));
    return seed;
}

// ------------------------------------------------------------------------------------------------
// One GPU

/// Copies a whole-problem output (all of pr's query rows) and LSE back from the device and checks them (check_rows).
void download_and_check(const Problem& pr, const void* dout, const void* dlse, const std::string& what) {
    std::vector<uint16_t> out(pr.q.size());
    std::vector<float> lse(pr.lse.size());
    WEFT_CUDA_CHECK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
    WEFT_CUDA_CHECK(cudaMemcpy(lse.data(), dlse, lse.size() * 4, cudaMemcpyDeviceToHost));
    check_rows(pr, 0, pr.seq_q, out, lse, what);
}

struct Case {
    int seq_q, seq_kv, hq, hkv, dim;
    bool causal;
    int64_t q_position;
    DType dtype = DType::kBF16;
    int kv_row_pad = 0;  // extra elements per K/V row: a strided view into a wider buffer
    int block_m = 0;     // 0: the default config
    std::optional<float> scale = std::nullopt;  // the op's default
};

void run_case(const Case& c, uint64_t seed, AttentionPrefillKernel kernel) {
    if (c.block_m == 192 && kernel != AttentionPrefillKernel::kWgmma) return;  // the wgmma kernel's items only
    const Problem pr =
        make_problem(c.seq_q, c.seq_kv, c.hq, c.hkv, c.dim, c.causal, c.q_position, c.dtype, seed, c.scale);
    const std::string what = "seq_q " + std::to_string(c.seq_q) + " seq_kv " + std::to_string(c.seq_kv) + " heads " +
                             std::to_string(c.hq) + "/" + std::to_string(c.hkv) + " dim " + std::to_string(c.dim) +
                             (c.causal ? " causal" : " no mask") + " q_position " + std::to_string(c.q_position) + " " +
                             dtype_name(c.dtype) + " pad " + std::to_string(c.kv_row_pad) + " block_m " +
                             std::to_string(c.block_m) + " scale " + (c.scale ? std::to_string(*c.scale) : "default") +
                             (kernel == AttentionPrefillKernel::kWgmma ? " wgmma" : " mma.sync");
    SCOPED_TRACE(what);
    const int64_t kv_row = static_cast<int64_t>(c.hkv) * c.dim + c.kv_row_pad;
    std::vector<uint16_t> kp(static_cast<size_t>(std::max(1, c.seq_kv) * kv_row), 0x7fc0);  // NaN in the padding
    std::vector<uint16_t> vp(kp.size(), 0x7fc0);
    for (int j = 0; j < c.seq_kv; ++j) {
        std::copy_n(pr.k.begin() + static_cast<std::ptrdiff_t>(j) * c.hkv * c.dim, c.hkv * c.dim,
                    kp.begin() + static_cast<std::ptrdiff_t>(j * kv_row));
        std::copy_n(pr.v.begin() + static_cast<std::ptrdiff_t>(j) * c.hkv * c.dim, c.hkv * c.dim,
                    vp.begin() + static_cast<std::ptrdiff_t>(j * kv_row));
    }
    void *dq, *dk, *dv, *dout, *dlse;
    WEFT_CUDA_CHECK(cudaMalloc(&dq, std::max<size_t>(16, pr.q.size() * 2)));
    WEFT_CUDA_CHECK(cudaMalloc(&dk, kp.size() * 2));
    WEFT_CUDA_CHECK(cudaMalloc(&dv, vp.size() * 2));
    WEFT_CUDA_CHECK(cudaMalloc(&dout, std::max<size_t>(16, pr.q.size() * 2)));
    WEFT_CUDA_CHECK(cudaMalloc(&dlse, std::max<size_t>(16, pr.lse.size() * 4)));
    WEFT_CUDA_CHECK(cudaMemcpy(dq, pr.q.data(), pr.q.size() * 2, cudaMemcpyHostToDevice));
    WEFT_CUDA_CHECK(cudaMemcpy(dk, kp.data(), kp.size() * 2, cudaMemcpyHostToDevice));
    WEFT_CUDA_CHECK(cudaMemcpy(dv, vp.data(), vp.size() * 2, cudaMemcpyHostToDevice));
    WEFT_CUDA_CHECK(cudaMemset(dout, 0xff, pr.q.size() * 2));
    WEFT_CUDA_CHECK(cudaMemset(dlse, 0xff, pr.lse.size() * 4));
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());  // the memsets run on the legacy stream: done before a non-blocking one
    const TensorView tq(dq, c.dtype, {c.seq_q, c.hq, c.dim});
    const TensorView tk(dk, c.dtype, {c.seq_kv, c.hkv, c.dim}, {kv_row, c.dim, 1});
    const TensorView tv(dv, c.dtype, {c.seq_kv, c.hkv, c.dim}, {kv_row, c.dim, 1});
    const TensorView tout(dout, c.dtype, {c.seq_q, c.hq, c.dim});
    const TensorView tlse(dlse, DType::kF32, {c.seq_q, c.hq});
    ops::FlashAttentionOptions o;
    o.mask = c.causal ? AttentionMask::kCausal : AttentionMask::kNone;
    o.q_position = c.q_position;
    o.config = config_of(kernel, c.dtype, c.dim, c.block_m);
    o.scale = c.scale;
    ops::flash_attention(tq, tk, tv, tout, tlse, nullptr, o);
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    download_and_check(pr, dout, dlse, what);
    for (void* p : {dq, dk, dv, dout, dlse}) cudaFree(p);
}

/// A problem's q, k and v on the device (bf16, contiguous), freed at the end of the scope.
struct DeviceQkv {
    void* q = nullptr;
    void* k = nullptr;
    void* v = nullptr;
    TensorView tq, tk, tv;

    explicit DeviceQkv(const Problem& pr) {
        WEFT_CUDA_CHECK(cudaMalloc(&q, pr.q.size() * 2));
        WEFT_CUDA_CHECK(cudaMalloc(&k, pr.k.size() * 2));
        WEFT_CUDA_CHECK(cudaMalloc(&v, pr.v.size() * 2));
        WEFT_CUDA_CHECK(cudaMemcpy(q, pr.q.data(), pr.q.size() * 2, cudaMemcpyHostToDevice));
        WEFT_CUDA_CHECK(cudaMemcpy(k, pr.k.data(), pr.k.size() * 2, cudaMemcpyHostToDevice));
        WEFT_CUDA_CHECK(cudaMemcpy(v, pr.v.data(), pr.v.size() * 2, cudaMemcpyHostToDevice));
        tq = TensorView(q, DType::kBF16, {pr.seq_q, pr.hq, pr.dim});
        tk = TensorView(k, DType::kBF16, {pr.seq_kv, pr.hkv, pr.dim});
        tv = TensorView(v, DType::kBF16, {pr.seq_kv, pr.hkv, pr.dim});
    }
    ~DeviceQkv() {
        for (void* p : {q, k, v}) cudaFree(p);
    }
    DeviceQkv(const DeviceQkv&) = delete;
    DeviceQkv& operator=(const DeviceQkv&) = delete;
};

class FlashAttention : public PrefillKernel {};

TEST_P(FlashAttention, MatchesTheReference) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    const uint64_t seed = fresh_seed();
    const std::vector<Case> cases = {
        {1, 1, 1, 1, 64, true, 0},
        {77, 77, 4, 4, 64, true, 0},
        {77, 77, 4, 4, 128, false, 0},
        {200, 200, 8, 2, 128, true, 0},                       // GQA 4, a partial query and key tile
        {129, 300, 16, 1, 64, true, 171},                     // GQA 16, queries at the end of the keys
        {129, 300, 16, 1, 128, false, 0},                     // GQA 16, more keys than queries
        {64, 1000, 2, 1, 128, true, 500},                     // keys past the queries' positions are masked
        {150, 150, 6, 3, 128, true, 0, DType::kF16},          // f16
        {90, 250, 4, 2, 64, false, 0, DType::kBF16, 24},      // strided K/V
        {300, 300, 4, 2, 128, true, 0, DType::kBF16, 8, 64},  // block_m 64
        {513, 513, 2, 2, 64, true, 0, DType::kBF16, 0, 64},
        {40, 0, 2, 1, 64, false, 0},  // no keys: zeros and -inf
    };
    for (size_t i = 0; i < cases.size(); ++i) run_case(cases[i], seed + i, GetParam());
}

// Scales other than the default: zero (uniform weights over the visible keys), negative (the largest weight on the
// smallest score) and large (sharp rows); the wgmma kernel folds only a positive scale into its exponent.
TEST_P(FlashAttention, ZeroNegativeAndLargeScales) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    const uint64_t seed = fresh_seed();
    const std::vector<Case> cases = {
        {200, 200, 4, 2, 64, true, 0, DType::kBF16, 0, 0, 0.f},
        {129, 300, 4, 1, 128, true, 171, DType::kBF16, 0, 0, -0.2f},
        {300, 300, 2, 1, 64, false, 0, DType::kF16, 0, 0, -1.5f},
        {77, 500, 2, 2, 128, true, 400, DType::kBF16, 0, 0, 1.0f},
        {257, 257, 2, 2, 64, true, 0, DType::kBF16, 0, 64, 3.0f},
        {400, 400, 2, 1, 64, true, 0, DType::kBF16, 0, 192, -0.7f},
        {400, 400, 2, 1, 64, true, 0, DType::kBF16, 0, 192, 2.0f},
    };
    for (size_t i = 0; i < cases.size(); ++i) run_case(cases[i], seed + i, GetParam());
}

// K and V broadcast over their heads (head stride 0: every KV head is head 0) with options.config unset: sm_90's
// default wgmma kernel cannot hold such a view in its tensor maps, so the op runs the mma.sync kernel; the result is
// that of one KV head shared by every q-head. A config naming kWgmma refuses the view before the device.
TEST(FlashAttentionDefaults, ABroadcastKvRunsOnTheMmaSyncKernel) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    const int seq = 150, hq = 8, hkv_view = 4, dim = 128;
    const Problem pr = make_problem(seq, seq, hq, 1, dim, true, 0, DType::kBF16, fresh_seed());
    const DeviceQkv in(pr);
    void *dout, *dlse;
    WEFT_CUDA_CHECK(cudaMalloc(&dout, pr.q.size() * 2));
    WEFT_CUDA_CHECK(cudaMalloc(&dlse, pr.lse.size() * 4));
    WEFT_CUDA_CHECK(cudaMemset(dout, 0xff, pr.q.size() * 2));
    WEFT_CUDA_CHECK(cudaMemset(dlse, 0xff, pr.lse.size() * 4));
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    const TensorView& tq = in.tq;
    const TensorView tk(in.k, DType::kBF16, {seq, hkv_view, dim}, {dim, 0, 1});
    const TensorView tv(in.v, DType::kBF16, {seq, hkv_view, dim}, {dim, 0, 1});
    const TensorView tout(dout, DType::kBF16, {seq, hq, dim});
    const TensorView tlse(dlse, DType::kF32, {seq, hq});
    ops::FlashAttentionOptions o;
    o.mask = AttentionMask::kCausal;
    ops::flash_attention(tq, tk, tv, tout, tlse, nullptr, o);
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    download_and_check(pr, dout, dlse, "broadcast K/V, default config");

    o.config = config_of(AttentionPrefillKernel::kWgmma, DType::kBF16, dim);
    try {
        ops::flash_attention(tq, tk, tv, tout, tlse, nullptr, o);
        ADD_FAILURE() << "a broadcast K with the wgmma config was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("k stride 1 must be positive"), std::string::npos) << e.what();
    }
    for (void* p : {dout, dlse}) cudaFree(p);
}

// Lengths around the tiles (1, 63, 129, 1000, 4097), GQA 1 / 4 / 16, q_position != 0, both masks, head dims 64 and
// 128, f16, block_m 64, 128 and 192 (the wgmma kernel: one, two or three consumer warpgroups; 128-key tiles, short last
// tiles).
TEST_P(FlashAttention, AwkwardLengthsGroupsAndPositions) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    const uint64_t seed = fresh_seed();
    const std::vector<Case> cases = {
        {1, 1, 4, 1, 128, false, 0},
        {1, 4097, 4, 1, 128, true, 4096},  // one query at the end: every key
        {63, 63, 4, 4, 64, true, 0},
        {63, 129, 16, 1, 128, false, 0},
        {129, 129, 16, 4, 64, true, 0},
        {129, 1000, 4, 1, 128, true, 871},  // the queries at the end of the keys
        {1000, 1000, 4, 1, 64, true, 0, DType::kF16},
        {1000, 1000, 2, 2, 128, false, 0, DType::kF16},
        {1000, 4097, 4, 1, 128, true, 2000},  // causal, keys past the last query unseen
        {4097, 4097, 2, 2, 64, true, 0},
        {4097, 4097, 2, 1, 128, true, 0, DType::kBF16, 0, 64},  // block_m 64
        {129, 4097, 16, 1, 128, false, 0, DType::kF16, 0, 64},
        {300, 700, 8, 2, 128, true, 100, DType::kBF16, 40},   // strided K/V, causal cut inside a tile
        {200, 200, 4, 1, 64, true, 1000},                     // q_position past the keys: every key visible
        {256, 256, 2, 1, 128, false, 0, DType::kBF16, 0, 0},  // whole tiles only
        // block_m 192 (the wgmma kernel at dim 64: three consumer warpgroups taking turns)
        {63, 63, 4, 4, 64, true, 0, DType::kBF16, 0, 192},
        {193, 500, 2, 1, 64, false, 0, DType::kBF16, 0, 192},
        {1000, 1000, 4, 1, 64, true, 0, DType::kF16, 0, 192},
        {129, 1000, 4, 1, 64, true, 871, DType::kBF16, 0, 192},
        {300, 700, 8, 2, 64, true, 100, DType::kBF16, 40, 192},  // strided K/V, causal cut inside a tile
        {200, 200, 4, 1, 64, true, 1000, DType::kBF16, 0, 192},
        {4097, 4097, 2, 2, 64, true, 0, DType::kBF16, 0, 192},
        // block_m 128 at dim 64 (the calls too small for 192-row items)
        {1000, 1000, 4, 1, 64, true, 0, DType::kF16, 0, 128},
        {129, 300, 16, 1, 64, true, 171, DType::kBF16, 0, 128},
        {4097, 4097, 2, 2, 64, true, 0, DType::kBF16, 0, 128},
    };
    for (size_t i = 0; i < cases.size(); ++i) run_case(cases[i], seed + i, GetParam());
}

// The wgmma kernel's work counters (one per device and stream for uncaptured calls, one of its own per captured
// launch; each left at zero by its launch): calls on two streams at once, repeated, each into a freshly poisoned
// output, every result checked against the fp64 reference (the first) or bit for bit against it (items are computed
// alike whichever block claims them); then graphs captured on a stream that has a counter and on a fresh one, each
// replayed on a third stream while a direct call runs on the capture stream. More items than resident blocks (192 at
// dim 64, 288 at 128).
TEST(FlashAttentionSchedule, CallsOnTwoStreamsRepeatedAndCapturedAgree) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    for (const int dim : {64, 128}) {
        const int seq = 700, hq = 48, hkv = 12;
        SCOPED_TRACE("dim " + std::to_string(dim));
        const Problem pr = make_problem(seq, seq, hq, hkv, dim, true, 0, DType::kBF16, fresh_seed());
        const size_t q_bytes = pr.q.size() * 2, lse_bytes = pr.lse.size() * 4;
        const DeviceQkv in(pr);
        void *dout[2], *dlse[2];
        for (int i = 0; i < 2; ++i) {
            WEFT_CUDA_CHECK(cudaMalloc(&dout[i], q_bytes));
            WEFT_CUDA_CHECK(cudaMalloc(&dlse[i], lse_bytes));
        }
        ops::FlashAttentionOptions o;
        o.mask = AttentionMask::kCausal;
        o.config = config_of(AttentionPrefillKernel::kWgmma, DType::kBF16, dim);
        cudaStream_t st[3];
        for (cudaStream_t& x : st) WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
        const auto call = [&](int i, cudaStream_t stream) {
            WEFT_CUDA_CHECK(cudaMemsetAsync(dout[i], 0xff, q_bytes, stream));
            WEFT_CUDA_CHECK(cudaMemsetAsync(dlse[i], 0xff, lse_bytes, stream));
            ops::flash_attention(in.tq, in.tk, in.tv, TensorView(dout[i], DType::kBF16, {seq, hq, dim}),
                                 TensorView(dlse[i], DType::kF32, {seq, hq}), stream, o);
        };
        std::vector<uint16_t> want(pr.q.size()), got(pr.q.size());
        std::vector<float> want_lse(pr.lse.size()), got_lse(pr.lse.size());
        const auto expect_same = [&](int i, const std::string& what) {
            WEFT_CUDA_CHECK(cudaMemcpy(got.data(), dout[i], q_bytes, cudaMemcpyDeviceToHost));
            WEFT_CUDA_CHECK(cudaMemcpy(got_lse.data(), dlse[i], lse_bytes, cudaMemcpyDeviceToHost));
            EXPECT_EQ(std::memcmp(got.data(), want.data(), q_bytes), 0) << what << ": out differs";
            EXPECT_EQ(std::memcmp(got_lse.data(), want_lse.data(), lse_bytes), 0) << what << ": lse differs";
        };
        for (int rep = 0; rep < 4; ++rep) {
            call(0, st[0]);
            call(1, st[1]);
            WEFT_CUDA_CHECK(cudaDeviceSynchronize());
            if (rep == 0) {
                download_and_check(pr, dout[0], dlse[0], "stream 0, first call");
                WEFT_CUDA_CHECK(cudaMemcpy(want.data(), dout[0], q_bytes, cudaMemcpyDeviceToHost));
                WEFT_CUDA_CHECK(cudaMemcpy(want_lse.data(), dlse[0], lse_bytes, cudaMemcpyDeviceToHost));
            } else {
                expect_same(0, "stream 0, call " + std::to_string(rep));
            }
            expect_same(1, "stream 1, call " + std::to_string(rep));
        }
        for (const int s : {0, 2}) {  // stream 0 has a counter, stream 2 none yet
            cudaGraph_t graph = nullptr;
            cudaGraphExec_t exec = nullptr;
            WEFT_CUDA_CHECK(cudaStreamBeginCapture(st[s], cudaStreamCaptureModeThreadLocal));
            call(1, st[s]);
            WEFT_CUDA_CHECK(cudaStreamEndCapture(st[s], &graph));
            WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            const cudaStream_t other = st[s == 0 ? 1 : 0];  // replays beside direct calls on the capture stream
            for (int rep = 0; rep < 2; ++rep) {
                WEFT_CUDA_CHECK(cudaGraphLaunch(exec, other));
                call(0, st[s]);
                WEFT_CUDA_CHECK(cudaDeviceSynchronize());
                expect_same(1, "graph captured on stream " + std::to_string(s) + ", replay " + std::to_string(rep));
                expect_same(0, "a call on stream " + std::to_string(s) + " beside the replay " + std::to_string(rep));
            }
            WEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
            WEFT_CUDA_CHECK(cudaGraphDestroy(graph));
        }
        call(0, st[2]);  // stream 2 on its own counter, after its capture
        WEFT_CUDA_CHECK(cudaStreamSynchronize(st[2]));
        expect_same(0, "stream 2 after its capture");
        for (cudaStream_t x : st) WEFT_CUDA_CHECK(cudaStreamDestroy(x));
        for (void* p : {dout[0], dout[1], dlse[0], dlse[1]}) cudaFree(p);
    }
}

// More captured launches than spare counters (an uncaptured call leaves at most 79): the first ones run on counters of
// their own, the rest walk the items in waves; every launch of the graph (replayed twice) writes its own output, each
// bit for bit the uncaptured call's (checked against the fp64 reference).
TEST(FlashAttentionSchedule, CapturesBeyondTheSpareCountersWalkWaves) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    const int seq = 700, hq = 48, hkv = 12, dim = 64, launches = 140;
    const Problem pr = make_problem(seq, seq, hq, hkv, dim, true, 0, DType::kBF16, fresh_seed());
    const size_t q_bytes = pr.q.size() * 2;
    const DeviceQkv in(pr);
    void *douts, *dlse;
    WEFT_CUDA_CHECK(cudaMalloc(&douts, q_bytes * (launches + 1)));
    WEFT_CUDA_CHECK(cudaMalloc(&dlse, pr.lse.size() * 4));
    const auto out = [&](int i) {
        return TensorView(static_cast<char*>(douts) + q_bytes * i, DType::kBF16, {seq, hq, dim});
    };
    ops::FlashAttentionOptions o;
    o.mask = AttentionMask::kCausal;
    o.config = config_of(AttentionPrefillKernel::kWgmma, DType::kBF16, dim);
    cudaStream_t st = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    WEFT_CUDA_CHECK(cudaMemsetAsync(douts, 0xff, q_bytes * (launches + 1), st));
    ops::flash_attention(in.tq, in.tk, in.tv, out(launches), TensorView(dlse, DType::kF32, {seq, hq}), st, o);
    WEFT_CUDA_CHECK(cudaStreamSynchronize(st));
    download_and_check(pr, out(launches).data, dlse, "the uncaptured call");
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    WEFT_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    WEFT_CUDA_CHECK(cudaMemsetAsync(douts, 0xff, q_bytes * launches, st));
    for (int i = 0; i < launches; ++i) ops::flash_attention(in.tq, in.tk, in.tv, out(i), TensorView(), st, o);
    WEFT_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
    WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<uint8_t> all(q_bytes * (launches + 1));
    for (int rep = 0; rep < 2; ++rep) {
        WEFT_CUDA_CHECK(cudaGraphLaunch(exec, st));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(st));
        WEFT_CUDA_CHECK(cudaMemcpy(all.data(), douts, all.size(), cudaMemcpyDeviceToHost));
        const uint8_t* want = all.data() + q_bytes * launches;
        for (int i = 0; i < launches; ++i) {
            ASSERT_EQ(std::memcmp(all.data() + q_bytes * i, want, q_bytes), 0)
                << "captured launch " << i << " of " << launches << ", replay " << rep;
        }
    }
    WEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
    WEFT_CUDA_CHECK(cudaGraphDestroy(graph));
    WEFT_CUDA_CHECK(cudaStreamDestroy(st));
    for (void* p : {douts, dlse}) cudaFree(p);
}

INSTANTIATE_TEST_SUITE_P(Kernels, FlashAttention,
                         ::testing::Values(AttentionPrefillKernel::kMmaSync, AttentionPrefillKernel::kWgmma),
                         kernel_param_name);

// ------------------------------------------------------------------------------------------------
// All-gather attention

struct AgCase {
    int world, rows, hq, hkv, dim;
    bool causal;
    bool graph = false;
};

void run_ag(const AgCase& c, uint64_t seed, AttentionPrefillKernel kernel) {
    const int seq = c.world * c.rows;
    const Problem pr = make_problem(seq, seq, c.hq, c.hkv, c.dim, c.causal, 0, DType::kBF16, seed);
    const std::string what = "world " + std::to_string(c.world) + " rows " + std::to_string(c.rows) + " heads " +
                             std::to_string(c.hq) + "/" + std::to_string(c.hkv) + " dim " + std::to_string(c.dim) +
                             (c.causal ? " causal" : " no mask") +
                             (kernel == AttentionPrefillKernel::kWgmma ? " wgmma" : " mma.sync");
    SCOPED_TRACE(what);
    run_ranks(
        c.world,
        [&](World& w) {
            const int me = w.rank();
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            const size_t q_elems = static_cast<size_t>(c.rows) * c.hq * c.dim;
            const size_t kv_elems = static_cast<size_t>(c.rows) * c.hkv * c.dim;
            void *dq, *dk, *dv, *dout, *dlse;
            WEFT_CUDA_CHECK(cudaMalloc(&dq, q_elems * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dk, kv_elems * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dv, kv_elems * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dout, q_elems * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dlse, static_cast<size_t>(c.rows) * c.hq * 4));
            // On `s`: a cudaMemcpy from pageable memory may return before its DMA lands, on the legacy stream.
            WEFT_CUDA_CHECK(cudaMemcpyAsync(dq, pr.q.data() + me * q_elems, q_elems * 2, cudaMemcpyHostToDevice, s));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(dk, pr.k.data() + me * kv_elems, kv_elems * 2, cudaMemcpyHostToDevice, s));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(dv, pr.v.data() + me * kv_elems, kv_elems * 2, cudaMemcpyHostToDevice, s));
            const TensorView tq(dq, DType::kBF16, {c.rows, c.hq, c.dim});
            const TensorView tk(dk, DType::kBF16, {c.rows, c.hkv, c.dim});
            const TensorView tv(dv, DType::kBF16, {c.rows, c.hkv, c.dim});
            const TensorView tout(dout, DType::kBF16, {c.rows, c.hq, c.dim});
            const TensorView tlse(dlse, DType::kF32, {c.rows, c.hq});
            ops::AgAttention op(w,
                                {.max_seq = seq + c.world * 7,  // calls may use less than the bound
                                 .num_q_heads = c.hq,
                                 .num_kv_heads = c.hkv,
                                 .head_dim = c.dim,
                                 .dtype = DType::kBF16,
                                 .mask = c.causal ? AttentionMask::kCausal : AttentionMask::kNone},
                                {.config = config_of(kernel, DType::kBF16, c.dim)});
            // Before every call: the outputs and this rank's gathered K/V poisoned (every rank's previous call is over:
            // its end of call meets the team), so that a shard not pulled again this call shows.
            const auto poison = [&] {
                WEFT_CUDA_CHECK(cudaMemsetAsync(dout, 0xff, q_elems * 2, s));
                WEFT_CUDA_CHECK(cudaMemsetAsync(dlse, 0xff, static_cast<size_t>(c.rows) * c.hq * 4, s));
                for (const TensorView& g : {op.gathered_k(seq), op.gathered_v(seq)}) {
                    WEFT_CUDA_CHECK(cudaMemsetAsync(g.data, 0xff, static_cast<size_t>(g.size_bytes()), s));
                }
            };
            // Some calls run on -V (the output negates exactly, the LSE stays): a call that read an earlier call's
            // V shows. `negated` tells download_and_check which.
            std::vector<uint16_t> v_negated(pr.v.begin() + static_cast<std::ptrdiff_t>(me * kv_elems),
                                            pr.v.begin() + static_cast<std::ptrdiff_t>((me + 1) * kv_elems));
            for (uint16_t& x : v_negated) x ^= 0x8000u;
            const auto set_v = [&](bool negated) {
                WEFT_CUDA_CHECK(cudaMemcpyAsync(dv, negated ? v_negated.data() : pr.v.data() + me * kv_elems,
                                                kv_elems * 2, cudaMemcpyHostToDevice, s));
            };
            const auto download_and_check = [&](const std::string& call, bool negated) {
                w.sync_and_check(s);
                std::vector<uint16_t> out(q_elems);
                std::vector<float> lse(static_cast<size_t>(c.rows) * c.hq);
                WEFT_CUDA_CHECK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
                WEFT_CUDA_CHECK(cudaMemcpy(lse.data(), dlse, lse.size() * 4, cudaMemcpyDeviceToHost));
                if (negated) {
                    for (uint16_t& x : out) x ^= 0x8000u;  // back to the reference's sign (a NaN stays a NaN)
                }
                check_rows(pr, me * c.rows, c.rows, out, lse,
                           what + ", rank " + std::to_string(me) + ", " + call + (negated ? " (on -V)" : ""));
                // The gathered K holds every shard this rank needed.
                const TensorView gk = op.gathered_k(seq);
                const int needed = c.causal ? me + 1 : c.world;
                std::vector<uint16_t> got(static_cast<size_t>(needed) * kv_elems);
                WEFT_CUDA_CHECK(cudaMemcpy(got.data(), gk.data, got.size() * 2, cudaMemcpyDeviceToHost));
                EXPECT_TRUE(std::equal(got.begin(), got.end(), pr.k.begin()))
                    << what << ", rank " << me << ", " << call << ": gathered K differs";
            };
            // V with a row stride of its own (K's is dense): a team of one rank copies both before its kernel.
            const int64_t v_pitch = static_cast<int64_t>(c.hkv) * c.dim + 8;
            void* dv_wide = nullptr;
            WEFT_CUDA_CHECK(cudaMalloc(&dv_wide, static_cast<size_t>(c.rows * v_pitch) * 2));
            WEFT_CUDA_CHECK(cudaMemcpy2DAsync(
                dv_wide, static_cast<size_t>(v_pitch) * 2, dv, static_cast<size_t>(c.hkv) * c.dim * 2,
                static_cast<size_t>(c.hkv) * c.dim * 2, static_cast<size_t>(c.rows), cudaMemcpyDeviceToDevice, s));
            const TensorView tv_wide(dv_wide, DType::kBF16, {c.rows, c.hkv, c.dim}, {v_pitch, c.dim, 1});
            for (int call = 0; call < 4; ++call) {
                poison();
                set_v(call == 1);  // calls 2 and 3 read V from dv and dv_wide, both +V
                if (call == 3) {
                    op.run(tq, tk, tv_wide, tout, tlse, s);
                } else if (call == 2) {
                    // K/V written straight into this rank's slots: the local copy is skipped.
                    const TensorView lk = op.local_k(seq), lv = op.local_v(seq);
                    WEFT_CUDA_CHECK(cudaMemcpyAsync(lk.data, dk, kv_elems * 2, cudaMemcpyDeviceToDevice, s));
                    WEFT_CUDA_CHECK(cudaMemcpyAsync(lv.data, dv, kv_elems * 2, cudaMemcpyDeviceToDevice, s));
                    op.run(tq, lk, lv, tout, tlse, s);
                } else {
                    op.run(tq, tk, tv, tout, tlse, s);
                }
                download_and_check("eager call " + std::to_string(call), call == 1);
            }
            if (c.graph) {
                cudaGraph_t g = nullptr;
                WEFT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
                op.run(tq, tk, tv, tout, tlse, s);
                WEFT_CUDA_CHECK(cudaStreamEndCapture(s, &g));
                cudaGraphExec_t exec = nullptr;
                WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
                WEFT_CUDA_CHECK(cudaGraphUpload(exec, s));
                w.sync_and_check(s);
                w.barrier();
                for (int r = 0; r < 3; ++r) {
                    poison();
                    set_v(r % 2 == 0);
                    WEFT_CUDA_CHECK(cudaGraphLaunch(exec, s));
                    download_and_check("graph replay " + std::to_string(r), r % 2 == 0);
                }
                WEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
                WEFT_CUDA_CHECK(cudaGraphDestroy(g));
            }
            w.sync_and_check(s);
            w.barrier();
            for (void* p : {dq, dk, dv, dv_wide, dout, dlse}) cudaFree(p);
            cudaStreamDestroy(s);
        },
        test_options(64ull << 20));
}

class AgAttention : public PrefillKernel {};

TEST_P(AgAttention, ShardedSequenceMatchesTheWholeSequenceReference) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    const uint64_t seed = fresh_seed();
    const std::vector<AgCase> cases = {
        {1, 100, 4, 2, 128, true},      {2, 77, 4, 2, 128, true, true}, {2, 64, 8, 8, 64, false},
        {3, 45, 16, 1, 64, true, true}, {3, 130, 4, 4, 128, false},     {4, 129, 8, 2, 128, true},
        {4, 33, 2, 1, 64, false, true}, {8, 40, 4, 1, 128, true},       {8, 17, 2, 2, 64, false},
        {5, 37, 4, 2, 64, true},        {6, 50, 2, 1, 128, false},      {7, 21, 4, 4, 64, true, true},
    };
    for (size_t i = 0; i < cases.size(); ++i) run_ag(cases[i], seed + i, GetParam());
}

TEST_P(AgAttention, RefusesUnevenShardsAndBadCalls) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    run_ranks(
        2,
        [&](World& w) {
            try {
                ops::AgAttention bad(w, {.max_seq = 101, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 64});
                ADD_FAILURE() << "an odd max_seq on 2 ranks was accepted";
            } catch (const Error& e) {
                EXPECT_NE(std::string(e.what()).find("uneven shards"), std::string::npos) << e.what();
            }
            ops::AgAttention op(w, {.max_seq = 128, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 64},
                                {.config = config_of(GetParam(), DType::kBF16, 64)});
            void* buf = nullptr;
            WEFT_CUDA_CHECK(cudaMalloc(&buf, 1 << 20));
            const TensorView q(buf, DType::kBF16, {100, 4, 64});  // 200 tokens > max_seq
            const TensorView kv(buf, DType::kBF16, {100, 2, 64});
            try {
                op.run(q, kv, kv, q, TensorView(), nullptr);
                ADD_FAILURE() << "a call longer than max_seq was accepted";
            } catch (const Error& e) {
                EXPECT_NE(std::string(e.what()).find("max_seq"), std::string::npos) << e.what();
            }
            const TensorView q2(buf, DType::kBF16, {32, 4, 64});
            const TensorView kv_wrong(buf, DType::kBF16, {31, 2, 64});
            try {
                op.run(q2, kv_wrong, kv_wrong, q2, TensorView(), nullptr);
                ADD_FAILURE() << "k_local with the wrong rows was accepted";
            } catch (const Error& e) {
                EXPECT_NE(std::string(e.what()).find("k_local"), std::string::npos) << e.what();
            }
            // Q inside the gathered K buffer: the shards are copied there while the kernel reads Q.
            uint8_t* b8 = static_cast<uint8_t*>(buf);
            const TensorView q_in_gathered(op.gathered_k(64).data, DType::kBF16, {32, 4, 64});
            const TensorView k3(b8, DType::kBF16, {32, 2, 64}), v3(b8 + (64 << 10), DType::kBF16, {32, 2, 64});
            const TensorView out3(b8 + (128 << 10), DType::kBF16, {32, 4, 64});
            try {
                op.run(q_in_gathered, k3, v3, out3, TensorView(), nullptr);
                ADD_FAILURE() << "q_local inside the gathered K buffer was accepted";
            } catch (const Error& e) {
                EXPECT_NE(std::string(e.what()).find("q_local must not overlap the gathered K buffer"),
                          std::string::npos)
                    << e.what();
            }
            w.barrier();
            cudaFree(buf);
        },
        test_options(64ull << 20));
}

// Ranks that call with different S (rank 0 with 64 rows, rank 1 with 32; no mask, so each reads the other's shard):
// every rank's call throws naming both calls, no abort is raised, and after every rank cleared its diagnostics a
// second call on the same op with agreeing rows matches the reference (the protocol came out of the first whole).
TEST_P(AgAttention, DifferentRowCountsOnTwoRanksAreDiagnosedOnBoth) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    const int hq = 4, hkv = 2, dim = 64, agreed_rows = 48;
    const Problem pr =
        make_problem(2 * agreed_rows, 2 * agreed_rows, hq, hkv, dim, false, 0, DType::kBF16, fresh_seed());
    std::mutex mutex;
    std::vector<std::string> messages(2);
    WorldOptions options = test_options(64ull << 20);
    options.heartbeat = std::chrono::milliseconds(200);
    run_ranks(
        2,
        [&](World& w) {
            const int me = w.rank();
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            const int max_rows = 64;
            const size_t q_elems = static_cast<size_t>(max_rows) * hq * dim;
            const size_t kv_elems = static_cast<size_t>(max_rows) * hkv * dim;
            void *dq, *dk, *dv, *dout, *dlse;
            WEFT_CUDA_CHECK(cudaMalloc(&dq, q_elems * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dk, kv_elems * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dv, kv_elems * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dout, q_elems * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dlse, static_cast<size_t>(max_rows) * hq * 4));
            {
                ops::AgAttention op(w,
                                    {.max_seq = 2 * max_rows,
                                     .num_q_heads = hq,
                                     .num_kv_heads = hkv,
                                     .head_dim = dim,
                                     .dtype = DType::kBF16,
                                     .mask = AttentionMask::kNone},
                                    {.config = config_of(GetParam(), DType::kBF16, dim)});
                // Call 0: 64 rows on rank 0, 32 on rank 1 (inputs: whatever the first rows of the problem hold).
                const int rows = me == 0 ? max_rows : max_rows / 2;
                const size_t q_n = static_cast<size_t>(rows) * hq * dim, kv_n = static_cast<size_t>(rows) * hkv * dim;
                WEFT_CUDA_CHECK(cudaMemsetAsync(dq, 0, q_elems * 2, s));
                WEFT_CUDA_CHECK(cudaMemsetAsync(dk, 0, kv_elems * 2, s));
                WEFT_CUDA_CHECK(cudaMemsetAsync(dv, 0, kv_elems * 2, s));
                WEFT_CUDA_CHECK(
                    cudaMemcpyAsync(dq, pr.q.data(), std::min(q_n, pr.q.size()) * 2, cudaMemcpyHostToDevice, s));
                WEFT_CUDA_CHECK(
                    cudaMemcpyAsync(dk, pr.k.data(), std::min(kv_n, pr.k.size()) * 2, cudaMemcpyHostToDevice, s));
                WEFT_CUDA_CHECK(
                    cudaMemcpyAsync(dv, pr.v.data(), std::min(kv_n, pr.v.size()) * 2, cudaMemcpyHostToDevice, s));
                std::string message;
                try {
                    op.run(
                        TensorView(dq, DType::kBF16, {rows, hq, dim}), TensorView(dk, DType::kBF16, {rows, hkv, dim}),
                        TensorView(dv, DType::kBF16, {rows, hkv, dim}), TensorView(dout, DType::kBF16, {rows, hq, dim}),
                        TensorView(dlse, DType::kF32, {rows, hq}), s);
                    w.sync_and_check(s);
                } catch (const Error& e) {
                    message = e.what();
                }
                {
                    std::lock_guard<std::mutex> lock(mutex);
                    messages[static_cast<size_t>(me)] = message;
                }
                EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the context stays usable";
                EXPECT_FALSE(w.aborted()) << "no abort: every rank found the mismatch itself";
                w.barrier();  // every rank read its record before any clears it
                w.clear_diagnostics();
                w.barrier();

                // Call 1: the ranks agree (48 rows each).
                const size_t q1 = static_cast<size_t>(agreed_rows) * hq * dim;
                const size_t kv1 = static_cast<size_t>(agreed_rows) * hkv * dim;
                WEFT_CUDA_CHECK(cudaMemcpyAsync(dq, pr.q.data() + me * q1, q1 * 2, cudaMemcpyHostToDevice, s));
                WEFT_CUDA_CHECK(cudaMemcpyAsync(dk, pr.k.data() + me * kv1, kv1 * 2, cudaMemcpyHostToDevice, s));
                WEFT_CUDA_CHECK(cudaMemcpyAsync(dv, pr.v.data() + me * kv1, kv1 * 2, cudaMemcpyHostToDevice, s));
                WEFT_CUDA_CHECK(cudaMemsetAsync(dout, 0xff, q1 * 2, s));
                WEFT_CUDA_CHECK(cudaMemsetAsync(dlse, 0xff, static_cast<size_t>(agreed_rows) * hq * 4, s));
                try {
                    op.run(TensorView(dq, DType::kBF16, {agreed_rows, hq, dim}),
                           TensorView(dk, DType::kBF16, {agreed_rows, hkv, dim}),
                           TensorView(dv, DType::kBF16, {agreed_rows, hkv, dim}),
                           TensorView(dout, DType::kBF16, {agreed_rows, hq, dim}),
                           TensorView(dlse, DType::kF32, {agreed_rows, hq}), s);
                    w.sync_and_check(s);
                    std::vector<uint16_t> out(q1);
                    std::vector<float> lse(static_cast<size_t>(agreed_rows) * hq);
                    WEFT_CUDA_CHECK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
                    WEFT_CUDA_CHECK(cudaMemcpy(lse.data(), dlse, lse.size() * 4, cudaMemcpyDeviceToHost));
                    check_rows(pr, me * agreed_rows, agreed_rows, out, lse,
                               "rank " + std::to_string(me) + ", the agreeing call after");
                } catch (const Error& e) {
                    ADD_FAILURE() << "rank " << me << ": the agreeing call after threw: " << e.what();
                }
                w.barrier();
            }
            for (void* p : {dq, dk, dv, dout, dlse}) cudaFree(p);
            cudaStreamDestroy(s);
        },
        options);
    const std::vector<std::string> words = {"collective call differs from rank",
                                            "rank 0 called ag_attention with S = 128, bf16",
                                            "rank 1 called ag_attention with S = 64, bf16"};
    for (int r = 0; r < 2; ++r) {
        const std::string& m = messages[static_cast<size_t>(r)];
        EXPECT_FALSE(m.empty()) << "rank " << r << " did not throw";
        for (const std::string& word : words) {
            EXPECT_NE(m.find(word), std::string::npos) << "rank " << r << ": '" << word << "' not in: " << m;
        }
    }
}

// In a child process (bounded by an alarm): rank 0 calls with no mask, so its kernel waits for rank 1's shard; rank 1
// never calls. Rank 0's call must fail within the bound with a weft error, and its CUDA context must stay usable (the
// kernel's blocks end without a trap). Exits 0 only then.
[[noreturn]] void provoke_absent_peer(AttentionPrefillKernel kernel) {
    alarm(120);
    WorldOptions options = test_options(64ull << 20);
    options.timeout = std::chrono::milliseconds(3000);
    std::string rank0_error;
    bool usable = false;
    std::mutex mutex;
    std::vector<std::string> others;
    try {
        run_local(
            2,
            [&](World& w) {
                cudaStream_t s = nullptr;
                WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
                uint8_t* buf = nullptr;
                WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&buf), 1 << 20));
                WEFT_CUDA_CHECK(cudaMemsetAsync(buf, 0, 1 << 20, s));  // on `s`: ordered before the op
                try {
                    ops::AgAttention op(w,
                                        {.max_seq = 128,
                                         .num_q_heads = 4,
                                         .num_kv_heads = 2,
                                         .head_dim = 64,
                                         .dtype = DType::kBF16,
                                         .mask = AttentionMask::kNone},
                                        {.config = config_of(kernel, DType::kBF16, 64)});
                    if (w.rank() == 0) {
                        const TensorView q(buf, DType::kBF16, {64, 4, 64});
                        const TensorView kv(buf + (64 << 10), DType::kBF16, {64, 2, 64});
                        const TensorView out(buf + (128 << 10), DType::kBF16, {64, 4, 64});
                        try {
                            op.run(q, kv, kv, out, TensorView(), s);
                            w.sync_and_check(s);
                        } catch (const std::exception& e) {
                            rank0_error = e.what();
                        }
                        // The context survives: a memset and a synchronisation still succeed.
                        usable = cudaMemsetAsync(buf, 0, 4096, s) == cudaSuccess &&
                                 cudaStreamSynchronize(s) == cudaSuccess;
                    }
                } catch (const std::exception& e) {
                    std::lock_guard<std::mutex> lock(mutex);
                    others.push_back(e.what());
                }
                cudaFree(buf);
                cudaStreamDestroy(s);
            },
            options);
    } catch (const std::exception& e) {
        others.push_back(e.what());
    }
    for (const std::string& m : others) std::fprintf(stderr, "other error: %s\n", m.c_str());
    std::fprintf(stderr, "rank 0's call: %s\ncontext usable: %s\n",
                 rank0_error.empty() ? "(no error)" : rank0_error.c_str(), usable ? "yes" : "no");
    const bool ok = !rank0_error.empty() && usable;
    std::fprintf(stderr, ok ? "diagnosed\n" : "FAIL\n");
    std::fflush(stderr);
    std::_Exit(ok ? 0 : 1);
}

TEST_P(AgAttention, APeerThatNeverCallsFailsTheCallAndLeavesTheContextUsable) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    const auto start = std::chrono::steady_clock::now();
    EXPECT_EXIT(provoke_absent_peer(GetParam()), ::testing::ExitedWithCode(0), "diagnosed");
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60)) << "the failure took too long";
}

INSTANTIATE_TEST_SUITE_P(Kernels, AgAttention,
                         ::testing::Values(AttentionPrefillKernel::kMmaSync, AttentionPrefillKernel::kWgmma),
                         kernel_param_name);

}  // namespace
}  // namespace weft::test
