// SPDX-License-Identifier: MIT
// Team membership maths (pure functions, unit-tested on the CPU): strided and colour splits, translation.
#pragma once

#include <string>
#include <vector>

namespace weft::detail {

/// A team is the list of its members' world ranks, indexed by team rank.
using TeamMembers = std::vector<int>;

/// OpenSHMEM's split_strided: the parent's ranks start, start + stride, ..., (size of them), in that
/// order. Throws weft::Error naming the argument when start/stride/size do not describe ranks of the
/// parent (start outside [0, parent size), size < 1, stride < 1 with size > 1, last rank out of range).
TeamMembers split_strided_members(const TeamMembers& parent, int start, int stride, int size);

/// MPI_Comm_split: of the parent's ranks, those whose colour equals `color`, ordered by (key, parent rank).
/// `colors[i]`/`keys[i]` are parent rank i's arguments. A negative `color` gives an empty team. Throws
/// weft::Error when the vectors do not have one entry per parent rank.
TeamMembers split_color_members(const TeamMembers& parent, const std::vector<int>& colors, const std::vector<int>& keys,
                                int color);

/// Team rank of `world_rank`, or -1 when it is not a member.
int team_rank_of(const TeamMembers& members, int world_rank);

/// World rank of `team_rank`; throws weft::Error when team_rank is outside [0, size).
int world_rank_of(const TeamMembers& members, int team_rank);

/// Groups ranks by an equal label (e.g. host name): result[i] = index of rank i's label in order of first
/// appearance. Used for the node-local team and for counting ranks that share a GPU.
std::vector<int> group_by_label(const std::vector<std::string>& labels);

}  // namespace weft::detail
