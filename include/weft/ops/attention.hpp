// SPDX-License-Identifier: MIT
// weft::ops::decode_attention: one query token per sequence against a paged KV cache (flash-decoding: split-KV
// across SMs, log-sum-exp combine), on one GPU. Its per-row log-sum-exp is what a cross-rank combine needs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "weft/common/attention.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft {
class World;
class Team;
}  // namespace weft

namespace weft::ops {

using weft::AttentionStatus;

struct DecodeAttentionOptions {
    /// Softmax scale applied to q.k; nullopt: 1 / sqrt(head_dim). Finite, at most about 2.3e38 in magnitude, and the
    /// scaled scores (scale x q.k in fp32, times log2 e) must stay below about 3.4e38 in magnitude: a row where one
    /// overflows comes out NaN, or as zeros with lse -inf (as an fp32 softmax does).
    std::optional<float> scale = std::nullopt;
    /// KV splits per (sequence, KV head); 0 chooses (plan_attention_splits). Clamped to [1, 256] and to one
    /// 64-token tile per split.
    int32_t num_splits = 0;
    /// Device scratch for the splits' partial outputs: u8 (or any dtype), contiguous, 16-byte aligned, at least
    /// decode_attention_workspace_bytes() bytes, its used bytes apart from every other argument (refused otherwise);
    /// not touched when one split suffices. Empty (a default TensorView:
    /// data null, no dimensions): weft keeps a buffer per (device, stream) for the process's life, grown as needed by
    /// uncaptured calls; growing it during CUDA graph capture is an error (pass one, as a program that makes a stream
    /// per call should).
    TensorView workspace = {};
    /// Programmatic dependent launch of the split kernel, for a decode step's chain of kernels: it may be scheduled
    /// while the kernel before it on `stream` still runs (hiding its launch latency and block setup) and waits for
    /// that kernel to complete (griddepcontrol.wait) before it reads or writes anything. Off by default.
    /// Capturable: in a CUDA graph the launch becomes a programmatic edge. (The combine kernel always launches so
    /// behind the split kernel.)
    bool programmatic_launch = false;
    /// Given (device or host-mapped memory, zeroed by the caller), the call checks every block-table entry it reads:
    /// one outside [0, num_pages) is never dereferenced, its sequence's out and lse are NaN, and the first one found
    /// is recorded here (check_attention_status turns a record into a weft::Error). Null: the entries are trusted (a
    /// bad one is an out-of-bounds read). The check is a second build of the split kernel, a few percent slower (one
    /// H100: +2.7% at head_dim 128 and +4% at 256, batch 8, 128K tokens; docs/performance.md). Graph-capturable (the
    /// record's address is captured: zero it again between replays). The block table must not change during the call.
    AttentionStatus* status = nullptr;
};

/// The message of a status record (DecodeAttentionOptions::status); empty when it is zero.
std::string describe_attention_status(const AttentionStatus& status);
/// Throws weft::Error with describe_attention_status unless the record is zero.
void check_attention_status(const AttentionStatus& status);

/// Decode attention for `batch` sequences, each with one query token:
///   out[b, h, :] = sum_j softmax_j(scale * q[b, h, :] . k_j) v_j   over the first seq_lens[b] tokens of sequence b,
///   lse[b, h]    = ln sum_j exp(scale * q[b, h, :] . k_j)          (natural log, fp32),
/// where q-head h reads KV head h / (num_q_heads / num_kv_heads) (grouped-query attention) and token j of sequence
/// b lives in slot j % page_size of physical page block_table[b, j / page_size]. A sequence of length 0 gets an
/// output of zeros and lse = -inf (the identity of an LSE-weighted combine).
///
///   q            bf16 or f16 [batch, num_q_heads, head_dim]; innermost stride 1, other strides multiples of 8
///   k_cache      same dtype, [num_pages, page_size, num_kv_heads, head_dim]; innermost stride 1, other strides
///                multiples of 8 (so both the [pages, slots, heads, dim] and the [pages, heads, slots, dim] layout
///                fit, the latter as a strided view)
///   v_cache      same dtype, shape and strides as k_cache
///   block_table  i32 [batch, max_pages_per_seq], innermost stride 1; the entries of the tokens read (those below
///                seq_lens[b] clipped to max_seq_len) must be valid page indices in [0, num_pages), checked only
///                when options.status is given (then one outside makes its sequence's out and lse NaN and is
///                recorded there; without, it is an out-of-bounds read); the others are never read
///   seq_lens     i32 [batch], contiguous; lengths are clipped to [0, max_seq_len] (out and lse then cover the
///                clipped length)
///   max_seq_len  an upper bound of seq_lens (it sizes the split plan), 0 <= max_seq_len <= max_pages_per_seq *
///                page_size and < 2^31 - 2^20
///   out          dtype of q, [batch, num_q_heads, head_dim], contiguous
///   lse          f32 [batch, num_q_heads], contiguous; or an empty view (a default TensorView: data null, no
///                dimensions) when not wanted
/// head_dim is 64, 128 or 256; num_q_heads is a multiple of num_kv_heads with at most 16 q-heads per KV head;
/// 1 <= page_size <= 2^30; 0 <= batch <= 65535 and num_kv_heads <= 65535 (grid limits; 0: nothing to do). Pointers
/// 16-byte aligned. Asynchronous on `stream`, no host
/// synchronisation, capturable in a CUDA graph (with options.workspace given, or the internal one already large
/// enough). The internal workspace is the stream's own (per device and stream, kept for the process's life: a program
/// that makes a stream per call should give options.workspace; cudaStreamPerThread, per thread): a
/// graph captured with it uses the capturing stream's, so replay it where no other call runs on that stream at the
/// same time, or give options.workspace. Calls on one stream come from one thread at a time (a split launch and its
/// combine are two launches: another thread's call between them would share the workspace). Kernels are
/// JIT-compiled on first use. Bad arguments throw weft::Error naming the argument; so does a view that is not this
/// GPU's device (or managed) memory (host memory, another GPU's).
void decode_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                      const TensorView& block_table, const TensorView& seq_lens, int64_t max_seq_len,
                      const TensorView& out, const TensorView& lse, cudaStream_t stream,
                      const DecodeAttentionOptions& options = {});

/// The KV splits decode_attention uses on the current device for these sizes and options.
AttentionSplitPlan decode_attention_split_plan(int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
                                               int64_t head_dim, int64_t max_seq_len,
                                               const DecodeAttentionOptions& options = {});

/// Sequence-parallel decode: every rank holds a shard of every sequence's KV cache (its own pages, block table and
/// lengths: the tokens of one sequence are split across the ranks in any way) and the same `q`; every rank gets the
/// attention over the whole sequence in `out` and `lse`, as decode_attention would give over the concatenated shards.
/// Each rank runs decode_attention's kernels on its shard, whose last kernel pushes every final row (fp32 output and
/// LSE) as LL lines into every rank's collective workspace; a collective kernel then waits for every rank's rows and
/// merges them by their LSE in fp32. Arguments as for decode_attention, per rank (q, out, lse and the head counts the
/// same on every rank; each rank's cache, page size, layout, max_seq_len and options are its own). Collective (every
/// rank calls it, in the same order as its other collectives, with the same batch, q-heads, head_dim and dtype: every
/// pushed row carries its call's descriptor, and a rank whose call differs is a mismatch that World::sync_and_check
/// throws on the ranks that saw it, naming both calls, as for the collectives; the ranks that wait for rows it never
/// pushes stop at the abort; every call counts in the team's sequence of collective calls, a refused or empty one
/// included, so a rank that skipped one fails its next call on every rank instead of merging two calls' rows); one node
/// (a team that spans nodes is refused); asynchronous, graph-capturable (the LL flags are the workspace's epochs, in
/// device memory), bounded waits (a missing rank ends in a timeout diagnostic). Sequences go in rounds of as many as
/// the LL slot holds (CollectiveWorkspaceInfo::ll_slot_bytes, 512 KiB per rank by default: batch x q-heads x (head_dim
/// + 2) x 8 bytes of LL lines per round); one sequence's rows must fit one round (at most 504 q-heads of head_dim 128,
/// 254 of head_dim 256 by default), else weft::Error on every rank before any kernel is loaded or launched. The first
/// call with a head_dim and dtype compiles and loads its kernels (with and without the block-table check: ranks may
/// differ in passing a status) and meets every rank (host barrier) before launching:
/// make it outside a CUDA graph capture, then capture. options.status (each rank its own, or none): a block-table entry
/// outside this rank's cache makes that sequence's out and lse NaN on every rank, and is recorded (its sequence index
/// within the call) in the status of the rank whose table holds it only.
void sp_decode_attention(const Team& team, const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                         const TensorView& block_table, const TensorView& seq_lens, int64_t max_seq_len,
                         const TensorView& out, const TensorView& lse, cudaStream_t stream,
                         const DecodeAttentionOptions& options = {});
/// The same on `world.team()`.
void sp_decode_attention(World& world, const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                         const TensorView& block_table, const TensorView& seq_lens, int64_t max_seq_len,
                         const TensorView& out, const TensorView& lse, cudaStream_t stream,
                         const DecodeAttentionOptions& options = {});

/// Bytes of options.workspace decode_attention needs on the current device for these sizes (0 when one split
/// suffices).
uint64_t decode_attention_workspace_bytes(int64_t batch, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                                          int64_t max_seq_len, const DecodeAttentionOptions& options = {});

/// The JIT spec of the split kernel (combine = false) or the combine kernel for `config`.
jit::KernelSpec decode_attention_kernel_spec(const AttentionDecodeConfig& config, bool combine);

/// Registers (once per process) the specs decode_attention can launch (bf16 and f16, head_dim 64/128/256, the default
/// depths) with weft::jit::register_aot_spec, for weft-compile --builtin. Thread-safe.
void register_attention_aot_specs();

namespace detail {

/// What decode_attention launches, computed on the CPU from the arguments alone.
struct DecodeAttentionPlan {
    AttentionDecodeConfig config;
    AttentionDecodeParams params;  ///< partial_o / partial_lse are offsets from null until bound to a workspace
    AttentionSplitPlan splits;
    uint64_t workspace_bytes = 0;  ///< 0 when num_splits == 1
    bool empty = false;            ///< batch 0: nothing to launch
};

/// Checks every argument (throws weft::Error naming the argument) and plans the launch for a GPU on which
/// `resident_blocks` split blocks run at once. No CUDA call.
DecodeAttentionPlan plan_decode_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                          const TensorView& block_table, const TensorView& seq_lens,
                                          int64_t max_seq_len, const TensorView& out, const TensorView& lse,
                                          const DecodeAttentionOptions& options, int64_t resident_blocks);
/// The same, asking `resident_blocks(head_dim)` (e.g. attention_resident_blocks_here, which queries the device) only
/// once every argument has passed its check.
DecodeAttentionPlan plan_decode_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                          const TensorView& block_table, const TensorView& seq_lens,
                                          int64_t max_seq_len, const TensorView& out, const TensorView& lse,
                                          const DecodeAttentionOptions& options,
                                          const std::function<int64_t(int64_t head_dim)>& resident_blocks);

/// Split blocks resident at once on a GPU with `num_sms` SMs of `smem_per_sm_bytes` shared memory each.
int64_t attention_resident_blocks(const AttentionDecodeConfig& config, int64_t num_sms, int64_t smem_per_sm_bytes);
/// The same for the current device and the default config of `head_dim`.
int64_t attention_resident_blocks_here(int64_t head_dim);

/// Binds the plan's partial buffers (options.workspace or the internal one) and launches its kernels on `stream`.
void launch_decode_attention(DecodeAttentionPlan& plan, const DecodeAttentionOptions& options, cudaStream_t stream);

/// Compiles (or finds) and loads both kernels of `config` into the current context.
void load_decode_attention_kernels(const AttentionDecodeConfig& config);

}  // namespace detail

}  // namespace weft::ops
