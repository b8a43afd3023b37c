// SPDX-License-Identifier: MIT
// The hierarchical collectives of a team that spans nodes (private to src/ops; docs/multinode.md).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "weft/runtime/team.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::ops::detail {

/// all_gather, reduce_scatter and all_reduce on a team whose members span several nodes: weft's own collectives over
/// each node's members, NCCL across nodes (net::HostBackend), pipelined in chunks of WEFT_NET_CHUNK_BYTES. Same
/// contracts as the ops (the caller has checked the arguments); throws weft::Error naming the team when the network
/// backend is unavailable or the nodes hold different numbers of members.
void hierarchical_all_gather(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream);
void hierarchical_reduce_scatter(const Team& team, const TensorView& input, const TensorView& output,
                                 cudaStream_t stream);
void hierarchical_all_reduce(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream);
/// all_to_all (`equal`; the counts then empty) and all_to_all_v on such a team: weft's all_to_all(_v) over each node's
/// members gathers, on each member, what its node sends to that member's column; NCCL send/receive pairs over the
/// column carry it to the other nodes (docs/multinode.md, "All-to-all across nodes"). Same contracts as the ops (the
/// caller has checked the arguments); throws as above, and for uneven splits when a node member's counts for this rank
/// differ from its recv_counts.
void hierarchical_all_to_all(const Team& team, const TensorView& input, std::span<const int64_t> send_counts,
                             const TensorView& output, std::span<const int64_t> recv_counts, bool equal,
                             cudaStream_t stream);

}  // namespace weft::ops::detail
