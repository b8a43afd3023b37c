// SPDX-License-Identifier: MIT
// weft::ops::ep normal mode: NormalHandle, and the layout, dispatch and combine launches.
#include "abort_mark.hpp"
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

NormalHandle::Impl::~Impl() {
    if (buffer == nullptr) {
        return;
    }
    const weft::RelaxedCaptureMode relaxed;  // frees and waits on the Buffer's stream beside another thread's capture
    try {
        buffer->uses.wait_all();  // no kernel of this Buffer still reads the handle's buffers here
        if (symmetric != nullptr) buffer->world->heap().free(buffer->team, symmetric);
    } catch (const std::exception& e) {
        ops::detail::log_failed_release(*buffer->world, "an ep::NormalHandle", e);
    }
    try {  // the private buffers, also after an abort
        if (exchange != nullptr) {
            WEFT_CUDA_CHECK(cudaFreeAsync(exchange, buffer->alloc_stream));
        }
        if (device != nullptr) {
            WEFT_CUDA_CHECK(cudaFreeAsync(device, buffer->alloc_stream));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(buffer->alloc_stream));
        }
    } catch (const std::exception& e) {
        WEFT_LOG_ERROR("ep: freeing a NormalHandle failed: " << e.what());
    }
    buffer->detach(&buffer);
}

NormalHandle::NormalHandle(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NormalHandle::NormalHandle(NormalHandle&&) noexcept = default;
NormalHandle& NormalHandle::operator=(NormalHandle&&) noexcept = default;
NormalHandle::~NormalHandle() = default;

TensorView NormalHandle::recv_x() const {
    const auto& h = detail::live_impl(impl_, "NormalHandle::recv_x()");
    const Geometry& g = h.buffer->geo;
    return TensorView(h.view.recv_x, DType::kBF16, {g.max_recv_rows, g.hidden});
}
const int32_t* NormalHandle::expert_counts() const {
    return detail::live_impl(impl_, "NormalHandle::expert_counts()").view.expert_counts;
}
const int32_t* NormalHandle::expert_offsets() const {
    return detail::live_impl(impl_, "NormalHandle::expert_offsets()").view.expert_offsets;
}
int NormalHandle::num_tokens() const { return detail::live_impl(impl_, "NormalHandle::num_tokens()").num_tokens; }
const NormalHandleView& NormalHandle::view() const { return detail::live_impl(impl_, "NormalHandle::view()").view; }

NormalHandle Buffer::make_normal_handle() {
    Impl& b = *impl_;
    WEFT_CHECK(b.config.normal, "ep: make_normal_handle: this Buffer was made with Config::normal = false");
    auto h = std::make_unique<NormalHandle::Impl>();
    h->ordinal = b.normal_handles_made++;
    if (b.across_nodes()) {
        b.init_across_nodes_handle(*h);
        b.attach(&h->buffer);
        return NormalHandle(std::move(h));
    }
    h->symmetric = static_cast<uint8_t*>(
        b.world->heap().alloc(b.team, static_cast<uint64_t>(b.ws.normal_handle_symmetric.bytes)));  // collective
    h->device = detail::device_alloc_zeroed(static_cast<uint64_t>(b.ws.normal_handle_device.bytes), b.alloc_stream);
    h->view = b.ws.normal_handle(h->symmetric, h->device);
    b.attach(&h->buffer);
    return NormalHandle(std::move(h));
}

weft::ep::NormalArgs Buffer::Impl::normal_args(const NormalHandle::Impl& h) const {
    weft::ep::NormalArgs a{};
    a.geo = geo;
    a.handle_ordinal = h.ordinal;
    a.handle = h.view;
    a.buffer = normal;
    a.status = status_dev;
    return a;
}

void Buffer::Impl::launch_layout(const NormalHandle::Impl& h, const TensorView& topk_idx, int t,
                                 cudaStream_t stream) const {
    weft::ep::NormalArgs a = normal_args(h);
    a.num_tokens = t;
    a.topk_idx = static_cast<const int32_t*>(topk_idx.data);
    a.idx_stride = t > 0 ? row_stride_of(topk_idx) : geo.topk;
    k_layout->launch({.grid = dim3(1),
                      .block = dim3(kThreads),
                      .dynamic_smem_bytes = static_cast<size_t>(weft::ep::LayoutSmem::make(geo, kThreads).total),
                      .stream = stream},
                     ctx, a);
    uses.note(stream);
}

void Buffer::layout(NormalHandle& handle, const TensorView& topk_idx, cudaStream_t stream) {
    WEFT_NVTX_RANGE("ep layout");
    Impl& b = *impl_;
    b.enter("layout", stream, handle.impl_ ? handle.impl_->buffer : nullptr);
    const int t = check_tokens("ep::layout", b.geo, topk_idx, -1, "");
    ops::detail::check_device_buffers(b.world->heap(), {{"topk_idx", topk_idx}}, "ep::layout", stream);
    // The combine of a dispatch reads its layout (which rows went where, how many partials come back): a new one in
    // between would send the combine's partials by one routing and wait for them by another.
    WEFT_CHECK(!handle.impl_->combine_pending,
               "ep::layout: the handle was dispatched and not combined yet (its combine reads the dispatch's layout); "
               "combine first, or use another handle");
    b.launch_layout(*handle.impl_, topk_idx, t, stream);
    // A combine after this would read the new layout against the last dispatch's rows: another dispatch first.
    handle.impl_->dispatched = false;
}

void Buffer::dispatch(NormalHandle& handle, const TensorView& x, const TensorView& topk_idx,
                      const TensorView& topk_weights, cudaStream_t stream, const NormalOptions& options) {
    WEFT_NVTX_RANGE("ep dispatch");
    Impl& b = *impl_;
    const Geometry& g = b.geo;
    b.enter("dispatch", stream, handle.impl_ ? handle.impl_->buffer : nullptr);
    WEFT_CHECK(b.config.normal, "ep: dispatch: this Buffer was made with Config::normal = false");
    check_matrix("ep::dispatch", "x", x, DType::kBF16, g.hidden, true);
    const int t = check_tokens("ep::dispatch", g, topk_idx, x.dim(0), "x");
    check_matrix("ep::dispatch", "topk_weights", topk_weights, DType::kF32, g.topk, false);
    WEFT_CHECK(topk_weights.dim(0) == t,
               "ep::dispatch: topk_weights has " << topk_weights.dim(0) << " rows but x has " << t);
    ops::detail::check_device_buffers(
        b.world->heap(), {{"x", x}, {"topk_idx", topk_idx}, {"topk_weights", topk_weights}}, "ep::dispatch", stream);
    // Across nodes the receive area is the handle's one-rank handle's (docs/multinode.md, "EP across nodes").
    const NormalHandle::Impl& receiver = handle.impl_->inner ? *handle.impl_->inner->impl_ : *handle.impl_;
    const Buffer::Impl& receiving = b.inner ? *b.inner->impl_ : b;
    if (receiver.symmetric != nullptr) {
        // Every rank's dispatch stores rows into this handle's receive area (its own included) while the kernel still
        // reads x: x (or the routing) taken from there would be overwritten before it is read. (Across nodes the
        // inputs are packed first; the rule is the same, so that a program is right on one node and across nodes.)
        const TensorView area(receiver.symmetric, DType::kU8,
                              {static_cast<int64_t>(receiving.fp.normal_handle_symmetric_bytes)});
        for (const ops::detail::NamedView& v :
             {ops::detail::NamedView{"x", x}, {"topk_idx", topk_idx}, {"topk_weights", topk_weights}}) {
            ops::detail::check_apart("ep::dispatch", v.name, v.view, {{"the handle's receive area (recv_x)", area}},
                                     "the dispatch writes rows there while it reads its inputs; copy them out first");
        }
    }
    const int sms = b.grid("dispatch", options.num_sms, default_normal_sms(t, b.world->sm_budget()));
    const NormalFused& f = options.fused;
    const int fused_words = (f.counts_ready != nullptr) + (f.expert_ready != nullptr) + (f.expert_rows != nullptr);
    WEFT_CHECK(fused_words == 0 || fused_words == 3,
               "ep::dispatch: options.fused needs counts_ready, expert_ready and expert_rows together (or none), got "
                   << fused_words << " of them");
    WEFT_CHECK(reinterpret_cast<uintptr_t>(f.counts_ready) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(f.expert_ready) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(f.expert_rows) % 4 == 0,
               "ep::dispatch: options.fused's words must be aligned to their size");
    if (fused_words == 3) {
        ops::detail::check_device_pointer(f.counts_ready, "options.fused.counts_ready", "ep::dispatch", stream);
        ops::detail::check_device_pointer(f.expert_ready, "options.fused.expert_ready", "ep::dispatch", stream);
        ops::detail::check_device_pointer(f.expert_rows, "options.fused.expert_rows", "ep::dispatch", stream);
    }
    NormalHandle::Impl& h = *handle.impl_;
    if (b.across_nodes()) {
        b.internode_dispatch(h, x, topk_idx, topk_weights, t, stream, options);
        h.num_tokens = t;
        h.dispatched = true;
        h.combine_pending = true;
        return;
    }
    b.launch_layout(h, topk_idx, t, stream);
    weft::ep::NormalArgs a = b.normal_args(h);
    a.num_tokens = t;
    a.x = static_cast<const uint16_t*>(x.data);
    a.x_stride = t > 0 ? row_stride_of(x) : g.hidden;
    a.topk_idx = static_cast<const int32_t*>(topk_idx.data);
    a.idx_stride = t > 0 ? row_stride_of(topk_idx) : g.topk;
    a.topk_weights = static_cast<const float*>(topk_weights.data);
    a.weight_stride = t > 0 ? row_stride_of(topk_weights) : g.topk;
    a.fused.counts_ready = options.fused.counts_ready;
    a.fused.expert_ready = options.fused.expert_ready;
    a.fused.expert_rows = options.fused.expert_rows;
    b.k_dispatch->launch({.grid = dim3(static_cast<unsigned>(sms)),
                          .block = dim3(kThreads),
                          .dynamic_smem_bytes = static_cast<size_t>(weft::ep::NormalSmem::make(g, kThreads).total),
                          .stream = stream},
                         b.ctx, a);
    b.uses.note(stream);
    h.num_tokens = t;
    h.dispatched = true;
    h.combine_pending = true;
}

void Buffer::combine(NormalHandle& handle, const TensorView& y, const TensorView& out, cudaStream_t stream,
                     const NormalOptions& options) {
    WEFT_NVTX_RANGE("ep combine");
    Impl& b = *impl_;
    const Geometry& g = b.geo;
    b.enter("combine", stream, handle.impl_ ? handle.impl_->buffer : nullptr, false);
    NormalHandle::Impl& h = *handle.impl_;
    WEFT_CHECK(h.dispatched,
               "ep::combine: the handle has not been dispatched (or layout() replaced its dispatch's layout since)");
    check_matrix("ep::combine", "y", y, DType::kBF16, g.hidden, true);
    WEFT_CHECK(y.dim(0) >= g.max_recv_rows, "ep::combine: y must have at least max_recv_rows = "
                                                << g.max_recv_rows << " rows (the rows of recv_x), got "
                                                << y.describe());
    const int t = h.num_tokens;
    check_matrix("ep::combine", "out", out, DType::kBF16, g.hidden, true);
    WEFT_CHECK(out.dim(0) == t, "ep::combine: out must have the dispatch's " << t << " rows, got " << out.describe());
    ops::detail::check_device_buffers(b.world->heap(), {{"y", y}, {"out", out}}, "ep::combine", stream);
    const int sms = b.grid("combine", options.num_sms, default_normal_sms(t, b.world->sm_budget()));
    const NormalFused& f = options.fused;
    if (f.tile_done != nullptr) {
        WEFT_CHECK(reinterpret_cast<uintptr_t>(f.tile_done) % 8 == 0,
                   "ep::combine: options.fused.tile_done must be 8-byte aligned");
        ops::detail::check_device_pointer(f.tile_done, "options.fused.tile_done", "ep::combine", stream);
        WEFT_CHECK(f.tile_m > 0 && f.tile_target > 0,
                   "ep::combine: options.fused needs tile_m > 0 and tile_target > 0, got tile_m "
                       << f.tile_m << ", tile_target " << f.tile_target);
        const int64_t rows_of_tiles = (g.max_recv_rows + f.tile_m - 1) / f.tile_m;
        WEFT_CHECK(f.tile_stride >= rows_of_tiles,
                   "ep::combine: options.fused.tile_stride must cover an expert's rows of tiles (ceil(max_recv_rows "
                   "/ tile_m) = " << rows_of_tiles << "), got " << f.tile_stride);
    }
    if (b.across_nodes()) {
        b.internode_combine(h, y, out, t, stream, options);
        h.combine_pending = false;
        return;
    }
    // A block writes its tokens' sums once this rank's partials are in, while other blocks may still read y's rows
    // for the peers' tokens.
    ops::detail::check_apart("ep::combine", "out", out, {{"y", y}},
                             "out is written while y's rows for the peers' tokens are still read");
    weft::ep::NormalArgs a = b.normal_args(h);
    a.num_tokens = t;
    a.y = static_cast<const uint16_t*>(y.data);
    a.y_stride = row_stride_of(y);
    a.out = static_cast<uint16_t*>(out.data);
    a.out_stride = t > 0 ? row_stride_of(out) : g.hidden;
    if (f.tile_done != nullptr) {
        a.fused.tile_done = f.tile_done;
        a.fused.tile_stride = f.tile_stride;
        a.fused.tile_m = f.tile_m;
        a.fused.tile_target = f.tile_target;
    }
    b.k_combine->launch({.grid = dim3(static_cast<unsigned>(sms)),
                         .block = dim3(kThreads),
                         .dynamic_smem_bytes = static_cast<size_t>(weft::ep::NormalSmem::make(g, kThreads).total),
                         .stream = stream},
                        b.ctx, a);
    b.uses.note(stream);
    h.combine_pending = false;
}

}  // namespace weft::ops::ep
