// SPDX-License-Identifier: MIT
// Teams: membership, splits, rank translation and the per-team device tables.
#include "weft/runtime/team.hpp"

#include <algorithm>
#include <cstring>

#include "runtime_internal.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/stream.hpp"

namespace weft {

namespace detail {

namespace {

// Deleter for the small device tables; safe on any thread (it makes the owning device current).
struct DeviceFree {
    int device;
    bool async;
    void operator()(void* p) const {
        if (p == nullptr) return;
        DeviceGuard guard(device);
        // cudaFree would synchronise the whole device, i.e. wait for other ranks' spinning kernels on a
        // shared GPU; the stream-ordered free does not. (The World's stream may be gone by now: a team can
        // outlive it by a few statements; the per-thread stream always exists.)
        cudaError_t st = async ? cudaFreeAsync(p, cudaStreamPerThread) : cudaFree(p);
        if (st != cudaSuccess) WEFT_LOG_WARN("freeing a team table failed: " << cudaGetErrorName(st));
    }
};

// Copies `bytes` of host data into a new device buffer on `device`, through the World's non-blocking stream.
std::shared_ptr<void> upload(int device, cudaStream_t stream, const void* host, size_t bytes) {
    DeviceGuard guard(device);
    const RelaxedCaptureMode relaxed;  // a private stream's work, beside another rank thread's capture
    int pools = 0;
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device));
    void* p = nullptr;
    if (pools != 0) {
        WEFT_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream));
    } else {
        WEFT_CUDA_CHECK(cudaMalloc(&p, bytes));
    }
    std::shared_ptr<void> owned(p, DeviceFree{device, pools != 0});
    WEFT_CUDA_CHECK(cudaMemcpyAsync(p, host, bytes, cudaMemcpyHostToDevice, stream));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    return owned;
}

// Team ranks r (and their world ranks) whose key `prefix + r` is not set; empty when none is missing or the
// store cannot say.
std::string missing_members(Store& store, const std::string& prefix, const TeamMembers& members) {
    std::vector<int> team_ranks, world_ranks;
    try {
        for (size_t r = 0; r < members.size(); ++r) {
            if (!store.check(prefix + std::to_string(r))) {
                team_ranks.push_back(static_cast<int>(r));
                world_ranks.push_back(members[r]);
            }
        }
    } catch (const std::exception&) {
        return "";
    }
    if (team_ranks.empty()) return "";
    return "team " + format_rank_list(team_ranks) + " (" + format_world_ranks(world_ranks) + ") did not arrive; ";
}

// For an exchange of a team made by split_strided (its id holds ".s": weft/team/<id>/...): members given other
// arguments hold teams of other ids and never meet this one.
std::string strided_split_hint(const std::string& name) {
    const std::string head = "weft/team/";
    if (name.rfind(head, 0) != 0) return "";
    const std::string id = name.substr(head.size(), name.find('/', head.size()) - head.size());
    if (id.find(".s") == std::string::npos) return "";
    return " (a member that is alive may hold another team: did every member call split_strided with the same "
           "arguments?)";
}

[[noreturn]] void fail_team_exchange(Store& store, const char* what, const std::string& name,
                                     const std::string& prefix, const TeamMembers& members, int team_rank,
                                     std::chrono::milliseconds timeout, const std::exception& e) {
    WEFT_FAIL("team " << what << " '" << name << "' of the team of " << format_world_ranks(members)
                      << " failed on team rank " << team_rank << " (world rank "
                      << members[static_cast<size_t>(team_rank)] << ") within " << timeout.count()
                      << " ms: " << missing_members(store, prefix, members) << e.what() << strided_split_hint(name));
}

}  // namespace

std::string format_world_ranks(const std::vector<int>& world_ranks) {
    return world_ranks.empty() ? "no world rank" : "world " + format_rank_list(world_ranks);
}

std::vector<Bytes> team_all_gather(Store& store, const std::string& name, const TeamMembers& members, int team_rank,
                                   const Bytes& blob, std::chrono::milliseconds timeout) {
    try {
        return store.all_gather(name, team_rank, static_cast<int>(members.size()), blob, timeout);
    } catch (const std::exception& e) {
        fail_team_exchange(store, "all_gather", name, name + "/", members, team_rank, timeout, e);
    }
}

void team_barrier(Store& store, const std::string& name, const TeamMembers& members, int team_rank,
                  std::chrono::milliseconds timeout) {
    try {
        store.barrier(name, team_rank, static_cast<int>(members.size()), timeout);
    } catch (const std::exception& e) {
        fail_team_exchange(store, "barrier", name, name + "/rank/", members, team_rank, timeout, e);
    }
}

Team TeamState::make(WorldContext* world, TeamMembers members, std::string id, bool is_world) {
    auto state = std::make_shared<TeamState>();
    state->world = world;
    state->id = std::move(id);
    state->members = std::move(members);
    state->is_world = is_world;
    state->rank = team_rank_of(state->members, world->rank);
    // Members per GPU (same host and PCI bus id), from what every rank published when the World started.
    std::vector<std::string> gpus;
    for (int w : state->members) {
        const RankInfo& info = world->ranks[static_cast<size_t>(w)];
        gpus.push_back(info.host + "|" + info.pci_bus_id);
    }
    const std::vector<int> gpu_group = group_by_label(gpus);
    std::vector<std::string> node_names;
    for (int w : state->members) node_names.push_back(world->ranks[static_cast<size_t>(w)].node);
    state->nodes = node_layout(group_by_label(node_names), state->rank);
    for (size_t r = 0; r < gpu_group.size(); ++r) {
        const int on_gpu = static_cast<int>(std::count(gpu_group.begin(), gpu_group.end(), gpu_group[r]));
        state->max_ranks_per_device = std::max(state->max_ranks_per_device, on_gpu);
        if (state->rank >= 0 && gpu_group[r] == gpu_group[static_cast<size_t>(state->rank)]) {
            ++state->num_ranks_on_device;
        }
    }
    if (state->rank >= 0) {
        const auto& bases = world->heap->peer_bases();
        std::vector<uint8_t*> peer_table;
        std::vector<int32_t> rank_table;
        for (int w : state->members) {
            peer_table.push_back(bases[static_cast<size_t>(w)]);
            rank_table.push_back(w);
        }
        // One entry past the peers: the World's trace buffer (or nullptr), where traced kernels find it in device
        // memory (include/weft/device/trace.cuh) instead of reading the host-mapped diagnostic record per event.
        peer_table.push_back(world->diag_host ? reinterpret_cast<uint8_t*>(world->diag_host->trace_buffer) : nullptr);
        std::vector<int64_t> key{is_world ? 1 : 0,
                                 static_cast<int64_t>(reinterpret_cast<uintptr_t>(peer_table.back()))};
        key.insert(key.end(), state->members.begin(), state->members.end());
        std::lock_guard<std::mutex> lock(world->team_tables_mutex);
        auto& tables = world->team_tables[key];
        if (!tables.first) {
            auto peers =
                upload(world->device, world->stream.get(), peer_table.data(), peer_table.size() * sizeof(uint8_t*));
            std::shared_ptr<void> ranks;
            if (!is_world) {
                ranks =
                    upload(world->device, world->stream.get(), rank_table.data(), rank_table.size() * sizeof(int32_t));
            }
            tables = {std::move(peers), std::move(ranks)};  // both or, when an upload throws, neither
        }
        state->peer_table = tables.first;
        state->rank_table = tables.second;
    }
    return Team(std::shared_ptr<const TeamState>(std::move(state)));
}

}  // namespace detail

Team::Team() : state_(std::make_shared<const detail::TeamState>()) {}

Team::Team(std::shared_ptr<const detail::TeamState> state) : state_(std::move(state)) {}

int Team::rank() const { return state_->rank; }

int Team::num_ranks() const { return static_cast<int>(state_->members.size()); }

int Team::world_rank(int team_rank) const { return detail::world_rank_of(state_->members, team_rank); }

int Team::team_rank(int world_rank) const { return detail::team_rank_of(state_->members, world_rank); }

const std::vector<int>& Team::members() const { return state_->members; }

World& Team::world() const {
    WEFT_CHECK(state_->world != nullptr && state_->world->owner != nullptr, "Team::world of an empty team");
    return *state_->world->owner;
}

const std::string& Team::id() const { return state_->id; }

bool Team::is_world() const { return state_->is_world; }

std::chrono::milliseconds Team::timeout() const {
    WEFT_CHECK(state_->world != nullptr, "Team::timeout of an empty team");
    return state_->world->timeout;
}

std::string Team::describe() const { return detail::format_world_ranks(state_->members); }

void Team::require_member(const std::string& what) const {
    WEFT_CHECK(state_->world != nullptr, what << ": the team is empty (a default-constructed Team)");
    WEFT_CHECK(is_member(), what << ": world rank " << state_->world->rank << " is not a member of this team ("
                                 << describe() << ")");
}

void Team::barrier() const {
    require_member("Team::barrier");
    detail::WorldContext& world = *state_->world;
    uint64_t seq = 0;
    {
        std::lock_guard<std::mutex> lock(world.team_mutex);
        seq = world.team_seq[state_->id + "/barrier"]++;
    }
    detail::team_barrier(*world.store, "weft/team/" + state_->id + "/barrier/" + std::to_string(seq), state_->members,
                         rank(), world.timeout);
}

std::vector<std::vector<uint8_t>> Team::all_gather(const std::string& key, const std::vector<uint8_t>& bytes) const {
    require_member("Team::all_gather('" + key + "')");
    WEFT_CHECK(!key.empty() && std::all_of(key.begin(), key.end(), [](unsigned char ch) { return ch > 0x20 && ch < 0x7f; }),
               "Team::all_gather: the key must be printable ASCII without spaces, got '" << key << "'");
    detail::WorldContext& world = *state_->world;
    uint64_t seq = 0;
    {
        std::lock_guard<std::mutex> lock(world.team_mutex);
        seq = world.team_seq[state_->id + "/ag/" + key]++;
    }
    // The sequence number makes each call's keys fresh: a member that has left the n-th exchange and starts the
    // next with the same key must not overwrite a value a slower member has yet to read.
    return detail::team_all_gather(*world.store, "weft/team/" + state_->id + "/ag/" + key + "/" + std::to_string(seq),
                                   state_->members, rank(), bytes, world.timeout);
}

int Team::num_ranks_on_device() const {
    require_member("Team::num_ranks_on_device");
    return state_->num_ranks_on_device;
}

int Team::max_ranks_per_device() const { return state_->max_ranks_per_device; }

int Team::num_nodes() const { return state_->nodes.num_nodes; }

int Team::ranks_per_node() const { return state_->nodes.ranks_per_node; }

int Team::node_index() const { return state_->nodes.node_index; }

int Team::local_index() const { return state_->nodes.local_index; }

const std::vector<int>& Team::node_members(int node_index) const {
    WEFT_CHECK(node_index >= 0 && node_index < state_->nodes.num_nodes,
               "Team::node_members: node_index must be in [0, " << state_->nodes.num_nodes << "), got " << node_index);
    return state_->nodes.members_by_node[static_cast<size_t>(node_index)];
}

Team Team::split_strided(int start, int stride, int size) const {
    WEFT_CHECK(state_->world != nullptr, "split_strided of an empty team");
    auto members = detail::split_strided_members(state_->members, start, stride, size);
    std::string id =
        state_->id + ".s" + std::to_string(start) + "_" + std::to_string(stride) + "_" + std::to_string(size);
    return detail::TeamState::make(state_->world, std::move(members), std::move(id), false);
}

Team Team::split_color(int color, int key) const {
    WEFT_CHECK(state_->world != nullptr, "split_color of an empty team");
    WEFT_CHECK(is_member(), "split_color: world rank " << state_->world->rank
                                                       << " is not a member of the team it splits (team id '"
                                                       << state_->id << "')");
    detail::WorldContext& world = *state_->world;
    uint64_t seq = 0;
    {
        std::lock_guard<std::mutex> lock(world.split_mutex);
        seq = world.split_seq[state_->id]++;
    }
    Bytes blob(8);
    std::memcpy(blob.data(), &color, 4);
    std::memcpy(blob.data() + 4, &key, 4);
    auto all = detail::team_all_gather(*world.store, "weft/team/" + state_->id + "/split/" + std::to_string(seq),
                                       state_->members, rank(), blob, world.timeout);
    std::vector<int> colors(all.size()), keys(all.size());
    for (size_t r = 0; r < all.size(); ++r) {
        WEFT_CHECK(all[r].size() == 8, "split_color: team rank " << r << " published a malformed record");
        std::memcpy(&colors[r], all[r].data(), 4);
        std::memcpy(&keys[r], all[r].data() + 4, 4);
    }
    auto members = detail::split_color_members(state_->members, colors, keys, color);
    std::string id = state_->id + ".c" + std::to_string(seq) + "_" + std::to_string(color);
    return detail::TeamState::make(state_->world, std::move(members), std::move(id), false);
}

DeviceCtx Team::device_ctx() const {
    WEFT_CHECK(state_->world != nullptr, "device_ctx of an empty team");
    require_member("device_ctx");
    const detail::WorldContext& world = *state_->world;
    DeviceCtx ctx{};
    ctx.rank = rank();
    ctx.num_ranks = num_ranks();
    ctx.heap_base = world.heap->base();
    ctx.heap_bytes = world.heap->bytes();
    ctx.peer_bases = static_cast<uint8_t* const*>(state_->peer_table.get());
    ctx.sm_budget = world.sm_budget;
    ctx.world_rank = world.rank;
    ctx.timeout_ns = static_cast<uint64_t>(world.timeout.count()) * 1000000ull;
    ctx.diag = world.diag_device;
    ctx.team_to_world = static_cast<const int32_t*>(state_->rank_table.get());
    ctx.abort_flag = world.abort_device;
    return ctx;
}

}  // namespace weft
