// SPDX-License-Identifier: MIT
// weft_bench_moe_tp: the tensor-parallel MoE layers (weft::ops::MoeAgGroupedGemm, MoeGroupedGemmRs) against the same
// layers from weft's separate ops in the same run: layer 0 vs all_gather then moe_route + grouped_gemm_gathered;
// layer 1 vs grouped_gemm_contiguous then moe_combine (top-k weighted sum, all tokens) then reduce_scatter. Ranks are
// threads (weft::run_local) over the visible GPUs; with fewer GPUs than ranks they share one (correctness and protocol
// cost, not NVLink speed). Each pair alternates call by call (CUDA events, means, the slowest rank's); the table shows
// each layer's GEMM roofline (2 * M * topk * (F/W) * H over the measured tensor peak) beside it, and JSON.
//
//   weft_bench_moe_tp [--cases mixtral,deepseek] [--world N[,N...]] [--tokens M] [--iters N] [--warmup N] [--check]
//                     [--json FILE]
// mixtral: M 8192 tokens, hidden 4096, FFN 14336 sharded by the world, 8 experts, top-2; deepseek: M 8192, hidden
// 2048, FFN 1408, 64 experts, top-6. Routing: distinct random experts per token (the same on every rank), weights
// uniform in [0, 1). Out of layer 1: f32 in both (reduce_scatter adds f32 partials). --world default: 1 and every
// power of two up to 8 (ranks share the GPUs there are). --check: the relative Frobenius error of each layer against
// its baseline (layer 0: same rows, same engine; layer 1: sums in another order).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/data.hpp"
#include "common/json.hpp"
#include "common/peaks.hpp"
#include "common/ranks.hpp"
#include "common/timing.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/ops/grouped_gemm.hpp"
#include "weft/ops/moe_tp.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/module_loading.hpp"
#include "weft/runtime/symmetric_heap.hpp"
#include "weft/runtime/world.hpp"

namespace {

using weft::BLayout;
using weft::DType;
using weft::TensorView;
using weft::World;

struct MoeShape {
    std::string name;
    int64_t tokens, hidden, ffn, experts, topk;
};

MoeShape shape_named(const std::string& name, int64_t tokens) {
    if (name == "mixtral") return {name, tokens, 4096, 14336, 8, 2};
    return {name, tokens, 2048, 1408, 64, 6};
}

struct Options {
    std::vector<std::string> cases = {"mixtral", "deepseek"};
    std::vector<int> worlds = {1, 2, 4, 8};
    int64_t tokens = 8192;
    int iters = 20, warmup = 3;
    bool check = false;
    std::string json;
    DType dtype = DType::kBF16;
};

struct Row {
    std::string name;
    int world = 1;
    int64_t tokens = 0, hidden = 0, ffn = 0, experts = 0, topk = 0;
    double l0_ms = 0, l0_base_ms = 0, l1_ms = 0, l1_base_ms = 0, roof_ms = 0;
    double l0_err = -1, l1_err = -1;
    std::string l0_tile, l1_tile;
};

using Buffer = weft::bench::DeviceBuffer;

std::vector<int32_t> routing_for(const MoeShape& s) {
    std::mt19937_64 rng(0x5eed ^ static_cast<uint64_t>(s.experts * 131 + s.topk));
    std::vector<int32_t> idx(static_cast<size_t>(s.tokens * s.topk));
    std::vector<int32_t> perm(static_cast<size_t>(s.experts));
    for (int64_t t = 0; t < s.tokens; ++t) {
        for (int64_t e = 0; e < s.experts; ++e) perm[static_cast<size_t>(e)] = static_cast<int32_t>(e);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int64_t k = 0; k < s.topk; ++k) idx[static_cast<size_t>(t * s.topk + k)] = perm[static_cast<size_t>(k)];
    }
    return idx;
}

/// The symmetric heap one rank needs for `s` at world `w`: both layers' buffers, the baselines' symmetric buffers and
/// the collective workspace.
uint64_t heap_bytes_for(const MoeShape& s, int w) {
    const uint64_t rows = static_cast<uint64_t>(s.tokens * s.topk), h = static_cast<uint64_t>(s.hidden);
    const uint64_t m = static_cast<uint64_t>(s.tokens);
    const uint64_t routing = (2 * static_cast<uint64_t>(s.experts) + 1 + 2 * rows) * 4;
    return rows * h * 2 + rows * h * 4 + m / static_cast<uint64_t>(w) * h * 4 + m * h * 2 + m * h * 4 + routing +
           (320ull << 20);
}

Row run_shape(World& w, weft::bench::SlowestRank& slowest, const MoeShape& s, const Options& o, double peak_tflops,
              cudaStream_t st) {
    const int nr = w.num_ranks(), me = w.rank();
    const int64_t fl = s.ffn / nr, tpr = s.tokens / nr, m = s.tokens, h = s.hidden;
    const int64_t rows = weft::ops::moe_gathered_rows(m, s.topk, s.experts, 1);
    Row r;
    r.name = s.name;
    r.world = nr;
    r.tokens = m;
    r.hidden = h;
    r.ffn = s.ffn;
    r.experts = s.experts;
    r.topk = s.topk;
    const std::vector<int32_t> idx_host = routing_for(s);

    Buffer x(static_cast<size_t>(tpr * h) * 2), idx(idx_host.size() * 4),
        w0(static_cast<size_t>(s.experts * fl * h) * 2), y(static_cast<size_t>(rows * fl) * 2),
        y_base(static_cast<size_t>(rows * fl) * 2), hb(static_cast<size_t>(rows * fl) * 2),
        w1(static_cast<size_t>(s.experts * h * fl) * 2), weights(static_cast<size_t>(m * s.topk) * 4),
        out(static_cast<size_t>(tpr * h) * 4), out_base(static_cast<size_t>(tpr * h) * 4),
        counts(static_cast<size_t>(s.experts) * 4), offsets(static_cast<size_t>(s.experts + 1) * 4),
        gather(static_cast<size_t>(rows) * 4), slots(static_cast<size_t>(m * s.topk) * 4),
        a_rows(static_cast<size_t>(rows * h) * 2), d_rows(static_cast<size_t>(rows * h) * 4);
    weft::SymmetricHeap& heap = w.heap();
    void* x_full = heap.alloc(w.team(), static_cast<uint64_t>(m * h) * 2);
    void* combined = heap.alloc(w.team(), static_cast<uint64_t>(m * h) * 4);
    const uint64_t seed = 1000 + static_cast<uint64_t>(me) * 17;
    weft::bench::fill_random(x.ptr, tpr * h, DType::kBF16, seed, st);
    weft::bench::fill_random(w0.ptr, s.experts * fl * h, DType::kBF16, seed + 1, st);
    weft::bench::fill_random(w1.ptr, s.experts * h * fl, DType::kBF16, seed + 2, st);
    weft::bench::fill_random(hb.ptr, rows * fl, DType::kBF16, seed + 3, st);
    std::vector<float> wt(static_cast<size_t>(m * s.topk));
    std::mt19937_64 rng(7);
    for (auto& v : wt) v = std::uniform_real_distribution<float>(0.f, 1.f)(rng);
    BENCH_CUDA(cudaMemcpyAsync(idx.ptr, idx_host.data(), idx_host.size() * 4, cudaMemcpyHostToDevice, st));
    BENCH_CUDA(cudaMemcpyAsync(weights.ptr, wt.data(), wt.size() * 4, cudaMemcpyHostToDevice, st));
    BENCH_CUDA(cudaStreamSynchronize(st));

    weft::ops::MoeRouting rt;
    rt.counts = static_cast<int32_t*>(counts.ptr);
    rt.offsets = static_cast<int32_t*>(offsets.ptr);
    rt.gather_index = static_cast<int32_t*>(gather.ptr);
    rt.slot_rows = static_cast<int32_t*>(slots.ptr);
    rt.num_experts = s.experts;
    rt.rows_capacity = rows;

    const TensorView xv(x.ptr, DType::kBF16, {tpr, h}), iv(idx.ptr, DType::kI32, {m, s.topk});
    const TensorView w0v(w0.ptr, DType::kBF16, {s.experts, fl, h}), yv(y.ptr, DType::kBF16, {rows, fl});
    const TensorView ybv(y_base.ptr, DType::kBF16, {rows, fl}), hv(hb.ptr, DType::kBF16, {rows, fl});
    const TensorView w1v(w1.ptr, DType::kBF16, {s.experts, h, fl}), wv(weights.ptr, DType::kF32, {m, s.topk});
    const TensorView ov(out.ptr, DType::kF32, {tpr, h}), obv(out_base.ptr, DType::kF32, {tpr, h});
    const TensorView xfv(x_full, DType::kBF16, {m, h}), arv(a_rows.ptr, DType::kBF16, {rows, h});
    const TensorView drv(d_rows.ptr, DType::kF32, {rows, h});
    const TensorView cv(combined, DType::kF32, {m, h});
    {
        const weft::ops::MoeTpShape shape{
            .max_tokens = m, .hidden = h, .ffn = fl, .num_experts = s.experts, .topk = s.topk};
        weft::ops::MoeAgGroupedGemm up(w, shape);
        weft::ops::MoeGroupedGemmRs down(w, shape);
        r.l0_tile = weft::ops::detail::config_text(up.config());
        r.l1_tile = weft::ops::detail::config_text(down.config());
        auto layer0 = [&](int) { up.run(xv, iv, w0v, yv, st); };
        auto base0 = [&](int) {
            weft::ops::all_gather(w, xv, xfv, st);
            weft::ops::moe_route(iv, rt, 1, st);
            weft::ops::grouped_gemm_gathered(xfv, w0v, ybv, BLayout::kNK, rt, arv, st);
        };
        auto layer1 = [&](int) { down.run(hv, w1v, up.routing(), wv, ov, st); };
        auto base1 = [&](int) {
            weft::ops::grouped_gemm_contiguous(hv, w1v, drv, BLayout::kNK, rt.offsets, rt.counts, st);
            weft::ops::moe_combine(drv, rt, weft::ops::MoeCombineMode::kWeightedSum, wv, cv, st);
            weft::ops::reduce_scatter(w, cv, obv, st);
        };
        // Both routings exist before layer 1 and its baseline run (layer 1 reads them).
        layer0(0);
        base0(0);
        w.sync_and_check(st);
        w.barrier();
        const auto ms =
            weft::bench::time_rounds_on_ranks_mean_ms(w, slowest, st, o.warmup, o.iters, layer0, base0, layer1, base1);
        r.l0_ms = ms[0];
        r.l0_base_ms = ms[1];
        r.l1_ms = ms[2];
        r.l1_base_ms = ms[3];
        if (o.check) {
            w.sync_and_check(st);
            const double e0 = weft::bench::relative_error(y.ptr, fl, y_base.ptr, fl, m * s.topk, fl, DType::kBF16, st);
            const double e1 = weft::bench::relative_error(out.ptr, h, out_base.ptr, h, tpr, h, DType::kF32, st);
            r.l0_err = slowest.max(w, e0);
            r.l1_err = slowest.max(w, e1);
        }
        w.sync_and_check(st);
        w.barrier();
    }
    heap.free(w.team(), combined);
    heap.free(w.team(), x_full);
    r.roof_ms = peak_tflops > 0 ? 2.0 * static_cast<double>(m * s.topk) * static_cast<double>(fl) *
                                      static_cast<double>(h) / (peak_tflops * 1e9)
                                : 0;
    return r;
}

}  // namespace

int main(int argc, char** argv) {
    Options opt;
    weft::bench::Cli cli("weft_bench_moe_tp", "tensor-parallel MoE layers vs weft's separate ops");
    cli.option("--cases", "mixtral,deepseek", "MoE shapes (default both)", [&](const std::string& v) {
        opt.cases = weft::bench::parse_choice_list(v, "--cases", {"mixtral", "deepseek"});
    });
    cli.option("--tokens", "M", "tokens of all ranks (default 8192; a multiple of every world size)",
               [&](const std::string& v) { opt.tokens = weft::bench::parse_int(v, "--tokens", 8, 1 << 20); });
    cli.dtype(&opt.dtype, {DType::kBF16}).world(&opt.worlds, 1, 8).iters(&opt.iters).warmup(&opt.warmup);
    cli.check(&opt.check).json(&opt.json);
    return weft::bench::run_main("weft_bench_moe_tp", [&] {
        cli.parse(argc, argv);
        // Before the first CUDA call (cudaSetDevice creates the context): eager module loading and 32 hardware queues.
        // Set later (run_local does), they are ignored, and 8 ranks' streams then share CUDA's default 8 queues, where
        // a rank's spinning kernel can sit ahead of the peer work it waits for (docs/runtime.md, "Hardware queues").
        weft::prepare_cuda_environment();
        BENCH_CUDA(cudaSetDevice(0));
        int gpus = 0;
        BENCH_CUDA(cudaGetDeviceCount(&gpus));
        const weft::bench::Peaks peaks = weft::bench::measure_peaks(weft::bench::kPeakTensor, DType::kBF16);
        char date[32];
        const std::time_t now = std::time(nullptr);
        std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
        std::printf("# weft_bench_moe_tp %s  %s x %d  iters %d warmup %d\n# %s\n", date, peaks.gpu.c_str(), gpus,
                    opt.iters, opt.warmup, weft::bench::describe(peaks).c_str());
        std::printf(
            "# ms: means of alternating calls, the slowest rank's; x: the layer's speed over its baseline "
            "(target >= 1.3 at world 8 on 8 GPUs); roof: the layer's GEMM at the measured peak\n");
        std::printf(
            "# layer 0 baseline: all_gather + moe_route + grouped_gemm_gathered; layer 1 baseline: "
            "grouped_gemm_contiguous + moe_combine + reduce_scatter\n");
        std::printf("%-9s %2s %6s %5s %6s %4s %4s %9s %9s %6s %9s %9s %6s %8s %-24s %8s %8s\n", "case", "W", "M", "H",
                    "F", "E", "topk", "layer0", "ag+gemm", "x", "layer1", "gemm+rs", "x", "roof", "tiles (l0 / l1)",
                    "err0", "err1");
        std::vector<Row> rows;
        std::mutex rows_mutex;
        for (int world : opt.worlds) {
            std::vector<MoeShape> shapes;
            uint64_t heap = 64ull << 20;
            for (const std::string& c : opt.cases) {
                shapes.push_back(shape_named(c, opt.tokens));
                WEFT_CHECK(opt.tokens % world == 0 && shapes.back().ffn % (8 * world) == 0,
                           "--tokens must be a multiple of the world size " << world << " and the FFN width "
                                                                            << shapes.back().ffn << " of 8 x it");
                heap = std::max(heap, heap_bytes_for(shapes.back(), world));
            }
            weft::WorldOptions wo;
            wo.heap_bytes = (heap + (2ull << 20) - 1) / (2ull << 20) * (2ull << 20);
            wo.timeout = std::chrono::milliseconds(60000);
            weft::bench::SlowestRank slowest(world);
            weft::run_local(
                world,
                [&](World& w) {
                    cudaStream_t st = nullptr;
                    BENCH_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
                    (void)weft::ops::prepare_collectives(w.team());  // collective, before any timing
                    for (const MoeShape& s : shapes) {
                        const Row r = run_shape(w, slowest, s, opt, peaks.tensor_tflops, st);
                        if (w.rank() != 0) continue;
                        std::lock_guard<std::mutex> lock(rows_mutex);
                        rows.push_back(r);
                        std::printf(
                            "%-9s %2d %6lld %5lld %6lld %4lld %4lld %9.3f %9.3f %6.3f %9.3f %9.3f %6.3f %8.3f "
                            "%-24s %8.1e %8.1e\n",
                            r.name.c_str(), r.world, static_cast<long long>(r.tokens), static_cast<long long>(r.hidden),
                            static_cast<long long>(r.ffn), static_cast<long long>(r.experts),
                            static_cast<long long>(r.topk), r.l0_ms, r.l0_base_ms,
                            r.l0_ms > 0 ? r.l0_base_ms / r.l0_ms : 0, r.l1_ms, r.l1_base_ms,
                            r.l1_ms > 0 ? r.l1_base_ms / r.l1_ms : 0, r.roof_ms,
                            (r.l0_tile + " / " + r.l1_tile).c_str(), r.l0_err, r.l1_err);
                        std::fflush(stdout);
                    }
                    w.barrier();
                    cudaStreamDestroy(st);
                },
                wo);
        }
        bool ok = true;
        if (opt.check) {
            for (const Row& r : rows) ok = ok && r.l0_err >= 0 && r.l0_err < 1e-2 && r.l1_err >= 0 && r.l1_err < 1e-3;
            std::printf("# check: %s (relative Frobenius error against the baselines)\n", ok ? "passed" : "FAILED");
        }
        if (!opt.json.empty()) {
            weft::bench::Json j;
            j.begin_object().field("bench", "moe_tp").field("gpus", gpus);
            weft::bench::add_peaks(j, peaks);
            j.key("results").begin_array();
            for (const Row& r : rows) {
                j.begin_object(true)
                    .field("case", r.name)
                    .field("world", r.world)
                    .field("tokens", r.tokens)
                    .field("hidden", r.hidden)
                    .field("ffn", r.ffn)
                    .field("experts", r.experts)
                    .field("topk", r.topk)
                    .field("layer0_ms", r.l0_ms)
                    .field("layer0_baseline_ms", r.l0_base_ms)
                    .field("layer1_ms", r.l1_ms)
                    .field("layer1_baseline_ms", r.l1_base_ms)
                    .field("gemm_roofline_ms", r.roof_ms)
                    .field("layer0_tile", r.l0_tile)
                    .field("layer1_tile", r.l1_tile)
                    .field("layer0_rel_err", r.l0_err)
                    .field("layer1_rel_err", r.l1_err)
                    .end_object();
            }
            j.end_array().end_object();
            weft::bench::write_json_file(opt.json, j);
        }
        return ok ? 0 : 1;
    });
}
