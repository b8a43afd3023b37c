// SPDX-License-Identifier: MIT
// weft::ops::reduce_scatter: argument checks, algorithm choice, rounds, and the kernel launches.
#include "weft/ops/reduce_scatter.hpp"

#include <algorithm>

#include "collective_workspace.hpp"
#include "hierarchical.hpp"
#include "weft/detail/collectives.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {

void reduce_scatter(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream,
                    const ReduceScatterOptions& options) {
    WEFT_NVTX_RANGE("reduce_scatter");
    team.require_member("reduce_scatter");
    const uint64_t call = detail::next_collective_call(team);  // counts a refused call too
    const int n = team.num_ranks();
    const int me = team.rank();
    detail::check_reduce_scatter_args(input, output, n, me);
    detail::check_algo_option(options.algo);
    const auto count = static_cast<uint64_t>(output.numel());
    const auto elem = static_cast<uint64_t>(dtype_bytes(output.dtype));
    const uint64_t bytes = count * elem;
    if (count == 0) return;
    const auto* in = static_cast<const uint8_t*>(input.data);
    auto* out = static_cast<uint8_t*>(output.data);
    if (n == 1) {
        // A copy, but the same buffers as at any world size: this GPU's memory.
        detail::check_device_buffers(team.world().heap(), {{"input", input}, {"output", output}}, "reduce_scatter",
                                     stream);
        if (in != out) WEFT_CUDA_CHECK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream));
        return;
    }
    const auto env_algo = env::get("WEFT_REDUCESCATTER_ALGO");
    if (select_hierarchical("reduce_scatter", team.num_nodes(),
                            options.algo != ReduceScatterAlgo::kAuto ? algo_name(options.algo)
                                                                     : env_algo.value_or(""))) {
        detail::hierarchical_reduce_scatter(team, input, output, stream);
        return;
    }
    detail::CollectiveWorkspace& ws = detail::CollectiveWorkspace::get(team, stream, "reduce_scatter");
    const CollectiveTopology& topo = ws.topology();
    const ReduceScatterAlgo algo =
        resolve_reduce_scatter_algo(options.algo, env::get("WEFT_REDUCESCATTER_ALGO"), bytes, topo);
    WEFT_CHECK(algo == ReduceScatterAlgo::kSmPull || algo == ReduceScatterAlgo::kLowLatency,
               "reduce_scatter: unknown algorithm " << static_cast<int>(algo));
    const bool in_sym = ws.symmetric(in, bytes * static_cast<uint64_t>(n));
    if (!in_sym) detail::check_device_pointer(in, "input", "reduce_scatter", stream);
    if (!ws.symmetric(out, bytes) && !(in_sym && out == in + static_cast<uint64_t>(me) * bytes)) {
        detail::check_device_pointer(out, "output", "reduce_scatter", stream);
    }
    const uint64_t granule = kCollectiveGranuleBytes / elem;
    if (algo == ReduceScatterAlgo::kLowLatency) {
        // Every rank pushes its slices as LL lines: no staging, no symmetric buffer needed. Rounds of at most the
        // LL capacity of output (whole granules, so every round but the last keeps 16-byte alignment); each round
        // is a kernel of its own epoch.
        const uint64_t round = detail::round_units(topo.low_latency_capacity_bytes, elem, granule);
        for (uint64_t begin = 0; begin < count; begin += round) {
            const uint64_t len = std::min(round, count - begin);
            CollectiveParams p = ws.params();
            p.in = in + begin * elem;
            p.out = out + begin * elem;
            p.count = len;
            p.in_stride = count;
            p.descriptor = detail::call_descriptor(CollectiveOp::kReduceScatter, static_cast<uint32_t>(algo),
                                                   output.dtype, count, {call, begin, len});
            ws.launch(detail::KernelId::kReduceScatterLowLatency, output.dtype,
                      reduce_scatter_grid(algo, len * elem, topo), stream, p);
        }
        return;
    }
    // Direct: peers read the symmetric input in place (then they read a user buffer: exit barrier). Staged: every
    // round copies its part of each slice into epoch-alternated staging, slice q at q x (the round rounded up to
    // 16 bytes). Rounds are whole granules, so n slices of a round always fit the staging half.
    const uint64_t round =
        in_sym ? count : detail::round_units(ws.info().staging_region_bytes, elem * static_cast<uint64_t>(n), granule);
    const uint64_t in_offset = in_sym ? ws.offset_or_none(in) : ~0ull;
    for (uint64_t begin = 0; begin < count; begin += round) {
        const uint64_t len = std::min(round, count - begin);
        CollectiveParams p = ws.params();
        p.in = in + begin * elem;
        p.out = out + begin * elem;
        p.count = len;
        p.in_stride = count;
        p.src = in_sym ? const_cast<uint8_t*>(in) + begin * elem : nullptr;
        p.src_stride = in_sym ? count : (len + granule - 1) / granule * granule;  // staged slices stay 16-byte aligned
        p.flags = in_sym ? kCollectiveExitBarrier : kCollectiveStageInput;
        p.descriptor =
            detail::call_descriptor(CollectiveOp::kReduceScatter, static_cast<uint32_t>(algo), output.dtype, count,
                                    {call, begin, len, p.flags, in_sym ? in_offset + begin * elem : in_offset});
        ws.launch(detail::KernelId::kReduceScatterPull, output.dtype, reduce_scatter_grid(algo, len * elem, topo),
                  stream, p);
    }
}

void reduce_scatter(World& world, const TensorView& input, const TensorView& output, cudaStream_t stream,
                    const ReduceScatterOptions& options) {
    reduce_scatter(world.team(), input, output, stream, options);
}

}  // namespace weft::ops
