// SPDX-License-Identifier: MIT
// weft::ops::reduce_scatter: rank r's output is the element-wise sum of slice r of every rank's input.
#pragma once

#include <cuda_runtime_api.h>

#include "weft/ops/collectives.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft {
class Team;
class World;
}  // namespace weft

namespace weft::ops {

struct ReduceScatterOptions {
    ReduceScatterAlgo algo = ReduceScatterAlgo::kAuto;  ///< kAuto: WEFT_REDUCESCATTER_ALGO, else the selection
};

/// output[i] = sum over team ranks q of (input of team rank q)[team.rank() * n + i], with n = output.numel() (added
/// in team-rank order in fp32; across nodes each node's sum is rounded to the dtype and NCCL adds the nodes').
/// Collective over the team's members (see collectives.hpp). `input`: contiguous,
/// bf16, f16 or f32, team.num_ranks() * n elements; `output`: same dtype, n elements (any n). In place when
/// `output` is this rank's slice of `input` (output.data == input.data + team.rank() * n elements); otherwise they must
/// not overlap. A symmetric `input` is read by the peers directly (no staging copy, no rounds).
void reduce_scatter(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream,
                    const ReduceScatterOptions& options = {});
/// reduce_scatter over world.team().
void reduce_scatter(World& world, const TensorView& input, const TensorView& output, cudaStream_t stream,
                    const ReduceScatterOptions& options = {});

}  // namespace weft::ops
