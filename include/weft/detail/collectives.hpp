// SPDX-License-Identifier: MIT
// Details of the collective ops testable without a GPU: argument checks, descriptors, rounds, kernel specs.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <vector>

#include "weft/common/tp_params.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::ops::detail {

/// Throws weft::Error naming `what` and `op` unless the view's fields make sense: 0 to TensorView::kMaxDims
/// dimensions, no negative extent, a known dtype (the checks below and the all-to-all's start with it).
void check_collective_view(const TensorView& v, const char* what, const char* op);
/// Throws weft::Error naming the op unless `algo` is one of its enumerators (a call's options.algo; the ops check it
/// before anything else touches the team or the device, resolve_*_algo again).
void check_algo_option(AllReduceAlgo algo);
void check_algo_option(AllGatherAlgo algo);
void check_algo_option(ReduceScatterAlgo algo);

/// Throws weft::Error naming the argument unless: both views contiguous with data (or 0 elements), the same
/// dtype, bf16/f16/f32, the same number of elements, and either the same pointer or no overlap.
void check_all_reduce_args(const TensorView& input, const TensorView& output);
/// As above for all-gather: any dtype (the same in both), output = num_ranks x input elements, in place only as
/// this rank's slot of the output.
void check_all_gather_args(const TensorView& input, const TensorView& output, int num_ranks, int rank);
/// As above for reduce-scatter: bf16/f16/f32, input = num_ranks x output elements, in place only as this rank's
/// slice of the input.
void check_reduce_scatter_args(const TensorView& input, const TensorView& output, int num_ranks, int rank);
/// The push all-gathers write into peers' outputs: weft::Error unless the output is symmetric.
void check_all_gather_output(AllGatherAlgo algo, bool output_symmetric);

/// The descriptor of a call (weft/common/collectives.hpp, make_call_descriptor) that every rank must agree on:
/// `op`, `algo` (the op's algorithm enum value), the element `dtype` and `count` (the whole call's, not a round's),
/// and a digest of `words` (buffer offsets, flags, the round ...). Never 0.
uint64_t call_descriptor(CollectiveOp op, uint32_t algo, DType dtype, uint64_t count,
                         std::initializer_list<uint64_t> words);
/// As above for calls that move bytes (no dtype): `bytes` is the count.
uint64_t call_descriptor_bytes(CollectiveOp op, uint32_t algo, uint64_t bytes, std::initializer_list<uint64_t> words);

/// How many units fit in `capacity_bytes` at `bytes_per_unit` each, rounded down to a multiple of `granule_units`
/// (so rounds keep 16-byte alignment); weft::Error when not even one granule fits.
uint64_t round_units(uint64_t capacity_bytes, uint64_t bytes_per_unit, uint64_t granule_units);

/// Every kernel the collectives launch.
enum class KernelId : int {
    kAllReduceOneShot = 0,
    kAllReduceTwoShot,
    kAllReduceLowLatency,
    kReduceScatterPull,
    kReduceScatterLowLatency,
    kAllGatherPush,
    kAllGatherLowLatency,
    kCopyEngineEnter,
    kCopyEngineExit,
    kAllToAllPull,
    kAttentionSpCombine,
    kCount
};

/// True for kernels specialised on a dtype (ReduceKernelConfig); the others move bytes (CopyKernelConfig).
bool kernel_is_reducing(KernelId id);
/// Threads per block of `id` in a world-size bucket.
int kernel_block_threads(KernelId id, int max_ranks);
/// The JIT spec of `id` for `dtype` (ignored by byte-moving kernels) and the world-size bucket `max_ranks`.
jit::KernelSpec collective_kernel_spec(KernelId id, DType dtype, int max_ranks);
/// Every spec a workspace for a `max_ranks` bucket loads (reducing kernels for bf16, f16 and f32).
std::vector<jit::KernelSpec> collective_kernel_specs(int max_ranks);

/// Whether a team's copy-engine all-gathers (ce_pull, ce_push) move their bytes with the one-CTA pull kernel
/// (kernels/tp_common/peer_pull.cuh) instead of copy-engine copies and stream writes: when this rank shares its GPU
/// with other ranks of this process (`ranks_on_device`: of any team). There the copies go on the caller's stream,
/// behind the entry kernel that spins until every peer arrives, and the ranks' streams outnumber the context's
/// hardware queues: a peer's work queued behind such a copy in a shared queue (its own staging copy, or a copy before
/// its entry kernel) could not run until the spin gave up. A spinning kernel holds no queue (docs/runtime.md,
/// "Hardware queues"). The pull kernel sets the peers' flags with release at system scope, so members on other GPUs
/// of the process (a team across GPUs that are shared) are served too.
bool copy_engine_copies_with_kernel(bool same_process, int ranks_on_device, int team_ranks);

/// The pull kernel's items of one copy-engine all-gather round (copy_engine_copies_with_kernel) on team rank `rank` of
/// `num_ranks`: bytes [begin, begin + len) of every shard of `shard` bytes. Pull: from every peer q (rank + 1 first)
/// `len` bytes at `from[q]` into slot q of `out`, then flag_on[q] = 1 (q's exit kernel: "done reading your shard").
/// Push: this rank's bytes at `in` + begin into `to[q]` (their place in slot `rank` of q's output, mapped here), then
/// flag_on[q] = 1 ("your slot is written"). Last, without a signal, this rank's own bytes into its slot of `out` unless
/// they are there already (in place). `from` (pull) or `to` (push) and `flag_on` hold one entry per team rank (the
/// addresses of this round; this rank's own entry is not read).
std::vector<PeerPullItem> copy_engine_kernel_items(bool pull, int num_ranks, int rank, const uint8_t* in, uint8_t* out,
                                                   uint64_t shard, uint64_t begin, uint64_t len,
                                                   std::span<const uint8_t* const> from, std::span<uint8_t* const> to,
                                                   std::span<uint64_t* const> flag_on);

}  // namespace weft::ops::detail
