// SPDX-License-Identifier: MIT
// The intra-kernel trace on the host: the per-rank device buffer (a World extension), the gather, the JSON writer.
#include "weft/runtime/trace.hpp"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <vector>

#include "runtime_internal.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/world.hpp"

namespace weft {

namespace {

constexpr const char* kExtensionName = "weft.trace";
constexpr uint32_t kDefaultCapacity = 262144;
// A rank's events travel to rank 0 as one store value (at most 64 MiB): up to `capacity` device events and as many
// copy and host events, 48 bytes each: 2 x 2^19 events are 48 MiB.
constexpr uint32_t kMaxCapacity = 1u << 19;
constexpr int kNumTraceRoles = 5;  // TraceRole's values

// Writes %globaltimer to *out: in PTX, so that the runtime needs no compiler of weft's (the driver compiles it).
constexpr char kTimerKernelPtx[] =
    ".version 7.0\n"
    ".target sm_75\n"
    ".address_size 64\n"
    ".visible .entry weft_read_globaltimer(.param .u64 out)\n"
    "{\n"
    "    .reg .b64 %rd<3>;\n"
    "    ld.param.u64 %rd1, [out];\n"
    "    cvta.to.global.u64 %rd2, %rd1;\n"
    "    mov.u64 %rd0, %globaltimer;\n"
    "    st.global.u64 [%rd2], %rd0;\n"
    "    ret;\n"
    "}\n";

/// Where CUDA event times fall on %globaltimer, and this host's clock against it, measured by one tiny kernel.
struct ClockCalibration {
    cudaEvent_t reference = nullptr;  ///< recorded half an event window before `globaltimer_ns`
    uint64_t globaltimer_ns = 0;
    int64_t host_minus_globaltimer_ns = 0;  ///< CLOCK_REALTIME - %globaltimer at the same moment
};

/// A copy timed with two CUDA events, resolved onto %globaltimer when the trace is taken.
struct PendingCopy {
    cudaEvent_t begin = nullptr, end = nullptr;
    uint16_t stream = 0;
    int32_t chunk = 0, peer = 0;
};

/// The rank's trace: its device buffer (the address is in the World's diagnostic record, where kernels find it),
/// the events timed on the host, and where the trace goes when the World is destroyed.
class Tracer final : public WorldExtension {
public:
    Tracer(std::string path, uint32_t capacity, Diagnostic* diag_host) : path_(std::move(path)), capacity_(capacity) {
        const uint64_t bytes = trace_buffer_bytes(capacity);
        WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&buffer_), bytes));
        WEFT_CUDA_CHECK(cudaMemset(buffer_, 0, bytes));  // a claimed slot never written reads as empty (kind 0)
        TraceBuffer header{};
        header.capacity = capacity;
        WEFT_CUDA_CHECK(cudaMemcpy(buffer_, &header, offsetof(TraceBuffer, events), cudaMemcpyHostToDevice));
        diag_host->trace_buffer = reinterpret_cast<uint64_t>(buffer_);
    }
    ~Tracer() override {
        for (const PendingCopy& c : copies_) {
            cudaEventDestroy(c.begin);
            cudaEventDestroy(c.end);
        }
        if (timer_library_ != nullptr) driver().cuLibraryUnload(timer_library_);
        if (timer_out_ != nullptr) cudaFree(timer_out_);
        if (buffer_ != nullptr) cudaFree(buffer_);
    }

    /// Two timing events for a copy (empty when this rank already holds `capacity` of them).
    TraceCopyEvents copy_events(uint16_t stream, int32_t chunk, int32_t peer) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (copies_.size() + host_events_.size() >= capacity_) {
            ++refused_;  // asked for and dropped: counted as the device buffer's overflow is
            return {};
        }
        PendingCopy c;
        c.stream = stream;
        c.chunk = chunk;
        c.peer = peer;
        WEFT_CUDA_CHECK(cudaEventCreate(&c.begin));
        if (cudaEventCreate(&c.end) != cudaSuccess) {
            cudaEventDestroy(c.begin);
            WEFT_FAIL("trace: cudaEventCreate failed");
        }
        copies_.push_back(c);
        return {c.begin, c.end};
    }

    const std::string& path() const { return path_; }

    /// This rank's events so far (device, then host), and empties both.
    detail::RankTrace take(int rank) {
        DeviceTrace d = read_device();
        empty_buffer(d.header);
        detail::RankTrace t;
        t.rank = rank;
        t.host = detail::host_name();
        t.events = std::move(d.events);
        t.recorded = d.recorded;
        const ClockCalibration clock = calibrate();
        t.clock_offset_ns = clock.host_minus_globaltimer_ns;  // rank 0 turns these into offsets against its clock
        std::lock_guard<std::mutex> lock(mutex_);
        uint64_t untimed = 0;
        for (const PendingCopy& c : copies_) {
            float begin_ms = 0, end_ms = 0;
            // A copy recorded during graph capture, or not run yet, has no time: it is left out (not a drop for
            // lack of room, so not in `recorded` either).
            const bool timed = cudaEventElapsedTime(&begin_ms, clock.reference, c.begin) == cudaSuccess &&
                               cudaEventElapsedTime(&end_ms, clock.reference, c.end) == cudaSuccess;
            cudaEventDestroy(c.begin);
            cudaEventDestroy(c.end);
            if (!timed) {
                ++untimed;
                continue;
            }
            ++t.recorded;
            TraceEvent e{};
            e.kind = static_cast<uint16_t>(TraceKind::kCopyChunk);
            e.role = static_cast<uint8_t>(TraceRole::kCopyEngine);
            e.sm = c.stream;
            e.begin_ns = clock.globaltimer_ns + static_cast<uint64_t>(static_cast<int64_t>(begin_ms * 1e6));
            e.end_ns = clock.globaltimer_ns + static_cast<uint64_t>(static_cast<int64_t>(end_ms * 1e6));
            e.args[0] = c.chunk;
            e.args[1] = c.peer;
            t.events.push_back(e);
        }
        copies_.clear();
        cudaEventDestroy(clock.reference);
        (void)cudaGetLastError();  // an elapsed-time query of an unrecorded event leaves its error behind
        t.events.insert(t.events.end(), host_events_.begin(), host_events_.end());
        t.recorded += host_events_.size() + refused_;
        host_events_.clear();
        refused_ = 0;
        if (untimed > 0) {
            WEFT_LOG_NOTICE("trace: rank " << rank << ": " << untimed
                                           << " copies had no time (recorded during graph capture, or not run yet) "
                                              "and are left out");
        }
        return t;
    }

    /// Events the buffer, the pending copies and the host events were asked to hold since the last take or discard.
    uint64_t count() {
        const DeviceTrace d = read_device();
        std::lock_guard<std::mutex> lock(mutex_);
        return d.recorded + copies_.size() + host_events_.size() + refused_;
    }

    /// Empties the device buffer, the pending copies and the host events; returns how many events they were asked to
    /// hold since the last take or discard.
    uint64_t discard() {
        const DeviceTrace d = read_device();
        empty_buffer(d.header);
        std::lock_guard<std::mutex> lock(mutex_);
        const uint64_t recorded = d.recorded + copies_.size() + host_events_.size() + refused_;
        for (const PendingCopy& c : copies_) {
            cudaEventDestroy(c.begin);
            cudaEventDestroy(c.end);
        }
        copies_.clear();
        host_events_.clear();
        refused_ = 0;
        return recorded;
    }

    void add(const TraceEvent& e) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (copies_.size() + host_events_.size() < capacity_) {
            host_events_.push_back(e);
        } else {
            ++refused_;
        }
    }

    uint64_t next_seq() { return seq_++; }

    /// Rank 0's writes (other ranks never write): whether any was made, and whether one went to WEFT_TRACE's own
    /// file (the same file, however the path was spelt).
    bool wrote_any() const { return wrote_any_; }
    bool wrote_env_path() const { return wrote_env_path_; }
    void wrote(const std::string& target) {
        wrote_any_ = true;
        std::error_code ec;
        if (std::filesystem::equivalent(target, path_, ec) && !ec) wrote_env_path_ = true;
    }

    TraceBuffer* device_buffer() const { return buffer_; }

private:
    /// The device buffer as the host reads it: its header, its events (the claimed slots below its capacity, empty
    /// ones removed) and how many events its writers recorded (the claims, less the slots blocks left empty).
    struct DeviceTrace {
        TraceBuffer header{};
        std::vector<TraceEvent> events;
        uint64_t recorded = 0;
    };

    /// Synchronises the device, then reads the buffer (DeviceTrace).
    DeviceTrace read_device() const {
        DeviceTrace d;
        WEFT_CUDA_CHECK(cudaDeviceSynchronize());
        WEFT_CUDA_CHECK(cudaMemcpy(&d.header, buffer_, offsetof(TraceBuffer, events), cudaMemcpyDeviceToHost));
        d.events.resize(static_cast<size_t>(std::min<uint64_t>(d.header.count, capacity_)));
        if (!d.events.empty()) {
            WEFT_CUDA_CHECK(cudaMemcpy(d.events.data(), buffer_->events, d.events.size() * sizeof(TraceEvent),
                                       cudaMemcpyDeviceToHost));
        }
        // Slots a block claimed and left empty (kind 0: weft/device/trace.cuh's block log) are no events.
        const uint64_t unused = detail::drop_empty_trace_events(d.events) + d.header.unused_past_capacity;
        d.recorded = d.header.count - std::min<uint64_t>(d.header.count, unused);
        return d;
    }

    /// Zeroes the claimed slots (so that a slot claimed by a block that ended before writing it, a failed wait's
    /// exit, reads as empty next time) and the counters. The device is idle (the callers synchronised it).
    void empty_buffer(const TraceBuffer& header) {
        const uint64_t used = std::min<uint64_t>(header.count, capacity_);
        if (used > 0) WEFT_CUDA_CHECK(cudaMemset(buffer_->events, 0, static_cast<size_t>(used) * sizeof(TraceEvent)));
        static_assert(offsetof(TraceBuffer, unused_past_capacity) == offsetof(TraceBuffer, count) + 8);
        WEFT_CUDA_CHECK(cudaMemset(&buffer_->count, 0, 2 * sizeof(unsigned long long)));
        WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    }

    /// Runs the timer kernel between two timing events on a stream of its own (a few times; the tightest window
    /// counts): the reference event lies half a window before the %globaltimer it read, and the host's clock, read
    /// around it, gives CLOCK_REALTIME - %globaltimer.
    ClockCalibration calibrate() {
        const DriverApi& api = driver();
        if (timer_library_ == nullptr) {
            WEFT_CU_CHECK(api.cuLibraryLoadData(&timer_library_, kTimerKernelPtx, nullptr, nullptr, 0, nullptr,
                                                nullptr, 0));
            CUkernel kernel = nullptr;
            WEFT_CU_CHECK(api.cuLibraryGetKernel(&kernel, timer_library_, "weft_read_globaltimer"));
            WEFT_CU_CHECK(api.cuKernelGetFunction(&timer_fn_, kernel));
            WEFT_CUDA_CHECK(cudaMalloc(&timer_out_, sizeof(uint64_t)));
        }
        cudaStream_t stream = nullptr;
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        ClockCalibration best;
        double best_window_ms = 1e30;
        for (int attempt = 0; attempt < 5; ++attempt) {
            cudaEvent_t before = nullptr, after = nullptr;
            WEFT_CUDA_CHECK(cudaEventCreate(&before));
            WEFT_CUDA_CHECK(cudaEventCreate(&after));
            const auto host0 = std::chrono::system_clock::now();
            WEFT_CUDA_CHECK(cudaEventRecord(before, stream));
            void* args[] = {&timer_out_};
            WEFT_CU_CHECK(api.cuLaunchKernel(timer_fn_, 1, 1, 1, 1, 1, 1, 0, reinterpret_cast<CUstream>(stream), args,
                                             nullptr));
            WEFT_CUDA_CHECK(cudaEventRecord(after, stream));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
            const auto host1 = std::chrono::system_clock::now();
            uint64_t gt = 0;
            WEFT_CUDA_CHECK(cudaMemcpy(&gt, timer_out_, sizeof(gt), cudaMemcpyDeviceToHost));
            float window_ms = 0;
            WEFT_CUDA_CHECK(cudaEventElapsedTime(&window_ms, before, after));
            cudaEventDestroy(after);
            if (window_ms >= best_window_ms) {
                cudaEventDestroy(before);
                continue;
            }
            if (best.reference != nullptr) cudaEventDestroy(best.reference);
            best_window_ms = window_ms;
            best.reference = before;
            best.globaltimer_ns = gt - static_cast<uint64_t>(window_ms * 0.5e6);
            const int64_t host_mid_ns =
                std::chrono::duration_cast<std::chrono::nanoseconds>(host0.time_since_epoch()).count() / 2 +
                std::chrono::duration_cast<std::chrono::nanoseconds>(host1.time_since_epoch()).count() / 2;
            best.host_minus_globaltimer_ns = host_mid_ns - static_cast<int64_t>(gt);
        }
        cudaStreamDestroy(stream);
        return best;
    }

    CUlibrary timer_library_ = nullptr;
    CUfunction timer_fn_ = nullptr;
    void* timer_out_ = nullptr;
    std::vector<PendingCopy> copies_;
    std::string path_;
    uint32_t capacity_;
    TraceBuffer* buffer_ = nullptr;
    std::mutex mutex_;
    std::vector<TraceEvent> host_events_;
    uint64_t refused_ = 0;  // copies and host events asked for while full (guarded by mutex_)
    uint64_t seq_ = 0;
    bool wrote_any_ = false;
    bool wrote_env_path_ = false;
};

Tracer* find_tracer(const World& world) { return dynamic_cast<Tracer*>(world.find_extension(kExtensionName)); }

void put_bytes(Bytes& out, const void* data, size_t bytes) {
    const size_t at = out.size();
    out.resize(at + bytes);
    if (bytes > 0) std::memcpy(out.data() + at, data, bytes);
}

template <class T>
void put(Bytes& out, const T& v) {
    put_bytes(out, &v, sizeof(T));
}

template <class T>
T get(const Bytes& in, size_t& at) {
    WEFT_CHECK(at + sizeof(T) <= in.size(), "trace: a rank's blob is truncated (" << in.size() << " bytes)");
    T v;
    std::memcpy(&v, in.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
}

void json_string(std::ostream& os, std::string_view s) {
    os << '"';
    for (char c : s) {
        if (c == '"' || c == '\\') {
            os << '\\' << c;
        } else if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\u%04x", c);
            os << buf;
        } else {
            os << c;
        }
    }
    os << '"';
}

/// Microseconds with nanosecond digits: "12.345".
std::string micros(int64_t ns) {
    char buf[40];
    std::snprintf(buf, sizeof(buf), "%lld.%03lld", static_cast<long long>(ns / 1000),
                  static_cast<long long>(ns % 1000 < 0 ? -(ns % 1000) : ns % 1000));
    return buf;
}

}  // namespace

std::optional<std::string> trace_path_from_env() {
    auto v = env::get("WEFT_TRACE");
    if (!v || v->empty()) return std::nullopt;
    return v;
}

uint32_t trace_capacity_from_env() {
    const auto v = env::get_int("WEFT_TRACE_EVENTS");
    if (!v) return kDefaultCapacity;
    WEFT_CHECK(*v >= 1 && *v <= kMaxCapacity,
               "WEFT_TRACE_EVENTS must be in [1, "
                   << kMaxCapacity << "] events (a rank's trace is sent as one store value), got " << *v);
    return static_cast<uint32_t>(*v);
}

bool tracing(const World& world) { return find_tracer(world) != nullptr; }

void add_trace_event(World& world, const TraceEvent& event) {
    if (Tracer* t = find_tracer(world)) t->add(event);
}

uint64_t discard_trace(World& world) {
    Tracer* t = find_tracer(world);
    if (t == nullptr) return 0;
    const detail::DeviceGuard guard(world.device());
    return t->discard();
}

TraceBuffer* trace_device_buffer(const World& world) {
    const Tracer* t = find_tracer(world);
    return t == nullptr ? nullptr : t->device_buffer();
}

uint64_t trace_event_count(World& world) {
    Tracer* t = find_tracer(world);
    if (t == nullptr) return 0;
    const detail::DeviceGuard guard(world.device());
    return t->count();
}

TraceCopyEvents trace_copy_events(World& world, uint16_t stream_idx, int32_t chunk, int32_t peer) {
    Tracer* t = find_tracer(world);
    return t == nullptr ? TraceCopyEvents{} : t->copy_events(stream_idx, chunk, peer);
}

namespace {

// Rank 0's part of write_trace: every rank's blob (empty: that rank's events could not be read) into one file at
// `path`.
void write_gathered_trace(const std::vector<Bytes>& all, const std::string& path) {
    std::vector<detail::RankTrace> ranks;
    std::vector<int> missing;
    uint64_t dropped = 0, kept = 0;
    for (size_t r = 0; r < all.size(); ++r) {
        if (all[r].empty()) {
            missing.push_back(static_cast<int>(r));
            continue;
        }
        ranks.push_back(detail::decode_rank_trace(all[r]));
        kept += ranks.back().events.size();
        dropped += ranks.back().recorded - ranks.back().events.size();
    }
    detail::align_rank_clocks(ranks);
    const std::string json = detail::chrome_trace_json(ranks);
    const std::filesystem::path target(path);
    // A name of this write's own (two Worlds, or two jobs, writing the same path do not interleave), complete on
    // disk before the rename makes it the trace.
    static std::atomic<uint64_t> writes{0};
    const std::filesystem::path tmp =
        target.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(writes.fetch_add(1));
    {
        std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
        out << json;
        out.close();
        if (out.fail()) {
            std::error_code ignored;
            std::filesystem::remove(tmp, ignored);
            WEFT_FAIL("write_trace: cannot write " << tmp.string());
        }
    }
    std::error_code ec;
    std::filesystem::rename(tmp, target, ec);
    if (ec) {
        std::error_code ignored;
        std::filesystem::remove(tmp, ignored);
        WEFT_FAIL("write_trace: cannot rename " << tmp.string() << " to " << path << ": " << ec.message());
    }
    WEFT_LOG_NOTICE("trace: " << kept << " events of " << ranks.size() << " rank(s) written to " << path);
    if (dropped > 0) {  // a timeline with holes: said at warn, which a quieted job still prints
        WEFT_LOG_WARN("trace: " << dropped << " events were dropped (the buffers were full; their ranks' names in "
                                << path << " say how many): raise WEFT_TRACE_EVENTS");
    }
    if (!missing.empty()) {
        WEFT_LOG_WARN("trace: the events of " << detail::format_rank_list(missing)
                                              << " could not be read there and are not in " << path);
    }
}

// How long rank 0 waits for a key the store says it holds, when it writes what it can read after a rank was late.
constexpr std::chrono::milliseconds kSalvageGet{1000};

// Whether a gathered blob holds events: recorded ones (kept or dropped) or a rank that could not be read (empty).
bool records_anything(const Bytes& blob) { return blob.empty() || detail::decode_rank_trace(blob).recorded > 0; }

// Where rank 0's write at shutdown goes: WEFT_TRACE's path, unless a write_trace of the program already wrote that
// file (it is kept; what came after goes beside it, "t.json" -> "t.at_exit.json").
std::string shutdown_path(const std::string& path, bool wrote_env_path) {
    if (!wrote_env_path) return path;
    std::filesystem::path p(path);
    const std::string ext = p.extension().string();
    return p.replace_extension().string() + ".at_exit" + (ext.empty() ? std::string(".json") : ext);
}

void write_trace(World& world, const std::string& path, bool at_shutdown) {
    Tracer* tracer = find_tracer(world);
    WEFT_CHECK(tracer != nullptr, "write_trace: this World records no trace (set WEFT_TRACE=path before making it)");
    WEFT_CHECK(!path.empty(), "write_trace: the path must not be empty");
    const detail::DeviceGuard guard(world.device());
    // Every rank sends its events, also one whose events cannot be read (a failed kernel left its context unusable):
    // it sends an empty blob, so rank 0 neither waits for it nor falls out of step with its next trace.
    const uint64_t seq = tracer->next_seq();
    Bytes blob;
    std::string failed;
    try {
        blob = detail::encode_rank_trace(tracer->take(world.rank()));
    } catch (const std::exception& e) {
        failed = e.what();
        blob.clear();
    }
    // A gather to rank 0, the one that writes: each rank sets its key and goes on; rank 0 reads and erases them (an
    // all-gather would send every rank every rank's events: N^2 copies of up to tens of MiB).
    // Every rank's take() synchronised its device; ranks that share a GPU share its context, so one rank's sync waits
    // for the kernels its peers launch meanwhile, which may wait for this rank's next launch: no rank leaves before
    // rank 0 has every rank's events (or gave up on the late ones), which each rank sends after its take().
    const std::string prefix = "weft/trace/" + std::to_string(seq) + "/";
    const std::string gathered = prefix + "gathered";
    if (world.rank() != 0) {
        world.store().set(prefix + std::to_string(world.rank()), blob);
        try {
            world.store().get(gathered, world.timeout());
            // The last rank to leave erases the key (rank 0 set it for the others, after its gather).
            if (world.store().add(prefix + "left", 1) == world.num_ranks() - 1) {
                world.store().erase(gathered);
                world.store().erase(prefix + "left");
            }
        } catch (const std::exception& e) {
            WEFT_LOG_WARN("trace: rank 0 did not finish gathering the events of write_trace #"
                          << seq << " within the timeout (" << world.timeout().count() << " ms; " << e.what()
                          << "); this rank's were sent, and it goes on");
        }
        WEFT_CHECK(failed.empty(), "write_trace: this rank's events could not be read: " << failed);
        return;
    }
    const auto deadline = std::chrono::steady_clock::now() + world.timeout();
    std::vector<Bytes> all{blob};
    all.resize(static_cast<size_t>(world.num_ranks()));
    std::vector<int> late;
    std::string late_error;
    for (int r = 1; r < world.num_ranks(); ++r) {
        const std::string key = prefix + std::to_string(r);
        try {
            // After one rank was late, only the events already there: a store that no longer answers, or ranks that
            // are gone, cost a second each, not the timeout each.
            if (late.empty()) {
                all[static_cast<size_t>(r)] = world.store().get(key, detail::remaining_ms(deadline));
            } else if (world.store().check(key)) {
                all[static_cast<size_t>(r)] = world.store().get(key, kSalvageGet);
            } else {
                late.push_back(r);
                continue;
            }
        } catch (const std::exception& e) {  // an aborted World's store, or a store of the user's: any std::exception
            if (late.empty()) late_error = e.what();
            late.push_back(r);
            continue;
        }
        try {
            world.store().erase(key);  // its events are read: an erase that fails leaves a key, not a late rank
        } catch (const std::exception&) {
        }
    }
    if (world.num_ranks() > 1) {
        try {
            world.store().set(gathered, Bytes{});  // the other ranks may go on (above)
        } catch (const std::exception&) {          // an aborted World's store: the others' waits end with it
        }
    }
    std::string target = path;
    if (at_shutdown) {
        if (tracer->wrote_any() && late.empty() && std::none_of(all.begin(), all.end(), records_anything)) {
            WEFT_LOG_INFO("trace: nothing recorded since the last write_trace; no trace written at shutdown");
            return;
        }
        target = shutdown_path(path, tracer->wrote_env_path());
    }
    if (!late.empty()) {
        // A rank that is gone (or hangs) does not cost the others' events: rank 0 writes those it has, and the trace
        // names the ranks it lacks.
        WEFT_LOG_WARN(
            "trace: " << detail::format_rank_list(late) << " did not send their events within the timeout ("
                      << world.timeout().count() << " ms; " << late_error << ")"
                      << (failed.empty() ? std::string() : "; this rank's own events could not be read: " + failed)
                      << "; writing the events at hand");
    }
    write_gathered_trace(all, target);
    tracer->wrote(target);
    WEFT_CHECK(late.empty(), "write_trace: " << detail::format_rank_list(late)
                                             << " did not send their events within the timeout ("
                                             << world.timeout().count() << " ms): " << late_error);
    WEFT_CHECK(failed.empty(), "write_trace: this rank's events could not be read: " << failed);
}

}  // namespace

void write_trace(World& world, const std::string& path) { write_trace(world, path, /*at_shutdown=*/false); }

namespace detail {

void start_trace_if_asked(World& world, Diagnostic* diag_host) {
    const auto path = trace_path_from_env();
    if (!path) return;
    const uint32_t capacity = trace_capacity_from_env();
    if (world.rank() == 0) {
        // Rank 0 writes the file when the World ends: a folder it cannot write into is said now, not after the run.
        std::error_code ec;
        const std::filesystem::path folder = std::filesystem::absolute(*path, ec).parent_path();
        if (ec || !std::filesystem::is_directory(folder, ec) || ::access(folder.c_str(), W_OK) != 0) {
            WEFT_LOG_WARN("trace: WEFT_TRACE=" << *path << ": cannot write into " << folder.string()
                                               << " (missing or not writable): the trace will be lost at the end "
                                                  "unless write_trace is given another path");
        }
    }
    world.add_extension(kExtensionName, std::make_unique<Tracer>(*path, capacity, diag_host));
    WEFT_LOG_INFO("trace: recording up to " << capacity << " events per rank; written to " << *path
                                            << " when the World is destroyed");
}

void finish_trace_at_shutdown(World& world) noexcept {
    Tracer* tracer = find_tracer(world);
    if (tracer == nullptr) return;
    try {
        write_trace(world, tracer->path(), /*at_shutdown=*/true);
    } catch (const std::exception& e) {
        WEFT_LOG_ERROR("trace: writing " << tracer->path() << " failed: " << e.what());
    }
}

void align_rank_clocks(std::vector<RankTrace>& ranks) {
    if (ranks.empty()) return;
    const std::string host0 = ranks[0].host;
    const int64_t ref = ranks[0].clock_offset_ns;
    for (RankTrace& r : ranks) {
        r.clock_offset_ns = r.host == host0 ? 0 : r.clock_offset_ns - ref;
    }
}

Bytes encode_rank_trace(const RankTrace& t) {
    Bytes out;
    out.reserve(64 + t.host.size() + t.events.size() * sizeof(TraceEvent));
    put(out, uint32_t{0x57545243});  // "WTRC"
    put(out, t.rank);
    put(out, static_cast<uint32_t>(t.host.size()));
    put_bytes(out, t.host.data(), t.host.size());
    put(out, t.clock_offset_ns);
    put(out, t.recorded);
    put(out, static_cast<uint64_t>(t.events.size()));
    put_bytes(out, t.events.data(), t.events.size() * sizeof(TraceEvent));
    return out;
}

RankTrace decode_rank_trace(const Bytes& in) {
    size_t at = 0;
    WEFT_CHECK(get<uint32_t>(in, at) == 0x57545243, "trace: a rank's blob does not start with the trace magic");
    RankTrace t;
    t.rank = get<int32_t>(in, at);
    const auto host_bytes = get<uint32_t>(in, at);
    WEFT_CHECK(at + host_bytes <= in.size(), "trace: a rank's blob is truncated in its host name");
    t.host.assign(reinterpret_cast<const char*>(in.data() + at), host_bytes);
    at += host_bytes;
    t.clock_offset_ns = get<int64_t>(in, at);
    t.recorded = get<uint64_t>(in, at);
    const auto n = get<uint64_t>(in, at);
    WEFT_CHECK(n <= (in.size() - at) / sizeof(TraceEvent) && at + n * sizeof(TraceEvent) == in.size(),
               "trace: rank " << t.rank << "'s blob holds " << in.size() - at << " event bytes, not " << n
                              << " events of " << sizeof(TraceEvent));
    t.events.resize(n);
    if (n > 0) std::memcpy(t.events.data(), in.data() + at, n * sizeof(TraceEvent));
    return t;
}

uint64_t drop_empty_trace_events(std::vector<TraceEvent>& events) {
    return static_cast<uint64_t>(std::erase_if(events, [](const TraceEvent& e) { return e.kind == 0; }));
}

std::string trace_event_name(const TraceEvent& e) {
    switch (static_cast<TraceKind>(e.kind)) {
        case TraceKind::kWaitChunk:
            if (e.args[1] > e.args[0]) return "wait chunks " + std::to_string(e.args[0]) + "-" + std::to_string(e.args[1]);
            return "wait chunk " + std::to_string(e.args[0]);
        case TraceKind::kTile: return "tile (" + std::to_string(e.args[0]) + ", " + std::to_string(e.args[1]) + ")";
        case TraceKind::kCopyChunk: return "copy chunk " + std::to_string(e.args[0]);
        case TraceKind::kNotify: return "notify";
        case TraceKind::kReduce: return "reduce";
        case TraceKind::kWaitPeers: return "wait peers";
        case TraceKind::kWaitPeer: return "wait peer " + std::to_string(e.args[0]);
        case TraceKind::kPushChunk:
            if (e.args[1] < 0) return "push chunk " + std::to_string(e.args[0]);
            return "push chunk " + std::to_string(e.args[0]) + " to " + std::to_string(e.args[1]);
        case TraceKind::kPullChunk:
            return "pull chunk " + std::to_string(e.args[0]) + " from " + std::to_string(e.args[1]);
        case TraceKind::kStage: return "stage chunk " + std::to_string(e.args[0]);
        case TraceKind::kSend: return e.args[0] < 0 ? std::string("send") : "send to " + std::to_string(e.args[0]);
        case TraceKind::kRecv: return e.args[0] < 0 ? std::string("recv") : "recv from " + std::to_string(e.args[0]);
        case TraceKind::kLayout: return "layout";
        case TraceKind::kCombine: return "combine";
    }
    return "event " + std::to_string(e.kind);
}

std::string trace_track_name(uint16_t sm, uint8_t role) {
    switch (static_cast<TraceRole>(role)) {
        case TraceRole::kProducer: return "SM " + std::to_string(sm) + " producer";
        case TraceRole::kConsumer0: return "SM " + std::to_string(sm) + " consumer 0";
        case TraceRole::kConsumer1: return "SM " + std::to_string(sm) + " consumer 1";
        case TraceRole::kComm: return "SM " + std::to_string(sm) + " comm";
        case TraceRole::kCopyEngine: return "copy engine " + std::to_string(sm);
    }
    return "SM " + std::to_string(sm) + " role " + std::to_string(role);
}

std::string chrome_trace_json(const std::vector<RankTrace>& ranks) {
    int64_t t0 = std::numeric_limits<int64_t>::max();
    for (const RankTrace& r : ranks) {
        for (const TraceEvent& e : r.events) t0 = std::min(t0, static_cast<int64_t>(e.begin_ns) + r.clock_offset_ns);
    }
    if (t0 == std::numeric_limits<int64_t>::max()) t0 = 0;
    std::ostringstream os;
    os << "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[";
    bool first = true;
    const auto sep = [&] {
        os << (first ? "\n" : ",\n");
        first = false;
    };
    for (const RankTrace& r : ranks) {
        sep();
        os << "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" << r.rank << ",\"args\":{\"name\":";
        const uint64_t dropped = r.recorded > r.events.size() ? r.recorded - r.events.size() : 0;
        json_string(os, "rank " + std::to_string(r.rank) + " (" + r.host +
                            (dropped > 0 ? "; " + std::to_string(dropped) + " events dropped" : std::string()) + ")");
        os << "}}";
        sep();
        os << "{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":" << r.rank
           << ",\"args\":{\"sort_index\":" << r.rank << "}}";
        // One track per (SM, role), sorted by SM then role; copy engines last.
        std::map<int, std::pair<uint16_t, uint8_t>> tracks;
        for (const TraceEvent& e : r.events) {
            const int tid = (e.role == static_cast<uint8_t>(TraceRole::kCopyEngine) ? 1 << 20 : 0) +
                            e.sm * kNumTraceRoles + e.role;
            tracks.emplace(tid, std::make_pair(e.sm, e.role));
        }
        for (const auto& [tid, track] : tracks) {
            sep();
            os << "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" << r.rank << ",\"tid\":" << tid
               << ",\"args\":{\"name\":";
            json_string(os, trace_track_name(track.first, track.second));
            os << "}}";
            sep();
            os << "{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":" << r.rank << ",\"tid\":" << tid
               << ",\"args\":{\"sort_index\":" << tid << "}}";
        }
        for (const TraceEvent& e : r.events) {
            const int tid = (e.role == static_cast<uint8_t>(TraceRole::kCopyEngine) ? 1 << 20 : 0) +
                            e.sm * kNumTraceRoles + e.role;
            const int64_t begin = static_cast<int64_t>(e.begin_ns) + r.clock_offset_ns - t0;
            const int64_t dur = e.end_ns >= e.begin_ns ? static_cast<int64_t>(e.end_ns - e.begin_ns) : 0;
            sep();
            os << "{\"ph\":\"X\",\"name\":";
            json_string(os, trace_event_name(e));
            os << ",\"cat\":\"weft\",\"pid\":" << r.rank << ",\"tid\":" << tid << ",\"ts\":" << micros(begin)
               << ",\"dur\":" << micros(dur) << ",\"args\":{\"kind\":" << e.kind << ",\"block\":" << e.block
               << ",\"args\":[" << e.args[0] << "," << e.args[1] << "," << e.args[2] << "," << e.args[3]
               << "],\"begin_ns\":" << e.begin_ns << ",\"end_ns\":" << e.end_ns << "}}";
        }
    }
    os << "\n]}\n";
    return os.str();
}

}  // namespace detail

}  // namespace weft
