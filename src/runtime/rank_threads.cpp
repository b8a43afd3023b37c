// SPDX-License-Identifier: MIT
// Rank threads with a bounded end (see weft/detail/rank_threads.hpp).
#include "weft/detail/rank_threads.hpp"

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "weft/runtime/error.hpp"

namespace weft::detail {

namespace {

enum class Phase { kWorking, kWaiting, kFinishing, kExited };

/// Shared by the caller and every rank thread; a detached thread keeps it alive.
struct State {
    std::mutex mutex;
    std::condition_variable changed;
    RankThreadBody body;
    std::vector<Phase> phases;
    int num_returned = 0;
    int first_failed = -1;
    std::chrono::steady_clock::time_point first_failure;
    bool abandoned = false;

    int count(Phase p) const {
        int n = 0;
        for (Phase q : phases) n += q == p ? 1 : 0;
        return n;
    }
};

void rank_thread(const std::shared_ptr<State>& state, int rank) {
    bool ok = false;
    try {
        ok = state->body.work(rank);
    } catch (...) {
        ok = false;  // the contract says it does not throw; a failure all the same
    }
    bool abandon = false;
    {
        std::unique_lock<std::mutex> lock(state->mutex);
        state->phases[static_cast<size_t>(rank)] = Phase::kWaiting;
        ++state->num_returned;
        if (!ok && state->first_failed < 0) {
            state->first_failed = rank;
            state->first_failure = std::chrono::steady_clock::now();
        }
        state->changed.notify_all();
        const int num_ranks = static_cast<int>(state->phases.size());
        state->changed.wait(lock, [&] { return state->num_returned == num_ranks || state->abandoned; });
        abandon = state->abandoned;
        state->phases[static_cast<size_t>(rank)] = Phase::kFinishing;
    }
    try {
        if (abandon) {
            state->body.abandon(rank);
        } else {
            state->body.finish(rank);
        }
    } catch (...) {
    }
    std::lock_guard<std::mutex> lock(state->mutex);
    state->phases[static_cast<size_t>(rank)] = Phase::kExited;
    state->changed.notify_all();
}

}  // namespace

RankThreadsOutcome run_rank_threads(int num_ranks, const RankThreadBody& body, std::chrono::milliseconds grace) {
    WEFT_CHECK(num_ranks >= 1, "run_rank_threads: num_ranks must be at least 1, got " << num_ranks);
    WEFT_CHECK(body.work && body.finish && body.abandon, "run_rank_threads: every part of the body must be set");
    auto state = std::make_shared<State>();
    state->body = body;
    state->phases.assign(static_cast<size_t>(num_ranks), Phase::kWorking);
    std::vector<std::thread> threads;
    threads.reserve(static_cast<size_t>(num_ranks));
    for (int r = 0; r < num_ranks; ++r) threads.emplace_back([state, r] { rank_thread(state, r); });

    RankThreadsOutcome outcome;
    {
        std::unique_lock<std::mutex> lock(state->mutex);
        auto all_exited = [&] { return state->count(Phase::kExited) == num_ranks; };
        while (!all_exited()) {
            if (state->first_failed < 0) {
                state->changed.wait(lock);
                continue;
            }
            if (state->changed.wait_until(lock, state->first_failure + grace, all_exited)) break;
            // Abandoned: ranks waiting for the stuck ones run `abandon` and exit; give them `grace` to.
            std::vector<int> waiting;
            for (int r = 0; r < num_ranks; ++r) {
                if (state->phases[static_cast<size_t>(r)] == Phase::kWaiting) waiting.push_back(r);
            }
            state->abandoned = true;
            state->changed.notify_all();
            state->changed.wait_for(lock, grace, [&] {
                for (int r : waiting) {
                    if (state->phases[static_cast<size_t>(r)] != Phase::kExited) return false;
                }
                return true;
            });
            for (int r = 0; r < num_ranks; ++r) {
                const Phase p = state->phases[static_cast<size_t>(r)];
                if (p == Phase::kWorking) outcome.not_returned.push_back(r);
                if (p == Phase::kWaiting || p == Phase::kFinishing) outcome.not_finished.push_back(r);
            }
            break;
        }
        outcome.first_failed = state->first_failed;
    }
    for (int r = 0; r < num_ranks; ++r) {
        std::unique_lock<std::mutex> lock(state->mutex);
        const bool exited = state->phases[static_cast<size_t>(r)] == Phase::kExited;
        lock.unlock();
        if (exited) {
            threads[static_cast<size_t>(r)].join();  // past its last use of the lock: returns at once
        } else {
            threads[static_cast<size_t>(r)].detach();  // keeps `state` (and what its body owns) alive
        }
    }
    return outcome;
}

}  // namespace weft::detail
