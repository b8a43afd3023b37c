// SPDX-License-Identifier: MIT
// weft::ops::ep on a team that spans nodes. Normal mode: every rank rebuilds the one-node receive order as records (two
// hops: node blocks over the column network, then the node's forward and load/store all_to_all; or one record exchange
// over ops::all_to_all on the team) and runs a one-rank dispatch on them; combine returns each record's partial over
// all_to_all and sums in rank order. Low-latency mode: one record per (destination, token) straight to the destination
// over all_to_all, placed into the masked layout there; combine returns every route's row to its source, which sums
// them in slot order (docs/multinode.md, "EP across nodes").
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "ep_buffer.hpp"
#include "weft/net/chunk_schedule.hpp"
#include "weft/net/host_backend.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"

namespace weft::ops::ep {

using detail::kThreads;
using detail::row_stride_of;

void Buffer::Impl::init_across_nodes() {
    spans_nodes = true;
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
    net::HostBackend& backend = net::HostBackend::get(team);
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&alloc_stream, cudaStreamNonBlocking));

    // The dispatch's path; every member must take the same one (their exchanges differ). The members publish what
    // they chose (0 two_hop, 1 all_to_all, 2 a value refused) before any refuses, so that every member refuses alike.
    const std::optional<std::string> path = env::get("WEFT_EP_ACROSS_NODES");
    const std::string chosen = !path || path->empty() ? "two_hop" : *path;
    const uint8_t code = chosen == "two_hop" ? 0 : chosen == "all_to_all" ? 1 : 2;
    two_hop = code == 0;
    {
        const std::vector<std::vector<uint8_t>> all = team.all_gather("weft.ops.ep.across_nodes", {code});
        const auto name = [](uint8_t c) {
            return c == 0 ? "two_hop" : c == 1 ? "all_to_all" : "a value other than two_hop and all_to_all";
        };
        const auto theirs_at = [&](int r) {
            return all[static_cast<size_t>(r)].size() == 1 ? all[static_cast<size_t>(r)][0] : uint8_t{2};
        };
        for (int r = 0; r < team.num_ranks(); ++r) {  // a refused value first, the same text on every member
            WEFT_CHECK(theirs_at(r) != 2, "ep::Buffer: WEFT_EP_ACROSS_NODES must be two_hop or all_to_all; world rank "
                                              << team.world_rank(r) << " has " << name(theirs_at(r))
                                              << (r == team.rank() ? " ('" + chosen + "')" : std::string()));
        }
        for (int r = 1; r < team.num_ranks(); ++r) {  // the team's first member and the first that differs
            WEFT_CHECK(theirs_at(r) == theirs_at(0), "ep::Buffer: the members' WEFT_EP_ACROSS_NODES differ: world rank "
                                                         << team.world_rank(0) << " takes " << name(theirs_at(0))
                                                         << ", world rank " << team.world_rank(r) << " "
                                                         << name(theirs_at(r)) << "; every member must take the same");
        }
    }
    hop = weft::ep::NodeRecordLayout::make(geo, backend.num_nodes(), backend.ranks_per_node());
    {
        std::vector<int32_t> by_node;
        for (const std::vector<int>& node : backend.team_ranks_by_node())
            by_node.insert(by_node.end(), node.begin(), node.end());
        const auto bytes = static_cast<size_t>(weft::ep::node_table_bytes(team.num_ranks()));
        WEFT_CHECK(by_node.size() * sizeof(int32_t) == bytes,
                   "ep::Buffer: the network backend lists " << by_node.size() << " ranks by node for the team of "
                                                            << team.describe() << ", expected " << team.num_ranks());
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&team_ranks_by_node), bytes, alloc_stream));
        WEFT_CUDA_CHECK(
            cudaMemcpyAsync(team_ranks_by_node, by_node.data(), bytes, cudaMemcpyHostToDevice, alloc_stream));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(alloc_stream));
    }

    // The layout kernels' state (their call counters, for reports); the team-wide layout arrays live in each handle.
    device = detail::device_alloc_zeroed(static_cast<uint64_t>(ws.buffer_device.bytes), alloc_stream);
    normal = weft::ep::NormalBufferView{};
    low_latency = weft::ep::LowLatencyBufferView{};
    const std::vector<jit::KernelSpec> specs = kernel_specs();
    if (config.low_latency) {
        low_latency.state = ws.buffer_device.ll_state.at(device);
        ll_net = weft::ep::LowLatencyRecordLayout::make(geo);
        k_ll_pack = &jit::compiler().get_kernel(specs[9]);
        k_ll_layout = &jit::compiler().get_kernel(specs[10]);
        k_ll_copy = &jit::compiler().get_kernel(specs[11]);
        k_ll_combine_pack = &jit::compiler().get_kernel(specs[12]);
        k_ll_combine_sum = &jit::compiler().get_kernel(specs[13]);
        WEFT_LOG_INFO("ep: low-latency across " << team.num_nodes() << " nodes: dispatch all_to_all of "
                                                << ll_net.dispatch_bytes() << " bytes per rank, combine all_to_all of "
                                                << ll_net.combine_bytes() << " bytes per rank");
    }
    if (!config.normal) return;
    normal.state = ws.buffer_device.normal_state.at(device);
    net = weft::ep::InternodeLayout::make(geo);

    // The one-rank Buffer the received records feed (detail::one_rank_config).
    inner = std::make_unique<Buffer>(team.split_strided(team.rank(), 1, 1), detail::one_rank_config(geo));
    inner->impl_->nested = true;

    k_layout = &jit::compiler().get_kernel(specs[0]);
    k_pack = &jit::compiler().get_kernel(specs[5]);
    k_sum = &jit::compiler().get_kernel(specs[6]);
    k_node_pack = &jit::compiler().get_kernel(specs[7]);
    k_forward = &jit::compiler().get_kernel(specs[8]);
    WEFT_LOG_INFO(
        "ep: the team spans " << team.num_nodes() << " nodes of " << team.ranks_per_node() << " members; dispatch: "
                              << (two_hop ? "two hops, " + std::to_string(hop.bytes()) +
                                                " bytes per rank to the column peers"
                                          : "all_to_all of " + std::to_string(net.dispatch_bytes()) + " bytes per rank")
                              << "; combine: all_to_all of " << net.combine_bytes() << " bytes per rank");
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
    // send | recv | partials | returned, then for two hops: node_send | node_recv | gathered (the forward's output is
    // `send`, the node all_to_all's output `gathered` is reordered into `recv`).
    const weft::ep::NormalExchangeLayout x = weft::ep::NormalExchangeLayout::make(net, hop, two_hop);
    h.exchange = detail::device_alloc_zeroed(static_cast<uint64_t>(x.bytes), alloc_stream);
    h.send = h.exchange + x.send;
    h.recv = h.exchange + x.recv;
    h.partials = reinterpret_cast<uint16_t*>(h.exchange + x.partials_at);
    h.returned = reinterpret_cast<uint16_t*>(h.exchange + x.returned);
    if (two_hop) {
        h.node_send = h.exchange + x.node_send;
        h.node_recv = h.exchange + x.node_recv;
        h.gathered = h.exchange + x.gathered;
    }
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
    if (two_hop) {
        two_hop_exchange(h, a, sms, stream);
    } else {
        k_pack->launch({.grid = dim3(static_cast<unsigned>(sms)), .block = dim3(kThreads), .stream = stream}, ctx, a);
        uses.note(stream);
        all_to_all(team, TensorView(h.send, DType::kU8, {net.dispatch_bytes()}),
                   TensorView(h.recv, DType::kU8, {net.dispatch_bytes()}), stream);
    }
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

void Buffer::Impl::two_hop_exchange(NormalHandle::Impl& h, weft::ep::InternodeArgs a, int sms, cudaStream_t stream) {
    net::HostBackend& backend = net::HostBackend::get(team);
    const int num_nodes = backend.num_nodes();
    const int per_node = backend.ranks_per_node();
    const int n = backend.node_index();
    const auto block = static_cast<uint64_t>(hop.block_bytes());
    a.hop = hop;
    a.team_ranks_by_node = team_ranks_by_node;
    a.node_index = n;
    a.node_send = h.node_send;
    a.node_recv = h.node_recv;
    a.forward = h.send;
    const jit::LaunchParams launch{.grid = dim3(static_cast<unsigned>(sms)), .block = dim3(kThreads), .stream = stream};
    // 1. One block per node: the tokens with a route there, for the column peer on that node.
    k_node_pack->launch(launch, ctx, a);
    uses.note(stream);
    // 2. The network hop over the column: step k sends block n + k to node n + k and receives node n - k's block for
    //    this node (each node's send at step k is its peer's receive at step k), chunk by chunk, under the watcher.
    backend.begin_call(stream);
    const std::vector<net::Chunk> chunks = net::plan_chunks(block, 1, 1, net::chunk_bytes_from_env());
    for (int k = 1; k < num_nodes; ++k) {
        const int to = (n + k) % num_nodes;
        const int from = (n - k + num_nodes) % num_nodes;
        for (const net::Chunk& c : chunks) {
            backend.send_recv(h.node_send + to * block + c.begin, c.count, to, h.node_recv + from * block + c.begin,
                              c.count, from);
        }
    }
    backend.end_call(stream);
    // This node's own block stays here.
    WEFT_CUDA_CHECK(
        cudaMemcpyAsync(h.node_recv + n * block, h.node_send + n * block, block, cudaMemcpyDeviceToDevice, stream));
    // 3. The forward: the final records of each member j of this node, by source node ([L][N][T_max] in h.send).
    k_forward->launch(launch, ctx, a);
    uses.note(stream);
    // 4. Inside the node (load/store): block j to member j; member j receives [l][m][T_max] = source t(m, l).
    all_to_all(backend.node_team(), TensorView(h.send, DType::kU8, {net.dispatch_bytes()}),
               TensorView(h.gathered, DType::kU8, {net.dispatch_bytes()}), stream);
    // 5. In source team-rank order, as the one-rank dispatch needs (the one-node receive order).
    const auto source_block = static_cast<uint64_t>(int64_t{net.capacity} * net.record_bytes);
    const std::vector<std::vector<int>>& by_node = backend.team_ranks_by_node();
    for (int l = 0; l < per_node; ++l) {
        for (int m = 0; m < num_nodes; ++m) {
            const auto s = static_cast<uint64_t>(by_node[static_cast<size_t>(m)][static_cast<size_t>(l)]);
            const auto from = static_cast<uint64_t>(l * num_nodes + m);
            WEFT_CUDA_CHECK(cudaMemcpyAsync(h.recv + s * source_block, h.gathered + from * source_block, source_block,
                                            cudaMemcpyDeviceToDevice, stream));
        }
    }
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

// ---- low-latency mode ----

void Buffer::Impl::init_across_nodes_handle(LowLatencyHandle::Impl& h) {
    const weft::ep::LowLatencyExchangeLayout x = weft::ep::LowLatencyExchangeLayout::make(ll_net);
    h.exchange = detail::device_alloc_zeroed(static_cast<uint64_t>(x.bytes), alloc_stream);
    h.send = h.exchange + x.send;
    h.recv = h.exchange + x.recv;
    h.route_row = reinterpret_cast<int32_t*>(h.exchange + x.route_row);
    h.combine_send = reinterpret_cast<uint16_t*>(h.exchange + x.combine_send);
    h.combine_recv = reinterpret_cast<uint16_t*>(h.exchange + x.combine_recv);
}

weft::ep::LowLatencyInternodeArgs Buffer::Impl::internode_ll_args(const LowLatencyHandle::Impl& h) const {
    weft::ep::LowLatencyInternodeArgs a{};
    a.geo = geo;
    a.net = ll_net;
    a.send = h.send;
    a.recv = h.recv;
    a.route_row = h.route_row;
    a.handle = h.view;
    a.combine_send = h.combine_send;
    a.combine_recv = h.combine_recv;
    a.state = low_latency.state;
    a.status = status_dev;
    return a;
}

void Buffer::Impl::internode_ll_dispatch(LowLatencyHandle::Impl& h, weft::ep::LowLatencyInternodeArgs a, int sms,
                                         cudaStream_t stream) {
    const weft::ep::LowLatencyRecordLayout& l = ll_net;
    const auto launch = [&](jit::Kernel* k, int blocks) {
        k->launch({.grid = dim3(static_cast<unsigned>(blocks)), .block = dim3(kThreads), .stream = stream}, ctx, a);
        uses.note(stream);
    };
    // 1. One record per (destination, token slot): the token's routes there, and its row when it has any.
    launch(k_ll_pack, sms);
    // 2. Straight to each destination (no forward hop): block r of every rank's records to rank r.
    all_to_all(team, TensorView(h.send, DType::kU8, {l.dispatch_bytes()}),
               TensorView(h.recv, DType::kU8, {l.dispatch_bytes()}), stream);
    uses.note(stream);
    // 3. Each local expert's rows in (source, token) order, then the rows themselves (quantised here for fp8).
    launch(k_ll_layout, std::min(geo.local_experts(), world->sm_budget()));
    launch(k_ll_copy, sms);
}

void Buffer::Impl::internode_ll_combine(LowLatencyHandle::Impl& h, weft::ep::LowLatencyInternodeArgs a, Phase phase,
                                        int sms, cudaStream_t stream) {
    const weft::ep::LowLatencyRecordLayout& l = ll_net;
    const jit::LaunchParams launch{.grid = dim3(static_cast<unsigned>(sms)), .block = dim3(kThreads), .stream = stream};
    if (phase != Phase::kRecv) {
        // Every received route's output row, back to its source at (token, position among its routes here).
        k_ll_combine_pack->launch(launch, ctx, a);
        uses.note(stream);
        all_to_all(team, TensorView(h.combine_send, DType::kU8, {l.combine_bytes()}),
                   TensorView(h.combine_recv, DType::kU8, {l.combine_bytes()}), stream);
        uses.note(stream);
    }
    if (phase != Phase::kSend) {
        k_ll_combine_sum->launch(launch, ctx, a);
        uses.note(stream);
    }
}

}  // namespace weft::ops::ep
