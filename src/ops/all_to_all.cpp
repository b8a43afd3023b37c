// SPDX-License-Identifier: MIT
// weft::ops::all_to_all / all_to_all_v: argument checks, the per-round layout, the kernel launches; the Ulysses
// re-shard helpers.
#include "weft/ops/all_to_all.hpp"

#include <algorithm>
#include <numeric>

#include "collective_workspace.hpp"
#include "hierarchical.hpp"
#include "tp_common.hpp"
#include "weft/detail/collectives.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {

namespace detail {

namespace {

constexpr uint64_t align16(uint64_t x) { return (x + 15) / 16 * 16; }

void check_a2a_view(const TensorView& v, const char* what, const char* op) {
    check_collective_view(v, what, op);
    WEFT_CHECK(v.numel() == 0 || v.data != nullptr,
               op << ": " << what << " is null but holds " << v.numel() << " elements (" << v.describe() << ")");
    WEFT_CHECK(v.is_contiguous(), op << ": " << what << " must be contiguous, got " << v.describe());
}

/// The sum of the counts, each >= 0, the sum's bytes (elem each) below 2^62.
uint64_t sum_counts(std::span<const int64_t> counts, uint64_t elem, const char* what, const char* op) {
    constexpr uint64_t kMaxBytes = uint64_t{1} << 62;
    uint64_t s = 0;
    for (size_t q = 0; q < counts.size(); ++q) {
        WEFT_CHECK(counts[q] >= 0, op << ": " << what << "[" << q << "] must be >= 0, got " << counts[q]);
        s += static_cast<uint64_t>(counts[q]);  // no wrap: each term and the running sum stay below 2^62
        WEFT_CHECK(static_cast<uint64_t>(counts[q]) < kMaxBytes / elem && s < kMaxBytes / elem,
                   op << ": " << what << " sums to more than 2^62 bytes (at entry " << q << ": " << counts[q] << ")");
    }
    return s;
}

}  // namespace

AllToAllPlan plan_all_to_all(const TensorView& input, std::span<const int64_t> send_counts, const TensorView& output,
                             std::span<const int64_t> recv_counts, int num_ranks, bool equal, bool input_symmetric,
                             uint64_t staging_capacity, int rank) {
    const char* op = equal ? "all_to_all" : "all_to_all_v";
    const int n = num_ranks;
    WEFT_CHECK(n >= 1 && n <= kMaxAllToAllRanks, op << ": up to " << kMaxAllToAllRanks << " ranks, got " << n);
    check_a2a_view(input, "input", op);
    check_a2a_view(output, "output", op);
    WEFT_CHECK(input.dtype == output.dtype, op << ": input and output must have the same dtype, got "
                                               << dtype_name(input.dtype) << " and " << dtype_name(output.dtype));
    const auto elem = static_cast<uint64_t>(dtype_bytes(input.dtype));
    const auto in_bytes = static_cast<uint64_t>(input.size_bytes());
    const auto out_bytes = static_cast<uint64_t>(output.size_bytes());
    const auto x = reinterpret_cast<uintptr_t>(input.data);
    const auto y = reinterpret_cast<uintptr_t>(output.data);
    WEFT_CHECK(in_bytes == 0 || out_bytes == 0 || x + in_bytes <= y || y + out_bytes <= x,
               op << ": input and output must not overlap (" << input.data << ", " << in_bytes << " bytes; "
                  << output.data << ", " << out_bytes << " bytes)");
    AllToAllPlan plan;
    plan.staged = !input_symmetric;
    if (equal) {
        WEFT_CHECK(input.numel() == output.numel(), op << ": output must have as many elements as input ("
                                                       << input.numel() << "), got " << output.numel());
        WEFT_CHECK(input.numel() % n == 0,
                   op << ": the element count (" << input.numel() << ") must be a multiple of num_ranks (" << n << ")");
        const uint64_t chunk = in_bytes / static_cast<uint64_t>(n);
        if (chunk == 0) return plan;  // nothing to move on any rank (the count is the same everywhere)
        // Staged rounds: each peer's slot of the staging half holds `per_round` bytes of its chunk.
        uint64_t per_round = chunk;
        if (plan.staged) {
            per_round = staging_capacity / static_cast<uint64_t>(n) / 16 * 16;
            WEFT_CHECK(per_round >= 16, op << ": the staging region is too small for " << n << " ranks");
        }
        for (uint64_t begin = 0; begin < chunk; begin += per_round) {
            const uint64_t len = std::min(per_round, chunk - begin);
            AllToAllTable t{};
            for (int q = 0; q < n; ++q) {
                const uint64_t at = static_cast<uint64_t>(q) * chunk + begin;
                t.send_offset[q] = at;
                t.send_bytes[q] = len;
                t.source_offset[q] = plan.staged ? static_cast<uint64_t>(q) * per_round : at;
                t.recv_offset[q] = at;
                t.recv_bytes[q] = len;
            }
            plan.rounds.push_back(t);
        }
        return plan;
    }
    WEFT_CHECK(send_counts.size() == static_cast<size_t>(n),
               op << ": send_counts must have num_ranks (" << n << ") entries, got " << send_counts.size());
    WEFT_CHECK(recv_counts.size() == static_cast<size_t>(n),
               op << ": recv_counts must have num_ranks (" << n << ") entries, got " << recv_counts.size());
    const uint64_t sent = sum_counts(send_counts, elem, "send_counts", op);
    const uint64_t received = sum_counts(recv_counts, elem, "recv_counts", op);
    if (rank >= 0 && rank < n) {
        const auto self = static_cast<size_t>(rank);
        WEFT_CHECK(send_counts[self] == recv_counts[self],
                   op << ": send_counts[" << rank << "] (to this rank itself) must equal recv_counts[" << rank
                      << "] (from itself), got " << send_counts[self] << " and " << recv_counts[self]);
    }
    WEFT_CHECK(static_cast<uint64_t>(input.numel()) == sent,
               op << ": input must hold sum(send_counts) = " << sent << " elements, got " << input.numel());
    WEFT_CHECK(static_cast<uint64_t>(output.numel()) == received,
               op << ": output must hold sum(recv_counts) = " << received << " elements, got " << output.numel());
    AllToAllTable t{};
    uint64_t send_at = 0, recv_at = 0, stage_at = 0;
    for (int q = 0; q < n; ++q) {
        const uint64_t s = static_cast<uint64_t>(send_counts[static_cast<size_t>(q)]) * elem;
        const uint64_t r = static_cast<uint64_t>(recv_counts[static_cast<size_t>(q)]) * elem;
        t.send_offset[q] = send_at;
        t.send_bytes[q] = s;
        t.source_offset[q] = plan.staged ? stage_at : send_at;
        t.recv_offset[q] = recv_at;
        t.recv_bytes[q] = r;
        send_at += s;
        recv_at += r;
        stage_at += align16(s);  // each staged chunk starts 16-byte aligned: the copies stay vectorised
    }
    WEFT_CHECK(!plan.staged || stage_at <= staging_capacity,
               op << ": a local input of " << sent * elem << " bytes (" << stage_at
                  << " staged) exceeds the staging region (" << staging_capacity
                  << " bytes; WEFT_COLLECTIVE_STAGING_BYTES): put the input on the symmetric heap");
    plan.rounds.push_back(t);
    return plan;
}

}  // namespace detail

namespace {

using detail::CollectiveWorkspace;
using detail::KernelId;

void run_all_to_all(const Team& team, const TensorView& input, std::span<const int64_t> send_counts,
                    const TensorView& output, std::span<const int64_t> recv_counts, bool equal, cudaStream_t stream) {
    const char* op = equal ? "all_to_all" : "all_to_all_v";
    team.require_member(op);
    WEFT_NVTX_RANGE(equal ? "all_to_all" : "all_to_all_v");
    const uint64_t call = detail::next_collective_call(team);  // counts a refused call too
    const int n = team.num_ranks();
    if (n == 1) {
        (void)detail::plan_all_to_all(input, send_counts, output, recv_counts, 1, equal, true, 0, 0);
        detail::check_device_buffers(team.world().heap(), {{"input", input}, {"output", output}}, op, stream);
        if (input.size_bytes() > 0) {
            WEFT_CUDA_CHECK(cudaMemcpyAsync(output.data, input.data, static_cast<size_t>(input.size_bytes()),
                                            cudaMemcpyDeviceToDevice, stream));
        }
        return;
    }
    if (team.num_nodes() > 1) {
        // A team that spans nodes (docs/multinode.md, "All-to-all across nodes"): node stages and the network. The
        // same checks as plan_all_to_all's, without its bound on the rank count (the node stages respect it).
        detail::check_a2a_view(input, "input", op);
        detail::check_a2a_view(output, "output", op);
        WEFT_CHECK(input.dtype == output.dtype, op << ": input and output must have the same dtype, got "
                                                   << dtype_name(input.dtype) << " and " << dtype_name(output.dtype));
        const auto x = reinterpret_cast<uintptr_t>(input.data), y = reinterpret_cast<uintptr_t>(output.data);
        const auto in_bytes = static_cast<uint64_t>(input.size_bytes());
        const auto out_bytes = static_cast<uint64_t>(output.size_bytes());
        WEFT_CHECK(in_bytes == 0 || out_bytes == 0 || x + in_bytes <= y || y + out_bytes <= x,
                   op << ": input and output must not overlap (" << input.data << ", " << in_bytes << " bytes; "
                      << output.data << ", " << out_bytes << " bytes)");
        if (equal) {
            WEFT_CHECK(input.numel() == output.numel(), op << ": output must have as many elements as input ("
                                                           << input.numel() << "), got " << output.numel());
            WEFT_CHECK(input.numel() % n == 0, op << ": the element count (" << input.numel()
                                                  << ") must be a multiple of num_ranks (" << n << ")");
        } else {
            WEFT_CHECK(send_counts.size() == static_cast<size_t>(n),
                       op << ": send_counts must have num_ranks (" << n << ") entries, got " << send_counts.size());
            WEFT_CHECK(recv_counts.size() == static_cast<size_t>(n),
                       op << ": recv_counts must have num_ranks (" << n << ") entries, got " << recv_counts.size());
            const auto elem = static_cast<uint64_t>(dtype_bytes(input.dtype));
            const uint64_t sent = detail::sum_counts(send_counts, elem, "send_counts", op);
            const uint64_t received = detail::sum_counts(recv_counts, elem, "recv_counts", op);
            WEFT_CHECK(static_cast<uint64_t>(input.numel()) == sent,
                       op << ": input must hold sum(send_counts) = " << sent << " elements, got " << input.numel());
            WEFT_CHECK(
                static_cast<uint64_t>(output.numel()) == received,
                op << ": output must hold sum(recv_counts) = " << received << " elements, got " << output.numel());
        }
        detail::hierarchical_all_to_all(team, input, send_counts, output, recv_counts, equal, stream);
        return;
    }
    // Every check that does not depend on the workspace, before the workspace is made (collectively) on first use.
    (void)detail::plan_all_to_all(input, send_counts, output, recv_counts, n, equal, true, 0, team.rank());
    if (equal && input.size_bytes() == 0) return;  // nothing launched: no workspace made (not under capture either)
    CollectiveWorkspace& ws = CollectiveWorkspace::get(team, stream, op);
    const auto in_bytes = static_cast<uint64_t>(input.size_bytes());
    const bool in_sym = in_bytes > 0 && ws.symmetric(input.data, in_bytes);
    const uint64_t capacity = ws.info().staging_region_bytes - kAllToAllHeaderBytes;
    const detail::AllToAllPlan plan =
        detail::plan_all_to_all(input, send_counts, output, recv_counts, n, equal, in_sym, capacity, team.rank());
    if (plan.rounds.empty()) return;
    if (!in_sym && in_bytes > 0) detail::check_device_pointer(input.data, "input", op, stream);
    if (output.size_bytes() > 0 && !ws.symmetric(output.data, static_cast<uint64_t>(output.size_bytes()))) {
        detail::check_device_pointer(output.data, "output", op, stream);
    }
    const CollectiveTopology& topo = ws.topology();
    // The same grid on every rank: from the (equal) chunk size, or the largest for uneven splits.
    const uint64_t grid_bytes = equal ? in_bytes : (1ull << 30);
    const int grid = all_gather_grid(AllGatherAlgo::kSmPush, grid_bytes, topo);
    const uint64_t in_offset = in_sym ? ws.offset_or_none(input.data) : ~0ull;
    for (size_t r = 0; r < plan.rounds.size(); ++r) {
        CollectiveParams p = ws.params();
        p.in = input.data;
        p.out = output.data;
        p.src = in_sym ? input.data : nullptr;
        p.count = equal ? in_bytes : 0;
        // Equal splits: every rank has the same bytes and passes a symmetric input on all ranks or on none, so the
        // staging and the input's offset are part of the call. Uneven: a rank may send nothing (its input then
        // counts as local) while others send from the heap: each rank publishes where its chunks lie, and every rank
        // meets at the exit (a direct rank's input is read until then). So staging is not part of an uneven call's
        // descriptor: ranks may differ in it.
        p.flags = equal ? (plan.staged ? kCollectiveStageInput : kCollectiveExitBarrier)
                        : ((plan.staged ? kCollectiveStageInput : 0u) | kCollectiveExitBarrier);
        p.descriptor = equal ? detail::call_descriptor_bytes(CollectiveOp::kAllToAll, plan.staged ? 1u : 0u, in_bytes,
                                                             {call, r, in_offset})
                             : detail::call_descriptor_bytes(CollectiveOp::kAllToAllV, 0u, 0, {call, r});
        ws.launch(KernelId::kAllToAllPull, grid, stream, p, plan.rounds[r]);
    }
}

// The [S/W, H, D] <-> [W, S/W, H/W, D] permutation: for every rank q, S/W rows of H/W x D elements (one head group)
// between a row pitch of H x D (the sequence-sharded side) and a packed block (the all-to-all's chunk q).
struct UlyssesShape {
    int64_t tokens_per_rank, heads_per_rank, dim, elem;
};

UlyssesShape ulysses_shape(const TensorView& seq_sharded, const TensorView& head_sharded, const TensorView& scratch,
                           int n, const char* op) {
    detail::check_collective_view(seq_sharded, "the sequence-sharded tensor", op);
    detail::check_collective_view(head_sharded, "the head-sharded tensor", op);
    detail::check_collective_view(scratch, "scratch", op);
    WEFT_CHECK(n >= 1, op << ": the team must have at least one rank, got " << n);
    WEFT_CHECK(seq_sharded.ndim == 3 && seq_sharded.is_contiguous(),
               op << ": the sequence-sharded tensor must be contiguous [S / W, H, D], got " << seq_sharded.describe());
    WEFT_CHECK(head_sharded.ndim == 3 && head_sharded.is_contiguous(),
               op << ": the head-sharded tensor must be contiguous [S, H / W, D], got " << head_sharded.describe());
    WEFT_CHECK(seq_sharded.dtype == head_sharded.dtype, op << ": input and output must have the same dtype");
    const int64_t s_local = seq_sharded.dim(0), h = seq_sharded.dim(1), d = seq_sharded.dim(2);
    WEFT_CHECK(h % n == 0, op << ": H (" << h << ") must be a multiple of num_ranks (" << n << ")");
    WEFT_CHECK(head_sharded.dim(0) == s_local * n && head_sharded.dim(1) == h / n && head_sharded.dim(2) == d,
               op << ": shapes do not match: [S / W, H, D] = " << seq_sharded.describe() << " needs [S, H / W, D] = ["
                  << s_local * n << ", " << h / n << ", " << d << "], got " << head_sharded.describe());
    WEFT_CHECK(scratch.is_contiguous() && scratch.size_bytes() >= seq_sharded.size_bytes() &&
                   (seq_sharded.numel() == 0 || scratch.data != nullptr),
               op << ": scratch must be a contiguous buffer of at least " << seq_sharded.size_bytes() << " bytes, got "
                  << scratch.describe());
    return {s_local, h / n, d, dtype_bytes(seq_sharded.dtype)};
}

// Refuses (naming `op`) a permutation whose strided copies the device cannot make (a token's heads of 2 GiB or more).
void check_ulysses_copies(const UlyssesShape& u, int n, const char* op) {
    const auto group_bytes = static_cast<size_t>(u.heads_per_rank * u.dim * u.elem);
    tp_detail::check_row_copy(op, "a token's heads", group_bytes, group_bytes * static_cast<size_t>(n), group_bytes,
                              static_cast<size_t>(u.tokens_per_rank));
}

// seq_to_head = true: seq-sharded [S/W, W, H/W, D] -> packed [W, S/W, H/W, D]; false: the reverse.
void ulysses_permute(const UlyssesShape& u, int n, void* packed, void* strided, bool to_packed, cudaStream_t stream) {
    const auto group_bytes = static_cast<size_t>(u.heads_per_rank * u.dim * u.elem);
    const size_t row_pitch = group_bytes * static_cast<size_t>(n);
    const auto rows = static_cast<size_t>(u.tokens_per_rank);
    if (rows == 0 || group_bytes == 0) return;
    for (int q = 0; q < n; ++q) {
        auto* block = static_cast<uint8_t*>(packed) + static_cast<size_t>(q) * rows * group_bytes;
        auto* column = static_cast<uint8_t*>(strided) + static_cast<size_t>(q) * group_bytes;
        if (to_packed) {
            tp_detail::copy_rows_async(block, group_bytes, column, row_pitch, group_bytes, rows, stream);
        } else {
            tp_detail::copy_rows_async(column, row_pitch, block, group_bytes, group_bytes, rows, stream);
        }
    }
}

// The bytes of a contiguous view.
bool bytes_overlap(const TensorView& x, const TensorView& y) {
    const auto a = reinterpret_cast<uintptr_t>(x.data), b = reinterpret_cast<uintptr_t>(y.data);
    const auto a_bytes = static_cast<uintptr_t>(x.size_bytes()), b_bytes = static_cast<uintptr_t>(y.size_bytes());
    return a_bytes > 0 && b_bytes > 0 && a < b + b_bytes && b < a + a_bytes;
}

}  // namespace

namespace detail {

void check_ulysses_args(const TensorView& input, const TensorView& output, const TensorView& scratch, int num_ranks,
                        bool seq_to_head, int num_nodes) {
    const char* op = seq_to_head ? "ulysses_seq_to_head" : "ulysses_head_to_seq";
    (void)ulysses_shape(seq_to_head ? input : output, seq_to_head ? output : input, scratch, num_ranks, op);
    WEFT_CHECK(input.numel() == 0 || (input.data != nullptr && output.data != nullptr),
               op << ": input and output must not be null when they hold elements, got " << input.data << " and "
                  << output.data);
    WEFT_CHECK(!bytes_overlap(scratch, input) && !bytes_overlap(scratch, output),
               op << ": scratch must overlap neither input nor output, got scratch " << scratch.data << " ("
                  << scratch.size_bytes() << " bytes), input " << input.data << " (" << input.size_bytes()
                  << " bytes), output " << output.data << " (" << output.size_bytes() << " bytes)");
    // The all-to-all's own checks on the views it is given, before the permutation writes anything (across nodes the
    // all-to-all has no bound on the rank count, and checks its views itself).
    if (num_nodes > 1) return;
    const TensorView send(seq_to_head ? scratch.data : input.data, input.dtype, {input.numel()});
    const TensorView recv(seq_to_head ? output.data : scratch.data, input.dtype, {input.numel()});
    (void)plan_all_to_all(send, {}, recv, {}, num_ranks, true, true, 0);
}

}  // namespace detail

void all_to_all(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream) {
    run_all_to_all(team, input, {}, output, {}, true, stream);
}

void all_to_all_v(const Team& team, const TensorView& input, std::span<const int64_t> send_counts,
                  const TensorView& output, std::span<const int64_t> recv_counts, cudaStream_t stream) {
    run_all_to_all(team, input, send_counts, output, recv_counts, false, stream);
}

void ulysses_seq_to_head(const Team& team, const TensorView& input, const TensorView& output, const TensorView& scratch,
                         cudaStream_t stream) {
    team.require_member("ulysses_seq_to_head");
    const int n = team.num_ranks();
    detail::check_ulysses_args(input, output, scratch, n, true, team.num_nodes());
    detail::check_device_buffers(team.world().heap(), {{"input", input}, {"output", output}, {"scratch", scratch}},
                                 "ulysses_seq_to_head", stream);
    const UlyssesShape u = ulysses_shape(input, output, scratch, n, "ulysses_seq_to_head");
    check_ulysses_copies(u, n, "ulysses_seq_to_head");
    ulysses_permute(u, n, scratch.data, input.data, true, stream);
    // Chunk q of scratch (my tokens, q's heads) goes to rank q, landing at rows [rank S/W, (rank + 1) S/W) there.
    all_to_all(team, TensorView(scratch.data, input.dtype, {input.numel()}),
               TensorView(output.data, output.dtype, {output.numel()}), stream);
}

void ulysses_head_to_seq(const Team& team, const TensorView& input, const TensorView& output, const TensorView& scratch,
                         cudaStream_t stream) {
    team.require_member("ulysses_head_to_seq");
    const int n = team.num_ranks();
    detail::check_ulysses_args(input, output, scratch, n, false, team.num_nodes());
    detail::check_device_buffers(team.world().heap(), {{"input", input}, {"output", output}, {"scratch", scratch}},
                                 "ulysses_head_to_seq", stream);
    const UlyssesShape u = ulysses_shape(output, input, scratch, n, "ulysses_head_to_seq");
    check_ulysses_copies(u, n, "ulysses_head_to_seq");
    // Chunk q of input (q's tokens, my heads) goes to rank q; chunk q received is my tokens of q's heads.
    all_to_all(team, TensorView(input.data, input.dtype, {input.numel()}),
               TensorView(scratch.data, input.dtype, {input.numel()}), stream);
    ulysses_permute(u, n, scratch.data, output.data, false, stream);
}

void all_to_all(World& world, const TensorView& input, const TensorView& output, cudaStream_t stream) {
    all_to_all(world.team(), input, output, stream);
}

void all_to_all_v(World& world, const TensorView& input, std::span<const int64_t> send_counts, const TensorView& output,
                  std::span<const int64_t> recv_counts, cudaStream_t stream) {
    all_to_all_v(world.team(), input, send_counts, output, recv_counts, stream);
}

void ulysses_seq_to_head(World& world, const TensorView& input, const TensorView& output, const TensorView& scratch,
                         cudaStream_t stream) {
    ulysses_seq_to_head(world.team(), input, output, scratch, stream);
}

void ulysses_head_to_seq(World& world, const TensorView& input, const TensorView& output, const TensorView& scratch,
                         cudaStream_t stream) {
    ulysses_head_to_seq(world.team(), input, output, scratch, stream);
}

}  // namespace weft::ops
