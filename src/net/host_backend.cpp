// SPDX-License-Identifier: MIT
// The host-API network backend (docs/multinode.md): how a chunk crosses nodes.
//
//   compute stream                       comm stream (this file)                      peer on another node
//   ──────────────                       ───────────────────────                      ────────────────────
//   kernel or copy produces chunk c
//   mark_ready(c)  ── ready[c] = 1 ──▶   comm_wait_ready(c)   (cuStreamWaitValue64)
//                                        ncclGroupStart; ncclSend/ncclRecv (or an
//                                        NCCL collective) of chunk c; ncclGroupEnd  ◀──────▶  the same, mirrored
//                                        comm_mark_arrived(c)  arrived[c] = 1
//   wait_arrived(c) ◀────────────────────
//   kernel consumes chunk c
//
// A stream only waits for a word whose writer is already enqueued (the driver's waits have no bound); NCCL's own
// waits for a peer are bounded by the watcher thread below, which aborts the communicator and the World when a step is
// not done within the World's timeout. The words are zeroed at the start of every call in stream order, so a value
// of 1 always means "this call's chunk", also when a captured graph is replayed.
#include "weft/net/host_backend.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "weft/detail/nccl_library.hpp"
#include "weft/net/chunk_schedule.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/stream.hpp"

// WEFT_NO_NCCL builds the backend without NCCL even where nccl.h exists (it then refuses, as without the header).
#if __has_include(<nccl.h>) && !defined(WEFT_NO_NCCL)
#include <nccl.h>
#define WEFT_NET_HAVE_NCCL_HEADER 1
#else
#define WEFT_NET_HAVE_NCCL_HEADER 0
#endif

namespace weft::net {

namespace {

std::string this_host_name() {
    char name[256] = {};
    if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
    return name;
}

#if WEFT_NET_HAVE_NCCL_HEADER

// NCCL's entry points the backend calls, resolved from a libnccl (weft/detail/nccl_library.hpp): weft's programs start
// on machines without it, and only the network path needs it. `usable` is false when the library did not load or lacks
// one of them (`why_not` says which).
struct NcclApi {
    bool usable = false;
    std::string path;
    std::string why_not;
    int version = 0;
    decltype(&ncclGetVersion) get_version = nullptr;
    decltype(&ncclGetErrorString) error_string = nullptr;
    decltype(&ncclGetUniqueId) get_unique_id = nullptr;
    decltype(&ncclCommInitRank) comm_init_rank = nullptr;
    decltype(&ncclCommDestroy) comm_destroy = nullptr;
    decltype(&ncclCommAbort) comm_abort = nullptr;
    decltype(&ncclCommGetAsyncError) comm_get_async_error = nullptr;
    decltype(&ncclGroupStart) group_start = nullptr;
    decltype(&ncclGroupEnd) group_end = nullptr;
    decltype(&ncclSend) send = nullptr;
    decltype(&ncclRecv) recv = nullptr;
    decltype(&ncclReduceScatter) reduce_scatter = nullptr;
    decltype(&ncclAllReduce) all_reduce = nullptr;
};

NcclApi resolve_nccl(const weft::detail::NcclLibrary& lib) {
    NcclApi a;
    if (!lib.loaded()) {
        a.why_not = lib.why_not();
        return a;
    }
    a.path = lib.path();
    std::string missing;
    lib.resolve(a.get_version, "ncclGetVersion", missing);
    lib.resolve(a.error_string, "ncclGetErrorString", missing);
    lib.resolve(a.get_unique_id, "ncclGetUniqueId", missing);
    lib.resolve(a.comm_init_rank, "ncclCommInitRank", missing);
    lib.resolve(a.comm_destroy, "ncclCommDestroy", missing);
    lib.resolve(a.comm_abort, "ncclCommAbort", missing);
    lib.resolve(a.comm_get_async_error, "ncclCommGetAsyncError", missing);
    lib.resolve(a.group_start, "ncclGroupStart", missing);
    lib.resolve(a.group_end, "ncclGroupEnd", missing);
    lib.resolve(a.send, "ncclSend", missing);
    lib.resolve(a.recv, "ncclRecv", missing);
    lib.resolve(a.reduce_scatter, "ncclReduceScatter", missing);
    lib.resolve(a.all_reduce, "ncclAllReduce", missing);
    if (!missing.empty()) {
        a.why_not = a.path + " lacks an NCCL entry point weft needs (" + missing + "; NCCL >= 2.19 is needed)";
        return a;
    }
    a.usable = true;
    a.version = lib.version();
    return a;
}

// The process's NCCL (weft::detail::NcclLibrary::process(): WEFT_NCCL_LIBRARY alone when set).
const NcclApi& nccl() {
    static const NcclApi api = resolve_nccl(weft::detail::NcclLibrary::process());
    return api;
}

#define WEFT_NCCL_CHECK(call, what)                                                                        \
    do {                                                                                                   \
        const ncclResult_t weft_nccl_r_ = (call);                                                          \
        WEFT_CHECK(weft_nccl_r_ == ncclSuccess, what << " failed: " << nccl().error_string(weft_nccl_r_)); \
    } while (0)

// ncclCommInitRank returns once every member of the communicator has joined; one that failed after the ids were
// exchanged would hold it forever (NCCL's bootstrap has no bound of its own). It runs on a thread of its own, waited
// for in slices up to `timeout` (an abort of the World, `aborted`, ends the wait sooner); on expiry the call fails
// naming `what`, and the thread, left inside NCCL, aborts the communicator itself should it ever get one.
ncclComm_t init_comm_bounded(int num_ranks, const ncclUniqueId& id, int rank, int device,
                             std::chrono::milliseconds timeout, const std::function<bool()>& aborted,
                             const std::string& what) {
    struct Init {
        std::mutex mutex;
        std::condition_variable done_cv;
        bool done = false;
        bool abandoned = false;
        ncclResult_t result = ncclInternalError;
        cudaError_t device_error = cudaSuccess;  // of cudaSetDevice on the thread
        ncclComm_t comm = nullptr;
    };
    auto init = std::make_shared<Init>();
    std::thread([init, num_ranks, id, rank, device] {
        ncclComm_t comm = nullptr;
        ncclResult_t result = ncclInternalError;
        const cudaError_t device_error = cudaSetDevice(device);
        if (device_error == cudaSuccess) result = nccl().comm_init_rank(&comm, num_ranks, id, rank);
        std::lock_guard<std::mutex> lock(init->mutex);
        if (init->abandoned) {
            if (comm != nullptr) nccl().comm_abort(comm);
            return;
        }
        init->done = true;
        init->device_error = device_error;
        init->result = result;
        init->comm = comm;
        init->done_cv.notify_all();
    }).detach();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::unique_lock<std::mutex> lock(init->mutex);
    while (!init->done) {
        const auto now = std::chrono::steady_clock::now();
        const bool stop = aborted();
        if (stop || now >= deadline) {
            init->abandoned = true;
            WEFT_FAIL(what << (stop ? " was stopped by an abort of the World"
                                    : " did not complete within the World's timeout (" +
                                          std::to_string(timeout.count()) +
                                          " ms): a member of the communicator never joined (it may have failed after "
                                          "the ids were exchanged)"));
        }
        init->done_cv.wait_for(
            lock, std::min<std::chrono::steady_clock::duration>(deadline - now, std::chrono::milliseconds(250)));
    }
    WEFT_CHECK(init->device_error == cudaSuccess, what << ": cudaSetDevice(" << device << ") failed on its thread: "
                                                       << cudaGetErrorString(init->device_error));
    WEFT_CHECK(init->result == ncclSuccess, what << " failed: " << nccl().error_string(init->result));
    return init->comm;
}

// Ends an NCCL group that a throwing call left open (the thread's group depth would otherwise defer every later NCCL
// call of this thread, another library's too); end() ends it on the normal path, checking the result.
class GroupGuard {
public:
    explicit GroupGuard(const NcclApi& api) : api_(api) {}
    ~GroupGuard() {
        if (open_) (void)api_.group_end();
    }
    GroupGuard(const GroupGuard&) = delete;
    GroupGuard& operator=(const GroupGuard&) = delete;
    void end(const std::string& what) {
        open_ = false;
        WEFT_NCCL_CHECK(api_.group_end(), what);
    }

private:
    const NcclApi& api_;
    bool open_ = true;
};

ncclDataType_t nccl_type(DType t) {
    switch (t) {
        case DType::kBF16:
            return ncclBfloat16;
        case DType::kF16:
            return ncclFloat16;
        case DType::kF32:
            return ncclFloat32;
        case DType::kI32:
            return ncclInt32;
        case DType::kI64:
            return ncclInt64;
        case DType::kU8:
        case DType::kF8E4M3:
            return ncclUint8;
    }
    return ncclUint8;
}

#endif  // WEFT_NET_HAVE_NCCL_HEADER

}  // namespace

std::string nccl_unavailable_reason() {
#if WEFT_NET_HAVE_NCCL_HEADER
    return nccl().why_not;
#else
    return "weft was built without nccl.h (the CUDA toolkit's NCCL headers): the network backend is not compiled in";
#endif
}

namespace detail {
std::string try_load_nccl(const std::string& path) {
#if WEFT_NET_HAVE_NCCL_HEADER
    return resolve_nccl(weft::detail::NcclLibrary({path})).why_not;
#else
    (void)path;
    return nccl_unavailable_reason();
#endif
}
}  // namespace detail

int nccl_version() {
#if WEFT_NET_HAVE_NCCL_HEADER
    return nccl().usable ? nccl().version : 0;
#else
    return 0;
#endif
}

void prepare_nccl_environment(const World& world, bool ranks_are_threads) {
    static std::once_flag once;
    if (world.virtual_nodes() <= 1 || ranks_are_threads) return;
    std::call_once(once, [&] {
        const auto user_id = env::get("NCCL_HOSTID");
        const std::string base = user_id && !user_id->empty() ? *user_id : this_host_name();
        const std::string id = base + "-vnode" + std::to_string(world.node());
        ::setenv("NCCL_HOSTID", id.c_str(), 1);
        ::setenv("NCCL_P2P_DISABLE", "1", 0);
        ::setenv("NCCL_SHM_DISABLE", "1", 0);
        WEFT_LOG_INFO("virtual node " << world.node() << ": NCCL_HOSTID=" << id
                                      << ", NCCL_P2P_DISABLE=" << std::getenv("NCCL_P2P_DISABLE")
                                      << ", NCCL_SHM_DISABLE=" << std::getenv("NCCL_SHM_DISABLE")
                                      << " (NCCL's network transport carries "
                                      << "the bytes between virtual nodes)");
    });
}

// The communicator, and the watcher that bounds every network step.
struct HostBackend::Impl {
#if WEFT_NET_HAVE_NCCL_HEADER
    ncclComm_t comm = nullptr;
#endif
    World* world = nullptr;
    int device = 0;
    std::string who;  // "the team of world ranks ..., column <l>", for errors
    std::chrono::milliseconds timeout{0};

    // A network step: registered before NCCL is called (the call itself may block, e.g. while NCCL connects to a
    // peer), given its event once enqueued.
    using Event = std::shared_ptr<CUevent_st>;  // destroyed with its last holder, on whichever thread
    struct Pending {
        uint64_t id = 0;
        cudaEvent_t done = nullptr;  // nullptr: NCCL is still being called
        std::chrono::steady_clock::time_point deadline;
        std::string what;
        // The call's start on the caller's stream (recorded where the comm stream forks from it): until it has
        // completed, the caller's stream has not reached the call and the step's clock does not run.
        Event start;
    };
    uint64_t next_id = 0;
    Event call_start;  // the current call's (begin_call; none under capture)
    std::mutex mutex;
    std::condition_variable wake;
    std::deque<Pending> pending;
    bool stop = false;
    // Set under `mutex`: once it is, no NCCL call on `comm` starts (begin_step and the async-error query check it
    // under the mutex), and the communicator is aborted (freed) only after the steps inside NCCL have left it.
    std::atomic<bool> aborted{false};
    int in_nccl = 0;  // steps between begin_step and the end of their NCCL calls (under `mutex`)
    std::condition_variable left_nccl;
    std::atomic<bool> stepped{false};  // a network operation was enqueued since the last check_after_sync
    std::thread watcher;

    void watch();
    /// Marks the communicator aborted, lets steps inside NCCL leave it (enqueueing takes microseconds; a call blocked
    /// on an absent peer is ended by the abort after kLeaveNcclWait), then aborts it. False when aborted already.
    /// Called without `mutex`.
    bool abort_nccl();
    /// abort_nccl, then the World with `reason` (unless it was aborted already: its reason stays).
    void abort_comm(const std::string& reason);
    /// The end of a step's NCCL calls (begin_step began them).
    void leave_nccl();
    /// Aborts the communicator and the World when NCCL reports an asynchronous error on it; true then.
    bool abort_on_async_error();
};

bool HostBackend::Impl::abort_on_async_error() {
#if WEFT_NET_HAVE_NCCL_HEADER
    ncclResult_t async = ncclSuccess;
    {
        std::lock_guard<std::mutex> lock(mutex);  // not aborted (freed) while it is queried
        if (comm == nullptr || aborted.load()) return false;
        if (nccl().comm_get_async_error(comm, &async) != ncclSuccess) return false;
    }
    if (async == ncclSuccess || async == ncclInProgress) return false;
    abort_comm("the NCCL communicator of " + who + " reported an asynchronous error: " +
               nccl().error_string(async) + " (a peer on another node left or the network failed); it was aborted");
    return true;
#else
    return false;
#endif
}

bool HostBackend::Impl::abort_nccl() {
    constexpr auto kLeaveNcclWait = std::chrono::milliseconds(500);
    {
        std::unique_lock<std::mutex> lock(mutex);
        if (aborted.exchange(true)) return false;
        left_nccl.wait_for(lock, kLeaveNcclWait, [&] { return in_nccl == 0; });
    }
#if WEFT_NET_HAVE_NCCL_HEADER
    // NCCL's kernels stop waiting for the peer and end: the comm stream drains, the World's error explains why.
    if (comm != nullptr) nccl().comm_abort(comm);
#endif
    return true;
}

void HostBackend::Impl::abort_comm(const std::string& reason) {
    if (!abort_nccl()) return;
    // A World aborted already keeps its reason (a device's diagnosis, a peer's abort): this one is a consequence.
    if (!world->aborted()) world->abort(reason);
}

void HostBackend::Impl::leave_nccl() {
    {
        std::lock_guard<std::mutex> lock(mutex);
        --in_nccl;
    }
    left_nccl.notify_all();
}

void HostBackend::Impl::watch() {
    cudaSetDevice(device);
    // Its event queries must not touch a capture another thread runs in global mode (CUDA's and PyTorch's default):
    // relaxed mode for this thread.
    cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&capture_mode);
    std::unique_lock<std::mutex> lock(mutex);
    while (!stop) {
        wake.wait_for(lock, std::chrono::milliseconds(20));
        if (pending.empty() && !aborted.load() && world->aborted()) {
            // Nothing eager is pending, but a graph's replay may be: NCCL's kernels would wait for a gone peer forever.
            // The World is aborted already (by whatever aborted it): not again.
            WEFT_LOG_WARN("network backend: the World was aborted; the NCCL communicator of " << who
                                                                                              << " is aborted with it");
            lock.unlock();
            abort_nccl();
            lock.lock();
            continue;
        }
        while (!pending.empty()) {
            Pending& p = pending.front();
            if (p.start != nullptr) {
                const cudaError_t started = cudaEventQuery(p.start.get());
                if (started == cudaErrorNotReady) {
                    p.deadline = std::chrono::steady_clock::now() + timeout;  // work queued ahead of the call
                } else {
                    if (started != cudaSuccess) (void)cudaGetLastError();
                    p.start.reset();
                }
            }
            const cudaError_t st = p.done != nullptr ? cudaEventQuery(p.done) : cudaErrorNotReady;
            if (st == cudaSuccess) {
                cudaEventDestroy(p.done);
                pending.pop_front();
                // The comm stream runs its steps in order: the next one's bound counts from now, not from when it was
                // enqueued (a call enqueues all its chunks' steps at once).
                if (!pending.empty()) {
                    pending.front().deadline =
                        std::max(pending.front().deadline, std::chrono::steady_clock::now() + timeout);
                }
                // NCCL may end a step's kernels on a peer's failure without failing the stream.
                lock.unlock();
                const bool failed = abort_on_async_error();
                lock.lock();
                if (failed) {
                    for (Pending& q : pending) {
                        if (q.done != nullptr) cudaEventDestroy(q.done);
                    }
                    pending.clear();
                    break;
                }
                continue;
            }
            if (st != cudaErrorNotReady) (void)cudaGetLastError();
            const bool late = std::chrono::steady_clock::now() > p.deadline;
            if (late || world->aborted()) {
                const std::string reason =
                    late ? "the network step '" + p.what + "' of " + who + " did not complete within " +
                               std::to_string(timeout.count()) +
                               " ms (a peer on another node did not take part, or the network failed); the NCCL "
                               "communicator was aborted"
                         : "the World was aborted while the network step '" + p.what + "' of " + who +
                               " was pending; the NCCL communicator was aborted";
                lock.unlock();
                abort_comm(reason);
                lock.lock();
                for (Pending& q : pending) {
                    if (q.done != nullptr) cudaEventDestroy(q.done);
                }
                pending.clear();
            }
            break;
        }
    }
    for (Pending& q : pending) {
        if (q.done != nullptr) cudaEventDestroy(q.done);
    }
    pending.clear();
}

namespace {
std::string backend_extension_name(const Team& team) { return "weft.net.host/" + team.id(); }
}  // namespace

bool HostBackend::exists(const Team& team) {
    return team.world().find_extension(backend_extension_name(team)) != nullptr;
}

HostBackend& HostBackend::get(const Team& team) {
    team.require_member("network backend");
    World& world = team.world();
    const std::string name = backend_extension_name(team);
    if (WorldExtension* e = world.find_extension(name)) return static_cast<HostBackend&>(*e);
    WEFT_CHECK(team.num_nodes() > 1, "network backend: the team of " << team.describe() << " lies on one node");
    WEFT_CHECK(team.ranks_per_node() > 0, "network backend: the team of "
                                              << team.describe() << " spans " << team.num_nodes()
                                              << " nodes with different numbers of members on them; the hierarchical "
                                                 "collectives need the same number of members on every node");
    const std::string why_not = nccl_unavailable_reason();
    WEFT_CHECK(why_not.empty(), "the team of " << team.describe() << " spans " << team.num_nodes()
                                               << " nodes and the network backend is unavailable: " << why_not);
    // Collective over the team (every member calls get in the same order): the node-local sub-team first.
    Team node_team = team.split_color(team.node_index(), team.local_index());
    std::unique_ptr<HostBackend> backend(new HostBackend(team, std::move(node_team)));
    return static_cast<HostBackend&>(world.add_extension(name, std::move(backend)));
}

int HostBackend::team_rank_at(int node, int local) const {
    WEFT_CHECK(node >= 0 && node < num_nodes() && local >= 0 && local < ranks_per_node_,
               "network backend: no member at node " << node << ", local index " << local);
    return by_node_[static_cast<size_t>(node)][static_cast<size_t>(local)];
}

HostBackend::HostBackend(const Team& team, Team node_team)
    : team_(team), node_team_(std::move(node_team)), impl_(std::make_unique<Impl>()) {
    World& world = team.world();
    ranks_per_node_ = team.ranks_per_node();
    node_index_ = team.node_index();
    local_index_ = team.local_index();
    for (int n = 0; n < team.num_nodes(); ++n) {
        by_node_.push_back(team.node_members(n));
        column_.push_back(by_node_.back()[static_cast<size_t>(local_index_)]);
    }
    impl_->world = &world;
    impl_->device = world.device();
    impl_->timeout = world.timeout();
    {
        std::string column_ranks;
        for (size_t n = 0; n < column_.size(); ++n) {
            column_ranks += (n > 0 ? ", " : "") + std::to_string(team.world_rank(column_[n]));
        }
        impl_->who = "the team of " + team.describe() + " (column of local index " + std::to_string(local_index_) +
                     ": world ranks " + column_ranks + ", one per node)";
    }
#if WEFT_NET_HAVE_NCCL_HEADER
    // Where every member is (host, process, GPU), and the column heads' unique ids: one bounded exchange.
    char pci[64] = {};
    WEFT_CUDA_CHECK(cudaDeviceGetPCIBusId(pci, sizeof(pci), world.device()));
    const std::string where = this_host_name() + "|" + std::to_string(::getpid()) + "|" + pci;
    std::vector<uint8_t> mine(where.begin(), where.end());
    mine.push_back('\n');
    std::vector<std::string> wheres;
    {
        auto all = team.all_gather("weft.net.where", mine);
        for (auto& b : all) wheres.emplace_back(b.begin(), b.end() - (b.empty() ? 0 : 1));
    }
    const auto process_of = [&](int t) {
        return wheres[static_cast<size_t>(t)].substr(0, wheres[static_cast<size_t>(t)].rfind('|'));
    };
    // Every column is checked on every member (each column's members form a communicator), so that all refuse alike
    // before the ids' exchange, which a refusing member would never join.
    bool threads = false;
    for (int l = 0; l < ranks_per_node_; ++l) {
        for (int n = 0; n < num_nodes(); ++n) {
            for (int m = 0; m < n; ++m) {
                const int a = by_node_[static_cast<size_t>(n)][static_cast<size_t>(l)];
                const int b = by_node_[static_cast<size_t>(m)][static_cast<size_t>(l)];
                if (process_of(a) != process_of(b)) continue;
                if (l == local_index_) threads = true;
                WEFT_CHECK(wheres[static_cast<size_t>(a)] != wheres[static_cast<size_t>(b)],
                           "network backend: team ranks "
                               << b << " and " << a << " (world ranks " << team.world_rank(b) << " and "
                               << team.world_rank(a) << ") of the team of " << team.describe()
                               << ", the column of local index " << l
                               << ", are threads of one process on one GPU, on different nodes; NCCL refuses two "
                                  "ranks of a communicator on one GPU in one process (its host identity is per "
                                  "process): run virtual nodes as processes (weftrun), or give each rank a GPU");
            }
        }
    }
    if (threads && world.virtual_nodes() > 1) {
        WEFT_LOG_WARN(
            "network backend: virtual nodes with ranks as threads of one process: NCCL sees one host and may "
            "move bytes through P2P or shared memory instead of its network transport");
    }
    prepare_nccl_environment(world, threads);
    std::vector<uint8_t> id_blob;
    if (node_index_ == 0) {
        ncclUniqueId id{};
        WEFT_NCCL_CHECK(nccl().get_unique_id(&id), "ncclGetUniqueId for " << impl_->who);
        id_blob.assign(reinterpret_cast<const uint8_t*>(&id), reinterpret_cast<const uint8_t*>(&id) + sizeof(id));
    }
    // The World's store carries the ids; a member that does not arrive is named, after the World's timeout.
    const auto ids = team.all_gather("weft.net.ids", id_blob);
    const auto& head = ids[static_cast<size_t>(column_[0])];
    WEFT_CHECK(head.size() == sizeof(ncclUniqueId), "network backend: team rank "
                                                        << column_[0] << " published a malformed NCCL unique id for "
                                                        << impl_->who);
    ncclUniqueId id{};
    std::memcpy(&id, head.data(), sizeof(id));
    try {
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
        impl_->comm = init_comm_bounded(
            num_nodes(), id, node_index_, impl_->device, impl_->timeout, [&world] { return world.aborted(); },
            "ncclCommInitRank (" + std::to_string(num_nodes()) + " ranks, rank " + std::to_string(node_index_) +
                ") for " + impl_->who);
        {
            // On the comm stream, not the legacy one (a synchronous memset there is refused while any stream of the
            // process is captured), beside another rank thread's capture in global mode.
            const RelaxedCaptureMode relaxed;
            WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&flags_), 2 * kMaxChunks * sizeof(uint64_t)));
            WEFT_CUDA_CHECK(cudaMemsetAsync(flags_, 0, 2 * kMaxChunks * sizeof(uint64_t), comm_stream_));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(comm_stream_));
        }
        WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
        WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
        impl_->watcher = std::thread([impl = impl_.get()] { impl->watch(); });
    } catch (...) {
        // The destructor does not run for a constructor that throws: the stream and a live communicator would leak.
        impl_->aborted.store(true);
        if (impl_->comm != nullptr) nccl().comm_abort(impl_->comm);
        release();
        throw;
    }
    WEFT_LOG_INFO("network backend for " << impl_->who << ": NCCL " << nccl().version << " from " << nccl().path
                                         << ", node " << node_index_ << " of " << num_nodes() << ", " << ranks_per_node_
                                         << " member(s) per node");
#endif
}

bool HostBackend::check_after_sync() {
    impl_->abort_on_async_error();
    return impl_->stepped.exchange(false);
}

HostBackend::~HostBackend() { release(); }

void HostBackend::release() noexcept {
    if (impl_->watcher.joinable()) {
        {
            std::lock_guard<std::mutex> lock(impl_->mutex);
            impl_->stop = true;
        }
        impl_->wake.notify_all();
        impl_->watcher.join();
    }
    impl_->call_start.reset();
#if WEFT_NET_HAVE_NCCL_HEADER
    if (impl_->comm != nullptr && !impl_->aborted.load()) {
        // After a failure a peer may be gone: abort rather than destroy, which may wait for it.
        const bool failed = impl_->world->aborted();
        const ncclResult_t r = failed ? nccl().comm_abort(impl_->comm) : nccl().comm_destroy(impl_->comm);
        if (r != ncclSuccess) {
            WEFT_LOG_WARN((failed ? "ncclCommAbort" : "ncclCommDestroy")
                          << " for " << impl_->who << ": " << nccl().error_string(r));
        }
    }
#endif
    impl_->comm = nullptr;
    if (fork_ != nullptr) cudaEventDestroy(fork_);
    if (join_ != nullptr) cudaEventDestroy(join_);
    if (flags_ != nullptr) {
        const RelaxedCaptureMode relaxed;  // beside another rank thread's capture in global mode
        cudaFree(flags_);
    }
    if (comm_stream_ != nullptr) cudaStreamDestroy(comm_stream_);
    fork_ = join_ = nullptr;
    flags_ = nullptr;
    comm_stream_ = nullptr;
}

void HostBackend::begin_call(cudaStream_t stream) {
    WEFT_CHECK(!impl_->aborted.load(),
               "network backend: the NCCL communicator of " << impl_->who << " was aborted earlier");
    WEFT_CUDA_CHECK(cudaMemsetAsync(flags_, 0, 2 * kMaxChunks * sizeof(uint64_t), stream));
    WEFT_CUDA_CHECK(cudaEventRecord(fork_, stream));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, fork_, 0));
    // The steps' bound counts from when the caller's stream reaches the call, not from when the host enqueued it.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    Impl::Event start;
    if (capture == cudaStreamCaptureStatusNone) {
        cudaEvent_t e = nullptr;
        WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        start = Impl::Event(e, [](cudaEvent_t ev) { cudaEventDestroy(ev); });
        WEFT_CUDA_CHECK(cudaEventRecord(e, stream));
    }
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->call_start = std::move(start);
}

void HostBackend::end_call(cudaStream_t stream) {
    WEFT_CUDA_CHECK(cudaEventRecord(join_, comm_stream_));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, join_, 0));
}

void HostBackend::mark_ready(cudaStream_t stream, int chunk) {
    WEFT_CHECK(chunk >= 0 && chunk < kMaxChunks,
               "network backend: chunk " << chunk << " outside [0, " << kMaxChunks << ")");
    stream_write_u64(stream, flags_ + chunk, 1);
}

void HostBackend::comm_wait_ready(int chunk) {
    WEFT_CHECK(chunk >= 0 && chunk < kMaxChunks,
               "network backend: chunk " << chunk << " outside [0, " << kMaxChunks << ")");
    stream_wait_u64_geq(comm_stream_, flags_ + chunk, 1);
}

void HostBackend::comm_mark_arrived(int chunk) {
    WEFT_CHECK(chunk >= 0 && chunk < kMaxChunks,
               "network backend: chunk " << chunk << " outside [0, " << kMaxChunks << ")");
    stream_write_u64(comm_stream_, flags_ + kMaxChunks + chunk, 1);
}

void HostBackend::wait_arrived(cudaStream_t stream, int chunk) {
    WEFT_CHECK(chunk >= 0 && chunk < kMaxChunks,
               "network backend: chunk " << chunk << " outside [0, " << kMaxChunks << ")");
    stream_wait_u64_geq(stream, flags_ + kMaxChunks + chunk, 1);
}

// Every network step is registered with its deadline before NCCL is called, and gets an event once enqueued; the
// watcher aborts the communicator (and the World) when a step is not done by its deadline, which also ends an NCCL
// call blocked on an absent peer. While the comm stream is captured no event is recorded (a captured event cannot be
// queried): a graph replay's steps have no deadline; a World abort aborts the communicator, which ends them.
// NOTE: an NCCL call starts only while the communicator is not aborted (checked under the mutex that the abort sets it
// under), and the abort waits for the steps inside NCCL to leave it; but it ends a call blocked on an absent peer from
// the watcher's thread after a short wait (NCCL documents that for non-blocking communicators; this one is blocking).
uint64_t HostBackend::begin_step(const char* what) {
    std::unique_lock<std::mutex> lock(impl_->mutex);  // abort_nccl marks the communicator aborted under it
    if (impl_->aborted.load()) {
        lock.unlock();
        const std::string text = "network backend: the NCCL communicator of " + impl_->who +
                                 " was aborted earlier (a failed step, or an abort of the World: make a new World)";
        // The World's own diagnosis first (a device wait's record, a peer's abort): the communicator's end follows it.
        try {
            impl_->world->check_diagnostics();
        } catch (const Error& cause) {
            throw Error(std::string(cause.what()) + " (then " + text + ")");
        }
        WEFT_FAIL(text);
    }
    const uint64_t id = ++impl_->next_id;
    impl_->pending.push_back({id, nullptr, std::chrono::steady_clock::now() + impl_->timeout, what, impl_->call_start});
    ++impl_->in_nccl;  // until run_step's body has returned
    return id;
}

template <class Body>
void HostBackend::run_step(uint64_t id, Body&& body) {
    try {
        body();
    } catch (const std::exception& e) {
        impl_->leave_nccl();
        // What a failed NCCL call left on the comm stream is unknown, and the watcher could not bound it: the
        // communicator (and with it the World) is aborted, which ends anything NCCL did enqueue.
        cancel_step(id);
        // A call that fails because a peer failed first (its World abort aborted its communicator, which ends ours:
        // "internal error") is a consequence: the peer's abort reaches this World within a heartbeat, and its reason
        // is the error to raise. Waited for up to kCauseWait; a failure nobody else reported is raised as it is.
        constexpr auto kCauseWait = std::chrono::seconds(2);
        const auto until = std::chrono::steady_clock::now() + kCauseWait;
        while (!impl_->world->aborted() && std::chrono::steady_clock::now() < until) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        const bool peer_failed_first = impl_->world->aborted();
        impl_->abort_comm(std::string("a network step of ") + impl_->who + " failed: " + e.what());
        if (peer_failed_first) {
            try {
                impl_->world->check_diagnostics();
            } catch (const Error& cause) {
                throw Error(std::string(cause.what()) + " (then " + e.what() + ")");
            }
        }
        throw;
    }
    impl_->leave_nccl();
    end_step(id);
}

void HostBackend::cancel_step(uint64_t id) noexcept {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    auto it =
        std::find_if(impl_->pending.begin(), impl_->pending.end(), [&](const Impl::Pending& p) { return p.id == id; });
    if (it != impl_->pending.end()) {
        if (it->done != nullptr) cudaEventDestroy(it->done);
        impl_->pending.erase(it);
    }
}

void HostBackend::end_step(uint64_t id) {
    impl_->stepped.store(true);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    WEFT_CUDA_CHECK(cudaStreamIsCapturing(comm_stream_, &capture));
    cudaEvent_t done = nullptr;
    if (capture == cudaStreamCaptureStatusNone) {
        WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
        WEFT_CUDA_CHECK(cudaEventRecord(done, comm_stream_));
    }
    {
        std::lock_guard<std::mutex> lock(impl_->mutex);
        auto it = std::find_if(impl_->pending.begin(), impl_->pending.end(),
                               [&](const Impl::Pending& p) { return p.id == id; });
        if (it == impl_->pending.end()) {  // the watcher gave up on it already
            if (done != nullptr) cudaEventDestroy(done);
        } else if (done != nullptr) {
            it->done = done;
        } else {
            impl_->pending.erase(it);
        }
    }
    impl_->wake.notify_all();
}

void HostBackend::exchange(const void* send, uint64_t bytes, const std::function<void*(int node)>& recv_at) {
#if WEFT_NET_HAVE_NCCL_HEADER
    if (bytes == 0) return;
    const NcclApi& api = nccl();
    const uint64_t step = begin_step("exchange");
    run_step(step, [&] {
        WEFT_NCCL_CHECK(api.group_start(), "ncclGroupStart");
        GroupGuard group(api);
        for (int k = 1; k < num_nodes(); ++k) {
            // Rotated order: node n first talks to n + 1, so no two ranks start on the same peer.
            const int peer = (node_index_ + k) % num_nodes();
            WEFT_NCCL_CHECK(api.send(send, bytes, ncclUint8, peer, impl_->comm, comm_stream_),
                            "ncclSend to node " << peer << " for " << impl_->who);
            WEFT_NCCL_CHECK(api.recv(recv_at(peer), bytes, ncclUint8, peer, impl_->comm, comm_stream_),
                            "ncclRecv from node " << peer << " for " << impl_->who);
        }
        group.end("ncclGroupEnd (send/recv) for " + impl_->who);
    });
#else
    (void)send, (void)bytes, (void)recv_at;
    WEFT_FAIL(nccl_unavailable_reason());
#endif
}

void HostBackend::send_recv(const void* send, uint64_t bytes, int to_node, void* recv, int from_node) {
    send_recv(send, bytes, to_node, recv, bytes, from_node);
}

void HostBackend::send_recv(const void* send, uint64_t send_bytes, int to_node, void* recv, uint64_t recv_bytes,
                            int from_node) {
    WEFT_CHECK(to_node >= 0 && to_node < num_nodes() && from_node >= 0 && from_node < num_nodes(),
               "network backend: send_recv between nodes " << to_node << " and " << from_node << " of " << num_nodes());
#if WEFT_NET_HAVE_NCCL_HEADER
    const bool sends = send_bytes > 0 && to_node != node_index_;
    const bool receives = recv_bytes > 0 && from_node != node_index_;
    if (!sends && !receives) return;
    const NcclApi& api = nccl();
    const uint64_t step = begin_step("send_recv");
    run_step(step, [&] {
        WEFT_NCCL_CHECK(api.group_start(), "ncclGroupStart");
        GroupGuard group(api);
        if (sends) {
            WEFT_NCCL_CHECK(api.send(send, send_bytes, ncclUint8, to_node, impl_->comm, comm_stream_),
                            "ncclSend to node " << to_node << " for " << impl_->who);
        }
        if (receives) {
            WEFT_NCCL_CHECK(api.recv(recv, recv_bytes, ncclUint8, from_node, impl_->comm, comm_stream_),
                            "ncclRecv from node " << from_node << " for " << impl_->who);
        }
        group.end("ncclGroupEnd (send_recv) for " + impl_->who);
    });
#else
    (void)send, (void)recv, (void)send_bytes, (void)recv_bytes;
    WEFT_FAIL(nccl_unavailable_reason());
#endif
}

void HostBackend::reduce_scatter(const void* send, void* recv, uint64_t recv_count, DType dtype) {
#if WEFT_NET_HAVE_NCCL_HEADER
    if (recv_count == 0) return;
    const uint64_t step = begin_step("reduce_scatter");
    run_step(step, [&] {
        WEFT_NCCL_CHECK(
            nccl().reduce_scatter(send, recv, recv_count, nccl_type(dtype), ncclSum, impl_->comm, comm_stream_),
            "ncclReduceScatter for " << impl_->who);
    });
#else
    (void)send, (void)recv, (void)recv_count, (void)dtype;
    WEFT_FAIL(nccl_unavailable_reason());
#endif
}

void HostBackend::all_reduce(void* buffer, uint64_t count, DType dtype) {
#if WEFT_NET_HAVE_NCCL_HEADER
    if (count == 0) return;
    const uint64_t step = begin_step("all_reduce");
    run_step(step, [&] {
        WEFT_NCCL_CHECK(nccl().all_reduce(buffer, buffer, count, nccl_type(dtype), ncclSum, impl_->comm, comm_stream_),
                        "ncclAllReduce for " << impl_->who);
    });
#else
    (void)buffer, (void)count, (void)dtype;
    WEFT_FAIL(nccl_unavailable_reason());
#endif
}

}  // namespace weft::net
