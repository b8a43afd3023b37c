// SPDX-License-Identifier: MIT
// weft::ops::ep normal mode on a team that spans nodes: the pack kernel, a record exchange over the team
// (ops::all_to_all across nodes: node stage, then the column network), a one-rank dispatch of the received records,
// and the reverse for combine (docs/multinode.md, "EP across nodes").
#include "ep_buffer.hpp"
#include "weft/net/host_backend.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"

namespace weft::ops::ep {

using detail::kThreads;
using detail::row_stride_of;

namespace {

constexpr int64_t kExchangeAlign = 256;

}  // namespace

void Buffer::Impl::init_across_nodes() {
    WEFT_CHECK(team.ranks_per_node() > 0,
               "ep::Buffer: the team of " << team.describe() << " spans " << team.num_nodes()
                                          << " nodes with different numbers of members; across nodes every node must "
                                             "hold the same number of the team's members");
    if (const std::string why = net::nccl_unavailable_reason(); !why.empty()) {
        WEFT_FAIL("ep::Buffer: the team of " << team.describe() << " spans " << team.num_nodes()
                                             << " nodes and the network backend is unavailable: " << why);
    }
    // The column communicators now (collective over the team, bounded by the World's timeout), so that a member that
    // never comes fails the construction, and the first dispatch can be captured in a graph.
    (void)net::HostBackend::get(team);
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&alloc_stream, cudaStreamNonBlocking));

    // The layout kernel's state (its call counter, for reports); the team-wide layout arrays live in each handle.
    device = detail::device_alloc_zeroed(static_cast<uint64_t>(ws.buffer_device.bytes), alloc_stream);
    normal = weft::ep::NormalBufferView{};
    normal.state = ws.buffer_device.normal_state.at(device);
    net = weft::ep::InternodeLayout::make(geo);

    // The one-rank Buffer the received records feed: this rank's experts, every (source, token) of the exchange as a
    // token of its own, in (source rank, source token) order; its capacities are the team's.
    Config one;
    one.num_experts = geo.local_experts();
    one.hidden = geo.hidden;
    one.topk = net.local_topk;
    one.max_tokens_per_rank = static_cast<int>(net.records());
    one.normal = true;
    one.low_latency = false;
    one.max_recv_tokens = geo.max_recv_tokens;
    one.max_recv_rows = geo.max_recv_rows;
    one.expert_alignment = geo.expert_alignment;
    WEFT_CHECK(net.records() <= (int64_t{1} << 24),
               "ep::Buffer: across nodes a rank receives num_ranks x max_tokens_per_rank = "
                   << net.records() << " records per dispatch, more than 2^24; lower max_tokens_per_rank");
    inner = std::make_unique<Buffer>(team.split_strided(team.rank(), 1, 1), one);

    const std::vector<jit::KernelSpec> specs = kernel_specs();
    k_layout = &jit::compiler().get_kernel(specs[0]);
    k_pack = &jit::compiler().get_kernel(specs[5]);
    k_sum = &jit::compiler().get_kernel(specs[6]);
    WEFT_LOG_INFO("ep: the team spans " << team.num_nodes() << " nodes of " << team.ranks_per_node()
                                        << " members: each dispatch and combine exchanges " << net.dispatch_bytes()
                                        << " and " << net.combine_bytes() << " bytes per rank over ops::all_to_all");
}

void Buffer::Impl::refuse_across_nodes(const char* op) const {
    WEFT_CHECK(!across_nodes(), "ep::" << op << ": the low-latency mode does not cross nodes yet (the team of "
                                       << team.describe() << " spans " << team.num_nodes()
                                       << " nodes, whose peers are not load/store reachable); use the normal mode "
                                          "(dispatch/combine), which crosses nodes, or a team within one node");
}

void Buffer::Impl::init_across_nodes_handle(NormalHandle::Impl& h) {
    h.inner = std::make_unique<NormalHandle>(inner->make_normal_handle());
    h.device = detail::device_alloc_zeroed(static_cast<uint64_t>(ws.normal_handle_device.bytes), alloc_stream);
    // The receive side is the one-rank handle's; the layout arrays are the team-wide ones of this handle.
    const weft::ep::NormalHandleDeviceLayout& d = ws.normal_handle_device;
    h.view = h.inner->view();
    h.view.tokens_per_expert = d.tokens_per_expert.at(h.device);
    h.view.tokens_per_rank = d.tokens_per_rank.at(h.device);
    h.view.token_in_rank = d.token_in_rank.at(h.device);
    h.view.send_idx = d.send_idx.at(h.device);
    h.view.route_pos = d.route_pos.at(h.device);
    const int64_t records = round_up(net.dispatch_bytes(), kExchangeAlign);
    const int64_t partials = round_up(net.combine_bytes(), kExchangeAlign);
    h.exchange = detail::device_alloc_zeroed(static_cast<uint64_t>(2 * records + 2 * partials), alloc_stream);
    h.send = h.exchange;
    h.recv = h.exchange + records;
    h.partials = reinterpret_cast<uint16_t*>(h.exchange + 2 * records);
    h.returned = reinterpret_cast<uint16_t*>(h.exchange + 2 * records + partials);
}

void Buffer::Impl::internode_dispatch(NormalHandle::Impl& h, const TensorView& x, const TensorView& topk_idx,
                                      const TensorView& topk_weights, int t, cudaStream_t stream,
                                      const NormalOptions& options) {
    const Geometry& g = geo;
    launch_layout(h, topk_idx, t, stream);  // send_idx, tokens_per_rank of the team
    weft::ep::InternodeArgs a{};
    a.geo = g;
    a.net = net;
    a.num_tokens = t;
    a.x = static_cast<const uint16_t*>(x.data);
    a.x_stride = t > 0 ? row_stride_of(x) : g.hidden;
    a.topk_idx = static_cast<const int32_t*>(topk_idx.data);
    a.idx_stride = t > 0 ? row_stride_of(topk_idx) : g.topk;
    a.topk_weights = static_cast<const float*>(topk_weights.data);
    a.weight_stride = t > 0 ? row_stride_of(topk_weights) : g.topk;
    a.send_idx = h.view.send_idx;
    a.tokens_per_rank = h.view.tokens_per_rank;
    a.send = h.send;
    const int sms = grid("dispatch", options.num_sms, default_normal_sms(t, world->sm_budget()));
    k_pack->launch({.grid = dim3(static_cast<unsigned>(sms)), .block = dim3(kThreads), .stream = stream}, ctx, a);
    uses.note(stream);
    all_to_all(team, TensorView(h.send, DType::kU8, {net.dispatch_bytes()}),
               TensorView(h.recv, DType::kU8, {net.dispatch_bytes()}), stream);
    // The records as the one-rank dispatch's tokens: rows, routes and weights read in place (strided views).
    const int64_t rows = net.records();
    const TensorView rx(h.recv, DType::kBF16, {rows, g.hidden}, {net.record_bytes / 2, 1});
    const TensorView ridx(h.recv + net.ids_offset, DType::kI32, {rows, net.local_topk}, {net.record_bytes / 4, 1});
    const TensorView rw(h.recv + net.weights_offset, DType::kF32, {rows, net.local_topk}, {net.record_bytes / 4, 1});
    NormalOptions one = options;
    one.num_sms = 0;  // the one-rank dispatch's own default (its tokens are the exchange's records)
    inner->dispatch(*h.inner, rx, ridx, rw, stream, one);
    uses.note(stream);  // the one-rank dispatch reads the receive records: they are freed only after it
}

void Buffer::Impl::internode_combine(NormalHandle::Impl& h, const TensorView& y, const TensorView& out, int t,
                                     cudaStream_t stream, const NormalOptions& options) {
    const Geometry& g = geo;
    NormalOptions one = options;
    one.num_sms = 0;
    // Each received (source, token)'s partial over this rank's experts, in slot order, rounded once to bf16.
    inner->combine(*h.inner, y, TensorView(h.partials, DType::kBF16, {net.records(), g.hidden}), stream, one);
    all_to_all(team, TensorView(h.partials, DType::kU8, {net.combine_bytes()}),
               TensorView(h.returned, DType::kU8, {net.combine_bytes()}), stream);
    weft::ep::InternodeArgs a{};
    a.geo = g;
    a.net = net;
    a.num_tokens = t;
    a.send_idx = h.view.send_idx;
    a.tokens_per_rank = h.view.tokens_per_rank;
    a.partials = h.returned;
    a.out = static_cast<uint16_t*>(out.data);
    a.out_stride = t > 0 ? row_stride_of(out) : g.hidden;
    const int sms = grid("combine", options.num_sms, default_normal_sms(t, world->sm_budget()));
    k_sum->launch({.grid = dim3(static_cast<unsigned>(sms)), .block = dim3(kThreads), .stream = stream}, ctx, a);
    uses.note(stream);
}

}  // namespace weft::ops::ep
