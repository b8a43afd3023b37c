// SPDX-License-Identifier: MIT
// GPU tests of the expert-parallel MoE block (weft/ops/ep_moe.hpp), ranks sharing the GPU: the fused block against
// the same block from the separate ops (bit for bit) and against a host reference (fp32/double arithmetic with the
// kernels' bf16 roundings) for every routing scenario, top-k 1, 2 and 8 and worlds 1..8; capacity overflow as a
// weft::Error with a working block afterwards; argument errors before any launch; back-to-back calls, mixed forms
// and CUDA-graph replay. Outputs are poisoned before every call.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "support/ep_reference.hpp"
#include "support/ep_testing.hpp"
#include "support/runtime_checks.hpp"
#include "weft/ops/ep_moe.hpp"
#include "weft/weft.hpp"

namespace weft::ops::ep {
namespace {

namespace ref = weft::test::ep;
using ref::DeviceArray;
using ref::download;
using ref::fresh_seed;
using ref::RankStream;
using ref::Scenario;
using test::run_ranks;

constexpr int kHidden = 256;
constexpr int kFfn = 128;
constexpr int kMaxTokens = 48;

class EpMoeGpu : public ::testing::Test {
protected:
    void SetUp() override { ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU"; }
};

MoeConfig moe_config(int num_ranks, int topk, int alignment) {
    MoeConfig c;
    int experts = 4 * num_ranks;
    while (experts < topk) experts += num_ranks;
    c.ep.num_experts = experts;
    c.ep.hidden = kHidden;
    c.ep.topk = topk;
    c.ep.max_tokens_per_rank = kMaxTokens;
    c.ep.expert_alignment = alignment;
    c.ep.low_latency = false;
    c.ffn = kFfn;
    return c;
}

ref::Params params_of(const MoeConfig& c, int num_ranks) {
    ref::Params p;
    p.num_ranks = num_ranks;
    p.num_experts = c.ep.num_experts;
    p.topk = c.ep.topk;
    p.hidden = c.ep.hidden;
    p.expert_alignment = c.ep.expert_alignment;
    return p;
}

WorldOptions options_for(const MoeConfig& c, int num_ranks) {
    WorldOptions o = test::test_options();
    Config ep = c.ep;
    o.heap_bytes = std::max<uint64_t>(64ull << 20, footprint(ep, num_ranks).heap_bytes(1) + (16ull << 20));
    return o;
}

// Expert weights from a hash of (expert, matrix, index): multiples of 1/1024 in [-1/16, 1/16] (exact in bf16).
uint16_t weight_bits(int expert, int matrix, int64_t i) {
    uint64_t z =
        (static_cast<uint64_t>(expert) << 40) ^ (static_cast<uint64_t>(matrix) << 36) ^ static_cast<uint64_t>(i);
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const int v = static_cast<int>(z % 129) - 64;  // [-64, 64] / 1024
    return ref::f32_to_bf16(static_cast<float>(v) / 1024.0f);
}

/// Every expert's weights on the host (floats) and this rank's on the device.
struct Experts {
    std::vector<std::vector<float>> gate_up;  // [E][2F * H]
    std::vector<std::vector<float>> down;     // [E][H * F]
    DeviceArray<uint16_t> gate_up_dev;        // [E_local, 2F, H]
    DeviceArray<uint16_t> down_dev;           // [E_local, H, F]
    int local = 0;
    Experts(const MoeConfig& c, int num_ranks, int me, cudaStream_t s)
        : gate_up_dev(static_cast<size_t>(c.ep.num_experts / num_ranks) * 2 * c.ffn * c.ep.hidden, s),
          down_dev(static_cast<size_t>(c.ep.num_experts / num_ranks) * c.ep.hidden * c.ffn, s),
          local(c.ep.num_experts / num_ranks) {
        const int64_t gu = int64_t{2} * c.ffn * c.ep.hidden;
        const int64_t dn = int64_t{c.ep.hidden} * c.ffn;
        std::vector<uint16_t> gu_local, dn_local;
        for (int e = 0; e < c.ep.num_experts; ++e) {
            std::vector<float> a(static_cast<size_t>(gu)), b(static_cast<size_t>(dn));
            const bool mine = e / local == me;
            for (int64_t i = 0; i < gu; ++i) {
                const uint16_t w = weight_bits(e, 0, i);
                a[static_cast<size_t>(i)] = ref::bf16_to_f32(w);
                if (mine) gu_local.push_back(w);
            }
            for (int64_t i = 0; i < dn; ++i) {
                const uint16_t w = weight_bits(e, 1, i);
                b[static_cast<size_t>(i)] = ref::bf16_to_f32(w);
                if (mine) dn_local.push_back(w);
            }
            gate_up.push_back(std::move(a));
            down.push_back(std::move(b));
        }
        gate_up_dev.upload(gu_local);
        down_dev.upload(dn_local);
    }
    MoeWeights views(const MoeConfig& c) const {
        return MoeWeights{TensorView(gate_up_dev.get(), DType::kBF16, {local, 2 * c.ffn, c.ep.hidden}),
                          TensorView(down_dev.get(), DType::kBF16, {local, c.ep.hidden, c.ffn})};
    }
};

/// Expert e's output for one bf16 row, with the block's roundings: h = bf16(x W^T) (2F), a = bf16(silu(g) * u)
/// (fp32), y = bf16(a D^T) (H), sums in double.
std::vector<float> expert_row(const MoeConfig& c, const Experts& ex, int e, const uint16_t* x) {
    const int h = c.ep.hidden, f = c.ffn;
    const std::vector<float>& gu = ex.gate_up[static_cast<size_t>(e)];
    const std::vector<float>& dn = ex.down[static_cast<size_t>(e)];
    std::vector<float> hv(static_cast<size_t>(2 * f));
    for (int n = 0; n < 2 * f; ++n) {
        double acc = 0;
        for (int k = 0; k < h; ++k) acc += double{ref::bf16_to_f32(x[k])} * gu[static_cast<size_t>(n) * h + k];
        hv[static_cast<size_t>(n)] = ref::bf16_to_f32(ref::f32_to_bf16(static_cast<float>(acc)));
    }
    std::vector<float> a(static_cast<size_t>(f));
    for (int j = 0; j < f; ++j) {
        const float g = hv[static_cast<size_t>(j)], u = hv[static_cast<size_t>(f + j)];
        a[static_cast<size_t>(j)] = ref::bf16_to_f32(ref::f32_to_bf16(g / (1.0f + std::exp(-g)) * u));
    }
    std::vector<float> y(static_cast<size_t>(h));
    for (int n = 0; n < h; ++n) {
        double acc = 0;
        for (int k = 0; k < f; ++k) acc += double{a[static_cast<size_t>(k)]} * dn[static_cast<size_t>(n) * f + k];
        y[static_cast<size_t>(n)] = ref::bf16_to_f32(ref::f32_to_bf16(static_cast<float>(acc)));
    }
    return y;
}

/// Random bf16 rows in [-1, 1), multiples of 1/64.
std::vector<uint16_t> random_rows(int tokens, int hidden, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> v(-64, 63);
    std::vector<uint16_t> rows(static_cast<size_t>(tokens) * hidden);
    for (auto& r : rows) r = ref::f32_to_bf16(static_cast<float>(v(rng)) / 64.0f);
    return rows;
}

/// Checks this rank's block output against the host reference: |got - want| <= 2^-5 * sum |w y| + 2^-10 per channel.
void check_against_reference(const MoeConfig& c, const ref::Params& p, const Experts& ex, const ref::Routing& r,
                             const std::vector<uint16_t>& x, const std::vector<uint16_t>& out, int me,
                             const std::string& what) {
    const int h = c.ep.hidden;
    for (int t = 0; t < r.num_tokens; ++t) {
        std::vector<double> want(static_cast<size_t>(h), 0.0), mag(static_cast<size_t>(h), 0.0);
        for (int j = 0; j < p.topk; ++j) {
            const int e = ref::valid_expert(p, r, t, j);
            if (e < 0) continue;
            const float w = r.topk_weights[static_cast<size_t>(t) * p.topk + j];
            const std::vector<float> y = expert_row(c, ex, e, &x[static_cast<size_t>(t) * h]);
            for (int ch = 0; ch < h; ++ch) {
                want[static_cast<size_t>(ch)] += double{w} * y[static_cast<size_t>(ch)];
                mag[static_cast<size_t>(ch)] += std::fabs(double{w} * y[static_cast<size_t>(ch)]);
            }
        }
        for (int ch = 0; ch < h; ++ch) {
            const double got = ref::bf16_to_f32(out[static_cast<size_t>(t) * h + ch]);
            const double tol = mag[static_cast<size_t>(ch)] / 32.0 + 1.0 / 1024.0;
            WEFT_CHECK(std::isfinite(got) && std::fabs(got - want[static_cast<size_t>(ch)]) <= tol,
                       "rank " << me << ", " << what << ": out[" << t << "][" << ch << "] = " << got << ", expected "
                               << want[static_cast<size_t>(ch)] << " (tolerance " << tol << ")");
        }
    }
}

/// One rank's inputs and outputs.
struct Io {
    DeviceArray<uint16_t> x;
    DeviceArray<int32_t> idx;
    DeviceArray<float> w;
    DeviceArray<uint16_t> out_fused;
    DeviceArray<uint16_t> out_seq;
    int num_tokens = 0;
    int topk = 0;
    Io(const MoeConfig& c, cudaStream_t s)
        : x(static_cast<size_t>(c.ep.max_tokens_per_rank) * c.ep.hidden + 8, s),
          idx(static_cast<size_t>(c.ep.max_tokens_per_rank + 1) * c.ep.topk, s),
          w(static_cast<size_t>(c.ep.max_tokens_per_rank + 1) * c.ep.topk, s),
          out_fused(static_cast<size_t>(c.ep.max_tokens_per_rank) * c.ep.hidden + 8, s),
          out_seq(static_cast<size_t>(c.ep.max_tokens_per_rank) * c.ep.hidden + 8, s),
          topk(c.ep.topk) {}
    void load(const ref::Routing& r, const std::vector<uint16_t>& rows) {
        num_tokens = r.num_tokens;
        x.upload(rows);
        idx.upload(r.topk_idx);
        w.upload(r.topk_weights);
    }
    TensorView x_view() const { return TensorView(x.get(), DType::kBF16, {num_tokens, kHidden}); }
    TensorView idx_view() const { return TensorView(idx.get(), DType::kI32, {num_tokens, topk}); }
    TensorView w_view() const { return TensorView(w.get(), DType::kF32, {num_tokens, topk}); }
    TensorView out_view(const DeviceArray<uint16_t>& o) const {
        return TensorView(o.get(), DType::kBF16, {num_tokens, kHidden});
    }
};

/// Both forms on one routing: fused == sequential bit for bit, and both within the reference's tolerance.
void run_case(World& world, MoeBlock& moe, const Experts& ex, Io& io, const ref::Params& p, Scenario sc, uint32_t seed,
              cudaStream_t s, int comm_sms = 0) {
    const int me = world.rank();
    const MoeConfig& c = moe.config();
    const auto all = ref::make_routing(sc, p, c.ep.max_tokens_per_rank, seed);
    const ref::Routing& mine = all[static_cast<size_t>(me)];
    const std::vector<uint16_t> rows = random_rows(mine.num_tokens, c.ep.hidden, seed * 31 + static_cast<uint32_t>(me));
    io.load(mine, rows);
    const std::string what =
        std::string(ref::scenario_name(sc)) + ", top-" + std::to_string(p.topk) + ", seed " + std::to_string(seed);
    io.out_fused.poison(0xFF);
    io.out_seq.poison(0xFF);
    moe.forward(io.x_view(), io.idx_view(), io.w_view(), ex.views(c), io.out_view(io.out_fused), s,
                {.fused = true, .comm_sms = comm_sms});
    moe.sync_and_check(s);
    moe.forward(io.x_view(), io.idx_view(), io.w_view(), ex.views(c), io.out_view(io.out_seq), s,
                {.fused = false, .comm_sms = comm_sms});
    moe.sync_and_check(s);
    const size_t n = static_cast<size_t>(io.num_tokens) * c.ep.hidden;
    const auto fused = download(io.out_fused.get(), n, s);
    const auto seq = download(io.out_seq.get(), n, s);
    ref::collective_check(world, [&] {
        for (size_t i = 0; i < n; ++i) {
            WEFT_CHECK(fused[i] == seq[i], "rank " << me << ", " << what << ": fused out[" << i / kHidden << "]["
                                                   << i % kHidden << "] = 0x" << std::hex << fused[i]
                                                   << " but the separate ops give 0x" << seq[i]);
        }
        check_against_reference(c, p, ex, mine, rows, fused, me, what);
    });
}

TEST_F(EpMoeGpu, FusedEqualsSeparateOpsForEveryScenarioTopkAndWorldSize) {
    const uint32_t seed = fresh_seed();
    for (int n = 1; n <= 8; ++n) {
        for (int topk : {1, 2, 8}) {
            SCOPED_TRACE("num_ranks " + std::to_string(n) + ", top-" + std::to_string(topk));
            const MoeConfig c = moe_config(n, topk, n % 2 == 0 ? 64 : 1);
            run_ranks(
                n,
                [&](World& world) {
                    RankStream rs;
                    MoeBlock moe(world, c);
                    const Experts ex(c, n, world.rank(), rs.s);
                    Io io(c, rs.s);
                    const ref::Params p = params_of(c, n);
                    int i = 0;
                    for (Scenario sc : ref::all_scenarios()) {
                        // comm_sms 1 (one block per kernel: the cross-block counters degenerate) every third case.
                        run_case(world, moe, ex, io, p, sc, seed + static_cast<uint32_t>(i), rs.s, i % 3 == 2 ? 1 : 0);
                        ++i;
                    }
                },
                options_for(c, n));
        }
    }
}

// A receive capacity that one hot expert exceeds: every rank gets a weft::Error naming the limit, nothing moves, the
// output is zeros; after clear_status the block works again (its counters stayed consistent).
TEST_F(EpMoeGpu, CapacityOverflowIsAnErrorAndTheBlockRecovers) {
    const uint32_t seed = fresh_seed();
    const int n = 4;
    MoeConfig c = moe_config(n, 2, 1);
    c.ep.max_recv_rows = c.ep.max_tokens_per_rank;  // the hot expert's owner receives a slot-0 row per token
    run_ranks(
        n,
        [&](World& world) {
            RankStream rs;
            const int me = world.rank();
            MoeBlock moe(world, c);
            const Experts ex(c, n, me, rs.s);
            Io io(c, rs.s);
            const ref::Params p = params_of(c, n);
            const auto all = ref::make_routing(Scenario::kSkewed, p, c.ep.max_tokens_per_rank, seed);
            const ref::Routing& mine = all[static_cast<size_t>(me)];
            io.load(mine, random_rows(mine.num_tokens, kHidden, seed));
            for (bool fused : {true, false}) {
                io.out_fused.poison(0xFF);
                moe.forward(io.x_view(), io.idx_view(), io.w_view(), ex.views(c), io.out_view(io.out_fused), rs.s,
                            {.fused = fused});
                world.sync_and_check(rs.s);
                ref::collective_check(world, [&] {
                    bool threw = false;
                    try {
                        moe.check();
                    } catch (const Error& e) {
                        threw = std::string(e.what()).find("max_recv_rows") != std::string::npos;
                    }
                    WEFT_CHECK(threw, "rank " << me << ": check() did not throw a message naming max_recv_rows");
                    for (uint16_t v :
                         download(io.out_fused.get(), static_cast<size_t>(io.num_tokens) * kHidden, rs.s)) {
                        WEFT_CHECK(v == 0, "rank " << me << ": an overflowing block must give zeros");
                    }
                });
                moe.buffer().clear_status();
            }
            run_case(world, moe, ex, io, p, Scenario::kOneToken, seed + 1, rs.s);  // fits the small capacity
        },
        options_for(c, n));
}

// Bad arguments throw weft::Error naming them before anything is launched: the next good call works.
TEST_F(EpMoeGpu, ArgumentErrorsAreHostErrorsBeforeAnyLaunch) {
    const uint32_t seed = fresh_seed();
    const int n = 2;
    const MoeConfig c = moe_config(n, 2, 1);
    run_ranks(
        n,
        [&](World& world) {
            RankStream rs;
            const int me = world.rank();
            MoeBlock moe(world, c);
            const Experts ex(c, n, me, rs.s);
            Io io(c, rs.s);
            const ref::Params p = params_of(c, n);
            const auto all = ref::make_routing(Scenario::kUniform, p, c.ep.max_tokens_per_rank, seed);
            io.load(all[static_cast<size_t>(me)], random_rows(all[static_cast<size_t>(me)].num_tokens, kHidden, seed));
            const auto expect_error = [&](const char* needle, const std::function<void()>& f) {
                try {
                    f();
                } catch (const Error& e) {
                    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
                    return;
                }
                ADD_FAILURE() << "no weft::Error naming " << needle;
            };
            MoeWeights w = ex.views(c);
            MoeWeights bad = w;
            bad.gate_up = TensorView(w.gate_up.data, DType::kBF16, {ex.local, c.ffn, kHidden});
            expect_error("weights.gate_up", [&] {
                moe.forward(io.x_view(), io.idx_view(), io.w_view(), bad, io.out_view(io.out_fused), rs.s);
            });
            bad = w;
            bad.down = TensorView(w.down.data, DType::kBF16, {ex.local, c.ffn, kHidden});
            expect_error("weights.down", [&] {
                moe.forward(io.x_view(), io.idx_view(), io.w_view(), bad, io.out_view(io.out_fused), rs.s);
            });
            expect_error("out", [&] {
                moe.forward(io.x_view(), io.idx_view(), io.w_view(), w,
                            TensorView(io.out_fused.get(), DType::kBF16, {io.num_tokens + 1, kHidden}), rs.s);
            });
            // out inside the block's own buffers: refused before the dispatch (the combine would refuse it only after).
            const TensorView inside(moe.expert_out().data, DType::kBF16, {io.num_tokens, kHidden});
            expect_error("out must not overlap the block's",
                         [&] { moe.forward(io.x_view(), io.idx_view(), io.w_view(), w, inside, rs.s); });
            expect_error("comm_sms", [&] {
                moe.forward(io.x_view(), io.idx_view(), io.w_view(), w, io.out_view(io.out_fused), rs.s,
                            {.comm_sms = world.sm_budget()});
            });
            expect_error("topk_weights", [&] {
                moe.forward(io.x_view(), io.idx_view(), TensorView(io.w.get(), DType::kI32, {io.num_tokens, 2}), w,
                            io.out_view(io.out_fused), rs.s);
            });
            run_case(world, moe, ex, io, p, Scenario::kUniform, seed + 1, rs.s);
        },
        options_for(c, n));
}

// Eight ranks on one GPU (the SM budget is the GPU's SMs / 8), with GEMM grids that fill every rank's share: the
// shape of weft_bench_moe_block's world-8 run, made small enough for a host reference. As the benchmark runs it: the
// first call right after construction, then fused and sequential calls back to back with no host synchronisation
// between them; every fused output equals the separate ops' bit for bit and the host reference.
TEST_F(EpMoeGpu, WorldEightSharingOneGpuRunsFullGridsBackToBack) {
    const uint32_t seed = fresh_seed();
    constexpr int n = 8;
    MoeConfig c;
    c.ep.num_experts = 32;
    c.ep.hidden = kHidden;
    c.ep.topk = 8;
    c.ep.max_tokens_per_rank = 96;  // the default comm_sms: 2 blocks (1 per 64 tokens)
    c.ep.low_latency = false;
    c.ffn = 512;
    run_ranks(
        n,
        [&](World& world) {
            RankStream rs;
            const int me = world.rank();
            MoeBlock moe(world, c);
            const ref::Params p = params_of(c, n);
            // The rank's kernels fill its SM share, and the shares fill the GPU: every rank's kernels are resident at
            // once only because each stays within its budget.
            for (bool fused : {true, false}) {
                const MoeGrids g =
                    moe_block_grids(c, moe.plan(), n, c.ep.max_tokens_per_rank, world.sm_budget(), {.fused = fused});
                if (world.num_ranks_on_device() == n) {  // all eight on one GPU: a share of 132 / 8 = 16 SMs
                    EXPECT_EQ(g.up, g.gemm_sms) << "rank " << me << ": the up-projection should fill its share";
                }
                EXPECT_EQ(g.resident(), world.sm_budget()) << "rank " << me;
            }
            const Experts ex(c, n, me, rs.s);
            constexpr int kPairs = 3;
            std::vector<std::unique_ptr<Io>> ios;
            std::vector<ref::Routing> routings;
            std::vector<std::vector<uint16_t>> rows;
            for (int i = 0; i < kPairs; ++i) {
                const Scenario sc = i == 1 ? Scenario::kSkewed : Scenario::kMaxTokens;
                auto all = ref::make_routing(sc, p, c.ep.max_tokens_per_rank, seed + static_cast<uint32_t>(i));
                routings.push_back(all[static_cast<size_t>(me)]);
                rows.push_back(random_rows(routings.back().num_tokens, kHidden,
                                           seed * 13 + 7 * static_cast<uint32_t>(i) + static_cast<uint32_t>(me)));
                ios.push_back(std::make_unique<Io>(c, rs.s));
                ios.back()->load(routings.back(), rows.back());
                ios.back()->out_fused.poison(0xFF);
                ios.back()->out_seq.poison(0xFF);
            }
            // Every rank's inputs are in place before any rank's first call can spin (as the benchmark does).
            world.barrier();
            for (int i = 0; i < kPairs; ++i) {
                Io& io = *ios[static_cast<size_t>(i)];
                moe.forward(io.x_view(), io.idx_view(), io.w_view(), ex.views(c), io.out_view(io.out_fused), rs.s,
                            {.fused = true});
                moe.forward(io.x_view(), io.idx_view(), io.w_view(), ex.views(c), io.out_view(io.out_seq), rs.s,
                            {.fused = false});
            }
            moe.sync_and_check(rs.s);
            ref::collective_check(world, [&] {
                for (int i = 0; i < kPairs; ++i) {
                    const Io& io = *ios[static_cast<size_t>(i)];
                    const size_t count = static_cast<size_t>(io.num_tokens) * kHidden;
                    const auto fused = download(io.out_fused.get(), count, rs.s);
                    const auto seq = download(io.out_seq.get(), count, rs.s);
                    for (size_t j = 0; j < count; ++j) {
                        WEFT_CHECK(fused[j] == seq[j], "rank " << me << ", pair " << i << ": fused out[" << j / kHidden
                                                               << "][" << j % kHidden << "] = 0x" << std::hex
                                                               << fused[j] << " but the separate ops give 0x"
                                                               << seq[j]);
                    }
                    check_against_reference(c, p, ex, routings[static_cast<size_t>(i)], rows[static_cast<size_t>(i)],
                                            fused, me, "world 8, back-to-back pair " + std::to_string(i));
                }
            });
        },
        options_for(c, n));
}

// Calls back to back without a host synchronisation between them (fused, sequential, fused ...), with changing
// routing, then the fused block captured once in a CUDA graph and replayed with new routing.
TEST_F(EpMoeGpu, BackToBackCallsAndGraphReplay) {
    const uint32_t seed = fresh_seed();
    const int n = 3;
    const MoeConfig c = moe_config(n, 8, 64);
    run_ranks(
        n,
        [&](World& world) {
            RankStream rs;
            const int me = world.rank();
            MoeBlock moe(world, c);
            const Experts ex(c, n, me, rs.s);
            const ref::Params p = params_of(c, n);
            constexpr int kCalls = 5;
            std::vector<std::unique_ptr<Io>> ios;
            std::vector<ref::Routing> routings;
            std::vector<std::vector<uint16_t>> rows;
            for (int i = 0; i < kCalls; ++i) {
                const Scenario sc = i % 2 == 0 ? Scenario::kUniform : Scenario::kSkewed;
                auto all = ref::make_routing(sc, p, c.ep.max_tokens_per_rank, seed + static_cast<uint32_t>(i));
                routings.push_back(all[static_cast<size_t>(me)]);
                rows.push_back(random_rows(routings.back().num_tokens, kHidden, seed + 7 * static_cast<uint32_t>(i)));
                ios.push_back(std::make_unique<Io>(c, rs.s));
                ios.back()->load(routings.back(), rows.back());
                ios.back()->out_fused.poison(0xFF);
            }
            for (int i = 0; i < kCalls; ++i) {
                Io& io = *ios[static_cast<size_t>(i)];
                moe.forward(io.x_view(), io.idx_view(), io.w_view(), ex.views(c), io.out_view(io.out_fused), rs.s,
                            {.fused = i % 3 != 1});
            }
            moe.sync_and_check(rs.s);
            ref::collective_check(world, [&] {
                for (int i = 0; i < kCalls; ++i) {
                    const Io& io = *ios[static_cast<size_t>(i)];
                    check_against_reference(
                        c, p, ex, routings[static_cast<size_t>(i)], rows[static_cast<size_t>(i)],
                        download(io.out_fused.get(), static_cast<size_t>(io.num_tokens) * kHidden, rs.s), me,
                        "back-to-back call " + std::to_string(i));
                }
            });

            // A graph fixes T: every rank's routing is padded or cut to its captured T.
            const int t = c.ep.max_tokens_per_rank - 5 * me;
            Io io(c, rs.s);
            io.num_tokens = t;
            cudaGraph_t graph = nullptr;
            cudaGraphExec_t exec = nullptr;
            WEFT_CUDA_CHECK(cudaStreamBeginCapture(rs.s, cudaStreamCaptureModeThreadLocal));
            moe.forward(io.x_view(), io.idx_view(), io.w_view(), ex.views(c), io.out_view(io.out_fused), rs.s);
            WEFT_CUDA_CHECK(cudaStreamEndCapture(rs.s, &graph));
            WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            for (int replay = 0; replay < 3; ++replay) {
                auto all = ref::make_routing(replay == 1 ? Scenario::kSkewed : Scenario::kUniform, p,
                                             c.ep.max_tokens_per_rank, seed + 50 + static_cast<uint32_t>(replay));
                ref::Routing r = all[static_cast<size_t>(me)];
                while (r.num_tokens < t) {
                    for (int j = 0; j < p.topk; ++j) {
                        r.topk_idx.push_back(j < p.num_experts ? j : -1);
                        r.topk_weights.push_back(0.25f);
                    }
                    ++r.num_tokens;
                }
                r.num_tokens = t;
                r.topk_idx.resize(static_cast<size_t>(t) * p.topk);
                r.topk_weights.resize(static_cast<size_t>(t) * p.topk);
                const auto x = random_rows(t, kHidden, seed + 90 + static_cast<uint32_t>(replay));
                io.load(r, x);
                io.out_fused.poison(0xFF);
                WEFT_CUDA_CHECK(cudaGraphLaunch(exec, rs.s));
                moe.sync_and_check(rs.s);
                ref::collective_check(world, [&] {
                    check_against_reference(c, p, ex, r, x,
                                            download(io.out_fused.get(), static_cast<size_t>(t) * kHidden, rs.s), me,
                                            "graph replay " + std::to_string(replay));
                });
            }
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(graph);
        },
        options_for(c, n));
}

}  // namespace
}  // namespace weft::ops::ep
