// SPDX-License-Identifier: MIT
// weft::ops::AgGemm: AllGather (copy engines) + persistent GEMM that waits per tile on the chunks it needs.
#include "weft/ops/ag_gemm.hpp"

#include <algorithm>
#include <mutex>
#include <sstream>

#include "tp_common.hpp"
#include "weft/jit/aot.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/common/tile_map.hpp"
#include "weft/common/tp_params.hpp"
#include "weft/common/tp_schedule.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/stream.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {

namespace {
constexpr const char* kOp = "ag_gemm";
constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;
}  // namespace

void validate_ag_gemm_shape(const AgGemmShape& s, int num_ranks, const AgGemmOptions& o) {
    WEFT_CHECK(num_ranks >= 1, "ag_gemm: num_ranks must be >= 1, got " << num_ranks);
    WEFT_CHECK(s.max_m > 0 && s.max_m % num_ranks == 0,
               "ag_gemm: shape.max_m must be a positive multiple of num_ranks " << num_ranks << ", got " << s.max_m);
    WEFT_CHECK(s.max_m <= kMaxDim, "ag_gemm: shape.max_m must fit in 31 bits, got " << s.max_m);
    WEFT_CHECK(s.n > 0 && s.n <= kMaxDim, "ag_gemm: shape.n must be in [1, 2^31), got " << s.n);
    WEFT_CHECK(s.k >= 8 && s.k % 8 == 0 && s.k <= kMaxDim,
               "ag_gemm: shape.k must be a positive multiple of 8, got " << s.k);
    WEFT_CHECK(s.dtype == DType::kBF16 || s.dtype == DType::kF16,
               "ag_gemm: shape.dtype must be bf16 or f16, got " << dtype_name(s.dtype));
    WEFT_CHECK(o.chunk_rows >= 0, "ag_gemm: options.chunk_rows must be >= 0 (0 = heuristic), got " << o.chunk_rows);
    WEFT_CHECK(o.copy_streams >= 0 && o.copy_streams <= std::max(1, num_ranks - 1),
               "ag_gemm: options.copy_streams must be in [0, " << std::max(1, num_ranks - 1) << "], got "
                                                               << o.copy_streams);
    WEFT_CHECK(o.sm_budget >= 0, "ag_gemm: options.sm_budget must be >= 0 (0 = the world's), got " << o.sm_budget);
    if (o.config) tp_detail::check_forced_config(*o.config, s.dtype, s.dtype, kOp);
}

int64_t validate_ag_gemm_call(const AgGemmShape& s, int num_ranks, const TensorView& a_local, const TensorView& b,
                              const TensorView& c) {
    WEFT_CHECK(a_local.ndim == 2, "ag_gemm: a_local must be a 2-D [M/W, K] matrix, got " << a_local.describe());
    WEFT_CHECK(b.ndim == 2, "ag_gemm: b must be a 2-D [N, K] matrix, got " << b.describe());
    WEFT_CHECK(c.ndim == 2, "ag_gemm: c must be a 2-D [M, N] matrix, got " << c.describe());
    const int64_t rows = a_local.dim(0);
    const int64_t m = rows * num_ranks;
    WEFT_CHECK(rows >= 1 && m <= s.max_m, "ag_gemm: a_local must have 1 .. max_m/W = " << s.max_m / num_ranks
                                                                                    << " rows, got " << a_local.describe());
    WEFT_CHECK(a_local.dim(1) == s.k, "ag_gemm: a_local must have K = " << s.k << " columns, got " << a_local.describe());
    WEFT_CHECK(a_local.dtype == s.dtype && b.dtype == s.dtype && c.dtype == s.dtype,
               "ag_gemm: a_local, b and c must be " << dtype_name(s.dtype) << ", got " << dtype_name(a_local.dtype)
                                                    << ", " << dtype_name(b.dtype) << ", " << dtype_name(c.dtype));
    WEFT_CHECK(b.dim(0) == s.n && b.dim(1) == s.k,
               "ag_gemm: b must be [N, K] = [" << s.n << ", " << s.k << "], got " << b.describe());
    WEFT_CHECK(c.dim(0) == m && c.dim(1) == s.n, "ag_gemm: c must be [M, N] = [" << m << ", " << s.n
                                                                               << "] (M = W * a_local rows), got "
                                                                               << c.describe());
    try {
        // a_local against the TMA rules too (a world of one rank reads it with TMA), with c's first rows.
        TensorView c_rows = c;
        c_rows.shape[0] = rows;
        validate_gemm_args(a_local, b, c_rows, BLayout::kNK);
    } catch (const Error& e) {
        tp_detail::rethrow_with_op(kOp, e);
    }
    return m;
}

int64_t ag_gemm_default_chunk_rows(int64_t rows_per_rank, int64_t k, int elem_bytes) {
    // One copy per peer unless a shard is large; then ~8 MiB copies (the copy engine's per-copy overhead
    // stays a few percent) whose rows are a multiple of 128 (whole GEMM tiles).
    constexpr int64_t kTargetBytes = int64_t{8} << 20;
    const int64_t shard_bytes = rows_per_rank * k * elem_bytes;
    if (shard_bytes <= 2 * kTargetBytes) return rows_per_rank;
    const int64_t chunks = (shard_bytes + kTargetBytes - 1) / kTargetBytes;
    return std::min(rows_per_rank, round_up((rows_per_rank + chunks - 1) / chunks, 128));
}

namespace detail {

jit::KernelSpec ag_gemm_kernel_spec(const GemmConfig& config, const std::string& arch) {
    return tp_detail::make_spec("ag_gemm/ag_gemm.cuh",
                                "weft::tp::ag_gemm_kernel<" + format_gemm_config(config) + ">",
                                "ag_gemm " + tp_detail::config_text(config), arch);
}

jit::KernelSpec ag_notify_kernel_spec(const std::string& arch) {
    return tp_detail::make_spec("ag_gemm/ag_gemm.cuh", "weft::tp::ag_notify_ready_kernel<0>", "ag_gemm notify", arch);
}

jit::KernelSpec plain_gemm_kernel_spec(const GemmConfig& config, const std::string& arch) {
    return gemm_kernel_spec(config, arch);  // weft::ops::gemm's own spec: one cache entry, one loaded kernel
}

}  // namespace detail

std::vector<jit::KernelSpec> tp_aot_specs() {
    std::vector<jit::KernelSpec> out;
    out.push_back(detail::ag_notify_kernel_spec());
    for (DType t : {DType::kBF16, DType::kF16}) {
        for (const GemmConfig& c : tp_detail::fused_candidates(t, t)) {
            out.push_back(detail::ag_gemm_kernel_spec(c));
            out.push_back(detail::gemm_rs_kernel_spec(c));
            out.push_back(detail::gemm_rs_kernel_spec(c, "", GemmRsMode::kPush));
            GemmConfig f32 = c;
            f32.out_dtype = DType::kF32;
            if (is_valid(f32)) out.push_back(detail::gemm_rs_kernel_spec(f32));
        }
        for (DType partial : {t, DType::kF32}) {
            out.push_back(detail::rs_reduce_kernel_spec(partial, t));
            out.push_back(detail::ar_reduce_kernel_spec(partial, t));
            // GemmAr's tiled GEMM (the plain kernel with a fused candidate): those that are not plain candidates
            // themselves (a ping-pong pair's tile without its cluster).
            const std::vector<GemmConfig> plain = gemm_candidate_configs(t, partial, BLayout::kNK);
            for (const GemmConfig& c : tp_detail::fused_candidates(t, partial)) {
                if (std::find(plain.begin(), plain.end(), c) == plain.end()) {
                    out.push_back(detail::plain_gemm_kernel_spec(c));
                }
            }
        }
    }
    return out;
}

void register_tp_aot_specs() {
    static std::once_flag once;
    std::call_once(once, [] {
        for (auto& spec : tp_aot_specs()) jit::register_aot_spec(std::move(spec));
    });
}

struct AgGemm::State {
    World* world = nullptr;
    AgGemmShape shape;
    AgGemmOptions options;
    int num_ranks = 1, rank = 0;
    int budget = 1;        // SMs of the persistent GEMM
    std::vector<GemmConfig> configs;           // [0]: the heuristic's (or the forced) config; the rest: tuning
    std::vector<const jit::Kernel*> kernels;   // the GEMM kernel of each config
    size_t active = 0;                         // the config calls use
    bool tuned = false;
    tp_detail::FirstCallSync first_calls;      // ranks sharing a GPU
    int64_t chunk_rows = 1;
    int32_t max_chunks_per_rank = 1;
    DeviceCtx ctx{};
    uint64_t pipeline_timeout_ns = 0;

    tp_detail::SymmetricAllocations heap;
    uint8_t* gathered = nullptr;
    uint64_t* chunk_signals = nullptr;  // [W * max_chunks_per_rank]
    uint64_t* ready = nullptr;          // [W]
    uint64_t* done = nullptr;           // [W]
    uint64_t* epoch = nullptr;
    uint64_t* tile_counter = nullptr;

    const jit::Kernel* notify_kernel = nullptr;

    tp_detail::StreamSet streams;
    std::vector<cudaStream_t> copy_streams;
    cudaEvent_t fork = nullptr;
    std::vector<cudaEvent_t> joins;

    explicit State(World& w) : world(&w), heap(w) {}
    ~State() { heap.free_all(); }
    int64_t elem_bytes() const { return dtype_bytes(shape.dtype); }
};

AgGemm::AgGemm(World& world, const AgGemmShape& shape, const AgGemmOptions& options)
    : s_(std::make_unique<State>(world)) {
    State& s = *s_;
    s.shape = shape;
    s.options = options;
    s.num_ranks = world.num_ranks();
    s.rank = world.rank();
    validate_ag_gemm_shape(shape, s.num_ranks, options);
    s.budget = options.sm_budget > 0 ? std::min(options.sm_budget, tp_detail::device_sm_count()) : world.sm_budget();
    // NOTE: ranks sharing a GPU keep one SM of their budget free of the persistent GEMM, for the helpers of
    // the copy path (the notify kernel; a driver that implements a same-device copy with a kernel).
    if (s.num_ranks > 1 && world.num_ranks_on_device() > 1 && options.sm_budget == 0) s.budget -= 1;
    WEFT_CHECK(s.budget >= 1, "ag_gemm: the SM budget must be >= 1, got " << s.budget);

    GemmProblem p;
    p.m = shape.max_m;
    p.n = shape.n;
    p.k = shape.k;
    p.in_dtype = p.out_dtype = shape.dtype;
    const GemmConfig first = tp_detail::choose_gemm_config(p, s.budget, options.config, kOp);
    s.configs = options.autotune ? tp_detail::tune_candidates(first, shape.dtype, shape.dtype)
                                 : std::vector<GemmConfig>{first};
    const int64_t max_rows = shape.max_m / s.num_ranks;
    s.chunk_rows = options.chunk_rows > 0 ? std::min(options.chunk_rows, max_rows)
                                          : ag_gemm_default_chunk_rows(max_rows, shape.k, dtype_bytes(shape.dtype));
    const AllGatherTileMap map{max_rows, s.num_ranks, s.chunk_rows, first.tile_m};
    WEFT_CHECK(map.is_valid(), "ag_gemm: " << map.invalid_reason());
    s.max_chunks_per_rank = map.chunks_per_rank();
    s.ctx = world.device_ctx();
    s.pipeline_timeout_ns = tp_detail::pipeline_timeout_ns(world);

    // Symmetric buffers (collective, same order on every rank).
    s.gathered = static_cast<uint8_t*>(s.heap.alloc(static_cast<uint64_t>(shape.max_m * shape.k * s.elem_bytes())));
    const int64_t num_signals = static_cast<int64_t>(s.num_ranks) * s.max_chunks_per_rank;
    uint64_t* words = s.heap.alloc_signals(static_cast<uint64_t>(num_signals + 2 * s.num_ranks + 2));
    s.chunk_signals = words;
    s.ready = words + num_signals;
    s.done = s.ready + s.num_ranks;
    s.epoch = s.done + s.num_ranks;
    s.tile_counter = s.epoch + 1;
    tp_detail::check_peers_reachable(world, s.gathered, kOp);

    // Streams: the copy streams pull the peers' shards; fork/join events tie them to the caller's stream.
    // Ranks sharing a GPU use one: their streams must stay within the process's hardware queues
    // (module_loading.hpp, ensure_device_connections), and one HBM gains nothing from more.
    const int num_copy =
        s.num_ranks == 1 || world.num_ranks_on_device() > 1 ? 1 : std::max(1, options.copy_streams);
    for (int i = 0; i < num_copy; ++i) {
        s.copy_streams.push_back(s.streams.add_stream());
        s.joins.push_back(s.streams.add_event());
    }
    s.fork = s.streams.add_event();

    // Every kernel a call launches is loaded now (lazy loading behind a waiting kernel can deadlock).
    for (const GemmConfig& c : s.configs) {
        s.kernels.push_back(&jit::compiler().get_kernel(s.num_ranks == 1 ? detail::plain_gemm_kernel_spec(c)
                                                                         : detail::ag_gemm_kernel_spec(c)));
    }
    if (s.num_ranks > 1) s.notify_kernel = &jit::compiler().get_kernel(detail::ag_notify_kernel_spec());
    // As GemmRs: with ranks sharing a GPU a config's first call ends before anything more is launched (the same on
    // every rank: the barrier is collective). TpAgGemm's cases on one H200 timed out in tile_wait (a chunk never
    // signalled, its sender's kernels not in a wait) in 3 of ~9 runs without it.
    if (s.num_ranks > 1 && world.max_ranks_per_device() > 1) s.first_calls.arm(s.configs.size());
    WEFT_LOG_INFO("ag_gemm: " << tp_detail::config_text(first) << (options.autotune ? " (to be tuned)" : "")
                              << ", chunk_rows " << s.chunk_rows << " ("
                              << s.max_chunks_per_rank << " per rank at max_m), " << num_copy
                              << " copy stream(s), SM budget " << s.budget);
    world.barrier();
}

AgGemm::~AgGemm() = default;

const AgGemmShape& AgGemm::shape() const { return s_->shape; }
const GemmConfig& AgGemm::config() const { return s_->configs[s_->active]; }
int64_t AgGemm::chunk_rows() const { return s_->chunk_rows; }
int AgGemm::gemm_grid() const { return tp_detail::gemm_grid(config(), s_->shape.max_m, s_->shape.n, s_->budget); }

TensorView AgGemm::gathered(int64_t m) const {
    const State& s = *s_;
    WEFT_CHECK(m >= 1 && m <= s.shape.max_m && m % s.num_ranks == 0,
               "ag_gemm: gathered(m) needs a multiple of num_ranks in [1, max_m = " << s.shape.max_m << "], got " << m);
    return TensorView(s.gathered, s.shape.dtype, {m, s.shape.k});
}

TensorView AgGemm::local_shard(int64_t m) const {
    const State& s = *s_;
    (void)gathered(m);  // checks m
    const int64_t rows = m / s.num_ranks;
    return TensorView(s.gathered + s.rank * rows * s.shape.k * s.elem_bytes(), s.shape.dtype, {rows, s.shape.k});
}

namespace {

/// One peer chunk the copy streams pull into the gathered buffer, then signal.
struct AgCopy {
    int stream = 0;                  // index into State::copy_streams
    uint64_t* wait_ready = nullptr;  // the peer's ready flag to await first (its first chunk), or null
    void* dst = nullptr;
    const void* src = nullptr;
    size_t bytes = 0;
    uint64_t* signal = nullptr;
};

/// One call of one config, set up on the host (views, peer addresses, tensor maps, kernel parameters):
/// launching it only enqueues. The peers' GEMMs wait for this rank's ready flag and done-barrier: nothing that
/// can throw may sit between this rank's launches (the autotuner relies on this, TuneCandidate::prepare).
struct AgCall {
    size_t idx = 0;
    bool copy_local = false;  // a_local is not already local_shard(M): copy it there first
    void* slot = nullptr;
    const void* local_src = nullptr;
    size_t width_bytes = 0, src_pitch = 0;
    size_t rows = 0;
    tp_detail::PlainGemmLaunch plain{};  // a world of one rank
    AgNotifyParams notify{};
    std::vector<AgCopy> copies;
    detail::GemmTensorMaps maps{};
    GemmArgs args{};
    AgGemmParams sched{};
    AgGemmHookParams hook{};
    int grid = 1;
};

AgCall prepare_call(const AgGemm::State& s, size_t idx, int64_t m, const TensorView& slot, const TensorView& gathered,
                    const TensorView& a_local, const TensorView& b, const TensorView& c);
void launch_call(AgGemm::State& s, const AgCall& call, cudaStream_t stream);

}  // namespace

void AgGemm::run(const TensorView& a_local, const TensorView& b, const TensorView& c, cudaStream_t stream) {
    State& s = *s_;
    const int64_t m = validate_ag_gemm_call(s.shape, s.num_ranks, a_local, b, c);
    const TensorView slot = local_shard(m);
    const TensorView g = gathered(m);
    if (s.configs.size() > 1 && !s.tuned) {
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
        if (capture == cudaStreamCaptureStatusNone) {
            // As GemmRs: every candidate is set up on every rank before any of its runs is launched anywhere,
            // and with more than one rank its runs go in lockstep (each call ends in a cross-rank barrier).
            std::vector<AgCall> calls(s.configs.size());
            std::vector<jit::TuneCandidate> cands;
            for (size_t i = 0; i < s.configs.size(); ++i) {
                cands.emplace_back(
                    tp_detail::config_text(s.configs[i]),
                    [&s, &calls, i](cudaStream_t st) { launch_call(s, calls[i], st); },
                    [&, i] { calls[i] = prepare_call(s, i, m, slot, g, a_local, b, c); });
            }
            std::ostringstream problem;
            problem << "m=" << m << ",n=" << s.shape.n << ",k=" << s.shape.k << "," << dtype_name(s.shape.dtype)
                    << ",chunk_rows=" << s.chunk_rows << ",copy_streams=" << s.copy_streams.size()
                    << ",budget=" << s.budget;
            const auto comm = tp_detail::make_tune_comm(*s.world, s.world->heap().offset_of(s.epoch));
            jit::TuneOptions to;
            to.stream = stream;
            to.collective_runs = s.num_ranks > 1;
            jit::TuneKey key;
            key.op = kOp;
            key.problem = problem.str();
            const jit::TuneResult r = jit::autotuner().tune(key, cands, comm.get(), to);
            s.active = r.index;
            s.tuned = true;
            WEFT_LOG_INFO("ag_gemm: tuned " << problem.str() << " -> " << r.name);
        }
    }
    launch_call(s, prepare_call(s, s.active, m, slot, g, a_local, b, c), stream);
}

namespace {

AgCall prepare_call(const AgGemm::State& s, size_t idx, int64_t m, const TensorView& slot, const TensorView& g,
                    const TensorView& a_local, const TensorView& b, const TensorView& c) {
    AgCall call;
    call.idx = idx;
    const GemmConfig& config = s.configs[idx];
    const int64_t rows = m / s.num_ranks;
    const int64_t es = s.elem_bytes();
    const int64_t k = s.shape.k;
    WEFT_CHECK(a_local.data != slot.data || rows == 1 || a_local.stride(0) == k,
               "ag_gemm: a_local starts at local_shard(M) but has row stride " << a_local.stride(0) << " instead of K = "
                                                                               << k << " (it would be copied onto itself)");
    call.copy_local = a_local.data != slot.data;
    call.slot = slot.data;
    call.local_src = a_local.data;
    call.width_bytes = static_cast<size_t>(k * es);
    call.src_pitch = static_cast<size_t>(a_local.stride(0) * es);
    call.rows = static_cast<size_t>(rows);

    if (s.num_ranks == 1) {
        // The plain GEMM straight from a_local; the copy into gathered(M) runs beside it.
        call.plain = tp_detail::prepare_plain_gemm(config, a_local, b, c, s.budget, s.pipeline_timeout_ns);
        return call;
    }
    call.notify = AgNotifyParams{s.ctx, s.ready};
    // The copy streams: for each peer in rank-rotated order, wait for its ready flag, pull its chunks, raise
    // one signal per chunk (constant 1: reset by the GEMM's last tile, so nothing is frozen in a graph).
    const AllGatherTileMap map{rows, s.num_ranks, s.chunk_rows, config.tile_m};
    const int32_t cpr = map.chunks_per_rank();
    const int num_copy = static_cast<int>(s.copy_streams.size());
    for (int32_t i = cpr; i < map.num_signals(); ++i) {  // chunk_at(rank, i): own shard first, skipped
        const ChunkInfo ch = map.chunk_at(s.rank, i);
        const int step = i / cpr;  // 1 .. W-1: the peer's distance
        AgCopy copy;
        copy.stream = (step - 1) % num_copy;
        copy.wait_ready = ch.chunk == 0 ? s.ready + ch.rank : nullptr;
        uint8_t* dst = s.gathered + ch.row_begin * k * es;
        copy.dst = dst;
        copy.src = s.world->heap().symm_at(static_cast<const void*>(dst), ch.rank);
        WEFT_CHECK(copy.src != nullptr, "ag_gemm: rank " << ch.rank << "'s gathered buffer is not reachable");
        copy.bytes = static_cast<size_t>(ch.num_rows * k * es);
        copy.signal = s.chunk_signals + ch.signal_idx;
        call.copies.push_back(copy);
    }
    // The GEMM: local tiles first, then tiles in arrival order, each waiting on its chunks.
    call.maps = detail::make_gemm_tensor_maps(config, g, b, c);
    call.args = detail::make_gemm_args(g, c, s.pipeline_timeout_ns);
    const AgGemmOrder order(config, rows, s.num_ranks, s.chunk_rows, static_cast<int32_t>(s.shape.n), s.rank);
    call.sched = AgGemmParams{s.ctx, order, s.chunk_signals};
    AgGemmHookParams& hook = call.hook;
    hook.ctx = s.ctx;
    hook.tile_counter = s.tile_counter;
    hook.num_tiles = order.num_m_tiles * order.num_n_tiles;
    hook.num_signals = map.num_signals();
    hook.chunk_signals = s.chunk_signals;
    hook.ready = s.ready;
    hook.done = s.done;
    hook.epoch = s.epoch;
    call.grid = std::max(1, std::min(s.budget, order.num_cluster_tiles()));
    return call;
}

void launch_call(AgGemm::State& s, const AgCall& call, cudaStream_t stream) {
    const GemmConfig& config = s.configs[call.idx];
    const jit::Kernel& kernel = *s.kernels[call.idx];
    const auto copy_shard = [&](cudaStream_t on) {
        WEFT_CUDA_CHECK(cudaMemcpy2DAsync(call.slot, call.width_bytes, call.local_src, call.src_pitch, call.width_bytes,
                                          call.rows, cudaMemcpyDefault, on));
    };

    if (s.num_ranks == 1) {
        if (call.copy_local) {
            WEFT_CUDA_CHECK(cudaEventRecord(s.fork, stream));
            WEFT_CUDA_CHECK(cudaStreamWaitEvent(s.copy_streams[0], s.fork, 0));
            copy_shard(s.copy_streams[0]);
        }
        tp_detail::launch_plain_gemm(kernel, config, call.plain, stream);
        if (call.copy_local) {
            WEFT_CUDA_CHECK(cudaEventRecord(s.joins[0], s.copy_streams[0]));
            WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, s.joins[0], 0));
        }
        return;
    }

    // 0. Fork the copy streams first: they only need the previous call to be over (it is, in stream order),
    //    and then wait on the peers' ready flags while this rank copies its own shard.
    WEFT_CUDA_CHECK(cudaEventRecord(s.fork, stream));
    for (cudaStream_t cs : s.copy_streams) WEFT_CUDA_CHECK(cudaStreamWaitEvent(cs, s.fork, 0));
    // 1. This rank's shard into its slot of the gathered buffer, then ready[rank] = 1 on every peer.
    if (call.copy_local) copy_shard(stream);
    {
        jit::LaunchParams lp;
        lp.grid = dim3(1, 1, 1);
        lp.block = dim3(kTpNotifyThreads, 1, 1);
        lp.stream = stream;
        s.notify_kernel->launch(lp, call.notify);
    }
    // 2. Copy streams: the peers' chunks, each signalled once it landed.
    for (const AgCopy& copy : call.copies) {
        cudaStream_t cs = s.copy_streams[static_cast<size_t>(copy.stream)];
        if (copy.wait_ready != nullptr) stream_wait_u64_geq(cs, copy.wait_ready, 1);
        WEFT_CUDA_CHECK(cudaMemcpyAsync(copy.dst, copy.src, copy.bytes, cudaMemcpyDefault, cs));
        stream_write_u64(cs, copy.signal, 1);
    }
    // 3. The GEMM: local tiles first, then tiles in arrival order, each waiting on its chunks.
    detail::launch_gemm_kernel(kernel, config, call.maps, call.args, call.grid, call.sched, call.hook, stream);
    // 4. Join the copy streams (finished by now: the GEMM waited for every chunk).
    for (size_t i = 0; i < s.copy_streams.size(); ++i) {
        WEFT_CUDA_CHECK(cudaEventRecord(s.joins[i], s.copy_streams[i]));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, s.joins[i], 0));
    }
    s.first_calls.after_call(*s.world, call.idx, stream);
}

}  // namespace

}  // namespace weft::ops
