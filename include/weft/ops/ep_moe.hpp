// SPDX-License-Identifier: MIT
// weft::ops::ep::MoeBlock: a whole expert-parallel MoE block (dispatch, up-projection, SwiGLU, down-projection,
// combine) on a team, bf16, with the expert GEMMs overlapping the communication:
//
//     weft::ops::ep::MoeConfig cfg{.ep = {.num_experts = 256, .hidden = 4096, .topk = 8, .max_tokens_per_rank = 128},
//                                  .ffn = 2048};
//     weft::ops::ep::MoeBlock moe(world, cfg);          // collective: EP buffers, workspaces, every kernel loaded
//     moe.forward(x, topk_idx, topk_weights, {gate_up, down}, out, stream);
//     moe.check();                                       // device-reported errors (capacity overflow, bad counts)
//
// For each token t: out[t] = sum over its valid slots j of topk_weights[t][j] * down_e(swiglu(gate_up_e(x[t]))),
// e = topk_idx[t][j], with gate_up_e(x) = x W_e^T ([2F] from gate_up[e_local] = [2F, H]: gate rows [0, F), up rows
// [F, 2F)), swiglu(g, u) = silu(g) * u rounded to bf16, down_e(a) = a D_e^T (down[e_local] = [H, F]); each GEMM
// accumulates in fp32 and rounds to bf16; the combine is ep::Buffer::combine's (deterministic).
//
// Fused (the default): the dispatch raises a counter per local expert once all its rows are in place, and the
// up-projection (a grouped GEMM whose CTAs run alongside the dispatch) starts each expert's tiles on its counter; the
// down-projection raises a counter per (expert, row of tiles) and the combine sends each received token's weighted
// sum as soon as the tiles of its rows are stored. Communication runs on the caller's stream with `comm_sms` SMs,
// the GEMMs on a stream of the block's own with the rest of the rank's SM budget, so every kernel that waits for
// another is resident with it (ranks of one process sharing a GPU run these kernels one after another on the caller's
// stream: docs/runtime.md, "Hardware queues"). The sequential form (MoeOptions::fused = false) runs the same kernels
// one after another on the caller's stream (the separate ops: Buffer::dispatch, grouped_gemm_contiguous, the SwiGLU,
// grouped_gemm_contiguous, Buffer::combine) and gives the same bits. kernels/ep/README.md shows the overlap.
//
// Ranks sharing a GPU (threads of one process): every rank's spinning kernels must be resident at once. A rank holds
// at most moe_block_grids(...).resident() <= World::sm_budget() CTAs at a time (one kernel per stream; the GEMM's CTA
// and the EP kernels' blocks each fit one SM), and the default budget is the device's SMs / ranks on it, so the ranks'
// kernels fit the GPU together (132 SMs, 8 ranks: 8 x 16 = 128). The first call of each form ends on every member
// (stream synchronised, team barrier) before the rank launches more, as the other fused ops do; the GEMMs' waits for
// the dispatch are bounded by twice the World's timeout and stop on its abort word, so a missing peer is named by the
// dispatch's own wait before a GEMM gives up.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "weft/common/gemm_config.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/ep.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::ops::ep {

/// A MoE block's shape: the EP buffer's limits and the experts' intermediate size.
struct MoeConfig {
    Config ep;    ///< hidden, experts, top-k, tokens and receive limits (normal mode is used; low_latency is ignored)
    int ffn = 0;  ///< F: each expert's intermediate size (the gate and the up projection each have F outputs), a
                  ///< positive multiple of 8
};

/// The experts of this rank (local experts e_local = 0 .. E/W - 1, i.e. global experts rank * E/W + e_local).
struct MoeWeights {
    TensorView gate_up;  ///< bf16 [E_local, 2F, H] row-major: gate rows [0, F), up rows [F, 2F) of each expert
    TensorView down;     ///< bf16 [E_local, H, F] row-major
};

struct MoeOptions {
    /// false: the separate ops one after another on the caller's stream. A team of one rank runs them so either way:
    /// there is no communication to hide, and the fused form's communication SMs would only be taken from the GEMMs
    /// (4096 tokens, H 4096, 256 experts, top-8: 0.86x the separate ops).
    bool fused = true;
    /// Blocks of the dispatch and combine kernels, below the rank's SM budget; 0 = moe_comm_sms(T, budget). Fused:
    /// the GEMMs get the rest of the budget.
    int comm_sms = 0;
};

/// What a block plans at construction (the expert GEMMs' configs) and runs with: pure host logic, tested on the CPU.
struct MoePlan {
    GemmConfig up{};    ///< [rows, H] x [2F, H]^T -> [rows, 2F]
    GemmConfig down{};  ///< [rows, F] x [H, F]^T -> [rows, H]
    int64_t max_recv_rows = 0;
    int32_t tile_stride = 0;   ///< rows of down tiles an expert can have: ceil(max_recv_rows / down.tile_m)
    int32_t down_n_tiles = 0;  ///< ceil(H / down.tile_n): the tiles of one row of down tiles
};

/// Validates `config` for `num_ranks` ranks (weft::Error naming the field) and picks the GEMMs' configs for the
/// expected rows per expert (uniform routing of max_tokens_per_rank) on `num_sms` SMs.
MoePlan plan_moe_block(const MoeConfig& config, int num_ranks, int num_sms);

/// The default blocks of a block's dispatch and combine: default_normal_sms(T, budget - 1), at most a quarter of the
/// budget (at least 1), so that the expert GEMMs beside them keep most of the SMs.
int moe_comm_sms(int num_tokens, int sm_budget);

/// The grids of one forward call of a rank (pure host logic, tested on the CPU). Fused: the caller's stream runs the
/// EP layout (1 block), the dispatch and the combine (`comm` blocks each), one after another; the block's stream runs
/// the up GEMM, the SwiGLU and the down GEMM (at most `gemm_sms` CTAs each), one after another. So a rank holds at
/// most comm + max(up, swiglu, down) CTAs at once, every one of which may spin (the dispatch on its peers, the up GEMM
/// on the dispatch, the combine on the down GEMM and its peers). Sequential: one kernel at a time, each within the
/// budget.
struct MoeGrids {
    bool fused = true;
    int comm = 0;      ///< blocks of the dispatch and of the combine
    int gemm_sms = 0;  ///< the GEMMs' SMs: fused, budget - comm; sequential, the budget
    int up = 0;        ///< CTAs of the up-projection: min(gemm_sms, the most tiles any counts can make)
    int swiglu = 0;    ///< blocks of the SwiGLU (gemm_sms)
    int down = 0;      ///< CTAs of the down-projection
    /// The most CTAs this rank's kernels of one call hold at once (each fits one SM: a GEMM CTA takes a whole SM).
    int resident() const;
};

/// A forward call's grids on a rank with `sm_budget` SMs (World::sm_budget()) and `num_tokens` tokens, for `plan`
/// (plan_moe_block(config, num_ranks, ...)); `options` as forward's (comm_sms in [0, budget), 0 = moe_comm_sms).
/// Throws weft::Error for a budget below 2 or a comm_sms outside that range.
MoeGrids moe_block_grids(const MoeConfig& config, const MoePlan& plan, int num_ranks, int num_tokens, int sm_budget,
                         const MoeOptions& options = {});

/// The bound of the fused GEMMs' waits (the up-projection's waits for the dispatch's words, and both GEMMs' pipeline
/// waits): twice the World's timeout (at most 30 days), which bounds the EP kernels' waits on peers, so that a peer
/// that never dispatches is named by those waits (and the World aborted, which stops the GEMMs' waits) before a GEMM
/// gives up.
uint64_t moe_gemm_timeout_ns(std::chrono::milliseconds world_timeout);

/// The SwiGLU kernel (header ep/moe.cuh) the block launches between its GEMMs.
jit::KernelSpec moe_swiglu_kernel_spec(const std::string& arch = "");

/// A MoE block of one rank of a team. Collective construction and destruction (over the team's members).
/// The team must lie within one node (a team that spans nodes is refused with a weft::Error; across nodes use
/// ep::Buffer's normal dispatch and combine).
class MoeBlock {
public:
    /// Collective: an ep::Buffer (normal mode) and one NormalHandle, the intermediate activations ([max_recv_rows,
    /// 2F], [max_recv_rows, F] and [max_recv_rows, H] bf16, private device memory), the fused path's counters, a
    /// stream for the GEMMs, and every kernel either form launches, loaded before any can spin.
    MoeBlock(const Team& team, const MoeConfig& config);
    MoeBlock(World& world, const MoeConfig& config);
    /// Collective over the team: waits for this block's eager work (not the whole device's), then frees its
    /// buffers. Its calls are made by one thread and ordered on one stream (or by events: two calls racing on two
    /// streams share its signal words and buffers); a CUDA graph that captured a call must not be replayed once it
    /// is gone (replays are not waited for).
    ~MoeBlock();
    MoeBlock(const MoeBlock&) = delete;
    MoeBlock& operator=(const MoeBlock&) = delete;

    /// Collective. x: bf16 [T, H]; topk_idx: int32 [T, k] (-1 = dropped; ids outside [-1, E) and repeats within a
    /// token are dropped and reported, as by Buffer::dispatch); topk_weights: f32 [T, k]; weights: this rank's experts
    /// (shapes above), device memory; out: bf16 [T, H], device memory. Asynchronous on `stream` (a non-blocking stream
    /// of the rank's own); when it returns, later work on `stream` is ordered after the whole block. With ranks sharing
    /// a GPU the first call of each form (fused, sequential) also waits for `stream` and meets the team's members
    /// (outside graph capture), and throws a device error it finds. A receive capacity overflow moves nothing, gives
    /// zeros and surfaces as a weft::Error from check() (the next call logs it as a warning and goes ahead); bad
    /// arguments throw weft::Error naming them, before anything is launched.
    void forward(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
                 const MoeWeights& weights, const TensorView& out, cudaStream_t stream, const MoeOptions& options = {});

    const MoeConfig& config() const;
    const MoePlan& plan() const;
    Buffer& buffer();
    NormalHandle& handle();
    /// The intermediates of the last forward (valid rows: the handle's expert segments).
    TensorView gate_up_out() const;
    TensorView activation() const;
    TensorView expert_out() const;

    /// Throws weft::Error for a device-reported error: the EP buffer's status, then the GEMMs' count records (which
    /// no dispatch of weft's sets, and which stay set for the block's life once set).
    void check() const;
    /// world().sync_and_check(stream), then check().
    void sync_and_check(cudaStream_t stream);

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace weft::ops::ep
