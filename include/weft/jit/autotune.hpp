// SPDX-License-Identifier: MIT
// The autotuner: times candidate configs of an op on the real problem, agrees on one winner across
// ranks, and remembers the decision on disk.
//
// Distributed contract: every rank calls tune() with the same key and the same candidate list, in the
// same order. All ranks time each candidate together (barrier before each), the slowest rank's time
// counts, and every rank returns the same winner. For fused cross-rank ops (a run launches kernels that
// wait for the other ranks' runs) see TuneCandidate::prepare and TuneOptions::collective_runs: nothing
// that can fail on the host may sit between a rank's launches, or its peers wait for work that never comes.
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace weft::jit {

/// How the autotuner talks to the other ranks. The runtime supplies an adapter over its World/Team;
/// tests supply fakes. Every call is collective: all ranks make it, in the same order.
class TuneComm {
public:
    virtual ~TuneComm() = default;
    virtual int rank() const = 0;
    virtual int num_ranks() const = 0;
    virtual void barrier() = 0;
    /// Returns every rank's `value`, indexed by rank.
    virtual std::vector<double> all_gather(double value) = 0;
};

/// A TuneComm built from two functions (for callers that have a barrier and an all-gather at hand).
class FunctionTuneComm final : public TuneComm {
public:
    FunctionTuneComm(int rank, int num_ranks, std::function<void()> barrier,
                     std::function<std::vector<double>(double)> all_gather);
    int rank() const override { return rank_; }
    int num_ranks() const override { return num_ranks_; }
    void barrier() override { barrier_(); }
    std::vector<double> all_gather(double value) override { return all_gather_(value); }

private:
    int rank_, num_ranks_;
    std::function<void()> barrier_;
    std::function<std::vector<double>(double)> all_gather_;
};

/// One config of the op. `run` enqueues the op once on `stream` (asynchronously).
struct TuneCandidate {
    TuneCandidate() = default;
    TuneCandidate(std::string candidate_name, std::function<void(cudaStream_t stream)> run_once,
                  std::function<void()> set_up = {})
        : name(std::move(candidate_name)), run(std::move(run_once)), prepare(std::move(set_up)) {}

    std::string name;  ///< stable across runs: decisions are cached by name
    std::function<void(cudaStream_t stream)> run;
    /// Optional host-side set-up, called once on every rank before any run of this candidate (e.g. build
    /// and check the tensor maps and kernel parameters, so that `run` only launches). A candidate whose
    /// prepare throws on any rank is skipped on every rank, before anything of it is launched anywhere.
    std::function<void()> prepare;
};

/// The device field of the decisions this process records and reads: the current device's name and SM count (an
/// H100 SXM and an H100 PCIe share an arch, not their best configs), or "no device".
std::string autotune_device_signature();

/// What identifies a decision (with the device it was measured on: autotune_device_signature). `arch` empty: the
/// current device's; `world_size` 0: the comm's size.
struct TuneKey {
    std::string op;       ///< e.g. "ag_gemm"
    std::string problem;  ///< shape, dtypes, layout..., e.g. "m=8192,n=4096,k=4096,bf16"
    int world_size = 0;
    std::string arch;
};

struct TuneOptions {
    int warmup_iters = 2;
    int repeat_iters = 7;  ///< the median of these counts
    cudaStream_t stream = nullptr;
    /// Called before every run (warm-up and timed) with a running index, e.g. to rotate through
    /// several input buffers so that caches start cold.
    std::function<void(int iteration)> rotate_inputs;
    /// The runs are collective: a run launches work that waits for the other ranks' runs of the same
    /// candidate (fused cross-rank ops). With a comm of more than one rank, every run (warm-up and timed)
    /// then starts only once this rank's previous run has finished (`stream` synchronised) and every rank
    /// has got there (a comm barrier), so no rank's call overlaps a peer's earlier call; and a run that
    /// throws ends the session (tune() rethrows) instead of disqualifying the candidate, because the peers
    /// may be waiting on the device for work this rank never launched: moving on would launch the next
    /// candidate into a desynchronised protocol. Needs a measure that calls rotate_inputs before each run
    /// (measure_with_cuda_events does). A run then starts on an idle stream, so its time includes its
    /// launches (the same for every candidate of one op: the ranking is unaffected).
    bool collective_runs = false;
};

/// Times one candidate on this rank: returns its median time in ms (or throws).
using TuneMeasure = std::function<double(const TuneCandidate&, const TuneOptions&)>;
/// Waits until everything queued on a stream has finished (TuneOptions::collective_runs); throws on error.
using TuneSync = std::function<void(cudaStream_t)>;
/// The default TuneSync: cudaStreamSynchronize.
void synchronize_stream(cudaStream_t stream);
/// The default measure: warm-up runs, then `repeat_iters` runs each bracketed by CUDA events on
/// `options.stream`; the median.
double measure_with_cuda_events(const TuneCandidate& candidate, const TuneOptions& options);

/// Pure selection: `times_ms[c][r]` is candidate c's time on rank r. A candidate's score is its
/// slowest rank; a non-finite or negative time disqualifies it (that rank failed to run it). Returns
/// the candidate with the lowest score, the lowest index on ties. Throws weft::Error when every
/// candidate is disqualified or the table is ragged.
size_t select_winner(const std::vector<std::vector<double>>& times_ms);

/// The median of `samples` (mean of the middle two for an even count). Throws when empty.
double median(std::vector<double> samples);

/// Parses WEFT_AUTOTUNE_FORCE's syntax, "op=candidate[,op=candidate...]".
std::map<std::string, std::string> parse_force_list(const std::string& text);

/// Settings; from_env() reads WEFT_AUTOTUNE, WEFT_AUTOTUNE_FORCE, WEFT_CACHE_DIR.
struct AutotuneConfig {
    bool enabled = true;                          ///< false: always the first candidate
    std::map<std::string, std::string> forced;    ///< op -> candidate name
    std::optional<std::filesystem::path> cache_dir;  ///< nullopt: decisions kept in memory only
    static AutotuneConfig from_env();
};

struct TuneResult {
    enum class Origin { kTuned, kCached, kForced, kDisabled };
    size_t index = 0;
    std::string name;
    Origin origin = Origin::kTuned;
    std::vector<double> times_ms;  ///< per candidate, the slowest rank's median (kTuned only)
};

/// Runs tuning sessions and keeps their decisions (in memory and in <cache_dir>/autotune.txt).
class Autotuner {
public:
    explicit Autotuner(AutotuneConfig config = AutotuneConfig::from_env(),
                       TuneMeasure measure = measure_with_cuda_events, TuneSync sync = synchronize_stream);

    /// Picks a candidate for `key`. With `comm` (may be null for one rank) the call is collective.
    /// A decision cached on every rank is reused without timing; otherwise all ranks time every
    /// candidate together. A candidate whose prepare or (without collective_runs) whose timing throws on
    /// some rank is disqualified on all ranks; with collective_runs a run that throws ends the session.
    TuneResult tune(const TuneKey& key, const std::vector<TuneCandidate>& candidates, TuneComm* comm = nullptr,
                    const TuneOptions& options = {});

    /// The cached decision's candidate name, if any (memory, then disk). In `key`, world_size 0
    /// means one rank and an empty arch the current device's.
    std::optional<std::string> cached_decision(const TuneKey& key) const;

private:
    std::string decision_id(const TuneKey& key) const;
    void store_decision(const TuneKey& key, const std::string& name, double time_ms);

    AutotuneConfig config_;
    TuneMeasure measure_;
    TuneSync sync_;
    mutable std::mutex mutex_;
    mutable std::map<std::string, std::string> memory_;  // decision id -> candidate name
};

/// The process-wide autotuner (from the environment, on first use).
Autotuner& autotuner();

}  // namespace weft::jit
