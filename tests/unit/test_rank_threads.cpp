// SPDX-License-Identifier: MIT
// Unit tests for the rank threads behind run_local: the wait for the ranks ends within a bound once one fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "weft/detail/rank_threads.hpp"
#include "weft/runtime/error.hpp"

namespace weft::detail {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

/// What the ranks did, shared with them (an abandoned rank outlives the call).
struct Record {
    std::mutex mutex;
    std::vector<int> finished, abandoned;
    std::atomic<bool> release{false};
};

RankThreadBody body_of(const std::shared_ptr<Record>& record, std::function<bool(int)> work) {
    RankThreadBody body;
    body.work = std::move(work);
    body.finish = [record](int r) {
        std::lock_guard<std::mutex> lock(record->mutex);
        record->finished.push_back(r);
    };
    body.abandon = [record](int r) {
        std::lock_guard<std::mutex> lock(record->mutex);
        record->abandoned.push_back(r);
    };
    return body;
}

TEST(RunLocalJoin, EveryRankFinishesAfterAllReturned) {
    auto record = std::make_shared<Record>();
    std::atomic<int> returned{0};
    auto body = body_of(record, [&](int r) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20 * r));
        ++returned;
        return true;
    });
    // finish runs only once every rank's work returned: check it from inside.
    body.finish = [record, &returned](int r) {
        EXPECT_EQ(returned.load(), 4);
        std::lock_guard<std::mutex> lock(record->mutex);
        record->finished.push_back(r);
    };
    RankThreadsOutcome out = run_rank_threads(4, body, 100ms);
    EXPECT_EQ(out.first_failed, -1);
    EXPECT_TRUE(out.not_returned.empty() && out.not_finished.empty());
    EXPECT_EQ(record->finished.size(), 4u);
    EXPECT_TRUE(record->abandoned.empty());
}

TEST(RunLocalJoin, NoBoundWhileNoRankFailed) {
    // A slow rank is not abandoned when nothing failed, however long it takes beyond the grace.
    auto record = std::make_shared<Record>();
    auto body = body_of(record, [](int r) {
        if (r == 1) std::this_thread::sleep_for(400ms);
        return true;
    });
    RankThreadsOutcome out = run_rank_threads(3, body, 50ms);
    EXPECT_TRUE(out.not_returned.empty());
    EXPECT_EQ(record->finished.size(), 3u);
}

TEST(RunLocalJoin, ARankThatDoesNotReturnAfterAFailureIsNamedWithinTheBound) {
    auto record = std::make_shared<Record>();
    auto body = body_of(record, [record](int r) {
        if (r == 0) return false;  // fails at once
        if (r == 2) {
            // Stuck (until the test lets it go, 30 s at most).
            for (auto end = Clock::now() + 30s; Clock::now() < end && !record->release.load();) {
                std::this_thread::sleep_for(5ms);
            }
        }
        return true;
    });
    const auto start = Clock::now();
    RankThreadsOutcome out = run_rank_threads(3, body, 300ms);
    const auto took = Clock::now() - start;
    EXPECT_GE(took, 290ms);
    EXPECT_LT(took, 5s);
    EXPECT_EQ(out.first_failed, 0);
    EXPECT_EQ(out.not_returned, std::vector<int>{2});
    EXPECT_TRUE(out.not_finished.empty());
    {
        std::lock_guard<std::mutex> lock(record->mutex);
        // Ranks 0 and 1 returned: they gave up their wait for rank 2 and released nothing.
        std::vector<int> abandoned = record->abandoned;
        std::sort(abandoned.begin(), abandoned.end());
        EXPECT_EQ(abandoned, (std::vector<int>{0, 1}));
        EXPECT_TRUE(record->finished.empty());
    }
    // The detached rank resumes later and still finds its state: it abandons too.
    record->release = true;
    for (auto end = Clock::now() + 10s; Clock::now() < end;) {
        {
            std::lock_guard<std::mutex> lock(record->mutex);
            if (record->abandoned.size() == 3) break;
        }
        std::this_thread::sleep_for(5ms);
    }
    std::lock_guard<std::mutex> lock(record->mutex);
    EXPECT_EQ(record->abandoned.size(), 3u);
}

TEST(RunLocalJoin, FailedRanksAloneEndPromptly) {
    auto record = std::make_shared<Record>();
    auto body = body_of(record, [](int r) { return r != 1; });
    const auto start = Clock::now();
    RankThreadsOutcome out = run_rank_threads(4, body, 60s);
    EXPECT_LT(Clock::now() - start, 5s);  // everyone returned: no waiting out the grace
    EXPECT_EQ(out.first_failed, 1);
    EXPECT_TRUE(out.not_returned.empty());
    EXPECT_EQ(record->finished.size(), 4u);
    EXPECT_THROW(run_rank_threads(0, body, 1s), Error);
}

}  // namespace
}  // namespace weft::detail
