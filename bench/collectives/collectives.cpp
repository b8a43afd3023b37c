// SPDX-License-Identifier: MIT
// Benchmark of the collectives: latency and bus bandwidth per size and algorithm, beside NCCL (same run, when the
// ranks have a GPU each) and the copy roofline.
//
//   weft_bench_collectives [--ops all_reduce,all_gather,reduce_scatter,all_to_all] [--sizes 8,64,...|A:B[:F]] [--iters
//   N]
//                          [--warmup N] [--reps N] [--dtype bf16|f16|f32] [--world 2,4,8] [--algos LIST]
//                          [--graph-max BYTES] [--buffers symmetric|local] [--no-nccl] [--check] [--json FILE]
//                          [--trace PATH] [--trace-overhead]
//
// Sizes follow nccl-tests: all_reduce = bytes per rank, all_gather = bytes gathered (output), reduce_scatter =
// bytes scattered (input), all_to_all = bytes each rank sends (equal splits). Bus bandwidth: all_reduce
// 2 (n-1)/n x size / time, the others (n-1)/n x size / time. NCCL's all-to-all is ncclAlltoAll where the library
// has it, else grouped ncclSend/ncclRecv.
// Ranks are threads of this process over the visible GPUs (rank r on GPU r % GPUs). Each figure is the median,
// over --reps repetitions, of (time of --iters back-to-back calls) / iters, measured with CUDA events on every rank;
// the slowest rank counts. Sizes up to --graph-max are timed from a CUDA graph of --iters calls (no launch
// overhead), larger ones from eager launches. Exception: with ranks sharing a GPU, the copy-engine algorithms
// (ce_pull, ce_push, and auto when it picks one) are always timed eagerly: two ranks' graphs of many copy-engine
// calls can deadlock in the GPU's shared hardware queues (docs/runtime.md, "Hardware queues"). Inputs hold small
// random integers (never zeros; --check verifies).
//
// Streams: one per rank (created here), plus the World's; NCCL only runs with one GPU per rank, and the collectives
// add no side stream when ranks share a GPU, so 8 ranks on one GPU stay well within CUDA's 32 hardware queues.
//
// Roofline: with one GPU per rank, the bus bandwidth of one copy-engine copy from rank 0's GPU to rank 1's (the
// link a ring-like algorithm streams over). With ranks sharing a GPU, every byte a collective moves between ranks
// is a device-to-device copy in the one HBM, shared by all n ranks: roofline bus bandwidth = measured
// cudaMemcpy D2D rate (bytes copied per second) / n. The roofline time is the bus bytes over that bandwidth.
//
// NCCL is loaded at run time (dlopen, bench/common/nccl.hpp): the process's libnccl, the one weft's network backends
// use (WEFT_NCCL_LIBRARY alone when set, else libnccl.so.2 on the loader's path or in the toolkit, else python3's
// nvidia.nccl package). NCCL refuses two ranks on one GPU, so it runs only when every rank has its own GPU, or when the
// ranks are processes over virtual nodes (every rank a host of its own to NCCL, docs/multinode.md); "NCCL: n/a (ranks
// share a GPU)" otherwise. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless set).
//
// Tracing (docs/profiling.md): with --trace PATH or WEFT_TRACE every weft kernel records the intra-kernel trace; each
// figure starts with an empty buffer and the file holds the last one measured. --trace-overhead runs every world
// twice, untraced then traced, and each cell shows "untraced/traced +overhead%" (JSON: us and us_traced, with the
// events recorded per call).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/json.hpp"
#include "common/nccl.hpp"
#include "common/peaks.hpp"
#include "common/ranks.hpp"
#include "common/report.hpp"
#include "common/timing.hpp"
#include "common/tracing.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/runtime/launch_env.hpp"
#include "weft/weft.hpp"

namespace weft::bench {
namespace {

// ------------------------------------------------------------------------------------------------
// Command line.

enum class Op { kAllReduce, kAllGather, kReduceScatter, kAllToAll };
const char* op_name(Op op) {
    return op == Op::kAllReduce       ? "all_reduce"
           : op == Op::kAllGather     ? "all_gather"
           : op == Op::kReduceScatter ? "reduce_scatter"
                                      : "all_to_all";
}

struct Options {
    std::vector<Op> ops = {Op::kAllReduce, Op::kAllGather, Op::kReduceScatter, Op::kAllToAll};
    std::vector<uint64_t> sizes;
    int iters = 20;
    int warmup = 5;
    int reps = 7;
    DType dtype = DType::kBF16;
    std::vector<int> worlds = {2, 4, 8};
    std::vector<std::string> algos;  // empty: every algorithm of each op
    uint64_t graph_max = 1ull << 20;
    bool symmetric = true;
    bool nccl = true;
    bool check = false;
    std::string json;
    int virtual_nodes = 0;  // 0: WEFT_VIRTUAL_NODES, else one node per host
    TraceOptions trace;
};

Options parse_options(int argc, char** argv) {
    Options o;
    o.sizes = parse_byte_sizes("8,64,512,4K,16K,64K,256K,1M,4M,16M,64M,256M", "--sizes");
    Cli cli("weft_bench_collectives",
            "all-reduce, all-gather, reduce-scatter, all-to-all: latency and bus bandwidth vs NCCL");
    cli.option("--ops", "LIST", "all_reduce,all_gather,reduce_scatter,all_to_all (default all four)",
               [&](const std::string& v) {
                   o.ops.clear();
                   for (const std::string& p :
                        parse_choice_list(v, "--ops", {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"})) {
                       o.ops.push_back(p == "all_reduce"       ? Op::kAllReduce
                                       : p == "all_gather"     ? Op::kAllGather
                                       : p == "reduce_scatter" ? Op::kReduceScatter
                                                               : Op::kAllToAll);
                   }
               });
    cli.sizes("8,64,...|A:B[:F]", "bytes as nccl-tests count them (default 8 .. 256M)",
              [&](const std::string& v) { o.sizes = parse_byte_sizes(v, "--sizes"); });
    cli.iters(&o.iters).warmup(&o.warmup);
    cli.int_option("--reps", "repetitions of --iters calls; the median counts", &o.reps, 1, 1 << 20);
    cli.dtype(&o.dtype, {DType::kBF16, DType::kF16, DType::kF32}).world(&o.worlds, 2, 64);
    cli.option("--algos", "LIST", "algorithms to run (default every one of each op)", [&](const std::string& v) {
        o.algos = parse_choice_list(
            v, "--algos", {"auto", "ll", "one_shot", "two_shot", "sm_push", "ce_pull", "ce_push", "sm_pull", "pull"});
    });
    cli.option("--graph-max", "BYTES", "sizes up to this are timed from a CUDA graph (default 1M)",
               [&](const std::string& v) { o.graph_max = parse_bytes(v, "--graph-max"); });
    cli.option("--buffers", "symmetric|local", "where inputs and outputs live (default symmetric)",
               [&](const std::string& v) {
                   o.symmetric = parse_choice(v, "--buffers", {"symmetric", "local"}) == "symmetric";
               });
    bool no_nccl = false;
    cli.flag("--no-nccl", "skip NCCL", &no_nccl);
    cli.int_option("--virtual-nodes", "split the ranks into K virtual nodes (docs/multinode.md; default "
                   "WEFT_VIRTUAL_NODES): weft runs its hierarchical collectives, NCCL its flat ones",
                   &o.virtual_nodes, 0, 1 << 16);
    cli.check(&o.check).json(&o.json);
    add_trace_options(cli, &o.trace);
    cli.parse(argc, argv);
    o.nccl = !no_nccl;
    return o;
}

// ------------------------------------------------------------------------------------------------
// Data: small integers in [-8, 8], a block repeated over the buffers (never zeros; exact sums for --check).

int32_t pattern_value(int rank, uint64_t i) {
    uint64_t x = (static_cast<uint64_t>(rank) << 40) ^ (i * 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 31)) * 0xbf58476d1ce4e5b9ull;
    return static_cast<int32_t>((x ^ (x >> 29)) % 17) - 8;
}

uint32_t int_bits(int32_t v, DType t) {
    const float f = static_cast<float>(v);
    uint32_t b = 0;
    std::memcpy(&b, &f, 4);
    if (t == DType::kF32) return b;
    if (t == DType::kBF16) return b >> 16;
    if (v == 0) return 0;
    const uint32_t sign = v < 0 ? 0x8000u : 0u;
    const uint32_t a = static_cast<uint32_t>(v < 0 ? -v : v);
    int e = 0;
    while ((a >> (e + 1)) != 0) ++e;
    return sign | (static_cast<uint32_t>(e + 15) << 10) | ((a << (10 - e)) & 0x3ffu);
}

constexpr uint64_t kPatternElems = 1 << 20;  // the repeated block

void fill_pattern(void* dst, uint64_t bytes, DType t, int rank, cudaStream_t s) {
    const int es = dtype_bytes(t);
    std::vector<uint8_t> block(kPatternElems * static_cast<uint64_t>(es));
    for (uint64_t i = 0; i < kPatternElems; ++i) {
        const uint32_t b = int_bits(pattern_value(rank, i), t);
        std::memcpy(block.data() + i * static_cast<uint64_t>(es), &b, static_cast<size_t>(es));
    }
    for (uint64_t at = 0; at < bytes; at += block.size()) {
        WEFT_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(dst) + at, block.data(),
                                        std::min<uint64_t>(block.size(), bytes - at), cudaMemcpyHostToDevice, s));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    }
}

// ------------------------------------------------------------------------------------------------
// Measurement.

struct Row {
    Op op;
    uint64_t size;
    int world;
    bool shared_gpu;
    std::string algo;    // weft algorithm name, or "nccl"
    std::string chosen;  // for "auto": what it picked
    double us = 0;       // median time per call, slowest rank
    double busbw = 0;    // GB/s
    bool graph = false;
    int check = -1;  // -1 not checked, 0 wrong, 1 right
    // Traced figures: the traced time (--trace-overhead: beside `us`, the untraced one) and the events per call.
    double us_traced = 0;
    double trace_events_per_call = 0;
};

double bus_factor(Op op, int n) {
    const double f = static_cast<double>(n - 1) / n;
    return op == Op::kAllReduce ? 2 * f : f;
}

// The bytes a call of nominal `size` moves (as nccl-tests counts them): all_reduce the whole elements of `size`; the
// others n equal shards of whole elements (at world sizes that do not divide `size`, less than `size`).
double moved_bytes(Op op, uint64_t size, int n, int es) {
    const uint64_t elems = size / static_cast<uint64_t>(es);
    const uint64_t whole = op == Op::kAllReduce ? elems : elems / static_cast<uint64_t>(n) * static_cast<uint64_t>(n);
    return static_cast<double>(whole * static_cast<uint64_t>(es));
}

// Times `call(k)` (k = the iteration, for buffer rotation): median over reps of (events around iters calls) / iters,
// in microseconds; from a captured graph when *graph (which is cleared if capturing fails: then eager launches).
/// `*calls` counts the calls made (the warm-up's included).
double time_calls(cudaStream_t s, const Options& o, bool* graph, const std::function<void(int)>& call, int* calls) {
    EventPair ev;
    const auto timed = [&](const std::function<void()>& body) {
        ev.start(s);
        body();
        return 1000.0 * ev.stop_ms(s) / o.iters;
    };
    std::vector<double> per_call;
    cudaGraphExec_t exec = nullptr;
    if (*graph) {
        cudaGraph_t g = nullptr;
        try {
            WEFT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            for (int k = 0; k < o.iters; ++k) call(k);
            WEFT_CUDA_CHECK(cudaStreamEndCapture(s, &g));
            WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
        } catch (const std::exception& e) {
            cudaGraph_t partial = nullptr;
            cudaStreamEndCapture(s, &partial);  // leave capture mode whatever state it is in
            if (partial != nullptr) cudaGraphDestroy(partial);
            (void)cudaGetLastError();
            std::fprintf(stderr, "note: capturing a graph failed (%s); timing eager launches instead\n", e.what());
            exec = nullptr;
            *graph = false;
        }
        if (g != nullptr) cudaGraphDestroy(g);
    }
    if (exec != nullptr) {
        const int warm = std::max(1, o.warmup / o.iters + 1);
        for (int k = 0; k < warm; ++k) WEFT_CUDA_CHECK(cudaGraphLaunch(exec, s));
        for (int r = 0; r < o.reps; ++r) per_call.push_back(timed([&] { WEFT_CUDA_CHECK(cudaGraphLaunch(exec, s)); }));
        cudaGraphExecDestroy(exec);
        *calls = (warm + o.reps) * o.iters;
    } else {
        *calls = o.warmup + o.reps * o.iters;
        for (int k = 0; k < o.warmup; ++k) call(k);
        for (int r = 0; r < o.reps; ++r) {
            per_call.push_back(timed([&] {
                for (int k = 0; k < o.iters; ++k) call(k);
            }));
        }
    }
    return median(per_call);
}

std::vector<std::string> algos_of(Op op, const Options& o) {
    std::vector<std::string> all;
    if (op == Op::kAllReduce) all = {"auto", "ll", "one_shot", "two_shot"};
    if (op == Op::kAllGather) all = {"auto", "ll", "sm_push", "ce_pull", "ce_push"};
    if (op == Op::kReduceScatter) all = {"auto", "sm_pull", "ll"};
    if (op == Op::kAllToAll) all = {"pull"};
    if (o.algos.empty()) return all;
    std::vector<std::string> picked;
    for (const std::string& a : all) {
        if (std::find(o.algos.begin(), o.algos.end(), a) != o.algos.end()) picked.push_back(a);
    }
    return picked;
}

// Forcing an algorithm far outside its range only measures rounds of a latency kernel: skip those.
bool worth_running(Op op, const std::string& algo, uint64_t size, int n) {
    const uint64_t per_rank = op == Op::kAllReduce ? size : size / static_cast<uint64_t>(n);
    if (algo == "ll") return per_rank <= (1ull << 20);
    if (algo == "one_shot") return size <= (32ull << 20);
    return true;
}

struct WorldResult {
    int world = 0;
    bool printer = true;  // this process prints the results (rank 0 of a launched job; always with run_local)
    int num_nodes = 1;
    std::vector<Row> rows;
    double roofline_busbw = 0;
    std::string roofline_what;
    std::string nccl_note;
};

// `launched`: this process is one rank of a job (weftrun, torchrun, srun: World::from_env); else run_local's threads.
void run_world(int n, bool launched, const Options& o, WorldResult* result) {
    const uint64_t max_size = *std::max_element(o.sizes.begin(), o.sizes.end());
    const uint64_t pool = std::max<uint64_t>(max_size, 64ull << 20);
    WorldOptions wo;
    wo.heap_bytes =
        o.symmetric ? (2 * pool + (256ull << 20) + (2ull << 20) - 1) / (2ull << 20) * (2ull << 20) : (256ull << 20);
    wo.timeout = std::chrono::milliseconds(60000);
    wo.virtual_nodes = o.virtual_nodes;
    std::mutex mutex;
    SlowestRank gather(n);
    const std::function<void(World&)> body = [&](World& w) {
            // A world that spans (virtual) nodes: weft's collectives are the hierarchical ones (auto), beside NCCL's
            // flat collectives over the same ranks; no all-to-all across nodes.
            const bool spans = w.num_nodes() > 1;
            // The node team's workspace across nodes (none for a node of one rank).
            const Team& local = spans ? w.node_team() : w.team();
            const ops::CollectiveWorkspaceInfo* info =
                local.num_ranks() > 1 || !spans ? &ops::prepare_collectives(local) : nullptr;
            const bool shared = w.max_ranks_per_device() > 1;
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            uint8_t* in = nullptr;
            uint8_t* out = nullptr;
            if (o.symmetric) {
                in = static_cast<uint8_t*>(w.heap().alloc(pool));
                out = static_cast<uint8_t*>(w.heap().alloc(pool));
            } else {
                WEFT_CUDA_CHECK(cudaMalloc(&in, pool));
                WEFT_CUDA_CHECK(cudaMalloc(&out, pool));
            }
            fill_pattern(in, pool, o.dtype, w.rank(), s);
            WEFT_CUDA_CHECK(cudaMemsetAsync(out, 0, pool, s));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(s));

            // Roofline (rank 0 measures, everyone waits).
            double roof = 0;
            std::string roof_what;
            if (w.rank() == 0) {
                const uint64_t bytes = std::min<uint64_t>(pool, 256ull << 20);
                void* dst = nullptr;
                int dst_device = w.device();
                int devices = 0;
                WEFT_CUDA_CHECK(cudaGetDeviceCount(&devices));
                if (!shared && devices > 1) dst_device = (w.device() + 1) % devices;
                WEFT_CUDA_CHECK(cudaSetDevice(dst_device));
                WEFT_CUDA_CHECK(cudaMalloc(&dst, bytes));
                WEFT_CUDA_CHECK(cudaSetDevice(w.device()));
                const double gbps = copy_bytes_per_s(dst, in, bytes, s, o.warmup, std::max(3, o.reps)) / 1e9;
                cudaFree(dst);
                roof = shared ? gbps / n : gbps;
                std::ostringstream os;
                os << (shared ? "cudaMemcpy D2D on the shared GPU: " : "copy-engine copy GPU0 -> GPU1: ") << gbps
                   << " GB/s" << (shared ? " / " + std::to_string(n) + " ranks" : "");
                roof_what = os.str();
            }
            const double roofline = gather.max(w, roof);

            // NCCL (one GPU per rank, or processes over virtual nodes: bench/common/nccl.hpp).
            NcclBaseline nccl_baseline = open_nccl_baseline(w, o.nccl, "bench/nccl_id/" + std::to_string(n));
            ncclComm_t comm = nccl_baseline.comm;
            const std::string nccl_note = nccl_baseline.note;

            std::vector<Row> rows;
            const int es = dtype_bytes(o.dtype);
            for (Op op : o.ops) {
                if (spans && op == Op::kAllToAll) continue;
                for (uint64_t size : o.sizes) {
                    // Element counts: all_reduce `size` bytes per rank; all_gather / reduce_scatter `size` bytes in
                    // total.
                    const uint64_t total_elems = size / static_cast<uint64_t>(es);
                    // all_to_all: `shard` elements to each rank.
                    const uint64_t shard = op == Op::kAllReduce ? total_elems : total_elems / static_cast<uint64_t>(n);
                    if (shard == 0) continue;
                    const bool whole_in = op == Op::kReduceScatter || op == Op::kAllToAll;
                    const bool whole_out = op == Op::kAllGather || op == Op::kAllToAll;
                    const uint64_t in_bytes = whole_in ? shard * n * es : shard * es;
                    const uint64_t out_bytes = whole_out ? shard * n * es : shard * es;
                    const PoolRotation rotation(pool, std::max(in_bytes, out_bytes), 64);
                    // Across nodes: eager (the network backend is made on the first call, through the store).
                    const bool graph = size <= o.graph_max && !spans;
                    const auto views = [&](int k) {
                        const uint64_t off = rotation.offset(k);
                        const auto in_n = static_cast<int64_t>(in_bytes / es);
                        const auto out_n = static_cast<int64_t>(out_bytes / es);
                        return std::make_pair(TensorView(in + off, o.dtype, {in_n}),
                                              TensorView(out + off, o.dtype, {out_n}));
                    };
                    std::vector<std::pair<std::string, std::function<void(int)>>> variants;
                    for (const std::string& a : algos_of(op, o)) {
                        if (spans && a != "auto") continue;  // single-node algorithms need every peer reachable
                        if (!worth_running(op, a, size, n)) continue;
                        if (!o.symmetric && (a == "sm_push" || a == "ce_push")) continue;  // need a symmetric output
                        variants.emplace_back(a, [&, a](int k) {
                            const auto [vi, vo] = views(k);
                            if (op == Op::kAllReduce)
                                ops::all_reduce(w, vi, vo, s, {.algo = *ops::parse_all_reduce_algo(a)});
                            if (op == Op::kAllGather)
                                ops::all_gather(w, vi, vo, s, {.algo = *ops::parse_all_gather_algo(a)});
                            if (op == Op::kReduceScatter) {
                                ops::reduce_scatter(w, vi, vo, s, {.algo = *ops::parse_reduce_scatter_algo(a)});
                            }
                            if (op == Op::kAllToAll) ops::all_to_all(w, vi, vo, s);
                        });
                    }
                    const bool nccl_has_op = op != Op::kAllToAll || nccl().all_to_all != nullptr ||
                                             (nccl().send != nullptr && nccl().recv != nullptr &&
                                              nccl().group_start != nullptr && nccl().group_end != nullptr);
                    if (comm != nullptr && nccl_has_op) {
                        variants.emplace_back("nccl", [&](int k) {
                            const auto [vi, vo] = views(k);
                            if (op == Op::kAllReduce) {
                                BENCH_NCCL_CHECK(
                                    nccl().all_reduce(vi.data, vo.data, shard, nccl_type(o.dtype), ncclSum, comm, s));
                            } else if (op == Op::kAllGather) {
                                BENCH_NCCL_CHECK(
                                    nccl().all_gather(vi.data, vo.data, shard, nccl_type(o.dtype), comm, s));
                            } else if (op == Op::kAllToAll) {
                                if (nccl().all_to_all != nullptr) {
                                    BENCH_NCCL_CHECK(
                                        nccl().all_to_all(vi.data, vo.data, shard, nccl_type(o.dtype), comm, s));
                                } else {
                                    const uint64_t chunk = shard * static_cast<uint64_t>(es);
                                    BENCH_NCCL_CHECK(nccl().group_start());
                                    for (int q = 0; q < n; ++q) {
                                        BENCH_NCCL_CHECK(nccl().send(static_cast<const uint8_t*>(vi.data) + q * chunk,
                                                                     shard, nccl_type(o.dtype), q, comm, s));
                                        BENCH_NCCL_CHECK(nccl().recv(static_cast<uint8_t*>(vo.data) + q * chunk, shard,
                                                                     nccl_type(o.dtype), q, comm, s));
                                    }
                                    BENCH_NCCL_CHECK(nccl().group_end());
                                }
                            } else {
                                BENCH_NCCL_CHECK(nccl().reduce_scatter(vi.data, vo.data, shard, nccl_type(o.dtype),
                                                                       ncclSum, comm, s));
                            }
                        });
                    }
                    for (auto& [name, call] : variants) {
                        Row row{op, size, n, shared, name, "", 0, 0, graph, -1};
                        if (name == "auto" && spans) {
                            row.chosen = "hierarchical";
                        } else if (name == "auto") {
                            // What the op's kAuto runs: a WEFT_*_ALGO override first, as the op resolves it.
                            const ops::CollectiveTopology& t = info->topology;
                            const auto env = [](const char* var) -> std::optional<std::string> {
                                const char* v = std::getenv(var);
                                return v != nullptr ? std::optional<std::string>(v) : std::nullopt;
                            };
                            if (op == Op::kAllReduce) {
                                row.chosen = ops::algo_name(ops::resolve_all_reduce_algo(
                                    ops::AllReduceAlgo::kAuto, env("WEFT_ALLREDUCE_ALGO"), shard * es, t));
                            }
                            if (op == Op::kAllGather) {
                                row.chosen = ops::algo_name(ops::resolve_all_gather_algo(
                                    ops::AllGatherAlgo::kAuto, env("WEFT_ALLGATHER_ALGO"), shard * es, t, o.symmetric));
                            }
                            if (op == Op::kReduceScatter) {
                                row.chosen = ops::algo_name(ops::resolve_reduce_scatter_algo(
                                    ops::ReduceScatterAlgo::kAuto, env("WEFT_REDUCESCATTER_ALGO"), shard * es, t));
                            }
                        }
                        if (o.check) {
                            // One call on slot 0 (whose input is the pattern from element 0), verified on the host.
                            WEFT_CUDA_CHECK(cudaMemsetAsync(out, 0xFF, out_bytes, s));
                            call(0);
                            std::vector<uint8_t> h(out_bytes);
                            WEFT_CUDA_CHECK(cudaMemcpyAsync(h.data(), out, out_bytes, cudaMemcpyDeviceToHost, s));
                            w.sync_and_check(s);
                            bool ok = true;
                            for (uint64_t i = 0; i < out_bytes / es && ok; ++i) {
                                int32_t want = 0;
                                if (op == Op::kAllReduce) {
                                    for (int r = 0; r < n; ++r) want += pattern_value(r, i % kPatternElems);
                                } else if (op == Op::kAllGather) {
                                    want = pattern_value(static_cast<int>(i / shard), (i % shard) % kPatternElems);
                                } else if (op == Op::kAllToAll) {
                                    const uint64_t j = static_cast<uint64_t>(w.rank()) * shard + i % shard;
                                    want = pattern_value(static_cast<int>(i / shard), j % kPatternElems);
                                } else {
                                    const uint64_t j = static_cast<uint64_t>(w.rank()) * shard + i;
                                    for (int r = 0; r < n; ++r) want += pattern_value(r, j % kPatternElems);
                                }
                                uint32_t got = 0;
                                std::memcpy(&got, h.data() + i * es, static_cast<size_t>(es));
                                ok = got == int_bits(want, o.dtype);
                            }
                            row.check = gather.max(w, ok ? 0.0 : 1.0) == 0.0 ? 1 : 0;
                        }
                        WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
                        w.barrier();
                        // A capture that fails, fails alike on every rank (same calls): all fall back to eager
                        // launches. Copy engines with ranks sharing a GPU: eager (see the top of this file).
                        const std::string& algo = row.chosen.empty() ? name : row.chosen;
                        const bool copy_engines = op == Op::kAllGather && (algo == "ce_pull" || algo == "ce_push");
                        bool use_graph = graph && !(shared && copy_engines);
                        start_traced_measurement(w);
                        int calls = 0;
                        const double us = time_calls(s, o, &use_graph, call, &calls);
                        row.graph = use_graph;
                        row.us = gather.max(w, us);
                        if (tracing(w) && name != "nccl") {
                            w.sync_and_check(s);
                            const double events = static_cast<double>(traced_events(w));
                            row.trace_events_per_call = gather.max(w, events / std::max(1, calls));
                            row.us_traced = row.us;
                        }
                        row.busbw = moved_bytes(op, size, n, es) * bus_factor(op, n) / (row.us * 1e3);
                        rows.push_back(row);
                    }
                }
            }
            w.sync_and_check(s);
            w.barrier();
            close_nccl_baseline(nccl_baseline);
            if (o.symmetric) {
                w.heap().free(out);
                w.heap().free(in);
            } else {
                cudaFree(out);
                cudaFree(in);
            }
            cudaStreamDestroy(s);
            if (w.rank() == 0) {
                std::lock_guard<std::mutex> lock(mutex);
                result->rows = rows;
                result->roofline_busbw = roofline;
                result->roofline_what = roof_what;
                result->nccl_note = nccl_note;
                result->num_nodes = w.num_nodes();
            }
    };
    if (launched) {
        std::unique_ptr<World> w = World::from_env(wo);
        WEFT_CHECK(w->num_ranks() == n, "launched with " << w->num_ranks() << " ranks, expected " << n);
        body(*w);
        result->printer = w->rank() == 0;
    } else {
        run_local(n, body, wo);
    }
}

int run(int argc, char** argv) {
    const Options o = parse_options(argc, argv);
    prepare_cuda_environment();
    cudaDeviceProp prop{};
    WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    int devices = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&devices));
    std::printf(
        "weft collectives benchmark: %s x %d (%d SMs), %s, dtype %s, %s buffers, iters %d x reps %d "
        "(median), graphs up to %s%s\n",
        prop.name, devices, prop.multiProcessorCount, utc_date().c_str(), dtype_name(o.dtype),
        o.symmetric ? "symmetric" : "local", o.iters, o.reps, format_bytes(o.graph_max).c_str(),
        o.check ? ", checked" : "");
    const std::string trace_path = traced_pass_path(o.trace, "weft_bench_collectives");
    if (!trace_path.empty()) {
        std::printf("intra-kernel trace: %s%s\n", trace_path.c_str(),
                    o.trace.overhead ? " (each world untraced, then traced: untraced/traced +overhead%)" : "");
    }
    const int cell = o.trace.overhead ? 25 : 19;
    std::vector<WorldResult> results;
    bool all_ok = true;
    // Under a launcher every process is one rank of the launched world (--world is ignored).
    const std::optional<LaunchEnv> launch = detect_launch_env();
    std::vector<int> worlds = launch && launch->num_ranks > 1 ? std::vector<int>{launch->num_ranks} : o.worlds;
    for (int n : worlds) {
        WorldResult r;
        r.world = n;
        const bool launched = launch && launch->num_ranks > 1;
        if (o.trace.overhead) {
            set_trace_env("");
            run_world(n, launched, o, &r);
            set_trace_env(trace_path);
            WorldResult traced;
            traced.world = n;
            run_world(n, launched, o, &traced);
            for (Row& x : r.rows) {
                for (const Row& y : traced.rows) {
                    if (y.op == x.op && y.size == x.size && y.algo == x.algo) {
                        x.us_traced = y.us_traced;
                        x.trace_events_per_call = y.trace_events_per_call;
                    }
                }
            }
        } else {
            set_trace_env(trace_path);
            run_world(n, launched, o, &r);
        }
        if (!r.printer) continue;
        const bool shared = !r.rows.empty() && r.rows.front().shared_gpu;
        if (r.num_nodes > 1) std::printf("\n(%d virtual nodes: weft's auto = hierarchical)", r.num_nodes);
        std::printf("\n== world %d (%s) ==  roofline bus bandwidth %.1f GB/s (%s);  %s%s\n", n,
                    shared ? "ranks share a GPU" : "one GPU per rank", r.roofline_busbw, r.roofline_what.c_str(),
                    r.nccl_note.c_str(), shared ? ";  copy-engine algorithms timed eagerly (no graph)" : "");
        for (Op op : o.ops) {
            std::vector<std::string> names = algos_of(op, o);
            names.push_back("nccl");
            std::printf("\n%s: microseconds per call (bus GB/s); roofline = bus bytes / roofline bandwidth\n",
                        op_name(op));
            std::printf("%8s", "size");
            for (const std::string& a : names) std::printf(" %*s", cell, a.c_str());
            std::printf(" %19s %8s\n", "roofline", "best/nc");
            for (uint64_t size : o.sizes) {
                double best = 0, nccl_us = 0;
                bool any = false;
                std::printf("%8s", format_bytes(size).c_str());
                for (const std::string& a : names) {
                    const Row* row = nullptr;
                    for (const Row& x : r.rows) {
                        if (x.op == op && x.size == size && x.algo == a) row = &x;
                    }
                    if (row == nullptr) {
                        std::printf(" %*s", cell, "-");
                        continue;
                    }
                    char text[64];
                    if (o.trace.overhead && row->us_traced > 0) {
                        std::snprintf(text, sizeof(text), "%.2f/%.2f %+.1f%%%s%s", row->us, row->us_traced,
                                      100.0 * (row->us_traced / row->us - 1.0), row->check == 0 ? "!" : "",
                                      row->graph ? "g" : "");
                    } else {
                        std::snprintf(text, sizeof(text), "%.2f (%.1f)%s%s", row->us, row->busbw,
                                      row->check == 0 ? "!" : "", row->graph ? "g" : "");
                    }
                    std::printf(" %*s", cell, text);
                    all_ok = all_ok && row->check != 0;
                    any = true;
                    if (a == "nccl")
                        nccl_us = row->us;
                    else if (best == 0 || row->us < best)
                        best = row->us;
                }
                if (!any) {
                    std::printf("\n");
                    continue;
                }
                const double bus = moved_bytes(op, size, n, dtype_bytes(o.dtype)) * bus_factor(op, n);
                const double roof_us = r.roofline_busbw > 0 ? bus / (r.roofline_busbw * 1e3) : 0;
                char roof[64];
                std::snprintf(roof, sizeof(roof), "%.2f (%.1f)", roof_us, r.roofline_busbw);
                std::printf(" %19s", roof);
                if (nccl_us > 0)
                    std::printf(" %8.2f", nccl_us / best);
                else
                    std::printf(" %8s", "-");
                std::printf("\n");
            }
            for (const Row& x : r.rows) {
                if (x.op == op && x.algo == "auto" && !x.chosen.empty() && x.size == o.sizes.front()) {
                    std::printf("  (auto picks per size:");
                    for (const Row& y : r.rows) {
                        if (y.op == op && y.algo == "auto")
                            std::printf(" %s=%s", format_bytes(y.size).c_str(), y.chosen.c_str());
                    }
                    std::printf(")\n");
                }
            }
        }
        results.push_back(std::move(r));
    }
    std::printf(
        "\n'g': timed from a CUDA graph of %d calls; no 'g': eager launches (sizes above --graph-max, and the "
        "copy-engine algorithms whenever ranks share a GPU: graphs of many copy-engine calls of ranks sharing a GPU "
        "have "
        "hung in its shared hardware queues, docs/runtime.md); '!': wrong result (--check); best/nc: NCCL time / best "
        "weft time (> 1: weft faster)%s\n",
        o.iters,
        o.trace.overhead ? "; with --trace-overhead a weft cell is 'untraced/traced microseconds +overhead%' (NCCL: "
                           "untraced only)"
                         : "");
    if (!o.json.empty() && !results.empty()) {
        Json j;
        j.begin_object().field("bench", "collectives").field("device", prop.name).field("devices", devices);
        j.field("date", utc_date()).field("dtype", dtype_name(o.dtype));
        j.field("buffers", o.symmetric ? "symmetric" : "local").field("iters", o.iters).field("reps", o.reps);
        j.field("trace", trace_path).field("trace_overhead", o.trace.overhead);
        j.key("worlds").begin_array();
        for (size_t i = 0; i < results.size(); ++i) {
            const WorldResult& r = results[i];
            j.begin_object().field("world", r.world).field("roofline_busbw_gbps", r.roofline_busbw);
            j.field("roofline", r.roofline_what).field("nccl", r.nccl_note).key("rows").begin_array();
            for (const Row& x : r.rows) {
                j.begin_object(true).field("op", op_name(x.op)).field("algo", x.algo);
                if (!x.chosen.empty()) j.field("chosen", x.chosen);
                j.field("size_bytes", x.size).field("shared_gpu", x.shared_gpu).field("graph", x.graph);
                j.field("us", x.us).field("busbw_gbps", x.busbw);
                if (x.us_traced > 0) {
                    j.field("us_traced", x.us_traced).field("trace_events_per_call", x.trace_events_per_call);
                }
                if (x.check >= 0) j.field("correct", x.check != 0);
                j.end_object();
            }
            j.end_array().end_object();
        }
        j.end_array().end_object();
        write_json_file(o.json, j);
        std::printf("wrote %s\n", o.json.c_str());
    }
    return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace weft::bench

int main(int argc, char** argv) {
    return weft::bench::run_main("weft_bench_collectives", [&] { return weft::bench::run(argc, argv); });
}
