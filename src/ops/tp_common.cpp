// SPDX-License-Identifier: MIT
// The skeleton and host pieces the tensor-parallel fused ops share: FusedOpState, config choice, ownership, tuning.
#include "tp_common.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "abort_mark.hpp"
#include "weft/common/net_call_check.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/tp_aot.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/symmetric_heap.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops::tp_detail {

jit::KernelSpec make_spec(const std::string& header, const std::string& instantiation, const std::string& description,
                          const std::string& arch) {
    jit::KernelSpec spec;
    spec.header = header;
    spec.instantiation = instantiation;
    spec.description = description;
    spec.arch = arch;
    return spec;
}

bool streams_may_share_queues(const World& world) { return world.same_process() && world.num_ranks_on_device() > 1; }

bool pulls_with_kernel(const World& world) { return streams_may_share_queues(world); }

jit::KernelSpec peer_pull_kernel_spec(const std::string& arch) {
    return make_spec("tp_common/peer_pull.cuh", "weft::kernels::tp_common::peer_pull_kernel<0>", "peer pull", arch);
}

void launch_net_call_check(const jit::Kernel& kernel, const DeviceCtx& ctx, const uint64_t* words, uint64_t signature,
                           const std::vector<NetCallCheck>& entries, cudaStream_t stream) {
    if (entries.empty()) return;
    WEFT_CHECK(entries.size() <= static_cast<size_t>(kNetCheckMaxCalls),
               "internal error: " << entries.size() << " calls across nodes to check; at most " << kNetCheckMaxCalls);
    NetCheckCallsParams p{};
    p.ctx = ctx;
    p.words = words;
    p.signature = signature;
    p.count = static_cast<int32_t>(entries.size());
    for (size_t i = 0; i < entries.size(); ++i) {
        p.index[i] = entries[i].index;
        p.peer[i] = entries[i].peer;
    }
    jit::LaunchParams lp;
    lp.grid = dim3(1, 1, 1);
    lp.block = dim3(32, 1, 1);
    lp.stream = stream;
    kernel.launch(lp, p);
}

void launch_peer_pulls(const jit::Kernel& kernel, const DeviceCtx& ctx, const std::vector<PeerPullItem>& items,
                       cudaStream_t stream, const uint64_t* signatures, uint64_t signature) {
    for (size_t first = 0; first < items.size(); first += kPeerPullMaxItems) {
        PeerPullParams p{};
        p.ctx = ctx;
        p.signatures = signatures;
        p.signature = signature;
        p.num_items = static_cast<int32_t>(std::min<size_t>(kPeerPullMaxItems, items.size() - first));
        std::copy_n(items.begin() + static_cast<std::ptrdiff_t>(first), p.num_items, p.items);
        jit::LaunchParams lp;
        lp.grid = dim3(1, 1, 1);
        lp.block = dim3(kPeerPullThreads, 1, 1);
        lp.stream = stream;
        kernel.launch(lp, p);
    }
}

namespace {
bool rows_back_to_back(size_t dst_pitch, size_t src_pitch, size_t width, size_t rows) {
    return rows <= 1 || (dst_pitch == width && src_pitch == width);
}
}  // namespace

void copy_rows_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows,
                     cudaStream_t stream) {
    if (rows_back_to_back(dst_pitch, src_pitch, width, rows)) {
        WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, width * rows, cudaMemcpyDefault, stream));
        return;
    }
    WEFT_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDefault, stream));
}

void check_row_copy(const char* op, const char* what, size_t dst_pitch, size_t src_pitch, size_t width, size_t rows) {
    if (rows_back_to_back(dst_pitch, src_pitch, width, rows)) return;
    const auto max_pitch = static_cast<size_t>(device_attribute(cudaDevAttrMaxPitch));
    WEFT_CHECK(dst_pitch <= max_pitch && src_pitch <= max_pitch,
               op << ": " << what << "'s rows are copied with a strided copy whose row pitch (" << src_pitch
                  << " bytes from, " << dst_pitch << " bytes to) passes the device's maximum of " << max_pitch
                  << " bytes; pass the rows back to back");
}

int device_attribute(cudaDeviceAttr attr) {
    int device = 0, n = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&n, attr, device));
    return n;
}

int device_sm_count() { return device_attribute(cudaDevAttrMultiProcessorCount); }

void check_sm_budget_share(const World& world, int option, const char* op) {
    // The most shared GPU's share: the same on every rank, so that every rank refuses alike.
    WEFT_CHECK(option <= 0 || world.max_ranks_per_device() <= 1 || option <= world.shared_sm_budget(),
               op << ": options.sm_budget = " << option << " exceeds a rank's share of a shared GPU ("
                  << world.shared_sm_budget() << " SMs: up to " << world.max_ranks_per_device()
                  << " ranks share a GPU, and their persistent kernels, which wait for each other, must all be "
                     "resident at once)");
}

int cap_for_copy_helpers(const World& world, int budget, const char* op) {
    WEFT_CHECK(world.sm_budget() >= 2 && budget >= 2,
               op << ": ranks sharing a GPU need an SM budget of at least 2 (one SM stays free for the copy helpers), "
                     "got "
                  << budget << " (the share of this GPU: " << world.sm_budget() << ")");
    return std::min(budget, world.sm_budget() - 1);
}

int resolve_sm_budget(int option, int world_default) {
    return option > 0 ? std::min(option, device_sm_count()) : world_default;
}

void check_forced_config(const GemmConfig& c, DType in, DType out, const char* op) {
    WEFT_CHECK(is_valid(c), op << ": options.config is not a valid GemmConfig: " << format_gemm_config(c));
    WEFT_CHECK(gemm_whole_store_boxes(c),
               op << ": options.config must have a tile_n of whole " << gemm_epi_cols(c)
                  << "-column store boxes (the fused ops route or signal every store), got " << format_gemm_config(c));
    WEFT_CHECK(c.cluster_m == 1 && c.cluster_n == 1,
               op << ": options.config must be cluster-free (cluster_m = cluster_n = 1), got "
                  << format_gemm_config(c));
    WEFT_CHECK(c.splits == 1, op << ": options.config must not split K (splits = 1: the fused ops signal and route "
                                    "whole tiles), got "
                                 << format_gemm_config(c));
    WEFT_CHECK(!c.swap_ab, op << ": options.config must not be swapped (swap_ab serves the plain GEMM only), got "
                              << format_gemm_config(c));
    WEFT_CHECK(c.in_dtype == in && c.out_dtype == out && c.b_layout == BLayout::kNK,
               op << ": options.config must take " << dtype_name(in) << " inputs, write " << dtype_name(out)
                  << " and B [N,K] (BLayout::kNK), got " << format_gemm_config(c));
}

GemmConfig choose_gemm_config(const GemmProblem& problem, int budget, const std::optional<GemmConfig>& forced,
                              const char* op, int64_t rows_multiple) {
    if (forced) {
        check_forced_config(*forced, problem.in_dtype, problem.out_dtype, op);
        return *forced;
    }
    const std::optional<GemmConfig> best = detail::cheapest_fused_gemm_config(problem, budget, rows_multiple);
    WEFT_CHECK(best.has_value(), op << ": options.chunk_rows must be a multiple of the tile_m of some GEMM config "
                                       "(64, 128 or 256), got " << rows_multiple);
    return *best;
}

std::vector<GemmConfig> tune_candidates(const GemmConfig& first, DType in, DType out, int64_t rows_multiple) {
    std::vector<GemmConfig> out_list = {first};
    for (const GemmConfig& c : fused_gemm_candidates(in, out, rows_multiple)) {
        if (c != first) out_list.push_back(c);
    }
    return out_list;
}

const Team& require_member(const Team& team, const char* op) {
    team.require_member(op);
    return team;
}

void check_peers_reachable(const Team& team, const void* symmetric_ptr, const char* op) {
    const World& world = team.world();
    for (int t = 0; t < team.num_ranks(); ++t) {
        WEFT_CHECK(world.heap().symm_at(symmetric_ptr, team.world_rank(t)) != nullptr,
                   op << ": team rank " << team.rank() << " (world rank " << world.rank()
                      << ") cannot load/store the symmetric heap of team rank " << t << " (world rank "
                      << team.world_rank(t)
                      << "): another host, or no peer access between their GPUs; the fused tensor-parallel ops need "
                         "every member of the team load/store reachable");
    }
}

void* SymmetricAllocations::alloc(uint64_t bytes) {
    void* p = team_.world().heap().alloc(team_, bytes, 256);
    ptrs_.push_back(p);
    return p;
}

uint64_t* SymmetricAllocations::alloc_signals(uint64_t count) {
    uint64_t* p = team_.world().heap().alloc_signals(team_, count);
    ptrs_.push_back(p);
    return p;
}

void* SymmetricAllocations::alloc_private(uint64_t bytes) {
    const RelaxedCaptureMode relaxed;  // also on a first call under capture (GemmAr's padded-row sum)
    if (private_stream_ == nullptr) {
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&private_stream_, cudaStreamNonBlocking));
    }
    void* p = nullptr;
    WEFT_CUDA_CHECK(cudaMallocAsync(&p, bytes, private_stream_));
    private_.push_back(p);
    WEFT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, private_stream_));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(private_stream_));
    return p;
}

void SymmetricAllocations::free_all() noexcept {
    if (ptrs_.empty() && private_.empty()) return;
    // Work still queued (ours, or a peer's reading these buffers) must end before the memory is reused: our own
    // launches here, the peers' behind the barrier.
    uses_.wait_all();
    try {
        if (!ptrs_.empty()) {
            // Not a team barrier: a member whose constructor failed after allocating releases here, and a barrier
            // would meet its peers' end-of-construction barrier, so that their constructors returned as if it had
            // succeeded (their first call then waited for it until the timeout). A key of its own meets only the
            // members' releases.
            (void)team_.all_gather("weft.tp.release", {});
            SymmetricHeap& heap = team_.world().heap();
            for (auto it = ptrs_.rbegin(); it != ptrs_.rend(); ++it) heap.free(team_, *it);
        }
    } catch (const std::exception& e) {
        // Attempted also after an abort (it fails at once there), so that every member's exchange sequence stays in
        // step.
        ops::detail::log_failed_release(team_.world(), "a tp op", e);
    }
    ptrs_.clear();
    if (private_stream_ != nullptr) {
        const RelaxedCaptureMode relaxed;
        for (void* p : private_) cudaFreeAsync(p, private_stream_);
        cudaStreamSynchronize(private_stream_);
        cudaStreamDestroy(private_stream_);
        private_stream_ = nullptr;
    }
    private_.clear();
}

StreamSet::~StreamSet() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    for (cudaStream_t s : streams_) cudaStreamDestroy(s);
}

cudaStream_t StreamSet::add_stream() {
    cudaStream_t s = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    streams_.push_back(s);
    return s;
}

cudaEvent_t StreamSet::add_event() {
    cudaEvent_t e = nullptr;
    WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    events_.push_back(e);
    return e;
}

void FirstCallSync::after_call(const Team& team, size_t idx, cudaStream_t stream) {
    if (idx >= pending_.size() || !pending_[idx]) return;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) return;
    pending_[idx] = false;
    const RelaxedCaptureMode relaxed;  // another rank thread may be capturing in global mode meanwhile
    team.world().sync_and_check(stream);
    team.barrier();
}

std::unique_ptr<jit::TuneComm> make_tune_comm(const Team& team, uint64_t tag) {
    auto seq = std::make_shared<uint64_t>(0);
    return std::make_unique<jit::FunctionTuneComm>(
        team.rank(), team.num_ranks(), [team] { team.barrier(); },
        [team, seq, tag](double v) {
            std::vector<uint8_t> blob(sizeof(double));
            std::memcpy(blob.data(), &v, sizeof(double));
            const std::string key = "weft_tp_tune_" + std::to_string(tag) + "_" + std::to_string((*seq)++);
            const std::vector<std::vector<uint8_t>> all = team.all_gather(key, blob);
            std::vector<double> out(all.size());
            for (size_t i = 0; i < all.size(); ++i) {
                WEFT_CHECK(all[i].size() == sizeof(double), "tp ops: tuning all-gather got a blob of "
                                                                << all[i].size() << " bytes from team rank " << i
                                                                << " (world rank "
                                                                << team.world_rank(static_cast<int>(i)) << ")");
                std::memcpy(&out[i], all[i].data(), sizeof(double));
            }
            return out;
        });
}

std::string problem_text(int64_t m, int64_t n, int64_t k, DType dtype) {
    return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) + " " + dtype_name(dtype);
}

FusedOpState::FusedOpState(const Team& t, const char* op_name)
    : op(op_name),
      team(require_member(t, op_name)),
      world(&team.world()),
      num_ranks(team.num_ranks()),
      rank(team.rank()),
      ctx(team.device_ctx()),
      pipeline_timeout_ns(fused_gemm_timeout_ns(*world)),
      heap(team) {
    abort_mark.note(*world);
}

FusedOpState::~FusedOpState() { heap.free_all(); }

void FusedOpState::refuse_after_abort(bool waits_alone) const {
    if (num_ranks > 1 || waits_alone) {
        abort_mark.check(*world, op, "make a new op (and, for a team that spans nodes, a new World)");
    }
}

void FusedOpState::load_gemms(const std::vector<GemmConfig>& configs, const FusedGemmSpec& spec,
                              bool sync_first_calls, const std::string& problem) {
    if (sync_first_calls) first_calls.arm(configs.size());
    std::vector<jit::KernelSpec> specs;
    for (const GemmConfig& c : configs) specs.push_back(fused_gemm_kernel_spec(spec, c));
    fused_gemm_compiler(spec.include_root).warm(specs, std::string(op) + (problem.empty() ? "" : " " + problem));
    gemms.reserve(configs.size());
    for (const GemmConfig& c : configs) gemms.emplace_back(team, spec, c);
}

bool FusedOpState::stream_is_capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    return capture != cudaStreamCaptureStatusNone;
}

void FusedOpState::tune(cudaStream_t stream, uint64_t tag, const std::string& problem,
                        const std::vector<jit::TuneCandidate>& cands) {
    const auto comm = make_tune_comm(team, tag);
    jit::TuneOptions to;
    to.stream = stream;
    to.collective_runs = num_ranks > 1;
    jit::TuneKey key;
    key.op = op;
    key.problem = problem;
    const jit::TuneResult r = jit::autotuner().tune(key, cands, comm.get(), to);
    active = r.index;
    tuned = true;
    WEFT_LOG_INFO(op << ": tuned " << problem << " -> " << r.name);
}

}  // namespace weft::ops::tp_detail

namespace weft::ops::detail {

jit::KernelSpec net_check_calls_kernel_spec(const std::string& arch) {
    return tp_detail::make_spec("tp_common/net_call_check.cuh", "weft::kernels::tp_common::net_check_calls_kernel",
                                "check of a call across nodes", arch);
}

}  // namespace weft::ops::detail
