// SPDX-License-Identifier: MIT
// Team: an ordered subset of the world's ranks (a node, a TP group ...), with rank translation.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "weft/common/device_ctx.hpp"

namespace weft {

class World;
namespace detail {
struct TeamState;
}

/// A team lists its members' world ranks in team-rank order. Teams are cheap to copy (copies share
/// state). A team object belongs to one rank and must not be used after its World is destroyed.
/// A rank may hold a team it is not a member of (split results for non-members): then rank() is -1 and
/// only membership queries work.
///
/// Collectives over a team (barrier, all_gather, split_color, the team-collective heap calls, and ops run on
/// the team) are called by every member, in the same order; non-members take no part. Teams that share no
/// member may run their collectives at the same time. Two Team objects with the same id() are the same team:
/// copies, and the same split of the same parent made again, share keys and sequence numbers.
class Team {
public:
    /// An empty team (no members, no World).
    Team();

    /// The World this team belongs to. Throws weft::Error for an empty team (Team()).
    World& world() const;
    /// Names the team: identical on every member and on non-members holding it, unique per team in the World
    /// (the world team's is "world"). Empty for Team().
    const std::string& id() const;
    /// True for the World's own team (World::team()).
    bool is_world() const;
    /// The World's timeout, which bounds every collective of the team. Throws weft::Error for an empty team.
    std::chrono::milliseconds timeout() const;

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
    /// team_split_strided. Ranks outside the result get a non-member team. Every member must pass the same
    /// arguments: members that differ hold teams of different ids, whose first collective meets nobody and times
    /// out. Splitting again is cheap: a team of the same members reuses the device tables the first one made.
    Team split_strided(int start, int stride, int size) const;
    /// Collective over this team's members (same order of calls on each): the members that pass the same
    /// non-negative `color`, ordered by (key, team rank), as in MPI_Comm_split. A negative color gives an
    /// empty team. Throws weft::Error when this rank is not a member, or after the timeout when a member
    /// does not call it. Every call makes a new team (a new id), also with the same colours and keys as an
    /// earlier one, and a team keeps the workspaces its ops make (collectives.hpp: 3 x the staging size and
    /// more) until the World ends: split once and keep the team, rather than splitting again per step.
    Team split_color(int color, int key) const;

    /// Collective over the members: returns once every member has called it. Throws weft::Error when this rank
    /// is not a member, or after timeout() naming the team ranks (and their world ranks) that did not arrive.
    void barrier() const;
    /// Collective over the members: every member's `bytes`, indexed by team rank. `key` names the exchange
    /// (every member passes the same key; any printable text without spaces); it is scoped to the team, so two
    /// teams may use one key at once, and a team may reuse a key (the n-th call with a key meets the n-th call
    /// of the other members). Throws weft::Error when this rank is not a member, or after timeout() naming the
    /// team ranks (and their world ranks) that did not arrive.
    std::vector<std::vector<uint8_t>> all_gather(const std::string& key, const std::vector<uint8_t>& bytes) const;

    /// Members that share this rank's GPU (same host and PCI bus id), this rank included. Throws weft::Error
    /// when this rank is not a member.
    int num_ranks_on_device() const;
    /// The most members any one GPU hosts: the same on every member.
    int max_ranks_per_device() const;
    /// Nodes the members span (hosts, or virtual nodes: docs/multinode.md); the same on every member and non-member.
    int num_nodes() const;
    /// Members per node when every spanned node holds the same number of members, else 0.
    int ranks_per_node() const;
    /// This member's node among the team's nodes (numbered in order of first appearance in team-rank order), or -1
    /// for a non-member.
    int node_index() const;
    /// This member's index among the team's members on its node (in team-rank order), or -1 for a non-member.
    int local_index() const;
    /// Team ranks of the members on team node `node_index` (in [0, num_nodes())), in team-rank order.
    const std::vector<int>& node_members(int node_index) const;
    /// "world ranks 0, 1, 2, 3": the members, for error messages.
    std::string describe() const;
    /// Throws weft::Error "<what>: world rank 5 is not a member of this team (world ranks 0, 1, 2, 3)" when this
    /// rank is not a member (or the team is empty); ops call it first.
    void require_member(const std::string& what) const;

    /// The DeviceCtx for kernels run by this team: rank/num_ranks are team values; peer_bases and
    /// team_to_world are device arrays indexed by team rank (allocated once per team, at its creation, and kept
    /// until the World shuts down, so that kernels launched with them may outlive the Team object;
    /// team_to_world is nullptr for the world team). Throws weft::Error when this rank is not a member.
    DeviceCtx device_ctx() const;

private:
    friend struct detail::TeamState;
    explicit Team(std::shared_ptr<const detail::TeamState> state);
    std::shared_ptr<const detail::TeamState> state_;
};

}  // namespace weft
