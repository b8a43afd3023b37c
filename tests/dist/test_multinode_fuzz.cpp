// SPDX-License-Identifier: MIT
// Seeded random fuzz of the communication ops on teams that span (virtual) nodes, one process per rank:
//
//   WEFT_VIRTUAL_NODES=2 weftrun -n 4 -- weft_dist_tests --gtest_filter='MultiNodeFuzz.*'
//
// Every process draws the same cases from the same seed; before each case the processes agree (a host exchange over
// the world) whether there is time for it and whether any rank has failed. A case picks one of the teams below and
// runs one call of fuzz_collectives.hpp on it (all_reduce / all_gather / reduce_scatter in bf16, f16, f32 and, for
// the gathers, 1- to 8-byte dtypes, odd counts and 0, in place and out of place, symmetric and local buffers at
// offsets; all_to_all and all_to_all_v with random per-peer counts, zeros included, views at any byte), checked
// exactly against a host reference of the inputs of every member (functions of the seed and the WORLD rank, so a
// result in the wrong rank order shows), with the output's buffer poisoned and checked around it. The teams:
//  - the world (every node, team rank = world rank);
//  - every other rank (with an even number of ranks per node: half the members per node, interleaved);
//  - the world with team ranks interleaved across the nodes (team rank = local rank * nodes + node);
//  - each node's own team (the single-node algorithms, every node's team at once).
// Across nodes the op picks the hierarchical algorithm itself; a case that forces one of the single-node algorithms
// there must be refused naming the op (docs/multinode.md). About a tenth of the cases hold another invalid call (alike
// on every member), which must be refused before anything is launched and write nothing. MultiNodeFuzz.FusedGemm
// runs fuzz_tp.hpp's AgGemm / GemmRs / GemmAr cases on the same teams, and MultiNodeFuzz.Ep fuzz_ep.hpp's on the world.
// Without virtual nodes (one node) or without NCCL the tests skip.
//
// Knobs (tests/gpu/fuzz_harness.hpp): WEFT_FUZZ_SEED, WEFT_FUZZ_SECONDS (default 15), WEFT_FUZZ_CASES,
// WEFT_FUZZ_CASE=i (replay case i under the same launcher, virtual nodes and seed).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "dist/dist_world.hpp"
#include "gpu/fuzz_collectives.hpp"
#include "gpu/fuzz_ep.hpp"
#include "gpu/fuzz_harness.hpp"
#include "gpu/fuzz_tp.hpp"
#include "support/jit_testing.hpp"
#include "weft/net/host_backend.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

using namespace fuzz_test;

constexpr uint64_t kStagingBytes = 256ull << 10;  // WEFT_COLLECTIVE_STAGING_BYTES: staged calls run in rounds
constexpr uint64_t kChunkBytes = 64ull << 10;     // WEFT_NET_CHUNK_BYTES: the network stage in several chunks
constexpr uint64_t kCollBytes = 1ull << 20;       // the largest buffer a collective call uses
constexpr int64_t kA2aRankBytes = 192 << 10;      // the most a rank sends in an all-to-all
constexpr uint64_t kCapacity = kCollBytes + 4096 + kGuard;

struct FuzzTeam {
    std::string name;
    Team team;
};

/// The teams the cases run on (collective over the world: every process makes them in the same order).
std::vector<FuzzTeam> make_teams(World& w) {
    const int nodes = w.num_nodes(), per_node = w.num_ranks() / nodes;
    std::vector<FuzzTeam> teams;
    teams.push_back({"world", w.team()});
    if (per_node >= 2 && per_node % 2 == 0) {
        teams.push_back({"every_other_rank", w.team().split_strided(0, 2, w.num_ranks() / 2)});
    }
    if (per_node >= 2) {
        teams.push_back({"interleaved", w.team().split_color(0, (w.rank() % per_node) * nodes + w.node())});
    }
    teams.push_back({"node", w.node_team()});
    return teams;
}

/// A case: the team and one call on it.
struct Case {
    size_t team = 0;
    bool a2a = false;
    CollCase coll;
    A2aCase all_to_all;
    bool forced_across = false;  // a single-node algorithm forced on a team that spans nodes (refused)
    bool invalid() const { return a2a ? all_to_all.invalid() : coll.invalid(); }
};

std::string describe(const Case& c, const std::vector<FuzzTeam>& teams) {
    std::ostringstream os;
    os << "team " << teams[c.team].name << ": ";
    if (c.a2a) {
        os << describe(c.all_to_all);
    } else {
        os << describe(c.coll);
        if (c.forced_across) os << " (a single-node algorithm forced across nodes)";
    }
    return os.str();
}

/// The call of a case on its team, drawn from the team's size and node count (alike on every member: each node's own
/// team has the same size).
void draw_call(Rng& r, Case& c, int ranks, int nodes) {
    c.a2a = r.chance(0.4);
    if (c.a2a) {
        c.all_to_all = draw_a2a(r, ranks, kA2aRankBytes);
        draw_a2a_bad(r, c.all_to_all, kStagingBytes, 0.1);
        // Across nodes the staging-overflow kind is not drawn (the node stage stages what the network stage brings,
        // not the input whole): another invalid kind stands in.
        if (nodes > 1 && c.all_to_all.bad == A2aBad::kStagingOverflow) {
            c.all_to_all = draw_a2a(r, ranks, kA2aRankBytes);
            c.all_to_all.bad = A2aBad::kNegativeCount;
            if (c.all_to_all.equal) c.all_to_all.bad = A2aBad::kCountMismatch;
        }
        return;
    }
    c.coll = draw_coll(r, ranks, kCollBytes, 0.1);
    if (nodes > 1 && c.coll.algo != 0 && c.coll.bad == CollBad::kNone) {
        // The single-node algorithms need every member load/store reachable: across nodes, forcing one is refused
        // (a fifth of these cases); the others let the op choose (the hierarchical algorithm).
        if (r.chance(0.2) && c.coll.ranks > 1) {
            c.forced_across = true;
            c.coll.bad = CollBad::kAlgoRange;  // run_coll's "refused, nothing written" check; the algo stays in range
            c.coll.count = std::max<uint64_t>(4, std::min<uint64_t>(c.coll.count, 4096));
            c.coll.in_place = false;
        } else {
            c.coll.algo = 0;
        }
    }
}

/// The command that replays a case of `test` (the launcher of this run: weftrun with virtual nodes, or the job's own).
std::string replay_command(const World& w, const char* test) {
    std::ostringstream os;
    if (w.virtual_nodes() > 1) {
        os << "WEFT_VIRTUAL_NODES=" << w.virtual_nodes() << " weftrun -n " << w.num_ranks() << " -- ";
    } else {
        os << "(under this job's launcher, " << w.num_ranks() << " ranks on " << w.num_nodes() << " nodes) ";
    }
    os << "weft_dist_tests --gtest_filter=" << test;
    return os.str();
}

/// A test's own World (collective): a 60 s timeout, `heap` bytes of symmetric heap.
std::unique_ptr<World> fuzz_world(uint64_t heap) {
    WorldOptions options;
    options.timeout = std::chrono::milliseconds(60000);
    options.heap_bytes = heap;
    return World::from_env(options);
}

/// Rank 0's decision for the next case (a draw's attempt, kSkip or kStop), agreed over the world: kStop for every rank
/// when any rank has failed.
int agree(World& w, int decision, bool failed) {
    std::vector<uint8_t> mine(5);
    std::memcpy(mine.data(), &decision, 4);
    mine[4] = static_cast<uint8_t>(failed);
    const auto votes = w.team().all_gather("weft.test.multinode_fuzz", mine);
    int d = kStop;
    std::memcpy(&d, votes[0].data(), 4);
    for (const auto& v : votes) d = v[4] != 0 ? kStop : d;
    return d;
}

/// Whether every rank should stop before case i: rank 0's budgets (time, cases), or a failure on any rank.
bool agree_to_stop(World& w, const FuzzRun& run, int64_t i, bool failed) {
    return agree(w, run.more(i) ? 0 : kStop, failed) == kStop;
}

TEST(MultiNodeFuzz, CollectivesAndAllToAll) {
    World& main_world = dist_world();
    if (const std::string why = why_no_network_across_nodes(main_world); !why.empty()) GTEST_SKIP() << why;
    const testing::ScopedEnv chunk("WEFT_NET_CHUNK_BYTES", std::to_string(kChunkBytes));
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::to_string(kStagingBytes));
    FuzzRun run("MultiNodeCollectives", 15, 100000, 1, "MultiNodeFuzz.CollectivesAndAllToAll",
                replay_command(main_world, "MultiNodeFuzz.CollectivesAndAllToAll"));

    std::unique_ptr<World> w = fuzz_world(256ull << 20);
    const std::vector<FuzzTeam> teams = make_teams(*w);
    auto rank = std::make_unique<CollRank>(*w, kCapacity);
    for (const FuzzTeam& t : teams) {
        if (t.team.is_member()) ops::prepare_collectives(t.team);
    }
    w->barrier();

    if (w->rank() == 0) {  // rank 0 is a member of every team
        std::ostringstream os;
        for (const FuzzTeam& t : teams) {
            os << " " << t.name << " (" << t.team.num_ranks() << " ranks on " << t.team.num_nodes() << " node(s))";
        }
        std::printf("[ fuzz     ] teams:%s\n", os.str().c_str());
    }
    int64_t cases = 0, invalid = 0;
    std::vector<int64_t> per_team(teams.size(), 0);
    bool failed = false;
    for (int64_t i = 0; !agree_to_stop(*w, run, i, failed); ++i) {
        const int64_t idx = run.case_index(i);
        Rng r = run.rng(idx, run.first_attempt());
        Case c;
        c.team = static_cast<size_t>(r.uniform(0, static_cast<int64_t>(teams.size()) - 1));
        const Team& team = teams[c.team].team;
        if (team.is_member()) {  // rank 0 is a member of every team: its counts are the run's
            draw_call(r, c, team.num_ranks(), team.num_nodes());
            const uint64_t seed = r.next();
            std::string what;
            try {
                what = c.a2a ? run_a2a(c.all_to_all, seed, static_cast<uint64_t>(idx), team, rank->buffers,
                                       rank->stream.st)
                             : run_coll(c.coll, seed, team, rank->buffers, rank->stream.st);
            } catch (const std::exception& e) {
                what = std::string("threw: ") + e.what();
            }
            if (!what.empty()) {
                run.fail(idx, run.first_attempt(), describe(c, teams) + " :: world rank " + std::to_string(w->rank()),
                         what);
                failed = true;
            }
        }
        ++cases;
        ++per_team[c.team];
        invalid += c.invalid() ? 1 : 0;
        w->barrier();  // every team's calls are done before the next case's inputs go in
    }
    rank->teardown(*w);
    rank.reset();
    if (w->rank() == 0) {
        std::ostringstream os;
        for (size_t t = 0; t < teams.size(); ++t) os << " " << teams[t].name << " " << per_team[t];
        std::printf("[ fuzz     ] cases per team:%s\n", os.str().c_str());
    }
    run.summary(cases, invalid, 0);
    w.reset();  // collective
}

// Expert parallelism across nodes: fuzz_ep.hpp's cases (a Buffer of a random Config, 1-6 rounds of routings with
// dropped, hot, sparse and invalid ids, padded strides, in-place combines, receive limits that routings exceed;
// low-latency rounds in bf16 and fp8, whole or in split halves, pairs interleaved, fp8 flags that differ across
// ranks) on the world, which spans the nodes: the normal mode's two-hop path and the low-latency mode's direct one,
// every output against the one-node reference (the combine bit for bit).
TEST(MultiNodeFuzz, Ep) {
    World& main_world = dist_world();
    if (const std::string why = why_no_network_across_nodes(main_world); !why.empty()) GTEST_SKIP() << why;
    const testing::ScopedEnv chunk("WEFT_NET_CHUNK_BYTES", std::to_string(kChunkBytes));
    FuzzRun run("MultiNodeEp", 15, 100000, 1, "MultiNodeFuzz.Ep", replay_command(main_world, "MultiNodeFuzz.Ep"));

    constexpr uint64_t kHeap = 512ull << 20;
    std::unique_ptr<World> w = fuzz_world(kHeap);
    const int n = w->num_ranks(), nodes = w->num_nodes();
    cudaStream_t s = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int64_t cases = 0, invalid = 0, refused = 0, low_latency = 0;
    bool failed = false;
    for (int64_t i = 0; !agree_to_stop(*w, run, i, failed); ++i) {
        const int64_t idx = run.case_index(i);
        Rng r = run.rng(idx, run.first_attempt());
        const bool ll = r.chance(0.5);
        EpCase c = draw_ep_case(r, n, ll);
        for (EpRound& rd : c.rounds) {  // the legacy stream is refused only to ranks that are threads sharing a GPU
            if (rd.bad == EpCallBad::kLegacyStream) rd.bad = EpCallBad::kSmsOverBudget;
        }
        if (c.cfg_bad == EpCfgBad::kNone) {
            bool fits = false;  // the Buffer across nodes and its handles within the World's heap
            try {
                fits = ops::ep::footprint(c.cfg, n, nodes).heap_bytes(4) + (32ull << 20) <= kHeap;
            } catch (const Error&) {
            }
            if (!fits) {
                ++refused;
                continue;
            }
        }
        bool fatal = false;
        std::vector<std::string> what;
        try {
            what = ll ? run_ep_low_latency(*w, c, s, &fatal) : run_ep_normal(*w, c, s, &fatal);
        } catch (const std::exception& e) {
            what.push_back(std::string("threw: ") + e.what());
            fatal = true;
        }
        for (const std::string& m : what) {
            run.fail(idx, run.first_attempt(), describe(c) + " :: world rank " + std::to_string(w->rank()), m);
        }
        failed = failed || !what.empty() || fatal;
        ++cases;
        low_latency += ll ? 1 : 0;
        invalid += c.cfg_bad != EpCfgBad::kNone || std::any_of(c.rounds.begin(), c.rounds.end(), [](const EpRound& x) {
                       return x.bad != EpCallBad::kNone;
                   });
        // After a fatal case the ranks' calls may no longer agree: no collective call after it (the others stop at
        // their next agreement, within the World's timeout). After another failure the next agreement stops them.
        if (fatal) break;
        w->barrier();
    }
    if (w->rank() == 0) {
        std::printf("[ fuzz     ] %lld low-latency cases, %lld normal; %lld draws too large for the heap\n",
                    static_cast<long long>(low_latency), static_cast<long long>(cases - low_latency),
                    static_cast<long long>(refused));
    }
    run.summary(cases, invalid, 0);
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    w.reset();  // collective
}

// The fused tensor-parallel GEMMs across nodes: fuzz_tp.hpp's cases (AgGemm and GemmRs of random shapes, dtypes,
// options and calls, invalid calls alike on every member; GemmAr, refused at construction on a team that spans nodes)
// on the teams above: the world, every other rank and the interleaved world take the inter-node paths (AgGemm's two
// hops, GemmRs's node stage and network in sub-blocks of WEFT_NET_CHUNK_BYTES), each node's own team the one-node ops
// (GemmAr included). Rank 0 draws each case, admitting a new kernel within the budget (WEFT_FUZZ_KERNELS, default
// 6), and the ranks agree on its draw.
TEST(MultiNodeFuzz, FusedGemm) {
    World& main_world = dist_world();
    if (const std::string why = why_no_network_across_nodes(main_world); !why.empty()) GTEST_SKIP() << why;
    const testing::ScopedEnv chunk("WEFT_NET_CHUNK_BYTES", std::to_string(kChunkBytes));
    // Small staging regions for GemmAr's collective all-reduce on the node teams.
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::string("4M"));
    FuzzRun run("MultiNodeFusedGemm", 15, 100000, 6, "MultiNodeFuzz.FusedGemm",
                replay_command(main_world, "MultiNodeFuzz.FusedGemm"));

    std::unique_ptr<World> w = fuzz_world(256ull << 20);
    const std::vector<FuzzTeam> teams = make_teams(*w);
    cudaStream_t s = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const auto draw = [&](int64_t idx, int attempt, size_t* team) {
        Rng r = run.rng(idx, attempt);
        *team = static_cast<size_t>(r.uniform(0, static_cast<int64_t>(teams.size()) - 1));
        const Team& t = teams[*team].team;
        TpCase c = t.is_member() ? draw_tp(r, *w, t) : TpCase{};
        return std::make_pair(c, r.next());
    };
    int64_t cases = 0, invalid = 0, refused = 0;
    std::vector<int64_t> per_team(teams.size(), 0);
    bool failed = false;
    for (int64_t i = 0;; ++i) {
        const int64_t idx = run.case_index(i);
        int decision = kStop;
        if (w->rank() == 0 && run.more(i)) {  // rank 0 is a member of every team
            decision = kSkip;
            for (int a = run.first_attempt(); a <= run.last_attempt(); ++a) {
                size_t team = 0;
                const TpCase c = draw(idx, a, &team).first;
                if (run.admit(tp_kernel_key(c, *w, teams[team].team))) {
                    decision = a;
                    break;
                }
                ++refused;
            }
        }
        decision = agree(*w, decision, failed);
        if (decision == kStop) break;
        if (decision == kSkip) continue;
        size_t team = 0;
        const auto [c, seed] = draw(idx, decision, &team);
        bool fatal = false;
        if (teams[team].team.is_member()) {
            std::string what;
            try {
                what = run_tp(c, seed, *w, teams[team].team, s);
            } catch (const std::exception& e) {
                what = std::string("threw: ") + e.what();
                fatal = true;  // the members' calls may no longer agree
            }
            if (!what.empty()) {
                run.fail(
                    idx, decision,
                    "team " + teams[team].name + ": " + describe(c) + " :: world rank " + std::to_string(w->rank()),
                    what);
                failed = true;
            }
        }
        ++cases;
        ++per_team[team];
        invalid += c.invalid() ? 1 : 0;
        if (fatal) break;  // no collective call after it: the others stop at their next agreement (World's timeout)
        w->barrier();
    }
    if (w->rank() == 0) {
        std::ostringstream os;
        for (size_t t = 0; t < teams.size(); ++t) os << " " << teams[t].name << " " << per_team[t];
        std::printf("[ fuzz     ] cases per team:%s\n", os.str().c_str());
    }
    run.summary(cases, invalid, refused);
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    w.reset();  // collective
}

}  // namespace
}  // namespace weft::test
