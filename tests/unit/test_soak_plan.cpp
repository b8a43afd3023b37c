// SPDX-License-Identifier: MIT
// weft_soak's plan generator (bench/soak/soak_plan.hpp), on the CPU: a seed and a call give one plan, whatever was
// drawn before; every plan stays within the sizes its buffers were made for; the descriptions' format; the EP normal
// ledger (rows per destination rank) and its replay of a recorded hang.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "soak/soak_plan.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/runtime/error.hpp"

namespace weft::bench::soak {
namespace {

constexpr uint64_t kSeeds[] = {0, 1, 123, 0xdeadbeef, 1764680000123456789ull};
constexpr int kWorlds[] = {2, 3, 5, 8, 16, 64};  // the command line allows 2..64

void expect_same(const Plan& a, const Plan& b, const std::string& where) {
    EXPECT_EQ(a.kind, b.kind) << where;
    EXPECT_EQ(a.algo, b.algo) << where;
    EXPECT_EQ(a.dtype, b.dtype) << where;
    EXPECT_EQ(a.count, b.count) << where;
    EXPECT_EQ(a.in_sym, b.in_sym) << where;
    EXPECT_EQ(a.out_sym, b.out_sym) << where;
    EXPECT_EQ(a.in_place, b.in_place) << where;
    EXPECT_EQ(a.tokens, b.tokens) << where;
    EXPECT_EQ(a.salt, b.salt) << where;
    EXPECT_EQ(describe(a), describe(b)) << where;
}

TEST(SoakPlan, SameSeedAndCallGiveTheSamePlanInAnyOrder) {
    for (uint64_t seed : kSeeds) {
        for (int w : kWorlds) {
            constexpr uint64_t kCalls = 500;
            std::vector<Plan> forward;
            for (uint64_t c = 0; c < kCalls; ++c) forward.push_back(draw_plan(seed, c, w));
            for (uint64_t c = kCalls; c-- > 0;) {
                expect_same(
                    draw_plan(seed, c, w), forward[c],
                    "seed " + std::to_string(seed) + " world " + std::to_string(w) + " call " + std::to_string(c));
            }
            for (int k = 0; k < kKinds; ++k) {
                const auto kind = static_cast<Kind>(k);
                expect_same(draw_plan(seed, ~static_cast<uint64_t>(k), w, kind),
                            draw_plan(seed, ~static_cast<uint64_t>(k), w, kind), kKindNames[k]);
            }
        }
    }
}

TEST(SoakPlan, SeedsAndCallsGiveDifferentInputs) {
    int same_salt = 0;
    for (uint64_t c = 0; c < 1000; ++c) {
        const Plan p = draw_plan(123, c, 4);
        same_salt += (p.salt == draw_plan(124, c, 4).salt) + (p.salt == draw_plan(123, c + 1, 4).salt);
    }
    EXPECT_EQ(same_salt, 0);
}

TEST(SoakPlan, ForcedKindIsDrawn) {
    for (int w : kWorlds) {
        for (int k = 0; k < kKinds; ++k) {
            EXPECT_EQ(draw_plan(7, ~static_cast<uint64_t>(k), w, static_cast<Kind>(k)).kind, static_cast<Kind>(k));
        }
    }
}

/// Checks p against the bounds soak_plan.hpp documents for a World of w ranks.
void expect_within_bounds(const Plan& p, int w, const std::string& where) {
    const auto ranks = static_cast<uint64_t>(w);
    const uint64_t per_rank_cap = kBufferBytes / ranks;
    const uint64_t elem = static_cast<uint64_t>(dtype_bytes(p.dtype));
    const bool reducing_dtype = p.dtype == DType::kBF16 || p.dtype == DType::kF16 || p.dtype == DType::kF32;
    switch (p.kind) {
        case Kind::kAllReduce:
            EXPECT_TRUE(p.algo >= 1 && p.algo <= 3) << where;
            EXPECT_TRUE(reducing_dtype) << where;
            EXPECT_GE(p.count, 1u) << where;
            EXPECT_LE(p.count * elem, (4ull << 20) + elem) << where;
            EXPECT_LE(p.count * elem, kBufferBytes) << where;
            break;
        case Kind::kAllGather:
            EXPECT_TRUE(p.algo >= 1 && p.algo <= 4) << where;
            EXPECT_GE(p.count, 1u) << where;
            EXPECT_LE(p.count, std::min<uint64_t>(2ull << 20, per_rank_cap)) << where;
            EXPECT_LE(p.count * ranks, kBufferBytes) << where;
            if (p.algo == static_cast<int>(ops::AllGatherAlgo::kSmPush) ||
                p.algo == static_cast<int>(ops::AllGatherAlgo::kCopyEnginePush)) {
                EXPECT_TRUE(p.out_sym) << where << ": a push all-gather needs a symmetric output";
            }
            break;
        case Kind::kReduceScatter:
            EXPECT_TRUE(p.algo >= 1 && p.algo <= 2) << where;
            EXPECT_TRUE(reducing_dtype) << where;
            EXPECT_GE(p.count, 1u) << where;
            EXPECT_LE(p.count * elem, std::min<uint64_t>(2ull << 20, per_rank_cap - 64) + elem) << where;
            EXPECT_LE(p.count * elem * ranks, kBufferBytes) << where;
            break;
        case Kind::kAllToAll:
            EXPECT_EQ(p.algo, 0) << where;
            EXPECT_GE(p.count, 1u) << where;
            EXPECT_LE(p.count, std::min<uint64_t>(1ull << 20, per_rank_cap)) << where;
            EXPECT_LE(p.count * ranks, kBufferBytes) << where;
            EXPECT_FALSE(p.in_place) << where;
            break;
        case Kind::kAgGemm:
        case Kind::kGemmRs:
            EXPECT_EQ(p.count % ranks, 0u) << where;
            EXPECT_GE(p.count / ranks, 1u) << where;
            EXPECT_LE(p.count / ranks, static_cast<uint64_t>(kGemmRowsPerRank)) << where;
            break;
        case Kind::kGemmAr:
            EXPECT_TRUE(p.algo == 0 || p.algo == 1) << where;
            EXPECT_GE(p.count, 1u) << where;
            EXPECT_LE(p.count, static_cast<uint64_t>(kGemmArMaxM)) << where;
            break;
        case Kind::kEpNormal:
        case Kind::kEpLowLatency:
            EXPECT_EQ(p.count, 0u) << where;
            ASSERT_EQ(p.tokens.size(), static_cast<size_t>(w)) << where;
            for (int t : p.tokens) {
                EXPECT_GE(t, 1) << where;
                EXPECT_LE(t, kEpMaxTokens) << where;
            }
            if (p.kind == Kind::kEpLowLatency) {
                EXPECT_TRUE(std::all_of(p.tokens.begin(), p.tokens.end(), [&](int t) { return t == p.tokens[0]; }))
                    << where << ": low-latency calls have the same tokens on every rank";
            }
            break;
        case Kind::kCount:
            ADD_FAILURE() << where << ": kind kCount drawn";
            break;
    }
    if (p.kind > Kind::kAllToAll) {
        EXPECT_FALSE(p.in_sym || p.out_sym || p.in_place) << where;
    }
}

TEST(SoakPlan, PlansStayWithinTheirBuffersAndSpanTheSizes) {
    for (int w : kWorlds) {
        std::array<int, kKinds> drawn{};
        uint64_t max_all_reduce_bytes = 0, min_all_reduce_bytes = ~0ull;
        for (uint64_t seed : kSeeds) {
            for (uint64_t c = 0; c < 4000; ++c) {
                const Plan p = draw_plan(seed, c, w);
                const std::string where = "world " + std::to_string(w) + " seed " + std::to_string(seed) + " call " +
                                          std::to_string(c) + " (" + describe(p) + ")";
                expect_within_bounds(p, w, where);
                ++drawn[static_cast<size_t>(p.kind)];
                if (p.kind == Kind::kAllReduce) {
                    const uint64_t bytes = p.count * static_cast<uint64_t>(dtype_bytes(p.dtype));
                    max_all_reduce_bytes = std::max(max_all_reduce_bytes, bytes);
                    min_all_reduce_bytes = std::min(min_all_reduce_bytes, bytes);
                }
            }
            for (int k = 0; k < kKinds; ++k) {
                const Plan p = draw_plan(seed, ~static_cast<uint64_t>(k), w, static_cast<Kind>(k));
                expect_within_bounds(p, w, "warm-up " + describe(p));
            }
        }
        // Every kind is drawn, about as often as its weight says (20000 draws: a few percent either way).
        int weight_sum = 0;
        for (int k : kKindWeights) weight_sum += k;
        for (int k = 0; k < kKinds; ++k) {
            const double share = drawn[static_cast<size_t>(k)] / 20000.0;
            EXPECT_NEAR(share, static_cast<double>(kKindWeights[k]) / weight_sum, 0.02) << kKindNames[k];
        }
        // Sizes are log-uniform over the whole range: both ends are reached.
        EXPECT_GE(max_all_reduce_bytes, 2ull << 20) << "world " << w;
        EXPECT_LE(min_all_reduce_bytes, 16u) << "world " << w;
    }
}

TEST(SoakPlan, DescriptionsNameKindAlgorithmSizeAndBuffers) {
    Plan p;
    p.kind = Kind::kAllReduce;
    p.algo = static_cast<int>(ops::AllReduceAlgo::kLowLatency);
    p.dtype = DType::kBF16;
    p.count = 1000;
    p.in_sym = true;
    p.in_place = true;
    EXPECT_EQ(describe(p), "all_reduce ll bf16 x 1000 sym-in in-place");

    p = Plan{};
    p.kind = Kind::kAllGather;
    p.algo = static_cast<int>(ops::AllGatherAlgo::kCopyEnginePush);
    p.count = 4096;
    p.out_sym = true;
    EXPECT_EQ(describe(p), "all_gather ce_push shard 4096 B sym-out");

    p = Plan{};
    p.kind = Kind::kReduceScatter;
    p.algo = static_cast<int>(ops::ReduceScatterAlgo::kSmPull);
    p.dtype = DType::kF32;
    p.count = 7;
    EXPECT_EQ(describe(p), "reduce_scatter sm_pull f32 x 7");

    p = Plan{};
    p.kind = Kind::kAllToAll;
    p.count = 3;
    p.in_sym = p.out_sym = true;
    EXPECT_EQ(describe(p), "all_to_all chunk 3 B sym-in sym-out");

    p = Plan{};
    p.kind = Kind::kGemmAr;
    p.algo = 1;
    p.count = 5;
    EXPECT_EQ(describe(p), "gemm_ar M 5 own kernel");
    p.algo = 0;
    EXPECT_EQ(describe(p), "gemm_ar M 5");
    p.kind = Kind::kAgGemm;
    p.count = 12;
    EXPECT_EQ(describe(p), "ag_gemm M 12");

    p = Plan{};
    p.kind = Kind::kEpNormal;
    p.tokens = {1, 64, 3};
    EXPECT_EQ(describe(p), "ep_normal tokens 1 64 3");
    p.kind = Kind::kEpLowLatency;
    p.tokens = {9, 9};
    EXPECT_EQ(describe(p), "ep_low_latency tokens 9 9");
}

// The EP normal ledger's rows: a token's row goes once to each rank that owns one of its experts (the data signal
// counts rows, not routes).
TEST(SoakPlan, RowsPerRankCountEachTokenOncePerDestination) {
    // 3 ranks of 2 experts each (rank r: experts 2r, 2r + 1), top-2.
    const std::vector<int32_t> idx = {
        0, 1,  // both on rank 0: one row to rank 0
        1, 2,  // ranks 0 and 1
        5, 4,  // both on rank 2
        3, 5,  // ranks 1 and 2
    };
    EXPECT_EQ(rows_per_rank(idx, 2, 2, 3), (std::vector<int64_t>{2, 2, 2}));
    EXPECT_EQ(rows_per_rank({}, 2, 2, 3), (std::vector<int64_t>{0, 0, 0}));  // no tokens
    EXPECT_THROW(rows_per_rank({0, 1, 2}, 2, 2, 3), Error);                  // not whole tokens
    EXPECT_THROW(rows_per_rank({0, 6}, 2, 2, 3), Error);                     // expert 6 of 6
}

// The ledger of a recorded world-8 hang (seed 1796282091014457446, call 2227, ep_normal tokens 57 11 57 46 61 47 64
// 18): the peers waited for rank 3's count signal >= 137 and rank 3 for rank 4's data signal >= 1977 (observed 1950).
// Replayed here: call 2227 is the World's 137th normal dispatch (the warm-up pass's one included), rank 4's dispatches
// before it sent rank 3 exactly 1950 rows and this one 27. So both sides counted right: rank 4 had sent nothing in
// call 2227 (it was still waiting for rank 3's counts), and rank 3's expected total was this call's.
TEST(SoakPlan, EpNormalLedgerOfARecordedHang) {
    constexpr uint64_t kSeed = 1796282091014457446ull;
    constexpr int kWorld = 8;
    constexpr int kSrc = 4;
    constexpr int kDst = 3;
    int64_t dispatches = 0;
    int64_t before = 0;
    int64_t in_call = 0;
    const auto rows_of = [&](const Plan& p) {
        const Routing r = routing_of(p.salt, kSrc, p.tokens[kSrc], kEpExpertsPerRank * kWorld);
        return rows_per_rank(r.idx, kEpTopk, kEpExpertsPerRank, kWorld)[kDst];
    };
    // The warm-up pass runs every kind once, with its own plans, on the same Buffer.
    const Plan warm =
        draw_plan(kSeed, ~static_cast<uint64_t>(static_cast<int>(Kind::kEpNormal)), kWorld, Kind::kEpNormal);
    ++dispatches;
    before += rows_of(warm);
    for (uint64_t call = 0; call < 2227; ++call) {
        const Plan p = draw_plan(kSeed, call, kWorld);
        if (p.kind != Kind::kEpNormal) continue;
        ++dispatches;
        before += rows_of(p);
    }
    const Plan hung = draw_plan(kSeed, 2227, kWorld);
    ASSERT_EQ(hung.kind, Kind::kEpNormal);
    EXPECT_EQ(describe(hung), "ep_normal tokens 57 11 57 46 61 47 64 18");
    ++dispatches;
    in_call = rows_of(hung);
    EXPECT_EQ(dispatches, 137);
    EXPECT_EQ(before, 1950);
    EXPECT_EQ(in_call, 27);
    EXPECT_EQ(before + in_call, 1977);
}

}  // namespace
}  // namespace weft::bench::soak
