// SPDX-License-Identifier: MIT
// The autotuner: CUDA-event timing, cross-rank agreement, and the decision file.
#include "weft/jit/autotune.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>

#include "weft/jit/cache.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/jit/hash.hpp"
#include "weft/jit/paths.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/progress.hpp"
#include "weft/runtime/stream.hpp"

namespace weft::jit {

namespace fs = std::filesystem;

namespace {

constexpr const char* kDecisionFile = "autotune.txt";
constexpr const char* kDecisionLock = "autotune.lock";
constexpr const char* kDecisionFormat = "v3";
// A v3 line: format \t op \t problem \t world_size \t arch \t device \t weft_version \t code \t candidate \t
// time_ms; the decision's id is the seven fields after the format (code: Compiler::code_fingerprint()).
constexpr size_t kIdFields = 7;
constexpr size_t kLineFields = kIdFields + 3;

// The decision file, read as the kernel cache reads its entries: a file that is not trusted (a symbolic
// link, a FIFO, another user's, writable by others, oversized) is ignored with a warning, never read.
constexpr uint64_t kMaxDecisionBytes = uint64_t{16} << 20;

std::optional<std::vector<char>> read_decisions(const fs::path& dir) {
    std::string why;
    std::optional<std::vector<char>> bytes = read_trusted_file(dir, kDecisionFile, kMaxDecisionBytes, &why);
    if (!bytes && !why.empty()) {
        WEFT_LOG_WARN("autotune: not using " << (dir / kDecisionFile).string() << ": " << why);
    }
    return bytes;
}

std::string trim(const std::string& s) {
    const size_t b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return {};
    const size_t e = s.find_last_not_of(" \t\r\n");
    return s.substr(b, e - b + 1);
}

std::vector<std::string> split(const std::string& s, char sep) {
    std::vector<std::string> out;
    std::string cur;
    for (char c : s) {
        if (c == sep) {
            out.push_back(cur);
            cur.clear();
        } else {
            cur.push_back(c);
        }
    }
    out.push_back(cur);
    return out;
}

/// A decision line's id (the fields after the format), or "" when the line is not of this format.
std::string line_id(const std::vector<std::string>& fields) {
    if (fields.size() != kLineFields || fields[0] != kDecisionFormat) return {};
    std::string id = fields[1];
    for (size_t i = 2; i <= kIdFields; ++i) id += '\t' + fields[i];
    return id;
}

}  // namespace

std::string autotune_device_signature() {
    int device = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return "no device";
    }
    std::string name = prop.name;
    std::replace_if(
        name.begin(), name.end(), [](char c) { return c == '\t' || c == '\n' || c == '\r'; }, ' ');
    return name + ", " + std::to_string(prop.multiProcessorCount) + " SMs";
}

namespace {

bool usable(double t) { return std::isfinite(t) && t >= 0.0; }

// RAII CUDA event.
struct Event {
    cudaEvent_t event = nullptr;
    Event() { WEFT_CUDA_CHECK(cudaEventCreate(&event)); }
    ~Event() {
        if (event) cudaEventDestroy(event);
    }
    Event(const Event&) = delete;
    Event& operator=(const Event&) = delete;
    Event(Event&& o) noexcept : event(o.event) { o.event = nullptr; }
};

// A number that identifies a candidate list, exact in a double (52 bits), for the cross-rank check.
double list_fingerprint(const TuneKey& key, const std::vector<TuneCandidate>& candidates) {
    Sha256 h;
    h.field(key.op).field(key.problem);
    for (const auto& c : candidates) h.field(c.name);
    const Digest d = h.finish();
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(d[static_cast<size_t>(i)]) << (8 * i);
    return static_cast<double>(v >> 12);
}

}  // namespace

FunctionTuneComm::FunctionTuneComm(int rank, int num_ranks, std::function<void()> barrier,
                                   std::function<std::vector<double>(double)> all_gather)
    : rank_(rank), num_ranks_(num_ranks), barrier_(std::move(barrier)), all_gather_(std::move(all_gather)) {
    WEFT_CHECK(num_ranks >= 1 && rank >= 0 && rank < num_ranks,
               "FunctionTuneComm: need 0 <= rank < num_ranks, got rank " << rank << ", num_ranks " << num_ranks);
    WEFT_CHECK(barrier_ && all_gather_, "FunctionTuneComm: barrier and all_gather must be set");
}

double median(std::vector<double> samples) {
    WEFT_CHECK(!samples.empty(), "median of an empty list");
    std::sort(samples.begin(), samples.end());
    const size_t n = samples.size();
    return n % 2 == 1 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
}

size_t select_winner(const std::vector<std::vector<double>>& times_ms) {
    WEFT_CHECK(!times_ms.empty(), "select_winner: no candidates");
    const size_t num_ranks = times_ms.front().size();
    WEFT_CHECK(num_ranks > 0, "select_winner: candidate 0 has no timings");
    size_t best = times_ms.size();
    double best_score = std::numeric_limits<double>::infinity();
    for (size_t c = 0; c < times_ms.size(); ++c) {
        WEFT_CHECK(times_ms[c].size() == num_ranks, "select_winner: candidate " << c << " has " << times_ms[c].size()
                                                                               << " timings, candidate 0 has " << num_ranks);
        double score = 0.0;
        bool ok = true;
        for (double t : times_ms[c]) {
            ok = ok && usable(t);
            score = std::max(score, t);
        }
        // Strictly lower: ties keep the earlier candidate.
        if (ok && (best == times_ms.size() || score < best_score)) {
            best = c;
            best_score = score;
        }
    }
    WEFT_CHECK(best < times_ms.size(), "autotune: every candidate failed on at least one rank");
    return best;
}

std::map<std::string, std::string> parse_force_list(const std::string& text) {
    std::map<std::string, std::string> out;
    for (const std::string& item : split(text, ',')) {
        const std::string t = trim(item);
        if (t.empty()) continue;
        const size_t eq = t.find('=');
        WEFT_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < t.size(),
                   "WEFT_AUTOTUNE_FORCE must be op=candidate[,op=candidate...], got item '" << t << "'");
        out[trim(t.substr(0, eq))] = trim(t.substr(eq + 1));
    }
    return out;
}

AutotuneConfig AutotuneConfig::from_env() {
    AutotuneConfig config;
    config.enabled = env::get_bool("WEFT_AUTOTUNE").value_or(true);
    if (auto v = env::get("WEFT_AUTOTUNE_FORCE")) config.forced = parse_force_list(*v);
    config.cache_dir = default_cache_dir();
    return config;
}

double measure_with_cuda_events(const TuneCandidate& candidate, const TuneOptions& options) {
    WEFT_CHECK(options.repeat_iters >= 1 && options.warmup_iters >= 0,
               "TuneOptions: repeat_iters must be >= 1 and warmup_iters >= 0, got " << options.repeat_iters << " and "
                                                                                     << options.warmup_iters);
    int iteration = 0;
    for (int i = 0; i < options.warmup_iters; ++i) {
        if (options.rotate_inputs) options.rotate_inputs(iteration);
        ++iteration;
        candidate.run(options.stream);
    }
    // The timed stream is not being captured (the callers refuse to tune under capture); another rank thread's capture
    // in global mode must neither fail these waits and event reads nor be invalidated by them.
    const RelaxedCaptureMode relaxed;
    std::vector<std::pair<Event, Event>> events;
    events.reserve(static_cast<size_t>(options.repeat_iters));
    for (int i = 0; i < options.repeat_iters; ++i) {
        if (options.rotate_inputs) options.rotate_inputs(iteration);
        ++iteration;
        events.emplace_back();
        WEFT_CUDA_CHECK(cudaEventRecord(events.back().first.event, options.stream));
        candidate.run(options.stream);
        WEFT_CUDA_CHECK(cudaEventRecord(events.back().second.event, options.stream));
    }
    WEFT_CUDA_CHECK(cudaStreamSynchronize(options.stream));
    std::vector<double> samples;
    for (auto& [start, stop] : events) {
        float ms = 0.0f;
        WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event, stop.event));
        samples.push_back(ms);
    }
    return median(std::move(samples));
}

void synchronize_stream(cudaStream_t stream) {
    const RelaxedCaptureMode relaxed;  // as in measure_with_cuda_events
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
}

Autotuner::Autotuner(AutotuneConfig config, TuneMeasure measure, TuneSync sync)
    : config_(std::move(config)), measure_(std::move(measure)), sync_(std::move(sync)) {
    WEFT_CHECK(measure_, "Autotuner: the measure function must be set");
    WEFT_CHECK(sync_, "Autotuner: the stream synchronisation function must be set");
}

std::string Autotuner::decision_id(const TuneKey& key_in) const {
    TuneKey key = key_in;
    if (key.world_size == 0) key.world_size = 1;
    if (key.arch.empty()) key.arch = Compiler::resolve_arch("");
    for (const std::string* field : {&key.op, &key.problem, &key.arch}) {
        WEFT_CHECK(field->find_first_of("\t\n\r") == std::string::npos,
                   "TuneKey fields must not contain tabs or newlines, got '" << *field << "'");
    }
    WEFT_CHECK(!key.op.empty(), "TuneKey.op must name the op, got an empty string");
    std::ostringstream os;
    // The device's name once per process and device (cudaGetDeviceProperties is not free).
    static std::mutex devices_mutex;
    static std::map<int, std::string> devices;
    int ordinal = -1;
    if (cudaGetDevice(&ordinal) != cudaSuccess) (void)cudaGetLastError();
    std::string device;
    {
        std::lock_guard<std::mutex> lock(devices_mutex);
        auto it = devices.find(ordinal);
        if (it == devices.end()) it = devices.emplace(ordinal, autotune_device_signature()).first;
        device = it->second;
    }
    os << key.op << '\t' << key.problem << '\t' << key.world_size << '\t' << key.arch << '\t' << device << '\t'
       << WEFT_VERSION_STRING << '\t' << Compiler::code_fingerprint();
    return os.str();
}

std::optional<std::string> Autotuner::cached_decision(const TuneKey& key) const {
    const std::string id = decision_id(key);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (auto it = memory_.find(id); it != memory_.end()) return it->second;
    }
    if (!config_.cache_dir) return std::nullopt;
    std::optional<std::vector<char>> bytes = read_decisions(*config_.cache_dir);
    if (!bytes) return std::nullopt;
    std::optional<std::string> found;
    std::istringstream in(std::string(bytes->begin(), bytes->end()));
    std::string line;
    while (std::getline(in, line)) {
        const auto fields = split(line, '\t');
        if (line_id(fields) == id) found = fields[kIdFields + 1];
    }
    if (found) {
        std::lock_guard<std::mutex> lock(mutex_);
        memory_[id] = *found;
    }
    return found;
}

void Autotuner::store_decision(const TuneKey& key, const std::string& name, double time_ms) {
    const std::string id = decision_id(key);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        memory_[id] = name;
    }
    if (!config_.cache_dir) return;
    try {
        std::error_code ec;
        create_cache_folder(*config_.cache_dir, ec);
        FileLock lock(*config_.cache_dir / kDecisionLock, std::chrono::seconds(60));
        WEFT_CHECK(lock.owns(), "cannot lock " << (*config_.cache_dir / kDecisionLock).string());
        const fs::path path = *config_.cache_dir / kDecisionFile;
        // Every other decision is kept (another weft version sharing the folder reads its own), the oldest first to
        // go once they pass half the readable size, so the file never grows past what read_decisions accepts.
        std::deque<std::string> lines;
        uint64_t bytes_kept = 0;
        if (std::optional<std::vector<char>> bytes = read_decisions(*config_.cache_dir)) {
            std::istringstream in(std::string(bytes->begin(), bytes->end()));
            std::string line;
            while (std::getline(in, line)) {
                // Lines of other formats (other weft versions') are kept as they are; comments go.
                if (line.empty() || line[0] == '#') continue;
                if (line_id(split(line, '\t')) == id) continue;  // replaced below
                bytes_kept += line.size() + 1;
                lines.push_back(std::move(line));
            }
        }
        while (!lines.empty() && bytes_kept > kMaxDecisionBytes / 2) {
            bytes_kept -= lines.front().size() + 1;
            lines.pop_front();
        }
        std::ostringstream os;
        os << "# weft autotune decisions: format op problem world_size arch device weft_version code candidate "
              "time_ms\n";
        for (const std::string& line : lines) os << line << '\n';
        os << kDecisionFormat << '\t' << id << '\t' << name << '\t' << time_ms << '\n';
        const std::string text = os.str();
        write_file_atomically(path, text.data(), text.size());
    } catch (const Error& e) {
        WEFT_LOG_WARN("autotune: cannot record the decision for " << key.op << ": " << e.what());
    }
}

TuneResult Autotuner::tune(const TuneKey& key_in, const std::vector<TuneCandidate>& candidates, TuneComm* comm,
                           const TuneOptions& options) {
    WEFT_CHECK(!candidates.empty(), "autotune " << key_in.op << ": no candidates");
    for (size_t i = 0; i < candidates.size(); ++i) {
        WEFT_CHECK(!candidates[i].name.empty() && candidates[i].run,
                   "autotune " << key_in.op << ": candidate " << i << " needs a name and a run function");
        WEFT_CHECK(candidates[i].name.find_first_of("\t\n\r") == std::string::npos,
                   "autotune " << key_in.op << ": candidate names must not contain tabs or newlines (the decision "
                               << "file's separators), got '" << candidates[i].name << "'");
        for (size_t j = 0; j < i; ++j) {
            WEFT_CHECK(candidates[i].name != candidates[j].name,
                       "autotune " << key_in.op << ": two candidates are named '" << candidates[i].name << "'");
        }
    }
    const int num_ranks = comm ? comm->num_ranks() : 1;
    TuneKey key = key_in;
    if (key.world_size == 0) key.world_size = num_ranks;
    WEFT_CHECK(key.world_size == num_ranks,
               "autotune " << key.op << ": TuneKey.world_size " << key.world_size << " but the comm has " << num_ranks << " ranks");
    if (key.arch.empty()) key.arch = Compiler::resolve_arch("");

    auto index_of = [&](const std::string& name) -> int {
        for (size_t i = 0; i < candidates.size(); ++i) {
            if (candidates[i].name == name) return static_cast<int>(i);
        }
        return -1;
    };
    TuneResult result;
    // This rank's setting for the op: a forced candidate's index, kNotForced (tune or reuse a decision),
    // kDisabled (WEFT_AUTOTUNE=0: the first candidate), or kUnknownForced (forced to a name not in the list).
    // Ranks must agree on it like on any decision: a forced rank would otherwise run another config than its
    // peers, whose kernels then wait for work that never comes.
    constexpr int kNotForced = -1, kDisabled = -2, kUnknownForced = -3;
    const auto forced = config_.forced.find(key.op);
    int setting = kNotForced;
    if (forced != config_.forced.end()) {
        setting = index_of(forced->second) >= 0 ? index_of(forced->second) : kUnknownForced;
    } else if (!config_.enabled) {
        setting = kDisabled;
    }
    const bool distributed = comm != nullptr && num_ranks > 1;
    if (distributed) {
        const double mine = list_fingerprint(key, candidates);
        for (double other : comm->all_gather(mine)) {
            WEFT_CHECK(other == mine, "autotune " << key.op << " [" << key.problem
                                                  << "]: ranks called tune() with different keys or candidate lists");
        }
        const std::vector<double> settings = comm->all_gather(static_cast<double>(setting));
        auto describe = [&](double v) -> std::string {
            const int s = static_cast<int>(v);
            if (s >= 0) return "forces '" + candidates[static_cast<size_t>(s)].name + "' (WEFT_AUTOTUNE_FORCE)";
            if (s == kDisabled) return "has autotuning off (WEFT_AUTOTUNE=0: the first candidate)";
            if (s == kUnknownForced) return "forces a candidate the op does not have (WEFT_AUTOTUNE_FORCE)";
            return "tunes";
        };
        for (size_t r = 0; r < settings.size(); ++r) {
            WEFT_CHECK(settings[r] == settings[0],
                       "autotune " << key.op << " [" << key.problem << "]: ranks disagree on how to choose: rank 0 "
                                   << describe(settings[0]) << ", rank " << r << " " << describe(settings[r])
                                   << "; set WEFT_AUTOTUNE_FORCE and WEFT_AUTOTUNE alike on every rank");
        }
    }
    if (setting == kUnknownForced) {
        std::ostringstream names;
        for (const auto& c : candidates) names << " " << c.name;
        WEFT_FAIL("WEFT_AUTOTUNE_FORCE names candidate '" << forced->second << "' for op " << key.op
                                                           << ", which has only:" << names.str());
    }
    if (setting >= 0) {
        result.index = static_cast<size_t>(setting);
        result.name = forced->second;
        result.origin = TuneResult::Origin::kForced;
        return result;
    }
    if (setting == kDisabled) {
        result.index = 0;
        result.name = candidates[0].name;
        result.origin = TuneResult::Origin::kDisabled;
        return result;
    }

    // Reuse a decision only when every rank has it: a rank that would tune alone would wait forever
    // for the others at the first barrier.
    const auto cached = cached_decision(key);
    const int cached_idx = cached ? index_of(*cached) : -1;
    bool agreed = cached_idx >= 0;
    if (distributed) {
        for (double v : comm->all_gather(static_cast<double>(cached_idx))) agreed = agreed && v == cached_idx;
    }
    if (agreed) {
        result.index = static_cast<size_t>(cached_idx);
        result.name = *cached;
        result.origin = TuneResult::Origin::kCached;
        WEFT_LOG_DEBUG("autotune " << key.op << " [" << key.problem << "]: cached decision " << result.name);
        return result;
    }

    // Collective runs (fused cross-rank ops): every run starts once this rank's previous run has finished and
    // every rank has got there, so no rank's call overlaps a peer's earlier one (a rank running ahead would
    // leave kernels spinning on the peers' progress while they still run the previous call).
    const bool lockstep = distributed && options.collective_runs;
    TuneOptions run_options = options;
    if (lockstep) {
        run_options.rotate_inputs = [this, comm, &options](int iteration) {
            sync_(options.stream);
            comm->barrier();
            if (options.rotate_inputs) options.rotate_inputs(iteration);
        };
    }
    const int rank = comm ? comm->rank() : 0;
    // Progress (notice) from rank 0 only: every rank times alike.
    const LogLevel progress = rank == 0 ? LogLevel::kNotice : LogLevel::kInfo;
    WEFT_LOG(progress, "autotune " << key.op << " [" << key.problem << "]: timing " << candidates.size()
                                   << " candidates on " << num_ranks << " rank(s) (first use; the decision is cached)");
    const NvtxRange nvtx_tune(("autotune " + key.op).c_str());
    const auto tune_start = std::chrono::steady_clock::now();
    std::vector<std::vector<double>> times(candidates.size());
    for (size_t c = 0; c < candidates.size(); ++c) {
        const TuneCandidate& cand = candidates[c];
        if (comm) comm->barrier();
        // Host-side set-up first, agreed by every rank before anything of the candidate is launched anywhere:
        // a rank that cannot run it must not leave its peers' kernels waiting for work it never launches.
        bool prepared = true;
        if (cand.prepare) {
            try {
                cand.prepare();
            } catch (const std::exception& e) {
                prepared = false;
                WEFT_LOG_WARN("autotune " << key.op << ": candidate " << cand.name << " cannot be set up on rank "
                                          << rank << ": " << e.what());
            }
        }
        if (distributed) {
            for (double v : comm->all_gather(prepared ? 1.0 : 0.0)) prepared = prepared && v == 1.0;
        }
        double t = std::numeric_limits<double>::infinity();
        if (prepared) {
            try {
                t = measure_(cand, run_options);
            } catch (const std::exception& e) {
                if (lockstep) {
                    // Peers may be waiting on the device for work this rank did not launch: the session cannot
                    // go on to another candidate. Each rank reports its own view (the first error is here).
                    WEFT_FAIL("autotune " << key.op << " [" << key.problem << "]: candidate " << cand.name
                                          << " failed while running on rank " << rank << ": " << e.what()
                                          << "; tuning stops (its runs launch work that the other ranks wait for)");
                }
                WEFT_LOG_WARN("autotune " << key.op << ": candidate " << cand.name << " failed: " << e.what());
            }
        }
        times[c] = distributed ? comm->all_gather(t) : std::vector<double>{t};
        WEFT_CHECK(static_cast<int>(times[c].size()) == num_ranks,
                   "TuneComm::all_gather returned " << times[c].size() << " values for " << num_ranks << " ranks");
    }
    result.index = select_winner(times);
    result.name = candidates[result.index].name;
    result.origin = TuneResult::Origin::kTuned;
    std::ostringstream summary;
    for (size_t c = 0; c < candidates.size(); ++c) {
        double score = 0.0;
        for (double t : times[c]) score = usable(t) ? std::max(score, t) : std::numeric_limits<double>::infinity();
        result.times_ms.push_back(score);
        summary << " " << candidates[c].name << "=" << score << "ms";
    }
    WEFT_LOG_INFO("autotune " << key.op << " [" << key.problem << "] on " << num_ranks << " rank(s): " << result.name
                              << " wins;" << summary.str());
    WEFT_LOG(progress, "autotune " << key.op << ": " << result.name << " wins ("
                                   << result.times_ms[result.index] << " ms against " << result.times_ms[0]
                                   << " ms for the first candidate); tuned in "
                                   << format_duration(std::chrono::duration<double>(
                                                          std::chrono::steady_clock::now() - tune_start)
                                                          .count()));
    store_decision(key, result.name, result.times_ms[result.index]);
    return result;
}

Autotuner& autotuner() {
    static Autotuner* instance = new Autotuner(AutotuneConfig::from_env());
    return *instance;
}

}  // namespace weft::jit
