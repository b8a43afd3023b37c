// SPDX-License-Identifier: MIT
// GPU tests of weft::ops::decode_attention against an fp64 host reference: fresh random data every run, every
// slot that is not a token of a sequence (and every unused block-table entry) poisoned so that a stray read shows,
// outputs poisoned before the call; page sizes 1/16/256, 1-16 q-heads per KV head, head_dim 64/128/256, bf16 and
// f16, lengths 0/1/7/1000/33000 mixed in one batch, both cache layouts, forced split counts, CUDA-graph replay.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "weft/ops/attention.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

#define CK(call)                                                                   \
    do {                                                                           \
        const cudaError_t err_ = (call);                                           \
        ASSERT_EQ(err_, cudaSuccess) << #call << ": " << cudaGetErrorString(err_); \
    } while (0)

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

#define REQUIRE_SM90()                               \
    do {                                             \
        std::string why_;                            \
        if (!have_sm90(&why_)) GTEST_SKIP() << why_; \
    } while (0)

struct CudaFree {
    void operator()(void* p) const { cudaFree(p); }
};
using DevicePtr = std::unique_ptr<void, CudaFree>;

DevicePtr device_alloc(size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(bytes, 16)) != cudaSuccess) throw Error("cudaMalloc failed");
    return DevicePtr(p);
}

// splitmix64: fast, fresh per run (seeded from random_device), reproducible from the printed seed.
struct Rng {
    uint64_t state;
    uint64_t next() {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    float uniform(float lo, float hi) { return lo + (hi - lo) * static_cast<float>(next() >> 40) * 0x1p-24f; }
};

uint16_t to_bits(float x, DType t) {
    if (t == DType::kBF16) {
        uint32_t u;
        std::memcpy(&u, &x, 4);
        u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (inputs are finite)
        return static_cast<uint16_t>(u >> 16);
    }
    // f16, round to nearest even, normal range only (test data is in [-4, 4] or 0).
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const int exp = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
    uint32_t mant = u & 0x7fffffu;
    if (exp <= 0) return static_cast<uint16_t>(sign);  // flush tiny values to zero
    uint32_t h = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
}

float from_bits(uint16_t b, DType t) {
    if (t == DType::kBF16) {
        const uint32_t u = static_cast<uint32_t>(b) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    const uint32_t sign = (b & 0x8000u) << 16;
    const uint32_t exp = (b >> 10) & 0x1f;
    const uint32_t mant = b & 0x3ffu;
    uint32_t u = 0;
    if (exp == 0) {
        if (mant == 0) {
            u = sign;
        } else {
            float f = std::ldexp(static_cast<float>(mant), -24);
            return (b & 0x8000u) ? -f : f;
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((exp - 15 + 127) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

uint16_t nan_bits(DType t) { return t == DType::kBF16 ? 0x7fc0 : 0x7e00; }

enum class Layout { kSlotsHeads, kHeadsSlots };  // [pages, slots, heads, dim] or [pages, heads, slots, dim]

struct Case {
    DType dtype = DType::kBF16;
    int dim = 128;
    int num_kv_heads = 2;
    int group = 4;
    int page_size = 16;
    std::vector<int> lens = {1, 7, 1000, 33000, 0};
    int32_t num_splits = 0;
    Layout layout = Layout::kSlotsHeads;
    bool want_lse = true;
    bool explicit_workspace = false;
    bool programmatic = false;  // DecodeAttentionOptions::programmatic_launch
    int extra_max_len = 0;      // max_seq_len above the longest sequence
    float q_scale = 2.f;        // q in [-q_scale, q_scale]: peaked and flat softmax rows both occur
};

std::string describe(const Case& c) {
    std::ostringstream os;
    os << dtype_name(c.dtype) << " dim " << c.dim << " kv_heads " << c.num_kv_heads << " group " << c.group << " page "
       << c.page_size << " splits " << c.num_splits << " layout "
       << (c.layout == Layout::kSlotsHeads ? "slots-heads" : "heads-slots") << " lens {";
    for (size_t i = 0; i < c.lens.size() && i < 8; ++i) os << (i ? ", " : "") << c.lens[i];
    if (c.lens.size() > 8) os << ", ... (" << c.lens.size() << ")";
    os << "}";
    return os.str();
}

uint64_t fresh_seed() {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// Runs one case on `stream`; returns (through gtest) after comparing every output element and LSE.
void run_case(const Case& c, cudaStream_t stream, bool via_graph = false) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(describe(c) + " seed " + std::to_string(seed));
    Rng rng{seed};
    const int batch = static_cast<int>(c.lens.size());
    const int hq = c.num_kv_heads * c.group;
    const int hkv = c.num_kv_heads;
    const int d = c.dim;
    const int ps = c.page_size;
    const int longest = c.lens.empty() ? 0 : *std::max_element(c.lens.begin(), c.lens.end());
    const int64_t max_len = longest + c.extra_max_len;
    const int64_t max_pages = std::max<int64_t>(1, (max_len + ps - 1) / ps);

    // Pages: every sequence's pages at random physical places, plus unused pages; all slots start as NaN.
    int64_t used_pages = 0;
    for (int len : c.lens) used_pages += (len + ps - 1) / ps;
    const int64_t num_pages = used_pages + 3;
    std::vector<int32_t> order(static_cast<size_t>(num_pages));
    std::iota(order.begin(), order.end(), 0);
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng.next() % i]);
    constexpr int32_t kPoisonPage = 1 << 30;  // unused table entries: far outside the cache
    std::vector<int32_t> table(static_cast<size_t>(batch * max_pages), kPoisonPage);
    size_t next_page = 0;
    for (int b = 0; b < batch; ++b) {
        for (int64_t i = 0; i < (c.lens[static_cast<size_t>(b)] + ps - 1) / ps; ++i) {
            table[static_cast<size_t>(b * max_pages + i)] = order[next_page++];
        }
    }
    const size_t cache_elems = static_cast<size_t>(num_pages) * ps * hkv * d;
    std::vector<uint16_t> k(cache_elems, nan_bits(c.dtype));
    std::vector<uint16_t> v(cache_elems, nan_bits(c.dtype));
    // Element strides of the cache for either layout.
    const int64_t page_stride = static_cast<int64_t>(ps) * hkv * d;
    const int64_t slot_stride = c.layout == Layout::kSlotsHeads ? static_cast<int64_t>(hkv) * d : d;
    const int64_t head_stride = c.layout == Layout::kSlotsHeads ? d : static_cast<int64_t>(ps) * d;
    auto at = [&](int b, int t, int h) {
        const int32_t page = table[static_cast<size_t>(b * max_pages + t / ps)];
        return static_cast<size_t>(page * page_stride + (t % ps) * slot_stride + h * head_stride);
    };
    for (int b = 0; b < batch; ++b) {
        for (int t = 0; t < c.lens[static_cast<size_t>(b)]; ++t) {
            for (int h = 0; h < hkv; ++h) {
                const size_t o = at(b, t, h);
                for (int e = 0; e < d; ++e) {
                    k[o + e] = to_bits(rng.uniform(-1.f, 1.f), c.dtype);
                    v[o + e] = to_bits(rng.uniform(-1.f, 1.f), c.dtype);
                }
            }
        }
    }
    std::vector<uint16_t> q(static_cast<size_t>(batch) * hq * d);
    for (auto& x : q) x = to_bits(rng.uniform(-c.q_scale, c.q_scale), c.dtype);
    std::vector<int32_t> lens(c.lens.begin(), c.lens.end());

    DevicePtr dq = device_alloc(q.size() * 2), dk = device_alloc(k.size() * 2), dv = device_alloc(v.size() * 2);
    DevicePtr dtable = device_alloc(table.size() * 4), dlens = device_alloc(lens.size() * 4);
    DevicePtr dout = device_alloc(q.size() * 2), dlse = device_alloc(static_cast<size_t>(batch) * hq * 4);
    CK(cudaMemcpy(dq.get(), q.data(), q.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dk.get(), k.data(), k.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv.get(), v.data(), v.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dtable.get(), table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dlens.get(), lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(dout.get(), 0xff, q.size() * 2));                         // NaN
    CK(cudaMemset(dlse.get(), 0xff, static_cast<size_t>(batch) * hq * 4));  // NaN
    // cudaMemset of device memory returns before it runs, on the legacy stream, which does not order a non-blocking
    // stream's work: without this the poison may land after the op has written `out` (seen as NaN rows).
    CK(cudaDeviceSynchronize());

    const TensorView tq(dq.get(), c.dtype, {batch, hq, d});
    const TensorView tk = c.layout == Layout::kSlotsHeads ? TensorView(dk.get(), c.dtype, {num_pages, ps, hkv, d})
                                                          : TensorView(dk.get(), c.dtype, {num_pages, ps, hkv, d},
                                                                       {page_stride, slot_stride, head_stride, 1});
    const TensorView tv = c.layout == Layout::kSlotsHeads ? TensorView(dv.get(), c.dtype, {num_pages, ps, hkv, d})
                                                          : TensorView(dv.get(), c.dtype, {num_pages, ps, hkv, d},
                                                                       {page_stride, slot_stride, head_stride, 1});
    const TensorView ttable(dtable.get(), DType::kI32, {batch, max_pages});
    const TensorView tlens(dlens.get(), DType::kI32, {batch});
    const TensorView tout(dout.get(), c.dtype, {batch, hq, d});
    const TensorView tlse = c.want_lse ? TensorView(dlse.get(), DType::kF32, {batch, hq}) : TensorView();
    ops::DecodeAttentionOptions opt;
    opt.num_splits = c.num_splits;
    opt.programmatic_launch = c.programmatic;
    DevicePtr dws;
    if (c.explicit_workspace) {
        const uint64_t bytes = ops::decode_attention_workspace_bytes(batch, hq, hkv, d, max_len, opt);
        dws = device_alloc(bytes);
        opt.workspace = TensorView(dws.get(), DType::kU8, {static_cast<int64_t>(std::max<uint64_t>(bytes, 16))});
    }
    if (via_graph) {
        cudaGraph_t graph = nullptr;
        CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        ops::decode_attention(tq, tk, tv, ttable, tlens, max_len, tout, tlse, stream, opt);
        CK(cudaStreamEndCapture(stream, &graph));
        cudaGraphExec_t exec = nullptr;
        CK(cudaGraphInstantiate(&exec, graph, 0));
        for (int r = 0; r < 3; ++r) {
            CK(cudaMemsetAsync(dout.get(), 0xff, q.size() * 2, stream));
            CK(cudaGraphLaunch(exec, stream));
        }
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
    } else {
        ops::decode_attention(tq, tk, tv, ttable, tlens, max_len, tout, tlse, stream, opt);
    }
    CK(cudaStreamSynchronize(stream));
    std::vector<uint16_t> out(q.size());
    std::vector<float> lse(static_cast<size_t>(batch) * hq);
    CK(cudaMemcpy(out.data(), dout.get(), out.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lse.data(), dlse.get(), lse.size() * 4, cudaMemcpyDeviceToHost));

    // fp64 reference from the rounded inputs.
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const double atol = c.dtype == DType::kBF16 ? 6e-3 : 1.5e-3;
    const double rtol = c.dtype == DType::kBF16 ? 1.6e-2 : 4e-3;
    int bad = 0;
    std::vector<double> s, o(static_cast<size_t>(d));
    std::vector<float> kf(static_cast<size_t>(d)), qf(static_cast<size_t>(d));
    for (int b = 0; b < batch && bad < 10; ++b) {
        const int len = c.lens[static_cast<size_t>(b)];
        for (int h = 0; h < hq && bad < 10; ++h) {
            const int kvh = h / c.group;
            const size_t row = static_cast<size_t>(b) * hq + h;
            for (int e = 0; e < d; ++e) qf[static_cast<size_t>(e)] = from_bits(q[row * d + e], c.dtype);
            s.assign(static_cast<size_t>(len), 0.0);
            double m = -INFINITY;
            for (int t = 0; t < len; ++t) {
                const size_t base = at(b, t, kvh);
                double dot = 0;
                for (int e = 0; e < d; ++e)
                    dot += static_cast<double>(qf[static_cast<size_t>(e)]) * from_bits(k[base + e], c.dtype);
                s[static_cast<size_t>(t)] = dot * scale;
                m = std::max(m, s[static_cast<size_t>(t)]);
            }
            double l = 0;
            std::fill(o.begin(), o.end(), 0.0);
            for (int t = 0; t < len; ++t) {
                const double p = std::exp(s[static_cast<size_t>(t)] - m);
                l += p;
                const size_t base = at(b, t, kvh);
                for (int e = 0; e < d; ++e) o[static_cast<size_t>(e)] += p * from_bits(v[base + e], c.dtype);
            }
            if (c.want_lse) {
                const float got = lse[row];
                if (len == 0) {
                    if (!(std::isinf(got) && got < 0)) {
                        ADD_FAILURE() << "lse[" << b << ", " << h << "] of an empty sequence: " << got << ", want -inf";
                        ++bad;
                    }
                } else {
                    const double want = m + std::log(l);
                    if (!(std::fabs(got - want) <= 2e-3 + 1e-5 * std::fabs(want))) {
                        ADD_FAILURE() << "lse[" << b << ", " << h << "] = " << got << ", want " << want << " (len "
                                      << len << ")";
                        ++bad;
                    }
                }
            }
            for (int e = 0; e < d; ++e) {
                const double want = len == 0 ? 0.0 : o[static_cast<size_t>(e)] / l;
                const double got = from_bits(out[row * d + e], c.dtype);
                const bool ok = len == 0 ? got == 0.0 : std::fabs(got - want) <= atol + rtol * std::fabs(want);
                if (!ok) {
                    ADD_FAILURE() << "out[" << b << ", " << h << ", " << e << "] = " << got << ", want " << want
                                  << " (len " << len << ")";
                    if (++bad >= 10) break;
                }
            }
        }
    }
}

class DecodeAttention : public ::testing::Test {
protected:
    void SetUp() override {
        std::string why;
        if (!have_sm90(&why)) GTEST_SKIP() << why;
        ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    }
    void TearDown() override {
        if (stream_ != nullptr) cudaStreamDestroy(stream_);
    }
    cudaStream_t stream_ = nullptr;
};

// Page sizes 1/16/256 x 1/4/8/16 q-heads per KV head x head_dim 64/128/256, bf16, lengths 1/7/1000/33000/0 in one
// batch.
TEST_F(DecodeAttention, Bf16SweepPagesGroupsDims) {
    for (int dim : {64, 128, 256}) {
        for (int group : {1, 4, 8, 16}) {
            for (int page : {1, 16, 256}) {
                Case c;
                c.dim = dim;
                c.group = group;
                c.page_size = page;
                c.num_kv_heads = group == 16 ? 1 : 2;
                run_case(c, stream_);
                if (HasFailure()) return;
            }
        }
    }
}

TEST_F(DecodeAttention, F16SweepGroupsDims) {
    for (int dim : {64, 128, 256}) {
        for (int group : {1, 8, 16}) {
            Case c;
            c.dtype = DType::kF16;
            c.dim = dim;
            c.group = group;
            c.page_size = group == 8 ? 1 : 16;
            c.num_kv_heads = 2;
            run_case(c, stream_);
            if (HasFailure()) return;
        }
    }
}

// [pages, heads, slots, dim] through strides; page sizes that are not powers of two.
TEST_F(DecodeAttention, HeadsSlotsLayoutAndOddPageSizes) {
    for (int page : {3, 16, 100}) {
        Case c;
        c.layout = Layout::kHeadsSlots;
        c.page_size = page;
        c.group = 8;
        c.lens = {5, 1000, 4097, 0, 64};
        run_case(c, stream_);
        if (HasFailure()) return;
    }
}

// One split (the split kernel writes out and lse), a few, the most; a max_seq_len far above every length (most
// splits empty); no lse; an explicit workspace.
TEST_F(DecodeAttention, SplitCountsWorkspaceAndOptionalLse) {
    for (int32_t splits : {1, 2, 7, 256}) {
        Case c;
        c.num_splits = splits;
        c.lens = {33000, 1, 0, 12345};
        c.group = 4;
        run_case(c, stream_);
        if (HasFailure()) return;
    }
    Case sparse;
    sparse.lens = {1, 7, 0};
    sparse.extra_max_len = 20000;
    run_case(sparse, stream_);
    Case no_lse;
    no_lse.want_lse = false;
    no_lse.explicit_workspace = true;
    run_case(no_lse, stream_);
}

// Large batches of short, mixed lengths (many blocks with a single tile, all-empty sequences); 96/12 heads.
TEST_F(DecodeAttention, LargeBatchMixedLengths) {
    Case c;
    c.num_kv_heads = 12;
    c.group = 8;
    c.lens.clear();
    Rng rng{12345};  // lengths fixed; the data is fresh in run_case
    for (int b = 0; b < 256; ++b) c.lens.push_back(b % 17 == 0 ? 0 : static_cast<int>(rng.next() % 300));
    run_case(c, stream_);
    c.page_size = 1;
    c.dim = 64;
    c.num_kv_heads = 8;
    c.group = 4;
    run_case(c, stream_);
}

// Random configurations: dtype, head dim 64/128/256, 1..8 KV heads with 1..16 q-heads each, page size 1..256 (any),
// either cache layout, a batch of 1..24 with lengths 0..40000 (some empty, some one token), the op's split count or a
// forced one, with and without lse. The draw seed is printed.
TEST_F(DecodeAttention, RandomConfigurations) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("draw seed " + std::to_string(seed));
    Rng rng{seed};
    const auto pick = [&](int lo, int hi) {
        return lo + static_cast<int>(rng.next() % static_cast<uint64_t>(hi - lo + 1));
    };
    for (int i = 0; i < 12; ++i) {
        Case c;
        c.dtype = pick(0, 1) == 0 ? DType::kBF16 : DType::kF16;
        c.dim = std::array<int, 3>{64, 128, 256}[pick(0, 2)];
        c.num_kv_heads = pick(1, 8);
        c.group = pick(1, 16);
        c.page_size = pick(0, 2) == 0 ? pick(1, 256) : std::array<int, 3>{1, 16, 64}[pick(0, 2)];
        c.layout = pick(0, 1) == 0 ? Layout::kSlotsHeads : Layout::kHeadsSlots;
        c.lens.clear();
        const int batch = pick(1, 24);
        for (int b = 0; b < batch; ++b) {
            const int kind = pick(0, 5);
            c.lens.push_back(kind == 0 ? 0 : kind == 1 ? 1 : pick(2, kind == 5 ? 40000 : 3000));
        }
        // The host reference's cost: tokens x q-heads x dim bounded by 2^30 (lengths scaled down past it).
        double work = 0;
        for (int len : c.lens) work += static_cast<double>(len) * c.num_kv_heads * c.group * c.dim;
        if (work > 0x1p30) {
            for (int& len : c.lens) len = static_cast<int>(len * (0x1p30 / work));
        }
        c.num_splits = pick(0, 3) == 0 ? pick(1, 64) : 0;
        c.want_lse = pick(0, 3) != 0;
        run_case(c, stream_);
        if (HasFailure()) return;
    }
}

// Captured once, replayed: each replay recomputes the same result (outputs re-poisoned in between).
TEST_F(DecodeAttention, CudaGraphReplay) {
    Case c;
    c.explicit_workspace = true;
    c.lens = {1000, 33000, 7};
    run_case(c, stream_, /*via_graph=*/true);
    c.programmatic = true;  // the split kernel's launch becomes a programmatic edge behind the poisoning memset
    run_case(c, stream_, /*via_graph=*/true);
}

// The split kernel launched programmatically: one split and several, twice each, `out` poisoned before each call.
TEST_F(DecodeAttention, ProgrammaticLaunchWaitsForWhatCameBefore) {
    Case c;
    c.programmatic = true;
    c.lens = {33000, 1, 0, 4096};
    for (int32_t splits : {0, 1, 7}) {
        c.num_splits = splits;
        run_case(c, stream_);
        run_case(c, stream_);
    }
}

// With a status, block-table entries outside [0, num_pages) are never dereferenced: entries terabytes away (a read
// would fault the context) in a page the prologue copies and in one only the main loop reads, at head_dim 64/128/256
// and page sizes 16, 24 (divided, not shifted) and 128 (two tiles per page), in one split and in several. The sequences
// holding one get NaN out and lse, the others are bit for bit those of the good table, the first bad entry found is
// recorded in options.status and check_attention_status names it; the unchecked build (no status) on the good table
// equals the checked one bit for bit.
TEST_F(DecodeAttention, BlockTableEntriesOutsideTheCachePoisonTheirSequenceAndAreRecorded) {
    constexpr int kHeads = 2, kQHeads = 8, kBatch = 3, kMaxLen = 1024;
    const std::vector<int32_t> seq_lens = {40, 100, 1000};
    Rng rng{fresh_seed()};
    for (const int dim : {64, 128, 256}) {
        for (const int page : {16, 24, 128}) {
            SCOPED_TRACE("head_dim " + std::to_string(dim) + ", page_size " + std::to_string(page));
            const int cols = (kMaxLen + page - 1) / page;
            int pages = 0;
            for (int32_t len : seq_lens) pages += (len + page - 1) / page;
            const size_t kv_bytes = static_cast<size_t>(pages) * page * kHeads * dim * 2;
            const size_t q_bytes = static_cast<size_t>(kBatch) * kQHeads * dim * 2;
            DevicePtr buf = device_alloc(kv_bytes + 2 * q_bytes + (1 << 16));
            auto* base = static_cast<uint8_t*>(buf.get());
            const TensorView kv(base, DType::kBF16, {pages, page, kHeads, dim});
            const TensorView q(base + kv_bytes, DType::kBF16, {kBatch, kQHeads, dim});
            const TensorView out(base + kv_bytes + q_bytes, DType::kBF16, {kBatch, kQHeads, dim});
            uint8_t* const tail = base + kv_bytes + 2 * q_bytes;
            const TensorView lse(tail, DType::kF32, {kBatch, kQHeads});
            const TensorView lens(tail + 256, DType::kI32, {kBatch});
            const TensorView table(tail + 512, DType::kI32, {kBatch, cols});
            std::vector<uint16_t> values(kv_bytes / 2);
            for (uint16_t& v : values) v = to_bits(rng.uniform(-1.f, 1.f), DType::kBF16);
            CK(cudaMemcpy(kv.data, values.data(), kv_bytes, cudaMemcpyHostToDevice));
            std::vector<uint16_t> qv(q_bytes / 2);
            for (uint16_t& v : qv) v = to_bits(rng.uniform(-2.f, 2.f), DType::kBF16);
            CK(cudaMemcpy(q.data, qv.data(), q_bytes, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(lens.data, seq_lens.data(), sizeof(int32_t) * kBatch, cudaMemcpyHostToDevice));
            // Every page used once, in a shuffled order; columns past a sequence's pages hold -9 (never read).
            std::vector<int32_t> order(static_cast<size_t>(pages));
            std::iota(order.begin(), order.end(), 0);
            std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(dim + page)));
            std::vector<int32_t> good(static_cast<size_t>(kBatch) * cols, -9);
            size_t next = 0;
            for (int b = 0; b < kBatch; ++b) {
                for (int j = 0; j < (seq_lens[static_cast<size_t>(b)] + page - 1) / page; ++j) {
                    good[static_cast<size_t>(b) * cols + j] = order[next++];
                }
            }
            struct Result {
                std::vector<uint16_t> out;
                std::vector<float> lse;
            };
            const auto run = [&](const std::vector<int32_t>& t, int splits, ops::AttentionStatus* status) {
                WEFT_CUDA_CHECK(cudaMemcpy(table.data, t.data(), sizeof(int32_t) * t.size(), cudaMemcpyHostToDevice));
                WEFT_CUDA_CHECK(cudaMemset(out.data, 0xFF, static_cast<size_t>(out.size_bytes())));
                WEFT_CUDA_CHECK(cudaMemset(lse.data, 0xFF, static_cast<size_t>(lse.size_bytes())));
                ops::DecodeAttentionOptions opt;
                opt.num_splits = splits;
                opt.status = status;
                ops::decode_attention(q, kv, kv, table, lens, kMaxLen, out, lse, stream_, opt);
                WEFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
                Result r{std::vector<uint16_t>(q_bytes / 2), std::vector<float>(kBatch * kQHeads)};
                WEFT_CUDA_CHECK(cudaMemcpy(r.out.data(), out.data, q_bytes, cudaMemcpyDeviceToHost));
                WEFT_CUDA_CHECK(cudaMemcpy(r.lse.data(), lse.data, r.lse.size() * 4, cudaMemcpyDeviceToHost));
                return r;
            };
            // The sequences in `poisoned` NaN in every element, the others as in `want`.
            const auto expect = [&](const Result& got, const Result& want, std::initializer_list<int> poisoned,
                                    const std::string& what) {
                const size_t row = static_cast<size_t>(kQHeads) * dim;
                for (int b = 0; b < kBatch; ++b) {
                    const bool nan = std::find(poisoned.begin(), poisoned.end(), b) != poisoned.end();
                    for (size_t i = b * row; i < (b + 1) * row; ++i) {
                        const bool is_nan = (got.out[i] & 0x7F80u) == 0x7F80u && (got.out[i] & 0x7Fu) != 0;
                        ASSERT_TRUE(nan ? is_nan : got.out[i] == want.out[i])
                            << what << ": sequence " << b << ", out element " << i - b * row << " = 0x" << std::hex
                            << got.out[i];
                    }
                    for (int h = b * kQHeads; h < (b + 1) * kQHeads; ++h) {
                        ASSERT_TRUE(nan ? std::isnan(got.lse[h]) : got.lse[h] == want.lse[h])
                            << what << ": sequence " << b << ", lse " << h << " = " << got.lse[h];
                    }
                }
            };
            const int32_t prologue_page = 85 / page;  // token 85 of sequence 1: within the first two tiles
            const int32_t loop_page = 900 / page;     // token 900 of sequence 2: a tile the prologue never copies
            ops::AttentionStatus* status = nullptr;
            CK(cudaHostAlloc(reinterpret_cast<void**>(&status), sizeof(ops::AttentionStatus), cudaHostAllocMapped));
            for (const int splits : {1, 4}) {
                SCOPED_TRACE("num_splits " + std::to_string(splits));
                *status = {};
                const Result want = run(good, splits, status);
                EXPECT_EQ(status->code, 0) << ops::describe_attention_status(*status);
                for (float x : want.lse) ASSERT_TRUE(std::isfinite(x));
                const Result unchecked = run(good, splits, nullptr);
                EXPECT_EQ(unchecked.out, want.out) << "the unchecked build";
                EXPECT_EQ(unchecked.lse, want.lse) << "the unchecked build";
                // In the main loop only: that entry is recorded, named, and its sequence alone is NaN.
                std::vector<int32_t> bad = good;
                bad[2 * cols + loop_page] = 1 << 30;
                *status = {};
                expect(run(bad, splits, status), want, {2}, "1 << 30 read by the loop");
                EXPECT_EQ(status->code, 1);
                EXPECT_EQ(status->sequence, 2);
                EXPECT_EQ(status->page, loop_page);
                EXPECT_EQ(status->value, 1 << 30);
                try {
                    ops::check_attention_status(*status);
                    ADD_FAILURE() << "check_attention_status did not throw";
                } catch (const Error& e) {
                    const std::string want_text = "block_table[2][" + std::to_string(loop_page) +
                                                  "] = " + std::to_string(1 << 30) + " is outside the cache's pages";
                    EXPECT_NE(std::string(e.what()).find(want_text), std::string::npos) << e.what();
                }
                // And in a prologue tile of another sequence: both NaN, one of the two recorded.
                bad[1 * cols + prologue_page] = INT32_MIN;
                *status = {};
                expect(run(bad, splits, status), want, {1, 2}, "INT32_MIN in a prologue tile too");
                EXPECT_EQ(status->code, 1);
                EXPECT_TRUE((status->sequence == 1 && status->page == prologue_page && status->value == INT32_MIN) ||
                            (status->sequence == 2 && status->page == loop_page && status->value == 1 << 30))
                    << ops::describe_attention_status(*status);
                // One past the cache, and -1: the bounds exactly.
                std::vector<int32_t> edge = good;
                edge[1 * cols + prologue_page] = pages;
                *status = {};
                expect(run(edge, splits, status), want, {1}, "num_pages");
                EXPECT_EQ(status->value, pages);
                edge[1 * cols + prologue_page] = -1;
                *status = {};
                expect(run(edge, splits, status), want, {1}, "-1");
                EXPECT_EQ(status->value, -1);
                EXPECT_EQ(cudaGetLastError(), cudaSuccess);
            }
            cudaFreeHost(status);
        }
    }
    // A pageable host status is refused by name before anything is launched.
    DevicePtr buf = device_alloc(1 << 20);
    auto* base = static_cast<uint8_t*>(buf.get());
    const TensorView q(base, DType::kBF16, {1, 8, 128});
    const TensorView kv(base + (64 << 10), DType::kBF16, {4, 16, 2, 128});
    const TensorView table(base + (384 << 10), DType::kI32, {1, 4});
    const TensorView lens(base + (388 << 10), DType::kI32, {1});
    const TensorView out(base + (392 << 10), DType::kBF16, {1, 8, 128});
    const TensorView lse(base + (400 << 10), DType::kF32, {1, 8});
    ops::AttentionStatus host_status{};
    ops::DecodeAttentionOptions opt;
    opt.status = &host_status;
    try {
        ops::decode_attention(q, kv, kv, table, lens, 64, out, lse, stream_, opt);
        ADD_FAILURE() << "a pageable host status was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("options.status ("), std::string::npos) << e.what();
    }
}

// Bad arguments are errors before anything launches (no device memory touched). The views lie apart in one buffer, so
// that each call reaches the check it is meant for (an overlap refusal would otherwise answer first), and each error
// is the one expected.
TEST_F(DecodeAttention, BadArgumentsThrowBeforeLaunching) {
    DevicePtr buf = device_alloc(1 << 20);
    auto* base = static_cast<uint8_t*>(buf.get());
    const TensorView q(base, DType::kBF16, {2, 8, 128});                     // 4 KiB at 0
    const TensorView kv(base + (64 << 10), DType::kBF16, {32, 16, 2, 128});  // 256 KiB at 64 KiB
    const TensorView table(base + (384 << 10), DType::kI32, {2, 16});        // at 384 KiB
    const TensorView lens(base + (388 << 10), DType::kI32, {2});             // at 388 KiB
    const TensorView out(base + (392 << 10), DType::kBF16, {2, 8, 128});     // 4 KiB at 392 KiB
    const auto expect_error = [](const std::function<void()>& call, const std::string& words) {
        try {
            call();
            ADD_FAILURE() << "no error; expected one saying '" << words << "'";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
        }
    };
    // max_seq_len above the 16 x 16 slots the table holds
    expect_error([&] { ops::decode_attention(q, kv, kv, table, lens, 257, out, TensorView(), stream_); },
                 "max_seq_len (257) exceeds what block_table holds");
    const TensorView bad_q(base, DType::kF32, {2, 8, 128});
    expect_error([&] { ops::decode_attention(bad_q, kv, kv, table, lens, 256, out, TensorView(), stream_); },
                 "q must be bf16 or f16");
    // 4 splits need a workspace far larger than 16 bytes
    ops::DecodeAttentionOptions opt;
    opt.num_splits = 4;
    opt.workspace = TensorView(base + (400 << 10), DType::kU8, {16});
    expect_error([&] { ops::decode_attention(q, kv, kv, table, lens, 256, out, TensorView(), stream_, opt); },
                 "options.workspace holds 16 bytes");
    // Host memory is refused by name (the kernels would fault on it).
    std::vector<int32_t> host_lens(2, 16);
    const TensorView host_lens_view(host_lens.data(), DType::kI32, {2});
    expect_error([&] { ops::decode_attention(q, kv, kv, table, host_lens_view, 256, out, TensorView(), stream_); },
                 "decode_attention: seq_lens (");
    CK(cudaStreamSynchronize(stream_));
}

}  // namespace
}  // namespace weft
