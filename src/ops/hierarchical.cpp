// SPDX-License-Identifier: MIT
// Hierarchical collectives: weft's intra-node collectives over each node's members, NCCL across nodes on the network
// backend's comm stream, pipelined in chunks (docs/multinode.md). Team ranks map to (node, local index) through the
// backend; node n's member with local index l is t(n, l).
#include "hierarchical.hpp"

#include <cstdlib>

#include "weft/net/all_to_all_plan.hpp"
#include "weft/net/chunk_schedule.hpp"
#include "weft/net/host_backend.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/nvtx.hpp"

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

uint64_t chunk_bytes() { return net::resolve_chunk_bytes(std::getenv("WEFT_NET_CHUNK_BYTES")); }

// The team's backend, and its node team's collectives ready (kernels loaded) before anything is enqueued: no module
// loads while NCCL's or weft's kernels wait.
net::HostBackend& backend(const Team& team) {
    net::HostBackend& net = net::HostBackend::get(team);
    if (net.node_team().num_ranks() > 1) prepare_collectives(net.node_team());
    return net;
}

}  // namespace

// Per chunk c of every shard: the comm stream gathers chunk c of the column's N shards (this rank's own and, by
// ncclSend/ncclRecv, the other nodes'), packed by node; the compute stream waits for it, all-gathers the packed chunks
// over the node's L members (weft), and unpacks the L x N chunks into their team ranks' output slots.
void hierarchical_all_gather(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream) {
    WEFT_NVTX_RANGE("all_gather.hierarchical");
    net::HostBackend& net = backend(team);
    const int num_nodes = net.num_nodes(), per_node = net.ranks_per_node(), me = net.node_index();
    const auto shard = static_cast<uint64_t>(input.size_bytes());
    const auto* in = static_cast<const uint8_t*>(input.data);
    auto* out = static_cast<uint8_t*>(output.data);
    const std::vector<net::Chunk> chunks = net::plan_chunks(shard, 1, 1, chunk_bytes());
    const auto n = static_cast<uint64_t>(num_nodes), l = static_cast<uint64_t>(per_node);
    Scratch column(n * shard, stream);        // chunk c at n * begin: [node][len]
    Scratch gathered(l * n * shard, stream);  // chunk c at l * n * begin: [local][node][len]
    net.begin_call(stream);
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
        all_gather(net.node_team(), bytes_view(packed, n * len), bytes_view(all, l * n * len), stream);
        for (int i = 0; i < per_node; ++i) {
            for (int m = 0; m < num_nodes; ++m) {
                const auto t = static_cast<uint64_t>(net.team_rank_at(m, i));
                copy(out + t * shard + begin, all + (static_cast<uint64_t>(i) * n + static_cast<uint64_t>(m)) * len,
                     len, stream);
            }
        }
    }
    net.end_call(stream);
}

// Per chunk c of every block: the compute stream packs the L x N blocks' chunks by (local index, node), reduce-scatters
// them over the node's members (weft: local index i keeps the node's sum of the chunks of t(m, i), for every node m)
// and raises ready(c); the comm stream reduce-scatters those N chunks across the column (ncclReduceScatter: node m
// gets t(m, i)'s chunk summed over every node) straight into the output.
void hierarchical_reduce_scatter(const Team& team, const TensorView& input, const TensorView& output,
                                 cudaStream_t stream) {
    WEFT_NVTX_RANGE("reduce_scatter.hierarchical");
    net::HostBackend& net = backend(team);
    const int num_nodes = net.num_nodes(), per_node = net.ranks_per_node();
    const DType dtype = output.dtype;
    const auto es = static_cast<uint64_t>(dtype_bytes(dtype));
    const auto block = static_cast<uint64_t>(output.numel());
    const auto* in = static_cast<const uint8_t*>(input.data);
    auto* out = static_cast<uint8_t*>(output.data);
    const std::vector<net::Chunk> chunks = net::plan_chunks(block, es, 1, chunk_bytes());
    const auto n = static_cast<uint64_t>(num_nodes), l = static_cast<uint64_t>(per_node);
    Scratch packed(l * n * block * es, stream);  // chunk c at l * n * begin: [local][node][len]
    Scratch node_sum(n * block * es, stream);    // chunk c at n * begin: [node][len]
    net.begin_call(stream);
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
    net.end_call(stream);
}

// Per chunk c (a multiple of L elements but the last, which is zero-padded to one): reduce-scatter over the node's
// members (weft), all-reduce of this member's 1/L slice across the column (ncclAllReduce), all-gather over the node's
// members (weft). Enqueued so that chunk c's network step runs while the node reduces chunk c + 1 and gathers c - 1.
void hierarchical_all_reduce(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream) {
    WEFT_NVTX_RANGE("all_reduce.hierarchical");
    net::HostBackend& net = backend(team);
    const DType dtype = output.dtype;
    const auto es = static_cast<uint64_t>(dtype_bytes(dtype));
    const auto count = static_cast<uint64_t>(output.numel());
    const auto l = static_cast<uint64_t>(net.ranks_per_node());
    const auto* in = static_cast<const uint8_t*>(input.data);
    auto* out = static_cast<uint8_t*>(output.data);
    const std::vector<net::Chunk> chunks = net::plan_chunks(count, es, l, chunk_bytes());
    const auto padded = [&](const net::Chunk& ch) { return (ch.count + l - 1) / l * l; };
    const uint64_t total = chunks.empty() ? 0 : chunks.back().begin + padded(chunks.back());
    Scratch staged(total * es, stream);      // chunk c at begin: its elements, zero-padded
    Scratch slices(total / l * es, stream);  // chunk c at begin / l: this member's slice
    Scratch gathered(total * es, stream);    // chunk c at begin
    net.begin_call(stream);
    const auto gather = [&](size_t c) {
        const uint64_t begin = chunks[c].begin, p = padded(chunks[c]);
        net.wait_arrived(stream, static_cast<int>(c));
        all_gather(net.node_team(), elems_view(slices.get() + begin / l * es, dtype, p / l),
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
    net.end_call(stream);
}

// Team ranks t(n, l); every rank's input and output hold one block per team rank. Node stages (compute stream, in the
// network's order): for destination node m = n - k, weft's all_to_all over the node's members of the blocks for
// t(m, 0 .. L-1) leaves this member the node's blocks for t(m, local), which the comm stream sends to t(m, local) once
// ready(k) is raised, in chunks of WEFT_NET_CHUNK_BYTES, receiving node n + k's blocks for this rank (arrived(k)).
// This node's own stage (m = n) runs last, while the network moves the others, and writes the output in place. With
// node-major team ranks every stage reads the input and every receive writes the output in place; otherwise blocks
// are packed and unpacked around them. One member per node: the network sends straight from the input.
void hierarchical_all_to_all(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream) {
    WEFT_NVTX_RANGE("all_to_all.hierarchical");
    const auto block = static_cast<uint64_t>(input.size_bytes()) / static_cast<uint64_t>(team.num_ranks());
    if (block == 0) return;  // nothing to move on any rank (the count is the same everywhere)
    net::HostBackend& net = backend(team);
    std::vector<std::vector<int>> by_node(static_cast<size_t>(net.num_nodes()));
    for (int n = 0; n < net.num_nodes(); ++n) {
        for (int l = 0; l < net.ranks_per_node(); ++l)
            by_node[static_cast<size_t>(n)].push_back(net.team_rank_at(n, l));
    }
    const net::A2aInterNodePlan plan = net::plan_a2a_internode(by_node, team.rank());
    WEFT_CHECK(plan.num_nodes - 1 <= net::kMaxChunks, "all_to_all: a team across up to "
                                                          << net::kMaxChunks + 1 << " nodes, got " << plan.num_nodes
                                                          << " (" << team.describe() << ")");
    const auto* in = static_cast<const uint8_t*>(input.data);
    auto* out = static_cast<uint8_t*>(output.data);
    const auto l = static_cast<uint64_t>(plan.per_node), steps = static_cast<uint64_t>(plan.num_nodes - 1);
    const uint64_t group = l * block;  // one stage's blocks
    const bool direct = plan.per_node == 1;
    bool pack = false, unpack = false;
    for (const auto& s : plan.node_stages) pack = pack || !s.send_contiguous;
    for (const auto& s : plan.net_steps) unpack = unpack || !s.recv_contiguous;
    const net::A2aNodeStage& own = plan.node_stages.back();
    Scratch packed(pack ? (steps + 1) * group : 0, stream);  // stage of distance k at k * group
    Scratch sent(direct ? 0 : steps * group, stream);        // step k's send buffer at (k - 1) * group
    Scratch received(unpack ? steps * group : 0, stream);    // step k's receive buffer at (k - 1) * group
    Scratch own_out(own.recv_contiguous ? 0 : group, stream);
    const auto stage_input = [&](const net::A2aNodeStage& s) -> const uint8_t* {
        if (s.send_contiguous) return in + static_cast<uint64_t>(s.send_blocks[0]) * block;
        uint8_t* p = packed.get() + static_cast<uint64_t>(s.distance) * group;
        for (size_t j = 0; j < s.send_blocks.size(); ++j) {
            copy(p + j * block, in + static_cast<uint64_t>(s.send_blocks[j]) * block, block, stream);
        }
        return p;
    };
    net.begin_call(stream);
    // 1. The node stages for the other nodes, each raising ready(k) for its network step.
    if (!direct) {
        for (const auto& s : plan.node_stages) {
            if (s.distance == 0) continue;
            uint8_t* dst = sent.get() + static_cast<uint64_t>(s.distance - 1) * group;
            all_to_all(net.node_team(), bytes_view(const_cast<uint8_t*>(stage_input(s)), group), bytes_view(dst, group),
                       stream);
            net.mark_ready(stream, s.distance - 1);
        }
    }
    // 2. The network steps on the comm stream (their ready words' writers are enqueued above).
    const std::vector<net::Chunk> pieces = net::plan_chunks(group, 1, 1, chunk_bytes());
    for (const auto& st : plan.net_steps) {
        const auto k = static_cast<uint64_t>(st.distance);
        const uint8_t* src = direct ? in + static_cast<uint64_t>(st.to_rank) * block : sent.get() + (k - 1) * group;
        uint8_t* dst = st.recv_contiguous ? out + static_cast<uint64_t>(st.recv_blocks[0]) * block
                                          : received.get() + (k - 1) * group;
        if (!direct) net.comm_wait_ready(st.distance - 1);
        for (const net::Chunk& c : pieces)
            net.send_recv(src + c.begin, c.count, st.to_node, dst + c.begin, st.from_node);
        net.comm_mark_arrived(st.distance - 1);
    }
    // 3. This node's own stage, while the network runs.
    uint8_t* own_dst = own.recv_contiguous ? out + static_cast<uint64_t>(own.recv_blocks[0]) * block : own_out.get();
    if (direct) {
        copy(own_dst, in + static_cast<uint64_t>(own.send_blocks[0]) * block, block, stream);
    } else {
        all_to_all(net.node_team(), bytes_view(const_cast<uint8_t*>(stage_input(own)), group),
                   bytes_view(own_dst, group), stream);
    }
    if (!own.recv_contiguous) {
        for (size_t i = 0; i < own.recv_blocks.size(); ++i) {
            copy(out + static_cast<uint64_t>(own.recv_blocks[i]) * block, own_out.get() + i * block, block, stream);
        }
    }
    // 4. The received blocks into their output slots (in place when they are consecutive).
    for (const auto& st : plan.net_steps) {
        if (st.recv_contiguous) continue;
        const uint8_t* src = received.get() + static_cast<uint64_t>(st.distance - 1) * group;
        net.wait_arrived(stream, st.distance - 1);
        for (size_t i = 0; i < st.recv_blocks.size(); ++i) {
            copy(out + static_cast<uint64_t>(st.recv_blocks[i]) * block, src + i * block, block, stream);
        }
    }
    net.end_call(stream);
}

}  // namespace weft::ops::detail
