// SPDX-License-Identifier: MIT
// weft_bench_prefill: prefill attention. `kernel` rows: weft::ops::flash_attention alone on one GPU (the sequence
// whole: q, k, v [S, heads, dim]) in TFLOP/s beside the dense tensor-core rate cuBLASLt reaches in the same run
// (PyTorch SDPA's figures for the same shapes come from bench/attention/sdpa_baseline.py). `ag` rows: the sequence
// sharded over a world of ranks (threads over the visible GPUs), weft::ops::AgAttention against its baseline, an
// all_gather of K and V then the same kernel, back to back; the slowest rank's time counts. `--kernel` picks the
// prefill kernel (AttentionPrefillConfig::kernel): mma.sync, wgmma (sm_90), or both side by side in one run.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/data.hpp"
#include "common/json.hpp"
#include "common/peaks.hpp"
#include "common/ranks.hpp"
#include "common/report.hpp"
#include "common/timing.hpp"
#include "weft/ops/ag_attention.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/world.hpp"

namespace {

using weft::DType;
using weft::TensorView;
using weft::bench::DeviceBuffer;

struct Options {
    std::vector<int64_t> seqs = {16384, 32768, 65536, 131072};
    int hq = 32;
    int hkv = 32;
    int dim = 128;
    bool causal = true;
    bool no_causal = false;
    std::string mode = "all";  // kernel | ag | all
    int world = 2;
    DType dtype = DType::kBF16;
    int iters = 10;
    int warmup = 2;
    bool check = false;
    std::string json;
    std::string kernel = "default";  // mma | wgmma | both | default (the device's)
    int block_m = 0;                 // 0: the default config's
    int stages = 0;                  // 0: the default config's
};

/// The config the rows run: the kernel's default, with --block-m / --stages where given (checked by the op).
weft::AttentionPrefillConfig config_of(const Options& o, weft::AttentionPrefillKernel kernel) {
    weft::AttentionPrefillConfig c = weft::attention_prefill_default_config(o.dtype, o.dim, kernel);
    if (o.block_m != 0) c.block_m = o.block_m;
    if (o.stages != 0) c.stages = o.stages;
    return c;
}

const char* kernel_label(weft::AttentionPrefillKernel k) {
    return k == weft::AttentionPrefillKernel::kWgmma ? "wgmma" : "mma";
}

/// The kernels a run measures, in order.
std::vector<weft::AttentionPrefillKernel> kernels_of(const Options& o) {
    using weft::AttentionPrefillKernel;
    if (o.kernel == "mma") return {AttentionPrefillKernel::kMmaSync};
    if (o.kernel == "wgmma") return {AttentionPrefillKernel::kWgmma};
    if (o.kernel == "both") return {AttentionPrefillKernel::kMmaSync, AttentionPrefillKernel::kWgmma};
    return {weft::ops::attention_prefill_device_kernel()};
}

Options parse(int argc, char** argv) {
    Options o;
    weft::bench::Cli cli("weft_bench_prefill", "prefill attention: the kernel alone, and all-gather attention");
    cli.sizes("S[,S...]", "total sequence lengths (default 16K,32K,64K,128K; K = 1024)", [&](const std::string& v) {
        o.seqs.clear();
        for (const std::string& s : weft::bench::split(v, ',')) {
            const uint64_t n = weft::bench::parse_bytes(s, "--sizes");
            if (n < 1 || n >= (1ull << 31) - (1ull << 20)) {
                throw weft::bench::UsageError("--sizes: 1 .. 2^31 - 2^20 tokens");
            }
            o.seqs.push_back(static_cast<int64_t>(n));
        }
    });
    cli.option("--heads", "Q/KV", "q-heads / KV heads (default 32/32)", [&](const std::string& v) {
        const auto slash = v.find('/');
        if (slash == std::string::npos) throw weft::bench::UsageError("--heads: expected Q/KV, got " + v);
        o.hq = static_cast<int>(weft::bench::parse_int(v.substr(0, slash), "--heads", 1, 4096));
        o.hkv = static_cast<int>(weft::bench::parse_int(v.substr(slash + 1), "--heads", 1, 4096));
        if (o.hq % o.hkv != 0 || o.hq / o.hkv > 16) {
            throw weft::bench::UsageError("--heads: Q must be a multiple of KV with Q / KV <= 16, got " + v);
        }
    });
    cli.option("--dim", "D", "head dimension: 64 or 128 (default 128)", [&](const std::string& v) {
        o.dim = static_cast<int>(weft::bench::parse_int(v, "--dim", 64, 128));
        if (o.dim != 64 && o.dim != 128) throw weft::bench::UsageError("--dim: 64 or 128");
    });
    cli.flag("--no-causal", "no mask (default: causal)", &o.no_causal);
    cli.option(
        "--block-m", "N", "query rows per work item: 64, 128 or 192 (wgmma, dim 64) (default: the config's)",
        [&](const std::string& v) { o.block_m = static_cast<int>(weft::bench::parse_int(v, "--block-m", 64, 192)); });
    cli.option("--stages", "N", "K/V pipeline stages: 2 or 3 (default: the config's)",
               [&](const std::string& v) { o.stages = static_cast<int>(weft::bench::parse_int(v, "--stages", 2, 3)); });
    cli.option("--kernel", "mma|wgmma|both", "prefill kernel (default: the device's, wgmma on sm_90)",
               [&](const std::string& v) {
                   if (v != "mma" && v != "wgmma" && v != "both") {
                       throw weft::bench::UsageError("--kernel: mma, wgmma or both");
                   }
                   o.kernel = v;
               });
    cli.option("--mode", "kernel|ag|all", "which rows (default all)", [&](const std::string& v) {
        if (v != "kernel" && v != "ag" && v != "all") throw weft::bench::UsageError("--mode: kernel, ag or all");
        o.mode = v;
    });
    cli.world(&o.world, 1, 64, "ranks of the ag rows, threads over the visible GPUs (default 2)");
    cli.dtype(&o.dtype, {DType::kBF16, DType::kF16}).iters(&o.iters).warmup(&o.warmup).check(&o.check).json(&o.json);
    cli.parse(argc, argv);
    o.causal = !o.no_causal;
    return o;
}

/// Multiply-adds x 2 of one attention forward: two GEMMs of dim per visible (query, key) pair and q-head.
double attention_flops(int64_t seq_q, int64_t seq_kv, int64_t q_position, bool causal, int hq, int dim) {
    double pairs = 0;
    if (!causal) {
        pairs = static_cast<double>(seq_q) * static_cast<double>(seq_kv);
    } else {
        for (int64_t i = 0; i < seq_q; ++i) pairs += static_cast<double>(std::min(seq_kv, q_position + i + 1));
    }
    return 4.0 * pairs * hq * dim;
}

/// Checks query rows `rows` of q-head 0 against an fp64 reference on the host (reads q-head 0's KV head, and the
/// rows). Returns the largest absolute error, or a negative value when a row is not finite.
double check_rows(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                  const std::vector<int64_t>& rows, int64_t q_position, bool causal, DType t) {
    const int64_t seq_kv = k.dim(0), dim = q.dim(2);
    const int64_t es = 2;
    std::vector<uint16_t> kh(static_cast<size_t>(seq_kv * dim)), vh(kh.size());
    BENCH_CUDA(cudaMemcpy2D(kh.data(), dim * es, k.data, k.stride(0) * es, dim * es, seq_kv, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy2D(vh.data(), dim * es, v.data, v.stride(0) * es, dim * es, seq_kv, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int64_t r : rows) {
        std::vector<uint16_t> qr(static_cast<size_t>(dim)), orow(static_cast<size_t>(dim));
        BENCH_CUDA(cudaMemcpy(qr.data(), static_cast<const uint16_t*>(q.data) + r * q.stride(0), dim * es,
                              cudaMemcpyDeviceToHost));
        BENCH_CUDA(cudaMemcpy(orow.data(), static_cast<const uint16_t*>(out.data) + r * out.stride(0), dim * es,
                              cudaMemcpyDeviceToHost));
        const int64_t visible = causal ? std::min(seq_kv, q_position + r + 1) : seq_kv;
        const std::vector<double> ref =
            weft::bench::attention_row_reference(qr.data(), kh.data(), vh.data(), visible, dim, t);
        for (int64_t e = 0; e < dim; ++e) {
            const double got = weft::bench::host_value(&orow[static_cast<size_t>(e)], t);
            if (!std::isfinite(got)) return -1;
            worst = std::max(worst, std::fabs(got - ref[static_cast<size_t>(e)]));
        }
    }
    return worst;
}

int run_kernel_rows(const Options& opt, const weft::bench::Peaks& peaks, weft::bench::Json& j) {
    cudaStream_t stream = nullptr;
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::printf("\n# kernel alone: flash_attention, q/k/v [S, heads, %d], %s, block_m %s, stages %s\n", opt.dim,
                opt.causal ? "causal" : "no mask", opt.block_m ? std::to_string(opt.block_m).c_str() : "default",
                opt.stages ? std::to_string(opt.stages).c_str() : "default");
    std::printf("%9s %7s %6s %10s %9s %8s %s\n", "seq", "heads", "kernel", "ms", "TFLOP/s", "%peak",
                opt.check ? "check" : "");
    bool ok_all = true;
    for (int64_t seq : opt.seqs) {
        for (weft::AttentionPrefillKernel kernel : kernels_of(opt)) {
            const int64_t q_elems = seq * opt.hq * opt.dim;
            const int64_t kv_elems = seq * opt.hkv * opt.dim;
            DeviceBuffer q(static_cast<size_t>(q_elems * 2)), k(static_cast<size_t>(kv_elems * 2)),
                v(static_cast<size_t>(kv_elems * 2)), out(static_cast<size_t>(q_elems * 2));
            weft::bench::fill_random(q.ptr, q_elems, opt.dtype, 1, stream);
            weft::bench::fill_random(k.ptr, kv_elems, opt.dtype, 2, stream);
            weft::bench::fill_random(v.ptr, kv_elems, opt.dtype, 3, stream);
            const TensorView tq(q.ptr, opt.dtype, {seq, opt.hq, opt.dim});
            const TensorView tk(k.ptr, opt.dtype, {seq, opt.hkv, opt.dim});
            const TensorView tv(v.ptr, opt.dtype, {seq, opt.hkv, opt.dim});
            const TensorView tout(out.ptr, opt.dtype, {seq, opt.hq, opt.dim});
            weft::ops::FlashAttentionOptions fo;
            fo.mask = opt.causal ? weft::AttentionMask::kCausal : weft::AttentionMask::kNone;
            fo.config = config_of(opt, kernel);
            // NaN in every output: a row the kernel leaves unwritten fails the check.
            BENCH_CUDA(cudaMemsetAsync(out.ptr, 0xff, static_cast<size_t>(q_elems * 2), stream));
            const double ms = weft::bench::time_median_ms(stream, opt.warmup, opt.iters, [&](int) {
                weft::ops::flash_attention(tq, tk, tv, tout, TensorView(), stream, fo);
            });
            const double tflops = attention_flops(seq, seq, 0, opt.causal, opt.hq, opt.dim) / (ms * 1e-3) / 1e12;
            const double pct = peaks.tensor_tflops > 0 ? 100.0 * tflops / peaks.tensor_tflops : 0;
            std::string check;
            if (opt.check) {
                BENCH_CUDA(cudaStreamSynchronize(stream));
                const double err = check_rows(tq, tk, tv, tout, {0, seq / 2 + 1, seq - 1}, 0, opt.causal, opt.dtype);
                const bool ok = err >= 0 && err < 2e-2;
                ok_all = ok_all && ok;
                char buf[48];
                std::snprintf(buf, sizeof(buf), "%s abs %.1e", ok ? "ok" : "FAIL", err);
                check = buf;
            }
            std::printf("%9lld %3d/%-3d %6s %10.3f %9.1f %7.1f%% %s\n", static_cast<long long>(seq), opt.hq, opt.hkv,
                        kernel_label(kernel), ms, tflops, pct, check.c_str());
            std::fflush(stdout);
            j.begin_object(true).field("rows", "kernel").field("seq", seq).field("q_heads", opt.hq);
            j.field("kernel", kernel_label(kernel));
            j.field("block_m", fo.config->block_m).field("stages", fo.config->stages);
            j.field("kv_heads", opt.hkv).field("causal", opt.causal).field("ms", ms).field("tflops", tflops);
            j.field("pct_of_tensor_peak", pct).end_object();
        }
    }
    BENCH_CUDA(cudaStreamDestroy(stream));
    return ok_all ? 0 : 1;
}

int run_ag_rows(const Options& opt, weft::bench::Json& j) {
    std::printf("\n# ag: AgAttention vs all_gather(K), all_gather(V) then flash_attention, world %d, %s\n", opt.world,
                opt.causal ? "causal" : "no mask");
    std::printf("%9s %6s %6s %10s %10s %8s %9s\n", "seq", "world", "kernel", "ag_ms", "base_ms", "speedup", "TFLOP/s");
    weft::bench::SlowestRank slowest(opt.world);
    bool check_failed = false;
    for (int64_t seq : opt.seqs) {
        for (weft::AttentionPrefillKernel kernel : kernels_of(opt)) {
            if (seq % opt.world != 0) {
                std::printf("%9lld %6d   skipped: not a multiple of the world\n", static_cast<long long>(seq),
                            opt.world);
                continue;
            }
            const int64_t rows = seq / opt.world;
            const uint64_t kv_bytes = static_cast<uint64_t>(seq * opt.hkv * opt.dim * 2);
            weft::WorldOptions wo;
            wo.heap_bytes = 2 * kv_bytes + (256ull << 20);
            double ag_ms = 0, base_ms = 0;
            weft::run_local(
                opt.world,
                [&](weft::World& w) {
                    const int me = w.rank();
                    cudaStream_t s = nullptr;
                    BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
                    const int64_t q_elems = rows * opt.hq * opt.dim;
                    const int64_t kv_elems = rows * opt.hkv * opt.dim;
                    DeviceBuffer q(static_cast<size_t>(q_elems * 2)), k(static_cast<size_t>(kv_elems * 2)),
                        v(static_cast<size_t>(kv_elems * 2)), out(static_cast<size_t>(q_elems * 2));
                    weft::bench::fill_random(q.ptr, q_elems, opt.dtype, 10 + static_cast<uint64_t>(me), s);
                    weft::bench::fill_random(k.ptr, kv_elems, opt.dtype, 100 + static_cast<uint64_t>(me), s);
                    weft::bench::fill_random(v.ptr, kv_elems, opt.dtype, 200 + static_cast<uint64_t>(me), s);
                    const TensorView tq(q.ptr, opt.dtype, {rows, opt.hq, opt.dim});
                    const TensorView tk(k.ptr, opt.dtype, {rows, opt.hkv, opt.dim});
                    const TensorView tv(v.ptr, opt.dtype, {rows, opt.hkv, opt.dim});
                    const TensorView tout(out.ptr, opt.dtype, {rows, opt.hq, opt.dim});
                    weft::ops::prepare_collectives(w);
                    weft::ops::AgAttention op(
                        w,
                        {.max_seq = seq,
                         .num_q_heads = opt.hq,
                         .num_kv_heads = opt.hkv,
                         .head_dim = opt.dim,
                         .dtype = opt.dtype,
                         .mask = opt.causal ? weft::AttentionMask::kCausal : weft::AttentionMask::kNone},
                        {.config = config_of(opt, kernel)});
                    // The baseline gathers into the op's symmetric buffers (the same memory), then runs the same
                    // kernel.
                    const TensorView gk = op.gathered_k(seq), gv = op.gathered_v(seq);
                    weft::ops::FlashAttentionOptions fo;
                    fo.mask = opt.causal ? weft::AttentionMask::kCausal : weft::AttentionMask::kNone;
                    fo.q_position = me * rows;
                    fo.config = config_of(opt, kernel);
                    const TensorView all_k(gk.data, opt.dtype, {seq * opt.hkv * opt.dim});
                    const TensorView all_v(gv.data, opt.dtype, {seq * opt.hkv * opt.dim});
                    const auto ag = [&](int) { op.run(tq, tk, tv, tout, TensorView(), s); };
                    // In place from this rank's slot (a symmetric input: no staging), after the same local copy the op
                    // makes.
                    const TensorView slot_k(op.local_k(seq).data, opt.dtype, {kv_elems});
                    const TensorView slot_v(op.local_v(seq).data, opt.dtype, {kv_elems});
                    const auto gather = [&] {
                        BENCH_CUDA(cudaMemcpyAsync(slot_k.data, k.ptr, static_cast<size_t>(kv_elems * 2),
                                                   cudaMemcpyDeviceToDevice, s));
                        BENCH_CUDA(cudaMemcpyAsync(slot_v.data, v.ptr, static_cast<size_t>(kv_elems * 2),
                                                   cudaMemcpyDeviceToDevice, s));
                        weft::ops::all_gather(w, slot_k, all_k, s);
                        weft::ops::all_gather(w, slot_v, all_v, s);
                    };
                    const auto base = [&](int) {
                        gather();
                        weft::ops::flash_attention(tq, gk, gv, tout, TensorView(), s, fo);
                    };
                    const auto t =
                        weft::bench::time_rounds_on_ranks_mean_ms(w, slowest, s, opt.warmup, opt.iters, ag, base);
                    if (me == 0) {
                        ag_ms = t[0];
                        base_ms = t[1];
                    }
                    if (opt.check) {
                        // The same kernel on the same data, the keys visited in another order: equal up to rounding.
                        DeviceBuffer ref(static_cast<size_t>(q_elems * 2));
                        const TensorView tref(ref.ptr, opt.dtype, {rows, opt.hq, opt.dim});
                        // Poisoned first: the timed rounds left the baseline's output there.
                        BENCH_CUDA(cudaMemsetAsync(out.ptr, 0xff, static_cast<size_t>(q_elems * 2), s));
                        op.run(tq, tk, tv, tout, TensorView(), s);
                        gather();
                        weft::ops::flash_attention(tq, gk, gv, tref, TensorView(), s, fo);
                        const double err = weft::bench::relative_error(
                            out.ptr, opt.hq * opt.dim, ref.ptr, opt.hq * opt.dim, rows, opt.hq * opt.dim, opt.dtype, s);
                        const double worst = slowest.max(w, err);
                        if (me == 0 && !(worst < 1e-2)) {
                            std::printf("  FAIL: AgAttention differs from all_gather + flash_attention, rel %.1e\n",
                                        worst);
                            check_failed = true;
                        }
                    }
                    w.sync_and_check(s);
                    w.barrier();
                    BENCH_CUDA(cudaStreamDestroy(s));
                },
                wo);
            // The busiest rank (the last one under a causal mask) sets the pace; count the whole sequence's work.
            const double tflops = attention_flops(seq, seq, 0, opt.causal, opt.hq, opt.dim) / (ag_ms * 1e-3) / 1e12;
            std::printf("%9lld %6d %6s %10.3f %10.3f %7.2fx %9.1f\n", static_cast<long long>(seq), opt.world,
                        kernel_label(kernel), ag_ms, base_ms, base_ms / ag_ms, tflops);
            std::fflush(stdout);
            j.begin_object(true)
                .field("rows", "ag")
                .field("seq", seq)
                .field("world", opt.world)
                .field("q_heads", opt.hq);
            j.field("kernel", kernel_label(kernel));
            j.field("kv_heads", opt.hkv)
                .field("causal", opt.causal)
                .field("ag_ms", ag_ms)
                .field("baseline_ms", base_ms);
            j.field("speedup", base_ms / ag_ms).field("tflops", tflops).end_object();
        }
    }
    return check_failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
    return weft::bench::run_main("weft_bench_prefill", [&] {
        Options opt = parse(argc, argv);
        const weft::bench::Peaks peaks = weft::bench::measure_peaks(weft::bench::kPeakTensor, opt.dtype);
        cudaDeviceProp prop{};
        BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
        std::printf("# weft_bench_prefill  GPU %s (%d SMs)  %s dim %d heads %d/%d  iters %d warmup %d  %s\n", prop.name,
                    prop.multiProcessorCount, weft::dtype_name(opt.dtype), opt.dim, opt.hq, opt.hkv, opt.iters,
                    opt.warmup, weft::bench::utc_date().c_str());
        std::printf("# %s\n", weft::bench::describe(peaks).c_str());
        weft::bench::Json j;
        j.begin_object().field("bench", "prefill").field("gpu", prop.name).field("sms", prop.multiProcessorCount);
        j.field("dtype", weft::dtype_name(opt.dtype)).field("dim", opt.dim).field("iters", opt.iters);
        j.field("warmup", opt.warmup).field("date", weft::bench::utc_date());
        weft::bench::add_peaks(j, peaks);
        j.key("results").begin_array();
        int rc = 0;
        if (opt.mode != "ag") rc |= run_kernel_rows(opt, peaks, j);
        if (opt.mode != "kernel") rc |= run_ag_rows(opt, j);
        j.end_array().end_object();
        if (!opt.json.empty()) weft::bench::write_json_file(opt.json, j);
        return rc;
    });
}
