// SPDX-License-Identifier: MIT
// Tensor-parallel MoE: the gathered layout of the grouped GEMM and the two fused TP MoE layers.
//
//   routing    topk_idx [T, topk] (expert of each slot, -1 = none) -> MoeRouting: expert e's rows
//              [offsets[e], offsets[e] + counts[e]) of the gathered rows, in (token, k) order; gather_index[r] the
//              token of row r; slot_rows[t * topk + k] the row of slot (t, k) (-1: dropped)
//   gathered   A rows read through gather_index, D rows in expert order (grouped_gemm_gathered), or written back to
//              token order per slot or as the top-k weighted sum (grouped_gemm_gathered_combine)
//   layer 0    MoeAgGroupedGemm: tokens sharded by rank [M/W, H], experts' weights sharded by columns [E, F/W, H]:
//              y [rows, F/W] = gathered x * w^T per expert, the rows pushed by their owners while the GEMM runs
//   layer 1    MoeGroupedGemmRs: h [rows, F/W] * w [E, H, F/W]^T partial per rank, summed over ranks and a token's
//              slots (weighted) into this rank's tokens [M/W, H], the reduction overlapped with the GEMM
//   (ranks of one process sharing a GPU: the push and the combine run on the caller's stream, before and after the
//   GEMM, not beside it; kernels/moe_tp/README.md, "Pitfalls"; a team of one: the gather, the GEMM and the combine
//   one after another, each on the whole SM budget, nothing waits)
//
//     weft::ops::MoeAgGroupedGemm up(team, shape);  weft::ops::MoeGroupedGemmRs down(team, shape);
//     up.run(x_local, topk_idx, w_up, y, stream);            // y: per (token, k) row, grouped by expert
//     /* activation on y -> h */
//     down.run(h, w_down, up.routing(), topk_weights, out_local, stream);
//
// The gathered layout runs as three launches: the rows gathered into a workspace (16-byte copies), the contiguous
// grouped GEMM (kernels/gemm, one engine), the rows combined back; Hopper's TMA has no row gather, and a cp.async
// producer for gathered rows is not in the engine yet. kernels/moe_tp/README.md: protocol, schedule, pitfalls.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weft/common/gemm_config.hpp"
#include "weft/common/moe_tp_params.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/grouped_gemm.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft {
class Team;
class World;
}  // namespace weft

namespace weft::ops {

using weft::moe::MoeCombineMode;
using weft::moe::MoeRoutingStatus;

/// Rows the gathered layout of T tokens, top-k and E experts needs with each expert padded to `align` rows:
/// T * topk + E * (align - 1).
int64_t moe_gathered_rows(int64_t tokens, int64_t topk, int64_t num_experts, int64_t align = 1);

/// The gathered layout's index arrays (device memory, int32; the caller's or an op's).
struct MoeRouting {
    int32_t* counts = nullptr;        ///< [E]
    int32_t* offsets = nullptr;       ///< [E + 1]; offsets[E]: rows used
    int32_t* gather_index = nullptr;  ///< [rows_capacity]
    int32_t* slot_rows = nullptr;     ///< [tokens * topk]
    int64_t num_experts = 0;
    int64_t rows_capacity = 0;  ///< >= moe_gathered_rows(tokens, topk, E, align)
    int64_t tokens = 0;
    int64_t topk = 0;
};

/// Fills `routing` (its num_experts, rows_capacity, pointers; tokens and topk are set from topk_idx) from topk_idx
/// [T, topk] int32 (row-major, device memory): two launches on `stream`, deterministic (no atomics on the result). An
/// index outside [-1, E) drops its slot and is recorded in `status` (device or host-mapped, zero-initialised; the first
/// bad slot claims it), when given. An expert named twice in one token's row gets two rows (one per slot; a weighted
/// combine then adds both, each with its slot's weight): unlike ep::Buffer, which drops the repeat and reports it.
/// Throws weft::Error for bad arguments (capacity too small, null arrays, topk outside [1, 64]).
void moe_route(const TensorView& topk_idx, MoeRouting& routing, int64_t align, cudaStream_t stream,
               MoeRoutingStatus* status = nullptr);

/// "" for a zero record, else what the routing found.
std::string describe_routing_status(const MoeRoutingStatus& status);

/// Gathered grouped GEMM, D in expert order: d[r] = a[gather_index[r]] * B[g] for the rows r of each group g
/// (routing.offsets/counts), rows of no group untouched. a [T, K] bf16; b [E, N, K] (kNK) or [E, K, N] (kKN) bf16;
/// d [rows_capacity, N] bf16 or f32; a_rows [rows_capacity, K] bf16 is the workspace the rows are gathered into (zeros
/// for padding rows). a_rows must overlap none of a, b, routing.gather_index, counts and offsets; d none of a_rows, b,
/// routing.counts and routing.offsets. Asynchronous on `stream`, capturable once its kernels exist; as
/// grouped_gemm_contiguous otherwise (options, status, alignment rules).
void grouped_gemm_gathered(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout,
                           const MoeRouting& routing, const TensorView& a_rows, cudaStream_t stream,
                           const GroupedGemmOptions& options = {});

/// Gathered grouped GEMM written back to token order: d_rows [rows_capacity, N] f32 (workspace) = the expert-ordered
/// product as above, then
///   kPerSlot:     out [T * topk, N]: row t*topk+k = d_rows[slot_rows[t*topk+k]] (zeros for a dropped slot)
///   kWeightedSum: out [T, N]: row t = sum over k (by ascending row: for a routing moe_route made, ascending
///                 expert, then k) of weights[t, k] * d_rows[slot_rows[t*topk+k]], in fp32 registers, cast once; a
///                 token with no slot gets zeros
/// A slot row outside [0, rows_capacity) is a dropped slot. weights: [T, topk] f32 or an empty view (weight 1). out
/// bf16 or f32, N a multiple of 8. out must overlap none of d_rows, weights and the routing's slot_rows, counts and
/// offsets; d_rows neither weights nor slot_rows. Deterministic: the same bits on every run.
void grouped_gemm_gathered_combine(const TensorView& a, const TensorView& b, const TensorView& out, BLayout b_layout,
                                   const MoeRouting& routing, MoeCombineMode mode, const TensorView& weights,
                                   const TensorView& a_rows, const TensorView& d_rows, cudaStream_t stream,
                                   const GroupedGemmOptions& options = {});

/// The combine alone: d_rows [rows_capacity, N] f32 (expert-ordered rows, e.g. a contiguous grouped GEMM's output on
/// the gathered rows) back to token order as grouped_gemm_gathered_combine does (kPerSlot / kWeightedSum, weights,
/// out). One launch on `stream`; deterministic.
void moe_combine(const TensorView& d_rows, const MoeRouting& routing, MoeCombineMode mode, const TensorView& weights,
                 const TensorView& out, cudaStream_t stream);

/// The forms of 0.1 that took an fp32 `acc` workspace [T, N]: the combine sums in registers now and reads none.
[[deprecated("the combine takes no acc workspace: drop the argument")]] inline void moe_combine(
    const TensorView& d_rows, const MoeRouting& routing, MoeCombineMode mode, const TensorView& weights,
    const TensorView& /*acc*/, const TensorView& out, cudaStream_t stream) {
    moe_combine(d_rows, routing, mode, weights, out, stream);
}
[[deprecated("the combine takes no acc workspace: drop the argument")]] inline void grouped_gemm_gathered_combine(
    const TensorView& a, const TensorView& b, const TensorView& out, BLayout b_layout, const MoeRouting& routing,
    MoeCombineMode mode, const TensorView& weights, const TensorView& a_rows, const TensorView& d_rows,
    const TensorView& /*acc*/, cudaStream_t stream, const GroupedGemmOptions& options = {}) {
    grouped_gemm_gathered_combine(a, b, out, b_layout, routing, mode, weights, a_rows, d_rows, stream, options);
}

// ---- TP MoE layers ---------------------------------------------------------------------------------------------

/// Problem bounds of a TP MoE layer, fixed when the op is made (symmetric buffers are sized from them).
struct MoeTpShape {
    int64_t max_tokens = 0;  ///< largest M of a call (all ranks' tokens); a positive multiple of the team's size;
                             ///< max_tokens x topk at most 2^31 - 2^24
    int64_t hidden = 0;      ///< H: layer 0's K, layer 1's N; a multiple of 8, at most 2^31 - 2^24
    int64_t ffn = 0;  ///< F / W, this rank's shard: layer 0's N, layer 1's K; a multiple of 8, at most 2^31 - 2^24
    int64_t num_experts = 0;  ///< E, 1 .. 4096
    int64_t topk = 0;         ///< 1 .. min(64, num_experts)
};

/// Knobs. Zero / empty: chosen from the problem and the device.
struct MoeTpOptions {
    int sm_budget = 0;                     ///< SMs of the op's kernels; 0 = World::sm_budget(); where ranks share a
                                           ///< GPU, at most World::shared_sm_budget() (weft::Error on every member
                                           ///< otherwise: the members' kernels wait for each other, all resident)
    int comm_blocks = 0;                   ///< CTAs of the push (layer 0) / combine (layer 1) kernel; 0 = heuristic
                                           ///< (the world's shared SM budget / 8); the same on every member (checked
                                           ///< at construction: a weft::Error naming both counts); a team of one
                                           ///< holds none beside its GEMM
    std::optional<GemmConfig> config;      ///< the grouped GEMM's config (is_valid_grouped, bf16 in, B [N, K]; out
                                           ///< bf16 for MoeAgGroupedGemm, is_valid_grouped_wait there; f32 for
                                           ///< MoeGroupedGemmRs)
    std::chrono::milliseconds timeout{0};  ///< bound on every wait on a peer; 0 = World::timeout() (the GEMM's
                                           ///< pipeline waits: twice it)
};

/// TP MoE layer 0: AllGather + grouped GEMM. Construction and destruction are collective over the team's members
/// (2 .. 8 ranks, or 1); the shape (but ffn, each member's own shard) and the communication CTAs must be the same on
/// every member (checked at construction: a weft::Error naming the field on every member, as is one member's
/// invalid shape). Not thread-safe: one rank's thread uses it.
class MoeAgGroupedGemm {
public:
    MoeAgGroupedGemm(const Team& team, const MoeTpShape& shape, const MoeTpOptions& options = {});
    MoeAgGroupedGemm(World& world, const MoeTpShape& shape, const MoeTpOptions& options = {});
    /// Collective over the team: waits for this op's eager work (not the whole device's), then frees its
    /// buffers. Its calls are made by one thread and ordered on one stream (or by events: two calls racing on two
    /// streams share its signal words and buffers); a CUDA graph that captured a call must not be replayed once it
    /// is gone (replays are not waited for).
    ~MoeAgGroupedGemm();
    MoeAgGroupedGemm(const MoeAgGroupedGemm&) = delete;
    MoeAgGroupedGemm& operator=(const MoeAgGroupedGemm&) = delete;

    /// y[r] = x[gather_index[r]] * w[g]^T for the rows r of each expert g, where team rank r's x_local holds tokens
    /// [r*M/W, (r+1)*M/W) of x.
    ///   x_local:  [M/W, hidden] bf16, at least one row (M >= W) (any device memory, row stride a multiple of 8)
    ///   topk_idx: [M, topk] int32, the same on every member (replicated routing; -1 = no expert)
    ///   w:        [E, ffn, hidden] bf16 (this rank's columns of every expert's weight)
    ///   y:        [rows_capacity(), ffn] bf16: row r is slot (gather_index[r], k)'s, grouped by expert (routing());
    ///             rows past routing's offsets[E] untouched; its bytes apart from x_local's and w's
    /// Every buffer is this GPU's device memory (host memory, or another GPU's, is refused naming it).
    /// Every member calls with the same M and topk_idx: each member's push carries its call's signature (M and the
    /// routing's per-expert counts) and the end of the call compares every member's with its own, so a member whose
    /// call differs is a mismatch that World::sync_and_check throws on every member, naming both calls (y is then
    /// wrong; two routings with the same counts per expert are not told apart). Asynchronous on `stream`; capturable in
    /// a CUDA graph after its first call (every value of the protocol is an epoch in device memory).
    void run(const TensorView& x_local, const TensorView& topk_idx, const TensorView& w, const TensorView& y,
             cudaStream_t stream);

    /// The routing of the last call (the op's device buffers, valid until the next call's routing on `stream`).
    MoeRouting routing() const;
    /// Rows of y: moe_gathered_rows(max_tokens, topk, E).
    int64_t rows_capacity() const;
    const GemmConfig& config() const;
    /// Record of bad expert indices in topk_idx (host-mapped, cumulative over calls; read after the stream's work).
    const MoeRoutingStatus& routing_status() const;

    struct State;

private:
    std::unique_ptr<State> s_;
};

/// TP MoE layer 1: grouped GEMM + top-k weighted reduction + ReduceScatter. Collective as MoeAgGroupedGemm.
class MoeGroupedGemmRs {
public:
    MoeGroupedGemmRs(const Team& team, const MoeTpShape& shape, const MoeTpOptions& options = {});
    MoeGroupedGemmRs(World& world, const MoeTpShape& shape, const MoeTpOptions& options = {});
    /// Collective over the team: waits for this op's eager work (not the whole device's), then frees its
    /// buffers. Its calls are made by one thread and ordered on one stream (or by events: two calls racing on two
    /// streams share its signal words and buffers); a CUDA graph that captured a call must not be replayed once it
    /// is gone (replays are not waited for).
    ~MoeGroupedGemmRs();
    MoeGroupedGemmRs(const MoeGroupedGemmRs&) = delete;
    MoeGroupedGemmRs& operator=(const MoeGroupedGemmRs&) = delete;

    /// out[t] = sum over k (by ascending expert, then k) of weights[T0 + t, k] * sum over ranks (in rank order) of (h *
    /// w^T)[slot_rows[ (T0 + t) * topk + k]], fp32 then cast, for this rank's tokens T0 = rank * M/W .. + M/W.
    ///   h:        [routing.rows_capacity, ffn] bf16, rows grouped by expert as routing says (layer 0's y after the
    ///             activation)
    ///   w:        [E, hidden, ffn] bf16 (this rank's K slice of every expert's down projection)
    ///   routing:  the same on every member (MoeAgGroupedGemm::routing(), or moe_route of the replicated topk_idx);
    ///             not compared across ranks: an expert with rows on one member and none on another leaves that
    ///             member's done word for it unraised, and the first member's combine ends at its wait's bound with
    ///             a diagnostic naming the member and the word (World::sync_and_check throws it; the kernels exit,
    ///             the context stays usable). A routing built by hand must keep every expert's rows inside
    ///             rows_capacity (0 <= offsets[g], offsets[g] + counts[g] <= rows_capacity): otherwise the rows past
    ///             it are neither computed nor read (their slots come out as dropped ones), and where the clamp
    ///             leaves the expert fewer tiles the same error as above.
    ///   weights:  [M, topk] f32, the same on every member
    ///   out:      [M/W, hidden] bf16 or f32; its bytes apart from h's, w's, weights' and routing's slot_rows, counts
    ///             and offsets
    /// Every buffer (the routing's arrays too) is this GPU's device memory (host memory, or another GPU's, is refused
    /// naming it).
    void run(const TensorView& h, const TensorView& w, const MoeRouting& routing, const TensorView& weights,
             const TensorView& out, cudaStream_t stream);

    int64_t rows_capacity() const;
    const GemmConfig& config() const;

    struct State;

private:
    std::unique_ptr<State> s_;
};

/// Checks a TP MoE shape and options against a team size (CPU only; the constructors call it). Throws weft::Error
/// naming the argument; `op` prefixes the message. `gemm_out`, when given: the layer's GEMM output dtype (bf16 for
/// MoeAgGroupedGemm, f32 for MoeGroupedGemmRs), which a forced options.config must produce (bf16: and be
/// is_valid_grouped_wait, as layer 0's GEMM waits for its rows).
void validate_moe_tp_shape(const MoeTpShape& shape, int num_ranks, const MoeTpOptions& options, const char* op,
                           std::optional<DType> gemm_out = std::nullopt);

namespace detail {
/// JIT specs of the kernels of the gathered layout and the TP MoE layers (`arch` as KernelSpec::arch).
jit::KernelSpec moe_kernel_spec(const std::string& name, const std::string& arch = "");
/// The layers' GEMMs: layer 0 (GatheredWaitScheduler) and layer 1 (GroupDoneHook), header moe_tp/moe_tp_gemm.cuh.
jit::KernelSpec moe_ag_gemm_kernel_spec(const GemmConfig& config, const std::string& arch = "");
jit::KernelSpec moe_gemm_rs_kernel_spec(const GemmConfig& config, const std::string& arch = "");
/// Names accepted by moe_kernel_spec.
std::vector<std::string> moe_kernel_names();

/// The bounds of a TP MoE layer's waits: `wait_ns` for every wait on a peer (the push, combine and wait kernels and
/// layer 0's per-tile wait): options.timeout, else the World's timeout; `pipeline_ns` = 2 x wait_ns for its GEMM's
/// pipeline waits, so a peer that stalls expires a peer wait first, whose Diagnostic names it, and not the GEMM's
/// pipeline, which traps without one (the rule of the other fused GEMMs: fused_gemm_timeout_ns).
struct MoeTpTimeouts {
    uint64_t wait_ns = 0;
    uint64_t pipeline_ns = 0;
};
MoeTpTimeouts moe_tp_timeouts(std::chrono::milliseconds world_timeout, std::chrono::milliseconds option);
}  // namespace detail

}  // namespace weft::ops
