// SPDX-License-Identifier: MIT
// weft::ops::AgGemm: AllGather (copy engines) + persistent GEMM that waits per tile on the chunks it needs.
#include "weft/ops/ag_gemm.hpp"

#include <algorithm>
#include <sstream>

#include "collective_workspace.hpp"
#include "member_records.hpp"
#include "tp_common.hpp"
#include "views_overlap.hpp"
#include "weft/common/collectives.hpp"
#include "weft/common/gemm_hook_params.hpp"
#include "weft/common/math.hpp"
#include "weft/common/net_call_check.hpp"
#include "weft/common/tile_map.hpp"
#include "weft/common/tp_params.hpp"
#include "weft/common/tp_schedule.hpp"
#include "weft/net/ag_gemm_plan.hpp"
#include "weft/net/host_backend.hpp"
#include "weft/ops/tp_aot.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/stream.hpp"
#include "weft/runtime/trace.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {

namespace {
constexpr const char* kOp = "ag_gemm";
constexpr int64_t kMaxDim = kGemmMaxExtent;  // M, N and K of the GEMM
/// SMs a team that spans nodes keeps free of its persistent GEMM by default, for the comm stream's kernels.
constexpr int kNetworkSms = 8;
}  // namespace

void validate_ag_gemm_shape(const AgGemmShape& s, int num_ranks, const AgGemmOptions& o) {
    WEFT_CHECK(num_ranks >= 1, "ag_gemm: the team's num_ranks must be >= 1, got " << num_ranks);
    WEFT_CHECK(s.max_m > 0 && s.max_m % num_ranks == 0,
               "ag_gemm: shape.max_m must be a positive multiple of the team's num_ranks " << num_ranks << ", got "
                                                                                           << s.max_m);
    WEFT_CHECK(s.max_m <= kMaxDim, "ag_gemm: shape.max_m must be at most 2^31 - 2^24, got " << s.max_m);
    WEFT_CHECK(s.n > 0 && s.n <= kMaxDim, "ag_gemm: shape.n must be in [1, 2^31 - 2^24], got " << s.n);
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
    WEFT_CHECK(num_ranks >= 1 && rows >= 1 && rows <= s.max_m / num_ranks,
               "ag_gemm: a_local must have 1 .. max_m/W = " << s.max_m / std::max(num_ranks, 1) << " rows, got "
                                                            << a_local.describe());
    const int64_t m = rows * num_ranks;
    WEFT_CHECK(a_local.dim(1) == s.k,
               "ag_gemm: a_local must have K = " << s.k << " columns, got " << a_local.describe());
    WEFT_CHECK(a_local.dtype == s.dtype && b.dtype == s.dtype && c.dtype == s.dtype,
               "ag_gemm: a_local, b and c must be " << dtype_name(s.dtype) << ", got " << dtype_name(a_local.dtype)
                                                    << ", " << dtype_name(b.dtype) << ", " << dtype_name(c.dtype));
    WEFT_CHECK(b.dim(0) == s.n && b.dim(1) == s.k,
               "ag_gemm: b must be [N, K] = [" << s.n << ", " << s.k << "], got " << b.describe());
    WEFT_CHECK(c.dim(0) == m && c.dim(1) == s.n, "ag_gemm: c must be [M, N] = [" << m << ", " << s.n
                                                                               << "] (M = W * a_local rows), got "
                                                                               << c.describe());
    try {
        // a_local against the TMA rules too (a team of one rank reads it with TMA), with c's first rows; then all of
        // c, which the GEMM of a larger team writes from the gathered buffer ([M, k], row stride k).
        TensorView c_rows = c;
        c_rows.shape[0] = rows;
        validate_gemm_args(a_local, b, c_rows, BLayout::kNK);
        if (m > rows) validate_gemm_args(TensorView(a_local.data, s.dtype, {m, s.k}, {s.k, 1}), b, c, BLayout::kNK);
    } catch (const Error& e) {
        detail::rethrow_with_op(kOp, e);
    }
    detail::check_apart(kOp, "c", c, {{"a_local", a_local}, {"b", b}},
                        "c is written while the GEMM and the copies still read them");
    return m;
}

int64_t ag_gemm_default_chunk_rows(int64_t rows_per_rank, int64_t k, int elem_bytes) {
    // One copy per peer unless a shard is large; then ~8 MiB copies (the copy engine's per-copy overhead
    // stays a few percent) whose rows are a multiple of 128 (whole GEMM tiles).
    constexpr int64_t kTargetBytes = int64_t{8} << 20;
    const int64_t shard_bytes = rows_per_rank * k * elem_bytes;
    if (shard_bytes <= 2 * kTargetBytes) return rows_per_rank;
    const int64_t chunks = ceil_div(shard_bytes, kTargetBytes);
    return std::min(rows_per_rank, round_up(ceil_div(rows_per_rank, chunks), 128));
}

namespace detail {

FusedGemmSpec ag_gemm_fused_spec() {
    FusedGemmSpec spec;
    spec.header = "ag_gemm/ag_gemm.cuh";
    spec.scheduler = "weft::kernels::ag_gemm::AgGemmScheduler";
    spec.hook = "weft::kernels::ag_gemm::AgGemmHook";
    // The GEMM, then the end of the call (ag_finish_call).
    spec.kernel_template = "weft::kernels::ag_gemm::ag_gemm_kernel<CFG>";
    spec.name = "ag_gemm";
    return spec;
}

jit::KernelSpec ag_gemm_kernel_spec(const GemmConfig& config, const std::string& arch) {
    return fused_gemm_kernel_spec(ag_gemm_fused_spec(), config, arch);
}

jit::KernelSpec ag_notify_kernel_spec(const std::string& arch) {
    return tp_detail::make_spec("ag_gemm/ag_gemm.cuh", "weft::kernels::ag_gemm::ag_notify_ready_kernel<0>",
                                "ag_gemm notify", arch);
}

jit::KernelSpec ag_relay_kernel_spec(const std::string& arch) {
    return tp_detail::make_spec("ag_gemm/ag_gemm.cuh", "weft::kernels::ag_gemm::ag_relay_notify_kernel<0>",
                                "ag_gemm relay notify", arch);
}

}  // namespace detail

struct AgGemm::State : tp_detail::FusedOpState {
    AgGemmShape shape;
    AgGemmOptions options;
    int64_t chunk_rows = 1;
    int32_t max_chunks_per_rank = 1;

    // The budget as the most shared GPU of the World plans it: the same on every rank, for what the ranks must agree
    // on when they tune (the candidates and the tuning key), where some GPUs host more ranks than others.
    int agreed_budget = 1;

    uint8_t* gathered = nullptr;
    uint64_t* chunk_signals = nullptr;  // [W * max_chunks_per_rank]
    uint64_t* ready = nullptr;          // [W]
    uint64_t* done = nullptr;           // [W]
    uint64_t* epoch = nullptr;
    uint64_t* tile_counter = nullptr;
    uint64_t* signatures = nullptr;  // [W] call descriptors, in ready's allocation (AgNotifyParams::signatures)

    const jit::Kernel* notify_kernel = nullptr;
    const jit::Kernel* pull_kernel = nullptr;  // ranks of one process sharing a GPU (tp_detail::pulls_with_kernel)

    std::vector<cudaStream_t> copy_streams;
    cudaEvent_t fork = nullptr;
    std::vector<cudaEvent_t> joins;

    // A team that spans nodes (docs/multinode.md, "AllGather+GEMM across nodes"); null / empty on one node.
    net::HostBackend* net = nullptr;
    net::AgInterNodePlan plan;
    uint64_t* relay_ready = nullptr;  // symmetric [W * max_chunks_per_rank]
    AgNodePeers node_peers{};         // num == 0 on one node
    const jit::Kernel* relay_kernel = nullptr;
    const jit::Kernel* check_kernel = nullptr;  // across nodes: the check of the column's call descriptors

    explicit State(const Team& t) : FusedOpState(t, kOp) {}
    int64_t elem_bytes() const { return dtype_bytes(shape.dtype); }
    /// gathered(m) and local_shard(m) for an m the call's validation accepted.
    TensorView gathered_view(int64_t m) const { return TensorView(gathered, shape.dtype, {m, shape.k}); }
    TensorView shard_view(int64_t m) const {
        const int64_t rows = m / num_ranks;
        return TensorView(gathered + rank * rows * shape.k * elem_bytes(), shape.dtype, {rows, shape.k});
    }
};

AgGemm::AgGemm(World& world, const AgGemmShape& shape, const AgGemmOptions& options)
    : AgGemm(world.team(), shape, options) {}

AgGemm::AgGemm(const Team& team, const AgGemmShape& shape, const AgGemmOptions& options)
    : s_(std::make_unique<State>(team)) {
    State& s = *s_;
    World& world = *s.world;
    s.shape = shape;
    s.options = options;
    const bool spans_nodes = s.num_ranks > 1 && team.num_nodes() > 1;
    // A member whose shape or options are invalid fails every member at once (its error is its record), instead of
    // leaving them waiting for it in the symmetric allocations. Across nodes the members must also cut the shards
    // alike: the network steps pair each shard's chunks with the column's, and a relay raises a node peer's word by
    // its own chunk numbering (on one node each member's cut is its own).
    GemmConfig first;
    std::vector<int64_t> mine;
    const std::vector<std::vector<uint8_t>> all =
        detail::exchange_member_records(team, "weft.ops.ag_gemm.shape", kOp, "shape or options are", [&] {
            validate_ag_gemm_shape(shape, s.num_ranks, options);
            WEFT_CHECK(!spans_nodes || !options.autotune, "ag_gemm: options.autotune on a team that spans nodes ("
                                                              << team.describe()
                                                              << ") is not supported yet; tune on one node and pass "
                                                              << "the winner as options.config");
            tp_detail::check_sm_budget_share(world, options.sm_budget, kOp);
            s.budget = tp_detail::resolve_sm_budget(options.sm_budget, world.sm_budget());
            // NOTE: ranks sharing a GPU keep one SM of their share free of the persistent GEMM, for the helpers of the
            // copy path (the notify and pull kernels; a driver that implements a same-device copy with a kernel): the
            // default budget is the share less one, and an explicit one is capped there (at the whole share, every
            // rank's GEMM could be resident before any rank's pull kernel, which they wait for). The budget and the
            // sharing are per device, whichever teams the ranks on it belong to.
            if (s.num_ranks > 1 && world.num_ranks_on_device() > 1)
                s.budget = tp_detail::cap_for_copy_helpers(world, s.budget, kOp);
            // NOTE: a team that spans nodes leaves kNetworkSms SMs of its default budget to NCCL's kernels and the
            // relay kernel on the comm stream: the persistent GEMM's CTAs fill their SMs (shared memory, registers),
            // and a tile waiting for a chunk that NCCL's kernel has yet to receive would otherwise wait for an SM that
            // never frees up. An explicit options.sm_budget is taken as is (it must leave SMs free the same way).
            if (spans_nodes && options.sm_budget == 0) s.budget = std::max(1, s.budget - kNetworkSms);
            WEFT_CHECK(s.budget >= 1, "ag_gemm: the SM budget must be >= 1, got " << s.budget);
            s.agreed_budget = tp_detail::resolve_sm_budget(options.sm_budget, world.shared_sm_budget());
            if (s.num_ranks > 1 && world.max_ranks_per_device() > 1) {
                s.agreed_budget = std::min(s.agreed_budget, world.shared_sm_budget() - 1);
            }
            if (spans_nodes && options.sm_budget == 0) s.agreed_budget = std::max(1, s.agreed_budget - kNetworkSms);
            s.agreed_budget = std::max(1, s.agreed_budget);

            GemmProblem p;
            p.m = shape.max_m;
            p.n = shape.n;
            p.k = shape.k;
            p.in_dtype = p.out_dtype = shape.dtype;
            // Tuned, every rank times the same candidates in the same order: the first from the agreed budget.
            first =
                tp_detail::choose_gemm_config(p, options.autotune ? s.agreed_budget : s.budget, options.config, kOp);
            const int64_t max_rows = shape.max_m / s.num_ranks;
            s.chunk_rows = options.chunk_rows > 0
                               ? std::min(options.chunk_rows, max_rows)
                               : ag_gemm_default_chunk_rows(max_rows, shape.k, dtype_bytes(shape.dtype));
            const AllGatherTileMap map{max_rows, s.num_ranks, s.chunk_rows, first.tile_m};
            WEFT_CHECK(map.is_valid(), "ag_gemm: " << map.invalid_reason());
            s.max_chunks_per_rank = map.chunks_per_rank();
            mine = {shape.max_m, shape.k, static_cast<int64_t>(shape.dtype), s.chunk_rows, s.max_chunks_per_rank};
            return detail::fields_record(mine);
        });
    const std::vector<GemmConfig> configs =
        options.autotune ? tp_detail::tune_candidates(first, shape.dtype, shape.dtype) : std::vector<GemmConfig>{first};

    // A team that spans nodes: the network backend of its columns (collective over the team: made before the
    // symmetric allocations, in the same order on every member) and where each shard comes from.
    if (spans_nodes) {
        static const char* const kFields[] = {"max_m", "k", "dtypes", "chunk rows (options.chunk_rows, resolved)",
                                              "chunks per shard"};
        detail::check_member_fields(team, all, mine, kFields, kOp, [](size_t f, int64_t v) -> std::string {
            return f == 2 ? std::string(dtype_name(static_cast<DType>(v))) : std::to_string(v);
        });
        s.net = &net::HostBackend::get(team);
        s.plan = net::plan_ag_internode(s.net->team_ranks_by_node(), s.rank);
        WEFT_CHECK(s.plan.per_node <= kAgMaxNodePeers, "ag_gemm: " << s.plan.per_node
                                                                   << " members per node on a team that spans nodes; "
                                                                   << "at most " << kAgMaxNodePeers);
        WEFT_CHECK(s.plan.num_nodes - 1 <= kNetCheckMaxCalls,
                   "ag_gemm: a team that spans " << s.plan.num_nodes << " nodes; at most " << kNetCheckMaxCalls + 1);
        s.node_peers.num = s.plan.per_node;
        for (int l = 0; l < s.plan.per_node; ++l) s.node_peers.rank[l] = s.plan.node_peers[static_cast<size_t>(l)];
    }

    // Symmetric buffers (collective over the team, same order on every member).
    s.gathered = static_cast<uint8_t*>(s.heap.alloc(static_cast<uint64_t>(shape.max_m * shape.k * s.elem_bytes())));
    const int64_t num_signals = static_cast<int64_t>(s.num_ranks) * s.max_chunks_per_rank;
    uint64_t* words = s.heap.alloc_signals(static_cast<uint64_t>(num_signals + 3 * s.num_ranks + 2));
    s.chunk_signals = words;
    s.ready = words + num_signals;
    s.done = s.ready + s.num_ranks;
    s.epoch = s.done + s.num_ranks;
    s.tile_counter = s.epoch + 1;
    s.signatures = s.tile_counter + 1;
    if (spans_nodes) {
        s.relay_ready = s.heap.alloc_signals(static_cast<uint64_t>(num_signals));
        // This node's members by load/store; the others through the network.
        for (int t : s.plan.node_peers) {
            WEFT_CHECK(world.heap().symm_at(s.gathered, team.world_rank(t)) != nullptr,
                       kOp << ": team rank " << s.rank << " cannot load/store the symmetric heap of team rank " << t
                           << " (world rank " << team.world_rank(t) << ") on its own node");
        }
    } else {
        tp_detail::check_peers_reachable(team, s.gathered, kOp);
    }

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
    // As GemmRs: with ranks sharing a GPU a config's first call ends before anything more is launched (the same on
    // every member: the team barrier is collective); without it a chunk could stay unsignalled, its sender's first
    // launch never started (kernels/ag_gemm/README.md, Pitfalls).
    s.load_gemms(configs, s.num_ranks == 1 ? plain_gemm_fused_spec() : detail::ag_gemm_fused_spec(),
                 s.num_ranks > 1 && world.max_ranks_per_device() > 1,
                 tp_detail::problem_text(shape.max_m, shape.n, shape.k, shape.dtype));
    if (s.num_ranks > 1) s.notify_kernel = &jit::compiler().get_kernel(detail::ag_notify_kernel_spec());
    if (spans_nodes && s.plan.per_node > 1) {
        s.relay_kernel = &jit::compiler().get_kernel(detail::ag_relay_kernel_spec());
    }
    if (spans_nodes) s.check_kernel = &jit::compiler().get_kernel(detail::net_check_calls_kernel_spec());
    if (s.num_ranks > 1 && tp_detail::pulls_with_kernel(world)) {
        s.pull_kernel = &jit::compiler().get_kernel(tp_detail::peer_pull_kernel_spec());
    }
    WEFT_LOG_INFO("ag_gemm: " << tp_detail::config_text(first) << (options.autotune ? " (to be tuned)" : "")
                              << ", chunk_rows " << s.chunk_rows << " (" << s.max_chunks_per_rank
                              << " per rank at max_m), " << num_copy << " copy stream(s), SM budget " << s.budget
                              << ", team of " << s.num_ranks
                              << (spans_nodes ? " across " + std::to_string(s.plan.num_nodes) +
                                                    " nodes (NCCL host API, " + std::to_string(s.plan.per_node) +
                                                    " member(s) per node)"
                                              : std::string()));
    team.barrier();
}

AgGemm::~AgGemm() = default;

const AgGemmShape& AgGemm::shape() const { return s_->shape; }
const GemmConfig& AgGemm::config() const { return s_->config(); }
int64_t AgGemm::chunk_rows() const { return s_->chunk_rows; }
int AgGemm::gemm_grid() const { return fused_gemm_grid(config(), s_->shape.max_m, s_->shape.n, s_->budget); }

TensorView AgGemm::gathered(int64_t m) const {
    const State& s = *s_;
    WEFT_CHECK(m >= 1 && m <= s.shape.max_m && m % s.num_ranks == 0,
               "ag_gemm: gathered(m) needs a multiple of the team's num_ranks "
                   << s.num_ranks << " in [1, max_m = " << s.shape.max_m << "], got " << m);
    return s.gathered_view(m);
}

TensorView AgGemm::local_shard(int64_t m) const {
    (void)gathered(m);  // checks m
    return s_->shard_view(m);
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
    int32_t chunk_idx = 0;  // the signal's index (the trace's "copy chunk")
    int32_t peer = 0;
};

/// A team that spans nodes: one network step of a call on the comm stream (net::AgNetStep for one chunk): send
/// this rank's chunk to node `to`, receive the chunk of slot `slot` from node `from` into its place, then raise its
/// chunk signal here and (with other members on this node) its relay word on them.
struct AgNetChunk {
    int32_t to = 0, from = 0;
    const void* send = nullptr;
    void* recv = nullptr;
    size_t bytes = 0;
    int32_t slot = 0;
    int32_t signal = 0;
};

/// One call of one config, set up on the host (views, peer addresses, tensor maps, kernel parameters):
/// launching it only enqueues. The peers' GEMMs wait for this rank's ready flag and done-barrier: nothing that
/// can throw may sit between this rank's launches (the autotuner relies on this, TuneCandidate::prepare).
struct AgCall {
    bool copy_local = false;  // a_local is not already local_shard(M): copy it there first
    void* slot = nullptr;
    const void* local_src = nullptr;
    size_t width_bytes = 0, src_pitch = 0;
    size_t rows = 0;
    AgNotifyParams notify{};
    std::vector<AgCopy> copies;       // by copy engines, or
    std::vector<PeerPullItem> pulls;  // by the pull kernel (State::pull_kernel): one of the two is empty
    FusedGemmCall gemm{};  // a team of one rank: the plain GEMM on a_local
    AgGemmParams sched{};
    AgGemmHookParams hook{};
    // A team that spans nodes: this call's descriptor (stored into signatures[rank] here, exchanged over the column
    // first) and the network steps, distance-major, chunk by chunk.
    uint64_t signature = 0;
    std::vector<AgNetChunk> net;
};

AgCall prepare_call(const AgGemm::State& s, size_t idx, int64_t m, const TensorView& a_local, const TensorView& b,
                    const TensorView& c);
void launch_call(AgGemm::State& s, size_t idx, const AgCall& call, cudaStream_t stream);

}  // namespace

void AgGemm::run(const TensorView& a_local, const TensorView& b, const TensorView& c, cudaStream_t stream) {
    WEFT_NVTX_RANGE("ag_gemm");
    State& s = *s_;
    const int64_t m = validate_ag_gemm_call(s.shape, s.num_ranks, a_local, b, c);
    s.refuse_after_abort();
    // Host memory or another GPU's would reach the copies and the tensor maps unchecked.
    detail::check_device_buffers(s.world->heap(), {{"a_local", a_local}, {"b", b}, {"c", c}}, kOp, stream);
    const auto problem = [&] {
        std::ostringstream os;
        os << "m=" << m << ",n=" << s.shape.n << ",k=" << s.shape.k << "," << dtype_name(s.shape.dtype)
           << ",chunk_rows=" << s.chunk_rows << ",copy_streams=" << s.options.copy_streams
           << ",shared=" << s.world->max_ranks_per_device()
           << ",budget=" << s.agreed_budget;  // facts every rank shares: the tuning key must agree
        return os.str();
    };
    s.run(
        stream, s.world->heap().offset_of(s.epoch), problem,
        [&](size_t idx) { return prepare_call(s, idx, m, a_local, b, c); },
        [&](const AgCall& call, size_t idx, cudaStream_t st) { launch_call(s, idx, call, st); });
}

namespace {

/// A team that spans nodes (net::AgInterNodePlan): the copies of this node's members' shards (as on one node) and of
/// the relayed chunks (each awaiting its relay word, from the holder's gathered buffer), in the plan's copy order;
/// the network steps (distance-major, chunk by chunk: the order in which the tile order needs them).
void prepare_internode(const AgGemm::State& s, const AllGatherTileMap& map, AgCall& call) {
    const int64_t es = s.elem_bytes();
    const int64_t k = s.shape.k;
    const int32_t cpr = map.chunks_per_rank();
    const int num_copy = static_cast<int>(s.copy_streams.size());
    for (size_t j = 0; j < s.plan.copy_order.size(); ++j) {
        const net::AgSlotSource& from = s.plan.slot(s.plan.copy_order[j]);
        for (int32_t c = 0; c < cpr; ++c) {
            const ChunkInfo ch = map.chunk(map.signal_index(from.slot, c));
            AgCopy copy;
            copy.stream = static_cast<int>(j % static_cast<size_t>(num_copy));
            copy.wait_ready = from.source == net::AgSource::kPeer ? (c == 0 ? s.ready + from.slot : nullptr)
                                                                  : s.relay_ready + ch.signal_idx;
            uint8_t* dst = s.gathered + ch.row_begin * k * es;
            copy.dst = dst;
            copy.src = s.world->heap().symm_at(static_cast<const void*>(dst), s.team.world_rank(from.holder));
            WEFT_CHECK(copy.src != nullptr, "ag_gemm: the gathered buffer of team rank "
                                                << from.holder << " (world rank " << s.team.world_rank(from.holder)
                                                << ", on this node) is not reachable");
            copy.bytes = static_cast<size_t>(ch.num_rows * k * es);
            copy.signal = s.chunk_signals + ch.signal_idx;
            copy.chunk_idx = ch.signal_idx;
            copy.peer = from.holder;
            if (s.pull_kernel != nullptr) {
                call.pulls.push_back(PeerPullItem{copy.wait_ready, copy.dst, copy.src, copy.signal, copy.bytes,
                                                  copy.peer, copy.chunk_idx});
            } else {
                call.copies.push_back(copy);
            }
        }
    }
    for (const net::AgNetStep& step : s.plan.net_steps) {
        for (int32_t c = 0; c < cpr; ++c) {
            const ChunkInfo mine = map.chunk(map.signal_index(s.rank, c));
            const ChunkInfo theirs = map.chunk(map.signal_index(step.from_slot, c));
            AgNetChunk x;
            x.to = step.to_node;
            x.from = step.from_node;
            x.send = s.gathered + mine.row_begin * k * es;
            x.recv = s.gathered + theirs.row_begin * k * es;
            x.bytes = static_cast<size_t>(theirs.num_rows * k * es);
            x.slot = step.from_slot;
            x.signal = theirs.signal_idx;
            call.net.push_back(x);
        }
    }
}

AgCall prepare_call(const AgGemm::State& s, size_t idx, int64_t m, const TensorView& a_local, const TensorView& b,
                    const TensorView& c) {
    AgCall call;
    const GemmConfig& config = s.gemms[idx].config();
    const TensorView slot = s.shard_view(m);
    const int64_t rows = m / s.num_ranks;
    const int64_t es = s.elem_bytes();
    const int64_t k = s.shape.k;
    WEFT_CHECK(a_local.data != slot.data || rows == 1 || a_local.stride(0) == k,
               "ag_gemm: a_local starts at local_shard(M) but has row stride "
                   << a_local.stride(0) << " instead of K = " << k << " (it would be copied onto itself)");
    call.copy_local = a_local.data != slot.data;
    // Elsewhere in the gathered buffer, a_local would be copied onto rows that the peers' shards fill at the same time.
    const TensorView gathered_all = s.gathered_view(s.shape.max_m);
    if (call.copy_local) {
        detail::check_apart(kOp, "a_local", a_local,
                            {{"the gathered buffer (unless it is local_shard(M))", gathered_all}},
                            "a_local is copied into local_shard(M) while the peers' shards arrive around it");
    }
    detail::check_apart(kOp, "c", c, {{"the gathered buffer", gathered_all}},
                        "the peers' shards arrive there while c is written");
    call.slot = slot.data;
    call.local_src = a_local.data;
    call.width_bytes = static_cast<size_t>(k * es);
    // One row: its own width (a one-row view may carry any row stride, even one below k).
    call.src_pitch = rows == 1 ? call.width_bytes : static_cast<size_t>(a_local.stride(0) * es);
    call.rows = static_cast<size_t>(rows);
    if (call.copy_local)
        tp_detail::check_row_copy(kOp, "a_local", call.width_bytes, call.src_pitch, call.width_bytes, call.rows);

    if (s.num_ranks == 1) {
        // The plain GEMM straight from a_local; the copy into gathered(M) runs beside it.
        call.gemm = detail::make_fused_gemm_call(config, a_local, b, c, fused_gemm_grid(config, m, s.shape.n, s.budget),
                                                 s.pipeline_timeout_ns);
        return call;
    }
    // What every rank's call must agree on: M (so every rank's shard sits where the peers copy it from), K and the
    // dtype (fixed by the op's shape, which the ranks may still have built differently). N is this rank's own (its
    // weight shard), and so is the chunking on one node (its copies); across nodes the constructor made the members
    // agree on it.
    const uint64_t signature =
        make_call_descriptor(CollectiveOp::kAgGemm, 0, true, s.shape.dtype, static_cast<uint64_t>(m),
                             call_descriptor_mix(0, static_cast<uint64_t>(s.shape.k)));
    call.notify = AgNotifyParams{s.ctx, s.ready, s.signatures, signature, s.node_peers};
    call.signature = signature;
    // The copy streams: for each peer in rank-rotated order, wait for its ready flag, pull its chunks, raise
    // one signal per chunk (constant 1: reset by the GEMM's last tile, so nothing is frozen in a graph).
    const AllGatherTileMap map{rows, s.num_ranks, s.chunk_rows, config.tile_m};
    const int32_t cpr = map.chunks_per_rank();
    const int num_copy = static_cast<int>(s.copy_streams.size());
    if (s.net != nullptr) prepare_internode(s, map, call);
    for (int32_t i = cpr; s.net == nullptr && i < map.num_signals(); ++i) {  // chunk_at(rank, i): own shard first
        const ChunkInfo ch = map.chunk_at(s.rank, i);
        const int step = i / cpr;  // 1 .. W-1: the peer's distance
        AgCopy copy;
        copy.stream = (step - 1) % num_copy;
        copy.wait_ready = ch.chunk == 0 ? s.ready + ch.rank : nullptr;
        uint8_t* dst = s.gathered + ch.row_begin * k * es;
        copy.dst = dst;
        // ch.rank is a team rank; the heap maps peers by world rank.
        copy.src = s.world->heap().symm_at(static_cast<const void*>(dst), s.team.world_rank(ch.rank));
        WEFT_CHECK(copy.src != nullptr, "ag_gemm: the gathered buffer of team rank " << ch.rank << " (world rank "
                                                                                     << s.team.world_rank(ch.rank)
                                                                                     << ") is not reachable");
        copy.bytes = static_cast<size_t>(ch.num_rows * k * es);
        copy.signal = s.chunk_signals + ch.signal_idx;
        copy.chunk_idx = ch.signal_idx;
        copy.peer = ch.rank;
        if (s.pull_kernel != nullptr) {
            call.pulls.push_back(PeerPullItem{copy.wait_ready, copy.dst, copy.src, copy.signal, copy.bytes, copy.peer,
                                              copy.chunk_idx});
        } else {
            call.copies.push_back(copy);
        }
    }
    // The GEMM: local tiles first, then tiles in arrival order, each waiting on its chunks. Across nodes: this
    // node's slots first (the plan's rotation slot), then the other nodes' in the order the network delivers them.
    AgGemmOrder order(config, rows, s.num_ranks, s.chunk_rows, static_cast<int32_t>(s.shape.n), s.rank);
    if (s.net != nullptr) order.rotation_start = order.rows().tile_at(s.plan.rotation_slot, 0);
    const int32_t ctas = std::max(1, std::min(s.budget, order.num_cluster_tiles()));
    const int64_t num_tiles = int64_t{order.num_m_tiles} * order.num_n_tiles;
    WEFT_CHECK(num_tiles < static_cast<int64_t>(kAgGaveUpMark) && ctas <= kAgMaxCtas,
               "ag_gemm: a call may have fewer than 2^23 tiles and at most "
                   << kAgMaxCtas << " CTAs, got " << num_tiles << " tiles (M " << m << ", N " << s.shape.n << ") on "
                   << ctas << " CTAs");
    call.gemm = detail::make_fused_gemm_call(config, s.gathered_view(m), b, c, ctas, s.pipeline_timeout_ns);
    call.sched = AgGemmParams{s.ctx, order, s.chunk_signals, s.signatures, signature, s.tile_counter};
    AgGemmHookParams& hook = call.hook;
    hook.ctx = s.ctx;
    hook.tile_counter = s.tile_counter;
    hook.num_tiles = static_cast<int32_t>(num_tiles);
    hook.num_signals = map.num_signals();
    hook.chunk_signals = s.chunk_signals;
    hook.ready = s.ready;
    hook.done = s.done;
    hook.epoch = s.epoch;
    hook.relay_ready = s.relay_ready;
    hook.peers = s.node_peers;
    return call;
}

/// A team that spans nodes, after the local copy: this call's descriptor into signatures[rank], the comm stream forked
/// (it sends this rank's slot), the descriptors exchanged over the column (one ring step per distance) and checked
/// (net_check_calls_kernel: calls that differ abort the World, which ends the chunk transfers behind it), then per
/// network step and chunk: the send/receive, the chunk's signal here (the GEMM's tiles wait for it as for a copied
/// chunk: constant 1, reset by the GEMM's end of call) and the relay words on this node's other members. Every
/// network step runs under the backend's watcher (a peer that never comes aborts the communicator and the World).
void launch_network(AgGemm::State& s, const AgCall& call, cudaStream_t stream) {
    net::HostBackend& net = *s.net;
    stream_write_u64(stream, s.signatures + s.rank, call.signature);
    for (const net::AgNetStep& step : s.plan.net_steps) stream_write_u64(stream, s.signatures + step.from_slot, 0);
    net.begin_call(stream);
    std::vector<tp_detail::NetCallCheck> checks;
    for (const net::AgNetStep& step : s.plan.net_steps) {
        net.send_recv(s.signatures + s.rank, sizeof(uint64_t), step.to_node, s.signatures + step.from_slot,
                      step.from_node);
        checks.push_back({step.from_slot, step.from_slot});
    }
    // Calls whose M differs across nodes send chunks of other sizes: a kCollectiveMismatch and an abort, which ends
    // them.
    tp_detail::launch_net_call_check(*s.check_kernel, s.ctx, s.signatures, call.signature, checks, net.comm_stream());
    for (const AgNetChunk& x : call.net) {
        net.send_recv(x.send, x.bytes, x.to, x.recv, x.from);
        stream_write_u64(net.comm_stream(), s.chunk_signals + x.signal, 1);
        if (s.relay_kernel != nullptr) {
            AgRelayParams p{};
            p.ctx = s.ctx;
            p.relay_ready = s.relay_ready;
            p.signatures = s.signatures;
            p.peers = s.node_peers;
            p.num_items = 1;
            p.slot[0] = x.slot;
            p.signal[0] = x.signal;
            jit::LaunchParams lp;
            lp.grid = dim3(1, 1, 1);
            lp.block = dim3(kTpNotifyThreads, 1, 1);
            lp.stream = net.comm_stream();
            s.relay_kernel->launch(lp, p);
        }
    }
}

void launch_call(AgGemm::State& s, size_t idx, const AgCall& call, cudaStream_t stream) {
    const FusedGemm& fused = s.gemms[idx];
    const auto copy_shard = [&](cudaStream_t on) {
        tp_detail::copy_rows_async(call.slot, call.width_bytes, call.local_src, call.src_pitch, call.width_bytes,
                                   call.rows, on);
    };

    if (s.num_ranks == 1) {
        if (call.copy_local) {
            WEFT_CUDA_CHECK(cudaEventRecord(s.fork, stream));
            WEFT_CUDA_CHECK(cudaStreamWaitEvent(s.copy_streams[0], s.fork, 0));
            copy_shard(s.copy_streams[0]);
        }
        fused.launch(call.gemm, weft::gemm::PersistentSchedulerParams{}, weft::gemm::NoEpilogueHookParams{}, stream);
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
    // 1b. A team that spans nodes: the network steps on the comm stream, forked here (after the local copy; after the
    //     notify, so that this node's members never wait on this host's NCCL calls).
    if (s.net != nullptr) launch_network(s, call, stream);
    // 2. Copy streams: the peers' chunks, each signalled once it landed (ranks of one process sharing a GPU: by the
    //    pull kernel, whose waits leave the hardware queues free).
    if (!call.pulls.empty()) {
        tp_detail::launch_peer_pulls(*s.pull_kernel, s.ctx, call.pulls, s.copy_streams[0]);
    } else {
        for (const AgCopy& copy : call.copies) {
            cudaStream_t cs = s.copy_streams[static_cast<size_t>(copy.stream)];
            if (copy.wait_ready != nullptr) stream_wait_u64_geq(cs, copy.wait_ready, 1);
            const TraceCopyEvents ev =
                trace_copy_events(*s.world, static_cast<uint16_t>(copy.stream), copy.chunk_idx, copy.peer);
            if (ev.begin != nullptr) WEFT_CUDA_CHECK(cudaEventRecord(ev.begin, cs));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(copy.dst, copy.src, copy.bytes, cudaMemcpyDefault, cs));
            if (ev.end != nullptr) WEFT_CUDA_CHECK(cudaEventRecord(ev.end, cs));
            stream_write_u64(cs, copy.signal, 1);
        }
    }
    // 3. The GEMM: local tiles first, then tiles in arrival order, each waiting on its chunks.
    fused.launch(call.gemm, call.sched, call.hook, stream);
    // 4. Join the copy streams (finished by now: the GEMM waited for every chunk) and the comm stream (its sends of
    //    this rank's shard are over before the next call may overwrite it).
    for (size_t i = 0; i < s.copy_streams.size(); ++i) {
        WEFT_CUDA_CHECK(cudaEventRecord(s.joins[i], s.copy_streams[i]));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, s.joins[i], 0));
    }
    if (s.net != nullptr) s.net->end_call(stream);
}

}  // namespace

}  // namespace weft::ops
