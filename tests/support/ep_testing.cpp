// SPDX-License-Identifier: MIT
// Routing scenarios and payloads of the expert-parallel GPU tests (see ep_testing.hpp).
#include "support/ep_testing.hpp"

#include <algorithm>
#include <numeric>
#include <sstream>
#include <utility>

#include "weft/runtime/world.hpp"

namespace weft::test::ep {

void collective_check(World& world, const std::function<void()>& check) {
    thread_local uint64_t sequence = 0;  // rank threads are fresh per run_local; every rank counts alike
    std::string error;
    try {
        check();
    } catch (const std::exception& e) {
        error = e.what();
        if (error.empty()) error = "check failed";
    }
    const std::vector<Bytes> all =
        world.store().all_gather("ep-test-check-" + std::to_string(sequence++), world.rank(), world.num_ranks(),
                                 Bytes(error.begin(), error.end()), world.timeout());
    for (size_t r = 0; r < all.size(); ++r) {
        if (!all[r].empty()) {
            WEFT_FAIL((static_cast<int>(r) == world.rank() ? "" : "(raised on every rank) ")
                      << std::string(all[r].begin(), all[r].end()));
        }
    }
}

const char* scenario_name(Scenario s) {
    switch (s) {
        case Scenario::kUniform:
            return "uniform";
        case Scenario::kSkewed:
            return "skewed";
        case Scenario::kSparse:
            return "sparse";
        case Scenario::kOneRank:
            return "one-rank";
        case Scenario::kAllDropped:
            return "all-dropped";
        case Scenario::kSomeDropped:
            return "some-dropped";
        case Scenario::kNoTokens:
            return "no-tokens";
        case Scenario::kOneToken:
            return "one-token";
        case Scenario::kMixedCounts:
            return "mixed-counts";
        case Scenario::kMaxTokens:
            return "max-tokens";
    }
    return "?";
}

std::vector<Scenario> all_scenarios() {
    return {Scenario::kUniform,     Scenario::kSkewed,      Scenario::kSparse,   Scenario::kOneRank,
            Scenario::kAllDropped,  Scenario::kSomeDropped, Scenario::kNoTokens, Scenario::kOneToken,
            Scenario::kMixedCounts, Scenario::kMaxTokens};
}

namespace {

// k distinct experts drawn from `pool`.
void pick_distinct(std::vector<int>& pool, int k, std::mt19937& rng, std::vector<int32_t>& out) {
    for (int j = 0; j < k; ++j) {
        std::uniform_int_distribution<size_t> pick(static_cast<size_t>(j), pool.size() - 1);
        std::swap(pool[static_cast<size_t>(j)], pool[pick(rng)]);
        out.push_back(pool[static_cast<size_t>(j)]);
    }
}

}  // namespace

std::vector<Routing> make_routing(Scenario s, const Params& p, int max_tokens, uint32_t seed) {
    std::mt19937 rng(seed * 2654435761u + static_cast<uint32_t>(s) * 97u + 1u);
    std::uniform_real_distribution<float> weight(0.05f, 1.0f);
    const int el = p.local_experts();
    const int hot = p.num_experts - 1;
    std::vector<Routing> all(static_cast<size_t>(p.num_ranks));
    for (int r = 0; r < p.num_ranks; ++r) {
        Routing& rt = all[static_cast<size_t>(r)];
        int t_count = max_tokens;
        switch (s) {
            case Scenario::kUniform:
            case Scenario::kSparse:
            case Scenario::kOneRank:
            case Scenario::kSomeDropped:
                t_count = std::uniform_int_distribution<int>(std::max(1, max_tokens / 2), max_tokens)(rng);
                break;
            case Scenario::kNoTokens:
                t_count = 0;
                break;
            case Scenario::kOneToken:
                t_count = 1;
                break;
            case Scenario::kMixedCounts:
                t_count = r % 3 == 0 ? 0 : (r % 3 == 1 ? 1 : max_tokens);
                break;
            default:
                break;
        }
        rt.num_tokens = t_count;
        for (int t = 0; t < t_count; ++t) {
            std::vector<int32_t> row;
            if (s == Scenario::kAllDropped) {
                row.assign(static_cast<size_t>(p.topk), -1);
            } else if (s == Scenario::kSkewed) {
                std::vector<int> pool(static_cast<size_t>(p.num_experts - 1));
                std::iota(pool.begin(), pool.end(), 0);
                row.push_back(hot);
                pick_distinct(pool, p.topk - 1, rng, row);
            } else if (s == Scenario::kSparse) {
                std::vector<int> pool;
                for (int e = 0; e < el; ++e) pool.push_back(e);
                if (p.num_ranks > 1) {
                    for (int e = el; e < 2 * el; e += 2) pool.push_back(e);
                }
                const int k = std::min<int>(p.topk, static_cast<int>(pool.size()));
                pick_distinct(pool, k, rng, row);
                while (static_cast<int>(row.size()) < p.topk) row.push_back(-1);
            } else if (s == Scenario::kOneRank) {
                const int dst = std::uniform_int_distribution<int>(0, p.num_ranks - 1)(rng);
                std::vector<int> pool(static_cast<size_t>(el));
                std::iota(pool.begin(), pool.end(), dst * el);
                const int k = std::min(p.topk, el);
                pick_distinct(pool, k, rng, row);
                while (static_cast<int>(row.size()) < p.topk) row.push_back(-1);
            } else {
                std::vector<int> pool(static_cast<size_t>(p.num_experts));
                std::iota(pool.begin(), pool.end(), 0);
                pick_distinct(pool, p.topk, rng, row);
                if (s == Scenario::kSomeDropped) {
                    for (auto& e : row) {
                        if (std::uniform_int_distribution<int>(0, 9)(rng) < 3) e = -1;
                    }
                }
            }
            for (int j = 0; j < p.topk; ++j) {
                rt.topk_idx.push_back(row[static_cast<size_t>(j)]);
                rt.topk_weights.push_back(weight(rng));
            }
        }
    }
    return all;
}

uint16_t payload(int rank, int token, int channel, uint32_t seed, bool fp8_friendly) {
    if (channel == 0) return f32_to_bf16(static_cast<float>(rank + 1));
    if (channel == 1) return f32_to_bf16(static_cast<float>(token / 64));
    if (channel == 2) return f32_to_bf16(static_cast<float>(token % 64));
    uint32_t h = seed ^ (static_cast<uint32_t>(rank) * 0x9E3779B1u) ^ (static_cast<uint32_t>(token) * 0x85EBCA77u) ^
                 (static_cast<uint32_t>(channel) * 0xC2B2AE3Du);
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    h *= 0x297A2D39u;
    h ^= h >> 15;
    float v = static_cast<float>(static_cast<int>(h % 512u) - 256) / 64.0f;
    if (fp8_friendly) {
        const int group = channel / 128;
        if ((group + token + rank) % 4 == 0) return f32_to_bf16(0.0f);  // an all-zero group (channels >= 3)
        v = std::ldexp(v, (token % 9) - 4);
    }
    return f32_to_bf16(v);
}

std::vector<uint16_t> payload_rows(int rank, int num_tokens, int hidden, uint32_t seed, bool fp8_friendly) {
    std::vector<uint16_t> rows(static_cast<size_t>(num_tokens) * static_cast<size_t>(hidden));
    for (int t = 0; t < num_tokens; ++t) {
        for (int c = 0; c < hidden; ++c) {
            rows[static_cast<size_t>(t) * static_cast<size_t>(hidden) + static_cast<size_t>(c)] =
                payload(rank, t, c, seed, fp8_friendly);
        }
    }
    return rows;
}

std::string describe_row(const uint16_t* row) {
    std::ostringstream os;
    const float r = bf16_to_f32(row[0]) - 1.0f;
    const float t = bf16_to_f32(row[1]) * 64.0f + bf16_to_f32(row[2]);
    os << "a row that looks like rank " << r << " token " << t;
    return os.str();
}

uint16_t expert_output(uint16_t x, int expert) {
    return f32_to_bf16(bf16_to_f32(x) * (1.0f + static_cast<float>(expert % 5) * 0.25f));
}

LowLatencyCall low_latency_call(const Params& p, std::vector<Routing> all, uint32_t seed, bool fp8_friendly) {
    LowLatencyCall call;
    call.all = std::move(all);
    for (int r = 0; r < p.num_ranks; ++r) {
        call.x_all.push_back(
            payload_rows(r, call.all[static_cast<size_t>(r)].num_tokens, p.hidden, seed, fp8_friendly));
        call.rows.push_back(reference_low_latency_rows(p, call.all, r));
    }
    call.row_of.resize(static_cast<size_t>(p.num_ranks));
    for (int s = 0; s < p.num_ranks; ++s) {
        call.row_of[static_cast<size_t>(s)].assign(
            static_cast<size_t>(call.all[static_cast<size_t>(s)].num_tokens) * p.topk, -1);
    }
    for (int r = 0; r < p.num_ranks; ++r) {
        for (int le = 0; le < p.local_experts(); ++le) {
            const auto& list = call.rows[static_cast<size_t>(r)][static_cast<size_t>(le)];
            for (size_t i = 0; i < list.size(); ++i) {
                call.row_of[static_cast<size_t>(list[i].src)]
                           [static_cast<size_t>(list[i].token) * p.topk + list[i].slot] = static_cast<int32_t>(i);
            }
        }
    }
    return call;
}

}  // namespace weft::test::ep
