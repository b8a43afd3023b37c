// SPDX-License-Identifier: MIT
// Timing on every rank of a World at once: the slowest rank's figure counts.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "common/timing.hpp"
#include "weft/runtime/world.hpp"

namespace weft::bench {

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
