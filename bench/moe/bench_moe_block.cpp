// SPDX-License-Identifier: MIT
// weft_bench_moe_block: the expert-parallel MoE block (weft::ops::ep::MoeBlock: dispatch, up-projection, SwiGLU,
// down-projection, combine) fused (the expert GEMMs overlapping dispatch and combine) against the same block from
// weft's separate ops one after another (MoeOptions::fused = false: the same kernels, the same bits), alternating call
// by call in the same run; the slowest rank's mean per call.
//
//   weft_bench_moe_block [--shapes HxExK,...] [--ffn F] [--tokens T,...] [--world W,...] [--comm-sms N]
//                        [--iters N] [--warmup N] [--check] [--json FILE]
// --shapes: hidden x experts x top-k; default 4096x256x8, 7168x256x8 and 4096x256x6 (DeepSeek-V4-Flash-like).
// --ffn: each expert's intermediate size (default 2048). --tokens: per rank (default 8,128,4096). --world: ranks
// (threads of this process over the visible GPUs; more ranks than GPUs share one: then no byte crosses NVLink and the
// figures are the kernels' own cost); default 1,8. Routing: k distinct experts per token, uniformly at random; receive
// limits 1.25x the uniform expectation. --check: fused and sequential outputs equal bit for bit on every rank.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/data.hpp"
#include "common/json.hpp"
#include "common/ranks.hpp"
#include "common/report.hpp"
#include "common/timing.hpp"
#include "weft/ops/ep_moe.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/world.hpp"
#include "weft/weft.hpp"

namespace weft::bench {
namespace {

namespace ep = weft::ops::ep;

struct Options {
    std::vector<std::array<int64_t, 3>> shapes = {{4096, 256, 8}, {7168, 256, 8}, {4096, 256, 6}};
    int ffn = 2048;
    std::vector<int> tokens = {8, 128, 4096};
    std::vector<int> worlds = {1, 8};
    int comm_sms = 0;
    int iters = 20;
    int warmup = 5;
    bool check = false;
    std::string json;
};

Options parse_options(int argc, char** argv) {
    Options o;
    Cli cli("weft_bench_moe_block", "expert-parallel MoE block: fused against the separate ops");
    cli.option("--shapes", "HxExK[,...]", "hidden x experts x top-k (default 4096x256x8,7168x256x8,4096x256x6)",
               [&](const std::string& v) { o.shapes = parse_shapes3(v, "--shapes"); });
    cli.int_option("--ffn", "each expert's intermediate size", &o.ffn, 8, 1 << 16);
    cli.option("--tokens", "T[,T...]", "tokens per rank (default 8,128,4096)", [&](const std::string& v) {
        o.tokens.clear();
        for (int64_t t : parse_int_list(v, "--tokens", 1, 1 << 20)) o.tokens.push_back(static_cast<int>(t));
    });
    cli.int_option("--comm-sms", "SMs of dispatch and combine (0: the default)", &o.comm_sms, 0, 1024);
    cli.iters(&o.iters).warmup(&o.warmup).world(&o.worlds, 1, ep::kMaxRanks).check(&o.check).json(&o.json);
    cli.parse(argc, argv);
    return o;
}

struct Row {
    int64_t hidden = 0, experts = 0, topk = 0;
    int ffn = 0, tokens = 0, world = 0, comm_sms = 0;
    double fused_us = 0, sequential_us = 0;
    std::string check;
};

/// Rank `me`'s routing: k distinct experts per token, uniform, weights in [0.05, 1].
void make_routing(int me, int tokens, int experts, int topk, std::vector<int32_t>* idx, std::vector<float>* w) {
    std::mt19937 rng(20261202u + static_cast<uint32_t>(me) * 7919u + static_cast<uint32_t>(tokens));
    std::vector<int> pool(static_cast<size_t>(experts));
    std::iota(pool.begin(), pool.end(), 0);
    std::uniform_real_distribution<float> weight(0.05f, 1.0f);
    for (int t = 0; t < tokens; ++t) {
        for (int j = 0; j < topk; ++j) {
            std::uniform_int_distribution<int> pick(j, experts - 1);
            std::swap(pool[static_cast<size_t>(j)], pool[static_cast<size_t>(pick(rng))]);
            idx->push_back(pool[static_cast<size_t>(j)]);
            w->push_back(weight(rng));
        }
    }
}

struct Shared {
    std::mutex mutex;
    std::vector<std::string> errors;
    std::array<double, 2> ms{};
    int comm_sms = 0;
};

void run_config(World& world, const Options& o, const ep::MoeConfig& c, int tokens, SlowestRank* slowest,
                Shared* shared) {
    const int me = world.rank();
    const int w = world.num_ranks();
    const int local = c.ep.num_experts / w;
    cudaStream_t s = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    ep::MoeBlock moe(world, c);
    const int64_t h = c.ep.hidden, f = c.ffn, k = c.ep.topk;
    void *x = nullptr, *idx = nullptr, *wt = nullptr, *gate_up = nullptr, *down = nullptr, *out_f = nullptr,
         *out_s = nullptr;
    WEFT_CUDA_CHECK(cudaMallocAsync(&x, static_cast<size_t>(tokens * h * 2), s));
    WEFT_CUDA_CHECK(cudaMallocAsync(&idx, static_cast<size_t>(tokens * k * 4), s));
    WEFT_CUDA_CHECK(cudaMallocAsync(&wt, static_cast<size_t>(tokens * k * 4), s));
    WEFT_CUDA_CHECK(cudaMallocAsync(&gate_up, static_cast<size_t>(local * 2 * f * h * 2), s));
    WEFT_CUDA_CHECK(cudaMallocAsync(&down, static_cast<size_t>(local * h * f * 2), s));
    WEFT_CUDA_CHECK(cudaMallocAsync(&out_f, static_cast<size_t>(tokens * h * 2), s));
    WEFT_CUDA_CHECK(cudaMallocAsync(&out_s, static_cast<size_t>(tokens * h * 2), s));
    fill_random(x, tokens * h, DType::kBF16, 11u + static_cast<uint64_t>(me), s);
    // Values in [-1, 1): the sums stay far inside bf16's range at these sizes; the cost does not depend on them.
    fill_random(gate_up, local * 2 * f * h, DType::kBF16, 101u + static_cast<uint64_t>(me), s);
    fill_random(down, local * h * f, DType::kBF16, 202u + static_cast<uint64_t>(me), s);
    std::vector<int32_t> hidx;
    std::vector<float> hw;
    make_routing(me, tokens, static_cast<int>(c.ep.num_experts), static_cast<int>(k), &hidx, &hw);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(idx, hidx.data(), hidx.size() * 4, cudaMemcpyHostToDevice, s));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(wt, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    // Ranks sharing a GPU: no rank allocates or copies from pageable memory while a peer's first call may already
    // spin (docs/runtime.md, "Shared GPUs and the runtime's own work").
    world.barrier();
    const TensorView xv(x, DType::kBF16, {tokens, h});
    const TensorView iv(idx, DType::kI32, {tokens, k});
    const TensorView wv(wt, DType::kF32, {tokens, k});
    const ep::MoeWeights weights{TensorView(gate_up, DType::kBF16, {local, 2 * f, h}),
                                 TensorView(down, DType::kBF16, {local, h, f})};
    const TensorView of(out_f, DType::kBF16, {tokens, h});
    const TensorView os(out_s, DType::kBF16, {tokens, h});
    const auto ms = time_rounds_on_ranks_mean_ms(
        world, *slowest, s, o.warmup, o.iters,
        [&](int) { moe.forward(xv, iv, wv, weights, of, s, {.fused = true, .comm_sms = o.comm_sms}); },
        [&](int) { moe.forward(xv, iv, wv, weights, os, s, {.fused = false, .comm_sms = o.comm_sms}); });
    moe.sync_and_check(s);
    std::string error;
    if (o.check) {
        std::vector<uint16_t> a(static_cast<size_t>(tokens * h)), b(a.size());
        WEFT_CUDA_CHECK(cudaMemcpyAsync(a.data(), out_f, a.size() * 2, cudaMemcpyDeviceToHost, s));
        WEFT_CUDA_CHECK(cudaMemcpyAsync(b.data(), out_s, b.size() * 2, cudaMemcpyDeviceToHost, s));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
        const auto diff = std::mismatch(a.begin(), a.end(), b.begin());
        if (diff.first != a.end()) {
            error = "rank " + std::to_string(me) + ": fused and sequential differ at element " +
                    std::to_string(diff.first - a.begin());
        }
    }
    {
        std::lock_guard<std::mutex> lock(shared->mutex);
        shared->ms = ms;
        shared->comm_sms = o.comm_sms > 0 ? o.comm_sms : ep::moe_comm_sms(tokens, world.sm_budget());
        if (!error.empty()) shared->errors.push_back(error);
    }
    for (void* p : {x, idx, wt, gate_up, down, out_f, out_s}) cudaFreeAsync(p, s);
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    world.barrier();
    cudaStreamDestroy(s);
}

int run(int argc, char** argv) {
    const Options o = parse_options(argc, argv);
    cudaDeviceProp prop{};
    WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    int devices = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&devices));
    std::vector<Row> rows;
    for (const auto& shape : o.shapes) {
        for (int w : o.worlds) {
            if (shape[1] % w != 0) {
                std::printf("skipping %lld experts at world %d (not a multiple)\n", static_cast<long long>(shape[1]),
                            w);
                continue;
            }
            for (int tokens : o.tokens) {
                ep::MoeConfig c;
                c.ep.hidden = static_cast<int>(shape[0]);
                c.ep.num_experts = static_cast<int>(shape[1]);
                c.ep.topk = static_cast<int>(shape[2]);
                c.ep.max_tokens_per_rank = tokens;
                c.ep.low_latency = false;
                c.ep.max_recv_rows = ep::expected_recv_rows(c.ep, w) * 5 / 4 + 256;
                c.ep.max_recv_tokens = ep::expected_recv_tokens(c.ep, w) * 5 / 4 + 64;
                c.ffn = o.ffn;
                WorldOptions wo;
                wo.heap_bytes = ep::footprint(c.ep, w).heap_bytes(1) + (64ull << 20);
                SlowestRank slowest(w);
                Shared shared;
                run_local(
                    w, [&](World& world) { run_config(world, o, c, tokens, &slowest, &shared); }, wo);
                Row r;
                r.hidden = shape[0];
                r.experts = shape[1];
                r.topk = shape[2];
                r.ffn = o.ffn;
                r.tokens = tokens;
                r.world = w;
                r.comm_sms = shared.comm_sms;
                r.fused_us = shared.ms[0] * 1e3;
                r.sequential_us = shared.ms[1] * 1e3;
                r.check = !o.check ? "" : (shared.errors.empty() ? "ok" : "FAILED: " + shared.errors.front());
                std::printf("H=%lld E=%lld top-%lld T=%d W=%d: fused %.1f us, sequential %.1f us\n",
                            static_cast<long long>(r.hidden), static_cast<long long>(r.experts),
                            static_cast<long long>(r.topk), tokens, w, r.fused_us, r.sequential_us);
                rows.push_back(r);
            }
        }
    }

    const bool shared_gpu = !o.worlds.empty() && *std::max_element(o.worlds.begin(), o.worlds.end()) > devices;
    std::printf("\nweft MoE block benchmark: %s x %d visible (%d SMs each), %s, F=%d, iters %d, warmup %d%s\n",
                prop.name, devices, prop.multiProcessorCount, utc_date().c_str(), o.ffn, o.iters, o.warmup,
                o.check ? ", checked" : "");
    if (shared_gpu) {
        std::printf(
            "NOTE: more ranks than GPUs - ranks SHARE a GPU: no byte crosses NVLink, each rank has its share of "
            "the SMs.\n");
    }
    std::printf("%6s %5s %4s %6s %5s %4s | %12s %12s %8s%s\n", "hidden", "exp", "topk", "tokens", "world", "comm",
                "fused us", "separate us", "speedup", o.check ? "  check" : "");
    bool ok = true;
    for (const Row& r : rows) {
        std::printf("%6lld %5lld %4lld %6d %5d %4d | %12.1f %12.1f %7.2fx%s%s\n", static_cast<long long>(r.hidden),
                    static_cast<long long>(r.experts), static_cast<long long>(r.topk), r.tokens, r.world, r.comm_sms,
                    r.fused_us, r.sequential_us, r.sequential_us / r.fused_us, r.check.empty() ? "" : "  ",
                    r.check.c_str());
        ok = ok && (r.check.empty() || r.check == "ok");
    }
    if (!o.json.empty()) {
        Json j;
        j.begin_object().field("bench", "moe_block").field("device", prop.name).field("devices", devices);
        j.field("ranks_share_gpu", shared_gpu).field("date", utc_date()).field("ffn", o.ffn);
        j.field("iters", o.iters).field("warmup", o.warmup);
        j.key("results").begin_array();
        for (const Row& r : rows) {
            j.begin_object(true).field("hidden", r.hidden).field("experts", r.experts).field("topk", r.topk);
            j.field("tokens", r.tokens).field("world", r.world).field("comm_sms", r.comm_sms);
            j.field("fused_us", r.fused_us).field("sequential_us", r.sequential_us);
            j.field("speedup", r.sequential_us / r.fused_us).field("check", r.check);
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
    // Before the first CUDA call (run() asks the device's properties before any World): eager module loading and 32
    // hardware queues. Set later (run_local does), they are ignored: 8 ranks' streams then share CUDA's default 8
    // queues, where a rank's waiting work can sit ahead of the peer work it waits for (docs/runtime.md, "Hardware
    // queues").
    weft::prepare_cuda_environment();
    return weft::bench::run_main("weft_bench_moe_block", [&] { return weft::bench::run(argc, argv); });
}
