// SPDX-License-Identifier: MIT
// Hierarchical collectives: weft's intra-node collectives over each node's members, NCCL across nodes on the network
// backend's comm stream, pipelined in chunks (docs/multinode.md). Team ranks map to (node, local index) through the
// backend; node n's member with local index l is t(n, l).
#include "hierarchical.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "collective_workspace.hpp"
#include "weft/net/all_to_all_plan.hpp"
#include "weft/net/chunk_schedule.hpp"
#include "weft/net/host_backend.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops::detail {

namespace {

// Stream-ordered scratch memory for one call (freed in stream order at its end: capturable).
class Scratch {
public:
    Scratch(uint64_t bytes, cudaStream_t stream) : stream_(stream) {
        WEFT_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes == 0 ? 1 : bytes, stream));
    }
    ~Scratch() {
        if (ptr_ != nullptr) (void)cudaFreeAsync(ptr_, stream_);
    }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
    uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }

private:
    void* ptr_ = nullptr;
    cudaStream_t stream_;
};

void copy(void* dst, const void* src, uint64_t bytes, cudaStream_t stream) {
    if (bytes == 0 || dst == src) return;
    WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
}

TensorView bytes_view(void* p, uint64_t bytes) { return TensorView(p, DType::kU8, {static_cast<int64_t>(bytes)}); }

TensorView elems_view(void* p, DType dtype, uint64_t count) {
    return TensorView(p, dtype, {static_cast<int64_t>(count)});
}

// The team's backend, and its node team's collectives ready (kernels loaded) before anything is enqueued: no module
// loads while NCCL's or weft's kernels wait.
// Made on the team's first call, which may not be captured (CollectiveWorkspace::get with a stream).
net::HostBackend& backend(const Team& team, cudaStream_t stream, const char* op) {
    if (!net::HostBackend::exists(team)) refuse_setup_under_capture(stream, op, "the team's network backend");
    net::HostBackend& net = net::HostBackend::get(team);
    if (net.node_team().num_ranks() > 1) (void)CollectiveWorkspace::get(net.node_team(), stream, op);
    return net;
}

// The user's buffers of a call across nodes: device memory of this rank's GPU (NCCL reads and writes some of them
// directly), checked before anything is enqueued, as the one-node collectives check theirs. Symmetric-heap buffers are.
void check_user_buffers(const Team& team, const char* op, const TensorView& input, const TensorView& output,
                        cudaStream_t stream) {
    check_device_buffers(team.world().heap(), {{"input", input}, {"output", output}}, op, stream);
}

// A refusal on part of the team, after the other nodes' members may have gone on into their stages and network steps:
// the World is aborted, so that they stop at their next heartbeat, then this rank throws.
[[noreturn]] void abort_and_fail(const Team& team, const std::string& why) {
    team.world().abort(why);
    WEFT_FAIL(why);
}

// A node stage's all_gather into weft's own scratch (never on the heap): the automatic algorithm for an output off
// the heap, whatever WEFT_ALLGATHER_ALGO forces for the user's calls (sm_push and ce_push write into symmetric
// outputs only, and a forced one would refuse here, part way through a call).
void node_all_gather(const Team& node, const TensorView& input, const TensorView& output, cudaStream_t stream) {
    AllGatherOptions options;
    if (node.num_ranks() > 1) {
        options.algo = select_all_gather_algo(static_cast<uint64_t>(input.size_bytes()),
                                              CollectiveWorkspace::get(node).topology(), /*output_symmetric=*/false);
    }
    all_gather(node, input, output, stream, options);
}

// A network call from begin_call to end_call. Declared after the call's scratch buffers: when the call throws part way
// (a node stage's argument error), end_call still joins the comm stream's queued steps to `stream` before the scratch
// is freed in stream order, and before the next call's begin_call zeroes the flags. (Every comm-stream wait is for a
// word whose writer the host enqueued first, so the join completes.)
class NetCall {
public:
    NetCall(net::HostBackend& net, cudaStream_t stream) : net_(net), stream_(stream) { net_.begin_call(stream_); }
    NetCall(const NetCall&) = delete;
    NetCall& operator=(const NetCall&) = delete;
    ~NetCall() {
        if (ended_) return;
        try {
            net_.end_call(stream_);
        } catch (const std::exception& e) {
            WEFT_LOG_ERROR("network call: joining the comm stream after an error failed: " << e.what());
        }
    }
    void end() {
        ended_ = true;
        net_.end_call(stream_);
    }

private:
    net::HostBackend& net_;
    cudaStream_t stream_;
    bool ended_ = false;
};

}  // namespace

// Per chunk c of every shard: the comm stream gathers chunk c of the column's N shards (this rank's own and, by
// ncclSend/ncclRecv, the other nodes'), packed by node; the compute stream waits for it, all-gathers the packed chunks
// over the node's L members (weft), and unpacks the L x N chunks into their team ranks' output slots.
void hierarchical_all_gather(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream) {
    WEFT_NVTX_RANGE("all_gather.hierarchical");
    check_user_buffers(team, "all_gather", input, output, stream);
    net::HostBackend& net = backend(team, stream, "all_gather");
    const int num_nodes = net.num_nodes(), per_node = net.ranks_per_node(), me = net.node_index();
    const auto shard = static_cast<uint64_t>(input.size_bytes());
    const auto* in = static_cast<const uint8_t*>(input.data);
    auto* out = static_cast<uint8_t*>(output.data);
    const std::vector<net::Chunk> chunks = net::plan_chunks(shard, 1, 1, net::chunk_bytes_from_env());
    const auto n = static_cast<uint64_t>(num_nodes), l = static_cast<uint64_t>(per_node);
    Scratch column(n * shard, stream);        // chunk c at n * begin: [node][len]
    Scratch gathered(l * n * shard, stream);  // chunk c at l * n * begin: [local][node][len]
    NetCall call(net, stream);
    for (size_t c = 0; c < chunks.size(); ++c) {
        const uint64_t begin = chunks[c].begin, len = chunks[c].count;
        uint8_t* packed = column.get() + n * begin;
        copy(packed + static_cast<uint64_t>(me) * len, in + begin, len, net.comm_stream());
        net.exchange(in + begin, len, [&](int node) { return packed + static_cast<uint64_t>(node) * len; });
        net.comm_mark_arrived(static_cast<int>(c));
    }
    for (size_t c = 0; c < chunks.size(); ++c) {
        const uint64_t begin = chunks[c].begin, len = chunks[c].count;
        uint8_t* packed = column.get() + n * begin;
        uint8_t* all = gathered.get() + l * n * begin;
        net.wait_arrived(stream, static_cast<int>(c));
        node_all_gather(net.node_team(), bytes_view(packed, n * len), bytes_view(all, l * n * len), stream);
        for (int i = 0; i < per_node; ++i) {
            for (int m = 0; m < num_nodes; ++m) {
                const auto t = static_cast<uint64_t>(net.team_rank_at(m, i));
                copy(out + t * shard + begin, all + (static_cast<uint64_t>(i) * n + static_cast<uint64_t>(m)) * len,
                     len, stream);
            }
        }
    }
    call.end();
}

// Per chunk c of every block: the compute stream packs the L x N blocks' chunks by (local index, node), reduce-scatters
// them over the node's members (weft: local index i keeps the node's sum of the chunks of t(m, i), for every node m)
// and raises ready(c); the comm stream reduce-scatters those N chunks across the column (ncclReduceScatter: node m
// gets t(m, i)'s chunk summed over every node) straight into the output.
void hierarchical_reduce_scatter(const Team& team, const TensorView& input, const TensorView& output,
                                 cudaStream_t stream) {
    WEFT_NVTX_RANGE("reduce_scatter.hierarchical");
    check_user_buffers(team, "reduce_scatter", input, output, stream);
    net::HostBackend& net = backend(team, stream, "reduce_scatter");
    const int num_nodes = net.num_nodes(), per_node = net.ranks_per_node();
    const DType dtype = output.dtype;
    const auto es = static_cast<uint64_t>(dtype_bytes(dtype));
    const auto block = static_cast<uint64_t>(output.numel());
    const auto* in = static_cast<const uint8_t*>(input.data);
    auto* out = static_cast<uint8_t*>(output.data);
    const std::vector<net::Chunk> chunks = net::plan_chunks(block, es, 1, net::chunk_bytes_from_env());
    const auto n = static_cast<uint64_t>(num_nodes), l = static_cast<uint64_t>(per_node);
    Scratch packed(l * n * block * es, stream);  // chunk c at l * n * begin: [local][node][len]
    Scratch node_sum(n * block * es, stream);    // chunk c at n * begin: [node][len]
    NetCall call(net, stream);
    for (size_t c = 0; c < chunks.size(); ++c) {
        const uint64_t begin = chunks[c].begin, len = chunks[c].count;
        uint8_t* p = packed.get() + l * n * begin * es;
        for (int i = 0; i < per_node; ++i) {
            for (int m = 0; m < num_nodes; ++m) {
                const auto t = static_cast<uint64_t>(net.team_rank_at(m, i));
                copy(p + (static_cast<uint64_t>(i) * n + static_cast<uint64_t>(m)) * len * es,
                     in + (t * block + begin) * es, len * es, stream);
            }
        }
        reduce_scatter(net.node_team(), elems_view(p, dtype, l * n * len),
                       elems_view(node_sum.get() + n * begin * es, dtype, n * len), stream);
        net.mark_ready(stream, static_cast<int>(c));
    }
    for (size_t c = 0; c < chunks.size(); ++c) {
        const uint64_t begin = chunks[c].begin, len = chunks[c].count;
        net.comm_wait_ready(static_cast<int>(c));
        net.reduce_scatter(node_sum.get() + n * begin * es, out + begin * es, len, dtype);
    }
    call.end();
}

// Per chunk c (a multiple of L elements but the last, which is zero-padded to one): reduce-scatter over the node's
// members (weft), all-reduce of this member's 1/L slice across the column (ncclAllReduce), all-gather over the node's
// members (weft). Enqueued so that chunk c's network step runs while the node reduces chunk c + 1 and gathers c - 1.
void hierarchical_all_reduce(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream) {
    WEFT_NVTX_RANGE("all_reduce.hierarchical");
    check_user_buffers(team, "all_reduce", input, output, stream);
    net::HostBackend& net = backend(team, stream, "all_reduce");
    const DType dtype = output.dtype;
    const auto es = static_cast<uint64_t>(dtype_bytes(dtype));
    const auto count = static_cast<uint64_t>(output.numel());
    const auto l = static_cast<uint64_t>(net.ranks_per_node());
    const auto* in = static_cast<const uint8_t*>(input.data);
    auto* out = static_cast<uint8_t*>(output.data);
    const std::vector<net::Chunk> chunks = net::plan_chunks(count, es, l, net::chunk_bytes_from_env());
    const auto padded = [&](const net::Chunk& ch) { return (ch.count + l - 1) / l * l; };
    const uint64_t total = chunks.empty() ? 0 : chunks.back().begin + padded(chunks.back());
    Scratch staged(total * es, stream);      // chunk c at begin: its elements, zero-padded
    Scratch slices(total / l * es, stream);  // chunk c at begin / l: this member's slice
    Scratch gathered(total * es, stream);    // chunk c at begin
    NetCall call(net, stream);
    const auto gather = [&](size_t c) {
        const uint64_t begin = chunks[c].begin, p = padded(chunks[c]);
        net.wait_arrived(stream, static_cast<int>(c));
        node_all_gather(net.node_team(), elems_view(slices.get() + begin / l * es, dtype, p / l),
                        elems_view(gathered.get() + begin * es, dtype, p), stream);
        copy(out + begin * es, gathered.get() + begin * es, chunks[c].count * es, stream);
    };
    for (size_t c = 0; c < chunks.size(); ++c) {
        const uint64_t begin = chunks[c].begin, len = chunks[c].count, p = padded(chunks[c]);
        uint8_t* s = staged.get() + begin * es;
        copy(s, in + begin * es, len * es, stream);
        if (p > len) WEFT_CUDA_CHECK(cudaMemsetAsync(s + len * es, 0, (p - len) * es, stream));
        reduce_scatter(net.node_team(), elems_view(s, dtype, p),
                       elems_view(slices.get() + begin / l * es, dtype, p / l), stream);
        net.mark_ready(stream, static_cast<int>(c));
        net.comm_wait_ready(static_cast<int>(c));
        net.all_reduce(slices.get() + begin / l * es, p / l, dtype);
        net.comm_mark_arrived(static_cast<int>(c));
        if (c > 0) gather(c - 1);
    }
    if (!chunks.empty()) gather(chunks.size() - 1);
    call.end();
}

// Team ranks t(n, l); a rank's input and output hold one piece per team rank, back to back in team-rank order. Node
// stages (compute stream, in the network's order): for destination node m = n - k, weft's all_to_all(_v) over the
// node's members of the pieces for t(m, 0 .. L-1) leaves this member the node's pieces for t(m, local), which the comm
// stream sends to t(m, local) once ready(k) is raised, in chunks of WEFT_NET_CHUNK_BYTES, receiving node n + k's pieces
// for this rank (arrived(k)). This node's own stage (m = n) runs last, while the network moves the others. With
// node-major team ranks the stages read the input and the receives write the output in place; otherwise pieces are
// packed and unpacked around them (net::layout_a2a_internode). One member per node: the network sends straight from
// the input. Uneven splits first gather the node members' send and receive counts (a bounded exchange through the
// World's store): a stage's receive counts are what the node's members send to this rank's column member on node m,
// and every member checks every pair of the node.
void hierarchical_all_to_all(const Team& team, const TensorView& input, std::span<const int64_t> send_counts,
                             const TensorView& output, std::span<const int64_t> recv_counts, bool equal,
                             cudaStream_t stream) {
    WEFT_NVTX_RANGE(equal ? "all_to_all.hierarchical" : "all_to_all_v.hierarchical");
    const char* op = equal ? "all_to_all" : "all_to_all_v";
    check_user_buffers(team, op, input, output, stream);
    const auto w = static_cast<size_t>(team.num_ranks());
    const auto es = static_cast<uint64_t>(dtype_bytes(input.dtype));
    const uint64_t block = equal ? static_cast<uint64_t>(input.size_bytes()) / w : 0;
    if (equal && block == 0) return;  // nothing to move on any rank (the count is the same everywhere)
    net::HostBackend& net = backend(team, stream, op);
    std::vector<std::vector<int>> by_node(static_cast<size_t>(net.num_nodes()));
    for (int n = 0; n < net.num_nodes(); ++n) {
        for (int l = 0; l < net.ranks_per_node(); ++l)
            by_node[static_cast<size_t>(n)].push_back(net.team_rank_at(n, l));
    }
    const net::A2aInterNodePlan plan = net::plan_a2a_internode(by_node, team.rank());
    WEFT_CHECK(plan.num_nodes - 1 <= net::kMaxChunks, op << ": a team across up to " << net::kMaxChunks + 1
                                                         << " nodes, got " << plan.num_nodes << " (" << team.describe()
                                                         << ")");
    const auto per_node = static_cast<size_t>(plan.per_node);
    std::vector<uint64_t> send_bytes(w, block), recv_bytes(w, block);
    std::vector<std::vector<uint64_t>> node_send_bytes(per_node, std::vector<uint64_t>(w, block));
    if (!equal) {
        for (size_t q = 0; q < w; ++q) {
            send_bytes[q] = static_cast<uint64_t>(send_counts[q]) * es;
            recv_bytes[q] = static_cast<uint64_t>(recv_counts[q]) * es;
        }
        // Every member's send and receive counts over the whole team (one exchange), so that every member checks
        // every pair, across nodes too (NCCL would get sends and receives of different sizes), and all of them
        // refuse together with the same message.
        std::vector<uint8_t> mine(2 * w * sizeof(uint64_t));
        std::memcpy(mine.data(), send_bytes.data(), w * sizeof(uint64_t));
        std::memcpy(mine.data() + w * sizeof(uint64_t), recv_bytes.data(), w * sizeof(uint64_t));
        const std::vector<std::vector<uint8_t>> rows = team.all_gather("weft.ops.all_to_all_v.counts", mine);
        std::vector<std::vector<uint64_t>> all_send(w, std::vector<uint64_t>(w, 0));
        std::vector<std::vector<uint64_t>> all_recv(w, std::vector<uint64_t>(w, 0));
        for (size_t r = 0; r < w; ++r) {
            WEFT_CHECK(rows[r].size() == 2 * w * sizeof(uint64_t),
                       op << ": team rank " << r << " sent " << rows[r].size() << " bytes of counts, expected "
                          << 2 * w * sizeof(uint64_t) << " (" << team.describe() << ")");
            std::memcpy(all_send[r].data(), rows[r].data(), w * sizeof(uint64_t));
            std::memcpy(all_recv[r].data(), rows[r].data() + w * sizeof(uint64_t), w * sizeof(uint64_t));
        }
        std::vector<int> node_of(w, 0);
        for (size_t n = 0; n < by_node.size(); ++n) {
            for (int r : by_node[n]) node_of[static_cast<size_t>(r)] = static_cast<int>(n);
        }
        for (size_t from = 0; from < w; ++from) {
            for (size_t to = 0; to < w; ++to) {
                WEFT_CHECK(all_send[from][to] == all_recv[to][from],
                           op << ": team rank " << from << " (node " << node_of[from] << ") sends "
                              << all_send[from][to] / es << " elements to team rank " << to << " (node " << node_of[to]
                              << "), whose recv_counts[" << from << "] is " << all_recv[to][from] / es
                              << " (checked on every member)");
            }
        }
        const std::vector<int>& members = by_node[static_cast<size_t>(plan.node)];
        for (size_t l = 0; l < per_node; ++l) node_send_bytes[l] = all_send[static_cast<size_t>(members[l])];
    }
    const net::A2aByteLayout layout = net::layout_a2a_internode(plan, send_bytes, recv_bytes, node_send_bytes);
    const auto* in = static_cast<const uint8_t*>(input.data);
    auto* out = static_cast<uint8_t*>(output.data);
    const bool direct = plan.per_node == 1;
    Scratch packed(layout.packed_bytes, stream);
    Scratch sent(layout.sent_bytes, stream);
    Scratch received(layout.received_bytes, stream);
    Scratch own_out(layout.own_bytes, stream);
    const auto run_stage = [&](const net::A2aNodeStage& s, const net::A2aByteLayout::Stage& b, uint8_t* dst) {
        const uint8_t* src = in + b.input_offset;
        if (!s.send_contiguous) {
            uint64_t at = b.input_offset;
            for (const net::A2aSpan& piece : b.pack) {
                copy(packed.get() + at, in + piece.offset, piece.bytes, stream);
                at += piece.bytes;
            }
            src = packed.get() + b.input_offset;
        }
        uint64_t in_total = 0, out_total = 0;
        std::vector<int64_t> sc, rc;  // byte counts (the stage moves bytes)
        for (uint64_t x : b.send_bytes) {
            in_total += x;
            sc.push_back(static_cast<int64_t>(x));
        }
        for (uint64_t x : b.recv_bytes) {
            out_total += x;
            rc.push_back(static_cast<int64_t>(x));
        }
        auto* from = const_cast<uint8_t*>(src);
        // A stage that refuses on this rank only (its packed input does not fit the staging region, which only this
        // rank's counts decide) would leave the others in their stages and network steps: abort the World, so that
        // they stop at their next heartbeat.
        try {
            if (equal) {
                all_to_all(net.node_team(), bytes_view(from, in_total), bytes_view(dst, out_total), stream);
            } else {
                all_to_all_v(net.node_team(), bytes_view(from, in_total), sc, bytes_view(dst, out_total), rc, stream);
            }
        } catch (const Error& e) {
            std::string why =
                std::string(op) + ": a node stage failed on team rank " + std::to_string(team.rank()) + ": " + e.what();
            if (!s.send_contiguous) {
                why +=
                    " (this team's ranks are not node-major, so the stage packs its input into weft's own "
                    "scratch: raise WEFT_COLLECTIVE_STAGING_BYTES, or order the team's ranks node by node)";
            }
            abort_and_fail(team, why);
        }
    };
    NetCall call(net, stream);
    // 1. The node stages for the other nodes, each raising ready(k) for its network step.
    if (!direct) {
        for (size_t i = 0; i + 1 < plan.node_stages.size(); ++i) {
            const net::A2aNodeStage& s = plan.node_stages[i];
            run_stage(s, layout.stages[i], sent.get() + layout.stages[i].output_offset);
            net.mark_ready(stream, s.distance - 1);
        }
    }
    // 2. The network steps on the comm stream (their ready words' writers are enqueued above), chunk by chunk.
    const uint64_t chunk = net::chunk_bytes_from_env();
    for (size_t i = 0; i < plan.net_steps.size(); ++i) {
        const net::A2aNetStep& s = plan.net_steps[i];
        const net::A2aByteLayout::Step& b = layout.steps[i];
        const uint8_t* src = direct ? in + b.send_offset : sent.get() + b.send_offset;
        uint8_t* dst = s.recv_contiguous ? out + b.recv_offset : received.get() + b.recv_offset;
        if (!direct) net.comm_wait_ready(s.distance - 1);
        // Piece p of each direction in one group: the sender and its receiver cut the same bytes the same way.
        const std::vector<net::Chunk> sends = net::plan_chunks(b.send_bytes, 1, 1, chunk);
        const std::vector<net::Chunk> recvs = net::plan_chunks(b.recv_bytes, 1, 1, chunk);
        for (size_t p = 0; p < std::max(sends.size(), recvs.size()); ++p) {
            const net::Chunk sc = p < sends.size() ? sends[p] : net::Chunk{};
            const net::Chunk rc = p < recvs.size() ? recvs[p] : net::Chunk{};
            net.send_recv(src + sc.begin, sc.count, s.to_node, dst + rc.begin, rc.count, s.from_node);
        }
        net.comm_mark_arrived(s.distance - 1);
    }
    // 3. This node's own stage, while the network runs.
    const net::A2aNodeStage& own = plan.node_stages.back();
    const net::A2aByteLayout::Stage& own_b = layout.stages.back();
    uint8_t* own_dst = own.recv_contiguous ? out + own_b.output_offset : own_out.get();
    if (direct) {
        copy(own_dst, in + own_b.input_offset, own_b.send_bytes[0], stream);
    } else {
        run_stage(own, own_b, own_dst);
    }
    uint64_t at = 0;
    for (const net::A2aSpan& piece : own_b.unpack) {
        copy(out + piece.offset, own_out.get() + at, piece.bytes, stream);
        at += piece.bytes;
    }
    // 4. The received pieces into their output slots (in place when they are consecutive).
    for (size_t i = 0; i < plan.net_steps.size(); ++i) {
        const net::A2aByteLayout::Step& b = layout.steps[i];
        if (b.unpack.empty()) continue;
        net.wait_arrived(stream, plan.net_steps[i].distance - 1);
        uint64_t from = b.recv_offset;
        for (const net::A2aSpan& piece : b.unpack) {
            copy(out + piece.offset, received.get() + from, piece.bytes, stream);
            from += piece.bytes;
        }
    }
    call.end();
}

}  // namespace weft::ops::detail
