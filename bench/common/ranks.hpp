// SPDX-License-Identifier: MIT
// A benchmark's World (threads of this process, or this process as one rank of a launched job) and timing on every
// rank of it at once: the slowest rank's figure counts.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/cli.hpp"
#include "common/timing.hpp"
#include "weft/runtime/launch_env.hpp"
#include "weft/runtime/world.hpp"

namespace weft::bench {

/// Where a benchmark's ranks live. Under a launcher (weftrun, torchrun, mpirun, srun) that started more than one
/// process, this process is one rank of the launched world (World::from_env); otherwise every rank is a thread of
/// this process, over the visible GPUs round-robin (run_local). detect() reads the environment only (no CUDA call).
struct RankLauncher {
    std::optional<LaunchEnv> env;  ///< set when launched with more than one process

    static RankLauncher detect() {
        RankLauncher l;
        std::optional<LaunchEnv> e = detect_launch_env();
        if (e && e->num_ranks > 1) l.env = std::move(e);
        return l;
    }
    bool launched() const { return env.has_value(); }
    /// Whether this process prints tables and writes JSON: the process of the threads, or rank 0 of a launched job.
    bool printer() const { return !env || env->rank == 0; }
    /// The world sizes to run: `requested` (or `defaults` when it is empty) with threads; under a launcher the
    /// launched world alone, which a non-empty `requested` must then be (UsageError naming --world otherwise).
    std::vector<int> worlds(const std::vector<int>& requested, const std::vector<int>& defaults) const {
        if (!env) return requested.empty() ? defaults : requested;
        if (!requested.empty() && (requested.size() != 1 || requested[0] != env->num_ranks)) {
            throw UsageError("--world: " + env->launcher + " started " + std::to_string(env->num_ranks) +
                             " processes, one rank each: leave --world out or pass --world " +
                             std::to_string(env->num_ranks));
        }
        return {env->num_ranks};
    }
    /// Runs `body` on every rank of a world of `num_ranks`: run_local's threads, or this process's rank of the
    /// launched World (whose size must be `num_ranks`).
    void run(int num_ranks, const std::function<void(World&)>& body, const WorldOptions& options) const {
        if (!env) {
            run_local(num_ranks, body, options);
            return;
        }
        std::unique_ptr<World> w = World::from_env(options);
        WEFT_CHECK(w->num_ranks() == num_ranks, "launched with " << w->num_ranks() << " ranks, expected " << num_ranks);
        body(*w);
    }
};

/// The largest of the ranks' values: every rank calls max() with its own (collective over the World's team, through
/// its store: the ranks may be threads of one process or processes of their own).
class SlowestRank {
public:
    explicit SlowestRank(int num_ranks) : num_ranks_(num_ranks) {}
    double max(World& w, double v) {
        std::vector<uint8_t> mine(sizeof(double));
        std::memcpy(mine.data(), &v, sizeof(double));
        const auto all = w.team().all_gather("bench.slowest", mine);
        double worst = -std::numeric_limits<double>::infinity();
        for (const auto& b : all) {
            double x = 0;
            if (b.size() == sizeof(double)) std::memcpy(&x, b.data(), sizeof(double));
            worst = std::max(worst, x);
        }
        return worst;
    }
    int num_ranks() const { return num_ranks_; }

private:
    int num_ranks_;
};

/// time_batch_ms on every rank at once (collective): `warmup` untimed calls, every rank's stream drained and a
/// host barrier, then events around `iters` back-to-back calls; returns the slowest rank's milliseconds per call.
/// A device timeout becomes its diagnosis (World::sync_and_check).
template <class Fn>
double time_batch_on_ranks_ms(World& w, SlowestRank& slowest, cudaStream_t s, int warmup, int iters, Fn&& fn) {
    for (int i = 0; i < warmup; ++i) fn(i);
    w.sync_and_check(s);
    w.barrier();
    const double ms = time_batch_ms(
        s, 0, iters, [&](int i) { fn(warmup + i); }, [&] { w.sync_and_check(s); });
    return slowest.max(w, ms);
}

/// time_rounds_ms on every rank at once (collective), the functions alternating call by call after `warmup`
/// untimed rounds and a host barrier; returns each function's mean milliseconds per call, the slowest rank's.
template <class... Fns>
std::array<double, sizeof...(Fns)> time_rounds_on_ranks_mean_ms(World& w, SlowestRank& slowest, cudaStream_t s,
                                                                int warmup, int iters, Fns&&... fns) {
    for (int i = 0; i < warmup; ++i) (fns(i), ...);
    w.sync_and_check(s);
    w.barrier();
    const auto samples = time_rounds_ms_sync(
        s, [&] { w.sync_and_check(s); }, 0, iters, [&](int i) { fns(warmup + i); }...);
    std::array<double, sizeof...(Fns)> out{};
    for (size_t f = 0; f < out.size(); ++f) out[f] = slowest.max(w, mean(samples[f]));
    return out;
}

}  // namespace weft::bench
