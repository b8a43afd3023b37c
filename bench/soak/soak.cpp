// SPDX-License-Identifier: MIT
// weft_soak: thousands of mixed calls on ranks sharing one GPU, every result checked, counting wrong results, hangs
// and leaks (device memory, file descriptors). How to run it and what it prints: README.md here.
//
//   weft_soak [--world 3,5,8] [--calls 10000] [--seconds 0] [--seed S] [--delay-prob 0.02] [--max-delay-ms 50]
//             [--hang-ms 60000] [--verbose]
//
// The parts: soak_plan.hpp (which calls, drawn from the seed), soak_calls.hpp (one rank's ops, each call and its
// check against a host reference), this file (the options, the per-World run loop, the host's hang guard, the leak
// accounting and the report). Before a call each rank sleeps 0-50 ms with a small probability drawn from its own
// generator, so ranks arrive late at random.
#include <cuda_runtime_api.h>
#include <dirent.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/cli.hpp"
#include "common/report.hpp"
#include "soak_calls.hpp"
#include "soak_plan.hpp"
#include "weft/ops/ep.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/module_loading.hpp"
#include "weft/runtime/world.hpp"

namespace weft::bench::soak {
namespace {

// ------------------------------------------------------------------------------------------------
// What the process holds: free device memory and open file descriptors.

struct Usage {
    size_t free_bytes = 0;
    int fds = 0;
};

Usage usage_now() {
    Usage u;
    size_t total = 0;
    WEFT_CUDA_CHECK(cudaMemGetInfo(&u.free_bytes, &total));
    if (DIR* d = opendir("/proc/self/fd")) {
        while (const dirent* e = readdir(d)) {
            if (e->d_name[0] != '.') ++u.fds;
        }
        closedir(d);
    }
    return u;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

// ------------------------------------------------------------------------------------------------
// One World's run.

struct Options {
    std::vector<int> worlds = {3, 5, 8};
    int calls = 10000;
    int seconds = 0;  // 0: no time bound
    uint64_t seed = 0;
    double delay_prob = 0.02;
    int max_delay_ms = 50;
    int hang_ms = 60000;
    bool verbose = false;
};

struct KindStats {
    uint64_t calls = 0, wrong = 0;
    double seconds = 0;
    uint64_t min_count = ~0ull, max_count = 0;
};

struct WorldResult {
    int world = 0;
    uint64_t planned = 0, done = 0, wrong = 0, hangs = 0, errors = 0, delays = 0;
    std::array<KindStats, kKinds> kinds{};
    std::vector<std::string> first_problems;
    std::string at_first_failure;  // every rank's call and phase when the first rank's call failed
    Usage warm, end;
    bool steady_measured = false;
    double seconds = 0;
};

/// What the rank threads of one World share.
struct Shared {
    const Options* o = nullptr;
    int calls = 0;
    std::mutex mutex;
    WorldResult result;
    std::atomic<bool> failed{false};
    std::atomic<bool> keep_going{true};
    std::atomic<bool> finished{false};
    std::vector<std::atomic<int64_t>> progress_ns;  // per rank: steady-clock time of its last finished call
    std::vector<std::atomic<int64_t>> at_call;      // per rank: the call it is in
    std::vector<std::atomic<int64_t>> call_ns;      // per rank: steady-clock time it entered that call
    std::vector<std::atomic<int>> phase;            // per rank: where in that call (Phase)
    std::vector<std::atomic<int64_t>> phase_ns;     // per rank: steady-clock time it entered that phase
    std::chrono::steady_clock::time_point start;
    explicit Shared(int w)
        : progress_ns(static_cast<size_t>(w)),
          at_call(static_cast<size_t>(w)),
          call_ns(static_cast<size_t>(w)),
          phase(static_cast<size_t>(w)),
          phase_ns(static_cast<size_t>(w)) {}
    void problem(const std::string& text) {
        std::lock_guard<std::mutex> lock(mutex);
        if (result.first_problems.size() < 10) result.first_problems.push_back(text);
    }
    /// "rank 0 call 2640 (for 60.3 s) waiting for the device (for 60.2 s), rank 1 call 2639 (for 0.1 s) copying results
    /// out (for 0.0 s), ...": where every rank's thread is now, and since when. A rank that the hang's waiters name but
    /// that never failed shows where it was held up: still launching, or waiting for the device since its launches
    /// returned long ago (its work queued on the device), or only just (a launch call that returned late).
    std::string where_ranks_are() const {
        const int64_t now = steady_now_ns();
        const auto secs = [now](int64_t since) {
            char buf[32];
            std::snprintf(buf, sizeof buf, "%.1f", static_cast<double>(now - since) * 1e-9);
            return std::string(buf);
        };
        std::string s;
        for (size_t r = 0; r < phase.size(); ++r) {
            const int ph = phase[r].load();
            s += (r == 0 ? "" : ", ");
            s += "rank " + std::to_string(r) + " call " + std::to_string(at_call[r].load()) + " (for " +
                 secs(call_ns[r].load()) + " s) " +
                 (ph >= 0 && ph <= static_cast<int>(Phase::kCheck) ? kPhaseNames[ph] : "?") + " (for " +
                 secs(phase_ns[r].load()) + " s)";
        }
        return s;
    }
};

int64_t now_ns() { return steady_now_ns(); }

/// "rank 2 call 17 (all_reduce ll bf16 x 1000)": where a problem was seen.
std::string call_label(int rank, int64_t call, const Plan& p) {
    return "rank " + std::to_string(rank) + " call " + std::to_string(call) + " (" + describe(p) + ")";
}

void rank_main(World& w, Shared& sh) {
    const Options& o = *sh.o;
    const int me = w.rank();
    const int n = w.num_ranks();
    RankOps ops_here(w);
    std::atomic<int>& phase_now = sh.phase[static_cast<size_t>(me)];
    std::atomic<int64_t>& phase_ns = sh.phase_ns[static_cast<size_t>(me)];
    const auto set_phase = [&](Phase ph) {
        phase_ns = now_ns();
        phase_now = static_cast<int>(ph);
    };
    set_phase(Phase::kBetween);
    ops_here.report_phase_to(&phase_now, &phase_ns);
    std::mt19937_64 delay_rng(o.seed * 0x2545F4914F6CDD1Dull + static_cast<uint64_t>(me) + 1);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    const auto one_call = [&](int64_t call, const Plan& p, bool counted) {
        sh.call_ns[static_cast<size_t>(me)] = now_ns();
        sh.at_call[static_cast<size_t>(me)] = call;
        if (counted && unit(delay_rng) < o.delay_prob) {
            set_phase(Phase::kDelay);
            const int ms = static_cast<int>(unit(delay_rng) * o.max_delay_ms);
            std::this_thread::sleep_for(std::chrono::milliseconds(ms));
            std::lock_guard<std::mutex> lock(sh.mutex);
            ++sh.result.delays;
        }
        const auto t0 = std::chrono::steady_clock::now();
        std::string bad;
        try {
            bad = ops_here.run(p);
        } catch (const std::exception& e) {
            set_phase(Phase::kBetween);
            const std::string m = e.what();
            const bool hang = m.find("timed out") != std::string::npos;
            // An EP normal call: what this rank launched, to set against the counts its peers waited for.
            const std::string ledger = p.kind == Kind::kEpNormal ? ops_here.ep_normal_ledger() : "";
            sh.problem(call_label(me, call, p) + ": " + (hang ? "HANG: " : "ERROR: ") + m +
                       (ledger.empty() ? "" : " [" + ledger + "]"));
            std::lock_guard<std::mutex> lock(sh.mutex);
            (hang ? sh.result.hangs : sh.result.errors) += 1;
            if (!sh.failed.exchange(true)) {
                sh.result.at_first_failure =
                    "rank " + std::to_string(me) + " failed first; then " + sh.where_ranks_are();
            }
            return false;
        }
        set_phase(Phase::kBetween);
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        sh.progress_ns[static_cast<size_t>(me)] = now_ns();
        if (!bad.empty()) sh.problem(call_label(me, call, p) + ": WRONG: " + bad);
        if (counted) {
            std::lock_guard<std::mutex> lock(sh.mutex);
            KindStats& k = sh.result.kinds[static_cast<size_t>(p.kind)];
            if (me == 0) {
                ++k.calls;
                ++sh.result.done;
                k.seconds += secs;
                k.min_count = std::min(k.min_count, p.count);
                k.max_count = std::max(k.max_count, p.count);
            }
            if (!bad.empty()) {
                ++k.wrong;
                ++sh.result.wrong;
            }
        }
        if (o.verbose && me == 0 && counted) {
            std::printf("  call %lld: %s (%.2f ms)%s\n", static_cast<long long>(call), describe(p).c_str(), secs * 1e3,
                        bad.empty() ? "" : " WRONG");
        }
        return true;
    };
    // Every kind once (first calls, JIT loads and pools settle), then the steady-state snapshot.
    for (int k = 0; k < kKinds && !sh.failed; ++k) {
        if (!one_call(-1 - k, draw_plan(o.seed, ~static_cast<uint64_t>(k), n, static_cast<Kind>(k)), false)) break;
    }
    if (!sh.failed && sh.calls > 0) {
        w.barrier();
        if (me == 0) {
            sh.result.warm = usage_now();
            sh.start = std::chrono::steady_clock::now();
        }
        w.barrier();
    }
    for (int64_t call = 0; call < sh.calls && !sh.failed; ++call) {
        if (call % 64 == 0) {
            // A collective decision to go on (the time bound), made by rank 0 between two host barriers.
            if (me == 0) {
                const double elapsed =
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - sh.start).count();
                sh.keep_going = !sh.failed && (o.seconds <= 0 || elapsed < o.seconds);
            }
            try {
                w.barrier();
                const bool go = sh.keep_going;
                w.barrier();
                if (!go) break;
            } catch (const std::exception& e) {
                sh.problem("rank " + std::to_string(me) + " at call " + std::to_string(call) + ": " + e.what());
                sh.failed = true;
                break;
            }
        }
        if (!one_call(call, draw_plan(o.seed, static_cast<uint64_t>(call), n), true)) break;
    }
    if (sh.failed && me == 0 && sh.start != std::chrono::steady_clock::time_point{}) {
        // A failed world reports the time until rank 0 stopped calling (a passing one: until every rank drained).
        sh.result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - sh.start).count();
    }
    if (!sh.failed && sh.calls > 0) {
        WEFT_CUDA_CHECK(cudaStreamSynchronize(ops_here.stream()));
        w.barrier();
        if (me == 0) {
            sh.result.end = usage_now();
            sh.result.steady_measured = true;
            sh.result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - sh.start).count();
        }
        w.barrier();
    }
}

/// A World of w rank threads: the warm-up pass, then `calls` calls (0: the warm-up pass only).
WorldResult run_world(const Options& o, int w, int calls) {
    Shared sh(w);
    sh.o = &o;
    sh.calls = calls;
    sh.result.world = w;
    sh.result.planned = static_cast<uint64_t>(calls);
    for (auto& p : sh.progress_ns) p = now_ns();
    for (auto& p : sh.call_ns) p = now_ns();
    // The host's guard: no rank finished a call within the hang bound plus a margin (the device waits end at the
    // bound themselves, as a diagnosed error): report where every rank is and stop the process.
    std::thread guard([&] {
        const int64_t bound_ns = (static_cast<int64_t>(o.hang_ms) + 30000) * 1000000;
        while (!sh.finished) {
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
            for (int r = 0; r < w && !sh.finished; ++r) {
                if (now_ns() - sh.progress_ns[static_cast<size_t>(r)] > bound_ns && sh.calls > 0) {
                    std::printf("weft_soak: HANG: world %d, rank %d has finished no call for %d ms; ranks at calls:", w,
                                r, o.hang_ms + 30000);
                    for (int q = 0; q < w; ++q) {
                        std::printf(" %lld", static_cast<long long>(sh.at_call[static_cast<size_t>(q)]));
                    }
                    std::printf(" (seed 0x%llx)\n  %s\n", static_cast<unsigned long long>(o.seed),
                                sh.where_ranks_are().c_str());
                    std::fflush(stdout);
                    std::_Exit(3);
                }
            }
        }
    });
    WorldOptions wo;
    wo.heap_bytes = (1ull << 30) + ops::ep::footprint(ep_config(w), w).heap_bytes(1);
    // The first World of a world size may compile kernels (a cold JIT cache) while its peers wait in a store barrier:
    // it gets ten minutes; the measured World (every kernel cached by then) the hang bound.
    wo.timeout = std::chrono::milliseconds(calls == 0 ? std::max(o.hang_ms, 600000) : o.hang_ms);
    try {
        run_local(w, [&](World& world) {
            // Construction and the warm-up pass are not timed by the guard.
            sh.progress_ns[static_cast<size_t>(world.rank())] = now_ns() + 600'000'000'000;
            rank_main(world, sh);
        }, wo);
    } catch (const std::exception& e) {
        sh.problem(std::string("the World failed: ") + e.what());
        if (!sh.failed) ++sh.result.errors;
        sh.failed = true;
    }
    sh.finished = true;
    guard.join();
    return sh.result;
}

// ------------------------------------------------------------------------------------------------
// The program: options, every world size in turn, the report.

constexpr int64_t kDeviceSlackBytes = 32ll << 20;  // the driver's own allocations move by a few MiB

Options parse_options(int argc, char** argv) {
    Options o;
    o.seed = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
    Cli cli("weft_soak", "mixed calls on ranks sharing one GPU, every result checked: wrong results, hangs, leaks");
    cli.world(&o.worlds, 2, 64);
    cli.int_option("--calls", "mixed calls per world size", &o.calls, 0, 100000000);
    cli.int_option("--seconds", "stop each world size after this many seconds of calls (0: no bound)", &o.seconds, 0,
                   1000000);
    cli.option("--seed", "S", "the shared seed (default: the clock; printed)", [&](const std::string& v) {
        o.seed = static_cast<uint64_t>(parse_int(v, "--seed", 0, INT64_MAX));
    });
    cli.option("--delay-prob", "P", "probability that a rank sleeps before a call (default 0.02)",
               [&](const std::string& v) {
                   o.delay_prob = std::stod(v);
                   if (!(o.delay_prob >= 0 && o.delay_prob <= 1)) throw UsageError("--delay-prob must be in [0, 1]");
               });
    cli.int_option("--max-delay-ms", "longest sleep before a call, ms", &o.max_delay_ms, 0, 60000);
    cli.int_option("--hang-ms", "a call not done within this many ms is a hang", &o.hang_ms, 1000,
                   3600000);
    cli.flag("--verbose", "print every call", &o.verbose);
    cli.parse(argc, argv);
    return o;
}

/// The per-kind table, the leak table and the final line; the exit status (0: nothing wrong, hung, failed or leaked).
int report(const Options& o, const std::vector<WorldResult>& results,
           const std::vector<std::pair<int64_t, int>>& process_leaks, bool ok) {
    std::printf("\n%-6s %-15s %8s %7s %10s %12s %12s\n", "world", "op", "calls", "wrong", "ms/call", "min size",
                "max size");
    for (const WorldResult& r : results) {
        for (int k = 0; k < kKinds; ++k) {
            const KindStats& s = r.kinds[static_cast<size_t>(k)];
            if (s.calls == 0) continue;
            std::printf("%-6d %-15s %8llu %7llu %10.3f %12llu %12llu\n", r.world, kKindNames[k],
                        static_cast<unsigned long long>(s.calls), static_cast<unsigned long long>(s.wrong),
                        1e3 * s.seconds / static_cast<double>(s.calls), static_cast<unsigned long long>(s.min_count),
                        static_cast<unsigned long long>(s.max_count));
        }
    }
    std::printf("(sizes: elements for all_reduce and reduce_scatter, bytes per rank for all_gather and all_to_all, M "
                "for the GEMMs)\n\n%-6s %18s %18s %14s %14s\n",
                "world", "device leak (MiB)", "steady (MiB)", "fd leak", "steady fds");
    uint64_t done = 0, planned = 0, wrong = 0, hangs = 0, errors = 0, leaks = 0;
    for (size_t i = 0; i < results.size(); ++i) {
        const WorldResult& r = results[i];
        const int64_t steady_bytes = r.steady_measured ? static_cast<int64_t>(r.warm.free_bytes) -
                                                             static_cast<int64_t>(r.end.free_bytes)
                                                       : 0;
        const int steady_fds = r.steady_measured ? r.end.fds - r.warm.fds : 0;
        const auto [dev_leak, fd_leak] = process_leaks[i];
        std::printf("%-6d %18.1f %18.1f %14d %14d\n", r.world, mib(dev_leak), mib(steady_bytes), fd_leak, steady_fds);
        leaks += (dev_leak > kDeviceSlackBytes ? 1 : 0) + (steady_bytes > kDeviceSlackBytes ? 1 : 0) +
                 (fd_leak > 0 ? 1 : 0) + (steady_fds > 0 ? 1 : 0);
        done += r.done;
        planned += r.planned;
        wrong += r.wrong;
        hangs += r.hangs;
        errors += r.errors;
    }
    ok = ok && wrong == 0 && hangs == 0 && errors == 0 && leaks == 0;
    std::string worlds;
    for (const WorldResult& r : results) {
        if (!worlds.empty()) worlds += ',';  // appended, for GCC 12's -Wrestrict false positive on "," + string
        worlds += std::to_string(r.world);
    }
    std::printf("\nweft_soak: %s: worlds %s, seed %llu, %llu/%llu calls, %llu wrong, %llu hangs, %llu errors, %llu "
                "leaks (device slack %lld MiB)\n",
                ok ? "PASS" : "FAIL", worlds.c_str(), static_cast<unsigned long long>(o.seed),
                static_cast<unsigned long long>(done), static_cast<unsigned long long>(planned),
                static_cast<unsigned long long>(wrong), static_cast<unsigned long long>(hangs),
                static_cast<unsigned long long>(errors), static_cast<unsigned long long>(leaks),
                static_cast<long long>(kDeviceSlackBytes >> 20));
    return ok ? 0 : 1;
}

/// The value CUDA read for `name` when it initialised (the variable as the process holds it), or "unset".
std::string env_or_unset(const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr ? v : "unset";
}

int run(int argc, char** argv) {
    // Before the process's first CUDA call: the driver reads both variables once, when it initialises. Without it
    // the ranks (threads sharing one GPU) run with lazy module loading and CUDA's 8 hardware queues, the two
    // settings under which a launch can be held back behind a peer's spinning kernel (docs/runtime.md).
    prepare_cuda_environment();
    const Options o = parse_options(argc, argv);
    WEFT_CUDA_CHECK(cudaFree(nullptr));
    warn_if_lazy_module_loading();
    cudaDeviceProp prop{};
    WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf(
        "weft_soak: %s, %s, seed %llu, %d calls per world size%s, delays p=%.3f up to %d ms, hang bound %d ms, "
        "CUDA_DEVICE_MAX_CONNECTIONS=%s, CUDA_MODULE_LOADING=%s\n",
        prop.name, utc_date().c_str(), static_cast<unsigned long long>(o.seed), o.calls,
        o.seconds > 0 ? (", at most " + std::to_string(o.seconds) + " s each").c_str() : "", o.delay_prob,
        o.max_delay_ms, o.hang_ms, env_or_unset("CUDA_DEVICE_MAX_CONNECTIONS").c_str(),
        env_or_unset("CUDA_MODULE_LOADING").c_str());
    std::fflush(stdout);
    std::vector<WorldResult> results;
    std::vector<std::pair<int64_t, int>> process_leaks;  // per world: device bytes, file descriptors
    bool ok = true;
    for (int w : o.worlds) {
        WEFT_CHECK(kEpExpertsPerRank * w <= ops::ep::kMaxExperts && w <= ops::ep::kMaxRanks,
                   "--world " << w << " is too large for EP");
        // A first World that makes every op and runs every kind once: the JIT's loaded kernels and the allocators'
        // pools that outlive a World are there before the measurement starts.
        const WorldResult warmup = run_world(o, w, 0);
        if (warmup.errors + warmup.hangs > 0) {
            for (const std::string& p : warmup.first_problems) std::printf("  %s\n", p.c_str());
            results.push_back(warmup);
            process_leaks.emplace_back(0, 0);
            ok = false;
            break;
        }
        const Usage before = usage_now();
        WorldResult r = run_world(o, w, o.calls);
        const Usage after = usage_now();
        process_leaks.emplace_back(static_cast<int64_t>(before.free_bytes) - static_cast<int64_t>(after.free_bytes),
                                   after.fds - before.fds);
        std::printf("world %d: %llu of %llu calls in %.1f s, %llu wrong, %llu hangs, %llu errors, %llu delays\n", w,
                    static_cast<unsigned long long>(r.done), static_cast<unsigned long long>(r.planned), r.seconds,
                    static_cast<unsigned long long>(r.wrong), static_cast<unsigned long long>(r.hangs),
                    static_cast<unsigned long long>(r.errors), static_cast<unsigned long long>(r.delays));
        for (const std::string& p : r.first_problems) std::printf("  %s\n", p.c_str());
        if (!r.at_first_failure.empty()) std::printf("  at the first failure: %s\n", r.at_first_failure.c_str());
        std::fflush(stdout);
        results.push_back(std::move(r));
        if (results.back().hangs + results.back().errors > 0) {
            ok = false;
            break;  // stop at the first hang or failure: the state to look at is this one
        }
    }
    return report(o, results, process_leaks, ok);
}

}  // namespace
}  // namespace weft::bench::soak

int main(int argc, char** argv) {
    return weft::bench::run_main("weft_soak", [&] { return weft::bench::soak::run(argc, argv); });
}
