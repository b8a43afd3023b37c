// SPDX-License-Identifier: MIT
// GPU tests of low-latency expert-parallel dispatch/combine, ranks sharing the GPU: masked outputs, counts and
// sources checked exactly (bf16, and fp8 codes and scales against the host quantiser), combine against the host
// reference; split halves, call orders, CUDA-graph replay and stragglers.
#include <gtest/gtest.h>

#include <algorithm>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <random>

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

class EpLowLatencyGpu : public ::testing::Test {
protected:
    void SetUp() override { ASSERT_TRUE(cuda_available()) << "the gpu tier needs a CUDA driver and a GPU"; }
};

Config ll_config(int num_ranks) {
    Config c;
    c.num_experts = num_ranks * (num_ranks % 2 == 1 ? 3 : 4);
    c.hidden = 384;  // 3 fp8 groups; 768-byte rows: partial chunks
    c.topk = num_ranks % 2 == 1 ? 3 : 4;
    c.max_tokens_per_rank = 40;
    c.normal = false;
    return c;
}

ref::Params params_of(const Config& c, int num_ranks) {
    ref::Params p;
    p.num_ranks = num_ranks;
    p.num_experts = c.num_experts;
    p.topk = c.topk;
    p.hidden = c.hidden;
    return p;
}

WorldOptions options_for(const Config& c, int num_ranks) {
    WorldOptions o = test::test_options();
    o.heap_bytes = std::max<uint64_t>(64ull << 20, footprint(c, num_ranks).heap_bytes(0) + (16ull << 20));
    return o;
}

using Call = ref::LowLatencyCall;

Call make_call(const ref::Params& p, Scenario sc, int max_tokens, uint32_t seed, bool fp8_friendly) {
    return ref::low_latency_call(p, ref::make_routing(sc, p, max_tokens, seed), seed, fp8_friendly);
}

struct Inputs {
    DeviceArray<uint16_t> x;
    DeviceArray<int32_t> idx;
    DeviceArray<float> w;
    int num_tokens = 0;
    const Config& c;
    Inputs(const Config& cfg, cudaStream_t s)
        : x(static_cast<size_t>(cfg.max_tokens_per_rank + 1) * cfg.hidden, s),
          idx(static_cast<size_t>(cfg.max_tokens_per_rank + 1) * cfg.topk, s),
          w(static_cast<size_t>(cfg.max_tokens_per_rank + 1) * cfg.topk, s),
          c(cfg) {}
    void load(const Call& call, int me) {
        num_tokens = call.all[static_cast<size_t>(me)].num_tokens;
        x.upload(call.x_all[static_cast<size_t>(me)]);
        idx.upload(call.all[static_cast<size_t>(me)].topk_idx);
        w.upload(call.all[static_cast<size_t>(me)].topk_weights);
    }
    TensorView x_view() const { return TensorView(x.get(), DType::kBF16, {num_tokens, c.hidden}); }
    TensorView idx_view() const { return TensorView(idx.get(), DType::kI32, {num_tokens, c.topk}); }
    TensorView w_view() const { return TensorView(w.get(), DType::kF32, {num_tokens, c.topk}); }
};

/// Checks a handle's counts, sources and rows (bf16 exactly; fp8 codes and scales against the host
/// quantiser, and the dequantised values within the e4m3 bound of the original).
void check_dispatch(const ref::Params& p, const Call& call, const LowLatencyHandle& h, bool fp8, int me, int max_tokens,
                    cudaStream_t s, const std::string& what) {
    const LowLatencyHandleView& v = h.view();
    const size_t el = static_cast<size_t>(p.local_experts());
    const size_t rpe = static_cast<size_t>(p.num_ranks) * static_cast<size_t>(max_tokens);
    const size_t hsz = static_cast<size_t>(p.hidden);
    const size_t row_bytes = fp8 ? hsz : 2 * hsz;
    const size_t groups = hsz / 128;
    const auto fail = [&](const std::string& m) {
        WEFT_FAIL("rank " << me << ", " << what << (fp8 ? " fp8" : " bf16") << ": " << m);
    };
    const std::vector<int32_t> counts = download(v.expert_counts, el, s);
    const std::vector<int32_t> src = download(v.recv_src_info, el * rpe, s);
    const std::vector<uint8_t> data = download(v.recv_x, el * rpe * row_bytes, s);
    const std::vector<float> scales = fp8 ? download(v.recv_scales, el * rpe * groups, s) : std::vector<float>();
    std::vector<uint8_t> codes(hsz);
    std::vector<float> want_scales(groups);
    for (size_t le = 0; le < el; ++le) {
        const auto& list = call.rows[static_cast<size_t>(me)][le];
        if (counts[le] != static_cast<int32_t>(list.size())) {
            fail("expert " + std::to_string(le) + " count " + std::to_string(counts[le]) + ", expected " +
                 std::to_string(list.size()));
        }
        for (size_t i = 0; i < list.size(); ++i) {
            const size_t row = le * rpe + i;
            const ref::RowSource rs = list[i];
            if (src[row] != rs.src * max_tokens + rs.token) {
                fail("expert " + std::to_string(le) + " row " + std::to_string(i) + " source info " +
                     std::to_string(src[row]) + ", expected rank " + std::to_string(rs.src) + " token " +
                     std::to_string(rs.token));
            }
            const uint16_t* x = &call.x_all[static_cast<size_t>(rs.src)][static_cast<size_t>(rs.token) * hsz];
            if (!fp8) {
                const auto* got = reinterpret_cast<const uint16_t*>(&data[row * row_bytes]);
                for (size_t c = 0; c < hsz; ++c) {
                    if (got[c] != x[c]) {
                        fail("expert " + std::to_string(le) + " row " + std::to_string(i) + " channel " +
                             std::to_string(c) + ": expected rank " + std::to_string(rs.src) + " token " +
                             std::to_string(rs.token) + ", found " + ref::describe_row(got));
                    }
                }
                continue;
            }
            ref::reference_quantize_row(x, p.hidden, codes.data(), want_scales.data());
            for (size_t g = 0; g < groups; ++g) {
                const float sc = scales[row * groups + g];
                if (!(sc == want_scales[g])) {
                    fail("expert " + std::to_string(le) + " row " + std::to_string(i) + " scale " + std::to_string(g) +
                         " = " + std::to_string(sc) + ", expected " + std::to_string(want_scales[g]));
                }
                for (size_t c = g * 128; c < (g + 1) * 128; ++c) {
                    const uint8_t code = data[row * row_bytes + c];
                    const float deq = ref::e4m3_to_f32(code) * sc;
                    const float orig = ref::bf16_to_f32(x[c]);
                    if (ref::e4m3_to_f32(code) != ref::e4m3_to_f32(codes[c])) {
                        fail("expert " + std::to_string(le) + " row " + std::to_string(i) + " channel " +
                             std::to_string(c) + ": code 0x" + std::to_string(code) + ", the host quantiser gives " +
                             std::to_string(codes[c]));
                    }
                    if (!std::isfinite(deq) ||
                        std::fabs(deq - orig) > std::max(std::fabs(orig) * 0.0625f, sc * 0.001f) * 1.0001f) {
                        fail("channel " + std::to_string(c) + " round trip " + std::to_string(orig) + " -> " +
                             std::to_string(deq) + " exceeds the e4m3 bound");
                    }
                }
            }
        }
    }
}

/// y rows of rank r: expert_output of the payload; rows past the count NaN.
std::vector<uint16_t> expected_y(const ref::Params& p, const Call& call, int r, int max_tokens) {
    const size_t rpe = static_cast<size_t>(p.num_ranks) * static_cast<size_t>(max_tokens);
    const size_t hsz = static_cast<size_t>(p.hidden);
    std::vector<uint16_t> y(static_cast<size_t>(p.local_experts()) * rpe * hsz, 0x7fc1);
    for (int le = 0; le < p.local_experts(); ++le) {
        const auto& list = call.rows[static_cast<size_t>(r)][static_cast<size_t>(le)];
        for (size_t i = 0; i < list.size(); ++i) {
            const uint16_t* x = &call.x_all[static_cast<size_t>(list[i].src)][static_cast<size_t>(list[i].token) * hsz];
            for (size_t c = 0; c < hsz; ++c) {
                y[(static_cast<size_t>(le) * rpe + i) * hsz + c] = ref::expert_output(x[c], r * p.local_experts() + le);
            }
        }
    }
    return y;
}

/// Checks rank me's combine output: exact emulation (fp32 fma in slot order, one bf16 rounding) and
/// the fp64 value. `y_of(r)` gives rank r's y.
void check_combine(const ref::Params& p, const Call& call, const std::function<std::vector<uint16_t>(int)>& y_of,
                   const std::vector<uint16_t>& out, int me, int max_tokens, const std::string& what) {
    const ref::Routing& r = call.all[static_cast<size_t>(me)];
    const size_t rpe = static_cast<size_t>(p.num_ranks) * static_cast<size_t>(max_tokens);
    const size_t hsz = static_cast<size_t>(p.hidden);
    std::vector<std::vector<uint16_t>> y_all;
    for (int q = 0; q < p.num_ranks; ++q) y_all.push_back(y_of(q));
    for (int t = 0; t < r.num_tokens; ++t) {
        for (size_t c = 0; c < hsz; ++c) {
            float acc = 0.0f;
            double ideal = 0.0;
            double magnitude = 0.0;
            for (int j = 0; j < p.topk; ++j) {
                const int e = ref::valid_expert(p, r, t, j);
                if (e < 0) continue;
                const int owner = p.owner(e);
                const size_t i =
                    static_cast<size_t>(call.row_of[static_cast<size_t>(me)][static_cast<size_t>(t) * p.topk + j]);
                const size_t le = static_cast<size_t>(e - owner * p.local_experts());
                const float y = ref::bf16_to_f32(y_all[static_cast<size_t>(owner)][(le * rpe + i) * hsz + c]);
                const float w = r.topk_weights[static_cast<size_t>(t) * p.topk + j];
                acc = std::fma(w, y, acc);
                ideal += static_cast<double>(w) * y;
                magnitude += std::fabs(static_cast<double>(w) * y);
            }
            const uint16_t want = ref::f32_to_bf16(acc);
            const uint16_t got = out[static_cast<size_t>(t) * hsz + c];
            if (got != want) {
                WEFT_FAIL("rank " << me << ", " << what << ": combine out[" << t << "][" << c << "] = "
                                  << ref::bf16_to_f32(got) << ", the exact emulation gives " << ref::bf16_to_f32(want));
            }
            // fp32 accumulation (~k * 2^-24 of the magnitude) and one bf16 rounding (2^-9 of the value).
            if (std::fabs(ref::bf16_to_f32(got) - ideal) > 4e-3 * std::fabs(ideal) + 1e-5 * magnitude + 1e-6) {
                WEFT_FAIL("rank " << me << ", " << what << ": combine out[" << t << "][" << c << "] far from "
                                  << ideal);
            }
        }
    }
}

TensorView y_view(const void* data, const ref::Params& p, int max_tokens) {
    return TensorView(const_cast<void*>(data), DType::kBF16,
                      {p.local_experts(), static_cast<int64_t>(p.num_ranks) * max_tokens, p.hidden});
}

/// One rank's low-latency set-up: its stream, Buffer and one handle, its inputs, y (every local expert's rows, each
/// source's max_tokens) and out ([max_tokens, H]). Tests name the parts with a structured binding.
struct LlRank {
    RankStream rs;
    int me;
    ref::Params p;
    Buffer ep;
    LowLatencyHandle h;
    Inputs in;
    DeviceArray<uint16_t> y;
    DeviceArray<uint16_t> out;
    LlRank(World& world, const Config& c)
        : me(world.rank()),
          p(params_of(c, world.num_ranks())),
          ep(world, c),
          h(ep.make_low_latency_handle()),
          in(c, rs.s),
          y(static_cast<size_t>(p.local_experts()) * world.num_ranks() * c.max_tokens_per_rank * c.hidden, rs.s),
          out(static_cast<size_t>(c.max_tokens_per_rank) * c.hidden, rs.s) {}
};

// Every routing scenario at world sizes 2..8, bf16 and fp8 dispatch, then the combine.
TEST_F(EpLowLatencyGpu, RoutingScenariosAtEveryWorldSize) {
    const uint32_t seed = fresh_seed();
    for (int n = 2; n <= 8; ++n) {
        SCOPED_TRACE("num_ranks " + std::to_string(n));
        const Config c = ll_config(n);
        run_ranks(
            n,
            [&](World& world) {
                LlRank rank(world, c);
                auto& [rs, me, p, ep, h, in, y, out] = rank;
                const size_t y_elems = static_cast<size_t>(p.local_experts()) * n * c.max_tokens_per_rank * c.hidden;
                int i = 0;
                for (Scenario sc : ref::all_scenarios()) {
                    for (bool fp8 : {false, true}) {
                        const std::string what = ref::scenario_name(sc);
                        const Call call =
                            make_call(p, sc, c.max_tokens_per_rank, seed + static_cast<uint32_t>(i++), fp8);
                        in.load(call, me);
                        WEFT_CUDA_CHECK(
                            cudaMemsetAsync(const_cast<uint8_t*>(h.view().recv_x), 0xEE, y_elems * 2, rs.s));
                        // Some calls on one block (the last-block election with a grid of one), most on the default.
                        const int sms = i % 3 == 0 ? 1 : 0;
                        ep.low_latency_dispatch(h, in.x_view(), in.idx_view(), rs.s,
                                                LowLatencyOptions{.fp8 = fp8, .num_sms = sms});
                        ep.sync_and_check(rs.s);
                        ref::collective_check(
                            world, [&] { check_dispatch(p, call, h, fp8, me, c.max_tokens_per_rank, rs.s, what); });
                        // y: the host's expert outputs (independent of the dispatch's data); in place for bf16.
                        const std::vector<uint16_t> y_me = expected_y(p, call, me, c.max_tokens_per_rank);
                        TensorView yv;
                        if (!fp8 && (i % 4) == 1) {
                            WEFT_CUDA_CHECK(cudaMemcpyAsync(h.recv_x().data, y_me.data(), y_me.size() * 2,
                                                            cudaMemcpyHostToDevice, rs.s));
                            yv = h.recv_x();
                        } else {
                            y.upload(y_me);
                            yv = y_view(y.get(), p, c.max_tokens_per_rank);
                        }
                        out.poison(0xFF);
                        ep.low_latency_combine(h, yv, in.idx_view(), in.w_view(),
                                               TensorView(out.get(), DType::kBF16, {in.num_tokens, c.hidden}), rs.s,
                                               LowLatencyOptions{.num_sms = sms});
                        ep.sync_and_check(rs.s);
                        ref::collective_check(world, [&] {
                            check_combine(
                                p, call, [&](int r) { return expected_y(p, call, r, c.max_tokens_per_rank); },
                                download(out.get(), static_cast<size_t>(in.num_tokens) * c.hidden, rs.s), me,
                                c.max_tokens_per_rank, what);
                        });
                    }
                }
            },
            options_for(c, n));
    }
}

// Split halves: send A, send B, receive A, receive B, then the combines the same way, three rounds with
// no host synchronisation (parity and credits wrap around); y = recv_x in place (identity expert).
TEST_F(EpLowLatencyGpu, SplitHalvesInterleavedBackToBack) {
    const uint32_t seed = fresh_seed();
    for (int n : {3, 4}) {
        const Config c = ll_config(n);
        run_ranks(
            n,
            [&](World& world) {
                RankStream rs;
                const int me = world.rank();
                Buffer ep(world, c);
                const ref::Params p = params_of(c, n);
                constexpr int kRounds = 3;
                std::vector<Call> calls;
                std::vector<std::unique_ptr<Inputs>> ins;
                std::vector<std::unique_ptr<DeviceArray<uint16_t>>> outs;
                std::vector<LowLatencyHandle> handles;
                const std::vector<Scenario> scs = {Scenario::kUniform, Scenario::kSkewed,      Scenario::kMixedCounts,
                                                   Scenario::kOneRank, Scenario::kSomeDropped, Scenario::kSparse};
                for (int i = 0; i < 2 * kRounds; ++i) {
                    calls.push_back(
                        make_call(p, scs[static_cast<size_t>(i)], c.max_tokens_per_rank, seed + 7 * i, false));
                    ins.push_back(std::make_unique<Inputs>(c, rs.s));
                    ins.back()->load(calls.back(), me);
                    outs.push_back(std::make_unique<DeviceArray<uint16_t>>(
                        static_cast<size_t>(c.max_tokens_per_rank) * c.hidden, rs.s));
                    outs.back()->poison(0xFF);
                    handles.push_back(ep.make_low_latency_handle());
                }
                const LowLatencyOptions send{.phase = Phase::kSend};
                const LowLatencyOptions recv{.phase = Phase::kRecv};
                for (int round = 0; round < kRounds; ++round) {
                    const int a = 2 * round;
                    const int b = 2 * round + 1;
                    auto& ia = *ins[static_cast<size_t>(a)];
                    auto& ib = *ins[static_cast<size_t>(b)];
                    ep.low_latency_dispatch(handles[static_cast<size_t>(a)], ia.x_view(), ia.idx_view(), rs.s, send);
                    ep.low_latency_dispatch(handles[static_cast<size_t>(b)], ib.x_view(), ib.idx_view(), rs.s, send);
                    ep.low_latency_dispatch(handles[static_cast<size_t>(a)], TensorView(), TensorView(), rs.s, recv);
                    ep.low_latency_dispatch(handles[static_cast<size_t>(b)], TensorView(), TensorView(), rs.s, recv);
                    const auto out_view = [&](int i) {
                        return TensorView(outs[static_cast<size_t>(i)]->get(), DType::kBF16,
                                          {ins[static_cast<size_t>(i)]->num_tokens, c.hidden});
                    };
                    ep.low_latency_combine(handles[static_cast<size_t>(a)], handles[static_cast<size_t>(a)].recv_x(),
                                           ia.idx_view(), ia.w_view(), out_view(a), rs.s, send);
                    ep.low_latency_combine(handles[static_cast<size_t>(b)], handles[static_cast<size_t>(b)].recv_x(),
                                           ib.idx_view(), ib.w_view(), out_view(b), rs.s, send);
                    ep.low_latency_combine(handles[static_cast<size_t>(a)], TensorView(), ia.idx_view(), ia.w_view(),
                                           out_view(a), rs.s, recv);
                    ep.low_latency_combine(handles[static_cast<size_t>(b)], TensorView(), ib.idx_view(), ib.w_view(),
                                           out_view(b), rs.s, recv);
                }
                ep.sync_and_check(rs.s);
                for (int i = 0; i < 2 * kRounds; ++i) {
                    const Call& call = calls[static_cast<size_t>(i)];
                    const std::string what = "split call " + std::to_string(i);
                    ref::collective_check(world, [&] {
                        check_dispatch(p, call, handles[static_cast<size_t>(i)], false, me, c.max_tokens_per_rank, rs.s,
                                       what);
                    });
                    // Identity expert: y rows are the received payloads.
                    const auto y_of = [&](int r) {
                        const size_t rpe = static_cast<size_t>(n) * c.max_tokens_per_rank;
                        std::vector<uint16_t> y(static_cast<size_t>(p.local_experts()) * rpe * c.hidden, 0);
                        for (int le = 0; le < p.local_experts(); ++le) {
                            const auto& list = call.rows[static_cast<size_t>(r)][static_cast<size_t>(le)];
                            for (size_t k = 0; k < list.size(); ++k) {
                                std::copy_n(&call.x_all[static_cast<size_t>(list[k].src)]
                                                       [static_cast<size_t>(list[k].token) * c.hidden],
                                            c.hidden, &y[(static_cast<size_t>(le) * rpe + k) * c.hidden]);
                            }
                        }
                        return y;
                    };
                    ref::collective_check(world, [&] {
                        check_combine(
                            p, call, y_of,
                            download(outs[static_cast<size_t>(i)]->get(),
                                     static_cast<size_t>(ins[static_cast<size_t>(i)]->num_tokens) * c.hidden, rs.s),
                            me, c.max_tokens_per_rank, what);
                    });
                }
            },
            options_for(c, n));
    }
}

// Call-order and capacity errors are host errors raised before anything is launched, on every rank.
TEST_F(EpLowLatencyGpu, CallOrderAndCapacityErrorsAreHostErrors) {
    const uint32_t seed = fresh_seed();
    const int n = 2;
    const Config c = ll_config(n);
    run_ranks(
        n,
        [&](World& world) {
            RankStream rs;
            const int me = world.rank();
            Buffer ep(world, c);
            const ref::Params p = params_of(c, n);
            const Call call = make_call(p, Scenario::kUniform, c.max_tokens_per_rank, seed, false);
            Inputs in(c, rs.s);
            in.load(call, me);
            LowLatencyHandle a = ep.make_low_latency_handle();
            LowLatencyHandle b = ep.make_low_latency_handle();
            LowLatencyHandle d = ep.make_low_latency_handle();
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
            const LowLatencyOptions send{.phase = Phase::kSend};
            const LowLatencyOptions recv{.phase = Phase::kRecv};
            const int64_t too_many = c.max_tokens_per_rank + 1;
            expect_error(
                [&] {
                    ep.low_latency_dispatch(a, TensorView(in.x.get(), DType::kBF16, {too_many, c.hidden}),
                                            TensorView(in.idx.get(), DType::kI32, {too_many, c.topk}), rs.s);
                },
                "exceed Config::max_tokens_per_rank");
            expect_error([&] { ep.low_latency_dispatch(a, TensorView(), TensorView(), rs.s, recv); },
                         "no send is outstanding");
            expect_error([&] { ep.low_latency_combine(a, a.recv_x(), in.idx_view(), in.w_view(), in.x_view(), rs.s); },
                         "has not been received");
            ep.low_latency_dispatch(a, in.x_view(), in.idx_view(), rs.s, send);
            ep.low_latency_dispatch(b, in.x_view(), in.idx_view(), rs.s, send);
            expect_error([&] { ep.low_latency_dispatch(d, in.x_view(), in.idx_view(), rs.s, send); },
                         "at most 2 sends");
            expect_error([&] { ep.low_latency_dispatch(d, in.x_view(), in.idx_view(), rs.s); }, "not received yet");
            expect_error([&] { ep.low_latency_dispatch(b, TensorView(), TensorView(), rs.s, recv); }, "not the oldest");
            expect_error(
                [&] {
                    ep.low_latency_dispatch(a, TensorView(), TensorView(), rs.s,
                                            LowLatencyOptions{.fp8 = true, .phase = Phase::kRecv});
                },
                "differs from the send");
            ep.low_latency_dispatch(a, TensorView(), TensorView(), rs.s, recv);
            ep.low_latency_dispatch(b, TensorView(), TensorView(), rs.s, recv);
            expect_error(
                [&] {
                    ep.low_latency_combine(a, a.recv_x(), in.idx_view(),
                                           TensorView(in.x.get(), DType::kF32, {in.num_tokens, c.topk}), in.x_view(),
                                           rs.s);
                },
                "out must not overlap topk_weights");
            ep.sync_and_check(rs.s);
            ref::collective_check(world, [&] {
                check_dispatch(p, call, a, false, me, c.max_tokens_per_rank, rs.s, "after the errors (a)");
            });
            ref::collective_check(world, [&] {
                check_dispatch(p, call, b, false, me, c.max_tokens_per_rank, rs.s, "after the errors (b)");
            });
            // A moved-from handle's accessors and calls name it as empty (local: no rank waits for another).
            LowLatencyHandle moved = std::move(d);
            expect_error([&] { (void)d.recv_x(); }, "the handle is empty");
            expect_error([&] { (void)d.expert_counts(); }, "the handle is empty");
            expect_error([&] { (void)d.view(); }, "the handle is empty");
            WEFT_CHECK(moved.recv_x().data != nullptr, "the handle moved to keeps its buffers");
        },
        options_for(c, n));
}

// Arguments that differ across ranks are found in the count words the ranks exchange anyway: one rank dispatches fp8,
// the other bf16 (each a valid call on its own). Every rank reports kCallMismatch naming both calls, receives nothing
// (counts 0, the combine gives zeros), nothing hangs; after clear_status the same Buffer serves matching calls
// (checked against the host reference), in both orders of the dtypes and with split halves.
TEST_F(EpLowLatencyGpu, DispatchWithFp8OnOneRankAndBf16OnTheOtherFailsOnEveryRank) {
    const uint32_t seed = fresh_seed();
    const int n = 2;
    const Config c = ll_config(n);
    run_ranks(
        n,
        [&](World& world) {
            LlRank rank(world, c);
            auto& [rs, me, p, ep, h, in, y, out] = rank;
            for (int round = 0; round < 3; ++round) {
                const Call call =
                    make_call(p, Scenario::kUniform, c.max_tokens_per_rank, seed + static_cast<uint32_t>(round), true);
                in.load(call, me);
                const std::string what = "round " + std::to_string(round);
                // Round 0: rank 0 fp8, rank 1 bf16; round 1 the other way round, split into halves; round 2 matches.
                const bool fp8 = round == 2 ? true : (me == round % 2);
                if (round == 1) {
                    ep.low_latency_dispatch(h, in.x_view(), in.idx_view(), rs.s,
                                            LowLatencyOptions{.fp8 = fp8, .phase = Phase::kSend});
                    ep.low_latency_dispatch(h, TensorView(), TensorView(), rs.s,
                                            LowLatencyOptions{.fp8 = fp8, .phase = Phase::kRecv});
                } else {
                    ep.low_latency_dispatch(h, in.x_view(), in.idx_view(), rs.s, LowLatencyOptions{.fp8 = fp8});
                }
                std::string error;
                try {
                    ep.sync_and_check(rs.s);
                } catch (const Error& e) {
                    error = e.what();
                }
                const std::vector<uint16_t> y_me = expected_y(p, call, me, c.max_tokens_per_rank);
                y.upload(y_me);
                out.poison(0xFF);
                // The combine completes the exchange whatever the dispatch found (it never refuses on the status).
                ep.low_latency_combine(h, y_view(y.get(), p, c.max_tokens_per_rank), in.idx_view(), in.w_view(),
                                       TensorView(out.get(), DType::kBF16, {in.num_tokens, c.hidden}), rs.s);
                world.sync_and_check(rs.s);
                const std::vector<uint16_t> got =
                    download(out.get(), static_cast<size_t>(in.num_tokens) * c.hidden, rs.s);
                if (round == 2) {
                    WEFT_CHECK(error.empty(), "rank " << me << ", " << what << ": matching calls failed: " << error);
                    ep.check();
                    ref::collective_check(
                        world, [&] { check_dispatch(p, call, h, true, me, c.max_tokens_per_rank, rs.s, what); });
                    ref::collective_check(world, [&] {
                        check_combine(
                            p, call, [&](int r) { return expected_y(p, call, r, c.max_tokens_per_rank); }, got, me,
                            c.max_tokens_per_rank, what);
                    });
                    continue;
                }
                const int peer = 1 - me;
                const std::string mine = fp8 ? "rank " + std::to_string(me) + " called it with fp8"
                                             : "rank " + std::to_string(me) + " called it with bf16";
                const std::string theirs =
                    std::string("rank ") + std::to_string(peer) + " with " + (fp8 ? "bf16" : "fp8");
                ref::collective_check(world, [&] {
                    WEFT_CHECK(!error.empty(), "rank " << me << ", " << what << ": no error for differing calls");
                    for (const std::string& frag : {std::string("low-latency dispatch"), std::string("differs from"),
                                                    mine, theirs, std::string("nothing was received")}) {
                        WEFT_CHECK(error.find(frag) != std::string::npos,
                                   "rank " << me << ", " << what << ": the error lacks '" << frag << "': " << error);
                    }
                    const std::vector<int32_t> counts =
                        download(h.view().expert_counts, static_cast<size_t>(p.local_experts()), rs.s);
                    for (size_t le = 0; le < counts.size(); ++le) {
                        WEFT_CHECK(counts[le] == 0, "rank " << me << ", " << what << ": expert " << le << " received "
                                                            << counts[le] << " rows from differing calls");
                    }
                    for (size_t i = 0; i < got.size(); ++i) {
                        WEFT_CHECK(got[i] == 0, "rank " << me << ", " << what << ": combine out element " << i
                                                        << " is 0x" << std::hex << got[i] << ", expected 0");
                    }
                });
                // The status stays set until cleared: check() throws it (the next call would log it and go ahead);
                // clear it and go on.
                ref::collective_check(world, [&] {
                    bool threw = false;
                    try {
                        ep.check();
                    } catch (const Error&) {
                        threw = true;
                    }
                    WEFT_CHECK(threw, "rank " << me << ", " << what << ": check() did not throw the pending mismatch");
                });
                ep.clear_status();
            }
        },
        options_for(c, n));
}

// A combine given another topk_idx than its dispatch's (one slot of one token of rank 0 changed) reports
// kCombineRoutingMismatch naming that token on rank 0 and writes that token's row as zeros; every other row is the
// combine of the dispatch's routing (bit for bit the previous round's, which combined with the same topk_idx), and rank
// 1, whose topk_idx is unchanged, reports nothing. Split halves and one launch alike.
TEST_F(EpLowLatencyGpu, CombineGivenAnotherTopkIdxThanItsDispatchReportsTheToken) {
    const uint32_t seed = fresh_seed();
    const int n = 2;
    const Config c = ll_config(n);
    run_ranks(
        n,
        [&](World& world) {
            LlRank rank(world, c);
            auto& [rs, me, p, ep, h, in, y, out] = rank;
            DeviceArray<int32_t> other_idx(static_cast<size_t>(c.max_tokens_per_rank) * c.topk, rs.s);
            const Call call = make_call(p, Scenario::kUniform, c.max_tokens_per_rank, seed, true);
            in.load(call, me);
            y.upload(expected_y(p, call, me, c.max_tokens_per_rank));
            const int t0 = in.num_tokens / 2;
            std::vector<int32_t> changed = call.all[static_cast<size_t>(me)].topk_idx;
            if (me == 0) {
                int32_t* row = changed.data() + static_cast<size_t>(t0) * c.topk;
                int32_t absent = 0;
                while (std::find(row, row + c.topk, absent) != row + c.topk) ++absent;
                row[0] = row[0] == -1 ? absent : -1;
            }
            other_idx.upload(changed);
            const TensorView other(other_idx.get(), DType::kI32, {in.num_tokens, c.topk});
            const TensorView out_view(out.get(), DType::kBF16, {in.num_tokens, c.hidden});
            const size_t elems = static_cast<size_t>(in.num_tokens) * c.hidden;
            for (const bool split : {false, true}) {
                const std::string what = split ? "split halves" : "one launch";
                std::vector<std::vector<uint16_t>> got(2);
                for (int round = 0; round < 2; ++round) {
                    const LowLatencyOptions send{.phase = split ? Phase::kSend : Phase::kSendRecv};
                    const LowLatencyOptions recv{.phase = Phase::kRecv};
                    ep.low_latency_dispatch(h, in.x_view(), in.idx_view(), rs.s, send);
                    if (split) ep.low_latency_dispatch(h, TensorView(), TensorView(), rs.s, recv);
                    out.poison(0xFF);
                    const TensorView& idx = round == 0 ? in.idx_view() : other;
                    const TensorView y_v = y_view(y.get(), p, c.max_tokens_per_rank);
                    ep.low_latency_combine(h, y_v, idx, in.w_view(), out_view, rs.s, send);
                    if (split) ep.low_latency_combine(h, TensorView(), idx, in.w_view(), out_view, rs.s, recv);
                    world.sync_and_check(rs.s);
                    got[static_cast<size_t>(round)] = download(out.get(), elems, rs.s);
                    std::string error;
                    try {
                        ep.check();
                    } catch (const Error& e) {
                        error = e.what();
                    }
                    ep.clear_status();
                    ref::collective_check(world, [&] {
                        if (round == 0 || me == 1) {
                            WEFT_CHECK(error.empty(), "rank " << me << ", " << what << ", round " << round
                                                              << ": unexpected error: " << error);
                            return;
                        }
                        for (const std::string& frag : {std::string("low-latency combine"),
                                                        "another topk_idx row for token " + std::to_string(t0),
                                                        std::string("written as zeros")}) {
                            WEFT_CHECK(error.find(frag) != std::string::npos,
                                       "rank 0, " << what << ": the error lacks '" << frag << "': " << error);
                        }
                    });
                }
                ref::collective_check(world, [&] {
                    for (size_t i = 0; i < elems; ++i) {
                        const bool zero_row = me == 0 && static_cast<int>(i / c.hidden) == t0;
                        const uint16_t want = zero_row ? uint16_t{0} : got[0][i];
                        WEFT_CHECK(got[1][i] == want, "rank " << me << ", " << what << ": out element " << i
                                                              << " (token " << i / c.hidden << ") is 0x" << std::hex
                                                              << got[1][i] << ", expected 0x" << want);
                    }
                });
            }
        },
        options_for(c, n));
}

// Two handles dispatched alike on every rank (a, then b), then combined in different orders (rank 0: a, b; rank 1:
// b, a), split halves and one launch: each combine's peer rows are of the other dispatch, so every combine on both
// ranks reports kCallMismatch naming both dispatch calls and writes zeros; then a matching dispatch and combine on the
// same Buffer are exact (the counters stayed in step).
TEST_F(EpLowLatencyGpu, RanksCombiningDispatchesInDifferentOrdersAreAMismatchOnEveryRank) {
    const uint32_t seed = fresh_seed();
    const int n = 2;
    const Config c = ll_config(n);
    run_ranks(
        n,
        [&](World& world) {
            LlRank rank(world, c);
            auto& [rs, me, p, ep, a, in, y, out] = rank;
            LowLatencyHandle b = ep.make_low_latency_handle();
            const Call call = make_call(p, Scenario::kUniform, c.max_tokens_per_rank, seed, true);
            in.load(call, me);
            y.upload(expected_y(p, call, me, c.max_tokens_per_rank));
            const TensorView y_v = y_view(y.get(), p, c.max_tokens_per_rank);
            const TensorView out_view(out.get(), DType::kBF16, {in.num_tokens, c.hidden});
            const size_t elems = static_cast<size_t>(in.num_tokens) * c.hidden;
            for (const bool split : {false, true}) {
                const LowLatencyOptions send{.phase = split ? Phase::kSend : Phase::kSendRecv};
                const LowLatencyOptions recv{.phase = Phase::kRecv};
                for (LowLatencyHandle* h : {&a, &b}) {
                    ep.low_latency_dispatch(*h, in.x_view(), in.idx_view(), rs.s, send);
                    if (split) ep.low_latency_dispatch(*h, TensorView(), TensorView(), rs.s, recv);
                }
                for (int step = 0; step < 2; ++step) {
                    const std::string what =
                        std::string(split ? "split halves" : "one launch") + ", combine " + std::to_string(step);
                    LowLatencyHandle& h = (me == 0) == (step == 0) ? a : b;
                    out.poison(0xFF);
                    ep.low_latency_combine(h, y_v, in.idx_view(), in.w_view(), out_view, rs.s, send);
                    if (split)
                        ep.low_latency_combine(h, TensorView(), in.idx_view(), in.w_view(), out_view, rs.s, recv);
                    world.sync_and_check(rs.s);
                    const std::vector<uint16_t> got = download(out.get(), elems, rs.s);
                    std::string error;
                    try {
                        ep.check();
                    } catch (const Error& e) {
                        error = e.what();
                    }
                    ep.clear_status();
                    ref::collective_check(world, [&] {
                        for (const std::string& frag :
                             {std::string("low-latency combine"), std::string("sent back rows of dispatch call"),
                              std::string("in different orders"), std::string("out of that call is zeros")}) {
                            WEFT_CHECK(error.find(frag) != std::string::npos, "rank " << me << ", " << what
                                                                                      << ": the error lacks '" << frag
                                                                                      << "': " << error);
                        }
                        for (size_t i = 0; i < got.size(); ++i) {
                            WEFT_CHECK(got[i] == 0, "rank " << me << ", " << what << ": out element " << i << " is 0x"
                                                            << std::hex << got[i] << ", expected 0");
                        }
                    });
                }
            }
            ep.low_latency_dispatch(a, in.x_view(), in.idx_view(), rs.s);
            out.poison(0xFF);
            ep.low_latency_combine(a, y_v, in.idx_view(), in.w_view(), out_view, rs.s);
            world.sync_and_check(rs.s);
            ep.check();
            const std::vector<uint16_t> got = download(out.get(), elems, rs.s);
            ref::collective_check(world, [&] {
                check_combine(
                    p, call, [&](int r) { return expected_y(p, call, r, c.max_tokens_per_rank); }, got, me,
                    c.max_tokens_per_rank, "matching combine after the mismatches");
            });
        },
        options_for(c, n));
}

// Buffers made with different Configs are refused at construction, on every rank, naming both.
TEST_F(EpLowLatencyGpu, BuffersOfDifferentConfigsAreRefusedOnEveryRank) {
    const int n = 2;
    const Config c = ll_config(n);
    run_ranks(
        n,
        [&](World& world) {
            Config mine = c;
            mine.hidden = world.rank() == 0 ? 384 : 512;
            std::string error;
            try {
                Buffer ep(world, mine);
            } catch (const Error& e) {
                error = e.what();
            }
            ref::collective_check(world, [&] {
                for (const char* frag :
                     {"Configs differ", "world rank 0", "world rank 1", "hidden = 384", "hidden = 512"}) {
                    WEFT_CHECK(error.find(frag) != std::string::npos,
                               "rank " << world.rank() << ": the error lacks '" << frag << "': " << error);
                }
            });
            Buffer same(world, c);  // the same Config on both ranks goes through
        },
        options_for(ll_config(n), n));
}

// Dispatch + combine captured in a CUDA graph per rank, replayed with new routing (fp8 and bf16 graphs).
TEST_F(EpLowLatencyGpu, GraphReplayWithChangingRouting) {
    const uint32_t seed = fresh_seed();
    const int n = 5;
    const Config c = ll_config(n);
    run_ranks(
        n,
        [&](World& world) {
            LlRank rank(world, c);
            auto& [rs, me, p, ep, h, in, y, out] = rank;
            const int t = c.max_tokens_per_rank - 3 * me;
            in.num_tokens = t;
            for (bool fp8 : {false, true}) {
                cudaGraph_t graph = nullptr;
                cudaGraphExec_t exec = nullptr;
                WEFT_CUDA_CHECK(cudaStreamBeginCapture(rs.s, cudaStreamCaptureModeThreadLocal));
                ep.low_latency_dispatch(h, in.x_view(), in.idx_view(), rs.s, LowLatencyOptions{.fp8 = fp8});
                ep.low_latency_combine(h, y_view(y.get(), p, c.max_tokens_per_rank), in.idx_view(), in.w_view(),
                                       TensorView(out.get(), DType::kBF16, {t, c.hidden}), rs.s);
                WEFT_CUDA_CHECK(cudaStreamEndCapture(rs.s, &graph));
                WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
                for (int replay = 0; replay < 3; ++replay) {
                    Call call =
                        make_call(p, replay == 1 ? Scenario::kSkewed : Scenario::kUniform, c.max_tokens_per_rank,
                                  seed + static_cast<uint32_t>(replay) + (fp8 ? 50u : 0u), fp8);
                    for (int r = 0; r < n; ++r) {  // the captured T of every rank
                        ref::Routing& rt = call.all[static_cast<size_t>(r)];
                        const int tr = c.max_tokens_per_rank - 3 * r;
                        while (rt.num_tokens < tr) {
                            for (int j = 0; j < p.topk; ++j) {
                                rt.topk_idx.push_back(rt.topk_idx[static_cast<size_t>(j)]);
                                rt.topk_weights.push_back(0.5f);
                            }
                            ++rt.num_tokens;
                        }
                        rt.num_tokens = tr;
                        rt.topk_idx.resize(static_cast<size_t>(tr) * p.topk);
                        rt.topk_weights.resize(static_cast<size_t>(tr) * p.topk);
                    }
                    const uint32_t pseed = seed + 1000u + static_cast<uint32_t>(replay);
                    call = [&] {  // rebuild rows and payloads for the final routing
                        Call fixed;
                        fixed.all = call.all;
                        for (int r = 0; r < n; ++r) {
                            fixed.x_all.push_back(ref::payload_rows(r, fixed.all[static_cast<size_t>(r)].num_tokens,
                                                                    c.hidden, pseed, fp8));
                            fixed.rows.push_back(ref::reference_low_latency_rows(p, fixed.all, r));
                        }
                        fixed.row_of.resize(static_cast<size_t>(n));
                        for (int s = 0; s < n; ++s) {
                            fixed.row_of[static_cast<size_t>(s)].assign(
                                static_cast<size_t>(fixed.all[static_cast<size_t>(s)].num_tokens) * p.topk, -1);
                        }
                        for (int r = 0; r < n; ++r) {
                            for (int le = 0; le < p.local_experts(); ++le) {
                                const auto& list = fixed.rows[static_cast<size_t>(r)][static_cast<size_t>(le)];
                                for (size_t i = 0; i < list.size(); ++i) {
                                    fixed.row_of[static_cast<size_t>(list[i].src)]
                                                [static_cast<size_t>(list[i].token) * p.topk + list[i].slot] =
                                        static_cast<int32_t>(i);
                                }
                            }
                        }
                        return fixed;
                    }();
                    in.load(call, me);
                    y.upload(expected_y(p, call, me, c.max_tokens_per_rank));
                    out.poison(0xFF);
                    WEFT_CUDA_CHECK(cudaGraphLaunch(exec, rs.s));
                    ep.sync_and_check(rs.s);
                    const std::string what = "graph replay " + std::to_string(replay);
                    ref::collective_check(
                        world, [&] { check_dispatch(p, call, h, fp8, me, c.max_tokens_per_rank, rs.s, what); });
                    ref::collective_check(world, [&] {
                        check_combine(
                            p, call, [&](int r) { return expected_y(p, call, r, c.max_tokens_per_rank); },
                            download(out.get(), static_cast<size_t>(t) * c.hidden, rs.s), me, c.max_tokens_per_rank,
                            what);
                    });
                }
                cudaGraphExecDestroy(exec);
                cudaGraphDestroy(graph);
            }
        },
        options_for(c, n));
}

// Late ranks at each half: the receive halves wait (bounded) and the results are exact.
TEST_F(EpLowLatencyGpu, StragglersAreWaitedFor) {
    const uint32_t seed = fresh_seed();
    const int n = 6;
    const Config c = ll_config(n);
    run_ranks(
        n,
        [&](World& world) {
            jit::KernelSpec delay_spec;
            delay_spec.header = "ep/testing.cuh";
            delay_spec.instantiation = "weft::kernels::ep::delay";
            jit::Kernel& delay = jit::compiler().get_kernel(delay_spec);
            LlRank rank(world, c);
            auto& [rs, me, p, ep, h, in, y, out] = rank;
            const Call call = make_call(p, Scenario::kUniform, c.max_tokens_per_rank, seed, true);
            in.load(call, me);
            y.upload(expected_y(p, call, me, c.max_tokens_per_rank));
            out.poison(0xFF);
            const uint64_t late_ns = 300ull * 1000 * 1000;
            if (me == 1) delay.launch({.grid = dim3(1), .block = dim3(1), .stream = rs.s}, late_ns);
            ep.low_latency_dispatch(h, in.x_view(), in.idx_view(), rs.s,
                                    LowLatencyOptions{.fp8 = true, .phase = Phase::kSend});
            if (me == 2) delay.launch({.grid = dim3(1), .block = dim3(1), .stream = rs.s}, late_ns);
            ep.low_latency_dispatch(h, TensorView(), TensorView(), rs.s,
                                    LowLatencyOptions{.fp8 = true, .phase = Phase::kRecv});
            if (me == n - 1) delay.launch({.grid = dim3(1), .block = dim3(1), .stream = rs.s}, late_ns);
            ep.low_latency_combine(h, y_view(y.get(), p, c.max_tokens_per_rank), in.idx_view(), in.w_view(),
                                   TensorView(out.get(), DType::kBF16, {in.num_tokens, c.hidden}), rs.s);
            ep.sync_and_check(rs.s);
            ref::collective_check(
                world, [&] { check_dispatch(p, call, h, true, me, c.max_tokens_per_rank, rs.s, "stragglers"); });
            ref::collective_check(world, [&] {
                check_combine(
                    p, call, [&](int r) { return expected_y(p, call, r, c.max_tokens_per_rank); },
                    download(out.get(), static_cast<size_t>(in.num_tokens) * c.hidden, rs.s), me, c.max_tokens_per_rank,
                    "stragglers");
            });
        },
        options_for(c, n));
}

}  // namespace
}  // namespace weft::ops::ep
