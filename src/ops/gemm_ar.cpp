// SPDX-License-Identifier: MIT
// weft::ops::GemmAr: small-M GEMM into a symmetric partial, then a one-shot all-reduce kernel.
#include "weft/ops/gemm_ar.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "collective_workspace.hpp"
#include "member_records.hpp"
#include "stream_key.hpp"
#include "tp_common.hpp"
#include "views_overlap.hpp"
#include "weft/common/collectives.hpp"
#include "weft/common/gemm_hook_params.hpp"
#include "weft/common/math.hpp"
#include "weft/common/tp_params.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {

namespace {
constexpr const char* kOp = "gemm_ar";
constexpr int64_t kMaxDim = kGemmMaxExtent;  // M, N and K of the GEMM
}  // namespace

void validate_gemm_ar_shape(const GemmArShape& s, int num_ranks, const GemmArOptions& o) {
    WEFT_CHECK(num_ranks >= 1 && num_ranks <= 8, "gemm_ar: the team's num_ranks must be in [1, 8], got " << num_ranks);
    WEFT_CHECK(s.max_m > 0 && s.max_m <= kMaxDim, "gemm_ar: shape.max_m must be positive, got " << s.max_m);
    WEFT_CHECK(s.n > 0 && s.n <= kMaxDim, "gemm_ar: shape.n must be in [1, 2^31 - 2^24], got " << s.n);
    WEFT_CHECK(s.k >= 8 && s.k % 8 == 0 && s.k <= kMaxDim,
               "gemm_ar: shape.k (this rank's K) must be a positive multiple of 8, got " << s.k);
    WEFT_CHECK(s.dtype == DType::kBF16 || s.dtype == DType::kF16,
               "gemm_ar: shape.dtype must be bf16 or f16, got " << dtype_name(s.dtype));
    if (o.partial_dtype) {
        WEFT_CHECK(*o.partial_dtype == s.dtype || *o.partial_dtype == DType::kF32,
                   "gemm_ar: options.partial_dtype must be " << dtype_name(s.dtype) << " or f32, got "
                                                             << dtype_name(*o.partial_dtype));
    }
    WEFT_CHECK(o.reduce_ctas >= 0, "gemm_ar: options.reduce_ctas must be >= 0 (0 = heuristic), got " << o.reduce_ctas);
    WEFT_CHECK(o.sm_budget >= 0, "gemm_ar: options.sm_budget must be >= 0 (0 = the world's), got " << o.sm_budget);
    if (o.config) tp_detail::check_forced_config(*o.config, s.dtype, o.partial_dtype.value_or(s.dtype), kOp);
}

namespace {

/// validate_gemm_ar_call's checks; returns the call's problem (M, and whether b's rows are back to back).
GemmProblem check_gemm_ar_call(const GemmArShape& s, const TensorView& a, const TensorView& b, const TensorView& c) {
    WEFT_CHECK(a.ndim == 2, "gemm_ar: a must be a 2-D [M, K] matrix, got " << a.describe());
    WEFT_CHECK(b.ndim == 2, "gemm_ar: b must be a 2-D [N, K] matrix, got " << b.describe());
    WEFT_CHECK(c.ndim == 2, "gemm_ar: c must be a 2-D [M, N] matrix, got " << c.describe());
    const int64_t m = a.dim(0);
    WEFT_CHECK(m >= 1 && m <= s.max_m, "gemm_ar: a must have 1 .. max_m = " << s.max_m << " rows, got " << a.describe());
    WEFT_CHECK(a.dim(1) == s.k, "gemm_ar: a must have K = " << s.k << " columns, got " << a.describe());
    WEFT_CHECK(a.dtype == s.dtype && b.dtype == s.dtype && c.dtype == s.dtype,
               "gemm_ar: a, b and c must be " << dtype_name(s.dtype) << ", got " << dtype_name(a.dtype) << ", "
                                              << dtype_name(b.dtype) << ", " << dtype_name(c.dtype));
    WEFT_CHECK(b.dim(0) == s.n && b.dim(1) == s.k,
               "gemm_ar: b must be [N, K] = [" << s.n << ", " << s.k << "], got " << b.describe());
    WEFT_CHECK(c.dim(0) == m && c.dim(1) == s.n,
               "gemm_ar: c must be [M, N] = [" << m << ", " << s.n << "], got " << c.describe());
    GemmProblem p;
    try {
        p = validate_gemm_args(a, b, c, BLayout::kNK);
    } catch (const Error& e) {
        detail::rethrow_with_op(kOp, e);
    }
    detail::check_apart(kOp, "c", c, {{"a", a}, {"b", b}}, "c is written while the GEMM's other tiles still read them");
    return p;
}

}  // namespace

int64_t validate_gemm_ar_call(const GemmArShape& s, const TensorView& a, const TensorView& b, const TensorView& c) {
    return check_gemm_ar_call(s, a, b, c).m;
}

namespace detail {

jit::KernelSpec ar_reduce_kernel_spec(DType partial, DType out, const std::string& arch) {
    return tp_detail::make_spec("gemm_ar/gemm_ar.cuh",
                                std::string("weft::kernels::gemm_ar::ar_reduce_kernel<") + dtype_enum_name(partial) +
                                    ", " + dtype_enum_name(out) + ">",
                                std::string("gemm_ar reduce ") + dtype_name(partial) + "->" + dtype_name(out), arch);
}

jit::KernelSpec gemv_kernel_spec(int m_tiles, DType in, DType out, GemvVariant variant, const std::string& arch) {
    // weft::ops::gemm's own spec (checks the config)
    return ops::gemv_kernel_spec(GemvConfig{.variant = variant, .m_tiles = m_tiles, .in_dtype = in, .out_dtype = out},
                                 arch);
}

}  // namespace detail

struct GemmAr::State : tp_detail::FusedOpState {
    GemmArShape shape;
    int num_sms = 1, reduce_ctas = 1;
    DType partial_dtype = DType::kBF16;
    DType gemm_out = DType::kBF16;  // partial_dtype, or shape.dtype for a team of one rank
    int64_t ldp = 0;

    void* partial = nullptr;  // symmetric [max_m, ldp]
    uint64_t* ready = nullptr;
    uint64_t* done = nullptr;
    uint64_t* epoch = nullptr;
    uint32_t* exit_count = nullptr;
    uint64_t* signatures = nullptr;  // symmetric [2][num_ranks] call descriptors (ArReduceParams::signatures)
    void* small_m_workspace = nullptr;  // split-K counters (zero) then fp32 partials
    size_t small_m_workspace_bytes = 0;
    GemvVariant small_m_variant = GemvVariant::kTmaRing;  // of the loaded small-M kernels

    const jit::Kernel* gemv[4] = {nullptr, nullptr, nullptr, nullptr};
    // GemvVariant::kBulkRows (B's rows by bulk copies), loaded where ops::gemm would pick it for this shape with B's
    // rows back to back; each call takes it when its b is so (small_m_plan with b_rows_contiguous).
    const jit::Kernel* gemv_rows = nullptr;
    const jit::Kernel* reduce = nullptr;
    bool use_collective = false;  // the all-reduce half through ops::all_reduce over the team (GemmArOptions)
    // The tiled path (M > kGemvMaxM): gemms[0], the plain GEMM.
    // A c with padded rows gets the collective's sum here first (contiguous, private: the same all-reduce every rank
    // runs with a dense c), then its rows: [max_m, n], made by the first call that needs it before it launches
    // anything, released with the op's other buffers (stream-ordered).
    void* padded_sum = nullptr;

    explicit State(const Team& t) : FusedOpState(t, kOp) {}
    ~State() { heap.free_all(); }  // waits for this op's work first

    /// Whether a call of `m` rows into `c` sums through `padded_sum` (the collective path with c's rows padded).
    bool sums_through_padded_rows(int64_t m, const TensorView& c) const {
        return use_collective && num_ranks > 1 && m > 1 && c.stride(0) != shape.n;
    }

    GemmProblem problem(int64_t m) const {
        GemmProblem p;
        p.m = m;
        p.n = shape.n;
        p.k = shape.k;
        p.in_dtype = shape.dtype;
        p.out_dtype = gemm_out;
        return p;
    }
    GemmPlan small_m_plan(int64_t m, bool b_rows_contiguous = false) const {
        GemmOptions o;
        o.allow_small_m = true;
        o.small_m_max_m = kGemvMaxM;  // gemm_ar serves every M <= 64 with the small-M kernels it loaded
        o.small_m_wgmma_max_m = 0;    // variants 3 / 4 only: one variant for every M
        GemmProblem p = problem(m);
        p.b_rows_contiguous = b_rows_contiguous;
        return plan_gemm(p, num_sms, o);
    }
};

GemmAr::GemmAr(World& world, const GemmArShape& shape, const GemmArOptions& options)
    : GemmAr(world.team(), shape, options) {}

GemmAr::GemmAr(const Team& team, const GemmArShape& shape, const GemmArOptions& options)
    : s_(std::make_unique<State>(team)) {
    State& s = *s_;
    World& world = *s.world;
    s.shape = shape;
    // Every member reads its peers' partials with loads and stores: a team that spans nodes is refused on every member
    // (each sees the same nodes) before anything is made or compiled.
    WEFT_CHECK(team.num_ranks() == 1 || team.num_nodes() == 1,
               "gemm_ar: a team that spans " << team.num_nodes() << " nodes (" << team.describe()
                                             << "); GemmAr needs every member load/store reachable (one node): across "
                                                "nodes run the GEMM, then ops::all_reduce (hierarchical there)");
    // Every member reads its peers' partials by its own M, N and dtypes, and runs the all-reduce half the same way
    // (ops::all_reduce or the op's kernel, on different signal words): they must agree (each has its own K). A member
    // whose shape or options are invalid fails every member at once.
    std::vector<int64_t> mine;
    const std::vector<std::vector<uint8_t>> all =
        detail::exchange_member_records(team, "weft.ops.gemm_ar.shape", kOp, "shape or options are", [&] {
            validate_gemm_ar_shape(shape, s.num_ranks, options);
            // This member's own bound (its device's budget), checked here so that every member fails with it.
            s.budget = tp_detail::resolve_sm_budget(options.sm_budget, world.sm_budget());
            WEFT_CHECK(s.num_ranks == 1 || options.reduce_ctas <= s.budget,
                       "gemm_ar: options.reduce_ctas must be <= the SM budget " << s.budget << ", got "
                                                                                << options.reduce_ctas);
            const DType partial = options.partial_dtype.value_or(shape.dtype);
            const bool collective = options.collective_all_reduce && partial == shape.dtype && shape.n % 8 == 0;
            mine = {shape.max_m, shape.n, static_cast<int64_t>(shape.dtype), static_cast<int64_t>(partial),
                    collective ? 1 : 0};
            return detail::fields_record(mine);
        });
    static constexpr const char* kFields[] = {"shape.max_m", "shape.n", "shape.dtype",
                                              "partial dtypes (options.partial_dtype)",
                                              "all-reduce paths (options.collective_all_reduce, and N % 8)"};
    detail::check_member_fields(team, all, mine, kFields, kOp, [](size_t f, int64_t v) -> std::string {
        if (f == 2 || f == 3) return dtype_name(static_cast<DType>(v));
        if (f == 4) return v != 0 ? "ops::all_reduce" : "the op's own kernel";
        return std::to_string(v);
    });
    s.num_sms = tp_detail::device_sm_count();
    WEFT_CHECK(s.budget >= 1, "gemm_ar: the SM budget must be >= 1, got " << s.budget);
    s.partial_dtype = options.partial_dtype.value_or(shape.dtype);
    s.gemm_out = s.num_ranks == 1 ? shape.dtype : s.partial_dtype;
    s.ldp = round_up(shape.n, 8);

    // GEMM kernels for every M up to max_m: the small-M kernels (ceil(M/16) row tiles) and the tiled one.
    const int64_t small_max = std::min<int64_t>(shape.max_m, kGemvMaxM);
    const GemmPlan plan = s.small_m_plan(small_max);
    WEFT_CHECK(plan.path == GemmPath::kSmallM, "gemm_ar: expected the small-M GEMM path for M = " << small_max);
    s.small_m_variant = plan.small_m_variant;
    for (int t = 1; t <= (small_max + 15) / 16; ++t) {
        s.gemv[t - 1] = &jit::compiler().get_kernel(
            detail::gemv_kernel_spec(t, shape.dtype, s.gemm_out, plan.small_m_variant));
    }
    if (s.small_m_plan(1, true).small_m_variant == GemvVariant::kBulkRows) {
        s.gemv_rows = &jit::compiler().get_kernel(
            detail::gemv_kernel_spec(1, shape.dtype, s.gemm_out, GemvVariant::kBulkRows));
    }
    // The largest workspace of any M up to small_max: a variant's grid and splits may depend on ceil(M/16)
    // in general, so the plan of small_max alone may not cover a smaller M.
    for (int t = 1; t <= (small_max + 15) / 16; ++t) {
        const GemmPlan pt = s.small_m_plan(std::min<int64_t>(16 * t, small_max));
        s.small_m_workspace_bytes = std::max(s.small_m_workspace_bytes, pt.workspace_bytes);
    }
    if (s.small_m_workspace_bytes > 0) {
        s.small_m_workspace = s.heap.alloc_private(s.small_m_workspace_bytes);
    }
    if (shape.max_m > kGemvMaxM) {
        // A team of one writes c itself: a forced config (checked against the partial dtype) writes c's dtype.
        std::optional<GemmConfig> forced = options.config;
        if (forced) forced->out_dtype = s.gemm_out;
        const GemmConfig config = tp_detail::choose_gemm_config(s.problem(shape.max_m), s.budget, forced, kOp);
        s.load_gemms({config}, plain_gemm_fused_spec(), false);
    }

    if (s.num_ranks > 1) {
        const int64_t vecs = shape.max_m * ((shape.n + kTpVecElems - 1) / kTpVecElems);
        const int64_t want = (vecs + 2 * kTpReduceThreads - 1) / (2 * kTpReduceThreads);
        s.reduce_ctas = options.reduce_ctas > 0
                            ? options.reduce_ctas
                            : static_cast<int>(std::clamp<int64_t>(want, 1, std::min(s.budget, 32)));  // checked above
        s.partial = s.heap.alloc(static_cast<uint64_t>(shape.max_m * s.ldp * dtype_bytes(s.partial_dtype)));
        uint64_t* words = s.heap.alloc_signals(static_cast<uint64_t>(4 * s.num_ranks + 2));
        s.ready = words;
        s.done = words + s.num_ranks;
        s.epoch = s.done + s.num_ranks;
        s.exit_count = reinterpret_cast<uint32_t*>(s.epoch + 1);
        s.signatures = s.epoch + 2;
        tp_detail::check_peers_reachable(team, s.partial, kOp);
        s.reduce = &jit::compiler().get_kernel(detail::ar_reduce_kernel_spec(s.partial_dtype, shape.dtype));
        s.use_collective = options.collective_all_reduce && s.partial_dtype == shape.dtype && shape.n % 8 == 0;
        if (s.use_collective) ops::prepare_collectives(team);  // collective: every member decides alike
    }
    WEFT_LOG_INFO("gemm_ar: partials " << dtype_name(s.partial_dtype) << ", all-reduce "
                                       << (s.use_collective ? "ops::all_reduce, else " : "") << s.reduce_ctas
                                       << " CTAs of the op's kernel, SM budget " << s.budget << ", team of "
                                       << s.num_ranks);
    team.barrier();
}

GemmAr::~GemmAr() = default;

const GemmArShape& GemmAr::shape() const { return s_->shape; }
DType GemmAr::partial_dtype() const { return s_->partial_dtype; }
int GemmAr::reduce_ctas() const { return s_->reduce_ctas; }
bool GemmAr::uses_small_m_path(int64_t m) const { return m <= kGemvMaxM; }

namespace {

/// One call set up on the host (the small-M or tiled GEMM's launch, the all-reduce half's parameters): launching it
/// only enqueues. The peers' all-reduce kernels wait for this rank's: nothing that can throw may sit between them.
struct ArCall {
    int64_t m = 0;
    const jit::Kernel* gemv = nullptr;  // the small-M path's kernel, else the tiled GEMM (gemms[0])
    detail::GemvLaunch gemv_launch{};
    FusedGemmCall tiled{};
    bool collective = false;           // the all-reduce half through ops::all_reduce
    bool collective_in_place = false;  // ... in place in the partial, then copied into c's rows
    ArReduceParams reduce{};
};

ArCall prepare_call(const GemmAr::State& s, const GemmProblem& p, const TensorView& a, const TensorView& b,
                    const TensorView& c) {
    ArCall call;
    const int64_t m = p.m;
    call.m = m;
    // The GEMM writes c itself in a team of one rank, else this rank's partial.
    const TensorView d = s.num_ranks == 1 ? c : TensorView(s.partial, s.partial_dtype, {m, s.shape.n}, {s.ldp, 1});
    if (m <= kGemvMaxM) {
        const bool b_rows_contiguous = s.gemv_rows != nullptr && p.b_rows_contiguous;
        const GemmPlan plan = s.small_m_plan(m, b_rows_contiguous);
        const bool whole_rows = plan.small_m_variant == GemvVariant::kBulkRows;
        WEFT_CHECK(plan.path == GemmPath::kSmallM &&
                       (whole_rows ? s.gemv_rows != nullptr : plan.small_m_variant == s.small_m_variant),
                   "gemm_ar: the small-M plan for M = " << m << " does not match the loaded kernels");
        call.gemv_launch = detail::make_gemv_launch(plan, a, b, d);
        GemvArgs& args = call.gemv_launch.args;
        if (plan.workspace_bytes > 0) {
            const size_t counter_bytes = static_cast<size_t>(round_up(static_cast<int64_t>(plan.grid) * 4, 256));
            WEFT_CHECK(plan.workspace_bytes <= s.small_m_workspace_bytes,
                       "gemm_ar: small-M workspace too small (" << s.small_m_workspace_bytes << " < "
                                                                << plan.workspace_bytes << ")");
            args.counters = static_cast<uint32_t*>(s.small_m_workspace);
            args.partials = reinterpret_cast<float*>(static_cast<char*>(s.small_m_workspace) + counter_bytes);
        }
        call.gemv = whole_rows ? s.gemv_rows : s.gemv[(m + 15) / 16 - 1];
    } else {
        const GemmConfig& config = s.gemms[0].config();
        call.tiled = detail::make_fused_gemm_call(config, a, b, d, fused_gemm_grid(config, m, s.shape.n, s.budget),
                                                  s.pipeline_timeout_ns);
    }
    if (s.num_ranks == 1) return call;

    // The partial is [m, n] contiguous here (ldp == n). Every rank takes the same path whatever its c's layout (the
    // peers' halves must meet): a c with padded rows receives the sum through the private padded-row buffer, row by
    // row.
    call.collective = s.use_collective;
    call.collective_in_place = s.sums_through_padded_rows(m, c);
    if (call.collective_in_place) {
        const size_t row_bytes = static_cast<size_t>(s.shape.n) * dtype_bytes(s.shape.dtype);
        tp_detail::check_row_copy(kOp, "c", static_cast<size_t>(c.stride(0)) * dtype_bytes(s.shape.dtype), row_bytes,
                                  row_bytes, static_cast<size_t>(m));
    }
    ArReduceParams& r = call.reduce;
    r.ctx = s.ctx;
    r.m = static_cast<int32_t>(m);
    r.n = static_cast<int32_t>(s.shape.n);
    r.partial = s.partial;
    r.ldp = s.ldp;
    r.out = c.data;
    r.ldc = c.stride(0);
    r.ready = s.ready;
    r.done = s.done;
    r.epoch = s.epoch;
    r.exit_count = s.exit_count;
    r.signatures = s.signatures;
    // What every rank's call must agree on: M (the rows every rank's partial holds), n and the dtypes.
    uint64_t mix = call_descriptor_mix(0, static_cast<uint64_t>(s.shape.n));
    mix = call_descriptor_mix(mix, static_cast<uint64_t>(s.partial_dtype));
    r.signature = make_call_descriptor(CollectiveOp::kGemmAr, 0, true, s.shape.dtype, static_cast<uint64_t>(m), mix);
    return call;
}

void launch_call(GemmAr::State& s, const ArCall& call, cudaStream_t stream) {
    if (call.gemv != nullptr) {
        jit::LaunchParams lp;
        lp.grid = call.gemv_launch.grid;
        lp.block = call.gemv_launch.block;
        lp.dynamic_smem_bytes = static_cast<size_t>(call.gemv_launch.smem_bytes);
        lp.cluster = call.gemv_launch.cluster;
        lp.stream = stream;
        call.gemv->launch(lp, call.gemv_launch.args, call.gemv_launch.maps);
    } else {
        s.gemms[0].launch(call.tiled, weft::gemm::PersistentSchedulerParams{}, weft::gemm::NoEpilogueHookParams{},
                          stream);
    }
    if (s.num_ranks == 1) return;
    if (call.collective) {
        const int64_t count = call.m * s.shape.n;
        const TensorView partial(s.partial, s.partial_dtype, {count});
        // c is the user's: whether it is on the symmetric heap, and where, may differ between ranks; and so may its
        // layout: every rank runs the same all-reduce into private contiguous memory (c itself, or the padded-sum
        // buffer whose rows then go to c's), so that the ranks' call descriptors agree.
        if (!call.collective_in_place) {
            detail::all_reduce_into_private(s.team, partial, TensorView(call.reduce.out, s.shape.dtype, {count}),
                                            stream);
            return;
        }
        const size_t row_bytes = static_cast<size_t>(s.shape.n) * dtype_bytes(s.shape.dtype);
        void* sum = s.padded_sum;  // made by run() before anything was launched
        detail::all_reduce_into_private(s.team, partial, TensorView(sum, s.shape.dtype, {count}), stream);
        tp_detail::copy_rows_async(call.reduce.out, static_cast<size_t>(call.reduce.ldc) * dtype_bytes(s.shape.dtype),
                                   sum, row_bytes, row_bytes, static_cast<size_t>(call.m), stream);
        return;
    }
    jit::LaunchParams lp;
    lp.grid = dim3(static_cast<unsigned>(s.reduce_ctas), 1, 1);
    lp.block = dim3(kTpReduceThreads, 1, 1);
    lp.stream = stream;
    s.reduce->launch(lp, call.reduce);
}

}  // namespace

void GemmAr::run(const TensorView& a, const TensorView& b, const TensorView& c, cudaStream_t stream) {
    WEFT_NVTX_RANGE("gemm_ar");
    State& s = *s_;
    GemmProblem p;
    try {
        p = check_gemm_ar_call(s.shape, a, b, c);
        s.refuse_after_abort();
        // Host memory or another GPU's would reach the tensor maps unchecked, and the all-reduce would refuse c only
        // after the GEMM ran (its peers then wait for this rank to their timeout).
        detail::check_device_buffers(s.world->heap(), {{"a", a}, {"b", b}, {"c", c}}, "gemm_ar", stream);
    } catch (...) {
        // The call's all-reduce keeps its place in the team's sequence of collective calls, as the collectives'
        // own refusals do (detail::next_collective_call).
        if (s.use_collective && s.num_ranks > 1) (void)detail::next_collective_call(s.team);
        throw;
    }
    // The padded-row sum, before any launch (an allocation that fails must not sit between this rank's launches).
    if (s.sums_through_padded_rows(p.m, c) && s.padded_sum == nullptr) {
        s.padded_sum =
            s.heap.alloc_private(static_cast<uint64_t>(s.shape.max_m * s.shape.n) * dtype_bytes(s.shape.dtype));
    }
    // One config at most (the tiled path's): nothing to tune, no problem text needed.
    s.run(
        stream, 0, [] { return std::string(); }, [&](size_t) { return prepare_call(s, p, a, b, c); },
        [&](const ArCall& call, size_t, cudaStream_t st) { launch_call(s, call, st); });
}

}  // namespace weft::ops
