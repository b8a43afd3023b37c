// SPDX-License-Identifier: MIT
// Unit tests of the autotuner with fake timings: selection, cross-rank agreement, decision caching,
// forcing and disabling. No GPU: a fake measure replaces CUDA-event timing.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "support/jit_testing.hpp"
#include "weft/jit/autotune.hpp"
#include "weft/runtime/error.hpp"

namespace weft::jit {
namespace {

namespace fs = std::filesystem;
using weft::testing::read_text_file;
using weft::testing::TempDir;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

TEST(JitAutotuneSelect, LowestScoreWinsTiesGoToTheLowerIndex) {
    EXPECT_EQ(select_winner({{3.0}, {1.0}, {2.0}}), 1u);
    EXPECT_EQ(select_winner({{2.0}, {1.0}, {1.0}}), 1u);
    EXPECT_EQ(select_winner({{1.0}, {1.0}}), 0u);
    EXPECT_EQ(select_winner({{5.0}}), 0u);
}

TEST(JitAutotuneSelect, TheSlowestRankCounts) {
    // Candidate 0 is fastest on rank 0 but slow on rank 2; candidate 1 is even everywhere.
    EXPECT_EQ(select_winner({{1.0, 1.0, 9.0}, {3.0, 3.0, 3.0}, {2.0, 4.0, 2.0}}), 1u);
    // Cross-rank disagreement: each rank alone would pick a different candidate.
    const std::vector<std::vector<double>> t = {{1.0, 6.0}, {6.0, 1.0}, {4.0, 4.5}};
    EXPECT_EQ(select_winner(t), 2u);
}

TEST(JitAutotuneSelect, FailuresDisqualifyAndAllFailedIsAnError) {
    EXPECT_EQ(select_winner({{1.0, kInf}, {2.0, 2.0}}), 1u);
    EXPECT_EQ(select_winner({{kNaN}, {2.0}}), 1u);
    EXPECT_EQ(select_winner({{-1.0}, {2.0}}), 1u);
    EXPECT_THROW(select_winner({{kInf}, {kNaN}}), Error);
    EXPECT_THROW(select_winner({}), Error);
    EXPECT_THROW(select_winner({{1.0, 2.0}, {1.0}}), Error);
}

TEST(JitAutotuneSelect, MedianAndForceList) {
    EXPECT_EQ(median({3.0, 1.0, 2.0}), 2.0);
    EXPECT_EQ(median({4.0, 1.0, 2.0, 3.0}), 2.5);
    EXPECT_EQ(median({7.0}), 7.0);
    EXPECT_THROW(median({}), Error);
    const auto forced = parse_force_list(" gemm = tile128 ,ag_gemm=a2");
    EXPECT_EQ(forced.size(), 2u);
    EXPECT_EQ(forced.at("gemm"), "tile128");
    EXPECT_EQ(forced.at("ag_gemm"), "a2");
    EXPECT_THROW(parse_force_list("gemm"), Error);
    EXPECT_THROW(parse_force_list("=x"), Error);
    EXPECT_THROW(parse_force_list("gemm="), Error);
}

// A fake measure: the time of (rank, candidate name) from a table; counts calls.
struct FakeTimes {
    std::map<std::pair<int, std::string>, double> table;
    std::mutex mutex;
    int calls = 0;
    TuneMeasure measure_for(int rank) {
        return [this, rank](const TuneCandidate& c, const TuneOptions&) {
            std::lock_guard<std::mutex> lock(mutex);
            ++calls;
            const auto it = table.find({rank, c.name});
            if (it == table.end()) throw Error("no fake time for " + c.name);
            if (it->second < 0) throw Error("candidate " + c.name + " cannot run here");
            return it->second;
        };
    }
};

std::vector<TuneCandidate> candidates(std::initializer_list<const char*> names) {
    std::vector<TuneCandidate> out;
    for (const char* n : names) out.push_back({n, [](cudaStream_t) {}});
    return out;
}

AutotuneConfig config_in(const fs::path& dir) {
    AutotuneConfig c;
    c.cache_dir = dir;
    return c;
}

TuneKey key(const std::string& problem = "m=128,n=256") { return TuneKey{"gemm", problem, 0, "sm_90a"}; }

TEST(JitAutotune, OneRankTunesThenReusesTheDecision) {
    TempDir dir("weft_tune");
    FakeTimes fake;
    fake.table = {{{0, "a"}, 3.0}, {{0, "b"}, 1.5}, {{0, "c"}, 2.0}};
    {
        Autotuner tuner(config_in(dir.path()), fake.measure_for(0));
        const TuneResult r = tuner.tune(key(), candidates({"a", "b", "c"}));
        EXPECT_EQ(r.origin, TuneResult::Origin::kTuned);
        EXPECT_EQ(r.index, 1u);
        EXPECT_EQ(r.name, "b");
        EXPECT_EQ(r.times_ms, (std::vector<double>{3.0, 1.5, 2.0}));
        EXPECT_EQ(fake.calls, 3);
        const TuneResult again = tuner.tune(key(), candidates({"a", "b", "c"}));
        EXPECT_EQ(again.origin, TuneResult::Origin::kCached);
        EXPECT_EQ(again.name, "b");
        EXPECT_EQ(fake.calls, 3) << "a cached decision times nothing";
        // Another problem is another decision.
        EXPECT_EQ(tuner.tune(key("m=1"), candidates({"a", "b", "c"})).origin, TuneResult::Origin::kTuned);
        EXPECT_EQ(fake.calls, 6);
    }
    // A new process (a new Autotuner) reads the decision file.
    Autotuner fresh(config_in(dir.path()), fake.measure_for(0));
    EXPECT_EQ(fresh.cached_decision(key()), std::optional<std::string>("b"));
    const TuneResult r = fresh.tune(key(), candidates({"a", "b", "c"}));
    EXPECT_EQ(r.origin, TuneResult::Origin::kCached);
    EXPECT_EQ(r.index, 1u);
    EXPECT_EQ(fake.calls, 6);
    const std::string file = read_text_file(dir / "autotune.txt");
    EXPECT_NE(file.find("gemm\tm=128,n=256\t1\tsm_90a\t" WEFT_VERSION_STRING "\tb\t"), std::string::npos) << file;
    // Decisions are keyed by world size and arch too.
    EXPECT_FALSE(fresh.cached_decision(TuneKey{"gemm", "m=128,n=256", 2, "sm_90a"}).has_value());
    EXPECT_FALSE(fresh.cached_decision(TuneKey{"gemm", "m=128,n=256", 1, "sm_100a"}).has_value());
    // A decision naming a candidate that no longer exists is ignored: tune again.
    fake.table[{0, "d"}] = 0.5;
    const TuneResult changed = fresh.tune(key(), candidates({"a", "c", "d"}));
    EXPECT_EQ(changed.origin, TuneResult::Origin::kTuned);
    EXPECT_EQ(changed.name, "d");
    // The file holds one line per decision (the retuned one replaced, not appended).
    Autotuner third(config_in(dir.path()), fake.measure_for(0));
    EXPECT_EQ(third.cached_decision(key()), std::optional<std::string>("d"));
    const std::string after = read_text_file(dir / "autotune.txt");
    size_t lines = 0;
    for (size_t p = after.find("\tm=128,n=256\t"); p != std::string::npos; p = after.find("\tm=128,n=256\t", p + 1)) ++lines;
    EXPECT_EQ(lines, 1u) << after;
}

TEST(JitAutotune, ForcedAndDisabled) {
    FakeTimes fake;
    fake.table = {{{0, "a"}, 3.0}, {{0, "b"}, 1.0}};
    AutotuneConfig forced;
    forced.forced = {{"gemm", "a"}};
    Autotuner f(forced, fake.measure_for(0));
    const TuneResult r = f.tune(key(), candidates({"a", "b"}));
    EXPECT_EQ(r.origin, TuneResult::Origin::kForced);
    EXPECT_EQ(r.name, "a");
    EXPECT_EQ(fake.calls, 0);
    forced.forced = {{"gemm", "zz"}};
    Autotuner bad(forced, fake.measure_for(0));
    try {
        bad.tune(key(), candidates({"a", "b"}));
        FAIL();
    } catch (const Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("zz"), std::string::npos) << what;
        EXPECT_NE(what.find(" a b"), std::string::npos) << "lists the candidates: " << what;
    }
    AutotuneConfig off;
    off.enabled = false;
    Autotuner d(off, fake.measure_for(0));
    const TuneResult first = d.tune(key(), candidates({"a", "b"}));
    EXPECT_EQ(first.origin, TuneResult::Origin::kDisabled);
    EXPECT_EQ(first.index, 0u);
    EXPECT_EQ(fake.calls, 0);
}

TEST(JitAutotune, FailingCandidateIsSkippedAndBadCandidateListsAreErrors) {
    FakeTimes fake;
    fake.table = {{{0, "a"}, -1.0}, {{0, "b"}, 5.0}};  // "a" throws
    Autotuner t(AutotuneConfig{}, fake.measure_for(0));
    EXPECT_EQ(t.tune(key(), candidates({"a", "b"})).name, "b");
    EXPECT_THROW(t.tune(key("p2"), candidates({})), Error);
    EXPECT_THROW(t.tune(key("p3"), candidates({"x", "x"})), Error);
    EXPECT_THROW(t.tune(TuneKey{"", "p", 0, "sm_90a"}, candidates({"a"})), Error);
    EXPECT_THROW(t.tune(TuneKey{"gemm", "p\tq", 0, "sm_90a"}, candidates({"a"})), Error);
    fake.table[{0, "a"}] = -1.0;
    fake.table[{0, "c"}] = -1.0;
    EXPECT_THROW(t.tune(key("p4"), candidates({"a", "c"})), Error);
}

// Runs tune() on `n` rank threads; returns each rank's result (or rethrows the first error).
std::vector<TuneResult> tune_on_ranks(int n, FakeTimes& fake, const std::vector<std::vector<TuneCandidate>>& lists,
                                      const std::vector<std::optional<fs::path>>& dirs, std::vector<std::string>* errors) {
    weft::testing::ThreadTuneComm comm(n);
    std::vector<std::unique_ptr<TuneComm>> comms;
    for (int r = 0; r < n; ++r) comms.push_back(comm.for_rank(r));
    std::vector<TuneResult> results(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    errors->assign(static_cast<size_t>(n), "");
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
            AutotuneConfig config;
            config.cache_dir = dirs[static_cast<size_t>(r)];
            Autotuner tuner(config, fake.measure_for(r));
            try {
                results[static_cast<size_t>(r)] =
                    tuner.tune(TuneKey{"ag_gemm", "m=96", 0, "sm_90a"}, lists[static_cast<size_t>(r)],
                               comms[static_cast<size_t>(r)].get());
            } catch (const Error& e) {
                (*errors)[static_cast<size_t>(r)] = e.what();
            }
        });
    }
    for (auto& t : threads) t.join();
    return results;
}

TEST(JitAutotune, ThreeRanksAgreeAndTheSlowestRankCounts) {
    TempDir dir("weft_tune");
    FakeTimes fake;
    // Rank 1 alone would pick "fast0", rank 0 "fast1"; "even" is never fastest anywhere but has the
    // lowest worst case.
    fake.table = {{{0, "fast0"}, 1.0}, {{1, "fast0"}, 8.0}, {{2, "fast0"}, 2.0},
                  {{0, "fast1"}, 7.0}, {{1, "fast1"}, 1.0}, {{2, "fast1"}, 2.0},
                  {{0, "even"}, 3.0},  {{1, "even"}, 3.5},  {{2, "even"}, 3.0}};
    const auto list = candidates({"fast0", "fast1", "even"});
    std::vector<std::string> errors;
    const auto results = tune_on_ranks(3, fake, {list, list, list}, {dir.path(), dir.path(), dir.path()}, &errors);
    for (int r = 0; r < 3; ++r) {
        EXPECT_EQ(errors[static_cast<size_t>(r)], "");
        EXPECT_EQ(results[static_cast<size_t>(r)].name, "even") << "rank " << r;
        EXPECT_EQ(results[static_cast<size_t>(r)].origin, TuneResult::Origin::kTuned);
        EXPECT_EQ(results[static_cast<size_t>(r)].times_ms, (std::vector<double>{8.0, 7.0, 3.5}));
    }
    EXPECT_EQ(fake.calls, 9) << "every rank timed every candidate";
    // Second session: every rank has the decision, nobody times anything.
    const auto again = tune_on_ranks(3, fake, {list, list, list}, {dir.path(), dir.path(), dir.path()}, &errors);
    for (const auto& r : again) {
        EXPECT_EQ(r.origin, TuneResult::Origin::kCached);
        EXPECT_EQ(r.name, "even");
    }
    EXPECT_EQ(fake.calls, 9);
}

TEST(JitAutotune, ADecisionCachedOnOnlySomeRanksIsRetunedByAll) {
    TempDir with("weft_tune_a");
    FakeTimes fake;
    fake.table = {{{0, "x"}, 2.0}, {{1, "x"}, 2.0}, {{0, "y"}, 1.0}, {{1, "y"}, 1.0}};
    const auto list = candidates({"x", "y"});
    std::vector<std::string> errors;
    // A first session leaves the decision in rank 0's folder only; in the second, rank 1 has no
    // cache at all. Rank 0 reusing its decision alone would leave rank 1 waiting at a barrier
    // forever, so both must tune.
    tune_on_ranks(2, fake, {list, list}, {with.path(), std::nullopt}, &errors);
    EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
    {
        Autotuner check(config_in(with.path()), fake.measure_for(0));
        EXPECT_EQ(check.cached_decision(TuneKey{"ag_gemm", "m=96", 2, "sm_90a"}), std::optional<std::string>("y"));
    }
    const int before = fake.calls;
    const auto results = tune_on_ranks(2, fake, {list, list}, {with.path(), std::nullopt}, &errors);
    for (const auto& r : results) {
        EXPECT_EQ(r.origin, TuneResult::Origin::kTuned);
        EXPECT_EQ(r.name, "y");
    }
    EXPECT_EQ(fake.calls - before, 4);
}

TEST(JitAutotune, ACandidateFailingOnOneRankIsDisqualifiedEverywhere) {
    FakeTimes fake;
    fake.table = {{{0, "x"}, 1.0}, {{1, "x"}, -1.0}, {{0, "y"}, 2.0}, {{1, "y"}, 2.0}};
    const auto list = candidates({"x", "y"});
    std::vector<std::string> errors;
    const auto results = tune_on_ranks(2, fake, {list, list}, {std::nullopt, std::nullopt}, &errors);
    EXPECT_EQ(results[0].name, "y");
    EXPECT_EQ(results[1].name, "y");
}

TEST(JitAutotune, RanksWithDifferentCandidateListsAllFail) {
    FakeTimes fake;
    fake.table = {{{0, "x"}, 1.0}, {{1, "x"}, 1.0}, {{1, "z"}, 1.0}};
    std::vector<std::string> errors;
    tune_on_ranks(2, fake, {candidates({"x"}), candidates({"x", "z"})}, {std::nullopt, std::nullopt}, &errors);
    for (const auto& e : errors) EXPECT_NE(e.find("different keys or candidate lists"), std::string::npos) << e;
    EXPECT_EQ(fake.calls, 0);
}

}  // namespace
}  // namespace weft::jit
