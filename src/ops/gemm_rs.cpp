// SPDX-License-Identifier: MIT
// weft::ops::GemmRs: GEMM+ReduceScatter. Push mode: the GEMM stores peers' tiles into their buffers and adds
// the peers' partials to its own tiles. Pull mode: signalled partial tiles + an overlapped fp32 reduction. A team that
// spans nodes: this op over each node's members, block by block, then NCCL across the nodes (docs/multinode.md).
#include "weft/ops/gemm_rs.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>

#include "collective_workspace.hpp"
#include "member_records.hpp"
#include "tp_common.hpp"
#include "views_overlap.hpp"
#include "weft/common/collectives.hpp"
#include "weft/common/gemm_hook_params.hpp"
#include "weft/common/gemm_rs_net_params.hpp"
#include "weft/common/math.hpp"
#include "weft/common/tile_map.hpp"
#include "weft/common/tp_params.hpp"
#include "weft/common/tp_schedule.hpp"
#include "weft/net/chunk_schedule.hpp"
#include "weft/net/gemm_rs_plan.hpp"
#include "weft/net/host_backend.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/tp_aot.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/stream.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {

namespace {
constexpr const char* kOp = "gemm_rs";
constexpr int64_t kMaxDim = kGemmMaxExtent;  // M, N and K of the GEMM
/// SMs a team that spans nodes keeps free of its node stage's default budget, for NCCL's kernels on the comm stream
/// (as AgGemm's): the persistent GEMM fills its SMs, and a network step would otherwise wait for the node stage's end.
constexpr int kNetworkSms = 8;

int64_t default_chunk_rows(int64_t rows_per_rank, int tile_m) {
    // About four counters per segment: the reduction starts on a segment's first rows while the GEMM
    // still computes its last ones.
    const int64_t m_tiles = ceil_div(rows_per_rank, tile_m);
    return std::max<int64_t>(1, ceil_div(m_tiles, 4)) * tile_m;
}

int default_reduce_ctas(int budget, bool shared_gpu) {
    // One rank per GPU: at most 16, the count measured fastest (kernels/gemm_rs/README.md, Knobs): more reduction
    // CTAs take SMs from the GEMM without reading the partials any faster.
    const int r = shared_gpu ? std::max(1, budget / 8) : std::clamp(budget / 8, 1, 16);
    return std::min(r, budget - 1);
}
}  // namespace

const char* gemm_rs_mode_name(GemmRsMode mode) {
    switch (mode) {
        case GemmRsMode::kAuto: return "auto";
        case GemmRsMode::kPull: return "pull";
        case GemmRsMode::kPush: return "push";
    }
    return "?";
}

void validate_gemm_rs_shape(const GemmRsShape& s, int num_ranks, const GemmRsOptions& o) {
    WEFT_CHECK(num_ranks >= 1, "gemm_rs: the team's num_ranks must be >= 1, got " << num_ranks);
    WEFT_CHECK(s.max_m > 0 && s.max_m % num_ranks == 0 && s.max_m <= kMaxDim,
               "gemm_rs: shape.max_m must be a positive multiple of the team's num_ranks " << num_ranks << ", got "
                                                                                           << s.max_m);
    WEFT_CHECK(s.n > 0 && s.n <= kMaxDim, "gemm_rs: shape.n must be in [1, 2^31 - 2^24], got " << s.n);
    WEFT_CHECK(s.k >= 8 && s.k % 8 == 0 && s.k <= kMaxDim,
               "gemm_rs: shape.k (this rank's K) must be a positive multiple of 8, got " << s.k);
    WEFT_CHECK(s.dtype == DType::kBF16 || s.dtype == DType::kF16,
               "gemm_rs: shape.dtype must be bf16 or f16, got " << dtype_name(s.dtype));
    if (o.partial_dtype) {
        WEFT_CHECK(*o.partial_dtype == s.dtype || *o.partial_dtype == DType::kF32,
                   "gemm_rs: options.partial_dtype must be " << dtype_name(s.dtype) << " or f32, got "
                                                             << dtype_name(*o.partial_dtype));
    }
    WEFT_CHECK(
        o.mode == GemmRsMode::kAuto || o.mode == GemmRsMode::kPull || o.mode == GemmRsMode::kPush,
        "gemm_rs: options.mode must be GemmRsMode::kAuto, kPull or kPush, got the value " << static_cast<int>(o.mode));
    WEFT_CHECK(o.chunk_rows >= 0, "gemm_rs: options.chunk_rows must be >= 0 (0 = heuristic), got " << o.chunk_rows);
    WEFT_CHECK(o.reduce_ctas >= 0, "gemm_rs: options.reduce_ctas must be >= 0 (0 = heuristic), got " << o.reduce_ctas);
    WEFT_CHECK(o.sm_budget >= 0, "gemm_rs: options.sm_budget must be >= 0 (0 = the world's), got " << o.sm_budget);
    if (o.config) {
        tp_detail::check_forced_config(*o.config, s.dtype, o.partial_dtype.value_or(s.dtype), kOp);
        WEFT_CHECK(o.chunk_rows == 0 || o.chunk_rows % o.config->tile_m == 0,
                   "gemm_rs: options.chunk_rows must be a multiple of the config's tile_m " << o.config->tile_m
                                                                                           << ", got " << o.chunk_rows);
    }
}

int64_t validate_gemm_rs_call(const GemmRsShape& s, int num_ranks, const TensorView& a, const TensorView& b,
                              const TensorView& c) {
    WEFT_CHECK(a.ndim == 2, "gemm_rs: a must be a 2-D [M, K] matrix, got " << a.describe());
    WEFT_CHECK(b.ndim == 2, "gemm_rs: b must be a 2-D [N, K] matrix, got " << b.describe());
    WEFT_CHECK(c.ndim == 2, "gemm_rs: c must be a 2-D [M/W, N] matrix, got " << c.describe());
    const int64_t m = a.dim(0);
    WEFT_CHECK(m >= num_ranks && m % num_ranks == 0 && m <= s.max_m,
               "gemm_rs: a's rows M must be a multiple of the team's num_ranks "
                   << num_ranks << " in [" << num_ranks << ", " << s.max_m << "], got " << a.describe());
    WEFT_CHECK(a.dim(1) == s.k, "gemm_rs: a must have K = " << s.k << " columns, got " << a.describe());
    WEFT_CHECK(a.dtype == s.dtype && b.dtype == s.dtype && c.dtype == s.dtype,
               "gemm_rs: a, b and c must be " << dtype_name(s.dtype) << ", got " << dtype_name(a.dtype) << ", "
                                              << dtype_name(b.dtype) << ", " << dtype_name(c.dtype));
    WEFT_CHECK(b.dim(0) == s.n && b.dim(1) == s.k,
               "gemm_rs: b must be [N, K] = [" << s.n << ", " << s.k << "], got " << b.describe());
    WEFT_CHECK(c.dim(0) == m / num_ranks && c.dim(1) == s.n,
               "gemm_rs: c must be [M/W, N] = [" << m / num_ranks << ", " << s.n << "], got " << c.describe());
    try {
        TensorView a_rows = a;
        a_rows.shape[0] = c.dim(0);
        validate_gemm_args(a, b, TensorView(a.data, s.dtype, {m, s.n}, {round_up(s.n, 8), 1}),
                           BLayout::kNK);  // a and b (d stands for the partial buffer)
        validate_gemm_args(a_rows, b, c, BLayout::kNK);                                // c's strides
    } catch (const Error& e) {
        detail::rethrow_with_op(kOp, e);
    }
    detail::check_apart(kOp, "c", c, {{"a", a}, {"b", b}},
                        "c is written while the GEMM's other tiles and the peers' partials still read them");
    return m;
}

namespace detail {

std::string gemm_rs_push_unsupported(const GemmRsShape& shape, int num_ranks, const GemmRsOptions& options) {
    std::ostringstream why;
    if (options.partial_dtype && *options.partial_dtype != shape.dtype) {
        why << "partials in " << dtype_name(*options.partial_dtype) << " (push mode sends " << dtype_name(shape.dtype)
            << " partials)";
    } else if (shape.n % 8 != 0) {
        why << "n = " << shape.n << " is not a multiple of 8 (push mode stores 16-byte rows into peers by TMA)";
    } else if (num_ranks > kRsPushMaxRanks) {
        why << num_ranks << " ranks (push mode serves at most " << kRsPushMaxRanks << ")";
    } else if (options.reduce_ctas > 0) {
        why << "options.reduce_ctas = " << options.reduce_ctas << " (reduction CTAs belong to the pull mode)";
    }
    return why.str();
}

GemmRsMode resolve_gemm_rs_mode(const GemmRsShape& shape, int num_ranks, const GemmRsOptions& options,
                                bool ranks_share_a_gpu) {
    if (options.mode == GemmRsMode::kPull) return GemmRsMode::kPull;
    if (num_ranks == 1) return options.mode == GemmRsMode::kPush ? GemmRsMode::kPush : GemmRsMode::kPull;  // plain
    const std::string why = gemm_rs_push_unsupported(shape, num_ranks, options);
    WEFT_CHECK(options.mode != GemmRsMode::kPush || why.empty(),
               "gemm_rs: options.mode = push cannot serve " << why << "; use GemmRsMode::kPull or kAuto");
    // Ranks that share a GPU take the pull mode: push's GEMM CTAs wait inside the kernel for the peers' tiles, so
    // every rank's CTAs must be resident at once, which a shared GPU's SMs cannot promise (push calls back to back
    // there have waited for a peer whose kernel never started: kernels/gemm_rs/README.md, "Ranks sharing a GPU").
    // One rank per GPU is unaffected.
    WEFT_CHECK(options.mode != GemmRsMode::kPush || !ranks_share_a_gpu || options.push_on_shared_gpus,
               "gemm_rs: options.mode = push is refused where ranks share a GPU (this World has more than one rank "
               "on a GPU): the push GEMM's CTAs wait inside the kernel for the peers' tiles, so every rank's CTAs "
               "must be resident at once, which a shared GPU cannot promise; use GemmRsMode::kAuto or kPull there "
               "(push runs with one rank per GPU)");
    if (options.mode == GemmRsMode::kAuto && ranks_share_a_gpu) return GemmRsMode::kPull;
    return why.empty() ? GemmRsMode::kPush : GemmRsMode::kPull;
}

GemmRsPlan plan_gemm_rs(const GemmRsShape& shape, int num_ranks, int gemm_budget, const GemmRsOptions& options) {
    validate_gemm_rs_shape(shape, num_ranks, options);
    WEFT_CHECK(gemm_budget >= 1, "gemm_rs: the GEMM's SM budget must be >= 1, got " << gemm_budget);
    GemmProblem p;
    p.m = shape.max_m;
    p.n = shape.n;
    p.k = shape.k;
    p.in_dtype = shape.dtype;
    p.out_dtype = num_ranks == 1 ? shape.dtype : options.partial_dtype.value_or(shape.dtype);
    // A team of one writes c itself: a forced config (checked against the partial dtype above) writes c's dtype.
    std::optional<GemmConfig> forced = options.config;
    if (forced) forced->out_dtype = p.out_dtype;
    // An explicit chunk_rows restricts the configs to those whose tile_m divides it (a forced config that
    // does not was rejected above); the heuristic chunk is a multiple of every candidate's tile_m.
    GemmRsPlan plan;
    const GemmConfig first = tp_detail::choose_gemm_config(p, gemm_budget, forced, kOp, options.chunk_rows);
    plan.configs = options.autotune ? tp_detail::tune_candidates(first, p.in_dtype, p.out_dtype, options.chunk_rows)
                                    : std::vector<GemmConfig>{first};
    const int64_t max_rows = shape.max_m / num_ranks;
    int max_tile_m = 1;
    for (const GemmConfig& c : plan.configs) max_tile_m = std::max(max_tile_m, c.tile_m);
    plan.chunk_rows = options.chunk_rows > 0 ? options.chunk_rows : default_chunk_rows(max_rows, max_tile_m);
    for (const GemmConfig& c : plan.configs) {
        // An invariant (the choice above): every config of the plan fits its chunk.
        WEFT_CHECK(plan.chunk_rows % c.tile_m == 0, "gemm_rs: internal error: chunk_rows "
                                                        << plan.chunk_rows << " is not a multiple of tile_m "
                                                        << c.tile_m << " of " << tp_detail::config_text(c));
        const ReduceScatterTileMap map{max_rows, num_ranks, shape.n, c.tile_m, c.tile_n, plan.chunk_rows};
        WEFT_CHECK(map.is_valid(), "gemm_rs: " << map.invalid_reason());
        plan.max_chunks_per_rank = std::max<int64_t>(plan.max_chunks_per_rank, map.chunks_per_rank());
    }
    return plan;
}

FusedGemmSpec gemm_rs_fused_spec(GemmRsMode mode) {
    WEFT_CHECK(mode != GemmRsMode::kAuto, "gemm_rs: a kernel spec needs a resolved mode (pull or push)");
    const bool push = mode == GemmRsMode::kPush;
    FusedGemmSpec spec;
    spec.header = "gemm_rs/gemm_rs.cuh";
    spec.scheduler = "weft::kernels::gemm_rs::RsGemmScheduler";
    spec.hook = push ? "weft::kernels::gemm_rs::RsPushHook<CFG>" : "weft::kernels::gemm_rs::RsGemmHook<CFG>";
    // The GEMM, after CTA 0 published the call's descriptor to the peers (publish_signature).
    spec.kernel_template = "weft::kernels::gemm_rs::rs_gemm_kernel<CFG, " + spec.hook + ">";
    spec.name = push ? "gemm_rs push" : "gemm_rs";
    return spec;
}

jit::KernelSpec gemm_rs_kernel_spec(const GemmConfig& config, const std::string& arch, GemmRsMode mode) {
    return fused_gemm_kernel_spec(gemm_rs_fused_spec(mode), config, arch);
}

jit::KernelSpec rs_reduce_kernel_spec(DType partial, DType out, const std::string& arch) {
    return tp_detail::make_spec("gemm_rs/gemm_rs.cuh",
                                std::string("weft::kernels::gemm_rs::rs_reduce_kernel<") + dtype_enum_name(partial) +
                                    ", " + dtype_enum_name(out) + ">",
                                std::string("gemm_rs reduce ") + dtype_name(partial) + "->" + dtype_name(out), arch);
}

jit::KernelSpec rs_node_sum_kernel_spec(DType dtype, const std::string& arch) {
    return tp_detail::make_spec(
        "gemm_rs/node_sum.cuh",
        std::string("weft::kernels::gemm_rs::rs_node_sum_kernel<") + dtype_enum_name(dtype) + ">",
        std::string("gemm_rs node sum ") + dtype_name(dtype), arch);
}

}  // namespace detail

struct GemmRs::State : tp_detail::FusedOpState {
    GemmRsShape shape;
    int64_t plan_k = 0;  // the team's largest shape.k: the config choice and the tuning key, the same on every member
    int reduce_ctas = 0;
    GemmRsMode mode = GemmRsMode::kPull;
    DType partial_dtype = DType::kBF16;
    int64_t chunk_rows = 1;
    int64_t ldp = 0, lda = 0;

    void* partial = nullptr;       // symmetric [max_m, ldp]
    uint64_t* counters = nullptr;  // symmetric [W * max_chunks_per_rank]
    uint64_t* released = nullptr;  // symmetric [W]
    uint64_t* gemm_calls = nullptr;
    uint64_t* red_epoch = nullptr;
    uint32_t* tile_counter = nullptr;
    uint32_t* exit_count = nullptr;
    uint64_t* signatures = nullptr;  // symmetric [2][W]: the sources' call descriptors (RsGemmParams::signatures)
    float* acc = nullptr;  // pull mode: local [max_m / W, lda]

    const jit::Kernel* reduce_kernel = nullptr;
    uint64_t launches = 0;  // calls launched by this rank (numbers the debug log's lines)
    cudaStream_t side = nullptr;
    cudaEvent_t fork = nullptr, join = nullptr;

    // A team that spans nodes (docs/multinode.md, "GEMM+ReduceScatter across nodes"); null / empty on one node, where
    // nothing above changes.
    net::HostBackend* net = nullptr;
    net::RsInterNodePlan plan;
    std::unique_ptr<GemmRs> node_op;  // the node stage: this op over this node's members (a team of one: the GEMM)
    int64_t max_rows = 0;             // rows of C per rank at max_m
    int64_t ld = 0;                   // row stride (elements) of the node sums
    uint8_t* node_sums = nullptr;     // local [num_nodes][max_rows][ld]: slot m, this node's sum of t(m, local)'s rows
    uint8_t* received = nullptr;      // local [num_nodes][max_rows][ld]: node m's sum of this rank's rows in slot m
    uint8_t* a_rows = nullptr;        // local [max_m / num_nodes][k]: a call's A rows, where they are not one slice
    uint64_t chunk_bytes = 0;         // WEFT_NET_CHUNK_BYTES: about this much of a node sum per network transfer
    uint64_t* descs = nullptr;        // signals [num_nodes]: slot m, the call descriptor of node m's column member
    const jit::Kernel* check_kernel = nullptr;
    const jit::Kernel* sum_kernel = nullptr;

    explicit State(const Team& t) : FusedOpState(t, kOp) {}
    uint8_t* slot(uint8_t* base, int node) const {
        return base + static_cast<int64_t>(node) * max_rows * ld * dtype_bytes(shape.dtype);
    }
    ~State() {
        heap.free_all();
    }
};

GemmRs::GemmRs(World& world, const GemmRsShape& shape, const GemmRsOptions& options)
    : GemmRs(world.team(), shape, options) {}

namespace {

/// A team that spans nodes: the network backend of its columns (collective over the team), the plan, the node stage
/// (this op over the node's members, made collectively over them), the node sums' buffers and the final sum's kernel.
void make_internode(GemmRs::State& s, const Team& team, const GemmRsOptions& options) {
    World& world = *s.world;
    s.net = &net::HostBackend::get(team);
    s.plan = net::plan_rs_internode(s.net->team_ranks_by_node(), s.rank);
    const int num_nodes = s.plan.num_nodes;
    WEFT_CHECK(num_nodes <= kRsMaxNodes, "gemm_rs: a team that spans " << num_nodes << " nodes; at most "
                                                                       << kRsMaxNodes);
    WEFT_CHECK(static_cast<int>(s.plan.net_steps.size()) <= net::kMaxChunks,
               "gemm_rs: " << s.plan.net_steps.size() << " network steps; at most " << net::kMaxChunks);
    // The node stage on max_m / N rows (L * R at most: R rows for each of the node's members); its team ranks are the
    // local indices (HostBackend's node team).
    GemmRsOptions node_options = options;
    if (options.sm_budget == 0) node_options.sm_budget = std::max(2, world.shared_sm_budget() - kNetworkSms);
    const GemmRsShape node_shape{s.shape.max_m / num_nodes, s.shape.n, s.shape.k, s.shape.dtype};
    s.node_op = std::make_unique<GemmRs>(s.net->node_team(), node_shape, node_options);
    s.budget = node_options.sm_budget;

    s.max_rows = s.shape.max_m / s.num_ranks;
    s.ld = round_up(s.shape.n, 8);
    const auto es = static_cast<uint64_t>(dtype_bytes(s.shape.dtype));
    const auto slots_bytes = static_cast<uint64_t>(num_nodes) * static_cast<uint64_t>(s.max_rows * s.ld) * es;
    s.node_sums = static_cast<uint8_t*>(s.heap.alloc_private(slots_bytes));
    s.received = static_cast<uint8_t*>(s.heap.alloc_private(slots_bytes));
    // A's rows of a node-stage call are one slice of A when the team ranks are node-major and the call covers whole
    // blocks; sub-blocks (a block cut for the network's pipeline; more of them for larger M) take every member's
    // sub-range, gathered into a staging buffer first.
    s.chunk_bytes = net::chunk_bytes_from_env();
    const net::RsCallSchedule largest =
        net::schedule_rs_call(s.plan, s.max_rows, static_cast<uint64_t>(s.ld) * es, s.chunk_bytes);
    bool sliced = largest.sub_blocks == 1;
    for (const net::RsNodeBlock& b : s.plan.blocks) sliced = sliced && b.first_rank >= 0;
    if (!sliced) {
        s.a_rows = static_cast<uint8_t*>(
            s.heap.alloc_private(static_cast<uint64_t>(s.shape.max_m / num_nodes * s.shape.k) * es));
    }
    // Signal words of the symmetric heap (collective: every member makes the same allocations in the same order):
    // stream memory operations write them, which memory of cudaMallocAsync's pools does not take.
    s.descs = s.heap.alloc_signals(static_cast<uint64_t>(num_nodes));
    s.check_kernel = &jit::compiler().get_kernel(detail::net_check_calls_kernel_spec());
    s.sum_kernel = &jit::compiler().get_kernel(detail::rs_node_sum_kernel_spec(s.shape.dtype));
    WEFT_LOG_INFO("gemm_rs: team of " << s.num_ranks << " across " << num_nodes << " nodes (NCCL host API, "
                                      << s.plan.per_node << " member(s) per node): node stage "
                                      << gemm_rs_mode_name(s.node_op->mode()) << ", "
                                      << tp_detail::config_text(s.node_op->config()) << ", chunk_rows "
                                      << s.node_op->chunk_rows() << ", SM budget " << s.budget << ", up to "
                                      << largest.sub_blocks << " network chunk(s) per block"
                                      << (sliced ? "" : ", A's rows gathered per node-stage call"));
    team.barrier();
}

}  // namespace

GemmRs::GemmRs(const Team& team, const GemmRsShape& shape, const GemmRsOptions& options)
    : s_(std::make_unique<State>(team)) {
    State& s = *s_;
    World& world = *s.world;
    s.shape = shape;
    // Every rank must make the same choices (mode, config, chunks: they fix how many tiles each rank expects from
    // each peer, the symmetric buffers' sizes and the first call's barrier), so they come from facts that are the same
    // on every rank: where some GPUs host more ranks than others (3 ranks on 2 GPUs), a rank with a GPU of its own
    // plans and runs as a rank of the most shared GPU. They are the World's, not the team's: ranks of other teams that
    // share a GPU with this team's run their kernels beside it. Each member has its own K (a shard that may be uneven):
    // the config is chosen for the team's largest. A member whose shape or options are invalid fails every member at
    // once, and members that disagree are named.
    const bool shared_gpus = world.max_ranks_per_device() > 1;
    const bool spans_nodes = s.num_ranks > 1 && team.num_nodes() > 1;
    std::vector<int64_t> mine;
    const std::vector<std::vector<uint8_t>> all =
        detail::exchange_member_records(team, "weft.ops.gemm_rs.shape", kOp, "shape or options are", [&] {
            validate_gemm_rs_shape(shape, s.num_ranks, options);
            s.partial_dtype = options.partial_dtype.value_or(shape.dtype);
            WEFT_CHECK(!spans_nodes || !options.autotune, "gemm_rs: options.autotune on a team that spans nodes ("
                                                              << team.describe()
                                                              << ") is not supported yet; tune on one node and pass "
                                                              << "the winner as options.config");
            if (!spans_nodes) {
                tp_detail::check_sm_budget_share(world, options.sm_budget, kOp);
                s.budget = tp_detail::resolve_sm_budget(options.sm_budget, world.shared_sm_budget());
                s.mode = detail::resolve_gemm_rs_mode(shape, s.num_ranks, options, shared_gpus);
                if (s.num_ranks > 1 && s.mode == GemmRsMode::kPull) {
                    WEFT_CHECK(s.budget >= 2,
                               "gemm_rs: the SM budget must be >= 2 (GEMM + reduction), got " << s.budget);
                    s.reduce_ctas =
                        options.reduce_ctas > 0 ? options.reduce_ctas : default_reduce_ctas(s.budget, shared_gpus);
                    WEFT_CHECK(s.reduce_ctas < s.budget,
                               "gemm_rs: options.reduce_ctas must leave the GEMM at least "
                               "one SM of the budget "
                                   << s.budget << ", got " << s.reduce_ctas);
                }
            }
            // Everything the plan (config, chunks, buffer sizes) and the first call's autotuning depend on.
            const int64_t forced =
                options.config
                    ? static_cast<int64_t>(std::hash<std::string>{}(format_gemm_config(*options.config)) >> 1)
                    : 0;
            mine = {shape.max_m,
                    shape.n,
                    static_cast<int64_t>(shape.dtype),
                    static_cast<int64_t>(s.partial_dtype),
                    static_cast<int64_t>(s.mode),
                    options.chunk_rows,
                    s.budget,
                    s.reduce_ctas,
                    options.autotune ? 1 : 0,
                    forced,
                    shape.k};
            return detail::fields_record(mine);
        });
    static constexpr const char* kFields[] = {"shape.max_m",
                                              "shape.n",
                                              "shape.dtype",
                                              "partial dtypes (options.partial_dtype)",
                                              "modes (options.mode, options.reduce_ctas and the shape, resolved)",
                                              "options.chunk_rows",
                                              "SM budgets (options.sm_budget, resolved)",
                                              "reduction CTAs (options.reduce_ctas, resolved)",
                                              "options.autotune",
                                              "forced configs (options.config: 0 = none, else a digest)"};
    s.plan_k = shape.k;
    for (const std::vector<uint8_t>& r : all) {
        WEFT_CHECK(r.size() == mine.size() * sizeof(int64_t), "gemm_rs: a member sent a malformed record");
        int64_t k = 0;
        std::memcpy(&k, r.data() + (mine.size() - 1) * sizeof(int64_t), sizeof(k));
        s.plan_k = std::max(s.plan_k, k);
    }
    mine.pop_back();  // K is each member's own
    std::vector<std::vector<uint8_t>> agreed = all;
    for (std::vector<uint8_t>& r : agreed) r.resize(mine.size() * sizeof(int64_t));
    detail::check_member_fields(team, agreed, mine, kFields, kOp, [](size_t f, int64_t v) -> std::string {
        if (f == 2 || f == 3) return dtype_name(static_cast<DType>(v));
        if (f == 4) return gemm_rs_mode_name(static_cast<GemmRsMode>(v));
        return std::to_string(v);
    });
    if (spans_nodes) {
        make_internode(s, team, options);
        return;
    }
    const int gemm_budget = s.budget - s.reduce_ctas;

    GemmRsShape plan_shape = shape;
    plan_shape.k = s.plan_k;
    const detail::GemmRsPlan plan = detail::plan_gemm_rs(plan_shape, s.num_ranks, gemm_budget, options);
    s.chunk_rows = plan.chunk_rows;
    const int64_t max_rows = shape.max_m / s.num_ranks;
    const int64_t max_chunks_per_rank = plan.max_chunks_per_rank;
    const GemmConfig& first = plan.configs.front();
    s.ldp = round_up(shape.n, 8);
    s.lda = round_up(shape.n, 8);

    s.load_gemms(plan.configs,
                 s.num_ranks == 1 ? plain_gemm_fused_spec() : detail::gemm_rs_fused_spec(s.mode), shared_gpus,
                 tp_detail::problem_text(shape.max_m, shape.n, shape.k, shape.dtype));
    if (s.num_ranks == 1) {
        team.barrier();
        return;
    }
    s.partial = s.heap.alloc(static_cast<uint64_t>(shape.max_m * s.ldp * dtype_bytes(s.partial_dtype)));
    const int64_t num_counters = static_cast<int64_t>(s.num_ranks) * max_chunks_per_rank;
    uint64_t* words = s.heap.alloc_signals(static_cast<uint64_t>(num_counters + 3 * s.num_ranks + 3));
    s.counters = words;
    s.released = words + num_counters;
    s.gemm_calls = s.released + s.num_ranks;
    s.red_epoch = s.gemm_calls + 1;
    s.tile_counter = reinterpret_cast<uint32_t*>(s.red_epoch + 1);
    s.exit_count = s.tile_counter + 1;
    s.signatures = s.red_epoch + 2;  // after the word that holds tile_counter and exit_count
    tp_detail::check_peers_reachable(team, s.partial, kOp);
    if (s.mode == GemmRsMode::kPush) {
        WEFT_LOG_INFO("gemm_rs: push mode, "
                      << tp_detail::config_text(first) << (options.autotune ? " (to be tuned)" : "") << ", chunk_rows "
                      << s.chunk_rows << ", SM budget " << s.budget << "; signals at "
                      << static_cast<const void*>(s.counters) << " (" << num_counters << " counters, " << s.num_ranks
                      << " released, calls, epoch, tiles), "
                      << "team of " << s.num_ranks);
        team.barrier();
        return;
    }
    s.acc = static_cast<float*>(s.heap.alloc_private(static_cast<uint64_t>(max_rows * s.lda) * sizeof(float)));

    s.side = s.streams.add_stream();
    s.fork = s.streams.add_event();
    s.join = s.streams.add_event();
    s.reduce_kernel = &jit::compiler().get_kernel(detail::rs_reduce_kernel_spec(s.partial_dtype, shape.dtype));
    WEFT_LOG_INFO("gemm_rs: pull mode, " << tp_detail::config_text(first) << (options.autotune ? " (to be tuned)" : "")
                                         << ", partials " << dtype_name(s.partial_dtype) << ", chunk_rows "
                                         << s.chunk_rows << ", " << s.reduce_ctas << " reduction CTAs, SM budget "
                                         << s.budget << ", team of " << s.num_ranks);
    team.barrier();
}

GemmRs::~GemmRs() = default;

// A team that spans nodes answers with its node stage's values.
const GemmRsShape& GemmRs::shape() const { return s_->shape; }
const GemmConfig& GemmRs::config() const { return s_->node_op ? s_->node_op->config() : s_->config(); }
DType GemmRs::partial_dtype() const { return s_->node_op ? s_->node_op->partial_dtype() : s_->partial_dtype; }
int64_t GemmRs::chunk_rows() const { return s_->node_op ? s_->node_op->chunk_rows() : s_->chunk_rows; }
int GemmRs::reduce_ctas() const { return s_->node_op ? s_->node_op->reduce_ctas() : s_->reduce_ctas; }
GemmRsMode GemmRs::mode() const { return s_->node_op ? s_->node_op->mode() : s_->mode; }
int GemmRs::gemm_grid() const {
    if (s_->node_op) return s_->node_op->gemm_grid();
    return fused_gemm_grid(config(), s_->shape.max_m, s_->shape.n, s_->budget - s_->reduce_ctas);
}

namespace {

/// One call of one config, set up on the host (views, tensor maps, kernel parameters): launching it only
/// enqueues. A team of more than one rank launches the reduction first, then the GEMM whose tiles it waits
/// for, on this rank and on the peers: nothing that can throw may sit between the launches, or the peers'
/// reductions wait for tiles that never come (the autotuner relies on this, TuneCandidate::prepare).
struct RsCall {
    FusedGemmCall gemm{};  // a team of one rank: the plain GEMM into c
    RsReduceParams reduce{};
    RsGemmParams sched{};
    RsGemmHookParams hook{};
    RsPushHookParams push{};
};

RsCall prepare_call(const GemmRs::State& s, size_t idx, int64_t m, const TensorView& a, const TensorView& b,
                    const TensorView& c);
void launch_call(GemmRs::State& s, size_t idx, const RsCall& call, cudaStream_t stream);
void run_internode(GemmRs::State& s, int64_t m, const TensorView& a, const TensorView& b, const TensorView& c,
                   cudaStream_t stream);

/// The fields that the push hook's, the pull hook's and the reduction's parameters share.
template <class Params>
void set_shared_fields(Params& p, const GemmRs::State& s, int64_t rows) {
    p.ctx = s.ctx;
    p.rows_per_rank = rows;
    p.chunk_rows = s.chunk_rows;
    p.counters = s.counters;
}

/// ... and those both GEMM hooks' parameters share.
/// This call's descriptor: what every rank's call must agree on (M, so the partials' segments and the counts each
/// source sends; n and the partials' dtype, so a peer's partial reads right; the tiles, chunks and mode, so the
/// counts match).
uint64_t call_signature(const GemmRs::State& s, const GemmConfig& config, int64_t m) {
    uint64_t mix = call_descriptor_mix(0, static_cast<uint64_t>(s.shape.n));
    mix = call_descriptor_mix(mix, static_cast<uint64_t>(s.shape.dtype));
    mix = call_descriptor_mix(mix, static_cast<uint64_t>(s.chunk_rows));
    mix = call_descriptor_mix(mix, static_cast<uint64_t>(config.tile_m) << 32 | static_cast<uint64_t>(config.tile_n));
    mix = call_descriptor_mix(mix, static_cast<uint64_t>(s.mode));
    return make_call_descriptor(CollectiveOp::kGemmRs, 0, true, s.partial_dtype, static_cast<uint64_t>(m), mix);
}

template <class Params>
void set_hook_fields(Params& p, const GemmRs::State& s, int64_t rows, const RsGemmOrder& order, int32_t n) {
    set_shared_fields(p, s, rows);
    p.tile_counter = s.tile_counter;
    p.num_tiles = order.num_tiles();
    p.n = n;
    p.gemm_calls = s.gemm_calls;
}

}  // namespace

void GemmRs::run(const TensorView& a, const TensorView& b, const TensorView& c, cudaStream_t stream) {
    WEFT_NVTX_RANGE("gemm_rs");
    State& s = *s_;
    const int64_t m = validate_gemm_rs_call(s.shape, s.num_ranks, a, b, c);
    s.refuse_after_abort();
    // Host memory or another GPU's would reach the tensor maps and the reduction unchecked.
    detail::check_device_buffers(s.world->heap(), {{"a", a}, {"b", b}, {"c", c}}, kOp, stream);
    if (s.node_op) {
        run_internode(s, m, a, b, c, stream);
        return;
    }
    const auto problem = [&] {
        std::ostringstream os;
        os << "m=" << m << ",n=" << s.shape.n << ",k=" << s.plan_k << "," << dtype_name(s.shape.dtype)
           << ",partials=" << dtype_name(s.partial_dtype) << ",chunk_rows=" << s.chunk_rows
           << ",mode=" << gemm_rs_mode_name(s.mode) << ",reduce_ctas=" << s.reduce_ctas << ",budget=" << s.budget;
        return os.str();
    };
    // With more than one rank, a trial call's reduction waits for every rank's GEMM of the same call.
    s.run(
        stream, s.num_ranks > 1 ? s.world->heap().offset_of(s.counters) : 0, problem,
        [&](size_t idx) { return prepare_call(s, idx, m, a, b, c); },
        [&](const RsCall& call, size_t idx, cudaStream_t st) { launch_call(s, idx, call, st); });
}

namespace {

RsCall prepare_call(const GemmRs::State& s, size_t idx, int64_t m, const TensorView& a, const TensorView& b,
                    const TensorView& c) {
    RsCall call;
    const GemmConfig& config = s.gemms[idx].config();
    if (s.num_ranks == 1) {
        call.gemm = detail::make_fused_gemm_call(config, a, b, c, fused_gemm_grid(config, m, s.shape.n, s.budget),
                                                 s.pipeline_timeout_ns);
        return call;
    }
    const int64_t rows = m / s.num_ranks;
    const int32_t n = static_cast<int32_t>(s.shape.n);
    const TensorView partial(s.partial, s.partial_dtype, {m, s.shape.n}, {s.ldp, 1});
    const RsGemmOrder order(config, rows, s.num_ranks, s.chunk_rows, n, s.rank);
    const uint64_t signature = call_signature(s, config, m);
    call.sched = RsGemmParams{s.ctx, rows, s.chunk_rows, s.released, s.gemm_calls, s.signatures, signature};

    if (s.mode == GemmRsMode::kPush) {
        // Own tiles store C through tma_d; a peer's tiles go into its buffer's slot for this rank (rows
        // [rank * rows, (rank+1) * rows) of its partial buffer), through a map of their own. The kernel's arguments
        // describe the partial (plain stores of ragged columns go there: none, push mode has n % 8 == 0).
        call.gemm = detail::make_fused_gemm_call(config, a, b, c, std::max(1, std::min(s.budget, order.num_tiles())),
                                                 s.pipeline_timeout_ns);
        call.gemm.args = detail::make_gemm_args(a, partial, s.pipeline_timeout_ns);
        RsPushHookParams& ph = call.push;
        static_assert(sizeof(CUtensorMap) == sizeof(TmaMapBytes), "a tensor map is 128 bytes");
        const int64_t elem = dtype_bytes(s.partial_dtype);
        for (int d = 0; d < s.num_ranks; ++d) {
            if (d == s.rank) continue;
            // d is a team rank; the heap maps peers by world rank.
            auto* slot = static_cast<unsigned char*>(s.world->heap().symm_at(s.partial, s.team.world_rank(d))) +
                         s.rank * rows * s.ldp * elem;
            const CUtensorMap map =
                detail::make_gemm_store_map(config, TensorView(slot, s.partial_dtype, {rows, s.shape.n}, {s.ldp, 1}));
            std::memcpy(&ph.peer_maps[d], &map, sizeof(map));
        }
        set_hook_fields(ph, s, rows, order, n);
        ph.recv = s.partial;
        ph.ldr = s.ldp;
        ph.released = s.released;
        ph.signatures = s.signatures;
        ph.signature = signature;
        return call;
    }

    // The reduction beside the GEMM, on the side stream.
    RsReduceParams& rp = call.reduce;
    set_shared_fields(rp, s, rows);
    rp.n = n;
    rp.tile_m = config.tile_m;
    rp.tile_n = config.tile_n;
    rp.partial = s.partial;
    rp.ldp = s.ldp;
    rp.acc = s.acc;
    rp.lda = s.lda;
    rp.out = c.data;
    rp.ldc = c.stride(0);
    rp.released = s.released;
    rp.epoch = s.red_epoch;
    rp.exit_count = s.exit_count;
    rp.signatures = s.signatures;
    rp.signature = signature;

    // The GEMM on the caller's stream: partial tiles in destination order, each signalled.
    call.gemm = detail::make_fused_gemm_call(config, a, b, partial,
                                             std::max(1, std::min(s.budget - s.reduce_ctas, order.num_tiles())),
                                             s.pipeline_timeout_ns);
    set_hook_fields(call.hook, s, rows, order, n);
    return call;
}

void launch_call(GemmRs::State& s, size_t idx, const RsCall& call, cudaStream_t stream) {
    const FusedGemm& fused = s.gemms[idx];
    // Ranks that share a GPU wait on each other's kernels: WEFT_LOG=debug orders their launches in time.
    WEFT_LOG_DEBUG("gemm_rs: launching call " << ++s.launches << " (" << tp_detail::config_text(fused.config())
                                              << ", " << gemm_rs_mode_name(s.mode) << ", grid " << call.gemm.grid
                                              << ")");
    if (s.num_ranks == 1) {
        fused.launch(call.gemm, weft::gemm::PersistentSchedulerParams{}, weft::gemm::NoEpilogueHookParams{}, stream);
        return;
    }
    if (s.mode == GemmRsMode::kPush) {
        fused.launch(call.gemm, call.sched, call.push, stream);
        WEFT_LOG_DEBUG("gemm_rs: launched call " << s.launches);
        return;
    }
    WEFT_CUDA_CHECK(cudaEventRecord(s.fork, stream));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(s.side, s.fork, 0));
    jit::LaunchParams lp;
    lp.grid = dim3(static_cast<unsigned>(s.reduce_ctas), 1, 1);
    lp.block = dim3(kTpReduceThreads, 1, 1);
    lp.stream = s.side;
    s.reduce_kernel->launch(lp, call.reduce);
    fused.launch(call.gemm, call.sched, call.hook, stream);
    WEFT_CUDA_CHECK(cudaEventRecord(s.join, s.side));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, s.join, 0));
    WEFT_LOG_DEBUG("gemm_rs: launched call " << s.launches);
}

/// A team that spans nodes (net::RsInterNodePlan, net::RsCallSchedule; docs/multinode.md, "GEMM+ReduceScatter across
/// nodes"), R = M / W rows of C per rank:
///   1. node stage, on `stream`: each other node m's block (by distance) in sub-blocks of rows, this node's own block
///      last: the node op over this node's L members on rows [r0, r0 + S) of each of t(m, 0 .. L-1) leaves this rank
///      this node's sum of those rows of t(m, local) in node_sums[m]; after a sub-block, its ready word is raised;
///   2. network, on the comm stream (forked by begin_call): the call's descriptor to and from the column member of
///      every other node, checked (net_check_calls_kernel: calls that differ abort the World, which ends the transfers
///      behind it); then step k, sub-block by sub-block, waits for the sub-block's ready word, then sends those rows of
///      node_sums[n + k] to the column member on node n + k and receives node n - k's sum of the same rows of this rank
///      into received[n - k] (one grouped ncclSend/ncclRecv, under the backend's watcher), while the node stage
///      computes the later sub-blocks;
///   3. end_call joins the comm stream; rs_node_sum_kernel writes C = the sum over nodes in fp32, rounded once.
/// Everything of the node stage is enqueued before the network steps: the comm stream only waits for words whose
/// writer is enqueued, and this node's members never wait on this host's NCCL calls.
void run_internode(GemmRs::State& s, int64_t m, const TensorView& a, const TensorView& b, const TensorView& c,
                   cudaStream_t stream) {
    net::HostBackend& net = *s.net;
    const net::RsInterNodePlan& plan = s.plan;
    const DType dtype = s.shape.dtype;
    const int64_t es = dtype_bytes(dtype);
    const int64_t rows = m / s.num_ranks;
    const int64_t k = s.shape.k;
    const int64_t lda = a.stride(0);
    const int64_t row_bytes = s.ld * es;  // of a node sum
    auto* a_bytes = static_cast<uint8_t*>(a.data);
    const net::RsCallSchedule sched =
        net::schedule_rs_call(plan, rows, static_cast<uint64_t>(row_bytes), s.chunk_bytes);
    // Host set-up first: nothing that can throw between the launches below (the node's members wait on them).
    struct NodeCall {
        TensorView a, c;
        bool gather = false;  // A's rows into the staging buffer first
        const net::RsNodeCall* call = nullptr;
    };
    std::vector<NodeCall> calls;
    tp_detail::check_row_copy(kOp, "a", static_cast<size_t>(k * es), static_cast<size_t>(lda * es),
                              static_cast<size_t>(k * es), static_cast<size_t>(rows));
    for (const net::RsNodeCall& call : sched.calls) {
        const net::RsNodeBlock& blk = plan.blocks[static_cast<size_t>(call.block)];
        NodeCall x;
        x.call = &call;
        x.gather = blk.first_rank < 0 || call.num_rows != rows;
        WEFT_CHECK(!x.gather || s.a_rows != nullptr, "gemm_rs: internal error: a node-stage call of "
                                                         << call.num_rows << " of " << rows
                                                         << " rows needs the staging buffer, which was not made");
        const int64_t call_rows = call.num_rows * plan.per_node;
        x.a = x.gather ? TensorView(s.a_rows, dtype, {call_rows, k}, {k, 1})
                       : TensorView(a_bytes + blk.first_rank * rows * lda * es, dtype, {call_rows, k}, {lda, 1});
        x.c = TensorView(s.slot(s.node_sums, blk.dest_node) + call.row_begin * row_bytes, dtype,
                         {call.num_rows, s.shape.n}, {s.ld, 1});
        calls.push_back(x);
    }
    // The call's descriptor (M, n, the dtypes): node m's column member's arrives in descs[m] before the call's rows;
    // calls that differ (their transfers differ in size) are a kCollectiveMismatch, and the final sum writes nothing.
    // WEFT_NET_CHUNK_BYTES too: it cuts the rows into transfers, and each op reads it when it is made.
    uint64_t mix = call_descriptor_mix(0, static_cast<uint64_t>(s.shape.n));
    mix = call_descriptor_mix(mix, static_cast<uint64_t>(dtype));
    mix = call_descriptor_mix(mix, s.chunk_bytes);
    const uint64_t signature =
        make_call_descriptor(CollectiveOp::kGemmRs, 0, true, s.partial_dtype, static_cast<uint64_t>(m), mix);
    std::vector<tp_detail::NetCallCheck> checks;
    for (const net::RsNetStep& st : plan.net_steps) checks.push_back({st.from_node, st.from_rank});
    RsNodeSumParams sum{};
    for (int node = 0; node < plan.num_nodes; ++node) {
        sum.inputs[node] = s.slot(node == plan.node ? s.node_sums : s.received, node);
    }
    sum.descs = s.descs;
    sum.signature = signature;
    sum.num_inputs = plan.num_nodes;
    sum.rows = rows;
    sum.cols = s.shape.n;
    sum.ld_in = s.ld;
    sum.out = c.data;
    sum.ldc = c.stride(0);
    const int64_t vectors = rows * ceil_div(s.shape.n, int64_t{8});
    jit::LaunchParams lp;
    lp.grid = dim3(static_cast<unsigned>(std::clamp<int64_t>(ceil_div(vectors, int64_t{kRsNodeSumThreads}), 1, 1024)),
                   1, 1);
    lp.block = dim3(kRsNodeSumThreads, 1, 1);
    lp.stream = stream;
    WEFT_LOG_DEBUG("gemm_rs: launching call " << ++s.launches << " across " << plan.num_nodes << " nodes (M " << m
                                              << ", " << sched.calls.size() << " node-stage calls, "
                                              << sched.chunks.size() << " network transfers)");

    stream_write_u64(stream, s.descs + plan.node, signature);
    for (const net::RsNetStep& st : plan.net_steps) stream_write_u64(stream, s.descs + st.from_node, 0);
    net.begin_call(stream);
    for (const NodeCall& x : calls) {
        const net::RsNodeCall& call = *x.call;
        if (x.gather) {
            // Rows [r0, r0 + S) of t(m, l) at l * S (the staging buffer's previous reader, the node stage's previous
            // GEMM, is ahead in stream order).
            const net::RsNodeBlock& blk = plan.blocks[static_cast<size_t>(call.block)];
            for (int32_t l = 0; l < plan.per_node; ++l) {
                const int64_t src_row = blk.rows_of[static_cast<size_t>(l)] * rows + call.row_begin;
                tp_detail::copy_rows_async(s.a_rows + l * call.num_rows * k * es, static_cast<size_t>(k * es),
                                           a_bytes + src_row * lda * es, static_cast<size_t>(lda * es),
                                           static_cast<size_t>(k * es), static_cast<size_t>(call.num_rows), stream);
            }
        }
        s.node_op->run(x.a, b, x.c, stream);
        if (call.ready >= 0) net.mark_ready(stream, call.ready);
    }
    // The network, after the whole node stage is enqueued: the descriptors, their check, then the rows.
    for (const net::RsNetStep& st : plan.net_steps) {
        net.send_recv(s.descs + plan.node, sizeof(uint64_t), st.to_node, s.descs + st.from_node, st.from_node);
    }
    tp_detail::launch_net_call_check(*s.check_kernel, s.ctx, s.descs, signature, checks, net.comm_stream());
    for (const net::RsNetChunk& ch : sched.chunks) {
        const net::RsNetStep& st = plan.net_steps[static_cast<size_t>(ch.step)];
        net.comm_wait_ready(ch.ready);
        net.send_recv(s.slot(s.node_sums, st.to_node) + ch.row_begin * row_bytes,
                      static_cast<uint64_t>(ch.num_rows * row_bytes), st.to_node,
                      s.slot(s.received, st.from_node) + ch.row_begin * row_bytes, st.from_node);
    }
    net.end_call(stream);
    s.sum_kernel->launch(lp, sum);
    s.heap.note_use(stream);
    WEFT_LOG_DEBUG("gemm_rs: launched call " << s.launches);
}

}  // namespace

}  // namespace weft::ops
