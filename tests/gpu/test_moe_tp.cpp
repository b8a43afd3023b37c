// SPDX-License-Identifier: MIT
// GPU tests of the gathered grouped GEMM and the TP MoE layers (weft/ops/moe_tp.hpp) against host references in fp64
// from the rounded inputs: routing (counts, offsets, gather_index, slot_rows exact; bad indices dropped and recorded),
// the gathered GEMM (rows in expert order, rows of no group untouched), its combine per slot and as the top-k weighted
// sum (bit-identical over runs); MoeAgGroupedGemm and MoeGroupedGemmRs at worlds 1-8 (ranks as threads on
// the visible GPUs) with fresh data per call, a smaller M on a later call, a CUDA-graph replay, and the routing cases
// that break MoE layers: one hot expert, experts with no token, a rank whose tokens all have -1 slots, -1 slots,
// top-k 1, 2 and 8, and the bench's DeepSeek FFN shard at world 8. Outputs are poisoned before every call.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/gemm_testing.hpp"
#include "support/runtime_checks.hpp"
#include "tp_test_util.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/moe_tp.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

using namespace tp_test;

#define REQUIRE_SM90()                                          \
    do {                                                        \
        std::string why_;                                       \
        if (!gemm_test::have_sm90(&why_)) GTEST_SKIP() << why_; \
    } while (0)

// ---- host side: routing cases, the routing reference, matrices -------------------------------------------------

enum class Routing { kRandom, kHotExpert, kFewExperts, kDropped, kRankWithoutTokens, kBadIndex };

const char* routing_name(Routing r) {
    switch (r) {
        case Routing::kRandom:
            return "random";
        case Routing::kHotExpert:
            return "hot expert";
        case Routing::kFewExperts:
            return "experts without tokens";
        case Routing::kDropped:
            return "-1 slots";
        case Routing::kRankWithoutTokens:
            return "rank 0's tokens all -1";
        case Routing::kBadIndex:
            return "bad indices";
    }
    return "?";
}

/// topk_idx [tokens, topk]: distinct experts per token (as a router's top-k), with the case's twist.
std::vector<int32_t> make_topk(Routing kind, int64_t tokens, int64_t topk, int64_t experts, int64_t tokens_per_rank,
                               uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<int32_t> out(static_cast<size_t>(tokens * topk));
    std::vector<int32_t> perm(static_cast<size_t>(experts));
    for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t e = 0; e < experts; ++e) perm[static_cast<size_t>(e)] = static_cast<int32_t>(e);
        std::shuffle(perm.begin(), perm.end(), rng);
        if (kind == Routing::kFewExperts) {
            // Only the odd experts, and never the last one.
            std::stable_partition(perm.begin(), perm.end(), [&](int32_t e) { return e % 2 == 1 && e != experts - 1; });
        }
        if (kind == Routing::kHotExpert) {
            std::iter_swap(perm.begin(), std::find(perm.begin(), perm.end(), 0));  // expert 0 is every token's first
        }
        for (int64_t k = 0; k < topk; ++k) {
            int32_t e = perm[static_cast<size_t>(k)];
            if (kind == Routing::kFewExperts && (e % 2 == 0 || e == experts - 1)) e = -1;
            if (kind == Routing::kDropped && rng() % 4 == 0) e = -1;
            if (kind == Routing::kRankWithoutTokens && t < tokens_per_rank) e = -1;
            if (kind == Routing::kBadIndex && rng() % 8 == 0)
                e = rng() % 2 == 0 ? static_cast<int32_t>(experts + 3) : -7;
            out[static_cast<size_t>(t * topk + k)] = e;
        }
    }
    return out;
}

struct HostRouting {
    std::vector<int32_t> counts, offsets, gather_index, slot_rows;
};

HostRouting host_route(const std::vector<int32_t>& idx, int64_t tokens, int64_t topk, int64_t experts, int64_t align,
                       int64_t rows_capacity) {
    HostRouting r;
    r.counts.assign(static_cast<size_t>(experts), 0);
    r.offsets.assign(static_cast<size_t>(experts + 1), 0);
    r.gather_index.assign(static_cast<size_t>(rows_capacity), -1);
    r.slot_rows.assign(static_cast<size_t>(tokens * topk), -1);
    for (int32_t e : idx) {
        if (e >= 0 && e < experts) ++r.counts[static_cast<size_t>(e)];
    }
    for (int64_t e = 0; e < experts; ++e) {
        const int64_t padded = (r.counts[static_cast<size_t>(e)] + align - 1) / align * align;
        r.offsets[static_cast<size_t>(e + 1)] = r.offsets[static_cast<size_t>(e)] + static_cast<int32_t>(padded);
    }
    std::vector<int32_t> next(r.offsets.begin(), r.offsets.end() - 1);
    for (int64_t e = 0; e < experts; ++e) {
        for (int64_t i = 0; i < tokens * topk; ++i) {
            if (idx[static_cast<size_t>(i)] != e) continue;
            const int32_t row = next[static_cast<size_t>(e)]++;
            r.gather_index[static_cast<size_t>(row)] = static_cast<int32_t>(i / topk);
            r.slot_rows[static_cast<size_t>(i)] = row;
        }
    }
    return r;
}

/// The expert of gathered row `row` (by the offsets), or -1.
int64_t expert_of_row(const HostRouting& r, int64_t row) {
    for (size_t e = 0; e + 1 < r.offsets.size(); ++e) {
        if (row >= r.offsets[e] && row < r.offsets[e] + r.counts[e]) return static_cast<int64_t>(e);
    }
    return -1;
}

/// bf16 matrix [rows, cols] (dense) with values uniform in [-1, 1] rounded to bf16.
std::vector<uint16_t> random_bf16(int64_t rows, int64_t cols, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::vector<uint16_t> out(static_cast<size_t>(rows * cols));
    for (auto& b : out) b = float_to_bits(DType::kBF16, u(rng));
    return out;
}

float bf(const std::vector<uint16_t>& m, int64_t idx) {
    return bits_to_float(DType::kBF16, m[static_cast<size_t>(idx)]);
}

/// Dot product of a[a_row, 0:k] and b[b_row, 0:k] (row strides lda, ldb) in fp64, and the sum of |products|.
void dot(const std::vector<uint16_t>& a, int64_t lda, int64_t a_row, const std::vector<uint16_t>& b, int64_t ldb,
         int64_t b_row, int64_t k, double* sum, double* abs_sum) {
    double s = 0, as = 0;
    for (int64_t j = 0; j < k; ++j) {
        const double p = static_cast<double>(bf(a, a_row * lda + j)) * bf(b, b_row * ldb + j);
        s += p;
        as += std::fabs(p);
    }
    *sum = s;
    *abs_sum = as;
}

/// Whether got is within the fp32-accumulation bound of want: |got - want| <= u_out |want| + 2^-22 * terms * abs_sum
/// (terms: products accumulated in fp32, abs_sum the sum of their magnitudes).
bool close(double got, double want, double abs_sum, int64_t terms, DType out) {
    const double u = out == DType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -23);
    return std::fabs(got - want) <=
           u * std::fabs(want) + std::ldexp(1.0, -22) * static_cast<double>(terms) * abs_sum + 1e-30;
}

float out_value(const std::vector<uint8_t>& raw, DType t, int64_t idx) {
    if (t == DType::kF32) {
        float f;
        std::memcpy(&f, raw.data() + idx * 4, 4);
        return f;
    }
    uint16_t b;
    std::memcpy(&b, raw.data() + idx * 2, 2);
    return bits_to_float(DType::kBF16, b);
}

template <class T>
void to_device(void* dst, const std::vector<T>& v, cudaStream_t s) {
    WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
}

template <class T>
std::vector<T> from_device(const void* src, size_t n, cudaStream_t s) {
    std::vector<T> v(n);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    return v;
}

constexpr uint8_t kPoisonByte = 0xFF;  // NaN in bf16 and f32

// ---- the gathered grouped GEMM on one GPU -------------------------------------------------------------------------

struct GatheredCase {
    int64_t tokens, topk, experts, n, k;
    Routing routing = Routing::kRandom;
    int64_t align = 1;
    DType out = DType::kBF16;
};

std::string describe(const GatheredCase& c, uint64_t seed) {
    std::ostringstream os;
    os << "gathered T=" << c.tokens << " topk " << c.topk << " E=" << c.experts << " N=" << c.n << " K=" << c.k << " "
       << routing_name(c.routing) << " align " << c.align << " out " << dtype_name(c.out) << " seed " << seed;
    return os.str();
}

void run_gathered(const GatheredCase& c, uint64_t seed) {
    SCOPED_TRACE(describe(c, seed));
    cudaStream_t st = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const int64_t rows = ops::moe_gathered_rows(c.tokens, c.topk, c.experts, c.align);
    const std::vector<int32_t> idx = make_topk(c.routing, c.tokens, c.topk, c.experts, c.tokens, seed);
    const HostRouting want = host_route(idx, c.tokens, c.topk, c.experts, c.align, rows);
    const auto a = random_bf16(c.tokens, c.k, seed ^ 1);
    const auto b = random_bf16(c.experts * c.n, c.k, seed ^ 2);  // [E, N, K]
    std::vector<float> weights(static_cast<size_t>(c.tokens * c.topk));
    std::mt19937_64 rng(seed ^ 3);
    for (auto& w : weights) w = std::uniform_real_distribution<float>(0.f, 1.f)(rng);

    const int64_t ob = dtype_bytes(c.out);
    DevBuf idx_d(idx.size() * 4), counts_d(static_cast<size_t>(c.experts) * 4),
        offsets_d(static_cast<size_t>(c.experts + 1) * 4), gather_d(static_cast<size_t>(rows) * 4),
        slots_d(idx.size() * 4), a_d(a.size() * 2), b_d(b.size() * 2), a_rows_d(static_cast<size_t>(rows * c.k) * 2),
        d_d(static_cast<size_t>(rows * c.n * ob)), d32_d(static_cast<size_t>(rows * c.n) * 4), w_d(weights.size() * 4),
        slot_out_d(static_cast<size_t>(c.tokens * c.topk * c.n * ob)),
        sum_out_d(static_cast<size_t>(c.tokens * c.n * ob));
    ops::MoeRoutingStatus* status = nullptr;
    WEFT_CUDA_CHECK(cudaMallocManaged(reinterpret_cast<void**>(&status), sizeof(*status)));
    *status = {};
    to_device(idx_d.ptr, idx, st);
    to_device(a_d.ptr, a, st);
    to_device(b_d.ptr, b, st);
    to_device(w_d.ptr, weights, st);
    WEFT_CUDA_CHECK(cudaMemsetAsync(d_d.ptr, kPoisonByte, d_d.bytes, st));
    WEFT_CUDA_CHECK(cudaMemsetAsync(gather_d.ptr, 0x7F, gather_d.bytes, st));
    WEFT_CUDA_CHECK(cudaMemsetAsync(slots_d.ptr, 0x7F, slots_d.bytes, st));
    WEFT_CUDA_CHECK(cudaMemsetAsync(slot_out_d.ptr, kPoisonByte, slot_out_d.bytes, st));
    WEFT_CUDA_CHECK(cudaMemsetAsync(sum_out_d.ptr, kPoisonByte, sum_out_d.bytes, st));

    ops::MoeRouting r;
    r.counts = static_cast<int32_t*>(counts_d.ptr);
    r.offsets = static_cast<int32_t*>(offsets_d.ptr);
    r.gather_index = static_cast<int32_t*>(gather_d.ptr);
    r.slot_rows = static_cast<int32_t*>(slots_d.ptr);
    r.num_experts = c.experts;
    r.rows_capacity = rows;
    ops::moe_route(TensorView(idx_d.ptr, DType::kI32, {c.tokens, c.topk}), r, c.align, st, status);
    const TensorView av(a_d.ptr, DType::kBF16, {c.tokens, c.k});
    const TensorView bv(b_d.ptr, DType::kBF16, {c.experts, c.n, c.k});
    const TensorView a_rows(a_rows_d.ptr, DType::kBF16, {rows, c.k});
    ops::grouped_gemm_gathered(av, bv, TensorView(d_d.ptr, c.out, {rows, c.n}), BLayout::kNK, r, a_rows, st);
    const TensorView d32(d32_d.ptr, DType::kF32, {rows, c.n});
    const TensorView wv(w_d.ptr, DType::kF32, {c.tokens, c.topk});
    ops::grouped_gemm_gathered_combine(av, bv, TensorView(slot_out_d.ptr, c.out, {c.tokens * c.topk, c.n}),
                                       BLayout::kNK, r, ops::MoeCombineMode::kPerSlot, TensorView(), a_rows, d32, st);
    ops::grouped_gemm_gathered_combine(av, bv, TensorView(sum_out_d.ptr, c.out, {c.tokens, c.n}), BLayout::kNK, r,
                                       ops::MoeCombineMode::kWeightedSum, wv, a_rows, d32, st);
    WEFT_CUDA_CHECK(cudaStreamSynchronize(st));

    // Routing: exact.
    EXPECT_EQ(from_device<int32_t>(counts_d.ptr, want.counts.size(), st), want.counts);
    EXPECT_EQ(from_device<int32_t>(offsets_d.ptr, want.offsets.size(), st), want.offsets);
    EXPECT_EQ(from_device<int32_t>(gather_d.ptr, want.gather_index.size(), st), want.gather_index);
    EXPECT_EQ(from_device<int32_t>(slots_d.ptr, want.slot_rows.size(), st), want.slot_rows);
    const bool bad = std::any_of(idx.begin(), idx.end(), [&](int32_t e) { return e < -1 || e >= c.experts; });
    EXPECT_EQ(status->code != 0, bad) << ops::describe_routing_status(*status);
    if (bad) {
        EXPECT_NE(ops::describe_routing_status(*status).find("outside [-1,"), std::string::npos);
    }

    // D in expert order; rows of no group keep the poison.
    const auto d = from_device<uint8_t>(d_d.ptr, d_d.bytes, st);
    int bad_values = 0;
    for (int64_t row = 0; row < rows; ++row) {
        const int64_t e = expert_of_row(want, row);
        for (int64_t col = 0; col < c.n; ++col) {
            const float got = out_value(d, c.out, row * c.n + col);
            if (e < 0) {
                if (!std::isnan(got) && bad_values++ < 5) ADD_FAILURE() << "row " << row << " of no group written";
                continue;
            }
            double s, as;
            dot(a, c.k, want.gather_index[static_cast<size_t>(row)], b, c.k, e * c.n + col, c.k, &s, &as);
            if (!close(got, s, as, c.k, c.out) && bad_values++ < 5) {
                ADD_FAILURE() << "d[" << row << ", " << col << "] = " << got << ", want " << s;
            }
        }
    }
    // Per slot, and the weighted sum in fp32 over k.
    const auto per_slot = from_device<uint8_t>(slot_out_d.ptr, slot_out_d.bytes, st);
    const auto summed = from_device<uint8_t>(sum_out_d.ptr, sum_out_d.bytes, st);
    for (int64_t t = 0; t < c.tokens; ++t) {
        for (int64_t col = 0; col < c.n; ++col) {
            double total = 0, total_abs = 0;
            for (int64_t k = 0; k < c.topk; ++k) {
                const int32_t e = idx[static_cast<size_t>(t * c.topk + k)];
                double s = 0, as = 0;
                if (e >= 0 && e < c.experts) dot(a, c.k, t, b, c.k, e * c.n + col, c.k, &s, &as);
                const float got = out_value(per_slot, c.out, (t * c.topk + k) * c.n + col);
                if (!close(got, s, as, c.k, c.out) && bad_values++ < 5) {
                    ADD_FAILURE() << "per slot (" << t << ", " << k << ")[" << col << "] = " << got << ", want " << s;
                }
                const double w = weights[static_cast<size_t>(t * c.topk + k)];
                total += w * s;
                total_abs += w * as;
            }
            const float got = out_value(summed, c.out, t * c.n + col);
            if (!close(got, total, total_abs, c.k + c.topk, c.out) && bad_values++ < 5) {
                ADD_FAILURE() << "weighted sum [" << t << ", " << col << "] = " << got << ", want " << total;
            }
        }
    }
    // The weighted sum again: the same bits.
    ops::grouped_gemm_gathered_combine(av, bv, TensorView(sum_out_d.ptr, c.out, {c.tokens, c.n}), BLayout::kNK, r,
                                       ops::MoeCombineMode::kWeightedSum, wv, a_rows, d32, st);
    EXPECT_EQ(from_device<uint8_t>(sum_out_d.ptr, sum_out_d.bytes, st), summed) << "weighted sum not deterministic";
    WEFT_CUDA_CHECK(cudaFree(status));
    WEFT_CUDA_CHECK(cudaStreamDestroy(st));
}

TEST(MoeGatheredGemm, MatchesTheHostReferenceOverRoutingCases) {
    REQUIRE_SM90();
    const uint64_t seed = fresh_seed();
    const std::vector<GatheredCase> cases = {
        {100, 2, 8, 136, 72},                                   // awkward sizes
        {257, 1, 5, 64, 64, Routing::kRandom, 1, DType::kF32},  // top-1, f32 out
        {64, 8, 16, 128, 128, Routing::kDropped},               // top-8, -1 slots
        {200, 2, 8, 256, 256, Routing::kHotExpert, 64},         // one hot expert, padded groups
        {130, 2, 12, 200, 96, Routing::kFewExperts},            // experts with no token
        {90, 2, 4, 72, 64, Routing::kBadIndex},                 // bad indices dropped and recorded
        {33, 8, 8, 64, 200, Routing::kRandom, 8, DType::kF32},  // every expert in every token
        {40, 40, 48, 64, 64, Routing::kDropped},                // top-40: slots past a warp's 32 lanes, -1 slots
    };
    for (size_t i = 0; i < cases.size(); ++i) run_gathered(cases[i], seed + i);
}

// A routing built by hand whose experts run outside [0, rows_capacity) (an expert one row past the end; one at a
// negative offset holding a dropped slot's -1): the combine reads no row outside d_rows, and those slots come out as
// dropped ones (zeros per slot, nothing in the weighted sum). d_rows sits inside a larger poisoned allocation, so a
// row read past either end would show as NaN.
TEST(MoeCombine, AHandBuiltRoutingPastTheCapacityReadsNoRowOutsideDRows) {
    REQUIRE_SM90();
    cudaStream_t st = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const int64_t n = 8, rows = 5, tokens = 5;
    std::vector<float> d_host((rows + 2) * n, std::nanf(""));
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < n; ++c) d_host[static_cast<size_t>((r + 1) * n + c)] = static_cast<float>(10 * r + c);
    }
    const std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> cases = {
        {{0, 3, 6}, {2, 3}},   // expert 1 owns rows [3, 6): one past the end
        {{-5, 0, 5}, {5, 5}},  // expert 0 at -5 (holds the dropped slot's -1), expert 1 owns [0, 5)
    };
    const std::vector<int32_t> slot_rows = {0, 1, 3, 4, 5};
    const std::vector<int32_t> slot_rows2 = {-1, 1, 2, 3, 4};
    for (size_t i = 0; i < cases.size(); ++i) {
        const std::vector<int32_t>& offsets = cases[i].first;
        const std::vector<int32_t>& counts = cases[i].second;
        const std::vector<int32_t>& slots = i == 0 ? slot_rows : slot_rows2;
        DevBuf d_dev(d_host.size() * 4), idx_dev(64 * 4), out_dev(tokens * n * 4), sum_dev(tokens * n * 4),
            w_dev(tokens * 4);
        to_device(d_dev.ptr, d_host, st);
        int32_t* ix = static_cast<int32_t*>(idx_dev.ptr);
        to_device(ix, counts, st);
        to_device(ix + 8, offsets, st);
        to_device(ix + 16, std::vector<int32_t>(rows, 0), st);  // gather_index (unread by the combine)
        to_device(ix + 32, slots, st);
        to_device(w_dev.ptr, std::vector<float>(tokens, 1.0f), st);
        ops::MoeRouting r;
        r.counts = ix;
        r.offsets = ix + 8;
        r.gather_index = ix + 16;
        r.slot_rows = ix + 32;
        r.num_experts = 2;
        r.rows_capacity = rows;
        r.tokens = tokens;
        r.topk = 1;
        const TensorView d(static_cast<float*>(d_dev.ptr) + n, DType::kF32, {rows, n});
        WEFT_CUDA_CHECK(cudaMemsetAsync(out_dev.ptr, kPoisonByte, out_dev.bytes, st));
        WEFT_CUDA_CHECK(cudaMemsetAsync(sum_dev.ptr, kPoisonByte, sum_dev.bytes, st));
        ops::moe_combine(d, r, ops::MoeCombineMode::kPerSlot, TensorView(),
                         TensorView(out_dev.ptr, DType::kF32, {tokens, n}), st);
        ops::moe_combine(d, r, ops::MoeCombineMode::kWeightedSum, TensorView(w_dev.ptr, DType::kF32, {tokens, 1}),
                         TensorView(sum_dev.ptr, DType::kF32, {tokens, n}), st);
        const auto per_slot = from_device<float>(out_dev.ptr, static_cast<size_t>(tokens * n), st);
        const auto summed = from_device<float>(sum_dev.ptr, static_cast<size_t>(tokens * n), st);
        for (int64_t t = 0; t < tokens; ++t) {
            const int32_t row = slots[static_cast<size_t>(t)];
            int32_t g = -1;
            for (int32_t e = 0; e < 2; ++e) {
                if (row >= offsets[static_cast<size_t>(e)] &&
                    row < offsets[static_cast<size_t>(e)] + counts[static_cast<size_t>(e)]) {
                    g = e;
                    break;
                }
            }
            const bool read = g >= 0 && row >= 0 && row < rows;
            for (int64_t c = 0; c < n; ++c) {
                const float want = read ? static_cast<float>(10 * row + c) : 0.0f;
                EXPECT_EQ(per_slot[static_cast<size_t>(t * n + c)], want) << "case " << i << ", slot " << t;
                EXPECT_EQ(summed[static_cast<size_t>(t * n + c)], want) << "case " << i << ", token " << t;
            }
        }
    }
    WEFT_CUDA_CHECK(cudaStreamDestroy(st));
}

// ---- the TP MoE layers ------------------------------------------------------------------------------------------

struct LayerCase {
    int64_t tokens_per_rank, hidden, ffn_per_rank, experts, topk;  // the layer's FFN width: ffn_per_rank x W
    Routing routing = Routing::kRandom;
    bool graph = false;
    DType out = DType::kBF16;
    ops::MoeTpOptions options{};  // both layers'
    std::optional<GemmConfig> down_config{};  // layer 1's forced config (options.config is layer 0's; it writes bf16)
};

std::string describe(const LayerCase& c, int w, uint64_t seed) {
    std::ostringstream os;
    os << "moe tp W=" << w << " tokens/rank " << c.tokens_per_rank << " H=" << c.hidden << " F/W=" << c.ffn_per_rank
       << " E=" << c.experts << " topk " << c.topk << " " << routing_name(c.routing) << (c.graph ? " graph" : "")
       << " out " << dtype_name(c.out) << " sm_budget " << c.options.sm_budget << " comm_blocks "
       << c.options.comm_blocks << " seed " << seed;
    return os.str();
}

/// Both layers on one rank: `calls` calls with fresh data (eager: the second with about half the tokens; graph: the
/// captured call replayed).
void run_layers(World& world, const LayerCase& c, int calls, uint64_t base, Failures& f) {
    const int nr = world.num_ranks(), me = world.rank();
    const int64_t max_m = c.tokens_per_rank * nr;
    const int64_t fl = c.ffn_per_rank;  // this rank's FFN shard
    const std::string what = describe(c, nr, base) + " rank " + std::to_string(me);
    const int64_t rows_cap = ops::moe_gathered_rows(max_m, c.topk, c.experts, 1);
    cudaStream_t st = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const int64_t ob = dtype_bytes(c.out);
    DevBuf x_d(static_cast<size_t>(c.tokens_per_rank * c.hidden) * 2), idx_d(static_cast<size_t>(max_m * c.topk) * 4),
        w0_d(static_cast<size_t>(c.experts * fl * c.hidden) * 2), y_d(static_cast<size_t>(rows_cap * fl) * 2),
        h_d(static_cast<size_t>(rows_cap * fl) * 2), w1_d(static_cast<size_t>(c.experts * c.hidden * fl) * 2),
        wt_d(static_cast<size_t>(max_m * c.topk) * 4), out_d(static_cast<size_t>(c.tokens_per_rank * c.hidden * ob));
    {
        const ops::MoeTpShape shape{
            .max_tokens = max_m, .hidden = c.hidden, .ffn = fl, .num_experts = c.experts, .topk = c.topk};
        ops::MoeTpOptions down_options = c.options;
        down_options.config = c.down_config;
        ops::MoeAgGroupedGemm up(world, shape, c.options);
        ops::MoeGroupedGemmRs down(world, shape, down_options);
        if (c.options.config && !(up.config() == *c.options.config)) {
            f.add(what + ": layer 0 runs " + ops::format_gemm_config(up.config()) + ", not the forced " +
                  ops::format_gemm_config(*c.options.config));
        }
        if (c.down_config && !(down.config() == *c.down_config)) {
            f.add(what + ": layer 1 runs " + ops::format_gemm_config(down.config()) + ", not the forced " +
                  ops::format_gemm_config(*c.down_config));
        }
        cudaGraphExec_t graph_exec = nullptr;
        for (int call = 0; call < calls; ++call) {
            const int64_t tpr = !c.graph && call == 1 ? std::max<int64_t>(1, c.tokens_per_rank / 2) : c.tokens_per_rank;
            const int64_t m = tpr * nr;
            const std::string at = what + " call " + std::to_string(call) + " M " + std::to_string(m);
            const uint64_t cs = seed_of(base, 0, 0, call);  // a replay reads the routing of its own call
            const std::vector<int32_t> idx = make_topk(c.routing, m, c.topk, c.experts, tpr, cs);
            const HostRouting want = host_route(idx, m, c.topk, c.experts, 1, rows_cap);
            std::vector<float> weights(static_cast<size_t>(m * c.topk));
            std::mt19937_64 rng(cs ^ 5);
            for (auto& w : weights) w = std::uniform_real_distribution<float>(0.f, 1.f)(rng);
            // Every rank's inputs (the references need them all); this rank uploads its own.
            std::vector<std::vector<uint16_t>> xs, w0s, w1s, hs;
            for (int r = 0; r < nr; ++r) {
                xs.push_back(random_bf16(tpr, c.hidden, seed_of(base, 1, r, call)));
                w0s.push_back(random_bf16(c.experts * fl, c.hidden, seed_of(base, 2, r, call)));
                w1s.push_back(random_bf16(c.experts * c.hidden, fl, seed_of(base, 3, r, call)));
                hs.push_back(random_bf16(rows_cap, fl, seed_of(base, 4, r, call)));
            }
            to_device(x_d.ptr, xs[static_cast<size_t>(me)], st);
            to_device(idx_d.ptr, idx, st);
            to_device(w0_d.ptr, w0s[static_cast<size_t>(me)], st);
            to_device(w1_d.ptr, w1s[static_cast<size_t>(me)], st);
            to_device(h_d.ptr, hs[static_cast<size_t>(me)], st);
            to_device(wt_d.ptr, weights, st);
            WEFT_CUDA_CHECK(cudaMemsetAsync(y_d.ptr, kPoisonByte, y_d.bytes, st));
            WEFT_CUDA_CHECK(cudaMemsetAsync(out_d.ptr, kPoisonByte, out_d.bytes, st));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(st));

            const TensorView xv(x_d.ptr, DType::kBF16, {tpr, c.hidden});
            const TensorView iv(idx_d.ptr, DType::kI32, {m, c.topk});
            const TensorView w0v(w0_d.ptr, DType::kBF16, {c.experts, fl, c.hidden});
            const TensorView yv(y_d.ptr, DType::kBF16, {rows_cap, fl});
            const TensorView hv(h_d.ptr, DType::kBF16, {rows_cap, fl});
            const TensorView w1v(w1_d.ptr, DType::kBF16, {c.experts, c.hidden, fl});
            const TensorView wtv(wt_d.ptr, DType::kF32, {m, c.topk});
            const TensorView ov(out_d.ptr, c.out, {tpr, c.hidden});
            auto run_both = [&] {
                up.run(xv, iv, w0v, yv, st);
                down.run(hv, w1v, up.routing(), wtv, ov, st);
            };
            if (!c.graph || call == 0) {
                run_both();
                if (c.graph) {
                    world.sync_and_check(st);
                    WEFT_CUDA_CHECK(cudaMemsetAsync(y_d.ptr, kPoisonByte, y_d.bytes, st));
                    WEFT_CUDA_CHECK(cudaMemsetAsync(out_d.ptr, kPoisonByte, out_d.bytes, st));
                    cudaGraph_t graph = nullptr;
                    WEFT_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                    run_both();
                    WEFT_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
                    WEFT_CUDA_CHECK(cudaGraphInstantiate(&graph_exec, graph, 0));
                    WEFT_CUDA_CHECK(cudaGraphDestroy(graph));
                    WEFT_CUDA_CHECK(cudaGraphLaunch(graph_exec, st));
                }
            } else {
                WEFT_CUDA_CHECK(cudaGraphLaunch(graph_exec, st));
            }
            world.sync_and_check(st);

            // Layer 0: the routing and y (rows in expert order, this rank's FFN columns); rows past the used ones keep
            // the poison.
            const ops::MoeRouting rt = up.routing();
            if (from_device<int32_t>(rt.slot_rows, want.slot_rows.size(), st) != want.slot_rows ||
                from_device<int32_t>(rt.counts, want.counts.size(), st) != want.counts) {
                f.add(at + ": layer 0's routing differs from the host's");
                continue;
            }
            EXPECT_EQ(up.routing_status().code != 0, c.routing == Routing::kBadIndex) << at;
            const auto y = from_device<uint16_t>(y_d.ptr, static_cast<size_t>(rows_cap * fl), st);
            int bad = 0;
            const int64_t used = want.offsets.back();
            for (int64_t row = 0; row < rows_cap && bad < 5; ++row) {
                const int64_t e = expert_of_row(want, row);
                for (int64_t col = 0; col < fl && bad < 5; ++col) {
                    const float got = bf(y, row * fl + col);
                    if (row >= used) {
                        if (!std::isnan(got)) {
                            f.add(at + ": y row " + std::to_string(row) + " past the used rows was written");
                            ++bad;
                        }
                        continue;
                    }
                    const int32_t token = want.gather_index[static_cast<size_t>(row)];
                    const int64_t owner = token / tpr;
                    double s, as;
                    dot(xs[static_cast<size_t>(owner)], c.hidden, token - owner * tpr, w0s[static_cast<size_t>(me)],
                        c.hidden, e * fl + col, c.hidden, &s, &as);
                    if (!close(got, s, as, c.hidden, DType::kBF16)) {
                        std::ostringstream os;
                        os << at << ": y[" << row << ", " << col << "] = " << got << ", want " << s;
                        f.add(os.str());
                        ++bad;
                    }
                }
            }
            // Layer 1: this rank's tokens, sum over k of weight * sum over ranks of h_r[row] . w1_r[e]^T.
            const auto out = from_device<uint8_t>(out_d.ptr, out_d.bytes, st);
            for (int64_t t = 0; t < tpr && bad < 5; ++t) {
                const int64_t token = me * tpr + t;
                for (int64_t col = 0; col < c.hidden && bad < 5; ++col) {
                    double total = 0, total_abs = 0;
                    for (int64_t k = 0; k < c.topk; ++k) {
                        const int32_t row = want.slot_rows[static_cast<size_t>(token * c.topk + k)];
                        if (row < 0) continue;
                        const int64_t e = expert_of_row(want, row);
                        const double w = weights[static_cast<size_t>(token * c.topk + k)];
                        for (int r = 0; r < nr; ++r) {
                            double s, as;
                            dot(hs[static_cast<size_t>(r)], fl, row, w1s[static_cast<size_t>(r)], fl,
                                e * c.hidden + col, fl, &s, &as);
                            total += w * s;
                            total_abs += w * as;
                        }
                    }
                    const float got = out_value(out, c.out, t * c.hidden + col);
                    if (!close(got, total, total_abs, fl * nr + c.topk * nr, c.out)) {
                        std::ostringstream os;
                        os << at << ": out[" << t << ", " << col << "] = " << got << ", want " << total;
                        f.add(os.str());
                        ++bad;
                    }
                }
            }
        }
        if (graph_exec != nullptr) WEFT_CUDA_CHECK(cudaGraphExecDestroy(graph_exec));
    }
    WEFT_CUDA_CHECK(cudaStreamDestroy(st));
}

void run_layer_cases(int world_size, const std::vector<LayerCase>& cases) {
    const uint64_t seed = fresh_seed();
    Failures f;
    test::run_ranks(world_size, [&](World& w) {
        for (size_t i = 0; i < cases.size(); ++i) run_layers(w, cases[i], 3, seed + i, f);
    });
    f.report();
}

const std::vector<LayerCase>& layer_cases() {
    static const std::vector<LayerCase> v = {
        {40, 128, 48, 8, 2},                                          // Mixtral-like in miniature
        {24, 136, 24, 16, 8, Routing::kDropped},                      // top-8 with -1 slots, awkward H and F
        {33, 64, 64, 5, 1, Routing::kHotExpert, false, DType::kF32},  // top-1, one hot expert, f32 out
        {20, 128, 32, 12, 2, Routing::kFewExperts},                   // experts with no token
        {16, 64, 16, 8, 2, Routing::kRankWithoutTokens},              // rank 0 routes nothing
        {32, 128, 64, 8, 2, Routing::kRandom, true},                  // graph replay
    };
    return v;
}

TEST(MoeTpLayers, World1) {
    REQUIRE_SM90();
    run_layer_cases(1, layer_cases());
}
TEST(MoeTpLayers, World2) {
    REQUIRE_SM90();
    run_layer_cases(2, layer_cases());
}
TEST(MoeTpLayers, World3) {
    REQUIRE_SM90();
    run_layer_cases(3, layer_cases());
}
TEST(MoeTpLayers, World4) {
    REQUIRE_SM90();
    run_layer_cases(4, layer_cases());
}
TEST(MoeTpLayers, World8) {
    REQUIRE_SM90();
    run_layer_cases(8, layer_cases());
}
// Worlds 5, 6 and 7: the first three cases (every routing kind above runs at the other worlds).
TEST(MoeTpLayers, Worlds5To7) {
    REQUIRE_SM90();
    const std::vector<LayerCase> cases(layer_cases().begin(), layer_cases().begin() + 3);
    for (int w : {5, 6, 7}) {
        SCOPED_TRACE("world " + std::to_string(w));
        run_layer_cases(w, cases);
    }
}

// The bench's DeepSeek shard at world 8 (F 1408 / 8 = 176 per rank: layer 0's N and layer 1's K neither a multiple of
// 64, so three k-blocks with a zero-filled tail), 64 experts and top-6, on fewer tokens and a narrower H.
TEST(MoeTpLayers, World8DeepseekShard) {
    REQUIRE_SM90();
    run_layer_cases(8, {{64, 256, 176, 64, 6}});
}

// The options take effect and the layers stay right: a small SM budget, one or two communication CTAs, a timeout of
// their own.
TEST(MoeTpLayers, OptionsAtWorld3) {
    REQUIRE_SM90();
    LayerCase few_sms{40, 128, 48, 8, 2};
    few_sms.options.sm_budget = 12;
    few_sms.options.comm_blocks = 2;
    LayerCase one_block{24, 136, 24, 16, 8, Routing::kDropped};
    one_block.options.comm_blocks = 1;
    one_block.options.timeout = std::chrono::milliseconds(20000);
    run_layer_cases(3, {few_sms, one_block});
}

// Forced grouped GEMM configs (MoeTpOptions::config): each layer runs the config it was given, with results as
// checked for the planned ones; rows and columns that are not multiples of the forced tiles.
TEST(MoeTpLayers, ForcedConfigsAtWorld2) {
    REQUIRE_SM90();
    LayerCase forced{40, 192, 72, 8, 2};
    forced.options.config = GemmConfig{.tile_m = 128, .tile_n = 64, .stages = 6};
    forced.down_config = GemmConfig{.tile_m = 128, .tile_n = 128, .stages = 4, .out_dtype = DType::kF32};
    run_layer_cases(2, {forced});
}

// Members whose communication CTAs differ (they count each other's blocks): construction fails on every member,
// naming both counts, instead of a call that would wait for blocks that never come.
TEST(MoeTpLayers, CommBlocksThatDifferFailEveryMember) {
    REQUIRE_SM90();
    const std::vector<std::string> errors = test::error_of_each_rank(2, [](World& w) {
        ops::MoeTpOptions o;
        o.comm_blocks = 2 + w.rank();
        const ops::MoeTpShape shape{.max_tokens = 64, .hidden = 128, .ffn = 32, .num_experts = 8, .topk = 2};
        ops::MoeAgGroupedGemm up(w, shape, o);
    });
    for (int r = 0; r < 2; ++r) {
        const std::string& e = errors[static_cast<size_t>(r)];
        EXPECT_NE(e.find("communication CTAs"), std::string::npos) << "rank " << r << ": " << e;
        const std::string mine = std::to_string(2 + r), theirs = std::to_string(3 - r);
        EXPECT_NE(e.find("has " + mine), std::string::npos) << "rank " << r << ": " << e;
        EXPECT_NE(e.find(" " + theirs), std::string::npos) << "rank " << r << ": " << e;
    }
}

// Ranks sharing a GPU: an explicit SM budget above a rank's share would let every member's GEMM take the GPU before the
// push kernels they wait for; construction fails on every member naming the share.
TEST(MoeTpLayers, AnSmBudgetAboveASharedGpusShareFailsEveryMember) {
    REQUIRE_SM90();
    std::atomic<bool> shared{false};
    const std::vector<std::string> errors = test::error_of_each_rank(2, [&](World& w) {
        if (w.max_ranks_per_device() < 2) return;  // one GPU per rank: nothing to refuse
        shared = true;
        ops::MoeTpOptions o;
        o.sm_budget = w.shared_sm_budget() + 1;
        const ops::MoeTpShape shape{.max_tokens = 64, .hidden = 128, .ffn = 32, .num_experts = 8, .topk = 2};
        ops::MoeAgGroupedGemm up(w, shape, o);
    });
    if (!shared) GTEST_SKIP() << "the ranks have a GPU each";
    for (int r = 0; r < 2; ++r) {
        const std::string& e = errors[static_cast<size_t>(r)];
        EXPECT_NE(e.find("exceeds a rank's share of a shared GPU"), std::string::npos) << "rank " << r << ": " << e;
    }
}

TEST(MoeTpLayers, BadIndicesAreRecorded) {
    REQUIRE_SM90();
    run_layer_cases(2, {{16, 64, 64, 4, 2, Routing::kBadIndex}});
}

// Bad arguments: weft::Error naming the argument, on every rank, before anything is launched.
TEST(MoeTpLayers, BadArgumentsThrowOnEveryRank) {
    REQUIRE_SM90();
    Failures f;
    test::run_ranks(2, [&](World& w) {
        const ops::MoeTpShape shape{.max_tokens = 64, .hidden = 64, .ffn = 64, .num_experts = 4, .topk = 2};
        const int64_t rows = ops::moe_gathered_rows(64, 2, 4);
        DevBuf x(32 * 64 * 2), idx(64 * 2 * 4), wt(4 * 64 * 64 * 2), y(static_cast<size_t>(rows * 64 * 2));
        ops::MoeAgGroupedGemm up(w, shape);
        EXPECT_EQ(up.rows_capacity(), rows);
        const TensorView xv(x.ptr, DType::kBF16, {32, 64}), iv(idx.ptr, DType::kI32, {64, 2}),
            wv(wt.ptr, DType::kBF16, {4, 64, 64}), yv(y.ptr, DType::kBF16, {rows, 64});
        auto expect_error = [&](const char* needle, auto&& fn) {
            try {
                fn();
                f.add(std::string("no error for ") + needle);
            } catch (const Error& e) {
                if (std::string(e.what()).find(needle) == std::string::npos) f.add(std::string("got ") + e.what());
            }
        };
        expect_error("x_local", [&] { up.run(TensorView(x.ptr, DType::kBF16, {40, 64}), iv, wv, yv, nullptr); });
        expect_error("topk_idx", [&] { up.run(xv, TensorView(idx.ptr, DType::kI32, {64, 3}), wv, yv, nullptr); });
        expect_error("w must be bf16", [&] {
            up.run(xv, iv, TensorView(wt.ptr, DType::kBF16, {3, 64, 64}), yv, nullptr);
        });
        expect_error("y", [&] { up.run(xv, iv, wv, TensorView(y.ptr, DType::kBF16, {10, 64}), nullptr); });
        std::vector<int32_t> host_idx(64 * 2, 0);  // pageable host memory: refused before anything is enqueued
        expect_error("topk_idx (", [&] {
            up.run(xv, TensorView(host_idx.data(), DType::kI32, {64, 2}), wv, yv, nullptr);
        });
        w.barrier();
    });
    f.report();
}

// Members whose layer-0 calls differ (another M, or the same M with another topk_idx): every member's call is a
// mismatch that sync_and_check throws, naming both calls (merged rows of unrelated calls before).
TEST(MoeTpLayers, MembersWhoseCallsDifferAreAMismatchOnEveryMember) {
    REQUIRE_SM90();
    for (bool routing_differs : {false, true}) {
        SCOPED_TRACE(routing_differs ? "another topk_idx" : "another M");
        const std::vector<std::string> errors = test::error_of_each_rank(2, [&](World& w) {
            const ops::MoeTpShape shape{.max_tokens = 64, .hidden = 128, .ffn = 32, .num_experts = 8, .topk = 2};
            const int64_t tpr = !routing_differs && w.rank() == 1 ? 16 : 32;
            const int64_t m = tpr * 2;
            ops::MoeAgGroupedGemm up(w, shape);
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            DevBuf x(static_cast<size_t>(tpr * 128 * 2)), idx(static_cast<size_t>(m * 2 * 4)),
                wt(static_cast<size_t>(8 * 32 * 128 * 2)), y(static_cast<size_t>(up.rows_capacity() * 32 * 2));
            std::vector<int32_t> ids(static_cast<size_t>(m * 2));
            for (size_t i = 0; i < ids.size(); ++i) {
                ids[i] = static_cast<int32_t>(i % 2) + (routing_differs && w.rank() == 1 ? 2 : 0);
            }
            WEFT_CUDA_CHECK(cudaMemsetAsync(x.ptr, 0, x.bytes, s));
            WEFT_CUDA_CHECK(cudaMemsetAsync(wt.ptr, 0, wt.bytes, s));
            to_device(idx.ptr, ids, s);
            std::string error;
            try {
                up.run(TensorView(x.ptr, DType::kBF16, {tpr, 128}), TensorView(idx.ptr, DType::kI32, {m, 2}),
                       TensorView(wt.ptr, DType::kBF16, {8, 32, 128}),
                       TensorView(y.ptr, DType::kBF16, {up.rows_capacity(), 32}), s);
                w.sync_and_check(s);
            } catch (const Error& e) {
                error = e.what();
            }
            cudaStreamDestroy(s);
            // Every rank's abort reached every rank; then the World is usable again for the op's release.
            std::this_thread::sleep_for(std::chrono::milliseconds(1500));
            w.clear_diagnostics();
            w.barrier();
            WEFT_CHECK(error.empty(), error);
        });
        for (int r = 0; r < 2; ++r) {
            const std::string& e = errors[static_cast<size_t>(r)];
            EXPECT_NE(e.find("collective call differs"), std::string::npos) << "rank " << r << ": " << e;
            EXPECT_NE(e.find("moe_ag_grouped_gemm with M = "), std::string::npos) << "rank " << r << ": " << e;
        }
    }
}

// A team of one: both layers' kernels wait on their own signal words (layer 1's combine on its done word), so a call
// that gave up leaves them out of step there too: once an abort was cleared, both layers refuse their next call before
// reading any argument.
TEST(MoeTpLayers, ATeamOfOneRefusesItsCallsAfterAClearedAbort) {
    REQUIRE_SM90();
    test::run_ranks(1, [&](World& w) {
        const ops::MoeTpShape shape{.max_tokens = 64, .hidden = 128, .ffn = 32, .num_experts = 8, .topk = 2};
        ops::MoeAgGroupedGemm up(w, shape);
        ops::MoeGroupedGemmRs down(w, shape);
        w.abort("a test's abort");
        w.clear_diagnostics();
        const auto error_of = [](auto&& call) {
            try {
                call();
            } catch (const Error& e) {
                return std::string(e.what());
            }
            return std::string("no error");
        };
        const std::string up_err =
            error_of([&] { up.run(TensorView(), TensorView(), TensorView(), TensorView(), nullptr); });
        const std::string down_err = error_of(
            [&] { down.run(TensorView(), TensorView(), ops::MoeRouting{}, TensorView(), TensorView(), nullptr); });
        for (const std::string& err : {up_err, down_err}) {
            EXPECT_NE(err.find("this World was aborted after"), std::string::npos) << err;
        }
    });
}

// Layer 1 with routings that differ between members (an expert with rows on one and none on the other): the combine's
// wait for the other's done word ends at the bound with a diagnosis that sync_and_check throws, and the kernels exit
// (no trap): the CUDA context stays usable.
TEST(MoeTpLayers, Layer1RoutingsThatDifferEndInADiagnosisNotATrap) {
    REQUIRE_SM90();
    WorldOptions options;
    options.timeout = std::chrono::milliseconds(3000);
    std::mutex mutex;
    std::vector<std::string> errors(2);
    test::run_ranks(
        2,
        [&](World& w) {
            const ops::MoeTpShape shape{.max_tokens = 64, .hidden = 128, .ffn = 32, .num_experts = 8, .topk = 2};
            const int64_t m = 64, tpr = 32, e = 8, topk = 2;
            ops::MoeGroupedGemmRs down(w, shape);
            const int64_t rows = down.rows_capacity();
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            DevBuf words(static_cast<size_t>((e + e + 1 + rows + m * topk) * 4)),
                idx(static_cast<size_t>(m * topk * 4));
            DevBuf h(static_cast<size_t>(rows * 32 * 2)), wt(static_cast<size_t>(e * 128 * 32 * 2));
            DevBuf weights(static_cast<size_t>(m * topk * 4)), out(static_cast<size_t>(tpr * 128 * 2));
            std::vector<int32_t> ids(static_cast<size_t>(m * topk));
            for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % 2) + 2 * w.rank();
            to_device(idx.ptr, ids, s);
            for (DevBuf* b : {&h, &wt, &weights}) WEFT_CUDA_CHECK(cudaMemsetAsync(b->ptr, 0, b->bytes, s));
            ops::MoeRouting routing;
            routing.counts = static_cast<int32_t*>(words.ptr);
            routing.offsets = routing.counts + e;
            routing.gather_index = routing.offsets + e + 1;
            routing.slot_rows = routing.gather_index + rows;
            routing.num_experts = e;
            routing.rows_capacity = rows;
            ops::moe_route(TensorView(idx.ptr, DType::kI32, {m, topk}), routing, 1, s);
            try {
                down.run(TensorView(h.ptr, DType::kBF16, {rows, 32}), TensorView(wt.ptr, DType::kBF16, {e, 128, 32}),
                         routing, TensorView(weights.ptr, DType::kF32, {m, topk}),
                         TensorView(out.ptr, DType::kBF16, {tpr, 128}), s);
                w.sync_and_check(s);
            } catch (const Error& ex) {
                const std::lock_guard<std::mutex> lock(mutex);
                errors[static_cast<size_t>(w.rank())] = ex.what();
            }
            // The context is usable: plain CUDA work still runs.
            WEFT_CUDA_CHECK(cudaMemsetAsync(out.ptr, 0, out.bytes, s));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
            cudaStreamDestroy(s);
            std::this_thread::sleep_for(std::chrono::milliseconds(1500));
            w.clear_diagnostics();
            w.barrier();
        },
        options);
    for (int r = 0; r < 2; ++r) EXPECT_FALSE(errors[static_cast<size_t>(r)].empty()) << "rank " << r;
}

}  // namespace
}  // namespace weft
