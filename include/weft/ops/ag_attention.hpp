// SPDX-License-Identifier: MIT
// Prefill attention on the tensor cores: weft::ops::flash_attention (one GPU) and
// weft::ops::AgAttention, all-gather attention for a sequence sharded by rank, whose K/V all-gather (copy engines)
// overlaps the attention kernel, which waits per chunk for the peers' K/V as it arrives, its own chunk first.
//
//     weft::ops::AgAttention op(team, {.max_seq = 65536, .num_q_heads = 32, .num_kv_heads = 8, .head_dim = 128});
//     op.run(q_local /*[S/W, 32, 128]*/, k_local, v_local /*[S/W, 8, 128]*/, out /*[S/W, 32, 128]*/, {}, stream);
//
// Schedule, protocol and knobs: kernels/attention/README.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "weft/common/attention_prefill.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft {
class World;
class Team;
}  // namespace weft

namespace weft::ops {

struct FlashAttentionOptions {
    /// Softmax scale applied to q.k; nullopt: 1 / sqrt(head_dim). Finite, at most about 2.3e38 in magnitude, and the
    /// scaled scores (scale x q.k in fp32, times log2 e) must stay below about 3.4e38 in magnitude: a row where one
    /// overflows comes out NaN, or as zeros with lse -inf (as an fp32 softmax does).
    std::optional<float> scale = std::nullopt;
    AttentionMask mask = AttentionMask::kNone;
    /// Global position of q's row 0 for the causal mask (key j is at position j): query i sees keys
    /// j <= q_position + i. 0 (the default) is PyTorch's is_causal=True for seq_q == seq_kv. In [0, 2^31).
    int64_t q_position = 0;
    /// The kernel's config (dtype and head_dim must be q's); nullopt: attention_prefill_call_config with the
    /// device's kernel (attention_prefill_device_kernel: wgmma on sm_90), or mma.sync where q, k or v is a broadcast
    /// (the wgmma kernel at head_dim 64: 192-row items where they give every SM one, else 128). Either way the wgmma
    /// kernel's resident blocks claim the items from a work counter where the call has one (flash_attention, below).
    std::optional<AttentionPrefillConfig> config = std::nullopt;
};

/// Attention forward on one GPU:
///   out[i, h, :] = sum_j softmax_j(scale * q[i, h, :] . k[j, h / group, :]) v[j, h / group, :]
///   lse[i, h]    = ln sum_j exp(scale * q[i, h, :] . k[j, h / group, :])       (fp32)
/// over the keys j query i sees (options.mask; group = num_q_heads / num_kv_heads).
///   q    bf16 or f16 [seq_q, num_q_heads, head_dim]; innermost stride 1, other strides multiples of 8
///   k, v q's dtype [seq_kv, num_kv_heads, head_dim], the same shape and strides; innermost stride 1, other
///        strides multiples of 8
/// The wgmma kernel (sm_90's default) reads q, k and v through tensor maps: their outer strides (of extents above 1)
/// must also be positive and below 2^40 bytes. With options.config unset, a broadcast view (stride 0) runs on the
/// mma.sync kernel; a config that names kWgmma refuses it.
///   out  q's dtype [seq_q, num_q_heads, head_dim], contiguous; may be q itself (the same view: in place), must
///        not overlap k, v or lse, nor q otherwise
///   lse  f32 [seq_q, num_q_heads], contiguous; or an empty view (a default TensorView: data null, no dimensions)
///        when not wanted
/// head_dim 64 or 128; num_q_heads a multiple of num_kv_heads, at most 16 q-heads per KV head and at most 65536 (grid
/// limit, AgAttention's too); seq_q, seq_kv in
/// [0, 2^31 - 2^20) (seq_q 0: nothing to do; a row that sees no key gets zeros and lse -inf). Pointers 16-byte
/// aligned. Asynchronous on `stream`, capturable in a CUDA graph; the host waits only when weft makes work counters
/// (below). The kernel is JIT-compiled on first use. Bad arguments throw weft::Error naming the argument.
/// The wgmma kernel's blocks take their items from a 4-byte work counter that every launch leaves at zero: a call on a
/// stream that is not being captured uses the stream's own (one per device and stream, per thread for
/// cudaStreamPerThread, made by its first call and kept for the process's life: the stream order keeps its launches
/// apart); a call captured in a
/// CUDA graph gets a counter of its own for good, so an instantiation of the graph may be replayed on any stream
/// beside any other calls (two instantiations of one captured graph share its counters: run them one at a time). Those
/// counters are made by uncaptured calls, 64 at a time (at the device's first call, and at an uncaptured call that
/// finds fewer than 16 spare), the host waiting for their zeroing on a stream of weft's (not for the work queued on
/// `stream`). A capture before any uncaptured call on the device, or one that finds no spare, walks the items in fixed
/// waves instead (the same results). Every view is this GPU's device (or managed) memory: host memory and another
/// GPU's are refused, naming the argument.
void flash_attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                     const TensorView& lse, cudaStream_t stream, const FlashAttentionOptions& options = {});

/// Problem bounds of an AgAttention, fixed when the op is made (the symmetric K/V buffers are sized from them).
struct AgAttentionShape {
    int64_t max_seq = 0;  ///< largest total sequence S of a call: a positive multiple of the team's size
    int64_t num_q_heads = 0;
    int64_t num_kv_heads = 0;                     ///< num_q_heads a multiple of it, at most 16 q-heads per KV head
    int64_t head_dim = 128;                       ///< 64 or 128
    DType dtype = DType::kBF16;                   ///< of Q, K, V and the output: kBF16 or kF16
    AttentionMask mask = AttentionMask::kCausal;  ///< over the global positions
};

struct AgAttentionOptions {
    std::optional<float> scale = std::nullopt;                    ///< as FlashAttentionOptions::scale
    std::optional<AttentionPrefillConfig> config = std::nullopt;  ///< as FlashAttentionOptions::config
    int sm_budget = 0;  ///< blocks of the persistent attention kernel; 0 = the world's SM budget (one SM less when
                        ///< ranks share a GPU) times the blocks that fit one SM (one when ranks share a GPU). A team
                        ///< of several ranks with a GPU each keeps one SM of the device free (at most SMs - 1 here);
                        ///< ranks sharing a GPU: at most World::shared_sm_budget() (weft::Error otherwise), and a
                        ///< budget of the whole share runs as the share less one (one SM for the copy helpers)
};

/// All-gather attention for the members of a Team (a World& means its world team): the sequence of S tokens is
/// sharded by team rank, rank r holding tokens [r*S/W, (r+1)*S/W) of Q, K and V (equal shards: S a multiple of W;
/// every member's call has S/W rows: see run()). Each call gathers every shard of K
/// and V a rank needs into the symmetric heap (copy engines: the causal mask needs only shards 0..r on rank r; no mask,
/// all) while the attention kernel computes, over the global positions, this rank's S/W queries against the gathered
/// keys: its own shard first, every peer's after waiting for that shard's arrival flag. Construction and destruction
/// are collective over the team's members (same shape and options, same order as their other collectives on the team).
/// Not thread-safe: one rank's thread uses it.
class AgAttention {
public:
    /// Allocates the gathered K and V [max_seq, num_kv_heads, head_dim] and the signal words (team-collectively),
    /// creates the copy stream, compiles (JIT, cached on disk) and loads every kernel a call launches, and meets the
    /// team (barrier). Throws weft::Error (on every member) for a bad shape or options, or when a member's heap is
    /// not load/store reachable from this rank; on a rank that is not a member, a weft::Error naming the team.
    AgAttention(const Team& team, const AgAttentionShape& shape, const AgAttentionOptions& options = {});
    /// AgAttention(world.team(), shape, options).
    AgAttention(World& world, const AgAttentionShape& shape, const AgAttentionOptions& options = {});
    /// Collective over the team: waits for this op's eager work (not the whole device's), then frees its
    /// buffers. Its calls are made by one thread and ordered on one stream (or by events: two calls racing on two
    /// streams share its signal words and buffers); a CUDA graph that captured a call must not be replayed once it
    /// is gone (replays are not waited for).
    ~AgAttention();
    AgAttention(const AgAttention&) = delete;
    AgAttention& operator=(const AgAttention&) = delete;

    /// out = attention of this rank's queries (global positions r*S/W ...) over the gathered keys, S = W * rows:
    ///   q_local  [S/W, num_q_heads, head_dim]: innermost stride 1, other strides multiples of 8 (positive with
    ///            the wgmma kernel, sm_90's default: a broadcast q needs options.config with kMmaSync)
    ///   k_local, v_local [S/W, num_kv_heads, head_dim]: heads and dims contiguous (head stride head_dim), row
    ///            stride >= num_kv_heads * head_dim and a multiple of 8, of at most 2 GiB - 1 bytes where the rows are
    ///            not back to back (this GPU's device memory; local_k(S) / local_v(S) themselves, rows back to
    ///            back, skip the local copy; any other view inside the gathered buffers is refused: the peers'
    ///            shards arrive there while it would be copied; q_local may not lie in them either)
    ///   out      [S/W, num_q_heads, head_dim] contiguous;  lse f32 [S/W, num_q_heads] contiguous, or empty
    /// all of shape.dtype, 16-byte aligned. Every member calls with the same S (1 <= S/W, S <= max_seq): a rank that
    /// reads the shard of a member whose S differs records a kCollectiveMismatch diagnostic naming both calls (its
    /// out/lse of that call are undefined; sync_and_check throws; the op stays usable once every rank cleared its
    /// diagnostics). Under the causal mask rank 0 reads no peer's shard and finds nothing.
    /// Asynchronous on `stream` (it forks the copy stream from it and joins it back); never synchronises the host
    /// (but the first call on ranks sharing a GPU: see kernels/attention/README.md); capturable in a CUDA graph
    /// (nothing of a call is a host value frozen into the graph). After the call's work on `stream`, gathered_k(S) /
    /// gathered_v(S) hold the shards this rank needed (all of them without a mask, shards 0..r under the causal
    /// mask) until the next call. A team of one rank runs flash_attention on its inputs.
    void run(const TensorView& q_local, const TensorView& k_local, const TensorView& v_local, const TensorView& out,
             const TensorView& lse, cudaStream_t stream);

    /// [seq, num_kv_heads, head_dim] views of the gathered K and V (symmetric heap).
    TensorView gathered_k(int64_t seq) const;
    TensorView gathered_v(int64_t seq) const;
    /// This rank's rows of gathered_k(seq) / gathered_v(seq): writing K/V there (stream-ordered before run) skips the
    /// local copy.
    TensorView local_k(int64_t seq) const;
    TensorView local_v(int64_t seq) const;

    const AgAttentionShape& shape() const;
    const AttentionPrefillConfig& config() const;
    int grid() const;  ///< blocks of the attention kernel (the items of max_seq bound it further per call)

    struct State;

private:
    std::unique_ptr<State> s_;
};

/// Checks a shape and options against a team size (CPU only; the constructor calls it). Throws weft::Error naming
/// the argument.
void validate_ag_attention_shape(const AgAttentionShape& shape, int num_ranks, const AgAttentionOptions& options = {});

/// The prefill kernel the current device runs by default (attention_prefill_default_kernel of its compute
/// capability): kWgmma on sm_90, kMmaSync elsewhere.
AttentionPrefillKernel attention_prefill_device_kernel();

/// JIT spec of the prefill kernel for `config` (`arch` as KernelSpec::arch; a kWgmma config needs sm_90a).
jit::KernelSpec attention_prefill_kernel_spec(const AttentionPrefillConfig& config, const std::string& arch = "");

/// Registers (once per process) the specs flash_attention and AgAttention launch by default (bf16 and f16, head_dim 64
/// and 128) with weft::jit::register_aot_spec, for weft-compile --builtin. Thread-safe.
void register_prefill_attention_aot_specs();

namespace detail {

/// What flash_attention launches, computed on the CPU from the arguments alone.
struct FlashAttentionPlan {
    AttentionPrefillConfig config;
    AttentionPrefillParams params;
    int64_t num_items = 0;  ///< (query tile, q-head) pairs; 0: nothing to launch
};

/// Checks every argument (throws weft::Error naming it, `op` first) and plans the launch. No CUDA call.
FlashAttentionPlan plan_flash_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                        const TensorView& out, const TensorView& lse,
                                        const FlashAttentionOptions& options, const char* op = "flash_attention");

/// Launches a plan's kernel with `grid` blocks (<= 0: one per item) on `stream`; compiles and loads it on first use.
void launch_flash_attention(const FlashAttentionPlan& plan, int64_t grid, cudaStream_t stream);

/// Blocks of `config`'s kernel that fit one SM of the current device.
int attention_prefill_blocks_per_sm(const AttentionPrefillConfig& config);

/// Gives a wgmma plan a work counter (zero, and left at zero by each launch; AttentionPrefillParams::item_counter)
/// and the head group of attention_prefill_head_group for a launch of `grid` resident blocks (at most the items, as
/// launch_flash_attention clamps it). Other kernels: nothing.
void use_prefill_counter(FlashAttentionPlan& plan, uint32_t* counter, int64_t grid);

}  // namespace detail

}  // namespace weft::ops
