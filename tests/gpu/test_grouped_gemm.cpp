// SPDX-License-Identifier: MIT
// GPU tests of weft::ops::grouped_gemm (contiguous and masked layouts) against a host reference in fp64 from the
// rounded inputs: 1, 3, 8 and 32 groups; a hot group; all groups but one empty; empty groups; counts that are not
// multiples of the tile; N and K on and off the tile; bf16 and fp32 out; both B layouts; every candidate config;
// rows outside every group left untouched; counts over capacity clamped and recorded; counts read on the device at
// replay of a captured graph; the per-group wait and per-tile signal hooks; random routings on random shapes.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/gemm_testing.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/grouped_gemm.hpp"
#include "weft/ops/moe_tp.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

using namespace gemm_test;

#define CK(call)                                                                   \
    do {                                                                           \
        const cudaError_t err_ = (call);                                           \
        ASSERT_EQ(err_, cudaSuccess) << #call << ": " << cudaGetErrorString(err_); \
    } while (0)

#define REQUIRE_SM90()                               \
    do {                                             \
        std::string why_;                            \
        if (!have_sm90(&why_)) GTEST_SKIP() << why_; \
    } while (0)

/// One grouped call.
struct GroupedCase {
    ops::GroupedLayout layout = ops::GroupedLayout::kContiguous;
    std::vector<int32_t> counts;  ///< rows per group (masked: may exceed capacity to test clamping)
    int64_t alignment = 1;        ///< contiguous: each group's first row is a multiple of this
    int64_t capacity = 0;         ///< masked: rows per group of A and D
    int64_t n = 0, k = 0;
    DType out = DType::kBF16;
    BLayout b_layout = BLayout::kNK;
    std::optional<GemmConfig> config;
    int sm_budget = 0;
};

std::string describe(const GroupedCase& c) {
    std::ostringstream os;
    os << (c.layout == ops::GroupedLayout::kContiguous ? "contiguous" : "masked") << " G=" << c.counts.size()
       << " N=" << c.n << " K=" << c.k << " out " << dtype_name(c.out)
       << (c.b_layout == BLayout::kNK ? " B[G,N,K]" : " B[G,K,N]") << " align " << c.alignment << " capacity "
       << c.capacity << " counts [";
    for (size_t g = 0; g < c.counts.size() && g < 12; ++g) os << (g ? "," : "") << c.counts[g];
    if (c.counts.size() > 12) os << ",...";
    os << "]" << (c.config ? " config " + ops::format_gemm_config(*c.config) : std::string());
    return os.str();
}

/// The operands of a case on host and device: A and D as [rows, cols] matrices (masked: groups back to back), B as
/// [G * N, K] (kNK) or [G * K, N] (kKN), the group arrays, and where each group's rows are.
struct GroupedOperands {
    std::vector<int32_t> offsets;  ///< first row of each group (declared first: total_rows fills it)
    std::vector<int32_t> valid;    ///< rows of each group the kernel computes (clamped as the kernel clamps)
    int64_t groups, rows;
    HostMatrix a, b, d;
    DeviceBuffer da, db, dd, dcounts, doffsets;

    static int64_t total_rows(const GroupedCase& c, std::vector<int32_t>* offsets) {
        int64_t row = 0;
        for (size_t g = 0; g < c.counts.size(); ++g) {
            if (c.layout == ops::GroupedLayout::kMasked) {
                offsets->push_back(static_cast<int32_t>(g * c.capacity));
            } else {
                row = (row + c.alignment - 1) / c.alignment * c.alignment;
                offsets->push_back(static_cast<int32_t>(row));
                row += c.counts[g];
            }
        }
        if (c.layout == ops::GroupedLayout::kMasked) return static_cast<int64_t>(c.counts.size()) * c.capacity;
        return (row + c.alignment - 1) / c.alignment * c.alignment + 7;  // a few rows past the last group
    }

    GroupedOperands(const GroupedCase& c, std::mt19937_64& rng)
        : groups(static_cast<int64_t>(c.counts.size())),
          rows(total_rows(c, &offsets)),
          a(rows, c.k, c.k, DType::kBF16),
          b(c.b_layout == BLayout::kNK ? HostMatrix(groups * c.n, c.k, c.k, DType::kBF16)
                                       : HostMatrix(groups * c.k, c.n, c.n, DType::kBF16)),
          d(rows, c.n, c.n, c.out),
          da(a.bytes.size()),
          db(b.bytes.size()),
          dd(d.bytes.size()),
          dcounts(std::max<size_t>(4, c.counts.size() * 4)),
          doffsets(std::max<size_t>(4, offsets.size() * 4)) {
        for (size_t g = 0; g < c.counts.size(); ++g) {
            int32_t v = std::max(c.counts[g], 0);
            if (c.layout == ops::GroupedLayout::kMasked) v = std::min<int32_t>(v, static_cast<int32_t>(c.capacity));
            valid.push_back(v);
        }
        a.fill_random(rng);
        b.fill_random(rng);
        poison(d);
    }
};

TensorView a_view(const GroupedCase& c, const GroupedOperands& o) {
    if (c.layout == ops::GroupedLayout::kMasked) return TensorView(o.da.ptr, DType::kBF16, {o.groups, c.capacity, c.k});
    return TensorView(o.da.ptr, DType::kBF16, {o.rows, c.k});
}
TensorView b_view(const GroupedCase& c, const GroupedOperands& o) {
    if (c.b_layout == BLayout::kNK) return TensorView(o.db.ptr, DType::kBF16, {o.groups, c.n, c.k});
    return TensorView(o.db.ptr, DType::kBF16, {o.groups, c.k, c.n});
}
TensorView d_view(const GroupedCase& c, const GroupedOperands& o) {
    if (c.layout == ops::GroupedLayout::kMasked) return TensorView(o.dd.ptr, c.out, {o.groups, c.capacity, c.n});
    return TensorView(o.dd.ptr, c.out, {o.rows, c.n});
}

void run_case(const GroupedCase& c, const GroupedOperands& o, cudaStream_t stream, ops::GroupedGemmOptions options) {
    options.config = c.config;
    options.sm_budget = c.sm_budget;
    const auto* counts = static_cast<const int32_t*>(o.dcounts.ptr);
    if (c.layout == ops::GroupedLayout::kMasked) {
        ops::grouped_gemm_masked(a_view(c, o), b_view(c, o), d_view(c, o), c.b_layout, counts, stream, options);
    } else {
        ops::grouped_gemm_contiguous(a_view(c, o), b_view(c, o), d_view(c, o), c.b_layout,
                                     static_cast<const int32_t*>(o.doffsets.ptr), counts, stream, options);
    }
}

/// fp64 reference of group g's rows of D from the rounded inputs, [valid[g]][N].
std::vector<double> group_reference(const GroupedCase& c, const GroupedOperands& o, int64_t g) {
    const int64_t rows = o.valid[static_cast<size_t>(g)], n = c.n, k = c.k;
    std::vector<double> bt(static_cast<size_t>(n * k));  // [n][k] of group g
    for (int64_t j = 0; j < n; ++j) {
        for (int64_t kk = 0; kk < k; ++kk) {
            bt[static_cast<size_t>(j * k + kk)] =
                c.b_layout == BLayout::kNK ? o.b.get(g * n + j, kk) : o.b.get(g * k + kk, j);
        }
    }
    std::vector<double> ref(static_cast<size_t>(rows * n));
    std::vector<double> arow(static_cast<size_t>(k));
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = o.offsets[static_cast<size_t>(g)] + r;
        for (int64_t kk = 0; kk < k; ++kk) arow[static_cast<size_t>(kk)] = o.a.get(row, kk);
        for (int64_t j = 0; j < n; ++j) {
            const double* bj = bt.data() + j * k;
            double s = 0;
            for (int64_t kk = 0; kk < k; ++kk) s += arow[static_cast<size_t>(kk)] * bj[kk];
            ref[static_cast<size_t>(r * n + j)] = s;
        }
    }
    return ref;
}

/// Uploads, runs (through `run`, default: one call), downloads and checks every group's rows against the reference
/// and every other row of D against its poison.
/// `prepare(o, rng)` may change the host operands before they are uploaded.
struct NoPrepare {
    void operator()(GroupedOperands&, std::mt19937_64&) const {}
};

template <class Run, class Prepare = NoPrepare>
void check_with(const GroupedCase& c, Run&& run, Prepare&& prepare = {}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(describe(c) + " seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    GroupedOperands o(c, rng);
    ASSERT_TRUE(o.da.ptr && o.db.ptr && o.dd.ptr && o.dcounts.ptr && o.doffsets.ptr);
    prepare(o, rng);
    upload(o.a, o.da);
    upload(o.b, o.db);
    upload(o.d, o.dd);
    if (!c.counts.empty()) {
        CK(cudaMemcpy(o.dcounts.ptr, c.counts.data(), c.counts.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(o.doffsets.ptr, o.offsets.data(), o.offsets.size() * 4, cudaMemcpyHostToDevice));
    }
    // A cudaMemcpy from pageable memory may return before its DMA lands, on the legacy stream: done before `run`
    // uses the operands on its non-blocking stream.
    CK(cudaDeviceSynchronize());
    const HostMatrix poisoned = o.d;
    cudaStream_t stream = nullptr;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    run(c, o, stream);
    CK(cudaStreamSynchronize(stream));
    CK(cudaStreamDestroy(stream));
    download(o.d, o.dd);

    std::vector<bool> in_group(static_cast<size_t>(o.rows), false);
    for (int64_t g = 0; g < o.groups; ++g) {
        const int32_t rows = o.valid[static_cast<size_t>(g)];
        if (rows == 0) continue;
        std::vector<int64_t> row_ids(static_cast<size_t>(rows));
        for (int32_t r = 0; r < rows; ++r) {
            row_ids[static_cast<size_t>(r)] = o.offsets[static_cast<size_t>(g)] + r;
            in_group[static_cast<size_t>(o.offsets[static_cast<size_t>(g)] + r)] = true;
        }
        expect_matches(o.d, group_reference(c, o, g), row_ids, tolerance_for(c.out),
                       "group " + std::to_string(g));
        if (::testing::Test::HasFailure()) return;
    }
    // Rows outside every group (alignment padding, past a group's count, past the last group) are never written.
    const size_t row_bytes = static_cast<size_t>(o.d.ld * dtype_bytes(c.out));
    int64_t written = 0, first = -1;
    for (int64_t r = 0; r < o.rows; ++r) {
        if (in_group[static_cast<size_t>(r)]) continue;
        if (std::memcmp(o.d.bytes.data() + r * row_bytes, poisoned.bytes.data() + r * row_bytes, row_bytes) != 0) {
            ++written;
            if (first < 0) first = r;
        }
    }
    EXPECT_EQ(written, 0) << written << " rows outside every group were written, the first " << first;
}

void check(const GroupedCase& c, ops::GroupedGemmOptions options = {}) {
    check_with(c, [&](const GroupedCase& cc, GroupedOperands& o, cudaStream_t s) { run_case(cc, o, s, options); });
}

std::vector<int32_t> random_counts(int groups, int max_rows, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int> dist(0, max_rows);
    std::vector<int32_t> v(static_cast<size_t>(groups));
    for (auto& x : v) x = dist(rng);
    return v;
}

TEST(GroupedGemm, ContiguousOneThreeEightAndThirtyTwoGroups) {
    REQUIRE_SM90();
    for (int groups : {1, 3, 8, 32}) {
        GroupedCase c;
        c.counts = random_counts(groups, groups >= 32 ? 150 : 600, fresh_seed());
        c.counts[0] = groups == 1 ? 777 : c.counts[0];  // never all empty
        c.n = 320;
        c.k = 256;
        check(c);
        c.alignment = 128;  // as ep::Buffer::dispatch pads with Config::expert_alignment = 128
        c.n = 256;
        c.k = 200;
        c.out = DType::kF32;
        check(c);
    }
}

TEST(GroupedGemm, HotGroupEmptyGroupsAndAllButOneEmpty) {
    REQUIRE_SM90();
    GroupedCase hot;
    hot.counts = {2000, 3, 0, 5, 64, 0, 129, 1};
    hot.n = 384;
    hot.k = 192;
    check(hot);

    GroupedCase one;
    one.counts.assign(16, 0);
    one.counts[11] = 1500;
    one.n = 512;
    one.k = 128;
    one.out = DType::kF32;
    check(one);

    GroupedCase zeros;  // every group empty: nothing is written
    zeros.counts.assign(5, 0);
    zeros.n = 128;
    zeros.k = 64;
    check(zeros);
}

TEST(GroupedGemm, TileAndOffTileShapesBothLayoutsBothOutputs) {
    REQUIRE_SM90();
    for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
        for (DType out : {DType::kBF16, DType::kF32}) {
            for (auto [n, k] : {std::pair<int64_t, int64_t>{256, 256}, {512, 128}, {200, 136}, {72, 520}, {264, 64}}) {
                if (layout == BLayout::kKN && n % 8 != 0) continue;  // B [G,K,N] rows: 16-byte strides
                GroupedCase c;
                c.counts = {300, 0, 129, 64, 1, 255};
                c.n = n;
                c.k = k;
                c.out = out;
                c.b_layout = layout;
                c.alignment = 64;
                check(c);
            }
        }
    }
}

TEST(GroupedGemm, EveryCandidateConfig) {
    REQUIRE_SM90();
    for (DType out : {DType::kBF16, DType::kF32}) {
        for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
            for (const GemmConfig& cfg : ops::grouped_gemm_candidate_configs(DType::kBF16, out, layout)) {
                GroupedCase c;
                c.counts = {513, 0, 77, 256, 3};
                c.n = 448;
                c.k = 136;
                c.out = out;
                c.b_layout = layout;
                c.config = cfg;
                check(c);
                c.sm_budget = 3;  // many tiles per CTA across group boundaries
                check(c);
            }
        }
    }
}

TEST(GroupedGemm, MaskedUniformSkewedAndEmpty) {
    REQUIRE_SM90();
    GroupedCase c;
    c.layout = ops::GroupedLayout::kMasked;
    c.capacity = 256;
    c.counts = random_counts(32, 256, fresh_seed());
    c.n = 384;
    c.k = 256;
    check(c);
    c.counts.assign(32, 3);
    c.counts[5] = 256;
    c.counts[6] = 0;
    c.out = DType::kF32;
    c.b_layout = BLayout::kKN;
    check(c);
    c.capacity = 100;  // capacity not a multiple of any tile
    c.counts = {100, 0, 37, 64, 99};
    c.out = DType::kBF16;
    check(c);
}

// The scheduler sums the groups' tiles 32 groups per warp and walks its cursor 4 groups per round of loads: more than
// two chunks of 32 groups with counts 0, 1, capacity - 1 and capacity, one hot group in the third chunk with every
// other group empty, SM budgets that leave CTAs without a tile or walk one CTA over every group, each tile height.
TEST(GroupedGemm, MaskedCountsAcrossWarpChunksAndBudgets) {
    REQUIRE_SM90();
    GroupedCase c;
    c.layout = ops::GroupedLayout::kMasked;
    c.capacity = 130;  // 64-row tiles: 3 per full group; 128-row: 2 (the last of 2 rows)
    c.n = 192;
    c.k = 128;
    const std::vector<int32_t> edge = {0, 1, 129, 130, 0, 0, 64, 65};
    c.counts.assign(70, 0);
    for (size_t g = 0; g < c.counts.size(); ++g) c.counts[g] = edge[g % edge.size()];
    for (const int budget : {0, 1, 7}) {
        c.sm_budget = budget;
        check(c);
    }
    c.counts.assign(70, 0);
    c.counts[67] = 130;  // one hot group in the third chunk of 32
    for (const int budget : {0, 3}) {
        c.sm_budget = budget;
        check(c);
    }
    c.counts[67] = 1;  // one row in all
    c.sm_budget = 0;
    check(c);
    c.counts[67] = 0;
    c.counts[31] = 129;  // the last group of the first chunk, then the first of the second
    c.counts[32] = 130;
    for (const int tile_m : {64, 128, 256}) {
        for (const GemmConfig& cfg : ops::grouped_gemm_candidate_configs(DType::kBF16, DType::kBF16, BLayout::kNK)) {
            if (cfg.tile_m != tile_m) continue;
            c.config = cfg;
            check(c);
            break;
        }
    }

    GroupedCase ct;  // contiguous: 40 groups at 16-row alignment, one hot group in the second chunk
    ct.counts = random_counts(40, 150, fresh_seed());
    ct.counts[35] = 700;
    ct.alignment = 16;
    ct.n = 128;
    ct.k = 64;
    for (const int budget : {0, 2}) {
        ct.sm_budget = budget;
        check(ct);
    }
}

// The value of an e4m3 code (bits: sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities).
float e4m3_value(uint8_t code) {
    const int sign = code >> 7, exp = (code >> 3) & 15, man = code & 7;
    const float mag = exp == 0 ? std::ldexp(static_cast<float>(man) / 8.0f, -6)
                               : std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
    return sign ? -mag : mag;
}

// fp8 rows with a scale per 128 channels (as the low-latency dispatch produces): dequantised on the device into the
// bf16 workspace (poisoned first), then multiplied; the reference multiplies the host's dequantisation
// (bf16_rn(float(code) * scale)) of the same codes.
TEST(GroupedGemm, MaskedFp8RowsWithBlockScales) {
    REQUIRE_SM90();
    for (DType out : {DType::kBF16, DType::kF32}) {
        GroupedCase c;
        c.layout = ops::GroupedLayout::kMasked;
        c.capacity = 192;
        c.counts = {192, 0, 65, 1, 130, 7};
        c.n = 320;
        c.k = 384;
        c.out = out;
        const int64_t groups = static_cast<int64_t>(c.counts.size()), rows = groups * c.capacity;
        std::vector<uint8_t> codes(static_cast<size_t>(rows * c.k));
        std::vector<float> scales(static_cast<size_t>(rows * c.k / 128));
        DeviceBuffer dcodes(codes.size()), dscales(scales.size() * 4);
        ASSERT_TRUE(dcodes.ptr && dscales.ptr);
        auto prepare = [&](GroupedOperands& o, std::mt19937_64& rng) {
            std::uniform_int_distribution<int> byte(0, 255);
            std::uniform_real_distribution<float> scale(1e-3f, 1e-2f);
            for (auto& b : codes) {
                b = static_cast<uint8_t>(byte(rng));
                if ((b & 0x7F) == 0x7F) b = 0;  // no NaN codes
            }
            for (auto& s : scales) s = scale(rng);
            for (int64_t r = 0; r < rows; ++r) {
                for (int64_t kk = 0; kk < c.k; ++kk) {
                    const float v = e4m3_value(codes[static_cast<size_t>(r * c.k + kk)]) *
                                    scales[static_cast<size_t>(r * (c.k / 128) + kk / 128)];
                    o.a.set(r, kk, v);
                }
            }
        };
        check_with(
            c,
            [&](const GroupedCase& cc, GroupedOperands& o, cudaStream_t s) {
                ASSERT_EQ(cudaMemcpyAsync(dcodes.ptr, codes.data(), codes.size(), cudaMemcpyHostToDevice, s),
                          cudaSuccess);
                ASSERT_EQ(cudaMemcpyAsync(dscales.ptr, scales.data(), scales.size() * 4, cudaMemcpyHostToDevice, s),
                          cudaSuccess);
                // The workspace: NaN, on `s` (a legacy-stream memset could land after the op has written it).
                ASSERT_EQ(cudaMemsetAsync(o.da.ptr, 0xFF, o.a.bytes.size(), s), cudaSuccess);
                ops::grouped_gemm_masked_fp8(TensorView(dcodes.ptr, DType::kF8E4M3, {groups, cc.capacity, cc.k}),
                                             TensorView(dscales.ptr, DType::kF32, {groups, cc.capacity, cc.k / 128}),
                                             b_view(cc, o), d_view(cc, o), cc.b_layout,
                                             static_cast<const int32_t*>(o.dcounts.ptr), a_view(cc, o), s);
            },
            prepare);
    }
}

// Random routings on random shapes: 1..64 groups, counts drawn uniform, skewed (a few hot groups, most small or
// empty), one hot group with the rest empty, or all empty; contiguous with alignment 1, 8, 64 or 128, or masked with a
// random capacity (counts up to it); N and K multiples of 8 from 8 to 1024, both B layouts, bf16 or fp32 out; the
// op's own config. Every group's rows against fp64, every other row of D untouched. The seed is printed.
TEST(GroupedGemm, RandomRoutingsShapesAndLayouts) {
    REQUIRE_SM90();
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("draw seed " + std::to_string(seed));
    RandomDraw draw(seed);
    for (int i = 0; i < 16; ++i) {
        GroupedCase c;
        c.layout = draw.uniform(0, 2) == 0 ? ops::GroupedLayout::kMasked : ops::GroupedLayout::kContiguous;
        const int groups = static_cast<int>(draw.uniform(0, 3) == 0 ? draw.uniform(1, 4) : draw.uniform(1, 64));
        c.n = 8 * draw.uniform(1, 128);
        c.k = 8 * draw.uniform(1, 128);
        c.out = draw.uniform(0, 1) == 0 ? DType::kBF16 : DType::kF32;
        c.b_layout = draw.uniform(0, 2) == 0 ? BLayout::kKN : BLayout::kNK;
        // Rows in all: the host reference's cost bounds them (rows x N x K <= 2^28).
        const int64_t max_rows = std::max<int64_t>(1, std::min<int64_t>(3000, (int64_t{1} << 28) / (c.n * c.k)));
        const int64_t per_group = std::max<int64_t>(1, max_rows / groups);
        c.capacity = c.layout == ops::GroupedLayout::kMasked ? draw.uniform(1, std::min<int64_t>(per_group, 300)) : 0;
        const int64_t cap = c.layout == ops::GroupedLayout::kMasked ? c.capacity : per_group;
        const int pattern = static_cast<int>(draw.uniform(0, 3));
        c.counts.assign(static_cast<size_t>(groups), 0);
        for (int g = 0; g < groups; ++g) {
            switch (pattern) {
                case 0:
                    c.counts[g] = static_cast<int32_t>(draw.uniform(0, cap));
                    break;  // uniform
                case 1:
                    c.counts[g] = static_cast<int32_t>(draw.uniform(0, 3) == 0 ? cap : draw.uniform(0, 4));
                    break;  // skewed
                default:
                    break;  // one hot group (below) or all empty
            }
        }
        if (pattern == 2) c.counts[static_cast<size_t>(draw.uniform(0, groups - 1))] = static_cast<int32_t>(cap);
        if (c.layout == ops::GroupedLayout::kContiguous)
            c.alignment = std::array<int64_t, 4>{1, 8, 64, 128}[draw.uniform(0, 3)];
        check(c);
        if (HasFatalFailure() || HasFailure()) return;
    }
}

// Counts over capacity (masked) or rows past A (contiguous) are clamped and recorded in the status word.
TEST(GroupedGemm, BadCountsAreClampedAndRecorded) {
    REQUIRE_SM90();
    ops::GroupedStatus* status = nullptr;
    CK(cudaHostAlloc(reinterpret_cast<void**>(&status), sizeof(ops::GroupedStatus), cudaHostAllocMapped));
    std::memset(status, 0, sizeof(*status));
    ops::GroupedGemmOptions options;
    options.status = status;

    GroupedCase c;
    c.layout = ops::GroupedLayout::kMasked;
    c.capacity = 128;
    c.counts = {10, 300, 128, -4};
    c.n = 128;
    c.k = 64;
    check(c, options);  // groups 1 and 3 clamped to 128 and 0: the reference clamps too
    EXPECT_EQ(status->code, static_cast<int32_t>(ops::GroupedStatusCode::kCountOverCapacity));
    EXPECT_EQ(status->group, 1);
    EXPECT_EQ(status->value, 300);
    EXPECT_EQ(status->limit, 128);
    EXPECT_THROW(ops::check_grouped_status(*status), Error);

    // The first bad group when it is in the second chunk of 32 groups the scheduler reads at once, another after it.
    std::memset(status, 0, sizeof(*status));
    c.counts.assign(40, 5);
    c.counts[33] = -7;
    c.counts[38] = 129;
    check(c, options);
    EXPECT_EQ(status->code, static_cast<int32_t>(ops::GroupedStatusCode::kCountNegative));
    EXPECT_EQ(status->group, 33);
    EXPECT_EQ(status->value, -7);
    EXPECT_EQ(status->limit, 0);
    CK(cudaFreeHost(status));
}

// The counts are read on the device at each replay of a captured launch.
TEST(GroupedGemm, GraphReplayReadsTheCountsOfItsReplay) {
    REQUIRE_SM90();
    GroupedCase c;
    c.counts = {200, 0, 300};
    c.alignment = 128;
    c.n = 256;
    c.k = 128;
    const std::vector<int32_t> replay_counts = {5, 0, 129};  // within the segments the offsets leave
    check_with(c, [&](const GroupedCase& cc, GroupedOperands& o, cudaStream_t s) {
        // Load the kernel outside the capture, restore D's poison, capture with the first counts, then replay with
        // other (smaller) counts in the same segments.
        run_case(cc, o, s, {});
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        upload(o.d, o.dd);
        cudaGraph_t graph = nullptr;
        ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        run_case(cc, o, s, {});
        ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
        cudaGraphExec_t exec = nullptr;
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        ASSERT_EQ(cudaMemcpyAsync(o.dcounts.ptr, replay_counts.data(), 12, cudaMemcpyHostToDevice, s), cudaSuccess);
        ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        o.valid = replay_counts;  // what the check below compares with
    });
}

// The hooks a fused MoE layer builds on: a per-group wait before A is loaded (satisfied here: the flags are set
// before the launch) and a per-tile signal (each group's counter grows by its tiles).
TEST(GroupedGemm, WaitAndSignalHooks) {
    REQUIRE_SM90();
    GroupedCase c;
    c.counts = {300, 0, 129, 1};
    c.n = 384;
    c.k = 128;
    c.config = GemmConfig{.tile_m = 128, .tile_n = 128, .stages = 6};
    const int groups = static_cast<int>(c.counts.size());
    DeviceBuffer wait_flags(groups * 8), signal_flags(groups * 8);
    ASSERT_TRUE(wait_flags.ptr && signal_flags.ptr);
    const std::vector<uint64_t> ready(static_cast<size_t>(groups), 1);
    CK(cudaMemcpy(wait_flags.ptr, ready.data(), groups * 8, cudaMemcpyHostToDevice));
    CK(cudaMemset(signal_flags.ptr, 0, groups * 8));
    CK(cudaDeviceSynchronize());  // legacy-stream work: done before the GEMM runs on its non-blocking stream
    ops::GroupedGemmOptions options;
    ops::GroupedWaitParams w{};
    w.flags = static_cast<const uint64_t*>(wait_flags.ptr);
    w.expected = 1;
    options.wait = w;
    ops::GroupedTileSignalParams sig{};
    sig.flags = static_cast<uint64_t*>(signal_flags.ptr);
    sig.value = 2;
    sig.mode = ops::GroupedSignalMode::kAddPerGroup;
    options.signal = sig;
    check(c, options);
    std::vector<uint64_t> got(static_cast<size_t>(groups));
    CK(cudaMemcpy(got.data(), signal_flags.ptr, groups * 8, cudaMemcpyDeviceToHost));
    for (int g = 0; g < groups; ++g) {
        const uint64_t tiles = static_cast<uint64_t>((c.counts[static_cast<size_t>(g)] + 127) / 128) * 3;
        EXPECT_EQ(got[static_cast<size_t>(g)], tiles * 2) << "group " << g;
    }
}

TEST(GroupedGemm, RejectsBadArguments) {
    REQUIRE_SM90();
    DeviceBuffer buf(1 << 20);
    ASSERT_TRUE(buf.ptr);
    const auto* counts = static_cast<const int32_t*>(buf.ptr);
    const TensorView a(buf.ptr, DType::kBF16, {64, 64});
    const TensorView b(buf.ptr, DType::kBF16, {2, 64, 64});
    const TensorView d(buf.ptr, DType::kBF16, {64, 64});
    EXPECT_THROW(ops::grouped_gemm_contiguous(a, b, d, BLayout::kNK, nullptr, counts, nullptr), Error);
    EXPECT_THROW(ops::grouped_gemm_masked(a, b, d, BLayout::kNK, counts, nullptr), Error);  // a must be 3-D
    ops::GroupedGemmOptions o;
    o.signal = ops::GroupedTileSignalParams{};
    EXPECT_THROW(ops::grouped_gemm_contiguous(a, b, d, BLayout::kNK, counts, counts, nullptr, o), Error);
}

// Arrays the kernels would dereference, in host memory: refused before anything is enqueued, naming the argument
// (without HMM the kernel would fault with a sticky error that names nothing).
TEST(GroupedGemm, HostMemoryIsRefusedNamingTheArgument) {
    REQUIRE_SM90();
    DeviceBuffer a_buf(64 * 64 * 2), b_buf(2 * 64 * 64 * 2), d_buf(64 * 64 * 2), arrays(4096);
    ASSERT_TRUE(a_buf.ptr && b_buf.ptr && d_buf.ptr && arrays.ptr);
    auto* dev_i32 = static_cast<int32_t*>(arrays.ptr);
    const TensorView a(a_buf.ptr, DType::kBF16, {64, 64});
    const TensorView b(b_buf.ptr, DType::kBF16, {2, 64, 64});
    const TensorView d(d_buf.ptr, DType::kBF16, {64, 64});
    std::vector<int32_t> host_counts(2, 0), host_offsets(2, 0);
    std::vector<uint16_t> host_a(64 * 64);
    const auto message = error_message;
    const std::string counts_err =
        message([&] { ops::grouped_gemm_contiguous(a, b, d, BLayout::kNK, dev_i32, host_counts.data(), nullptr); });
    EXPECT_NE(counts_err.find("grouped_gemm_contiguous: counts ("), std::string::npos) << counts_err;
    EXPECT_NE(counts_err.find("must be device memory, got unregistered host memory"), std::string::npos) << counts_err;
    const std::string offsets_err =
        message([&] { ops::grouped_gemm_contiguous(a, b, d, BLayout::kNK, host_offsets.data(), dev_i32, nullptr); });
    EXPECT_NE(offsets_err.find("offsets ("), std::string::npos) << offsets_err;
    const TensorView host_view(host_a.data(), DType::kBF16, {64, 64});
    const std::string a_err =
        message([&] { ops::grouped_gemm_contiguous(host_view, b, d, BLayout::kNK, dev_i32, dev_i32 + 4, nullptr); });
    EXPECT_NE(a_err.find("grouped_gemm_contiguous: a ("), std::string::npos) << a_err;
    const TensorView a3(a_buf.ptr, DType::kBF16, {2, 32, 64});
    const TensorView d3(d_buf.ptr, DType::kBF16, {2, 32, 64});
    const std::string masked_err =
        message([&] { ops::grouped_gemm_masked(a3, b, d3, BLayout::kNK, host_counts.data(), nullptr); });
    EXPECT_NE(masked_err.find("grouped_gemm_masked: counts ("), std::string::npos) << masked_err;

    // moe_route: topk_idx, and the routing's own arrays.
    ops::MoeRouting routing;
    routing.num_experts = 4;
    routing.rows_capacity = 16;
    routing.counts = dev_i32 + 64;
    routing.offsets = dev_i32 + 128;
    routing.gather_index = dev_i32 + 192;
    routing.slot_rows = dev_i32 + 256;
    std::vector<int32_t> host_idx(8 * 2, 0);
    const std::string idx_err = message([&] {
        ops::moe_route(TensorView(host_idx.data(), DType::kI32, {8, 2}), routing, 1, nullptr);
    });
    EXPECT_NE(idx_err.find("moe_route: topk_idx ("), std::string::npos) << idx_err;
    ops::MoeRouting host_routing = routing;
    std::vector<int32_t> host_slots(16, 0);
    host_routing.slot_rows = host_slots.data();
    const std::string slots_err = message([&] {
        ops::moe_route(TensorView(dev_i32 + 512, DType::kI32, {8, 2}), host_routing, 1, nullptr);
    });
    EXPECT_NE(slots_err.find("moe_route: routing.slot_rows ("), std::string::npos) << slots_err;

    // The words the options point at: a pageable host status record is refused by name (the kernel's first write to
    // it would fault the context); host-mapped pinned memory is taken.
    ops::GroupedStatus host_status{};
    ops::GroupedGemmOptions with_status;
    with_status.status = &host_status;
    const std::string status_err = message(
        [&] { ops::grouped_gemm_contiguous(a, b, d, BLayout::kNK, dev_i32, dev_i32 + 4, nullptr, with_status); });
    EXPECT_NE(status_err.find("grouped_gemm_contiguous: options.status ("), std::string::npos) << status_err;
    EXPECT_NE(status_err.find("must be device memory or host-mapped pinned memory, got unregistered host memory"),
              std::string::npos)
        << status_err;
    ops::MoeRoutingStatus host_route_status{};
    const std::string route_status_err = message([&] {
        ops::moe_route(TensorView(dev_i32 + 512, DType::kI32, {8, 2}), routing, 1, nullptr, &host_route_status);
    });
    EXPECT_NE(route_status_err.find("moe_route: status ("), std::string::npos) << route_status_err;
    void* mapped = nullptr;
    ASSERT_EQ(cudaHostAlloc(&mapped, sizeof(ops::GroupedStatus), cudaHostAllocMapped), cudaSuccess);
    std::memset(mapped, 0, sizeof(ops::GroupedStatus));
    with_status.status = static_cast<ops::GroupedStatus*>(mapped);
    WEFT_CUDA_CHECK(cudaMemset(dev_i32, 0, 64));  // offsets and counts 0: an empty call
    EXPECT_NO_THROW(ops::grouped_gemm_contiguous(a, b, d, BLayout::kNK, dev_i32, dev_i32 + 4, nullptr, with_status));
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    cudaFreeHost(mapped);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a refused call left a CUDA error behind";
}

}  // namespace
}  // namespace weft
