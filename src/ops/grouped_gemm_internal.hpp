// SPDX-License-Identifier: MIT
// What a fused grouped op (the TP MoE layers) needs from the grouped GEMM to launch weft's GEMM kernel with its own
// grouped scheduler and hook: the plan, tensor maps and arguments of a validated call.
#pragma once

#include "views_overlap.hpp"
#include "weft/detail/gemm_launch.hpp"
#include "weft/ops/grouped_gemm.hpp"

namespace weft::ops::detail {

/// One grouped launch set up on the host: config, persistent grid, tensor maps, GemmArgs and the scheduler's groups.
struct GroupedGemmLaunch {
    GemmConfig config{};
    int grid = 0;
    GemmTensorMaps maps{};
    GemmArgs args{};
    GroupedSchedulerParams groups{};
};

/// Checks a grouped call's options against its problem (every option the launch reads: the plan's, the timeout, the
/// status record's alignment, wait and signal); throws weft::Error naming the option. The grouped ops call it before
/// anything touches the device.
void check_grouped_gemm_options(const GroupedGemmOptions& options, const GroupedGemmProblem& problem);

/// The words a grouped call's options point at (status, the wait's and the signal's flags, epoch, groups_ready,
/// abort_flag): each must be device memory of this GPU or host-mapped pinned memory (a pageable host struct would fault
/// the context at the first write); weft::Error naming the option. The public grouped ops call it with their buffers.
void check_grouped_option_words(const GroupedGemmOptions& options, const char* op, cudaStream_t stream);

/// The checks of a grouped GEMM's launch that depend on its plan (the signal's group stride) and on its options'
/// timeout, for a caller that enqueues work before the GEMM (the gathered path's gather): weft::Error before it does.
void check_grouped_gemm_launch(const GroupedGemmProblem& p, const GroupedGemmOptions& options);

/// The launch of a grouped call `p` (validate_grouped_gemm_args) on the views: plan_grouped_gemm(p, num_sms, options),
/// its tensor maps over a and d seen as rows, and the groups from offsets/counts. p must have rows, groups and n > 0.
GroupedGemmLaunch prepare_grouped_gemm_launch(const GroupedGemmProblem& p, const TensorView& a, const TensorView& b,
                                              const TensorView& d, const int32_t* offsets, const int32_t* counts,
                                              int num_sms, const GroupedGemmOptions& options);

/// grouped_gemm_contiguous for a caller that has made sure every buffer is this GPU's memory (on the symmetric heap, or
/// checked once for the call), without querying each pointer again.
void grouped_gemm_contiguous_on_device(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout,
                                       const int32_t* offsets, const int32_t* counts, cudaStream_t stream,
                                       const GroupedGemmOptions& options);

}  // namespace weft::ops::detail
