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
// another is resident with it. The sequential form (MoeOptions::fused = false) runs the same kernels one after
// another on the caller's stream (the separate ops: Buffer::dispatch, grouped_gemm_contiguous, the SwiGLU,
// grouped_gemm_contiguous, Buffer::combine) and gives the same bits. kernels/ep/README.md shows the overlap.
#pragma once

#include <cuda_runtime_api.h>

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
    bool fused = true;  ///< false: the separate ops one after another on the caller's stream
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

/// The SwiGLU kernel (header ep/moe.cuh) the block launches between its GEMMs.
jit::KernelSpec moe_swiglu_kernel_spec(const std::string& arch = "");

/// A MoE block of one rank of a team. Collective construction and destruction (over the team's members).
class MoeBlock {
public:
    /// Collective: an ep::Buffer (normal mode) and one NormalHandle, the intermediate activations ([max_recv_rows,
    /// 2F], [max_recv_rows, F] and [max_recv_rows, H] bf16, private device memory), the fused path's counters, a
    /// stream for the GEMMs, and every kernel either form launches, loaded before any can spin.
    MoeBlock(const Team& team, const MoeConfig& config);
    MoeBlock(World& world, const MoeConfig& config);
    ~MoeBlock();
    MoeBlock(const MoeBlock&) = delete;
    MoeBlock& operator=(const MoeBlock&) = delete;

    /// Collective. x: bf16 [T, H]; topk_idx: int32 [T, k] (-1 = dropped); topk_weights: f32 [T, k]; weights: this
    /// rank's experts (shapes above); out: bf16 [T, H]. Asynchronous on `stream` (a non-blocking stream of the rank's
    /// own); when it returns, later work on `stream` is ordered after the whole block. A receive capacity overflow
    /// moves nothing, gives zeros and surfaces as a weft::Error from check() (or the next call); bad arguments throw
    /// weft::Error naming them.
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

    /// Throws weft::Error for a device-reported error: the EP buffer's status, then the GEMMs' count records.
    void check() const;
    /// world().sync_and_check(stream), then check().
    void sync_and_check(cudaStream_t stream);

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace weft::ops::ep
