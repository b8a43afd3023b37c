// SPDX-License-Identifier: MIT
// weft::ops::all_to_all / all_to_all_v: every rank sends a chunk of its input to every rank (itself included) and
// receives one chunk from each, in rank order; and the Ulysses re-shard helpers built on it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "weft/common/all_to_all.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft {
class World;
class Team;
}  // namespace weft

namespace weft::ops {

/// Equal splits: with c = input.numel() / num_ranks, output[q * c + i] = input of rank q [rank * c + i] for every
/// rank q. Collective (see collectives.hpp: every rank calls the same ops in the same order with the same count and
/// dtype). `input` and `output`: contiguous, the same dtype (any: bytes are moved), the same number of elements, a
/// multiple of num_ranks (0 included); they must not overlap. Any device memory: a symmetric `input` (the same heap
/// allocation on every rank) is read by the peers in place, any other is staged through the collective workspace in
/// rounds; symmetric inputs on every rank or on none (ranks that differ make different calls: a call mismatch).
/// Asynchronous on `stream`, graph-capturable, bounded waits (a missing peer ends in a diagnosed timeout). A team that
/// spans nodes: node stages over each node's members, then NCCL over the columns (docs/multinode.md, "All-to-all across
/// nodes"; the same number of members per node, NCCL available; graph capture after one eager call).
void all_to_all(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream);
/// The same on `world.team()`.
void all_to_all(World& world, const TensorView& input, const TensorView& output, cudaStream_t stream);

/// Uneven splits: this rank sends send_counts[q] elements to rank q and receives recv_counts[q] from it; chunks lie
/// back to back in rank order in `input` (sum of send_counts elements) and `output` (sum of recv_counts). Rank q's
/// send_counts[rank] must equal this rank's recv_counts[q]: checked for q = this rank on the host (a weft::Error), and
/// across ranks by the kernel before it reads anything (a rank whose count differs throws, naming both counts and
/// the peer; its abort stops the others). Across nodes only the pairs within a node are checked (docs/multinode.md).
/// Counts may be 0; their bytes must sum below 2^62. Collective; `input`/`output` as for all_to_all except the sizes. A
/// local (non-symmetric) `input` is staged in one piece: every rank's must fit the workspace's staging region
/// (WEFT_COLLECTIVE_STAGING_BYTES, 32 MiB by default, less 16 bytes per chunk of alignment and a 1 KiB header) — larger
/// inputs must be symmetric. A rank whose staged input does not fit (or whose counts it refuses) throws weft::Error and
/// keeps the World usable; a call refused on one rank only leaves its peers in the call: they end at their next
/// heartbeat if that rank's process ends, fail at once when it makes its next collective call on the team (the calls'
/// places in the sequence differ: a mismatch), else at the World's timeout. A team that spans nodes: as all_to_all, the
/// node members' counts gathered through the World's store first (docs/multinode.md).
void all_to_all_v(const Team& team, const TensorView& input, std::span<const int64_t> send_counts,
                  const TensorView& output, std::span<const int64_t> recv_counts, cudaStream_t stream);
/// The same on `world.team()`.
void all_to_all_v(World& world, const TensorView& input, std::span<const int64_t> send_counts, const TensorView& output,
                  std::span<const int64_t> recv_counts, cudaStream_t stream);

/// Ulysses, sequence-sharded to head-sharded: `input` [S / W, H, D] (this rank's tokens, all heads) becomes `output`
/// [S, H / W, D] (all tokens, this rank's heads: rank r holds heads [r H / W, (r + 1) H / W)). `scratch`: a
/// contiguous device buffer of at least input's bytes, not overlapping either. S and H multiples of W = num_ranks.
/// Collective, asynchronous, graph-capturable (a strided copy into `scratch`, then all_to_all).
void ulysses_seq_to_head(const Team& team, const TensorView& input, const TensorView& output, const TensorView& scratch,
                         cudaStream_t stream);
/// The same on `world.team()`.
void ulysses_seq_to_head(World& world, const TensorView& input, const TensorView& output, const TensorView& scratch,
                         cudaStream_t stream);

/// The inverse: `input` [S, H / W, D] becomes `output` [S / W, H, D] (all_to_all into `scratch`, then a strided copy).
void ulysses_head_to_seq(const Team& team, const TensorView& input, const TensorView& output, const TensorView& scratch,
                         cudaStream_t stream);
/// The same on `world.team()`.
void ulysses_head_to_seq(World& world, const TensorView& input, const TensorView& output, const TensorView& scratch,
                         cudaStream_t stream);

namespace detail {

/// What one all-to-all call launches: one kernel per table, the input staged or read in place.
struct AllToAllPlan {
    bool staged = false;
    std::vector<AllToAllTable> rounds;
};

/// Checks the arguments (weft::Error naming the argument) and lays the call out. `send_counts` / `recv_counts` in
/// elements, one per rank; `equal` for all_to_all (both empty then: the counts follow from the sizes).
/// `staging_capacity`: bytes of an epoch's staging half after the header. `rank` (>= 0): the calling rank, whose
/// count to itself must equal its count from itself. Pure (no CUDA call).
AllToAllPlan plan_all_to_all(const TensorView& input, std::span<const int64_t> send_counts, const TensorView& output,
                             std::span<const int64_t> recv_counts, int num_ranks, bool equal, bool input_symmetric,
                             uint64_t staging_capacity, int rank = -1);

/// Checks the arguments of ulysses_seq_to_head (`seq_to_head`) or ulysses_head_to_seq on a team of `num_ranks` over
/// `num_nodes` nodes: the shapes against each other, scratch large enough and overlapping neither view, and the
/// one-node all-to-all's own checks (its rank bound included) when the team is on one node; weft::Error naming the
/// argument. Pure (no CUDA call); the helpers call it before they copy anything.
void check_ulysses_args(const TensorView& input, const TensorView& output, const TensorView& scratch, int num_ranks,
                        bool seq_to_head, int num_nodes = 1);

}  // namespace detail

}  // namespace weft::ops
