// SPDX-License-Identifier: MIT
// Host pieces shared by the tensor-parallel fused ops: JIT specs, config/grid choice, launches, ownership.
#include "tp_common.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/store.hpp"
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

std::string gemm_instantiation(const GemmConfig& config, const std::string& scheduler_template,
                               const std::string& hook) {
    const std::string cfg = format_gemm_config(config);
    std::string h = hook;
    for (size_t pos = h.find("CFG"); pos != std::string::npos; pos = h.find("CFG", pos + cfg.size())) {
        h.replace(pos, 3, cfg);
    }
    return "weft::gemm::gemm_kernel<" + cfg + ", " + scheduler_template + "<" + cfg + ">, " + h + ">";
}

std::string config_text(const GemmConfig& c) {
    std::ostringstream os;
    os << c.tile_m << "x" << c.tile_n << "x" << c.tile_k << "/" << c.stages << (c.pingpong ? " ping-pong " : " ")
       << dtype_name(c.in_dtype) << "->" << dtype_name(c.out_dtype);
    return os.str();
}

int device_sm_count() {
    int device = 0, n = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return n;
}

void check_forced_config(const GemmConfig& c, DType in, DType out, const char* op) {
    WEFT_CHECK(is_valid(c), op << ": options.config is not a valid GemmConfig: " << format_gemm_config(c));
    WEFT_CHECK(gemm_whole_store_boxes(c),
               op << ": options.config must have a tile_n of whole " << gemm_epi_cols(c)
                  << "-column store boxes (the fused ops route or signal every store), got " << format_gemm_config(c));
    WEFT_CHECK(c.cluster_m == 1 && c.cluster_n == 1,
               op << ": options.config must be cluster-free (cluster_m = cluster_n = 1), got "
                  << format_gemm_config(c));
    WEFT_CHECK(c.in_dtype == in && c.out_dtype == out && c.b_layout == BLayout::kNK,
               op << ": options.config must take " << dtype_name(in) << " inputs, write " << dtype_name(out)
                  << " and B [N,K] (BLayout::kNK), got " << format_gemm_config(c));
}

std::vector<GemmConfig> fused_candidates(DType in, DType out, int64_t rows_multiple) {
    std::vector<GemmConfig> list;
    for (GemmConfig c : gemm_candidate_configs(in, out, BLayout::kNK)) {
        c.cluster_m = c.cluster_n = 1;
        if (!is_valid(c) || !gemm_whole_store_boxes(c)) continue;
        if (rows_multiple > 0 && rows_multiple % c.tile_m != 0) continue;
        if (std::find(list.begin(), list.end(), c) == list.end()) list.push_back(c);
    }
    return list;
}

// Per tile, the fused ops' hooks (chunk waits before its loads, a stored signal after its stores) cost about as much
// as 1024 more output elements of MMA (3% of a 128x256 tile), which favours the larger tiles more than the plain
// GEMM's cost model does: AG+GEMM 8192x11008x4096 on 2 H200s (autotuned, 2026-11-30) ran 128x256 in 0.531 ms,
// 256x128 0.542, 128x128 0.557, 128x192 0.575, where the plain model alone would pick 128x128.
constexpr double kHookedTileCost = 1024;

GemmConfig choose_gemm_config(const GemmProblem& problem, int budget, const std::optional<GemmConfig>& forced,
                              const char* op, int64_t rows_multiple) {
    if (forced) {
        check_forced_config(*forced, problem.in_dtype, problem.out_dtype, op);
        return *forced;
    }
    // The cheapest candidate the fused kernels can run, each tile charged the hooks' own cost.
    std::optional<GemmConfig> best;
    double best_cost = 0;
    for (const GemmConfig& cand : fused_candidates(problem.in_dtype, problem.out_dtype, rows_multiple)) {
        const double cost = gemm_config_cost(problem, cand, budget, kHookedTileCost);
        if (!best || cost < best_cost * 0.999) {
            best = cand;
            best_cost = cost;
        }
    }
    WEFT_CHECK(best.has_value(), op << ": options.chunk_rows must be a multiple of the tile_m of some GEMM config "
                                       "(64, 128 or 256), got " << rows_multiple);
    return *best;
}

int gemm_grid(const GemmConfig& config, int64_t m, int64_t n, int budget) {
    const GemmTileGrid g(config, static_cast<int32_t>(m), static_cast<int32_t>(n));
    return std::max(1, std::min(budget, g.num_tiles()));
}

uint64_t pipeline_timeout_ns(const World& world) {
    const auto ms = static_cast<uint64_t>(std::max<int64_t>(1, world.timeout().count()));
    return 2 * ms * 1000000ull;
}

PlainGemmLaunch prepare_plain_gemm(const GemmConfig& config, const TensorView& a, const TensorView& b,
                                   const TensorView& d, int budget, uint64_t timeout_ns) {
    PlainGemmLaunch call;
    call.maps = detail::make_gemm_tensor_maps(config, a, b, d);
    call.args = detail::make_gemm_args(a, d, timeout_ns);
    call.grid = gemm_grid(config, a.dim(0), d.dim(1), budget);
    return call;
}

void launch_plain_gemm(const jit::Kernel& kernel, const GemmConfig& config, const PlainGemmLaunch& call,
                       cudaStream_t stream) {
    // PersistentSchedulerParams and NoEpilogueHookParams (device headers): one int32_t each.
    const int32_t sched = 0;
    const int32_t hook = 0;
    detail::launch_gemm_kernel(kernel, config, call.maps, call.args, call.grid, sched, hook, stream);
}

void launch_plain_gemm(const jit::Kernel& kernel, const GemmConfig& config, const TensorView& a, const TensorView& b,
                       const TensorView& d, int budget, uint64_t timeout_ns, cudaStream_t stream) {
    launch_plain_gemm(kernel, config, prepare_plain_gemm(config, a, b, d, budget, timeout_ns), stream);
}

void check_peers_reachable(const World& world, const void* symmetric_ptr, const char* op) {
    for (int r = 0; r < world.num_ranks(); ++r) {
        WEFT_CHECK(world.heap().symm_at(symmetric_ptr, r) != nullptr,
                   op << ": rank " << world.rank() << " cannot load/store rank " << r
                      << "'s symmetric heap (another host, or no peer access between their GPUs); the fused "
                         "tensor-parallel ops need every peer load/store reachable");
    }
}

void* SymmetricAllocations::alloc(uint64_t bytes) {
    void* p = world_->heap().alloc(bytes, 256);
    ptrs_.push_back(p);
    return p;
}

uint64_t* SymmetricAllocations::alloc_signals(uint64_t count) {
    uint64_t* p = world_->heap().alloc_signals(count);
    ptrs_.push_back(p);
    return p;
}

void SymmetricAllocations::free_all() noexcept {
    if (ptrs_.empty()) return;
    try {
        // Work still queued (ours, or a peer's reading these buffers) must end before the memory is reused.
        WEFT_CUDA_CHECK(cudaDeviceSynchronize());
        world_->barrier();
        for (auto it = ptrs_.rbegin(); it != ptrs_.rend(); ++it) world_->heap().free(*it);
    } catch (const std::exception& e) {
        WEFT_LOG_ERROR("tp ops: releasing symmetric buffers failed: " << e.what());
    }
    ptrs_.clear();
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

void FirstCallSync::after_call(World& world, size_t idx, cudaStream_t stream) {
    if (idx >= pending_.size() || !pending_[idx]) return;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) return;
    pending_[idx] = false;
    world.sync_and_check(stream);
    world.barrier();
}

std::vector<GemmConfig> tune_candidates(const GemmConfig& first, DType in, DType out, int64_t rows_multiple) {
    std::vector<GemmConfig> out_list = {first};
    for (const GemmConfig& c : fused_candidates(in, out, rows_multiple)) {
        if (c != first) out_list.push_back(c);
    }
    return out_list;
}

std::unique_ptr<jit::TuneComm> make_tune_comm(World& world, uint64_t tag) {
    auto seq = std::make_shared<uint64_t>(0);
    World* w = &world;
    return std::make_unique<jit::FunctionTuneComm>(
        world.rank(), world.num_ranks(), [w] { w->barrier(); },
        [w, seq, tag](double v) {
            Bytes blob(sizeof(double));
            std::memcpy(blob.data(), &v, sizeof(double));
            const std::string name = "weft_tp_tune_" + std::to_string(tag) + "_" + std::to_string((*seq)++);
            const std::vector<Bytes> all = w->store().all_gather(name, w->rank(), w->num_ranks(), blob, w->timeout());
            std::vector<double> out(all.size());
            for (size_t i = 0; i < all.size(); ++i) {
                WEFT_CHECK(all[i].size() == sizeof(double), "tp ops: tuning all-gather got a blob of "
                                                                << all[i].size() << " bytes from rank " << i);
                std::memcpy(&out[i], all[i].data(), sizeof(double));
            }
            return out;
        });
}

void rethrow_with_op(const char* op, const std::exception& e) {
    std::string what = e.what();
    const std::string prefix = "weft: ";
    if (what.rfind(prefix, 0) == 0) what = what.substr(prefix.size());
    throw Error("weft: " + std::string(op) + ": " + what);
}

}  // namespace weft::ops::tp_detail
