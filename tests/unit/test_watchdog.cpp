// SPDX-License-Identifier: MIT
// Unit tests (CPU) of the World's watchdog: its settings, which peers a rank watches, heartbeat bookkeeping and its
// reasons, process liveness on this host, and the watchdog thread itself over an in-process store (two ranks'
// World state without a GPU): a peer that stops beating, or whose process exits, aborts the World within the bound
// with a reason naming it; an abort published by one rank reaches the other, also while this rank's watchdog hangs
// in a store call; the World's store waits stop.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <regex>
#include <thread>

#include "../../src/runtime/runtime_internal.hpp"
#include "support/error_text.hpp"
#include "support/freezing_proxy.hpp"
#include "weft/detail/runtime_placement.hpp"
#include "weft/detail/watchdog.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/in_process_store.hpp"
#include "weft/runtime/rendezvous.hpp"

namespace weft {
namespace {

using namespace std::chrono_literals;
using detail::HeartbeatBook;
using Clock = std::chrono::steady_clock;

using testing::error_of;

TEST(WatchdogSettings, OptionThenEnvironmentThenDefault) {
    EXPECT_EQ(detail::resolve_heartbeat(0ms, std::nullopt), 1000ms);
    EXPECT_EQ(detail::resolve_heartbeat(0ms, std::string("250")), 250ms);
    EXPECT_EQ(detail::resolve_heartbeat(40ms, std::string("250")), 40ms);
    EXPECT_NE(error_of([] { detail::resolve_heartbeat(0ms, std::string("0")); }).find("WEFT_HEARTBEAT_MS"),
              std::string::npos);
    EXPECT_NE(error_of([] { detail::resolve_heartbeat(-1ms, std::nullopt); }).find("WorldOptions::heartbeat"),
              std::string::npos);
    EXPECT_EQ(detail::resolve_dead_peer(0ms, std::nullopt, 1000ms), 10000ms);
    EXPECT_EQ(detail::resolve_dead_peer(0ms, std::string("3000"), 1000ms), 3000ms);
    EXPECT_EQ(detail::resolve_dead_peer(500ms, std::string("3000"), 1000ms), 2000ms) << "at least two heartbeats";
    EXPECT_NE(error_of([] { detail::resolve_dead_peer(0ms, std::string("x"), 1000ms); }).find("WEFT_DEAD_PEER_MS"),
              std::string::npos);
}

TEST(WatchdogPeers, EveryRankIsWatchedByAsManyOthers) {
    EXPECT_TRUE(detail::watched_peers(0, 1).empty());
    EXPECT_EQ(detail::watched_peers(0, 2), (std::vector<int>{1}));
    EXPECT_EQ(detail::watched_peers(1, 2), (std::vector<int>{0}));
    EXPECT_EQ(detail::watched_peers(3, 5), (std::vector<int>{4, 0}));
    for (int n : {3, 4, 7, 64}) {
        std::vector<int> watchers(static_cast<size_t>(n), 0);
        for (int r = 0; r < n; ++r) {
            for (int p : detail::watched_peers(r, n)) {
                EXPECT_NE(p, r);
                ++watchers[static_cast<size_t>(p)];
            }
        }
        for (int r = 0; r < n; ++r) EXPECT_EQ(watchers[static_cast<size_t>(r)], detail::kWatchedPeers) << r;
    }
    EXPECT_NE(error_of([] { detail::watched_peers(2, 2); }), "");
}

TEST(WatchdogBook, APeerIsDeadOnceItsBeatStandsStillPastTheBound) {
    const auto t0 = Clock::now();
    HeartbeatBook book({2, 5}, 3000ms, t0);
    EXPECT_EQ(book.first_dead(t0 + 2999ms), std::nullopt) << "alive from the start";
    book.observe(2, 1, t0 + 1000ms);
    book.observe(5, 1, t0 + 1000ms);
    book.observe(2, 2, t0 + 2000ms);
    book.observe(5, 1, t0 + 2000ms);  // the same beat again: no news
    EXPECT_EQ(book.first_dead(t0 + 4000ms), std::nullopt);
    EXPECT_EQ(book.first_dead(t0 + 4001ms), std::optional<int>(5));
    book.observe(5, 2, t0 + 4500ms);  // beats again: alive
    EXPECT_EQ(book.first_dead(t0 + 5000ms), std::nullopt);
    EXPECT_EQ(book.first_dead(t0 + 5001ms), std::optional<int>(2));
    const std::string why = book.reason(2, t0 + 5001ms, "host h, pid 7");
    EXPECT_NE(why.find("rank 2 is gone"), std::string::npos) << why;
    EXPECT_NE(why.find("3001 ms"), std::string::npos) << why;
    EXPECT_NE(why.find("WEFT_DEAD_PEER_MS"), std::string::npos) << why;
    EXPECT_NE(why.find("host h, pid 7"), std::string::npos) << why;
    book.observe(9, 1, t0);  // not watched: ignored
    EXPECT_EQ(book.peers(), (std::vector<int>{2, 5}));
}

TEST(WatchdogBook, TheWatchersOwnStallIsNoPeersSilence) {
    const auto t0 = Clock::now();
    HeartbeatBook book({1, 2}, 10000ms, t0);
    book.observe(1, 1, t0 + 1000ms);
    book.observe(2, 1, t0 + 1000ms);
    // The watcher stalled 15 s (its store's host frozen): on its next look no counter has moved.
    book.excuse(15000ms, t0 + 16500ms);
    EXPECT_EQ(book.first_dead(t0 + 16500ms), std::nullopt);
    // A peer that stays silent afterwards is dead once the bound passes again.
    book.observe(1, 2, t0 + 20000ms);
    EXPECT_EQ(book.first_dead(t0 + 26001ms), std::optional<int>(2));
    // The excuse never moves a renewal past the present.
    HeartbeatBook fresh({4}, 10000ms, t0);
    fresh.excuse(60000ms, t0 + 1000ms);
    EXPECT_EQ(fresh.first_dead(t0 + 11001ms), std::optional<int>(4));
}

TEST(WatchdogBook, AGoneProcessIsDeadAtOnceAndSaysSo) {
    const auto t0 = Clock::now();
    HeartbeatBook book({1, 3}, 10000ms, t0);
    book.mark_gone(3, "its process 4242 on this host has exited");
    EXPECT_EQ(book.first_dead(t0), std::optional<int>(3));
    const std::string why = book.reason(3, t0, "");
    EXPECT_NE(why.find("rank 3 is gone: its process 4242 on this host has exited"), std::string::npos) << why;
}

TEST(WatchdogBook, AbortRecordsRoundTrip) {
    EXPECT_EQ(detail::decode_abort_record(detail::encode_abort_record('D', "rank 3 is gone")),
              (std::pair<char, std::string>{'D', "rank 3 is gone"}));
    EXPECT_EQ(detail::decode_abort_record(detail::encode_abort_record('A', "")),
              (std::pair<char, std::string>{'A', ""}));
    EXPECT_EQ(detail::decode_abort_record("xyz"), (std::pair<char, std::string>{'A', "xyz"}));
    EXPECT_EQ(detail::decode_abort_record(""), (std::pair<char, std::string>{'A', ""}));
}

TEST(WatchdogProcesses, AKilledChildIsGoneBeforeAndAfterItIsReaped) {
    EXPECT_TRUE(detail::process_running(::getpid()));
    EXPECT_FALSE(detail::process_running(0));
    EXPECT_FALSE(detail::process_running(-5));
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        ::pause();
        std::_Exit(0);
    }
    EXPECT_TRUE(detail::process_running(child));
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    // Until waitpid, the child is a zombie: it has exited all the same.
    const auto deadline = Clock::now() + 5s;
    while (detail::process_running(child) && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
    EXPECT_FALSE(detail::process_running(child)) << "a zombie counts as gone";
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_FALSE(detail::process_running(child));
}

// Two ranks' World state without a GPU: what the watchdog reads (ranks, pids, timings) and the abort word, which
// here lives in ordinary memory (released before the context is destroyed: it is not pinned).
struct FakeWorld {
    detail::WorldContext c;
    uint32_t word = 0;
    FakeWorld(int rank, int num_ranks, std::vector<detail::RankInfo> ranks, std::chrono::milliseconds heartbeat,
              std::chrono::milliseconds dead_peer) {
        c.rank = rank;
        c.num_ranks = num_ranks;
        c.same_process = false;
        c.ranks = std::move(ranks);
        c.heartbeat = heartbeat;
        c.dead_peer = dead_peer;
        c.abort_host.reset(&word);
    }
    ~FakeWorld() {
        if (c.watchdog) c.watchdog->stop(false);
        (void)c.abort_host.release();
    }
};

std::vector<detail::RankInfo> ranks_on(const std::vector<std::string>& hosts, const std::vector<int64_t>& pids) {
    std::vector<detail::RankInfo> ranks;
    for (size_t r = 0; r < hosts.size(); ++r) {
        detail::RankInfo info;
        info.host = hosts[r];
        info.pid = pids[r];
        info.pid_namespace = detail::this_process_record().pid_namespace;  // every rank in this one
        ranks.push_back(info);
    }
    return ranks;
}

bool wait_until(const std::function<bool()>& done, std::chrono::milliseconds bound) {
    const auto deadline = Clock::now() + bound;
    while (!done()) {
        if (Clock::now() > deadline) return false;
        std::this_thread::sleep_for(5ms);
    }
    return true;
}

TEST(WatchdogThread, APeerThatStopsBeatingAbortsTheWorldNamingIt) {
    auto store = std::make_shared<InProcessStore>();
    // Two hosts: only the heartbeat tells (no process check).
    const auto ranks = ranks_on({"host-a", "host-b"}, {111, 222});
    FakeWorld w0(0, 2, ranks, 50ms, 400ms);
    FakeWorld w1(1, 2, ranks, 50ms, 400ms);
    w0.c.watchdog = std::make_unique<detail::Watchdog>(&w0.c, store);
    w1.c.watchdog = std::make_unique<detail::Watchdog>(&w1.c, store);
    std::this_thread::sleep_for(1000ms);  // alive peers beat: no abort for 2.5 bounds
    EXPECT_EQ(w0.word, 0u) << w0.c.abort_text();
    EXPECT_EQ(w1.word, 0u) << w1.c.abort_text();
    const auto silenced = Clock::now();
    w1.c.watchdog->stop(false);  // rank 1 stops beating (and removes its key), as a dead process would
    ASSERT_TRUE(wait_until([&] { return w0.word != 0; }, 3000ms)) << "rank 0 never noticed";
    const auto after = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - silenced);
    EXPECT_LT(after.count(), 2000) << "noticed within the bound and a few beats";
    EXPECT_EQ(w0.word, uint32_t{kAbortByHost});
    const std::string why = w0.c.abort_text();
    // Not declared dead before the bound: the silence the watchdog saw (from the last beat it saw change, which on
    // a loaded machine may come well before `silenced`) is at least the bound.
    std::smatch stood;
    ASSERT_TRUE(std::regex_search(why, stood, std::regex("stood still for ([0-9]+) ms"))) << why;
    EXPECT_GE(std::stol(stood[1].str()), 400) << why;
    EXPECT_NE(why.find("rank 1 is gone"), std::string::npos) << why;
    EXPECT_NE(why.find("host host-b, pid 222"), std::string::npos) << why;
    EXPECT_TRUE(w0.c.dead_peer_known);
    // The World's store waits stop now, naming the reason, even during shutdown (a dead peer).
    auto view = detail::make_abortable_store(store, &w0.c);
    w0.c.shutting_down = true;
    const auto start = Clock::now();
    const std::string e = error_of([&] { view->get("never/set", 60000ms); });
    EXPECT_LT(Clock::now() - start, 2s);
    EXPECT_NE(e.find("rank 1 is gone"), std::string::npos) << e;
    EXPECT_NE(e.find("never/set"), std::string::npos) << e;
}

TEST(WatchdogThread, APeerProcessOfThisHostThatExitsIsNoticedAtTheNextBeat) {
    auto store = std::make_shared<InProcessStore>();
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        ::pause();
        std::_Exit(0);
    }
    const auto ranks = ranks_on({"host-a", "host-a"}, {::getpid(), child});
    FakeWorld w0(0, 2, ranks, 50ms, 60000ms);  // the heartbeat bound alone would take a minute
    w0.c.watchdog = std::make_unique<detail::Watchdog>(&w0.c, store);
    std::this_thread::sleep_for(300ms);
    EXPECT_EQ(w0.word, 0u) << w0.c.abort_text();
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    EXPECT_TRUE(wait_until([&] { return w0.word != 0; }, 3000ms));
    const std::string why = w0.c.abort_text();
    EXPECT_NE(why.find("rank 1 is gone: its process " + std::to_string(child) + " on this host has exited"),
              std::string::npos)
        << why;
    int status = 0;
    ::waitpid(child, &status, 0);
}

// A peer of this host in another pid namespace (a container sharing the host's name and network): its pid means
// nothing here, so a pid that no process of this namespace has does not make it gone (its heartbeats decide).
TEST(WatchdogThread, APeerOfAnotherPidNamespaceIsNotWatchedByPid) {
    if (detail::this_process_record().pid_namespace.empty()) GTEST_SKIP() << "SKIPPED: /proc cannot say the namespace";
    auto store = std::make_shared<InProcessStore>();
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) std::_Exit(0);
    int status = 0;
    ::waitpid(child, &status, 0);  // `child` now names no process here
    auto ranks = ranks_on({"host-a", "host-a"}, {::getpid(), child});
    ranks[1].pid_namespace = "pid:[1]";
    FakeWorld w0(0, 2, ranks, 50ms, 60000ms);
    w0.c.watchdog = std::make_unique<detail::Watchdog>(&w0.c, store);
    std::this_thread::sleep_for(500ms);  // ten beats
    EXPECT_EQ(w0.word, 0u) << w0.c.abort_text();
}

TEST(WatchdogThread, AnAbortReachesEveryRankAndClearingAllowsTheNextOne) {
    auto store = std::make_shared<InProcessStore>();
    const auto ranks = ranks_on({"host-a", "host-b", "host-c"}, {1, 2, 3});
    FakeWorld w0(0, 3, ranks, 30ms, 60000ms);
    FakeWorld w1(1, 3, ranks, 30ms, 60000ms);
    FakeWorld w2(2, 3, ranks, 30ms, 60000ms);
    for (FakeWorld* w : {&w0, &w1, &w2}) w->c.watchdog = std::make_unique<detail::Watchdog>(&w->c, store);
    // A device wait on rank 2 gives up: its word reads kAbortByDeviceWait; its watchdog tells the others.
    __atomic_store_n(&w2.word, uint32_t{kAbortByDeviceWait}, __ATOMIC_SEQ_CST);
    ASSERT_TRUE(wait_until([&] { return w0.word != 0 && w1.word != 0; }, 3000ms));
    for (FakeWorld* w : {&w0, &w1}) {
        const std::string why = w->c.abort_text();
        EXPECT_NE(why.find("rank 2: a device wait gave up"), std::string::npos) << why;
        EXPECT_FALSE(w->c.dead_peer_known) << "a device timeout is not a dead peer";
    }
    // The World's store waits stop on an aborted World, but not during shutdown (its live peers still meet).
    auto view = detail::make_abortable_store(store, &w1.c);
    EXPECT_NE(error_of([&] { view->get("never/set", 60000ms); }).find("a device wait gave up"), std::string::npos);
    w1.c.shutting_down = true;
    store->set("late/key", Bytes{7});
    EXPECT_EQ(view->get("late/key", 1000ms), Bytes{7});
    store->erase("late/key");
    w1.c.shutting_down = false;
    // Every rank clears; a later abort (the user's, on rank 0) is the one every rank reports.
    for (FakeWorld* w : {&w0, &w1, &w2}) {
        w->c.abort_reason.clear();
        w->c.device_abort_published = false;
        __atomic_store_n(&w->word, 0u, __ATOMIC_SEQ_CST);
    }
    std::this_thread::sleep_for(200ms);
    EXPECT_EQ(w1.word, 0u) << "an old record was applied again: " << w1.c.abort_text();
    w0.c.raise_abort("rank 0 called World::abort: checkpoint failed", false);
    ASSERT_TRUE(w0.c.watchdog->publish('A', "rank 0 called World::abort: checkpoint failed"));
    ASSERT_TRUE(wait_until([&] { return w1.word != 0 && w2.word != 0; }, 3000ms));
    EXPECT_NE(w2.c.abort_text().find("checkpoint failed"), std::string::npos) << w2.c.abort_text();
    // Stopping removes every key the watchdogs wrote.
    for (FakeWorld* w : {&w1, &w2, &w0}) w->c.watchdog->stop(w == &w0);
    EXPECT_EQ(store->num_keys(), 0u);
}

TEST(WatchdogThread, ARecordKeptPastStopIsReadNowByAPeer) {
    auto store = std::make_shared<InProcessStore>();
    const auto ranks = ranks_on({"host-a", "host-b"}, {1, 2});
    // Beats a minute apart: only read_records_now() reads the records during this test.
    FakeWorld w0(0, 2, ranks, 60000ms, 120000ms);
    FakeWorld w1(1, 2, ranks, 60000ms, 120000ms);
    w0.c.watchdog = std::make_unique<detail::Watchdog>(&w0.c, store);
    w1.c.watchdog = std::make_unique<detail::Watchdog>(&w1.c, store);
    // A record not kept goes with its rank: a peer reading after the stop finds nothing.
    ASSERT_TRUE(w1.c.watchdog->publish('A', "rank 1: a passing remark"));
    // A leaving rank's record stays after it stops.
    ASSERT_TRUE(w1.c.watchdog->publish('A', "rank 1 left the World before the other ranks met it", /*keep=*/true));
    w1.c.watchdog->stop(false);
    EXPECT_FALSE(w1.c.watchdog->publish('A', "after the stop")) << "a stopped watchdog publishes nothing";
    EXPECT_EQ(w0.word, 0u);
    w0.c.watchdog->read_records_now();
    EXPECT_EQ(w0.word, uint32_t{kAbortByHost});
    const std::string why = w0.c.abort_text();
    EXPECT_NE(why.find("rank 1 left the World"), std::string::npos) << why;
    EXPECT_EQ(why.find("passing remark"), std::string::npos) << "a record that was not kept was read: " << why;
    // The kept record is all that stays once both have stopped.
    w0.c.watchdog->stop(true);
    EXPECT_EQ(store->num_keys(), 1u);
    w0.c.watchdog->read_records_now();  // stopped: does nothing, throws nothing
}

TEST(WatchdogThread, ALostStoreAbortsTheWorld) {
    auto store = std::make_shared<InProcessStore>();
    const auto ranks = ranks_on({"host-a", "host-b"}, {1, 2});
    FakeWorld w0(0, 2, ranks, 30ms, 60000ms);
    w0.c.watchdog = std::make_unique<detail::Watchdog>(&w0.c, store);
    store->abort("the store's host went away");
    ASSERT_TRUE(wait_until([&] { return w0.word != 0; }, 3000ms));
    EXPECT_NE(w0.c.abort_text().find("lost the World's store"), std::string::npos) << w0.c.abort_text();
    EXPECT_NE(w0.c.abort_text().find("the store's host went away"), std::string::npos) << w0.c.abort_text();
}

// A peer's key that check() finds and that is gone by the get (its watchdog stopped in between, at a World's
// shutdown): the watchdog skips it and goes on beating; it neither stalls for long nor takes it for a lost store.
class VanishingKeyStore final : public Store {
public:
    std::shared_ptr<InProcessStore> inner = std::make_shared<InProcessStore>();
    std::atomic<int> vanished{0};

    void set(const std::string& key, const Bytes& value) override { inner->set(key, value); }
    Bytes get(const std::string& key, std::chrono::milliseconds timeout) override { return inner->get(key, timeout); }
    int64_t add(const std::string& key, int64_t delta) override { return inner->add(key, delta); }
    bool check(const std::string& key) override {
        // Rank 1's beat: found by every other check, never there (removed between the check and the get).
        if (key.find("/beat/1") != std::string::npos) return vanished.fetch_add(1) % 2 == 0;
        return inner->check(key);
    }
    void erase(const std::string& key) override { inner->erase(key); }
};

TEST(WatchdogThread, APeersKeyRemovedBetweenCheckAndGetIsSkipped) {
    auto store = std::make_shared<VanishingKeyStore>();
    const auto ranks = ranks_on({"host-a", "host-b"}, {1, 2});
    FakeWorld w0(0, 2, ranks, 30ms, 60000ms);
    w0.c.watchdog = std::make_unique<detail::Watchdog>(&w0.c, store);
    const auto beats = [&] {
        const Bytes b = store->inner->get("weft/watchdog/beat/0", 0ms);
        return std::stoll(std::string(b.begin(), b.end()));
    };
    ASSERT_TRUE(wait_until([&] { return store->vanished >= 2; }, 3000ms)) << "the watchdog never looked for rank 1";
    const int64_t before = beats();
    std::this_thread::sleep_for(1500ms);
    EXPECT_GE(beats() - before, 5) << "the watchdog stalled on the vanished key";
    EXPECT_EQ(w0.word, 0u) << w0.c.abort_text();
}

// The network to the store's host goes silent (the host froze: no FIN, no RST). The watchdog's client has the
// World's reply bound (World::from_env sets the dead-peer bound), so its next call fails at that bound and the World
// aborts naming the lost store; an abort published meanwhile on the same connection is not held up for longer.
TEST(WatchdogThread, AStoreHostThatFreezesAbortsTheWorldAtTheReplyBound) {
    RendezvousOptions o;
    o.token = "watchdog-test";
    o.timeout = 20000ms;
    TcpStoreServer server(o);
    testing::FreezingProxy proxy(server.port());
    o.port = proxy.port();
    o.num_ranks = 2;
    o.rank = 1;
    o.reply_timeout = 400ms;
    std::shared_ptr<Store> store = connect_tcp_store(o);
    const auto ranks = ranks_on({"host-a", "host-b"}, {1, 2});
    FakeWorld w1(1, 2, ranks, 30ms, 60000ms);
    w1.c.watchdog = std::make_unique<detail::Watchdog>(&w1.c, store);
    std::this_thread::sleep_for(100ms);
    ASSERT_EQ(w1.word, 0u);
    proxy.freeze();
    const auto start = Clock::now();
    EXPECT_FALSE(w1.c.watchdog->publish('A', "rank 1 called World::abort")) << "the store is gone";
    EXPECT_LT(Clock::now() - start, 1500ms) << "the publish waited for more than the reply bound twice";
    ASSERT_TRUE(wait_until([&] { return w1.word != 0; }, 3000ms)) << "the watchdog never gave up on the store";
    EXPECT_LT(Clock::now() - start, 3000ms);
    EXPECT_NE(w1.c.abort_text().find("lost the World's store"), std::string::npos) << w1.c.abort_text();
    EXPECT_NE(w1.c.abort_text().find("reply timed out"), std::string::npos) << w1.c.abort_text();
}

// A store whose check() of a heartbeat key stalls for `stall_for` while `stall` is set (a store call that hangs
// until its own timeout), every other call going straight to an in-process store.
class StallingStore final : public Store {
public:
    std::shared_ptr<InProcessStore> inner = std::make_shared<InProcessStore>();
    std::atomic<bool> stall{false};
    std::atomic<int> stalled_calls{0};
    std::chrono::milliseconds stall_for{3000};

    void set(const std::string& key, const Bytes& value) override { inner->set(key, value); }
    Bytes get(const std::string& key, std::chrono::milliseconds timeout) override { return inner->get(key, timeout); }
    int64_t add(const std::string& key, int64_t delta) override { return inner->add(key, delta); }
    bool check(const std::string& key) override {
        if (stall && key.find("/beat/") != std::string::npos) {
            ++stalled_calls;
            std::this_thread::sleep_for(stall_for);
        }
        return inner->check(key);
    }
    void erase(const std::string& key) override { inner->erase(key); }
};

// World::abort on another thread publishes its record while the watchdog thread sits in a store call that hangs:
// the watchdog holds no lock of its own across store I/O, so the publish does not wait for that call (a store
// client that serialises its calls, as the TCP one does, bounds the wait by its reply bound: the test above), and a
// peer reads the record.
TEST(WatchdogThread, AnAbortIsPublishedWhileTheWatchdogsStoreCallHangs) {
    auto store = std::make_shared<StallingStore>();
    const auto ranks = ranks_on({"host-a", "host-b"}, {1, 2});
    FakeWorld w0(0, 2, ranks, 20ms, 120000ms);
    FakeWorld w1(1, 2, ranks, 60000ms, 120000ms);
    w1.c.watchdog = std::make_unique<detail::Watchdog>(&w1.c, store->inner);  // beats, so w0 reads its key
    w0.c.watchdog = std::make_unique<detail::Watchdog>(&w0.c, store);
    store->stall = true;
    ASSERT_TRUE(wait_until([&] { return store->stalled_calls > 0; }, 3000ms)) << "the watchdog never read a beat";
    const auto start = Clock::now();
    EXPECT_TRUE(w0.c.watchdog->publish('A', "rank 0 called World::abort: out of memory"));
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    EXPECT_LT(took.count(), 1500) << "the publish waited for the watchdog's hung store call";
    w1.c.watchdog->read_records_now();
    EXPECT_NE(w1.c.abort_text().find("out of memory"), std::string::npos) << w1.c.abort_text();
    store->stall = false;
}

}  // namespace
}  // namespace weft
