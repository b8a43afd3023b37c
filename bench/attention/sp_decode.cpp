// SPDX-License-Identifier: MIT
// weft_bench_sp_decode: sequence-parallel decode attention, weft::ops::sp_decode_attention, against the one-GPU kernel
// weft::ops::decode_attention on one rank's shard. Every sequence of L tokens is cut into W equal contiguous shards,
// one per rank, each in the rank's own paged KV cache. `sp`: the collective call (the decode kernels on the shard,
// pushing their rows to every rank, then the LSE-weighted combine); `shard`: the one-GPU kernel on the same shard;
// the two alternate call by call on every rank and the slowest rank's mean counts, so `added` = sp - shard is what the
// exchange and the combine cost. `full`: the one-GPU kernel over all L tokens on rank 0's GPU while the other ranks
// wait, for reference. Beside them the read roofline: the K and V bytes one GPU reads per call at the streaming-read
// bandwidth measured in the same run. Ranks are threads over the visible GPUs, or one process each under a launcher
// (weftrun, torchrun, mpirun, srun: World::from_env).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/data.hpp"
#include "common/json.hpp"
#include "common/peaks.hpp"
#include "common/ranks.hpp"
#include "common/report.hpp"
#include "common/timing.hpp"
#include "weft/ops/attention.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/module_loading.hpp"
#include "weft/runtime/world.hpp"

namespace {

using weft::DType;
using weft::TensorView;
using weft::bench::DeviceBuffer;

struct Options {
    std::vector<int64_t> kv_lens = {65536, 131072, 262144, 524288, 1048576};  // global tokens per sequence
    std::vector<int> worlds;  // empty: kDefaultWorlds with threads, the launched world under a launcher
    std::vector<int64_t> batches = {1};
    std::vector<std::array<int64_t, 2>> heads = {{96, 12}};
    std::vector<int64_t> pages = {16};
    bool programmatic = false;  // DecodeAttentionOptions::programmatic_launch
    bool no_full = false;
    int dim = 128;
    DType dtype = DType::kBF16;
    int iters = 20;
    int warmup = 3;
    bool check = false;
    uint64_t max_bytes = 48ull << 30;  // KV cache bytes of one rank (rotated copies included); larger rows are skipped
    std::string json;
};

const std::vector<int> kDefaultWorlds = {2, 4, 8};

// Deterministic data: rank r's K and V from seeds of r, its page order from a generator seeded with r, so that rank 0
// can rebuild every rank's shard for the whole-sequence reference. q is the same on every rank.
constexpr uint64_t kSeedQ = 7;
uint64_t seed_k(int rank) { return 1000 + 2 * static_cast<uint64_t>(rank); }
uint64_t seed_v(int rank) { return 1001 + 2 * static_cast<uint64_t>(rank); }

Options parse(int argc, char** argv) {
    Options o;
    weft::bench::Cli cli("weft_bench_sp_decode",
                         "sequence-parallel decode attention vs the one-GPU kernel on one rank's shard");
    cli.sizes("L[,L...]", "global KV tokens per sequence, split evenly over the ranks (default 64K,128K,256K,512K,1M)",
              [&](const std::string& v) {
                  o.kv_lens.clear();
                  for (const std::string& s : weft::bench::split(v, ',')) {
                      const uint64_t n = weft::bench::parse_bytes(s, "--sizes");  // K/M read as 1024 / 1048576
                      if (n < 1 || n >= (1ull << 31) - (1ull << 20)) {
                          throw weft::bench::UsageError("--sizes: 1 .. 2^31 - 2^20 - 1 tokens, got " + s);
                      }
                      o.kv_lens.push_back(static_cast<int64_t>(n));
                  }
              });
    cli.option("--world", "N[,N...]",
               "ranks, threads over the visible GPUs (default 2,4,8); under a launcher the launched world, which "
               "--world must then equal",
               [&](const std::string& v) {
                   o.worlds.clear();
                   for (int64_t w : weft::bench::parse_int_list(v, "--world", 1, 64)) {
                       o.worlds.push_back(static_cast<int>(w));
                   }
               });
    cli.option("--batch", "B[,B...]", "sequences per call (default 1)",
               [&](const std::string& v) { o.batches = weft::bench::parse_int_list(v, "--batch", 1, 4096); });
    cli.option("--heads", "Q/KV[,Q/KV...]", "q-heads / KV heads (default 96/12)",
               [&](const std::string& v) { o.heads = weft::bench::parse_head_pairs(v, "--heads", 16); });
    cli.option("--page", "P[,P...]", "page sizes in tokens (default 16; 1 for one token per page)",
               [&](const std::string& v) { o.pages = weft::bench::parse_int_list(v, "--page", 1, 4096); });
    cli.option("--dim", "D", "head dimension: 64, 128 or 256 (default 128)", [&](const std::string& v) {
        o.dim = static_cast<int>(weft::bench::parse_int(v, "--dim", 64, 256));
        if (o.dim != 64 && o.dim != 128 && o.dim != 256) throw weft::bench::UsageError("--dim: 64, 128 or 256");
    });
    cli.flag("--programmatic",
             "launch the split kernels programmatically (DecodeAttentionOptions::programmatic_launch)",
             &o.programmatic);
    cli.flag("--no-full", "leave out the one-GPU kernel over the whole sequence (full_us; --check still runs it)",
             &o.no_full);
    cli.option("--max-bytes", "BYTES",
               "skip rows whose KV cache on one rank exceeds this; the whole-sequence run (full_us, --check) is left "
               "out when its cache (every rank's) exceeds it (default 48G)",
               [&](const std::string& v) { o.max_bytes = weft::bench::parse_bytes(v, "--max-bytes"); });
    cli.dtype(&o.dtype, {DType::kBF16, DType::kF16}).iters(&o.iters).warmup(&o.warmup).check(&o.check).json(&o.json);
    cli.parse(argc, argv);
    return o;
}

/// One configuration of a world, its sizes derived from the options alone (every rank computes the same).
struct Shape {
    int world = 1;
    int64_t kv_len = 0, shard_len = 0, batch = 1, hq = 1, hkv = 1, page = 1, dim = 128;
    int64_t pages_per_shard = 0;  // per sequence
    int64_t used = 0;             // pages of one rotation: batch x pages_per_shard
    int64_t rotations = 1;        // page sets each rank cycles through so that L2 holds none
    int64_t num_pages = 0;        // per rank: used x rotations
    int64_t page_bytes = 0;       // of K (and of V)
    uint64_t shard_kv_bytes = 0;  // K and V bytes one rank reads per call
    uint64_t rank_cache_bytes = 0;
    uint64_t full_cache_bytes = 0;  // every rank's pages on one GPU
};

/// The shape of a row, or the reason it is skipped (non-empty).
std::string make_shape(const Options& o, int world, int64_t len, int64_t batch, const std::array<int64_t, 2>& heads,
                       int64_t page, Shape* sh) {
    if (len % world != 0) return "not a multiple of the world";
    Shape s;
    s.world = world;
    s.kv_len = len;
    s.shard_len = len / world;
    s.batch = batch;
    s.hq = heads[0];
    s.hkv = heads[1];
    s.page = page;
    s.dim = o.dim;
    // The whole-sequence reference strings the ranks' pages together: each shard must be whole pages.
    if (s.shard_len % page != 0) {
        return "a shard of " + std::to_string(s.shard_len) + " tokens is not whole pages of " + std::to_string(page);
    }
    const int64_t elem = 2;
    s.pages_per_shard = s.shard_len / page;
    s.used = batch * s.pages_per_shard;
    s.page_bytes = page * s.hkv * s.dim * elem;
    s.shard_kv_bytes = static_cast<uint64_t>(batch * s.shard_len * s.hkv * s.dim * elem * 2);
    const uint64_t set_bytes = static_cast<uint64_t>(s.used * s.page_bytes * 2);
    if (set_bytes > o.max_bytes) {
        return weft::bench::format_bytes(set_bytes) + " of KV per rank > --max-bytes";
    }
    // Enough page sets that consecutive calls read different memory (>= 256 MiB per rank in all).
    s.rotations = std::clamp<int64_t>(static_cast<int64_t>((256ull << 20) / set_bytes) + 1, 1,
                                      std::max<int64_t>(1, static_cast<int64_t>(o.max_bytes / set_bytes)));
    s.num_pages = s.used * s.rotations;
    s.rank_cache_bytes = static_cast<uint64_t>(s.num_pages * s.page_bytes * 2);
    s.full_cache_bytes = s.rank_cache_bytes * static_cast<uint64_t>(world);
    if (s.num_pages * world > INT32_MAX) return "page indices beyond int32";
    *sh = s;
    return "";
}

/// Rank `rank`'s block tables, [rotations][batch][pages_per_shard]: its pages in a random order of its own.
std::vector<int32_t> rank_tables(const Shape& s, int rank) {
    std::vector<int32_t> order(static_cast<size_t>(s.num_pages));
    std::iota(order.begin(), order.end(), 0);
    std::mt19937_64 rng(42 + static_cast<uint64_t>(rank));
    std::shuffle(order.begin(), order.end(), rng);
    return order;
}

/// The block tables of the whole sequences, [rotations][batch][world x pages_per_shard], into a cache that holds rank
/// r's pages at page offset r x num_pages: rank 0's shard first, then rank 1's, ...
std::vector<int32_t> full_tables(const Shape& s) {
    const int64_t row = static_cast<int64_t>(s.world) * s.pages_per_shard;
    std::vector<int32_t> full(static_cast<size_t>(s.rotations * s.batch * row));
    for (int r = 0; r < s.world; ++r) {
        const std::vector<int32_t> t = rank_tables(s, r);
        for (int64_t k = 0; k < s.rotations; ++k) {
            for (int64_t b = 0; b < s.batch; ++b) {
                for (int64_t p = 0; p < s.pages_per_shard; ++p) {
                    const int64_t src = (k * s.batch + b) * s.pages_per_shard + p;
                    const int64_t dst = (k * s.batch + b) * row + r * s.pages_per_shard + p;
                    full[static_cast<size_t>(dst)] =
                        t[static_cast<size_t>(src)] + static_cast<int32_t>(r * s.num_pages);
                }
            }
        }
    }
    return full;
}

/// Fills a cache with rank `rank`'s K and V pages (num_pages of them).
void fill_rank_cache(const Shape& s, int rank, void* k, void* v, DType t, cudaStream_t stream) {
    const int64_t elems = s.num_pages * s.page_bytes / 2;
    weft::bench::fill_random(k, elems, t, seed_k(rank), stream);
    weft::bench::fill_random(v, elems, t, seed_v(rank), stream);
}

void upload(DeviceBuffer& d, const std::vector<int32_t>& h, cudaStream_t stream) {
    BENCH_CUDA(cudaMemcpyAsync(d.ptr, h.data(), h.size() * 4, cudaMemcpyHostToDevice, stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));  // h is pageable and may go out of scope
}

/// What rank 0 reports of a row.
struct Row {
    Shape s;
    int32_t splits = 0;
    int ranks_per_gpu = 1;
    double sp_ms = 0, shard_ms = 0, full_ms = -1;
    double roof_us = 0;
    std::string check;  // "" without --check
    double check_rel = -1, check_lse = -1;
};

/// The whole-sequence run on rank 0: the one-GPU kernel over every rank's pages strung together. Checks the SP result
/// (`sp_out`, `sp_lse`, from rotation 0) against it when `check`, times it when `time`.
void run_full(const Options& o, const Shape& s, const TensorView& tq, const weft::ops::DecodeAttentionOptions& base,
              const void* sp_out, const std::vector<float>& sp_lse, bool check, bool time, cudaStream_t stream,
              Row* row) {
    DeviceBuffer k(static_cast<size_t>(s.full_cache_bytes / 2)), v(static_cast<size_t>(s.full_cache_bytes / 2));
    for (int r = 0; r < s.world; ++r) {
        const size_t at = static_cast<size_t>(r * s.num_pages * s.page_bytes);
        fill_rank_cache(s, r, static_cast<uint8_t*>(k.ptr) + at, static_cast<uint8_t*>(v.ptr) + at, o.dtype, stream);
    }
    const std::vector<int32_t> tables_host = full_tables(s);
    DeviceBuffer tables(tables_host.size() * 4);
    upload(tables, tables_host, stream);
    const int64_t row_pages = static_cast<int64_t>(s.world) * s.pages_per_shard;
    DeviceBuffer lens(static_cast<size_t>(s.batch * 4));
    upload(lens, std::vector<int32_t>(static_cast<size_t>(s.batch), static_cast<int32_t>(s.kv_len)), stream);
    const int64_t q_rows = s.batch * s.hq;
    DeviceBuffer out(static_cast<size_t>(q_rows * s.dim * 2)), lse(static_cast<size_t>(q_rows * 4));
    const int64_t total_pages = s.num_pages * s.world;
    const TensorView tk(k.ptr, o.dtype, {total_pages, s.page, s.hkv, s.dim});
    const TensorView tv(v.ptr, o.dtype, {total_pages, s.page, s.hkv, s.dim});
    const TensorView tlens(lens.ptr, DType::kI32, {s.batch});
    const TensorView tout(out.ptr, o.dtype, {s.batch, s.hq, s.dim});
    const TensorView tlse(lse.ptr, DType::kF32, {s.batch, s.hq});
    weft::ops::DecodeAttentionOptions fo = base;
    const uint64_t ws_bytes = weft::ops::decode_attention_workspace_bytes(s.batch, s.hq, s.hkv, s.dim, s.kv_len, fo);
    DeviceBuffer ws(static_cast<size_t>(ws_bytes));
    fo.workspace = TensorView(ws.ptr, DType::kU8, {static_cast<int64_t>(std::max<uint64_t>(ws_bytes, 16))});
    const auto call = [&](int i) {
        const int64_t r = i % s.rotations;
        const TensorView table(static_cast<int32_t*>(tables.ptr) + r * s.batch * row_pages, DType::kI32,
                               {s.batch, row_pages});
        weft::ops::decode_attention(tq, tk, tv, table, tlens, s.kv_len, tout, tlse, stream, fo);
    };
    if (check) {
        // NaN in every output: a row the kernel leaves unwritten fails the check.
        BENCH_CUDA(cudaMemsetAsync(out.ptr, 0xff, static_cast<size_t>(q_rows * s.dim * 2), stream));
        BENCH_CUDA(cudaMemsetAsync(lse.ptr, 0xff, static_cast<size_t>(q_rows * 4), stream));
        call(0);
        const double rel = weft::bench::relative_error(sp_out, s.dim, out.ptr, s.dim, q_rows, s.dim, o.dtype, stream);
        std::vector<float> ref_lse(static_cast<size_t>(q_rows));
        BENCH_CUDA(cudaMemcpyAsync(ref_lse.data(), lse.ptr, ref_lse.size() * 4, cudaMemcpyDeviceToHost, stream));
        BENCH_CUDA(cudaStreamSynchronize(stream));
        double lse_err = 0;
        for (size_t i = 0; i < ref_lse.size(); ++i) {
            const double d = std::fabs(static_cast<double>(sp_lse[i]) - ref_lse[i]);
            lse_err = std::isfinite(d) ? std::max(lse_err, d) : INFINITY;
        }
        // The tolerances of weft_bench_attention's check (output) and of the SpDecodeAttention GPU tests (LSE).
        const bool ok = rel < (o.dtype == DType::kBF16 ? 1e-2 : 3e-3) && lse_err <= 2e-3;
        char buf[64];
        std::snprintf(buf, sizeof(buf), "%s rel %.1e lse %.1e", ok ? "ok" : "FAIL", rel, lse_err);
        row->check = buf;
        row->check_rel = rel;
        row->check_lse = lse_err;
    }
    if (time) row->full_ms = weft::bench::mean(weft::bench::time_rounds_ms(stream, o.warmup, o.iters, call)[0]);
}

/// One row on every rank of `w` (collective). Returns rank 0's figures (the other ranks' Row is unused).
Row run_row(weft::World& w, weft::bench::SlowestRank& slowest, const Options& o, const Shape& s,
            const weft::bench::Peaks& peaks, cudaStream_t stream) {
    const int me = w.rank();
    Row row;
    row.s = s;
    row.ranks_per_gpu = w.max_ranks_per_device();
    DeviceBuffer k(static_cast<size_t>(s.num_pages * s.page_bytes)), v(static_cast<size_t>(s.num_pages * s.page_bytes));
    fill_rank_cache(s, me, k.ptr, v.ptr, o.dtype, stream);
    DeviceBuffer tables(static_cast<size_t>(s.num_pages * 4));
    upload(tables, rank_tables(s, me), stream);
    DeviceBuffer lens(static_cast<size_t>(s.batch * 4));
    upload(lens, std::vector<int32_t>(static_cast<size_t>(s.batch), static_cast<int32_t>(s.shard_len)), stream);
    const int64_t q_rows = s.batch * s.hq;
    const size_t out_bytes = static_cast<size_t>(q_rows * s.dim * 2), lse_bytes = static_cast<size_t>(q_rows * 4);
    DeviceBuffer q(out_bytes), out(out_bytes), lse(lse_bytes), check_out(out_bytes), check_lse(lse_bytes);
    weft::bench::fill_random(q.ptr, q_rows * s.dim, o.dtype, kSeedQ, stream);
    const TensorView tq(q.ptr, o.dtype, {s.batch, s.hq, s.dim});
    const TensorView tk(k.ptr, o.dtype, {s.num_pages, s.page, s.hkv, s.dim});
    const TensorView tv(v.ptr, o.dtype, {s.num_pages, s.page, s.hkv, s.dim});
    const TensorView tlens(lens.ptr, DType::kI32, {s.batch});
    const TensorView tout(out.ptr, o.dtype, {s.batch, s.hq, s.dim});
    const TensorView tlse(lse.ptr, DType::kF32, {s.batch, s.hq});
    weft::ops::DecodeAttentionOptions base;
    base.programmatic_launch = o.programmatic;
    weft::ops::DecodeAttentionOptions so = base;
    const uint64_t ws_bytes = weft::ops::decode_attention_workspace_bytes(s.batch, s.hq, s.hkv, s.dim, s.shard_len, so);
    DeviceBuffer ws(static_cast<size_t>(ws_bytes));
    so.workspace = TensorView(ws.ptr, DType::kU8, {static_cast<int64_t>(std::max<uint64_t>(ws_bytes, 16))});
    row.splits = weft::ops::decode_attention_split_plan(s.batch, s.hq, s.hkv, s.dim, s.shard_len, so).num_splits;
    const auto table_of = [&](int64_t k_call) {
        const int64_t r = k_call % s.rotations;
        return TensorView(static_cast<int32_t*>(tables.ptr) + r * s.used, DType::kI32, {s.batch, s.pages_per_shard});
    };
    // Every rank passes the same max_seq_len (its shard's length): equal split plans on every rank.
    const auto sp = [&](int i) {
        weft::ops::sp_decode_attention(w, tq, tk, tv, table_of(2 * int64_t{i}), tlens, s.shard_len, tout, tlse, stream,
                                       so);
    };
    const auto shard = [&](int i) {
        weft::ops::decode_attention(tq, tk, tv, table_of(2 * int64_t{i} + 1), tlens, s.shard_len, tout, tlse, stream,
                                    so);
    };

    // Every rank has made its allocations (and the previous row's frees) before any rank launches the spinning
    // combine: cudaMalloc and cudaFree may wait for the whole device, and with ranks sharing a GPU a rank held there
    // would never push what a peer's combine waits for.
    w.barrier();

    // --check: the SP result of rotation 0 into poisoned buffers, kept for rank 0's comparison below.
    std::vector<float> sp_lse;
    if (o.check) {
        BENCH_CUDA(cudaMemsetAsync(check_out.ptr, 0xff, out_bytes, stream));
        BENCH_CUDA(cudaMemsetAsync(check_lse.ptr, 0xff, lse_bytes, stream));
        weft::ops::sp_decode_attention(w, tq, tk, tv, table_of(0), tlens, s.shard_len,
                                       TensorView(check_out.ptr, o.dtype, {s.batch, s.hq, s.dim}),
                                       TensorView(check_lse.ptr, DType::kF32, {s.batch, s.hq}), stream, so);
        w.sync_and_check(stream);
        sp_lse.resize(static_cast<size_t>(q_rows));
        BENCH_CUDA(cudaMemcpyAsync(sp_lse.data(), check_lse.ptr, lse_bytes, cudaMemcpyDeviceToHost, stream));
        BENCH_CUDA(cudaStreamSynchronize(stream));
    }

    BENCH_CUDA(cudaMemsetAsync(out.ptr, 0xff, out_bytes, stream));
    BENCH_CUDA(cudaMemsetAsync(lse.ptr, 0xff, lse_bytes, stream));
    const auto t = weft::bench::time_rounds_on_ranks_mean_ms(w, slowest, stream, o.warmup, o.iters, sp, shard);
    row.sp_ms = t[0];
    row.shard_ms = t[1];
    w.sync_and_check(stream);
    w.barrier();

    // The whole sequence on rank 0's GPU alone (the other ranks wait at the barrier).
    const bool full_fits = s.full_cache_bytes <= o.max_bytes;
    if (me == 0) {
        if ((o.check || !o.no_full) && full_fits) {
            run_full(o, s, tq, base, check_out.ptr, sp_lse, o.check, !o.no_full, stream, &row);
        } else if (o.check) {
            row.check =
                "unchecked: whole-sequence KV " + weft::bench::format_bytes(s.full_cache_bytes) + " > --max-bytes";
        }
    }
    w.barrier();
    const uint64_t gpu_bytes = s.shard_kv_bytes * static_cast<uint64_t>(row.ranks_per_gpu);
    row.roof_us = peaks.read_tbs > 0 ? static_cast<double>(gpu_bytes) / (peaks.read_tbs * 1e12) * 1e6 : 0;
    return row;
}

void print_header(const Options& o, const cudaDeviceProp& prop, int gpus, const weft::bench::Peaks& peaks) {
    std::printf("# weft_bench_sp_decode  GPU %s x%d (%d SMs)  %s dim %d  iters %d warmup %d  %s\n", prop.name, gpus,
                prop.multiProcessorCount, weft::dtype_name(o.dtype), o.dim, o.iters, o.warmup,
                weft::bench::utc_date().c_str());
    std::printf("# %s\n", weft::bench::describe(peaks).c_str());
    std::printf(
        "# each sequence's L tokens cut into `world` equal shards, one per rank; pages in random order, inputs rotated "
        "over >= 256 MiB per rank so that L2 holds none\n"
        "# shard_us: decode_attention on one rank's shard; sp_us: sp_decode_attention; the two alternating call by "
        "call on every rank, the slowest rank's mean; added_us = sp - shard\n"
        "# full_us: decode_attention over all L tokens on rank 0's GPU alone; roof_us: the K and V bytes one GPU reads "
        "per sp call at the read roofline; %%roof = roof / sp\n");
}

void print_world(const weft::World& w, bool check) {
    const int shared = w.max_ranks_per_device();
    std::printf("\n# world %d: ranks are %s, %s\n", w.num_ranks(),
                w.same_process() ? "threads of this process" : "one process each",
                shared > 1 ? (std::to_string(shared) + " per GPU").c_str() : "one per GPU");
    if (shared > 1) {
        std::printf(
            "# NOTE: %d ranks share a GPU: their kernels share its SMs (threads: streams of one context; processes: "
            "time-sliced), so sp_us and shard_us each hold the work of %d ranks on one GPU and added_us shows the "
            "exchange and combine only roughly (with every rank on one GPU, full_us is the like-for-like baseline). "
            "The per-GPU figure needs one GPU per rank.\n",
            shared, shared);
    }
    std::printf("%9s %5s %8s %5s %5s %7s %6s %10s %10s %9s %10s %10s %6s %s\n", "kv_len", "world", "shard", "page",
                "batch", "heads", "splits", "shard_us", "sp_us", "added_us", "full_us", "roof_us", "%roof",
                check ? "check" : "");
}

void print_skip(int world, int64_t len, int64_t batch, const std::array<int64_t, 2>& heads, int64_t page,
                const std::string& why) {
    std::printf("%9lld %5d %8s %5lld %5lld %3lld/%-3lld   skipped: %s\n", static_cast<long long>(len), world, "-",
                static_cast<long long>(page), static_cast<long long>(batch), static_cast<long long>(heads[0]),
                static_cast<long long>(heads[1]), why.c_str());
    std::fflush(stdout);
}

void print_row(const Row& r) {
    const Shape& s = r.s;
    const double sp_us = r.sp_ms * 1e3, shard_us = r.shard_ms * 1e3;
    char full[32] = "-";
    if (r.full_ms >= 0) std::snprintf(full, sizeof(full), "%.2f", r.full_ms * 1e3);
    std::printf("%9lld %5d %8lld %5lld %5lld %3lld/%-3lld %6d %10.2f %10.2f %+9.2f %10s %10.2f %5.1f%% %s\n",
                static_cast<long long>(s.kv_len), s.world, static_cast<long long>(s.shard_len),
                static_cast<long long>(s.page), static_cast<long long>(s.batch), static_cast<long long>(s.hq),
                static_cast<long long>(s.hkv), r.splits, shard_us, sp_us, sp_us - shard_us, full, r.roof_us,
                sp_us > 0 ? 100.0 * r.roof_us / sp_us : 0.0, r.check.c_str());
    std::fflush(stdout);
}

void add_row(weft::bench::Json& j, const Row& r) {
    const Shape& s = r.s;
    j.begin_object(true).field("world", s.world).field("kv_len", s.kv_len).field("shard_len", s.shard_len);
    j.field("batch", s.batch).field("q_heads", s.hq).field("kv_heads", s.hkv).field("page", s.page);
    j.field("splits", r.splits).field("ranks_per_gpu", r.ranks_per_gpu).field("shard_kv_bytes", s.shard_kv_bytes);
    j.field("shard_ms", r.shard_ms).field("sp_ms", r.sp_ms).field("added_us", (r.sp_ms - r.shard_ms) * 1e3);
    if (r.full_ms >= 0) j.field("full_ms", r.full_ms);
    j.field("roofline_us", r.roof_us);
    if (!r.check.empty()) {
        const bool ok = r.check.rfind("ok", 0) == 0, failed = r.check.rfind("FAIL", 0) == 0;
        j.field("check", ok ? "ok" : failed ? "fail" : "unchecked");
        if (r.check_rel >= 0) j.field("check_rel", r.check_rel).field("check_lse_abs", r.check_lse);
    }
    j.end_object();
}

/// Every row of one world on rank `w` (collective); rank 0 keeps the rows and `prints` them.
void run_world(weft::World& w, const Options& o, const weft::bench::Peaks& peaks, bool prints, std::vector<Row>* rows) {
    cudaStream_t stream = nullptr;
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    weft::ops::prepare_collectives(w);
    weft::bench::SlowestRank slowest(w.num_ranks());
    if (prints) print_world(w, o.check);
    for (const auto& heads : o.heads) {
        for (int64_t batch : o.batches) {
            for (int64_t page : o.pages) {
                for (int64_t len : o.kv_lens) {
                    Shape s;
                    const std::string skip = make_shape(o, w.num_ranks(), len, batch, heads, page, &s);
                    if (!skip.empty()) {
                        if (prints) print_skip(w.num_ranks(), len, batch, heads, page, skip);
                        continue;
                    }
                    const Row r = run_row(w, slowest, o, s, peaks, stream);
                    if (w.rank() == 0) rows->push_back(r);
                    if (prints) print_row(r);
                }
            }
        }
    }
    w.sync_and_check(stream);
    w.barrier();
    BENCH_CUDA(cudaStreamDestroy(stream));
}

}  // namespace

int main(int argc, char** argv) {
    return weft::bench::run_main("weft_bench_sp_decode", [&] {
        const Options opt = parse(argc, argv);
        const weft::bench::RankLauncher launcher = weft::bench::RankLauncher::detect();
        const std::vector<int> worlds = launcher.worlds(opt.worlds, kDefaultWorlds);
        weft::prepare_cuda_environment();
        cudaDeviceProp prop{};
        BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
        int gpus = 0;
        BENCH_CUDA(cudaGetDeviceCount(&gpus));
        // The read roofline on an idle GPU: before the ranks' threads start, or, with processes (which may share the
        // GPU), on rank 0 in the World while the other ranks wait at a barrier.
        weft::bench::Peaks peaks;
        if (!launcher.launched()) {
            peaks = weft::bench::measure_peaks(weft::bench::kPeakRead);
            print_header(opt, prop, gpus, peaks);
        }
        std::vector<Row> rows;
        for (int world : worlds) {
            weft::WorldOptions wo;
            const uint64_t heap = weft::ops::collective_workspace_heap_bytes(world) + (64ull << 20);
            wo.heap_bytes = (heap + (2ull << 20) - 1) / (2ull << 20) * (2ull << 20);
            wo.timeout = std::chrono::milliseconds(60000);
            launcher.run(
                world,
                [&](weft::World& w) {
                    const bool prints = launcher.printer() && w.rank() == 0;
                    if (launcher.launched()) {  // one world under a launcher
                        if (w.rank() == 0)
                            peaks = weft::bench::measure_peaks(weft::bench::kPeakRead, opt.dtype, w.device());
                        w.barrier();
                        if (prints) print_header(opt, prop, gpus, peaks);
                    }
                    run_world(w, opt, peaks, prints, &rows);
                },
                wo);
        }
        if (!launcher.printer()) return 0;  // rank 0 prints, checks and writes the JSON
        if (!opt.json.empty()) {
            weft::bench::Json j;
            j.begin_object().field("bench", "sp_decode").field("gpu", prop.name).field("gpus", gpus);
            j.field("sms", prop.multiProcessorCount).field("dtype", weft::dtype_name(opt.dtype)).field("dim", opt.dim);
            j.field("iters", opt.iters).field("warmup", opt.warmup).field("date", weft::bench::utc_date());
            j.field("ranks", launcher.launched() ? "processes" : "threads");
            weft::bench::add_peaks(j, peaks);
            j.key("results").begin_array();
            for (const Row& r : rows) add_row(j, r);
            j.end_array().end_object();
            weft::bench::write_json_file(opt.json, j);
        }
        const bool failed =
            std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.check.rfind("FAIL", 0) == 0; });
        return failed ? 1 : 0;
    });
}
