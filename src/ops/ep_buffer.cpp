// SPDX-License-Identifier: MIT
// weft::ops::ep::Buffer: allocation, argument validation, call-order checks and kernel launches of the
// expert-parallel ops.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <future>
#include <sstream>

#include "weft/jit/compiler.hpp"
#include "weft/ops/ep.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops::ep {

using weft::ep::kPhaseRecv;
using weft::ep::kPhaseSend;
using weft::ep::LayoutSmem;
using weft::ep::LowLatencyArgs;
using weft::ep::LowLatencySmem;
using weft::ep::NormalArgs;
using weft::ep::NormalSmem;

namespace {

constexpr int kThreads = 512;  // matches kernel_specs()

/// A zeroed private device allocation, stream-ordered so that allocating never synchronises the device while
/// other ranks' kernels spin on it.
uint8_t* device_alloc_zeroed(uint64_t bytes, cudaStream_t stream) {
    void* p = nullptr;
    if (bytes == 0) {
        return nullptr;
    }
    WEFT_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream));
    WEFT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    return static_cast<uint8_t*>(p);
}

const char* phase_name(Phase p) {
    switch (p) {
        case Phase::kSendRecv:
            return "kSendRecv";
        case Phase::kSend:
            return "kSend";
        case Phase::kRecv:
            return "kRecv";
    }
    return "?";
}

int phase_bits(Phase p) {
    switch (p) {
        case Phase::kSendRecv:
            return kPhaseSend | kPhaseRecv;
        case Phase::kSend:
            return kPhaseSend;
        case Phase::kRecv:
            return kPhaseRecv;
    }
    return 0;
}

// ---- argument validation ----

int64_t row_stride_of(const TensorView& v) { return v.ndim >= 1 && v.dim(0) > 1 ? v.stride(0) : v.dim(1); }

/// A 2-D row-major view with `cols` columns of `dtype`, rows 16-byte aligned when `align16`.
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

// ---------------------------------------------------------------------------------------------------

struct NormalHandle::Impl {
    Buffer::Impl* buffer = nullptr;
    uint8_t* symmetric = nullptr;  // heap allocation: Workspace::normal_handle_symmetric
    uint8_t* device = nullptr;     // private allocation: Workspace::normal_handle_device
    NormalHandleView view{};
    int num_tokens = -1;  // of the last dispatch
    bool dispatched = false;
    ~Impl();
};

struct LowLatencyHandle::Impl {
    Buffer::Impl* buffer = nullptr;
    uint8_t* device = nullptr;  // private allocation: Workspace::low_latency_handle_device
    LowLatencyHandleView view{};
    bool fp8 = false;
    int num_tokens = -1;
    enum class State { kIdle, kDispatchSent, kDispatched, kCombineSent } state = State::kIdle;
    ~Impl();
};

struct Buffer::Impl {
    World* world = nullptr;
    Config config;
    Geometry geo{};
    Workspace ws{};
    Footprint fp;
    cudaStream_t alloc_stream = nullptr;
    uint8_t* symmetric = nullptr;  // heap allocation: Workspace::buffer_symmetric
    uint8_t* device = nullptr;     // private allocation: Workspace::buffer_device
    weft::ep::NormalBufferView normal{};
    weft::ep::LowLatencyBufferView low_latency{};
    Status* status_host = nullptr;
    Status* status_dev = nullptr;
    jit::Kernel* k_layout = nullptr;
    jit::Kernel* k_dispatch = nullptr;
    jit::Kernel* k_combine = nullptr;
    jit::Kernel* k_ll_dispatch = nullptr;
    jit::Kernel* k_ll_combine = nullptr;
    int live_handles = 0;
    std::deque<LowLatencyHandle::Impl*> ll_dispatch_queue;  // sent, not yet received (oldest first)
    std::deque<LowLatencyHandle::Impl*> ll_combine_queue;

    NormalArgs normal_args(const NormalHandle::Impl& h) const {
        NormalArgs a{};
        a.geo = geo;
        a.handle = h.view;
        a.buffer = normal;
        a.status = status_dev;
        return a;
    }

    LowLatencyArgs ll_args(const LowLatencyHandle::Impl& h) const {
        LowLatencyArgs a{};
        a.geo = geo;
        a.handle = h.view;
        a.buffer = low_latency;
        a.status = status_dev;
        return a;
    }

    int grid(const char* op, int requested, int fallback) const {
        const int budget = world->sm_budget();
        WEFT_CHECK(requested >= 0, op << ": num_sms must be >= 0 (0 = default), got " << requested);
        const int n = requested > 0 ? requested : fallback;
        WEFT_CHECK(n <= budget, op << ": num_sms = " << n << " exceeds this rank's SM budget of " << budget
                                   << " (every rank's kernel must stay resident; see World::sm_budget)");
        return n;
    }

    /// Ranks of one process that share a GPU share its legacy default stream: their kernels, which wait
    /// for each other, would be serialised there (and time out). Refuse it where that can happen.
    void check_stream(const char* op, cudaStream_t stream) const {
        WEFT_CHECK(!(world->num_ranks_on_device() > 1 && (stream == nullptr || stream == cudaStreamLegacy)),
                   op << ": pass a non-blocking stream of this rank's own (cudaStreamCreateWithFlags(..., "
                         "cudaStreamNonBlocking)); "
                      << world->num_ranks_on_device()
                      << " ranks share this GPU and the legacy default stream would serialise their kernels, "
                         "which wait for each other");
    }

    void check_status(const char* op) const {
        if (auto s = read_status(status_host)) {
            WEFT_FAIL(describe_status(*s)
                      << " (reported before " << op << "; call Buffer::clear_status() after handling it)");
        }
    }
};

NormalHandle::Impl::~Impl() {
    if (buffer == nullptr) {
        return;
    }
    try {
        buffer->world->heap().free(symmetric);
        if (device != nullptr) {
            WEFT_CUDA_CHECK(cudaFreeAsync(device, buffer->alloc_stream));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(buffer->alloc_stream));
        }
    } catch (const std::exception& e) {
        WEFT_LOG_ERROR("ep: freeing a NormalHandle failed: " << e.what());
    }
    --buffer->live_handles;
}

LowLatencyHandle::Impl::~Impl() {
    if (buffer == nullptr) {
        return;
    }
    for (auto* q : {&buffer->ll_dispatch_queue, &buffer->ll_combine_queue}) {
        if (std::find(q->begin(), q->end(), this) != q->end()) {
            WEFT_LOG_ERROR(
                "ep: a LowLatencyHandle with an outstanding send is destroyed; the buffer's "
                "low-latency calls cannot continue consistently");
            q->erase(std::remove(q->begin(), q->end(), this), q->end());
        }
    }
    if (device != nullptr) {
        cudaFreeAsync(device, buffer->alloc_stream);
        cudaStreamSynchronize(buffer->alloc_stream);
    }
    --buffer->live_handles;
}

// ---- NormalHandle ----

NormalHandle::NormalHandle(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NormalHandle::NormalHandle(NormalHandle&&) noexcept = default;
NormalHandle& NormalHandle::operator=(NormalHandle&&) noexcept = default;
NormalHandle::~NormalHandle() = default;

TensorView NormalHandle::recv_x() const {
    const Geometry& g = impl_->buffer->geo;
    return TensorView(impl_->view.recv_x, DType::kBF16, {g.max_recv_rows, g.hidden});
}
const int32_t* NormalHandle::expert_counts() const { return impl_->view.expert_counts; }
const int32_t* NormalHandle::expert_offsets() const { return impl_->view.expert_offsets; }
int NormalHandle::num_tokens() const { return impl_->num_tokens; }
const NormalHandleView& NormalHandle::view() const { return impl_->view; }

// ---- LowLatencyHandle ----

LowLatencyHandle::LowLatencyHandle(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LowLatencyHandle::LowLatencyHandle(LowLatencyHandle&&) noexcept = default;
LowLatencyHandle& LowLatencyHandle::operator=(LowLatencyHandle&&) noexcept = default;
LowLatencyHandle::~LowLatencyHandle() = default;

TensorView LowLatencyHandle::recv_x() const {
    const Geometry& g = impl_->buffer->geo;
    return TensorView(impl_->view.recv_x, impl_->fp8 ? DType::kF8E4M3 : DType::kBF16,
                      {g.local_experts(), g.ll_rows_per_expert(), g.hidden});
}
TensorView LowLatencyHandle::recv_scales() const {
    const Geometry& g = impl_->buffer->geo;
    return TensorView(impl_->view.recv_scales, DType::kF32,
                      {g.local_experts(), g.ll_rows_per_expert(), g.ll_fp8_scales()});
}
const int32_t* LowLatencyHandle::expert_counts() const { return impl_->view.expert_counts; }
bool LowLatencyHandle::fp8() const { return impl_->fp8; }
const LowLatencyHandleView& LowLatencyHandle::view() const { return impl_->view; }

// ---- Buffer ----

Buffer::Buffer(World& world, const Config& config) : impl_(std::make_unique<Impl>()) {
    Impl& b = *impl_;
    b.world = &world;
    b.config = config;
    b.geo = resolve_geometry(config, world.num_ranks(), world.rank());
    b.ws = Workspace::make(b.geo);
    b.fp = footprint(config, world.num_ranks());
    // Only the load/store transport exists today: every rank must map every other rank's heap.
    for (int r = 0; r < world.num_ranks(); ++r) {
        WEFT_CHECK(world.heap().symm_at(world.heap().base(), r) != nullptr,
                   "ep: rank " << r << " is not load/store reachable from rank " << world.rank()
                               << " (another host, or no peer access between the GPUs); weft::ops::ep needs every rank "
                                  "of the World reachable through NVLink or PCIe P2P until a network transport exists");
    }
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&b.alloc_stream, cudaStreamNonBlocking));

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
    b.k_layout = &jit::compiler().get_kernel(specs[0]);
    b.k_dispatch = &jit::compiler().get_kernel(specs[1]);
    b.k_combine = &jit::compiler().get_kernel(specs[2]);
    b.k_ll_dispatch = &jit::compiler().get_kernel(specs[3]);
    b.k_ll_combine = &jit::compiler().get_kernel(specs[4]);

    // One symmetric allocation (same offset on every rank) and one private one, carved by the Workspace. The
    // signal words start at zero on every rank: no rank launches before the barrier below.
    const weft::ep::BufferSymmetricLayout& sym = b.ws.buffer_symmetric;
    b.symmetric = static_cast<uint8_t*>(world.heap().alloc(static_cast<uint64_t>(sym.bytes)));
    WEFT_CUDA_CHECK(
        cudaMemsetAsync(sym.signals.at(b.symmetric), 0, static_cast<size_t>(sym.signals.bytes()), b.alloc_stream));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(b.alloc_stream));
    b.device = device_alloc_zeroed(static_cast<uint64_t>(b.ws.buffer_device.bytes), b.alloc_stream);
    b.normal = b.ws.normal_buffer(b.symmetric, b.device);
    b.low_latency = b.ws.low_latency_buffer(b.symmetric, b.device);

    void* host = nullptr;
    WEFT_CUDA_CHECK(cudaHostAlloc(&host, sizeof(Status), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(host, 0, sizeof(Status));
    b.status_host = static_cast<Status*>(host);
    void* dev = nullptr;
    WEFT_CUDA_CHECK(cudaHostGetDevicePointer(&dev, host, 0));
    b.status_dev = static_cast<Status*>(dev);
    // Nobody launches before every rank has its buffers and kernels.
    world.barrier();
    WEFT_LOG_INFO("ep: buffer ready: " << b.fp.describe());
}

Buffer::~Buffer() {
    Impl& b = *impl_;
    if (b.live_handles != 0) {
        WEFT_LOG_ERROR("ep: Buffer destroyed with " << b.live_handles
                                                    << " live handle(s); destroy handles first (their memory leaks)");
    }
    try {
        WEFT_CUDA_CHECK(cudaDeviceSynchronize());
        if (b.symmetric != nullptr) b.world->heap().free(b.symmetric);
    } catch (const std::exception& e) {
        WEFT_LOG_ERROR("ep: releasing the Buffer failed: " << e.what());
    }
    if (b.device != nullptr) {
        cudaFreeAsync(b.device, b.alloc_stream);
        cudaStreamSynchronize(b.alloc_stream);
    }
    if (b.status_host != nullptr) {
        cudaFreeHost(b.status_host);
    }
    cudaStreamDestroy(b.alloc_stream);
}

const Config& Buffer::config() const { return impl_->config; }
const Geometry& Buffer::geometry() const { return impl_->geo; }
World& Buffer::world() const { return *impl_->world; }

NormalHandle Buffer::make_normal_handle() {
    Impl& b = *impl_;
    WEFT_CHECK(b.config.normal, "ep: make_normal_handle: this Buffer was made with Config::normal = false");
    auto h = std::make_unique<NormalHandle::Impl>();
    h->symmetric = static_cast<uint8_t*>(
        b.world->heap().alloc(static_cast<uint64_t>(b.ws.normal_handle_symmetric.bytes)));  // collective
    h->device = device_alloc_zeroed(static_cast<uint64_t>(b.ws.normal_handle_device.bytes), b.alloc_stream);
    h->view = b.ws.normal_handle(h->symmetric, h->device);
    h->buffer = &b;
    ++b.live_handles;
    return NormalHandle(std::move(h));
}

void Buffer::layout(NormalHandle& handle, const TensorView& topk_idx, cudaStream_t stream) {
    Impl& b = *impl_;
    b.check_status("layout");
    b.check_stream("ep::layout", stream);
    WEFT_CHECK(handle.impl_ && handle.impl_->buffer == &b, "ep: layout: the handle belongs to another Buffer");
    const int t = check_tokens("ep::layout", b.geo, topk_idx, -1, "");
    NormalArgs a = b.normal_args(*handle.impl_);
    a.num_tokens = t;
    a.topk_idx = static_cast<const int32_t*>(topk_idx.data);
    a.idx_stride = t > 0 ? row_stride_of(topk_idx) : b.geo.topk;
    const DeviceCtx ctx = b.world->device_ctx();
    b.k_layout->launch({.grid = dim3(1),
                        .block = dim3(kThreads),
                        .dynamic_smem_bytes = static_cast<size_t>(LayoutSmem::make(b.geo, kThreads).total),
                        .stream = stream},
                       ctx, a);
}

void Buffer::dispatch(NormalHandle& handle, const TensorView& x, const TensorView& topk_idx,
                      const TensorView& topk_weights, cudaStream_t stream, const NormalOptions& options) {
    Impl& b = *impl_;
    const Geometry& g = b.geo;
    b.check_status("dispatch");
    b.check_stream("ep::dispatch", stream);
    WEFT_CHECK(b.config.normal, "ep: dispatch: this Buffer was made with Config::normal = false");
    WEFT_CHECK(handle.impl_ && handle.impl_->buffer == &b, "ep: dispatch: the handle belongs to another Buffer");
    check_matrix("ep::dispatch", "x", x, DType::kBF16, g.hidden, true);
    const int t = check_tokens("ep::dispatch", g, topk_idx, x.dim(0), "x");
    check_matrix("ep::dispatch", "topk_weights", topk_weights, DType::kF32, g.topk, false);
    WEFT_CHECK(topk_weights.dim(0) == t,
               "ep::dispatch: topk_weights has " << topk_weights.dim(0) << " rows but x has " << t);
    const int sms = b.grid("ep::dispatch", options.num_sms, default_normal_sms(t, b.world->sm_budget()));
    layout(handle, topk_idx, stream);
    NormalArgs a = b.normal_args(*handle.impl_);
    a.num_tokens = t;
    a.x = static_cast<const uint16_t*>(x.data);
    a.x_stride = t > 0 ? row_stride_of(x) : g.hidden;
    a.topk_idx = static_cast<const int32_t*>(topk_idx.data);
    a.idx_stride = t > 0 ? row_stride_of(topk_idx) : g.topk;
    a.topk_weights = static_cast<const float*>(topk_weights.data);
    a.weight_stride = t > 0 ? row_stride_of(topk_weights) : g.topk;
    b.k_dispatch->launch({.grid = dim3(static_cast<unsigned>(sms)),
                          .block = dim3(kThreads),
                          .dynamic_smem_bytes = static_cast<size_t>(NormalSmem::make(g, kThreads).total),
                          .stream = stream},
                         b.world->device_ctx(), a);
    handle.impl_->num_tokens = t;
    handle.impl_->dispatched = true;
}

void Buffer::combine(NormalHandle& handle, const TensorView& y, const TensorView& out, cudaStream_t stream,
                     const NormalOptions& options) {
    Impl& b = *impl_;
    const Geometry& g = b.geo;
    b.check_status("combine");
    b.check_stream("ep::combine", stream);
    WEFT_CHECK(handle.impl_ && handle.impl_->buffer == &b, "ep: combine: the handle belongs to another Buffer");
    WEFT_CHECK(handle.impl_->dispatched, "ep::combine: the handle has not been dispatched");
    check_matrix("ep::combine", "y", y, DType::kBF16, g.hidden, true);
    WEFT_CHECK(y.dim(0) >= g.max_recv_rows, "ep::combine: y must have at least max_recv_rows = "
                                                << g.max_recv_rows << " rows (the rows of recv_x), got "
                                                << y.describe());
    const int t = handle.impl_->num_tokens;
    check_matrix("ep::combine", "out", out, DType::kBF16, g.hidden, true);
    WEFT_CHECK(out.dim(0) == t, "ep::combine: out must have the dispatch's " << t << " rows, got " << out.describe());
    const int sms = b.grid("ep::combine", options.num_sms, default_normal_sms(t, b.world->sm_budget()));
    NormalArgs a = b.normal_args(*handle.impl_);
    a.num_tokens = t;
    a.y = static_cast<const uint16_t*>(y.data);
    a.y_stride = row_stride_of(y);
    a.out = static_cast<uint16_t*>(out.data);
    a.out_stride = t > 0 ? row_stride_of(out) : g.hidden;
    b.k_combine->launch({.grid = dim3(static_cast<unsigned>(sms)),
                         .block = dim3(kThreads),
                         .dynamic_smem_bytes = static_cast<size_t>(NormalSmem::make(g, kThreads).total),
                         .stream = stream},
                        b.world->device_ctx(), a);
}

LowLatencyHandle Buffer::make_low_latency_handle() {
    Impl& b = *impl_;
    WEFT_CHECK(b.config.low_latency,
               "ep: make_low_latency_handle: this Buffer was made with Config::low_latency = false");
    auto h = std::make_unique<LowLatencyHandle::Impl>();
    h->device = device_alloc_zeroed(static_cast<uint64_t>(b.ws.low_latency_handle_device.bytes), b.alloc_stream);
    h->view = b.ws.low_latency_handle(h->device);
    h->buffer = &b;
    ++b.live_handles;
    return LowLatencyHandle(std::move(h));
}

void Buffer::low_latency_dispatch(LowLatencyHandle& handle, const TensorView& x, const TensorView& topk_idx,
                                  cudaStream_t stream, const LowLatencyOptions& options) {
    Impl& b = *impl_;
    const Geometry& g = b.geo;
    b.check_status("low_latency_dispatch");
    b.check_stream("ep::low_latency_dispatch", stream);
    WEFT_CHECK(b.config.low_latency, "ep: low_latency_dispatch: this Buffer was made with Config::low_latency = false");
    WEFT_CHECK(handle.impl_ && handle.impl_->buffer == &b,
               "ep: low_latency_dispatch: the handle belongs to another Buffer");
    LowLatencyHandle::Impl& h = *handle.impl_;
    using State = LowLatencyHandle::Impl::State;
    LowLatencyArgs a = b.ll_args(h);
    a.phases = phase_bits(options.phase);
    if (options.phase != Phase::kRecv) {
        WEFT_CHECK(
            !options.fp8 || g.hidden % kFp8GroupSize == 0,
            "ep::low_latency_dispatch: fp8 needs hidden to be a multiple of " << kFp8GroupSize << ", got " << g.hidden);
        check_matrix("ep::low_latency_dispatch", "x", x, DType::kBF16, g.hidden, true);
        const int t = check_tokens("ep::low_latency_dispatch", g, topk_idx, x.dim(0), "x");
        WEFT_CHECK(h.state != State::kDispatchSent && h.state != State::kCombineSent,
                   "ep::low_latency_dispatch: the handle still has an outstanding send; receive it first");
        if (options.phase == Phase::kSendRecv) {
            WEFT_CHECK(b.ll_dispatch_queue.empty(),
                       "ep::low_latency_dispatch(kSendRecv): " << b.ll_dispatch_queue.size()
                                                               << " earlier send(s) are not received yet; receive "
                                                                  "them (Phase::kRecv) first");
        } else {
            WEFT_CHECK(b.ll_dispatch_queue.size() < 2,
                       "ep::low_latency_dispatch(kSend): at most 2 sends may be outstanding per Buffer; receive "
                       "the oldest first");
        }
        a.num_tokens = t;
        a.x = static_cast<const uint16_t*>(x.data);
        a.x_stride = t > 0 ? row_stride_of(x) : g.hidden;
        a.topk_idx = static_cast<const int32_t*>(topk_idx.data);
        a.idx_stride = t > 0 ? row_stride_of(topk_idx) : g.topk;
        h.fp8 = options.fp8;
        h.num_tokens = t;
    } else {
        WEFT_CHECK(!b.ll_dispatch_queue.empty() && b.ll_dispatch_queue.front() == &h,
                   "ep::low_latency_dispatch(kRecv): "
                       << (b.ll_dispatch_queue.empty() ? std::string("no send is outstanding")
                                                       : std::string("receives complete sends in order; this handle "
                                                                     "is not the oldest outstanding send")));
        WEFT_CHECK(options.fp8 == h.fp8, "ep::low_latency_dispatch(kRecv): fp8 = "
                                             << options.fp8 << " differs from the send's fp8 = " << h.fp8);
        a.num_tokens = h.num_tokens;
    }
    a.fp8 = h.fp8 ? 1 : 0;
    const int sms = b.grid("ep::low_latency_dispatch", options.num_sms,
                           default_low_latency_sms(g.max_tokens, g.topk, b.world->sm_budget()));
    b.k_ll_dispatch->launch({.grid = dim3(static_cast<unsigned>(sms)),
                             .block = dim3(kThreads),
                             .dynamic_smem_bytes = static_cast<size_t>(LowLatencySmem::make(g, kThreads).total),
                             .stream = stream},
                            b.world->device_ctx(), a);
    switch (options.phase) {
        case Phase::kSendRecv:
            h.state = State::kDispatched;
            break;
        case Phase::kSend:
            h.state = State::kDispatchSent;
            b.ll_dispatch_queue.push_back(&h);
            break;
        case Phase::kRecv:
            h.state = State::kDispatched;
            b.ll_dispatch_queue.pop_front();
            break;
    }
}

void Buffer::low_latency_combine(LowLatencyHandle& handle, const TensorView& y, const TensorView& topk_idx,
                                 const TensorView& topk_weights, const TensorView& out, cudaStream_t stream,
                                 const LowLatencyOptions& options) {
    Impl& b = *impl_;
    const Geometry& g = b.geo;
    b.check_status("low_latency_combine");
    b.check_stream("ep::low_latency_combine", stream);
    WEFT_CHECK(b.config.low_latency, "ep: low_latency_combine: this Buffer was made with Config::low_latency = false");
    WEFT_CHECK(handle.impl_ && handle.impl_->buffer == &b,
               "ep: low_latency_combine: the handle belongs to another Buffer");
    LowLatencyHandle::Impl& h = *handle.impl_;
    using State = LowLatencyHandle::Impl::State;
    LowLatencyArgs a = b.ll_args(h);
    a.phases = phase_bits(options.phase);
    const int t = h.num_tokens;
    if (options.phase != Phase::kRecv) {
        WEFT_CHECK(h.state == State::kDispatched,
                   "ep::low_latency_combine(" << phase_name(options.phase)
                                              << "): the handle's dispatch has not been received (or its combine "
                                                 "send is outstanding)");
        if (options.phase == Phase::kSendRecv) {
            WEFT_CHECK(b.ll_combine_queue.empty(), "ep::low_latency_combine(kSendRecv): "
                                                       << b.ll_combine_queue.size()
                                                       << " earlier send(s) are not received yet; receive them first");
        } else {
            WEFT_CHECK(b.ll_combine_queue.size() < 2,
                       "ep::low_latency_combine(kSend): at most 2 sends may be outstanding per Buffer");
        }
        WEFT_CHECK(y.dtype == DType::kBF16 && y.ndim == 3 && y.dim(0) == g.local_experts() &&
                       y.dim(1) >= g.ll_rows_per_expert() && y.dim(2) == g.hidden,
                   "ep::low_latency_combine: y must be bf16 [" << g.local_experts() << ", >= " << g.ll_rows_per_expert()
                                                               << ", " << g.hidden << "], got " << y.describe());
        WEFT_CHECK(y.data != nullptr && reinterpret_cast<uintptr_t>(y.data) % 16 == 0 && y.stride(2) == 1 &&
                       (y.stride(1) * 2) % 16 == 0 && (y.stride(0) * 2) % 16 == 0 && y.stride(1) >= g.hidden,
                   "ep::low_latency_combine: y must be 16-byte aligned, row-major with 16-byte row strides, got "
                       << y.describe());
        a.y = static_cast<const uint16_t*>(y.data);
        a.y_expert_stride = y.stride(0);
        a.y_row_stride = y.stride(1);
    } else {
        WEFT_CHECK(!b.ll_combine_queue.empty() && b.ll_combine_queue.front() == &h,
                   "ep::low_latency_combine(kRecv): "
                       << (b.ll_combine_queue.empty() ? std::string("no send is outstanding")
                                                      : std::string("receives complete sends in order; this handle is "
                                                                    "not the oldest outstanding send")));
    }
    if (options.phase != Phase::kSend) {
        check_tokens("ep::low_latency_combine", g, topk_idx, t, "the dispatch");
        check_matrix("ep::low_latency_combine", "topk_weights", topk_weights, DType::kF32, g.topk, false);
        WEFT_CHECK(topk_weights.dim(0) == t, "ep::low_latency_combine: topk_weights has "
                                                 << topk_weights.dim(0) << " rows, the dispatch had " << t);
        check_matrix("ep::low_latency_combine", "out", out, DType::kBF16, g.hidden, true);
        WEFT_CHECK(out.dim(0) == t,
                   "ep::low_latency_combine: out must have the dispatch's " << t << " rows, got " << out.describe());
        a.topk_idx = static_cast<const int32_t*>(topk_idx.data);
        a.idx_stride = t > 0 ? row_stride_of(topk_idx) : g.topk;
        a.topk_weights = static_cast<const float*>(topk_weights.data);
        a.weight_stride = t > 0 ? row_stride_of(topk_weights) : g.topk;
        a.out = static_cast<uint16_t*>(out.data);
        a.out_stride = t > 0 ? row_stride_of(out) : g.hidden;
    }
    a.num_tokens = t;
    const int sms = b.grid("ep::low_latency_combine", options.num_sms,
                           default_low_latency_sms(g.max_tokens, g.topk, b.world->sm_budget()));
    b.k_ll_combine->launch({.grid = dim3(static_cast<unsigned>(sms)),
                            .block = dim3(kThreads),
                            .dynamic_smem_bytes = static_cast<size_t>(LowLatencySmem::make(g, kThreads).total),
                            .stream = stream},
                           b.world->device_ctx(), a);
    switch (options.phase) {
        case Phase::kSendRecv:
            break;
        case Phase::kSend:
            h.state = State::kCombineSent;
            b.ll_combine_queue.push_back(&h);
            break;
        case Phase::kRecv:
            h.state = State::kDispatched;
            b.ll_combine_queue.pop_front();
            break;
    }
}

void Buffer::check() const { impl_->check_status("check"); }

void Buffer::sync_and_check(cudaStream_t stream) {
    impl_->world->sync_and_check(stream);
    check();
}

std::optional<StatusReport> Buffer::status() const {
    auto s = read_status(impl_->status_host);
    if (!s) {
        return std::nullopt;
    }
    return StatusReport{s->code, *s, describe_status(*s)};
}

void Buffer::clear_status() {
    auto* p = reinterpret_cast<volatile uint8_t*>(impl_->status_host);
    for (size_t i = 0; i < sizeof(Status); ++i) {
        p[i] = 0;
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);
}

}  // namespace weft::ops::ep
