// SPDX-License-Identifier: MIT
// Unit tests of the autotuner with fake timings: selection, cross-rank agreement, decision caching,
// forcing and disabling, set-up failures and lockstep runs of collective candidates. No GPU: a fake measure
// replaces CUDA-event timing and a fake stream synchronisation CUDA's.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <sys/stat.h>

#include "support/jit_testing.hpp"
#include "weft/jit/autotune.hpp"
#include "weft/jit/cache.hpp"
#include "weft/jit/compiler.hpp"
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
    const std::string device = autotune_device_signature();
    EXPECT_NE(file.find("v3\tgemm\tm=128,n=256\t1\tsm_90a\t" + device + "\t" WEFT_VERSION_STRING "\t" +
                        Compiler::code_fingerprint() + "\tb\t"),
              std::string::npos)
        << file;
    // Decisions are keyed by world size, arch and device too.
    EXPECT_FALSE(fresh.cached_decision(TuneKey{"gemm", "m=128,n=256", 2, "sm_90a"}).has_value());
    EXPECT_FALSE(fresh.cached_decision(TuneKey{"gemm", "m=128,n=256", 1, "sm_100a"}).has_value());
    {
        TempDir other("weft_tune_other_device");
        const std::string planted = std::string("v3\tgemm\tm=128,n=256\t1\tsm_90a\tOther GPU, 7 SMs\t") +
                                    WEFT_VERSION_STRING + "\t" + Compiler::code_fingerprint() + "\ta\t0.1\n";
        write_file_atomically(other.path() / "autotune.txt", planted.data(), planted.size());
        Autotuner elsewhere(config_in(other.path()), fake.measure_for(0));
        EXPECT_FALSE(elsewhere.cached_decision(key()).has_value()) << "a decision of another device was taken";
    }
    {
        // Tuned on kernels compiled otherwise (another toolchain, WEFT_TRACE, WEFT_JIT_*): not taken.
        TempDir other("weft_tune_other_code");
        const std::string planted = std::string("v3\tgemm\tm=128,n=256\t1\tsm_90a\t") + autotune_device_signature() +
                                    "\t" + WEFT_VERSION_STRING + "\t0123456789abcdef\ta\t0.1\n";
        write_file_atomically(other.path() / "autotune.txt", planted.data(), planted.size());
        Autotuner elsewhere(config_in(other.path()), fake.measure_for(0));
        EXPECT_FALSE(elsewhere.cached_decision(key()).has_value()) << "a decision of other kernels' code was taken";
    }
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

// The code fingerprint follows the options as compiles read them, in one process too: a decision tuned untraced is not
// the decision of the traced kernels made after WEFT_TRACE is set.
TEST(JitAutotune, TheCodeFingerprintFollowsWeftTraceWithinAProcess) {
    const std::string before = Compiler::code_fingerprint();
    {
        const weft::testing::ScopedEnv trace("WEFT_TRACE", "trace.json");
        EXPECT_NE(Compiler::code_fingerprint(), before) << "the traced kernels' decisions would be the untraced ones'";
    }
    EXPECT_EQ(Compiler::code_fingerprint(), before);
}

TEST(JitAutotune, StoringADecisionKeepsTheOtherDecisionsOfEveryVersion) {
    TempDir dir("weft_tune_prune");
    FakeTimes fake;
    fake.table = {{{0, "a"}, 3.0}, {{0, "b"}, 1.5}};
    const std::string device = autotune_device_signature();
    const std::string planted = std::string("# header\n") + "v1\tgemm\tm=1\t1\tsm_90a\t0.0.0-old\ta\t0.1\n" +
                                "v2\tgemm\tm=2\t1\tsm_90a\t" + device + "\t" + WEFT_VERSION_STRING + "\ta\t0.1\n" +
                                "v3\tgemm\tm=4\t1\tsm_90a\t" + device + "\t" + WEFT_VERSION_STRING + "\t" +
                                Compiler::code_fingerprint() + "\ta\t0.1\n";
    write_file_atomically(dir.path() / "autotune.txt", planted.data(), planted.size());
    Autotuner tuner(config_in(dir.path()), fake.measure_for(0));
    EXPECT_EQ(tuner.tune(key(), candidates({"a", "b"})).name, "b");
    const std::string after = read_text_file(dir.path() / "autotune.txt");
    // Another version sharing the folder, in the format it wrote.
    EXPECT_NE(after.find("v1\tgemm\tm=1\t1\tsm_90a\t0.0.0-old\ta\t0.1\n"), std::string::npos) << after;
    EXPECT_NE(after.find("v2\tgemm\tm=2\t1\tsm_90a\t" + device + "\t" + WEFT_VERSION_STRING + "\ta\t"),
              std::string::npos)
        << after;
    EXPECT_NE(after.find("v3\tgemm\tm=4\t1\tsm_90a\t" + device + "\t" + WEFT_VERSION_STRING + "\t" +
                         Compiler::code_fingerprint() + "\ta\t"),
              std::string::npos)
        << after;
    EXPECT_NE(after.find("gemm\tm=128,n=256\t1\tsm_90a\t"), std::string::npos) << after;
    EXPECT_EQ(after.find("# header"), std::string::npos) << "comments are written anew";
    // A candidate name with the file's separators would write a line no reader parses (or two): refused.
    try {
        tuner.tune(key("m=3"), candidates({"a", "b\tc"}));
        FAIL() << "a tab in a candidate's name";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("tabs or newlines"), std::string::npos) << e.what();
    }
}

TEST(JitAutotune, UntrustedDecisionFilesAreIgnored) {
    // A decision file the kernel cache would not trust is never read: each case plants a file naming
    // candidate "a" (the slowest), and the tuner must measure instead of taking it.
    FakeTimes fake;
    fake.table = {{{0, "a"}, 3.0}, {{0, "b"}, 1.5}};
    const std::string planted = std::string("v3\tgemm\tm=128,n=256\t1\tsm_90a\t") + autotune_device_signature() + "\t" +
                                WEFT_VERSION_STRING + "\t" + Compiler::code_fingerprint() + "\ta\t0.1\n";
    auto expect_ignored = [&](const fs::path& dir, const char* what) {
        Autotuner tuner(config_in(dir), fake.measure_for(0));
        const auto started = std::chrono::steady_clock::now();
        EXPECT_FALSE(tuner.cached_decision(key()).has_value()) << what;
        EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::milliseconds(1000)) << what;  // not blocked
        EXPECT_EQ(tuner.tune(key(), candidates({"a", "b"})).name, "b") << what;
    };
    {
        TempDir dir("weft_tune_link");
        write_file_atomically(dir / "elsewhere.txt", planted.data(), planted.size());
        fs::create_symlink(dir / "elsewhere.txt", dir / "autotune.txt");
        expect_ignored(dir.path(), "symbolic link");
    }
    {
        TempDir dir("weft_tune_writable");
        write_file_atomically(dir / "autotune.txt", planted.data(), planted.size());
        fs::permissions(dir / "autotune.txt", fs::perms::all);
        expect_ignored(dir.path(), "file writable by others");
    }
    {
        TempDir dir("weft_tune_fifo");
        ASSERT_EQ(::mkfifo((dir / "autotune.txt").c_str(), 0644), 0);
        expect_ignored(dir.path(), "FIFO");
    }
    {
        TempDir dir("weft_tune_open_dir");
        fs::create_directories(dir / "open");
        write_file_atomically(dir / "open" / "autotune.txt", planted.data(), planted.size());
        fs::permissions(dir / "open", fs::perms::all);  // 0777 without the sticky bit
        expect_ignored(dir / "open", "folder writable by others");
    }
    {
        // The same file, trusted, is taken (the cases above fail for the reason they name).
        TempDir dir("weft_tune_trusted");
        write_file_atomically(dir / "autotune.txt", planted.data(), planted.size());
        Autotuner tuner(config_in(dir.path()), fake.measure_for(0));
        EXPECT_EQ(tuner.cached_decision(key()), std::optional<std::string>("a"));
    }
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
                                      const std::vector<std::optional<fs::path>>& dirs, std::vector<std::string>* errors,
                                      const std::vector<AutotuneConfig>& configs = {}) {
    weft::testing::ThreadTuneComm comm(n);
    std::vector<std::unique_ptr<TuneComm>> comms;
    for (int r = 0; r < n; ++r) comms.push_back(comm.for_rank(r));
    std::vector<TuneResult> results(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    errors->assign(static_cast<size_t>(n), "");
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
            AutotuneConfig config = configs.empty() ? AutotuneConfig{} : configs[static_cast<size_t>(r)];
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

TEST(JitAutotune, ForcedChoiceMustAgree) {
    FakeTimes fake;
    fake.table = {{{0, "x"}, 1.0}, {{1, "x"}, 1.0}, {{2, "x"}, 1.0}, {{0, "y"}, 2.0}, {{1, "y"}, 2.0}, {{2, "y"}, 2.0}};
    const auto list = candidates({"x", "y"});
    std::vector<std::string> errors;
    AutotuneConfig forced;
    forced.forced = {{"ag_gemm", "y"}};
    AutotuneConfig off;
    off.enabled = false;
    // Rank 1 alone forces "y": every rank fails, naming both settings, and nothing is timed.
    tune_on_ranks(3, fake, {list, list, list}, {std::nullopt, std::nullopt, std::nullopt}, &errors,
                  {AutotuneConfig{}, forced, AutotuneConfig{}});
    for (const auto& e : errors) {
        EXPECT_NE(e.find("ranks disagree on how to choose: rank 0 tunes, rank 1 forces 'y'"), std::string::npos) << e;
    }
    EXPECT_EQ(fake.calls, 0);
    // One rank with autotuning off, the others forcing: an error too.
    tune_on_ranks(2, fake, {list, list}, {std::nullopt, std::nullopt}, &errors, {forced, off});
    for (const auto& e : errors) EXPECT_NE(e.find("WEFT_AUTOTUNE=0"), std::string::npos) << e;
    // Every rank forcing the same candidate: agreed, nothing timed.
    const auto results = tune_on_ranks(2, fake, {list, list}, {std::nullopt, std::nullopt}, &errors, {forced, forced});
    EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
    for (const auto& r : results) {
        EXPECT_EQ(r.name, "y");
        EXPECT_EQ(r.origin, TuneResult::Origin::kForced);
    }
    EXPECT_EQ(fake.calls, 0);
}

// ---- Candidates of fused cross-rank ops (prepare, collective_runs) ----

// Ranks as threads with a barrier and an all-gather that give up after `timeout` (a rank that left the
// session must not hang the test): a generation-counted rendezvous under one mutex.
class TimedThreadComm {
public:
    TimedThreadComm(int n, std::chrono::milliseconds timeout)
        : n_(n), timeout_(timeout), values_(static_cast<size_t>(n)) {}
    std::unique_ptr<TuneComm> for_rank(int rank) {
        return std::make_unique<FunctionTuneComm>(
            rank, n_, [this] { rendezvous(); },
            [this, rank](double v) {
                std::vector<double> all;
                rendezvous([&] { values_[static_cast<size_t>(rank)] = v; });
                {
                    std::lock_guard<std::mutex> lock(mutex_);
                    all = values_;
                }
                rendezvous();  // nobody overwrites a value before everyone has read it
                return all;
            });
    }

private:
    void rendezvous(const std::function<void()>& before = {}) {
        std::unique_lock<std::mutex> lock(mutex_);
        if (before) before();
        const uint64_t gen = generation_;
        if (++arrived_ == n_) {
            arrived_ = 0;
            ++generation_;
            cv_.notify_all();
            return;
        }
        if (!cv_.wait_for(lock, timeout_, [&] { return generation_ != gen; })) {
            throw Error("fake comm: a rank did not arrive within " + std::to_string(timeout_.count()) + " ms");
        }
    }
    int n_;
    std::chrono::milliseconds timeout_;
    std::mutex mutex_;
    std::condition_variable cv_;
    int arrived_ = 0;
    uint64_t generation_ = 0;
    std::vector<double> values_;
};

// What the fake runs saw, shared by every rank.
struct RunLog {
    std::mutex mutex;
    std::map<std::string, int> runs;      // candidate -> runs launched, all ranks
    std::map<std::string, int> prepares;  // candidate -> prepare calls, all ranks
    std::map<std::pair<std::string, int>, int> finished;  // (candidate, run index) -> ranks done with it
    std::vector<std::string> violations;  // runs that started before every rank had finished the previous one
    std::atomic<int> syncs{0};
};

// A measure shaped like measure_with_cuda_events: rotate_inputs, then the run, `runs` times; rank 0's runs
// are slow, so without lockstep the other ranks would start run i before rank 0 finished run i - 1.
TuneMeasure lockstep_checking_measure(int rank, int num_ranks, int runs, RunLog& log) {
    return [rank, num_ranks, runs, &log](const TuneCandidate& c, const TuneOptions& o) {
        for (int i = 0; i < runs; ++i) {
            if (o.rotate_inputs) o.rotate_inputs(i);
            {
                std::lock_guard<std::mutex> lock(log.mutex);
                if (i > 0 && log.finished[{c.name, i - 1}] != num_ranks) {
                    log.violations.push_back(c.name + " run " + std::to_string(i) + " on rank " + std::to_string(rank));
                }
                ++log.runs[c.name];
            }
            c.run(o.stream);
            if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(3));
            std::lock_guard<std::mutex> lock(log.mutex);
            ++log.finished[{c.name, i}];
        }
        return c.name == "fast" ? 1.0 : 2.0;
    };
}

// Runs tune() with collective runs on `n` rank threads over a TimedThreadComm; returns each rank's error text.
std::vector<std::string> tune_collective(int n, RunLog& log, const std::function<TuneMeasure(int)>& measure,
                                         const std::function<std::vector<TuneCandidate>(int)>& list,
                                         std::vector<TuneResult>* results) {
    TimedThreadComm comm(n, std::chrono::milliseconds(2000));
    std::vector<std::unique_ptr<TuneComm>> comms;
    for (int r = 0; r < n; ++r) comms.push_back(comm.for_rank(r));
    std::vector<std::string> errors(static_cast<size_t>(n));
    results->assign(static_cast<size_t>(n), TuneResult{});
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
            Autotuner tuner(AutotuneConfig{}, measure(r), [&log](cudaStream_t) { ++log.syncs; });
            TuneOptions o;
            o.collective_runs = true;
            try {
                (*results)[static_cast<size_t>(r)] =
                    tuner.tune(TuneKey{"gemm_rs", "m=600", 0, "sm_90a"}, list(r), comms[static_cast<size_t>(r)].get(), o);
            } catch (const Error& e) {
                errors[static_cast<size_t>(r)] = e.what();
            }
        });
    }
    for (auto& t : threads) t.join();
    return errors;
}

std::vector<TuneCandidate> logged_candidates(RunLog& log, const std::set<std::string>& failing_prepare = {}) {
    std::vector<TuneCandidate> out;
    for (const char* name : {"slow", "fast", "other"}) {
        const std::string n = name;
        out.emplace_back(n, [](cudaStream_t) {}, [n, &log, failing_prepare] {
            {
                std::lock_guard<std::mutex> lock(log.mutex);
                ++log.prepares[n];
            }
            if (failing_prepare.count(n) != 0) throw Error("no tensor map for " + n);
        });
    }
    return out;
}

TEST(JitAutotuneCollective, RunsGoInLockstepAcrossRanks) {
    for (int n : {2, 3}) {
        RunLog log;
        const int runs = 5;
        std::vector<TuneResult> results;
        const auto errors = tune_collective(
            n, log, [&](int r) { return lockstep_checking_measure(r, n, runs, log); },
            [&](int) { return logged_candidates(log); }, &results);
        for (int r = 0; r < n; ++r) {
            EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
            EXPECT_EQ(results[static_cast<size_t>(r)].name, "fast") << "rank " << r;
        }
        EXPECT_TRUE(log.violations.empty()) << n << " ranks: a run started before every rank had finished the "
                                            << "previous one, first: " << log.violations.front();
        EXPECT_EQ(log.syncs.load(), n * 3 * runs) << "the stream is synchronised before every run";
        for (const char* c : {"slow", "fast", "other"}) {
            EXPECT_EQ(log.runs[c], n * runs) << c;
            EXPECT_EQ(log.prepares[c], n) << c << ": prepared once per rank";
        }
    }
}

TEST(JitAutotuneCollective, ACandidateThatCannotBeSetUpOnOneRankIsNeverLaunched) {
    RunLog log;
    std::vector<TuneResult> results;
    const auto errors = tune_collective(
        2, log, [&](int r) { return lockstep_checking_measure(r, 2, 3, log); },
        [&](int r) { return r == 1 ? logged_candidates(log, {"fast"}) : logged_candidates(log); }, &results);
    EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
    EXPECT_EQ(log.runs.count("fast"), 0u) << "no rank may launch a candidate that some rank could not set up";
    EXPECT_EQ(log.runs["slow"], 6);
    for (const auto& r : results) {
        EXPECT_EQ(r.name, "slow");
        EXPECT_TRUE(std::isinf(r.times_ms[1]));
    }
}

TEST(JitAutotuneCollective, ARunFailureEndsTheSessionOnEveryRank) {
    // Rank 1's third run of "slow" fails: its peers may wait on the device for work it never launched, so no
    // rank goes on to another candidate; every rank throws (rank 0 when the next lockstep barrier times out).
    RunLog log;
    std::vector<TuneResult> results;
    auto measure = [&](int r) -> TuneMeasure {
        TuneMeasure inner = lockstep_checking_measure(r, 2, 5, log);
        return [r, inner](const TuneCandidate& c, const TuneOptions& o) {
            if (r != 1 || c.name != "slow") return inner(c, o);
            TuneOptions failing = o;
            failing.rotate_inputs = [o](int i) {
                if (i == 2) throw Error("launching kernel gemm_rs failed: an illegal instruction");
                if (o.rotate_inputs) o.rotate_inputs(i);
            };
            return inner(c, failing);
        };
    };
    const auto errors = tune_collective(2, log, measure, [&](int) { return logged_candidates(log); }, &results);
    ASSERT_NE(errors[1], "");
    EXPECT_NE(errors[1].find("candidate slow failed while running on rank 1"), std::string::npos) << errors[1];
    EXPECT_NE(errors[1].find("illegal instruction"), std::string::npos) << errors[1];
    EXPECT_NE(errors[0], "") << "rank 0 must not finish the session alone";
    EXPECT_EQ(log.runs.count("fast"), 0u) << "no candidate may be launched after a collective run failed";
    EXPECT_EQ(log.prepares.count("fast"), 0u);
}

TEST(JitAutotuneCollective, OneRankKeepsSkippingFailedCandidates) {
    // Without peers a failed run leaves nobody waiting: the candidate is disqualified as before.
    RunLog log;
    Autotuner tuner(AutotuneConfig{}, [](const TuneCandidate& c, const TuneOptions&) -> double {
        if (c.name == "slow") throw Error("cannot run");
        return c.name == "fast" ? 1.0 : 2.0;
    }, [&log](cudaStream_t) { ++log.syncs; });
    TuneOptions o;
    o.collective_runs = true;
    EXPECT_EQ(tuner.tune(TuneKey{"gemm_rs", "m=8", 0, "sm_90a"}, logged_candidates(log), nullptr, o).name, "fast");
    EXPECT_EQ(log.syncs.load(), 0);
}

}  // namespace
}  // namespace weft::jit
