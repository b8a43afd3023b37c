// SPDX-License-Identifier: MIT
// weft::ops TP MoE, the two fused tensor-parallel layers: AllGather + grouped GEMM (layer 0) and grouped GEMM +
// top-k reduction + ReduceScatter (layer 1) (kernels/moe_tp/README.md).
#include "weft/ops/moe_tp.hpp"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>

#include "collective_workspace.hpp"
#include "grouped_gemm_internal.hpp"
#include "member_records.hpp"
#include "moe_internal.hpp"
#include "tp_common.hpp"
#include "weft/common/math.hpp"
#include "weft/detail/host_mapped_pool.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/symmetric_heap.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {

using moe_detail::check_dense;
using moe_detail::check_matrix;
using moe_detail::check_routing;
using moe_detail::counts_view;
using moe_detail::kMaxTopk;
using moe_detail::launch_params;
using moe_detail::launch_route;
using moe_detail::moe_kernel;
using moe_detail::num_sms;
using moe_detail::offsets_view;
using moe_detail::slot_rows_view;
using weft::moe::kMoeMaxRanks;
using weft::moe::kMoeThreads;

void validate_moe_tp_shape(const MoeTpShape& s, int num_ranks, const MoeTpOptions& o, const char* op,
                           std::optional<DType> gemm_out) {
    WEFT_CHECK(num_ranks >= 1 && num_ranks <= kMoeMaxRanks,
               op << ": the team must have 1 .. " << kMoeMaxRanks << " ranks, got " << num_ranks);
    WEFT_CHECK(s.max_tokens > 0 && s.max_tokens % num_ranks == 0,
               op << ": shape.max_tokens must be a positive multiple of the team's num_ranks " << num_ranks << ", got "
                  << s.max_tokens);
    WEFT_CHECK(s.hidden >= 8 && s.hidden % 8 == 0 && s.hidden <= kGemmMaxExtent,
               op << ": shape.hidden must be a positive multiple of 8, at most 2^31 - 2^24, got " << s.hidden);
    WEFT_CHECK(
        s.ffn >= 8 && s.ffn % 8 == 0 && s.ffn <= kGemmMaxExtent,
        op << ": shape.ffn (this rank's shard) must be a positive multiple of 8, at most 2^31 - 2^24, got " << s.ffn);
    WEFT_CHECK(s.num_experts >= 1 && s.num_experts <= 4096,
               op << ": shape.num_experts must be in [1, 4096], got " << s.num_experts);
    WEFT_CHECK(s.topk >= 1 && s.topk <= kMaxTopk && s.topk <= s.num_experts,
               op << ": shape.topk must be in [1, min(" << kMaxTopk << ", num_experts)], got " << s.topk);
    WEFT_CHECK(s.max_tokens <= kGemmMaxExtent / s.topk,
               op << ": shape.max_tokens x topk (the grouped GEMM's rows) must be at most 2^31 - 2^24, got "
                  << s.max_tokens << " x " << s.topk);
    WEFT_CHECK(o.sm_budget >= 0, op << ": options.sm_budget must be >= 0, got " << o.sm_budget);
    WEFT_CHECK(o.comm_blocks >= 0 && o.comm_blocks <= 64,
               op << ": options.comm_blocks must be in [0, 64], got " << o.comm_blocks);
    constexpr std::chrono::milliseconds kMaxTimeout = std::chrono::hours(24 * 30);  // the GEMM's bound
    WEFT_CHECK(o.timeout.count() >= 0 && o.timeout <= kMaxTimeout,
               op << ": options.timeout must be in [0, 30 days] (0: the World's), got " << o.timeout.count() << " ms");
    if (o.config) {
        WEFT_CHECK(
            is_valid_grouped(*o.config) && o.config->in_dtype == DType::kBF16 && o.config->b_layout == BLayout::kNK,
            op << ": options.config must be a valid grouped config with bf16 inputs and B [N, K], got "
               << format_gemm_config(*o.config));
        WEFT_CHECK(!gemm_out || o.config->out_dtype == *gemm_out,
                   op << ": options.config must write " << dtype_name(gemm_out.value_or(DType::kBF16))
                      << " (this layer's GEMM output), got " << format_gemm_config(*o.config));
        // Layer 0 (bf16 out): its GEMM's producer waits for each tile's rows (GatheredWaitScheduler).
        WEFT_CHECK(gemm_out != DType::kBF16 || is_valid_grouped_wait(*o.config),
                   op << ": options.config must have at most 128 accumulators per consumer thread "
                         "(is_valid_grouped_wait: the GEMM waits for each tile's rows), got "
                      << format_gemm_config(*o.config));
    }
}

namespace {

// What both layers share: the team skeleton, the epoch word, the side stream, the SM split. Ranks of one process that
// share a GPU (tp_detail::streams_may_share_queues) get no side stream: the push (layer 0) and the combine (layer 1)
// then run on the caller's stream, in order with the GEMM, with no event wait between streams (with them,
// MoeTpLayers.World8 timed out twice after other suites in the same process: kernels/moe_tp/README.md, "Pitfalls").
// The kernels and their signals are the same either way; only the overlap with this rank's own GEMM is lost.
//
// A team of one rank has nothing to overlap: its layers run the gather (layer 0) or the combine (layer 1) in order with
// a grouped GEMM on the whole SM budget, each kernel on every SM it may use, with no waits and no side stream.
struct MoeLayerBase : tp_detail::FusedOpState {
    MoeTpShape shape;
    MoeTpOptions options;
    bool alone = false;  // a team of one rank: the serial schedule above, on the whole budget
    int comm_blocks = 1;
    int gemm_budget = 1;
    int64_t rows_capacity = 0;
    uint64_t* epoch = nullptr;
    uint64_t* consumed = nullptr;  // [W]
    cudaStream_t side = nullptr;   // null: the push or combine goes on the caller's stream (see above)
    cudaEvent_t fork = nullptr, join = nullptr;
    GemmConfig config{};
    jit::Kernel* gemm = nullptr;  // the call's GEMM over a team (alone: the grouped GEMM op's own)
    detail::MoeTpTimeouts timeouts;
    bool first_call_pending = false;

    MoeLayerBase(const Team& t, const char* op_name, DType gemm_out, const MoeTpShape& s, const MoeTpOptions& o)
        : FusedOpState(t, op_name), shape(s), options(o) {
        // Every member counts the others' push (or combine) blocks with its own count, and sizes and indexes the
        // peers' buffers by its own shape: both must agree (options.comm_blocks, or the worlds' SM budgets behind the
        // heuristic; a shape whose fields differ with equal products would otherwise pass the allocations and mix
        // rows silently). shape.ffn is this member's own shard: not compared. A member whose shape or options are
        // invalid fails every member at once.
        std::vector<int64_t> mine;
        const std::vector<std::vector<uint8_t>> all = detail::exchange_member_records(
            team, std::string("weft.ops.") + op_name + ".shape", op_name, "shape or options are", [&] {
                validate_moe_tp_shape(s, num_ranks, o, op_name, gemm_out);
                // Every member's push and GEMM kernels spin on the others': all must be resident at once.
                tp_detail::check_sm_budget_share(*world, o.sm_budget, op_name);
                budget = tp_detail::resolve_sm_budget(o.sm_budget, world->sm_budget());
                timeouts = detail::moe_tp_timeouts(world->timeout(), o.timeout);
                // Uniform over the team (the members count each other's blocks): from the world's shared budget.
                comm_blocks = o.comm_blocks > 0 ? o.comm_blocks : std::clamp(world->shared_sm_budget() / 8, 1, 16);
                WEFT_CHECK(budget - comm_blocks >= 1, op_name << ": the SM budget " << budget
                                                              << " leaves no SM for the GEMM beside " << comm_blocks
                                                              << " communication CTAs (options.comm_blocks)");
                mine = {comm_blocks, s.max_tokens, s.hidden, s.num_experts, s.topk};
                return detail::fields_record(mine);
            });
        static constexpr const char* kFields[] = {
            "communication CTAs (options.comm_blocks, else the SM budget / 8: "
            "pass the same options.comm_blocks on every member)",
            "shape.max_tokens", "shape.hidden", "shape.num_experts", "shape.topk"};
        detail::check_member_fields(team, all, mine, kFields, op);
        alone = num_ranks == 1;
        gemm_budget = alone ? budget : budget - comm_blocks;  // >= 1: checked above, before the members compared
        rows_capacity = moe_gathered_rows(s.max_tokens, s.topk, s.num_experts, 1);
        if (!alone && !tp_detail::streams_may_share_queues(*world)) {
            side = streams.add_stream();
            fork = streams.add_event();
            join = streams.add_event();
        }
        first_call_pending = num_ranks > 1 && world->max_ranks_per_device() > 1;
    }

    GroupedGemmOptions gemm_options(int64_t tokens) const {
        GroupedGemmOptions g;
        g.sm_budget = gemm_budget;
        g.config = options.config;
        g.expected_rows_per_group = std::max<int64_t>(1, tokens * shape.topk / shape.num_experts);
        g.timeout = options.timeout;
        return g;
    }

    uint64_t wait_timeout_ns() const { return timeouts.wait_ns; }

    /// Loads every kernel a call launches, before anything can spin (lazy loading behind a waiting kernel can
    /// deadlock): alone, `alone_kernel`; over a team, the GEMM of `gemm_spec`, `team_kernels` and the epoch advance.
    /// Then logs the schedule (`alone_text`, or the communication CTAs as `comm_role`).
    void load_kernels(const char* alone_kernel, const jit::KernelSpec& gemm_spec,
                      std::initializer_list<const char*> team_kernels, const char* alone_text, const char* comm_role) {
        if (alone) {
            (void)moe_kernel(alone_kernel);
        } else {
            gemm = &ops::detail::gemm_jit_kernel(gemm_spec);
            for (const char* k : team_kernels) (void)moe_kernel(k);
            (void)ops::detail::gemm_jit_kernel(gemm_advance_epoch_spec());
        }
        WEFT_LOG_INFO(op << ": " << tp_detail::config_text(config) << ", "
                         << (alone ? std::string(alone_text) : std::to_string(comm_blocks) + " " + comm_role)
                         << ", SM budget " << budget << ", team of " << num_ranks);
    }

    /// The call's grouped GEMM launch with its pipeline waits bounded by timeouts.pipeline_ns: longer than every peer
    /// wait (layer 0's producer waits for the members' pushes while its consumers wait for the producer; at the
    /// grouped GEMM's own bound, WEFT_TIMEOUT_MS or 10 s, a peer slower than that trapped them with no diagnostic).
    ops::detail::GroupedGemmLaunch prepare_gemm(const GroupedGemmProblem& p, const TensorView& a, const TensorView& b,
                                                const TensorView& d, const int32_t* offsets, const int32_t* counts,
                                                const GroupedGemmOptions& go) const {
        ops::detail::GroupedGemmLaunch gl =
            ops::detail::prepare_grouped_gemm_launch(p, a, b, d, offsets, counts, num_sms(), go);
        gl.args.timeout_ns = timeouts.pipeline_ns;
        return gl;
    }

    DeviceCtx wait_ctx() const {
        DeviceCtx c = ctx;
        c.timeout_ns = wait_timeout_ns();
        return c;
    }

    template <class T>
    T* peer(T* local, int team_rank) const {
        T* p = world->heap().symm_at(local, team.world_rank(team_rank));
        WEFT_CHECK(p != nullptr, op << ": the symmetric buffer of team rank " << team_rank << " is not reachable");
        return p;
    }

    /// The stream of this call's push or combine: the side stream, made to wait for `stream`'s work so far, where
    /// there is one; else `stream` itself (the push or combine then runs in order with the GEMM).
    cudaStream_t fork_comm(cudaStream_t stream) {
        if (side == nullptr) return stream;
        WEFT_CUDA_CHECK(cudaEventRecord(fork, stream));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(side, fork, 0));
        return side;
    }
    /// `stream` waits for the side stream's work (nothing to wait for without one).
    void join_comm(cudaStream_t stream) {
        if (side == nullptr) return;
        WEFT_CUDA_CHECK(cudaEventRecord(join, side));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, join, 0));
    }

    /// Ranks sharing a GPU: the first call ends on every member before any launches more (a member's first launch
    /// could stay queued behind a peer's spinning kernel: kernels/gemm_rs/README.md, "Ranks sharing a GPU").
    void after_call(cudaStream_t stream) {
        heap.note_use(stream);  // the release waits for this call (a side stream joined `stream`)
        if (!first_call_pending) return;
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
        if (capture != cudaStreamCaptureStatusNone) return;
        first_call_pending = false;
        world->sync_and_check(stream);  // in relaxed capture mode itself
        team.barrier();
    }
};

}  // namespace

// ---- layer 0 ----

struct MoeAgGroupedGemm::State : MoeLayerBase {
    unsigned short* gathered = nullptr;  // symmetric [rows_capacity, hidden]
    uint64_t* arrived = nullptr;         // [W]
    uint64_t* signatures = nullptr;      // [W]: each member's call signature (moe_call_signature), from its push
    int32_t* routing_words = nullptr;    // counts, offsets, gather_index, slot_rows
    MoeRouting routing;
    MoeRoutingStatus* status_host = nullptr;
    MoeRoutingStatus* status_dev = nullptr;

    State(const Team& t, const MoeTpShape& s, const MoeTpOptions& o)
        : MoeLayerBase(t, "moe_ag_grouped_gemm", DType::kBF16, s, o) {}
    ~State() {
        heap.free_all();
        weft::detail::host_mapped_free(status_host);
    }
};

MoeAgGroupedGemm::MoeAgGroupedGemm(World& world, const MoeTpShape& shape, const MoeTpOptions& options)
    : MoeAgGroupedGemm(world.team(), shape, options) {}

MoeAgGroupedGemm::MoeAgGroupedGemm(const Team& team, const MoeTpShape& shape, const MoeTpOptions& options)
    : s_(std::make_unique<State>(team, shape, options)) {
    State& s = *s_;
    const int64_t e = shape.num_experts;
    s.gathered = static_cast<unsigned short*>(
        s.heap.alloc(static_cast<uint64_t>(s.rows_capacity * shape.hidden) * sizeof(unsigned short)));
    uint64_t* words = s.heap.alloc_signals(static_cast<uint64_t>(3 * s.num_ranks + 1));
    s.arrived = words;
    s.consumed = words + s.num_ranks;
    s.epoch = words + 2 * s.num_ranks;
    s.signatures = s.epoch + 1;
    const int64_t index_words = e + (e + 1) + s.rows_capacity + shape.max_tokens * shape.topk;
    s.routing_words = static_cast<int32_t*>(s.heap.alloc(static_cast<uint64_t>(index_words) * sizeof(int32_t)));
    s.routing.counts = s.routing_words;
    s.routing.offsets = s.routing.counts + e;
    s.routing.gather_index = s.routing.offsets + e + 1;
    s.routing.slot_rows = s.routing.gather_index + s.rows_capacity;
    s.routing.num_experts = e;
    s.routing.rows_capacity = s.rows_capacity;
    s.routing.topk = shape.topk;
    tp_detail::check_peers_reachable(team, s.gathered, s.op);
    // From the process's pool, not cudaHostAlloc: that would wait for kernels spinning anywhere on the GPU.
    static_assert(sizeof(MoeRoutingStatus) <= weft::detail::kHostMappedBlockBytes);
    const weft::detail::HostMappedBlock status_block = weft::detail::host_mapped_alloc(sizeof(MoeRoutingStatus));
    s.status_host = static_cast<MoeRoutingStatus*>(status_block.host);
    *s.status_host = MoeRoutingStatus{};
    s.status_dev = static_cast<MoeRoutingStatus*>(status_block.device);

    GroupedGemmProblem p;
    p.layout = GroupedLayout::kContiguous;
    p.groups = e;
    p.rows = s.rows_capacity;
    p.n = shape.ffn;
    p.k = shape.hidden;
    // The GEMM's producer waits for each tile's rows (GatheredWaitScheduler): a waiting grouped kernel's config. Alone,
    // the rows are gathered before a plain grouped GEMM.
    GroupedGemmOptions go = s.gemm_options(shape.max_tokens);
    if (!s.alone) go.wait = GroupedWaitParams{};  // planned as a waiting call
    s.config = plan_grouped_gemm(p, num_sms(), go).config;
    for (const char* k : {"routing_count", "routing_place"}) (void)moe_kernel(k);
    s.load_kernels("gather", detail::moe_ag_gemm_kernel_spec(s.config), {"push", "notify"}, "gather then GEMM",
                   "push CTAs");
    team.barrier();
}

MoeAgGroupedGemm::~MoeAgGroupedGemm() = default;

MoeRouting MoeAgGroupedGemm::routing() const { return s_->routing; }
int64_t MoeAgGroupedGemm::rows_capacity() const { return s_->rows_capacity; }
const GemmConfig& MoeAgGroupedGemm::config() const { return s_->config; }
const MoeRoutingStatus& MoeAgGroupedGemm::routing_status() const { return *s_->status_host; }

void MoeAgGroupedGemm::run(const TensorView& x_local, const TensorView& topk_idx, const TensorView& w,
                           const TensorView& y, cudaStream_t stream) {
    WEFT_NVTX_RANGE("moe_ag_grouped_gemm");
    State& s = *s_;
    s.refuse_after_abort(/*waits_alone=*/true);  // at every team size, a team of one too
    const char* op = s.op;
    const int64_t h = s.shape.hidden, f = s.shape.ffn, e = s.shape.num_experts, topk = s.shape.topk;
    check_matrix(x_local, op, "x_local", DType::kBF16, -1, h, false);
    const int64_t tpr = x_local.dim(0);
    WEFT_CHECK(tpr >= 1 && tpr <= s.shape.max_tokens / s.num_ranks,
               op << ": x_local must have 1 .. max_tokens / W = " << s.shape.max_tokens / s.num_ranks << " rows, got "
                  << x_local.describe());
    const int64_t m = tpr * s.num_ranks;
    check_dense(topk_idx, op, "topk_idx", DType::kI32, m, topk);
    WEFT_CHECK(
        w.ndim == 3 && w.dtype == DType::kBF16 && w.dim(0) == e && w.dim(1) == f && w.dim(2) == h,
        op << ": w must be bf16 [E, ffn, hidden] = [" << e << ", " << f << ", " << h << "], got " << w.describe());
    check_matrix(y, op, "y", DType::kBF16, s.rows_capacity, f);
    // The push reads x_local (beside the GEMM where there is a side stream) and the GEMM reads w while it writes y.
    ops::detail::check_apart(op, "y", y, {{"x_local", x_local}, {"w", w}},
                             "the push and the GEMM read it while the GEMM writes y");
    // This GPU's memory (a kernel would fault on the rest, and the peers wait for its rows until their bound).
    ops::detail::check_device_buffers(s.world->heap(),
                                      {{"x_local", x_local}, {"topk_idx", topk_idx}, {"w", w}, {"y", y}}, op, stream);
    const TensorView a_rows(s.gathered, DType::kBF16, {s.rows_capacity, h});
    const GroupedGemmProblem p = validate_grouped_gemm_args(GroupedLayout::kContiguous, a_rows, w, y, BLayout::kNK,
                                                            s.routing.offsets, s.routing.counts);
    const GroupedGemmOptions go = s.gemm_options(m);
    GroupedGemmOptions go_forced = go;
    go_forced.config = s.config;
    // Alone, only its checks are used: the launch is refused (if at all) before the route and the gather are enqueued.
    const ops::detail::GroupedGemmLaunch gl =
        s.prepare_gemm(p, a_rows, w, y, s.routing.offsets, s.routing.counts, go_forced);
    s.routing.tokens = m;  // once nothing more refuses the call: routing() names the last call that ran
    if (s.alone) {
        launch_route(static_cast<const int32_t*>(topk_idx.data), s.routing, 1, stream, s.status_dev);
        moe_detail::launch_gather(x_local, s.routing, a_rows, stream);
        ops::detail::grouped_gemm_contiguous_on_device(a_rows, w, y, BLayout::kNK, s.routing.offsets, s.routing.counts,
                                                       stream, go_forced);
        s.after_call(stream);
        return;
    }
    weft::moe::GatheredWaitParams wait{};
    wait.groups = gl.groups;
    wait.gather_index = s.routing.gather_index;
    wait.arrived = s.arrived;
    wait.epoch = s.epoch;
    wait.per_epoch = static_cast<uint64_t>(s.comm_blocks);
    wait.timeout_ns = s.wait_timeout_ns();
    wait.diag = s.ctx.diag;
    wait.tokens_per_rank = static_cast<int32_t>(tpr);
    wait.world_rank = s.ctx.world_rank;
    wait.num_ranks = s.num_ranks;

    weft::moe::MoePushArgs push{};
    push.ctx = s.wait_ctx();
    for (int q = 0; q < s.num_ranks; ++q) {
        push.dst[q] = s.peer(s.gathered, q);
        push.arrived[q] = s.peer(s.arrived + s.rank, q);
    }
    push.consumed = s.consumed;
    push.x = static_cast<const unsigned short*>(x_local.data);
    push.slot_rows = s.routing.slot_rows;
    push.epoch = s.epoch;
    push.ldx = x_local.stride(0);
    push.ldd = h;
    push.tokens_per_rank = static_cast<int32_t>(tpr);
    push.topk = static_cast<int32_t>(topk);
    push.k = static_cast<int32_t>(h);
    push.num_ranks = s.num_ranks;
    push.rank = s.rank;
    // What the members' calls must agree on: M and (on the device) the routing's counts; the shape's topk and hidden
    // were agreed at construction.
    const uint64_t descriptor = make_call_descriptor(CollectiveOp::kMoeAgGemm, 0, true, DType::kBF16,
                                                     static_cast<uint64_t>(m), call_descriptor_mix(0, topk));
    for (int q = 0; q < s.num_ranks; ++q) push.signature_at[q] = s.peer(s.signatures + s.rank, q);
    push.descriptor = descriptor;
    push.counts = s.routing.counts;
    push.num_experts = static_cast<int32_t>(e);

    weft::moe::MoeNotifyArgs notify{};
    for (int q = 0; q < s.num_ranks; ++q) notify.words[q] = s.peer(s.consumed + s.rank, q);
    notify.value = 1;
    notify.n = s.num_ranks;
    notify.num_experts = static_cast<int32_t>(e);
    notify.ctx = s.wait_ctx();
    notify.arrived = s.arrived;
    notify.signatures = s.signatures;
    notify.epoch = s.epoch;
    notify.per_epoch = static_cast<uint64_t>(s.comm_blocks);
    notify.descriptor = descriptor;
    notify.counts = s.routing.counts;

    // Launches only from here: nothing that can throw may sit between them (a peer waits for each on the device).
    gemm_advance_epoch(s.epoch, stream);
    launch_route(static_cast<const int32_t*>(topk_idx.data), s.routing, 1, stream, s.status_dev);
    moe_kernel("push").launch(launch_params(s.comm_blocks, kMoeThreads, s.fork_comm(stream)), push);
    ops::detail::launch_gemm_kernel(*s.gemm, gl.config, gl.maps, gl.args, gl.grid, wait,
                                    weft::gemm::NoEpilogueHookParams{}, stream);
    // This rank's gathered A is read: the members may push the next call's rows into it.
    moe_kernel("notify").launch(launch_params(1, 32, stream), notify);
    s.join_comm(stream);
    s.after_call(stream);
}

// ---- layer 1 ----

struct MoeGroupedGemmRs::State : MoeLayerBase {
    float* partial = nullptr;      // symmetric [rows_capacity, hidden] fp32
    uint64_t* done = nullptr;      // symmetric [E]
    uint32_t* counters = nullptr;  // [E]
    float* acc = nullptr;          // [max_tokens / W, hidden] fp32

    State(const Team& t, const MoeTpShape& s, const MoeTpOptions& o)
        : MoeLayerBase(t, "moe_grouped_gemm_rs", DType::kF32, s, o) {}
    ~State() { heap.free_all(); }
};

MoeGroupedGemmRs::MoeGroupedGemmRs(World& world, const MoeTpShape& shape, const MoeTpOptions& options)
    : MoeGroupedGemmRs(world.team(), shape, options) {}

MoeGroupedGemmRs::MoeGroupedGemmRs(const Team& team, const MoeTpShape& shape, const MoeTpOptions& options)
    : s_(std::make_unique<State>(team, shape, options)) {
    State& s = *s_;
    const int64_t e = shape.num_experts;
    s.partial =
        static_cast<float*>(s.heap.alloc(static_cast<uint64_t>(s.rows_capacity * shape.hidden) * sizeof(float)));
    // The counters return to zero at the end of every call (the group's last tile resets its own): they start as
    // the zeroed signal words after the others (two 32-bit counters a word), so no stream of this op zeroes them.
    const uint64_t counter_words = static_cast<uint64_t>((e + 1) / 2);
    uint64_t* words = s.heap.alloc_signals(static_cast<uint64_t>(e + s.num_ranks + 1) + counter_words);
    s.done = words;
    s.consumed = words + e;
    s.epoch = words + e + s.num_ranks;
    s.counters = reinterpret_cast<uint32_t*>(words + e + s.num_ranks + 1);
    if (!s.alone) {  // the waiting combine's accumulators (the combine of a team of one sums in registers)
        s.acc = static_cast<float*>(
            s.heap.alloc(static_cast<uint64_t>(shape.max_tokens / s.num_ranks * shape.hidden) * sizeof(float)));
    }
    tp_detail::check_peers_reachable(team, s.partial, s.op);

    GroupedGemmProblem p;
    p.layout = GroupedLayout::kContiguous;
    p.groups = e;
    p.rows = s.rows_capacity;
    p.n = shape.hidden;
    p.k = shape.ffn;
    p.out_dtype = DType::kF32;
    s.config = plan_grouped_gemm(p, num_sms(), s.gemm_options(shape.max_tokens)).config;
    WEFT_CHECK(s.config.out_dtype == DType::kF32, s.op << ": options.config must write f32 (the partial products)");
    s.load_kernels("combine_ready", detail::moe_gemm_rs_kernel_spec(s.config), {"combine", "wait"}, "GEMM then combine",
                   "combine CTAs");
    team.barrier();
}

MoeGroupedGemmRs::~MoeGroupedGemmRs() = default;

int64_t MoeGroupedGemmRs::rows_capacity() const { return s_->rows_capacity; }
const GemmConfig& MoeGroupedGemmRs::config() const { return s_->config; }

void MoeGroupedGemmRs::run(const TensorView& h, const TensorView& w, const MoeRouting& routing,
                           const TensorView& weights, const TensorView& out, cudaStream_t stream) {
    WEFT_NVTX_RANGE("moe_grouped_gemm_rs");
    State& s = *s_;
    s.refuse_after_abort(/*waits_alone=*/true);  // at every team size, a team of one too
    const char* op = s.op;
    const int64_t hid = s.shape.hidden, f = s.shape.ffn, e = s.shape.num_experts, topk = s.shape.topk;
    check_routing(routing, op);
    WEFT_CHECK(routing.num_experts == e && routing.topk == topk, op << ": routing must have num_experts = " << e
                                                                    << " and topk = " << topk << ", got "
                                                                    << routing.num_experts << " and " << routing.topk);
    const int64_t m = routing.tokens;
    WEFT_CHECK(m >= s.num_ranks && m % s.num_ranks == 0 && m <= s.shape.max_tokens,
               op << ": routing.tokens must be a positive multiple of the team's num_ranks " << s.num_ranks
                  << " up to max_tokens = " << s.shape.max_tokens << ", got " << m);
    WEFT_CHECK(routing.rows_capacity <= s.rows_capacity, op << ": routing.rows_capacity must be <= " << s.rows_capacity
                                                            << " (the op's), got " << routing.rows_capacity);
    check_matrix(h, op, "h", DType::kBF16, routing.rows_capacity, f, false);
    WEFT_CHECK(
        w.ndim == 3 && w.dtype == DType::kBF16 && w.dim(0) == e && w.dim(1) == hid && w.dim(2) == f,
        op << ": w must be bf16 [E, hidden, ffn] = [" << e << ", " << hid << ", " << f << "], got " << w.describe());
    check_dense(weights, op, "weights", DType::kF32, m, topk);
    const int64_t tpr = m / s.num_ranks;
    WEFT_CHECK(out.dtype == DType::kBF16 || out.dtype == DType::kF32,
               op << ": out must be bf16 or f32, got " << dtype_name(out.dtype));
    check_matrix(out, op, "out", out.dtype, tpr, hid);
    // The combine writes out (beside the GEMM where there is a side stream) while the GEMM reads h and w and its warps
    // read the weights and the routing's arrays.
    ops::detail::check_apart(op, "out", out,
                             {{"h", h},
                              {"w", w},
                              {"weights", weights},
                              {"routing.slot_rows", slot_rows_view(routing)},
                              {"routing.counts", counts_view(routing)},
                              {"routing.offsets", offsets_view(routing)}},
                             "the GEMM and the combine read it while the combine writes out");
    ops::detail::check_device_buffers(s.world->heap(),
                                      {{"h", h},
                                       {"w", w},
                                       {"weights", weights},
                                       {"out", out},
                                       {"routing.slot_rows", slot_rows_view(routing)},
                                       {"routing.counts", counts_view(routing)},
                                       {"routing.offsets", offsets_view(routing)}},
                                      op, stream);
    const TensorView d_rows(s.partial, DType::kF32, {routing.rows_capacity, hid});
    const GroupedGemmProblem p = validate_grouped_gemm_args(GroupedLayout::kContiguous, h, w, d_rows, BLayout::kNK,
                                                            routing.offsets, routing.counts);
    GroupedGemmOptions go = s.gemm_options(m);
    go.config = s.config;
    const ops::detail::GroupedGemmLaunch gl = s.prepare_gemm(p, h, w, d_rows, routing.offsets, routing.counts, go);
    weft::moe::GroupDoneParams hook{};
    hook.counters = s.counters;
    hook.done = s.done;
    hook.counts = routing.counts;
    hook.epoch = s.epoch;
    hook.tile_m = gl.config.tile_m;
    hook.tile_n = gl.config.tile_n;
    hook.n = static_cast<int32_t>(hid);
    hook.capacity = static_cast<int32_t>(routing.rows_capacity);

    weft::moe::MoeWaitArgs wait{};
    wait.ctx = s.wait_ctx();
    for (int q = 0; q < s.num_ranks; ++q) {
        wait.words[q] = s.consumed + q;
        wait.owner[q] = q;
    }
    wait.epoch = s.epoch;
    wait.per_epoch = static_cast<uint64_t>(s.comm_blocks);
    wait.lag = static_cast<uint64_t>(s.comm_blocks);  // the previous call's combines: (epoch - 1) * blocks
    wait.n = s.num_ranks;

    weft::moe::MoeCombineArgs c{};
    for (int q = 0; q < s.num_ranks; ++q) {
        c.partials[q] = s.peer(s.partial, q);
        c.done[q] = s.peer(s.done, q);
        c.consumed[q] = s.peer(s.consumed + s.rank, q);
        c.done_owner[q] = q;
    }
    c.slot_rows = routing.slot_rows;
    c.counts = routing.counts;
    c.offsets = routing.offsets;
    c.weights = static_cast<const float*>(weights.data);
    c.acc = s.acc;
    c.out = out.data;
    c.epoch = s.epoch;
    c.ctx = s.wait_ctx();
    c.ldp = hid;
    c.ldo = out.stride(0);
    c.num_sources = s.num_ranks;
    c.num_experts = static_cast<int32_t>(e);
    c.topk = static_cast<int32_t>(topk);
    c.n = static_cast<int32_t>(hid);
    c.token_begin = static_cast<int32_t>(tpr * s.rank);
    c.tokens = static_cast<int32_t>(tpr);
    c.rows = static_cast<int32_t>(routing.rows_capacity);
    c.mode = MoeCombineMode::kWeightedSum;
    c.out_f32 = out.dtype == DType::kF32 ? 1 : 0;

    if (s.alone) {  // no peer reads the partial products, and the combine waits for nothing: the GEMM is before it
        ops::detail::grouped_gemm_contiguous_on_device(h, w, d_rows, BLayout::kNK, routing.offsets, routing.counts,
                                                       stream, go);
        moe_kernel("combine_ready").launch(launch_params(moe_detail::memory_grid(tpr), kMoeThreads, stream), c);
        s.after_call(stream);
        return;
    }

    // Launches only from here.
    gemm_advance_epoch(s.epoch, stream);
    const cudaStream_t comm = s.fork_comm(stream);  // forked after the epoch advance, as the wait kernel below
    // The members' combines of the previous call have read this rank's partial products.
    moe_kernel("wait").launch(launch_params(1, 32, stream), wait);
    ops::detail::launch_gemm_kernel(*s.gemm, gl.config, gl.maps, gl.args, gl.grid, gl.groups, hook, stream);
    moe_kernel("combine").launch(launch_params(s.comm_blocks, kMoeThreads, comm), c);
    s.join_comm(stream);
    s.after_call(stream);
}

namespace detail {

MoeTpTimeouts moe_tp_timeouts(std::chrono::milliseconds world_timeout, std::chrono::milliseconds option) {
    WEFT_CHECK(option.count() >= 0, "moe_tp: options.timeout must be >= 0, got " << option.count() << " ms");
    const auto ms =
        static_cast<uint64_t>(std::max<int64_t>(1, option.count() > 0 ? option.count() : world_timeout.count()));
    MoeTpTimeouts t;
    t.wait_ns = ms * 1000000ull;
    t.pipeline_ns = 2 * t.wait_ns;
    return t;
}

jit::KernelSpec moe_ag_gemm_kernel_spec(const GemmConfig& config, const std::string& arch) {
    WEFT_CHECK(is_valid_grouped_wait(config),
               "moe_ag_grouped_gemm: invalid config for its waiting grouped kernel " << format_gemm_config(config));
    jit::KernelSpec spec = gemm_kernel_spec(config, "weft::kernels::gemm::GatheredWaitScheduler",
                                            "weft::kernels::gemm::NoEpilogueHook", arch);
    spec.header = "moe_tp/moe_tp_gemm.cuh";
    return spec;
}

jit::KernelSpec moe_gemm_rs_kernel_spec(const GemmConfig& config, const std::string& arch) {
    WEFT_CHECK(is_valid_grouped(config), "moe_grouped_gemm_rs: invalid grouped config " << format_gemm_config(config));
    jit::KernelSpec spec =
        gemm_kernel_spec(config, "weft::kernels::gemm::GroupedScheduler", "weft::kernels::gemm::GroupDoneHook", arch);
    spec.header = "moe_tp/moe_tp_gemm.cuh";
    return spec;
}

}  // namespace detail

}  // namespace weft::ops
