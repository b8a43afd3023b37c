// SPDX-License-Identifier: MIT
// Kernel parameters of the gathered grouped GEMM and the tensor-parallel MoE layers (kernels/moe_tp/*.cuh), in a
// header that host-only code includes to fill them for a JIT launch.
#pragma once

#include "weft/common/collectives.hpp"
#include "weft/common/device_ctx.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/common/gemm_hook_params.hpp"
#include "weft/common/macros.hpp"

namespace weft::moe {

/// Most ranks of a TP MoE layer's team (the peers' pointers travel in fixed arrays of the kernel parameters).
inline constexpr int kMoeMaxRanks = 8;
/// Threads per CTA of the routing, gather, scatter and reduce kernels.
inline constexpr int kMoeThreads = 256;
inline constexpr int kMoeMaxTopk = 64;  ///< topk of a routing (moe_route) and of a TP MoE layer

/// A TP MoE layer-0 call's signature: the host's call descriptor (CollectiveOp::kMoeAgGemm, M, topk, hidden) with the
/// routing's per-expert counts folded into its digest (`routing` = the sum over experts e of
/// call_descriptor_mix(e + 1, counts[e])), so that members whose M or topk_idx differ disagree.
WEFT_HOST_DEVICE constexpr uint64_t moe_call_signature(uint64_t descriptor, uint64_t routing) {
    const uint64_t d = routing ^ (routing >> 20) ^ (routing >> 40);
    return (descriptor & ~0xFFFFFull) | ((descriptor ^ d) & 0xFFFFFull);
}

/// What the routing kernels found wrong in a top-k index list (device or host-mapped memory, zero-initialised by its
/// owner; the first bad slot of the first launch that finds one claims the record).
struct MoeRoutingStatus {
    int32_t code;   ///< 0: nothing found; 1: an expert index outside [-1, num_experts) (the slot was dropped)
    int32_t slot;   ///< token * topk + k of the first bad slot found
    int32_t value;  ///< the index it held
    int32_t limit;  ///< num_experts
};

/// The routing kernels' arguments (moe_routing.cuh): from topk_idx [tokens, topk] (expert of each slot, -1 = none) to
/// the gathered layout: expert e's rows are [offsets[e], offsets[e] + counts[e]) of the gathered rows, its slots in
/// (token, k) order; its padding rows (up to a multiple of `align`) and the rows from offsets[E] on hold -1.
struct MoeRoutingArgs {
    const int32_t* topk_idx;   ///< [tokens, topk]
    int32_t* counts;           ///< [E] rows of each expert
    int32_t* offsets;          ///< [E + 1] first row of each expert; offsets[E] = rows used (padding included)
    int32_t* gather_index;     ///< [rows_capacity] token of each gathered row, -1 for padding and unused rows
    int32_t* slot_rows;        ///< [tokens * topk] gathered row of each slot, -1 for a dropped (-1 or bad) slot
    MoeRoutingStatus* status;  ///< or nullptr
    int32_t tokens, topk, num_experts, align, rows_capacity;
};

/// The gather kernel's arguments: out[r] = a[gather_index[r]] for r in [0, rows), zeros where gather_index[r] < 0.
struct MoeGatherArgs {
    const unsigned short* a;      ///< [tokens, K] 16-bit rows, row stride lda elements
    unsigned short* out;          ///< [rows, K] row stride ldo elements
    const int32_t* gather_index;  ///< [rows]
    int64_t lda, ldo;
    int32_t rows, k, tokens;  ///< k: a multiple of 8; indices >= tokens are treated as -1
};

/// How the top-k reduce kernel writes the expert-sorted rows D back to token order.
enum class MoeCombineMode : int32_t {
    kPerSlot = 0,      ///< out [tokens * topk, N]: row t*topk+k = D[slot_rows[t*topk+k]] (zeros for a dropped slot)
    kWeightedSum = 1,  ///< out [tokens, N]: row t = sum over k (by ascending expert, then k) of weight[t, k] *
                       ///< D[slot_rows[t*topk+k]]
};

/// The top-k reduce kernels' arguments (moe_gather.cuh: moe_combine_kernel, which waits; moe_combine_ready_kernel,
/// which does not and ignores done, consumed, epoch and acc). D is fp32 rows [rows, N]; with more than one source (a
/// TP MoE layer's ReduceScatter) each source's D is another rank's partial product of the same rows and the kernel
/// sums the sources in index order; the waiting kernel reads group g's rows of source s only after *done[s][g] >=
/// *epoch (the source's GEMM finished group g). Tokens [token_begin, token_begin + tokens) are this launch's; out rows
/// are relative to token_begin. The sum over a token's slots runs in (group, k) order (the ready kernel: ascending
/// row, the same order for moe_route's layout): ascending expert index, then k; deterministic whatever the grid.
struct MoeCombineArgs {
    const float* partials[kMoeMaxRanks];  ///< D of each source [rows, N] (row stride ldp floats)
    const uint64_t* done[kMoeMaxRanks];   ///< [E] per-group "stored" words of each source (the waiting kernel)
    uint64_t* consumed[kMoeMaxRanks];     ///< waiting kernel: after its reads each block adds 1 to *consumed[s], or
                                          ///< nullptr
    const int32_t* slot_rows;             ///< [total tokens, topk]
    const int32_t* counts;                ///< [E]
    const int32_t* offsets;               ///< [E]
    const float* weights;                 ///< [total tokens, topk] (kWeightedSum), or nullptr: weight 1
    float* acc;                           ///< waiting kernel, kWeightedSum: fp32 scratch [tokens, N] (row stride N)
    void* out;                            ///< bf16 or f32 (out_f32), row stride ldo elements
    const uint64_t* epoch;                ///< waiting kernel: the call counter (the wait is for >= *epoch)
    DeviceCtx ctx;                        ///< bound and diagnostics of the waits
    int64_t ldp, ldo;
    int32_t num_sources, num_experts, topk, n;
    int32_t token_begin, tokens;
    int32_t rows;  ///< rows of each source's partials: a slot row outside [0, rows) is read as a dropped slot
    MoeCombineMode mode;
    int32_t out_f32;
    int32_t done_owner[kMoeMaxRanks];  ///< team rank of each source (named by a timeout's diagnostic)
};

/// The TP MoE layer 0 push kernel's arguments (moe_tp.cuh, moe_push_rows_kernel): this rank's tokens' rows, one per
/// routed slot, into every team member's gathered A [rows, K] at the slot's row, local member first; after a block's
/// share of a member's rows, one release add of 1 on that member's arrived[this rank]. Before writing into member q,
/// the kernel waits until q's GEMM of the previous call is over: *consumed[q] >= *epoch - 1 (q adds 1 per call).
struct MoePushArgs {
    DeviceCtx ctx;
    unsigned short* dst[kMoeMaxRanks];  ///< member q's gathered A
    uint64_t* arrived[kMoeMaxRanks];    ///< &(member q's arrived[this rank])
    const uint64_t* consumed;           ///< [W] local words the members' end-of-call notify adds to
    const unsigned short* x;            ///< [tokens_per_rank, K] this rank's tokens, row stride ldx
    const int32_t* slot_rows;           ///< [W * tokens_per_rank, topk]
    const uint64_t* epoch;
    int64_t ldx, ldd;
    int32_t tokens_per_rank, topk, k, num_ranks, rank;
    uint64_t* signature_at[kMoeMaxRanks];  ///< &(member q's signatures[this rank]): the call's, before its arrived add
    uint64_t descriptor;                   ///< the host's part of moe_call_signature
    const int32_t* counts;                 ///< [num_experts] this call's routing counts
    int32_t num_experts;
};

/// Adds `value` to *words[i] for i in [0, n) with release semantics at system scope (one thread per word): the end of
/// a call tells every member that this rank is done with the data it read from it. With `signatures` set (layer 0),
/// first waits (bounded) for every member's pushes (arrived[q] >= *epoch * per_epoch) and compares the signature
/// each wrote (signatures[q]) with this call's: one that differs records a kCollectiveMismatch (the abort raised).
struct MoeNotifyArgs {
    uint64_t* words[kMoeMaxRanks];
    uint64_t value;
    int32_t n;
    int32_t num_experts;
    DeviceCtx ctx;
    const uint64_t* arrived;     ///< [n] local
    const uint64_t* signatures;  ///< [n] local, or null: no check
    const uint64_t* epoch;
    uint64_t per_epoch;
    uint64_t descriptor;    ///< as MoePushArgs::descriptor
    const int32_t* counts;  ///< as MoePushArgs::counts
};

/// Waits until *words[i] >= *epoch * per_epoch - lag for i in [0, n) (one thread per word, bounded).
struct MoeWaitArgs {
    DeviceCtx ctx;
    const uint64_t* words[kMoeMaxRanks];
    int32_t owner[kMoeMaxRanks];  ///< the team rank that raises each word (a timeout's diagnostic names it)
    const uint64_t* epoch;
    uint64_t per_epoch, lag;
    int32_t n;
};

/// GatheredWaitScheduler's parameters (TP MoE layer 0): the grouped GEMM over gathered rows whose producer waits, per
/// tile, until every team member whose tokens the tile's rows hold has pushed its rows: arrived[s] >= *epoch * blocks
/// for each source rank s of the tile's first and last row (rows sorted by token within a group: the sources of a
/// tile are the ranks between them).
struct GatheredWaitParams {
    weft::gemm::GroupedSchedulerParams groups;
    const int32_t* gather_index;  ///< [rows] token of each row (global index)
    const uint64_t* arrived;      ///< [W] local words, raised by the members' push kernels
    const uint64_t* epoch;
    uint64_t per_epoch;  ///< adds per member per call (the push kernel's blocks)
    uint64_t timeout_ns;
    Diagnostic* diag;
    int32_t tokens_per_rank;
    int32_t world_rank;
    int32_t num_ranks;  ///< W: arrived's words
};

/// GroupDoneHook's parameters (TP MoE layer 1): each stored tile adds 1 to counters[group] (gpu scope); the tile that
/// completes its group (ceil(counts[g] / tile_m) * ceil(n / tile_n) tiles) resets the counter and raises done[group]
/// to *epoch with release semantics at system scope.
struct GroupDoneParams {
    uint32_t* counters;     ///< [E] zero between calls
    uint64_t* done;         ///< [E]
    const int32_t* counts;  ///< [E]
    const uint64_t* epoch;
    int32_t tile_m, tile_n, n, capacity;  ///< capacity: clamp of a count (rows of the GEMM)
};

}  // namespace weft::moe
