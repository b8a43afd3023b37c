// SPDX-License-Identifier: MIT
// weft_soak's call plans: which op, algorithm, dtype, size and buffers a call uses, drawn from the shared seed; the EP
// calls' routing and what a normal dispatch sends to each rank. Host code (mix32 also on the device), unit-tested on
// the CPU (tests/unit/test_soak_plan.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "weft/common/dtype.hpp"
#include "weft/common/macros.hpp"

namespace weft::bench::soak {

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
inline constexpr int kKinds = static_cast<int>(Kind::kCount);
inline constexpr const char* kKindNames[kKinds] = {"all_reduce", "all_gather", "reduce_scatter",
                                                   "all_to_all", "ag_gemm",    "gemm_rs",
                                                   "gemm_ar",    "ep_normal",  "ep_low_latency"};
// How often each kind is drawn (out of the sum): collectives are the cheap, many-algorithm part.
inline constexpr int kKindWeights[kKinds] = {4, 3, 3, 2, 1, 1, 1, 1, 1};

// The largest call of each kind: a rank's buffers and ops are made once per World at these sizes.
inline constexpr uint64_t kBufferBytes = 16ull << 20;  // each of a rank's four collective buffers
inline constexpr int64_t kGemmN = 256, kGemmK = 256, kGemmRowsPerRank = 64, kGemmArMaxM = 64;
inline constexpr int kEpHidden = 512, kEpTopk = 4, kEpMaxTokens = 64, kEpExpertsPerRank = 4;

/// One call. Sizes, for a World of w ranks (every buffer a call touches fits in kBufferBytes):
///   all_reduce      count elements, count x dtype bytes in [dtype bytes, 4 MiB + dtype bytes]
///   all_gather      count bytes per rank (the shard), in [1, min(2 MiB, kBufferBytes / w)]
///   reduce_scatter  count elements per rank, count x dtype bytes in [dtype bytes, min(2 MiB, kBufferBytes / w - 64)
///                   + dtype bytes]; the input holds w x count
///   all_to_all      count bytes per chunk, in [1, min(1 MiB, kBufferBytes / w)]; w chunks in and out
///   ag_gemm, gemm_rs  count = M = w x [1, kGemmRowsPerRank]
///   gemm_ar         count = M in [1, kGemmArMaxM]
///   ep_*            count 0; tokens[r] in [1, kEpMaxTokens] for every rank r (the same on every rank for
///                   ep_low_latency)
struct Plan {
    Kind kind = Kind::kAllReduce;
    int algo = 0;  // the op's algorithm enum (collectives); gemm_ar: 0 through ops::all_reduce, 1 its own kernel
    DType dtype = DType::kBF16;
    uint64_t count = 0;  // elements (reducing), bytes (moving); GEMMs: M
    bool in_sym = false, out_sym = false, in_place = false;
    std::vector<int> tokens;  // EP: per rank
    uint64_t salt = 0;        // the call's inputs are a function of (salt, rank, index)
};

/// Call `call`'s plan: a function of (seed, call, num_ranks) only, so every rank draws the same sequence. With
/// `kind`, that kind is drawn instead of a weighted random one (the warm-up pass runs every kind once).
Plan draw_plan(uint64_t seed, uint64_t call, int num_ranks, std::optional<Kind> kind = std::nullopt);

/// One line: the kind, algorithm, dtype, size and buffers ("all_reduce ll bf16 x 1000 sym-in in-place").
std::string describe(const Plan& p);

/// The inputs' hash (soak_calls.cu draws every input element from it, on the device and on the host alike).
WEFT_HOST_DEVICE inline uint32_t mix32(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return static_cast<uint32_t>(x);
}

/// One rank's routing of an EP call: kEpTopk distinct experts of `experts` per token (idx, [tokens, kEpTopk]) and
/// weights in [0.05, 1], a function of (salt, rank, tokens, experts).
struct Routing {
    std::vector<int32_t> idx;
    std::vector<float> weights;
};
Routing routing_of(uint64_t salt, int rank, int tokens, int experts);

/// What one rank's EP normal dispatch adds to each destination rank's data signal for it: per destination, the
/// tokens with at least one of their `topk` experts there (`idx`: [tokens, topk] expert ids, row-major; rank r owns
/// experts [r * experts_per_rank, (r + 1) * experts_per_rank)). A token's row goes once to each destination rank.
std::vector<int64_t> rows_per_rank(const std::vector<int32_t>& idx, int topk, int experts_per_rank, int num_ranks);

}  // namespace weft::bench::soak
