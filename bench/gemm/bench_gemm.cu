// SPDX-License-Identifier: MIT
// weft_bench_gemm: TFLOP/s of weft::ops::gemm and of cuBLASLt (best of its heuristic algorithms) on the same
// random inputs in the same run, rotating input buffers to keep L2 cold, CUDA events, median; a fixed table
// with the roofline (max(2MNK / the tensor-core peak, bytes / the read bandwidth), both measured at start-up),
// and JSON.
//
//   weft_bench_gemm [--sizes MxNxK,...] [--iters N] [--warmup N] [--dtype bf16|f16] [--out same|f32]
//                   [--layout nk|kn|both] [--all-configs] [--check] [--json FILE]
//                   [--small-m-variant 3|4|5] [--small-m-splits S] [--small-m-max-m M] [--split-k S] [--chain L]
//                   [--host-us]
// --small-m-variant / --small-m-splits / --small-m-max-m set GemmOptions for the op's own row (the one --check
// compares with cuBLAS); forcing a variant or a split count also sets small_m_max_m to 64 (unless
// --small-m-max-m says otherwise), so that M 17..64 measure the small-M kernels (3: GemvVariant::kTmaRing, 4:
// kBulkRows); variant 5 (kTmaWgmma) is forced only on the shapes it serves (M <= 256, B [N,K]; the op's default
// elsewhere); --split-k S sets GemmOptions::split_k of the op's row (0: the op's rule, 1: none, S: S splits of the
// heuristic's tile); --all-configs adds a row per tiled candidate, per split-K config (gemm_split_k_configs, label
// suffix kS, where each split gets at least 8 k-blocks) and, for M <= 64 with B [N,K], per small-M kernel that can
// serve the shape (variant 3 at every split count listed, variant 4), and for M <= 256 with B [N,K] variant 5 with
// its own split rule (label smallM.v5/sS, S the rule's count) and forced to 1, 2 and 4 splits (smallM.v5/fS), and
// the swapped configs the autotuner tries for the shape (gemm_swap_ab_configs, label suffix sw).
// --check compares every row with cuBLASLt.
// The kernels come from weft::jit: from the headers that WEFT_HOME names (cached in WEFT_CACHE_DIR), so kernels
// edited in another source tree run against the same host code and the same cuBLASLt.
// --chain L adds, for every shape the op may launch programmatically (the small-M variants 3 and 4), the time per
// call of chains of L calls back to back on one stream (a decode step's layers), each call on the next input set,
// with no event between them: weft launched plainly, weft with GemmOptions::programmatic_launch, and cuBLASLt; the
// three chains alternate round by round.
// --host-us prints, for the op's own row of each shape, the host time per call of weft::ops::gemm and of cuBLASLt
// (the mean over 200 calls enqueued back to back, the GPU left to drain after them): a call whose host time exceeds
// the kernel time before it leaves the GPU idle, and a launch-by-launch timing counts that idle time.
// --world is accepted for the shared command line and ignored (one GPU).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/cublaslt.hpp"
#include "common/data.hpp"
#include "common/json.hpp"
#include "common/peaks.hpp"
#include "common/timing.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/runtime/error.hpp"

namespace {

constexpr double kCheckTolerance = 1e-2;  // --check: relative error to cuBLASLt's result

using weft::BLayout;
using weft::DType;
using weft::GemmConfig;
using weft::bench::LtGemm;

/// Median milliseconds of each function, alternating launch by launch on the legacy stream.
template <class... Fns>
auto time_rounds_ms(int warmup, int iters, Fns&&... fns) {
    return weft::bench::time_rounds_median_ms(nullptr, warmup, iters, std::forward<Fns>(fns)...);
}
template <class Fn>
double time_median_ms(int warmup, int iters, Fn&& fn) {
    return weft::bench::time_median_ms(nullptr, warmup, iters, std::forward<Fn>(fn));
}

struct Shape {
    int64_t m, n, k;
};

struct Options {
    std::vector<Shape> sizes;
    int iters = 30;
    int warmup = 5;
    DType in = DType::kBF16;
    bool out_f32 = false;
    std::vector<BLayout> layouts = {BLayout::kNK};
    bool all_configs = false;
    bool check = false;
    std::string json;
    std::optional<weft::GemvVariant> small_m_variant;  // unset: the op's default
    int small_m_splits = 0;    // 0: the op's heuristic
    int small_m_max_m = -1;    // -1: the op's default (kGemvMaxM when a variant or split count is forced)
    int split_k = 0;           // GemmOptions::split_k of the op's row
    int chain = 0;  // --chain L: also time chains of L calls (0: no chains)
    bool host_us = false;  // --host-us: host time per call of weft and cuBLASLt
};

std::vector<Shape> default_sizes() {
    std::vector<Shape> s = {{8192, 8192, 8192}, {4096, 4096, 4096}};
    for (auto nk : {Shape{0, 1376, 4096}, Shape{0, 1792, 4096}, Shape{0, 3584, 8192}, Shape{0, 6656, 16384},
                    Shape{0, 3696, 8192}, Shape{0, 4096, 1376}, Shape{0, 4096, 1792}, Shape{0, 8192, 3584},
                    Shape{0, 16384, 6656}, Shape{0, 8192, 3696}}) {
        s.push_back({8192, nk.n, nk.k});
    }
    for (int64_t m : {1, 16, 128, 1024}) s.push_back({m, 8192, 8192});
    return s;
}

Options parse(int argc, char** argv) {
    Options o;
    o.sizes = default_sizes();
    int world = 1;
    weft::bench::Cli cli("weft_bench_gemm", "weft::ops::gemm against cuBLASLt (best heuristic algorithm), TFLOP/s");
    cli.sizes("MxNxK[,...]", "GEMM shapes (default: the reference table)", [&](const std::string& v) {
        o.sizes.clear();
        for (const auto& [m, n, k] : weft::bench::parse_shapes3(v, "--sizes")) o.sizes.push_back({m, n, k});
    });
    cli.iters(&o.iters).warmup(&o.warmup).dtype(&o.in, {DType::kBF16, DType::kF16});
    cli.world(&world, 1, 1 << 16, "accepted for the shared command line; a GEMM runs on one GPU");
    cli.check(&o.check).json(&o.json);
    cli.option("--out", "same|f32", "output dtype: the input's, or f32 (default same)", [&](const std::string& v) {
        o.out_f32 = weft::bench::parse_choice(v, "--out", {"same", "f32"}) == "f32";
    });
    cli.option("--layout", "nk|kn|both", "B stored [N,K], [K,N], or both in turn (default nk)",
               [&](const std::string& v) {
                   const std::string l = weft::bench::parse_choice(v, "--layout", {"nk", "kn", "both"});
                   o.layouts = l == "nk"   ? std::vector<BLayout>{BLayout::kNK}
                               : l == "kn" ? std::vector<BLayout>{BLayout::kKN}
                                           : std::vector<BLayout>{BLayout::kNK, BLayout::kKN};
               });
    cli.flag("--all-configs", "add a row per candidate config and small-M variant", &o.all_configs);
    cli.option("--small-m-variant", "3|4|5",
               "GemmOptions::small_m_variant of the op's row: 3 (TMA ring), 4 "
               "(bulk-copied rows) or 5 (swapped wgmma; where it serves); default: the op's choice",
               [&](const std::string& v) {
                   const std::string c = weft::bench::parse_choice(v, "--small-m-variant", {"3", "4", "5"});
                   o.small_m_variant = c == "3"   ? weft::GemvVariant::kTmaRing
                                       : c == "4" ? weft::GemvVariant::kBulkRows
                                                  : weft::GemvVariant::kTmaWgmma;
               });
    cli.int_option("--small-m-splits", "GemmOptions::small_m_splits (0: the op's heuristic)", &o.small_m_splits, 0,
                   1 << 20);
    cli.int_option("--small-m-max-m", "GemmOptions::small_m_max_m (-1: the op's default)", &o.small_m_max_m, -1,
                   weft::kGemvMaxM);
    cli.int_option("--split-k", "GemmOptions::split_k of the op's row (0: the op's rule, 1: none, S: S splits)",
                   &o.split_k, 0, weft::kGemmMaxSplits);
    cli.int_option("--chain", "also time chains of L calls (0: no chains)", &o.chain, 0, 1 << 20);
    cli.flag("--host-us", "print the host time per call of weft and cuBLASLt (the op's own row)", &o.host_us);
    cli.parse(argc, argv);
    return o;
}

using Buffer = weft::bench::DeviceBuffer;

std::string config_label(const GemmConfig& c) {
    std::ostringstream os;
    os << c.tile_m << "x" << c.tile_n << "s" << c.stages;
    if (c.cluster_m > 1) os << "cm" << c.cluster_m;
    if (c.cluster_n > 1) os << "cn" << c.cluster_n;
    if (c.pingpong) os << "pp";
    if (c.splits > 1) os << "k" << c.splits;
    if (c.swap_ab) os << "sw";
    return os.str();
}

struct Views {
    weft::TensorView a, b, d;
};

struct Row {
    Shape s;
    BLayout layout;
    std::string path;
    double weft_us = 0, cublas_us = 0, roof_us = 0;
    double rel_err = -1;
    bool best = false;   // the op's own choice (auto)
    bool chain = false;  // time per call of a chain (--chain), in the summary beside the op's row
};

double tflops(const Shape& s, double us) { return 2.0 * s.m * s.n * s.k / (us * 1e-6) / 1e12; }

}  // namespace

int main(int argc, char** argv) {
    return weft::bench::run_main("weft_bench_gemm", [&] {
        const Options opt = parse(argc, argv);
        cudaDeviceProp prop{};
        BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
        const DType out = opt.out_f32 ? DType::kF32 : opt.in;
        const int out_bytes = weft::dtype_bytes(out);
        // The roofline's two limits, measured on this GPU before anything else runs.
        const weft::bench::Peaks peaks =
            weft::bench::measure_peaks(weft::bench::kPeakRead | weft::bench::kPeakTensor, opt.in);
        const double read_bw = peaks.read_tbs;
        const double peak_tflops = peaks.tensor_tflops;
        char date[32];
        const std::time_t now = std::time(nullptr);
        std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
        std::printf("# weft_bench_gemm %s  GPU %s (%d SMs, %.0f MB L2)  in %s out %s  iters %d warmup %d\n", date,
                    prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, weft::dtype_name(opt.in),
                    weft::dtype_name(out), opt.iters, opt.warmup);
        std::printf("# %s\n# roofline = max(2MNK / %.0f TFLOP/s, bytes / %.2f TB/s)\n",
                    weft::bench::describe(peaks).c_str(), peak_tflops, read_bw);
        std::printf("# weft and cuBLASLt (best of its heuristic algorithms) alternate launch by launch; medians\n");

        weft::bench::CublasLt lt(size_t{64} << 20);
        std::vector<Row> rows;
        for (BLayout layout : opt.layouts) {
            for (const Shape& s : opt.sizes) {
                const size_t in_bytes = weft::dtype_bytes(opt.in);
                const size_t a_bytes = static_cast<size_t>(s.m * s.k) * in_bytes;
                const size_t b_bytes = static_cast<size_t>(s.n * s.k) * in_bytes;
                const size_t d_bytes = static_cast<size_t>(s.m * s.n) * out_bytes;
                // Enough input sets that one pass over them is > 3x the L2: every iteration reads from DRAM.
                const int sets = weft::bench::cold_l2_sets(a_bytes + b_bytes, static_cast<size_t>(prop.l2CacheSize));
                std::vector<std::unique_ptr<Buffer>> as, bs;
                for (int i = 0; i < sets; ++i) {
                    as.push_back(std::make_unique<Buffer>(a_bytes));
                    bs.push_back(std::make_unique<Buffer>(b_bytes));
                    weft::bench::fill_random(as.back()->ptr, s.m * s.k, opt.in, 0x1234567ull + 977ull * i, nullptr);
                    weft::bench::fill_random(bs.back()->ptr, s.n * s.k, opt.in, 0xABCDEFull + 131ull * i, nullptr);
                }
                Buffer d_weft(d_bytes), d_lt(d_bytes);
                BENCH_CUDA(cudaDeviceSynchronize());
                auto views = [&](int i, void* d) {
                    const int set = i % sets;
                    Views v;
                    v.a = weft::TensorView(as[set]->ptr, opt.in, {s.m, s.k});
                    v.b = layout == BLayout::kNK ? weft::TensorView(bs[set]->ptr, opt.in, {s.n, s.k})
                                                 : weft::TensorView(bs[set]->ptr, opt.in, {s.k, s.n});
                    v.d = weft::TensorView(d, out, {s.m, s.n});
                    return v;
                };
                const double flops = 2.0 * s.m * s.n * s.k;
                const double bytes = static_cast<double>(a_bytes + b_bytes + d_bytes);
                const double roof_us = std::max(flops / (peak_tflops * 1e12), bytes / (read_bw * 1e12)) * 1e6;

                // cuBLASLt: time each heuristic algorithm briefly, keep the best, then time it fully.
                const LtGemm g(lt.handle(), opt.in, out,
                               layout == BLayout::kNK ? weft::bench::LtLayout::kNK : weft::bench::LtLayout::kKN,
                               {s.m, s.n, s.k, s.k, layout == BLayout::kNK ? s.k : s.n, s.n}, lt.workspace(),
                               lt.workspace_bytes(), LtGemm::kMaxAlgos);
                size_t best_algo = 0;
                double best_ms = 1e30;
                for (size_t al = 0; al < g.num_algos(); ++al) {
                    double ms = 1e30;
                    try {
                        ms = time_median_ms(2, std::min(opt.iters, 7), [&](int i) {
                            const Views v = views(i, d_lt.ptr);
                            g.run(al, v.a.data, v.b.data, v.d.data);
                        });
                    } catch (const std::exception&) {
                        continue;  // an algorithm that fails to run is skipped
                    }
                    if (ms < best_ms) {
                        best_ms = ms;
                        best_algo = al;
                    }
                }

                std::printf("# cuBLASLt %ldx%ldx%ld %s: algorithm %zu of %zu, %s\n", s.m, s.n, s.k,
                            layout == BLayout::kNK ? "NK" : "KN", best_algo, g.num_algos(), g.describe(best_algo).c_str());
                auto run_weft = [&](weft::ops::GemmOptions o, const std::string& label, bool is_auto) {
                    Row r;
                    r.s = s;
                    r.layout = layout;
                    r.path = label;
                    r.best = is_auto;
                    r.roof_us = roof_us;
                    // Launch j (weft and cuBLAS alternate) reads input set j % sets: no launch finds the
                    // previous launch's inputs in L2.
                    const auto [weft_ms, lt_ms] = time_rounds_ms(
                        opt.warmup, opt.iters,
                        [&](int i) {
                            const Views v = views(2 * i, d_weft.ptr);
                            weft::ops::gemm(v.a, v.b, v.d, layout, nullptr, o);
                        },
                        [&](int i) {
                            const Views v = views(2 * i + 1, d_lt.ptr);
                            g.run(best_algo, v.a.data, v.b.data, v.d.data);
                        });
                    r.weft_us = 1e3 * weft_ms;
                    r.cublas_us = 1e3 * lt_ms;
                    BENCH_CUDA(cudaGetLastError());
                    if (opt.check) {
                        const Views v = views(0, d_weft.ptr);
                        // Poisoned first: the timed calls left this output written.
                        BENCH_CUDA(cudaMemset(d_weft.ptr, 0xff, d_bytes));
                        weft::ops::gemm(v.a, v.b, v.d, layout, nullptr, o);
                        const Views w = views(0, d_lt.ptr);
                        g.run(best_algo, w.a.data, w.b.data, w.d.data);
                        BENCH_CUDA(cudaDeviceSynchronize());
                        r.rel_err = weft::bench::relative_error(d_weft.ptr, s.n, d_lt.ptr, s.n, s.m, s.n, out, nullptr);
                    }
                    rows.push_back(r);
                };
                // The op as a user calls it (heuristic path and config).
                {
                    const Views v0 = views(0, d_weft.ptr);
                    const weft::ops::GemmProblem p = weft::ops::validate_gemm_args(v0.a, v0.b, v0.d, layout);
                    weft::ops::GemmOptions o;
                    o.small_m_variant = opt.small_m_variant;
                    // A forced variant refuses shapes it cannot serve: force it only where it serves.
                    const bool serves = layout == BLayout::kNK &&
                                        (o.small_m_variant == weft::GemvVariant::kTmaWgmma ? s.m <= weft::kGemvWgmmaMaxM
                                         : o.small_m_variant == weft::GemvVariant::kBulkRows
                                             ? weft::ops::gemv_rows_unsupported(p).empty()
                                             : s.m <= weft::kGemvMaxM);
                    if (!serves) o.small_m_variant.reset();
                    o.small_m_splits = opt.small_m_splits;
                    o.split_k = opt.split_k;
                    const bool forced = o.small_m_variant.has_value() || opt.small_m_splits > 0;
                    if (forced) o.small_m_max_m = weft::kGemvMaxM;
                    if (opt.small_m_max_m >= 0) o.small_m_max_m = opt.small_m_max_m;
                    const auto plan = weft::ops::plan_gemm(p, prop.multiProcessorCount, o);
                    const std::string label = plan.path == weft::ops::GemmPath::kSmallM
                                                  ? std::string(forced ? "opt:" : "auto:") + "smallM.v" +
                                                        std::to_string(static_cast<int>(plan.small_m_variant)) + "/s" +
                                                        std::to_string(plan.small_m_splits)
                                                  : "auto:" + config_label(plan.config);
                    run_weft(o, label, true);
                    if (opt.host_us) {
                        // Host time per call: enqueue kCalls calls back to back, read the clock, then drain.
                        constexpr int kCalls = 200;
                        const auto host_us = [&](auto&& call) {
                            BENCH_CUDA(cudaDeviceSynchronize());
                            const auto t0 = std::chrono::steady_clock::now();
                            for (int i = 0; i < kCalls; ++i) call(i);
                            const auto t1 = std::chrono::steady_clock::now();
                            BENCH_CUDA(cudaDeviceSynchronize());
                            return std::chrono::duration<double, std::micro>(t1 - t0).count() / kCalls;
                        };
                        const double weft_host = host_us([&](int i) {
                            const Views v = views(i, d_weft.ptr);
                            weft::ops::gemm(v.a, v.b, v.d, layout, nullptr, o);
                        });
                        const double lt_host = host_us([&](int i) {
                            const Views v = views(i, d_lt.ptr);
                            g.run(best_algo, v.a.data, v.b.data, v.d.data);
                        });
                        std::printf("# host time per call %ldx%ldx%ld: weft %.2f us, cuBLASLt %.2f us\n", s.m, s.n, s.k,
                                    weft_host, lt_host);
                    }
                    weft::ops::GemmOptions pdl = o;
                    pdl.programmatic_launch = true;
                    if (opt.chain > 0 && weft::ops::gemm_launches_programmatically(plan, pdl)) {
                        // Chains of opt.chain calls, each on the next input set: plain, programmatic, cuBLASLt.
                        const int L = opt.chain;
                        const auto [plain_ms, pdl_ms, lt_ms] = time_rounds_ms(
                            std::max(1, opt.warmup / 2), opt.iters,
                            [&](int i) {
                                for (int j = 0; j < L; ++j) {
                                    const Views v = views(3 * L * i + j, d_weft.ptr);
                                    weft::ops::gemm(v.a, v.b, v.d, layout, nullptr, o);
                                }
                            },
                            [&](int i) {
                                for (int j = 0; j < L; ++j) {
                                    const Views v = views(3 * L * i + L + j, d_weft.ptr);
                                    weft::ops::gemm(v.a, v.b, v.d, layout, nullptr, pdl);
                                }
                            },
                            [&](int i) {
                                for (int j = 0; j < L; ++j) {
                                    const Views v = views(3 * L * i + 2 * L + j, d_lt.ptr);
                                    g.run(best_algo, v.a.data, v.b.data, v.d.data);
                                }
                            });
                        BENCH_CUDA(cudaGetLastError());
                        using Tagged = std::pair<const char*, double>;
                        for (const auto& [tag, ms] : {Tagged{"plain", plain_ms}, Tagged{"pdl", pdl_ms}}) {
                            Row r;
                            r.s = s;
                            r.layout = layout;
                            r.path = "chain" + std::to_string(L) + ":" + tag;
                            r.chain = true;
                            r.roof_us = roof_us;
                            r.weft_us = 1e3 * ms / L;
                            r.cublas_us = 1e3 * lt_ms / L;
                            rows.push_back(r);
                        }
                    }
                }
                if (opt.all_configs) {
                    for (const GemmConfig& c : weft::ops::gemm_candidate_configs(opt.in, out, layout)) {
                        weft::ops::GemmOptions o;
                        o.config = c;
                        run_weft(o, config_label(c), false);
                    }
                    for (const GemmConfig& c : weft::ops::gemm_split_k_configs(opt.in, out, layout)) {
                        const int64_t k_blocks = (s.k + c.tile_k - 1) / c.tile_k;
                        if (k_blocks < int64_t{weft::ops::kGemmMinSplitKBlocks} * c.splits) continue;
                        weft::ops::GemmOptions o;
                        o.config = c;
                        run_weft(o, config_label(c), false);
                    }
                    {
                        // The swapped configs the autotuner tries for this shape (GemmConfig::swap_ab, label "sw").
                        const Views v0 = views(0, d_weft.ptr);
                        const auto p = weft::ops::validate_gemm_args(v0.a, v0.b, v0.d, layout);
                        for (const GemmConfig& c : weft::ops::gemm_swap_ab_configs(p, prop.multiProcessorCount)) {
                            weft::ops::GemmOptions o;
                            o.config = c;
                            run_weft(o, config_label(c), false);
                        }
                    }
                    if (s.m <= weft::kGemvMaxM && layout == BLayout::kNK) {
                        for (int splits : {1, 2, 3, 4, 8, 16}) {
                            weft::ops::GemmOptions o;
                            o.small_m_splits = splits;
                            o.small_m_variant = weft::GemvVariant::kTmaRing;
                            o.small_m_max_m = weft::kGemvMaxM;
                            run_weft(o, "smallM.v3/s" + std::to_string(splits), false);
                        }
                        const Views v0 = views(0, d_weft.ptr);
                        const auto p = weft::ops::validate_gemm_args(v0.a, v0.b, v0.d, layout);
                        if (weft::ops::gemv_rows_unsupported(p).empty()) {
                            weft::ops::GemmOptions o;
                            o.small_m_variant = weft::GemvVariant::kBulkRows;
                            run_weft(o, "smallM.v4/s1", false);
                        }
                    }
                    if (s.m <= weft::kGemvWgmmaMaxM && layout == BLayout::kNK) {
                        // Variant 5 with its split rule (the autotuner's small_m_v5), then forced split counts.
                        weft::ops::GemmOptions o;
                        o.small_m_variant = weft::GemvVariant::kTmaWgmma;
                        const Views v0 = views(0, d_weft.ptr);
                        const auto p = weft::ops::validate_gemm_args(v0.a, v0.b, v0.d, layout);
                        const auto plan = weft::ops::plan_gemm(p, prop.multiProcessorCount, o);
                        run_weft(o, "smallM.v5/s" + std::to_string(plan.small_m_splits), false);
                        for (int splits : {1, 2, 4}) {
                            o.small_m_splits = splits;
                            run_weft(o, "smallM.v5/f" + std::to_string(splits), false);
                        }
                    }
                }
                // Print this shape's rows now (a killed run still shows what it measured).
                for (const Row& r : rows) {
                    if (r.s.m != s.m || r.s.n != s.n || r.s.k != s.k || r.layout != layout) continue;
                    char shape[48];
                    std::snprintf(shape, sizeof(shape), "%ldx%ldx%ld", r.s.m, r.s.n, r.s.k);
                    const double b_gbs = static_cast<double>(b_bytes) / (r.weft_us * 1e-6) / 1e9;
                    std::printf("%-20s %-3s %-22s %9.1f %9.1f %7.3f %9.1f %9.2f %9.2f %8.0f %6.1f%% %s\n", shape,
                                layout == BLayout::kNK ? "NK" : "KN", r.path.c_str(), tflops(r.s, r.weft_us),
                                tflops(r.s, r.cublas_us), r.cublas_us / r.weft_us, tflops(r.s, r.roof_us), r.weft_us,
                                r.cublas_us, b_gbs, 100.0 * b_gbs / (read_bw * 1e3),
                                r.rel_err >= 0 ? ("err " + std::to_string(r.rel_err)).c_str() : "");
                }
                std::fflush(stdout);
            }
        }
        // The fixed summary table: the op's own choice per shape.
        std::printf("\n%-20s %-3s %-22s %9s %9s %7s %9s %9s %9s %8s %7s\n", "shape (MxNxK)", "B", "path/config",
                    "weft TF/s", "cuBLAS", "ratio", "roof TF/s", "weft us", "cuBLAS us", "B GB/s", "%readBW");
        for (const Row& r : rows) {
            if (!r.best && !r.chain) continue;
            char shape[48];
            std::snprintf(shape, sizeof(shape), "%ldx%ldx%ld", r.s.m, r.s.n, r.s.k);
            const double b_gbs = static_cast<double>(r.s.n * r.s.k * weft::dtype_bytes(opt.in)) / (r.weft_us * 1e-6) / 1e9;
            std::printf("%-20s %-3s %-22s %9.1f %9.1f %7.3f %9.1f %9.2f %9.2f %8.0f %6.1f%%\n", shape,
                        r.layout == BLayout::kNK ? "NK" : "KN", r.path.c_str(), tflops(r.s, r.weft_us),
                        tflops(r.s, r.cublas_us), r.cublas_us / r.weft_us, tflops(r.s, r.roof_us), r.weft_us,
                        r.cublas_us, b_gbs, 100.0 * b_gbs / (read_bw * 1e3));
        }
        if (!opt.json.empty()) {
            weft::bench::Json j;
            j.begin_object().field("bench", "gemm").field("date", date).field("gpu", prop.name);
            j.field("sms", prop.multiProcessorCount).field("in", weft::dtype_name(opt.in));
            j.field("out", weft::dtype_name(out));
            j.field("iters", opt.iters).field("warmup", opt.warmup).field("read_bw_tbs", read_bw);
            j.field("peak_tflops", peak_tflops);
            weft::bench::add_peaks(j, peaks);
            j.key("results").begin_array();
            for (const Row& r : rows) {
                j.begin_object(true).field("m", r.s.m).field("n", r.s.n).field("k", r.s.k);
                j.field("layout", r.layout == BLayout::kNK ? "nk" : "kn").field("path", r.path).field("auto", r.best);
                j.field("chain", r.chain).field("weft_us", r.weft_us).field("cublas_us", r.cublas_us);
                j.field("weft_tflops", tflops(r.s, r.weft_us)).field("cublas_tflops", tflops(r.s, r.cublas_us));
                j.field("ratio", r.cublas_us / r.weft_us).field("roof_tflops", tflops(r.s, r.roof_us));
                j.field("rel_err_vs_cublas", r.rel_err).end_object();
            }
            j.end_array().end_object();
            weft::bench::write_json_file(opt.json, j);
        }
        // --check: every row within the tolerance of cuBLASLt's result (fp32 accumulation both sides, rounded to the
        // output type: 1e-2 covers bf16 rounding; an unwritten or wrong tile is far above it).
        int failed = 0;
        for (const Row& r : rows) {
            if (r.rel_err < 0 || r.rel_err <= kCheckTolerance) continue;
            std::printf("FAIL: %lldx%lldx%lld %s differs from cuBLASLt: relative error %.2e > %.0e\n",
                        static_cast<long long>(r.s.m), static_cast<long long>(r.s.n), static_cast<long long>(r.s.k),
                        r.path.c_str(), r.rel_err, kCheckTolerance);
            ++failed;
        }
        return failed > 0 ? 1 : 0;
    });
}
