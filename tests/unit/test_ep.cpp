// SPDX-License-Identifier: MIT
// Unit tests of expert parallelism on the CPU: the host reference against brute force, config validation,
// footprint and sizing maths, the workspace layout and its pointer views, status messages, number formats, and
// NVRTC compilation of the kernels (with the combines' row loads in flight together in SASS).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <type_traits>

#include "support/ep_reference.hpp"
#include "support/jit_testing.hpp"
#include "support/sass_testing.hpp"
#include "weft/jit/aot.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/aot.hpp"
#include "weft/ops/ep.hpp"
#include "weft/runtime/error.hpp"

namespace weft::ops::ep {
namespace {

namespace ref = weft::test::ep;
namespace fs = std::filesystem;

std::mt19937 fresh_rng() {
    const unsigned seed = std::random_device{}();
    std::printf("[ seed     ] %u\n", seed);
    return std::mt19937(seed);
}

// A routing with every kind of slot: valid, dropped (-1), out of range, repeated.
ref::Routing messy_routing(const ref::Params& p, int tokens, std::mt19937& rng) {
    ref::Routing r;
    r.num_tokens = tokens;
    std::uniform_int_distribution<int> expert(0, p.num_experts - 1);
    std::uniform_int_distribution<int> kind(0, 19);
    for (int t = 0; t < tokens; ++t) {
        for (int j = 0; j < p.topk; ++j) {
            const int k = kind(rng);
            int32_t e = expert(rng);
            if (k == 0) e = -1;
            if (k == 1) e = p.num_experts + expert(rng);
            if (k == 2) e = -2 - expert(rng);
            if (k == 3 && j > 0) e = r.topk_idx[r.topk_idx.size() - 1];
            r.topk_idx.push_back(e);
            r.topk_weights.push_back(0.5f);
        }
    }
    return r;
}

TEST(EpReference, LayoutMatchesBruteForce) {
    auto rng = fresh_rng();
    for (int trial = 0; trial < 30; ++trial) {
        ref::Params p;
        p.num_ranks = 1 + static_cast<int>(rng() % 8);
        p.num_experts = p.num_ranks * (1 + static_cast<int>(rng() % 5));
        p.topk = 1 + static_cast<int>(rng() % std::min(p.num_experts, 9));
        const int tokens = static_cast<int>(rng() % 70);
        const ref::Routing r = messy_routing(p, tokens, rng);
        const ref::RankLayout l = ref::reference_layout(p, r);
        const int k = p.topk;
        const int w = p.num_ranks;
        // Brute force: validity, then counts by scanning all earlier routes / tokens.
        auto valid = [&](int t, int j) {
            const int32_t e = r.topk_idx[static_cast<size_t>(t * k + j)];
            if (e < 0 || e >= p.num_experts) return -1;
            for (int i = 0; i < j; ++i)
                if (r.topk_idx[static_cast<size_t>(t * k + i)] == e) return -1;
            return static_cast<int>(e);
        };
        auto goes = [&](int t, int dst) {
            for (int j = 0; j < k; ++j)
                if (valid(t, j) >= 0 && valid(t, j) / p.local_experts() == dst) return true;
            return false;
        };
        for (int e = 0; e < p.num_experts; ++e) {
            int count = 0;
            for (int t = 0; t < tokens; ++t)
                for (int j = 0; j < k; ++j) count += valid(t, j) == e;
            EXPECT_EQ(l.tokens_per_expert[static_cast<size_t>(e)], count) << "expert " << e;
        }
        for (int t = 0; t < tokens; ++t) {
            for (int j = 0; j < k; ++j) {
                int before = -1;
                if (valid(t, j) >= 0) {
                    before = 0;
                    for (int t2 = 0; t2 <= t; ++t2)
                        for (int j2 = 0; j2 < k && (t2 < t || j2 < j); ++j2) before += valid(t2, j2) == valid(t, j);
                }
                EXPECT_EQ(l.route_pos[static_cast<size_t>(t * k + j)], before) << "route " << t << "," << j;
            }
            for (int d = 0; d < w; ++d) {
                int before = -1;
                if (goes(t, d)) {
                    before = 0;
                    for (int t2 = 0; t2 < t; ++t2) before += goes(t2, d);
                }
                EXPECT_EQ(l.send_idx[static_cast<size_t>(t * w + d)], before) << "token " << t << " rank " << d;
                EXPECT_EQ(l.token_in_rank[static_cast<size_t>(t * w + d)], goes(t, d) ? 1 : 0);
            }
        }
        for (int d = 0; d < w; ++d) {
            int count = 0;
            for (int t = 0; t < tokens; ++t) count += goes(t, d);
            EXPECT_EQ(l.tokens_per_rank[static_cast<size_t>(d)], count);
        }
    }
}

TEST(EpReference, NormalPlanIsExpertContiguousAndStable) {
    auto rng = fresh_rng();
    for (int trial = 0; trial < 20; ++trial) {
        ref::Params p;
        p.num_ranks = 1 + static_cast<int>(rng() % 6);
        p.num_experts = p.num_ranks * (1 + static_cast<int>(rng() % 4));
        p.topk = 1 + static_cast<int>(rng() % std::min(p.num_experts, 6));
        p.expert_alignment = 1 + static_cast<int>(rng() % 8);
        std::vector<ref::Routing> all;
        for (int s = 0; s < p.num_ranks; ++s) all.push_back(messy_routing(p, static_cast<int>(rng() % 40), rng));
        const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
        for (int r = 0; r < p.num_ranks; ++r) {
            const auto& off = plan.expert_offsets[static_cast<size_t>(r)];
            const auto& rows = plan.rows[static_cast<size_t>(r)];
            for (int le = 0; le < p.local_experts(); ++le) {
                EXPECT_EQ(off[static_cast<size_t>(le)] % p.expert_alignment, 0);
                const int count = plan.expert_counts[static_cast<size_t>(r)][static_cast<size_t>(le)];
                EXPECT_GE(off[static_cast<size_t>(le) + 1] - off[static_cast<size_t>(le)], count);
                EXPECT_LT(off[static_cast<size_t>(le) + 1] - off[static_cast<size_t>(le)], count + p.expert_alignment);
                std::pair<int, int> last{-1, -1};
                for (int i = 0; i < count; ++i) {
                    const ref::RowSource src = rows[static_cast<size_t>(off[static_cast<size_t>(le)] + i)];
                    ASSERT_GE(src.src, 0);
                    EXPECT_EQ(ref::valid_expert(p, all[static_cast<size_t>(src.src)], src.token, src.slot),
                              r * p.local_experts() + le);
                    const std::pair<int, int> key{src.src, src.token};
                    EXPECT_LT(last, key) << "rows of an expert are ordered by (source, token)";
                    last = key;
                }
            }
            // Every valid route of every source has exactly one row on its owner.
            int64_t routes = 0;
            for (int s = 0; s < p.num_ranks; ++s) {
                const ref::Routing& src = all[static_cast<size_t>(s)];
                for (int t = 0; t < src.num_tokens; ++t)
                    for (int j = 0; j < p.topk; ++j) {
                        const int e = ref::valid_expert(p, src, t, j);
                        const int32_t row = plan.row_of[static_cast<size_t>(s)][static_cast<size_t>(t * p.topk + j)];
                        if (e < 0) {
                            EXPECT_EQ(row, -1);
                        } else if (p.owner(e) == r) {
                            ++routes;
                            const ref::RowSource back = plan.rows[static_cast<size_t>(r)][static_cast<size_t>(row)];
                            EXPECT_TRUE(back.src == s && back.token == t && back.slot == j);
                        }
                    }
            }
            int64_t counted = 0;
            for (int c : plan.expert_counts[static_cast<size_t>(r)]) counted += c;
            EXPECT_EQ(routes, counted);
            EXPECT_EQ(plan.source_offsets[static_cast<size_t>(r)].back(), plan.recv_tokens[static_cast<size_t>(r)]);
        }
    }
}

TEST(EpReference, Bf16RoundsToNearestEven) {
    EXPECT_EQ(ref::f32_to_bf16(1.0f), 0x3f80);
    EXPECT_EQ(ref::f32_to_bf16(-2.5f), 0xc020);
    EXPECT_EQ(ref::f32_to_bf16(1.0f + 1.0f / 256), 0x3f80);  // tie -> even (down)
    EXPECT_EQ(ref::f32_to_bf16(1.0f + 3.0f / 256), 0x3f82);  // tie -> even (up)
    EXPECT_EQ(ref::f32_to_bf16(1.0f + 1.5f / 256), 0x3f81);  // above the tie
    for (uint32_t b = 0; b < 0x10000; b += 7) {
        const uint16_t bits = static_cast<uint16_t>(b);
        const float f = ref::bf16_to_f32(bits);
        if (std::isnan(f)) continue;
        EXPECT_EQ(ref::f32_to_bf16(f), bits);
    }
}

TEST(EpReference, E4m3EncoderIsExactAndSaturating) {
    for (int c = 0; c < 256; ++c) {
        if ((c & 0x7f) == 0x7f) {
            EXPECT_TRUE(std::isnan(ref::e4m3_to_f32(static_cast<uint8_t>(c))));
            continue;
        }
        const float v = ref::e4m3_to_f32(static_cast<uint8_t>(c));
        EXPECT_EQ(ref::f32_to_e4m3(v), c) << "code " << c;
    }
    EXPECT_EQ(ref::e4m3_to_f32(0x7e), 448.0f);
    EXPECT_EQ(ref::e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
    EXPECT_EQ(ref::f32_to_e4m3(1e6f), 0x7e);
    EXPECT_EQ(ref::f32_to_e4m3(-1e6f), 0xfe);
    EXPECT_EQ(ref::f32_to_e4m3(460.0f), 0x7e);
    EXPECT_EQ(ref::f32_to_e4m3(INFINITY), 0x7e);
    EXPECT_EQ(ref::f32_to_e4m3(1.0625f), 0x38);  // 1 + 1/16: tie between 1 (0x38) and 1.125 (0x39) -> even
    EXPECT_EQ(ref::f32_to_e4m3(1.1875f), 0x3a);  // tie between 1.125 (0x39) and 1.25 (0x3a) -> even
    EXPECT_EQ(ref::f32_to_e4m3(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: tie -> 0
    EXPECT_EQ(ref::f32_to_e4m3(std::ldexp(1.5f, -10)), 0x01);
}

TEST(EpReference, Fp8QuantisationIsFiniteAndWithinTheE4m3Bound) {
    auto rng = fresh_rng();
    std::normal_distribution<float> normal(0.0f, 3.0f);
    const int h = 512;
    std::vector<uint16_t> row(h);
    for (int i = 0; i < h; ++i)
        row[static_cast<size_t>(i)] = ref::f32_to_bf16(i < 128 ? 0.0f : normal(rng));  // group 0: zeros
    std::vector<uint8_t> codes(h);
    std::vector<float> scales(h / 128);
    ref::reference_quantize_row(row.data(), h, codes.data(), scales.data());
    for (int g = 0; g < h / 128; ++g) {
        EXPECT_TRUE(std::isfinite(scales[static_cast<size_t>(g)]) && scales[static_cast<size_t>(g)] > 0);
        for (int c = g * 128; c < (g + 1) * 128; ++c) {
            const float x = ref::bf16_to_f32(row[static_cast<size_t>(c)]);
            const float d = ref::e4m3_to_f32(codes[static_cast<size_t>(c)]) * scales[static_cast<size_t>(g)];
            ASSERT_TRUE(std::isfinite(d));
            // e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal step 2^-9 of the scaled value.
            EXPECT_LE(std::fabs(d - x),
                      std::max(std::fabs(x) * 0.0625f, scales[static_cast<size_t>(g)] * 0.001f) * 1.0001f)
                << "channel " << c;
            if (g == 0) {
                EXPECT_EQ(d, 0.0f);
            }
        }
    }
}

Config small_config() {
    Config c;
    c.num_experts = 16;
    c.hidden = 256;
    c.topk = 4;
    c.max_tokens_per_rank = 64;
    return c;
}

TEST(EpConfig, ResolvesDefaultsToTheWorstCase) {
    Config c = small_config();
    c.expert_alignment = 8;
    const Geometry g = resolve_geometry(c, 4, 1);
    EXPECT_EQ(g.local_experts(), 4);
    EXPECT_EQ(g.max_recv_tokens, 4 * 64);
    EXPECT_EQ(g.max_recv_rows, 4 * 64 * 4 + 4 * 7);  // min(k, local experts) = 4, plus padding
    EXPECT_EQ(g.max_send_rows(), 64 * 4);
    EXPECT_EQ(g.meta_ints(), 12);
    EXPECT_EQ(g.ll_slot_bytes(), 512 + 16);
    c.max_recv_tokens = 100;
    c.max_recv_rows = 300;
    const Geometry g2 = resolve_geometry(c, 4, 0);
    EXPECT_EQ(g2.max_recv_tokens, 100);
    EXPECT_EQ(g2.max_recv_rows, 300);
}

void expect_error(const Config& c, int ranks, const std::string& fragment) {
    try {
        (void)resolve_geometry(c, ranks, 0);
        ADD_FAILURE() << "expected an error mentioning '" << fragment << "'";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
}

TEST(EpConfig, BadArgumentsAreNamed) {
    Config c = small_config();
    c.num_experts = 15;
    expect_error(c, 4, "multiple of the number of ranks");
    c = small_config();
    c.hidden = 100;
    expect_error(c, 4, "Config::hidden");
    c = small_config();
    c.topk = 0;
    expect_error(c, 4, "Config::topk");
    c.topk = 17;
    expect_error(c, 4, "Config::topk");
    c = small_config();
    c.max_tokens_per_rank = 0;
    expect_error(c, 4, "max_tokens_per_rank");
    c.max_tokens_per_rank = 2048;
    expect_error(c, 4, "low-latency mode supports at most");
    c.low_latency = false;
    EXPECT_NO_THROW(resolve_geometry(c, 4, 0));
    c = small_config();
    c.expert_alignment = 0;
    expect_error(c, 4, "expert_alignment");
    c = small_config();
    c.max_recv_rows = -1;
    expect_error(c, 4, "max_recv_rows");
    c.max_recv_rows = (int64_t{1} << 31) - (int64_t{1} << 24) + 1;  // fits int32, past a grouped GEMM's rows
    expect_error(c, 4, "max_recv_rows (2130706433, worst case");
    c = small_config();
    c.normal = c.low_latency = false;
    expect_error(c, 4, "neither");
    expect_error(small_config(), 65, "number of ranks");
    c = small_config();
    c.low_latency = false;
    c.max_tokens_per_rank = 1 << 24;
    c.num_experts = 128;
    c.topk = 8;
    expect_error(c, 64, "max_recv_rows (2147483648, worst case 2147483648) must be at most 2^31 - 2^24");
}

TEST(EpConfig, FootprintFollowsTheFormulas) {
    Config c;
    c.num_experts = 256;
    c.hidden = 7168;
    c.topk = 8;
    c.max_tokens_per_rank = 128;
    const Footprint f = footprint(c, 8);
    const uint64_t ll_slots = 2ull * 256 * 128 * (7168 * 2 + 16);
    const uint64_t ll_landing = 2ull * 128 * 8 * 7168 * 2;
    EXPECT_GE(f.buffer_symmetric_bytes, ll_slots + ll_landing);
    EXPECT_LT(f.buffer_symmetric_bytes, ll_slots + ll_landing + (1u << 20));
    const uint64_t rows = 32ull * 8 * 128;
    EXPECT_GE(f.low_latency_handle_device_bytes, rows * 7168 * 2 + rows * 56 * 4 + rows * 8);
    EXPECT_LT(f.low_latency_handle_device_bytes, rows * 7168 * 2 + rows * 56 * 4 + rows * 8 + 4096);
    // Normal handle: recv_x (worst case rows) + records + landing.
    const Geometry g = resolve_geometry(c, 8, 0);
    EXPECT_GE(f.normal_handle_symmetric_bytes,
              static_cast<uint64_t>(g.max_recv_rows) * 7168 * 2 + static_cast<uint64_t>(g.max_send_rows()) * 7168 * 2);
    EXPECT_GT(f.heap_bytes(2), f.buffer_symmetric_bytes + 2 * f.normal_handle_symmetric_bytes);
    EXPECT_EQ(f.total_bytes(1, 1), f.buffer_symmetric_bytes + f.buffer_device_bytes + f.normal_handle_symmetric_bytes +
                                       f.normal_handle_device_bytes + f.low_latency_handle_device_bytes);
    Config n = c;
    n.low_latency = false;
    EXPECT_EQ(footprint(n, 8).low_latency_handle_device_bytes, 0u);
    n.max_recv_rows = 1000;
    EXPECT_LT(footprint(n, 8).normal_handle_symmetric_bytes, f.normal_handle_symmetric_bytes);
}

// Prints the footprint of the benchmark shapes (the table in kernels/ep/README.md comes from here).
TEST(EpConfig, FootprintOfTheBenchmarkShapes) {
    for (int tokens : {128, 4096}) {
        Config c;
        c.num_experts = 256;
        c.hidden = 7168;
        c.topk = 8;
        c.max_tokens_per_rank = tokens;
        c.low_latency = tokens <= kMaxLowLatencyTokens;
        c.max_recv_rows = expected_recv_rows(c, 8) * 5 / 4;
        c.max_recv_tokens = expected_recv_tokens(c, 8) * 5 / 4;
        const Footprint f = footprint(c, 8);
        std::printf("[ footprint] T=%d H=7168 E=256 k=8 W=8 (max_recv_rows %lld, max_recv_tokens %lld): %s\n", tokens,
                    static_cast<long long>(c.max_recv_rows), static_cast<long long>(c.max_recv_tokens),
                    f.describe().c_str());
        c.max_recv_rows = c.max_recv_tokens = 0;
        std::printf("[ footprint] T=%d worst case: %s\n", tokens, footprint(c, 8).describe().c_str());
        EXPECT_GT(f.buffer_symmetric_bytes, 0u);
    }
}

TEST(EpConfig, ExpectedReceiveSizesMatchSampling) {
    auto rng = fresh_rng();
    Config c;
    c.num_experts = 64;
    c.hidden = 64;
    c.topk = 6;
    c.max_tokens_per_rank = 512;
    const int w = 8;
    ref::Params p{w, c.num_experts, c.topk, c.hidden, 1};
    std::vector<ref::Routing> all;
    std::vector<int> experts(static_cast<size_t>(c.num_experts));
    for (int i = 0; i < c.num_experts; ++i) experts[static_cast<size_t>(i)] = i;
    for (int s = 0; s < w; ++s) {
        ref::Routing r;
        r.num_tokens = c.max_tokens_per_rank;
        for (int t = 0; t < r.num_tokens; ++t) {
            std::shuffle(experts.begin(), experts.end(), rng);
            for (int j = 0; j < c.topk; ++j) {
                r.topk_idx.push_back(experts[static_cast<size_t>(j)]);
                r.topk_weights.push_back(1.0f);
            }
        }
        all.push_back(std::move(r));
    }
    const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
    double tokens = 0, rows = 0;
    for (int r = 0; r < w; ++r) {
        tokens += static_cast<double>(plan.recv_tokens[static_cast<size_t>(r)]) / w;
        rows += static_cast<double>(plan.recv_rows[static_cast<size_t>(r)]) / w;
    }
    EXPECT_NEAR(tokens, static_cast<double>(expected_recv_tokens(c, w)), 0.03 * tokens);
    EXPECT_NEAR(rows, static_cast<double>(expected_recv_rows(c, w)), 1e-9);
}

TEST(EpConfig, DefaultSmCounts) {
    EXPECT_EQ(default_normal_sms(0, 16), 1);
    EXPECT_EQ(default_normal_sms(64, 16), 1);
    EXPECT_EQ(default_normal_sms(65, 16), 2);
    EXPECT_EQ(default_normal_sms(4096, 132), 24);
    EXPECT_EQ(default_normal_sms(4096, 16), 16);
    EXPECT_EQ(default_low_latency_sms(128, 8, 132), 32);
    EXPECT_EQ(default_low_latency_sms(128, 8, 16), 16);
    EXPECT_EQ(default_low_latency_sms(1, 8, 16), 1);
}

// ---- the workspace: every array of every allocation ----

struct ArrayInfo {
    const char* name;
    int64_t offset;
    int64_t bytes;
};

template <class T>
ArrayInfo info(const char* name, const weft::ep::Array<T>& a) {
    return ArrayInfo{name, a.offset, a.bytes()};
}

// The arrays of each of the five allocations. The sizeof checks make a layout member this list misses fail the
// tests (every member is an Array of 16 bytes, then the allocation's size).
std::vector<ArrayInfo> arrays_of(const weft::ep::BufferSymmetricLayout& l) {
    static_assert(sizeof(l) == 5 * 16 + 8);
    return {info("signals", l.signals), info("normal_mailbox", l.normal_mailbox),
            info("ll_recv_slots", l.ll_recv_slots), info("ll_mailbox", l.ll_mailbox), info("ll_landing", l.ll_landing)};
}
std::vector<ArrayInfo> arrays_of(const weft::ep::BufferDeviceLayout& l) {
    static_assert(sizeof(l) == 2 * 16 + 8);
    return {info("normal_state", l.normal_state), info("ll_state", l.ll_state)};
}
std::vector<ArrayInfo> arrays_of(const weft::ep::NormalHandleSymmetricLayout& l) {
    static_assert(sizeof(l) == 3 * 16 + 8);
    return {info("recv_x", l.recv_x), info("recv_meta", l.recv_meta), info("landing", l.landing)};
}
std::vector<ArrayInfo> arrays_of(const weft::ep::NormalHandleDeviceLayout& l) {
    static_assert(sizeof(l) == 9 * 16 + 8);
    return {info("tokens_per_expert", l.tokens_per_expert),
            info("tokens_per_rank", l.tokens_per_rank),
            info("token_in_rank", l.token_in_rank),
            info("send_idx", l.send_idx),
            info("route_pos", l.route_pos),
            info("expert_counts", l.expert_counts),
            info("expert_offsets", l.expert_offsets),
            info("source_offsets", l.source_offsets),
            info("info", l.info)};
}
std::vector<ArrayInfo> arrays_of(const weft::ep::LowLatencyHandleDeviceLayout& l) {
    static_assert(sizeof(l) == 8 * 16 + 8);
    return {info("recv_x", l.recv_x),
            info("recv_scales", l.recv_scales),
            info("recv_src_info", l.recv_src_info),
            info("recv_src_slot", l.recv_src_slot),
            info("expert_counts", l.expert_counts),
            info("dispatch_call", l.dispatch_call),
            info("mismatch", l.mismatch),
            info("route_digest", l.route_digest)};
}

// Every array starts at a multiple of kArrayAlign, right after the previous one (rounded up), none overlaps the
// next, and the allocation's size is the end of the last one, rounded up.
void expect_packed(const std::vector<ArrayInfo>& arrays, int64_t bytes, const std::string& what) {
    int64_t at = 0;
    for (const ArrayInfo& a : arrays) {
        EXPECT_GE(a.bytes, 0) << what << "." << a.name;
        EXPECT_EQ(a.offset % weft::ep::kArrayAlign, 0) << what << "." << a.name << " at " << a.offset;
        EXPECT_EQ(a.offset, at) << what << "." << a.name << " does not follow the previous array (gap or overlap)";
        at = round_up(a.offset + a.bytes, weft::ep::kArrayAlign);
    }
    EXPECT_EQ(bytes, at) << what << ": the allocation's size";
}

void expect_workspace_packed(const Workspace& ws, const std::string& what) {
    expect_packed(arrays_of(ws.buffer_symmetric), ws.buffer_symmetric.bytes, what + " buffer_symmetric");
    expect_packed(arrays_of(ws.buffer_device), ws.buffer_device.bytes, what + " buffer_device");
    expect_packed(arrays_of(ws.normal_handle_symmetric), ws.normal_handle_symmetric.bytes,
                  what + " normal_handle_symmetric");
    expect_packed(arrays_of(ws.normal_handle_device), ws.normal_handle_device.bytes, what + " normal_handle_device");
    expect_packed(arrays_of(ws.low_latency_handle_device), ws.low_latency_handle_device.bytes,
                  what + " low_latency_handle_device");
}

// A view is a struct of pointers only: its words, in declaration order.
template <class View>
std::vector<uintptr_t> words_of(const View& v) {
    static_assert(std::is_trivially_copyable_v<View> && sizeof(View) % sizeof(void*) == 0);
    std::vector<uintptr_t> w(sizeof(View) / sizeof(void*));
    std::memcpy(w.data(), &v, sizeof(View));
    return w;
}

// One allocation of a view: where it is mapped in the two views compared, and its size.
struct Mapping {
    uintptr_t base_a;
    uintptr_t base_b;
    int64_t bytes;
};

// Built from two sets of bases (this rank's, a peer's), every pointer of the view lies inside one of its
// allocations in both, at the same offset from that allocation's base, 8-byte aligned, and no two pointers
// coincide: no field is left unset, rebased against the wrong base, or aliased with another.
template <class View>
void expect_same_offsets(const View& a, const View& b, const std::vector<Mapping>& maps, const std::string& what) {
    const std::vector<uintptr_t> wa = words_of(a);
    const std::vector<uintptr_t> wb = words_of(b);
    std::set<uintptr_t> seen;
    for (size_t i = 0; i < wa.size(); ++i) {
        int found = -1;
        for (size_t m = 0; m < maps.size(); ++m) {
            if (wa[i] >= maps[m].base_a && wa[i] < maps[m].base_a + static_cast<uintptr_t>(maps[m].bytes)) {
                found = static_cast<int>(m);
            }
        }
        ASSERT_GE(found, 0) << what << " field " << i << " (0x" << std::hex << wa[i]
                            << ") is in none of its allocations";
        const Mapping& m = maps[static_cast<size_t>(found)];
        EXPECT_EQ(wa[i] - m.base_a, wb[i] - m.base_b)
            << what << " field " << i << ": another offset from a peer's base";
        EXPECT_EQ(wa[i] % 8, 0u) << what << " field " << i;
        EXPECT_TRUE(seen.insert(wa[i]).second) << what << " field " << i << " points where another field does";
    }
}

Geometry geometry_for(int ranks, int experts, int hidden, int topk, int tokens, bool normal, bool low_latency,
                      int alignment = 1) {
    Config c;
    c.num_experts = experts;
    c.hidden = hidden;
    c.topk = topk;
    c.max_tokens_per_rank = tokens;
    c.normal = normal;
    c.low_latency = low_latency;
    c.expert_alignment = alignment;
    return resolve_geometry(c, ranks, ranks - 1);
}

TEST(EpWorkspace, ArraysAreAlignedPackedAndSizedFromTheGeometry) {
    auto rng = fresh_rng();
    for (int trial = 0; trial < 200; ++trial) {
        const int ranks = 1 + static_cast<int>(rng() % 16);
        const int experts = ranks * (1 + static_cast<int>(rng() % 8));
        const int topk = 1 + static_cast<int>(rng() % std::min(experts, 9));
        const int hidden = 128 * (1 + static_cast<int>(rng() % 8)) + (trial % 2 == 0 ? 0 : 8);
        const int tokens = 1 + static_cast<int>(rng() % 300);
        const int modes = 1 + trial % 3;  // normal, low-latency, both
        const Geometry g = geometry_for(ranks, experts, hidden, topk, tokens, modes & 1, (modes & 2) != 0,
                                        1 + static_cast<int>(rng() % 64));
        const Workspace ws = Workspace::make(g);
        const std::string what = "W " + std::to_string(ranks) + " E " + std::to_string(experts) + " k " +
                                 std::to_string(topk) + " H " + std::to_string(hidden) + " T " +
                                 std::to_string(tokens) + " modes " + std::to_string(modes);
        expect_workspace_packed(ws, what);
        // Sizes from the geometry, and nothing for a mode the Buffer does not serve.
        const int64_t w = ranks, t = tokens, h = hidden, k = topk, el = g.local_experts();
        const int64_t n = g.normal() ? 1 : 0, l = g.low_latency() ? 1 : 0;
        EXPECT_EQ(ws.buffer_symmetric.signals.count, weft::ep::kNumSignalArrays * w) << what;
        EXPECT_EQ(ws.buffer_symmetric.normal_mailbox.count, n * 2 * w * (experts + w + 1)) << what;
        EXPECT_EQ(ws.buffer_symmetric.ll_recv_slots.bytes(), l * 2 * el * w * t * (2 * h + 16)) << what;
        EXPECT_EQ(ws.buffer_symmetric.ll_mailbox.count, l * 2 * w * el) << what;
        EXPECT_EQ(ws.buffer_symmetric.ll_landing.bytes(), l * 2 * t * k * h * 2) << what;
        EXPECT_EQ(ws.buffer_device.normal_state.count, n) << what;
        EXPECT_EQ(ws.buffer_device.ll_state.count, l) << what;
        EXPECT_EQ(ws.normal_handle_symmetric.recv_x.bytes(), n * g.max_recv_rows * h * 2) << what;
        EXPECT_EQ(ws.normal_handle_symmetric.recv_meta.count, n * g.max_recv_tokens * g.meta_ints()) << what;
        EXPECT_EQ(ws.normal_handle_symmetric.landing.bytes(), n * t * std::min(k, w) * h * 2) << what;
        EXPECT_EQ(ws.normal_handle_device.token_in_rank.bytes(), n * t * w) << what;
        EXPECT_EQ(ws.normal_handle_device.send_idx.count, n * t * w) << what;
        EXPECT_EQ(ws.normal_handle_device.route_pos.count, n * t * k) << what;
        EXPECT_EQ(ws.normal_handle_device.expert_offsets.count, n * (el + 1)) << what;
        EXPECT_EQ(ws.normal_handle_device.source_offsets.count, n * (w + 1)) << what;
        EXPECT_EQ(ws.normal_handle_device.info.count, n * kInfoInts) << what;
        const int64_t rows = l * el * w * t;
        EXPECT_EQ(ws.low_latency_handle_device.recv_x.bytes(), rows * h * 2) << what;
        EXPECT_EQ(ws.low_latency_handle_device.recv_scales.count, rows * (h / 128)) << what;
        EXPECT_EQ(ws.low_latency_handle_device.recv_src_slot.count, rows) << what;
        EXPECT_EQ(ws.low_latency_handle_device.expert_counts.count, l * el) << what;
        EXPECT_EQ(ws.low_latency_handle_device.mismatch.count, l) << what;
        if (!g.normal()) {
            EXPECT_EQ(ws.normal_handle_symmetric.bytes, 0) << what;
            EXPECT_EQ(ws.normal_handle_device.bytes, 0) << what;
        }
        if (!g.low_latency()) {
            EXPECT_EQ(ws.low_latency_handle_device.bytes, 0) << what;
        }
    }
}

// Workspace::make is constexpr: the layout can be computed (and checked) at compile time, as on the device.
TEST(EpWorkspace, IsComputedAtCompileTime) {
    constexpr Geometry g{.num_ranks = 8,
                         .rank = 3,
                         .num_experts = 256,
                         .hidden = 7168,
                         .topk = 8,
                         .max_tokens = 128,
                         .expert_alignment = 1,
                         .modes = weft::ep::kNormalMode | weft::ep::kLowLatencyMode,
                         .max_recv_tokens = 1024,
                         .max_recv_rows = 8192};
    constexpr Workspace ws = Workspace::make(g);
    static_assert(ws.buffer_symmetric.signals.offset == 0);
    static_assert(ws.buffer_symmetric.normal_mailbox.offset == 768);  // 11 x 8 signal words, rounded up to 256
    static_assert(ws.buffer_symmetric.ll_recv_slots.bytes() == 2ll * 32 * 8 * 128 * (2 * 7168 + 16));
    static_assert(ws.normal_handle_symmetric.recv_meta.offset == 8192ll * 7168 * 2);
    EXPECT_EQ(ws.buffer_symmetric.bytes, Workspace::make(g).buffer_symmetric.bytes);
}

// The footprint is the five allocations' sizes, and the benchmark shape's low-latency areas are what the README says.
TEST(EpWorkspace, FootprintIsTheWorkspace) {
    for (const bool normal : {false, true}) {
        for (const bool ll : {false, true}) {
            if (!normal && !ll) continue;
            Config c;
            c.num_experts = 256;
            c.hidden = 7168;
            c.topk = 8;
            c.max_tokens_per_rank = 128;
            c.normal = normal;
            c.low_latency = ll;
            const Footprint f = footprint(c, 8);
            const Workspace ws = Workspace::make(resolve_geometry(c, 8, 0));
            EXPECT_EQ(f.buffer_symmetric_bytes, static_cast<uint64_t>(ws.buffer_symmetric.bytes));
            EXPECT_EQ(f.buffer_device_bytes, static_cast<uint64_t>(ws.buffer_device.bytes));
            EXPECT_EQ(f.normal_handle_symmetric_bytes, static_cast<uint64_t>(ws.normal_handle_symmetric.bytes));
            EXPECT_EQ(f.normal_handle_device_bytes, static_cast<uint64_t>(ws.normal_handle_device.bytes));
            EXPECT_EQ(f.low_latency_handle_device_bytes, static_cast<uint64_t>(ws.low_latency_handle_device.bytes));
        }
    }
}

TEST(EpWorkspace, ViewsOfAPeerBaseHaveTheSameOffsets) {
    auto rng = fresh_rng();
    for (int trial = 0; trial < 50; ++trial) {
        const int ranks = 1 + static_cast<int>(rng() % 16);
        const int experts = ranks * (1 + static_cast<int>(rng() % 8));
        const int topk = 1 + static_cast<int>(rng() % std::min(experts, 4));
        const Geometry g =
            geometry_for(ranks, experts, 256 + 128 * (trial % 4), topk, 1 + static_cast<int>(rng() % 200), true, true);
        const Workspace ws = Workspace::make(g);
        // This rank's bases and a peer's mapping of the symmetric ones: far apart, 256-byte aligned, never
        // dereferenced.
        const uintptr_t sym_a = 0x100000000ull + (rng() % 1024) * 256;
        const uintptr_t dev_a = 0x900000000000ull + (rng() % 1024) * 256;
        const uintptr_t sym_b = 0x500000000000ull + (rng() % 1024) * 256;
        const uintptr_t dev_b = 0xd00000000000ull + (rng() % 1024) * 256;
        const auto p = [](uintptr_t v) { return reinterpret_cast<uint8_t*>(v); };
        const std::string what = "trial " + std::to_string(trial);
        expect_same_offsets(ws.normal_buffer(p(sym_a), p(dev_a)), ws.normal_buffer(p(sym_b), p(dev_b)),
                            {{sym_a, sym_b, ws.buffer_symmetric.bytes}, {dev_a, dev_b, ws.buffer_device.bytes}},
                            what + " NormalBufferView");
        expect_same_offsets(ws.low_latency_buffer(p(sym_a), p(dev_a)), ws.low_latency_buffer(p(sym_b), p(dev_b)),
                            {{sym_a, sym_b, ws.buffer_symmetric.bytes}, {dev_a, dev_b, ws.buffer_device.bytes}},
                            what + " LowLatencyBufferView");
        expect_same_offsets(
            ws.normal_handle(p(sym_a), p(dev_a)), ws.normal_handle(p(sym_b), p(dev_b)),
            {{sym_a, sym_b, ws.normal_handle_symmetric.bytes}, {dev_a, dev_b, ws.normal_handle_device.bytes}},
            what + " NormalHandleView");
        expect_same_offsets(ws.low_latency_handle(p(dev_a)), ws.low_latency_handle(p(dev_b)),
                            {{dev_a, dev_b, ws.low_latency_handle_device.bytes}}, what + " LowLatencyHandleView");
        // The signal arrays: [W] words each, in SignalArray order, inside `signals`.
        const auto nb = ws.normal_buffer(p(sym_a), p(dev_a));
        const auto lb = ws.low_latency_buffer(p(sym_a), p(dev_a));
        const uint64_t* signals = ws.buffer_symmetric.signals.at(p(sym_a));
        const uint64_t* in_order[] = {nb.count_signal,    nb.data_signal,     nb.partial_signal,      nb.combine_done,
                                      lb.dispatch_signal, lb.dispatch_credit, lb.combine_signal,      lb.combine_credit,
                                      nb.combine_handle,  lb.combine_call,    lb.combine_call + ranks};
        static_assert(std::size(in_order) == weft::ep::kNumSignalArrays);
        for (int i = 0; i < weft::ep::kNumSignalArrays; ++i) {
            EXPECT_EQ(in_order[i], signals + static_cast<int64_t>(i) * ranks) << what << " signal array " << i;
        }
        // The views point at the layout's arrays, each exactly once (the Buffer's two views share its allocations;
        // `signals` is pointed at through its SignalArray slices).
        std::multiset<uintptr_t> buffer_arrays, buffer_fields;
        for (const ArrayInfo& a : arrays_of(ws.buffer_symmetric)) {
            if (std::string(a.name) == "signals") continue;
            buffer_arrays.insert(sym_a + static_cast<uintptr_t>(a.offset));
        }
        for (const uint64_t* slice : in_order) {
            // combine_call's odd half is reached through the view's [2][W] indexing, not a field of its own.
            if (slice != lb.combine_call + ranks) buffer_arrays.insert(reinterpret_cast<uintptr_t>(slice));
        }
        for (const ArrayInfo& a : arrays_of(ws.buffer_device)) buffer_arrays.insert(dev_a + a.offset);
        for (uintptr_t f : words_of(nb)) buffer_fields.insert(f);
        for (uintptr_t f : words_of(lb)) buffer_fields.insert(f);
        EXPECT_EQ(buffer_fields, buffer_arrays) << what << ": the Buffer's views and arrays";
        std::multiset<uintptr_t> normal_arrays, normal_fields;
        for (const ArrayInfo& a : arrays_of(ws.normal_handle_symmetric)) normal_arrays.insert(sym_a + a.offset);
        for (const ArrayInfo& a : arrays_of(ws.normal_handle_device)) normal_arrays.insert(dev_a + a.offset);
        for (uintptr_t f : words_of(ws.normal_handle(p(sym_a), p(dev_a)))) normal_fields.insert(f);
        EXPECT_EQ(normal_fields, normal_arrays) << what << ": NormalHandleView and its arrays";
        std::multiset<uintptr_t> ll_arrays, ll_fields;
        for (const ArrayInfo& a : arrays_of(ws.low_latency_handle_device)) ll_arrays.insert(dev_a + a.offset);
        for (uintptr_t f : words_of(ws.low_latency_handle(p(dev_a)))) ll_fields.insert(f);
        EXPECT_EQ(ll_fields, ll_arrays) << what << ": LowLatencyHandleView and its arrays";
    }
}

TEST(EpStatus, MessagesNameTheRankTheLimitAndTheValue) {
    Status s{};
    s.claimed = 2;
    s.code = StatusCode::kRecvRowsOverflow;
    s.rank = 3;
    s.culprit_rank = 5;
    s.value = 9000;
    s.limit = 8192;
    s.call = 7;
    s.kernel = static_cast<uint32_t>(KernelId::kNormalDispatch);
    const std::string m = describe_status(s);
    for (const char* frag : {"rank 3", "rank 5", "9000", "8192", "max_recv_rows", "call 7", "normal dispatch"}) {
        EXPECT_NE(m.find(frag), std::string::npos) << frag << " missing from: " << m;
    }
    s.code = StatusCode::kInvalidExpert;
    s.value = 300;
    s.limit = 256;
    s.token = 11;
    s.slot = 2;
    const std::string m2 = describe_status(s);
    EXPECT_NE(m2.find("topk_idx[11][2]"), std::string::npos) << m2;
    EXPECT_NE(m2.find("300"), std::string::npos) << m2;
}

// The low-latency mailbox word: a count and the sender's call signature, read back apart; the signature tells fp8 from
// bf16 and one geometry from another, and never looks like a zeroed word.
TEST(EpLowLatencyMailbox, WordsCarryTheCountAndTheCallSignature) {
    using weft::ep::ll_call_signature;
    using weft::ep::ll_mailbox_count;
    using weft::ep::ll_mailbox_signature;
    using weft::ep::ll_mailbox_word;
    using weft::ep::ll_signature_digest;
    using weft::ep::ll_signature_fp8;
    const Geometry g = geometry_for(8, 256, 7168, 8, 128, false, true);
    for (bool fp8 : {false, true}) {
        const uint32_t sig = ll_call_signature(g, fp8);
        EXPECT_EQ(ll_mailbox_count(sig), 0) << "a signature has no count bits";
        EXPECT_EQ(ll_signature_fp8(sig), fp8);
        EXPECT_NE(ll_signature_digest(sig), 0u);
        EXPECT_NE(ll_mailbox_signature(ll_mailbox_word(sig, 0)), ll_mailbox_signature(0u)) << "a zeroed word matches";
        for (int count : {0, 1, 2, 127, 128, 1000, kMaxLowLatencyTokens}) {
            const uint32_t w = ll_mailbox_word(sig, count);
            EXPECT_EQ(ll_mailbox_count(w), count) << "fp8 " << fp8;
            EXPECT_EQ(ll_mailbox_signature(w), sig) << "fp8 " << fp8 << " count " << count;
        }
    }
    // fp8 against bf16: same digest, other signature.
    EXPECT_NE(ll_call_signature(g, true), ll_call_signature(g, false));
    EXPECT_EQ(ll_signature_digest(ll_call_signature(g, true)), ll_signature_digest(ll_call_signature(g, false)));
    // The same Config gives every rank the same signature (the rank is not in it).
    Config c;
    c.num_experts = 256;
    c.hidden = 7168;
    c.topk = 8;
    c.max_tokens_per_rank = 128;
    c.normal = false;
    for (int r = 0; r < 8; ++r) {
        EXPECT_EQ(ll_call_signature(resolve_geometry(c, 8, r), true), ll_call_signature(g, true)) << "rank " << r;
    }
    // Each geometry field changes the digest.
    const Geometry others[] = {
        geometry_for(8, 256, 4096, 8, 128, false, true), geometry_for(8, 128, 7168, 8, 128, false, true),
        geometry_for(8, 256, 7168, 6, 128, false, true), geometry_for(8, 256, 7168, 8, 256, false, true),
        geometry_for(4, 256, 7168, 8, 128, false, true)};
    for (const Geometry& o : others) {
        EXPECT_NE(ll_signature_digest(ll_call_signature(o, true)), ll_signature_digest(ll_call_signature(g, true)))
            << "hidden " << o.hidden << " experts " << o.num_experts << " topk " << o.topk << " tokens " << o.max_tokens
            << " ranks " << o.num_ranks;
    }
    // Computed alike at compile time (as on the device).
    constexpr Geometry kSmall{.num_ranks = 2,
                              .rank = 0,
                              .num_experts = 8,
                              .hidden = 256,
                              .topk = 2,
                              .max_tokens = 64,
                              .expert_alignment = 1,
                              .modes = weft::ep::kLowLatencyMode,
                              .max_recv_tokens = 0,
                              .max_recv_rows = 0};
    static_assert(ll_mailbox_count(ll_mailbox_word(ll_call_signature(kSmall, true), 1024)) == 1024);
    static_assert(ll_signature_fp8(ll_mailbox_signature(ll_mailbox_word(ll_call_signature(kSmall, true), 7))));
}

TEST(EpStatus, ACombineGivenAnotherRoutingNamesTheTokenAndWhatToPass) {
    Status s{};
    s.claimed = 2;
    s.code = StatusCode::kCombineRoutingMismatch;
    s.rank = 3;
    s.culprit_rank = 3;
    s.value = 0x1234abcd;
    s.limit = 0xfedc0042;
    s.token = 17;
    s.slot = -1;
    s.call = 2;
    s.kernel = static_cast<uint32_t>(KernelId::kLowLatencyCombine);
    const std::string m = describe_status(s);
    for (const char* frag : {"rank 3", "low-latency combine call 2", "another topk_idx row for token 17", "0x1234abcd",
                             "0xfedc0042", "written as zeros", "topk_idx its dispatch was given"}) {
        EXPECT_NE(m.find(frag), std::string::npos) << frag << " missing from: " << m;
    }
}

TEST(EpStatus, ACallMismatchNamesBothRanksAndWhatDiffered) {
    const Geometry g = geometry_for(2, 8, 384, 2, 40, false, true);
    Status s{};
    s.claimed = 2;
    s.code = StatusCode::kCallMismatch;
    s.rank = 1;
    s.culprit_rank = 0;
    s.value = weft::ep::ll_call_signature(g, false);
    s.limit = weft::ep::ll_call_signature(g, true);
    s.call = 4;
    s.kernel = static_cast<uint32_t>(KernelId::kLowLatencyDispatch);
    const std::string m = describe_status(s);
    for (const char* frag : {"rank 1", "low-latency dispatch call 4", "differs from rank 0's",
                             "rank 1 called it with bf16", "rank 0 with fp8", "nothing was received"}) {
        EXPECT_NE(m.find(frag), std::string::npos) << frag << " missing from: " << m;
    }
    EXPECT_EQ(m.find("geometries differ"), std::string::npos) << m;
    s.limit = weft::ep::ll_call_signature(geometry_for(2, 8, 512, 2, 40, false, true), false);
    const std::string m2 = describe_status(s);
    EXPECT_NE(m2.find("rank 0 with bf16"), std::string::npos) << m2;
    EXPECT_NE(m2.find("geometries differ"), std::string::npos) << m2;
}

// Ranks that combine their normal handles in different orders: the combine names both handles and the order rule.
TEST(EpStatus, ANormalCombineOnAnotherHandleThanItsPeersNamesBoth) {
    Status s{};
    s.claimed = 2;
    s.code = StatusCode::kCallMismatch;
    s.rank = 1;
    s.culprit_rank = 0;
    s.value = 1;
    s.limit = 0;
    s.call = 3;
    s.kernel = static_cast<uint32_t>(KernelId::kNormalCombine);
    const std::string m = describe_status(s);
    for (const char* frag : {"combine call 3 on rank 1 combined normal handle #1",
                             "rank 0's partials came from its "
                             "combine on handle #0",
                             "out of that call is zeros", "in the same order on every rank"}) {
        EXPECT_NE(m.find(frag), std::string::npos) << frag << " missing from: " << m;
    }
}

// Ranks that combine their low-latency dispatches in different orders: the combine names both dispatch calls and the
// order rule.
TEST(EpStatus, ALowLatencyCombineOfAnotherDispatchThanItsPeersNamesBoth) {
    Status s{};
    s.claimed = 2;
    s.code = StatusCode::kCallMismatch;
    s.rank = 0;
    s.culprit_rank = 1;
    s.value = 4;
    s.limit = 5;
    s.call = 7;
    s.kernel = static_cast<uint32_t>(KernelId::kLowLatencyCombine);
    const std::string m = describe_status(s);
    for (const char* frag :
         {"low-latency combine call 7 on rank 0 combined the rows of its low-latency dispatch call 4",
          "rank 1 sent back rows of dispatch call 5", "in different orders", "out of that call is zeros",
          "the same on every rank"}) {
        EXPECT_NE(m.find(frag), std::string::npos) << frag << " missing from: " << m;
    }
}

// The EP kernels, as the op launches them, compile for sm_90a without spills and within the register
// budget of a 512-thread block; plus the test-only delay kernel.
TEST(EpNvrtc, KernelSpecsCompileForSm90a) {
    weft::testing::TempDir cache("weft_ep_cache");
    jit::Compiler compiler(weft::testing::isolated_compiler_config(cache.path()));
    std::vector<jit::KernelSpec> specs = kernel_specs();
    jit::KernelSpec delay;
    delay.header = "ep/testing.cuh";
    delay.instantiation = "weft::kernels::ep::delay";
    specs.push_back(delay);
    for (jit::KernelSpec s : specs) {
        s.arch = "sm_90a";
        const jit::CompileResult r = compiler.compile(s);
        ASSERT_TRUE(r.cubin && !r.cubin->empty()) << s.describe();
        EXPECT_GT(r.ptxas_info.registers, 0) << s.describe() << "\n" << r.log;
        EXPECT_LE(r.ptxas_info.registers, 128) << s.describe() << ": 512 threads per block need <= 128 registers";
        EXPECT_EQ(r.ptxas_info.spill_store_bytes, 0) << s.describe() << "\n" << r.ptxas_info.text;
    }
}

// The combines' reductions (normal: the partial sums over a received token's local rows and the sum of a
// token's partials; low latency: the weighted sum over a token's slots) load two rows' chunks, each lane's
// .unroll 16-byte granules of each, before accumulating the first: in SASS, every reduction loop must keep
// 2 x unroll loads in flight together. A conversion right after each load makes ptxas wait for them one by one
// (one load in flight: docs/performance_archive.md, "MoE expert parallelism").
TEST(EpNvrtc, CombineReductionsKeepTheirRowLoadsInFlight) {
    struct Want {
        const char* kernel;
        int reductions;  // reduction loops in the kernel
    };
    const Want wants[] = {{"ep::normal_combine", 2}, {"ep::low_latency_combine", 1}};
    weft::testing::TempDir cache("weft_ep_sass_cache");
    jit::Compiler compiler(weft::testing::isolated_compiler_config(cache.path()));
    const std::regex unroll_field(R"(\.unroll = (\d+))");
    int checked = 0;
    for (jit::KernelSpec s : kernel_specs()) {
        const Want* want = nullptr;
        for (const Want& w : wants) {
            if (s.describe() == w.kernel) want = &w;
        }
        if (want == nullptr) continue;
        s.arch = "sm_90a";
        const jit::CompileResult r = compiler.compile(s);
        ASSERT_TRUE(r.cubin && !r.cubin->empty()) << s.describe() << "\n" << r.log;
        weft::testing::expect_clean_ptxas_report(r.log, s.describe());
        std::smatch m;
        ASSERT_TRUE(std::regex_search(s.instantiation, m, unroll_field)) << s.instantiation;
        const int unroll = std::stoi(m[1].str());
        std::string tool, why_not;
        const auto sass = weft::testing::disassemble(*r.cubin, &tool, &why_not);
        if (sass.empty()) GTEST_SKIP() << "SKIPPED: cannot check SASS: " << why_not;
        const auto fn = sass.find(r.lowered_name);
        ASSERT_NE(fn, sass.end()) << "no SASS for " << s.describe() << " (" << r.lowered_name << ", tool " << tool
                                  << ")";
        const std::vector<int> runs = weft::testing::loads_in_flight(fn->second, weft::testing::LoadUse::kComputed);
        const int most = runs.empty() ? 0 : *std::max_element(runs.begin(), runs.end());
        // A group of n loads in flight together shows as runs n, n - 1, ..., 1: count the groups' heads.
        const auto groups = std::count_if(runs.begin(), runs.end(), [&](int n) { return n >= 2 * unroll; });
        std::printf("[ SASS     ] %s: at most %d 16-byte row loads in flight together in its reductions; %d group(s) "
                    "of >= %d (unroll %d)\n",
                    s.describe().c_str(), most, static_cast<int>(groups), 2 * unroll, unroll);
        EXPECT_GE(most, 2 * unroll) << s.describe() << ": the reductions' row loads wait for each other";
        EXPECT_GE(groups, want->reductions)
            << s.describe() << ": a reduction loop keeps fewer than 2 x unroll row loads in flight";
        ++checked;
    }
    EXPECT_EQ(checked, 2) << "kernel_specs() no longer names ep::normal_combine and ep::low_latency_combine";
}

// weft/ptx/cvt.cuh emits the conversion instructions it promises (checked in the PTX).
TEST(EpNvrtc, CvtWrappersEmitThePromisedPtx) {
    weft::testing::TempDir cache("weft_cvt_cache");
    jit::Compiler compiler(weft::testing::isolated_compiler_config(cache.path()));
    jit::KernelSpec s;
    s.header = "weft/ptx/cvt.cuh";
    s.extra_code =
        "extern \"C\" __global__ void cvt_probe(const float* in, unsigned* out) {\n"
        "    const unsigned short f8 = weft::ptx::cvt_rn_satfinite_e4m3x2(in[0], in[1]);\n"
        "    out[0] = weft::ptx::cvt_rn_bf16x2(in[2], in[3]);\n"
        "    out[1] = f8;\n"
        "    out[2] = weft::ptx::cvt_rn_f16x2_e4m3x2(f8);\n"
        "    out[3] = __float_as_uint(weft::ptx::bf16_bits_to_f32(static_cast<unsigned short>(out[0])));\n"
        "}\n";
    s.instantiation = "cvt_probe";
    s.arch = "sm_90a";
    const jit::CompileResult r = compiler.compile(s);
    ASSERT_FALSE(r.ptx.empty()) << r.log;
    for (const char* insn : {"cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.bf16x2.f32", "cvt.rn.f16x2.e4m3x2"}) {
        EXPECT_NE(r.ptx.find(insn), std::string::npos) << insn << " missing from the PTX";
    }
}

// weft-compile --builtin sees the EP kernels (through weft::ops::register_op_aot_specs).
TEST(EpNvrtc, KernelsAreInTheAotRegistry) {
    weft::ops::register_op_aot_specs();
    const std::vector<jit::KernelSpec> registered = jit::aot_specs();
    for (const jit::KernelSpec& s : kernel_specs()) {
        const bool found = std::any_of(registered.begin(), registered.end(), [&](const jit::KernelSpec& r) {
            return r.header == s.header && r.instantiation == s.instantiation;
        });
        EXPECT_TRUE(found) << s.instantiation << " is not in weft::jit::aot_specs()";
    }
}

// kernels/ep/aot_specs.txt (for weft-compile --specs) lists exactly kernel_specs().
TEST(EpNvrtc, AotSpecFileMatchesTheOps) {
    const fs::path file = fs::path(__FILE__).parent_path().parent_path().parent_path() / "kernels/ep/aot_specs.txt";
    std::ifstream in(file);
    ASSERT_TRUE(in.good()) << file;
    std::stringstream text;
    text << in.rdbuf();
    std::set<std::pair<std::string, std::string>> listed;
    std::string line;
    while (std::getline(text, line)) {
        if (line.empty() || line[0] == '#') continue;
        const size_t bar = line.find('|');
        ASSERT_NE(bar, std::string::npos) << line;
        listed.insert({line.substr(0, bar), line.substr(bar + 1)});
    }
    std::set<std::pair<std::string, std::string>> wanted;
    for (const jit::KernelSpec& s : kernel_specs()) wanted.insert({s.header, s.instantiation});
    EXPECT_EQ(listed, wanted);
}

}  // namespace
}  // namespace weft::ops::ep
