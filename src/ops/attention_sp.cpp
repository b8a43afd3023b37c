// SPDX-License-Identifier: MIT
// weft::ops::sp_decode_attention: decode attention over a KV cache sharded across ranks by sequence; each rank's
// final rows are pushed to every rank by its decode kernels (LL lines) and merged by a collective kernel.
#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>

#include "collective_workspace.hpp"
#include "weft/detail/collectives.hpp"
#include "weft/ops/attention.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {

namespace {

// The decode configs a World's teams have loaded and met over: a World extension, so that it ends with its World.
struct LoadedDecodeConfigs final : WorldExtension {
    std::set<std::tuple<std::string, int, int, int>> loaded;  // team id, dtype, head dim, stages
};

// Loads the decode kernels of `config` the first time a team uses them, then meets the team: no rank launches
// the spinning combine kernel while another is still loading a module (CUDA may wait for the context to idle). Both
// split builds (with and without the block-table check) at that one meeting: ranks may differ in passing a status.
// The World's extensions belong to the rank's own thread: no lock.
void ensure_loaded(const Team& team, const AttentionDecodeConfig& config, cudaStream_t stream) {
    constexpr const char* kExtension = "weft.sp_decode_attention.loaded";
    World& world = team.world();
    auto* ext = static_cast<LoadedDecodeConfigs*>(world.find_extension(kExtension));
    if (ext == nullptr) {
        ext = static_cast<LoadedDecodeConfigs*>(
            &world.add_extension(kExtension, std::make_unique<LoadedDecodeConfigs>()));
    }
    const auto key = std::make_tuple(team.id(), static_cast<int>(config.dtype), config.head_dim, config.stages);
    if (ext->loaded.count(key) != 0) return;
    // The same first calls on every member (the same shapes): every member refuses alike.
    detail::refuse_setup_under_capture(stream, "sp_decode_attention",
                                       "loading its decode kernels for this head_dim and dtype and meeting the team");
    for (const bool check_pages : {false, true}) {
        AttentionDecodeConfig c = config;
        c.check_pages = check_pages;
        detail::load_decode_attention_kernels(c);
    }
    team.barrier();
    ext->loaded.insert(key);
}

}  // namespace

void sp_decode_attention(const Team& team, const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                         const TensorView& block_table, const TensorView& seq_lens, int64_t max_seq_len,
                         const TensorView& out, const TensorView& lse, cudaStream_t stream,
                         const DecodeAttentionOptions& options) {
    team.require_member("sp_decode_attention");
    WEFT_NVTX_RANGE("sp_decode_attention");
    if (team.num_ranks() == 1) {
        decode_attention(q, k_cache, v_cache, block_table, seq_lens, max_seq_len, out, lse, stream, options);
        return;
    }
    // Counts a refused or empty call too: a rank that skipped one then fails its next call on every rank (the index is
    // in the descriptor, whose digest travels in every pushed row) instead of merging one step's rows with the next's.
    const uint64_t call = detail::next_collective_call(team);
    WEFT_CHECK(team.num_nodes() == 1, "sp_decode_attention: the team spans "
                                          << team.num_nodes() << " nodes (" << team.describe()
                                          << "); its low-latency push needs every member load/store reachable: "
                                             "use a team within one node");
    detail::DecodeAttentionPlan plan =
        detail::plan_decode_attention(q, k_cache, v_cache, block_table, seq_lens, max_seq_len, out, lse, options,
                                      detail::attention_resident_blocks_here);
    if (plan.empty) return;
    // As the other collectives: this GPU's memory, refused before any rank's kernels launch on it (and before the
    // collective workspace is set up on a first call).
    detail::check_device_buffers(team.world().heap(),
                                 {{"q", q},
                                  {"k_cache", k_cache},
                                  {"v_cache", v_cache},
                                  {"block_table", block_table},
                                  {"seq_lens", seq_lens},
                                  {"out", out},
                                  {"lse", lse},
                                  {"options.workspace", options.workspace}},
                                 "sp_decode_attention", stream);
    detail::check_device_or_mapped_pointer(options.status, "options.status", "sp_decode_attention", stream);
    detail::CollectiveWorkspace& ws = detail::CollectiveWorkspace::get(team, stream, "sp_decode_attention");
    const int64_t batch = plan.params.batch;
    const int64_t heads = plan.params.num_q_heads;
    const int64_t dim = plan.config.head_dim;
    const auto row_bytes = static_cast<uint64_t>(attention_push_row_lines(dim)) * kLowLatencyLineBytes;
    const uint64_t slot = ws.info().ll_slot_bytes;
    // Before the kernels are loaded and the team meets: every rank has the same shapes, so every rank stops here.
    WEFT_CHECK(static_cast<uint64_t>(heads) * row_bytes <= slot, "sp_decode_attention: one sequence's rows ("
                                                                     << heads << " q-heads x " << row_bytes
                                                                     << " bytes of LL lines) exceed the LL buffer of "
                                                                     << slot << " bytes per rank");
    ensure_loaded(team, plan.config, stream);
    const int64_t per_round =
        std::max<int64_t>(1, static_cast<int64_t>(slot / (static_cast<uint64_t>(heads) * row_bytes)));

    CollectiveParams base = ws.params();
    AttentionPeerPush push;
    push.ctx = team.device_ctx();
    push.epoch = &base.state->epoch;
    push.ll_buffer = base.ll_buffer;
    push.ll_slot_bytes = base.ll_slot_bytes;
    const CollectiveTopology& topo = ws.topology();
    const auto elem = static_cast<int64_t>(dtype_bytes(q.dtype));
    for (int64_t b0 = 0; b0 < batch; b0 += per_round) {
        const int64_t nb = std::min(per_round, batch - b0);
        detail::DecodeAttentionPlan round = plan;
        AttentionDecodeParams& p = round.params;
        p.q = static_cast<const uint8_t*>(p.q) + b0 * p.q_batch_stride * elem;
        p.block_table += b0 * p.block_table_stride;
        p.seq_lens += b0;
        p.sequence_base = static_cast<int32_t>(b0);
        p.batch = static_cast<int32_t>(nb);
        p.out = nullptr;
        p.lse = nullptr;
        const int64_t rows = nb * heads;
        CollectiveParams cp = base;
        cp.count = static_cast<uint64_t>(rows);
        cp.out_stride = static_cast<uint64_t>(dim);
        cp.out = static_cast<uint8_t*>(out.data) + b0 * heads * dim * elem;
        cp.res = lse.data != nullptr ? static_cast<float*>(lse.data) + b0 * heads : nullptr;
        // What every rank's round must agree on; 32 bits of it travel in every pushed row (AttentionPeerPush::tag).
        cp.descriptor =
            detail::call_descriptor(CollectiveOp::kAttentionCombine, 0, q.dtype, static_cast<uint64_t>(rows),
                                    {call, static_cast<uint64_t>(dim), static_cast<uint64_t>(heads),
                                     static_cast<uint64_t>(b0), static_cast<uint64_t>(batch)});
        p.push_enabled = 1;
        p.push = push;
        p.push.tag = attention_push_tag(cp.descriptor);
        detail::launch_decode_attention(round, options, stream);

        const int grid = all_gather_grid(AllGatherAlgo::kLowLatency, static_cast<uint64_t>(rows * dim / 4) * 8, topo);
        ws.launch(detail::KernelId::kAttentionSpCombine, q.dtype, grid, stream, cp);
    }
}

void sp_decode_attention(World& world, const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                         const TensorView& block_table, const TensorView& seq_lens, int64_t max_seq_len,
                         const TensorView& out, const TensorView& lse, cudaStream_t stream,
                         const DecodeAttentionOptions& options) {
    sp_decode_attention(world.team(), q, k_cache, v_cache, block_table, seq_lens, max_seq_len, out, lse, stream,
                        options);
}

}  // namespace weft::ops
