// SPDX-License-Identifier: MIT
// Unit tests for the in-process store, Store's default barrier and all-gather (ranks as threads), prefix views, and
// the embedding's wait check (set_wait_interrupt_check).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../../src/runtime/runtime_internal.hpp"
#include "support/error_text.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/in_process_store.hpp"
#include "weft/runtime/rendezvous.hpp"

namespace weft {
namespace {

using namespace std::chrono_literals;
using testing::error_of;

Bytes text_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }

// Runs fn(rank) on num_ranks threads; returns each rank's error message ("" when it succeeded).
std::vector<std::string> on_threads(int num_ranks, const std::function<void(int)>& fn) {
    std::vector<std::string> errors(static_cast<size_t>(num_ranks));
    std::vector<std::thread> threads;
    for (int r = 0; r < num_ranks; ++r) {
        threads.emplace_back([&, r] {
            try {
                fn(r);
            } catch (const std::exception& e) {
                errors[static_cast<size_t>(r)] = e.what();
            }
        });
    }
    for (auto& t : threads) t.join();
    return errors;
}

TEST(RuntimeInProcessStore, SetGetCheckEraseAdd) {
    InProcessStore store;
    EXPECT_FALSE(store.check("k"));
    store.set("k", text_bytes("v1"));
    EXPECT_TRUE(store.check("k"));
    EXPECT_EQ(store.get("k", 10ms), text_bytes("v1"));
    store.set("k", text_bytes("v2"));
    EXPECT_EQ(store.get("k", 10ms), text_bytes("v2"));
    store.erase("k");
    store.erase("k");  // absent: no error
    EXPECT_FALSE(store.check("k"));
    EXPECT_EQ(store.add("c", 5), 5);
    EXPECT_EQ(store.add("c", -2), 3);
    store.set("not-a-number", text_bytes("x"));
    EXPECT_THROW(store.add("not-a-number", 1), Error);
}

TEST(RuntimeInProcessStore, GetWaitsForALaterSet) {
    InProcessStore store;
    std::thread setter([&] {
        std::this_thread::sleep_for(30ms);
        store.set("late", text_bytes("here"));
    });
    EXPECT_EQ(store.get("late", 5000ms), text_bytes("here"));
    setter.join();
}

TEST(RuntimeInProcessStore, GetTimeoutNamesTheKey) {
    InProcessStore store;
    const auto start = std::chrono::steady_clock::now();
    try {
        store.get("weft/missing/key", 50ms);
        FAIL() << "get did not time out";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("'weft/missing/key' was not set within 50 ms"), std::string::npos)
            << e.what();
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    EXPECT_GE(waited, 50ms);
    EXPECT_LT(waited, 5000ms);
}

TEST(RuntimeInProcessStore, AbortWakesBlockedCallers) {
    InProcessStore store;
    std::thread aborter([&] {
        std::this_thread::sleep_for(30ms);
        store.abort("rank 3 failed: boom");
    });
    try {
        store.get("never", 60000ms);
        FAIL() << "get did not fail";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("rank 3 failed: boom"), std::string::npos) << e.what();
    }
    aborter.join();
    EXPECT_THROW(store.set("x", {}), Error);
}

TEST(RuntimeStoreBarrier, AllRanksPassAndKeysAreCleanedUp) {
    for (int n : {1, 2, 3, 5, 8}) {
        InProcessStore store;
        std::atomic<int> arrived{0};
        std::atomic<bool> early{false};
        auto errors = on_threads(n, [&](int r) {
            for (int round = 0; round < 20; ++round) {
                arrived.fetch_add(1);
                store.barrier("b/" + std::to_string(round), r, n, 10000ms);
                // Nobody leaves barrier `round` before everyone has arrived at it.
                if (arrived.load() < (round + 1) * n) early = true;
            }
        });
        for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "n=" << n << " rank " << r;
        EXPECT_FALSE(early.load()) << "n=" << n;
        EXPECT_EQ(store.num_keys(), 0u) << "n=" << n;
    }
}

TEST(RuntimeStoreBarrier, MissingRanksAreNamed) {
    InProcessStore store;
    const int n = 5;
    // Ranks 1 and 3 never arrive: the others give up at the 100 ms timeout, not much later.
    const auto started = std::chrono::steady_clock::now();
    auto errors = on_threads(n, [&](int r) {
        if (r == 1 || r == 3) return;
        store.barrier("lonely", r, n, 100ms);
    });
    const auto elapsed = std::chrono::steady_clock::now() - started;
    EXPECT_LT(elapsed, 2s) << "the barrier's timeout bounds the wait";
    for (int r : {0, 2, 4}) {
        const std::string& e = errors[static_cast<size_t>(r)];
        EXPECT_NE(e.find("barrier 'lonely' failed on rank " + std::to_string(r)), std::string::npos) << e;
        EXPECT_NE(e.find("3 of 5 ranks arrived; ranks 1, 3 did not arrive"), std::string::npos) << e;
    }
}

// A World's start: ranks given another number of ranks than rank 0 (a stale WORLD_SIZE) fail at once, naming both
// numbers; ranks that agree pass, and rank 0 finds the key to erase.
TEST(RuntimeWorldStart, RanksThatDisagreeOnTheWorldSizeFailNamingBoth) {
    InProcessStore store;
    const auto started = std::chrono::steady_clock::now();
    auto errors = on_threads(4, [&](int r) { detail::agree_on_world_size(store, r, r == 2 ? 3 : 4, 5s); });
    EXPECT_LT(std::chrono::steady_clock::now() - started, 2s) << "no rank waits out the timeout";
    for (int r : {0, 1, 3}) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    EXPECT_NE(errors[2].find("rank 2 was started in a World of 3 ranks, rank 0 in one of 4"), std::string::npos)
        << errors[2];
    EXPECT_NE(errors[2].find("WORLD_SIZE"), std::string::npos) << errors[2];
    EXPECT_TRUE(store.check({detail::kWorldSizeKey}));
    // Rank 0 and the ranks that agree with it, whose start-up exchange waits for rank 2 in vain, read its note.
    const std::string note = detail::world_size_disagreement(store, 4);
    EXPECT_NE(note.find("rank 2 was started in a World of 3 ranks, rank 0 in one of 4"), std::string::npos) << note;
    InProcessStore agreeing;
    on_threads(2, [&](int r) { detail::agree_on_world_size(agreeing, r, 2, 5s); });
    EXPECT_EQ(detail::world_size_disagreement(agreeing, 2), "") << "no rank disagreed";
}

// Rank 0 never comes: the others fail within the timeout, saying whom they waited for.
TEST(RuntimeWorldStart, ANonZeroRankWithoutRankZeroFailsWithinTheTimeout) {
    InProcessStore store;
    const auto started = std::chrono::steady_clock::now();
    const std::string e = [&] {
        try {
            detail::agree_on_world_size(store, 1, 2, 100ms);
        } catch (const Error& err) {
            return std::string(err.what());
        }
        return std::string();
    }();
    EXPECT_LT(std::chrono::steady_clock::now() - started, 2s);
    EXPECT_NE(e.find("rank 1 did not meet rank 0 at the World's start within 100 ms"), std::string::npos) << e;
}

TEST(RuntimeStoreBarrier, RejectsBadRanks) {
    InProcessStore store;
    EXPECT_THROW(store.barrier("x", 2, 2, 10ms), Error);
    EXPECT_THROW(store.barrier("x", -1, 2, 10ms), Error);
    EXPECT_THROW(store.barrier("x", 0, 0, 10ms), Error);
}

TEST(RuntimeStoreAllGather, ReturnsBlobsInRankOrder) {
    for (int n : {1, 2, 3, 7}) {
        InProcessStore store;
        std::vector<std::vector<Bytes>> results(static_cast<size_t>(n));
        auto errors = on_threads(n, [&](int r) {
            // Different sizes per rank, including an empty blob.
            Bytes blob(static_cast<size_t>(r * 3), static_cast<uint8_t>(r + 1));
            results[static_cast<size_t>(r)] = store.all_gather("g", r, n, blob, 10000ms);
        });
        for (int r = 0; r < n; ++r) {
            ASSERT_EQ(errors[static_cast<size_t>(r)], "");
            ASSERT_EQ(results[static_cast<size_t>(r)].size(), static_cast<size_t>(n));
            for (int s = 0; s < n; ++s) {
                EXPECT_EQ(results[static_cast<size_t>(r)][static_cast<size_t>(s)],
                          Bytes(static_cast<size_t>(s * 3), static_cast<uint8_t>(s + 1)))
                    << "rank " << r << " slot " << s;
            }
        }
        EXPECT_EQ(store.num_keys(), 0u);
    }
}

TEST(RuntimeStoreAllGather, MissingRankIsNamed) {
    InProcessStore store;
    auto errors = on_threads(3, [&](int r) {
        if (r == 2) return;
        store.all_gather("partial", r, 3, Bytes{1}, 100ms);
    });
    EXPECT_NE(errors[0].find("2 of 3 ranks arrived; rank 2 did not arrive"), std::string::npos) << errors[0];
    EXPECT_NE(errors[1].find("rank 2 did not arrive"), std::string::npos) << errors[1];
}

/// An InProcessStore whose waits fail while its keys stay readable: at once, as a World's store view does once the
/// World is aborted (`late` false), or after their whole timeout, as if the key came just too late (`late` true).
class FailingWaitsStore final : public Store {
public:
    explicit FailingWaitsStore(bool late) : late_(late) {}
    void set(const std::string& key, const Bytes& value) override { inner_.set(key, value); }
    Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
        if (!late_) throw std::runtime_error("stopped waiting for " + key + ": the World was aborted");
        std::this_thread::sleep_for(timeout);
        throw std::runtime_error("timed out waiting for " + key);
    }
    int64_t add(const std::string& key, int64_t delta) override { return inner_.add(key, delta); }
    bool check(const std::string& key) override { return inner_.check(key); }
    void erase(const std::string& key) override { inner_.erase(key); }

private:
    bool late_;
    InProcessStore inner_;
};

/// The errors of an all_gather and a barrier of 2 ranks on rank 0 whose peer (rank 1) has arrived, while every wait
/// of the store fails (FailingWaitsStore).
std::vector<std::string> errors_with_every_rank_arrived(bool late, std::chrono::milliseconds timeout) {
    FailingWaitsStore store(late);
    store.set("g/1", Bytes{7});
    store.set("b/rank/1", Bytes{1});
    std::vector<std::string> errors;
    for (int barrier = 0; barrier < 2; ++barrier) {
        errors.emplace_back();
        try {
            if (barrier) {
                store.barrier("b", 0, 2, timeout);
            } else {
                store.all_gather("g", 0, 2, Bytes{1}, timeout);
            }
        } catch (const Error& error) {
            errors.back() = error.what();
        }
    }
    return errors;
}

// A wait that timed out while the last rank arrived just after it is reported as such (not as an early end).
TEST(RuntimeStoreAllGather, AWaitThatRanItsCourseIsALateArrival) {
    for (const std::string& e : errors_with_every_rank_arrived(true, 60ms)) {
        EXPECT_NE(e.find("every rank arrived just after the deadline"), std::string::npos) << e;
    }
}

// A wait that the store ends early while every rank has in fact arrived is not reported as a late arrival.
TEST(RuntimeStoreAllGather, AWaitTheStoreEndsEarlyIsNotCalledALateArrival) {
    for (const std::string& e : errors_with_every_rank_arrived(false, 10000ms)) {
        EXPECT_NE(e.find("every rank has arrived by now; the store ended the wait before the deadline"),
                  std::string::npos)
            << e;
        EXPECT_EQ(e.find("just after the deadline"), std::string::npos) << e;
        EXPECT_NE(e.find("the World was aborted"), std::string::npos) << e;
    }
}

/// A store of the user's own, written against the contract in store.hpp only (what a torch.distributed store
/// adapter provides): a map under a mutex, no barrier or all_gather of its own, and a get that throws a
/// plain std::runtime_error.
class UserStore final : public Store {
public:
    void set(const std::string& key, const Bytes& value) override {
        std::lock_guard<std::mutex> lock(mutex_);
        values_[key] = value;
        changed_.notify_all();
    }
    Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
        std::unique_lock<std::mutex> lock(mutex_);
        if (!changed_.wait_for(lock, timeout, [&] { return values_.count(key) != 0; })) {
            throw std::runtime_error("user store: timed out waiting for " + key);
        }
        return values_.at(key);
    }
    int64_t add(const std::string& key, int64_t delta) override {
        std::lock_guard<std::mutex> lock(mutex_);
        int64_t v = counters_[key] += delta;
        values_[key] = text_bytes(std::to_string(v));
        changed_.notify_all();
        return v;
    }
    bool check(const std::string& key) override {
        std::lock_guard<std::mutex> lock(mutex_);
        return values_.count(key) != 0;
    }
    void erase(const std::string& key) override {
        std::lock_guard<std::mutex> lock(mutex_);
        values_.erase(key);
        counters_.erase(key);
    }
    std::vector<std::string> keys() {
        std::lock_guard<std::mutex> lock(mutex_);
        std::vector<std::string> out;
        for (const auto& kv : values_) out.push_back(kv.first);
        return out;
    }

private:
    std::mutex mutex_;
    std::condition_variable changed_;
    std::map<std::string, Bytes> values_;
    std::map<std::string, int64_t> counters_;
};

TEST(RuntimePrefixStore, KeysLandUnderThePrefix) {
    auto inner = std::make_shared<InProcessStore>();
    auto view = make_prefix_store(inner, "torch/job7");
    view->set("k", text_bytes("v"));
    EXPECT_TRUE(inner->check("torch/job7/k"));
    EXPECT_FALSE(inner->check("k"));
    EXPECT_TRUE(view->check("k"));
    EXPECT_EQ(view->get("k", 10ms), text_bytes("v"));
    EXPECT_EQ(view->add("n", 3), 3);
    EXPECT_EQ(inner->add("torch/job7/n", 1), 4);  // one counter, seen through either name
    view->erase("k");
    EXPECT_FALSE(inner->check("torch/job7/k"));
    // The inner store's own keys are invisible through the view.
    inner->set("k", text_bytes("outside"));
    EXPECT_FALSE(view->check("k"));
    // A view of a view nests the prefixes.
    auto nested = make_prefix_store(view, "world");
    nested->set("x", {});
    EXPECT_TRUE(inner->check("torch/job7/world/x"));
    // A timeout names the whole key, so the error shows which World's key was missing.
    try {
        view->get("weft/init/2", 20ms);
        FAIL() << "get did not time out";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("'torch/job7/weft/init/2'"), std::string::npos) << e.what();
    }
}

TEST(RuntimePrefixStore, ViewsOfOneUserStoreDoNotCollide) {
    // Two Worlds' worth of ranks (3 and 2) on one user store, with the same barrier and all-gather names at
    // the same time: each group meets only its own ranks, and nothing is left behind.
    auto user = std::make_shared<UserStore>();
    auto a = make_prefix_store(user, "a");
    auto b = make_prefix_store(user, "b");
    std::vector<std::vector<Bytes>> gathered(5);
    auto errors = on_threads(5, [&](int t) {
        const bool in_a = t < 3;
        Store& view = in_a ? *a : *b;
        const int rank = in_a ? t : t - 3;
        const int n = in_a ? 3 : 2;
        std::string mine(in_a ? "a" : "b");
        mine.append(std::to_string(rank));
        for (int round = 0; round < 10; ++round) {
            view.barrier("weft/barrier/" + std::to_string(round), rank, n, 10000ms);
            gathered[static_cast<size_t>(t)] = view.all_gather("weft/init", rank, n, text_bytes(mine), 10000ms);
        }
    });
    for (int t = 0; t < 5; ++t) EXPECT_EQ(errors[static_cast<size_t>(t)], "") << "thread " << t;
    for (int t = 0; t < 3; ++t) {
        EXPECT_EQ(gathered[static_cast<size_t>(t)],
                  (std::vector<Bytes>{text_bytes("a0"), text_bytes("a1"), text_bytes("a2")}));
    }
    for (int t = 3; t < 5; ++t) {
        EXPECT_EQ(gathered[static_cast<size_t>(t)], (std::vector<Bytes>{text_bytes("b0"), text_bytes("b1")}));
    }
    EXPECT_TRUE(user->keys().empty()) << user->keys().size() << " keys left, e.g. " << user->keys().front();
}

TEST(RuntimePrefixStore, BarrierThroughAUserStoreNamesTheMissingRank) {
    // The user store's own exception text is carried into the barrier's error.
    auto view = make_prefix_store(std::make_shared<UserStore>(), "p");
    auto errors = on_threads(3, [&](int r) {
        if (r == 1) return;
        view->barrier("late", r, 3, 100ms);
    });
    for (int r : {0, 2}) {
        const std::string& e = errors[static_cast<size_t>(r)];
        EXPECT_NE(e.find("barrier 'late' failed on rank " + std::to_string(r)), std::string::npos) << e;
        EXPECT_NE(e.find("rank 1 did not arrive"), std::string::npos) << e;
        EXPECT_NE(e.find("user store: timed out waiting for p/late/done"), std::string::npos) << e;
    }
}

TEST(RuntimePrefixStore, BadArgumentsAreNamed) {
    auto store = std::make_shared<InProcessStore>();
    EXPECT_NE(error_of([] { make_prefix_store(nullptr, "p"); }).find("store is null"), std::string::npos);
    EXPECT_NE(error_of([&] { make_prefix_store(store, ""); }).find("prefix must not be empty"), std::string::npos);
    EXPECT_NE(error_of([&] { make_prefix_store(store, "a b"); }).find("'a b'"), std::string::npos);
}


// ---- the embedding's wait check (weft::set_wait_interrupt_check) ----

/// An InProcessStore that records the timeout of every get.
class RecordingStore final : public Store {
public:
    void set(const std::string& key, const Bytes& value) override { inner_.set(key, value); }
    Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            gets_.push_back(timeout);
        }
        return inner_.get(key, timeout);
    }
    int64_t add(const std::string& key, int64_t delta) override { return inner_.add(key, delta); }
    bool check(const std::string& key) override { return inner_.check(key); }
    void erase(const std::string& key) override { inner_.erase(key); }
    std::vector<std::chrono::milliseconds> gets() {
        std::lock_guard<std::mutex> lock(mutex_);
        return gets_;
    }

private:
    InProcessStore inner_;
    std::mutex mutex_;
    std::vector<std::chrono::milliseconds> gets_;
};

// A check that answers "the test stopped it" from its kChecksBeforeStop-th call on.
constexpr int kChecksBeforeStop = 3;
std::atomic<int> checks_made{0};
std::optional<std::string> stop_after_some_checks() noexcept {
    if (++checks_made < kChecksBeforeStop) return std::nullopt;
    return "the test stopped it";
}

/// Sets stop_after_some_checks for a test's duration; null again after it (the check is process-wide).
class ScopedCheck {
public:
    ScopedCheck() {
        checks_made = 0;
        set_wait_interrupt_check(&stop_after_some_checks);
    }
    ~ScopedCheck() { set_wait_interrupt_check(nullptr); }
    ScopedCheck(const ScopedCheck&) = delete;
    ScopedCheck& operator=(const ScopedCheck&) = delete;
};

// No check set (a C++ program): the start-up store of a World not yet made is the store itself, and its waits are
// the store's own, one get with the whole timeout and the store's own timeout message.
TEST(RuntimeWaitInterruptCheck, WithoutACheckTheStoreIsLeftAsItIs) {
    ASSERT_FALSE(detail::wait_interrupt_check_set());
    EXPECT_EQ(wait_interrupted(), std::nullopt);
    auto store = std::make_shared<RecordingStore>();
    const std::shared_ptr<Store> view = detail::make_abortable_store(store, nullptr);
    EXPECT_EQ(view.get(), store.get());
    const std::string e = error_of([&] { view->get("missing", 300ms); });
    EXPECT_NE(e.find("'missing' was not set within 300 ms"), std::string::npos) << e;
    EXPECT_EQ(store->gets(), std::vector<std::chrono::milliseconds>{300ms});
}

// With a check set, a wait asks it only once a slice (250 ms) ran out without the key, and its answer ends the wait.
TEST(RuntimeWaitInterruptCheck, ACheckIsAskedAfterEachSliceThatRanOutAndItsReasonEndsTheWait) {
    ScopedCheck check;
    ASSERT_TRUE(detail::wait_interrupt_check_set());
    auto store = std::make_shared<RecordingStore>();
    // Stacked as a World's own view is on from_store's start-up view: the inner view passes the outer's slices through.
    const std::shared_ptr<Store> view =
        detail::make_abortable_store(make_prefix_store(detail::make_abortable_store(store, nullptr), "p"), nullptr);
    store->set("p/here", text_bytes("v"));
    EXPECT_EQ(view->get("here", 60000ms), text_bytes("v"));
    EXPECT_EQ(checks_made, 0) << "a get answered at once never asks the check";

    const auto start = std::chrono::steady_clock::now();
    const std::string e = error_of([&] { view->get("missing", 60000ms); });
    const auto waited = std::chrono::steady_clock::now() - start;
    EXPECT_NE(e.find("store get('missing') stopped after "), std::string::npos) << e;
    EXPECT_NE(e.find(" ms: the test stopped it"), std::string::npos) << e;
    EXPECT_EQ(checks_made, kChecksBeforeStop) << "once per slice that ran out, and only by the outer view";
    EXPECT_GE(waited, kChecksBeforeStop * 250ms - 50ms);
    EXPECT_LT(waited, 10s);
    const std::vector<std::chrono::milliseconds> gets = store->gets();
    ASSERT_EQ(gets.size(), 1u + kChecksBeforeStop) << "the present key's get, then one get per slice";
    for (size_t i = 1; i < gets.size(); ++i) EXPECT_LE(gets[i], 250ms) << "get " << i;
}

// The connection to rank 0's store asks the check between its attempts, and stops naming the reason.
TEST(RuntimeWaitInterruptCheck, ACheckEndsTheConnectionRetriesToRankZerosStore) {
    ScopedCheck check;
    RendezvousOptions o;
    o.unix_socket = "weft-unit-interrupt-" + std::to_string(::getpid());  // nobody listens there
    o.rank = 1;
    o.num_ranks = 2;
    o.timeout = 60000ms;
    const auto start = std::chrono::steady_clock::now();
    const std::string e = error_of([&] { connect_tcp_store(o); });
    EXPECT_NE(e.find("rendezvous: connecting to the store at @" + o.unix_socket + " stopped: the test stopped it"),
              std::string::npos)
        << e;
    EXPECT_EQ(checks_made, kChecksBeforeStop);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

// A store that accepted the connection but does not answer HELLO (rank 0 stopped in a debugger): the wait for its
// reply asks the check too.
TEST(RuntimeWaitInterruptCheck, ACheckEndsTheWaitForAnAnswerToHello) {
    const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(listener, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(addr);
    ASSERT_EQ(::bind(listener, reinterpret_cast<const sockaddr*>(&addr), length), 0);
    ASSERT_EQ(::listen(listener, 4), 0);  // never accepts: the kernel completes the connection, nobody answers
    ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &length), 0);
    ScopedCheck check;
    RendezvousOptions o;
    o.host = "127.0.0.1";
    o.port = ntohs(addr.sin_port);
    o.rank = 1;
    o.num_ranks = 2;
    o.timeout = 60000ms;
    const auto start = std::chrono::steady_clock::now();
    const std::string e = error_of([&] { connect_tcp_store(o); });
    ::close(listener);
    EXPECT_NE(e.find("rendezvous: connecting to the store at 127.0.0.1:" + std::to_string(o.port) +
                     " stopped: the test stopped it"),
              std::string::npos)
        << e;
    EXPECT_EQ(checks_made, kChecksBeforeStop);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

}  // namespace
}  // namespace weft
