// SPDX-License-Identifier: MIT
// weft::ops::all_reduce: every rank's output is the element-wise sum of every rank's input.
#pragma once

#include <cuda_runtime_api.h>

#include "weft/ops/collectives.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft {
class Team;
class World;
}  // namespace weft

namespace weft::ops {

struct AllReduceOptions {
    AllReduceAlgo algo = AllReduceAlgo::kAuto;  ///< kAuto: WEFT_ALLREDUCE_ALGO, else select_all_reduce_algo
};

/// output[i] = input_0[i] + input_1[i] + ... over the team's ranks (sum, added in team-rank order in fp32, so every
/// member gets the same bits; bf16 and f16 are rounded once, at the end; a team that spans nodes sums each node's
/// members so, rounds the node sums to the dtype and adds them in NCCL's order: docs/multinode.md). Collective over the
/// team's members (see collectives.hpp for the contract every collective op follows; a non-member caller gets
/// weft::Error). `input` and `output`: contiguous, same dtype (bf16, f16 or f32), same number of elements (any,
/// including 0 and 1); `output` may equal `input` (in place) but must not partly overlap it. Asynchronous on `stream`.
/// Any device memory; symmetric buffers save the two-shot's staging copy. Bad arguments throw weft::Error naming the
/// argument.
void all_reduce(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream,
                const AllReduceOptions& options = {});
/// all_reduce over world.team().
void all_reduce(World& world, const TensorView& input, const TensorView& output, cudaStream_t stream,
                const AllReduceOptions& options = {});

}  // namespace weft::ops
