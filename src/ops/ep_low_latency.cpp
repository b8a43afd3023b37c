// SPDX-License-Identifier: MIT
// weft::ops::ep low-latency mode: LowLatencyHandle, the dispatch and combine launches and their call-order checks.
#include <algorithm>
#include <string>

#include "collective_workspace.hpp"
#include "ep_buffer.hpp"
#include "views_overlap.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/stream.hpp"

namespace weft::ops::ep {

using detail::check_matrix;
using detail::check_tokens;
using detail::kThreads;
using detail::row_stride_of;

namespace {

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

void check_phase(const char* op, Phase p) {
    WEFT_CHECK(p == Phase::kSendRecv || p == Phase::kSend || p == Phase::kRecv,
               "ep::" << op << ": options.phase must be Phase::kSendRecv, kSend or kRecv, got the value "
                      << static_cast<int>(p));
}

int phase_bits(Phase p) {
    switch (p) {
        case Phase::kSendRecv:
            return weft::ep::kPhaseSend | weft::ep::kPhaseRecv;
        case Phase::kSend:
            return weft::ep::kPhaseSend;
        case Phase::kRecv:
            return weft::ep::kPhaseRecv;
    }
    return 0;
}

}  // namespace

void Buffer::Impl::launch_one_node_ll(jit::Kernel& kernel, const weft::ep::LowLatencyArgs& a, int sms,
                                      cudaStream_t stream) {
    kernel.launch({.grid = dim3(static_cast<unsigned>(sms)),
                   .block = dim3(kThreads),
                   .dynamic_smem_bytes = static_cast<size_t>(weft::ep::LowLatencySmem::make(geo, kThreads).total),
                   .stream = stream},
                  ctx, a);
    uses.note(stream);
}

weft::ep::LowLatencyArgs Buffer::Impl::low_latency_args(const LowLatencyHandle::Impl& h, Phase phase) const {
    weft::ep::LowLatencyArgs a{};
    a.geo = geo;
    a.phases = phase_bits(phase);
    a.handle = h.view;
    a.buffer = low_latency;
    a.status = status_dev;
    a.trace = trace;
    return a;
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
    // No kernel of this Buffer still reads the handle's buffers (its receive rows, records and counts, the exchange
    // buffers) after this: they are freed on the Buffer's own stream, which the callers' streams do not order.
    const weft::RelaxedCaptureMode relaxed;  // beside another thread's capture
    buffer->uses.wait_all();
    if (exchange != nullptr) cudaFreeAsync(exchange, buffer->alloc_stream);
    if (device != nullptr) {
        cudaFreeAsync(device, buffer->alloc_stream);
        cudaStreamSynchronize(buffer->alloc_stream);
    }
    buffer->detach(&buffer);
}

LowLatencyHandle::LowLatencyHandle(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LowLatencyHandle::LowLatencyHandle(LowLatencyHandle&&) noexcept = default;
LowLatencyHandle& LowLatencyHandle::operator=(LowLatencyHandle&&) noexcept = default;
LowLatencyHandle::~LowLatencyHandle() = default;

TensorView LowLatencyHandle::recv_x() const {
    const auto& h = detail::live_impl(impl_, "LowLatencyHandle::recv_x()");
    const Geometry& g = h.buffer->geo;
    return TensorView(h.view.recv_x, h.fp8 ? DType::kF8E4M3 : DType::kBF16,
                      {g.local_experts(), g.ll_rows_per_expert(), g.hidden});
}
TensorView LowLatencyHandle::recv_scales() const {
    const auto& h = detail::live_impl(impl_, "LowLatencyHandle::recv_scales()");
    const Geometry& g = h.buffer->geo;
    return TensorView(h.view.recv_scales, DType::kF32, {g.local_experts(), g.ll_rows_per_expert(), g.ll_fp8_scales()});
}
const int32_t* LowLatencyHandle::expert_counts() const {
    return detail::live_impl(impl_, "LowLatencyHandle::expert_counts()").view.expert_counts;
}
bool LowLatencyHandle::fp8() const { return detail::live_impl(impl_, "LowLatencyHandle::fp8()").fp8; }
const LowLatencyHandleView& LowLatencyHandle::view() const {
    return detail::live_impl(impl_, "LowLatencyHandle::view()").view;
}

LowLatencyHandle Buffer::make_low_latency_handle() {
    Impl& b = *impl_;
    WEFT_CHECK(b.config.low_latency,
               "ep: make_low_latency_handle: this Buffer was made with Config::low_latency = false");
    auto h = std::make_unique<LowLatencyHandle::Impl>();
    h->device =
        detail::device_alloc_zeroed(static_cast<uint64_t>(b.ws.low_latency_handle_device.bytes), b.alloc_stream);
    h->view = b.ws.low_latency_handle(h->device);
    if (b.across_nodes()) b.init_across_nodes_handle(*h);
    b.attach(&h->buffer);
    return LowLatencyHandle(std::move(h));
}

void Buffer::low_latency_dispatch(LowLatencyHandle& handle, const TensorView& x, const TensorView& topk_idx,
                                  cudaStream_t stream, const LowLatencyOptions& options) {
    WEFT_NVTX_RANGE("ep low_latency_dispatch");
    check_phase("low_latency_dispatch", options.phase);
    Impl& b = *impl_;
    const Geometry& g = b.geo;
    b.enter("low_latency_dispatch", stream, handle.impl_ ? handle.impl_->buffer : nullptr,
            options.phase != Phase::kRecv);
    WEFT_CHECK(b.config.low_latency, "ep: low_latency_dispatch: this Buffer was made with Config::low_latency = false");
    LowLatencyHandle::Impl& h = *handle.impl_;
    using State = LowLatencyHandle::Impl::State;
    weft::ep::LowLatencyArgs a = b.low_latency_args(h, options.phase);
    if (options.phase != Phase::kRecv) {
        WEFT_CHECK(
            !options.fp8 || g.hidden % kFp8GroupSize == 0,
            "ep::low_latency_dispatch: fp8 needs hidden to be a multiple of " << kFp8GroupSize << ", got " << g.hidden);
        check_matrix("ep::low_latency_dispatch", "x", x, DType::kBF16, g.hidden, true);
        const int t = check_tokens("ep::low_latency_dispatch", g, topk_idx, x.dim(0), "x");
        ops::detail::check_device_buffers(b.world->heap(), {{"x", x}, {"topk_idx", topk_idx}},
                                          "ep::low_latency_dispatch", stream);
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
    const int sms = b.grid("low_latency_dispatch", options.num_sms,
                           default_low_latency_sms(g.max_tokens, g.topk, b.world->sm_budget()));
    // Every check has passed: from here on the call happens.
    if (options.phase != Phase::kRecv) {
        h.fp8 = options.fp8;
        h.num_tokens = a.num_tokens;
    }
    a.fp8 = h.fp8 ? 1 : 0;
    // Sent with every count and compared by every receiver: a rank whose call differs (fp8 against bf16) is reported
    // by every rank (kCallMismatch) and nothing is received.
    a.signature = weft::ep::ll_call_signature(g, h.fp8);
    if (b.across_nodes()) {
        // The send half carries the whole exchange (the network's all_to_all waits for every peer); the receive half
        // launches nothing (docs/multinode.md, "EP across nodes").
        if (options.phase != Phase::kRecv) {
            weft::ep::LowLatencyInternodeArgs n = b.internode_ll_args(h);
            n.num_tokens = a.num_tokens;
            n.fp8 = a.fp8;
            n.signature = a.signature;
            n.x = a.x;
            n.x_stride = a.x_stride;
            n.topk_idx = a.topk_idx;
            n.idx_stride = a.idx_stride;
            b.internode_ll_dispatch(h, n, sms, stream);
        }
    } else {
        b.launch_one_node_ll(*b.k_ll_dispatch, a, sms, stream);
    }
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
    WEFT_NVTX_RANGE("ep low_latency_combine");
    check_phase("low_latency_combine", options.phase);
    Impl& b = *impl_;
    const Geometry& g = b.geo;
    b.enter("low_latency_combine", stream, handle.impl_ ? handle.impl_->buffer : nullptr, false);
    WEFT_CHECK(b.config.low_latency, "ep: low_latency_combine: this Buffer was made with Config::low_latency = false");
    LowLatencyHandle::Impl& h = *handle.impl_;
    using State = LowLatencyHandle::Impl::State;
    weft::ep::LowLatencyArgs a = b.low_latency_args(h, options.phase);
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
                       (y.stride(1) * 2) % 16 == 0 && (y.stride(0) * 2) % 16 == 0 && y.stride(1) >= g.hidden &&
                       (y.dim(0) <= 1 || y.stride(0) >= y.dim(1) * y.stride(1)),
                   "ep::low_latency_combine: y must be 16-byte aligned, row-major with 16-byte row strides and "
                   "experts apart (stride(0) >= rows x stride(1)), got "
                       << y.describe());
        ops::detail::check_device_buffers(b.world->heap(), {{"y", y}}, "ep::low_latency_combine", stream);
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
        ops::detail::check_device_buffers(b.world->heap(),
                                          {{"topk_idx", topk_idx}, {"topk_weights", topk_weights}, {"out", out}},
                                          "ep::low_latency_combine", stream);
        // A token's row is summed by several warps, each reading its topk_idx and topk_weights rows.
        ops::detail::check_apart("ep::low_latency_combine", "out", out,
                                 {{"topk_idx", topk_idx}, {"topk_weights", topk_weights}},
                                 "one warp's stores into out may land before another reads a token's routing");
        a.topk_idx = static_cast<const int32_t*>(topk_idx.data);
        a.idx_stride = t > 0 ? row_stride_of(topk_idx) : g.topk;
        a.topk_weights = static_cast<const float*>(topk_weights.data);
        a.weight_stride = t > 0 ? row_stride_of(topk_weights) : g.topk;
        a.out = static_cast<uint16_t*>(out.data);
        a.out_stride = t > 0 ? row_stride_of(out) : g.hidden;
    }
    a.num_tokens = t;
    const int sms = b.grid("low_latency_combine", options.num_sms,
                           default_low_latency_sms(g.max_tokens, g.topk, b.world->sm_budget()));
    if (b.across_nodes()) {
        weft::ep::LowLatencyInternodeArgs n = b.internode_ll_args(h);
        n.num_tokens = t;
        n.y = a.y;
        n.y_expert_stride = a.y_expert_stride;
        n.y_row_stride = a.y_row_stride;
        n.topk_idx = a.topk_idx;
        n.idx_stride = a.idx_stride;
        n.topk_weights = a.topk_weights;
        n.weight_stride = a.weight_stride;
        n.out = a.out;
        n.out_stride = a.out_stride;
        b.internode_ll_combine(h, n, options.phase, sms, stream);
    } else {
        b.launch_one_node_ll(*b.k_ll_combine, a, sms, stream);
    }
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

}  // namespace weft::ops::ep
