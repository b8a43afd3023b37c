// SPDX-License-Identifier: MIT
// The GpuFuzz suites' harness (tests/gpu/test_fuzz_*.cpp): a seeded generator, a run's time, case and kernel budgets
// with replay of one case (WEFT_FUZZ_SEED, WEFT_FUZZ_SECONDS, WEFT_FUZZ_CASES, WEFT_FUZZ_KERNELS, WEFT_FUZZ_CASE=i.a),
// random 16-bit value pools and host matrices, the poison checks, the one-GPU case loop, the world loop of the suites
// whose ranks are threads (fuzz_worlds) and the GpuFuzz fixture that skips every suite off sm_90.
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "support/gemm_testing.hpp"
#include "support/runtime_checks.hpp"
#include "support/tp_reference.hpp"
#include "weft/common/dtype.hpp"
#include "weft/common/math.hpp"  // round_up, ceil_div
#include "weft/runtime/error.hpp"
#include "weft/runtime/tensor_view.hpp"
#include "weft/runtime/world.hpp"

namespace weft::fuzz_test {

inline constexpr uint64_t kDefaultSeed = 0x7765667466757a7aull;  // "weftfuzz"
inline constexpr int kMaxDrawAttempts = 64;                      // redraws of a case whose kernel the budget refuses
inline constexpr int kMaxFailures = 5;                           // failing cases reported before a test stops
inline constexpr uint64_t kGuard = 256;  // poisoned bytes after an output that nothing may touch

/// An index or extent as size_t (for containers), from any integer.
template <class T>
size_t sz(T x) {
    return static_cast<size_t>(x);
}

inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/// splitmix64, with the draws the cases need.
struct Rng {
    uint64_t state;
    explicit Rng(uint64_t seed) : state(seed) {}
    uint64_t next() { return mix64(state += 0x9e3779b97f4a7c15ull); }
    int64_t uniform(int64_t lo, int64_t hi) {  // inclusive
        return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
    }
    double real(double lo, double hi) { return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1p-53; }
    bool chance(double p) { return real(0, 1) < p; }
    int64_t log_uniform(int64_t lo, int64_t hi) {  // lo >= 1: as many draws per octave
        const double x = real(std::log(static_cast<double>(lo)), std::log(static_cast<double>(hi) + 1.0));
        return std::clamp<int64_t>(static_cast<int64_t>(std::exp(x)), lo, hi);
    }
    template <class T>
    T pick(std::initializer_list<T> values) {
        return *(values.begin() + uniform(0, static_cast<int64_t>(values.size()) - 1));
    }
};

inline const char* env_or_null(const char* name) {
    const char* v = std::getenv(name);
    return v && *v ? v : nullptr;
}

/// One fuzz test's run: its seed, time and case budgets, and the kernels its cases have used so far.
class FuzzRun {
public:
    /// `test` and `command`: the test's gtest name and the command a failure's replay line runs (defaults:
    /// GpuFuzz.<name> and weft_gpu_tests filtered to it).
    FuzzRun(std::string name, double seconds, int64_t max_cases, int max_kernels, std::string test = {},
            std::string command = {})
        : name_(std::move(name)),
          test_(test.empty() ? "GpuFuzz." + name_ : std::move(test)),
          command_(command.empty() ? "weft_gpu_tests --gtest_filter=" + test_ : std::move(command)),
          seconds_(seconds),
          max_cases_(max_cases),
          max_kernels_(max_kernels) {
        seed_ = kDefaultSeed;
        if (const char* s = env_or_null("WEFT_FUZZ_SEED")) seed_ = std::strtoull(s, nullptr, 0);
        if (const char* s = env_or_null("WEFT_FUZZ_SECONDS")) seconds_ = std::strtod(s, nullptr);
        if (const char* s = env_or_null("WEFT_FUZZ_CASES")) max_cases_ = std::strtoll(s, nullptr, 0);
        if (const char* s = env_or_null("WEFT_FUZZ_KERNELS"))
            max_kernels_ = static_cast<int>(std::strtol(s, nullptr, 0));
        if (const char* s = env_or_null("WEFT_FUZZ_CASE")) {
            char* end = nullptr;
            const int64_t i = std::strtoll(s, &end, 0);
            const int a = end && *end == '.' ? static_cast<int>(std::strtol(end + 1, nullptr, 0)) : 0;
            only_ = {i, a};
        }
        start_ = std::chrono::steady_clock::now();
        std::printf(
            "[ fuzz     ] %s seed %llu, %.0f s, at most %lld cases and %d kernels%s\n", test_.c_str(),
            static_cast<unsigned long long>(seed_), seconds_, static_cast<long long>(max_cases_), max_kernels_,
            only_ ? (" (replaying case " + std::to_string(only_->first) + "." + std::to_string(only_->second) + ")")
                        .c_str()
                  : "");
        std::fflush(stdout);
    }

    double elapsed() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
    double seconds() const { return seconds_; }
    uint64_t seed() const { return seed_; }
    bool replaying() const { return only_.has_value(); }
    /// Whether case `i` should run (the time and case budgets; a replay runs one case).
    bool more(int64_t i) const {
        if (failures_ >= kMaxFailures) return false;
        if (only_) return i == 0;
        return i < max_cases_ && elapsed() < seconds_;
    }
    /// The draws of case `i`, attempt `a` (a replay: the replayed case).
    int64_t case_index(int64_t i) const { return only_ ? only_->first : i; }
    int first_attempt() const { return only_ ? only_->second : 0; }
    int last_attempt() const { return only_ ? only_->second : kMaxDrawAttempts - 1; }
    Rng rng(int64_t i, int a) const {
        uint64_t h = 1469598103934665603ull;
        for (char ch : name_) h = (h ^ static_cast<uint8_t>(ch)) * 1099511628211ull;
        return Rng(mix64(seed_ ^ mix64(h) ^ mix64(static_cast<uint64_t>(i) * 0x10001ull + static_cast<uint64_t>(a))));
    }
    /// Whether a draw that runs kernel `key` may run now: a known kernel always; a new one while fewer than the
    /// budget's kernels have run and the first half of the time lasts (a replay: always).
    bool admit(const std::string& key) {
        if (kernels_.count(key) || only_) {
            kernels_.insert(key);
            return true;
        }
        if (!kernels_.empty() && (static_cast<int>(kernels_.size()) >= max_kernels_ || elapsed() > 0.5 * seconds_)) {
            return false;
        }
        kernels_.insert(key);
        return true;
    }
    /// The line that reproduces case i.a.
    std::string repro(int64_t i, int a) const {
        std::ostringstream os;
        os << test_ << " seed=" << seed_ << " case=" << i << "." << a << " | replay: WEFT_FUZZ_SEED=" << seed_
           << " WEFT_FUZZ_CASE=" << i << "." << a << " " << command_;
        return os.str();
    }
    /// Reports a failing case: one line with the case's parameters and what went wrong.
    void fail(int64_t i, int a, const std::string& params, const std::string& what) {
        ++failures_;
        ADD_FAILURE() << "[ FUZZ FAIL ] " << params << " :: " << what << " :: " << repro(i, a);
    }
    void summary(int64_t cases, int64_t invalid, int64_t refused) const {
        EXPECT_GT(cases, 0) << test_ << " ran no case: a suite that checks nothing does not pass";
        std::printf(
            "[ fuzz     ] %s: %lld cases (%lld invalid-argument cases), %zu kernels, %lld draws "
            "redrawn for the kernel budget, %.1f s\n",
            test_.c_str(), static_cast<long long>(cases), static_cast<long long>(invalid), kernels_.size(),
            static_cast<long long>(refused), elapsed());
        std::fflush(stdout);
    }

private:
    std::string name_, test_, command_;
    uint64_t seed_ = kDefaultSeed;
    double seconds_;
    int64_t max_cases_;
    int max_kernels_;
    std::optional<std::pair<int64_t, int>> only_;
    std::chrono::steady_clock::time_point start_;
    std::set<std::string> kernels_;
    int failures_ = 0;
};

/// When a world of ranks that starts now stops starting cases: a third of the run's time later (3 s at least), or at
/// the run's end.
inline double world_slice_end(const FuzzRun& run) {
    return std::min(run.seconds(), run.elapsed() + std::max(3.0, run.seconds() / 3));
}

/// Prints the line that starts a world of `world` ranks.
inline void announce_world(int world) {
    std::printf("[ fuzz     ] world %d\n", world);
    std::fflush(stdout);
}

/// Random 16-bit values (bf16 or f16 bits, uniform in [-1, 1) and rounded): a pool drawn from a case's generator; each
/// row is a window at a random place in it, so rows differ and a 36M-element matrix costs a memcpy per row.
class ValuePool {
public:
    static constexpr int64_t kSize = int64_t{1} << 16;
    ValuePool(Rng& rng, DType t, int64_t max_cols) : bits_(static_cast<size_t>(kSize + max_cols)) {
        for (int64_t i = 0; i < kSize; ++i) {
            bits_[static_cast<size_t>(i)] = tp_test::float_to_bits(t, static_cast<float>(rng.real(-1, 1)));
        }
        for (int64_t i = kSize; i < kSize + max_cols; ++i)
            bits_[static_cast<size_t>(i)] = bits_[static_cast<size_t>(i - kSize)];
    }
    const uint16_t* window(Rng& rng) const { return bits_.data() + rng.uniform(0, kSize - 1); }

private:
    std::vector<uint16_t> bits_;
};

/// A row-major 16-bit matrix on the host (row stride ld elements), filled from a pool.
struct Host16 {
    int64_t rows = 0, cols = 0, ld = 0;
    DType dtype = DType::kBF16;
    std::vector<uint16_t> bits;
    Host16() = default;
    Host16(int64_t r, int64_t c, int64_t l, DType t) : rows(r), cols(c), ld(l), dtype(t) {
        bits.assign(static_cast<size_t>(std::max<int64_t>(r, 1) * l), 0);
    }
    void fill(const ValuePool& pool, Rng& rng) {
        for (int64_t r = 0; r < rows; ++r) {
            std::memcpy(bits.data() + r * ld, pool.window(rng), static_cast<size_t>(cols) * 2);
        }
    }
    float at(int64_t r, int64_t c) const {
        return tp_test::bits_to_float(dtype, bits[static_cast<size_t>(r * ld + c)]);
    }
    size_t bytes() const { return static_cast<size_t>(rows * ld) * 2; }
};

inline double read_elem(const uint8_t* p, DType t) {
    if (t == DType::kF32) {
        float v;
        std::memcpy(&v, p, 4);
        return v;
    }
    uint16_t b;
    std::memcpy(&b, p, 2);
    return tp_test::bits_to_float(t, b);
}

inline bool cuda_ok(cudaError_t e, std::string* why, const char* what) {
    if (e == cudaSuccess) return true;
    *why = std::string(what) + ": " + cudaGetErrorString(e);
    return false;
}

/// Bytes of a device buffer that no element of the output may touch: they keep the 0xFF poison (NaN).
inline bool poison_intact(const uint8_t* p, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        if (p[i] != 0xFF) return false;
    }
    return true;
}

/// A [rows, cols] view of `p` with row stride ld.
inline TensorView view2(void* p, DType t, int64_t rows, int64_t cols, int64_t ld) {
    return TensorView(p, t, {rows, cols}, {ld, 1});
}

/// The kernel a draw runs, for the kernel budget: `key` names it; no key, a case that runs no budgeted kernel (an
/// invalid-argument case or one with no work), kept at once; `give_up`, the draw has already failed (no case this
/// time).
struct DrawKernel {
    std::optional<std::string> key;
    bool give_up = false;
};

/// What a one-GPU suite does with its cases: draw one from a generator, name its kernel (for the budget), say whether
/// it is an invalid-argument case (for the summary's count), and run it on a stream: "" or what went wrong, setting
/// *fatal when the GPU may be unusable.
template <class Case>
struct OneGpuSuite {
    std::function<Case(Rng&)> draw;
    std::function<DrawKernel(const Case&, int64_t idx, int attempt)> kernel;
    std::function<bool(const Case&)> invalid;
    std::function<std::string(const Case&, Rng&, cudaStream_t, bool* fatal)> run;
};

/// Case `idx` of a one-GPU suite: the first attempt's draw whose kernel the budget admits, with the generator that drew
/// it (the case's later draws come from it) and the attempt; none when every attempt was refused or one gave up. Each
/// refused draw adds one to *refused.
template <class Case>
struct Chosen {
    Case c;
    Rng rng;
    int attempt;
};
template <class Case>
std::optional<Chosen<Case>> choose_case(FuzzRun& run, const OneGpuSuite<Case>& suite, int64_t idx, int64_t* refused) {
    for (int attempt = run.first_attempt(); attempt <= run.last_attempt(); ++attempt) {
        Rng r = run.rng(idx, attempt);
        Case c = suite.draw(r);
        const DrawKernel k = suite.kernel(c, idx, attempt);
        if (k.give_up) return std::nullopt;
        if (!k.key || run.admit(*k.key)) return Chosen<Case>{std::move(c), r, attempt};
        ++*refused;
    }
    return std::nullopt;
}

/// Runs a one-GPU suite's cases on a stream of its own while the run's budgets last (or until a fatal case), reporting
/// each failing case, then the summary.
template <class Case>
void fuzz_one_gpu(FuzzRun& run, const OneGpuSuite<Case>& suite) {
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    int64_t cases = 0, invalid = 0, refused = 0;
    for (int64_t i = 0; run.more(i); ++i) {
        const int64_t idx = run.case_index(i);
        std::optional<Chosen<Case>> chosen = choose_case(run, suite, idx, &refused);
        if (!chosen) continue;
        ++cases;
        invalid += suite.invalid(chosen->c);
        bool fatal = false;
        const std::string what = suite.run(chosen->c, chosen->rng, stream, &fatal);
        if (!what.empty()) run.fail(idx, chosen->attempt, describe(chosen->c), what);
        if (fatal) break;
    }
    run.summary(cases, invalid, refused);
    cudaStreamDestroy(stream);
}

// ---- ranks as threads -----------------------------------------------------------------------------------------------

inline void check_cuda(cudaError_t e, const char* what) {
    if (e != cudaSuccess) WEFT_FAIL(what << ": " << cudaGetErrorString(e));
}

inline void to_dev(void* dst, const void* src, size_t bytes, cudaStream_t st) {
    if (bytes == 0) return;
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, st), "upload");
    check_cuda(cudaStreamSynchronize(st), "upload");
}

inline std::vector<uint8_t> from_dev(const void* src, size_t bytes, cudaStream_t st) {
    std::vector<uint8_t> h(bytes);
    if (bytes == 0) return h;
    check_cuda(cudaMemcpyAsync(h.data(), src, bytes, cudaMemcpyDeviceToHost, st), "download");
    check_cuda(cudaStreamSynchronize(st), "download");
    return h;
}

/// The rank's stream for a world's cases.
struct StreamRank {
    cudaStream_t st = nullptr;
    explicit StreamRank(World& w) {
        check_cuda(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
        w.barrier();
    }
    ~StreamRank() {
        if (st) cudaStreamDestroy(st);
    }
    StreamRank(const StreamRank&) = delete;
    StreamRank& operator=(const StreamRank&) = delete;
    void teardown(World& w) {
        cudaStreamSynchronize(st);
        w.barrier();
    }
};

/// "" when a refused call threw weft::Error with a message naming `op`; else what went wrong.
template <class Fn>
std::string expect_refused(const char* op, Fn&& fn) {
    try {
        fn();
    } catch (const Error& e) {
        const std::string m = e.what();
        if (m.find(op) == std::string::npos) return std::string("a weft::Error that does not name ") + op + ": " + m;
        return "";
    } catch (const std::exception& e) {
        return std::string("threw a non-weft exception: ") + e.what();
    }
    return "the call accepted it (no weft::Error)";
}

/// The worlds fuzz_worlds visits: the first of `first` ranks (one drawn), the later ones of min..max ranks.
struct WorldSizes {
    int min = 1, max = 8;
    std::vector<int> first = {3, 5, 6, 7};
};

/// fuzz_worlds' default `room`: every case fits.
struct EveryCaseFits {
    template <class Case, class Rank>
    bool operator()(const Case&, Rank&) const {
        return true;
    }
};

inline constexpr int kStop = -1;  // rank 0's decision: no more cases in this world
inline constexpr int kSkip = -2;  // rank 0's decision: no draw of this case fits the kernel budget

/// Runs a test's cases world by world, ranks as threads. Per world: `setup(World&)` makes each rank's resources
/// (collectively; a unique_ptr to a type with `void teardown(World&)`, collective too); per case rank 0 draws
/// (`draw(Rng&, World&)`: the same case on every rank for the same generator and world) until `key(case, World&)` names
/// a kernel the budget admits ("" admits always), asks `room(case, its Rank&)` whether the world's resources left hold
/// the case (the room function books them; no room ends the world, and the next one starts afresh), and tells the
/// ranks which draw it took through a barrier; every rank then runs `run_case(case, data_seed, World&, Rank&)`
/// (returns "" or what went wrong) and the ranks meet again. `describe(case)` goes into a failure's line,
/// `invalid(case)` counts the invalid-argument cases. Case i of a world of W ranks, draw d, is replayed by
/// WEFT_FUZZ_CASE=i.a with a = W * 100 + d.
template <class Case, class Draw, class Key, class Describe, class Invalid, class Setup, class RunCase,
          class Room = EveryCaseFits>
void fuzz_worlds(FuzzRun& run, const WorldOptions& options, Draw draw, Key key, Describe describe, Invalid invalid,
                 Setup setup, RunCase run_case, const WorldSizes& sizes = {}, Room room = {}) {
    int64_t cases = 0, invalid_cases = 0, refused = 0;  // rank 0's
    int64_t next_index = 0;                             // case indices are never reused across worlds
    std::vector<std::string> failures;
    for (int64_t w_idx = 0; run.more(cases) && failures.empty(); ++w_idx) {
        Rng wr = run.rng(-1 - w_idx, 0);
        const auto pick_first = [&] {
            return sizes.first[static_cast<size_t>(wr.uniform(0, static_cast<int64_t>(sizes.first.size()) - 1))];
        };
        const int world = run.replaying()
                              ? run.first_attempt() / 100
                              : (w_idx == 0 ? pick_first() : static_cast<int>(wr.uniform(sizes.min, sizes.max)));
        if (world < sizes.min || world > sizes.max) {
            ADD_FAILURE() << "WEFT_FUZZ_CASE=i.a replays case i with a = W * 100 + draw, W = " << sizes.min << ".."
                          << sizes.max << " ranks; got a = " << run.first_attempt();
            break;
        }
        const double slice_end = world_slice_end(run);
        constexpr int kMaxCasesPerWorld = 2000;
        std::vector<int> decided(kMaxCasesPerWorld, kStop);
        std::vector<std::vector<std::string>> rank_failures(static_cast<size_t>(world));
        std::atomic<bool> failed{false};
        const int64_t first_case = next_index;
        int64_t tried = 0;  // rank 0's: case indices this world used
        announce_world(world);
        test::run_ranks(
            world,
            [&](World& w) {
                const int me = w.rank();
                auto& fails = rank_failures[static_cast<size_t>(me)];
                auto rank = setup(w);
                for (int i = 0; i < kMaxCasesPerWorld; ++i) {
                    const int64_t idx = run.case_index(first_case + i);
                    if (me == 0) {
                        int d = kStop;
                        const bool more = run.replaying() ? i == 0 : run.elapsed() < slice_end && run.more(cases);
                        if (more && !failed.load()) {
                            d = kSkip;
                            const int a0 = run.replaying() ? run.first_attempt() % 100 : 0;
                            const int a1 = run.replaying() ? a0 : kMaxDrawAttempts - 1;
                            for (int a = a0; a <= a1; ++a) {
                                Rng r = run.rng(idx, a);
                                const Case c = draw(r, w);
                                std::string k;
                                try {
                                    k = key(c, w);
                                } catch (const std::exception& e) {
                                    fails.push_back("[ FUZZ FAIL ] " + describe(c) +
                                                    " :: the planner refused a valid case: " + e.what() +
                                                    " :: " + run.repro(idx, world * 100 + a));
                                    failed = true;
                                    d = kStop;
                                    break;
                                }
                                if (k.empty() || run.admit(k)) {
                                    d = a;
                                    if (!room(c, *rank)) {
                                        d = kStop;  // the next world starts with its resources whole
                                        if (i == 0) {
                                            fails.push_back("[ FUZZ FAIL ] " + describe(c) +
                                                            " :: the case does not fit a fresh world :: " +
                                                            run.repro(idx, world * 100 + a));
                                            failed = true;
                                        }
                                    }
                                    break;
                                }
                                ++refused;
                            }
                        }
                        decided[static_cast<size_t>(i)] = d;
                        tried = i + 1;
                    }
                    w.barrier();
                    const int d = decided[static_cast<size_t>(i)];
                    if (d == kStop) break;
                    if (d == kSkip) continue;
                    Rng r = run.rng(idx, d);
                    const Case c = draw(r, w);
                    const uint64_t data_seed = r.next();
                    std::string what;
                    try {
                        what = run_case(c, data_seed, w, *rank);
                    } catch (const std::exception& e) {
                        what = std::string("threw: ") + e.what();
                    }
                    if (!what.empty()) {
                        fails.push_back("[ FUZZ FAIL ] " + describe(c) + " :: rank " + std::to_string(me) + ": " +
                                        what + " :: " + run.repro(idx, world * 100 + d));
                        failed = true;
                    }
                    w.barrier();  // every rank's calls of the case are done before the next one's inputs go in
                    if (me == 0) {
                        ++cases;
                        invalid_cases += invalid(c) ? 1 : 0;
                    }
                }
                rank->teardown(w);
            },
            options);
        next_index += tried;
        for (const auto& f : rank_failures) failures.insert(failures.end(), f.begin(), f.end());
        if (run.replaying()) break;
    }
    for (const std::string& f : failures) ADD_FAILURE() << f;
    run.summary(cases, invalid_cases, refused);
}

}  // namespace weft::fuzz_test

/// The GpuFuzz suites' fixture: every suite runs on an sm_90 GPU and skips elsewhere.
class GpuFuzz : public ::testing::Test {
protected:
    void SetUp() override {
        std::string why;
        if (!weft::gemm_test::have_sm90(&why)) GTEST_SKIP() << why;
    }
};
