// SPDX-License-Identifier: MIT
// The skeleton the tensor-parallel fused ops share (AgGemm, GemmRs, GemmAr; the grouped/MoE ops next):
// FusedOpState (team, SM budget, symmetric allocations, streams, the GEMM configs with their loaded kernels, the
// active config, tune-once, the first-call synchronisation of ranks sharing a GPU, the prepare/launch split) and the
// host helpers around it. kernels/tp_common/README.md says how an op uses it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "abort_mark.hpp"
#include "weft/common/device_ctx.hpp"
#include "weft/common/gemm_config.hpp"
#include "weft/common/tp_params.hpp"
#include "weft/jit/autotune.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/stream.hpp"
#include "weft/runtime/team.hpp"

namespace weft {
class World;
}

namespace weft::ops::tp_detail {

/// A KernelSpec for header + instantiation with a log description; `arch` as KernelSpec::arch.
jit::KernelSpec make_spec(const std::string& header, const std::string& instantiation, const std::string& description,
                          const std::string& arch);

/// Short config text for logs and the autotuner's candidate names: "128x256x64/4 bf16->bf16".
using ops::detail::config_text;

/// "8192x14336x4096 bf16" (M x N x K): an op's problem in progress lines.
std::string problem_text(int64_t m, int64_t n, int64_t k, DType dtype);

/// An attribute of the current device (cudaDeviceGetAttribute).
int device_attribute(cudaDeviceAttr attr);

/// The current device's SM count.
int device_sm_count();

/// Whether the peer pulls of AgGemm and AgAttention run as peer_pull_kernel launches (kernels/tp_common/peer_pull.cuh)
/// instead of stream memory waits and copy-engine copies: where ranks of one process share a GPU (their streams may
/// share a hardware queue, and a stream memory wait blocks the queue it sits in).
bool pulls_with_kernel(const World& world);
/// Whether this rank's streams may share a hardware queue with a peer's: ranks of one process on one GPU (one CUDA
/// context; docs/runtime.md, "Hardware queues"). There, work a peer's spinning kernel waits for must not sit on an
/// extra stream of this rank's: ops keep it on the caller's stream (the condition pulls_with_kernel also uses).
bool streams_may_share_queues(const World& world);
/// The pull kernel's spec (one CTA of kPeerPullThreads).
jit::KernelSpec peer_pull_kernel_spec(const std::string& arch = "");
/// One descriptor of a call across nodes to check: words[index] holds what team rank `peer` called.
struct NetCallCheck {
    int32_t index;
    int32_t peer;
};
/// Launches ops::detail::net_check_calls_kernel_spec's `kernel` (one warp) on `stream`: each entry's word against
/// `signature` (weft/common/net_call_check.hpp). At most kNetCheckMaxCalls entries; none: nothing launched.
void launch_net_call_check(const jit::Kernel& kernel, const DeviceCtx& ctx, const uint64_t* words, uint64_t signature,
                           const std::vector<NetCallCheck>& entries, cudaStream_t stream);
/// Launches `items` in order on `stream`, kPeerPullMaxItems per launch of `kernel` (peer_pull_kernel_spec's); with
/// `signatures`, each waited-for peer's call descriptor is compared with `signature` (PeerPullParams).
void launch_peer_pulls(const jit::Kernel& kernel, const DeviceCtx& ctx, const std::vector<PeerPullItem>& items,
                       cudaStream_t stream, const uint64_t* signatures = nullptr, uint64_t signature = 0);

/// Copies `rows` rows of `width` bytes (row pitches `dst_pitch`, `src_pitch`) on `stream`: one cudaMemcpyAsync when
/// the rows lie back to back on both sides (one row, or both pitches the width: any size), else cudaMemcpy2DAsync,
/// whose pitches must not pass the device's maximum (check_row_copy, before anything is launched).
void copy_rows_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows,
                     cudaStream_t stream);
/// Refuses (weft::Error naming `op` and `what`) a copy_rows_async that the 2-D copy cannot make: strided rows whose
/// pitch passes the device's maximum (cudaDevAttrMaxPitch: 2 GiB - 1 on Hopper).
void check_row_copy(const char* op, const char* what, size_t dst_pitch, size_t src_pitch, size_t width, size_t rows);

/// Refuses an explicit SM budget above a rank's share of a GPU that several ranks share (World::shared_sm_budget,
/// the same on every rank): the ranks' persistent kernels wait for each other and must all be resident at once.
void check_sm_budget_share(const World& world, int option, const char* op);
/// `budget` of a persistent kernel whose team's ranks share this GPU, capped at this rank's share less one SM (the
/// copy helpers it waits for must find one free); weft::Error naming `op` when share or budget is below 2.
int cap_for_copy_helpers(const World& world, int budget, const char* op);
/// An op's SM budget: options.sm_budget when > 0 (at most the device's SMs), else `world_default`.
int resolve_sm_budget(int option, int world_default);

/// Checks a forced config for a fused op (valid, of whole store boxes, cluster-free, dtypes and B [N,K]);
/// throws naming `op`.
void check_forced_config(const GemmConfig& config, DType in, DType out, const char* op);

/// The GEMM config of a fused op: `forced`, else fused_gemm_config's choice (the cheapest fused candidate on `budget`
/// SMs). `rows_multiple` > 0: the config's tile_m must divide it (GemmRs's explicit chunk_rows); throws naming `op`
/// when no candidate's does. A forced config is returned as is (its callers check it against their own constraints).
GemmConfig choose_gemm_config(const GemmProblem& problem, int budget, const std::optional<GemmConfig>& forced,
                              const char* op, int64_t rows_multiple = 0);

/// The cluster-free candidates a fused op may tune over: `first` (the op's choice), then every other candidate of
/// fused_gemm_candidates(in, out, rows_multiple) (`first`'s tile_m must divide `rows_multiple` when it is > 0).
std::vector<GemmConfig> tune_candidates(const GemmConfig& first, DType in, DType out, int64_t rows_multiple = 0);

/// `team` itself when this rank is one of its members; otherwise throws Team::require_member's weft::Error naming
/// `op`, this rank and the team's world ranks ("ag_gemm: world rank 5 is not a member of this team (world ranks 0, 1,
/// 2, 3)").
const Team& require_member(const Team& team, const char* op);

/// Throws when a member's copy of a symmetric object is not load/store reachable from this rank (the error names
/// its team rank and world rank).
void check_peers_reachable(const Team& team, const void* symmetric_ptr, const char* op);

/// Owns symmetric allocations of one op, made team-collectively (SymmetricHeap::alloc(team, ...)); free_all() is
/// collective over the team's members (call it from every member, in order).
class SymmetricAllocations {
public:
    explicit SymmetricAllocations(const Team& team) : team_(team) {}
    void* alloc(uint64_t bytes);
    uint64_t* alloc_signals(uint64_t count);
    /// A zeroed private device buffer, stream-ordered (cudaMalloc/cudaFree would wait for every kernel on the
    /// device, e.g. another team's spinning ones); freed by free_all.
    void* alloc_private(uint64_t bytes);
    /// Records that work touching these buffers was enqueued on `stream` (after each launch).
    void note_use(cudaStream_t stream) { uses_.note(stream); }
    /// Waits for the work noted (this op's, not the whole device's), meets the team's other members at a barrier
    /// (no peer still touches these buffers), frees everything; logs instead of throwing (destructors call it).
    /// Idempotent.
    void free_all() noexcept;

private:
    Team team_;
    std::vector<void*> ptrs_;
    std::vector<void*> private_;
    StreamUses uses_;
    cudaStream_t private_stream_ = nullptr;
};

/// Non-blocking streams and events created on the current device, destroyed with the owner.
class StreamSet {
public:
    StreamSet() = default;
    ~StreamSet();
    StreamSet(const StreamSet&) = delete;
    StreamSet& operator=(const StreamSet&) = delete;
    cudaStream_t add_stream();
    cudaEvent_t add_event();

private:
    std::vector<cudaStream_t> streams_;
    std::vector<cudaEvent_t> events_;
};

/// Ranks sharing a GPU: a config's first call on each rank ends (stream synchronised, then a barrier of the team's
/// members) before the rank launches anything more: a rank's first launch of a kernel could stay queued for good
/// while a peer's instance of it spun waiting for it (kernels/gemm_rs/README.md, "Ranks sharing a GPU"). Every member
/// must arm it alike (World::max_ranks_per_device, the same on every rank: the barrier is collective). Not while the
/// stream is being captured.
class FirstCallSync {
public:
    void arm(size_t num_configs) { pending_.assign(num_configs, true); }
    /// After the launches of a call with config `idx`.
    void after_call(const Team& team, size_t idx, cudaStream_t stream);

private:
    std::vector<bool> pending_;
};

/// A TuneComm over the team's members (Team::barrier, Team::all_gather: ranks are team ranks). `tag` must be the same
/// on every member and unique among the team's live tuning ops (e.g. the heap offset of an op's signal words); the
/// exchanges are scoped to the team, so other teams may use the same tag at the same time.
std::unique_ptr<jit::TuneComm> make_tune_comm(const Team& team, uint64_t tag);

/// What every fused op's State derives from, and the one path a call takes:
///   run(stream, tag, problem, prepare, launch)
///     - tune once: with more than one config and not yet tuned, outside graph capture, every member times every
///       config in lockstep through weft::jit::autotuner (a TuneComm over the team; the slowest member counts; one
///       winner, adopted by every member, becomes `active`);
///     - then prepare(active) (host set-up: views, tensor maps, kernel parameters; may throw), and launch(call,
///       active, stream) (only enqueues: nothing that can throw may sit between a rank's launches, or its peers
///       wait on the device for work that never comes; the autotuner relies on it, TuneCandidate::prepare), then
///       the first-call synchronisation of that config when armed.
/// The op keeps what is its own: its protocol (signal words, streams, kernels besides the GEMM), its validation (once
/// per call, before run), its Call type and its prepare and launch.
struct FusedOpState {
    /// Throws weft::Error naming `op_name` when this rank is not a member of `team` (require_member).
    FusedOpState(const Team& team, const char* op_name);
    /// Frees the symmetric allocations (collective over the team); an op whose State owns more frees its own first.
    ~FusedOpState();
    FusedOpState(const FusedOpState&) = delete;
    FusedOpState& operator=(const FusedOpState&) = delete;

    const char* op;  ///< "ag_gemm" ...: logs, errors and the autotuner's key
    Team team;       ///< the ranks the op runs on; rank and num_ranks below are team values
    World* world;    ///< the team's World: heap, SM budget (per device, not per team), timeout, diagnostics
    int num_ranks = 1, rank = 0;
    DeviceCtx ctx{};                   ///< team.device_ctx(): peers indexed by team rank
    uint64_t pipeline_timeout_ns = 0;  ///< fused_gemm_timeout_ns(world)
    int budget = 1;                    ///< SMs of the op (set by the op)

    SymmetricAllocations heap;
    StreamSet streams;

    /// A call whose wait gave up (a peer that never called, an aborted World) leaves the op's flags and epochs out of
    /// step across ranks: once an abort was cleared after the op was made, refuse_after_abort() refuses its calls.
    detail::AbortMark abort_mark;
    /// Throws weft::Error naming `op` once an abort was cleared since the op was made; on a team of one only for an op
    /// whose kernels wait for each other there too (`waits_alone`: the TP MoE layers' signal words).
    void refuse_after_abort(bool waits_alone = false) const;

    std::vector<FusedGemm> gemms;  ///< [0]: the op's choice (heuristic or forced); the rest: tuning candidates
    size_t active = 0;             ///< the config calls use
    bool tuned = false;
    FirstCallSync first_calls;

    /// Compiles and loads `spec`'s kernel for every config (before anything spins: lazy loading behind a waiting
    /// kernel can deadlock) and arms the first-call synchronisation for them when `sync_first_calls`. Kernels not yet
    /// cached are compiled first with progress lines naming the op and `problem` (e.g. "8192x14336x4096 bf16").
    void load_gemms(const std::vector<GemmConfig>& configs, const FusedGemmSpec& spec, bool sync_first_calls,
                    const std::string& problem = {});
    const GemmConfig& config() const { return gemms[active].config(); }

    /// One call (see the struct comment). `prepare(size_t config_idx)` returns the op's Call for gemms[config_idx];
    /// `launch(const Call&, size_t config_idx, cudaStream_t)` enqueues it; `problem()` describes the call for the
    /// autotuner's key (called only to tune).
    template <class Problem, class Prepare, class Launch>
    void run(cudaStream_t stream, uint64_t tune_tag, Problem&& problem, Prepare&& prepare, Launch&& launch) {
        using Call = std::decay_t<std::invoke_result_t<Prepare&, size_t>>;
        if (gemms.size() > 1 && !tuned && !stream_is_capturing(stream)) {
            // Each candidate is set up (prepare) on every rank before any of its runs is launched anywhere; its
            // runs only launch, and with more than one rank they run in lockstep (TuneOptions::collective_runs).
            std::vector<Call> calls(gemms.size());
            std::vector<jit::TuneCandidate> cands;
            for (size_t i = 0; i < gemms.size(); ++i) {
                cands.emplace_back(
                    config_text(gemms[i].config()),
                    [this, &calls, &launch, i](cudaStream_t st) { launch_and_sync(launch, calls[i], i, st); },
                    [&calls, &prepare, i] { calls[i] = prepare(i); });
            }
            WEFT_NVTX_RANGE("autotune");
            tune(stream, tune_tag, problem(), cands);
        }
        std::optional<Call> call;
        {
            WEFT_NVTX_RANGE("setup");
            call.emplace(prepare(active));
        }
        WEFT_NVTX_RANGE("launch");
        launch_and_sync(launch, *call, active, stream);
    }

private:
    template <class Launch, class Call>
    void launch_and_sync(Launch& launch, const Call& call, size_t idx, cudaStream_t stream) {
        launch(call, idx, stream);
        heap.note_use(stream);
        first_calls.after_call(team, idx, stream);
    }
    /// Whether `stream` is being captured (throws on a CUDA error).
    static bool stream_is_capturing(cudaStream_t stream);
    /// Times `cands` on every member, adopts the winner (active, tuned) and logs it.
    void tune(cudaStream_t stream, uint64_t tag, const std::string& problem,
              const std::vector<jit::TuneCandidate>& cands);
};

}  // namespace weft::ops::tp_detail
