// SPDX-License-Identifier: MIT
// weft::ops::grouped_gemm: one GEMM per group (MoE expert) in one persistent launch of weft's sm_90a GEMM, with the
// groups' row counts read on the device (as an expert-parallel dispatch leaves them), in two layouts:
//
//   contiguous  A [rows, K], group g's rows [offsets[g], offsets[g] + counts[g])   (ep::NormalHandle: recv_x,
//               D [rows, N], the same rows                                           expert_offsets, expert_counts)
//   masked      A [G, capacity, K], group g's rows [0, counts[g])                   (ep::LowLatencyHandle: recv_x,
//               D [G, capacity, N], the same rows                                    expert_counts)
//   both        B [G, N, K] (BLayout::kNK, a linear layer's weights per expert) or [G, K, N] (kKN)
//
//     weft::ops::grouped_gemm_contiguous(h.recv_x(), w, y, weft::BLayout::kNK, h.expert_offsets(),
//                                        h.expert_counts(), stream);
//
// D[rows of g] = A[rows of g] * B[g]; bf16 (or f16) in, fp32 accumulate, bf16 (f16) or fp32 out. The kernel is the
// dense GEMM's (kernels/gemm/gemm_sm90.cuh) with GroupedScheduler (kernels/gemm/gemm_scheduler.cuh): every group's
// tiles in one persistent walk, so a hot group is spread over every SM and an empty group costs one count read.
// Rows of D outside every group (padding between groups, rows past a group's count) are never written.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "weft/common/gemm_config.hpp"
#include "weft/common/gemm_hook_params.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft::ops {

using weft::gemm::GroupedSchedulerParams;
using weft::gemm::GroupedSignalMode;
using weft::gemm::GroupedStatus;
using weft::gemm::GroupedStatusCode;
using weft::gemm::GroupedTileSignalParams;
using weft::gemm::GroupedWaitParams;

/// Which layout a grouped call has (the header's table).
enum class GroupedLayout : int32_t { kContiguous = 0, kMasked = 1 };

/// Knobs of one grouped call. Defaults pick everything from the problem and the device.
struct GroupedGemmOptions {
    int sm_budget = 0;                 ///< CTAs of the persistent grid; 0 = every SM
    std::optional<GemmConfig> config;  ///< force a config (is_valid_grouped, with `wait` is_valid_grouped_wait; dtypes
                                       ///< and layout must match the call)
    /// Rows per group the heuristic plans for (its tile height): 0 = contiguous: rows of A / groups; masked: capacity
    /// / 2 (the mean of counts spread evenly over [0, capacity]). The kernel reads the real counts on the device
    /// whatever this says; a good hint saves padding rows (groups of ~200 rows run 64-row tiles).
    int64_t expected_rows_per_group = 0;
    std::chrono::milliseconds timeout{0};  ///< bound on every pipeline wait; 0 = WEFT_TIMEOUT_MS or 10 s
    /// Where the kernel records a bad count (device or host-mapped memory, zero-initialised by the caller; the first
    /// bad group of the first launch that finds one claims it): counts are clamped into their bounds (masked:
    /// [0, capacity]; contiguous: the group keeps its rows inside A, [offset, rows of A), none for a negative
    /// offset), so nothing outside the views is read or written, and the record
    /// says which group, what it held and the bound. check_grouped_status turns a record into a weft::Error.
    /// nullptr: clamped silently.
    GroupedStatus* status = nullptr;
    /// Per-tile wait before loading A (GroupedWaitScheduler), for fused layers; unset: none. The op fills its
    /// `groups` from the call (and a zero timeout_ns with the call's bound); the rest is the caller's. Refused by the
    /// ops whose A passes through a kernel of their own first (grouped_gemm_masked_fp8's dequantisation,
    /// grouped_gemm_gathered(_combine)'s gather), which would read A before it arrived.
    std::optional<GroupedWaitParams> wait;
    /// Per-tile signal once a tile is stored (GroupedTileSignalHook, add-only counters), for fused layers; unset:
    /// none.
    std::optional<GroupedTileSignalParams> signal;
};

/// contiguous: a [rows, K]; b [G, N, K] (kNK) or [G, K, N] (kKN); d [rows, N]; offsets and counts: G int32 each in
/// device memory (G = b's first extent), read by the kernel (they may be written by a kernel earlier on `stream`;
/// a captured launch reads them at replay). Group g's rows [offsets[g], offsets[g] + counts[g]) must lie inside A;
/// groups must not overlap (each row of D is written by its group's tiles only); they may lie in any order, with rows
/// between them that no group owns (those rows of D are not written). D's bytes must not overlap A's, B's,
/// offsets' or counts' (the kernel reads them while other CTAs write D). Asynchronous on `stream`,
/// capturable once its kernel exists. Row strides: multiples of 16 bytes; K a positive multiple of 8; every extent (and
/// the rows of A) at most kGemmMaxExtent = 2^31 - 2^24; base addresses 16-byte aligned. Every operand and array is
/// this GPU's memory (or managed memory): host memory and another GPU's are refused. Bad arguments throw weft::Error
/// naming the argument, before anything is enqueued; bad counts: GroupedGemmOptions::status.
void grouped_gemm_contiguous(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout,
                             const int32_t* offsets, const int32_t* counts, cudaStream_t stream,
                             const GroupedGemmOptions& options = {});

/// masked: a [G, capacity, K]; b [G, N, K] (kNK) or [G, K, N] (kKN); d [G, capacity, N]; counts: G int32 in device
/// memory, each in [0, capacity] (else clamped and recorded: GroupedGemmOptions::status). A and D's groups must be
/// back to back (stride(0) = capacity * stride(1)), rows with a row stride. Otherwise as grouped_gemm_contiguous.
void grouped_gemm_masked(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout,
                         const int32_t* counts, cudaStream_t stream, const GroupedGemmOptions& options = {});

/// masked, fp8 rows (what ep::Buffer::low_latency_dispatch with fp8 produces): a [G, capacity, K] e4m3 (kF8E4M3)
/// with a_scales [G, capacity, K / 128] fp32 (one scale per 128 channels: value = float(code) * scale), b bf16 as in
/// grouped_gemm_masked, d [G, capacity, N] bf16 or f32. Two kernels on `stream`: the rows [0, counts[g]) of each
/// group are dequantised into a_bf16 ([G, capacity, K] bf16, the caller's workspace, groups back to back: each value
/// rounded once to bf16), then grouped_gemm_masked(a_bf16, b, d, ...) multiplies them. a_bf16 must overlap none of a,
/// a_scales, b and counts; d none of a_bf16, b and counts. K must be a multiple of 128;
/// codes' rows 16-byte aligned. The engine's mainloop multiplies 16-bit operands: an fp8 mainloop (fp8 wgmma with the
/// block scales applied per k-block to an fp32 accumulator) would save the bf16 round trip and is not there yet.
void grouped_gemm_masked_fp8(const TensorView& a, const TensorView& a_scales, const TensorView& b, const TensorView& d,
                             BLayout b_layout, const int32_t* counts, const TensorView& a_bf16, cudaStream_t stream,
                             const GroupedGemmOptions& options = {});

// ---- planning (pure host logic, tested on the CPU) ----------------------------------------------------------

/// A grouped call's shape after validation.
struct GroupedGemmProblem {
    GroupedLayout layout = GroupedLayout::kContiguous;
    int64_t groups = 0;    ///< G
    int64_t rows = 0;      ///< rows of A and D seen as 2-D (contiguous: rows; masked: G * capacity)
    int64_t capacity = 0;  ///< masked: rows per group; contiguous: 0
    int64_t n = 0, k = 0;
    BLayout b_layout = BLayout::kNK;
    DType in_dtype = DType::kBF16;
    DType out_dtype = DType::kBF16;
};

/// Checks the views of a call (and the group arrays, non-null and 4-byte aligned); throws weft::Error naming the
/// offending argument.
GroupedGemmProblem validate_grouped_gemm_args(GroupedLayout layout, const TensorView& a, const TensorView& b,
                                              const TensorView& d, BLayout b_layout, const int32_t* offsets,
                                              const int32_t* counts);

/// The configs a grouped call chooses from for its dtypes and layout (each is_valid_grouped; with `waits`, a call whose
/// producer waits per group, each is_valid_grouped_wait).
std::vector<GemmConfig> grouped_gemm_candidate_configs(DType in_dtype, DType out_dtype, BLayout b_layout,
                                                       bool waits = false);

/// What a grouped call launches: its config and persistent grid (CTAs).
struct GroupedGemmPlan {
    GemmConfig config{};
    int grid = 0;
};

/// Two ways the expected rows (G x rows per group) may fall over the groups, which the planner weighs (the counts are
/// read on the device): evenly (even_groups groups of even_rows rows), and packed into as few groups as hold them
/// (masked: full_groups groups of full_rows = capacity rows plus one of rest_rows; contiguous: one group of rest_rows).
struct GroupedRowSpread {
    int64_t even_groups = 0, even_rows = 0;
    int64_t full_groups = 0, full_rows = 0, rest_rows = 0;
};

/// The spreads of `rows_per_group` expected rows per group (at least 1; masked: at most the capacity).
GroupedRowSpread grouped_row_spreads(const GroupedGemmProblem& problem, int64_t rows_per_group);

/// The config a grouped call runs when none is forced: each candidate (grouped_gemm_candidate_configs) costed by the
/// dense GEMM's cost model (gemm_config_cost) on the rows its tiles cover in each spread of grouped_row_spreads (each
/// group's rows rounded up to whole tiles; the even spread's waves unrounded, GemmWaves::kUnrounded: real counts differ
/// between groups, so the last wave's fill is not known); the pick has the smallest worse ratio to the cheapest
/// candidate of each spread (ties: the earlier candidate). So few rows in one group (256 rows of one expert) get tiles
/// that fill the SMs, where the even spread alone (32 experts of 8 rows) would pick the tiles of the most work per
/// tile.
/// With `waits`, among the candidates of a call whose producer waits per group.
GemmConfig pick_grouped_config(const GroupedGemmProblem& problem, int64_t rows_per_group, int budget,
                               bool waits = false);

/// Picks the config (pick_grouped_config over the expected rows per group: GroupedGemmOptions::
/// expected_rows_per_group; among is_valid_grouped_wait configs when options.wait is set) and the grid (the SM
/// budget, or fewer when the most tiles any counts could make are fewer).
GroupedGemmPlan plan_grouped_gemm(const GroupedGemmProblem& problem, int num_sms,
                                  const GroupedGemmOptions& options = {});

/// The kernel a grouped call launches: gemm_kernel<config, GroupedScheduler or GroupedWaitScheduler, NoEpilogueHook
/// or GroupedTileSignalHook> (header gemm/gemm_sm90.cuh).
jit::KernelSpec grouped_gemm_kernel_spec(const GemmConfig& config, bool wait, bool signal,
                                         const std::string& arch = "");

/// The specs of every grouped kernel the op may launch without wait or signal (each candidate, bf16 -> bf16 / f32,
/// both B layouts), for weft-compile.
std::vector<jit::KernelSpec> grouped_gemm_aot_specs();

/// The fp8 dequantisation kernel of grouped_gemm_masked_fp8 (header gemm/grouped_dequant.cuh).
jit::KernelSpec grouped_dequant_kernel_spec(const std::string& arch = "");

/// Checks the fp8 operands of grouped_gemm_masked_fp8 against `problem` (the bf16 call on a_bf16, validated); throws
/// weft::Error naming the argument.
void validate_grouped_fp8_args(const GroupedGemmProblem& problem, const TensorView& a, const TensorView& a_scales);

/// Registers grouped_gemm_aot_specs() and the dequantisation kernel with weft::jit's ahead-of-time registry (once per
/// process; weft::ops::register_op_aot_specs calls it, so `weft-compile --builtin` warms them).
void register_grouped_gemm_aot_specs();

/// "" for a zero record, else what the kernel found ("grouped gemm: group 3 has 300 rows, over the capacity 256
/// (clamped)").
std::string describe_grouped_status(const GroupedStatus& status);
/// Throws weft::Error with describe_grouped_status unless the record is zero.
void check_grouped_status(const GroupedStatus& status);

}  // namespace weft::ops
