// SPDX-License-Identifier: MIT
// Benchmark of expert-parallel dispatch/combine (low-latency and normal) with DeepEP's bandwidth metric and the bytes
// that cross GPUs.
//
//   weft_bench_ep [--mode ll|normal|all] [--tokens 1,32,128,256] [--hidden 7168] [--experts 256] [--topk 8]
//                 [--iters 20] [--warmup 5] [--world 8] [--check] [--json FILE] [--trace PATH] [--trace-overhead]
//
// Ranks are threads of this process (weft::run_local) over the visible GPUs: with one GPU every rank shares
// it, no byte crosses NVLink, and the figures measure the kernels' own overhead (their "GB/s" is a rate
// of HBM work, not link bandwidth). With one GPU per rank they are the real thing. Under a launcher (weftrun,
// torchrun, srun) every process is one rank of the launched world (--world is ignored; rank 0 prints): the way to
// run a team that spans nodes, e.g. `WEFT_VIRTUAL_NODES=2 weftrun -n 4 -- weft_bench_ep --mode ll` (docs/multinode.md,
// "EP across nodes"; virtual nodes on one GPU measure correctness and overhead, not a network).
// Routing: k distinct experts per token, uniformly at random (the same draw on every rank). Timing: a
// batch of back-to-back calls per op (dispatch alone, combine alone) timed with CUDA events on every
// rank; the slowest rank's time per call counts. GB/s = the average rank's bytes / that time:
//   DeepEP metric: dispatch and combine count every received row, the rank's own included (low-latency:
//   one row per (token, expert); normal: one per (token, rank)), at the transmitted dtype;
//   crossing: only the bytes that leave a rank for another one, with weft's per-row extras (the
//   low-latency 16-byte trailer, the normal receive record).
// Normal mode defaults: tokens 4096, receive limits 1.25x the uniform expectation. The header gives GPU 0's
// device-to-device copy peak (measured at start-up): the limit of HBM work when ranks share a GPU.
// --trace-overhead times every row untraced, then traced (WEFT_TRACE; each timed batch starts with an empty buffer),
// and shows both; at world 1 (a rank dispatching to itself, nothing shared) it measures the instrumentation alone.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/json.hpp"
#include "common/peaks.hpp"
#include "common/report.hpp"
#include "common/timing.hpp"
#include "common/tracing.hpp"
#include "weft/detail/node_topology.hpp"
#include "weft/detail/team_math.hpp"
#include "weft/ops/ep.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/launch_env.hpp"
#include "weft/runtime/module_loading.hpp"
#include "weft/runtime/world.hpp"

namespace weft::bench {
namespace {

namespace ep = weft::ops::ep;

struct Options {
    std::string mode = "all";
    std::vector<int> tokens;  // empty: per-mode defaults
    int hidden = 7168;
    int experts = 256;
    int topk = 8;
    int iters = 20;
    int warmup = 5;
    std::vector<int> worlds = {8};
    bool check = false;
    std::string json;
    TraceOptions trace;
};

Options parse_options(int argc, char** argv) {
    Options o;
    Cli cli("weft_bench_ep", "expert-parallel dispatch and combine: time per call, DeepEP's GB/s and crossing GB/s");
    cli.option("--mode", "ll|normal|all", "low-latency kernels, normal kernels, or both (default all)",
               [&](const std::string& v) {
                   o.mode = parse_choice(v, "--mode", {"ll", "normal", "all"});
               });
    cli.option("--tokens", "T[,T...]", "tokens per rank (default ll: 1,32,128,256; normal: 4096)",
               [&](const std::string& v) {
                   o.tokens.clear();
                   for (int64_t t : parse_int_list(v, "--tokens", 0, 1 << 20)) o.tokens.push_back(static_cast<int>(t));
               });
    cli.int_option("--hidden", "hidden size", &o.hidden, 8, 1 << 20);
    cli.int_option("--experts", "experts in all", &o.experts, 1, ep::kMaxExperts);
    cli.int_option("--topk", "experts per token", &o.topk, 1, ep::kMaxTopk);
    cli.iters(&o.iters).warmup(&o.warmup).world(&o.worlds, 1, ep::kMaxRanks).check(&o.check).json(&o.json);
    add_trace_options(cli, &o.trace);
    cli.parse(argc, argv);
    return o;
}

uint16_t to_bf16(float f) {
    uint32_t u = 0;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f = 0;
    std::memcpy(&f, &u, 4);
    return f;
}

/// Every rank's routing (uniform, k distinct experts) and weights, from one seed.
struct Routing {
    std::vector<std::vector<int32_t>> idx;  // [rank][T * k]
    std::vector<std::vector<float>> w;
};

Routing make_routing(int world, int tokens, int experts, int topk, uint32_t seed) {
    Routing r;
    std::mt19937 rng(seed);
    std::vector<int> pool(static_cast<size_t>(experts));
    std::iota(pool.begin(), pool.end(), 0);
    std::uniform_real_distribution<float> weight(0.05f, 1.0f);
    for (int s = 0; s < world; ++s) {
        r.idx.emplace_back();
        r.w.emplace_back();
        for (int t = 0; t < tokens; ++t) {
            for (int j = 0; j < topk; ++j) {
                std::uniform_int_distribution<int> pick(j, experts - 1);
                std::swap(pool[static_cast<size_t>(j)], pool[static_cast<size_t>(pick(rng))]);
                r.idx.back().push_back(pool[static_cast<size_t>(j)]);
                r.w.back().push_back(weight(rng));
            }
        }
    }
    return r;
}

/// Rows each rank receives under a routing: per (token, expert) and per (token, rank), own and others'.
struct Traffic {
    std::vector<int64_t> routes_all, routes_remote, tokens_all, tokens_remote;  // [rank]
    std::vector<std::vector<int32_t>> expert_counts;                            // [rank][local expert]
};

Traffic count_traffic(const Routing& r, int world, int tokens, int experts, int topk) {
    Traffic tr;
    const int local = experts / world;
    tr.routes_all.assign(static_cast<size_t>(world), 0);
    tr.routes_remote = tr.tokens_all = tr.tokens_remote = tr.routes_all;
    tr.expert_counts.assign(static_cast<size_t>(world), std::vector<int32_t>(static_cast<size_t>(local), 0));
    for (int s = 0; s < world; ++s) {
        for (int t = 0; t < tokens; ++t) {
            std::vector<bool> hit(static_cast<size_t>(world), false);
            for (int j = 0; j < topk; ++j) {
                const int e = r.idx[static_cast<size_t>(s)][static_cast<size_t>(t * topk + j)];
                const int d = e / local;
                tr.routes_all[static_cast<size_t>(d)]++;
                tr.routes_remote[static_cast<size_t>(d)] += d != s;
                tr.expert_counts[static_cast<size_t>(d)][static_cast<size_t>(e % local)]++;
                hit[static_cast<size_t>(d)] = true;
            }
            for (int d = 0; d < world; ++d) {
                if (!hit[static_cast<size_t>(d)]) continue;
                tr.tokens_all[static_cast<size_t>(d)]++;
                tr.tokens_remote[static_cast<size_t>(d)] += d != s;
            }
        }
    }
    return tr;
}

struct Row {
    std::string mode, dtype, op;
    int tokens = 0, world = 0, sms = 0;
    double us = 0, deepep_gbps = 0, crossing_gbps = 0;
    std::string check;     // "", "ok", "FAILED: ..."
    double us_traced = 0;  // --trace-overhead: the same call traced (0: not measured)
};

/// Per-rank timings, gathered after the run (ms per call).
struct Timings {
    std::mutex mutex;
    std::vector<double> dispatch_ms, combine_ms;
    std::vector<std::string> errors;
    int sms = 0;
};

void device_random_bf16(void* dst, size_t count, uint32_t seed, cudaStream_t s) {
    std::vector<uint16_t> h(count);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> d(-2.0f, 2.0f);
    for (auto& v : h) v = to_bf16(d(rng));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, h.data(), count * 2, cudaMemcpyHostToDevice, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
}

void* device_alloc(size_t bytes, cudaStream_t s) {
    void* p = nullptr;
    WEFT_CUDA_CHECK(cudaMallocAsync(&p, std::max<size_t>(bytes, 16), s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    return p;
}

/// Identity expert (y = recv_x): out[t] ~ x[t] * sum of t's weights, up to bf16 roundings.
std::string check_identity(const void* x, const void* out, int tokens, int hidden, int topk,
                           const std::vector<float>& weights) {
    const size_t hsz = static_cast<size_t>(hidden);
    std::vector<uint16_t> hx(static_cast<size_t>(tokens) * hsz), ho(hx.size());
    WEFT_CUDA_CHECK(cudaMemcpy(hx.data(), x, hx.size() * 2, cudaMemcpyDeviceToHost));
    WEFT_CUDA_CHECK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
    for (int t = 0; t < tokens; ++t) {
        float sum = 0;
        for (int j = 0; j < topk; ++j) sum += weights[static_cast<size_t>(t * topk + j)];
        for (size_t ch = 0; ch < hsz; ++ch) {
            const float want = from_bf16(hx[static_cast<size_t>(t) * hsz + ch]) * sum;
            const float got = from_bf16(ho[static_cast<size_t>(t) * hsz + ch]);
            if (!(std::fabs(got - want) <= 0.03f * std::fabs(want) + 0.02f)) {
                return "FAILED: out[" + std::to_string(t) + "][" + std::to_string(ch) + "] = " + std::to_string(got) +
                       ", expected about " + std::to_string(want);
            }
        }
    }
    return "ok";
}

/// Times `n` back-to-back calls of `op` on this rank's stream, every rank at once; ms per call. A traced World starts
/// each batch with an empty trace buffer.
template <class F>
double time_batch(World& world, cudaStream_t s, int n, F&& op) {
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    start_traced_measurement(world);
    world.barrier();
    return time_batch_ms(s, 0, n, op, [&] { world.sync_and_check(s); });
}

// One (mode, dtype, tokens, world) configuration on every rank.
void run_config(World& world, const Options& o, bool low_latency, bool fp8, int tokens, const Routing& routing,
                const Traffic& traffic, Timings* timings) {
    const int me = world.rank();
    const int w = world.num_ranks();
    cudaStream_t s = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    ep::Config c;
    c.num_experts = o.experts;
    c.hidden = o.hidden;
    c.topk = o.topk;
    c.max_tokens_per_rank = std::max(1, tokens);
    c.normal = !low_latency;
    c.low_latency = low_latency;
    if (!low_latency) {
        c.max_recv_rows = ep::expected_recv_rows(c, w) * 5 / 4 + 256;
        c.max_recv_tokens = ep::expected_recv_tokens(c, w) * 5 / 4 + 64;
    }
    ep::Buffer buffer(world, c);
    const ep::Geometry& g = buffer.geometry();
    const size_t hsz = static_cast<size_t>(o.hidden);
    // Two input sets, used alternately (the next call does not find its inputs in L2).
    void* x[2];
    void* idx[2];
    void* wt[2];
    for (int b = 0; b < 2; ++b) {
        x[b] = device_alloc(static_cast<size_t>(tokens) * hsz * 2, s);
        device_random_bf16(x[b], static_cast<size_t>(tokens) * hsz, 1000u + static_cast<uint32_t>(me * 2 + b), s);
        idx[b] = device_alloc(static_cast<size_t>(tokens) * o.topk * 4, s);
        wt[b] = device_alloc(static_cast<size_t>(tokens) * o.topk * 4, s);
        WEFT_CUDA_CHECK(cudaMemcpyAsync(idx[b], routing.idx[static_cast<size_t>(me)].data(),
                                        static_cast<size_t>(tokens) * o.topk * 4, cudaMemcpyHostToDevice, s));
        WEFT_CUDA_CHECK(cudaMemcpyAsync(wt[b], routing.w[static_cast<size_t>(me)].data(),
                                        static_cast<size_t>(tokens) * o.topk * 4, cudaMemcpyHostToDevice, s));
    }
    void* out = device_alloc(static_cast<size_t>(tokens) * hsz * 2, s);
    const auto xv = [&](int i) { return TensorView(x[i & 1], DType::kBF16, {tokens, o.hidden}); };
    const auto iv = [&](int i) { return TensorView(idx[i & 1], DType::kI32, {tokens, o.topk}); };
    const auto wv = [&](int i) { return TensorView(wt[i & 1], DType::kF32, {tokens, o.topk}); };
    const TensorView ov(out, DType::kBF16, {tokens, o.hidden});
    std::string check;
    double d_ms = 0, c_ms = 0;
    int sms = 0;
    if (low_latency) {
        ep::LowLatencyHandle h = buffer.make_low_latency_handle();
        const int64_t rows = g.ll_rows_per_expert();
        void* y = device_alloc(static_cast<size_t>(g.local_experts()) * rows * hsz * 2, s);
        device_random_bf16(y, static_cast<size_t>(g.local_experts()) * rows * hsz, 77u + static_cast<uint32_t>(me), s);
        const TensorView yv = fp8 ? TensorView(y, DType::kBF16, {g.local_experts(), rows, o.hidden}) : h.recv_x();
        const ep::LowLatencyOptions opt{.fp8 = fp8};
        sms = ep::default_low_latency_sms(g.max_tokens, g.topk, world.sm_budget());
        for (int i = 0; i < o.warmup; ++i) {
            buffer.low_latency_dispatch(h, xv(i), iv(i), s, opt);
            buffer.low_latency_combine(h, fp8 ? yv : h.recv_x(), iv(i), wv(i), ov, s);
        }
        world.sync_and_check(s);
        if (o.check) {
            // Poisoned first: the warm-up's last combine may have left this very result there.
            WEFT_CUDA_CHECK(cudaMemsetAsync(out, 0xff, static_cast<size_t>(tokens) * hsz * 2, s));
            buffer.low_latency_dispatch(h, xv(0), iv(0), s, opt);
            buffer.low_latency_combine(h, fp8 ? yv : h.recv_x(), iv(0), wv(0), ov, s);
            buffer.sync_and_check(s);
            std::vector<int32_t> counts(static_cast<size_t>(g.local_experts()));
            WEFT_CUDA_CHECK(cudaMemcpy(counts.data(), h.expert_counts(), counts.size() * 4, cudaMemcpyDeviceToHost));
            check = counts == traffic.expert_counts[static_cast<size_t>(me)] ? "ok" : "FAILED: expert counts";
            if (check == "ok" && !fp8) {
                check = check_identity(x[0], out, tokens, o.hidden, o.topk, routing.w[static_cast<size_t>(me)]);
            }
        }
        d_ms = time_batch(world, s, o.iters, [&](int i) { buffer.low_latency_dispatch(h, xv(i), iv(i), s, opt); });
        c_ms = time_batch(world, s, o.iters,
                          [&](int i) { buffer.low_latency_combine(h, fp8 ? yv : h.recv_x(), iv(i), wv(i), ov, s); });
        cudaFreeAsync(y, s);
    } else {
        ep::NormalHandle h = buffer.make_normal_handle();
        sms = ep::default_normal_sms(tokens, world.sm_budget());
        for (int i = 0; i < o.warmup; ++i) {
            buffer.dispatch(h, xv(i), iv(i), wv(i), s);
            buffer.combine(h, h.recv_x(), ov, s);
        }
        world.sync_and_check(s);
        if (o.check) {
            WEFT_CUDA_CHECK(cudaMemsetAsync(out, 0xff, static_cast<size_t>(tokens) * hsz * 2, s));  // as above
            buffer.dispatch(h, xv(0), iv(0), wv(0), s);
            buffer.combine(h, h.recv_x(), ov, s);
            buffer.sync_and_check(s);
            check = check_identity(x[0], out, tokens, o.hidden, o.topk, routing.w[static_cast<size_t>(me)]);
        }
        d_ms = time_batch(world, s, o.iters, [&](int i) { buffer.dispatch(h, xv(i), iv(i), wv(i), s); });
        c_ms = time_batch(world, s, o.iters, [&](int) { buffer.combine(h, h.recv_x(), ov, s); });
    }
    {
        std::lock_guard<std::mutex> lock(timings->mutex);
        timings->dispatch_ms[static_cast<size_t>(me)] = d_ms;
        timings->combine_ms[static_cast<size_t>(me)] = c_ms;
        timings->sms = sms;
        if (!check.empty() && check != "ok") timings->errors.push_back("rank " + std::to_string(me) + ": " + check);
    }
    for (int b = 0; b < 2; ++b) {
        cudaFreeAsync(x[b], s);
        cudaFreeAsync(idx[b], s);
        cudaFreeAsync(wt[b], s);
    }
    cudaFreeAsync(out, s);
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    cudaStreamDestroy(s);
}

/// Under a launcher: every rank's (dispatch ms, combine ms, failed) into `t`'s per-rank arrays (each process measured
/// only its own rank), so that every process sees the slowest rank's time.
void gather_timings(World& world, Timings* t) {
    const int me = world.rank();
    const double mine[3] = {t->dispatch_ms[static_cast<size_t>(me)], t->combine_ms[static_cast<size_t>(me)],
                            t->errors.empty() ? 0.0 : 1.0};
    std::vector<uint8_t> bytes(sizeof(mine));
    std::memcpy(bytes.data(), mine, sizeof(mine));
    const std::vector<std::vector<uint8_t>> all = world.team().all_gather("weft.bench.ep.timings", bytes);
    for (int r = 0; r < world.num_ranks(); ++r) {
        double theirs[3] = {0, 0, 0};
        std::memcpy(theirs, all[static_cast<size_t>(r)].data(),
                    std::min(sizeof(theirs), all[static_cast<size_t>(r)].size()));
        t->dispatch_ms[static_cast<size_t>(r)] = theirs[0];
        t->combine_ms[static_cast<size_t>(r)] = theirs[1];
        if (theirs[2] != 0.0 && r != me) t->errors.push_back("rank " + std::to_string(r) + ": check failed");
    }
}

/// The nodes a World of `num_ranks` ranks, `ranks_per_host` on each host (each host's ranks consecutive), spans, as the
/// World will count them: its hosts, split into WEFT_VIRTUAL_NODES virtual nodes when set. Known before the World is
/// made, so that its heap can be sized for the team across nodes.
int nodes_of_world(int num_ranks, int ranks_per_host) {
    const int virtual_nodes = weft::detail::resolve_virtual_nodes(0, env::get("WEFT_VIRTUAL_NODES"), num_ranks);
    std::vector<std::string> hosts;
    for (int r = 0; r < num_ranks; ++r) hosts.push_back("host" + std::to_string(r / std::max(1, ranks_per_host)));
    const std::vector<int> nodes = weft::detail::group_by_label(weft::detail::node_labels(hosts, virtual_nodes));
    return weft::detail::node_layout(nodes, 0).num_nodes;
}

/// Every (world, mode, tokens) row of the options, measured (Worlds made now pick WEFT_TRACE up). `launched`: this
/// process is one rank of a launched world of launch->num_ranks ranks (else run_local's threads).
std::vector<Row> measure_rows(const Options& o, const std::optional<LaunchEnv>& launch) {
    const bool launched = launch && launch->num_ranks > 1;
    const bool printer = !launched || launch->rank == 0;
    std::vector<Row> rows;
    struct Mode {
        bool ll;
        bool fp8;
    };
    std::vector<Mode> modes;
    if (o.mode != "normal") {
        modes.push_back({true, false});
        modes.push_back({true, true});
    }
    if (o.mode != "ll") modes.push_back({false, false});

    for (int w : launched ? std::vector<int>{launch->num_ranks} : o.worlds) {
        WEFT_CHECK(o.experts % w == 0, "--experts (" << o.experts << ") must be a multiple of --world (" << w << ")");
        for (const Mode& m : modes) {
            std::vector<int> token_list = o.tokens;
            if (token_list.empty()) token_list = m.ll ? std::vector<int>{1, 32, 128, 256} : std::vector<int>{4096};
            for (int tokens : token_list) {
                if (m.ll && tokens > ep::kMaxLowLatencyTokens) {
                    if (printer) {
                        std::printf("skipping low-latency at %d tokens (limit %d)\n", tokens, ep::kMaxLowLatencyTokens);
                    }
                    continue;
                }
                ep::Config c;
                c.num_experts = o.experts;
                c.hidden = o.hidden;
                c.topk = o.topk;
                c.max_tokens_per_rank = std::max(1, tokens);
                c.normal = !m.ll;
                c.low_latency = m.ll;
                if (!m.ll) {
                    c.max_recv_rows = ep::expected_recv_rows(c, w) * 5 / 4 + 256;
                    c.max_recv_tokens = ep::expected_recv_tokens(c, w) * 5 / 4 + 64;
                }
                // The footprint of the World's team over its nodes (across nodes: the one-rank Buffer and the node
                // stage's collective workspace) plus slack; WEFT_SYMMETRIC_HEAP_BYTES, when set, decides instead.
                const int nodes = nodes_of_world(w, launched ? launch->local_num_ranks : w);
                const ep::Footprint fp = ep::footprint(c, w, nodes);
                WorldOptions wo;
                const std::optional<std::string> heap_env = env::get("WEFT_SYMMETRIC_HEAP_BYTES");
                if (!heap_env || heap_env->empty()) wo.heap_bytes = fp.heap_bytes(m.ll ? 0 : 1) + (64ull << 20);
                const Routing routing =
                    make_routing(w, tokens, o.experts, o.topk, 20240601u + static_cast<uint32_t>(tokens));
                const Traffic traffic = count_traffic(routing, w, tokens, o.experts, o.topk);
                Timings t;
                t.dispatch_ms.assign(static_cast<size_t>(w), 0);
                t.combine_ms.assign(static_cast<size_t>(w), 0);
                if (launched) {
                    std::unique_ptr<World> world = World::from_env(wo);
                    WEFT_CHECK(world->num_ranks() == w,
                               "launched with " << world->num_ranks() << " ranks, expected " << w);
                    run_config(*world, o, m.ll, m.fp8, tokens, routing, traffic, &t);
                    gather_timings(*world, &t);
                } else {
                    run_local(
                        w, [&](World& world) { run_config(world, o, m.ll, m.fp8, tokens, routing, traffic, &t); }, wo);
                }
                const double d_ms = *std::max_element(t.dispatch_ms.begin(), t.dispatch_ms.end());
                const double c_ms = *std::max_element(t.combine_ms.begin(), t.combine_ms.end());
                // Average rank's bytes per call.
                const double row_bf16 = 2.0 * o.hidden;
                const double row_fp8 = o.hidden + 4.0 * (o.hidden / ep::kFp8GroupSize);
                const auto mean = [&](const std::vector<int64_t>& v) {
                    return static_cast<double>(std::accumulate(v.begin(), v.end(), int64_t{0})) / w;
                };
                double d_deepep, d_cross, c_deepep, c_cross;
                if (m.ll) {
                    const double row = m.fp8 ? row_fp8 : row_bf16;
                    d_deepep = mean(traffic.routes_all) * row;
                    d_cross = mean(traffic.routes_remote) * (row + 16);
                    c_deepep = mean(traffic.routes_all) * row_bf16;
                    c_cross = mean(traffic.routes_remote) * row_bf16;
                } else {
                    const ep::Geometry g = ep::resolve_geometry(c, w, 0);
                    d_deepep = mean(traffic.tokens_all) * row_bf16;
                    d_cross = mean(traffic.tokens_remote) * (row_bf16 + 4.0 * g.meta_ints());
                    c_deepep = mean(traffic.tokens_all) * row_bf16;
                    c_cross = mean(traffic.tokens_remote) * row_bf16;
                }
                // The fp8 pass checks the dispatch's expert counts only (its rows are quantised): its rows say so.
                const std::string check = !o.check            ? ""
                                          : !t.errors.empty() ? "FAILED: " + t.errors.front()
                                          : m.fp8             ? "ok (counts only)"
                                                              : "ok";
                const std::string mode = m.ll ? "low-latency" : "normal";
                rows.push_back({mode, m.fp8 ? "fp8" : "bf16", "dispatch", tokens, w, t.sms, d_ms * 1e3,
                                d_deepep / (d_ms * 1e6), d_cross / (d_ms * 1e6), check});
                // The combine is bf16 in both passes: the fp8 pass's row is its own series ("bf16 after fp8").
                rows.push_back({mode, m.fp8 ? "bf16 after fp8" : "bf16", "combine", tokens, w, t.sms, c_ms * 1e3,
                                c_deepep / (c_ms * 1e6), c_cross / (c_ms * 1e6), check});
                if (printer) {
                    std::printf("%s %s T=%d W=%d: dispatch %.1f us, combine %.1f us; footprint %s\n", mode.c_str(),
                                m.fp8 ? "fp8" : "bf16", tokens, w, d_ms * 1e3, c_ms * 1e3, fp.describe().c_str());
                }
            }
        }
    }
    return rows;
}

int run(int argc, char** argv) {
    const Options o = parse_options(argc, argv);
    cudaDeviceProp prop{};
    WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const Peaks peaks = measure_peaks(kPeakCopy);
    int devices = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&devices));
    const std::string trace_path = traced_pass_path(o.trace, "weft_bench_ep");
    const std::optional<LaunchEnv> launch = detect_launch_env();
    const bool launched = launch && launch->num_ranks > 1;
    std::vector<Row> rows;
    if (o.trace.overhead) {
        set_trace_env("");
        rows = measure_rows(o, launch);
        std::printf("traced pass (trace: %s)\n", trace_path.c_str());
        set_trace_env(trace_path);
        Options traced_options = o;
        traced_options.check = false;
        for (const Row& t : measure_rows(traced_options, launch)) {
            for (Row& r : rows) {
                if (r.mode == t.mode && r.dtype == t.dtype && r.op == t.op && r.tokens == t.tokens &&
                    r.world == t.world) {
                    r.us_traced = t.us;
                }
            }
        }
    } else {
        set_trace_env(trace_path);
        rows = measure_rows(o, launch);
    }
    if (launched && launch->rank != 0) return 0;  // rank 0 prints (every rank saw the same checks)

    const int most_ranks =
        launched ? launch->num_ranks : (o.worlds.empty() ? 0 : *std::max_element(o.worlds.begin(), o.worlds.end()));
    const bool shared = most_ranks > devices;
    std::printf("\nweft EP benchmark: %s x %d visible (%d SMs each), %s, H=%d E=%d top-%d, iters %d, warmup %d%s\n",
                prop.name, devices, prop.multiProcessorCount, utc_date().c_str(), o.hidden, o.experts, o.topk, o.iters,
                o.warmup, o.check ? ", checked" : "");
    std::printf("%s\n", describe(peaks).c_str());
    if (shared) {
        std::printf(
            "NOTE: more ranks than GPUs - ranks SHARE a GPU, no byte crosses NVLink: the figures are the kernels'\n"
            "own overhead (GB/s = rate of HBM work), not link bandwidth.\n");
    }
    std::printf("%-12s %-14s %-9s %6s %5s %4s | %10s %12s %12s%s%s\n", "mode", "dtype", "op", "tokens", "world", "sms",
                "us/call", "DeepEP GB/s", "cross GB/s", o.trace.overhead ? "  traced us  trace" : "",
                o.check ? "  check" : "");
    bool ok = true;
    for (const Row& r : rows) {
        char traced[48] = "";
        if (o.trace.overhead) {
            std::snprintf(traced, sizeof(traced), "  %9.1f %+6.1f%%", r.us_traced,
                          r.us > 0 && r.us_traced > 0 ? 100.0 * (r.us_traced / r.us - 1.0) : 0.0);
        }
        std::printf("%-12s %-14s %-9s %6d %5d %4d | %10.1f %12.1f %12.1f%s%s%s\n", r.mode.c_str(), r.dtype.c_str(),
                    r.op.c_str(), r.tokens, r.world, r.sms, r.us, r.deepep_gbps, r.crossing_gbps, traced,
                    r.check.empty() ? "" : "  ", r.check.c_str());
        ok = ok && (r.check.empty() || r.check.rfind("ok", 0) == 0);  // "ok", or "ok (counts only)"
    }
    if (!o.json.empty()) {
        Json j;
        j.begin_object().field("bench", "ep").field("device", prop.name).field("devices", devices);
        j.field("ranks_share_gpu", shared).field("date", utc_date()).field("hidden", o.hidden);
        j.field("experts", o.experts).field("topk", o.topk).field("iters", o.iters).field("warmup", o.warmup);
        add_peaks(j, peaks);
        j.key("results").begin_array();
        for (const Row& r : rows) {
            j.begin_object(true).field("mode", r.mode).field("dtype", r.dtype).field("op", r.op);
            j.field("tokens", r.tokens).field("world", r.world).field("sms", r.sms).field("us", r.us);
            j.field("deepep_gbps", r.deepep_gbps).field("crossing_gbps", r.crossing_gbps).field("check", r.check);
            if (r.us_traced > 0) j.field("us_traced", r.us_traced);
            j.end_object();
        }
        j.end_array().end_object();
        write_json_file(o.json, j);
        std::printf("\nwrote %s\n", o.json.c_str());
    }
    return ok ? 0 : 1;
}

}  // namespace
}  // namespace weft::bench

int main(int argc, char** argv) {
    // Before the first CUDA call (run() asks the device's properties and measures peaks before any World): eager
    // module loading and 32 hardware queues (docs/runtime.md, "Hardware queues"); set later, CUDA ignores them.
    weft::prepare_cuda_environment();
    return weft::bench::run_main("weft_bench_ep", [&] { return weft::bench::run(argc, argv); });
}
