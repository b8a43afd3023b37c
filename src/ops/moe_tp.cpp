// SPDX-License-Identifier: MIT
// weft::ops TP MoE, the steps: routing to the gathered layout, the gathered grouped GEMM (gather, contiguous grouped
// GEMM, combine), and the helpers the fused layers share with them (moe_internal.hpp; the layers: moe_tp_layers.cpp).
#include "weft/ops/moe_tp.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <utility>

#include "collective_workspace.hpp"
#include "grouped_gemm_internal.hpp"
#include "moe_internal.hpp"
#include "tp_common.hpp"
#include "weft/common/math.hpp"
#include "weft/detail/host_mapped_pool.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/symmetric_heap.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {

using weft::moe::kMoeThreads;

namespace moe_detail {

// Rows and slots the routing and combine kernels index with int32 loop counters that step past the last one: kept
// below 2^31 by a margin (the GEMM's own bound).
constexpr int64_t kMaxIndex = kGemmMaxExtent;

int num_sms() {
    int device = 0, n = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return n;
}

jit::LaunchParams launch_params(int grid, int block, cudaStream_t stream) {
    jit::LaunchParams lp;
    lp.grid = dim3(static_cast<unsigned>(std::max(grid, 1)), 1, 1);
    lp.block = dim3(static_cast<unsigned>(block), 1, 1);
    lp.stream = stream;
    return lp;
}

// A row-major 2-D view of `dtype` with `rows` x `cols` (cols < 0: any), inner stride 1, 16-byte aligned base and row
// stride; `what` names it. `written`: the op writes it, so its rows must not repeat or overlap (an input read only
// may broadcast a row).
void check_matrix(const TensorView& v, const char* op, const char* what, DType dtype, int64_t rows, int64_t cols,
                  bool written) {
    WEFT_CHECK(v.ndim == 2, op << ": " << what << " must be a 2-D matrix, got " << v.describe());
    WEFT_CHECK(v.dtype == dtype,
               op << ": " << what << " must be " << dtype_name(dtype) << ", got " << dtype_name(v.dtype));
    WEFT_CHECK(rows < 0 || v.dim(0) == rows,
               op << ": " << what << " must have " << rows << " rows, got " << v.describe());
    WEFT_CHECK(cols < 0 || v.dim(1) == cols,
               op << ": " << what << " must have " << cols << " columns, got " << v.describe());
    WEFT_CHECK(v.dim(1) <= 1 || v.stride(1) == 1, op << ": " << what << " must be row-major, got " << v.describe());
    if (v.numel() == 0) return;
    WEFT_CHECK(v.data != nullptr, op << ": " << what << " has a null data pointer");
    WEFT_CHECK(reinterpret_cast<uintptr_t>(v.data) % 16 == 0,
               op << ": " << what << "'s base address must be 16-byte aligned, got " << v.data);
    WEFT_CHECK(!written || v.dim(0) <= 1 || v.stride(0) >= v.dim(1),
               op << ": " << what << "'s row stride must be at least its " << v.dim(1)
                  << " columns (rows apart, none repeated), got " << v.describe());
    WEFT_CHECK(v.dim(0) <= 1 || (v.stride(0) * dtype_bytes(dtype)) % 16 == 0,
               op << ": " << what << "'s row stride must be a multiple of 16 bytes, got " << v.describe());
}

// A densely packed row-major [rows, cols] array of `dtype` read element by element (indices, weights): 4-byte aligned.
void check_dense(const TensorView& v, const char* op, const char* what, DType dtype, int64_t rows, int64_t cols) {
    WEFT_CHECK(v.ndim == 2, op << ": " << what << " must be a 2-D matrix, got " << v.describe());
    WEFT_CHECK(v.dtype == dtype,
               op << ": " << what << " must be " << dtype_name(dtype) << ", got " << dtype_name(v.dtype));
    WEFT_CHECK(rows < 0 || v.dim(0) == rows,
               op << ": " << what << " must have " << rows << " rows, got " << v.describe());
    WEFT_CHECK(cols < 0 || v.dim(1) == cols,
               op << ": " << what << " must have " << cols << " columns, got " << v.describe());
    WEFT_CHECK((v.dim(1) <= 1 || v.stride(1) == 1) && (v.dim(0) <= 1 || v.stride(0) == v.dim(1)),
               op << ": " << what << " must be densely packed (row-major, row stride = columns), got " << v.describe());
    if (v.numel() == 0) return;
    WEFT_CHECK(v.data != nullptr, op << ": " << what << " has a null data pointer");
    WEFT_CHECK(reinterpret_cast<uintptr_t>(v.data) % 4 == 0,
               op << ": " << what << " must be 4-byte aligned, got " << v.data);
}

void check_routing(const MoeRouting& r, const char* op) {
    WEFT_CHECK(r.num_experts >= 1 && r.num_experts <= kMaxIndex,
               op << ": routing.num_experts must be in [1, 2^31 - 2^24], got " << r.num_experts);
    WEFT_CHECK(r.topk >= 1 && r.topk <= kMaxTopk,
               op << ": routing.topk must be in [1, " << kMaxTopk << "], got " << r.topk);
    WEFT_CHECK(r.tokens >= 0 && r.tokens <= kMaxIndex / r.topk,
               op << ": routing.tokens x topk must be at most 2^31 - 2^24, got " << r.tokens << " x " << r.topk);
    WEFT_CHECK(r.rows_capacity >= moe_gathered_rows(r.tokens, r.topk, r.num_experts, 1) && r.rows_capacity <= kMaxIndex,
               op << ": routing.rows_capacity must be at least tokens x topk = " << r.tokens * r.topk
                  << " (and at most 2^31 - 2^24), got " << r.rows_capacity);
    WEFT_CHECK(r.counts != nullptr && r.offsets != nullptr && r.gather_index != nullptr && r.slot_rows != nullptr,
               op << ": routing's arrays (counts, offsets, gather_index, slot_rows) must all be given");
    for (const auto& [name, ptr] : {std::pair<const char*, const void*>{"counts", r.counts},
                                    {"offsets", r.offsets},
                                    {"gather_index", r.gather_index},
                                    {"slot_rows", r.slot_rows}}) {
        WEFT_CHECK(reinterpret_cast<uintptr_t>(ptr) % 4 == 0,
                   op << ": routing." << name << " (int32) must be 4-byte aligned, got " << ptr);
    }
}

// The kernels of this file (header, instantiation).
struct MoeKernelName {
    const char* name;
    const char* header;
    const char* instantiation;
};
constexpr MoeKernelName kMoeKernels[] = {
    {"routing_count", "moe_tp/moe_routing.cuh", "weft::kernels::moe_tp::moe_routing_count_kernel<0>"},
    {"routing_place", "moe_tp/moe_routing.cuh", "weft::kernels::moe_tp::moe_routing_place_kernel<0>"},
    {"gather", "moe_tp/moe_gather.cuh", "weft::kernels::moe_tp::moe_gather_kernel<0>"},
    {"combine", "moe_tp/moe_gather.cuh", "weft::kernels::moe_tp::moe_combine_kernel<0>"},
    {"combine_ready", "moe_tp/moe_gather.cuh", "weft::kernels::moe_tp::moe_combine_ready_kernel<0>"},
    {"notify", "moe_tp/moe_gather.cuh", "weft::kernels::moe_tp::moe_notify_kernel<0>"},
    {"wait", "moe_tp/moe_gather.cuh", "weft::kernels::moe_tp::moe_wait_kernel<0>"},
    {"push", "moe_tp/moe_gather.cuh", "weft::kernels::moe_tp::moe_push_rows_kernel<0>"},
};

jit::Kernel& moe_kernel(const char* name) { return ops::detail::gemm_jit_kernel(detail::moe_kernel_spec(name)); }

// A grid for a memory-bound kernel over `items` warps of work: ~4 CTAs per SM at most.
int memory_grid(int64_t items) {
    return static_cast<int>(std::clamp<int64_t>(ceil_div(items, kMoeThreads / 32), 1, int64_t{4} * num_sms()));
}

void launch_route(const int32_t* topk_idx, const MoeRouting& r, int64_t align, cudaStream_t stream,
                  MoeRoutingStatus* status) {
    weft::moe::MoeRoutingArgs args{};
    args.topk_idx = topk_idx;
    args.counts = r.counts;
    args.offsets = r.offsets;
    args.gather_index = r.gather_index;
    args.slot_rows = r.slot_rows;
    args.status = status;
    args.tokens = static_cast<int32_t>(r.tokens);
    args.topk = static_cast<int32_t>(r.topk);
    args.num_experts = static_cast<int32_t>(r.num_experts);
    args.align = static_cast<int32_t>(align);
    args.rows_capacity = static_cast<int32_t>(r.rows_capacity);
    moe_kernel("routing_count").launch(launch_params(static_cast<int>(r.num_experts), kMoeThreads, stream), args);
    moe_kernel("routing_place").launch(launch_params(static_cast<int>(r.num_experts) + 1, kMoeThreads, stream), args);
}

void launch_gather(const TensorView& a, const MoeRouting& r, const TensorView& a_rows, cudaStream_t stream) {
    weft::moe::MoeGatherArgs g{};
    g.a = static_cast<const unsigned short*>(a.data);
    g.out = static_cast<unsigned short*>(a_rows.data);
    g.gather_index = r.gather_index;
    g.lda = a.stride(0);
    g.ldo = a_rows.stride(0);
    g.rows = static_cast<int32_t>(r.rows_capacity);
    g.k = static_cast<int32_t>(a.dim(1));
    g.tokens = static_cast<int32_t>(a.dim(0));
    moe_kernel("gather").launch(launch_params(memory_grid(r.rows_capacity), kMoeThreads, stream), g);
}

// The routing's arrays as views (their bytes, for the overlap checks).
TensorView counts_view(const MoeRouting& r) { return ops::detail::int32_array_view(r.counts, r.num_experts); }
TensorView offsets_view(const MoeRouting& r) { return ops::detail::int32_array_view(r.offsets, r.num_experts + 1); }
TensorView gather_index_view(const MoeRouting& r) {
    return ops::detail::int32_array_view(r.gather_index, r.rows_capacity);
}
TensorView slot_rows_view(const MoeRouting& r) { return ops::detail::int32_array_view(r.slot_rows, r.tokens * r.topk); }

// The routing's arrays are read (and, by moe_route, written) by the kernels: this GPU's memory.
void check_routing_on_device(const MoeRouting& r, const char* op, cudaStream_t stream) {
    ops::detail::check_device_views({{"routing.counts", counts_view(r)},
                                     {"routing.offsets", offsets_view(r)},
                                     {"routing.gather_index", gather_index_view(r)},
                                     {"routing.slot_rows", slot_rows_view(r)}},
                                    op, stream);
}

// The gathered GEMM's outputs against what is read while or after they are written: the gather reads gather_index
// while other CTAs write a_rows, and the GEMM reads b and the group arrays after it; the GEMM reads a_rows, b and the
// group arrays while other CTAs write d. (a is read by the gather alone, which ends before the GEMM writes d.)
void check_gathered_apart(const char* op, const MoeRouting& r, const TensorView& b, const TensorView& d,
                          const TensorView& a_rows) {
    ops::detail::check_apart(op, "a_rows", a_rows,
                             {{"routing.gather_index", gather_index_view(r)},
                              {"b", b},
                              {"routing.counts", counts_view(r)},
                              {"routing.offsets", offsets_view(r)}},
                             "the gather writes a_rows while reading gather_index, the GEMM reads the rest after it");
    ops::detail::check_apart(
        op, "d", d,
        {{"a_rows", a_rows}, {"b", b}, {"routing.counts", counts_view(r)}, {"routing.offsets", offsets_view(r)}},
        "the GEMM reads it while other CTAs write d");
}

}  // namespace moe_detail

using namespace moe_detail;  // NOLINT: this file defines them

int64_t moe_gathered_rows(int64_t tokens, int64_t topk, int64_t num_experts, int64_t align) {
    WEFT_CHECK(tokens >= 0 && topk >= 0 && num_experts >= 0 && align >= 1,
               "moe_gathered_rows: tokens, topk, num_experts must be >= 0 and align >= 1, got "
                   << tokens << ", " << topk << ", " << num_experts << ", " << align);
    return tokens * topk + num_experts * (align - 1);
}

void moe_route(const TensorView& topk_idx, MoeRouting& routing, int64_t align, cudaStream_t stream,
               MoeRoutingStatus* status) {
    WEFT_NVTX_RANGE("moe_route");
    check_dense(topk_idx, "moe_route", "topk_idx", DType::kI32, -1, -1);
    // Checked on a copy: a refused call leaves the caller's routing as it was.
    MoeRouting r = routing;
    r.tokens = topk_idx.dim(0);
    r.topk = topk_idx.dim(1);
    WEFT_CHECK(align >= 1 && align <= 4096, "moe_route: align must be in [1, 4096], got " << align);
    check_routing(r, "moe_route");
    WEFT_CHECK(r.rows_capacity >= moe_gathered_rows(r.tokens, r.topk, r.num_experts, align),
               "moe_route: routing.rows_capacity must be >= tokens x topk + E x (align - 1) = "
                   << moe_gathered_rows(r.tokens, r.topk, r.num_experts, align) << ", got " << r.rows_capacity);
    WEFT_CHECK(reinterpret_cast<uintptr_t>(status) % 4 == 0, "moe_route: status must be 4-byte aligned");
    // The placement writes every array while other blocks still read topk_idx (and the counts, to place).
    const TensorView idx_view =
        ops::detail::int32_array_view(static_cast<const int32_t*>(topk_idx.data), r.tokens * r.topk);
    const char* why = "moe_route writes it while other blocks read them";
    ops::detail::check_apart("moe_route", "routing.counts", counts_view(r), {{"topk_idx", idx_view}}, why);
    ops::detail::check_apart("moe_route", "routing.offsets", offsets_view(r),
                             {{"topk_idx", idx_view}, {"routing.counts", counts_view(r)}}, why);
    ops::detail::check_apart(
        "moe_route", "routing.gather_index", gather_index_view(r),
        {{"topk_idx", idx_view}, {"routing.counts", counts_view(r)}, {"routing.offsets", offsets_view(r)}}, why);
    ops::detail::check_apart("moe_route", "routing.slot_rows", slot_rows_view(r),
                             {{"topk_idx", idx_view},
                              {"routing.counts", counts_view(r)},
                              {"routing.offsets", offsets_view(r)},
                              {"routing.gather_index", gather_index_view(r)}},
                             why);
    ops::detail::check_device_views({{"topk_idx", idx_view}}, "moe_route", stream);
    ops::detail::check_device_or_mapped_pointer(status, "status", "moe_route", stream);
    check_routing_on_device(r, "moe_route", stream);
    routing = r;
    launch_route(static_cast<const int32_t*>(topk_idx.data), routing, align, stream, status);
}

std::string describe_routing_status(const MoeRoutingStatus& s) {
    if (s.code == 0) return "";
    std::ostringstream os;
    os << "moe_route: slot " << s.slot << " (token x topk + k) has expert index " << s.value << ", outside [-1, "
       << s.limit << ") (the slot was dropped)";
    return os.str();
}

namespace {

// grouped_gemm_gathered; `check_memory`: also that every buffer is this GPU's memory.
void gathered(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout,
              const MoeRouting& routing, const TensorView& a_rows, cudaStream_t stream,
              const GroupedGemmOptions& options, bool check_memory) {
    WEFT_NVTX_RANGE("grouped_gemm_gathered");
    constexpr const char* kOp = "grouped_gemm_gathered";
    check_routing(routing, kOp);
    check_matrix(a, kOp, "a", DType::kBF16, routing.tokens, -1, false);
    check_matrix(a_rows, kOp, "a_rows", DType::kBF16, routing.rows_capacity, a.dim(1));
    WEFT_CHECK(!ops::detail::views_overlap(a_rows, a), kOp << ": a_rows (the workspace) must not overlap a, got a_rows "
                                                           << a_rows.data << " (" << a_rows.describe() << "), a "
                                                           << a.data << " (" << a.describe() << ")");
    WEFT_CHECK(b.ndim == 3 && b.dim(0) == routing.num_experts,
               kOp << ": b must be [E, ...] with E = routing.num_experts = " << routing.num_experts << ", got "
                   << b.describe());
    // The grouped GEMM checks b, d and the dtypes against a_rows; its options are checked before the gather runs.
    const GroupedGemmProblem p =
        validate_grouped_gemm_args(GroupedLayout::kContiguous, a_rows, b, d, b_layout, routing.offsets, routing.counts);
    ops::detail::check_grouped_gemm_options(options, p);
    // The gather runs first and waits for nothing: rows a producer is still writing would be copied stale, and the
    // GEMM's per-group wait would then guard a copy already made.
    WEFT_CHECK(!options.wait, kOp << ": options.wait is not supported (the gather that copies a's rows runs before the "
                                     "GEMM and waits for nothing): make a ready before the call, in stream order");
    check_gathered_apart(kOp, routing, b, d, a_rows);
    if (routing.rows_capacity == 0) return;
    ops::detail::check_grouped_gemm_launch(p, options);  // before the gather is enqueued
    if (check_memory) {
        ops::detail::check_device_views({{"a", a}, {"a_rows", a_rows}, {"b", b}, {"d", d}}, kOp, stream);
        ops::detail::check_grouped_option_words(options, kOp, stream);
        check_routing_on_device(routing, kOp, stream);
    }
    launch_gather(a, routing, a_rows, stream);
    ops::detail::grouped_gemm_contiguous_on_device(a_rows, b, d, b_layout, routing.offsets, routing.counts, stream,
                                                   options);
}

// The operands of a combine of `n` columns (d_rows, out, weights) against the routing: moe_combine's checks,
// which grouped_gemm_gathered_combine makes before it launches its GEMM.
void check_combine_operands(const char* op, const MoeRouting& routing, MoeCombineMode mode, int64_t n,
                            const TensorView& d_rows, const TensorView& weights, const TensorView& out) {
    check_matrix(d_rows, op, "d_rows", DType::kF32, routing.rows_capacity, n);
    const bool sum = mode == MoeCombineMode::kWeightedSum;
    WEFT_CHECK(out.dtype == DType::kBF16 || out.dtype == DType::kF32,
               op << ": out must be bf16 or f32, got " << dtype_name(out.dtype));
    check_matrix(out, op, "out", out.dtype, sum ? routing.tokens : routing.tokens * routing.topk, n);
    if (weights.numel() > 0 || weights.data != nullptr) {
        check_dense(weights, op, "weights", DType::kF32, routing.tokens, routing.topk);
    }
    // The combine writes out while other warps read d_rows, the weights and the routing's arrays.
    const std::initializer_list<ops::detail::NamedView> read = {{"d_rows", d_rows},
                                                                {"weights", weights},
                                                                {"routing.slot_rows", slot_rows_view(routing)},
                                                                {"routing.counts", counts_view(routing)},
                                                                {"routing.offsets", offsets_view(routing)}};
    const char* why = "the combine writes it while other warps read them";
    ops::detail::check_apart(op, "out", out, read, why);
}

// moe_combine; `check_memory`: also that every buffer is this GPU's memory.
void combine(const TensorView& d_rows, const MoeRouting& routing, MoeCombineMode mode, const TensorView& weights,
             const TensorView& out, cudaStream_t stream, bool check_memory) {
    WEFT_NVTX_RANGE("moe_combine");
    constexpr const char* kOp = "moe_combine";
    WEFT_CHECK(mode == MoeCombineMode::kPerSlot || mode == MoeCombineMode::kWeightedSum,
               kOp << ": mode must be kPerSlot or kWeightedSum, got " << static_cast<int>(mode));
    check_routing(routing, kOp);
    const int64_t n = d_rows.ndim == 2 ? d_rows.dim(1) : -1;
    WEFT_CHECK(
        n >= 0 && n % 8 == 0 && n <= kGemmMaxExtent,
        kOp << ": d_rows must be [rows, N] with N a multiple of 8 (at most 2^31 - 2^24), got " << d_rows.describe());
    check_combine_operands(kOp, routing, mode, n, d_rows, weights, out);
    if (routing.tokens == 0 || n == 0) return;
    if (check_memory) {
        ops::detail::check_device_views({{"d_rows", d_rows}, {"weights", weights}, {"out", out}}, kOp, stream);
        check_routing_on_device(routing, kOp, stream);
    }
    weft::moe::MoeCombineArgs c{};
    c.partials[0] = static_cast<const float*>(d_rows.data);
    c.slot_rows = routing.slot_rows;
    c.counts = routing.counts;
    c.offsets = routing.offsets;
    c.weights = static_cast<const float*>(weights.data);
    c.out = out.data;
    c.ldp = d_rows.stride(0);
    c.ldo = out.stride(0);
    c.num_sources = 1;
    c.num_experts = static_cast<int32_t>(routing.num_experts);
    c.topk = static_cast<int32_t>(routing.topk);
    c.n = static_cast<int32_t>(n);
    c.token_begin = 0;
    c.tokens = static_cast<int32_t>(routing.tokens);
    c.rows = static_cast<int32_t>(routing.rows_capacity);
    c.mode = mode;
    c.out_f32 = out.dtype == DType::kF32 ? 1 : 0;
    moe_kernel("combine_ready").launch(launch_params(memory_grid(routing.tokens), kMoeThreads, stream), c);
}

}  // namespace

void grouped_gemm_gathered(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout,
                           const MoeRouting& routing, const TensorView& a_rows, cudaStream_t stream,
                           const GroupedGemmOptions& options) {
    gathered(a, b, d, b_layout, routing, a_rows, stream, options, true);
}

void moe_combine(const TensorView& d_rows, const MoeRouting& routing, MoeCombineMode mode, const TensorView& weights,
                 const TensorView& out, cudaStream_t stream) {
    combine(d_rows, routing, mode, weights, out, stream, true);
}

void grouped_gemm_gathered_combine(const TensorView& a, const TensorView& b, const TensorView& out, BLayout b_layout,
                                   const MoeRouting& routing, MoeCombineMode mode, const TensorView& weights,
                                   const TensorView& a_rows, const TensorView& d_rows, cudaStream_t stream,
                                   const GroupedGemmOptions& options) {
    WEFT_NVTX_RANGE("grouped_gemm_gathered_combine");
    constexpr const char* kOp = "grouped_gemm_gathered_combine";
    WEFT_CHECK(mode == MoeCombineMode::kPerSlot || mode == MoeCombineMode::kWeightedSum,
               kOp << ": mode must be kPerSlot or kWeightedSum, got " << static_cast<int>(mode));
    check_routing(routing, kOp);
    const int64_t n = b.ndim == 3 ? (b_layout == BLayout::kNK ? b.dim(1) : b.dim(2)) : -1;
    WEFT_CHECK(n >= 0 && n % 8 == 0, kOp << ": N (b's output columns) must be a multiple of 8, got " << b.describe());
    check_combine_operands(kOp, routing, mode, n, d_rows, weights, out);
    ops::detail::check_apart(kOp, "d_rows", d_rows,
                             {{"weights", weights}, {"routing.slot_rows", slot_rows_view(routing)}},
                             "the combine reads them after the GEMM writes d_rows");
    ops::detail::check_apart(kOp, "a_rows", a_rows,
                             {{"weights", weights}, {"routing.slot_rows", slot_rows_view(routing)}},
                             "the combine reads them after the gather writes a_rows");
    // Every buffer once, before anything is enqueued.
    ops::detail::check_device_views(
        {{"a", a}, {"a_rows", a_rows}, {"b", b}, {"d_rows", d_rows}, {"weights", weights}, {"out", out}}, kOp, stream);
    ops::detail::check_grouped_option_words(options, kOp, stream);
    check_routing_on_device(routing, kOp, stream);
    gathered(a, b, d_rows, b_layout, routing, a_rows, stream, options, false);
    combine(d_rows, routing, mode, weights, out, stream, false);
}

namespace detail {

jit::KernelSpec moe_kernel_spec(const std::string& name, const std::string& arch) {
    for (const MoeKernelName& k : kMoeKernels) {
        if (name == k.name) return tp_detail::make_spec(k.header, k.instantiation, std::string("moe ") + k.name, arch);
    }
    WEFT_FAIL("moe: no kernel named '" << name << "'");
}

std::vector<std::string> moe_kernel_names() {
    std::vector<std::string> out;
    for (const MoeKernelName& k : kMoeKernels) out.emplace_back(k.name);
    return out;
}

}  // namespace detail

}  // namespace weft::ops
