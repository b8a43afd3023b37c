// SPDX-License-Identifier: MIT
// weft_bench_attention: weft::ops::decode_attention (one query token per sequence, paged KV cache) by KV length,
// batch, heads and page size; the figure is bytes of K and V read per second, shown beside the streaming-read
// bandwidth measured in the same run (the roofline of a memory-bound kernel) and its share of it, and beside the time
// a plain streaming kernel takes to read the same bytes, timed the same way (at small sizes the launch and the ramp
// of any kernel are a visible share; the 4 GiB roofline hides them).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/cli.hpp"
#include "common/data.hpp"
#include "common/json.hpp"
#include "common/peaks.hpp"
#include "common/report.hpp"
#include "common/timing.hpp"
#include "weft/ops/attention.hpp"
#include "weft/runtime/error.hpp"

namespace {

using weft::DType;
using weft::TensorView;
using weft::bench::DeviceBuffer;

struct Heads {
    int q = 32;
    int kv = 8;
};

struct Options {
    std::vector<int64_t> kv_lens = {1024, 4096, 16384, 32768, 65536, 131072, 262144, 524288, 1048576};
    std::vector<int64_t> batches = {1, 8, 64};
    std::vector<Heads> heads = {{32, 8}, {96, 12}};
    std::vector<int64_t> pages = {1, 16};
    std::vector<int64_t> splits = {0};  // DecodeAttentionOptions::num_splits; 0 = the automatic plan
    bool programmatic = false;          // DecodeAttentionOptions::programmatic_launch
    bool check_pages = false;           // pass a DecodeAttentionOptions::status: the build that checks the block table
    int dim = 128;
    DType dtype = DType::kBF16;
    int iters = 20;
    int warmup = 3;
    bool check = false;
    uint64_t max_bytes = 48ull << 30;  // KV bytes per configuration; larger ones are skipped
    std::string json;
};

/// The relative error ||out - ref|| / ||ref|| of the decode output row (b, hq), against an fp64 reference on the
/// host over the sequence's `len` tokens, read through its row of `table` (the pages of rotation 0). +infinity when a
/// value is not finite. The row's K and V are copied page by page (one 2D copy of the KV head's slots each).
double decode_row_error(const TensorView& q, const TensorView& k, const TensorView& v,
                        const std::vector<int32_t>& table, int64_t pages_per_seq, int64_t len, const TensorView& out,
                        int64_t b, int64_t hq, int kv_heads, cudaStream_t stream) {
    const DType t = q.dtype;
    const int64_t dim = q.dim(2), page = k.dim(1), es = 2;
    const int64_t kvh = hq / (q.dim(1) / kv_heads);
    std::vector<uint16_t> kh(static_cast<size_t>(len * dim)), vh(kh.size()), qr(static_cast<size_t>(dim)),
        orow(qr.size());
    for (int64_t p = 0; p * page < len; ++p) {
        const int64_t slots = std::min(page, len - p * page);
        const int64_t phys = table[static_cast<size_t>(b * pages_per_seq + p)];
        const auto src = [&](const TensorView& c) {
            return static_cast<const uint8_t*>(c.data) + (phys * c.stride(0) + kvh * c.stride(2)) * es;
        };
        BENCH_CUDA(cudaMemcpy2DAsync(kh.data() + p * page * dim, dim * es, src(k), k.stride(1) * es, dim * es, slots,
                                     cudaMemcpyDeviceToHost, stream));
        BENCH_CUDA(cudaMemcpy2DAsync(vh.data() + p * page * dim, dim * es, src(v), v.stride(1) * es, dim * es, slots,
                                     cudaMemcpyDeviceToHost, stream));
    }
    BENCH_CUDA(cudaMemcpyAsync(qr.data(),
                               static_cast<const uint8_t*>(q.data) + (b * q.stride(0) + hq * q.stride(1)) * es,
                               dim * es, cudaMemcpyDeviceToHost, stream));
    BENCH_CUDA(cudaMemcpyAsync(orow.data(),
                               static_cast<const uint8_t*>(out.data) + (b * out.stride(0) + hq * out.stride(1)) * es,
                               dim * es, cudaMemcpyDeviceToHost, stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    const std::vector<double> ref = weft::bench::attention_row_reference(qr.data(), kh.data(), vh.data(), len, dim, t);
    double num = 0, den = 0;
    for (int64_t e = 0; e < dim; ++e) {
        const double want = ref[static_cast<size_t>(e)];
        const double got = weft::bench::host_value(&orow[static_cast<size_t>(e)], t);
        if (!std::isfinite(got)) return INFINITY;
        num += (got - want) * (got - want);
        den += want * want;
    }
    return std::sqrt(num / std::max(den, 1e-30));
}

Options parse(int argc, char** argv) {
    Options o;
    weft::bench::Cli cli("weft_bench_attention",
                         "paged decode attention: KV bytes read per second vs the read roofline");
    cli.sizes("L[,L...]", "KV tokens per sequence (default 1K..1M, powers of 4 and 32K)", [&](const std::string& v) {
        o.kv_lens.clear();
        for (const std::string& s : weft::bench::split(v, ',')) {
            const uint64_t n = weft::bench::parse_bytes(s, "--sizes");  // K/M suffixes read as 1024 / 1048576
            if (n >= (1ull << 31) - (1ull << 20)) throw weft::bench::UsageError("--sizes: at most 2^31 - 2^20 tokens");
            o.kv_lens.push_back(static_cast<int64_t>(n));
        }
    });
    cli.option("--batch", "B[,B...]", "sequences per call (default 1,8,64)",
               [&](const std::string& v) { o.batches = weft::bench::parse_int_list(v, "--batch", 1, 65535); });
    cli.option("--heads", "Q/KV[,Q/KV...]", "q-heads / KV heads (default 32/8,96/12)", [&](const std::string& v) {
        o.heads.clear();
        for (const auto& [q, kv] : weft::bench::parse_head_pairs(v, "--heads", 16)) {
            o.heads.push_back({static_cast<int>(q), static_cast<int>(kv)});
        }
    });
    cli.option("--page", "P[,P...]", "page sizes in tokens (default 1,16)",
               [&](const std::string& v) { o.pages = weft::bench::parse_int_list(v, "--page", 1, 4096); });
    cli.option("--splits", "S[,S...]", "KV splits per (sequence, KV head); 0 = automatic (default 0)",
               [&](const std::string& v) { o.splits = weft::bench::parse_int_list(v, "--splits", 0, 256); });
    cli.flag("--programmatic", "launch the split kernel programmatically (DecodeAttentionOptions::programmatic_launch)",
             &o.programmatic);
    cli.flag("--check-pages",
             "pass a status (DecodeAttentionOptions::status): the split kernel's build that checks every block-table "
             "entry",
             &o.check_pages);
    cli.option("--dim", "D", "head dimension: 64, 128 or 256 (default 128)", [&](const std::string& v) {
        o.dim = static_cast<int>(weft::bench::parse_int(v, "--dim", 64, 256));
        if (o.dim != 64 && o.dim != 128 && o.dim != 256) throw weft::bench::UsageError("--dim: 64, 128 or 256");
    });
    cli.option("--max-bytes", "BYTES", "skip configurations whose KV cache exceeds this (default 48G)",
               [&](const std::string& v) { o.max_bytes = weft::bench::parse_bytes(v, "--max-bytes"); });
    cli.dtype(&o.dtype, {DType::kBF16, DType::kF16}).iters(&o.iters).warmup(&o.warmup).check(&o.check).json(&o.json);
    cli.parse(argc, argv);
    return o;
}

}  // namespace

int main(int argc, char** argv) {
    return weft::bench::run_main("weft_bench_attention", [&] {
        const Options opt = parse(argc, argv);
        const weft::bench::Peaks peaks = weft::bench::measure_peaks(weft::bench::kPeakRead);
        cudaDeviceProp prop{};
        BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
        cudaStream_t stream = nullptr;
        BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        std::printf("# weft_bench_attention  GPU %s (%d SMs)  %s dim %d  iters %d warmup %d  %s\n", prop.name,
                    prop.multiProcessorCount, weft::dtype_name(opt.dtype), opt.dim, opt.iters, opt.warmup,
                    weft::bench::utc_date().c_str());
        std::printf("# %s\n", weft::bench::describe(peaks).c_str());
        std::printf("# pages in random order; inputs rotated over >= 256 MiB of pages so that L2 holds none\n");
        std::printf("%6s %7s %5s %9s %7s %10s %10s %8s %8s %10s %8s %s\n", "batch", "heads", "page", "kv_len", "splits",
                    "us", "roof_us", "TB/s", "%roof", "read_us", "%read", opt.check ? "check" : "");
        weft::bench::Json j;
        j.begin_object().field("bench", "attention").field("gpu", prop.name).field("sms", prop.multiProcessorCount);
        j.field("dtype", weft::dtype_name(opt.dtype)).field("dim", opt.dim).field("iters", opt.iters);
        j.field("warmup", opt.warmup).field("date", weft::bench::utc_date());
        weft::bench::add_peaks(j, peaks);
        j.key("results").begin_array();
        bool all_ok = true;
        const int64_t elem = 2;
        for (const Heads& h : opt.heads) {
            for (int64_t batch : opt.batches) {
                for (int64_t page : opt.pages) {
                    for (int64_t len : opt.kv_lens) {
                        const int64_t pages_per_seq = (len + page - 1) / page;
                        const int64_t page_bytes = page * h.kv * opt.dim * elem;
                        const uint64_t kv_bytes = static_cast<uint64_t>(batch * len * h.kv * opt.dim * elem * 2);
                        const uint64_t cache_bytes = static_cast<uint64_t>(batch * pages_per_seq * page_bytes * 2);
                        if (cache_bytes > opt.max_bytes) {
                            std::printf("%6lld %3d/%-3d %5lld %9lld   skipped: %s of KV > --max-bytes\n",
                                        static_cast<long long>(batch), h.q, h.kv, static_cast<long long>(page),
                                        static_cast<long long>(len), weft::bench::format_bytes(cache_bytes).c_str());
                            continue;
                        }
                        // Enough page sets that consecutive calls read different memory (>= 256 MiB in all).
                        const int64_t used = batch * pages_per_seq;
                        const int64_t rotations = std::clamp<int64_t>(
                            static_cast<int64_t>((256ull << 20) / std::max<uint64_t>(cache_bytes, 1)) + 1, 1,
                            std::max<int64_t>(
                                1, static_cast<int64_t>(opt.max_bytes / std::max<uint64_t>(cache_bytes, 1))));
                        const int64_t num_pages = used * rotations;
                        DeviceBuffer k(static_cast<size_t>(num_pages * page_bytes));
                        DeviceBuffer v(static_cast<size_t>(num_pages * page_bytes));
                        weft::bench::fill_random(k.ptr, num_pages * page_bytes / elem, opt.dtype, 1, stream);
                        weft::bench::fill_random(v.ptr, num_pages * page_bytes / elem, opt.dtype, 2, stream);
                        std::vector<int32_t> order(static_cast<size_t>(num_pages));
                        std::iota(order.begin(), order.end(), 0);
                        std::mt19937_64 rng(42);
                        std::shuffle(order.begin(), order.end(), rng);
                        DeviceBuffer tables(order.size() * 4);
                        BENCH_CUDA(cudaMemcpy(tables.ptr, order.data(), order.size() * 4, cudaMemcpyHostToDevice));
                        std::vector<int32_t> lens_host(static_cast<size_t>(batch), static_cast<int32_t>(len));
                        DeviceBuffer lens(lens_host.size() * 4);
                        BENCH_CUDA(
                            cudaMemcpy(lens.ptr, lens_host.data(), lens_host.size() * 4, cudaMemcpyHostToDevice));
                        const int64_t q_elems = batch * h.q * opt.dim;
                        DeviceBuffer q(static_cast<size_t>(q_elems * elem));
                        DeviceBuffer out(static_cast<size_t>(q_elems * elem));
                        DeviceBuffer lse(static_cast<size_t>(batch * h.q * 4));
                        weft::bench::fill_random(q.ptr, q_elems, opt.dtype, 3, stream);
                        const TensorView tq(q.ptr, opt.dtype, {batch, h.q, opt.dim});
                        const TensorView tk(k.ptr, opt.dtype, {num_pages, page, h.kv, opt.dim});
                        const TensorView tv(v.ptr, opt.dtype, {num_pages, page, h.kv, opt.dim});
                        const TensorView tlens(lens.ptr, DType::kI32, {batch});
                        const TensorView tout(out.ptr, opt.dtype, {batch, h.q, opt.dim});
                        const TensorView tlse(lse.ptr, DType::kF32, {batch, h.q});
                        // The same bytes read by a plain streaming kernel, timed the same way: the best a kernel
                        // that reads them can do at this size (launch and ramp included).
                        const double read_us = weft::bench::read_pair_us(
                            k.ptr, v.ptr, kv_bytes / 2, static_cast<size_t>(used * page_bytes),
                            static_cast<int>(rotations), stream, opt.warmup, opt.iters);
                        for (int64_t requested : opt.splits) {
                            weft::ops::DecodeAttentionOptions o;
                            o.num_splits = static_cast<int32_t>(requested);
                            o.programmatic_launch = opt.programmatic;
                            DeviceBuffer status(opt.check_pages ? sizeof(weft::ops::AttentionStatus) : 0);
                            if (opt.check_pages) {
                                BENCH_CUDA(cudaMemsetAsync(status.ptr, 0, sizeof(weft::ops::AttentionStatus), stream));
                                o.status = static_cast<weft::ops::AttentionStatus*>(status.ptr);
                            }
                            const uint64_t ws_bytes =
                                weft::ops::decode_attention_workspace_bytes(batch, h.q, h.kv, opt.dim, len, o);
                            DeviceBuffer ws(static_cast<size_t>(ws_bytes));
                            o.workspace = TensorView(ws.ptr, DType::kU8,
                                                     {static_cast<int64_t>(std::max<uint64_t>(ws_bytes, 16))});
                            const auto call = [&](int i) {
                                const int64_t r = i % rotations;
                                const TensorView table(static_cast<int32_t*>(tables.ptr) + r * used, DType::kI32,
                                                       {batch, pages_per_seq});
                                weft::ops::decode_attention(tq, tk, tv, table, tlens, len, tout, tlse, stream, o);
                            };
                            const double ms = weft::bench::time_batch_ms(stream, opt.warmup, opt.iters, call);
                            const double us = ms * 1e3;
                            const double tbs = static_cast<double>(kv_bytes) / (us * 1e-6) / 1e12;
                            const double roof_us =
                                peaks.read_tbs > 0 ? static_cast<double>(kv_bytes) / (peaks.read_tbs * 1e12) * 1e6 : 0;
                            const double pct = peaks.read_tbs > 0 ? 100.0 * tbs / peaks.read_tbs : 0;
                            const int32_t splits =
                                weft::ops::decode_attention_split_plan(batch, h.q, h.kv, opt.dim, len, o).num_splits;
                            std::string check;
                            if (opt.check) {
                                // The chosen plan's output, poisoned first (NaN), against an fp64 host reference for
                                // the first and the last (sequence, q-head) pair.
                                const TensorView table(tables.ptr, DType::kI32, {batch, pages_per_seq});
                                BENCH_CUDA(cudaMemsetAsync(out.ptr, 0xff, static_cast<size_t>(q_elems * elem), stream));
                                weft::ops::decode_attention(tq, tk, tv, table, tlens, len, tout, tlse, stream, o);
                                double err = 0;
                                for (const auto& [b, hq] : {std::pair<int64_t, int64_t>{0, 0}, {batch - 1, h.q - 1}}) {
                                    err = std::max(err, decode_row_error(tq, tk, tv, order, pages_per_seq, len, tout, b,
                                                                         hq, h.kv, stream));
                                }
                                const bool ok = err < (opt.dtype == DType::kBF16 ? 1e-2 : 3e-3);
                                all_ok = all_ok && ok;
                                char buf[48];
                                std::snprintf(buf, sizeof(buf), "%s rel %.1e", ok ? "ok" : "FAIL", err);
                                check = buf;
                            }
                            std::printf(
                                "%6lld %3d/%-3d %5lld %9lld %7d %10.2f %10.2f %8.3f %7.1f%% %10.2f %7.1f%% %s\n",
                                static_cast<long long>(batch), h.q, h.kv, static_cast<long long>(page),
                                static_cast<long long>(len), splits, us, roof_us, tbs, pct, read_us,
                                100.0 * read_us / us, check.c_str());
                            std::fflush(stdout);
                            j.begin_object(true).field("batch", batch).field("q_heads", h.q).field("kv_heads", h.kv);
                            j.field("page", page)
                                .field("kv_len", len)
                                .field("splits", splits)
                                .field("kv_bytes", kv_bytes);
                            j.field("us", us).field("roofline_us", roof_us).field("tbs", tbs).field("pct_of_read", pct);
                            j.field("read_us", read_us).field("pct_of_same_size_read", 100.0 * read_us / us);
                            j.end_object();
                        }
                    }
                }
            }
        }
        j.end_array().end_object();
        if (!opt.json.empty()) weft::bench::write_json_file(opt.json, j);
        BENCH_CUDA(cudaStreamDestroy(stream));
        return all_ok ? 0 : 1;
    });
}
