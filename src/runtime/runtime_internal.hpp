// SPDX-License-Identifier: MIT
// Private types and helpers shared by the runtime's source files (not installed, not part of the API).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "weft/common/diagnostics.hpp"
#include "weft/detail/node_topology.hpp"
#include "weft/detail/team_math.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/store.hpp"
#include "weft/runtime/symmetric_heap.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/world.hpp"

namespace weft::detail {

/// "rank 2" / "ranks 0, 1, 3" / "no rank".
std::string format_rank_list(const std::vector<int>& ranks);

/// Store::all_gather among a team's members under the full store key `name`: `team_rank` is this rank's index
/// in `members` (world ranks). A failure (the timeout) is rethrown as a weft::Error that names the team ranks
/// that did not arrive and their world ranks, then the store's message.
std::vector<Bytes> team_all_gather(Store& store, const std::string& name, const TeamMembers& members, int team_rank,
                                   const Bytes& blob, std::chrono::milliseconds timeout);
/// Store::barrier among a team's members, with team_all_gather's errors.
void team_barrier(Store& store, const std::string& name, const TeamMembers& members, int team_rank,
                  std::chrono::milliseconds timeout);
/// "world ranks 0, 1, 2, 3" (format_rank_list with "world ").
std::string format_world_ranks(const std::vector<int>& world_ranks);

/// Where rank 0 puts its number of ranks at a World's start (erased once every rank has read it).
inline constexpr const char* kWorldSizeKey = "weft/init/num_ranks";
/// Rank 0 publishes its number of ranks, the others compare theirs with it before the start-up exchange: that exchange
/// (Store::all_gather) counts arrivals against each rank's own number, so ranks that disagree (a stale WORLD_SIZE, a
/// WorldMembership::num_ranks of another job) would let each other out early and fail later naming the wrong cause.
/// Throws on a rank whose number differs, naming both, or when rank 0 does not come within `timeout`.
void agree_on_world_size(Store& store, int rank, int num_ranks, std::chrono::milliseconds timeout);
/// What a rank that disagreed on the size left for the others (agree_on_world_size), naming it and both sizes; ""
/// when none did (or the store cannot say).
std::string world_size_disagreement(Store& store, int num_ranks);
/// Runs a start-up exchange of every rank (after agree_on_world_size); when it fails and a rank that disagreed on the
/// size left its note, throws that instead (naming `rank`, the exchange's own error appended): that, not the rank's
/// absence, is the cause.
template <class Exchange>
auto start_exchange(Store& store, int rank, int num_ranks, Exchange&& exchange) -> decltype(exchange()) {
    try {
        return exchange();
    } catch (const std::exception& e) {
        const std::string disagreement = world_size_disagreement(store, num_ranks);
        if (disagreement.empty()) throw;
        WEFT_FAIL("rank " << rank << ": " << disagreement << " [" << e.what() << "]");
    }
}

/// Processes of one job start seconds apart (context creation on a shared GPU is slow): the start-up exchanges wait at
/// least this long, whatever WEFT_TIMEOUT_MS says.
inline constexpr std::chrono::milliseconds kMinInitTimeout{60000};

/// Milliseconds left until `deadline` (at least 1, so that a final check still happens).
std::chrono::milliseconds remaining_ms(std::chrono::steady_clock::time_point deadline);
/// Whether a store get that was given `asked` (from `get_start`) and threw ended well before that time ran out (the
/// store failed, or the World was aborted) rather than by timing out: in under half of it.
bool ended_early(std::chrono::steady_clock::time_point get_start, std::chrono::milliseconds asked);

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
    std::string node;        ///< node label: the host name, plus "/vnode<i>" with virtual nodes (node_topology.hpp)
    std::string pci_bus_id;  ///< of the rank's GPU, e.g. "0000:19:00.0"
    int device = -1;         ///< CUDA ordinal in that rank's process
    int64_t pid = 0;
    std::string pid_namespace;  ///< "pid:[...]" of its process, "" when unknown: its pid means something only here
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
    /// Why the heap's start-up waits outside the store (the descriptor exchange's sockets) should end now, or
    /// empty (WorldContext::startup_wait_stop); may be unset.
    std::function<std::optional<std::string>()> stop_reason;
};

/// How run_local / from_env describe the rank to World's constructor.
struct WorldSetup {
    int rank = 0;
    int num_ranks = 1;
    int local_rank = 0;
    int local_num_ranks = 1;
    int device_hint = 0;  ///< device = device_hint % visible devices unless options.device is set
    std::shared_ptr<Store> store;
    /// A second connection to the same store for the World's watchdog (so that its beats never queue behind a
    /// blocking call of the rank's thread on a client that serialises calls), or null: the watchdog shares `store`
    /// (an in-process store, or a store of the user's, which must serve concurrent calls).
    std::function<std::shared_ptr<Store>()> connect_watchdog_store;
    bool same_process = true;
    WorldOptions options;
};

/// Frees the pinned diagnostic record and the pinned abort word.
struct PinnedFree {
    void operator()(Diagnostic* p) const;
    void operator()(uint32_t* p) const;
};

struct WorldContext;

/// A World's watchdog: one thread that, every heartbeat, beats (sets this rank's heartbeat key), checks the peers
/// it watches (detail::watched_peers) and every peer process of this host, applies the abort records other ranks
/// published, and publishes this rank's own abort (a device wait that gave up, World::abort, a dead peer). Made
/// when the World has more than one rank, after its start-up; stopped by the World's shutdown.
class Watchdog {
public:
    Watchdog(WorldContext* world, std::shared_ptr<Store> store);
    ~Watchdog();
    Watchdog(const Watchdog&) = delete;
    Watchdog& operator=(const Watchdog&) = delete;

    /// Publishes an abort record (detail::encode_abort_record) for every other rank; false when the store failed.
    /// `keep`: the record stays in the store after stop() (a rank that leaves while its peers may still be in a call
    /// with it: they read it after this rank is gone).
    bool publish(char kind, const std::string& reason, bool keep = false) noexcept;
    /// Reads the abort records the other ranks published since the last read, now (not at the next beat), and
    /// applies them to the World. For a call that cannot tell by itself whether a peer left before its result was
    /// complete (a network operation that NCCL ends when the peer closes its connection). Does nothing once stopped.
    void read_records_now() noexcept;
    /// Stops and joins the thread, then removes this rank's heartbeat key and the abort records it published
    /// (`last_out`: and the records' index), except those published with `keep`. Idempotent.
    void stop(bool last_out) noexcept;

private:
    void run();
    void beat();
    void read_records();  // with records_mutex_ held; throws what the store throws

    WorldContext* world_;
    std::shared_ptr<Store> store_;  // thread-safe (the Store contract): no lock is held across its calls
    // Guards stop_, stopped_, publishing_, published_ and kept_; never held during a store call, so that an abort
    // published from another thread does not wait behind the watchdog's store I/O.
    std::mutex mutex_;
    std::condition_variable wake_;  // the thread's sleep between beats (stop_)
    std::condition_variable idle_;  // publishing_ reached 0 (stop() waits for publishes in flight)
    bool stop_ = false;
    bool stopped_ = false;
    int publishing_ = 0;  ///< publish() calls between their check of stopped_ and their record's bookkeeping
    std::vector<int64_t> published_;       ///< indices of the records this rank wrote
    std::vector<int64_t> kept_;            ///< those of them that stay after stop()
    std::mutex records_mutex_;             // guards seen_records_ and unread_records_ (read_records)
    int64_t seen_records_ = 0;             ///< abort record indices looked at so far (1 .. seen_records_)
    std::vector<int64_t> unread_records_;  ///< of those, the ones whose record was not there (yet, or any more)
    int64_t beats_ = 0;                    ///< the thread's (and the constructor's) only
    std::thread thread_;
};

/// The World's state; teams point at it (a team must not outlive its World).
struct WorldContext {
    World* owner = nullptr;  ///< the World this is the state of (Team::world)
    int rank = 0;
    int num_ranks = 1;
    int local_rank = 0;
    int local_num_ranks = 1;
    int device = 0;
    int sm_budget = 1;
    int num_ranks_on_device = 1;
    int max_ranks_per_device = 1;  ///< the most ranks any one GPU of the world hosts (the same on every rank)
    int virtual_nodes = 1;         ///< WorldOptions::virtual_nodes, resolved
    int node = 0;                  ///< this rank's node (World::node)
    int num_nodes = 1;
    int shared_sm_budget = 1;  ///< the budget this rank would have on that GPU (World::shared_sm_budget)
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

    // Every team's device tables (peer table, rank table or null), kept until shutdown: kernels launched with a
    // team's DeviceCtx may still read them after the Team object that made them is gone. Keyed by what they hold
    // (world team or not, the trace buffer's address, the members): a split made again takes the tables it made.
    std::mutex team_tables_mutex;
    std::map<std::vector<int64_t>, std::pair<std::shared_ptr<void>, std::shared_ptr<void>>> team_tables;

    std::mutex split_mutex;  // split_color sequence numbers, per team id
    std::map<std::string, uint64_t> split_seq;
    std::mutex team_mutex;  // Team::barrier / all_gather sequence numbers, per team id (and key)
    std::map<std::string, uint64_t> team_seq;

    std::map<std::string, std::unique_ptr<WorldExtension>> extensions;  // destroyed before the heap

    // Late and dead peers (docs/reliability.md, "Late and dead peers").
    std::unique_ptr<uint32_t, PinnedFree> abort_host;  ///< the abort word (an AbortCode), host-mapped
    uint32_t* abort_device = nullptr;                  ///< its device address (DeviceCtx::abort_flag)
    std::chrono::milliseconds heartbeat{1000};
    std::chrono::milliseconds dead_peer{10000};
    std::atomic<bool> shutting_down{false};  ///< store waits then stop only for a dead peer
    /// Between the start-up exchange and the end of the World's construction: store waits also stop once a rank
    /// publishes that its construction failed (kStartupFailedKey), naming it, instead of running to the timeout.
    std::atomic<bool> starting{false};
    /// A start-up wait of this rank was stopped by a peer's kStartupFailedKey: this rank's failure is that peer's,
    /// not its own to publish.
    mutable std::atomic<bool> startup_stopped_by_peer{false};
    /// std::uncaught_exceptions() when the World was made: more at its destruction means an exception propagates
    /// through it (a World made and destroyed inside cleanup that runs during unwinding is not leaving on an error).
    int uncaught_at_creation = 0;
    std::atomic<bool> past_shutdown_barrier{false};  ///< peers may exit now: the watchdog stops counting deaths
    std::atomic<bool> dead_peer_known{false};
    std::atomic<bool> device_abort_published{false};  ///< the watchdog told the peers of a device wait's abort
    mutable std::mutex abort_mutex;
    std::string abort_reason;  ///< guarded by abort_mutex: why the World was aborted (empty: not by the host)
    std::atomic<uint64_t> cleared_aborts{0};  ///< aborts clear_diagnostics cleared (World::cleared_aborts)
    std::string last_cleared_abort;           ///< guarded by abort_mutex: the last one's text
    std::unique_ptr<Watchdog> watchdog;

    /// Sets the abort word (kAbortByHost unless a value is there) and, when none is recorded yet, the reason.
    /// `is_dead_peer`: the reason is a dead peer (store waits stop even during shutdown). Thread-safe.
    void raise_abort(const std::string& reason, bool is_dead_peer);
    /// The abort word's value (0: not aborted).
    uint32_t abort_word() const;
    /// The recorded reason, or, when a device wait set the word, the device diagnostic; empty when not aborted.
    std::string abort_text() const;
    /// Why a store wait of the World must stop now, or nullopt: the World is aborted (during shutdown: only a dead
    /// peer or a failed store stops it).
    std::optional<std::string> store_wait_stop() const;
    /// store_wait_stop(), or, while the World starts, the start-up failure a peer recorded under kStartupFailedKey
    /// in `from` (startup_stopped_by_peer is then set): why a wait of this rank's start-up should end now.
    std::optional<std::string> startup_wait_stop(Store& from) const;
    /// The key (under the World's store prefix) a rank whose construction failed after the start-up exchange sets,
    /// its value naming the rank: its peers' start-up waits stop on it (WorldContext::starting).
    static constexpr const char* kStartupFailedKey = "startup_failed";
};

/// The text of the World's diagnostic record (format_diagnostic), or "" when none was written; with
/// `wait_for_writer`, a record caught mid-write gets 100 ms to complete.
std::string read_diagnostic(const WorldContext& world, bool wait_for_writer);

/// A view of `store` whose get() (and so barrier and all_gather) waits in slices, asking world.store_wait_stop() before
/// each and wait_interrupted() after each that ran out without the key: a World's store waits end within a slice once
/// the World is aborted, a peer is dead or the embedding's check answers. `world` null (the store of a World not yet
/// made: from_env, from_store): wait_interrupted() alone, so `store` itself while no check is set, and a get made
/// inside another view's get on the same thread (the World's own view, stacked on it) is passed through whole.
std::shared_ptr<Store> make_abortable_store(std::shared_ptr<Store> store, const WorldContext* world);

/// Whether an embedding's wait check is set (set_wait_interrupt_check).
bool wait_interrupt_check_set();

/// The weft::Error of a wait that the embedding's check ended (wait_interrupted): code that adds context to a wait's
/// errors (a hint about their usual cause) lets it through as it is.
class WaitInterrupted : public Error {
public:
    using Error::Error;
};

/// Throws WaitInterrupted: "weft: <message>" (the message names the wait and the check's reason).
[[noreturn]] void throw_wait_interrupted(const std::string& message);

/// A team's shared state: members, this rank's place, and its device tables.
struct TeamState {
    WorldContext* world = nullptr;
    std::string id;  ///< identical on every member: names the team's store keys
    TeamMembers members;
    int rank = -1;
    bool is_world = false;
    int num_ranks_on_device = 0;       ///< members on this rank's GPU (0 for a non-member)
    int max_ranks_per_device = 0;      ///< the most members on any one GPU
    NodeLayout nodes;                  ///< how the members lie over nodes (node_topology.hpp)
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
