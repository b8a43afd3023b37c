// SPDX-License-Identifier: MIT
// weft::ops::ep::Buffer: construction (kernels, symmetric and private allocations), status word, and the argument
// checks the normal and low-latency ops share.
#include "ep_buffer.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <future>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "abort_mark.hpp"
#include "member_records.hpp"
#include "weft/detail/host_mapped_pool.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/stream.hpp"
#include "weft/runtime/trace.hpp"

namespace weft::ops::ep {

namespace detail {

int64_t row_stride_of(const TensorView& v) { return v.ndim >= 1 && v.dim(0) > 1 ? v.stride(0) : v.dim(1); }

void check_matrix(const char* op, const char* name, const TensorView& v, DType dtype, int64_t cols, bool align16) {
    WEFT_CHECK(v.dtype == dtype, op << ": " << name << " must be " << dtype_name(dtype) << ", got "
                                    << dtype_name(v.dtype) << " (" << v.describe() << ")");
    WEFT_CHECK(v.ndim == 2, op << ": " << name << " must be 2-D [rows, " << cols << "], got " << v.describe());
    WEFT_CHECK(v.dim(1) == cols, op << ": " << name << " must have " << cols << " columns, got " << v.describe());
    WEFT_CHECK(v.dim(0) >= 0, op << ": " << name << " has a negative row count: " << v.describe());
    if (v.dim(0) == 0) {
        return;
    }
    WEFT_CHECK(v.data != nullptr, op << ": " << name << " has a null data pointer (" << v.describe() << ")");
    WEFT_CHECK(cols <= 1 || v.stride(1) == 1,
               op << ": " << name << " must be row-major (inner stride 1), got " << v.describe());
    const int64_t stride = row_stride_of(v);
    WEFT_CHECK(v.dim(0) <= 1 || stride >= cols,
               op << ": " << name << "'s row stride must be >= " << cols << ", got " << v.describe());
    const auto addr = reinterpret_cast<uintptr_t>(v.data);
    const int64_t align = align16 ? 16 : dtype_bytes(dtype);
    WEFT_CHECK(addr % static_cast<uintptr_t>(align) == 0, op << ": " << name << "'s data must be " << align
                                                             << "-byte aligned, got address 0x" << std::hex << addr
                                                             << std::dec);
    WEFT_CHECK(!align16 || (stride * dtype_bytes(dtype)) % 16 == 0,
               op << ": " << name << "'s row stride must be a multiple of 16 bytes, got " << stride << " elements ("
                  << v.describe() << ")");
}

int check_tokens(const char* op, const Geometry& g, const TensorView& idx, int64_t rows_expected,
                 const char* rows_from) {
    check_matrix(op, "topk_idx", idx, DType::kI32, g.topk, false);
    const int64_t t = idx.dim(0);
    WEFT_CHECK(rows_expected < 0 || t == rows_expected,
               op << ": topk_idx has " << t << " rows but " << rows_from << " has " << rows_expected);
    WEFT_CHECK(t <= g.max_tokens, op << ": " << t << " tokens exceed Config::max_tokens_per_rank = " << g.max_tokens
                                     << " (never truncated: raise the limit or split the batch)");
    return static_cast<int>(t);
}

uint8_t* device_alloc_zeroed(uint64_t bytes, cudaStream_t stream) {
    void* p = nullptr;
    if (bytes == 0) {
        return nullptr;
    }
    // A private stream's work, waited for: neither failing nor invalidating another rank thread's capture.
    const weft::RelaxedCaptureMode relaxed;
    WEFT_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream));
    cudaError_t err = cudaMemsetAsync(p, 0, bytes, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) {
        cudaFreeAsync(p, stream);
        WEFT_CUDA_CHECK(err);
    }
    return static_cast<uint8_t*>(p);
}

}  // namespace detail

namespace {

// The Config fields every member must agree on, as the resolved geometry holds them (the rank zeroed).
std::vector<uint8_t> geometry_record(Geometry g) {
    static_assert(sizeof(Geometry) == 8 * 4 + 2 * 8, "Geometry has no padding: its bytes compare");
    g.rank = 0;
    const auto* p = reinterpret_cast<const uint8_t*>(&g);
    return std::vector<uint8_t>(p, p + sizeof(g));
}

std::string describe_config(const Geometry& g) {
    std::ostringstream os;
    os << "{num_experts = " << g.num_experts << ", hidden = " << g.hidden << ", topk = " << g.topk
       << ", max_tokens_per_rank = " << g.max_tokens << ", normal = " << g.normal()
       << ", low_latency = " << g.low_latency() << ", expert_alignment = " << g.expert_alignment
       << ", max_recv_tokens = " << g.max_recv_tokens << ", max_recv_rows = " << g.max_recv_rows << "}";
    return os.str();
}

std::optional<Status> read_status(const Status* host) {
    const auto* claimed = reinterpret_cast<const volatile uint32_t*>(&host->claimed);
    if (*claimed != 2u) {
        return std::nullopt;
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    Status s;
    const auto* src = reinterpret_cast<const volatile uint8_t*>(host);
    auto* dst = reinterpret_cast<uint8_t*>(&s);
    for (size_t i = 0; i < sizeof(Status); ++i) {
        dst[i] = src[i];
    }
    return s;
}

}  // namespace

// ---- Buffer::Impl ----

void Buffer::Impl::enter(const char* op, cudaStream_t stream, const Buffer::Impl* handle_owner,
                         bool warn_pending) const {
    abort_mark.check(*world, (std::string("ep::") + op).c_str(),
                     "make a new World (a Buffer's signal words are never cleared: kernels/ep/README.md, \"Errors\")");
    if (warn_pending && !nested) warn_pending_status(op);
    // Ranks of one process that share a GPU share its legacy default stream: their kernels, which wait for each
    // other, would be serialised there (and time out). Refuse it where that can happen (processes sharing a GPU
    // each have their own context and default stream).
    WEFT_CHECK(!(world->same_process() && world->num_ranks_on_device() > 1 &&
                 (stream == nullptr || stream == cudaStreamLegacy)),
               "ep::" << op
                      << ": pass a non-blocking stream of this rank's own (cudaStreamCreateWithFlags(..., "
                         "cudaStreamNonBlocking)); "
                      << world->num_ranks_on_device()
                      << " ranks share this GPU and the legacy default stream would serialise their kernels, "
                         "which wait for each other");
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) (void)cudaGetLastError();
    if (world->same_process() && world->num_ranks_on_device() > 1 && capture == cudaStreamCaptureStatusNone) {
        // A blocking stream (cudaStreamCreate, cudaStreamPerThread) waits for the legacy default stream and it for
        // them: one rank thread's legacy call (a cudaMemset, a synchronous copy) would queue behind a peer's kernel
        // that waits for this rank. (Not asked of a stream being captured: the check of its first, eager call holds.)
        unsigned int flags = 0;
        const bool known = cudaStreamGetFlags(stream, &flags) == cudaSuccess;
        if (!known) (void)cudaGetLastError();  // an invalid stream fails at its launch, with CUDA's own message
        WEFT_CHECK(!known || (stream != cudaStreamPerThread && (flags & cudaStreamNonBlocking) != 0),
                   "ep::" << op
                          << ": pass a non-blocking stream (cudaStreamCreateWithFlags(..., cudaStreamNonBlocking)); "
                             "a blocking stream (cudaStreamCreate, cudaStreamPerThread) synchronises with the legacy "
                             "default stream, which the "
                          << world->num_ranks_on_device()
                          << " rank threads sharing this GPU also use: one rank's legacy call would wait for a "
                             "peer's kernel that waits for this rank");
    }
    WEFT_CHECK(handle_owner != nullptr,
               "ep: " << op << ": the handle is empty (moved from) or its Buffer was destroyed before it");
    WEFT_CHECK(handle_owner == this, "ep: " << op << ": the handle belongs to another Buffer");
}

int Buffer::Impl::grid(const char* op, int requested, int fallback) const {
    const int budget = world->sm_budget();
    WEFT_CHECK(requested >= 0, "ep::" << op << ": num_sms must be >= 0 (0 = default), got " << requested);
    const int n = requested > 0 ? requested : fallback;
    WEFT_CHECK(n <= budget, "ep::" << op << ": num_sms = " << n << " exceeds this rank's SM budget of " << budget
                                   << " (every rank's kernel must stay resident; see World::sm_budget)");
    return n;
}

void Buffer::Impl::warn_pending_status(const char* op) const {
    if (status_warned) return;
    if (const std::optional<StatusReport> r = pending_report()) {
        status_warned = true;
        WEFT_LOG_WARN("ep::" << op << " goes ahead with an error of an earlier call pending on this rank: "
                             << r->message << " (Buffer::check() throws it; call clear_status() after handling it)");
    }
}

void Buffer::Impl::check_status(const char* op) const {
    if (const std::optional<StatusReport> r = pending_report()) {
        WEFT_FAIL(r->message << " (reported before " << op << "; call Buffer::clear_status() after handling it)");
    }
}

std::string Buffer::Impl::describe(const Status& s, bool one_rank_skipped) const {
    const auto text = [one_rank_skipped](const Status& x) {
        return one_rank_skipped ? detail::describe_status_one_rank_skipped(x) : describe_status(x);
    };
    if (team.is_world()) {
        return text(s);
    }
    Status world_ranks = s;
    const auto to_world = [&](int32_t r) { return r >= 0 && r < team.num_ranks() ? team.world_rank(r) : r; };
    world_ranks.rank = to_world(s.rank);
    world_ranks.culprit_rank = to_world(s.culprit_rank);
    return text(world_ranks) + " (ranks are world ranks; the Buffer's team is " + team.describe() + ")";
}

std::optional<StatusReport> Buffer::Impl::pending_report() const {
    if (const std::optional<Status> s = read_status(status_host)) return StatusReport{s->code, *s, describe(*s)};
    if (!inner) return std::nullopt;
    // Across nodes: what the one-rank dispatch and combine reported. That Buffer's team is this rank alone: its rank 0
    // is this rank of this Buffer's team, and a receive overflow there was this rank's (the others went ahead).
    const std::optional<StatusReport> r = inner->status();
    if (!r) return std::nullopt;
    Status s = r->raw;
    if (s.rank == 0) s.rank = team.rank();
    if (s.culprit_rank == 0) s.culprit_rank = team.rank();
    const bool skipped = s.code == StatusCode::kRecvTokensOverflow || s.code == StatusCode::kRecvRowsOverflow;
    return StatusReport{s.code, s, describe(s, skipped)};
}

void Buffer::Impl::init_one_node() {
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&alloc_stream, cudaStreamNonBlocking));
    // Compile (in parallel, all ranks sharing the cache) and load every kernel before anything spins.
    const std::vector<jit::KernelSpec> specs = kernel_specs();
    {
        std::vector<std::future<void>> compiles;
        for (const jit::KernelSpec& s : specs) {
            compiles.push_back(std::async(std::launch::async, [&s] { jit::compiler().compile(s); }));
        }
        for (auto& f : compiles) {
            f.get();
        }
    }
    k_layout = &jit::compiler().get_kernel(specs[0]);
    k_dispatch = &jit::compiler().get_kernel(specs[1]);
    k_combine = &jit::compiler().get_kernel(specs[2]);
    k_ll_dispatch = &jit::compiler().get_kernel(specs[3]);
    k_ll_combine = &jit::compiler().get_kernel(specs[4]);

    // One symmetric allocation (same offset on every member) and one private one, carved by the Workspace. The
    // signal words start at zero on every member: no member launches before the barrier below.
    const weft::ep::BufferSymmetricLayout& sym = ws.buffer_symmetric;
    symmetric = static_cast<uint8_t*>(world->heap().alloc(team, static_cast<uint64_t>(sym.bytes)));
    WEFT_CUDA_CHECK(
        cudaMemsetAsync(sym.signals.at(symmetric), 0, static_cast<size_t>(sym.signals.bytes()), alloc_stream));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(alloc_stream));
    device = detail::device_alloc_zeroed(static_cast<uint64_t>(ws.buffer_device.bytes), alloc_stream);
    normal = ws.normal_buffer(symmetric, device);
    low_latency = ws.low_latency_buffer(symmetric, device);
}

// ---- Buffer ----

Buffer::Buffer(World& world, const Config& config) : Buffer(world.team(), config) {}

void Buffer::Impl::release_private() noexcept {
    const RelaxedCaptureMode relaxed;  // a release while another rank thread captures in global mode
    if (team_ranks_by_node != nullptr) cudaFreeAsync(team_ranks_by_node, alloc_stream);
    if (device != nullptr) cudaFreeAsync(device, alloc_stream);
    if (alloc_stream != nullptr) {
        cudaStreamSynchronize(alloc_stream);
        cudaStreamDestroy(alloc_stream);
    }
    if (status_host != nullptr) weft::detail::host_mapped_free(status_host);
    team_ranks_by_node = nullptr;
    device = nullptr;
    alloc_stream = nullptr;
    status_host = nullptr;
    status_dev = nullptr;
}

Buffer::Buffer(const Team& team, const Config& config) : impl_(std::make_unique<Impl>()) {
    team.require_member("ep::Buffer");
    try {
        construct(team, config);
    } catch (...) {
        // A member may have failed before the others: the symmetric block (a collective free) stays allocated until
        // the World's heap is released; this rank's private memory goes now.
        if (impl_->symmetric != nullptr) {
            WEFT_LOG_WARN(
                "ep: the Buffer's construction failed; its symmetric heap block stays allocated until the "
                "World's heap is released");
        }
        impl_->release_private();
        throw;
    }
}

void Buffer::construct(const Team& team, const Config& config) {
    // Its allocations and private-stream waits must neither fail nor invalidate another rank thread's capture.
    const weft::RelaxedCaptureMode relaxed;
    Impl& b = *impl_;
    World& world = team.world();
    b.world = &world;
    b.abort_mark.note(world);
    b.team = team;
    b.ctx = team.device_ctx();
    b.trace = trace_device_buffer(world);
    b.config = config;
    // Every member's kernels trust the others' layouts and limits: the Configs must agree (checked once, here; the
    // low-latency count words carry a digest of the geometry as well, with the fp8 flag of each call). A member whose
    // Config is invalid fails every member at once.
    const std::vector<std::vector<uint8_t>> all =
        ops::detail::exchange_member_records(team, "weft.ops.ep.config", "ep::Buffer", "Config is", [&] {
            b.geo = resolve_geometry(config, team.num_ranks(), team.rank());
            return geometry_record(b.geo);
        });
    const std::vector<uint8_t> mine = geometry_record(b.geo);
    for (int r = 0; r < team.num_ranks(); ++r) {
        const std::vector<uint8_t>& theirs = all[static_cast<size_t>(r)];
        if (theirs == mine) continue;
        Geometry other{};
        std::memcpy(&other, theirs.data(), std::min(theirs.size(), sizeof(other)));
        WEFT_FAIL("ep::Buffer: the members' Configs differ: world rank "
                  << world.rank() << " made its Buffer with " << describe_config(b.geo) << ", world rank "
                  << team.world_rank(r) << " with " << describe_config(other)
                  << " (defaults resolved); every member must pass the same Config");
    }
    b.ws = Workspace::make(b.geo);
    if (team.num_nodes() > 1) {
        // Peers on other nodes are reached through the network: docs/multinode.md, "EP across nodes".
        b.init_across_nodes();
    } else {
        // Within a node every member must map every other member's heap.
        for (int r = 0; r < team.num_ranks(); ++r) {
            WEFT_CHECK(world.heap().symm_at(world.heap().base(), team.world_rank(r)) != nullptr,
                       "ep: world rank "
                           << team.world_rank(r) << " is not load/store reachable from world rank " << world.rank()
                           << " (no peer access between the GPUs of one node); weft::ops::ep needs the members of a "
                              "node reachable through NVLink or PCIe P2P");
        }
        b.init_one_node();
    }
    b.fp = footprint(config, team.num_ranks(), team.num_nodes());

    // From the process's pool, not cudaHostAlloc: that would wait for kernels spinning anywhere on the GPU.
    static_assert(sizeof(Status) <= weft::detail::kHostMappedBlockBytes);
    const weft::detail::HostMappedBlock words = weft::detail::host_mapped_alloc(sizeof(Status));
    b.status_host = static_cast<Status*>(words.host);
    b.status_dev = static_cast<Status*>(words.device);
    // Nobody launches before every member has its buffers and kernels.
    team.barrier();
    WEFT_LOG_INFO("ep: buffer ready: " << b.fp.describe());
}

Buffer::~Buffer() {
    Impl& b = *impl_;
    if (!b.handle_owners.empty()) {
        WEFT_LOG_ERROR("ep: Buffer destroyed with "
                       << b.handle_owners.size()
                       << " live handle(s); destroy handles first (their calls are now refused, and their memory "
                          "is not freed: a normal handle's heap block until the World's heap is released, their "
                          "private device memory for good)");
        for (Buffer::Impl** owner : b.handle_owners) *owner = nullptr;  // detached: see ~Impl of the handles
        b.handle_owners.clear();
    }
    b.uses.wait_all();  // this Buffer's kernels, not the whole GPU's (other teams' may spin on a member behind us)
    try {
        if (b.symmetric != nullptr) b.world->heap().free(b.team, b.symmetric);
    } catch (const std::exception& e) {
        ops::detail::log_failed_release(*b.world, "an ep::Buffer", e);
    }
    b.release_private();
}

const Config& Buffer::config() const { return impl_->config; }
const Geometry& Buffer::geometry() const { return impl_->geo; }
World& Buffer::world() const { return *impl_->world; }
const Team& Buffer::team() const { return impl_->team; }

void Buffer::check() const { impl_->check_status("check"); }

void Buffer::sync_and_check(cudaStream_t stream) {
    impl_->world->sync_and_check(stream);
    check();
}

std::optional<StatusReport> Buffer::status() const { return impl_->pending_report(); }

void Buffer::clear_status() {
    auto* p = reinterpret_cast<volatile uint8_t*>(impl_->status_host);
    for (size_t i = 0; i < sizeof(Status); ++i) {
        p[i] = 0;
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);
    impl_->status_warned = false;
    if (impl_->inner) impl_->inner->clear_status();
}

}  // namespace weft::ops::ep
