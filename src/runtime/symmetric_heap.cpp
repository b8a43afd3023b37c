// SPDX-License-Identifier: MIT
// The symmetric heap: VMM allocation per rank, peer mappings (same process or POSIX fds), collective alloc/free.
#include "weft/runtime/symmetric_heap.hpp"

#include <cuda.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>

#include "runtime_internal.hpp"
#include "weft/detail/fd_passing.hpp"
#include "weft/detail/offset_allocator.hpp"
#include "weft/detail/runtime_config.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/stream.hpp"

namespace weft {
namespace detail {

namespace {

constexpr uint64_t kOutsideHeap = std::numeric_limits<uint64_t>::max();
// kAllocSignals: alloc_signals (an alloc, then a zeroing barrier the plain alloc does not have).
enum class HeapOp : uint64_t { kAlloc = 1, kFree = 2, kAllocSignals = 3 };
// What a rank finds at the offset it is asked to free (the record's `b` for a free).
enum FreeStatus : uint64_t { kLive = 0, kNotLive = 1, kOtherTeam = 2 };

// One collective call as every rank describes it; compared across ranks before anything changes.
struct CallRecord {
    uint64_t seq = 0;
    HeapOp op = HeapOp::kAlloc;
    uint64_t a = 0;  // alloc: bytes; free: offset (kOutsideHeap when the pointer was not in the heap)
    uint64_t b = 0;  // alloc: align; free: FreeStatus
    bool operator==(const CallRecord&) const = default;
};

constexpr size_t kRecordBytes = 32;

void put_u64(Bytes& out, uint64_t v) {
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

uint64_t get_u64(const Bytes& in, size_t at) {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(in[at + static_cast<size_t>(i)]) << (8 * i);
    return v;
}

Bytes encode(const CallRecord& r) {
    Bytes out;
    for (uint64_t w : {r.seq, static_cast<uint64_t>(r.op), r.a, r.b}) put_u64(out, w);
    return out;
}

CallRecord decode(const Bytes& in, int from_rank) {
    WEFT_CHECK(in.size() >= kRecordBytes, "symmetric heap: world rank " << from_rank << " published a call record of "
                                                                        << in.size() << " bytes, expected at least "
                                                                        << kRecordBytes);
    return CallRecord{get_u64(in, 0), static_cast<HeapOp>(get_u64(in, 8)), get_u64(in, 16), get_u64(in, 24)};
}

// The free list that follows an alloc's record: (offset, size) pairs.
Bytes encode_free_list(const FreeBlocks& list) {
    Bytes out;
    for (const auto& [offset, size] : list) {
        put_u64(out, offset);
        put_u64(out, size);
    }
    return out;
}

FreeBlocks decode_free_list(const Bytes& in, int from_rank) {
    WEFT_CHECK((in.size() - kRecordBytes) % 16 == 0,
               "symmetric heap: world rank " << from_rank << " published a malformed free list");
    FreeBlocks list;
    for (size_t at = kRecordBytes; at < in.size(); at += 16) list.emplace_back(get_u64(in, at), get_u64(in, at + 8));
    return list;
}

std::string describe(const CallRecord& r) {
    std::ostringstream os;
    if (r.op == HeapOp::kAlloc) {
        os << "alloc(" << r.a << " bytes, align " << r.b << ")";
    } else if (r.op == HeapOp::kAllocSignals) {
        os << "alloc_signals(" << r.a / 8 << " words)";
    } else if (r.op == HeapOp::kFree) {
        if (r.a == kOutsideHeap) {
            os << "free(a pointer outside the heap)";
        } else {
            os << "free(offset " << r.a << ")";
            if (r.b == kNotLive) os << " where it has no live allocation";
            if (r.b == kOtherTeam) os << " of an allocation another team made";
        }
    } else {
        os << "an unknown heap call (" << static_cast<uint64_t>(r.op) << ")";
    }
    return os.str();
}

// The ranks of one collective heap call: the world, or a team's members.
struct CallGroup {
    std::string id;         // "world" or the team's id
    bool is_world = true;
    int rank = 0;           // this rank's index in `members`
    TeamMembers members;    // world ranks
    std::string key_scope;  // "" for the world (its keys predate teams), else "team/<id>/"
    std::string who() const { return is_world ? std::string() : " of the team of " + format_world_ranks(members); }
};

// Calls a driver function and turns a failure into a weft::Error that says what weft was doing.
void cu_call(CUresult status, const std::string& what) {
    if (status == CUDA_SUCCESS) return;
    const char* name = "unknown";
    driver().cuGetErrorName(status, &name);
    WEFT_FAIL(what << " failed: " << name);
}

CUmemAllocationProp allocation_prop(int device, bool exportable) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop.requestedHandleTypes = exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    return prop;
}

CUmemAccessDesc read_write_access(int device) {
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return desc;
}

bool can_access(int from_device, int to_device) {
    if (from_device == to_device) return true;
    int can = 0;
    return cudaDeviceCanAccessPeer(&can, from_device, to_device) == cudaSuccess && can != 0;
}

}  // namespace

/// One VMM mapping: a physical allocation handle mapped at a reserved VA range.
struct Mapping {
    CUmemGenericAllocationHandle handle = 0;
    CUdeviceptr va = 0;
    bool created = false;
    bool reserved = false;
    bool mapped = false;

    // Undoes whatever was done, in reverse order; never throws (logs instead).
    void release(uint64_t bytes, const char* whose) noexcept {
        const DriverApi& d = driver();
        if (mapped && d.cuMemUnmap(va, bytes) != CUDA_SUCCESS) WEFT_LOG_WARN("cuMemUnmap of " << whose << " failed");
        if (reserved && d.cuMemAddressFree(va, bytes) != CUDA_SUCCESS) {
            WEFT_LOG_WARN("cuMemAddressFree of " << whose << " failed");
        }
        if (created && d.cuMemRelease(handle) != CUDA_SUCCESS) WEFT_LOG_WARN("cuMemRelease of " << whose << " failed");
        mapped = reserved = created = false;
    }
};

struct HeapImpl {
    explicit HeapImpl(const HeapSetup& s) : setup(s), allocator(s.bytes), peers(static_cast<size_t>(s.num_ranks)) {}
    ~HeapImpl() { release(); }

    HeapSetup setup;
    OffsetAllocator allocator;
    Mapping own;
    std::vector<Mapping> peers;  // imported mappings (processes mode), by rank
    std::vector<uint8_t*> peer_bases;
    std::map<std::string, uint64_t> call_seq;  // per team id ("world" for the world)
    std::map<uint64_t, std::string> owner;     // live allocation's offset -> id of the team that made it

    uint8_t* base() const { return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(own.va)); }
    std::string key(const std::string& what) const { return "weft/heap/" + setup.job_id + "/" + what; }

    void create_own();
    void share_in_process();
    void share_across_processes();
    void import_peer(int peer, UniqueFd fd);

    CallGroup world_group() const;
    /// The group of `team`'s members; `team_heap` is the heap of the team's World (checked to be this one).
    CallGroup team_group(const Team& team, const char* what, const SymmetricHeap& team_heap,
                         const SymmetricHeap& this_heap) const;
    /// Exchanges this rank's record (and `extra` after it) with the group; throws weft::Error on every member
    /// when the records differ. Returns every member's blob, by team rank.
    std::vector<Bytes> agree(const CallGroup& g, const CallRecord& mine, const Bytes& extra);
    void* alloc(const CallGroup& g, uint64_t bytes, uint64_t align, HeapOp op = HeapOp::kAlloc);
    void free(const CallGroup& g, void* ptr);
    uint64_t* alloc_signals(const CallGroup& g, uint64_t count);

    // Peers' mappings first, then our own: the shutdown order in docs/runtime.md.
    void release() noexcept {
        for (size_t p = 0; p < peers.size(); ++p) {
            peers[p].release(setup.bytes, ("rank " + std::to_string(p) + "'s heap").c_str());
        }
        own.release(setup.bytes, "this rank's heap");
    }
};

void HeapImpl::create_own() {
    const DriverApi& d = driver();
    const std::string size_text = format_bytes(setup.bytes);
    CUmemAllocationProp prop = allocation_prop(setup.device, !setup.same_process);
    cu_call(d.cuMemCreate(&own.handle, setup.bytes, &prop, 0),
            "cuMemCreate of the " + size_text + " symmetric heap on device " + std::to_string(setup.device) +
                " (lower WEFT_SYMMETRIC_HEAP_BYTES if the GPU is short of memory)");
    own.created = true;
    cu_call(d.cuMemAddressReserve(&own.va, setup.bytes, setup.granularity, 0, 0),
            "cuMemAddressReserve of " + size_text + " for the symmetric heap");
    own.reserved = true;
    cu_call(d.cuMemMap(own.va, setup.bytes, 0, own.handle, 0), "cuMemMap of the symmetric heap");
    own.mapped = true;

    // Within one process every rank uses this VA directly, so grant access to each device of this process
    // that can reach ours; another process maps its own VA and sets its own access.
    std::vector<CUmemAccessDesc> access{read_write_access(setup.device)};
    if (setup.same_process) {
        std::vector<int> granted{setup.device};
        for (const RankInfo& r : setup.ranks) {
            if (std::find(granted.begin(), granted.end(), r.device) != granted.end()) continue;
            if (!can_access(r.device, setup.device)) continue;
            granted.push_back(r.device);
            access.push_back(read_write_access(r.device));
        }
    }
    cu_call(d.cuMemSetAccess(own.va, setup.bytes, access.data(), access.size()),
            "cuMemSetAccess of the symmetric heap for " + std::to_string(access.size()) + " device(s)");
}

void HeapImpl::share_in_process() {
    Bytes mine(8);
    const uint64_t va = own.va;
    std::memcpy(mine.data(), &va, 8);
    auto all = setup.store->all_gather(key("bases"), setup.rank, setup.num_ranks, mine, setup.init_timeout);
    for (int p = 0; p < setup.num_ranks; ++p) {
        uint64_t peer_va = 0;
        WEFT_CHECK(all[static_cast<size_t>(p)].size() == 8, "rank " << p << " published a malformed heap base");
        std::memcpy(&peer_va, all[static_cast<size_t>(p)].data(), 8);
        // Rank p granted our device access exactly when our device can reach p's (see create_own). A rank on
        // another (virtual) node is never load/store reachable, even when its GPU is.
        const RankInfo& info = setup.ranks[static_cast<size_t>(p)];
        const bool same_node = info.node == setup.ranks[static_cast<size_t>(setup.rank)].node;
        const bool reachable = same_node && can_access(setup.device, info.device);
        peer_bases[static_cast<size_t>(p)] =
            reachable ? reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(peer_va)) : nullptr;
        if (!reachable) {
            WEFT_LOG_INFO("rank " << p << "'s heap is not reachable from device " << setup.device
                                  << (same_node ? " (no peer access)" : " (another node)")
                                  << ": symm_at returns nullptr for it");
        }
    }
    peer_bases[static_cast<size_t>(setup.rank)] = base();
}

void HeapImpl::import_peer(int peer, UniqueFd fd) {
    const DriverApi& d = driver();
    const RankInfo& info = setup.ranks[static_cast<size_t>(peer)];
    // Find the peer's GPU among ours by PCI bus id (device ordinals differ between processes).
    int peer_device = -1;
    const bool visible = cudaDeviceGetByPCIBusId(&peer_device, info.pci_bus_id.c_str()) == cudaSuccess;
    if (!visible) cudaGetLastError();  // clear the non-sticky error
    if (visible && !can_access(setup.device, peer_device)) {
        WEFT_LOG_INFO("rank " << peer << "'s GPU " << info.pci_bus_id << " is not peer-accessible from device "
                              << setup.device << ": symm_at returns nullptr for it");
        return;  // fd closes here
    }
    Mapping& m = peers[static_cast<size_t>(peer)];
    const std::string whose = "rank " + std::to_string(peer) + "'s heap";
    try {
        cu_call(d.cuMemImportFromShareableHandle(&m.handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd.get())),
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                "cuMemImportFromShareableHandle of " + whose);
        m.created = true;
        fd.reset();  // the imported handle holds the memory; the descriptor is no longer needed
        cu_call(d.cuMemAddressReserve(&m.va, setup.bytes, setup.granularity, 0, 0), "cuMemAddressReserve for " + whose);
        m.reserved = true;
        cu_call(d.cuMemMap(m.va, setup.bytes, 0, m.handle, 0), "cuMemMap of " + whose);
        m.mapped = true;
        CUmemAccessDesc access = read_write_access(setup.device);
        cu_call(d.cuMemSetAccess(m.va, setup.bytes, &access, 1), "cuMemSetAccess of " + whose);
    } catch (const Error& e) {
        m.release(setup.bytes, whose.c_str());
        if (visible) throw;
        // Its GPU is not visible to this process, so reachability could not be checked in advance.
        WEFT_LOG_WARN(whose << " could not be mapped (" << e.what() << "): symm_at returns nullptr for it");
        return;
    }
    peer_bases[static_cast<size_t>(peer)] = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(m.va));
}

void HeapImpl::share_across_processes() {
    const DriverApi& d = driver();
    std::vector<int> local_peers;
    const RankInfo& me = setup.ranks[static_cast<size_t>(setup.rank)];
    for (int p = 0; p < setup.num_ranks; ++p) {
        // Only the ranks of this node: a rank on another virtual node of this host is reached through the network.
        if (p != setup.rank && setup.ranks[static_cast<size_t>(p)].host == me.host &&
            setup.ranks[static_cast<size_t>(p)].node == me.node) {
            local_peers.push_back(p);
        }
    }
    peer_bases[static_cast<size_t>(setup.rank)] = base();
    int raw_fd = -1;
    cu_call(d.cuMemExportToShareableHandle(&raw_fd, own.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle of the symmetric heap (POSIX file descriptor)");
    UniqueFd own_fd(raw_fd);
    FdExchange exchange;
    exchange.job_id = setup.job_id;
    exchange.rank = setup.rank;
    exchange.local_peers = local_peers;
    exchange.heap_bytes = setup.bytes;
    exchange.store = setup.store;
    exchange.num_ranks = setup.num_ranks;
    exchange.timeout = setup.init_timeout;
    exchange.stop_reason = setup.stop_reason;
    auto fds = exchange_fds(exchange, own_fd.get());
    own_fd.reset();
    for (auto& [peer, fd] : fds) import_peer(peer, std::move(fd));
    // Ranks on other hosts stay nullptr: not load/store reachable (a network transport serves them).
}

CallGroup HeapImpl::world_group() const {
    CallGroup g;
    g.id = "world";
    g.is_world = true;
    g.rank = setup.rank;
    g.members.resize(static_cast<size_t>(setup.num_ranks));
    for (int r = 0; r < setup.num_ranks; ++r) g.members[static_cast<size_t>(r)] = r;
    return g;
}

CallGroup HeapImpl::team_group(const Team& team, const char* what, const SymmetricHeap& team_heap,
                               const SymmetricHeap& this_heap) const {
    WEFT_CHECK(&team_heap == &this_heap, "symmetric heap " << what << ": the team belongs to another World");
    if (team.is_world()) return world_group();
    CallGroup g;
    g.id = team.id();
    g.is_world = false;
    g.rank = team.rank();
    g.members = team.members();
    g.key_scope = "team/" + g.id + "/";
    return g;
}

std::vector<Bytes> HeapImpl::agree(const CallGroup& g, const CallRecord& mine, const Bytes& extra) {
    Bytes blob = encode(mine);
    blob.insert(blob.end(), extra.begin(), extra.end());
    auto blobs = team_all_gather(*setup.store, key(g.key_scope + "call/" + std::to_string(mine.seq)), g.members,
                                 g.rank, blob, setup.timeout);
    std::vector<CallRecord> calls;
    calls.reserve(blobs.size());
    bool same = true;
    for (size_t r = 0; r < blobs.size(); ++r) {
        calls.push_back(decode(blobs[r], g.members[r]));
        same = same && calls.back() == calls.front();
    }
    if (same) return blobs;
    // Group ranks by what they asked, in order of first appearance; every rank builds the same message.
    std::vector<std::pair<CallRecord, std::vector<int>>> groups;
    for (size_t r = 0; r < calls.size(); ++r) {
        auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == calls[r]; });
        if (it == groups.end()) {
            groups.push_back({calls[r], {g.members[r]}});
        } else {
            it->second.push_back(g.members[r]);
        }
    }
    std::ostringstream os;
    os << "symmetric heap call #" << mine.seq << g.who()
       << " differs across ranks (every rank must make the same alloc/free calls, with the same arguments, in "
          "the same order): ";
    for (size_t i = 0; i < groups.size(); ++i) {
        os << (i ? "; " : "") << (g.is_world ? "" : "world ") << format_rank_list(groups[i].second) << " asked "
           << describe(groups[i].first);
        if (groups[i].first.seq != mine.seq) os << " as its call #" << groups[i].first.seq;
    }
    WEFT_FAIL(os.str());
}

void* HeapImpl::alloc(const CallGroup& g, uint64_t bytes, uint64_t align, HeapOp op) {
    const CallRecord call{++call_seq[g.id], op, bytes, align};
    // Every member posts its free blocks that could hold the allocation; all pick the lowest aligned offset
    // free on every member. With identical heaps (only world allocations so far) that is plain first fit.
    const auto blobs = agree(g, call, encode_free_list(allocator.free_list(std::max<uint64_t>(bytes, 1))));
    // From here on every member holds the same arguments and free lists: errors are raised on all of them.
    WEFT_CHECK(bytes > 0, "symmetric heap alloc #" << call.seq << g.who() << ": bytes must be positive, got 0");
    WEFT_CHECK(align > 0 && (align & (align - 1)) == 0 && align <= setup.granularity,
               "symmetric heap alloc #" << call.seq << g.who() << ": align must be a power of two no larger than "
                                        << setup.granularity << " (the VMM granularity), got " << align);
    std::vector<FreeBlocks> lists;
    lists.reserve(blobs.size());
    for (size_t r = 0; r < blobs.size(); ++r) lists.push_back(decode_free_list(blobs[r], g.members[r]));
    const auto offset = lowest_common_fit(lists, bytes, align);
    WEFT_CHECK(offset.has_value(), "symmetric heap alloc #"
                                       << call.seq << g.who() << " of " << format_bytes(bytes) << " (align " << align
                                       << ") does not fit: the heap is " << format_bytes(setup.bytes)
                                       << " per rank, and no aligned range of that size is free on every rank"
                                       << (g.is_world ? "" : " of the team") << " (this rank has "
                                       << format_bytes(allocator.bytes_in_use()) << " in use and a largest free block of "
                                       << format_bytes(allocator.largest_free_block())
                                       << "); enlarge it with WEFT_SYMMETRIC_HEAP_BYTES (or WorldOptions::heap_bytes)");
    allocator.reserve(*offset, bytes);
    owner[*offset] = g.id;
    return base() + *offset;
}

void HeapImpl::free(const CallGroup& g, void* ptr) {
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    const auto b = reinterpret_cast<uintptr_t>(base());
    const uint64_t offset = p >= b && p - b < setup.bytes ? static_cast<uint64_t>(p - b) : kOutsideHeap;
    uint64_t status = kLive;
    if (offset != kOutsideHeap) {
        auto it = owner.find(offset);
        status = it == owner.end() ? kNotLive : it->second == g.id ? kLive : kOtherTeam;
    }
    const CallRecord call{++call_seq[g.id], HeapOp::kFree, offset, offset == kOutsideHeap ? 0 : status};
    agree(g, call, {});
    WEFT_CHECK(offset != kOutsideHeap,
               "symmetric heap free (call #" << call.seq << g.who() << "): pointer " << ptr << " is not in the heap");
    WEFT_CHECK(status != kNotLive, "symmetric heap free (call #"
                                       << call.seq << g.who() << "): no live allocation starts at offset " << offset
                                       << " (double free, or not a pointer alloc returned)");
    WEFT_CHECK(status != kOtherTeam, "symmetric heap free (call #"
                                         << call.seq << g.who() << "): the allocation at offset " << offset
                                         << " was made by another team ('" << owner[offset]
                                         << "'): free it with the team that allocated it");
    allocator.release(offset);
    owner.erase(offset);
}

uint64_t* HeapImpl::alloc_signals(const CallGroup& g, uint64_t count) {
    // Oversized counts saturate so that alloc reports them (identically on every member).
    const uint64_t bytes =
        count > std::numeric_limits<uint64_t>::max() / 8 ? std::numeric_limits<uint64_t>::max() : count * 8;
    auto* signals = static_cast<uint64_t*>(alloc(g, bytes, 256, HeapOp::kAllocSignals));
    const uint64_t seq = call_seq[g.id];
    {
        DeviceGuard guard(setup.device);
        // The World's non-blocking stream does not wait for other ranks' kernels on a shared GPU.
        WEFT_CUDA_CHECK(cudaMemsetAsync(signals, 0, bytes, setup.stream));
        const RelaxedCaptureMode relaxed;  // beside another rank thread's capture in global mode
        WEFT_CUDA_CHECK(cudaStreamSynchronize(setup.stream));
    }
    team_barrier(*setup.store, key(g.key_scope + "signals/" + std::to_string(seq)), g.members, g.rank, setup.timeout);
    return signals;
}

uint64_t heap_granularity(int device, bool exportable) {
    CUmemAllocationProp prop = allocation_prop(device, exportable);
    size_t granularity = 0;
    cu_call(driver().cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity on device " + std::to_string(device));
    WEFT_CHECK(granularity > 0, "device " << device << " reports a VMM granularity of 0");
    return granularity;
}

std::unique_ptr<SymmetricHeap> make_symmetric_heap(const HeapSetup& setup) {
    WEFT_CHECK(setup.store != nullptr, "the symmetric heap needs a store");
    WEFT_CHECK(setup.granularity > 0 && setup.bytes > 0 && setup.bytes % setup.granularity == 0,
               "symmetric heap size " << setup.bytes << " is not a positive multiple of the granularity "
                                      << setup.granularity);
    WEFT_CHECK(static_cast<int>(setup.ranks.size()) == setup.num_ranks,
               "symmetric heap: " << setup.ranks.size() << " rank records for " << setup.num_ranks << " ranks");
    auto impl = std::make_unique<HeapImpl>(setup);
    impl->peer_bases.assign(static_cast<size_t>(setup.num_ranks), nullptr);
    impl->create_own();
    if (setup.same_process) {
        impl->share_in_process();
    } else {
        impl->share_across_processes();
    }
    return std::unique_ptr<SymmetricHeap>(new SymmetricHeap(std::move(impl)));
}

}  // namespace detail

SymmetricHeap::SymmetricHeap(std::unique_ptr<detail::HeapImpl> impl) : impl_(std::move(impl)) {}

SymmetricHeap::~SymmetricHeap() = default;

void* SymmetricHeap::alloc(uint64_t bytes, uint64_t align) { return impl_->alloc(impl_->world_group(), bytes, align); }

void SymmetricHeap::free(void* ptr) { impl_->free(impl_->world_group(), ptr); }

uint64_t* SymmetricHeap::alloc_signals(uint64_t count) { return impl_->alloc_signals(impl_->world_group(), count); }

namespace {

// The members of `team` as the heap's call group; throws weft::Error naming `what` when this rank is not a member.
detail::CallGroup group_of(const Team& team, const char* what, const SymmetricHeap& heap, const detail::HeapImpl& impl) {
    team.require_member(std::string("symmetric heap ") + what);
    return impl.team_group(team, what, team.world().heap(), heap);
}

}  // namespace

void* SymmetricHeap::alloc(const Team& team, uint64_t bytes, uint64_t align) {
    return impl_->alloc(group_of(team, "alloc", *this, *impl_), bytes, align);
}

void SymmetricHeap::free(const Team& team, void* ptr) { impl_->free(group_of(team, "free", *this, *impl_), ptr); }

uint64_t* SymmetricHeap::alloc_signals(const Team& team, uint64_t count) {
    return impl_->alloc_signals(group_of(team, "alloc_signals", *this, *impl_), count);
}

bool SymmetricHeap::contains(const void* ptr, uint64_t bytes) const {
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    const auto b = reinterpret_cast<uintptr_t>(impl_->base());
    return p >= b && p - b < impl_->setup.bytes && bytes <= impl_->setup.bytes - (p - b);
}

uint64_t SymmetricHeap::offset_of(const void* ptr) const {
    WEFT_CHECK(contains(ptr), "pointer " << ptr << " is not in this rank's symmetric heap ["
                                         << static_cast<void*>(base()) << ", +" << impl_->setup.bytes << ")");
    return static_cast<uint64_t>(static_cast<const uint8_t*>(ptr) - impl_->base());
}

void* SymmetricHeap::symm_at(const void* local_ptr, int rank) const {
    WEFT_CHECK(rank >= 0 && rank < impl_->setup.num_ranks,
               "symm_at: rank must be in [0, " << impl_->setup.num_ranks << "), got " << rank);
    const uint64_t offset = offset_of(local_ptr);
    uint8_t* peer = impl_->peer_bases[static_cast<size_t>(rank)];
    return peer == nullptr ? nullptr : peer + offset;
}

uint8_t* SymmetricHeap::base() const { return impl_->base(); }
uint64_t SymmetricHeap::bytes() const { return impl_->setup.bytes; }
uint64_t SymmetricHeap::granularity() const { return impl_->setup.granularity; }
uint64_t SymmetricHeap::bytes_in_use() const { return impl_->allocator.bytes_in_use(); }
const std::vector<uint8_t*>& SymmetricHeap::peer_bases() const { return impl_->peer_bases; }
int SymmetricHeap::rank() const { return impl_->setup.rank; }
int SymmetricHeap::num_ranks() const { return impl_->setup.num_ranks; }

}  // namespace weft
