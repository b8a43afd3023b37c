// SPDX-License-Identifier: MIT
// weft_soak's seeded plan generator and plan descriptions (soak_plan.hpp).
#include "soak_plan.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include "weft/ops/collectives.hpp"
#include "weft/runtime/error.hpp"

namespace weft::bench::soak {
namespace {

uint64_t log_uniform(std::mt19937_64& rng, uint64_t lo, uint64_t hi) {
    std::uniform_real_distribution<double> u(std::log(static_cast<double>(lo)), std::log(static_cast<double>(hi) + 1));
    return std::clamp<uint64_t>(static_cast<uint64_t>(std::exp(u(rng))), lo, hi);
}

}  // namespace

// NOTE: the order of the draws below is the seed's meaning: a change in it gives a seed other plans.
Plan draw_plan(uint64_t seed, uint64_t call, int num_ranks, std::optional<Kind> kind) {
    std::mt19937_64 rng(seed ^ ((call + 1) * 0x9E3779B97F4A7C15ull));
    Plan p;
    p.salt = rng();
    if (kind) {
        p.kind = *kind;
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
    const uint64_t per_rank_cap = kBufferBytes / static_cast<uint64_t>(num_ranks);
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
            // The push algorithms write into the peers' outputs: those must be symmetric.
            p.out_sym = p.algo == static_cast<int>(ops::AllGatherAlgo::kSmPush) ||
                        p.algo == static_cast<int>(ops::AllGatherAlgo::kCopyEnginePush) || coin();
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
            p.count = static_cast<uint64_t>(num_ranks) * (1 + static_cast<uint64_t>(pick(kGemmRowsPerRank)));
            break;
        case Kind::kGemmAr:
            p.algo = pick(2);  // 0: through ops::all_reduce, 1: the op's own kernel
            p.count = 1 + static_cast<uint64_t>(pick(kGemmArMaxM));
            break;
        case Kind::kEpNormal:
            for (int r = 0; r < num_ranks; ++r) p.tokens.push_back(1 + pick(kEpMaxTokens));
            break;
        case Kind::kEpLowLatency:
            p.tokens.assign(static_cast<size_t>(num_ranks), 1 + pick(kEpMaxTokens));
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
            s += std::string(" ") + ops::algo_name(static_cast<ops::AllReduceAlgo>(p.algo)) + " " +
                 dtype_name(p.dtype) + " x " + std::to_string(p.count);
            break;
        case Kind::kAllGather:
            s += std::string(" ") + ops::algo_name(static_cast<ops::AllGatherAlgo>(p.algo)) + " shard " +
                 std::to_string(p.count) + " B";
            break;
        case Kind::kReduceScatter:
            s += std::string(" ") + ops::algo_name(static_cast<ops::ReduceScatterAlgo>(p.algo)) + " " +
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
            for (int t : p.tokens) {
                s += ' ';  // appended: `" " + std::to_string(t)` trips GCC 12's -Wrestrict false positive
                s += std::to_string(t);
            }
            break;
        case Kind::kCount:
            break;
    }
    if (p.kind <= Kind::kAllToAll) {
        s += std::string(p.in_sym ? " sym-in" : "") + (p.out_sym ? " sym-out" : "") + (p.in_place ? " in-place" : "");
    }
    return s;
}

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

std::vector<int64_t> rows_per_rank(const std::vector<int32_t>& idx, int topk, int experts_per_rank, int num_ranks) {
    WEFT_CHECK(topk > 0 && experts_per_rank > 0 && num_ranks > 0,
               "rows_per_rank: topk, experts_per_rank and num_ranks must be positive, got "
                   << topk << ", " << experts_per_rank << ", " << num_ranks);
    WEFT_CHECK(idx.size() % static_cast<size_t>(topk) == 0,
               "rows_per_rank: idx must hold whole tokens of " << topk << " experts, got " << idx.size() << " ids");
    std::vector<int64_t> rows(static_cast<size_t>(num_ranks), 0);
    std::vector<char> here(static_cast<size_t>(num_ranks));
    for (size_t t = 0; t < idx.size(); t += static_cast<size_t>(topk)) {
        std::fill(here.begin(), here.end(), 0);
        for (int j = 0; j < topk; ++j) {
            const int32_t e = idx[t + static_cast<size_t>(j)];
            WEFT_CHECK(e >= 0 && e < experts_per_rank * num_ranks,
                       "rows_per_rank: expert " << e << " is outside [0, " << experts_per_rank * num_ranks << ")");
            here[static_cast<size_t>(e / experts_per_rank)] = 1;
        }
        for (int r = 0; r < num_ranks; ++r) rows[static_cast<size_t>(r)] += here[static_cast<size_t>(r)];
    }
    return rows;
}

}  // namespace weft::bench::soak
