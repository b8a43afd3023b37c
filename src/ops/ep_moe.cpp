// SPDX-License-Identifier: MIT
// weft::ops::ep::MoeBlock: planning, workspaces and the fused and sequential launches of a MoE block.
#include "weft/ops/ep_moe.hpp"

#include <algorithm>
#include <cstring>
#include <future>
#include <optional>
#include <utility>
#include <vector>

#include "collective_workspace.hpp"
#include "ep_buffer.hpp"
#include "grouped_gemm_internal.hpp"
#include "tp_common.hpp"
#include "weft/common/math.hpp"
#include "weft/detail/gemm_launch.hpp"
#include "weft/detail/host_mapped_pool.hpp"
#include "weft/detail/rendezvous_protocol.hpp"
#include "weft/jit/kernel.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/grouped_gemm.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/stream.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops::ep {
namespace {

constexpr int kSwigluThreads = 256;

GroupedGemmProblem grouped_problem(int64_t groups, int64_t rows, int64_t n, int64_t k) {
    GroupedGemmProblem p;
    p.layout = GroupedLayout::kContiguous;
    p.groups = groups;
    p.rows = rows;
    p.n = n;
    p.k = k;
    p.b_layout = BLayout::kNK;
    p.in_dtype = DType::kBF16;
    p.out_dtype = DType::kBF16;
    return p;
}

// Places the block's private arrays in one allocation (each at a multiple of 256 bytes).
struct MoeLayout {
    int64_t gate_up_out = 0, activation = 0, expert_out = 0;
    int64_t epoch = 0, counts_ready = 0, scratch = 0, expert_ready = 0, expert_rows = 0, tile_done = 0;
    int64_t bytes = 0;
    static MoeLayout make(const MoePlan& plan, int64_t local_experts, int64_t hidden, int64_t ffn) {
        MoeLayout l;
        int64_t at = 0;
        const auto take = [&at](int64_t n) {
            const int64_t here = at;
            at += round_up(std::max<int64_t>(n, 1), 256);
            return here;
        };
        const int64_t rows = plan.max_recv_rows;
        l.gate_up_out = take(rows * 2 * ffn * 2);
        l.activation = take(rows * ffn * 2);
        l.expert_out = take(rows * hidden * 2);
        l.epoch = take(8);
        l.counts_ready = take(8);
        l.scratch = take(8);
        l.expert_ready = take(local_experts * 8);
        l.expert_rows = take(local_experts * 4);
        l.tile_done = take(local_experts * plan.tile_stride * 8);
        l.bytes = at;
        return l;
    }
};

}  // namespace

MoePlan plan_moe_block(const MoeConfig& config, int num_ranks, int num_sms) {
    WEFT_CHECK(config.ep.normal, "ep::MoeBlock: config.ep.normal must be true (the block dispatches in normal mode)");
    WEFT_CHECK(config.ffn > 0 && config.ffn % 8 == 0,
               "ep::MoeBlock: config.ffn (each expert's intermediate size) must be a positive multiple of 8, got "
                   << config.ffn);
    WEFT_CHECK(num_sms > 0, "ep::MoeBlock: num_sms must be positive, got " << num_sms);
    Config ep = config.ep;
    ep.low_latency = false;
    const Geometry g = resolve_geometry(ep, num_ranks, 0);
    const int64_t local = g.local_experts();
    const int64_t expected_rows = std::max<int64_t>(1, expected_recv_rows(ep, num_ranks) / std::max<int64_t>(local, 1));
    GroupedGemmOptions options;
    options.expected_rows_per_group = expected_rows;
    MoePlan plan;
    plan.max_recv_rows = g.max_recv_rows;
    // The up-projection waits for each expert's rows (GroupedWaitScheduler): planned as a call with a wait.
    GroupedGemmOptions up_options = options;
    up_options.wait = GroupedWaitParams{};
    plan.up = plan_grouped_gemm(grouped_problem(local, g.max_recv_rows, 2 * int64_t{config.ffn}, g.hidden), num_sms,
                                up_options)
                  .config;
    plan.down =
        plan_grouped_gemm(grouped_problem(local, g.max_recv_rows, g.hidden, config.ffn), num_sms, options).config;
    plan.tile_stride = static_cast<int32_t>(std::max<int64_t>(1, ceil_div(g.max_recv_rows, plan.down.tile_m)));
    plan.down_n_tiles = static_cast<int32_t>(ceil_div(int64_t{g.hidden}, plan.down.tile_n));
    return plan;
}

int moe_comm_sms(int num_tokens, int sm_budget) {
    WEFT_CHECK(sm_budget >= 2,
               "ep::MoeBlock: the rank's SM budget must be at least 2 (communication and the GEMMs "
               "run side by side), got "
                   << sm_budget);
    return std::max(1, std::min(default_normal_sms(num_tokens, sm_budget - 1), sm_budget / 4));
}

int MoeGrids::resident() const {
    const int gemm = std::max({up, swiglu, down});
    return fused ? comm + gemm : std::max(comm, gemm);
}

MoeGrids moe_block_grids(const MoeConfig& config, const MoePlan& plan, int num_ranks, int num_tokens, int sm_budget,
                         const MoeOptions& options) {
    WEFT_CHECK(num_ranks > 0 && config.ep.num_experts > 0 && config.ep.num_experts % num_ranks == 0,
               "ep::MoeBlock: config.ep.num_experts (" << config.ep.num_experts << ") must be a positive multiple of "
                                                       << "the ranks (" << num_ranks << ")");
    const int comm = moe_comm_sms(num_tokens, sm_budget);  // checks the budget
    WEFT_CHECK(options.comm_sms >= 0 && options.comm_sms < sm_budget,
               "ep::MoeBlock::forward: options.comm_sms must be in [0, SM budget "
                   << sm_budget << ") (0 = default), got " << options.comm_sms);
    MoeGrids g;
    g.fused = options.fused && num_ranks > 1;  // one rank: nothing to overlap (MoeOptions::fused)
    g.comm = options.comm_sms > 0 ? options.comm_sms : comm;
    g.gemm_sms = g.fused ? sm_budget - g.comm : sm_budget;
    const int64_t local = config.ep.num_experts / num_ranks;
    const int64_t ffn = config.ffn;
    const int64_t hidden = config.ep.hidden;
    // The launches' own planning (grouped_gemm_contiguous: the grid of a forced config within sm_budget).
    GroupedGemmOptions o;
    o.sm_budget = g.gemm_sms;
    o.config = plan.up;
    g.up = plan_grouped_gemm(grouped_problem(local, plan.max_recv_rows, 2 * ffn, hidden), g.gemm_sms, o).grid;
    o.config = plan.down;
    g.down = plan_grouped_gemm(grouped_problem(local, plan.max_recv_rows, hidden, ffn), g.gemm_sms, o).grid;
    g.swiglu = g.gemm_sms;
    return g;
}

uint64_t moe_gemm_timeout_ns(std::chrono::milliseconds world_timeout) {
    WEFT_CHECK(world_timeout.count() > 0,
               "ep::MoeBlock: the World's timeout must be positive, got " << world_timeout.count() << " ms");
    // Twice the World's bound, at most the 30 days a GEMM's timeout may be (the grouped GEMM refuses more).
    const uint64_t ms = std::min<uint64_t>(2 * static_cast<uint64_t>(world_timeout.count()),
                                           static_cast<uint64_t>(weft::detail::rendezvous::kMaxWaitMs));
    return ms * 1000000ull;
}

jit::KernelSpec moe_swiglu_kernel_spec(const std::string& arch) {
    jit::KernelSpec spec;
    spec.header = "ep/moe.cuh";
    spec.instantiation = "weft::kernels::ep::moe_swiglu<" + std::to_string(kSwigluThreads) + ">";
    spec.description = "ep::moe_swiglu";
    spec.arch = arch;
    return spec;
}

struct MoeBlock::Impl {
    World* world = nullptr;
    ops::detail::AbortMark abort_mark;  // forward() refuses once an abort was cleared after the block was made
    Team team;
    MoeConfig config;
    MoePlan plan;
    int local_experts = 0;
    std::unique_ptr<Buffer> buffer;
    std::optional<NormalHandle> handle;
    // The block's one stream of its own (the GEMMs; also its allocation): with ranks sharing a GPU every stream a
    // rank adds may share a hardware queue with a peer's (docs/runtime.md, "Hardware queues").
    cudaStream_t gemm_stream = nullptr;
    // Ranks of one process sharing a GPU (tp_detail::streams_may_share_queues): the fused form's GEMMs run on the
    // caller's stream after the dispatch, and the combine after them (no wait between streams, whose queues a peer's
    // spinning kernel may hold up); the kernels and their signals are the fused form's, only the overlap is lost.
    bool serial = false;
    cudaEvent_t fork = nullptr;
    cudaEvent_t join = nullptr;
    MoeLayout layout;
    uint8_t* device = nullptr;
    GroupedStatus* status_host = nullptr;  // [2]: up, down (host-mapped)
    GroupedStatus* status_dev = nullptr;
    jit::Kernel* k_swiglu = nullptr;
    uint64_t gemm_timeout_ns = 0;  // moe_gemm_timeout_ns(the World's timeout)
    // Ranks sharing a GPU: the first call of each form (0 sequential, 1 fused) ends on every member before the rank
    // launches more, as in the other fused ops.
    ops::tp_detail::FirstCallSync first_calls;

    Impl() = default;
    Impl(const Impl&) = delete;
    Impl& operator=(const Impl&) = delete;
    ~Impl();

    template <class T>
    T* at(int64_t offset) const {
        return reinterpret_cast<T*>(device + offset);
    }
    TensorView gate_up_out() const {
        return TensorView(at<uint16_t>(layout.gate_up_out), DType::kBF16,
                          {plan.max_recv_rows, 2 * int64_t{config.ffn}});
    }
    TensorView activation() const {
        return TensorView(at<uint16_t>(layout.activation), DType::kBF16, {plan.max_recv_rows, int64_t{config.ffn}});
    }
    TensorView expert_out() const {
        return TensorView(at<uint16_t>(layout.expert_out), DType::kBF16,
                          {plan.max_recv_rows, int64_t{config.ep.hidden}});
    }

    void swiglu(cudaStream_t stream, int grid) const {
        weft::ep::MoeSwigluArgs a{};
        a.gate_up = at<uint16_t>(layout.gate_up_out);
        a.gate_up_stride = 2 * int64_t{config.ffn};
        a.out = at<uint16_t>(layout.activation);
        a.out_stride = config.ffn;
        a.rows_end = handle->expert_offsets() + local_experts;
        a.max_rows = static_cast<int32_t>(plan.max_recv_rows);
        a.ffn = config.ffn;
        jit::LaunchParams lp;
        lp.grid = dim3(static_cast<unsigned>(std::max(grid, 1)), 1, 1);
        lp.block = dim3(kSwigluThreads, 1, 1);
        lp.stream = stream;
        k_swiglu->launch(lp, a);
    }

    GroupedGemmOptions gemm_options(const GemmConfig& c, int sm_budget, int which) const {
        GroupedGemmOptions o;
        o.config = c;
        o.sm_budget = sm_budget;
        o.status = status_dev + which;
        return o;
    }
    /// The fused form's: pipeline waits bounded by gemm_timeout_ns (the GEMMs run beside kernels that wait for peers
    /// for up to the World's timeout; at the grouped GEMM's own 10 s bound a slow peer trapped them undiagnosed).
    GroupedGemmOptions fused_gemm_options(const GemmConfig& c, int sm_budget, int which) const {
        GroupedGemmOptions o = gemm_options(c, sm_budget, which);
        o.timeout = std::chrono::milliseconds(static_cast<int64_t>(gemm_timeout_ns / 1000000ull));
        return o;
    }
};

MoeBlock::MoeBlock(World& world, const MoeConfig& config) : MoeBlock(world.team(), config) {}

MoeBlock::MoeBlock(const Team& team, const MoeConfig& config) : impl_(std::make_unique<Impl>()) {
    const weft::RelaxedCaptureMode relaxed;  // its allocations and waits beside another rank thread's capture
    team.require_member("ep::MoeBlock");
    // The fused block's GEMMs wait on the dispatch's per-expert signals within one node; across nodes the Buffer
    // dispatches through the network (docs/multinode.md, "EP across nodes"), which the block does not drive yet.
    WEFT_CHECK(team.num_nodes() == 1, "ep::MoeBlock: the team spans "
                                          << team.num_nodes() << " nodes (" << team.describe()
                                          << "); the MoE block runs within one node. Across nodes, use ep::Buffer's "
                                             "normal dispatch and combine with grouped_gemm between them");
    Impl& m = *impl_;
    m.world = &team.world();
    m.abort_mark.note(*m.world);
    m.team = team;
    m.config = config;
    m.config.ep.low_latency = false;
    int device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    int num_sms = 0;
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
    // A member whose config is refused here still meets the others (its error in place of an empty record), so that
    // every member throws at once instead of waiting for it in the Buffer's construction below.
    std::exception_ptr invalid;
    std::string why_invalid;
    try {
        m.plan = plan_moe_block(m.config, team.num_ranks(), std::min(num_sms, m.world->sm_budget()));
        WEFT_CHECK(m.world->sm_budget() >= 2,
                   "ep::MoeBlock: the rank's SM budget must be at least 2 (communication and "
                   "the GEMMs run side by side), got "
                       << m.world->sm_budget());
    } catch (const Error& e) {
        invalid = std::current_exception();
        why_invalid = e.what();
    }
    if (team.num_ranks() > 1) {
        const std::vector<std::vector<uint8_t>> all =
            team.all_gather("weft.ops.ep.moe_block", std::vector<uint8_t>(why_invalid.begin(), why_invalid.end()));
        if (invalid) std::rethrow_exception(invalid);
        for (int r = 0; r < team.num_ranks(); ++r) {
            const std::vector<uint8_t>& theirs = all[static_cast<size_t>(r)];
            WEFT_CHECK(theirs.empty(), "ep::MoeBlock: world rank " << team.world_rank(r) << "'s MoeConfig is invalid ("
                                                                   << std::string(theirs.begin(), theirs.end()) << ")");
        }
    }
    if (invalid) std::rethrow_exception(invalid);
    m.local_experts = m.config.ep.num_experts / team.num_ranks();
    if (m.world->same_process() && m.world->num_ranks_on_device() > 1 &&
        int64_t{m.world->sm_budget()} * m.world->num_ranks_on_device() > num_sms) {
        WEFT_LOG_WARN("ep::MoeBlock: " << m.world->num_ranks_on_device()
                                       << " ranks share this GPU with an SM budget of " << m.world->sm_budget()
                                       << " each, more than its " << num_sms
                                       << " SMs: their kernels, which wait for each other, may not all be resident "
                                          "(the default budget is the SMs / ranks on the GPU)");
    }
    m.gemm_timeout_ns = moe_gemm_timeout_ns(m.world->timeout());
    // The same on every member (a world-wide fact): the first-call synchronisation is collective.
    if (team.num_ranks() > 1 && m.world->max_ranks_per_device() > 1) m.first_calls.arm(2);

    // Every kernel of both forms, compiled in parallel and loaded before any of them can spin (the Buffer's
    // constructor ends at a barrier of the team, after which ranks may launch).
    const std::vector<jit::KernelSpec> gemms = {
        grouped_gemm_kernel_spec(m.plan.up, true, false), grouped_gemm_kernel_spec(m.plan.up, false, false),
        grouped_gemm_kernel_spec(m.plan.down, false, true), grouped_gemm_kernel_spec(m.plan.down, false, false)};
    {
        std::vector<std::future<void>> compiles;
        for (const jit::KernelSpec& s : gemms) {
            compiles.push_back(std::async(std::launch::async, [&s] { jit::compiler().compile(s); }));
        }
        const jit::KernelSpec swiglu = moe_swiglu_kernel_spec();
        compiles.push_back(std::async(std::launch::async, [swiglu] { jit::compiler().compile(swiglu); }));
        for (auto& f : compiles) f.get();
    }
    for (const jit::KernelSpec& s : gemms) ops::detail::gemm_jit_kernel(s);
    m.k_swiglu = &jit::compiler().get_kernel(moe_swiglu_kernel_spec());

    m.serial = ops::tp_detail::streams_may_share_queues(*m.world);
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&m.gemm_stream, cudaStreamNonBlocking));
    WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&m.fork, cudaEventDisableTiming));
    WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&m.join, cudaEventDisableTiming));
    m.layout = MoeLayout::make(m.plan, m.local_experts, m.config.ep.hidden, m.config.ffn);
    m.device = detail::device_alloc_zeroed(static_cast<uint64_t>(m.layout.bytes), m.gemm_stream);
    // The epoch kernel, loaded here on the spare word (the epoch itself counts forward calls only).
    gemm_advance_epoch(m.at<uint64_t>(m.layout.scratch), m.gemm_stream);
    WEFT_CUDA_CHECK(cudaStreamSynchronize(m.gemm_stream));

    // From the process's pool, not cudaHostAlloc: that would wait for kernels spinning anywhere on the GPU.
    static_assert(2 * sizeof(GroupedStatus) <= weft::detail::kHostMappedBlockBytes);
    const weft::detail::HostMappedBlock words = weft::detail::host_mapped_alloc(2 * sizeof(GroupedStatus));
    m.status_host = static_cast<GroupedStatus*>(words.host);
    m.status_dev = static_cast<GroupedStatus*>(words.device);

    m.buffer = std::make_unique<Buffer>(team, m.config.ep);  // collective; ends at a team barrier
    m.handle.emplace(m.buffer->make_normal_handle());        // collective
}

// Also what a constructor that threw part way leaves behind (the members it had made by then). The handle's and the
// Buffer's destructors are collective: after a failure on one rank only, its peers' wait there ends at the timeout.
MoeBlock::Impl::~Impl() {
    const weft::RelaxedCaptureMode relaxed;  // its waits and frees beside another rank thread's capture
    Impl& m = *this;
    try {
        if (m.gemm_stream != nullptr) WEFT_CUDA_CHECK(cudaStreamSynchronize(m.gemm_stream));
    } catch (const std::exception& e) {
        WEFT_LOG_ERROR("ep::MoeBlock: waiting for the GEMM stream failed: " << e.what());
    }
    m.handle.reset();  // collective, before the Buffer
    m.buffer.reset();
    if (m.device != nullptr) {
        cudaFreeAsync(m.device, m.gemm_stream);
        cudaStreamSynchronize(m.gemm_stream);
    }
    weft::detail::host_mapped_free(m.status_host);
    if (m.fork != nullptr) cudaEventDestroy(m.fork);
    if (m.join != nullptr) cudaEventDestroy(m.join);
    if (m.gemm_stream != nullptr) cudaStreamDestroy(m.gemm_stream);
}

MoeBlock::~MoeBlock() = default;

const MoeConfig& MoeBlock::config() const { return impl_->config; }
const MoePlan& MoeBlock::plan() const { return impl_->plan; }
Buffer& MoeBlock::buffer() { return *impl_->buffer; }
NormalHandle& MoeBlock::handle() { return *impl_->handle; }
TensorView MoeBlock::gate_up_out() const { return impl_->gate_up_out(); }
TensorView MoeBlock::activation() const { return impl_->activation(); }
TensorView MoeBlock::expert_out() const { return impl_->expert_out(); }

void MoeBlock::check() const {
    impl_->buffer->check();
    for (int i = 0; i < 2; ++i) {
        GroupedStatus s;
        std::memcpy(&s, const_cast<const GroupedStatus*>(impl_->status_host + i), sizeof(s));
        const std::string what = describe_grouped_status(s);
        WEFT_CHECK(what.empty(), "ep::MoeBlock: " << (i == 0 ? "up" : "down") << "-projection " << what);
    }
}

void MoeBlock::sync_and_check(cudaStream_t stream) {
    impl_->buffer->sync_and_check(stream);
    check();
}

void MoeBlock::forward(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
                       const MoeWeights& weights, const TensorView& out, cudaStream_t stream,
                       const MoeOptions& options) {
    WEFT_NVTX_RANGE("ep moe block");
    Impl& m = *impl_;
    m.abort_mark.check(*m.world, "ep::MoeBlock::forward",
                       "make a new World (its Buffer's signal words are never cleared)");
    const Geometry& g = m.buffer->geometry();
    const int64_t ffn = m.config.ffn;
    // Everything the launches below could refuse is checked first: once the dispatch is out, every rank must reach
    // its combine. (A device-reported error of an earlier call is not refused here: the dispatch logs it, check()
    // throws it; Buffer::Impl::enter says why.)
    detail::check_matrix("ep::MoeBlock::forward", "x", x, DType::kBF16, g.hidden, true);
    const int t = detail::check_tokens("ep::MoeBlock::forward", g, topk_idx, x.dim(0), "x");
    detail::check_matrix("ep::MoeBlock::forward", "topk_weights", topk_weights, DType::kF32, g.topk, false);
    WEFT_CHECK(topk_weights.dim(0) == t,
               "ep::MoeBlock::forward: topk_weights has " << topk_weights.dim(0) << " rows but x has " << t);
    detail::check_matrix("ep::MoeBlock::forward", "out", out, DType::kBF16, g.hidden, true);
    WEFT_CHECK(out.dim(0) == t, "ep::MoeBlock::forward: out must have x's " << t << " rows, got " << out.describe());
    WEFT_CHECK(weights.gate_up.ndim == 3 && weights.gate_up.dim(0) == m.local_experts &&
                   weights.gate_up.dim(1) == 2 * ffn && weights.gate_up.dim(2) == g.hidden,
               "ep::MoeBlock::forward: weights.gate_up must be bf16 [E_local, 2F, H] = ["
                   << m.local_experts << ", " << 2 * ffn << ", " << g.hidden << "], got "
                   << weights.gate_up.describe());
    WEFT_CHECK(weights.down.ndim == 3 && weights.down.dim(0) == m.local_experts && weights.down.dim(1) == g.hidden &&
                   weights.down.dim(2) == ffn,
               "ep::MoeBlock::forward: weights.down must be bf16 [E_local, H, F] = ["
                   << m.local_experts << ", " << g.hidden << ", " << ffn << "], got " << weights.down.describe());
    // x, topk_idx and topk_weights are the dispatch's (checked by it before it launches); the combine's out and the
    // GEMMs' weights would be refused or fault only after the dispatch is out.
    ops::detail::check_device_buffers(
        m.world->heap(), {{"out", out}, {"weights.gate_up", weights.gate_up}, {"weights.down", weights.down}},
        "ep::MoeBlock::forward", stream);
    const NormalHandle& h = *m.handle;
    // out inside the block's own buffers would race with its GEMMs and combine; the combine itself checks only y, and
    // only after the dispatch is out.
    ops::detail::check_apart("ep::MoeBlock::forward", "out", out,
                             {{"the block's received rows (recv_x)", h.recv_x()},
                              {"the block's gate_up_out", m.gate_up_out()},
                              {"the block's activation", m.activation()},
                              {"the block's expert_out", m.expert_out()}},
                             "the block writes them during the call");
    // Fused, the combine writes out (the caller's stream) while the GEMMs still read the weights (the block's stream).
    ops::detail::check_apart("ep::MoeBlock::forward", "out", out,
                             {{"weights.gate_up", weights.gate_up}, {"weights.down", weights.down}},
                             "the combine writes out while the GEMMs may still read the weights");
    try {
        validate_grouped_gemm_args(GroupedLayout::kContiguous, h.recv_x(), weights.gate_up, m.gate_up_out(),
                                   BLayout::kNK, h.expert_offsets(), h.expert_counts());
    } catch (const Error& e) {
        ops::detail::rethrow_with_op("ep::MoeBlock::forward (the up-projection's b: weights.gate_up)", e);
    }
    try {
        validate_grouped_gemm_args(GroupedLayout::kContiguous, m.activation(), weights.down, m.expert_out(),
                                   BLayout::kNK, h.expert_offsets(), h.expert_counts());
    } catch (const Error& e) {
        ops::detail::rethrow_with_op("ep::MoeBlock::forward (the down-projection's b: weights.down)", e);
    }
    // Every kernel of the call within the rank's SM budget (MoeGrids): with ranks sharing a GPU, all ranks' kernels
    // are resident together.
    const MoeGrids grids = moe_block_grids(m.config, m.plan, m.team.num_ranks(), t, m.world->sm_budget(), options);
    WEFT_CHECK(grids.resident() <= m.world->sm_budget(), "ep::MoeBlock::forward: the call's kernels would hold "
                                                             << grids.resident() << " CTAs at once, over the "
                                                             << "rank's SM budget " << m.world->sm_budget());
    const int comm = grids.comm;
    NormalHandle& hm = *m.handle;

    if (!grids.fused) {
        const int budget = grids.gemm_sms;
        NormalOptions comm_options;
        comm_options.num_sms = comm;
        m.buffer->dispatch(hm, x, topk_idx, topk_weights, stream, comm_options);
        ops::detail::grouped_gemm_contiguous_on_device(hm.recv_x(), weights.gate_up, m.gate_up_out(), BLayout::kNK,
                                                       hm.expert_offsets(), hm.expert_counts(), stream,
                                                       m.gemm_options(m.plan.up, budget, 0));
        m.swiglu(stream, grids.swiglu);
        ops::detail::grouped_gemm_contiguous_on_device(m.activation(), weights.down, m.expert_out(), BLayout::kNK,
                                                       hm.expert_offsets(), hm.expert_counts(), stream,
                                                       m.gemm_options(m.plan.down, budget, 1));
        m.buffer->combine(hm, m.expert_out(), out, stream, comm_options);
        m.first_calls.after_call(m.team, 0, stream);
        return;
    }

    // Fused: communication on `stream` with `comm` SMs, the GEMMs on the block's stream with the rest of the budget
    // (on `stream` too, after the dispatch, where the block runs serially: Impl::serial).
    const int gemm_sms = grids.gemm_sms;
    const cudaStream_t gemm_stream = m.serial ? stream : m.gemm_stream;
    if (!m.serial) {
        WEFT_CUDA_CHECK(cudaEventRecord(m.fork, stream));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(m.gemm_stream, m.fork, 0));
    }

    NormalOptions dispatch_options;
    dispatch_options.num_sms = comm;
    dispatch_options.fused.counts_ready = m.at<uint64_t>(m.layout.counts_ready);
    dispatch_options.fused.expert_ready = m.at<uint64_t>(m.layout.expert_ready);
    dispatch_options.fused.expert_rows = m.at<uint32_t>(m.layout.expert_rows);
    m.buffer->dispatch(hm, x, topk_idx, topk_weights, stream, dispatch_options);

    // This call's epoch: each fused dispatch raises counts_ready and every expert_ready word by one, so the up
    // projection waits for them to reach the number of forward calls.
    uint64_t* epoch = m.at<uint64_t>(m.layout.epoch);
    gemm_advance_epoch(epoch, gemm_stream);
    GroupedGemmOptions up = m.fused_gemm_options(m.plan.up, gemm_sms, 0);
    GroupedWaitParams wait{};
    wait.flags = m.at<uint64_t>(m.layout.expert_ready);
    wait.expected = 1;
    wait.value_mode = weft::gemm::SignalValueMode::kEpoch;
    wait.epoch = epoch;
    wait.groups_ready = m.at<uint64_t>(m.layout.counts_ready);
    wait.world_rank = m.world->rank();
    const DeviceCtx ctx = m.team.device_ctx();
    wait.diag = ctx.diag;
    wait.abort_flag = ctx.abort_flag;  // a peer's wait that gave up (or a dead peer) stops these waits too
    wait.timeout_ns = m.gemm_timeout_ns;
    up.wait = wait;
    ops::detail::grouped_gemm_contiguous_on_device(hm.recv_x(), weights.gate_up, m.gate_up_out(), BLayout::kNK,
                                                   hm.expert_offsets(), hm.expert_counts(), gemm_stream, up);
    m.swiglu(gemm_stream, grids.swiglu);
    GroupedGemmOptions down = m.fused_gemm_options(m.plan.down, gemm_sms, 1);
    GroupedTileSignalParams signal{};
    signal.flags = m.at<uint64_t>(m.layout.tile_done);
    signal.value = 1;
    signal.group_stride = m.plan.tile_stride;
    signal.mode = GroupedSignalMode::kAddPerGroupTileRow;
    signal.ctx = m.team.device_ctx();  // the down-projection's tiles in a traced World's timeline
    down.signal = signal;
    ops::detail::grouped_gemm_contiguous_on_device(m.activation(), weights.down, m.expert_out(), BLayout::kNK,
                                                   hm.expert_offsets(), hm.expert_counts(), gemm_stream, down);

    NormalOptions combine_options;
    combine_options.num_sms = comm;
    combine_options.fused.tile_done = m.at<uint64_t>(m.layout.tile_done);
    combine_options.fused.tile_stride = m.plan.tile_stride;
    combine_options.fused.tile_m = m.plan.down.tile_m;
    combine_options.fused.tile_target = static_cast<uint64_t>(m.plan.down_n_tiles);
    m.buffer->combine(hm, m.expert_out(), out, stream, combine_options);

    if (!m.serial) {
        WEFT_CUDA_CHECK(cudaEventRecord(m.join, m.gemm_stream));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, m.join, 0));
    }
    m.first_calls.after_call(m.team, 1, stream);
}

}  // namespace weft::ops::ep
