// SPDX-License-Identifier: MIT
// GinBackend: NCCL communicator, heap window and ncclDevComm with GIN; the probe; the refusal message.
//
// libnccl is opened at run time (weft/detail/nccl_library.hpp), like the driver: programs that never ask for the
// network do not need NCCL installed, and probe() can answer "no NCCL" instead of the program failing to start.
#include "weft/net/gin.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <sstream>
#include <thread>

#include "weft/detail/install_prefix.hpp"
#include "weft/detail/nccl_library.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/symmetric_heap.hpp"
#include "weft/runtime/world.hpp"

namespace weft::net {

namespace {

constexpr int kMinNcclVersion = 22800;  // 2.28.0: the device API with GIN
constexpr const char* kGinDeviceLibraryName = "weft_gin_device_sm90a.fatbin";
using fs_path = std::filesystem::path;

// The NCCL functions the backend calls, resolved on first use.
#define WEFT_NCCL_FUNCTIONS(X)                                                                      \
    X(ncclGetVersion) X(ncclGetErrorString) X(ncclGetLastError) X(ncclGetUniqueId)                 \
    X(ncclCommInitRankConfig) X(ncclCommGetAsyncError) X(ncclCommAbort) X(ncclCommFinalize)        \
    X(ncclCommDestroy) X(ncclCommCount) X(ncclCommUserRank) X(ncclCommWindowRegister)              \
    X(ncclCommWindowDeregister) X(ncclDevCommCreate) X(ncclDevCommDestroy)

struct NcclApi {
#define WEFT_NCCL_MEMBER(fn) decltype(&::fn) fn = nullptr;
    WEFT_NCCL_FUNCTIONS(WEFT_NCCL_MEMBER)
#undef WEFT_NCCL_MEMBER
    bool loaded = false;
    std::string error;  // why not, when !loaded
    int version = 0;
};

// The process's NCCL (weft::detail::NcclLibrary::process()) and the functions above resolved from it.
const NcclApi& nccl() {
    static const NcclApi api = [] {
        NcclApi a;
        const weft::detail::NcclLibrary& lib = weft::detail::NcclLibrary::process();
        if (!lib.loaded()) {
            a.error = lib.why_not();
            return a;
        }
        std::string missing;
#define WEFT_NCCL_RESOLVE(fn) lib.resolve(a.fn, #fn, missing);
        WEFT_NCCL_FUNCTIONS(WEFT_NCCL_RESOLVE)
#undef WEFT_NCCL_RESOLVE
        a.version = lib.version();
        if (!missing.empty()) {
            // An NCCL older than 2.28 lacks the device API: report the version rather than the symbols.
            a.error = lib.path() + " (version code " + std::to_string(a.version) + ") lacks " + missing;
            return a;
        }
        a.loaded = true;
        return a;
    }();
    return api;
}

std::string result_text(ncclResult_t r) {
    const NcclApi& n = nccl();
    std::ostringstream os;
    os << (n.ncclGetErrorString != nullptr ? n.ncclGetErrorString(r) : "NCCL error") << " (ncclResult " << int(r)
       << ")";
    return os.str();
}

std::string last_error(ncclComm_t comm) {
    const NcclApi& n = nccl();
    if (n.ncclGetLastError == nullptr) return {};
    const char* text = n.ncclGetLastError(comm);
    return text != nullptr ? std::string(text) : std::string();
}

std::string version_text(int code) {
    // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
    std::ostringstream os;
    os << code / 10000 << "." << (code % 10000) / 100 << "." << code % 100;
    return os.str();
}

// Waits until `comm`'s pending operation (a non-blocking init, register, devComm create or finalize) is done:
// ncclSuccess, an error, or ncclInProgress still when `timeout` passed.
ncclResult_t wait_comm(ncclComm_t comm, ncclResult_t started, std::chrono::milliseconds timeout) {
    if (started != ncclInProgress) return started;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    ncclResult_t state = ncclInProgress;
    while (true) {
        if (nccl().ncclCommGetAsyncError(comm, &state) != ncclSuccess) return ncclInternalError;
        if (state != ncclInProgress) return state;
        if (std::chrono::steady_clock::now() >= deadline) return ncclInProgress;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
}

std::vector<std::string> list_rdma_devices() {
    std::vector<std::string> names;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/sys/class/infiniband", ec)) {
        names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
}

}  // namespace

GinAvailability decide_gin_availability(const GinProbeInputs& in) {
    GinAvailability out;
    out.nccl_version = in.nccl_version;
    out.rdma_devices = in.rdma_devices;
    if (in.nccl_version == 0) {
        out.reason = "NCCL is not usable here (" +
                     (in.nccl_load_error.empty() ? std::string("libnccl.so.2 not loaded") : in.nccl_load_error) + ")";
    } else if (in.nccl_version < kMinNcclVersion) {
        out.reason = "NCCL " + version_text(in.nccl_version) + " has no GIN device API (needs 2.28 or newer)";
    } else if (!in.nccl_gin_enable.empty() && in.nccl_gin_enable == "0") {
        out.reason = "GIN is disabled by NCCL_GIN_ENABLE=0";
    } else if (!in.gpu_visible) {
        out.reason = "no CUDA GPU is visible";
    } else if (in.rdma_devices.empty()) {
        out.reason = "no RDMA device (InfiniBand or RoCE NIC) is present: /sys/class/infiniband lists none";
    } else {
        out.available = true;
    }
    return out;
}

GinAvailability GinBackend::probe() noexcept {
    try {
        GinProbeInputs in;
        const NcclApi& n = nccl();
        in.nccl_version = n.loaded ? n.version : 0;
        in.nccl_load_error = n.error;
        if (!n.loaded && n.version != 0 && n.version < kMinNcclVersion) in.nccl_version = n.version;
        in.gpu_visible = cuda_available();
        in.nccl_gin_enable = env::get("NCCL_GIN_ENABLE").value_or("");
        in.rdma_devices = list_rdma_devices();
        return decide_gin_availability(in);
    } catch (const std::exception& e) {
        GinAvailability out;
        out.reason = std::string("the probe failed: ") + e.what();
        return out;
    } catch (...) {
        GinAvailability out;
        out.reason = "the probe failed";
        return out;
    }
}

std::string gin_refusal_message(const std::string& asked, const std::string& nccl_result,
                                const std::string& nccl_last_error, const GinAvailability& probe) {
    std::ostringstream os;
    os << "GIN backend unavailable: " << asked << "; NCCL answered " << nccl_result;
    if (!nccl_last_error.empty()) os << ": \"" << nccl_last_error << "\"";
    os << ". GIN needs an RDMA NIC that NCCL can drive (InfiniBand or RoCE, with GPUDirect RDMA) and NCCL 2.28 or "
          "newer";
    if (!probe.available && !probe.reason.empty()) os << "; here: " << probe.reason;
    os << ". Use the NCCL host-API network backend instead (it runs wherever NCCL runs, sockets included).";
    return os.str();
}

std::string GinBackend::device_library() {
    std::vector<std::string> tried;
    if (auto path = env::get("WEFT_GIN_DEVICE_LIBRARY"); path && !path->empty()) {
        std::error_code ec;
        WEFT_CHECK(std::filesystem::is_regular_file(*path, ec),
                   "WEFT_GIN_DEVICE_LIBRARY='" << *path << "' is not a file (expected weft's GIN device library, "
                                                 "weft_gin_device_sm90a.fatbin)");
        return *path;
    }
    // Beside the running program's build tree (build/lib/ for build/tests/x), as weft finds its headers from there.
    {
        std::error_code ec;
        fs_path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
        for (int up = 0; !ec && up < 4 && exe.has_parent_path() && exe != exe.parent_path(); ++up) {
            exe = exe.parent_path();
            const fs_path candidate = exe / "lib" / kGinDeviceLibraryName;
            if (std::filesystem::is_regular_file(candidate, ec)) return candidate.string();
            tried.push_back(candidate.string());
            ec.clear();
        }
    }
#ifdef WEFT_GIN_DEVICE_LIBRARY_BUILD_PATH
    {
        std::error_code ec;
        if (std::filesystem::is_regular_file(WEFT_GIN_DEVICE_LIBRARY_BUILD_PATH, ec)) {
            return WEFT_GIN_DEVICE_LIBRARY_BUILD_PATH;
        }
        tried.push_back(WEFT_GIN_DEVICE_LIBRARY_BUILD_PATH);
    }
#endif
    // Where `cmake --install` put it: <prefix>/share/weft/ (the prefix written into the installed library).
    if (const std::string prefix = weft::detail::installed_prefix(); !prefix.empty()) {
        std::error_code ec;
        const fs_path candidate = fs_path(prefix) / "share" / "weft" / kGinDeviceLibraryName;
        if (std::filesystem::is_regular_file(candidate, ec)) return candidate.string();
        tried.push_back(candidate.string());
    }
    std::ostringstream os;
    for (const auto& t : tried) os << " " << t;
    WEFT_FAIL("weft's GIN device library (weft_gin_device_sm90a.fatbin, built with libweft by nvcc) was not found; "
              "set WEFT_GIN_DEVICE_LIBRARY to its path. Tried:"
              << (tried.empty() ? std::string(" nothing (this libweft was built without it)") : os.str()));
}

GinBackend::GinBackend(const Team& team, const GinOptions& options) : team_(team), options_(options) {
    team.require_member("GinBackend");
    init(team);
}

GinBackend::GinBackend(const Team& team, ncclComm_t comm, const GinOptions& options)
    : team_(team), options_(options), comm_(comm) {
    team.require_member("GinBackend");
    WEFT_CHECK(comm != nullptr, "GinBackend: comm must be an NCCL communicator over the team's ranks, got nullptr");
    init(team);
}

GinBackend::~GinBackend() { release(); }

void GinBackend::init(const Team& team) {
    WEFT_CHECK(options_.signal_count > 0, "GinOptions.signal_count must be > 0, got " << options_.signal_count);
    WEFT_CHECK(options_.counter_count >= 0, "GinOptions.counter_count must be >= 0, got " << options_.counter_count);
    WEFT_CHECK(options_.context_count > 0, "GinOptions.context_count must be > 0, got " << options_.context_count);
    const GinAvailability found = probe();
    const NcclApi& n = nccl();
    const std::string asked = "an NCCL device communicator with GIN (" + std::to_string(options_.signal_count) +
                              " signals, " + std::to_string(options_.counter_count) + " counters) over team " +
                              team.describe();
    if (!n.loaded) {
        WEFT_FAIL(gin_refusal_message(asked, "nothing: it could not be loaded", n.error, found));
    }
    WEFT_CHECK(n.version >= kMinNcclVersion,
               gin_refusal_message(asked, "nothing: NCCL " + version_text(n.version) + " has no device API", "",
                                   found));
    WEFT_CHECK(cuda_available(), gin_refusal_message(asked, "nothing: no CUDA GPU is visible", "", found));

    World& world = team.world();
    WEFT_CUDA_CHECK(cudaSetDevice(world.device()));
    const std::chrono::milliseconds timeout = team.timeout();
    try {
        if (comm_ == nullptr) {
            // Team rank 0 makes the id; the team's all_gather (bounded by its timeout) carries it to the others.
            std::vector<uint8_t> mine;
            if (team.rank() == 0) {
                ncclUniqueId id{};
                const ncclResult_t r = n.ncclGetUniqueId(&id);
                WEFT_CHECK(r == ncclSuccess, "GinBackend: ncclGetUniqueId failed: " << result_text(r));
                mine.assign(reinterpret_cast<const uint8_t*>(&id), reinterpret_cast<const uint8_t*>(&id) + sizeof id);
            }
            const auto all = team.all_gather("weft-gin-nccl-unique-id", mine);
            WEFT_CHECK(all.at(0).size() == sizeof(ncclUniqueId),
                       "GinBackend: team rank 0 sent an NCCL unique id of " << all.at(0).size() << " bytes, expected "
                                                                            << sizeof(ncclUniqueId));
            ncclUniqueId id{};
            std::memcpy(&id, all[0].data(), sizeof id);
            // Non-blocking, so that a member that never arrives ends the wait at the team's timeout.
            ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
            config.blocking = 0;
            ncclComm_t comm = nullptr;
            const ncclResult_t started = n.ncclCommInitRankConfig(&comm, team.num_ranks(), id, team.rank(), &config);
            const ncclResult_t r = comm != nullptr ? wait_comm(comm, started, timeout) : started;
            if (r != ncclSuccess) {
                const std::string last = comm != nullptr ? last_error(comm) : last_error(nullptr);
                if (comm != nullptr) n.ncclCommAbort(comm);
                WEFT_FAIL("GinBackend: NCCL could not make a communicator over team "
                          << team.describe() << " (rank " << team.rank() << " of " << team.num_ranks() << "): "
                          << (r == ncclInProgress ? "not every member joined within " +
                                                        std::to_string(timeout.count()) + " ms"
                                                  : result_text(r))
                          << (last.empty() ? "" : ": \"" + last + "\""));
            }
            comm_ = comm;
            owns_comm_ = true;
        } else {
            int count = 0, rank = -1;
            WEFT_CHECK(n.ncclCommCount(comm_, &count) == ncclSuccess && n.ncclCommUserRank(comm_, &rank) == ncclSuccess,
                       "GinBackend: ncclCommCount/ncclCommUserRank failed on the given communicator");
            WEFT_CHECK(count == team.num_ranks() && rank == team.rank(),
                       "GinBackend: comm must hold the team's ranks in team order: it has "
                           << count << " ranks and this rank is " << rank << " in it; the team has "
                           << team.num_ranks() << " and this rank is " << team.rank());
        }

        // The whole heap is one window: a kernel's heap offset is its window offset on every member.
        // NOTE: NCCL writes window_ and dev_comm_ from its own thread when the communicator is non-blocking: they
        // are members, so that a wait that times out leaves NCCL no dangling destination (release() aborts it).
        SymmetricHeap& heap = world.heap();
        ncclResult_t r = wait_comm(comm_,
                                   n.ncclCommWindowRegister(comm_, heap.base(), heap.bytes(), &window_,
                                                            NCCL_WIN_COLL_SYMMETRIC),
                                   timeout);
        if (r != ncclSuccess || window_ == nullptr) {
            WEFT_FAIL(gin_refusal_message(
                asked + " (first step: register the " + std::to_string(heap.bytes()) +
                    "-byte symmetric heap as a window)",
                r == ncclInProgress ? "no answer within " + std::to_string(timeout.count()) + " ms"
                : r != ncclSuccess  ? result_text(r)
                                    : "success, but registered no window (its symmetric memory support "
                                                    "is off: it needs CUDA VMM memory, NCCL_CUMEM_ENABLE not 0)",
                last_error(comm_), found));
        }

        ncclDevCommRequirements reqs{};
        reqs.ginForceEnable = true;
        reqs.ginContextCount = options_.context_count;
        reqs.ginSignalCount = options_.signal_count;
        reqs.ginCounterCount = options_.counter_count;
        r = wait_comm(comm_, n.ncclDevCommCreate(comm_, &reqs, &dev_comm_), timeout);
        if (r != ncclSuccess) {
            WEFT_FAIL(gin_refusal_message(asked,
                                          "ncclDevCommCreate: " + (r == ncclInProgress
                                                                       ? "no answer within " +
                                                                             std::to_string(timeout.count()) + " ms"
                                                                       : result_text(r)),
                                          last_error(comm_), found));
        }
        has_dev_comm_ = true;
        WEFT_CUDA_CHECK(cudaMalloc(&dev_comm_device_, sizeof(ncclDevComm)));
        WEFT_CUDA_CHECK(cudaMemcpy(dev_comm_device_, &dev_comm_, sizeof(ncclDevComm), cudaMemcpyHostToDevice));
        WEFT_CHECK(dev_comm_.ginContextCount > 0 && dev_comm_.ginSignalCount >= options_.signal_count,
                   gin_refusal_message(asked,
                                       "success with " + std::to_string(dev_comm_.ginContextCount) +
                                           " GIN contexts and " + std::to_string(dev_comm_.ginSignalCount) + " signals",
                                       "", found));
        WEFT_LOG_INFO("GIN backend over team " << team.describe() << ": " << dev_comm_.ginContextCount
                                               << " contexts, " << dev_comm_.ginSignalCount << " signals, NCCL "
                                               << version_text(n.version));
    } catch (...) {
        if (dev_comm_device_ != nullptr) {
            cudaFree(dev_comm_device_);
            dev_comm_device_ = nullptr;
        }
        if (owns_comm_) {
            // Abort is local (no peer needs to answer) and frees the window and devComm with the communicator.
            nccl().ncclCommAbort(comm_);
            comm_ = nullptr;
            owns_comm_ = false;
            window_ = nullptr;
            has_dev_comm_ = false;
        } else {
            release();
        }
        throw;
    }
}

void GinBackend::release() noexcept {
    if (dev_comm_device_ != nullptr) {
        cudaFree(dev_comm_device_);
        dev_comm_device_ = nullptr;
    }
    const NcclApi& n = nccl();
    if (!n.loaded || comm_ == nullptr) return;
    const std::chrono::milliseconds timeout = team_.is_member() ? team_.timeout() : std::chrono::milliseconds(60000);
    if (has_dev_comm_) {
        const ncclResult_t r = wait_comm(comm_, n.ncclDevCommDestroy(comm_, &dev_comm_), timeout);
        if (r != ncclSuccess) WEFT_LOG_WARN("GinBackend: ncclDevCommDestroy: " << result_text(r));
        has_dev_comm_ = false;
    }
    if (window_ != nullptr) {
        const ncclResult_t r = wait_comm(comm_, n.ncclCommWindowDeregister(comm_, window_), timeout);
        if (r != ncclSuccess) WEFT_LOG_WARN("GinBackend: ncclCommWindowDeregister: " << result_text(r));
        window_ = nullptr;
    }
    if (owns_comm_) {
        const ncclResult_t r = wait_comm(comm_, n.ncclCommFinalize(comm_), timeout);
        if (r == ncclSuccess) {
            n.ncclCommDestroy(comm_);
        } else {
            WEFT_LOG_WARN("GinBackend: ncclCommFinalize: " << result_text(r) << "; aborting the communicator");
            n.ncclCommAbort(comm_);
        }
        owns_comm_ = false;
    }
    comm_ = nullptr;
}

}  // namespace weft::net
