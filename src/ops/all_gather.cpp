// SPDX-License-Identifier: MIT
// weft::ops::all_gather: argument checks, algorithm choice, and the SM and copy-engine schedules.
#include "weft/ops/all_gather.hpp"

#include <algorithm>
#include <vector>

#include "collective_workspace.hpp"
#include "hierarchical.hpp"
#include "weft/detail/collectives.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/stream.hpp"
#include "weft/runtime/trace.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {

namespace {

using detail::CollectiveWorkspace;
using detail::KernelId;

// Copy-engine all-gather of shard bytes [begin, begin + len) (one round). Pull: each peer's shard is copied from
// `source(q)` (an address mapped here) on a side stream, then a stream write tells q that this rank is done reading it.
// Push: this rank's shard is copied into every peer's output slot, then a stream write tells the peer it has arrived.
// Both: an entry kernel first (every rank ready), the exit kernel last (every peer's flag seen and consumed).
//
// The copies and flag writes go to side streams (copy engines in parallel) when every rank has a GPU of its own. When
// ranks share a GPU (ranks as processes: those of one process take the pull kernel, below) the workspace has no side
// stream and everything is issued on `stream`, in order: the bytes
// cross one HBM either way, and a call then adds no stream to the GPU's hardware queues and, captured, is a single
// chain of graph nodes. A branched capture of many calls lets CUDA spread each rank's graph over internal streams
// that the ranks' graphs (one context) may share: a rank's copies for call k could then wait in an in-order queue
// behind another rank's branch for call k + 1, whose entry barrier waits for the first rank to leave call k, i.e.
// for those very copies (docs/runtime.md, "Hardware queues").
// A World that traces (WEFT_TRACE) times each copy with CUDA events: "copy chunk q" (the output slot written) on the
// track of its stream (copy engine i: side stream i, or 0 for `stream`).
// Where ranks of this process share this rank's GPU (ws.copies_with_kernel(); members on other GPUs too) the one-CTA
// pull kernel moves the bytes instead, which also sets the peers' flags: the copies and stream writes would otherwise
// sit behind the spinning entry kernel on `stream`, and in a hardware queue that ranks' streams share (they outnumber
// the queues at 8 ranks with a few ops each) a peer's work queued behind them could not run until the entry gave up
// (detail::copy_engine_copies_with_kernel). The pull kernel records "copy chunk q" itself when traced.
template <class Source>
void copy_engine_round(CollectiveWorkspace& ws, AllGatherAlgo algo, const uint8_t* in, uint8_t* out,
                       const Source& source, uint64_t shard, uint64_t begin, uint64_t len, uint64_t descriptor,
                       cudaStream_t stream) {
    const int n = ws.num_ranks();
    const int me = ws.rank();
    CollectiveParams p = ws.params();
    p.count = len;
    p.descriptor = descriptor;
    if (ws.copies_with_kernel()) {
        // Set up before the entry kernel: nothing that can throw sits between a rank's launches.
        const bool pull = algo == AllGatherAlgo::kCopyEnginePull;
        std::vector<const uint8_t*> from(static_cast<size_t>(n), nullptr);
        std::vector<uint8_t*> to(static_cast<size_t>(n), nullptr);
        std::vector<uint64_t*> flags(static_cast<size_t>(n), nullptr);
        for (int q = 0; q < n; ++q) {
            if (q == me) continue;
            const auto qi = static_cast<size_t>(q);
            if (pull) {
                from[qi] = source(q);
            } else {
                to[qi] = static_cast<uint8_t*>(ws.peer_pointer(out, q)) + static_cast<uint64_t>(me) * shard + begin;
            }
            flags[qi] = ws.copy_engine_flag_on(q);
        }
        const std::vector<PeerPullItem> items =
            detail::copy_engine_kernel_items(pull, n, me, in, out, shard, begin, len, from, to, flags);
        ws.launch(KernelId::kCopyEngineEnter, DType::kU8, 1, stream, p);
        ws.launch_pulls(items, stream);
        ws.launch(KernelId::kCopyEngineExit, DType::kU8, 1, stream, p);
        return;
    }
    ws.launch(KernelId::kCopyEngineEnter, DType::kU8, 1, stream, p);
    const int sides = std::min(ws.num_side_streams(), n - 1);
    if (sides > 0) ws.fork(stream, sides);
    for (int k = 1; k < n; ++k) {
        const int q = (me + k) % n;
        const int side = sides > 0 ? (k - 1) % sides : 0;
        cudaStream_t s = sides > 0 ? ws.side_stream(side) : stream;
        const bool pull = algo == AllGatherAlgo::kCopyEnginePull;
        const TraceCopyEvents ev = trace_copy_events(ws.world(), static_cast<uint16_t>(side), pull ? q : me, q);
        if (ev.begin != nullptr) WEFT_CUDA_CHECK(cudaEventRecord(ev.begin, s));
        if (pull) {
            const uint8_t* from = source(q);
            WEFT_CUDA_CHECK(cudaMemcpyAsync(out + static_cast<uint64_t>(q) * shard + begin, from, len,
                                            cudaMemcpyDeviceToDevice, s));
        } else {
            auto* to = static_cast<uint8_t*>(ws.peer_pointer(out, q)) + static_cast<uint64_t>(me) * shard + begin;
            WEFT_CUDA_CHECK(cudaMemcpyAsync(to, in + begin, len, cudaMemcpyDeviceToDevice, s));
        }
        if (ev.end != nullptr) WEFT_CUDA_CHECK(cudaEventRecord(ev.end, s));
        stream_write_u64(s, ws.copy_engine_flag_on(q), 1);
    }
    uint8_t* own = out + static_cast<uint64_t>(me) * shard + begin;
    if (own != in + begin) {
        WEFT_CUDA_CHECK(cudaMemcpyAsync(own, in + begin, len, cudaMemcpyDeviceToDevice, stream));
    }
    if (sides > 0) ws.join(stream, sides);
    ws.launch(KernelId::kCopyEngineExit, DType::kU8, 1, stream, p);
}

}  // namespace

void all_gather(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream,
                const AllGatherOptions& options) {
    WEFT_NVTX_RANGE("all_gather");
    team.require_member("all_gather");
    const uint64_t call = detail::next_collective_call(team);  // counts a refused call too
    const int n = team.num_ranks();
    const int me = team.rank();
    detail::check_all_gather_args(input, output, n, me);
    detail::check_algo_option(options.algo);
    const auto shard = static_cast<uint64_t>(input.size_bytes());
    const uint64_t total = shard * static_cast<uint64_t>(n);
    if (shard == 0) return;
    const auto* in = static_cast<const uint8_t*>(input.data);
    auto* out = static_cast<uint8_t*>(output.data);
    if (n == 1) {
        // A copy, but the same buffers as at any world size: this GPU's memory.
        detail::check_device_buffers(team.world().heap(), {{"input", input}, {"output", output}}, "all_gather", stream);
        if (in != out) WEFT_CUDA_CHECK(cudaMemcpyAsync(out, in, shard, cudaMemcpyDeviceToDevice, stream));
        return;
    }
    const auto env_algo = env::get("WEFT_ALLGATHER_ALGO");
    if (select_hierarchical("all_gather", team.num_nodes(),
                            options.algo != AllGatherAlgo::kAuto ? algo_name(options.algo) : env_algo.value_or(""))) {
        detail::hierarchical_all_gather(team, input, output, stream);
        return;
    }
    CollectiveWorkspace& ws = CollectiveWorkspace::get(team, stream, "all_gather");
    const CollectiveTopology& topo = ws.topology();
    const bool in_sym = ws.symmetric(in, shard);
    const bool out_sym = ws.symmetric(out, total);
    const AllGatherAlgo algo =
        resolve_all_gather_algo(options.algo, env::get("WEFT_ALLGATHER_ALGO"), shard, topo, out_sym);
    detail::check_all_gather_output(algo, out_sym);
    if (!in_sym) detail::check_device_pointer(in, "input", "all_gather", stream);
    if (!out_sym) detail::check_device_pointer(out, "output", "all_gather", stream);
    const uint64_t out_offset = ws.offset_or_none(out);
    const auto kind = CollectiveOp::kAllGather;
    const auto a = static_cast<uint32_t>(algo);

    switch (algo) {
        case AllGatherAlgo::kLowLatency: {
            const uint64_t round = detail::round_units(topo.low_latency_capacity_bytes, 1, kCollectiveGranuleBytes);
            for (uint64_t begin = 0; begin < shard; begin += round) {
                const uint64_t len = std::min(round, shard - begin);
                CollectiveParams p = ws.params();
                p.in = in + begin;
                p.out = out + begin;
                p.count = len;
                p.out_stride = shard;
                p.descriptor = detail::call_descriptor_bytes(kind, a, shard, {call, begin, len});
                ws.launch(KernelId::kAllGatherLowLatency, DType::kU8, all_gather_grid(algo, len, topo), stream, p);
            }
            return;
        }
        case AllGatherAlgo::kSmPush: {
            CollectiveParams p = ws.params();
            p.in = in;
            p.out = out;
            p.count = shard;
            p.out_stride = shard;
            p.descriptor = detail::call_descriptor_bytes(kind, a, shard, {call, out_offset});
            ws.launch(KernelId::kAllGatherPush, DType::kU8, all_gather_grid(algo, shard, topo), stream, p);
            return;
        }
        case AllGatherAlgo::kCopyEnginePull: {
            const bool inplace = in == out + static_cast<uint64_t>(me) * shard;
            if (inplace && out_sym) {  // every rank's shard sits in its own slot of its (symmetric) output
                const auto source = [&](int q) {
                    return static_cast<const uint8_t*>(ws.peer_pointer(out, q)) + static_cast<uint64_t>(q) * shard;
                };
                copy_engine_round(ws, algo, in, out, source, shard, 0, shard,
                                  detail::call_descriptor_bytes(kind, a, shard, {call, 2, out_offset}), stream);
                return;
            }
            if (in_sym) {  // peers copy straight from the input (the same symmetric allocation on every rank)
                const auto source = [&](int q) { return static_cast<const uint8_t*>(ws.peer_pointer(in, q)); };
                copy_engine_round(ws, algo, in, out, source, shard, 0, shard,
                                  detail::call_descriptor_bytes(kind, a, shard, {call, 0, ws.offset_or_none(in)}),
                                  stream);
                return;
            }
            // Staged through the copy-engine region, in rounds of its size.
            const uint64_t round = detail::round_units(ws.info().staging_region_bytes, 1, kCollectiveGranuleBytes);
            uint8_t* region = ws.copy_engine_region();
            for (uint64_t begin = 0; begin < shard; begin += round) {
                const uint64_t len = std::min(round, shard - begin);
                if (ws.copies_with_kernel()) {  // behind the previous round's spinning exit kernel: no queued copy
                    PeerPullItem stage{};
                    stage.dst = region;
                    stage.src = in + begin;
                    stage.bytes = len;
                    stage.peer = me;
                    stage.chunk = -1;
                    ws.launch_pulls({stage}, stream);
                } else {
                    WEFT_CUDA_CHECK(cudaMemcpyAsync(region, in + begin, len, cudaMemcpyDeviceToDevice, stream));
                }
                const auto source = [&](int q) { return static_cast<const uint8_t*>(ws.peer_pointer(region, q)); };
                copy_engine_round(ws, algo, in, out, source, shard, begin, len,
                                  detail::call_descriptor_bytes(kind, a, shard, {call, 1, begin, len}), stream);
            }
            return;
        }
        case AllGatherAlgo::kCopyEnginePush:
            copy_engine_round(
                ws, algo, in, out, [](int) { return static_cast<const uint8_t*>(nullptr); }, shard, 0, shard,
                detail::call_descriptor_bytes(kind, a, shard, {call, out_offset}), stream);
            return;
        case AllGatherAlgo::kAuto:
            break;
    }
    WEFT_FAIL("all_gather: the algorithm was not resolved");
}

void all_gather(World& world, const TensorView& input, const TensorView& output, cudaStream_t stream,
                const AllGatherOptions& options) {
    all_gather(world.team(), input, output, stream, options);
}

}  // namespace weft::ops
