// SPDX-License-Identifier: MIT
// weft_bench_moe: weft's grouped GEMM (weft::ops::grouped_gemm_contiguous / grouped_gemm_masked) against cuBLAS's
// grouped GEMM (cublasGemmGroupedBatchedEx, one problem per expert), a loop of per-expert cuBLASLt GEMMs, and weft's
// dense GEMM over the same total rows (the bound a grouped GEMM aims at), on the same random inputs in the same run;
// each launch alternates with the others (CUDA events, medians); a fixed table with the roofline and JSON.
// Roofline of a row: max(2 * rows * N * K over the measured tensor-core peak, the bytes the call must move over the
// measured read bandwidth), rows = the sum of the counts; the bytes: the weights of every expert with rows (each
// expert has its own N x K matrix: a grouped call over E experts reads E of them where the dense GEMM of the same rows
// reads one), A's rows read and D's rows written. "%roof" is the roofline over weft grouped's time; "xDenseMem" weft
// grouped's speed over max(weft dense's time, the memory term): the dense engine's rate on these rows with the weights
// the grouped call must read.
//
//   weft_bench_moe [--sizes GxRxNxK,...] [--masked GxCAPxNxK,...] [--counts uniform,skewed,one]
//                  [--out bf16|f32] [--grouped-config NAME] [--dense-config NAME] [--grouped-sm-budget N]
//                  [--iters N] [--warmup N] [--check] [--json FILE]
// --sizes: contiguous cases, G experts of R rows each (A [G*R, K], B [G, N, K]); default 8x4096x4096x7168 and
// 8x4096x7168x2048. --masked: masked cases, G experts of capacity CAP (A [G, CAP, K]); default 32x256x4096x7168 and
// 32x256x7168x2048. --counts: uniform (contiguous: R rows each; masked: 3/4 of CAP each), skewed (expert e gets
// about R / (e + 1) rows, at least 1, or CAP / (e + 1)), one (every expert empty but expert G / 2, which gets R or CAP:
// compare with the dense GEMM of that one expert). The dense row is weft::ops::gemm on [sum of rows, K] x [N, K].
// The inputs of one case exceed 3x the L2 (every shape listed): launches read them from DRAM without rotation.
// --dtype and --world are accepted for the shared command line (bf16, one GPU).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <memory>
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
#include "weft/ops/grouped_gemm.hpp"
#include "weft/runtime/error.hpp"

namespace {

using weft::BLayout;
using weft::DType;
using weft::TensorView;

#define BENCH_CUBLAS(call)                                                                               \
    do {                                                                                                 \
        const cublasStatus_t st_ = (call);                                                               \
        WEFT_CHECK(st_ == CUBLAS_STATUS_SUCCESS, #call << " failed: cuBLAS status " << static_cast<int>(st_)); \
    } while (0)

using Buffer = weft::bench::DeviceBuffer;

struct MoeCase {
    bool masked = false;
    int64_t groups = 0, rows = 0, n = 0, k = 0;  // rows: per expert (contiguous) or capacity (masked)
    std::string counts;                          // uniform | skewed | one
};

std::vector<int32_t> make_counts(const MoeCase& c) {
    std::vector<int32_t> v(static_cast<size_t>(c.groups), 0);
    for (int64_t e = 0; e < c.groups; ++e) {
        int64_t rows = 0;
        if (c.counts == "uniform") {
            rows = c.masked ? c.rows * 3 / 4 : c.rows;
        } else if (c.counts == "skewed") {
            rows = std::max<int64_t>(1, c.rows / (e + 1));
        } else {
            rows = e == c.groups / 2 ? c.rows : 0;
        }
        v[static_cast<size_t>(e)] = static_cast<int32_t>(rows);
    }
    return v;
}

struct Options {
    std::vector<MoeCase> contiguous, masked;
    std::vector<std::string> counts = {"uniform", "skewed", "one"};
    DType out = DType::kBF16;
    DType dtype = DType::kBF16;
    std::vector<int> world = {1};
    int iters = 20;
    int warmup = 3;
    bool check = false;
    std::string json;
    std::string grouped_config;  // --grouped-config: a grouped candidate's name (gemm_candidate_name), "" = the plan's
    std::string dense_config;    // --dense-config: a dense or grouped candidate's name, "" = the op's own choice
    int grouped_sm_budget = 0;   // --grouped-sm-budget: CTAs of weft grouped's persistent grid, 0 = every SM
};

// The grouped candidate named `name` for these dtypes, or a usage error listing the names.
weft::GemmConfig grouped_config_named(const std::string& name, DType out) {
    std::string names;
    for (const weft::GemmConfig& c : weft::ops::grouped_gemm_candidate_configs(DType::kBF16, out, BLayout::kNK)) {
        if (weft::ops::gemm_candidate_name(c) == name) return c;
        names += (names.empty() ? "" : ", ") + weft::ops::gemm_candidate_name(c);
    }
    throw weft::bench::UsageError("--grouped-config: no grouped candidate named '" + name + "'; the candidates: " +
                                  names);
}

// The dense candidate (or grouped one: a config weft::ops::gemm runs as well) named `name`, or a usage error.
weft::GemmConfig dense_config_named(const std::string& name, DType out) {
    std::string names;
    for (const auto& list : {weft::ops::gemm_candidate_configs(DType::kBF16, out, BLayout::kNK),
                             weft::ops::grouped_gemm_candidate_configs(DType::kBF16, out, BLayout::kNK)}) {
        for (const weft::GemmConfig& c : list) {
            if (weft::ops::gemm_candidate_name(c) == name) return c;
            names += (names.empty() ? "" : ", ") + weft::ops::gemm_candidate_name(c);
        }
    }
    throw weft::bench::UsageError("--dense-config: no candidate named '" + name + "'; the candidates: " + names);
}

std::vector<MoeCase> parse_cases(const std::string& text, const std::string& option, bool masked) {
    std::vector<MoeCase> out;
    for (const std::string& item : weft::bench::split(text, ',')) {
        const auto parts = weft::bench::split(item, 'x');
        if (parts.size() != 4) throw weft::bench::UsageError(option + ": expected GxRxNxK, got '" + item + "'");
        MoeCase c;
        c.masked = masked;
        c.groups = weft::bench::parse_int(parts[0], option, 1, 4096);
        c.rows = weft::bench::parse_int(parts[1], option, 1, 1 << 20);
        c.n = weft::bench::parse_int(parts[2], option, 8, 1 << 20);
        c.k = weft::bench::parse_int(parts[3], option, 8, 1 << 20);
        out.push_back(c);
    }
    return out;
}

struct Row {
    std::string layout, counts;
    int64_t groups = 0, total_rows = 0, n = 0, k = 0;
    double grouped_ms = 0, cublas_grouped_ms = 0, cublas_loop_ms = 0, dense_ms = 0;
    int64_t experts = 0;  // experts with rows
    double compute_ms = 0, memory_ms = 0, roofline_ms = 0;  // roofline_ms = max(compute_ms, memory_ms)
    double err = -1;
    std::string config;
    std::string
        dense_config;  // the dense GEMM's tiled config (its plan, or --dense-config); "small-M" off the tiled path
};

double tflops(const Row& r, double ms) { return ms > 0 ? 2.0 * r.total_rows * r.n * r.k / (ms * 1e9) : 0; }

// The roofline of a grouped call (the file's header): compute at the measured tensor peak, bytes at the measured read
// bandwidth; `counts` per expert, bf16 inputs, `out_bytes` per element of D.
void set_roofline(Row& r, const std::vector<int32_t>& counts, size_t out_bytes, const weft::bench::Peaks& peaks) {
    r.experts = std::count_if(counts.begin(), counts.end(), [](int32_t c) { return c > 0; });
    const double bytes = 2.0 * r.experts * r.n * r.k + 2.0 * r.total_rows * r.k +
                         static_cast<double>(out_bytes) * r.total_rows * r.n;
    r.compute_ms = peaks.tensor_tflops > 0 ? 2.0 * r.total_rows * r.n * r.k / (peaks.tensor_tflops * 1e9) : 0;
    r.memory_ms = peaks.read_tbs > 0 ? bytes / (peaks.read_tbs * 1e9) : 0;
    r.roofline_ms = std::max(r.compute_ms, r.memory_ms);
}

// Weft grouped's speed over max(weft dense's time on the same rows, the memory term).
double dense_mem(const Row& r) { return r.grouped_ms > 0 ? std::max(r.dense_ms, r.memory_ms) / r.grouped_ms : 0; }

Row run_case(const MoeCase& c, const Options& opt, const weft::bench::Peaks& peaks, cublasHandle_t blas,
             weft::bench::CublasLt& lt, cudaStream_t stream) {
    const std::vector<int32_t> counts = make_counts(c);
    const int64_t groups = c.groups;
    std::vector<int32_t> offsets(static_cast<size_t>(groups));
    int64_t total = 0;
    for (int64_t e = 0; e < groups; ++e) {
        offsets[static_cast<size_t>(e)] = static_cast<int32_t>(c.masked ? e * c.rows : total);
        total += counts[static_cast<size_t>(e)];
    }
    const int64_t a_rows = c.masked ? groups * c.rows : std::max<int64_t>(total, 1);
    const size_t out_bytes = static_cast<size_t>(weft::dtype_bytes(opt.out));
    Buffer a(static_cast<size_t>(a_rows * c.k) * 2), b(static_cast<size_t>(groups * c.n * c.k) * 2);
    Buffer d(static_cast<size_t>(a_rows * c.n) * out_bytes), d_ref(static_cast<size_t>(a_rows * c.n) * out_bytes);
    Buffer d_dense(static_cast<size_t>(std::max<int64_t>(total, 1) * c.n) * out_bytes);
    Buffer dcounts(counts.size() * 4), doffsets(offsets.size() * 4);
    weft::bench::fill_random(a.ptr, a_rows * c.k, DType::kBF16, 1, stream);
    weft::bench::fill_random(b.ptr, groups * c.n * c.k, DType::kBF16, 2, stream);
    BENCH_CUDA(cudaMemcpyAsync(dcounts.ptr, counts.data(), counts.size() * 4, cudaMemcpyHostToDevice, stream));
    BENCH_CUDA(cudaMemcpyAsync(doffsets.ptr, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice, stream));

    Row row;
    row.layout = c.masked ? "masked" : "contiguous";
    row.counts = c.counts;
    row.groups = groups;
    row.total_rows = total;
    row.n = c.n;
    row.k = c.k;
    set_roofline(row, counts, out_bytes, peaks);

    const auto* counts_d = static_cast<const int32_t*>(dcounts.ptr);
    weft::ops::GroupedGemmOptions gopt;
    gopt.expected_rows_per_group = std::max<int64_t>(1, total / std::max<int64_t>(groups, 1));
    if (!opt.grouped_config.empty()) gopt.config = grouped_config_named(opt.grouped_config, opt.out);
    gopt.sm_budget = opt.grouped_sm_budget;
    auto grouped = [&](int) {
        if (c.masked) {
            weft::ops::grouped_gemm_masked(TensorView(a.ptr, DType::kBF16, {groups, c.rows, c.k}),
                                           TensorView(b.ptr, DType::kBF16, {groups, c.n, c.k}),
                                           TensorView(d.ptr, opt.out, {groups, c.rows, c.n}), BLayout::kNK, counts_d,
                                           stream, gopt);
        } else {
            weft::ops::grouped_gemm_contiguous(TensorView(a.ptr, DType::kBF16, {a_rows, c.k}),
                                               TensorView(b.ptr, DType::kBF16, {groups, c.n, c.k}),
                                               TensorView(d.ptr, opt.out, {a_rows, c.n}), BLayout::kNK,
                                               static_cast<const int32_t*>(doffsets.ptr), counts_d, stream, gopt);
        }
    };
    {
        weft::ops::GroupedGemmProblem p = weft::ops::validate_grouped_gemm_args(
            c.masked ? weft::ops::GroupedLayout::kMasked : weft::ops::GroupedLayout::kContiguous,
            c.masked ? TensorView(a.ptr, DType::kBF16, {groups, c.rows, c.k})
                     : TensorView(a.ptr, DType::kBF16, {a_rows, c.k}),
            TensorView(b.ptr, DType::kBF16, {groups, c.n, c.k}),
            c.masked ? TensorView(d.ptr, opt.out, {groups, c.rows, c.n}) : TensorView(d.ptr, opt.out, {a_rows, c.n}),
            BLayout::kNK, static_cast<const int32_t*>(doffsets.ptr), counts_d);
        int sms = 0;
        BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        const auto plan = weft::ops::plan_grouped_gemm(p, sms, gopt);
        row.config = std::to_string(plan.config.tile_m) + "x" + std::to_string(plan.config.tile_n) +
                     (plan.config.pingpong ? "_pp" : "");
    }

    // cuBLAS grouped: one group per non-empty expert, one problem each; row-major D = A B^T as column-major
    // D^T (N x rows) = B (N x K, "T" of its [K, N] column-major view) * A^T (K x rows).
    std::vector<const void*> ptr_a, ptr_b;
    std::vector<void*> ptr_d;
    std::vector<int> m_arr, n_arr, k_arr, lda, ldb, ldc, group_size;
    std::vector<cublasOperation_t> ta, tb;
    std::vector<float> alpha, beta;
    for (int64_t e = 0; e < groups; ++e) {
        const int32_t rows_e = counts[static_cast<size_t>(e)];
        if (rows_e == 0) continue;
        const int64_t first = offsets[static_cast<size_t>(e)];
        ptr_a.push_back(static_cast<const char*>(b.ptr) + e * c.n * c.k * 2);
        ptr_b.push_back(static_cast<const char*>(a.ptr) + first * c.k * 2);
        ptr_d.push_back(static_cast<char*>(d_ref.ptr) + static_cast<size_t>(first * c.n) * out_bytes);
        m_arr.push_back(static_cast<int>(c.n));
        n_arr.push_back(rows_e);
        k_arr.push_back(static_cast<int>(c.k));
        lda.push_back(static_cast<int>(c.k));
        ldb.push_back(static_cast<int>(c.k));
        ldc.push_back(static_cast<int>(c.n));
        ta.push_back(CUBLAS_OP_T);
        tb.push_back(CUBLAS_OP_N);
        alpha.push_back(1.0f);
        beta.push_back(0.0f);
        group_size.push_back(1);
    }
    const int num_groups = static_cast<int>(group_size.size());
    Buffer dptr_a(ptr_a.size() * 8 + 8), dptr_b(ptr_b.size() * 8 + 8), dptr_d(ptr_d.size() * 8 + 8);
    BENCH_CUDA(cudaMemcpy(dptr_a.ptr, ptr_a.data(), ptr_a.size() * 8, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(dptr_b.ptr, ptr_b.data(), ptr_b.size() * 8, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(dptr_d.ptr, ptr_d.data(), ptr_d.size() * 8, cudaMemcpyHostToDevice));
    const cudaDataType_t c_type = opt.out == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
    BENCH_CUBLAS(cublasSetStream(blas, stream));
    auto cublas_grouped_call = [&]() {
        return cublasGemmGroupedBatchedEx(blas, ta.data(), tb.data(), m_arr.data(), n_arr.data(), k_arr.data(),
                                          alpha.data(), static_cast<const void* const*>(dptr_a.ptr), CUDA_R_16BF,
                                          lda.data(), static_cast<const void* const*>(dptr_b.ptr), CUDA_R_16BF,
                                          ldb.data(), beta.data(), static_cast<void* const*>(dptr_d.ptr), c_type,
                                          ldc.data(), num_groups, group_size.data(), CUBLAS_COMPUTE_32F);
    };
    // A type combination this cuBLAS does not offer leaves its column empty (reported) rather than ending the run.
    bool have_cublas_grouped = num_groups > 0;
    if (have_cublas_grouped) {
        const cublasStatus_t st = cublas_grouped_call();
        if (st != CUBLAS_STATUS_SUCCESS) {
            std::printf("# cublasGemmGroupedBatchedEx: status %d for bf16 -> %s: no cuBLAS grouped figure\n",
                        static_cast<int>(st), weft::dtype_name(opt.out));
            have_cublas_grouped = false;
        }
    }
    auto cublas_grouped = [&](int) {
        if (have_cublas_grouped) BENCH_CUBLAS(cublas_grouped_call());
    };
    // Per-expert cuBLASLt GEMMs (the fastest of its heuristic's algorithms per shape), one launch per non-empty
    // expert.
    std::vector<std::unique_ptr<weft::bench::LtGemm>> loop;
    std::vector<size_t> loop_algo(static_cast<size_t>(groups), 0);
    for (int64_t e = 0; e < groups; ++e) {
        const int32_t rows_e = counts[static_cast<size_t>(e)];
        if (rows_e == 0) {
            loop.emplace_back();
            continue;
        }
        loop.push_back(std::make_unique<weft::bench::LtGemm>(
            lt.handle(), DType::kBF16, opt.out, weft::bench::LtLayout::kNK,
            weft::bench::LtGemm::Shape{rows_e, c.n, c.k, c.k, c.k, c.n}, lt.workspace(), lt.workspace_bytes(),
            weft::bench::LtGemm::kMaxAlgos));
        const int64_t first = offsets[static_cast<size_t>(e)];
        loop_algo[static_cast<size_t>(e)] = loop.back()->fastest(
            static_cast<const char*>(a.ptr) + first * c.k * 2, static_cast<const char*>(b.ptr) + e * c.n * c.k * 2,
            static_cast<char*>(d_ref.ptr) + static_cast<size_t>(first * c.n) * out_bytes, stream);
    }
    auto cublas_loop = [&](int) {
        for (int64_t e = 0; e < groups; ++e) {
            if (!loop[static_cast<size_t>(e)]) continue;
            const int64_t first = offsets[static_cast<size_t>(e)];
            loop[static_cast<size_t>(e)]->run(
                loop_algo[static_cast<size_t>(e)], static_cast<const char*>(a.ptr) + first * c.k * 2,
                static_cast<const char*>(b.ptr) + e * c.n * c.k * 2,
                static_cast<char*>(d_ref.ptr) + static_cast<size_t>(first * c.n) * out_bytes, stream);
        }
    };
    // weft's dense GEMM over the same total rows (expert 0's weights): what the grouped GEMM is measured against.
    weft::ops::GemmOptions dense_options;
    if (!opt.dense_config.empty()) dense_options.config = dense_config_named(opt.dense_config, opt.out);
    if (total > 0) {
        weft::ops::GemmProblem dp;
        dp.m = total;
        dp.n = c.n;
        dp.k = c.k;
        dp.in_dtype = DType::kBF16;
        dp.out_dtype = opt.out;
        dp.b_rows_contiguous = true;  // B [N, K], rows back to back (as validate_gemm_args finds)
        int sms = 0;
        BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        const weft::ops::GemmPlan plan = weft::ops::plan_gemm(dp, sms, dense_options);
        row.dense_config =
            plan.path == weft::ops::GemmPath::kTiled ? weft::ops::gemm_candidate_name(plan.config) : "small-M";
    }
    auto dense = [&](int) {
        if (total == 0) return;
        weft::ops::gemm(TensorView(a.ptr, DType::kBF16, {total, c.k}), TensorView(b.ptr, DType::kBF16, {c.n, c.k}),
                        TensorView(d_dense.ptr, opt.out, {total, c.n}), BLayout::kNK, stream, dense_options);
    };

    // Correctness first (--check): the grouped output against the per-expert cuBLASLt loop, group by group.
    if (opt.check && total > 0) {
        grouped(0);
        cublas_loop(0);
        BENCH_CUDA(cudaStreamSynchronize(stream));
        double worst = 0;
        for (int64_t e = 0; e < groups; ++e) {
            const int32_t rows_e = counts[static_cast<size_t>(e)];
            if (rows_e == 0) continue;
            const size_t off = static_cast<size_t>(offsets[static_cast<size_t>(e)] * c.n) * out_bytes;
            worst = std::max(worst, weft::bench::relative_error(static_cast<char*>(d.ptr) + off, c.n,
                                                                static_cast<char*>(d_ref.ptr) + off, c.n, rows_e, c.n,
                                                                opt.out, stream));
        }
        row.err = worst;
    }

    const auto ms = weft::bench::time_rounds_median_ms(stream, opt.warmup, opt.iters, grouped, cublas_grouped,
                                                       cublas_loop, dense);
    row.grouped_ms = ms[0];
    row.cublas_grouped_ms = have_cublas_grouped ? ms[1] : 0;
    row.cublas_loop_ms = ms[2];
    row.dense_ms = total > 0 ? ms[3] : 0;
    return row;
}

}  // namespace

int main(int argc, char** argv) {
    Options opt;
    opt.contiguous = parse_cases("8x4096x4096x7168,8x4096x7168x2048", "--sizes", false);
    opt.masked = parse_cases("32x256x4096x7168,32x256x7168x2048", "--masked", true);
    weft::bench::Cli cli("weft_bench_moe",
                         "weft's grouped GEMM against cuBLAS grouped GEMM, a per-expert cuBLASLt loop and weft's dense "
                         "GEMM over the same rows");
    cli.sizes("GxRxNxK", "contiguous cases: G experts of R rows (default 8x4096x4096x7168,8x4096x7168x2048)",
              [&](const std::string& v) { opt.contiguous = parse_cases(v, "--sizes", false); });
    cli.option("--masked", "GxCAPxNxK", "masked cases: G experts of capacity CAP (default 32x256x4096x7168,...)",
               [&](const std::string& v) { opt.masked = v == "none" ? std::vector<MoeCase>{} : parse_cases(v, "--masked", true); });
    cli.option("--counts", "uniform,skewed,one", "row counts per expert (default all three)", [&](const std::string& v) {
        opt.counts = weft::bench::parse_choice_list(v, "--counts", {"uniform", "skewed", "one"});
    });
    cli.option("--out", "bf16|f32", "output dtype (default bf16)", [&](const std::string& v) {
        opt.out = weft::bench::parse_dtype(v, "--out", {DType::kBF16, DType::kF32});
    });
    cli.dtype(&opt.dtype, {DType::kBF16}).world(&opt.world, 1, 1).iters(&opt.iters).warmup(&opt.warmup);
    cli.option("--grouped-config", "NAME",
               "force weft grouped's config, a grouped candidate by name (e.g. 128x256x64_s4_c1x1, "
               "64x256x64_s4_c1x1_pp; default: the plan's)",
               [&](const std::string& v) { opt.grouped_config = v; });
    cli.option("--dense-config", "NAME",
               "force weft dense's config, a dense or grouped candidate by name (default: the op's own choice); "
               "the dense config used is printed per row",
               [&](const std::string& v) { opt.dense_config = v; });
    cli.int_option("--grouped-sm-budget", "CTAs of weft grouped's persistent grid (default 0: every SM)",
                   &opt.grouped_sm_budget, 0, 1 << 16);
    cli.check(&opt.check).json(&opt.json);
    return weft::bench::run_main("weft_bench_moe", [&] {
        cli.parse(argc, argv);
        if (!opt.grouped_config.empty()) (void)grouped_config_named(opt.grouped_config, opt.out);  // fails early
        if (!opt.dense_config.empty()) (void)dense_config_named(opt.dense_config, opt.out);
        BENCH_CUDA(cudaSetDevice(0));
        const weft::bench::Peaks peaks =
            weft::bench::measure_peaks(weft::bench::kPeakTensor | weft::bench::kPeakRead, DType::kBF16);
        cudaStream_t stream = nullptr;
        BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        cublasHandle_t blas = nullptr;
        BENCH_CUBLAS(cublasCreate(&blas));
        weft::bench::CublasLt lt;
        char date[32];
        const std::time_t now = std::time(nullptr);
        std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
        std::printf("# weft_bench_moe %s  %s  out %s  iters %d warmup %d\n# %s\n", date, peaks.gpu.c_str(),
                    weft::dtype_name(opt.out), opt.iters, opt.warmup, weft::bench::describe(peaks).c_str());
        std::printf("# ms: medians, the four alternating launch by launch; x: weft grouped's speed over the column's\n");
        std::printf("# targets: contiguous x(weftDense) >= 0.9 and x(cublasGrp) >= 1.0; masked x(weftDense) >= 0.85; "
                    "counts 'one' x(weftDense) >= 0.95\n");
        std::printf("# roofline: max(2 rows N K / tensor peak, (weights of the E experts with rows + A rows + D rows) "
                    "/ read bandwidth), bound c(ompute) or m(emory); %%roof: roofline / grouped; xDenseMem: "
                    "max(weftDense, memory term) / grouped\n");
        std::printf("%-10s %-7s %4s %4s %7s %5s %5s %-9s %9s %7s %9s %6s %9s %6s %9s %6s %9s %5s %6s %9s %8s\n",
                    "layout", "counts", "G", "E", "rows", "N", "K", "tile", "grouped", "TFLOP/s", "cublasGrp", "x",
                    "cublasLoop", "x", "weftDense", "x", "roofline", "bound", "%roof", "xDenseMem", "err");
        std::vector<Row> rows;
        for (const auto& list : {opt.contiguous, opt.masked}) {
            for (MoeCase c : list) {
                for (const std::string& counts : opt.counts) {
                    c.counts = counts;
                    const Row r = run_case(c, opt, peaks, blas, lt, stream);
                    std::printf("%-10s %-7s %4lld %4lld %7lld %5lld %5lld %-9s %9.3f %7.1f %9.3f %6.3f %9.3f %6.3f "
                                "%9.3f %6.3f %9.3f %5s %6.1f %9.3f %8.1e\n",
                                r.layout.c_str(), r.counts.c_str(), static_cast<long long>(r.groups),
                                static_cast<long long>(r.experts), static_cast<long long>(r.total_rows),
                                static_cast<long long>(r.n), static_cast<long long>(r.k), r.config.c_str(),
                                r.grouped_ms, tflops(r, r.grouped_ms), r.cublas_grouped_ms,
                                r.grouped_ms > 0 ? r.cublas_grouped_ms / r.grouped_ms : 0, r.cublas_loop_ms,
                                r.grouped_ms > 0 ? r.cublas_loop_ms / r.grouped_ms : 0, r.dense_ms,
                                r.grouped_ms > 0 ? r.dense_ms / r.grouped_ms : 0, r.roofline_ms,
                                r.memory_ms > r.compute_ms ? "m" : "c",
                                r.grouped_ms > 0 ? 100.0 * r.roofline_ms / r.grouped_ms : 0, dense_mem(r), r.err);
                    std::printf("#   weft dense: %s\n", r.dense_config.c_str());
                    std::fflush(stdout);
                    rows.push_back(r);
                }
            }
        }
        bool ok = true;
        if (opt.check) {
            for (const Row& r : rows) {
                if (r.err > (opt.out == DType::kF32 ? 1e-5 : 1e-2)) ok = false;
            }
            std::printf("# check: %s (grouped vs per-expert cuBLASLt, relative Frobenius error per expert)\n",
                        ok ? "passed" : "FAILED");
        }
        if (!opt.json.empty()) {
            weft::bench::Json j;
            j.begin_object().field("bench", "moe").field("out", weft::dtype_name(opt.out));
            weft::bench::add_peaks(j, peaks);
            j.key("results").begin_array();
            for (const Row& r : rows) {
                j.begin_object(true)
                    .field("layout", r.layout)
                    .field("counts", r.counts)
                    .field("groups", r.groups)
                    .field("rows", r.total_rows)
                    .field("n", r.n)
                    .field("k", r.k)
                    .field("tile", r.config)
                    .field("grouped_ms", r.grouped_ms)
                    .field("cublas_grouped_ms", r.cublas_grouped_ms)
                    .field("cublas_loop_ms", r.cublas_loop_ms)
                    .field("weft_dense_ms", r.dense_ms)
                    .field("weft_dense_config", r.dense_config)
                    .field("experts_with_rows", r.experts)
                    .field("roofline_ms", r.roofline_ms)
                    .field("roofline_compute_ms", r.compute_ms)
                    .field("roofline_memory_ms", r.memory_ms)
                    .field("roofline_bound", r.memory_ms > r.compute_ms ? "memory" : "compute")
                    .field("pct_of_roofline", r.grouped_ms > 0 ? 100.0 * r.roofline_ms / r.grouped_ms : 0)
                    .field("x_dense_or_memory", dense_mem(r))
                    .field("rel_err", r.err)
                    .end_object();
            }
            j.end_array().end_object();
            weft::bench::write_json_file(opt.json, j);
        }
        cublasDestroy(blas);
        cudaStreamDestroy(stream);
        return ok ? 0 : 1;
    });
}
