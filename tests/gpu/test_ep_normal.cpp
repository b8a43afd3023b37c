// SPDX-License-Identifier: MIT
// GPU tests of normal-mode expert-parallel dispatch/combine, ranks sharing the GPU: every layout array, count,
// offset and received row checked exactly, combine against the host reference; overflow, bad input, call
// orders, CUDA-graph replay and stragglers.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <sstream>

#include "support/ep_reference.hpp"
#include "support/ep_testing.hpp"
#include "support/runtime_checks.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/ep.hpp"
#include "weft/weft.hpp"

namespace weft::ops::ep {
namespace {

namespace ref = weft::test::ep;
using ref::DeviceArray;
using ref::fresh_seed;
using ref::RankStream;
using ref::download;
using ref::Scenario;
using test::run_ranks;

class EpNormalGpu : public ::testing::Test {
protected:
    void SetUp() override { ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU"; }
};

ref::Params params_of(const Config& c, int num_ranks) {
    ref::Params p;
    p.num_ranks = num_ranks;
    p.num_experts = c.num_experts;
    p.topk = c.topk;
    p.hidden = c.hidden;
    p.expert_alignment = c.expert_alignment;
    return p;
}

WorldOptions options_for(const Config& c, int num_ranks, int normal_handles) {
    WorldOptions o = test::test_options();
    o.heap_bytes = std::max<uint64_t>(64ull << 20, footprint(c, num_ranks).heap_bytes(normal_handles) + (16ull << 20));
    return o;
}

/// This rank's device inputs for one case.
struct Inputs {
    DeviceArray<uint16_t> x;
    DeviceArray<int32_t> idx;
    DeviceArray<float> w;
    int num_tokens = 0;
    int hidden = 0;
    int topk = 0;
    Inputs(const Config& c, cudaStream_t s)
        : x(static_cast<size_t>(c.max_tokens_per_rank) * c.hidden + 8, s),
          idx(static_cast<size_t>(c.max_tokens_per_rank + 1) * c.topk, s),
          w(static_cast<size_t>(c.max_tokens_per_rank + 1) * c.topk, s),
          hidden(c.hidden),
          topk(c.topk) {}
    void load(const ref::Routing& r, const std::vector<uint16_t>& rows) {
        num_tokens = r.num_tokens;
        x.upload(rows);
        idx.upload(r.topk_idx);
        w.upload(r.topk_weights);
    }
    TensorView x_view() const { return TensorView(x.get(), DType::kBF16, {num_tokens, hidden}); }
    TensorView idx_view() const { return TensorView(idx.get(), DType::kI32, {num_tokens, topk}); }
    TensorView w_view() const { return TensorView(w.get(), DType::kF32, {num_tokens, topk}); }
};

/// One rank's normal-mode set-up: its stream, Buffer and first handle, and its inputs. Tests name the parts with a
/// structured binding.
struct NormalRank {
    RankStream rs;
    int me;
    ref::Params p;
    Buffer ep;
    NormalHandle h;
    Inputs in;
    NormalRank(World& world, const Config& c)
        : me(world.rank()), p(params_of(c, world.num_ranks())), ep(world, c), h(ep.make_normal_handle()), in(c, rs.s) {}
};

/// The expected y rows of every rank: expert_output of the row's payload; padding rows are NaN (a
/// combine that reads one fails loudly).
std::vector<std::vector<uint16_t>> expected_y(const ref::Params& p, const ref::NormalPlan& plan,
                                              const std::vector<std::vector<uint16_t>>& x_all, int64_t max_rows) {
    std::vector<std::vector<uint16_t>> y(static_cast<size_t>(p.num_ranks));
    for (int r = 0; r < p.num_ranks; ++r) {
        auto& yr = y[static_cast<size_t>(r)];
        yr.assign(static_cast<size_t>(max_rows) * p.hidden, 0x7fc1);
        const auto& rows = plan.rows[static_cast<size_t>(r)];
        const auto& off = plan.expert_offsets[static_cast<size_t>(r)];
        for (int le = 0; le < p.local_experts(); ++le) {
            const int expert = r * p.local_experts() + le;
            for (int32_t row = off[static_cast<size_t>(le)]; row < off[static_cast<size_t>(le) + 1]; ++row) {
                const ref::RowSource src = rows[static_cast<size_t>(row)];
                if (src.src < 0) continue;  // padding stays NaN
                const uint16_t* x = &x_all[static_cast<size_t>(src.src)][static_cast<size_t>(src.token) * p.hidden];
                for (int c = 0; c < p.hidden; ++c) {
                    yr[static_cast<size_t>(row) * p.hidden + static_cast<size_t>(c)] = ref::expert_output(x[c], expert);
                }
            }
        }
    }
    return y;
}

/// Compares the handle's layout, counts, offsets and received rows with the plan (this rank's view).
void check_dispatch(const ref::Params& p, const ref::NormalPlan& plan, const std::vector<std::vector<uint16_t>>& x_all,
                    const NormalHandle& h, int me, int num_tokens, int64_t max_recv_rows, cudaStream_t s,
                    const std::string& what) {
    const NormalHandleView& v = h.view();
    const size_t w = static_cast<size_t>(p.num_ranks);
    const size_t el = static_cast<size_t>(p.local_experts());
    const size_t t = static_cast<size_t>(num_tokens);
    const size_t k = static_cast<size_t>(p.topk);
    const ref::RankLayout& l = plan.layouts[static_cast<size_t>(me)];
    const auto fail = [&](const std::string& m) { WEFT_FAIL("rank " << me << ", " << what << ": " << m); };
    if (download(v.tokens_per_expert, static_cast<size_t>(p.num_experts), s) != l.tokens_per_expert)
        fail("tokens_per_expert differs");
    if (download(v.tokens_per_rank, w, s) != l.tokens_per_rank) fail("tokens_per_rank differs");
    if (download(v.token_in_rank, t * w, s) != l.token_in_rank) fail("token_in_rank differs");
    if (download(v.send_idx, t * w, s) != l.send_idx) fail("send_idx differs");
    if (download(v.route_pos, t * k, s) != l.route_pos) fail("route_pos differs");
    if (download(v.expert_counts, el, s) != plan.expert_counts[static_cast<size_t>(me)]) fail("expert_counts differ");
    if (download(v.expert_offsets, el + 1, s) != plan.expert_offsets[static_cast<size_t>(me)])
        fail("expert_offsets differ");
    if (download(v.source_offsets, w + 1, s) != plan.source_offsets[static_cast<size_t>(me)])
        fail("source_offsets differ");
    const std::vector<int32_t> info = download(v.info, static_cast<size_t>(kInfoInts), s);
    if (info[kInfoValid] != 1 || info[kInfoNumTokens] != num_tokens ||
        info[kInfoRecvTokens] != plan.recv_tokens[static_cast<size_t>(me)] ||
        info[kInfoRecvRows] != plan.recv_rows[static_cast<size_t>(me)]) {
        fail("info {valid " + std::to_string(info[0]) + ", T " + std::to_string(info[1]) + ", tokens " +
             std::to_string(info[2]) + ", rows " + std::to_string(info[3]) + "} differs from the plan");
    }
    const auto& rows = plan.rows[static_cast<size_t>(me)];
    WEFT_CHECK(static_cast<int64_t>(rows.size()) <= max_recv_rows, "plan exceeds capacity");
    const size_t hsz = static_cast<size_t>(p.hidden);
    const std::vector<uint16_t> got = download(v.recv_x, rows.size() * hsz, s);
    for (size_t row = 0; row < rows.size(); ++row) {
        const ref::RowSource src = rows[row];
        if (src.src < 0) continue;  // padding: unspecified
        const uint16_t* want = &x_all[static_cast<size_t>(src.src)][static_cast<size_t>(src.token) * hsz];
        const uint16_t* have = &got[row * hsz];
        for (size_t c = 0; c < hsz; ++c) {
            if (want[c] != have[c]) {
                fail("received row " + std::to_string(row) + " channel " + std::to_string(c) + ": expected rank " +
                     std::to_string(src.src) + " token " + std::to_string(src.token) + " (slot " +
                     std::to_string(src.slot) + "), found " + ref::describe_row(have));
            }
        }
    }
}

/// Compares a combine output with the exact emulation and with the fp64 value.
void check_combine(const ref::Params& p, const ref::NormalPlan& plan, const std::vector<ref::Routing>& all,
                   const std::vector<std::vector<uint16_t>>& y_all, const std::vector<uint16_t>& out, int me,
                   const std::string& what) {
    const auto y_row = [&](int r, int32_t row) {
        return &y_all[static_cast<size_t>(r)][static_cast<size_t>(row) * p.hidden];
    };
    const std::vector<uint16_t> want = ref::reference_normal_combine(p, plan, all, me, y_row);
    const std::vector<double> ideal = ref::ideal_combine(p, plan, all, me, y_row);
    const std::vector<double> magnitude = ref::ideal_combine(p, plan, all, me, y_row, true);
    WEFT_CHECK(out.size() == want.size(), "out size");
    for (size_t i = 0; i < want.size(); ++i) {
        const double got = ref::bf16_to_f32(out[i]);
        if (out[i] != want[i]) {
            WEFT_FAIL("rank " << me << ", " << what << ": combine out[" << i / static_cast<size_t>(p.hidden) << "]["
                              << i % static_cast<size_t>(p.hidden) << "] = " << got << " (bits 0x" << std::hex << out[i]
                              << "), the exact emulation gives " << ref::bf16_to_f32(want[i]) << " (0x" << want[i]
                              << std::dec << ")");
        }
        // One bf16 rounding (2^-9 relative) of each rank's partial and one of the sum: bounded by 2^-9 times
        // the terms' magnitude plus 2^-9 times the value; twice that as the tolerance.
        const double tol = 4e-3 * (std::fabs(ideal[i]) + magnitude[i]) + 1e-6;
        if (std::fabs(got - ideal[i]) > tol) {
            WEFT_FAIL("rank " << me << ", " << what << ": combine out element " << i << " = " << got
                              << " is far from the exact value " << ideal[i]);
        }
    }
}

/// One dispatch + combine of a scenario, checked. `in_place` computes y inside recv_x.
void run_case(Buffer& ep, NormalHandle& h, Inputs& in, DeviceArray<uint16_t>& y_dev, DeviceArray<uint16_t>& out,
              const ref::Params& p, Scenario sc, uint32_t seed, bool in_place, cudaStream_t s, int num_sms = 0,
              bool check_status = true) {
    // check_status false: the World's checks only (a rank's Buffer may hold an earlier call's error on purpose).
    const auto sync = [&] { check_status ? ep.sync_and_check(s) : ep.world().sync_and_check(s); };
    World& world = ep.world();
    const int me = world.rank();
    const Config& c = ep.config();
    const std::vector<ref::Routing> all = ref::make_routing(sc, p, c.max_tokens_per_rank, seed);
    std::vector<std::vector<uint16_t>> x_all;
    for (int r = 0; r < p.num_ranks; ++r) {
        x_all.push_back(ref::payload_rows(r, all[static_cast<size_t>(r)].num_tokens, p.hidden, seed, false));
    }
    const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
    const std::string what = std::string(ref::scenario_name(sc)) + (in_place ? " (in place)" : "");
    const int t = all[static_cast<size_t>(me)].num_tokens;
    in.load(all[static_cast<size_t>(me)], x_all[static_cast<size_t>(me)]);
    const int64_t max_rows = ep.geometry().max_recv_rows;
    // Poison what the dispatch writes.
    WEFT_CUDA_CHECK(cudaMemsetAsync(h.recv_x().data, 0xEE, static_cast<size_t>(max_rows) * p.hidden * 2, s));
    const NormalOptions options{.num_sms = std::min(num_sms, world.sm_budget())};
    ep.dispatch(h, in.x_view(), in.idx_view(), in.w_view(), s, options);
    sync();
    ref::collective_check(world, [&] {
        check_dispatch(p, plan, x_all, h, me, t, max_rows, s, what + ", num_sms " + std::to_string(options.num_sms));
    });

    const auto y_all = expected_y(p, plan, x_all, max_rows);
    TensorView y;
    if (in_place) {
        WEFT_CUDA_CHECK(cudaMemcpyAsync(h.recv_x().data, y_all[static_cast<size_t>(me)].data(),
                                        y_all[static_cast<size_t>(me)].size() * 2, cudaMemcpyHostToDevice, s));
        y = h.recv_x();
    } else {
        y_dev.upload(y_all[static_cast<size_t>(me)]);
        y = TensorView(y_dev.get(), DType::kBF16, {max_rows, p.hidden});
    }
    out.poison(0xFF);
    ep.combine(h, y, TensorView(out.get(), DType::kBF16, {t, p.hidden}), s, options);
    sync();
    ref::collective_check(world, [&] {
        check_combine(p, plan, all, y_all, download(out.get(), static_cast<size_t>(t) * p.hidden, s), me, what);
    });
}

Config normal_config(int num_ranks) {
    Config c;
    c.num_experts = num_ranks * (num_ranks % 2 == 1 ? 3 : 4);  // 3 or 4 experts per rank
    c.hidden = 200;                                            // 400-byte rows: partial chunks
    c.topk = num_ranks % 2 == 1 ? 3 : 4;
    c.max_tokens_per_rank = 48;
    c.low_latency = false;
    c.expert_alignment = num_ranks % 2 == 1 ? 8 : 1;
    return c;
}

// Every routing scenario at world sizes 2..8: layout, counts, offsets, every row, and the combine.
TEST_F(EpNormalGpu, RoutingScenariosAtEveryWorldSize) {
    const uint32_t seed = fresh_seed();
    for (int n = 2; n <= 8; ++n) {
        SCOPED_TRACE("num_ranks " + std::to_string(n));
        const Config c = normal_config(n);
        run_ranks(
            n,
            [&](World& world) {
                NormalRank rank(world, c);
                auto& [rs, me, p, ep, h, in] = rank;
                DeviceArray<uint16_t> y(static_cast<size_t>(ep.geometry().max_recv_rows) * c.hidden, rs.s);
                DeviceArray<uint16_t> out(static_cast<size_t>(c.max_tokens_per_rank) * c.hidden, rs.s);
                int i = 0;
                for (Scenario sc : ref::all_scenarios()) {
                    // Grids of 1..5 blocks (0 = the default) exercise the cross-block counts and the last block.
                    run_case(ep, h, in, y, out, p, sc, seed + static_cast<uint32_t>(i), (i % 2) == 1, rs.s, i % 6);
                    ++i;
                }
            },
            options_for(c, n, 1));
    }
}

// A receive capacity that a skewed routing exceeds: every rank reports it, nothing moves, the combine (with the
// error still pending) gives zeros, and after clear_status the next (fitting) call works.
TEST_F(EpNormalGpu, CapacityOverflowIsReportedByEveryRankAndRecoverable) {
    const uint32_t seed = fresh_seed();
    const int n = 4;
    for (int kind = 1; kind <= 2; ++kind) {
        Config c = normal_config(n);
        if (kind == 1) {
            c.max_recv_tokens = c.max_tokens_per_rank * 2;  // the hot rank receives n * T distinct tokens
        } else {
            c.max_recv_rows = c.max_tokens_per_rank * 2;
        }
        run_ranks(
            n,
            [&](World& world) {
                NormalRank rank(world, c);
                auto& [rs, me, p, ep, h, in] = rank;
                const auto all = ref::make_routing(Scenario::kSkewed, p, c.max_tokens_per_rank, seed);
                const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
                const ref::Overflow of =
                    ref::find_overflow(plan, ep.geometry().max_recv_tokens, ep.geometry().max_recv_rows);
                WEFT_CHECK(of.rank >= 0 && of.kind == kind, "the test routing should overflow kind " << kind);
                in.load(all[static_cast<size_t>(me)],
                        ref::payload_rows(me, all[static_cast<size_t>(me)].num_tokens, c.hidden, seed, false));
                ep.dispatch(h, in.x_view(), in.idx_view(), in.w_view(), rs.s);
                world.sync_and_check(rs.s);
                ref::collective_check(world, [&] {
                    const auto st = ep.status();
                    WEFT_CHECK(st.has_value(), "rank " << me << ": no status after an overflowing dispatch");
                    WEFT_CHECK(
                        st->code == (kind == 1 ? StatusCode::kRecvTokensOverflow : StatusCode::kRecvRowsOverflow) &&
                            st->raw.culprit_rank == of.rank && st->raw.value == of.value,
                        "rank " << me << ": status " << st->message << " (expected culprit " << of.rank << ", value "
                                << of.value << ")");
                    bool threw = false;
                    try {
                        ep.check();
                    } catch (const Error& e) {
                        threw = std::string(e.what()).find(kind == 1 ? "max_recv_tokens" : "max_recv_rows") !=
                                std::string::npos;
                    }
                    WEFT_CHECK(threw, "rank " << me << ": check() did not throw a message naming the limit");
                    const auto counts = download(h.expert_counts(), static_cast<size_t>(p.local_experts()), rs.s);
                    for (int v : counts)
                        WEFT_CHECK(v == 0, "rank " << me << ": expert counts must be 0 after an overflow");
                });
                // The combine completes the exchange its dispatch began: the overflow still pending (seen by every
                // rank here), it must not refuse, and it gives zeros.
                DeviceArray<uint16_t> out(static_cast<size_t>(c.max_tokens_per_rank) * c.hidden, rs.s);
                out.poison(0xFF);
                const int t = all[static_cast<size_t>(me)].num_tokens;
                ep.combine(h, h.recv_x(), TensorView(out.get(), DType::kBF16, {t, c.hidden}), rs.s);
                world.sync_and_check(rs.s);
                ref::collective_check(world, [&] {
                    for (uint16_t v : download(out.get(), static_cast<size_t>(t) * c.hidden, rs.s)) {
                        WEFT_CHECK(v == 0, "rank " << me << ": combine after an overflow must give zeros");
                    }
                });
                ep.clear_status();
                // The buffer's state stayed consistent: a call that fits works.
                DeviceArray<uint16_t> y(static_cast<size_t>(ep.geometry().max_recv_rows) * c.hidden, rs.s);
                run_case(ep, h, in, y, out, p, Scenario::kOneToken, seed + 1, false, rs.s);
            },
            options_for(c, n, 1));
    }
}

// On every rank (checked collectively): the Buffer's status is a call mismatch whose message holds `fragment`, and
// the t rows of `out` the combine wrote are zeros. Clears the status.
void expect_call_mismatch_and_zeros(World& world, Buffer& ep, const DeviceArray<uint16_t>& out, int t, int hidden,
                                    const std::string& fragment, cudaStream_t s) {
    const int me = world.rank();
    ref::collective_check(world, [&] {
        const auto st = ep.status();
        WEFT_CHECK(
            st.has_value() && st->code == StatusCode::kCallMismatch,
            "rank " << me << ": expected a call mismatch, got " << (st ? st->message : std::string("no status")));
        WEFT_CHECK(st->message.find(fragment) != std::string::npos,
                   "rank " << me << ": the message lacks '" << fragment << "': " << st->message);
        for (uint16_t v : download(out.get(), static_cast<size_t>(t) * hidden, s)) {
            WEFT_CHECK(v == 0, "rank " << me << ": a combine after a call mismatch must give zeros");
        }
    });
    ep.clear_status();
}

// Ranks that dispatch on different normal handles of one Buffer (rank 1 on its second handle): every rank reports the
// mismatch naming both handles, nothing moves, the combines give zeros; after clear_status matching calls are exact.
TEST_F(EpNormalGpu, RanksDispatchingOnDifferentHandlesAreAMismatchOnEveryRank) {
    const uint32_t seed = fresh_seed();
    const int n = 3;
    const Config c = normal_config(n);
    run_ranks(
        n,
        [&](World& world) {
            NormalRank rank(world, c);
            auto& [rs, me, p, ep, h0, in] = rank;
            NormalHandle h1 = ep.make_normal_handle();
            const auto all = ref::make_routing(Scenario::kUniform, p, c.max_tokens_per_rank, seed);
            in.load(all[static_cast<size_t>(me)],
                    ref::payload_rows(me, all[static_cast<size_t>(me)].num_tokens, c.hidden, seed, false));
            NormalHandle& h = me == 1 ? h1 : h0;
            ep.dispatch(h, in.x_view(), in.idx_view(), in.w_view(), rs.s);
            const int t = all[static_cast<size_t>(me)].num_tokens;
            DeviceArray<uint16_t> out(static_cast<size_t>(c.max_tokens_per_rank) * c.hidden, rs.s);
            out.poison(0xFF);
            ep.combine(h, h.recv_x(), TensorView(out.get(), DType::kBF16, {t, c.hidden}), rs.s);
            world.sync_and_check(rs.s);
            expect_call_mismatch_and_zeros(world, ep, out, t, c.hidden, "normal handle #", rs.s);
            DeviceArray<uint16_t> y(static_cast<size_t>(ep.geometry().max_recv_rows) * c.hidden, rs.s);
            run_case(ep, h0, in, y, out, p, Scenario::kUniform, seed + 1, false, rs.s);
        },
        options_for(c, n, 1));
}

// Both handles dispatched alike on every rank, then combined in different orders (rank 0: h0, h1; rank 1: h1, h0):
// each combine's peer partials are of the other handle, so both combines on both ranks report it and write zeros, and
// the Buffer goes on (the counts matched, so its counters did too).
TEST_F(EpNormalGpu, RanksCombiningHandlesInDifferentOrdersAreAMismatchOnEveryRank) {
    const uint32_t seed = fresh_seed();
    const int n = 2;
    const Config c = normal_config(n);
    run_ranks(
        n,
        [&](World& world) {
            NormalRank rank(world, c);
            auto& [rs, me, p, ep, h0, in] = rank;
            NormalHandle h1 = ep.make_normal_handle();
            const auto all = ref::make_routing(Scenario::kUniform, p, c.max_tokens_per_rank, seed);
            in.load(all[static_cast<size_t>(me)],
                    ref::payload_rows(me, all[static_cast<size_t>(me)].num_tokens, c.hidden, seed, false));
            ep.dispatch(h0, in.x_view(), in.idx_view(), in.w_view(), rs.s);
            ep.dispatch(h1, in.x_view(), in.idx_view(), in.w_view(), rs.s);
            world.sync_and_check(rs.s);
            ep.check();
            const int t = all[static_cast<size_t>(me)].num_tokens;
            DeviceArray<uint16_t> out(static_cast<size_t>(c.max_tokens_per_rank) * c.hidden, rs.s);
            for (int step = 0; step < 2; ++step) {
                NormalHandle& h = (me == 0) == (step == 0) ? h0 : h1;
                out.poison(0xFF);
                ep.combine(h, h.recv_x(), TensorView(out.get(), DType::kBF16, {t, c.hidden}), rs.s);
                world.sync_and_check(rs.s);
                SCOPED_TRACE("combine " + std::to_string(step));
                expect_call_mismatch_and_zeros(world, ep, out, t, c.hidden, "in different orders", rs.s);
            }
            DeviceArray<uint16_t> y(static_cast<size_t>(ep.geometry().max_recv_rows) * c.hidden, rs.s);
            run_case(ep, h0, in, y, out, p, Scenario::kUniform, seed + 1, false, rs.s);
        },
        options_for(c, n, 1));
}

// Out-of-range and repeated expert ids on one rank: reported by that rank, dropped, everything else exact. The second
// error is left pending: it does not stop that rank's next calls (a refusal on that rank alone left its peers waiting
// until their timeout); they run and are exact on every rank, and check() still throws it there.
TEST_F(EpNormalGpu, InvalidAndRepeatedExpertIdsAreReportedAndDropped) {
    const uint32_t seed = fresh_seed();
    const int n = 3;
    const Config c = normal_config(n);
    run_ranks(
        n,
        [&](World& world) {
            NormalRank rank(world, c);
            auto& [rs, me, p, ep, h, in] = rank;
            for (int bad = 0; bad < 2; ++bad) {
                auto all =
                    ref::make_routing(Scenario::kUniform, p, c.max_tokens_per_rank, seed + static_cast<uint32_t>(bad));
                ref::Routing& r1 = all[1];
                r1.topk_idx[static_cast<size_t>(p.topk) + 1] =
                    bad == 0 ? c.num_experts + 5 : r1.topk_idx[static_cast<size_t>(p.topk)];
                const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
                std::vector<std::vector<uint16_t>> x_all;
                for (int r = 0; r < n; ++r)
                    x_all.push_back(
                        ref::payload_rows(r, all[static_cast<size_t>(r)].num_tokens, c.hidden, seed, false));
                in.load(all[static_cast<size_t>(me)], x_all[static_cast<size_t>(me)]);
                ep.dispatch(h, in.x_view(), in.idx_view(), in.w_view(), rs.s);
                world.sync_and_check(rs.s);
                ref::collective_check(world, [&] {
                    const auto st = ep.status();
                    if (me == 1) {
                        WEFT_CHECK(
                            st && st->code == (bad == 0 ? StatusCode::kInvalidExpert : StatusCode::kDuplicateExpert) &&
                                st->raw.token == 1 && st->raw.slot == 1,
                            "rank 1: expected an input error at topk_idx[1][1], got "
                                << (st ? st->message : std::string("no status")));
                        if (bad == 0) ep.clear_status();
                    } else {
                        WEFT_CHECK(!st, "rank " << me << ": unexpected status " << st->message);
                    }
                });
                ref::collective_check(world, [&] {
                    check_dispatch(p, plan, x_all, h, me, all[static_cast<size_t>(me)].num_tokens,
                                   ep.geometry().max_recv_rows, rs.s, "bad ids");
                });
            }
            // Rank 1's duplicate-id error is still pending: the next calls go ahead on every rank.
            DeviceArray<uint16_t> y(static_cast<size_t>(ep.geometry().max_recv_rows) * c.hidden, rs.s);
            DeviceArray<uint16_t> out(static_cast<size_t>(c.max_tokens_per_rank) * c.hidden, rs.s);
            run_case(ep, h, in, y, out, p, Scenario::kUniform, seed + 7, false, rs.s, 0, false);
            ref::collective_check(world, [&] {
                bool threw = false;
                try {
                    ep.check();
                } catch (const Error& e) {
                    threw = std::string(e.what()).find("expert") != std::string::npos;
                }
                WEFT_CHECK(threw == (me == 1), "rank " << me << ": check() " << (threw ? "threw" : "did not throw")
                                                       << " with rank 1's error pending");
            });
            if (me == 1) ep.clear_status();
        },
        options_for(c, n, 1));
}

// A handle that outlives its Buffer (a misuse the Buffer's destructor logs): its calls are refused, naming why, and
// its destructor touches nothing of the Buffer.
TEST_F(EpNormalGpu, AHandleThatOutlivesItsBufferIsRefusedNotUsed) {
    const int n = 2;
    const Config c = normal_config(n);
    run_ranks(
        n,
        [&](World& world) {
            auto ep = std::make_unique<Buffer>(world, c);
            NormalHandle h = ep->make_normal_handle();
            ep.reset();  // collective
            try {
                (void)h.recv_x();
                WEFT_FAIL("recv_x() of a handle whose Buffer was destroyed returned");
            } catch (const Error& e) {
                WEFT_CHECK(std::string(e.what()).find("Buffer was destroyed") != std::string::npos, e.what());
            }
            Buffer fresh(world, c);  // may land at the old Buffer's address: the handle is still not its own
            RankStream rs;
            try {
                fresh.layout(h, TensorView(nullptr, DType::kI32, {0, c.topk}), rs.s);
                WEFT_FAIL("a fresh Buffer took a destroyed Buffer's handle");
            } catch (const Error& e) {
                WEFT_CHECK(std::string(e.what()).find("Buffer was destroyed") != std::string::npos, e.what());
            }
        },
        options_for(c, n, 2));  // the detached handle keeps its heap block
}

// Host-side argument errors: raised on every rank before anything is launched, naming the argument.
TEST_F(EpNormalGpu, ArgumentErrorsAreHostErrors) {
    const int n = 2;
    const Config c = normal_config(n);
    run_ranks(
        n,
        [&](World& world) {
            RankStream rs;
            Buffer ep(world, c);
            NormalHandle h = ep.make_normal_handle();
            DeviceArray<uint16_t> x(static_cast<size_t>(c.max_tokens_per_rank + 1) * c.hidden, rs.s);
            DeviceArray<int32_t> idx(static_cast<size_t>(c.max_tokens_per_rank + 1) * c.topk, rs.s);
            DeviceArray<float> w(static_cast<size_t>(c.max_tokens_per_rank + 1) * c.topk, rs.s);
            const auto expect_error = [&](const std::function<void()>& f, const std::string& fragment) {
                try {
                    f();
                } catch (const Error& e) {
                    WEFT_CHECK(std::string(e.what()).find(fragment) != std::string::npos,
                               "error message lacks '" << fragment << "': " << e.what());
                    return;
                }
                WEFT_FAIL("expected an error mentioning '" << fragment << "'");
            };
            const int64_t too_many = c.max_tokens_per_rank + 1;
            expect_error(
                [&] {
                    ep.dispatch(h, TensorView(x.get(), DType::kBF16, {too_many, c.hidden}),
                                TensorView(idx.get(), DType::kI32, {too_many, c.topk}),
                                TensorView(w.get(), DType::kF32, {too_many, c.topk}), rs.s);
                },
                "exceed Config::max_tokens_per_rank");
            expect_error(
                [&] {
                    ep.combine(h, h.recv_x(), TensorView(x.get(), DType::kBF16, {1, c.hidden}), rs.s);
                },
                "has not been dispatched");
            expect_error(
                [&] {
                    ep.dispatch(h, TensorView(x.get(), DType::kF32, {4, c.hidden}),
                                TensorView(idx.get(), DType::kI32, {4, c.topk}),
                                TensorView(w.get(), DType::kF32, {4, c.topk}), rs.s);
                },
                "x must be bf16");
            expect_error(
                [&] {
                    ep.dispatch(h, TensorView(x.get(), DType::kBF16, {4, c.hidden}),
                                TensorView(idx.get(), DType::kI32, {3, c.topk}),
                                TensorView(w.get(), DType::kF32, {4, c.topk}), rs.s);
                },
                "topk_idx has 3 rows");
            expect_error(
                [&] {
                    ep.dispatch(h, TensorView(x.get(), DType::kBF16, {4, c.hidden}),
                                TensorView(idx.get(), DType::kI32, {4, c.topk}),
                                TensorView(w.get(), DType::kF32, {4, c.topk}), rs.s,
                                NormalOptions{.num_sms = world.sm_budget() + 1});
                },
                "exceeds this rank's SM budget");
            expect_error(
                [&] {
                    ep.dispatch(
                        h,
                        TensorView(static_cast<uint8_t*>(static_cast<void*>(x.get())) + 2, DType::kBF16, {4, c.hidden}),
                        TensorView(idx.get(), DType::kI32, {4, c.topk}), TensorView(w.get(), DType::kF32, {4, c.topk}),
                        rs.s);
                },
                "16-byte aligned");
            if (world.num_ranks_on_device() > 1) {  // ranks share the GPU: the legacy stream would serialise them
                expect_error(
                    [&] {
                        ep.dispatch(h, TensorView(x.get(), DType::kBF16, {4, c.hidden}),
                                    TensorView(idx.get(), DType::kI32, {4, c.topk}),
                                    TensorView(w.get(), DType::kF32, {4, c.topk}), nullptr);
                    },
                    "non-blocking stream");
                // A blocking stream synchronises with the legacy one, which the other rank threads use too.
                cudaStream_t blocking = nullptr;
                WEFT_CUDA_CHECK(cudaStreamCreate(&blocking));
                for (cudaStream_t s : {blocking, cudaStreamPerThread}) {
                    expect_error(
                        [&] {
                            ep.dispatch(h, TensorView(x.get(), DType::kBF16, {4, c.hidden}),
                                        TensorView(idx.get(), DType::kI32, {4, c.topk}),
                                        TensorView(w.get(), DType::kF32, {4, c.topk}), s);
                        },
                        "a blocking stream (cudaStreamCreate, cudaStreamPerThread) synchronises with the legacy");
                }
                WEFT_CUDA_CHECK(cudaStreamDestroy(blocking));
            }
            // Between a dispatch and its combine the handle's layout is the combine's: a new one is refused, and
            // allowed again once combined. Every slot dropped (-1): a valid routing that moves no row.
            const TensorView x4(x.get(), DType::kBF16, {4, c.hidden});
            const TensorView idx4(idx.get(), DType::kI32, {4, c.topk});
            WEFT_CUDA_CHECK(cudaMemsetAsync(idx.get(), 0xff, sizeof(int32_t) * 4 * c.topk, rs.s));
            ep.dispatch(h, x4, idx4, TensorView(w.get(), DType::kF32, {4, c.topk}), rs.s);
            expect_error([&] { ep.layout(h, idx4, rs.s); }, "dispatched and not combined yet");
            ep.combine(h, h.recv_x(), TensorView(x.get() + 4 * c.hidden, DType::kBF16, {4, c.hidden}), rs.s);
            ep.layout(h, idx4, rs.s);
            // The new layout is not the dispatch's: a combine now would pair the dispatch's rows with it.
            expect_error(
                [&] {
                    ep.combine(h, h.recv_x(), TensorView(x.get(), DType::kBF16, {4, c.hidden}), rs.s);
                },
                "layout() replaced");
            // x read from the handle's own receive area is overwritten by the dispatch it feeds; host memory is no
            // GPU's.
            expect_error(
                [&] {
                    ep.dispatch(h, TensorView(h.recv_x().data, DType::kBF16, {4, c.hidden}), idx4,
                                TensorView(w.get(), DType::kF32, {4, c.topk}), rs.s);
                },
                "receive area");
            std::vector<uint16_t> host_x(static_cast<size_t>(4 * c.hidden));
            expect_error(
                [&] {
                    ep.dispatch(h, TensorView(host_x.data(), DType::kBF16, {4, c.hidden}), idx4,
                                TensorView(w.get(), DType::kF32, {4, c.topk}), rs.s);
                },
                "must be device memory");
            WEFT_CUDA_CHECK(cudaStreamSynchronize(rs.s));
            ep.check();
        },
        options_for(c, n, 1));
}

// Back-to-back dispatch/combine without host synchronisation (inputs staged first), then interleaved
// dispatch A, dispatch B, combine A, combine B (twice), and one dispatch combined twice.
TEST_F(EpNormalGpu, BackToBackAndInterleavedCalls) {
    const uint32_t seed = fresh_seed();
    for (int n : {3, 5}) {
        const Config c = normal_config(n);
        run_ranks(
            n,
            [&](World& world) {
                RankStream rs;
                const int me = world.rank();
                Buffer ep(world, c);
                NormalHandle ha = ep.make_normal_handle();
                NormalHandle hb = ep.make_normal_handle();
                const ref::Params p = params_of(c, n);
                constexpr int kIters = 6;
                std::vector<std::unique_ptr<Inputs>> ins;
                std::vector<std::unique_ptr<DeviceArray<uint16_t>>> outs;
                std::vector<std::vector<ref::Routing>> routings;
                std::vector<std::vector<std::vector<uint16_t>>> payloads;
                const std::vector<Scenario> scs = {Scenario::kUniform, Scenario::kSkewed,      Scenario::kMixedCounts,
                                                   Scenario::kOneRank, Scenario::kSomeDropped, Scenario::kSparse};
                for (int i = 0; i < kIters; ++i) {
                    routings.push_back(
                        ref::make_routing(scs[static_cast<size_t>(i)], p, c.max_tokens_per_rank, seed + 10 * i));
                    std::vector<std::vector<uint16_t>> x_all;
                    for (int r = 0; r < n; ++r) {
                        x_all.push_back(ref::payload_rows(r, routings.back()[static_cast<size_t>(r)].num_tokens,
                                                          c.hidden, seed + static_cast<uint32_t>(i), false));
                    }
                    payloads.push_back(x_all);
                    ins.push_back(std::make_unique<Inputs>(c, rs.s));
                    ins.back()->load(routings.back()[static_cast<size_t>(me)], x_all[static_cast<size_t>(me)]);
                    outs.push_back(std::make_unique<DeviceArray<uint16_t>>(
                        static_cast<size_t>(c.max_tokens_per_rank) * c.hidden, rs.s));
                    outs.back()->poison(0xFF);
                }
                // y = recv_x in place and unchanged (the identity expert): y rows are the payloads.
                const auto check_out = [&](int i, const DeviceArray<uint16_t>& out, const std::string& what) {
                    const ref::NormalPlan plan = ref::reference_normal_plan(p, routings[static_cast<size_t>(i)]);
                    std::vector<std::vector<uint16_t>> y_all(static_cast<size_t>(n));
                    for (int r = 0; r < n; ++r) {
                        auto& yr = y_all[static_cast<size_t>(r)];
                        yr.assign(plan.rows[static_cast<size_t>(r)].size() * static_cast<size_t>(c.hidden), 0);
                        for (size_t row = 0; row < plan.rows[static_cast<size_t>(r)].size(); ++row) {
                            const ref::RowSource src = plan.rows[static_cast<size_t>(r)][row];
                            if (src.src < 0) continue;
                            std::copy_n(&payloads[static_cast<size_t>(i)][static_cast<size_t>(src.src)]
                                                 [static_cast<size_t>(src.token) * c.hidden],
                                        c.hidden, &yr[row * static_cast<size_t>(c.hidden)]);
                        }
                    }
                    const int t = routings[static_cast<size_t>(i)][static_cast<size_t>(me)].num_tokens;
                    ref::collective_check(world, [&] {
                        check_combine(p, plan, routings[static_cast<size_t>(i)], y_all,
                                      download(out.get(), static_cast<size_t>(t) * c.hidden, rs.s), me, what);
                    });
                };
                const auto out_view = [&](int i) {
                    return TensorView(outs[static_cast<size_t>(i)]->get(), DType::kBF16,
                                      {routings[static_cast<size_t>(i)][static_cast<size_t>(me)].num_tokens, c.hidden});
                };
                // Back to back on one handle, no host synchronisation in between.
                for (int i = 0; i < kIters; ++i) {
                    ep.dispatch(ha, ins[static_cast<size_t>(i)]->x_view(), ins[static_cast<size_t>(i)]->idx_view(),
                                ins[static_cast<size_t>(i)]->w_view(), rs.s);
                    ep.combine(ha, ha.recv_x(), out_view(i), rs.s);
                }
                ep.sync_and_check(rs.s);
                for (int i = 0; i < kIters; ++i)
                    check_out(i, *outs[static_cast<size_t>(i)], "back-to-back call " + std::to_string(i));
                // Interleaved: dispatch A, dispatch B, combine A, combine B (twice over), then a double combine.
                for (int round = 0; round < 2; ++round) {
                    const int ia = 2 * round;
                    const int ib = 2 * round + 1;
                    outs[static_cast<size_t>(ia)]->poison(0xFF);
                    outs[static_cast<size_t>(ib)]->poison(0xFF);
                    ep.dispatch(ha, ins[static_cast<size_t>(ia)]->x_view(), ins[static_cast<size_t>(ia)]->idx_view(),
                                ins[static_cast<size_t>(ia)]->w_view(), rs.s);
                    ep.dispatch(hb, ins[static_cast<size_t>(ib)]->x_view(), ins[static_cast<size_t>(ib)]->idx_view(),
                                ins[static_cast<size_t>(ib)]->w_view(), rs.s);
                    ep.combine(ha, ha.recv_x(), out_view(ia), rs.s);
                    ep.combine(hb, hb.recv_x(), out_view(ib), rs.s);
                }
                ep.sync_and_check(rs.s);
                ref::collective_check(world, [&] { check_out(2, *outs[2], "interleaved A"); });
                ref::collective_check(world, [&] { check_out(3, *outs[3], "interleaved B"); });
                outs[4]->poison(0xFF);
                outs[5]->poison(0xFF);
                ep.dispatch(ha, ins[4]->x_view(), ins[4]->idx_view(), ins[4]->w_view(), rs.s);
                ep.combine(ha, ha.recv_x(), out_view(4), rs.s);
                ep.combine(ha, ha.recv_x(),
                           TensorView(outs[5]->get(), DType::kBF16,
                                      {routings[4][static_cast<size_t>(me)].num_tokens, c.hidden}),
                           rs.s);
                ep.sync_and_check(rs.s);
                ref::collective_check(world, [&] { check_out(4, *outs[4], "first combine of one dispatch"); });
                ref::collective_check(world, [&] { check_out(4, *outs[5], "second combine of the same dispatch"); });
            },
            options_for(c, n, 2));
    }
}

// One dispatch + combine captured in a CUDA graph per rank, replayed with new routing and payloads.
TEST_F(EpNormalGpu, GraphReplayWithChangingRouting) {
    const uint32_t seed = fresh_seed();
    const int n = 4;
    const Config c = normal_config(n);
    run_ranks(
        n,
        [&](World& world) {
            NormalRank rank(world, c);
            auto& [rs, me, p, ep, h, in] = rank;
            DeviceArray<uint16_t> out(static_cast<size_t>(c.max_tokens_per_rank) * c.hidden, rs.s);
            // T fixed per rank (a graph fixes shapes); it differs between ranks.
            const int t = c.max_tokens_per_rank - 7 * me;
            in.num_tokens = t;
            cudaGraph_t graph = nullptr;
            cudaGraphExec_t exec = nullptr;
            WEFT_CUDA_CHECK(cudaStreamBeginCapture(rs.s, cudaStreamCaptureModeThreadLocal));
            ep.dispatch(h, in.x_view(), in.idx_view(), in.w_view(), rs.s);
            ep.combine(h, h.recv_x(), TensorView(out.get(), DType::kBF16, {t, c.hidden}), rs.s);
            WEFT_CUDA_CHECK(cudaStreamEndCapture(rs.s, &graph));
            WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            for (int replay = 0; replay < 4; ++replay) {
                const Scenario sc = replay % 2 == 0 ? Scenario::kUniform : Scenario::kSkewed;
                auto all = ref::make_routing(sc, p, c.max_tokens_per_rank, seed + static_cast<uint32_t>(replay));
                for (int r = 0; r < n; ++r) {  // the captured T of every rank
                    ref::Routing& rt = all[static_cast<size_t>(r)];
                    const int tr = c.max_tokens_per_rank - 7 * r;
                    while (rt.num_tokens < tr) {  // pad with tokens of the same scenario's first token
                        for (int j = 0; j < p.topk; ++j) {
                            rt.topk_idx.push_back(rt.topk_idx[static_cast<size_t>(j)]);
                            rt.topk_weights.push_back(0.25f);
                        }
                        ++rt.num_tokens;
                    }
                    rt.num_tokens = tr;
                    rt.topk_idx.resize(static_cast<size_t>(tr) * p.topk);
                    rt.topk_weights.resize(static_cast<size_t>(tr) * p.topk);
                }
                std::vector<std::vector<uint16_t>> x_all;
                for (int r = 0; r < n; ++r) {
                    x_all.push_back(ref::payload_rows(r, all[static_cast<size_t>(r)].num_tokens, c.hidden,
                                                      seed + 100 + static_cast<uint32_t>(replay), false));
                }
                in.load(all[static_cast<size_t>(me)], x_all[static_cast<size_t>(me)]);
                out.poison(0xFF);
                WEFT_CUDA_CHECK(cudaGraphLaunch(exec, rs.s));
                ep.sync_and_check(rs.s);
                const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
                const std::string what = "graph replay " + std::to_string(replay);
                ref::collective_check(
                    world, [&] { check_dispatch(p, plan, x_all, h, me, t, ep.geometry().max_recv_rows, rs.s, what); });
                std::vector<std::vector<uint16_t>> y_all(static_cast<size_t>(n));
                for (int r = 0; r < n; ++r) {
                    for (const ref::RowSource& src : plan.rows[static_cast<size_t>(r)]) {
                        for (int ch = 0; ch < c.hidden; ++ch) {
                            y_all[static_cast<size_t>(r)].push_back(
                                src.src < 0 ? 0
                                            : x_all[static_cast<size_t>(src.src)]
                                                   [static_cast<size_t>(src.token) * c.hidden + ch]);
                        }
                    }
                }
                ref::collective_check(world, [&] {
                    check_combine(p, plan, all, y_all, download(out.get(), static_cast<size_t>(t) * c.hidden, rs.s), me,
                                  what);
                });
            }
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(graph);
        },
        options_for(c, n, 1));
}

// A rank that arrives late at the dispatch, another late at the combine: the others wait (bounded) and
// the results are exact.
TEST_F(EpNormalGpu, StragglersAreWaitedFor) {
    const uint32_t seed = fresh_seed();
    const int n = 5;
    const Config c = normal_config(n);
    run_ranks(
        n,
        [&](World& world) {
            RankStream rs;
            const int me = world.rank();
            jit::KernelSpec delay_spec;
            delay_spec.header = "ep/testing.cuh";
            delay_spec.instantiation = "weft::kernels::ep::delay";
            jit::Kernel& delay = jit::compiler().get_kernel(delay_spec);  // loaded before anything spins
            Buffer ep(world, c);
            NormalHandle h = ep.make_normal_handle();
            const ref::Params p = params_of(c, n);
            Inputs in(c, rs.s);
            DeviceArray<uint16_t> y(static_cast<size_t>(ep.geometry().max_recv_rows) * c.hidden, rs.s);
            DeviceArray<uint16_t> out(static_cast<size_t>(c.max_tokens_per_rank) * c.hidden, rs.s);
            const auto all = ref::make_routing(Scenario::kUniform, p, c.max_tokens_per_rank, seed);
            std::vector<std::vector<uint16_t>> x_all;
            for (int r = 0; r < n; ++r)
                x_all.push_back(ref::payload_rows(r, all[static_cast<size_t>(r)].num_tokens, c.hidden, seed, false));
            in.load(all[static_cast<size_t>(me)], x_all[static_cast<size_t>(me)]);
            const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
            const auto y_all = expected_y(p, plan, x_all, ep.geometry().max_recv_rows);
            y.upload(y_all[static_cast<size_t>(me)]);
            out.poison(0xFF);
            const uint64_t late_ns = 300ull * 1000 * 1000;
            if (me == n - 1) delay.launch({.grid = dim3(1), .block = dim3(1), .stream = rs.s}, late_ns);
            ep.dispatch(h, in.x_view(), in.idx_view(), in.w_view(), rs.s);
            if (me == 0) delay.launch({.grid = dim3(1), .block = dim3(1), .stream = rs.s}, late_ns);
            const int t = all[static_cast<size_t>(me)].num_tokens;
            ep.combine(h, TensorView(y.get(), DType::kBF16, {ep.geometry().max_recv_rows, c.hidden}),
                       TensorView(out.get(), DType::kBF16, {t, c.hidden}), rs.s);
            ep.sync_and_check(rs.s);
            ref::collective_check(world, [&] {
                check_dispatch(p, plan, x_all, h, me, t, ep.geometry().max_recv_rows, rs.s, "stragglers");
            });
            ref::collective_check(world, [&] {
                check_combine(p, plan, all, y_all, download(out.get(), static_cast<size_t>(t) * c.hidden, rs.s), me,
                              "stragglers");
            });
        },
        options_for(c, n, 1));
}

// One block per rank (the last-block election with a grid of one) and a larger hidden size.
TEST_F(EpNormalGpu, SingleBlockGridAndWideRows) {
    const uint32_t seed = fresh_seed();
    const int n = 2;
    Config c = normal_config(n);
    c.hidden = 7168;
    c.max_tokens_per_rank = 40;
    run_ranks(
        n,
        [&](World& world) {
            NormalRank rank(world, c);
            auto& [rs, me, p, ep, h, in] = rank;
            DeviceArray<uint16_t> out(static_cast<size_t>(c.max_tokens_per_rank) * c.hidden, rs.s);
            for (int sms : {1, 3}) {
                const auto all =
                    ref::make_routing(Scenario::kUniform, p, c.max_tokens_per_rank, seed + static_cast<uint32_t>(sms));
                std::vector<std::vector<uint16_t>> x_all;
                for (int r = 0; r < n; ++r)
                    x_all.push_back(
                        ref::payload_rows(r, all[static_cast<size_t>(r)].num_tokens, c.hidden, seed, false));
                in.load(all[static_cast<size_t>(me)], x_all[static_cast<size_t>(me)]);
                const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
                const int t = all[static_cast<size_t>(me)].num_tokens;
                out.poison(0xFF);
                ep.dispatch(h, in.x_view(), in.idx_view(), in.w_view(), rs.s, NormalOptions{.num_sms = sms});
                ep.combine(h, h.recv_x(), TensorView(out.get(), DType::kBF16, {t, c.hidden}), rs.s,
                           NormalOptions{.num_sms = sms});
                ep.sync_and_check(rs.s);
                const std::string what = "num_sms " + std::to_string(sms);
                ref::collective_check(
                    world, [&] { check_dispatch(p, plan, x_all, h, me, t, ep.geometry().max_recv_rows, rs.s, what); });
                std::vector<std::vector<uint16_t>> y_all(static_cast<size_t>(n));
                for (int r = 0; r < n; ++r) {
                    for (const ref::RowSource& src : plan.rows[static_cast<size_t>(r)]) {
                        for (int ch = 0; ch < c.hidden; ++ch) {
                            y_all[static_cast<size_t>(r)].push_back(
                                src.src < 0 ? 0
                                            : x_all[static_cast<size_t>(src.src)]
                                                   [static_cast<size_t>(src.token) * c.hidden + ch]);
                        }
                    }
                }
                ref::collective_check(world, [&] {
                    check_combine(p, plan, all, y_all, download(out.get(), static_cast<size_t>(t) * c.hidden, rs.s), me,
                                  what);
                });
            }
        },
        options_for(c, n, 1));
}

}  // namespace
}  // namespace weft::ops::ep
