// SPDX-License-Identifier: MIT
// A step-by-step model of the TP MoE layers' cross-rank protocol (kernels/moe_tp/README.md) run under random
// schedules: every rank's kernels (layer 0: push blocks and GEMM CTAs; layer 1: GEMM CTAs and combine blocks, the wait
// and notify kernels) are state machines that follow the kernels' order of waits, writes and signals, calls back to
// back with the routing (which experts have rows, which members a tile's rows come from) changing between calls.
// Checks that no schedule deadlocks and that every read sees the data of its own call (never overwritten early, never
// stale). Both schedules of the ops: the push (combine) on a side stream beside the GEMM, and `serial` (ranks of one
// process sharing a GPU): the push before the GEMM, the combine after it, on the caller's stream.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace weft {
namespace {

using U64 = uint64_t;
template <class T>
using Vec = std::vector<T>;

/// One actor: `step` runs one atomic step when `ready` (false: blocked on a wait); done after its last step.
struct Actor {
    std::function<bool()> ready;
    std::function<void()> step;
    std::function<bool()> done;
};

/// Runs the actors under a random schedule until all are done; "" or the failure. `spawn` may add actors.
std::string schedule(Vec<Actor>& actors, std::mt19937_64& rng, const std::string* failure) {
    for (int steps = 0; steps < 4000000; ++steps) {
        if (!failure->empty()) return *failure;
        Vec<size_t> runnable;
        bool all_done = true;
        for (size_t i = 0; i < actors.size(); ++i) {
            if (actors[i].done()) continue;
            all_done = false;
            if (actors[i].ready()) runnable.push_back(i);
        }
        if (all_done) return "";
        if (runnable.empty()) return "deadlock: no actor can run";
        actors[runnable[rng() % runnable.size()]].step();
    }
    return "no end after 4M steps";
}

// ---- layer 0: push + gathered GEMM ----------------------------------------------------------------------------

/// `broken`: the push does not wait for the member's previous GEMM (consumed): must fail under some schedule.
std::string run_layer0(int ranks, int blocks, int ctas, int calls, uint64_t seed, bool serial, bool broken = false) {
    std::mt19937_64 rng(seed);
    const auto w = static_cast<size_t>(ranks);
    Vec<U64> epoch(w, 0);
    Vec<Vec<U64>> arrived(w, Vec<U64>(w, 0)), consumed(w, Vec<U64>(w, 0));
    // buf[r][s][b]: the call whose rows block b of source s last wrote into rank r's gathered A.
    Vec<Vec<Vec<int>>> buf(w, Vec<Vec<int>>(w, Vec<int>(static_cast<size_t>(blocks), -1)));
    std::string failure;
    // Per call, the tiles (each a contiguous range of source ranks), the same on every rank.
    Vec<Vec<std::pair<int, int>>> tiles(static_cast<size_t>(calls));
    for (auto& t : tiles) {
        const int n = 1 + static_cast<int>(rng() % 12);
        for (int i = 0; i < n; ++i) {
            const int a = static_cast<int>(rng() % w), b = static_cast<int>(rng() % w);
            t.emplace_back(std::min(a, b), std::max(a, b));
        }
    }
    struct RankState {
        int call = 0;
        int phase = 0;         // 0: advance epoch; 1: GEMM + push running; 2: notify; 3: join, next call
        Vec<int> cta_next;     // next tile index (in this CTA's stride) per GEMM CTA
        Vec<int> push_member;  // next member index (0 .. W) per push block
        Vec<int> push_stage;   // 0: wait consumed, 1: write + signal
    };
    Vec<RankState> rs(w);
    Vec<Actor> actors;
    for (int r = 0; r < ranks; ++r) {
        RankState& init = rs[static_cast<size_t>(r)];
        init.cta_next.assign(static_cast<size_t>(ctas), 0);
        init.push_member.assign(static_cast<size_t>(blocks), 0);
        init.push_stage.assign(static_cast<size_t>(blocks), 0);
        auto gemm_done = [&, r] {
            const RankState& st = rs[static_cast<size_t>(r)];
            const int n = static_cast<int>(tiles[static_cast<size_t>(st.call)].size());
            for (int c = 0; c < ctas; ++c) {
                if (c + st.cta_next[static_cast<size_t>(c)] * ctas < n) return false;
            }
            return true;
        };
        auto push_done = [&, r] {
            for (int v : rs[static_cast<size_t>(r)].push_member) {
                if (v < ranks) return false;
            }
            return true;
        };
        // The main stream: epoch, (GEMM), notify, join.
        actors.push_back(Actor{[&, r, gemm_done, push_done] {
                                   const RankState& st = rs[static_cast<size_t>(r)];
                                   if (st.phase == 1) return gemm_done();
                                   if (st.phase == 3) return push_done();
                                   return true;
                               },
                               [&, r] {
                                   RankState& st = rs[static_cast<size_t>(r)];
                                   const auto ru = static_cast<size_t>(r);
                                   if (st.phase == 0) {
                                       ++epoch[ru];
                                       std::fill(st.cta_next.begin(), st.cta_next.end(), 0);
                                       std::fill(st.push_member.begin(), st.push_member.end(), 0);
                                       std::fill(st.push_stage.begin(), st.push_stage.end(), 0);
                                       st.phase = 1;
                                   } else if (st.phase == 1) {
                                       st.phase = 2;
                                   } else if (st.phase == 2) {
                                       for (size_t q = 0; q < w; ++q)
                                           consumed[q][ru] += 1;  // this rank's gathered A is read
                                       st.phase = 3;
                                   } else {
                                       st.phase = 0;
                                       ++st.call;
                                   }
                               },
                               [&, r] { return rs[static_cast<size_t>(r)].call >= calls; }});
        // GEMM CTAs: tile c, c + ctas, ...; each waits arrived[s] >= epoch * blocks for its sources, then reads them.
        for (int c = 0; c < ctas; ++c) {
            auto tile_of = [&, r, c](int* lo, int* hi) {
                const RankState& st = rs[static_cast<size_t>(r)];
                const auto& t = tiles[static_cast<size_t>(st.call)];
                const int i = c + st.cta_next[static_cast<size_t>(c)] * ctas;
                if (i >= static_cast<int>(t.size())) return false;
                *lo = t[static_cast<size_t>(i)].first;
                *hi = t[static_cast<size_t>(i)].second;
                return true;
            };
            actors.push_back(Actor{[&, r, tile_of, push_done, serial] {
                                       const RankState& st = rs[static_cast<size_t>(r)];
                                       int lo = 0, hi = 0;
                                       if (st.phase != 1 || !tile_of(&lo, &hi)) return false;
                                       if (serial && !push_done()) return false;  // the push runs first
                                       for (int s = lo; s <= hi; ++s) {
                                           if (arrived[static_cast<size_t>(r)][static_cast<size_t>(s)] <
                                               epoch[static_cast<size_t>(r)] * static_cast<U64>(blocks)) {
                                               return false;
                                           }
                                       }
                                       return true;
                                   },
                                   [&, r, c, tile_of] {
                                       RankState& st = rs[static_cast<size_t>(r)];
                                       int lo = 0, hi = 0;
                                       tile_of(&lo, &hi);
                                       for (int s = lo; s <= hi; ++s) {
                                           for (int v : buf[static_cast<size_t>(r)][static_cast<size_t>(s)]) {
                                               if (v != st.call && failure.empty()) {
                                                   std::ostringstream os;
                                                   os << "layer 0: rank " << r << " call " << st.call
                                                      << " read rows of source " << s << " from call " << v;
                                                   failure = os.str();
                                               }
                                           }
                                       }
                                       ++st.cta_next[static_cast<size_t>(c)];
                                   },
                                   [&, r] { return rs[static_cast<size_t>(r)].call >= calls; }});
        }
        // Push blocks: members in rotated order; wait consumed[q] >= epoch - 1 (not for itself), write, signal.
        for (int b = 0; b < blocks; ++b) {
            actors.push_back(Actor{[&, r, b] {
                                       const RankState& st = rs[static_cast<size_t>(r)];
                                       const int i = st.push_member[static_cast<size_t>(b)];
                                       // Forked after the call's epoch advance; runs beside the GEMM until the join.
                                       if (st.phase == 0 || i >= ranks || st.call >= calls) return false;
                                       const int q = (r + i) % ranks;
                                       if (st.push_stage[static_cast<size_t>(b)] == 0 && q != r && !broken) {
                                           return consumed[static_cast<size_t>(r)][static_cast<size_t>(q)] + 1 >=
                                                  epoch[static_cast<size_t>(r)];
                                       }
                                       return true;
                                   },
                                   [&, r, b] {
                                       RankState& st = rs[static_cast<size_t>(r)];
                                       const auto bu = static_cast<size_t>(b);
                                       const int q = (r + st.push_member[bu]) % ranks;
                                       if (st.push_stage[bu] == 0) {
                                           st.push_stage[bu] = 1;
                                           return;
                                       }
                                       buf[static_cast<size_t>(q)][static_cast<size_t>(r)][bu] = st.call;
                                       arrived[static_cast<size_t>(q)][static_cast<size_t>(r)] += 1;
                                       st.push_stage[bu] = 0;
                                       ++st.push_member[bu];
                                   },
                                   [&, r] { return rs[static_cast<size_t>(r)].call >= calls; }});
        }
    }
    return schedule(actors, rng, &failure);
}

// ---- layer 1: grouped GEMM with per-expert done words + combine ---------------------------------------------------

/// `broken`: the GEMM does not wait for the members' previous combines (consumed): must fail under some schedule.
std::string run_layer1(int ranks, int blocks, int ctas, int experts, int calls, uint64_t seed, bool serial,
                       bool broken = false) {
    std::mt19937_64 rng(seed);
    const auto w = static_cast<size_t>(ranks);
    const auto e = static_cast<size_t>(experts);
    Vec<U64> epoch(w, 0);
    Vec<Vec<U64>> done(w, Vec<U64>(e, 0)), consumed(w, Vec<U64>(w, 0));
    Vec<Vec<U64>> counters(w, Vec<U64>(e, 0));
    // partial[r][g][t]: the call whose tile t of expert g rank r's GEMM last stored.
    constexpr int kMaxTiles = 3;
    Vec<Vec<Vec<int>>> partial(w, Vec<Vec<int>>(e, Vec<int>(kMaxTiles, -1)));
    std::string failure;
    // Per call, the tiles of each expert (0 = no rows), the same on every rank; the GEMM walks them expert-major.
    Vec<Vec<int>> tiles_of(static_cast<size_t>(calls), Vec<int>(e, 0));
    Vec<Vec<std::pair<int, int>>> walk(static_cast<size_t>(calls));
    for (int c = 0; c < calls; ++c) {
        for (int g = 0; g < experts; ++g) {
            const int n = static_cast<int>(rng() % (kMaxTiles + 1));
            tiles_of[static_cast<size_t>(c)][static_cast<size_t>(g)] = n;
            for (int t = 0; t < n; ++t) walk[static_cast<size_t>(c)].emplace_back(g, t);
        }
    }
    struct RankState {
        int call = 0;
        int phase = 0;  // 0: epoch; 1: wait kernel; 2: GEMM (combine on the side); 3: join, next call
        Vec<int> cta_next;
        Vec<int> combine_group;  // next expert per combine block (experts + 1: signalled consumed)
    };
    Vec<RankState> rs(w);
    Vec<Actor> actors;
    for (int r = 0; r < ranks; ++r) {
        const auto ru = static_cast<size_t>(r);
        rs[ru].cta_next.assign(static_cast<size_t>(ctas), 0);
        rs[ru].combine_group.assign(static_cast<size_t>(blocks), 0);
        auto gemm_done = [&, r] {
            const RankState& st = rs[static_cast<size_t>(r)];
            const int n = static_cast<int>(walk[static_cast<size_t>(st.call)].size());
            for (int c = 0; c < ctas; ++c) {
                if (c + st.cta_next[static_cast<size_t>(c)] * ctas < n) return false;
            }
            return true;
        };
        auto combine_done = [&, r] {
            for (int v : rs[static_cast<size_t>(r)].combine_group) {
                if (v <= experts) return false;
            }
            return true;
        };
        actors.push_back(Actor{[&, r, gemm_done, combine_done] {
                                   const RankState& st = rs[static_cast<size_t>(r)];
                                   const auto rr = static_cast<size_t>(r);
                                   if (st.phase == 1 && !broken) {
                                       for (size_t q = 0; q < w; ++q) {
                                           if (consumed[rr][q] + static_cast<U64>(blocks) <
                                               epoch[rr] * static_cast<U64>(blocks)) {
                                               return false;
                                           }
                                       }
                                       return true;
                                   }
                                   if (st.phase == 2) return gemm_done();
                                   if (st.phase == 3) return combine_done();
                                   return true;
                               },
                               [&, r] {
                                   RankState& st = rs[static_cast<size_t>(r)];
                                   if (st.phase == 0) {
                                       ++epoch[static_cast<size_t>(r)];
                                       std::fill(st.cta_next.begin(), st.cta_next.end(), 0);
                                       std::fill(st.combine_group.begin(), st.combine_group.end(), 0);
                                       st.phase = 1;
                                   } else if (st.phase == 1) {
                                       st.phase = 2;  // the wait kernel passed; the GEMM starts
                                   } else if (st.phase == 2) {
                                       st.phase = 3;
                                   } else {
                                       st.phase = 0;
                                       ++st.call;
                                   }
                               },
                               [&, r] { return rs[static_cast<size_t>(r)].call >= calls; }});
        for (int c = 0; c < ctas; ++c) {
            actors.push_back(
                Actor{[&, r, c] {
                          const RankState& st = rs[static_cast<size_t>(r)];
                          if (st.phase != 2) return false;
                          const auto& wk = walk[static_cast<size_t>(st.call)];
                          return c + st.cta_next[static_cast<size_t>(c)] * ctas < static_cast<int>(wk.size());
                      },
                      [&, r, c] {
                          RankState& st = rs[static_cast<size_t>(r)];
                          const auto rr = static_cast<size_t>(r);
                          const auto [g, t] = walk[static_cast<size_t>(st.call)]
                                                  [static_cast<size_t>(c + st.cta_next[static_cast<size_t>(c)] * ctas)];
                          const auto gu = static_cast<size_t>(g);
                          partial[rr][gu][static_cast<size_t>(t)] = st.call;
                          if (++counters[rr][gu] == static_cast<U64>(tiles_of[static_cast<size_t>(st.call)][gu])) {
                              counters[rr][gu] = 0;
                              done[rr][gu] = epoch[rr];
                          }
                          ++st.cta_next[static_cast<size_t>(c)];
                      },
                      [&, r] { return rs[static_cast<size_t>(r)].call >= calls; }});
        }
        for (int b = 0; b < blocks; ++b) {
            // Combine block: experts in order (those with rows), waiting done[q][g] >= epoch on every member and
            // reading their partials; then consumed[q][r] += 1 on every member.
            auto next_group = [&, r, b] {
                RankState& st = rs[static_cast<size_t>(r)];
                int& g = st.combine_group[static_cast<size_t>(b)];
                while (g < experts && tiles_of[static_cast<size_t>(st.call)][static_cast<size_t>(g)] == 0) ++g;
                return g;
            };
            actors.push_back(Actor{[&, r, next_group, serial] {
                                       const RankState& st = rs[static_cast<size_t>(r)];
                                       if (st.phase == 0 || st.call >= calls) return false;
                                       if (serial && st.phase != 3) return false;  // after this rank's GEMM
                                       const int g = next_group();
                                       if (g > experts) return false;
                                       if (g == experts) return true;
                                       for (size_t q = 0; q < w; ++q) {
                                           if (done[q][static_cast<size_t>(g)] < epoch[static_cast<size_t>(r)])
                                               return false;
                                       }
                                       return true;
                                   },
                                   [&, r, b, next_group] {
                                       RankState& st = rs[static_cast<size_t>(r)];
                                       const int g = next_group();
                                       if (g == experts) {
                                           for (size_t q = 0; q < w; ++q) consumed[q][static_cast<size_t>(r)] += 1;
                                       } else {
                                           const int n = tiles_of[static_cast<size_t>(st.call)][static_cast<size_t>(g)];
                                           for (size_t q = 0; q < w; ++q) {
                                               for (int t = 0; t < n; ++t) {
                                                   const int v =
                                                       partial[q][static_cast<size_t>(g)][static_cast<size_t>(t)];
                                                   if (v != st.call && failure.empty()) {
                                                       std::ostringstream os;
                                                       os << "layer 1: rank " << r << " call " << st.call
                                                          << " read expert " << g << " tile " << t << " of rank " << q
                                                          << " from call " << v;
                                                       failure = os.str();
                                                   }
                                               }
                                           }
                                       }
                                       ++st.combine_group[static_cast<size_t>(b)];
                                   },
                                   [&, r] { return rs[static_cast<size_t>(r)].call >= calls; }});
        }
    }
    return schedule(actors, rng, &failure);
}

TEST(MoeTpProtocol, Layer0NeverDeadlocksNorReadsAnotherCallsRows) {
    for (bool serial : {false, true}) {
        for (int ranks : {1, 2, 3, 4, 8}) {
            for (uint64_t seed = 0; seed < 40; ++seed) {
                const std::string bad =
                    run_layer0(ranks, 1 + static_cast<int>(seed % 3), 1 + static_cast<int>(seed % 4), 4,
                               seed * 7919 + static_cast<uint64_t>(ranks), serial);
                ASSERT_EQ(bad, "") << "W=" << ranks << " seed " << seed << (serial ? " serial" : " side stream");
            }
        }
    }
}

TEST(MoeTpProtocol, Layer1NeverDeadlocksNorReadsAnotherCallsPartial) {
    for (bool serial : {false, true}) {
        for (int ranks : {1, 2, 3, 4, 8}) {
            for (uint64_t seed = 0; seed < 40; ++seed) {
                const std::string bad =
                    run_layer1(ranks, 1 + static_cast<int>(seed % 3), 1 + static_cast<int>(seed % 4),
                               1 + static_cast<int>(seed % 5), 4, seed * 104729 + static_cast<uint64_t>(ranks), serial);
                ASSERT_EQ(bad, "") << "W=" << ranks << " seed " << seed << (serial ? " serial" : " side stream");
            }
        }
    }
}

// The checks can fail: without the consumed waits some schedule reads another call's data (both schedules).
TEST(MoeTpProtocol, TheModelCatchesAMissingConsumedWait) {
    for (bool serial : {false, true}) {
        int layer0_failures = 0, layer1_failures = 0;
        for (uint64_t seed = 0; seed < 200; ++seed) {
            layer0_failures += run_layer0(3, 2, 2, 4, seed, serial, true).empty() ? 0 : 1;
            layer1_failures += run_layer1(3, 2, 2, 3, 4, seed, serial, true).empty() ? 0 : 1;
        }
        EXPECT_GT(layer0_failures, 0) << (serial ? "serial" : "side stream");
        EXPECT_GT(layer1_failures, 0) << (serial ? "serial" : "side stream");
    }
}

}  // namespace
}  // namespace weft
