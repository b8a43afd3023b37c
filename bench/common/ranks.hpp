// SPDX-License-Identifier: MIT
// Timing on every rank of a World at once (ranks are threads of one process): the slowest rank's figure counts.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "common/timing.hpp"
#include "weft/runtime/world.hpp"

namespace weft::bench {

/// The largest of the ranks' values: every rank calls max() with its own (collective: two host barriers).
/// One object per World, shared by its rank threads.
class SlowestRank {
public:
    explicit SlowestRank(int num_ranks) : values_(static_cast<size_t>(num_ranks)) {}
    double max(World& w, double v) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            values_[static_cast<size_t>(w.rank())] = v;
        }
        w.barrier();
        double worst = -std::numeric_limits<double>::infinity();
        {
            std::lock_guard<std::mutex> lock(mutex_);
            for (double x : values_) worst = std::max(worst, x);
        }
        w.barrier();  // nobody overwrites a value before every rank has read them all
        return worst;
    }

private:
    std::mutex mutex_;
    std::vector<double> values_;
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
