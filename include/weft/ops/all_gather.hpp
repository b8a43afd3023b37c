// SPDX-License-Identifier: MIT
// weft::ops::all_gather: every rank's output is the concatenation of every rank's input, in rank order.
#pragma once

#include <cuda_runtime_api.h>

#include "weft/ops/collectives.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft {
class Team;
class World;
}  // namespace weft

namespace weft::ops {

struct AllGatherOptions {
    AllGatherAlgo algo = AllGatherAlgo::kAuto;  ///< kAuto: WEFT_ALLGATHER_ALGO, else select_all_gather_algo
};

/// output[r * n + i] = input of team rank r [i], for every rank r of the team, with n = input.numel(). Collective
/// over the team's members (see collectives.hpp). `input`: contiguous, any dtype, any count; `output`: contiguous, same dtype, team.num_ranks() * n
/// elements. In place when `input` is this rank's slot of `output` (input.data == output.data + team.rank() * n
/// elements); otherwise they must not overlap. kSmPush and kCopyEnginePush write into peers' outputs: `output`
/// must be symmetric. A symmetric `input` lets kCopyEnginePull read it directly (no staging copy).
void all_gather(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream,
                const AllGatherOptions& options = {});
/// all_gather over world.team().
void all_gather(World& world, const TensorView& input, const TensorView& output, cudaStream_t stream,
                const AllGatherOptions& options = {});

}  // namespace weft::ops
