// SPDX-License-Identifier: MIT
// Rank threads with a bounded end: how run_local starts one thread per rank and waits for them.
#pragma once

#include <chrono>
#include <functional>
#include <vector>

namespace weft::detail {

/// What each rank's thread runs, in order. Every function is called on the rank's own thread, must not
/// throw, and may run after run_rank_threads has returned (for a rank that was abandoned): it must own, or
/// share ownership of, everything it touches.
struct RankThreadBody {
    /// The rank's work (in run_local: the World's construction and the user's fn). Returns false when it
    /// failed: from then on the other ranks have `grace` to return too.
    std::function<bool(int rank)> work;
    /// Runs once every rank's work has returned (in run_local: the World's destruction, which must wait
    /// for every rank because ranks of one process use each other's heaps directly).
    std::function<void(int rank)> finish;
    /// Runs instead of `finish` on the ranks that returned when the wait is abandoned: some rank did not
    /// return in time, so it may still use what this rank owns, which must therefore not be released
    /// (run_local leaks the rank's World).
    std::function<void(int rank)> abandon;
};

struct RankThreadsOutcome {
    std::vector<int> not_returned;  ///< ranks whose work had not returned when the wait was abandoned
    std::vector<int> not_finished;  ///< ranks whose finish or abandon had not returned by then
    int first_failed = -1;          ///< the first rank whose work returned false, or -1
};

/// Runs `body` on one thread per rank in [0, num_ranks) and waits for them. While every rank's work
/// succeeds the wait has no bound (a rank's work may legitimately run for hours). Once a rank's work has
/// failed, every thread must be done within `grace`; otherwise the wait is abandoned: ranks waiting to
/// finish run `abandon` instead (given up to `grace` more to return), and the threads still running are
/// detached and named in the outcome. C++ cannot stop a thread: a detached one keeps running, and the
/// process should end soon after (its exit may then find that thread still inside CUDA).
RankThreadsOutcome run_rank_threads(int num_ranks, const RankThreadBody& body, std::chrono::milliseconds grace);

}  // namespace weft::detail
