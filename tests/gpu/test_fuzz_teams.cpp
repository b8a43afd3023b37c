// SPDX-License-Identifier: MIT
// Seeded random fuzz of the communication ops on teams (GpuFuzz.Teams): weft as "a TP group inside a larger job".
// Worlds of 2..8 ranks as threads on the visible GPUs (non-powers of two included), several worlds per run; each case
// splits the world into teams and every team runs its calls at the same time as the others:
//  - the split: split_color with 1-3 colours (arbitrary non-negative values; some ranks may pass a negative colour and
//    sit the case out) and random keys with ties, so team-rank order differs from world order; or split_strided: one
//    team anywhere, interleaved teams (start 0..stride-1), or blocks of consecutive ranks, each rank passing its own
//    team's (start, stride, size) and ranks outside every team sitting out. Teams of one rank included. Every rank
//    checks the team it got (members in team-rank order, its team rank, the rank translation) before any team calls
//    anything;
//  - every team then runs 1-3 calls of its own, drawn for its size: all_reduce / all_gather / reduce_scatter (every
//    algorithm value each header allows, bf16 / f16 / f32 for the reductions and 1- to 8-byte dtypes for all_gather,
//    odd counts and 0, in place and out of place, symmetric (World heap) and local buffers), all_to_all and
//    all_to_all_v (random per-peer counts, zeros included; symmetric or local input and output): fuzz_collectives.hpp's
//    cases, whose inputs are functions of (seed, WORLD rank, index), so a result in world order instead of team order
//    shows;
//  - the case either makes every team's workspace first (prepare_collectives, then a world barrier) or leaves it to
//    the team's first call, while other teams' kernels run;
//  - a rank outside every team calls an op on the (non-member or empty) team its split gave it: weft::Error naming the
//    op, nothing written;
//  - about a tenth of the cases hold an invalid call (alike on every member of its team: a kind the headers say is
//    refused with weft::Error before anything is launched); it must name the op and write nothing, and the team then
//    runs the valid call it stands for.
// After every case all ranks meet at a world barrier, so the next case may split the world another way.
//
// Knobs (fuzz_harness.hpp): WEFT_FUZZ_SEED, WEFT_FUZZ_SECONDS (default 15), WEFT_FUZZ_CASES, WEFT_FUZZ_CASE=i.a with
// a = W * 100 + d (case i in a world of W ranks, draw d: what a failure's line prints). JIT: one kernel set (the
// collectives', loaded by each world's setup), so the kernel budget never refuses a draw.
//
// Heap: every new team keeps its collectives' workspace until its World ends (collectives.hpp), and split_color makes
// new teams every time, so rank 0 books each case's new workspaces against the heap (an upper bound on the heap's high
// water mark: every team allocation lands at most at the top of its members' allocations) and ends the world when the
// next case would not fit; the next world starts with an empty heap.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_collectives.hpp"
#include "fuzz_harness.hpp"
#include "support/jit_testing.hpp"
#include "support/runtime_checks.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/runtime/error.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

using namespace fuzz_test;

constexpr uint64_t kStagingBytes = 512ull << 10;  // WEFT_COLLECTIVE_STAGING_BYTES: staged calls run in rounds
constexpr uint64_t kCollBytes = 1ull << 20;       // the largest buffer a collective call uses
constexpr int64_t kA2aRankBytes = 256 << 10;      // the most a rank sends in an all-to-all (a local one is staged)
constexpr uint64_t kCapacity = kCollBytes + 4096 + kGuard;  // each of a world's buffers
constexpr uint64_t kHeapBytes = 1ull << 30;                 // the world's symmetric heaps
constexpr uint64_t kHeapMargin = 16ull << 20;  // heap bytes never booked (the allocations' alignment, the World's own)
constexpr uint64_t kWorkspaceSlack = 8ull << 10;  // per workspace: the alignment of its allocations
static_assert(kStagingBytes + 64 * 8 + 15 * 8 < kCapacity, "a staging overflow's input must fit the buffers");

// ---- the case -------------------------------------------------------------------------------------------------------

enum class Split { kColor, kStrided };

/// One call a team makes: a collective or an all-to-all (fuzz_collectives.hpp), drawn for the team's size.
struct TeamCall {
    bool a2a = false;
    CollCase coll;
    A2aCase all_to_all;
    bool invalid() const { return a2a ? all_to_all.invalid() : coll.invalid(); }
};

/// A team of a case's split: its members, how the split makes it, and its calls.
struct TeamPlan {
    std::vector<int> members;   // world ranks, by team rank
    int color = 0;              // split_color: the members' colour
    int start = 0, stride = 1;  // split_strided: (start, stride, members.size())
    std::vector<TeamCall> calls;
};

/// What a rank outside every team calls on the team its split gave it (a non-member or empty team).
enum class SitOut { kAllReduce, kAllGather, kReduceScatter, kAllToAll, kAllToAllV, kPrepare, kCount };
const char* sit_out_name(SitOut s) {
    static const char* const kNames[] = {"all_reduce", "all_gather",   "reduce_scatter",
                                         "all_to_all", "all_to_all_v", "prepare_collectives"};
    return kNames[static_cast<int>(s)];
}

struct TeamsCase {
    int world = 2;
    Split split = Split::kColor;
    std::vector<int> color, key;  // per world rank (split_color; a negative colour: no team)
    std::vector<TeamPlan> teams;  // disjoint
    bool prepare = false;         // every team's workspace made (and a world barrier) before any call
    SitOut sit_out = SitOut::kAllReduce;
    /// The index of world rank `r`'s team, or -1 when it sits the case out.
    int team_of(int r) const {
        for (size_t t = 0; t < teams.size(); ++t) {
            const auto& m = teams[t].members;
            if (std::find(m.begin(), m.end(), r) != m.end()) return static_cast<int>(t);
        }
        return -1;
    }
    bool invalid() const {
        for (const TeamPlan& t : teams) {
            for (const TeamCall& c : t.calls) {
                if (c.invalid()) return true;
            }
        }
        return false;
    }
};

std::string list(const std::vector<int>& v) {
    std::ostringstream os;
    os << "[";
    for (size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
    os << "]";
    return os.str();
}

std::string describe(const TeamsCase& c) {
    std::ostringstream os;
    os << "W=" << c.world << (c.split == Split::kColor ? " split_color" : " split_strided");
    if (c.split == Split::kColor) os << " colors=" << list(c.color) << " keys=" << list(c.key);
    os << (c.prepare ? ", workspaces prepared first" : ", workspaces made by the first call");
    for (size_t t = 0; t < c.teams.size(); ++t) {
        const TeamPlan& p = c.teams[t];
        os << " | team " << t << " = world ranks " << list(p.members);
        if (c.split == Split::kStrided) os << " (start " << p.start << ", stride " << p.stride << ")";
        for (size_t k = 0; k < p.calls.size(); ++k) {
            os << (k ? "; then " : ": ")
               << (p.calls[k].a2a ? describe(p.calls[k].all_to_all) : describe(p.calls[k].coll));
        }
    }
    std::vector<int> out;
    for (int r = 0; r < c.world; ++r) {
        if (c.team_of(r) < 0) out.push_back(r);
    }
    if (!out.empty()) os << " | sitting out: world ranks " << list(out) << ", calling " << sit_out_name(c.sit_out);
    return os.str();
}

// ---- the draw -------------------------------------------------------------------------------------------------------

void draw_color_split(Rng& r, TeamsCase& c) {
    const int colors = r.pick({1, 2, 2, 3, 3});
    std::vector<int> palette;  // distinct non-negative colours
    while (static_cast<int>(palette.size()) < colors) {
        const int v = r.pick({0, 1, 2, 3, 7, 1000});
        if (std::find(palette.begin(), palette.end(), v) == palette.end()) palette.push_back(v);
    }
    const double sit_out = r.pick({0.0, 0.0, 0.15, 0.4});
    for (int q = 0; q < c.world; ++q) {
        c.color.push_back(r.chance(sit_out) ? r.pick({-1, -2, -100})
                                            : palette[static_cast<size_t>(r.uniform(0, colors - 1))]);
        c.key.push_back(static_cast<int>(r.uniform(-2, 2)));  // ties: world order decides
    }
    if (std::all_of(c.color.begin(), c.color.end(), [](int v) { return v < 0; })) {
        c.color[static_cast<size_t>(r.uniform(0, c.world - 1))] = palette[0];
    }
    std::sort(palette.begin(), palette.end());
    for (int col : palette) {
        TeamPlan t;
        t.color = col;
        for (int q = 0; q < c.world; ++q) {
            if (c.color[static_cast<size_t>(q)] == col) t.members.push_back(q);
        }
        // MPI_Comm_split order: by (key, parent rank); the parent is the world.
        std::stable_sort(t.members.begin(), t.members.end(),
                         [&](int a, int b) { return c.key[static_cast<size_t>(a)] < c.key[static_cast<size_t>(b)]; });
        if (!t.members.empty()) c.teams.push_back(std::move(t));
    }
}

TeamPlan strided_team(int start, int stride, int size) {
    TeamPlan t;
    t.start = start;
    t.stride = stride;
    for (int k = 0; k < size; ++k) t.members.push_back(start + k * stride);
    return t;
}

void draw_strided_split(Rng& r, TeamsCase& c) {
    const int w = c.world;
    switch (r.pick({0, 1, 1, 2, 2})) {
        case 0: {  // one team anywhere (size 1: any stride, 0 included)
            const int size = static_cast<int>(r.uniform(1, w));
            const int stride =
                size == 1 ? static_cast<int>(r.uniform(0, 3)) : static_cast<int>(r.uniform(1, (w - 1) / (size - 1)));
            const int start = static_cast<int>(r.uniform(0, w - 1 - (size == 1 ? 0 : stride * (size - 1))));
            c.teams.push_back(strided_team(start, stride, size));
            break;
        }
        case 1: {  // interleaved: a team per residue of the stride, some shortened, shifted or left out
            const int stride = static_cast<int>(r.uniform(1, r.chance(0.8) ? std::max(1, w / 2) : w));
            for (int s0 = 0; s0 < stride; ++s0) {
                const int full = (w - 1 - s0) / stride + 1;
                const int shift = r.chance(0.2) ? static_cast<int>(r.uniform(0, full - 1)) : 0;
                const int size = r.chance(0.7) ? full - shift : static_cast<int>(r.uniform(1, full - shift));
                if (!r.chance(0.15)) c.teams.push_back(strided_team(s0 + shift * stride, stride, size));
            }
            break;
        }
        default:  // blocks of consecutive ranks, some left out
            for (int pos = 0; pos < w;) {
                const int len = static_cast<int>(r.uniform(1, w - pos));
                if (!r.chance(0.15)) c.teams.push_back(strided_team(pos, 1, len));
                pos += len;
            }
            break;
    }
    if (c.teams.empty()) c.teams.push_back(strided_team(0, 1, w));
}

/// One call for a team of `n` ranks; invalid exactly when `bad`.
TeamCall draw_call(Rng& r, int n, bool bad) {
    TeamCall call;
    call.a2a = r.chance(0.35);
    if (call.a2a) {
        call.all_to_all = draw_a2a(r, n, kA2aRankBytes);
        // A symmetric output: the same allocation and offset on every member (collectives.hpp's rule for buffers).
        A2aCase& a = call.all_to_all;
        a.out_symmetric = r.chance(0.3);
        if (a.out_symmetric) std::fill(a.out_offset.begin(), a.out_offset.end(), a.out_offset[0]);
        draw_a2a_bad(r, call.all_to_all, kStagingBytes, bad ? 1.0 : 0.0);
    } else {
        call.coll = draw_coll(r, n, kCollBytes, bad ? 1.0 : 0.0);
    }
    return call;
}

TeamsCase draw_teams(Rng& r, int world) {
    TeamsCase c;
    c.world = world;
    c.split = r.chance(0.55) ? Split::kColor : Split::kStrided;
    if (c.split == Split::kColor) {
        draw_color_split(r, c);
    } else {
        draw_strided_split(r, c);
    }
    c.prepare = r.chance(0.5);
    c.sit_out = static_cast<SitOut>(r.uniform(0, static_cast<int>(SitOut::kCount) - 1));
    // About a tenth of the cases: the first call of one team is invalid, then the valid call it stands for.
    const bool invalid_case = r.chance(0.1);
    const auto bad_team = static_cast<size_t>(r.uniform(0, static_cast<int64_t>(c.teams.size()) - 1));
    for (size_t t = 0; t < c.teams.size(); ++t) {
        TeamPlan& p = c.teams[t];
        const int n = static_cast<int>(p.members.size());
        const int calls = r.pick({1, 1, 1, 1, 1, 1, 2, 2, 3});
        for (int k = 0; k < calls; ++k) {
            TeamCall call = draw_call(r, n, invalid_case && t == bad_team && k == 0);
            p.calls.push_back(call);
            if (!call.invalid()) continue;
            if (call.a2a) {
                call.all_to_all = valid_twin(call.all_to_all);
            } else {
                call.coll = valid_twin(call.coll);
            }
            p.calls.push_back(call);
        }
    }
    return c;
}

// ---- the world's resources ------------------------------------------------------------------------------------------

/// A rank's stream and buffers for a world's cases (CollRank: its setup loads every collective kernel before any
/// team's kernels spin, since a module load may wait for them); rank 0's also books the heap (room_for).
struct TeamsRank {
    CollRank coll;
    uint64_t booked = 0;                      // heap bytes the world's allocations may reach (rank 0's booking)
    uint64_t budget = 0;                      // the most they may reach
    std::set<std::vector<int>> strided_made;  // (start, stride, size) of the strided teams made: reused ids
    explicit TeamsRank(World& w)
        : coll(w, kCapacity), booked(w.heap().bytes_in_use()), budget(w.heap().bytes() - kHeapMargin) {}
    void teardown(World& w) { coll.teardown(w); }
};

/// Books the workspaces a case may make on rank 0's TeamsRank: every team of two or more ranks a colour split makes,
/// and the strided teams not made before in this world. False (nothing booked) when they would pass the budget.
bool room_for(const TeamsCase& c, TeamsRank& rk) {
    uint64_t bytes = 0;
    std::vector<std::vector<int>> made;
    for (const TeamPlan& t : c.teams) {
        const int n = static_cast<int>(t.members.size());
        if (n < 2) continue;  // a team of one allocates nothing
        if (c.split == Split::kStrided) {
            std::vector<int> args = {t.start, t.stride, n};
            if (rk.strided_made.count(args)) continue;
            made.push_back(std::move(args));
        }
        bytes += ops::collective_workspace_heap_bytes(n) + kWorkspaceSlack;
    }
    if (rk.booked + bytes > rk.budget) return false;
    rk.booked += bytes;
    rk.strided_made.insert(made.begin(), made.end());
    return true;
}

// ---- a case on a rank -----------------------------------------------------------------------------------------------

/// "" when `team` is what the case's split should give world rank `me`; else what differs.
std::string check_split(const TeamsCase& c, const Team& team, int me) {
    const int t = c.team_of(me);
    if (t < 0) {
        if (!team.is_member()) return "";
        return "sits out, but the split made it team rank " + std::to_string(team.rank()) + " of " + team.describe();
    }
    const std::vector<int>& want = c.teams[static_cast<size_t>(t)].members;
    if (team.members() != want)
        return "the split gave the team of " + team.describe() + ", want world ranks " + list(want);
    const int n = static_cast<int>(want.size());
    if (team.num_ranks() != n)
        return "num_ranks() is " + std::to_string(team.num_ranks()) + ", want " + std::to_string(n);
    for (int q = 0; q < n; ++q) {
        if (team.world_rank(q) != want[static_cast<size_t>(q)] || team.team_rank(want[static_cast<size_t>(q)]) != q) {
            return "rank translation of team rank " + std::to_string(q) + " in " + team.describe() + " is wrong";
        }
    }
    const auto mine = static_cast<int>(std::find(want.begin(), want.end(), me) - want.begin());
    if (team.rank() != mine) return "rank() is " + std::to_string(team.rank()) + ", want " + std::to_string(mine);
    return "";
}

/// A rank outside every team: the case's op on the team its split gave it must be refused, naming the op, with
/// nothing written.
std::string sit_out(const TeamsCase& c, const Team& team, TeamsRank& rk) {
    cudaStream_t st = rk.coll.stream.st;
    uint8_t* out = rk.coll.buffers.local_out;
    check_cuda(cudaMemsetAsync(out, 0xFF, kGuard, st), "poison");
    const TensorView in(rk.coll.buffers.local_in, DType::kF32, {8}), o(out, DType::kF32, {8});
    const std::vector<int64_t> counts(static_cast<size_t>(std::max(team.num_ranks(), 1)), 0);
    const std::function<void()> calls[] = {
        [&] { ops::all_reduce(team, in, o, st); },
        [&] { ops::all_gather(team, in, o, st); },
        [&] { ops::reduce_scatter(team, in, o, st); },
        [&] { ops::all_to_all(team, in, o, st); },
        [&] { ops::all_to_all_v(team, in, counts, o, counts, st); },
        [&] { ops::prepare_collectives(team); },
    };
    std::string what = expect_refused(sit_out_name(c.sit_out), calls[static_cast<int>(c.sit_out)]);
    check_cuda(cudaStreamSynchronize(st), "after a refused call");
    check_cuda(cudaGetLastError(), "after a refused call");
    if (what.empty() && !poison_intact(from_dev(out, kGuard, st).data(), kGuard)) what = "a refused call wrote";
    if (what.empty()) return "";
    return std::string("sitting out, ") + sit_out_name(c.sit_out) + " on the team of " + team.describe() + ": " + what;
}

std::string run_teams_case(const TeamsCase& c, uint64_t seed, World& w, TeamsRank& rk) {
    const int me = w.rank();
    const int t = c.team_of(me);
    // A rank outside every strided team passes team 0's arguments: it holds that team as a non-member.
    const TeamPlan& mine = c.teams[static_cast<size_t>(std::max(t, 0))];
    const Team team = c.split == Split::kColor
                          ? w.team().split_color(c.color[static_cast<size_t>(me)], c.key[static_cast<size_t>(me)])
                          : w.team().split_strided(mine.start, mine.stride, static_cast<int>(mine.members.size()));
    // Every rank's split is checked before any team calls anything: one that went wrong anywhere ends the case on every
    // rank (its team's members would otherwise wait for a peer that is not coming).
    const std::string wrong = check_split(c, team, me);
    const std::vector<std::vector<uint8_t>> verdicts =
        w.team().all_gather("fuzz_teams_split", {static_cast<uint8_t>(wrong.empty() ? 1 : 0)});
    if (!wrong.empty()) return wrong;
    for (const auto& v : verdicts) {
        if (v.empty() || v[0] != 1) return "";  // the rank whose split went wrong reports it
    }
    if (c.prepare) {
        if (t >= 0) ops::prepare_collectives(team);
        w.barrier();  // every team's workspace is made before any team's kernels run
    }
    if (t < 0) return sit_out(c, team, rk);
    const TeamPlan& plan = c.teams[static_cast<size_t>(t)];
    for (size_t k = 0; k < plan.calls.size(); ++k) {
        const TeamCall& call = plan.calls[k];
        const uint64_t s = mix64(seed ^ mix64((static_cast<uint64_t>(t) << 8) | k));
        const std::string what = call.a2a ? run_a2a(call.all_to_all, s, k, team, rk.coll.buffers, rk.coll.stream.st)
                                          : run_coll(call.coll, s, team, rk.coll.buffers, rk.coll.stream.st);
        if (!what.empty()) {
            return "team " + std::to_string(t) + " (team rank " + std::to_string(team.rank()) + "), call " +
                   std::to_string(k) + ": " + what;
        }
    }
    return "";
}

TEST_F(GpuFuzz, Teams) {
    FuzzRun run("Teams", 15, 1000000, 1);
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::to_string(kStagingBytes));
    fuzz_worlds<TeamsCase>(
        run, test::test_options(kHeapBytes), [](Rng& r, World& w) { return draw_teams(r, w.num_ranks()); },
        [](const TeamsCase&, World&) { return std::string("collectives"); },
        [](const TeamsCase& c) { return describe(c); }, [](const TeamsCase& c) { return c.invalid(); },
        [](World& w) { return std::make_unique<TeamsRank>(w); }, run_teams_case, WorldSizes{2, 8, {3, 5, 6, 7}},
        room_for);
}

}  // namespace
}  // namespace weft
