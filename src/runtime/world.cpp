// SPDX-License-Identifier: MIT
// World: device binding, the start-up exchange, diagnostics, shutdown (run_local: run_local.cpp).
#include "weft/runtime/world.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "runtime_internal.hpp"
#include "weft/detail/host_mapped_pool.hpp"
#include "weft/detail/node_topology.hpp"
#include "weft/detail/runtime_config.hpp"
#include "weft/detail/runtime_placement.hpp"
#include "weft/detail/watchdog.hpp"
#include "weft/net/chunk_schedule.hpp"
#include "weft/runtime/diagnostics.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/module_loading.hpp"
#include "weft/runtime/stream.hpp"
#include "weft/runtime/trace.hpp"

namespace weft {

namespace detail {

void PinnedFree::operator()(Diagnostic* p) const {
    if (p == nullptr) return;
    cudaError_t st = cudaFreeHost(p);
    if (st != cudaSuccess) WEFT_LOG_WARN("cudaFreeHost of the diagnostic record failed: " << cudaGetErrorName(st));
}

void PinnedFree::operator()(uint32_t* p) const {
    if (p == nullptr) return;
    cudaError_t st = cudaFreeHost(p);
    if (st != cudaSuccess) WEFT_LOG_WARN("cudaFreeHost of the abort word failed: " << cudaGetErrorName(st));
}

void OwnedStream::create() {
    reset();
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

void OwnedStream::reset() noexcept {
    if (stream_ == nullptr) return;
    cudaError_t st = cudaStreamDestroy(stream_);
    if (st != cudaSuccess) WEFT_LOG_WARN("cudaStreamDestroy of the runtime's stream failed: " << cudaGetErrorName(st));
    stream_ = nullptr;
}

std::string random_hex_id() {
    std::random_device device;
    uint64_t v = (static_cast<uint64_t>(device()) << 32) ^ device();
    char text[17];
    std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(v));
    return text;
}

namespace {
// "rank r was started in a World of N ranks, rank 0 in one of M: ...", said by rank r and read by the others.
std::string size_disagreement(int rank, const std::string& its_size, const std::string& rank0_size) {
    return "rank " + std::to_string(rank) + " was started in a World of " + its_size + " ranks, rank 0 in one of " +
           rank0_size +
           ": every rank must be given the same number of ranks (WORLD_SIZE, or WorldMembership::num_ranks)";
}
}  // namespace

void agree_on_world_size(Store& store, int rank, int num_ranks, std::chrono::milliseconds timeout) {
    if (rank == 0) {
        const std::string mine = std::to_string(num_ranks);
        store.set(kWorldSizeKey, Bytes(mine.begin(), mine.end()));
        return;
    }
    Bytes theirs;
    try {
        theirs = store.get(kWorldSizeKey, timeout);
    } catch (const detail::WaitInterrupted&) {
        throw;  // the embedding's check ended the wait: not a sign of a missing or mis-sized rank 0
    } catch (const std::exception& e) {  // a store of the user's may throw any std::exception
        WEFT_FAIL("rank " << rank << " did not meet rank 0 at the World's start within " << timeout.count()
                          << " ms (is rank 0 of this job running? If it is, it may have been started in a World of "
                             "fewer than "
                          << rank + 1 << " ranks, which has started without this rank): " << e.what());
    }
    const std::string text(theirs.begin(), theirs.end());
    if (text != std::to_string(num_ranks)) {
        // For rank 0 and the ranks that agree with it, whose start-up exchange waits for this rank in vain.
        const std::string mine = std::to_string(num_ranks);
        store.set(kWorldSizeKey + std::string("/") + std::to_string(rank), Bytes(mine.begin(), mine.end()));
        WEFT_FAIL(size_disagreement(rank, mine, text));
    }
}

std::string world_size_disagreement(Store& store, int num_ranks) {
    try {
        for (int r = 1; r < num_ranks; ++r) {
            const std::string key = kWorldSizeKey + std::string("/") + std::to_string(r);
            if (!store.check(key)) continue;
            const Bytes theirs = store.get(key, std::chrono::milliseconds(1000));
            return size_disagreement(r, std::string(theirs.begin(), theirs.end()), std::to_string(num_ranks));
        }
    } catch (const std::exception&) {  // the store cannot say
    }
    return "";
}

}  // namespace detail

namespace {

// How long the ranks that refuse a World together wait for each other before throwing.
constexpr std::chrono::milliseconds kRefusalMeeting{10000};

// A setting as the ranks compare it: `resolve()`'s text, or `refused` when this rank refuses the value (the raw value
// may hold anything, a newline too).
template <class Resolve>
std::string setting_for_agreement(Resolve&& resolve, const char* refused) {
    try {
        return resolve();
    } catch (const std::exception&) {
        return refused;
    }
}

// What the ranks compare of tracing: on or off, and the buffer size it resolves to (or the value it refuses).
std::string trace_setting_for_agreement() {
    if (!trace_path_from_env()) return "off";
    return setting_for_agreement([] { return "on, " + std::to_string(trace_capacity_from_env()) + " events"; },
                                 "on, a WEFT_TRACE_EVENTS it refuses");
}

// What the ranks compare of WEFT_NET_CHUNK_BYTES: the chunk every network path cuts by (members that cut a node
// stage's blocks differently pair their sends and receives wrongly), or the value it refuses.
std::string net_chunk_setting_for_agreement() {
    return setting_for_agreement([] { return std::to_string(net::chunk_bytes_from_env()) + " bytes"; },
                                 "a value it refuses");
}

// The start-up record: "key=value" lines (values never contain a newline).
Bytes encode_fields(const std::map<std::string, std::string>& fields) {
    std::string text;
    for (const auto& [k, v] : fields) text += k + "=" + v + "\n";
    return Bytes(text.begin(), text.end());
}

std::map<std::string, std::string> decode_fields(const Bytes& blob, int from_rank) {
    std::map<std::string, std::string> fields;
    std::istringstream in(std::string(blob.begin(), blob.end()));
    std::string line;
    while (std::getline(in, line)) {
        auto eq = line.find('=');
        WEFT_CHECK(eq != std::string::npos,
                   "rank " << from_rank << " sent a malformed start-up record line '" << line << "'");
        fields[line.substr(0, eq)] = line.substr(eq + 1);
    }
    return fields;
}

const std::string& field(const std::map<std::string, std::string>& fields, const char* name, int from_rank) {
    auto it = fields.find(name);
    WEFT_CHECK(it != fields.end(), "rank " << from_rank << "'s start-up record has no '" << name
                                           << "' (ranks built from different weft versions?)");
    return it->second;
}

uint64_t parse_u64(const std::string& text, const char* name, int from_rank) {
    WEFT_CHECK(
        !text.empty() && std::all_of(text.begin(), text.end(), [](unsigned char ch) { return std::isdigit(ch); }),
        "rank " << from_rank << "'s start-up record has a malformed " << name << " '" << text << "'");
    return std::stoull(text);
}

/// What a rank finds out on its own before the start-up exchange.
struct LocalSetup {
    int num_devices = 0;  ///< visible to this rank
    int sm_count = 0;
    std::string pci;  ///< the device's PCI bus id
    uint64_t granularity = 0;
    uint64_t heap_request = 0;
};

/// World's construction up to the start-up exchange: the rank's own settings, its device and CUDA context.
void prepare_local(detail::WorldContext& c, const detail::WorldSetup& setup, LocalSetup& local) {
    check_log_env();
    prepare_cuda_environment();  // before this rank's first CUDA call
    c.timeout = detail::resolve_timeout(setup.options.timeout, env::get("WEFT_TIMEOUT_MS"));
    c.heartbeat = detail::resolve_heartbeat(setup.options.heartbeat, env::get("WEFT_HEARTBEAT_MS"));
    c.dead_peer =
        detail::resolve_dead_peer(setup.options.dead_peer_timeout, env::get("WEFT_DEAD_PEER_MS"), c.heartbeat);
    c.virtual_nodes =
        detail::resolve_virtual_nodes(setup.options.virtual_nodes, env::get("WEFT_VIRTUAL_NODES"), c.num_ranks);

    int& num_devices = local.num_devices;
    const cudaError_t count_status = cudaGetDeviceCount(&num_devices);
    if (count_status != cudaSuccess) {
        // The runtime says "insufficient driver" also where there is no driver at all: say which.
        int driver_version = 0;  // stays 0 without a driver
        cudaDriverGetVersion(&driver_version);
        WEFT_CHECK(driver_version != 0, "no CUDA driver on this machine (rank "
                                            << c.rank
                                            << "): a World needs a GPU; building, JIT compilation and "
                                               "unit tests run without one (weft-info says what the machine has)");
        WEFT_FAIL("cudaGetDeviceCount failed on rank "
                  << c.rank << ": " << cudaGetErrorName(count_status) << " (" << cudaGetErrorString(count_status)
                  << "); the driver supports CUDA " << driver_version / 1000 << "." << (driver_version % 1000) / 10
                  << " (weft-info says more)");
    }
    WEFT_CHECK(num_devices > 0, "no CUDA device is visible to rank " << c.rank);
    WEFT_CHECK(setup.options.device >= -1,
               "WorldOptions::device must be -1 (by local rank) or a visible device, got " << setup.options.device);
    if (setup.options.device >= 0) {
        WEFT_CHECK(setup.options.device < num_devices, "WorldOptions::device must be a visible device in [0, "
                                                           << num_devices << "), got " << setup.options.device);
        c.device = setup.options.device;
    } else {
        c.device = setup.device_hint % num_devices;
    }
    // The architecture, before the context, the first kernel or any compile: on another GPU the driver's and
    // NVRTC's messages would not say why nothing loads.
    cudaDeviceProp props{};
    WEFT_CUDA_CHECK(cudaGetDeviceProperties(&props, c.device));
    const std::string problem =
        detail::unsupported_device_message(c.rank, c.device, props.name, props.major, props.minor);
    if (!problem.empty()) throw Error("weft: " + problem);
    WEFT_CUDA_CHECK(cudaSetDevice(c.device));
    WEFT_CUDA_CHECK(cudaFree(nullptr));  // create the context now, so that failures surface here
    c.stream.create();
    warn_if_lazy_module_loading();
    // Before the start-up exchange: no rank leaves this constructor (and launches an op) until every rank of
    // the process is past the context's first kernel launch.
    detail::launch_first_kernel_of_context(c.stream.get());
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&local.sm_count, cudaDevAttrMultiProcessorCount, c.device));
    char pci[64] = {};
    WEFT_CUDA_CHECK(cudaDeviceGetPCIBusId(pci, sizeof(pci), c.device));
    local.pci = pci;
    local.granularity = detail::heap_granularity(c.device, !c.same_process);
    local.heap_request = detail::resolve_heap_bytes(setup.options.heap_bytes, env::get("WEFT_SYMMETRIC_HEAP_BYTES"), 1);
}

}  // namespace

World::World(detail::WorldSetup&& setup) : ctx_(std::make_unique<detail::WorldContext>()) {
    ctx_->uncaught_at_creation = std::uncaught_exceptions();
    detail::WorldContext& c = *ctx_;
    c.owner = this;
    WEFT_CHECK(setup.store != nullptr, "World needs a store");
    WEFT_CHECK(setup.num_ranks >= 1 && setup.rank >= 0 && setup.rank < setup.num_ranks,
               "World: rank " << setup.rank << " is outside [0, " << setup.num_ranks << ")");
    c.rank = setup.rank;
    c.num_ranks = setup.num_ranks;
    c.local_rank = setup.local_rank;
    c.local_num_ranks = setup.local_num_ranks;
    c.same_process = setup.same_process;
    c.store = std::move(setup.store);
    set_log_rank(c.rank);

    // What a rank resolves on its own before the start-up exchange. A rank that refuses here (a malformed setting,
    // a GPU weft cannot use, a failing CUDA call) still takes part in the exchange, carrying its refusal: every rank
    // then fails at once naming it, instead of waiting for it until the start-up timeout.
    std::exception_ptr refused;
    std::string refusal;
    LocalSetup local;
    try {
        prepare_local(c, setup, local);
    } catch (const std::exception& e) {
        refused = std::current_exception();
        refusal = e.what();
        if (refusal.rfind("weft: ", 0) == 0) refusal.erase(0, 6);
        std::replace(refusal.begin(), refusal.end(), '\n', ' ');  // one line of the record
        if (refusal.empty()) refusal = "(an error without a message)";
        // Said at once: the exchange waits for every rank, which may take until the start-up timeout.
        WEFT_LOG_ERROR("rank " << c.rank << " cannot start the World (" << refusal
                               << "); telling the other ranks at the start-up exchange");
    }
    const int sm_count = local.sm_count;
    const std::string& pci = local.pci;
    // A refusing rank waits as long as its peers do (its own timeout may be the setting it refused).
    const auto init_timeout =
        std::max(refused ? detail::timeout_before_exchange(setup.options.timeout) : c.timeout, detail::kMinInitTimeout);

    // Start-up exchange: who is where, and what each rank asks for.
    std::map<std::string, std::string> mine{
        {"host", detail::host_name()},
        {"pci", pci},
        {"device", std::to_string(c.device)},
        {"pid", std::to_string(::getpid())},
        {"pid_ns", detail::this_process_record().pid_namespace},
        {"heap_bytes", std::to_string(local.heap_request)},
        {"granularity", std::to_string(local.granularity)},
        // Settings every rank must share (compared below, naming the variable).
        {"virtual_nodes", std::to_string(c.virtual_nodes)},
        {"sm_budget_request", setup.options.sm_budget > 0 ? std::to_string(setup.options.sm_budget)
                                                          : env::get("WEFT_SM_BUDGET").value_or("")},
        // Tracing gathers every rank's events at shutdown (a collective): on on some ranks only, it would stall it;
        // its buffer size too (a value one rank refuses after this exchange would leave the others waiting).
        {"trace", trace_setting_for_agreement()},
        {"net_chunk", net_chunk_setting_for_agreement()},
        // Each rank beats at its own period and judges its peers by its own bound: a peer beating slower than a
        // watcher's bound allows would be declared dead.
        {"liveness", std::to_string(c.heartbeat.count()) + " ms heartbeat, " + std::to_string(c.dead_peer.count()) +
                         " ms dead-peer bound"},
        {"refused", refusal}};
    if (c.rank == 0) mine["job"] = detail::random_hex_id();
    // On the store the World was given; every later key is under this World's own prefix (below). A refusing rank
    // whose exchange fails (a peer that never came) ends with its own error, the cause.
    std::vector<Bytes> blobs;
    try {
        detail::agree_on_world_size(*c.store, c.rank, c.num_ranks, init_timeout);
        blobs = detail::start_exchange(*c.store, c.rank, c.num_ranks, [&] {
            return c.store->all_gather("weft/init", c.rank, c.num_ranks, encode_fields(mine), init_timeout);
        });
    } catch (const std::exception& e) {
        if (!refused) throw;
        WEFT_LOG_WARN("the start-up exchange failed too: " << e.what());
        std::rethrow_exception(refused);
    }
    // Every rank has read the size (each set its record after): the next World on this store sets its own.
    if (c.rank == 0) c.store->erase(detail::kWorldSizeKey);
    std::vector<uint64_t> heap_requests;
    uint64_t heap_granularity = 0;
    std::vector<std::string> virtual_nodes, sm_budget_requests, traces, net_chunks, liveness;
    uint64_t heap_bytes = 0;
    // The checks every rank makes alike on the same records, so every rank refuses here together. Before leaving,
    // they meet (bounded): rank 0's store (from_env's lives in its process) must stay up until every rank has read
    // every record, or a slower rank would report the closed store rather than the cause.
    try {
        // A rank that refused before the exchange: every rank fails now, naming it (it throws its own error).
        std::vector<std::map<std::string, std::string>> records;
        std::vector<std::pair<int, std::string>> refusals;
        for (int r = 0; r < c.num_ranks; ++r) {
            records.push_back(decode_fields(blobs[static_cast<size_t>(r)], r));
            if (const std::string& text = field(records.back(), "refused", r); !text.empty())
                refusals.emplace_back(r, text);
        }
        if (refused) std::rethrow_exception(refused);
        if (!refusals.empty()) {
            std::ostringstream os;
            os << "the World cannot start: "
               << (refusals.size() == 1 ? "a rank" : std::to_string(refusals.size()) + " ranks")
               << " refused before the start-up exchange (rank " << refusals[0].first << ": " << refusals[0].second
               << ")";
            if (refusals.size() > 1) {
                std::vector<int> ranks;
                for (const auto& [r, text] : refusals) ranks.push_back(r);
                os << "; refusing: " << detail::format_rank_list(ranks);
            }
            WEFT_FAIL(os.str());
        }
        for (int r = 0; r < c.num_ranks; ++r) {
            const auto& fields = records[static_cast<size_t>(r)];
            virtual_nodes.push_back(field(fields, "virtual_nodes", r));
            sm_budget_requests.push_back(field(fields, "sm_budget_request", r));
            traces.push_back(field(fields, "trace", r));
            net_chunks.push_back(field(fields, "net_chunk", r));
            liveness.push_back(field(fields, "liveness", r));
            detail::RankInfo info;
            info.host = field(fields, "host", r);
            info.pci_bus_id = field(fields, "pci", r);
            info.device = static_cast<int>(parse_u64(field(fields, "device", r), "device", r));
            info.pid = static_cast<int64_t>(parse_u64(field(fields, "pid", r), "pid", r));
            info.pid_namespace = field(fields, "pid_ns", r);
            c.ranks.push_back(info);
            heap_requests.push_back(parse_u64(field(fields, "heap_bytes", r), "heap_bytes", r));
            heap_granularity = std::max(heap_granularity, parse_u64(field(fields, "granularity", r), "granularity", r));
            if (r == 0) c.job_id = field(fields, "job", 0);
        }
        if (std::adjacent_find(heap_requests.begin(), heap_requests.end(), std::not_equal_to<>()) !=
            heap_requests.end()) {
            std::map<uint64_t, std::vector<int>> by_size;
            for (int r = 0; r < c.num_ranks; ++r) by_size[heap_requests[static_cast<size_t>(r)]].push_back(r);
            std::ostringstream os;
            os << "the symmetric heap size differs across ranks: ";
            bool first = true;
            for (const auto& [bytes, ranks] : by_size) {
                os << (first ? "" : "; ") << detail::format_rank_list(ranks) << " asked "
                   << detail::format_bytes(bytes);
                first = false;
            }
            os << "; set WEFT_SYMMETRIC_HEAP_BYTES (or WorldOptions::heap_bytes) identically on every rank";
            WEFT_FAIL(os.str());
        }
        heap_bytes = detail::resolve_heap_bytes(heap_requests[0], std::nullopt, heap_granularity);
        // The node layout and the SM split must be the same on every rank (teams, fused ops' tile counts).
        for (const auto& [values, what] :
             {std::pair{&virtual_nodes, "WEFT_VIRTUAL_NODES (or WorldOptions::virtual_nodes; resolved: 1 = none)"},
              std::pair{&sm_budget_requests, "WEFT_SM_BUDGET (or WorldOptions::sm_budget; empty: unset)"},
              std::pair{&traces, "WEFT_TRACE (set or not) and WEFT_TRACE_EVENTS"},
              std::pair{&net_chunks, "WEFT_NET_CHUNK_BYTES (resolved)"},
              std::pair{&liveness,
                        "WEFT_HEARTBEAT_MS and WEFT_DEAD_PEER_MS (or WorldOptions::heartbeat and "
                        "dead_peer_timeout; resolved)"}}) {
            for (int r = 1; r < c.num_ranks; ++r) {
                WEFT_CHECK((*values)[static_cast<size_t>(r)] == (*values)[0],
                           what << " differs across ranks: rank 0 has '" << (*values)[0] << "', rank " << r << " '"
                                << (*values)[static_cast<size_t>(r)] << "'; set it identically on every rank");
            }
        }
    } catch (...) {
        try {
            c.store->barrier("weft/init/refused", c.rank, c.num_ranks, std::min(init_timeout, kRefusalMeeting));
        } catch (const std::exception& e) {
            WEFT_LOG_DEBUG("the ranks did not all meet before refusing the World: " << e.what());
        }
        throw;
    }
    // Keys private to this World: a store that outlives it (a store of the user's, World::from_store) may carry
    // the next World under the same prefix, and must not see this one's keys (the shutdown's among them).
    const std::string world_prefix = "weft/world/" + c.job_id;
    c.store = make_prefix_store(std::move(c.store), world_prefix);
    // A rank whose construction fails from here on tells its peers, whose start-up waits (the heap's exchanges, the
    // ready barrier) would otherwise run to the timeout and name it as late.
    struct StartupFailure {
        detail::WorldContext& c;
        const int uncaught = std::uncaught_exceptions();
        ~StartupFailure() {
            c.starting = false;
            // Published by the rank that failed first, not by the ranks its key stopped.
            if (std::uncaught_exceptions() <= uncaught || !c.store || c.startup_stopped_by_peer) return;
            try {
                const std::string claim = std::string(detail::WorldContext::kStartupFailedKey) + "/claim";
                if (c.store->add(claim, 1) != 1) return;
                const std::string text =
                    "rank " + std::to_string(c.rank) + " failed while starting the World (its own error says why)";
                c.store->set(detail::WorldContext::kStartupFailedKey, Bytes(text.begin(), text.end()));
            } catch (...) {  // best effort: the peers' waits still end at their timeout
            }
        }
    } startup_failure{c};
    c.starting = true;
    // The watchdog's view of the store (its own connection where the World can make one), and the World's own
    // view, whose waits stop once the World is aborted. Connected only after the checks every rank makes alike: a
    // rank 0 that refused first would take its store away while a slower rank still connected (until the timeout).
    std::shared_ptr<Store> watchdog_store =
        setup.connect_watchdog_store ? make_prefix_store(setup.connect_watchdog_store(), world_prefix) : c.store;
    c.store = detail::make_abortable_store(std::move(c.store), &c);

    // Ranks that share this node (host, or virtual node: node_topology.hpp), this host, and this GPU (same host and
    // PCI bus id).
    std::vector<std::string> hosts, gpus;
    for (const auto& info : c.ranks) {
        hosts.push_back(info.host);
        gpus.push_back(info.host + "|" + info.pci_bus_id);
    }
    const std::vector<std::string> nodes = detail::node_labels(hosts, c.virtual_nodes);
    for (int r = 0; r < c.num_ranks; ++r) c.ranks[static_cast<size_t>(r)].node = nodes[static_cast<size_t>(r)];
    const auto host_group = detail::group_by_label(hosts);
    const auto node_group = detail::group_by_label(nodes);
    const auto gpu_group = detail::group_by_label(gpus);
    c.node = node_group[static_cast<size_t>(c.rank)];
    c.num_nodes = *std::max_element(node_group.begin(), node_group.end()) + 1;
    detail::TeamMembers node_members;
    int host_members = 0;
    for (int r = 0; r < c.num_ranks; ++r) {
        if (node_group[static_cast<size_t>(r)] == node_group[static_cast<size_t>(c.rank)]) node_members.push_back(r);
        if (host_group[static_cast<size_t>(r)] == host_group[static_cast<size_t>(c.rank)]) ++host_members;
        if (gpu_group[static_cast<size_t>(r)] == gpu_group[static_cast<size_t>(c.rank)] && r != c.rank) {
            ++c.num_ranks_on_device;
        }
        const auto on_gpu_of_r = std::count(gpu_group.begin(), gpu_group.end(), gpu_group[static_cast<size_t>(r)]);
        c.max_ranks_per_device = std::max(c.max_ranks_per_device, static_cast<int>(on_gpu_of_r));
    }
    const auto my_gpu = gpu_group[static_cast<size_t>(c.rank)];
    const bool first_on_gpu = std::find(gpu_group.begin(), gpu_group.end(), my_gpu) - gpu_group.begin() == c.rank;
    if (const std::string shared =
            detail::shared_gpu_warning(c.same_process, setup.options.device >= 0, first_on_gpu, c.local_rank, c.device,
                                       c.num_ranks_on_device - 1, local.num_devices);
        !shared.empty()) {
        WEFT_LOG_WARN(shared);
    }
    if (host_members != c.local_num_ranks) {
        WEFT_LOG_WARN("the launcher says " << c.local_num_ranks << " ranks run on this host, but "
                                           << host_members << " ranks report host name '"
                                           << hosts[static_cast<size_t>(c.rank)]
                                           << "'; the node team follows the host names");
    }
    c.sm_budget =
        detail::resolve_sm_budget(setup.options.sm_budget, env::get("WEFT_SM_BUDGET"), sm_count, c.num_ranks_on_device);
    c.shared_sm_budget = detail::resolve_sm_budget(setup.options.sm_budget, env::get("WEFT_SM_BUDGET"), sm_count,
                                                   c.max_ranks_per_device);

    // The pool ops take their host-mapped status words from: ready before any kernel spins (docs/runtime.md).
    detail::host_mapped_reserve();
    // Diagnostic record: pinned and mapped, so the host can read it even after a trap.
    Diagnostic* diag = nullptr;
    WEFT_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&diag), sizeof(Diagnostic),
                                  cudaHostAllocMapped | cudaHostAllocPortable));
    c.diag_host.reset(diag);
    std::memset(diag, 0, sizeof(Diagnostic));
    void* diag_device = nullptr;
    WEFT_CUDA_CHECK(cudaHostGetDevicePointer(&diag_device, diag, 0));
    c.diag_device = static_cast<Diagnostic*>(diag_device);
    // The abort word: pinned and mapped, so that the host sets it while kernels run and every wait reads it.
    uint32_t* abort_word = nullptr;
    WEFT_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&abort_word), 64, cudaHostAllocMapped | cudaHostAllocPortable));
    c.abort_host.reset(abort_word);
    std::memset(abort_word, 0, 64);
    void* abort_device = nullptr;
    WEFT_CUDA_CHECK(cudaHostGetDevicePointer(&abort_device, abort_word, 0));
    c.abort_device = static_cast<uint32_t*>(abort_device);

    detail::HeapSetup heap;
    heap.rank = c.rank;
    heap.num_ranks = c.num_ranks;
    heap.device = c.device;
    heap.store = c.store.get();
    heap.timeout = c.timeout;
    heap.init_timeout = init_timeout;
    heap.bytes = heap_bytes;
    heap.granularity = heap_granularity;
    heap.same_process = c.same_process;
    heap.stream = c.stream.get();
    heap.job_id = c.job_id;
    heap.ranks = c.ranks;
    heap.stop_reason = [&c] { return c.startup_wait_stop(*c.store); };
    c.heap = detail::make_symmetric_heap(heap);

    // The trace buffer first: every team's peer table carries its address (TeamState::make).
    detail::start_trace_if_asked(*this, c.diag_host.get());
    detail::TeamMembers everyone(static_cast<size_t>(c.num_ranks));
    for (int r = 0; r < c.num_ranks; ++r) everyone[static_cast<size_t>(r)] = r;
    c.world_team = detail::TeamState::make(&c, std::move(everyone), "world", true);
    c.node_team = detail::TeamState::make(&c, std::move(node_members), "node" + std::to_string(c.node), false);
    c.store->barrier("weft/init/ready", c.rank, c.num_ranks, init_timeout);
    if (c.num_ranks > 1) c.watchdog = std::make_unique<detail::Watchdog>(&c, std::move(watchdog_store));
    if (c.virtual_nodes > 1) {
        WEFT_LOG_INFO("virtual nodes: " << c.virtual_nodes << " of " << c.num_ranks / c.virtual_nodes
                                        << " ranks; this rank is on node " << c.node << " of " << c.num_nodes
                                        << " (peers on other nodes: network only, symm_at returns nullptr)");
    }
    WEFT_LOG_INFO("rank " << c.rank << "/" << c.num_ranks << " on device " << c.device << " (" << pci << "), "
                          << c.num_ranks_on_device << " rank(s) on this GPU, SM budget " << c.sm_budget << " of "
                          << sm_count << ", heap " << detail::format_bytes(heap_bytes) << ", timeout "
                          << c.timeout.count() << " ms, heartbeat " << c.heartbeat.count() << " ms, dead peer after "
                          << c.dead_peer.count() << " ms");
}

World::~World() {
    if (ctx_ && std::uncaught_exceptions() > ctx_->uncaught_at_creation && !aborted()) {
        try {
            abort("its World was destroyed while an exception propagated (the rank is leaving on an error)");
        } catch (const std::exception& e) {
            WEFT_LOG_WARN("aborting the World while leaving on an error failed: " << e.what());
        }
    }
    shutdown();
}

// Order (docs/runtime.md): device sync, barrier, peers' mappings and descriptors, own heap, device tables
// and pinned memory, then the store.
void World::shutdown() noexcept {
    if (!ctx_) return;
    detail::WorldContext& c = *ctx_;
    try {
        detail::DeviceGuard guard(c.device);
        // From now on the World's store waits stop only for a dead peer (an aborted World still meets its live
        // peers to shut down); the watchdog still runs, so a kernel that waits for a dead peer ends too.
        c.shutting_down = true;
        cudaError_t st = cudaDeviceSynchronize();
        if (st != cudaSuccess) {
            WEFT_LOG_WARN("shutdown: cudaDeviceSynchronize returned " << cudaGetErrorName(st) << "; releasing anyway");
        }
        detail::finish_trace_at_shutdown(*this);
        bool barrier_ok = c.store != nullptr;
        if (c.store) {
            try {
                c.store->barrier("weft/shutdown", c.rank, c.num_ranks, c.timeout);
            } catch (const std::exception& e) {
                barrier_ok = false;
                WEFT_LOG_WARN("shutdown barrier failed (a peer may be gone); releasing this rank's resources anyway: "
                              << e.what());
                // The peers that did not come may be inside a call with this rank; releasing its resources (a network
                // communicator) can end their side of it early without an error. Tell them first, in a record that
                // outlives this rank, and release as an aborted World (a communicator is aborted, not destroyed).
                const std::string why = "rank " + std::to_string(c.rank) +
                                        " left the World before the other ranks met it at its shutdown barrier (" +
                                        e.what() + "); a call they are in with it cannot complete";
                if (c.watchdog) c.watchdog->publish('A', why, /*keep=*/true);
                c.raise_abort(why, false);
            }
        }
        c.past_shutdown_barrier = true;  // peers may now exit: the watchdog no longer counts them dead
        // Extensions (the collectives' workspace ...) hold streams and device memory; the device is idle.
        c.extensions.clear();
        c.heap.reset();
        c.world_team = Team();
        c.node_team = Team();
        {
            std::lock_guard<std::mutex> lock(c.team_tables_mutex);
            c.team_tables.clear();  // the device is idle (synchronised above)
        }
        if (c.watchdog) c.watchdog->stop(c.rank == 0);  // before the records it reads go
        c.diag_host.reset();
        c.diag_device = nullptr;
        c.stream.reset();
        // Rank 0 hosts the store of from_env (and, by the Store contract, any store one rank's process hosts):
        // it closes only after every other rank has left the shutdown barrier, so that no rank loses the store
        // halfway through it.
        if (barrier_ok && !c.same_process && c.num_ranks > 1 && !c.dead_peer_known) {
            try {
                if (c.rank != 0) {
                    if (c.store->add("weft/shutdown/left", 1) == c.num_ranks - 1) {
                        c.store->set("weft/shutdown/all_left", Bytes{1});
                    }
                } else {
                    c.store->get("weft/shutdown/all_left", c.timeout);
                    // Nobody touches them any more; a long-lived store of the user's keeps nothing of this World.
                    c.store->erase("weft/shutdown/left");
                    c.store->erase("weft/shutdown/all_left");
                }
            } catch (const std::exception& e) {
                WEFT_LOG_WARN("shutdown: waiting for the other ranks to leave failed: " << e.what());
            }
        }
        c.store.reset();
    } catch (const std::exception& e) {
        WEFT_LOG_ERROR("shutdown failed: " << e.what());
    }
    if (c.watchdog) c.watchdog->stop(false);  // when the release above threw before it
    ctx_.reset();
}

int World::rank() const { return ctx_->rank; }
int World::num_ranks() const { return ctx_->num_ranks; }
int World::local_rank() const { return ctx_->local_rank; }
int World::local_num_ranks() const { return ctx_->local_num_ranks; }
int World::device() const { return ctx_->device; }
int World::sm_budget() const { return ctx_->sm_budget; }
int World::num_ranks_on_device() const { return ctx_->num_ranks_on_device; }
bool World::same_process() const { return ctx_->same_process; }
int World::max_ranks_per_device() const { return ctx_->max_ranks_per_device; }
int World::shared_sm_budget() const { return ctx_->shared_sm_budget; }
std::chrono::milliseconds World::timeout() const { return ctx_->timeout; }
SymmetricHeap& World::heap() { return *ctx_->heap; }
const SymmetricHeap& World::heap() const { return *ctx_->heap; }
Store& World::store() { return *ctx_->store; }
const Team& World::team() const { return ctx_->world_team; }
const Team& World::node_team() const { return ctx_->node_team; }

int World::node() const { return ctx_->node; }

int World::num_nodes() const { return ctx_->num_nodes; }

int World::virtual_nodes() const { return ctx_->virtual_nodes; }
DeviceCtx World::device_ctx() const { return ctx_->world_team.device_ctx(); }

void World::barrier() {
    ctx_->store->barrier("weft/barrier/" + std::to_string(ctx_->barrier_seq++), ctx_->rank, ctx_->num_ranks,
                         ctx_->timeout);
}

std::string World::diagnostic_message(bool wait_for_writer) const {
    return detail::read_diagnostic(*ctx_, wait_for_writer);
}

// "rank R: the World was aborted: <reason>; <this rank's record>", or the record alone, or "" when neither.
std::string World::failure_message() const {
    const detail::WorldContext& c = *ctx_;
    const std::string diagnosis = diagnostic_message(true);
    const std::string reason = c.abort_text();
    if (reason.empty()) return diagnosis;
    std::string text = "rank " + std::to_string(c.rank) + ": the World was aborted: " + reason;
    if (!diagnosis.empty() && reason.find(diagnosis) == std::string::npos) text += "; on this rank: " + diagnosis;
    return text;
}

void World::check_diagnostics() const {
    std::string message = failure_message();
    if (!message.empty()) throw Error("weft: " + message);
}

void World::clear_diagnostics() {
    detail::WorldContext& c = *ctx_;
    // A device wait's abort reaches the peers through the watchdog's next beat: cleared before it, the peers would
    // never hear of it and wait for this rank until their own timeout. Tell them now.
    if (c.abort_word() == kAbortByDeviceWait && c.watchdog && !c.device_abort_published.exchange(true)) {
        c.watchdog->publish('A', c.abort_text());
    }
    if (c.abort_word() != kAbortNone) {
        std::string text = c.abort_text();
        if (text.empty()) text = "the abort word was set";
        {
            std::lock_guard<std::mutex> lock(c.abort_mutex);
            c.last_cleared_abort = std::move(text);
        }
        c.cleared_aborts.fetch_add(1);
    }
    if (Diagnostic* record = c.diag_host.get()) {
        const uint64_t trace_buffer = record->trace_buffer;
        std::memset(record, 0, sizeof(Diagnostic));
        record->trace_buffer = trace_buffer;
    }
    {
        std::lock_guard<std::mutex> lock(c.abort_mutex);
        c.abort_reason.clear();
    }
    c.dead_peer_known = false;
    c.device_abort_published = false;
    if (c.abort_host) __atomic_store_n(c.abort_host.get(), uint32_t{kAbortNone}, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

uint64_t World::cleared_aborts() const { return ctx_->cleared_aborts.load(); }

std::string World::last_cleared_abort() const {
    std::lock_guard<std::mutex> lock(ctx_->abort_mutex);
    return ctx_->last_cleared_abort;
}

void World::abort(const std::string& reason) {
    detail::WorldContext& c = *ctx_;
    const std::string text =
        "rank " + std::to_string(c.rank) + " called World::abort" + (reason.empty() ? std::string() : ": " + reason);
    const bool first = c.abort_word() == kAbortNone;
    c.raise_abort(text, false);
    if (first && c.watchdog) c.watchdog->publish('A', text);
}

bool World::aborted() const { return ctx_->abort_word() != kAbortNone; }

namespace {
bool is_capture_error(cudaError_t e) {
    switch (e) {
        case cudaErrorStreamCaptureUnsupported:
        case cudaErrorStreamCaptureInvalidated:
        case cudaErrorStreamCaptureMerge:
        case cudaErrorStreamCaptureUnmatched:
        case cudaErrorStreamCaptureUnjoined:
        case cudaErrorStreamCaptureIsolation:
        case cudaErrorStreamCaptureImplicit:
        case cudaErrorStreamCaptureWrongThread:
            return true;
        default:
            return false;
    }
}
/// cudaStreamSynchronize(stream) for an embedding whose interruptions end weft's host waits
/// (set_wait_interrupt_check): the stream queried until it is done, yielding between queries (as the synchronisation
/// spins by default), the check asked every 100 ms; its reason throws detail::WaitInterrupted (the stream's work goes
/// on: the embedding aborts the World, which ends weft's device waits). Returns what the last query returned.
cudaError_t synchronize_interruptibly(cudaStream_t stream, int rank) {
    using Clock = std::chrono::steady_clock;
    const Clock::time_point start = Clock::now();
    Clock::time_point next_check = start + std::chrono::milliseconds(100);
    while (true) {
        const cudaError_t st = cudaStreamQuery(stream);
        if (st != cudaErrorNotReady) return st;
        const Clock::time_point now = Clock::now();
        if (now >= next_check) {
            if (std::optional<std::string> why = wait_interrupted()) {
                detail::throw_wait_interrupted(
                    "rank " + std::to_string(rank) + ": sync_and_check stopped after " +
                    std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count()) +
                    " ms with the stream's work still running: " + *why);
            }
            next_check = now + std::chrono::milliseconds(100);
        }
        std::this_thread::yield();
    }
}
}  // namespace

void World::sync_and_check(cudaStream_t stream) {
    // A stream being captured, or the legacy stream beside a capture of a blocking stream, cannot be synchronised
    // (CUDA refuses, with an error that is not sticky and says nothing of the kernels): a usage error of this call,
    // not a kernel failure to abort the World for. Any other failure of the query (a kernel that trapped leaves the
    // context's error sticky) is left to the synchronisation, which reports it and aborts as always.
    const auto refuse_under_capture = [&](cudaError_t why) {
        (void)cudaGetLastError();
        WEFT_FAIL("rank " << ctx_->rank
                          << ": sync_and_check on a stream that is being captured into a CUDA graph, or "
                             "the legacy stream while another stream is captured ("
                          << cudaGetErrorName(why)
                          << "): synchronise and check after the graph's launch, on the "
                             "stream it was launched on");
    };
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (const cudaError_t q = cudaStreamIsCapturing(stream, &capture); q != cudaSuccess) {
        if (is_capture_error(q)) refuse_under_capture(q);
        capture = cudaStreamCaptureStatusNone;
        (void)cudaGetLastError();  // not left for a later call to find (a sticky error stays regardless)
    }
    if (capture != cudaStreamCaptureStatusNone) refuse_under_capture(cudaErrorStreamCaptureUnsupported);
    cudaError_t st = cudaSuccess;
    const bool interruptible = detail::wait_interrupt_check_set();
    const std::string synchronized_by = interruptible ? "cudaStreamQuery" : "cudaStreamSynchronize";
    {
        // Another rank thread's capture in global mode (PyTorch's default) must neither fail this synchronisation nor
        // be invalidated by it.
        const RelaxedCaptureMode relaxed;
        st = interruptible ? synchronize_interruptibly(stream, ctx_->rank) : cudaStreamSynchronize(stream);
    }
    if (is_capture_error(st)) refuse_under_capture(st);
    if (st != cudaSuccess) {
        const std::string cuda = std::string(cudaGetErrorName(st)) + " (" + cudaGetErrorString(st) + ")";
        // The peers may wait for this rank's kernel: they stop at their next heartbeat rather than at their bound.
        if (ctx_->abort_word() == kAbortNone) {
            const std::string why = "rank " + std::to_string(ctx_->rank) + ": a kernel failed: " + cuda;
            ctx_->raise_abort(why, false);
            if (ctx_->watchdog) ctx_->watchdog->publish('A', why);
        }
        const std::string diagnosis = failure_message();
        if (!diagnosis.empty()) {
            throw Error("weft: " + diagnosis + "; the kernel then trapped: " + synchronized_by + " returned " + cuda);
        }
        throw Error("weft: rank " + std::to_string(ctx_->rank) + ": " + synchronized_by + " returned " + cuda +
                    (ctx_->same_process ? "; this rank wrote no diagnostic record (a kernel of another rank of "
                                          "this process may have trapped)"
                                        : "; no diagnostic record was written (not a weft spin timeout)"));
    }
    bool read_peers = false;
    for (auto& [name, extension] : ctx_->extensions) read_peers = extension->check_after_sync() || read_peers;
    if (read_peers && ctx_->watchdog) ctx_->watchdog->read_records_now();
    check_diagnostics();
}

WorldExtension* World::find_extension(const std::string& name) const {
    auto it = ctx_->extensions.find(name);
    return it == ctx_->extensions.end() ? nullptr : it->second.get();
}

WorldExtension& World::add_extension(const std::string& name, std::unique_ptr<WorldExtension> extension) {
    WEFT_CHECK(extension != nullptr, "World::add_extension('" << name << "'): the extension is null");
    auto [it, inserted] = ctx_->extensions.emplace(name, std::move(extension));
    WEFT_CHECK(inserted, "World::add_extension: an extension named '" << name << "' is already registered");
    return *it->second;
}

}  // namespace weft
