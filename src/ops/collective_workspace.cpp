// SPDX-License-Identifier: MIT
// The per-World collective workspace: made collectively on first use, destroyed with the World.
#include "collective_workspace.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>

#include "tp_common.hpp"
#include "weft/jit/aot.hpp"
#include "weft/net/host_backend.hpp"
#include "weft/ops/aot.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/stream.hpp"

namespace weft::ops {

namespace detail {

namespace {

constexpr uint64_t kDefaultStagingRegionBytes = 32ull << 20;
constexpr uint64_t kMinStagingRegionBytes = 64ull << 10;
constexpr int kMaxSideStreams = 8;
constexpr DType kReducibleTypes[3] = {DType::kBF16, DType::kF16, DType::kF32};

int dtype_index(DType t) {
    for (int i = 0; i < 3; ++i) {
        if (kReducibleTypes[i] == t) return i;
    }
    WEFT_FAIL("collectives: dtype " << dtype_name(t) << " cannot be reduced (bf16, f16, f32)");
}

// Throws unless a reducing kernel exists for `t`.
void check_reducing_dtype(DType t) {
    for (DType r : kReducibleTypes) {
        if (r == t) return;
    }
    WEFT_FAIL("collectives: no reducing kernel for dtype " << dtype_name(t));
}

struct KernelName {
    const char* header;
    const char* function;
    const char* description;
};

KernelName kernel_name(KernelId id) {
    switch (id) {
        case KernelId::kAllReduceOneShot:
            return {"all_reduce/all_reduce.cuh", "weft::kernels::all_reduce::all_reduce_one_shot",
                    "all_reduce one_shot"};
        case KernelId::kAllReduceTwoShot:
            return {"all_reduce/all_reduce.cuh", "weft::kernels::all_reduce::all_reduce_two_shot",
                    "all_reduce two_shot"};
        case KernelId::kAllReduceLowLatency:
            return {"all_reduce/all_reduce.cuh", "weft::kernels::all_reduce::all_reduce_low_latency", "all_reduce ll"};
        case KernelId::kReduceScatterPull:
            return {"reduce_scatter/reduce_scatter.cuh", "weft::kernels::reduce_scatter::reduce_scatter_pull",
                    "reduce_scatter sm_pull"};
        case KernelId::kReduceScatterLowLatency:
            return {"reduce_scatter/reduce_scatter.cuh", "weft::kernels::reduce_scatter::reduce_scatter_low_latency",
                    "reduce_scatter ll"};
        case KernelId::kAllGatherPush:
            return {"all_gather/all_gather.cuh", "weft::kernels::all_gather::all_gather_push", "all_gather sm_push"};
        case KernelId::kAllGatherLowLatency:
            return {"all_gather/all_gather.cuh", "weft::kernels::all_gather::all_gather_low_latency", "all_gather ll"};
        case KernelId::kCopyEngineEnter:
            return {"all_gather/all_gather.cuh", "weft::kernels::all_gather::copy_engine_enter", "copy_engine enter"};
        case KernelId::kCopyEngineExit:
            return {"all_gather/all_gather.cuh", "weft::kernels::all_gather::copy_engine_exit", "copy_engine exit"};
        case KernelId::kAllToAllPull:
            return {"all_to_all/all_to_all.cuh", "weft::kernels::all_to_all::all_to_all_pull", "all_to_all pull"};
        case KernelId::kAttentionSpCombine:
            return {"attention/sp_combine.cuh", "weft::kernels::attention::attention_sp_combine",
                    "attention sp_combine"};
        case KernelId::kCount:
            break;
    }
    WEFT_FAIL("collectives: unknown kernel id " << static_cast<int>(id));
}

// Ranks of every rank's setup record, in the store's all-gather.
struct SetupRecord {
    int32_t sm_budget;
    int32_t ranks_on_device;
    uint64_t staging_region_bytes;
};

}  // namespace

bool kernel_is_reducing(KernelId id) {
    return id == KernelId::kAllReduceOneShot || id == KernelId::kAllReduceTwoShot ||
           id == KernelId::kAllReduceLowLatency || id == KernelId::kReduceScatterPull ||
           id == KernelId::kReduceScatterLowLatency || id == KernelId::kAttentionSpCombine;
}

int kernel_block_threads(KernelId id, int max_ranks) {
    if (id == KernelId::kCopyEngineEnter || id == KernelId::kCopyEngineExit) {
        return std::max(32, (max_ranks + 31) / 32 * 32);
    }
    return 256;  // two blocks per SM fit, so ranks sharing a GPU stay co-resident beside other small kernels
}

jit::KernelSpec collective_kernel_spec(KernelId id, DType dtype, int max_ranks) {
    const KernelName name = kernel_name(id);
    const int threads = kernel_block_threads(id, max_ranks);
    std::ostringstream config;
    std::ostringstream desc;
    if (kernel_is_reducing(id)) {
        check_reducing_dtype(dtype);
        config << "weft::ReduceKernelConfig{.dtype = " << dtype_enum_name(dtype) << ", .max_ranks = " << max_ranks
               << ", .vec_bytes = 16, .block_threads = " << threads << "}";
        desc << name.description << " " << dtype_name(dtype) << " max_ranks=" << max_ranks;
    } else {
        config << "weft::CopyKernelConfig{.max_ranks = " << max_ranks
               << ", .vec_bytes = 16, .block_threads = " << threads << "}";
        desc << name.description << " max_ranks=" << max_ranks;
    }
    jit::KernelSpec spec;
    spec.header = name.header;
    spec.instantiation = std::string(name.function) + "<" + config.str() + ">";
    spec.description = desc.str();
    return spec;
}

std::vector<jit::KernelSpec> collective_kernel_specs(int max_ranks) {
    std::vector<jit::KernelSpec> specs;
    for (int k = 0; k < static_cast<int>(KernelId::kCount); ++k) {
        const auto id = static_cast<KernelId>(k);
        if (kernel_is_reducing(id)) {
            for (DType t : kReducibleTypes) specs.push_back(collective_kernel_spec(id, t, max_ranks));
        } else {
            specs.push_back(collective_kernel_spec(id, DType::kBF16, max_ranks));
        }
    }
    return specs;
}

namespace {

// What check_device_pointer asks of the stream and the thread once per call, for all the call's pointers.
struct PointerCheckContext {
    bool valid_stream = true;  // an invalid stream fails at the first enqueue, with CUDA's own message
    bool capturing = false;
    int device = 0;
};

PointerCheckContext pointer_check_context(cudaStream_t stream) {
    PointerCheckContext c;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
        (void)cudaGetLastError();
        c.valid_stream = false;
        return c;
    }
    c.capturing = capture != cudaStreamCaptureStatusNone;
    WEFT_CUDA_CHECK(cudaGetDevice(&c.device));
    return c;
}

void check_device_pointer(const PointerCheckContext& c, const void* ptr, const char* what, const char* op,
                          bool mapped_host_ok = false) {
    if (!c.valid_stream) return;
    // Checked under capture too (a graph's buffers are often new ones), in relaxed capture mode (the query is no
    // stream operation and must not invalidate a capture); there only what the query can tell for sure is refused:
    // an address the graph itself allocates (cudaMallocAsync in the capture) is not mapped yet.
    cudaPointerAttributes attr{};
    cudaError_t st = cudaSuccess;
    {
        const RelaxedCaptureMode relaxed;
        st = cudaPointerGetAttributes(&attr, ptr);
    }
    if (st != cudaSuccess) {
        (void)cudaGetLastError();  // the query left an error behind: clear it
        if (c.capturing) return;
        WEFT_FAIL(op << ": " << what << " (" << ptr << ") is not memory CUDA knows (" << cudaGetErrorName(st) << ")");
    }
    if (c.capturing && attr.type == cudaMemoryTypeUnregistered) return;
    if (mapped_host_ok && attr.type == cudaMemoryTypeHost) {
        WEFT_CHECK(attr.devicePointer == ptr, op << ": " << what << " (" << ptr
                                                 << ") is pinned host memory the device does not reach at that address "
                                                    "(allocate it with cudaHostAlloc(..., cudaHostAllocMapped))");
        return;
    }
    WEFT_CHECK(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged,
               op << ": " << what << " (" << ptr << ") must be device memory"
                  << (mapped_host_ok ? " or host-mapped pinned memory" : "") << ", got "
                  << (attr.type == cudaMemoryTypeHost ? "pinned host memory" : "unregistered host memory"));
    if (attr.type == cudaMemoryTypeDevice) {
        WEFT_CHECK(attr.device == c.device, op << ": " << what << " (" << ptr << ") is memory of device " << attr.device
                                               << ", but this rank runs on device " << c.device);
    }
}

}  // namespace

void check_device_pointer(const void* ptr, const char* what, const char* op, cudaStream_t stream) {
    check_device_pointer(pointer_check_context(stream), ptr, what, op);
}

void check_device_or_mapped_pointer(const void* ptr, const char* what, const char* op, cudaStream_t stream) {
    if (ptr == nullptr) return;
    check_device_pointer(pointer_check_context(stream), ptr, what, op, /*mapped_host_ok=*/true);
}

void check_device_buffers(const SymmetricHeap& heap, std::initializer_list<NamedView> views, const char* op,
                          cudaStream_t stream) {
    std::optional<PointerCheckContext> c;  // asked for at the first view off the heap
    for (const NamedView& v : views) {
        const auto bytes = static_cast<uint64_t>(v.view.size_bytes());
        if (bytes == 0 || heap.contains(v.view.data, bytes)) continue;
        if (!c) c = pointer_check_context(stream);
        check_device_pointer(*c, v.view.data, v.name, op);
    }
}

void check_device_views(std::initializer_list<NamedView> views, const char* op, cudaStream_t stream) {
    std::optional<PointerCheckContext> c;
    for (const NamedView& v : views) {
        if (v.view.size_bytes() == 0) continue;
        if (!c) c = pointer_check_context(stream);
        check_device_pointer(*c, v.view.data, v.name, op);
    }
}

CollectiveHeapSizes CollectiveHeapSizes::make(int num_ranks, uint64_t staging_region_bytes,
                                              const CollectiveTopology& topo) {
    const auto n = static_cast<uint64_t>(num_ranks);
    CollectiveHeapSizes s;
    s.staging_region_bytes = staging_region_bytes;
    s.ll_slot_bytes = 2 * topo.low_latency_capacity_bytes;
    s.barrier_signals = uint64_t{kMaxCollectiveBlocks} * n;
    s.descriptor_signals = 2 * n;
    s.copy_engine_signals = n;
    s.ll_buffer_signals = 2 * n * s.ll_slot_bytes / 8;
    s.ll_header_signals = 2 * n * uint64_t{kMaxCollectiveBlocks} * kLowLatencyLineBytes / 8;
    s.staging_bytes = 3 * staging_region_bytes;
    return s;
}

uint64_t CollectiveHeapSizes::bytes() const {
    // Each allocation starts 256-byte aligned on the heap: the gaps before the next count too.
    const auto signals = [](uint64_t words) { return (8 * words + 255) / 256 * 256; };
    return signals(barrier_signals) + signals(descriptor_signals) + signals(copy_engine_signals) +
           signals(ll_buffer_signals) + signals(ll_header_signals) + (staging_bytes + 255) / 256 * 256;
}

uint64_t staging_region_from_env() {
    const uint64_t region = env::get_bytes("WEFT_COLLECTIVE_STAGING_BYTES").value_or(kDefaultStagingRegionBytes);
    // Three regions live in the symmetric heap: far below 2^64 (a wrapped size would allocate a sliver).
    constexpr uint64_t kMaxRegion = uint64_t{1} << 40;
    WEFT_CHECK(region <= kMaxRegion,
               "WEFT_COLLECTIVE_STAGING_BYTES must be at most 1 TiB (one staging region; the "
               "workspace holds three in the symmetric heap), got "
                   << region << " bytes");
    return std::max<uint64_t>((region + 255) / 256 * 256, kMinStagingRegionBytes);
}

std::string CollectiveWorkspace::extension_name(const Team& team) {
    return team.is_world() ? std::string(kExtensionName) : std::string(kExtensionName) + "/" + team.id();
}

CollectiveWorkspace& CollectiveWorkspace::get(const Team& team) {
    World& world = team.world();
    const std::string name = extension_name(team);
    if (WorldExtension* e = world.find_extension(name)) {
        auto& ws = static_cast<CollectiveWorkspace&>(*e);
        if (ws.num_ranks_ > 1) {
            ws.abort_mark_.check(world, "the collectives' workspace of this team",
                                 "make a new World for weft's collectives (a fresh one always works)");
        }
        return ws;
    }
    std::unique_ptr<CollectiveWorkspace> ws(new CollectiveWorkspace(team));
    return static_cast<CollectiveWorkspace&>(world.add_extension(name, std::move(ws)));
}

namespace {

// next_collective_call's counter: a World extension of its own (the workspace is made only at the first call that
// launches, after a call of 0 elements may already have counted).
struct CollectiveCalls final : WorldExtension {
    std::atomic<uint64_t> next{0};
};

}  // namespace

uint64_t next_collective_call(const Team& team) {
    if (team.num_ranks() == 1) return 0;
    World& world = team.world();
    const std::string name = CollectiveWorkspace::extension_name(team) + "#calls";
    WorldExtension* e = world.find_extension(name);
    if (e == nullptr) e = &world.add_extension(name, std::make_unique<CollectiveCalls>());
    return static_cast<CollectiveCalls&>(*e).next.fetch_add(1, std::memory_order_relaxed);
}

void refuse_setup_under_capture(cudaStream_t stream, const char* op, const char* what) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
        (void)cudaGetLastError();  // an invalid stream fails at its first enqueue, with CUDA's own message
    }
    WEFT_CHECK(capture == cudaStreamCaptureStatusNone,
               op << ": " << what
                  << " is made at the team's first collective call (it allocates, compiles and synchronises), which "
                     "cannot happen while the stream is being captured; call weft::ops::prepare_collectives(team) "
                     "(Python: weft.world().prepare_collectives() for the World's team), or make one call on the "
                     "team that moves data, before capturing");
}

CollectiveWorkspace& CollectiveWorkspace::get(const Team& team, cudaStream_t stream, const char* op) {
    if (team.num_ranks() > 1 && team.world().find_extension(extension_name(team)) == nullptr) {
        refuse_setup_under_capture(stream, op, "the team's collectives workspace");
    }
    return get(team);
}

CollectiveWorkspace::CollectiveWorkspace(const Team& team) : team_(team), world_(team.world()) {
    World& world = world_;
    abort_mark_.note(world);
    rank_ = team.rank();
    num_ranks_ = team.num_ranks();
    max_ranks_ = collective_rank_bucket(num_ranks_);
    WEFT_CHECK(max_ranks_ > 0, "collectives support up to 64 ranks, the team has " << num_ranks_ << " ("
                                                                                    << team.describe() << ")");
    ctx_ = team.device_ctx();
    info_.topology.num_ranks = num_ranks_;
    if (num_ranks_ == 1) return;  // one rank: the ops copy, nothing to share or launch
    try {
        SymmetricHeap& heap = world.heap();
        const uint64_t region = staging_region_from_env();

        // Agree on the facts the kernels' grids and the algorithm choice depend on, and check reachability. The
        // SM budget is the World's per-GPU one: ranks of other teams may share the GPU and run at the same time.
        const SetupRecord mine{world.sm_budget(), team.num_ranks_on_device(), region};
        const auto* mine_bytes = reinterpret_cast<const uint8_t*>(&mine);
        Bytes blob(mine_bytes, mine_bytes + sizeof(mine));
        for (int q = 0; q < num_ranks_; ++q) {
            blob.push_back(heap.peer_bases()[static_cast<size_t>(team.world_rank(q))] != nullptr ? 1 : 0);
        }
        const std::vector<Bytes> all = team.all_gather("weft.ops.collectives.setup", blob);
        CollectiveTopology topo;
        topo.num_ranks = num_ranks_;
        topo.grid_budget = static_cast<int>(kMaxCollectiveBlocks);
        topo.max_ranks_per_gpu = 1;
        for (int r = 0; r < num_ranks_; ++r) {
            const Bytes& b = all[static_cast<size_t>(r)];
            WEFT_CHECK(b.size() == blob.size(), "collectives: world rank " << team.world_rank(r)
                                                                           << " sent a setup record of " << b.size()
                                                                           << " bytes, expected " << blob.size());
            SetupRecord rec{};
            std::memcpy(&rec, b.data(), sizeof(rec));
            topo.grid_budget = std::min(topo.grid_budget, std::max(1, rec.sm_budget));
            topo.max_ranks_per_gpu = std::max(topo.max_ranks_per_gpu, rec.ranks_on_device);
            WEFT_CHECK(rec.staging_region_bytes == region,
                       "collectives: WEFT_COLLECTIVE_STAGING_BYTES differs between ranks: world rank "
                           << world.rank() << " uses " << region << " bytes per region, world rank "
                           << team.world_rank(r) << " " << rec.staging_region_bytes);
            for (int q = 0; q < num_ranks_; ++q) {
                WEFT_CHECK(b[sizeof(SetupRecord) + static_cast<size_t>(q)] != 0,
                           "collectives need load/store access between every pair of ranks of the team, but world rank "
                               << team.world_rank(r) << " cannot reach world rank " << team.world_rank(q)
                               << "'s symmetric heap (another host, or no peer access between their GPUs); a "
                                  "network transport for collectives is not implemented yet");
            }
        }
        const CollectiveHeapSizes sizes = CollectiveHeapSizes::make(num_ranks_, region, topo);
        info_.topology = topo;
        info_.staging_region_bytes = sizes.staging_region_bytes;
        info_.ll_slot_bytes = sizes.ll_slot_bytes;

        const uint64_t before = heap.bytes_in_use();
        barrier_flags_ = heap.alloc_signals(team, sizes.barrier_signals);
        descriptors_ = heap.alloc_signals(team, sizes.descriptor_signals);
        ce_flags_ = heap.alloc_signals(team, sizes.copy_engine_signals);
        ll_buffer_ = reinterpret_cast<uint8_t*>(heap.alloc_signals(team, sizes.ll_buffer_signals));
        ll_headers_ = reinterpret_cast<uint8_t*>(heap.alloc_signals(team, sizes.ll_header_signals));
        staging_ = static_cast<uint8_t*>(heap.alloc(team, sizes.staging_bytes, 256));
        info_.heap_bytes = heap.bytes_in_use() - before;

        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&setup_stream_, cudaStreamNonBlocking));
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&state_), sizeof(CollectiveState), setup_stream_));
        WEFT_CUDA_CHECK(cudaMemsetAsync(state_, 0, sizeof(CollectiveState), setup_stream_));
        {
            const RelaxedCaptureMode relaxed;  // beside another rank thread's capture in global mode
            WEFT_CUDA_CHECK(cudaStreamSynchronize(setup_stream_));
        }
        WEFT_CUDA_CHECK(cudaStreamDestroy(setup_stream_));  // one stream fewer in the hardware queues
        setup_stream_ = nullptr;
        // NOTE: ranks of one process sharing a GPU (of any team) share its hardware queues. Then the copy-engine
        // schedule runs on the caller's stream (no side stream at all), which keeps the ranks' streams few
        // (module_loading.hpp, ensure_device_connections) and a captured call a single chain of graph nodes
        // (all_gather.cpp, copy_engine_round); for the ranks of one process the bytes move with the pull kernel
        // (copies_with_kernel), since with many ranks and ops the streams still outnumber the queues.
        const int sides = world.num_ranks_on_device() > 1 ? 0 : std::min(std::max(num_ranks_ - 1, 1), kMaxSideStreams);
        WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&fork_event_, cudaEventDisableTiming));
        for (int i = 0; i < sides; ++i) {
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            side_streams_.push_back(s);
            cudaEvent_t e = nullptr;
            WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
            join_events_.push_back(e);
        }

        // Load every kernel now: a module loaded later, while a peer's kernel spins, could wait for it (CUDA may
        // synchronise the context to load). Ranks start at different specs so that threads of one process compile
        // different ones at once (the cache's locks make the others wait for, then reuse, each result).
        const std::vector<jit::KernelSpec> specs = collective_kernel_specs(max_ranks_);
        std::vector<jit::Kernel*> loaded(specs.size(), nullptr);
        for (size_t k = 0; k < specs.size(); ++k) {
            const size_t i = (k + static_cast<size_t>(rank_)) % specs.size();
            loaded[i] = &jit::compiler().get_kernel(specs[i]);
        }
        size_t i = 0;
        for (int k = 0; k < static_cast<int>(KernelId::kCount); ++k) {
            const int copies = kernel_is_reducing(static_cast<KernelId>(k)) ? 3 : 1;
            for (int t = 0; t < copies; ++t) kernels_[static_cast<size_t>(k)][static_cast<size_t>(t)] = loaded[i++];
        }
        info_.num_kernels = static_cast<int>(specs.size());
        if (copy_engine_copies_with_kernel(world.same_process(), world.num_ranks_on_device(), num_ranks_)) {
            pull_kernel_ = &jit::compiler().get_kernel(tp_detail::peer_pull_kernel_spec());
        }
        team.barrier();  // nobody launches a spinning kernel before every member has loaded everything
        WEFT_LOG_INFO("collectives: workspace ready for the team of " << team.describe() << ": "
                      << info_.heap_bytes << " heap bytes (3 x " << region << " staging, LL " << info_.ll_slot_bytes
                      << " per sender), " << info_.num_kernels << " kernels, grid budget " << topo.grid_budget
                      << ", up to " << topo.max_ranks_per_gpu << " ranks per GPU");
    } catch (...) {
        release();
        throw;
    }
}

CollectiveWorkspace::~CollectiveWorkspace() { release(); }

void CollectiveWorkspace::release() noexcept {
    // The heap's allocations die with the heap (the World destroys extensions first, then the heap).
    for (cudaStream_t s : side_streams_) cudaStreamDestroy(s);
    side_streams_.clear();
    for (cudaEvent_t e : join_events_) cudaEventDestroy(e);
    join_events_.clear();
    if (fork_event_ != nullptr) cudaEventDestroy(fork_event_);
    fork_event_ = nullptr;
    if (state_ != nullptr && setup_stream_ == nullptr) {
        cudaStreamCreateWithFlags(&setup_stream_, cudaStreamNonBlocking);
    }
    if (state_ != nullptr && setup_stream_ != nullptr) {  // stream-ordered: cudaFree would wait for every rank
        const RelaxedCaptureMode relaxed;                 // beside another rank thread's capture in global mode
        cudaFreeAsync(state_, setup_stream_);
        cudaStreamSynchronize(setup_stream_);
    }
    state_ = nullptr;
    if (setup_stream_ != nullptr) cudaStreamDestroy(setup_stream_);
    setup_stream_ = nullptr;
}

bool CollectiveWorkspace::symmetric(const void* ptr, uint64_t bytes) const {
    return ptr != nullptr && world_.heap().contains(ptr, std::max<uint64_t>(bytes, 1));
}

uint64_t CollectiveWorkspace::offset_or_none(const void* ptr) const {
    return symmetric(ptr, 1) ? world_.heap().offset_of(ptr) : ~0ull;
}

void* CollectiveWorkspace::peer_pointer(const void* ptr, int peer) const {
    void* p = world_.heap().symm_at(ptr, team_.world_rank(peer));
    WEFT_CHECK(p != nullptr, "collectives: world rank " << team_.world_rank(peer)
                                                       << " is not load/store reachable from world rank "
                                                       << world_.rank());
    return p;
}

CollectiveParams CollectiveWorkspace::params() const {
    CollectiveParams p{};
    p.state = state_;
    p.barrier_flags = barrier_flags_;
    p.descriptors = descriptors_;
    p.ce_flags = ce_flags_;
    p.staging = staging_;
    p.staging_half_bytes = info_.staging_region_bytes;
    p.ll_buffer = ll_buffer_;
    p.ll_slot_bytes = info_.ll_slot_bytes;
    p.ll_headers = ll_headers_;
    return p;
}

uint64_t* CollectiveWorkspace::copy_engine_flag_on(int peer) const {
    return static_cast<uint64_t*>(peer_pointer(ce_flags_ + rank_, peer));
}

jit::Kernel& CollectiveWorkspace::kernel_for_launch(KernelId id, DType dtype, int grid) const {
    const int t = kernel_is_reducing(id) ? dtype_index(dtype) : 0;
    jit::Kernel* k = kernels_[static_cast<size_t>(id)][static_cast<size_t>(t)];
    WEFT_CHECK(k != nullptr, "collectives: kernel " << static_cast<int>(id) << " was not loaded");
    WEFT_CHECK(grid >= 1 && grid <= static_cast<int>(kMaxCollectiveBlocks),
               "collectives: grid " << grid << " outside [1, " << kMaxCollectiveBlocks << "]");
    return *k;
}

jit::LaunchParams CollectiveWorkspace::launch_params(KernelId id, int grid, cudaStream_t stream) const {
    return jit::LaunchParams{.grid = dim3(static_cast<unsigned>(grid)),
                             .block = dim3(static_cast<unsigned>(kernel_block_threads(id, max_ranks_))),
                             .stream = stream};
}

void CollectiveWorkspace::launch(KernelId id, DType dtype, int grid, cudaStream_t stream, const CollectiveParams& p) {
    kernel_for_launch(id, dtype, grid).launch(launch_params(id, grid, stream), ctx_, p);
}

void CollectiveWorkspace::launch(KernelId id, int grid, cudaStream_t stream, const CollectiveParams& p,
                                 const AllToAllTable& table) {
    kernel_for_launch(id, DType::kU8, grid).launch(launch_params(id, grid, stream), ctx_, p, table);
}

void CollectiveWorkspace::launch_pulls(const std::vector<PeerPullItem>& items, cudaStream_t stream) const {
    WEFT_CHECK(pull_kernel_ != nullptr,
               "collectives: the pull kernel is loaded only where ranks of one process share this rank's GPU");
    tp_detail::launch_peer_pulls(*pull_kernel_, ctx_, items, stream);
}

void CollectiveWorkspace::fork(cudaStream_t stream, int count) {
    WEFT_CUDA_CHECK(cudaEventRecord(fork_event_, stream));
    for (int i = 0; i < count; ++i) {
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(side_streams_[static_cast<size_t>(i)], fork_event_, 0));
    }
}

void CollectiveWorkspace::join(cudaStream_t stream, int count) {
    for (int i = 0; i < count; ++i) {
        WEFT_CUDA_CHECK(cudaEventRecord(join_events_[static_cast<size_t>(i)], side_streams_[static_cast<size_t>(i)]));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, join_events_[static_cast<size_t>(i)], 0));
    }
}

}  // namespace detail

const CollectiveWorkspaceInfo& prepare_collectives(const Team& team) {
    team.require_member("prepare_collectives");
    if (team.num_nodes() > 1) {
        // Across nodes the collectives run over each node's members and the network (detail::hierarchical_*): make
        // the team's network backend and its node team's workspace.
        const net::HostBackend& net = net::HostBackend::get(team);
        if (net.node_team().num_ranks() > 1) return prepare_collectives(net.node_team());
        static const CollectiveWorkspaceInfo kNone{};  // one member per node: nothing to prepare on the node
        return kNone;
    }
    return detail::CollectiveWorkspace::get(team).info();
}

const CollectiveWorkspaceInfo& prepare_collectives(World& world) { return prepare_collectives(world.team()); }

void count_refused_collective_call(const Team& team) {
    team.require_member("count_refused_collective_call");
    (void)detail::next_collective_call(team);
}

uint64_t collective_workspace_heap_bytes(int num_ranks) {
    WEFT_CHECK(num_ranks >= 1 && collective_rank_bucket(num_ranks) > 0,
               "collective_workspace_heap_bytes: num_ranks must be in [1, 64] (the collectives' team size on one "
               "node), got "
                   << num_ranks);
    if (num_ranks == 1) return 0;  // one rank: the ops copy, the workspace allocates nothing
    return detail::CollectiveHeapSizes::make(num_ranks, detail::staging_region_from_env(), CollectiveTopology{})
        .bytes();
}

void register_collective_aot_specs(int max_ranks) {
    static std::mutex mutex;
    static bool done[65] = {};
    const int bucket = collective_rank_bucket(max_ranks);
    WEFT_CHECK(bucket > 0, "register_collective_aot_specs: max_ranks must be in [1, 64], got " << max_ranks);
    std::lock_guard<std::mutex> lock(mutex);
    if (done[bucket]) return;
    done[bucket] = true;
    for (jit::KernelSpec& s : detail::collective_kernel_specs(bucket)) jit::register_aot_spec(std::move(s));
}

}  // namespace weft::ops
