// SPDX-License-Identifier: MIT
// The hierarchical collectives of a team that spans nodes (private to src/ops; docs/multinode.md).
#pragma once

#include <cuda_runtime_api.h>

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
/// all_to_all (equal splits) on such a team: weft's all_to_all over each node's members gathers, on each member, what
/// its node sends to that member's column; NCCL send/receive pairs over the column carry it to the other nodes
/// (docs/multinode.md, "All-to-all across nodes"). Same contract as ops::all_to_all (the caller has checked the
/// arguments); throws as above.
void hierarchical_all_to_all(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream);

}  // namespace weft::ops::detail
