// SPDX-License-Identifier: MIT
// Private types and helpers shared by the runtime's source files (not installed, not part of the API).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "weft/common/diagnostics.hpp"
#include "weft/detail/team_math.hpp"
#include "weft/runtime/store.hpp"
#include "weft/runtime/symmetric_heap.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/world.hpp"

namespace weft::detail {

/// "rank 2" / "ranks 0, 1, 3" / "no rank".
std::string format_rank_list(const std::vector<int>& ranks);

/// Milliseconds left until `deadline` (at least 1, so that a final check still happens).
std::chrono::milliseconds remaining_ms(std::chrono::steady_clock::time_point deadline);

/// Makes `device` current for a scope and restores the previous device (errors are ignored: used in
/// destructors and deleters too).
class DeviceGuard {
public:
    explicit DeviceGuard(int device) {
        if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
            changed_ = cudaSetDevice(device) == cudaSuccess;
        }
    }
    ~DeviceGuard() {
        if (changed_) cudaSetDevice(previous_);
    }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;

private:
    int previous_ = -1;
    bool changed_ = false;
};

/// Launches one empty kernel on `stream` and synchronises it, once per CUDA context (the current one); later
/// calls for the same context return at once. Thread-safe: the first caller launches, the others wait for it.
/// Why (docs/runtime.md, "A context's first kernel launch"): with ranks sharing a GPU, the context's first
/// kernel launch could stay queued while another stream's kernel spun waiting for it. The World's
/// constructor calls it before its start-up exchange, so every rank of the process is past it before any
/// rank can launch an op.
void launch_first_kernel_of_context(cudaStream_t stream);

/// A non-blocking stream for the runtime's own small copies and memsets: unlike the legacy default stream
/// (and the per-thread stream, which syncs with it), it never waits for other ranks' kernels on a shared GPU.
class OwnedStream {
public:
    OwnedStream() = default;
    ~OwnedStream() { reset(); }
    OwnedStream(const OwnedStream&) = delete;
    OwnedStream& operator=(const OwnedStream&) = delete;
    /// Creates the stream on the current device.
    void create();
    void reset() noexcept;
    cudaStream_t get() const { return stream_; }

private:
    cudaStream_t stream_ = nullptr;
};

/// What every rank publishes about itself when the World starts.
struct RankInfo {
    std::string host;        ///< host name
    std::string pci_bus_id;  ///< of the rank's GPU, e.g. "0000:19:00.0"
    int device = -1;         ///< CUDA ordinal in that rank's process
    int64_t pid = 0;
};

/// Everything SymmetricHeap's construction needs from the World.
struct HeapSetup {
    int rank = 0;
    int num_ranks = 1;
    int device = 0;
    Store* store = nullptr;
    std::chrono::milliseconds timeout{10000};       ///< for collective alloc/free
    std::chrono::milliseconds init_timeout{60000};  ///< for the exchanges while the heap is built
    uint64_t bytes = 0;                             ///< already rounded to `granularity`, equal on every rank
    uint64_t granularity = 0;                       ///< equal on every rank
    bool same_process = true;                       ///< ranks are threads of this process (run_local)
    cudaStream_t stream = nullptr;                  ///< the World's internal stream (zeroing signal pads)
    std::string job_id;                             ///< random, shared by every rank
    std::vector<RankInfo> ranks;
};

/// How run_local / from_env describe the rank to World's constructor.
struct WorldSetup {
    int rank = 0;
    int num_ranks = 1;
    int local_rank = 0;
    int local_num_ranks = 1;
    int device_hint = 0;  ///< device = device_hint % visible devices unless options.device is set
    std::shared_ptr<Store> store;
    bool same_process = true;
    WorldOptions options;
};

/// Frees the pinned diagnostic record.
struct PinnedFree {
    void operator()(Diagnostic* p) const;
};

/// The World's state; teams point at it (a team must not outlive its World).
struct WorldContext {
    int rank = 0;
    int num_ranks = 1;
    int local_rank = 0;
    int local_num_ranks = 1;
    int device = 0;
    int sm_budget = 1;
    int num_ranks_on_device = 1;
    int max_ranks_per_device = 1;  ///< the most ranks any one GPU of the world hosts (the same on every rank)
    int shared_sm_budget = 1;      ///< the budget this rank would have on that GPU (World::shared_sm_budget)
    std::chrono::milliseconds timeout{10000};
    bool same_process = true;
    std::string job_id;
    std::vector<RankInfo> ranks;

    std::shared_ptr<Store> store;
    OwnedStream stream;  // declared before the heap and teams, which use it, so it is destroyed after them
    std::unique_ptr<SymmetricHeap> heap;
    std::unique_ptr<Diagnostic, PinnedFree> diag_host;
    Diagnostic* diag_device = nullptr;
    Team world_team;
    Team node_team;
    uint64_t barrier_seq = 0;

    std::mutex split_mutex;  // split_color sequence numbers, per team id
    std::map<std::string, uint64_t> split_seq;

    std::map<std::string, std::unique_ptr<WorldExtension>> extensions;  // destroyed before the heap
};

/// A team's shared state: members, this rank's place, and its device tables.
struct TeamState {
    WorldContext* world = nullptr;
    std::string id;  ///< identical on every member: names the team's store keys
    TeamMembers members;
    int rank = -1;
    bool is_world = false;
    std::shared_ptr<void> peer_table;  ///< device uint8_t*[size]
    std::shared_ptr<void> rank_table;  ///< device int32_t[size] (nullptr for the world team)

    /// Builds a team (allocating its device tables when this rank is a member).
    static Team make(WorldContext* world, TeamMembers members, std::string id, bool is_world);
};

std::unique_ptr<SymmetricHeap> make_symmetric_heap(const HeapSetup& setup);

/// The VMM allocation granularity of `device` for a heap (exportable: with POSIX descriptor handles).
uint64_t heap_granularity(int device, bool exportable);

/// 16 random hex digits (from the OS's random source).
std::string random_hex_id();

/// This host's name ("localhost" when it cannot be read).
std::string host_name();

/// With WEFT_TRACE set: gives `world` its trace buffer (its address into `diag_host`, where kernels find it).
void start_trace_if_asked(World& world, Diagnostic* diag_host);
/// Writes the trace of a World that traces to WEFT_TRACE's path (collective; errors are logged).
void finish_trace_at_shutdown(World& world) noexcept;

}  // namespace weft::detail
