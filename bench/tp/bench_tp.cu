// SPDX-License-Identifier: MIT
// weft_bench_tp: the tensor-parallel fused ops (AllGather+GEMM, GEMM+ReduceScatter, GEMM+AllReduce) against
// (a) cuBLAS GEMM + the collective back to back, (b) a decomposed overlap (chunked cuBLAS GEMMs beside
// copy-engine transfers, as PyTorch's async-TP does), NCCL's collective + the same cuBLAS GEMM back to back, and the
// ideal max(GEMM alone, collective alone), all measured in the same run on the same data. Ranks are threads over
// the visible GPUs (they share a GPU when there are fewer GPUs than ranks: then the figures measure overhead, not
// overlap); under a launcher (weftrun, torchrun, srun) every process is one rank of the launched world and rank 0
// prints the table and writes the JSON: the way to run across (virtual) nodes (docs/multinode.md).
//
//   weft_bench_tp [--op ag,rs,ar] [--shapes I,J,...] [--sizes MxNxK,...] [--iters N] [--warmup N]
//                 [--dtype bf16|f16] [--world W] [--check] [--tune] [--baseline-coll weft|simple]
//                 [--reduce-ctas R (GEMM+RS reduction CTAs)] [--rs-mode auto|pull|push] [--no-nccl] [--json FILE]
//                 [--trace PATH] [--trace-overhead]
//
// Shapes are whole layers: AG+GEMM shards N over the ranks (each computes [M, N/W] from all of A[M, K]);
// GEMM+RS shards K (each holds A[M, K/W], B[N, K/W]; out [M/W, N]); GEMM+AR shards K (out [M, N]).
// --shapes picks entries of each op's default list by index (0-based); --sizes replaces the lists.
// The collective of (a) and of the "coll" column is weft's standalone op (weft::ops::all_gather / reduce_scatter /
// all_reduce, automatic algorithm, on symmetric-heap buffers: weft's tuned collective, not a slow stand-in); with
// --baseline-coll simple it is the weft-free code of tp_baselines.cuh (device barriers + copy-engine pulls or an
// SM sum kernel). (b) keeps its copy-engine transfers; its GEMM+AR chunks use weft's all_reduce too (README.md
// says why). The "nccl+gemm" column is NCCL's own collective over the same ranks (ncclAllGather before the GEMM,
// ncclReduceScatter / ncclAllReduce after it, one stream, plain cudaMalloc buffers), where NCCL can run: one GPU per
// rank, or ranks as processes over virtual nodes (bench/common/nccl.hpp; elsewhere the header says why not).
// Across (virtual) nodes the fused ops and weft's collectives take their inter-node paths (docs/multinode.md); (b)
// is skipped there (its copy engines need load/store access to every peer's buffers) and so is GEMM+AR (GemmAr
// stays on one node).
// The header gives the tensor-core peak (cuBLASLt on a random 8192^3 GEMM) and copy peak of GPU 0 (of rank 0's GPU
// under a launcher), measured at start-up.
// Tracing (docs/profiling.md): --trace PATH (or WEFT_TRACE) records the intra-kernel trace of every kernel; the fused
// op's measurement starts with an empty buffer, and the file holds the last op measured. --trace-overhead runs the
// shapes untraced, then the fused ops alone traced, and adds their traced time and the overhead to the table.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/cli.hpp"
#include "common/json.hpp"
#include "common/nccl.hpp"
#include "common/peaks.hpp"
#include "common/tracing.hpp"
#include "tp_baselines.cuh"
#include "weft/detail/gemm_launch.hpp"
#include "weft/device.cuh"
#include "weft/jit/compiler.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/runtime/launch_env.hpp"
#include "weft/weft.hpp"

namespace {

using weft::DType;
using weft::TensorView;
using weft::World;
using namespace weft::bench_tp;

// ---- command line ---------------------------------------------------------------------------------------

struct Shape {
    int64_t m, n, k;
};

struct Options {
    std::vector<std::string> ops = {"ag", "rs", "ar"};
    std::vector<int> shape_idx;
    std::vector<Shape> sizes;
    int iters = 10;
    int warmup = 3;
    DType dtype = DType::kBF16;
    int world = 0;
    bool check = false;
    bool tune = false;
    BaselineColl coll = BaselineColl::kWeft;
    int reduce_ctas = 0;  // GEMM+RS reduction CTAs (0: the op's heuristic)
    weft::ops::GemmRsMode rs_mode = weft::ops::GemmRsMode::kAuto;
    bool nccl = true;  // the nccl+gemm column, where NCCL can run
    std::string json;
    weft::bench::TraceOptions trace;
    bool weft_only = false;  // the traced pass of --trace-overhead: the fused op (and its engine) only
};

std::vector<Shape> default_shapes(const std::string& op) {
    if (op == "ag")
        return {
            {8192, 11008, 4096}, {8192, 14336, 4096}, {8192, 28672, 8192}, {8192, 53248, 16384}, {8192, 29568, 8192}};
    if (op == "rs")
        return {
            {8192, 4096, 11008}, {8192, 4096, 14336}, {8192, 8192, 28672}, {8192, 16384, 53248}, {8192, 8192, 29568}};
    return {{1, 8192, 8192}, {16, 8192, 8192}, {128, 8192, 8192}};
}

Options parse(int argc, char** argv) {
    Options o;
    weft::bench::Cli cli(
        "weft_bench_tp",
        "AllGather+GEMM, GEMM+ReduceScatter, GEMM+AllReduce against cuBLAS + a collective (weft's, NCCL's)");
    cli.option("--op", "ag,rs,ar", "the fused ops to measure (default all three)",
               [&](const std::string& v) { o.ops = weft::bench::parse_choice_list(v, "--op", {"ag", "rs", "ar"}); });
    cli.option("--shapes", "I,J,...", "entries of each op's default shape list, 0-based (indices past a list's end "
               "pick nothing)", [&](const std::string& v) {
                   o.shape_idx.clear();
                   for (int64_t i : weft::bench::parse_int_list(v, "--shapes", 0, 1 << 20)) {
                       o.shape_idx.push_back(static_cast<int>(i));
                   }
               });
    cli.sizes("MxNxK[,...]", "layer shapes, replacing the default lists", [&](const std::string& v) {
        o.sizes.clear();
        for (const auto& [m, n, k] : weft::bench::parse_shapes3(v, "--sizes")) o.sizes.push_back({m, n, k});
    });
    cli.iters(&o.iters).warmup(&o.warmup).dtype(&o.dtype, {DType::kBF16, DType::kF16});
    cli.world(&o.world, 0, 1 << 10,
              "ranks, threads over the visible GPUs (default 0: max(2, GPUs)); under a launcher the launched "
              "world, which --world must then equal");
    cli.check(&o.check);
    cli.flag("--tune", "AG+GEMM and GEMM+RS tune their GEMM config on their first call", &o.tune);
    cli.option("--baseline-coll", "weft|simple", "(a)'s collective: weft's own op or simple kernels (default weft)",
               [&](const std::string& v) {
                   o.coll = weft::bench::parse_choice(v, "--baseline-coll", {"weft", "simple"}) == "weft"
                                ? BaselineColl::kWeft
                                : BaselineColl::kSimple;
               });
    cli.int_option("--reduce-ctas", "GEMM+RS reduction CTAs (0: the op's heuristic)", &o.reduce_ctas, 0, 1 << 10);
    cli.option("--rs-mode", "auto|pull|push", "GemmRsOptions::mode (default auto)", [&](const std::string& v) {
        const std::string m = weft::bench::parse_choice(v, "--rs-mode", {"auto", "pull", "push"});
        o.rs_mode = m == "pull"   ? weft::ops::GemmRsMode::kPull
                    : m == "push" ? weft::ops::GemmRsMode::kPush
                                  : weft::ops::GemmRsMode::kAuto;
    });
    bool no_nccl = false;
    cli.flag("--no-nccl", "skip the nccl+gemm baseline", &no_nccl);
    cli.json(&o.json);
    weft::bench::add_trace_options(cli, &o.trace);
    cli.parse(argc, argv);
    o.nccl = !no_nccl;
    return o;
}

// --check: the fused op's output poisoned, then one more call (the timed calls left it written), every rank together.
template <class Call>
void rerun_poisoned(weft::World& w, cudaStream_t s, void* out, int64_t bytes, Call&& call) {
    BENCH_CUDA(cudaMemsetAsync(out, 0xff, static_cast<size_t>(bytes), s));
    BENCH_CUDA(cudaStreamSynchronize(s));
    w.barrier();
    call();
    BENCH_CUDA(cudaStreamSynchronize(s));
}

struct Row {
    std::string op;
    Shape shape;
    int world;
    double gemm = 0, engine = -1, coll = 0, a = 0, b = -1, weft = 0;  // -1: not measured
    double nccl = -1;                                                 // NCCL's collective + cuBLAS; -1: not run
    double err_weft = -1, err_b = -1, err_nccl = -1;                  // relative to (a), max over ranks
    std::string coll_algo = "";        // the algorithm of (a)'s collective and of "coll" (weft's choice or "simple")
    double weft_traced = -1;           // --trace-overhead: the fused op traced
    double trace_events_per_call = 0;  // traced: events the fused op recorded per call (slowest rank)
};

/// A baseline's time_all, or -1 (not measured) in the traced pass of --trace-overhead.
double time_baseline(World& w, Shared& sh, const Options& o, cudaStream_t s, const std::function<void()>& body) {
    return o.weft_only ? -1 : time_all(w, sh, s, o.warmup, o.iters, body);
}

/// Starts the fused op's traced measurement (an empty buffer; collective; the streams drained). No-op untraced.
void start_weft_measurement(World& w) { weft::bench::start_traced_measurement(w); }

/// Events per fused-op call since start_weft_measurement (`calls` of them), the slowest rank's; 0 untraced.
double weft_events_per_call(World& w, Shared& sh, int calls) {
    if (!weft::tracing(w)) return 0;
    return max_over_ranks(w, sh, static_cast<double>(weft::bench::traced_events(w)) / std::max(1, calls));
}

// ---- AllGather + GEMM -------------------------------------------------------------------------------------

/// The plain GEMM kernel of the fused op's config at the time of the launch: with --tune the op's config may
/// change in the warm-up (its first call tunes), and the "weft-gemm" column follows it.
class EngineKernel {
public:
    const weft::jit::Kernel& get(const weft::GemmConfig& config) {
        if (kernel_ == nullptr || !(config == config_)) {
            kernel_ = &weft::jit::compiler().get_kernel(weft::ops::gemm_kernel_spec(config));
            config_ = config;
        }
        return *kernel_;
    }

private:
    weft::GemmConfig config_{};
    const weft::jit::Kernel* kernel_ = nullptr;
};

Row bench_ag(World& w, Shared& sh, const Options& o, const Shape& full, Lt& lt, cudaStream_t s, cudaStream_t comm,
             ncclComm_t nccl_comm) {
    const int nr = w.num_ranks(), me = w.rank();
    const bool one_node = w.num_nodes() == 1;  // (b) pulls peers' symmetric buffers: one node only
    const DType t = o.dtype;
    const int64_t m = full.m / nr * nr, rows = m / nr, k = full.k;
    const int64_t n = std::max<int64_t>(8, full.n / nr / 8 * 8);  // this rank's columns
    const int64_t es = 2;
    Row row{"ag", {m, n * nr, k}, nr};

    weft::ops::AgGemmOptions opt;
    opt.autotune = o.tune;
    weft::ops::AgGemm op(w, {m, n, k, t}, opt);
    auto* g_base = static_cast<uint8_t*>(w.heap().alloc(static_cast<uint64_t>(m * k * es)));  // baseline gather
    BaselineAllGather coll(w, o.coll, g_base, static_cast<uint64_t>(rows * k * es));          // (a), in place on g_base
    row.coll_algo = coll.algo();
    DeviceBarrier bar;  // (b)'s
    if (one_node) bar.make(w);
    void *b_dev = nullptr, *c_w = nullptr, *c_a = nullptr, *c_b = nullptr, *c_e = nullptr;
    BENCH_CUDA(cudaMalloc(&b_dev, static_cast<size_t>(n * k * es)));
    for (void** p : {&c_w, &c_a, &c_b, &c_e}) BENCH_CUDA(cudaMalloc(p, static_cast<size_t>(m * n * es)));
    // NCCL's baseline: its own gathered buffer (this rank's slot is the input: in place) and output.
    uint8_t* g_nccl = nullptr;
    void* c_n = nullptr;
    if (nccl_comm != nullptr) {
        BENCH_CUDA(cudaMalloc(&g_nccl, static_cast<size_t>(m * k * es)));
        BENCH_CUDA(cudaMalloc(&c_n, static_cast<size_t>(m * n * es)));
    }
    const uint64_t seed = 1234567 + static_cast<uint64_t>(me);
    fill_random(op.local_shard(m).data, rows * k, t, seed, s);
    BENCH_CUDA(cudaMemcpyAsync(g_base + me * rows * k * es, op.local_shard(m).data, static_cast<size_t>(rows * k * es),
                               cudaMemcpyDeviceToDevice, s));
    if (g_nccl != nullptr) {
        BENCH_CUDA(cudaMemcpyAsync(g_nccl + me * rows * k * es, op.local_shard(m).data,
                                   static_cast<size_t>(rows * k * es), cudaMemcpyDeviceToDevice, s));
    }
    fill_random(b_dev, n * k, t, seed + 100, s);
    EngineKernel engine;
    engine.get(op.config());  // loaded before anything is timed (--tune may change the config in the warm-up)
    w.barrier();
    // The gathered A the GEMM alone is timed on: every rank's shard, not the heap's leftovers (zeros, or the previous
    // shape's rows: a GEMM on zeros runs faster).
    coll(s);
    BENCH_CUDA(cudaStreamSynchronize(s));
    w.barrier();

    weft::Event ev_fork, ev_join;
    std::vector<weft::Event> ev_shard(static_cast<size_t>(nr));
    auto pull_all = [&](cudaStream_t on) {  // (b)'s copy-engine pulls, one event per shard
        for (int i = 1; i < nr; ++i) {
            const int src = (me + i) % nr;
            uint8_t* dst = g_base + src * rows * k * es;
            BENCH_CUDA(cudaMemcpyAsync(dst, w.heap().symm_at(dst, src), static_cast<size_t>(rows * k * es),
                                       cudaMemcpyDefault, on));
            ev_shard[static_cast<size_t>(src)].record(on);
        }
    };
    auto gemm_full = [&](void* c) { lt.gemm(t, g_base, k, b_dev, k, c, n, m, n, k, s); };

    row.gemm = time_baseline(w, sh, o, s, [&] { gemm_full(c_a); });
    row.coll = time_baseline(w, sh, o, s, [&] { coll(s); });
    row.a = time_baseline(w, sh, o, s, [&] {
        coll(s);
        gemm_full(c_a);
    });
    row.nccl = nccl_comm == nullptr ? -1 : time_baseline(w, sh, o, s, [&] {
        BENCH_NCCL_CHECK(weft::bench::nccl().all_gather(g_nccl + me * rows * k * es, g_nccl,
                                                        static_cast<size_t>(rows * k), weft::bench::nccl_type(t),
                                                        nccl_comm, s));
        lt.gemm(t, g_nccl, k, b_dev, k, c_n, n, m, n, k, s);
    });
    row.b = !one_node ? -1 : time_baseline(w, sh, o, s, [&] {
        bar(s);
        ev_fork.record(s);
        ev_fork.wait(comm);
        pull_all(comm);
        lt.gemm(t, g_base + me * rows * k * es, k, b_dev, k, static_cast<uint8_t*>(c_b) + me * rows * n * es, n, rows,
                n, k, s);
        for (int i = 1; i < nr; ++i) {
            const int src = (me + i) % nr;
            ev_shard[static_cast<size_t>(src)].wait(s);
            lt.gemm(t, g_base + src * rows * k * es, k, b_dev, k, static_cast<uint8_t*>(c_b) + src * rows * n * es, n,
                    rows, n, k, s);
        }
        ev_join.record(comm);
        ev_join.wait(s);
        bar(s);
    });
    const TensorView a_local = op.local_shard(m), bv(b_dev, t, {n, k}), cw(c_w, t, {m, n});
    // The fused op and the engine alone with the same config, alternately (the fused op tunes on its first
    // call with --tune: in the warm-up).
    start_weft_measurement(w);
    std::tie(row.weft, row.engine) = time_pair(
        w, sh, s, o.warmup, o.iters, [&] { op.run(a_local, bv, cw, s); },
        [&] {
            weft::ops::detail::GemmTensorMaps maps = weft::ops::detail::make_gemm_tensor_maps(
                op.config(), TensorView(g_base, t, {m, k}), TensorView(b_dev, t, {n, k}), TensorView(c_e, t, {m, n}));
            const weft::GemmArgs args = weft::ops::detail::make_gemm_args(
                TensorView(g_base, t, {m, k}), TensorView(c_e, t, {m, n}), 20'000'000'000ull);
            weft::jit::LaunchParams lp;
            lp.grid = dim3(static_cast<unsigned>(op.gemm_grid()));
            lp.block = dim3(weft::kGemmThreads);
            lp.dynamic_smem_bytes = static_cast<size_t>(weft::gemm_smem_plan(op.config()).alloc_bytes);
            lp.stream = s;
            engine.get(op.config()).launch(lp, maps.a, maps.b, maps.d, args, int32_t{0}, int32_t{0});
        });
    row.trace_events_per_call = weft_events_per_call(w, sh, o.warmup + o.iters);
    if (o.check) {
        rerun_poisoned(w, s, c_w, m * n * es, [&] { op.run(a_local, bv, cw, s); });
        row.err_weft = max_over_ranks(w, sh, rel_error(c_w, n, c_a, n, m, n, t, s));
        if (row.b >= 0) row.err_b = max_over_ranks(w, sh, rel_error(c_b, n, c_a, n, m, n, t, s));
        if (row.nccl >= 0) row.err_nccl = max_over_ranks(w, sh, rel_error(c_n, n, c_a, n, m, n, t, s));
    }
    w.sync_and_check(s);
    w.barrier();
    for (void* p : {b_dev, c_w, c_a, c_b, c_e, static_cast<void*>(g_nccl), c_n}) cudaFree(p);
    if (bar.words != nullptr) w.heap().free(bar.words);
    coll.release();
    w.heap().free(g_base);
    return row;
}

// ---- GEMM + ReduceScatter -----------------------------------------------------------------------------------

Row bench_rs(World& w, Shared& sh, const Options& o, const Shape& full, Lt& lt, cudaStream_t s, cudaStream_t comm,
             ncclComm_t nccl_comm) {
    const int nr = w.num_ranks(), me = w.rank();
    const bool one_node = w.num_nodes() == 1;  // (b) pushes into peers' symmetric buffers: one node only
    const DType t = o.dtype;
    const int64_t m = full.m / nr * nr, rows = m / nr, n = full.n / 8 * 8;
    const int64_t k = std::max<int64_t>(8, full.k / nr / 8 * 8);  // this rank's K
    const int64_t es = 2;
    Row row{"rs", {m, n, k * nr}, nr};

    weft::ops::GemmRsOptions opt;
    opt.autotune = o.tune;
    opt.reduce_ctas = o.reduce_ctas;
    opt.mode = o.rs_mode;
    weft::ops::GemmRs op(w, {m, n, k, t}, opt);
    if (nr > 1 && op.mode() == weft::ops::GemmRsMode::kPull) row.op = "rs/pull";
    auto* partial = static_cast<uint8_t*>(w.heap().alloc(static_cast<uint64_t>(m * n * es)));
    uint8_t* recv = nullptr;  // (b): [W][rows, n]
    DeviceBarrier bar;        // (b)'s
    if (one_node) {
        recv = static_cast<uint8_t*>(w.heap().alloc(static_cast<uint64_t>(m * n * es)));
        bar.make(w);
    }
    const weft::DeviceCtx ctx = w.device_ctx();
    // (a)'s output is symmetric, as in weft's collective benchmark (no pointer query per call).
    void* c_a = w.heap().alloc(static_cast<uint64_t>(rows * n * es));
    void *a_dev = nullptr, *b_dev = nullptr, *c_w = nullptr, *c_b = nullptr, *c_e = nullptr;
    BENCH_CUDA(cudaMalloc(&a_dev, static_cast<size_t>(m * k * es)));
    BENCH_CUDA(cudaMalloc(&b_dev, static_cast<size_t>(n * k * es)));
    BENCH_CUDA(cudaMalloc(&c_e, static_cast<size_t>(m * n * es)));
    for (void** p : {&c_w, &c_b}) BENCH_CUDA(cudaMalloc(p, static_cast<size_t>(rows * n * es)));
    void *p_n = nullptr, *c_n = nullptr;  // NCCL's baseline: its own partial [m, n] and output [rows, n]
    if (nccl_comm != nullptr) {
        BENCH_CUDA(cudaMalloc(&p_n, static_cast<size_t>(m * n * es)));
        BENCH_CUDA(cudaMalloc(&c_n, static_cast<size_t>(rows * n * es)));
    }
    BaselineReduceScatter coll(w, o.coll, t, partial, c_a, rows, n);  // (a): partial -> c_a
    row.coll_algo = coll.algo();
    const uint64_t seed = 7654321 + static_cast<uint64_t>(me);
    fill_random(a_dev, m * k, t, seed, s);
    fill_random(b_dev, n * k, t, seed + 100, s);
    const auto engine_config = [&] {
        weft::GemmConfig c = op.config();
        c.out_dtype = t;
        return c;
    };
    EngineKernel engine;
    engine.get(engine_config());  // loaded before anything is timed (--tune may change the config in the warm-up)
    w.barrier();

    row.gemm = time_baseline(w, sh, o, s, [&] { lt.gemm(t, a_dev, k, b_dev, k, partial, n, m, n, k, s); });
    row.coll = time_baseline(w, sh, o, s, [&] { coll(s); });
    row.a = time_baseline(w, sh, o, s, [&] {
        lt.gemm(t, a_dev, k, b_dev, k, partial, n, m, n, k, s);
        coll(s);
    });
    row.nccl = nccl_comm == nullptr ? -1 : time_baseline(w, sh, o, s, [&] {
        lt.gemm(t, a_dev, k, b_dev, k, p_n, n, m, n, k, s);
        BENCH_NCCL_CHECK(weft::bench::nccl().reduce_scatter(p_n, c_n, static_cast<size_t>(rows * n),
                                                            weft::bench::nccl_type(t), ncclSum, nccl_comm, s));
    });
    weft::Event ev_fork, ev_join;
    std::vector<weft::Event> ev_seg(static_cast<size_t>(nr));
    row.b = !one_node ? -1 : time_baseline(w, sh, o, s, [&] {
        bar(s);  // every rank's receive buffer is free
        ev_fork.record(s);
        ev_fork.wait(comm);
        for (int i = 0; i < nr; ++i) {
            const int dest = (me + 1 + i) % nr;
            uint8_t* seg = partial + dest * rows * n * es;
            lt.gemm(t, static_cast<uint8_t*>(a_dev) + dest * rows * k * es, k, b_dev, k, seg, n, rows, n, k, s);
            ev_seg[static_cast<size_t>(i)].record(s);
            ev_seg[static_cast<size_t>(i)].wait(comm);
            uint8_t* slot = recv + me * rows * n * es;  // my slot in dest's receive buffer
            BENCH_CUDA(cudaMemcpyAsync(w.heap().symm_at(slot, dest), seg, static_cast<size_t>(rows * n * es),
                                       cudaMemcpyDefault, comm));
        }
        ev_join.record(comm);
        ev_join.wait(s);
        bar(s);  // every push into my receive buffer landed
        sum_launch(t, [&](auto* tag) {
            using T = std::remove_pointer_t<decltype(tag)>;
            bench_sum_kernel<T><<<kSumBlocks, kSumThreads, 0, s>>>(ctx, nullptr, reinterpret_cast<const T*>(recv),
                                                                   rows * n, nr, 0, rows, 0, n, n, static_cast<T*>(c_b),
                                                                   n);
        });
        BENCH_CUDA(cudaGetLastError());
    });
    const TensorView av(a_dev, t, {m, k}), bv(b_dev, t, {n, k}), cw(c_w, t, {rows, n});
    // The fused op and the engine alone with the same config, alternately (--tune: tuned in the warm-up).
    start_weft_measurement(w);
    std::tie(row.weft, row.engine) = time_pair(
        w, sh, s, o.warmup, o.iters, [&] { op.run(av, bv, cw, s); },
        [&] {
            const weft::GemmConfig c = engine_config();
            const auto maps = weft::ops::detail::make_gemm_tensor_maps(
                c, TensorView(a_dev, t, {m, k}), TensorView(b_dev, t, {n, k}), TensorView(c_e, t, {m, n}));
            const weft::GemmArgs args = weft::ops::detail::make_gemm_args(
                TensorView(a_dev, t, {m, k}), TensorView(c_e, t, {m, n}), 20'000'000'000ull);
            weft::jit::LaunchParams lp;
            lp.grid = dim3(static_cast<unsigned>(op.gemm_grid() + op.reduce_ctas()));
            lp.block = dim3(weft::kGemmThreads);
            lp.dynamic_smem_bytes = static_cast<size_t>(weft::gemm_smem_plan(c).alloc_bytes);
            lp.stream = s;
            engine.get(c).launch(lp, maps.a, maps.b, maps.d, args, int32_t{0}, int32_t{0});
        });
    row.trace_events_per_call = weft_events_per_call(w, sh, o.warmup + o.iters);
    if (o.check) {
        rerun_poisoned(w, s, c_w, rows * n * es, [&] { op.run(av, bv, cw, s); });
        row.err_weft = max_over_ranks(w, sh, rel_error(c_w, n, c_a, n, rows, n, t, s));
        if (row.b >= 0) row.err_b = max_over_ranks(w, sh, rel_error(c_b, n, c_a, n, rows, n, t, s));
        if (row.nccl >= 0) row.err_nccl = max_over_ranks(w, sh, rel_error(c_n, n, c_a, n, rows, n, t, s));
    }
    w.sync_and_check(s);
    w.barrier();
    for (void* p : {a_dev, b_dev, c_w, c_b, c_e, p_n, c_n}) cudaFree(p);
    if (bar.words != nullptr) w.heap().free(bar.words);
    coll.release();
    w.heap().free(c_a);
    if (recv != nullptr) w.heap().free(recv);
    w.heap().free(partial);
    return row;
}

// ---- GEMM + AllReduce ---------------------------------------------------------------------------------------

Row bench_ar(World& w, Shared& sh, const Options& o, const Shape& full, Lt& lt, cudaStream_t s, cudaStream_t comm,
             ncclComm_t nccl_comm) {
    const int nr = w.num_ranks();
    const DType t = o.dtype;
    const int64_t m = full.m, n = full.n / 8 * 8;
    const int64_t k = std::max<int64_t>(8, full.k / nr / 8 * 8);
    const int64_t es = 2;
    Row row{"ar", {m, n, k * nr}, nr};

    weft::ops::GemmAr op(w, {m, n, k, t});
    auto* partial = static_cast<uint8_t*>(w.heap().alloc(static_cast<uint64_t>(m * n * es)));
    const weft::DeviceCtx ctx = w.device_ctx();
    // The baselines' outputs are symmetric too, as in weft's collective benchmark (no pointer query per call).
    void* c_a = w.heap().alloc(static_cast<uint64_t>(m * n * es));
    void* c_b = w.heap().alloc(static_cast<uint64_t>(m * n * es));
    void *a_dev = nullptr, *b_dev = nullptr, *c_w = nullptr;
    BENCH_CUDA(cudaMalloc(&a_dev, static_cast<size_t>(m * k * es)));
    BENCH_CUDA(cudaMalloc(&b_dev, static_cast<size_t>(n * k * es)));
    BENCH_CUDA(cudaMalloc(&c_w, static_cast<size_t>(m * n * es)));
    void *p_n = nullptr, *c_n = nullptr;  // NCCL's baseline: its own partial and output, [m, n] each
    if (nccl_comm != nullptr) {
        BENCH_CUDA(cudaMalloc(&p_n, static_cast<size_t>(m * n * es)));
        BENCH_CUDA(cudaMalloc(&c_n, static_cast<size_t>(m * n * es)));
    }
    BaselineAllReduce coll(w, o.coll, t, partial, c_a, m, n);  // (a): partial -> c_a
    row.coll_algo = coll.algo();
    const uint64_t seed = 99991 + static_cast<uint64_t>(w.rank());
    fill_random(a_dev, m * k, t, seed, s);
    fill_random(b_dev, n * k, t, seed + 100, s);
    w.barrier();

    row.gemm = time_baseline(w, sh, o, s, [&] { lt.gemm(t, a_dev, k, b_dev, k, partial, n, m, n, k, s); });
    row.coll = time_baseline(w, sh, o, s, [&] { coll(s); });
    row.a = time_baseline(w, sh, o, s, [&] {
        lt.gemm(t, a_dev, k, b_dev, k, partial, n, m, n, k, s);
        coll(s);
    });
    row.nccl = nccl_comm == nullptr ? -1 : time_baseline(w, sh, o, s, [&] {
        lt.gemm(t, a_dev, k, b_dev, k, p_n, n, m, n, k, s);
        BENCH_NCCL_CHECK(weft::bench::nccl().all_reduce(p_n, c_n, static_cast<size_t>(m * n), weft::bench::nccl_type(t),
                                                        ncclSum, nccl_comm, s));
    });
    // (b): 4 column chunks; chunk j's all-reduce runs on `comm` beside chunk j+1's GEMM on `s`.
    constexpr int kChunks = 4;
    const int64_t chunk = (n / kChunks + 7) / 8 * 8;
    weft::Event ev_fork, ev_join;
    std::vector<weft::Event> ev_chunk(kChunks);
    DeviceBarrier bar_comm;  // simple only
    if (o.coll == BaselineColl::kSimple) bar_comm.make(w);
    auto chunk_all_reduce = [&](int64_t c0, int64_t cols) {
        if (o.coll == BaselineColl::kWeft) {
            // The chunk is a contiguous [m, cols] block at element m * c0 (chunk-major), so one weft all_reduce
            // (automatic algorithm) reduces it; every rank issues the chunks in the same order on `comm`.
            weft::ops::all_reduce(w, TensorView(partial + m * c0 * es, t, {m * cols}),
                                  TensorView(static_cast<uint8_t*>(c_b) + m * c0 * es, t, {m * cols}), comm);
            return;
        }
        bar_comm(comm);  // every rank's chunk is complete
        sum_launch(t, [&](auto* tag) {
            using T = std::remove_pointer_t<decltype(tag)>;
            bench_sum_kernel<T><<<kSumBlocks, kSumThreads, 0, comm>>>(
                ctx, reinterpret_cast<const T*>(partial), nullptr, 0, nr, 0, m, c0, cols, n, static_cast<T*>(c_b), n);
        });
        BENCH_CUDA(cudaGetLastError());
    };
    row.b = time_baseline(w, sh, o, s, [&] {
        ev_fork.record(s);
        ev_fork.wait(comm);
        for (int j = 0; j < kChunks; ++j) {
            const int64_t c0 = j * chunk, cols = std::min(chunk, n - c0);
            if (cols <= 0) break;
            // weft: chunk-major (block j = [m, cols] at element m * c0); simple: row-major [m, n], columns c0...
            uint8_t* d = o.coll == BaselineColl::kWeft ? partial + m * c0 * es : partial + c0 * es;
            lt.gemm(t, a_dev, k, static_cast<uint8_t*>(b_dev) + c0 * k * es, k, d,
                    o.coll == BaselineColl::kWeft ? cols : n, m, cols, k, s);
            ev_chunk[static_cast<size_t>(j)].record(s);
            ev_chunk[static_cast<size_t>(j)].wait(comm);
            chunk_all_reduce(c0, cols);
        }
        // simple: every rank has read every partial. weft: each all_reduce leaves its input free on return.
        if (o.coll == BaselineColl::kSimple) bar_comm(comm);
        ev_join.record(comm);
        ev_join.wait(s);
    });
    const TensorView av(a_dev, t, {m, k}), bv(b_dev, t, {n, k}), cw(c_w, t, {m, n});
    start_weft_measurement(w);
    row.weft = time_all(w, sh, s, o.warmup, o.iters, [&] { op.run(av, bv, cw, s); });
    row.trace_events_per_call = weft_events_per_call(w, sh, o.warmup + o.iters);
    if (o.check) {
        rerun_poisoned(w, s, c_w, m * n * es, [&] { op.run(av, bv, cw, s); });
        row.err_weft = max_over_ranks(w, sh, rel_error(c_w, n, c_a, n, m, n, t, s));
        void* b_rows = c_b;                   // (b)'s result as row-major [m, n]
        if (o.coll == BaselineColl::kWeft) {  // chunk-major -> row-major, outside the timed region
            BENCH_CUDA(cudaMalloc(&b_rows, static_cast<size_t>(m * n * es)));
            for (int j = 0; j < kChunks; ++j) {
                const int64_t c0 = j * chunk, cols = std::min(chunk, n - c0);
                if (cols <= 0) break;
                BENCH_CUDA(cudaMemcpy2DAsync(static_cast<uint8_t*>(b_rows) + c0 * es, static_cast<size_t>(n * es),
                                             static_cast<uint8_t*>(c_b) + m * c0 * es, static_cast<size_t>(cols * es),
                                             static_cast<size_t>(cols * es), static_cast<size_t>(m),
                                             cudaMemcpyDeviceToDevice, s));
            }
        }
        row.err_b = max_over_ranks(w, sh, rel_error(b_rows, n, c_a, n, m, n, t, s));
        if (b_rows != c_b) cudaFree(b_rows);
        if (row.nccl >= 0) row.err_nccl = max_over_ranks(w, sh, rel_error(c_n, n, c_a, n, m, n, t, s));
    }
    w.sync_and_check(s);
    w.barrier();
    for (void* p : {a_dev, b_dev, c_w, p_n, c_n}) cudaFree(p);
    if (bar_comm.words != nullptr) w.heap().free(bar_comm.words);
    coll.release();
    w.heap().free(c_b);
    w.heap().free(c_a);
    w.heap().free(partial);
    return row;
}

// ---- report -------------------------------------------------------------------------------------------------

/// What the table's header says about a pass's World (rank 0's view; every rank's is the same).
struct PassInfo {
    int world = 0;
    int num_nodes = 1;
    int virtual_nodes = 1;
    bool processes = false;          // ranks are processes of their own (a launcher), else threads of this process
    bool shared = false;             // some GPU hosts more than one rank
    std::string nccl_note;           // open_nccl_baseline's note
    std::vector<std::string> notes;  // baselines or ops skipped, and why
};

std::string fmt(double ms) {
    if (ms < 0) return "-";
    char buf[32];
    std::snprintf(buf, sizeof(buf), ms < 1 ? "%.1f us" : "%.3f ms", ms < 1 ? ms * 1000 : ms);
    return buf;
}

std::string fmt_err(double e) {
    if (e < 0) return "-";
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.1e", e);
    return buf;
}

std::string fmt_ratio(double num, double den) {
    if (num < 0 || den <= 0) return "-";
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.2fx", num / den);
    return buf;
}

void print_and_save(const std::vector<Row>& rows, const Options& o, const PassInfo& info, int gpus,
                    const std::string& device, const weft::bench::Peaks& peaks) {
    std::printf("\nweft_bench_tp: %s x%d, %s, world %d%s, %d iters (slowest rank, mean)\n", device.c_str(), gpus,
                weft::dtype_name(o.dtype), info.world,
                info.shared ? " (ranks share GPUs: figures measure overhead, not overlap)" : "", o.iters);
    std::string nodes = "one node";
    if (info.num_nodes > 1) {
        nodes = std::to_string(info.num_nodes) +
                (info.virtual_nodes > 1 ? " virtual nodes (WEFT_VIRTUAL_NODES)" : " nodes") +
                ": the fused ops and weft's collectives take their inter-node paths";
    }
    std::printf("ranks: %s; %s\n", info.processes ? "one process each (launcher)" : "threads of this process",
                nodes.c_str());
    std::printf("%s\n", weft::bench::describe(peaks).c_str());
    std::printf("baseline collective (coll, (a)): %s\n",
                o.coll == BaselineColl::kWeft
                    ? "weft's standalone op (weft::ops::all_gather / reduce_scatter / all_reduce), automatic algorithm"
                    : "simple weft-free kernels (device barriers + copy-engine pulls / SM sum kernel)");
    std::printf("nccl+gemm: %s\n", info.nccl_note.c_str());
    const bool overhead = o.trace.overhead;
    std::printf("%-3s %-22s %10s %10s %10s %-12s %10s %10s %10s %10s %10s %8s %8s %6s %s%s\n", "op",
                "M x N x K (layer)", "gemm", "weft-gemm", "coll", "algo", "(a)seq", "(b)decomp", "nccl+gemm", "weft",
                "ideal", "vs (a)", "vs nccl", "eff", overhead ? " weft+trace   trace  ev/call " : "",
                o.check ? "err weft/(b)/nccl" : "");
    for (const Row& r : rows) {
        const double ideal = std::max(r.gemm, r.coll);
        char shape[64];
        std::snprintf(shape, sizeof(shape), "%ldx%ldx%ld", r.shape.m, r.shape.n, r.shape.k);
        std::string check;
        if (o.check) check = fmt_err(r.err_weft) + "/" + fmt_err(r.err_b) + "/" + fmt_err(r.err_nccl);
        char traced[64] = "";
        if (overhead) {
            std::snprintf(traced, sizeof(traced), " %10s %+6.1f%% %7.0f ", fmt(r.weft_traced).c_str(),
                          r.weft_traced > 0 ? 100.0 * (r.weft_traced / r.weft - 1.0) : 0.0, r.trace_events_per_call);
        }
        std::printf("%-3s %-22s %10s %10s %10s %-12s %10s %10s %10s %10s %10s %8s %8s %5.0f%% %s%s\n", r.op.c_str(),
                    shape, fmt(r.gemm).c_str(), fmt(r.engine).c_str(), fmt(r.coll).c_str(), r.coll_algo.c_str(),
                    fmt(r.a).c_str(), fmt(r.b).c_str(), fmt(r.nccl).c_str(), fmt(r.weft).c_str(), fmt(ideal).c_str(),
                    fmt_ratio(r.a, r.weft).c_str(), fmt_ratio(r.nccl, r.weft).c_str(), 100.0 * ideal / r.weft, traced,
                    check.c_str());
    }
    const bool weft_coll = o.coll == BaselineColl::kWeft;
    std::printf(
        "gemm: cuBLASLt alone; weft-gemm: weft's GEMM engine alone (same config, no communication); coll: the\n"
        "baseline collective alone, algo: its algorithm (%s); (a)seq: cuBLAS and that same\n"
        "collective back to back; (b)decomp: chunked cuBLAS GEMMs beside copy-engine transfers (GEMM+AR:\n"
        "beside %s); nccl+gemm: NCCL's collective over the same ranks and the same cuBLAS GEMM\n"
        "back to back on one stream (ncclAllGather then GEMM; GEMM then ncclReduceScatter / ncclAllReduce);\n"
        "ideal = max(gemm, coll); vs (a) = (a) / weft; vs nccl = nccl+gemm / weft; eff = ideal / weft.\n",
        weft_coll ? "weft's automatic choice, hierarchical across nodes; WEFT_*_ALGO overrides it on one node"
                  : "--baseline-coll simple",
        weft_coll ? "weft all_reduce per chunk" : "the simple sum kernel per chunk");
    for (const std::string& note : info.notes) std::printf("%s\n", note.c_str());
    if (overhead) {
        std::printf(
            "weft+trace: the fused op with the intra-kernel trace on (WEFT_TRACE; a pass of its own, the fused ops "
            "alone);\ntrace = weft+trace / weft - 1; ev/call: trace events the fused op records per call (slowest "
            "rank).\n");
    }
    if (o.json.empty()) return;
    weft::bench::Json j;
    j.begin_object().field("bench", "weft_bench_tp").field("device", device).field("gpus", gpus);
    j.field("dtype", weft::dtype_name(o.dtype)).field("iters", o.iters).field("warmup", o.warmup);
    j.field("baseline_coll", baseline_coll_name(o.coll)).field("trace_overhead", o.trace.overhead);
    j.field("ranks", info.processes ? "processes" : "threads").field("num_nodes", info.num_nodes);
    j.field("virtual_nodes", info.virtual_nodes).field("nccl", info.nccl_note);
    j.key("notes").begin_array();
    for (const std::string& note : info.notes) j.value(note);
    j.end_array();
    weft::bench::add_peaks(j, peaks);
    j.key("results").begin_array();
    for (const Row& r : rows) {
        const double ideal = std::max(r.gemm, r.coll);
        j.begin_object(true).field("op", r.op).field("m", r.shape.m).field("n", r.shape.n).field("k", r.shape.k);
        j.field("world", r.world).field("gemm_ms", r.gemm).field("weft_gemm_ms", r.engine).field("coll_ms", r.coll);
        j.field("coll_algo", r.coll_algo).field("a_ms", r.a).field("b_ms", r.b).field("nccl_gemm_ms", r.nccl);
        j.field("weft_ms", r.weft).field("ideal_ms", ideal).field("speedup_vs_a", r.a / r.weft);
        j.field("speedup_vs_nccl", r.nccl > 0 ? r.nccl / r.weft : -1.0).field("overlap_efficiency", ideal / r.weft);
        j.field("err_weft", r.err_weft).field("err_b", r.err_b).field("err_nccl", r.err_nccl);
        if (r.weft_traced > 0) {
            j.field("weft_traced_ms", r.weft_traced).field("trace_events_per_call", r.trace_events_per_call);
        }
        j.end_object();
    }
    j.end_array().end_object();
    weft::bench::write_json_file(o.json, j);
    std::printf("wrote %s\n", o.json.c_str());
}

/// Symmetric heap bytes per rank for the ops and shapes of `o` on `world` ranks: the largest op's symmetric buffers
/// (the fused op's and the baselines'), room, and the baseline collectives' workspace (it stays allocated for the
/// whole run once made: by the weft baselines, and by GemmAr, whose all-reduce half is ops::all_reduce, with either
/// baseline). Across (virtual) nodes nothing needs more (docs/multinode.md): AgGemm keeps its gathered buffer and adds
/// a few relay signal words; GemmRs's node stage holds a partial of M / nodes rows, its node sums, received rows and
/// A staging being private device memory, as are the network backend's signal words and the hierarchical collectives'
/// scratch; the collective workspace is the node team's (fewer ranks than the world's); (b)'s buffers are not made.
/// The NCCL baseline's buffers are cudaMalloc'd.
uint64_t heap_bytes_for(const Options& o, int world) {
    uint64_t heap = 64ull << 20;
    for (const std::string& op : o.ops) {
        for (const Shape& sz : o.sizes.empty() ? default_shapes(op) : o.sizes) {
            const uint64_t per = static_cast<uint64_t>(sz.m) * static_cast<uint64_t>(op == "ag" ? sz.k : sz.n) * 2;
            heap = std::max<uint64_t>(heap, (op == "ar" ? 5 : (op == "rs" ? 6 : 2)) * per + (64ull << 20));
        }
    }
    heap += collective_workspace_heap_bytes(world);
    return (heap + (2ull << 20) - 1) / (2ull << 20) * (2ull << 20);
}

}  // namespace

int main(int argc, char** argv) {
    return weft::bench::run_main("weft_bench_tp", [&] {
        const Options o = parse(argc, argv);
        // Under a launcher (weftrun, torchrun, srun) every process is one rank of the launched world; a job of one
        // rank runs threads, as without a launcher.
        const std::optional<weft::LaunchEnv> launch = weft::detect_launch_env();
        const bool launched = launch && launch->num_ranks > 1;
        if (launched && o.world > 0 && o.world != launch->num_ranks) {
            throw weft::bench::UsageError("--world " + std::to_string(o.world) + " differs from the world " +
                                          launch->launcher + " started (" + std::to_string(launch->num_ranks) +
                                          " ranks, one process each): leave --world out or pass --world " +
                                          std::to_string(launch->num_ranks));
        }
        weft::prepare_cuda_environment();
        int gpus = 0;
        BENCH_CUDA(cudaGetDeviceCount(&gpus));
        cudaDeviceProp prop{};
        BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
        const bool printer = !launched || launch->rank == 0;
        const int world = launched ? launch->num_ranks : (o.world > 0 ? o.world : std::max(2, gpus));
        // The peaks on an idle GPU: before the ranks' threads start, or, with processes (which may share the GPU),
        // on rank 0 in the first World while the other ranks wait at a barrier.
        constexpr unsigned kPeaks = weft::bench::kPeakCopy | weft::bench::kPeakTensor;
        weft::bench::Peaks peaks;
        if (!launched) peaks = weft::bench::measure_peaks(kPeaks, o.dtype);
        bool peaks_pending = launched;
        weft::WorldOptions wo;
        wo.heap_bytes = heap_bytes_for(o, world);
        wo.timeout = std::chrono::milliseconds(60000);
        std::mutex rows_mutex;
        Shared sh(world);
        const auto run_pass = [&](const Options& pass, std::vector<Row>& rows, PassInfo& info) {
            const std::function<void(World&)> body = [&](World& w) {
                const bool spans = w.num_nodes() > 1;
                WEFT_CHECK(!spans || !w.same_process() || w.max_ranks_per_device() == 1,
                           "the world spans " << w.num_nodes() << " nodes with ranks that are threads of one process "
                                              << "sharing a GPU: NCCL (weft's network path) refuses them; run one "
                                                 "process per rank, e.g. WEFT_VIRTUAL_NODES="
                                              << w.num_nodes() << " weftrun -n " << w.num_ranks()
                                              << " -- weft_bench_tp ...");
                WEFT_CHECK(!spans || pass.coll == BaselineColl::kWeft,
                           "--baseline-coll simple loads and stores every peer's symmetric buffers, which a world "
                           "that spans "
                               << w.num_nodes() << " nodes cannot; use --baseline-coll weft (hierarchical there)");
                if (peaks_pending) {
                    if (w.rank() == 0) peaks = weft::bench::measure_peaks(kPeaks, o.dtype, w.device());
                    w.barrier();
                    peaks_pending = false;
                }
                // NCCL's communicator before weft's own network communicators exist (the fused ops and the
                // hierarchical collectives make them across nodes): NCCL takes a process's host identity once, at its
                // first use (docs/multinode.md), and the baseline's ranks that share a GPU need one host each
                // (open_nccl_baseline); weft's column communicators work under that identity too.
                weft::bench::NcclBaseline nccl_baseline =
                    weft::bench::open_nccl_baseline(w, pass.nccl && !pass.weft_only, "bench/tp/nccl_id");
                cudaStream_t s = nullptr, comm = nullptr;
                BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
                BENCH_CUDA(cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking));
                prepare_baseline_collectives(w, pass.coll);  // collective, once per World, before any timing
                std::vector<std::string> notes;
                if (spans && !pass.weft_only) {
                    notes.push_back(
                        "(b)decomp: skipped: its copy engines pull (AG) or push (RS) peers' symmetric buffers, which a "
                        "world across nodes cannot reach (symm_at is nullptr there)");
                }
                {
                    Lt lt;
                    for (const std::string& op : pass.ops) {
                        if (op == "ar" && spans) {
                            notes.push_back(
                                "ar: skipped: GemmAr needs every rank of its team load/store reachable "
                                "(it does not cross nodes)");
                            continue;
                        }
                        std::vector<Shape> shapes = pass.sizes.empty() ? default_shapes(op) : pass.sizes;
                        if (!pass.shape_idx.empty() && pass.sizes.empty()) {
                            std::vector<Shape> pick;
                            for (int i : pass.shape_idx) {
                                if (i >= 0 && i < static_cast<int>(shapes.size()))
                                    pick.push_back(shapes[static_cast<size_t>(i)]);
                            }
                            shapes = pick;
                        }
                        for (const Shape& sz : shapes) {
                            Row r = op == "ag"   ? bench_ag(w, sh, pass, sz, lt, s, comm, nccl_baseline.comm)
                                    : op == "rs" ? bench_rs(w, sh, pass, sz, lt, s, comm, nccl_baseline.comm)
                                                 : bench_ar(w, sh, pass, sz, lt, s, comm, nccl_baseline.comm);
                            if (w.rank() == 0) {
                                std::lock_guard<std::mutex> lock(rows_mutex);
                                rows.push_back(r);
                                std::printf("  %s %ldx%ldx%ld: (a) %s (coll %s, %s), nccl+gemm %s, weft %s\n",
                                            r.op.c_str(), r.shape.m, r.shape.n, r.shape.k, fmt(r.a).c_str(),
                                            fmt(r.coll).c_str(), r.coll_algo.c_str(), fmt(r.nccl).c_str(),
                                            fmt(r.weft).c_str());
                                std::fflush(stdout);
                            }
                        }
                    }
                }
                w.barrier();
                weft::bench::close_nccl_baseline(nccl_baseline);
                cudaStreamDestroy(comm);
                cudaStreamDestroy(s);
                if (w.rank() == 0) {
                    std::lock_guard<std::mutex> lock(rows_mutex);
                    info.world = w.num_ranks();
                    info.num_nodes = w.num_nodes();
                    info.virtual_nodes = w.virtual_nodes();
                    info.processes = !w.same_process();
                    info.shared = w.max_ranks_per_device() > 1;
                    info.nccl_note = nccl_baseline.note;
                    info.notes = notes;
                }
            };
            if (launched) {
                std::unique_ptr<World> w = World::from_env(wo);
                WEFT_CHECK(w->num_ranks() == world, "launched with " << w->num_ranks() << " ranks, expected " << world);
                body(*w);
            } else {
                weft::run_local(world, body, wo);
            }
        };
        const std::string trace_path = weft::bench::traced_pass_path(o.trace, "weft_bench_tp");
        std::vector<Row> rows;
        PassInfo info;
        if (o.trace.overhead) {
            weft::bench::set_trace_env("");
            run_pass(o, rows, info);
            if (printer) std::printf("traced pass (the fused ops alone; trace: %s)\n", trace_path.c_str());
            weft::bench::set_trace_env(trace_path);
            Options traced_options = o;
            traced_options.weft_only = true;
            traced_options.check = false;
            std::vector<Row> traced;
            PassInfo traced_info;
            run_pass(traced_options, traced, traced_info);
            for (Row& r : rows) {
                for (const Row& t : traced) {
                    if (t.op == r.op && t.shape.m == r.shape.m && t.shape.n == r.shape.n && t.shape.k == r.shape.k) {
                        r.weft_traced = t.weft;
                        r.trace_events_per_call = t.trace_events_per_call;
                    }
                }
            }
        } else {
            weft::bench::set_trace_env(trace_path);
            run_pass(o, rows, info);
        }
        if (printer) print_and_save(rows, o, info, gpus, prop.name, peaks);
        // --check: the fused op (and (b), NCCL's) within 1e-2 of (a), cuBLAS then weft's collective, on every rank.
        int failed = 0;
        for (const Row& r : rows) {
            for (const auto& [err, what] :
                 {std::pair{r.err_weft, "weft"}, std::pair{r.err_b, "(b)"}, std::pair{r.err_nccl, "nccl"}}) {
                if (err < 0 || err <= 1e-2) continue;
                if (printer) {
                    std::printf("FAIL: %s %lldx%lldx%lld: %s differs from (a): relative error %.2e\n", r.op.c_str(),
                                static_cast<long long>(r.shape.m), static_cast<long long>(r.shape.n),
                                static_cast<long long>(r.shape.k), what, err);
                }
                ++failed;
            }
        }
        return failed > 0 ? 1 : 0;
    });
}
