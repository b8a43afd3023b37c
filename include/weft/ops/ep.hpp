// SPDX-License-Identifier: MIT
// weft::ops::ep: expert-parallel MoE dispatch and combine over a team (a World's, or any weft::Team), normal
// (throughput) and low-latency (decode) modes.
//
//     weft::ops::ep::Config cfg{.num_experts = 256, .hidden = 7168, .topk = 8, .max_tokens_per_rank = 4096,
//                               .low_latency = false};  // low-latency buffers: at most 1024 tokens per rank
//     weft::ops::ep::Buffer ep(team, cfg);                      // collective: symmetric buffers, kernels loaded
//     weft::ops::ep::NormalHandle h = ep.make_normal_handle();  // collective: one in-flight dispatch
//     ep.dispatch(h, x, topk_idx, topk_weights, stream);        // rows land expert-contiguous in h.recv_x()
//     weft::ops::grouped_gemm_contiguous(h.recv_x(), w, y, weft::BLayout::kNK, h.expert_offsets(),
//                                        h.expert_counts(), stream);  // your per-expert computation
//     ep.combine(h, y, out, stream);                            // weighted sum over the k experts, token order
//     ep.check();                                               // device-reported errors, without a sync
//
// Every dispatch and combine call is asynchronous, graph-capturable and never synchronises the host: sizes are
// exchanged between ranks on the device. Making and releasing a Buffer or a handle allocates and waits on the
// Buffer's own stream: do it outside a capture on this thread. A Buffer belongs to a team (World::team() for the whole
// World, or a split of it): ranks, experts and rank order are the team's. Every member of the team calls the same
// sequence of collective calls (dispatch, combine, low-latency halves) on a non-blocking stream of its own (ranks that
// are threads of one process share the legacy default stream, which would serialise their mutually waiting kernels:
// refused, as is a blocking stream, which synchronises with it); calls on one Buffer must be ordered (one stream, or
// streams joined by events). Buffers of teams that share no member may run at the same time. Design, diagrams and
// pitfalls: kernels/ep/README.md. A team that spans nodes (both modes; the same number of members on every node, NCCL
// available) exchanges fixed-size records over the network and gives the same results and receive layout:
// docs/multinode.md, "EP across nodes". EP's vocabulary (a Config, a Buffer, two kinds of handle, their options and
// views) lives in its own namespace, weft::ops::ep, rather than behind an Ep prefix on a dozen names.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weft/common/ep_workspace.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft {
class Team;
class World;
namespace jit {
struct KernelSpec;
}
}  // namespace weft

namespace weft::ops::ep {

// The structs the op shares with its kernels (weft/common/ep_workspace.hpp), under this namespace too.
using weft::ep::Geometry;
using weft::ep::KernelId;
using weft::ep::kFp8GroupSize;
using weft::ep::kFp8Max;
using weft::ep::kFp8MinAmax;
using weft::ep::kInfoCall;
using weft::ep::kInfoInts;
using weft::ep::kInfoNumTokens;
using weft::ep::kInfoRecvRows;
using weft::ep::kInfoRecvTokens;
using weft::ep::kInfoValid;
using weft::ep::kMaxExpertAlignment;
using weft::ep::kMaxExperts;
using weft::ep::kMaxLowLatencyTokens;
using weft::ep::kMaxRanks;
using weft::ep::kMaxTopk;
using weft::ep::LowLatencyHandleView;
using weft::ep::NormalFused;
using weft::ep::NormalHandleView;
using weft::ep::Status;
using weft::ep::StatusCode;
using weft::ep::Workspace;

/// The limits every buffer is sized from. Fixed for a Buffer's life; a call beyond them is an error
/// (host-checked where the host knows the size, device-reported otherwise), never a truncation. resolve_geometry
/// also requires the resolved max_recv_tokens and max_tokens_per_rank * min(k, ranks) to fit in int32, max_recv_rows
/// to be at most 2^31 - 2^24 (recv_x feeds a grouped GEMM), and the kernels' shared memory (which grows with E, and in
/// low-latency mode with T * k) to fit one block.
struct Config {
    int num_experts = 0;          ///< E: a multiple of the number of ranks, <= kMaxExperts
    int hidden = 0;               ///< H (bf16 channels): a multiple of 8, <= 2^20; of 128 for fp8 low-latency (checked
                                  ///< by the fp8 dispatch, not here)
    int topk = 0;                 ///< k: 1..min(kMaxTopk, E)
    int max_tokens_per_rank = 0;  ///< T per call: 1..2^24 (low_latency: <= kMaxLowLatencyTokens); more is an error
    bool normal = true;           ///< allocate the normal mode's buffers
    bool low_latency = true;      ///< allocate the low-latency mode's buffers
    /// Normal mode: distinct (source rank, token) pairs one rank may receive; 0 = the worst case
    /// (num_ranks * max_tokens_per_rank). Exceeding it is reported by every rank (kRecvTokensOverflow; on a
    /// team that spans nodes by the overflowing rank only).
    int64_t max_recv_tokens = 0;
    /// Normal mode: expert-contiguous rows one rank may receive, padding included; 0 = the worst case
    /// (num_ranks * max_tokens_per_rank * min(k, experts per rank) plus padding). Exceeding it is
    /// reported by every rank (kRecvRowsOverflow; across nodes by the overflowing rank only). See
    /// expected_recv_rows() for a sizing estimate.
    int64_t max_recv_rows = 0;
    /// Normal mode: each local expert's segment starts at a multiple of this (a grouped GEMM's M tile),
    /// 1..kMaxExpertAlignment.
    int expert_alignment = 1;
};

/// Validates `config` for `num_ranks` ranks and fills in the defaults. Throws weft::Error naming the
/// field, the expectation and the value found.
Geometry resolve_geometry(const Config& config, int num_ranks, int rank);

/// Bytes each rank needs, by owner. On one node: the sizes of the five allocations of Workspace::make(geometry). Across
/// nodes (footprint(config, num_ranks, num_nodes)): the Buffer's symmetric and device bytes include the one-rank
/// Buffer's (normal mode) and the node table, each handle's device bytes its exchange buffers (and, normal mode, the
/// one-rank handle's, whose symmetric bytes are the handle's), plus the node team's collective workspace.
struct Footprint {
    uint64_t buffer_symmetric_bytes = 0;           ///< symmetric heap: signals, mailboxes, low-latency areas
    uint64_t buffer_device_bytes = 0;              ///< private device memory of the Buffer (state)
    uint64_t normal_handle_symmetric_bytes = 0;    ///< symmetric heap per NormalHandle (recv_x, records, landing)
    uint64_t normal_handle_device_bytes = 0;       ///< private device memory per NormalHandle (layout, counts)
    uint64_t low_latency_handle_device_bytes = 0;  ///< private device memory per LowLatencyHandle (outputs)
    /// Across nodes only (else 0): the symmetric heap the node stage of ops::all_to_all takes for the exchanges (the
    /// node team's collective workspace, collective_workspace_heap_bytes(ranks per node)). Once per World and node
    /// team: Buffers of one team, and other collectives on its node team, share it.
    uint64_t node_collectives_symmetric_bytes = 0;
    /// Symmetric heap bytes for the Buffer and `normal_handles` handles (and the node stage's workspace), with
    /// allocation slack.
    uint64_t heap_bytes(int normal_handles) const;
    /// Everything one rank allocates for the Buffer, `normal_handles` and `low_latency_handles` handles.
    uint64_t total_bytes(int normal_handles, int low_latency_handles) const;
    std::string describe() const;
};

/// Memory one rank needs for `config` with `num_ranks` ranks on one node (no allocation; no GPU needed).
Footprint footprint(const Config& config, int num_ranks);
/// Memory one rank needs for `config` on a team of `num_ranks` ranks spread evenly over `num_nodes` nodes
/// (Team::num_nodes(); num_ranks / num_nodes members each), as the Buffer across nodes allocates it
/// (docs/multinode.md, "EP across nodes"): the normal mode's two-hop dispatch (the default; WEFT_EP_ACROSS_NODES=
/// all_to_all allocates less), the node stage's collective workspace with WEFT_COLLECTIVE_STAGING_BYTES as set in
/// this process. num_nodes = 1 is footprint(config, num_ranks). Throws weft::Error when num_nodes < 1 or does not
/// divide num_ranks, or as footprint(config, num_ranks) does. Not counted: the network backend's own memory and the
/// stream-ordered scratch of each all_to_all call across nodes (freed at its end).
Footprint footprint(const Config& config, int num_ranks, int num_nodes);

/// Expected normal-mode receive rows per rank under uniform routing (k distinct experts per token
/// drawn uniformly), with `alignment` padding per expert: a sizing aid for Config::max_recv_rows.
int64_t expected_recv_rows(const Config& config, int num_ranks);
/// Expected distinct tokens one rank receives under uniform routing.
int64_t expected_recv_tokens(const Config& config, int num_ranks);

/// The default number of SMs (blocks) of a normal dispatch/combine: one per 64 tokens, at least 1, at
/// most 24 and at most the rank's SM budget.
int default_normal_sms(int num_tokens, int sm_budget);
/// The default number of SMs of a low-latency kernel: one per 32 routes, at least 1, at most the budget.
int default_low_latency_sms(int num_tokens, int topk, int sm_budget);

/// The kernel specialisations the ops launch (also listed in kernels/ep/aot_specs.txt).
std::vector<jit::KernelSpec> kernel_specs();
/// Registers kernel_specs() with weft::jit's ahead-of-time registry (once per process; called by
/// weft::ops::register_op_aot_specs, i.e. weft-compile --builtin). Thread-safe.
void register_ep_aot_specs();

/// Which half of a low-latency operation a call launches.
enum class Phase {
    kSendRecv,  ///< both, in one kernel
    kSend,      ///< only the send half: returns without waiting for any peer's data
    kRecv,      ///< only the receive half of the oldest outstanding send (launch it later)
};

struct NormalOptions {
    int num_sms = 0;  ///< blocks of the dispatch/combine kernel; 0 = default_normal_sms()
    /// Expert GEMMs running alongside (MoeBlock, weft/ops/ep_moe.hpp; the contract of each word: NormalFused in
    /// weft/common/ep_workspace.hpp). Dispatch: counts_ready, expert_ready and expert_rows, all or none; combine:
    /// tile_done with its geometry, or null. Default: none. For kernels that keep that contract (MoeBlock does): the
    /// host checks only the pointers and the counters' stride, so a GEMM that raises the words otherwise (another
    /// tile_m, fewer tiles per row than tile_target) leaves the combine waiting until its timeout, or reading early.
    NormalFused fused{};
};

struct LowLatencyOptions {
    /// dispatch: quantise rows to e4m3, one fp32 scale per 128 channels. A kRecv call must repeat its send's value
    /// (weft::Error otherwise).
    bool fp8 = false;
    Phase phase = Phase::kSendRecv;
    int num_sms = 0;  ///< 0 = default_low_latency_sms()
};

/// A device-reported error, as read from the status word.
struct StatusReport {
    StatusCode code = StatusCode::kOk;
    Status raw{};         ///< as the kernel wrote it (rank and culprit_rank are team ranks; across nodes the
                          ///< one-rank Buffer's report, its rank 0 given as this rank's team rank)
    std::string message;  ///< names the world rank, the limit and the value (and the team, for a Buffer of a split)
};

class Buffer;

/// One normal dispatch in flight: its receive buffers (symmetric), its layout and the plan its
/// combine reuses. Created collectively (over the Buffer's team) by Buffer::make_normal_handle(); freed
/// collectively by its destructor (every member destroys its handles in the same order, before the Buffer).
class NormalHandle {
public:
    NormalHandle(NormalHandle&&) noexcept;
    NormalHandle& operator=(NormalHandle&&) noexcept;
    ~NormalHandle();

    /// bf16 [max_recv_rows, H] in the symmetric heap. After dispatch: rows of local expert e at
    /// [expert_offsets[e], expert_offsets[e] + expert_counts[e]), ordered by (source rank, source
    /// token); padding rows hold unspecified values. Valid until the next dispatch on this handle.
    TensorView recv_x() const;
    const int32_t* expert_counts() const;   ///< device int32 [E_local]
    const int32_t* expert_offsets() const;  ///< device int32 [E_local + 1]; the last entry: every expert's rows
    /// Device pointers of the handle's arrays (recv_x, recv_meta and landing in the symmetric heap, the rest in
    /// private device memory).
    const NormalHandleView& view() const;
    /// T of the last dispatch (host-side), -1 before the first.
    int num_tokens() const;

private:
    friend class Buffer;
    struct Impl;
    explicit NormalHandle(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

/// One low-latency dispatch's outputs (masked layout) and the plan its combine reuses. Local (not
/// collective); made by Buffer::make_low_latency_handle().
class LowLatencyHandle {
public:
    LowLatencyHandle(LowLatencyHandle&&) noexcept;
    LowLatencyHandle& operator=(LowLatencyHandle&&) noexcept;
    ~LowLatencyHandle();

    /// [E_local, W * max_tokens, H]: bf16, or fp8 e4m3 after an fp8 dispatch (typed by the last send: between an
    /// fp8 kSend and its kRecv the view is e4m3 while it still holds the previous receive). Rows [0, count) of each
    /// expert are valid, ordered by (source rank, source token).
    TensorView recv_x() const;
    /// f32 [E_local, W * max_tokens, H / 128]: the scale of each 128-channel group (fp8 dispatches).
    TensorView recv_scales() const;
    const int32_t* expert_counts() const;
    /// Device pointers of the handle's arrays (private device memory).
    const LowLatencyHandleView& view() const;
    bool fp8() const;

private:
    friend class Buffer;
    struct Impl;
    explicit LowLatencyHandle(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

/// The expert-parallel communication buffers of one rank of a team. Collective construction and destruction
/// (over the team's members).
class Buffer {
public:
    /// Collective over the team's members: every member calls with the same config (num_experts a multiple of
    /// team.num_ranks()). Allocates the symmetric buffers (team-collective heap allocations) and the device
    /// state, and compiles and loads every kernel (before any of them can spin). A rank that is not a member of
    /// `team` gets weft::Error naming the team's world ranks. The Buffer keeps a copy of `team`. A team that spans
    /// nodes also builds the network backend's column communicators here (bounded by the World's timeout) and, for
    /// the normal mode, a one-rank Buffer of this rank's experts (docs/multinode.md). What it and its handles
    /// allocate: footprint(config, team.num_ranks(), team.num_nodes()).
    Buffer(const Team& team, const Config& config);
    /// Buffer(world.team(), config).
    Buffer(World& world, const Config& config);
    /// Collective over the team: waits for this Buffer's eager work (not the whole device's), then frees its
    /// buffers. Its calls are made by one thread and ordered on one stream (or by events: two calls racing on two
    /// streams share its signal words and buffers); a CUDA graph that captured a call must not be replayed once it
    /// is gone (replays are not waited for).
    ~Buffer();
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;

    const Config& config() const;
    const Geometry& geometry() const;
    World& world() const;
    const Team& team() const;

    // ---- normal mode ----
    /// Collective: a handle with its own receive buffers (symmetric heap, Footprint's per-handle size). Every rank
    /// makes its handles in the same order and dispatches on the same one: a dispatch whose ranks use different
    /// handles moves nothing and reports kCallMismatch on every rank (check()), naming both handles.
    NormalHandle make_normal_handle();
    /// The layout kernel alone (counts, token->rank mask, stable offsets) into the handle's layout
    /// arrays. Local. `topk_idx`: int32 [T, k], T <= max_tokens_per_rank. Refused (weft::Error) on a handle that was
    /// dispatched and not combined since: that combine reads the dispatch's layout. After it, the handle's last
    /// dispatch is retired: a combine needs another dispatch first.
    void layout(NormalHandle& handle, const TensorView& topk_idx, cudaStream_t stream);
    /// Collective: layout, then dispatch. x: bf16 [T, H]; topk_idx: int32 [T, k] (-1 = dropped; an id outside
    /// [-1, E), or one repeated within a token's k, is dropped too and reported by check() on this rank as
    /// kInvalidExpert / kDuplicateExpert: a token's valid slots are its first of each expert in [0, E));
    /// topk_weights: f32 [T, k]. T may differ between ranks. Receive capacity overflow is detected on
    /// the device by every rank, nothing moves, and check() reports it. A dispatch on a handle dispatched and not
    /// combined since replaces that dispatch (its received rows and its layout): the next combine is the latest
    /// dispatch's (use a handle per dispatch in flight). x, topk_idx and topk_weights must not lie in this handle's
    /// own receive area (recv_x and its records: the dispatch writes there while it reads them; another handle's
    /// recv_x is fine). Every view of every EP op is this GPU's device (or managed) memory or the symmetric heap:
    /// host memory and another GPU's are refused.
    void dispatch(NormalHandle& handle, const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
                  cudaStream_t stream, const NormalOptions& options = {});
    /// Collective: y: bf16 [>= max_recv_rows, H] laid out like recv_x (it may be recv_x itself);
    /// out: bf16 [T, H] with T of the handle's dispatch, its bytes apart from y's. out[t] = sum over t's valid slots j
    /// of topk_weights[t][j] * y[row of (t, j)], accumulated in fp32 (per destination rank in slot order, rounded once
    /// to bf16, then over ranks in rank order), rounded to bf16. Deterministic.
    void combine(NormalHandle& handle, const TensorView& y, const TensorView& out, cudaStream_t stream,
                 const NormalOptions& options = {});

    // ---- low-latency mode ----
    LowLatencyHandle make_low_latency_handle();
    /// Collective. x: bf16 [T, H], topk_idx: int32 [T, k]. At most two sends may be outstanding (sent,
    /// not yet received) per Buffer; kRecv completes the oldest one and must name its handle. On a team that spans
    /// nodes kSend carries the whole exchange and kRecv launches nothing (docs/multinode.md, "EP across nodes").
    void low_latency_dispatch(LowLatencyHandle& handle, const TensorView& x, const TensorView& topk_idx,
                              cudaStream_t stream, const LowLatencyOptions& options = {});
    /// Collective. y: bf16 [E_local, W * max_tokens, H] (row stride may be larger than H); topk_idx
    /// and topk_weights as given to the dispatch; out: bf16 [T, H]. out[t] = sum over valid j of
    /// topk_weights[t][j] * y[row of (t, j)], fp32 fma in slot order, rounded once to bf16. A token whose topk_idx
    /// row differs from the one its dispatch sent is reported (kCombineRoutingMismatch, check()) and its row of out
    /// written as zeros. Every rank combines the same dispatch (combine the handles in the order they were
    /// dispatched): within a node, a rank whose peers sent back rows of another dispatch reports kCallMismatch and
    /// writes out as zeros.
    void low_latency_combine(LowLatencyHandle& handle, const TensorView& y, const TensorView& topk_idx,
                             const TensorView& topk_weights, const TensorView& out, cudaStream_t stream,
                             const LowLatencyOptions& options = {});

    // ---- errors the kernels report ----
    /// Reads this rank's status word (host-mapped memory: no synchronisation, sees every kernel that
    /// has completed) and throws weft::Error describing the first error, if any. Every error the kernels report leaves
    /// the Buffer consistent, and no call refuses on it: a call that starts an exchange (dispatch, a low-latency
    /// dispatch's kSendRecv or kSend; layout, which is local, too) logs a pending error once as a warning and goes
    /// ahead (whether a rank's host sees the error before its next call depends on its GPU's progress; a rank that
    /// refused alone would leave the others waiting for it until their timeout). Call check() (or sync_and_check())
    /// after the calls whose errors you handle. The word stays set until clear_status().
    void check() const;
    /// world().sync_and_check(stream), then check().
    void sync_and_check(cudaStream_t stream);
    /// The first error a kernel reported, if any (check() without the throw).
    std::optional<StatusReport> status() const;
    /// Empties the status word. Call it once no kernel of this Buffer runs (after sync_and_check): a kernel writing
    /// its report meanwhile could leave a record whose fields were cleared under it.
    void clear_status();

private:
    friend struct NormalHandle::Impl;
    friend struct LowLatencyHandle::Impl;
    struct Impl;
    void construct(const Team& team, const Config& config);  // the constructor's work (it cleans up on a throw)
    std::unique_ptr<Impl> impl_;
};

/// The message check() throws for a status record (exposed for tests).
std::string describe_status(const Status& status);

}  // namespace weft::ops::ep
