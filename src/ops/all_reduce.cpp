// SPDX-License-Identifier: MIT
// weft::ops::all_reduce: argument checks, algorithm choice, rounds, and the kernel launches.
#include "weft/ops/all_reduce.hpp"

#include <algorithm>

#include "collective_workspace.hpp"
#include "hierarchical.hpp"
#include "weft/detail/collectives.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {

namespace {

// `output_private`: output is the caller's wherever it lives (fused ops pass their users' buffers): peers never read
// it, so that whether it is on the symmetric heap, and where, need not agree across ranks.
void all_reduce_impl(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream,
                     const AllReduceOptions& options, bool output_private) {
    team.require_member("all_reduce");
    const uint64_t call = detail::next_collective_call(team);  // counts a refused call too
    detail::check_all_reduce_args(input, output);
    detail::check_algo_option(options.algo);
    const auto count = static_cast<uint64_t>(input.numel());
    const auto elem = static_cast<uint64_t>(dtype_bytes(input.dtype));
    const uint64_t bytes = count * elem;
    if (count == 0) return;
    if (team.num_ranks() == 1) {
        // A copy, but the same buffers as at any world size: this GPU's memory.
        detail::check_device_buffers(team.world().heap(), {{"input", input}, {"output", output}}, "all_reduce", stream);
        if (input.data != output.data) {
            WEFT_CUDA_CHECK(cudaMemcpyAsync(output.data, input.data, bytes, cudaMemcpyDeviceToDevice, stream));
        }
        return;
    }
    const auto env_algo = env::get("WEFT_ALLREDUCE_ALGO");
    if (select_hierarchical("all_reduce", team.num_nodes(),
                            options.algo != AllReduceAlgo::kAuto ? algo_name(options.algo) : env_algo.value_or(""))) {
        detail::hierarchical_all_reduce(team, input, output, stream);
        return;
    }
    detail::CollectiveWorkspace& ws = detail::CollectiveWorkspace::get(team, stream, "all_reduce");
    const CollectiveTopology& topo = ws.topology();
    const AllReduceAlgo algo = resolve_all_reduce_algo(options.algo, env::get("WEFT_ALLREDUCE_ALGO"), bytes, topo);
    const bool in_sym = ws.symmetric(input.data, bytes);
    const bool out_sym = !output_private && ws.symmetric(output.data, bytes);
    if (!in_sym) detail::check_device_pointer(input.data, "input", "all_reduce", stream);
    if (!out_sym && output.data != input.data)
        detail::check_device_pointer(output.data, "output", "all_reduce", stream);

    const auto* in = static_cast<const uint8_t*>(input.data);
    auto* out = static_cast<uint8_t*>(output.data);
    const uint64_t granule = kCollectiveGranuleBytes / elem;
    CollectiveParams base = ws.params();
    detail::KernelId kernel = detail::KernelId::kAllReduceOneShot;
    uint64_t round = count;  // elements per kernel
    bool direct = false;     // two-shot reads a symmetric input in place (no staging copy)
    bool res_is_user = false;
    switch (algo) {
        case AllReduceAlgo::kLowLatency:
            kernel = detail::KernelId::kAllReduceLowLatency;
            round = detail::round_units(topo.low_latency_capacity_bytes, elem, granule);
            break;
        case AllReduceAlgo::kOneShot:
            // Always staged: peers then read only epoch-alternated staging, so no exit barrier is needed.
            kernel = detail::KernelId::kAllReduceOneShot;
            base.flags = kCollectiveStageInput;
            round = detail::round_units(ws.info().staging_region_bytes, elem, granule);
            break;
        case AllReduceAlgo::kTwoShot:
            kernel = detail::KernelId::kAllReduceTwoShot;
            direct = in_sym;
            if (direct) {
                // Reduced slices go to a user buffer when there is a symmetric one (then peers read it until the
                // exit barrier), else to staging.
                res_is_user = input.data == output.data || out_sym;
                base.flags = res_is_user ? kCollectiveExitBarrier : 0u;
                if (!res_is_user) round = detail::round_units(ws.info().staging_region_bytes, elem, granule);
            } else {
                base.flags = kCollectiveStageInput;
                round = detail::round_units(ws.info().staging_region_bytes, elem, granule);
            }
            break;
        case AllReduceAlgo::kAuto:
            WEFT_FAIL("all_reduce: the algorithm was not resolved");
    }
    const uint64_t in_offset = direct ? ws.offset_or_none(in) : ~0ull;
    const uint64_t res_offset = res_is_user ? ws.offset_or_none(input.data == output.data ? in : out) : ~0ull;
    for (uint64_t begin = 0; begin < count; begin += round) {
        const uint64_t n = std::min(round, count - begin);
        CollectiveParams p = base;
        p.in = in + begin * elem;
        p.out = out + begin * elem;
        p.src = direct ? const_cast<uint8_t*>(in) + begin * elem : nullptr;
        p.res = res_is_user ? (input.data == output.data ? const_cast<uint8_t*>(in) : out) + begin * elem : nullptr;
        p.count = n;
        p.descriptor =
            detail::call_descriptor(CollectiveOp::kAllReduce, static_cast<uint32_t>(algo), input.dtype, count,
                                    {call, begin, n, p.flags, in_offset == ~0ull ? in_offset : in_offset + begin * elem,
                                     res_offset == ~0ull ? res_offset : res_offset + begin * elem});
        ws.launch(kernel, input.dtype, all_reduce_grid(algo, n * elem, topo), stream, p);
    }
}

}  // namespace

void all_reduce(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream,
                const AllReduceOptions& options) {
    WEFT_NVTX_RANGE("all_reduce");
    all_reduce_impl(team, input, output, stream, options, false);
}

void detail::all_reduce_into_private(const Team& team, const TensorView& input, const TensorView& output,
                                     cudaStream_t stream) {
    all_reduce_impl(team, input, output, stream, {}, true);
}

void all_reduce(World& world, const TensorView& input, const TensorView& output, cudaStream_t stream,
                const AllReduceOptions& options) {
    all_reduce(world.team(), input, output, stream, options);
}

}  // namespace weft::ops
