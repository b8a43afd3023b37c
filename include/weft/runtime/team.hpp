// SPDX-License-Identifier: MIT
// Team: an ordered subset of the world's ranks (a node, a TP group ...), with rank translation.
#pragma once

#include <memory>
#include <vector>

#include "weft/common/device_ctx.hpp"

namespace weft {

namespace detail {
struct TeamState;
}

/// A team lists its members' world ranks in team-rank order. Teams are cheap to copy (copies share
/// state). A team object belongs to one rank and must not be used after its World is destroyed.
/// A rank may hold a team it is not a member of (split results for non-members): then rank() is -1 and
/// only membership queries work.
class Team {
public:
    /// An empty team (no members).
    Team();

    /// This rank's index in the team, or -1 when it is not a member.
    int rank() const;
    int num_ranks() const;
    bool is_member() const { return rank() >= 0; }
    /// World rank of `team_rank` (throws weft::Error when out of range).
    int world_rank(int team_rank) const;
    /// Team rank of `world_rank`, or -1 when it is not a member.
    int team_rank(int world_rank) const;
    /// World ranks, indexed by team rank.
    const std::vector<int>& members() const;

    /// Local (not collective): the team's ranks start, start + stride, ... (size of them), as in OpenSHMEM's
    /// team_split_strided. Ranks outside the result get a non-member team.
    Team split_strided(int start, int stride, int size) const;
    /// Collective over this team's members (same order of calls on each): the members that pass the same
    /// non-negative `color`, ordered by (key, team rank), as in MPI_Comm_split. A negative color gives an
    /// empty team. Throws weft::Error when this rank is not a member, or after the timeout when a member
    /// does not call it.
    Team split_color(int color, int key) const;

    /// The DeviceCtx for kernels run by this team: rank/num_ranks are team values; peer_bases and
    /// team_to_world are device arrays indexed by team rank (allocated once per team, at its creation;
    /// team_to_world is nullptr for the world team). Throws weft::Error when this rank is not a member.
    DeviceCtx device_ctx() const;

private:
    friend struct detail::TeamState;
    explicit Team(std::shared_ptr<const detail::TeamState> state);
    std::shared_ptr<const detail::TeamState> state_;
};

}  // namespace weft
