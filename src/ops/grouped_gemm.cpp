// SPDX-License-Identifier: MIT
// weft::ops::grouped_gemm: validation, planning, tensor maps and the launch of weft's GEMM kernel with a grouped
// tile scheduler (kernels/gemm/gemm_scheduler.cuh, GroupedScheduler).
#include "weft/ops/grouped_gemm.hpp"

#include "collective_workspace.hpp"
#include "grouped_gemm_internal.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>
#include <tuple>
#include <utility>

#include "weft/common/math.hpp"
#include "weft/detail/gemm_launch.hpp"
#include "weft/jit/aot.hpp"
#include "weft/jit/kernel.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/nvtx.hpp"

namespace weft::ops {
namespace {

constexpr int64_t kMaxCoord = (int64_t{1} << 31) - 1;  // TMA coordinates and the kernel's row indices are int32

// Checks a row-major view of `ndim` dimensions (inner stride 1, 16-byte aligned base and outer strides, extents
// within int32); `shape_text` names the expected shape.
void check_view(const TensorView& v, const char* name, int ndim, const char* shape_text) {
    WEFT_CHECK(v.ndim == ndim, "grouped_gemm: " << name << " must be " << shape_text << " (" << ndim
                                                << " dimensions), got " << v.describe());
    for (int i = 0; i < ndim; ++i) {
        WEFT_CHECK(v.dim(i) >= 0 && v.dim(i) <= kGemmMaxExtent,
                   "grouped_gemm: " << name << "'s extents must be in [0, 2^31 - 2^24 = " << kGemmMaxExtent
                                    << "] (int32 tile and TMA coordinates), got " << v.describe());
    }
    WEFT_CHECK(v.dim(ndim - 1) <= 1 || v.stride(ndim - 1) == 1,
               "grouped_gemm: " << name << " must be row-major (inner stride 1), got " << v.describe());
    if (v.numel() == 0) return;
    WEFT_CHECK(v.data != nullptr, "grouped_gemm: " << name << " has a null data pointer (" << v.describe() << ")");
    WEFT_CHECK(reinterpret_cast<uintptr_t>(v.data) % 16 == 0,
               "grouped_gemm: " << name << "'s base address must be 16-byte aligned (TMA), got " << v.data);
    const int64_t elem = dtype_bytes(v.dtype);
    for (int i = 0; i + 1 < ndim; ++i) {
        WEFT_CHECK(v.dim(i) <= 1 || (v.stride(i) * elem) % 16 == 0,
                   "grouped_gemm: " << name << "'s stride " << i << " must be a multiple of 16 bytes (TMA), got "
                                    << v.describe());
        // Past the elements the inner dimensions span (a dimension of extent 1 spans nothing, whatever its stride).
        int64_t inner_span = 1;
        for (int j = i + 1; j < ndim; ++j) inner_span += (v.dim(j) - 1) * v.stride(j);
        WEFT_CHECK(v.dim(i) <= 1 || v.stride(i) >= inner_span,
                   "grouped_gemm: " << name << "'s rows must not overlap (stride " << i << " >= the " << inner_span
                                    << " elements the inner dimensions span), got " << v.describe());
    }
}

// A view's rows seen as one [rows, cols] matrix: a 2-D view as is; a 3-D [G, capacity, cols] one whose groups are
// back to back (stride(0) = capacity * stride(1), checked by the caller).
TensorView as_rows(const TensorView& v) {
    if (v.ndim == 2) return v;
    return TensorView(v.data, v.dtype, {v.dim(0) * v.dim(1), v.dim(2)}, {v.stride(1), 1});
}

CUtensorMapDataType tma_dtype(DType t) {
    switch (t) {
        case DType::kBF16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
        case DType::kF16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
        default: break;
    }
    WEFT_FAIL("grouped_gemm: no tensor-map type for input dtype " << dtype_name(t));
}

// A tiled, 128B-swizzled tensor map of `rank` dimensions (innermost first); strides in bytes of dims 1.., each a
// multiple of 16 (an extent-1 dimension's stride is never followed: rounded up to a legal value).
void encode(CUtensorMap* map, const char* name, DType dtype, void* data, int rank, const uint64_t* dims,
            const uint64_t* strides_in, const uint32_t* box) {
    uint64_t strides[2] = {0, 0};
    for (int i = 0; i + 1 < rank; ++i) {
        strides[i] = dims[i + 1] <= 1 ? std::max<uint64_t>(round_up(static_cast<int64_t>(strides_in[i]), 16), 16)
                                      : strides_in[i];
    }
    const uint32_t elem_strides[3] = {1, 1, 1};
    const CUresult r = driver().cuTensorMapEncodeTiled(
        map, tma_dtype(dtype), static_cast<unsigned>(rank), data, dims, strides, box, elem_strides,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    WEFT_CHECK(r == CUDA_SUCCESS, "grouped_gemm: cuTensorMapEncodeTiled failed for " << name << ": CUresult "
                                                                                    << static_cast<int>(r));
}

// The kernel's tensor maps: A [rows, K] as the dense GEMM's, B [G, ...] as a 3D map whose box is one group's, D
// through the dense GEMM's store map.
detail::GemmTensorMaps make_maps(const GemmConfig& c, const TensorView& a_rows, const TensorView& b,
                                 const TensorView& d_rows) {
    detail::GemmTensorMaps maps;
    std::memset(&maps, 0, sizeof(maps));
    const uint64_t elem = static_cast<uint64_t>(dtype_bytes(a_rows.dtype));
    {
        const uint64_t dims[2] = {static_cast<uint64_t>(a_rows.dim(1)), static_cast<uint64_t>(a_rows.dim(0))};
        const uint64_t strides[1] = {static_cast<uint64_t>(a_rows.stride(0)) * elem};
        const uint32_t box[2] = {static_cast<uint32_t>(c.tile_k), static_cast<uint32_t>(c.tile_m)};
        encode(&maps.a, "a", a_rows.dtype, a_rows.data, 2, dims, strides, box);
    }
    {
        const uint64_t dims[3] = {static_cast<uint64_t>(b.dim(2)), static_cast<uint64_t>(b.dim(1)),
                                  static_cast<uint64_t>(b.dim(0))};
        const uint64_t strides[2] = {static_cast<uint64_t>(b.stride(1)) * elem, static_cast<uint64_t>(b.stride(0)) * elem};
        // kNK: {64 k, tile_n rows of B, 1 group}; kKN: {64 n, 64 k, 1 group} (tile_n / 64 boxes per stage).
        const uint32_t box[3] = {static_cast<uint32_t>(c.b_layout == BLayout::kNK ? c.tile_k : 64),
                                 static_cast<uint32_t>(c.b_layout == BLayout::kNK ? c.tile_n : c.tile_k), 1};
        encode(&maps.b, "b", b.dtype, b.data, 3, dims, strides, box);
    }
    maps.d = detail::make_gemm_store_map(c, d_rows);
    return maps;
}

int current_device() {
    int device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    return device;
}

// The GEMM's plan, with the checks that depend on it (the signal's group stride against its tile height) and on the
// options' timeout: made before anything is enqueued (the masked fp8 path's dequantisation and the gathered path's
// gather run first).
GroupedGemmPlan checked_plan(const GroupedGemmProblem& p, const GroupedGemmOptions& options) {
    const int device = current_device();
    int num_sms = 0;
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
    const GroupedGemmPlan plan = plan_grouped_gemm(p, num_sms, options);
    GemmOptions dense_options;
    dense_options.timeout = options.timeout;
    (void)detail::gemm_timeout_ns(dense_options);
    if (options.signal && options.signal->mode == GroupedSignalMode::kAddPerGroupTileRow) {
        // A group's counters are its rows of tiles: as many as the rows a group can have (masked: the capacity;
        // contiguous: every row of A) over the plan's tile height.
        const int64_t rows_of_tiles =
            ceil_div(p.layout == GroupedLayout::kMasked ? p.capacity : p.rows, int64_t{plan.config.tile_m});
        WEFT_CHECK(options.signal->group_stride >= rows_of_tiles,
                   "grouped_gemm: options.signal.group_stride must cover a group's rows of tiles (ceil("
                       << (p.layout == GroupedLayout::kMasked ? "capacity " : "rows ")
                       << (p.layout == GroupedLayout::kMasked ? p.capacity : p.rows) << " / tile_m "
                       << plan.config.tile_m << ") = " << rows_of_tiles << "), got " << options.signal->group_stride);
    }
    return plan;
}

void launch(const GroupedGemmProblem& p, const TensorView& a, const TensorView& b, const TensorView& d,
            const int32_t* offsets, const int32_t* counts, cudaStream_t stream, const GroupedGemmOptions& options) {
    if (p.groups == 0 || p.rows == 0 || p.n == 0) return;  // nothing to write
    const TensorView a_rows = as_rows(a);
    const TensorView d_rows = as_rows(d);
    const GroupedGemmPlan plan = checked_plan(p, options);

    GroupedSchedulerParams groups{};
    groups.counts = counts;
    groups.offsets = p.layout == GroupedLayout::kContiguous ? offsets : nullptr;
    groups.num_groups = static_cast<int32_t>(p.groups);
    groups.capacity = static_cast<int32_t>(p.capacity);
    groups.status = options.status;

    GemmOptions dense_options;
    dense_options.timeout = options.timeout;
    const uint64_t timeout_ns = detail::gemm_timeout_ns(dense_options);
    const detail::GemmTensorMaps maps = make_maps(plan.config, a_rows, b, d_rows);
    const GemmArgs args = detail::make_gemm_args(a_rows, d_rows, timeout_ns);

    const bool wait = options.wait.has_value();
    const bool signal = options.signal.has_value();
    jit::Kernel& kernel = detail::gemm_jit_kernel(grouped_gemm_kernel_spec(plan.config, wait, signal));
    const weft::gemm::NoEpilogueHookParams no_hook{};
    if (wait) {
        GroupedWaitParams w = *options.wait;
        w.groups = groups;
        if (w.timeout_ns == 0) w.timeout_ns = timeout_ns;
        if (signal) {
            detail::launch_gemm_kernel(kernel, plan.config, maps, args, plan.grid, w, *options.signal, stream);
        } else {
            detail::launch_gemm_kernel(kernel, plan.config, maps, args, plan.grid, w, no_hook, stream);
        }
    } else if (signal) {
        detail::launch_gemm_kernel(kernel, plan.config, maps, args, plan.grid, groups, *options.signal, stream);
    } else {
        detail::launch_gemm_kernel(kernel, plan.config, maps, args, plan.grid, groups, no_hook, stream);
    }
}

// The options plan_grouped_gemm reads.
void check_plan_options(const GroupedGemmOptions& options, const GroupedGemmProblem& p) {
    WEFT_CHECK(options.sm_budget >= 0, "grouped_gemm: options.sm_budget must be >= 0, got " << options.sm_budget);
    WEFT_CHECK(options.expected_rows_per_group >= 0,
               "grouped_gemm: options.expected_rows_per_group must be >= 0, got " << options.expected_rows_per_group);
    if (options.config) {
        const GemmConfig& c = *options.config;
        WEFT_CHECK(is_valid_grouped(c),
                   "grouped_gemm: options.config must be a valid cluster-free config without swap_ab or split-K "
                   "(is_valid_grouped), got "
                       << format_gemm_config(c));
        WEFT_CHECK(c.in_dtype == p.in_dtype && c.out_dtype == p.out_dtype && c.b_layout == p.b_layout,
                   "grouped_gemm: options.config's dtypes/layout must match the call, got " << format_gemm_config(c));
        WEFT_CHECK(!options.wait || is_valid_grouped_wait(c),
                   "grouped_gemm: with options.wait, options.config must have at most 128 accumulators per consumer "
                   "thread (is_valid_grouped_wait), got "
                       << format_gemm_config(c));
    }
}

// The kernel reads A, B and the group arrays while other CTAs write D: their bytes must not meet D's. `a_name` names
// the caller's argument that is A.
void check_output_apart(const char* op, const GroupedGemmProblem& p, const char* a_name, const TensorView& a,
                        const TensorView& b, const TensorView& d, const int32_t* offsets, const int32_t* counts);

}  // namespace

namespace detail {

namespace {

// Row-major matrices with the same row pitch whose rows fit it (a [M, K] slice of a wider buffer): the bytes each
// touches, row by row. Two such views meet only where a row of one meets a row of the other.
struct RowsInPitch {
    int64_t begin, rows, width, pitch;  // bytes; width <= pitch
};

std::optional<RowsInPitch> rows_in_pitch(const TensorView& v) {
    if (v.ndim != 2 || v.stride(1) != 1 || v.dim(0) < 1 || v.dim(1) < 1) return std::nullopt;
    const int64_t es = dtype_bytes(v.dtype);
    const int64_t width = v.dim(1) * es, pitch = v.stride(0) * es;
    if (pitch < width) return std::nullopt;
    return RowsInPitch{static_cast<int64_t>(reinterpret_cast<uintptr_t>(v.data)), v.dim(0), width, pitch};
}

}  // namespace

bool views_overlap(const TensorView& x, const TensorView& y) {
    const auto span = [](const TensorView& v) -> std::pair<uintptr_t, uintptr_t> {
        if (v.numel() == 0) return {0, 0};
        int64_t last = 0;  // the offset of the last element, in elements
        for (int i = 0; i < v.ndim; ++i) last += (v.dim(i) - 1) * v.stride(i);
        const auto begin = reinterpret_cast<uintptr_t>(v.data);
        return {begin, begin + static_cast<uintptr_t>((last + 1) * dtype_bytes(v.dtype))};
    };
    const auto [x0, x1] = span(x);
    const auto [y0, y1] = span(y);
    if (!(x0 < x1 && y0 < y1 && x0 < y1 && y0 < x1)) return false;
    // The spans meet; column slices of one buffer ([M, K] and [M, N] side by side) still touch different bytes.
    const auto rx = rows_in_pitch(x), ry = rows_in_pitch(y);
    if (!rx || !ry || rx->pitch != ry->pitch) return true;
    // y's row q starts d + (q - r) * pitch bytes after x's row r; they meet where that shift lies in (-wy, wx).
    // Widths are at most the pitch, so only the two row distances around -d / pitch can.
    const int64_t pitch = rx->pitch, d = ry->begin - rx->begin;
    const int64_t k0 = (-d >= 0 ? -d / pitch : -((d + pitch - 1) / pitch));  // floor(-d / pitch)
    for (int64_t k = k0; k <= k0 + 1; ++k) {
        if (k <= -rx->rows || k >= ry->rows) continue;  // q - r for some row r of x and q of y
        const int64_t shift = d + k * pitch;
        if (shift > -ry->width && shift < rx->width) return true;
    }
    return false;
}

TensorView int32_array_view(const int32_t* data, int64_t count) {
    return TensorView(const_cast<int32_t*>(data), DType::kI32, {data == nullptr ? 0 : count});
}

void check_apart(const char* op, const char* out_name, const TensorView& out, std::initializer_list<NamedView> inputs,
                 const char* why) {
    for (const NamedView& in : inputs) {
        WEFT_CHECK(!views_overlap(out, in.view), op << ": " << out_name << " must not overlap " << in.name << " ("
                                                    << why << "), got " << out_name << " " << out.describe() << " at "
                                                    << out.data << ", " << in.name << " " << in.view.describe()
                                                    << " at " << in.view.data);
    }
}

void check_grouped_option_words(const GroupedGemmOptions& options, const char* op, cudaStream_t stream) {
    check_device_or_mapped_pointer(options.status, "options.status", op, stream);
    if (options.wait) {
        check_device_or_mapped_pointer(options.wait->flags, "options.wait.flags", op, stream);
        check_device_or_mapped_pointer(options.wait->epoch, "options.wait.epoch", op, stream);
        check_device_or_mapped_pointer(options.wait->groups_ready, "options.wait.groups_ready", op, stream);
        check_device_or_mapped_pointer(options.wait->abort_flag, "options.wait.abort_flag", op, stream);
    }
    if (options.signal) check_device_or_mapped_pointer(options.signal->flags, "options.signal.flags", op, stream);
}

void check_grouped_gemm_options(const GroupedGemmOptions& options, const GroupedGemmProblem& p) {
    check_plan_options(options, p);
    WEFT_CHECK(options.timeout.count() >= 0,
               "grouped_gemm: options.timeout must be >= 0 ms (0: WEFT_TIMEOUT_MS or 10 s), got "
                   << options.timeout.count() << " ms");
    if (options.wait) {
        WEFT_CHECK(options.wait->flags != nullptr && reinterpret_cast<uintptr_t>(options.wait->flags) % 8 == 0,
                   "grouped_gemm: options.wait.flags must be a non-null, 8-byte aligned array of " << p.groups
                                                                                                 << " signals");
        WEFT_CHECK(options.wait->value_mode != weft::gemm::SignalValueMode::kEpoch || options.wait->epoch != nullptr,
                   "grouped_gemm: options.wait.value_mode kEpoch needs options.wait.epoch");
    }
    if (options.signal) {
        WEFT_CHECK(options.signal->flags != nullptr && reinterpret_cast<uintptr_t>(options.signal->flags) % 8 == 0,
                   "grouped_gemm: options.signal.flags must be a non-null, 8-byte aligned array");
        WEFT_CHECK(options.signal->mode == GroupedSignalMode::kAddPerGroup ||
                       (options.signal->mode == GroupedSignalMode::kAddPerGroupTileRow &&
                        options.signal->group_stride > 0),
                   "grouped_gemm: options.signal.mode must be kAddPerGroup, or kAddPerGroupTileRow with a positive "
                   "group_stride, got mode "
                       << static_cast<int>(options.signal->mode) << ", group_stride " << options.signal->group_stride);
    }
    WEFT_CHECK(reinterpret_cast<uintptr_t>(options.status) % 4 == 0,
               "grouped_gemm: options.status must be 4-byte aligned, got " << static_cast<void*>(options.status));
}

}  // namespace detail

namespace {

void check_output_apart(const char* op, const GroupedGemmProblem& p, const char* a_name, const TensorView& a,
                        const TensorView& b, const TensorView& d, const int32_t* offsets, const int32_t* counts) {
    const int64_t offset_words = p.layout == GroupedLayout::kContiguous ? p.groups : 0;
    detail::check_apart(op, "d", d,
                        {{a_name, a},
                         {"b", b},
                         {"counts", detail::int32_array_view(counts, p.groups)},
                         {"offsets", detail::int32_array_view(offsets, offset_words)}},
                        "the kernel reads it while other CTAs write d");
}

}  // namespace

GroupedRowSpread grouped_row_spreads(const GroupedGemmProblem& p, int64_t rows_per_group) {
    const int64_t groups = std::max<int64_t>(p.groups, 1);
    const bool masked = p.layout == GroupedLayout::kMasked && p.capacity > 0;
    // Rows are int32 tile coordinates: a larger estimate (expected_rows_per_group is the caller's) only overflows.
    const int64_t per_group = std::min(std::max<int64_t>(rows_per_group, 1), masked ? p.capacity : int64_t{kMaxCoord});
    GroupedRowSpread s;
    s.even_groups = groups;
    s.even_rows = per_group;
    // The same rows in as few groups as hold them: masked, groups filled to the capacity; contiguous, one group.
    const int64_t total = groups * per_group;
    if (masked) {
        s.full_groups = std::min(groups, total / p.capacity);
        s.full_rows = p.capacity;
        s.rest_rows = s.full_groups < groups ? std::min(total - s.full_groups * p.capacity, p.capacity) : 0;
    } else {
        s.full_groups = 0;
        s.full_rows = 0;
        s.rest_rows = total;
    }
    return s;
}

namespace {

// The dense cost model (gemm_config_cost) on the rows a grouped call's tiles cover: `groups` groups of `rows_each`
// rows and one of `extra_rows`, each rounded up to whole tiles. With `waves` kUnrounded, the last wave is not rounded
// up (the even spread: the groups' counts differ from one another, so how many tiles they make, and how full their
// last wave is, is not known; 11131 rows over 8 experts at 4096 x 7168 make 88 tile rows spread evenly, where ping-pong
// 128x176 fills exactly 16 waves, and 89 in the benchmark's skew, where it needs a 17th).
double grouped_config_cost(const GroupedGemmProblem& p, const GemmConfig& c, int budget, int64_t groups,
                           int64_t rows_each, int64_t extra_rows, GemmWaves waves = GemmWaves::kWhole) {
    GemmProblem dense;
    dense.m = std::max<int64_t>(1, groups * round_up(rows_each, c.tile_m) + round_up(extra_rows, c.tile_m));
    dense.n = p.n;
    dense.k = p.k;
    dense.b_layout = p.b_layout;
    dense.in_dtype = p.in_dtype;
    dense.out_dtype = p.out_dtype;
    return gemm_config_cost(dense, c, budget, 0, waves);
}

}  // namespace

GemmConfig pick_grouped_config(const GroupedGemmProblem& p, int64_t rows_per_group, int budget, bool waits) {
    WEFT_CHECK(budget > 0, "grouped_gemm: the SM budget must be positive, got " << budget);
    const std::vector<GemmConfig> configs = grouped_gemm_candidate_configs(p.in_dtype, p.out_dtype, p.b_layout, waits);
    WEFT_CHECK(!configs.empty(), "grouped_gemm: no config for in " << dtype_name(p.in_dtype) << ", out "
                                                                   << dtype_name(p.out_dtype));
    const GroupedRowSpread s = grouped_row_spreads(p, rows_per_group);
    std::vector<double> even(configs.size()), packed(configs.size());
    double best_even = std::numeric_limits<double>::infinity(), best_packed = best_even;
    for (size_t i = 0; i < configs.size(); ++i) {
        even[i] = grouped_config_cost(p, configs[i], budget, s.even_groups, s.even_rows, 0, GemmWaves::kUnrounded);
        packed[i] = grouped_config_cost(p, configs[i], budget, s.full_groups, s.full_rows, s.rest_rows);
        best_even = std::min(best_even, even[i]);
        best_packed = std::min(best_packed, packed[i]);
    }
    // The counts are read on the device, so the plan does not know how the expected rows fall: the pick is the config
    // whose worse ratio to the best config of each spread is smallest (ties: the earlier candidate).
    size_t pick = 0;
    double pick_regret = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < configs.size(); ++i) {
        const double regret = std::max(even[i] / best_even, packed[i] / best_packed);
        if (regret < pick_regret * 0.999) {
            pick_regret = regret;
            pick = i;
        }
    }
    return configs[pick];
}

GroupedGemmProblem validate_grouped_gemm_args(GroupedLayout layout, const TensorView& a, const TensorView& b,
                                              const TensorView& d, BLayout b_layout, const int32_t* offsets,
                                              const int32_t* counts) {
    WEFT_CHECK(layout == GroupedLayout::kContiguous || layout == GroupedLayout::kMasked,
               "grouped_gemm: layout must be GroupedLayout::kContiguous or kMasked, got " << static_cast<int>(layout));
    WEFT_CHECK(b_layout == BLayout::kNK || b_layout == BLayout::kKN,
               "grouped_gemm: b_layout must be BLayout::kNK or BLayout::kKN, got " << static_cast<int>(b_layout));
    const bool masked = layout == GroupedLayout::kMasked;
    check_view(a, "a", masked ? 3 : 2, masked ? "[G, capacity, K]" : "[rows, K]");
    check_view(b, "b", 3, b_layout == BLayout::kNK ? "[G, N, K]" : "[G, K, N]");
    check_view(d, "d", masked ? 3 : 2, masked ? "[G, capacity, N]" : "[rows, N]");
    WEFT_CHECK(a.dtype == DType::kBF16 || a.dtype == DType::kF16,
               "grouped_gemm: a must be bf16 or f16, got " << dtype_name(a.dtype));
    WEFT_CHECK(b.dtype == a.dtype,
               "grouped_gemm: b must have a's dtype " << dtype_name(a.dtype) << ", got " << dtype_name(b.dtype));
    WEFT_CHECK(d.dtype == a.dtype || d.dtype == DType::kF32,
               "grouped_gemm: d must be " << dtype_name(a.dtype) << " (the input dtype) or f32, got "
                                          << dtype_name(d.dtype));
    GroupedGemmProblem p;
    p.layout = layout;
    p.groups = b.dim(0);
    p.b_layout = b_layout;
    p.in_dtype = a.dtype;
    p.out_dtype = d.dtype;
    p.k = masked ? a.dim(2) : a.dim(1);
    p.n = b_layout == BLayout::kNK ? b.dim(1) : b.dim(2);
    const int64_t b_k = b_layout == BLayout::kNK ? b.dim(2) : b.dim(1);
    WEFT_CHECK(b_k == p.k, "grouped_gemm: b (" << (b_layout == BLayout::kNK ? "[G, N, K]" : "[G, K, N]")
                                               << ") must have K = " << p.k << " (a's columns), got " << b.describe());
    WEFT_CHECK(p.k >= 8 && p.k % 8 == 0, "grouped_gemm: K (a's columns) must be a positive multiple of 8, got " << p.k);
    WEFT_CHECK(p.groups <= kMaxCoord, "grouped_gemm: too many groups: " << p.groups);
    if (masked) {
        p.capacity = a.dim(1);
        WEFT_CHECK(a.dim(0) == p.groups, "grouped_gemm: a must be [G, capacity, K] with G = " << p.groups
                                                                                          << " (b's groups), got "
                                                                                          << a.describe());
        WEFT_CHECK(d.dim(0) == p.groups && d.dim(1) == p.capacity && d.dim(2) == p.n,
                   "grouped_gemm: d must be [G, capacity, N] = [" << p.groups << ", " << p.capacity << ", " << p.n
                                                                  << "], got " << d.describe());
        WEFT_CHECK(a.dim(0) <= 1 || a.dim(1) == 0 || a.stride(0) == a.dim(1) * a.stride(1),
                   "grouped_gemm: a's groups must be back to back (stride(0) = capacity x stride(1)), got "
                       << a.describe());
        WEFT_CHECK(d.dim(0) <= 1 || d.dim(1) == 0 || d.stride(0) == d.dim(1) * d.stride(1),
                   "grouped_gemm: d's groups must be back to back (stride(0) = capacity x stride(1)), got "
                       << d.describe());
        p.rows = p.groups * p.capacity;
    } else {
        p.rows = a.dim(0);
        WEFT_CHECK(d.dim(0) == p.rows && d.dim(1) == p.n,
                   "grouped_gemm: d must be [rows, N] = [" << p.rows << ", " << p.n << "], got " << d.describe());
        WEFT_CHECK(p.groups == 0 || offsets != nullptr,
                   "grouped_gemm: offsets (device memory, one int32 per group) must be given for the contiguous "
                   "layout");
        WEFT_CHECK(reinterpret_cast<uintptr_t>(offsets) % 4 == 0,
                   "grouped_gemm: offsets must be 4-byte aligned, got " << static_cast<const void*>(offsets));
    }
    WEFT_CHECK(p.rows <= kGemmMaxExtent, "grouped_gemm: a has too many rows for int32 tile indices: "
                                             << p.rows << " (at most 2^31 - 2^24 = " << kGemmMaxExtent << ")");
    WEFT_CHECK(p.groups == 0 || counts != nullptr,
               "grouped_gemm: counts (device memory, one int32 per group) must be given");
    WEFT_CHECK(reinterpret_cast<uintptr_t>(counts) % 4 == 0,
               "grouped_gemm: counts must be 4-byte aligned, got " << static_cast<const void*>(counts));
    return p;
}

std::vector<GemmConfig> grouped_gemm_candidate_configs(DType in_dtype, DType out_dtype, BLayout b_layout, bool waits) {
    const auto fits = [waits](const GemmConfig& c) { return waits ? is_valid_grouped_wait(c) : is_valid_grouped(c); };
    // The dense candidates that a grouped call can run (is_valid_grouped), then ping-pong 128x128 (the dense set has
    // it only in cluster pairs) and ping-pong 64x256 (groups of a few hundred rows: 64-row tiles waste at most 63 rows
    // per group, with the arithmetic intensity of a 128x128 tile).
    std::vector<GemmConfig> out;
    for (int i = 0; i < kGemmNumCandidates; ++i) {
        const GemmConfig c = gemm_candidate(i, in_dtype, out_dtype, b_layout);
        if (fits(c)) out.push_back(c);
    }
    for (const auto& [tile_m, tile_n, stages] : {std::tuple{128, 128, 6}, std::tuple{64, 256, 4}}) {
        GemmConfig pp = gemm_candidate(0, in_dtype, out_dtype, b_layout);
        pp.tile_m = tile_m;
        pp.tile_n = tile_n;
        pp.stages = stages;
        pp.pingpong = true;
        if (fits(pp)) out.push_back(pp);
    }
    return out;
}

GroupedGemmPlan plan_grouped_gemm(const GroupedGemmProblem& p, int num_sms, const GroupedGemmOptions& options) {
    WEFT_CHECK(num_sms > 0, "grouped_gemm: the device must report a positive SM count, got " << num_sms);
    check_plan_options(options, p);
    const int budget = options.sm_budget > 0 ? std::min(options.sm_budget, num_sms) : num_sms;
    GroupedGemmPlan plan;
    const int64_t groups = std::max<int64_t>(p.groups, 1);
    const int64_t per_group = options.expected_rows_per_group > 0
                                  ? options.expected_rows_per_group
                                  : (p.layout == GroupedLayout::kMasked ? std::max<int64_t>(p.capacity / 2, 1)
                                                                                : ceil_div(p.rows, groups));
    if (options.config) {
        plan.config = *options.config;  // checked by check_plan_options
    } else {
        plan.config = pick_grouped_config(p, per_group, budget, options.wait.has_value());
    }
    // The most tiles any counts can make: every row in a group of its own tile rows, plus a partial tile per group.
    const GemmConfig& c = plan.config;
    const int64_t max_m_tiles = p.layout == GroupedLayout::kMasked
                                    ? p.groups * ceil_div(p.capacity, c.tile_m)
                                    : ceil_div(p.rows, c.tile_m) + p.groups;
    const int64_t max_tiles = std::max<int64_t>(1, max_m_tiles * ceil_div(p.n, c.tile_n));
    plan.grid = static_cast<int>(std::min<int64_t>(budget, max_tiles));
    return plan;
}

jit::KernelSpec grouped_gemm_kernel_spec(const GemmConfig& config, bool wait, bool signal, const std::string& arch) {
    WEFT_CHECK(is_valid_grouped(config), "grouped_gemm: invalid grouped config " << format_gemm_config(config));
    WEFT_CHECK(!wait || is_valid_grouped_wait(config),
               "grouped_gemm: invalid config for a waiting grouped kernel " << format_gemm_config(config));
    return gemm_kernel_spec(config,
                            wait ? "weft::kernels::gemm::GroupedWaitScheduler" : "weft::kernels::gemm::GroupedScheduler",
                            signal ? "weft::kernels::gemm::GroupedTileSignalHook" : "weft::kernels::gemm::NoEpilogueHook",
                            arch);
}

std::vector<jit::KernelSpec> grouped_gemm_aot_specs() {
    std::vector<jit::KernelSpec> specs;
    for (DType out : {DType::kBF16, DType::kF32}) {
        for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
            for (const GemmConfig& c : grouped_gemm_candidate_configs(DType::kBF16, out, layout)) {
                specs.push_back(grouped_gemm_kernel_spec(c, false, false));
            }
        }
    }
    return specs;
}

jit::KernelSpec grouped_dequant_kernel_spec(const std::string& arch) {
    jit::KernelSpec spec;
    spec.header = "gemm/grouped_dequant.cuh";
    spec.instantiation = "weft::kernels::gemm::grouped_dequant_fp8_kernel<0>";
    spec.description = "grouped gemm fp8 rows to bf16";
    spec.arch = arch;
    return spec;
}

void register_grouped_gemm_aot_specs() {
    static std::once_flag once;
    std::call_once(once, [] {
        for (auto& spec : grouped_gemm_aot_specs()) jit::register_aot_spec(std::move(spec));
        jit::register_aot_spec(grouped_dequant_kernel_spec());
    });
}

void validate_grouped_fp8_args(const GroupedGemmProblem& p, const TensorView& a, const TensorView& a_scales) {
    WEFT_CHECK(p.layout == GroupedLayout::kMasked, "grouped_gemm_masked_fp8: the bf16 call must be masked");
    WEFT_CHECK(a.dtype == DType::kF8E4M3, "grouped_gemm_masked_fp8: a must be f8e4m3, got " << dtype_name(a.dtype));
    check_view(a, "a", 3, "[G, capacity, K] (e4m3)");
    WEFT_CHECK(a.dim(0) == p.groups && a.dim(1) == p.capacity && a.dim(2) == p.k,
               "grouped_gemm_masked_fp8: a must be [G, capacity, K] = [" << p.groups << ", " << p.capacity << ", "
                                                                         << p.k << "] (a_bf16's shape), got "
                                                                         << a.describe());
    WEFT_CHECK(p.k % 128 == 0, "grouped_gemm_masked_fp8: K must be a multiple of 128 (one scale per 128 channels), "
                               "got " << p.k);
    WEFT_CHECK(a.dim(0) <= 1 || a.dim(1) == 0 || a.stride(0) == a.dim(1) * a.stride(1),
               "grouped_gemm_masked_fp8: a's groups must be back to back (stride(0) = capacity x stride(1)), got "
                   << a.describe());
    WEFT_CHECK(a_scales.dtype == DType::kF32,
               "grouped_gemm_masked_fp8: a_scales must be f32, got " << dtype_name(a_scales.dtype));
    WEFT_CHECK(a_scales.ndim == 3 && a_scales.dim(0) == p.groups && a_scales.dim(1) == p.capacity &&
                   a_scales.dim(2) == p.k / 128,
               "grouped_gemm_masked_fp8: a_scales must be [G, capacity, K / 128] = ["
                   << p.groups << ", " << p.capacity << ", " << p.k / 128 << "], got " << a_scales.describe());
    WEFT_CHECK(a_scales.stride(2) == 1 &&
                   (a_scales.dim(0) <= 1 || a_scales.dim(1) == 0 || a_scales.stride(0) == a_scales.dim(1) * a_scales.stride(1)),
               "grouped_gemm_masked_fp8: a_scales must be row-major with its groups back to back, got "
                   << a_scales.describe());
    WEFT_CHECK(p.groups * p.capacity == 0 || a_scales.data != nullptr,
               "grouped_gemm_masked_fp8: a_scales has a null data pointer");
    WEFT_CHECK(reinterpret_cast<uintptr_t>(a_scales.data) % 4 == 0,
               "grouped_gemm_masked_fp8: a_scales must be 4-byte aligned");
}

void grouped_gemm_masked_fp8(const TensorView& a, const TensorView& a_scales, const TensorView& b, const TensorView& d,
                             BLayout b_layout, const int32_t* counts, const TensorView& a_bf16, cudaStream_t stream,
                             const GroupedGemmOptions& options) {
    WEFT_NVTX_RANGE("grouped_gemm_masked_fp8");
    WEFT_CHECK(a_bf16.dtype == DType::kBF16,
               "grouped_gemm_masked_fp8: a_bf16 (the workspace) must be bf16, got " << dtype_name(a_bf16.dtype));
    const GroupedGemmProblem p = [&] {
        try {  // the GEMM's a is the workspace: its messages say so
            return validate_grouped_gemm_args(GroupedLayout::kMasked, a_bf16, b, d, b_layout, nullptr, counts);
        } catch (const Error& e) {
            detail::rethrow_with_op("grouped_gemm_masked_fp8 (the GEMM's a: the workspace a_bf16)", e);
        }
    }();
    validate_grouped_fp8_args(p, a, a_scales);
    WEFT_CHECK(!detail::views_overlap(a_bf16, a) && !detail::views_overlap(a_bf16, a_scales),
               "grouped_gemm_masked_fp8: a_bf16 (the workspace) must not overlap a or a_scales, got a_bf16 "
                   << a_bf16.data << " (" << a_bf16.describe() << "), a " << a.data << ", a_scales " << a_scales.data);
    detail::check_grouped_gemm_options(options, p);
    // The dequantisation runs first and waits for nothing: codes or counts a producer is still writing would be read
    // stale, and the GEMM's per-group wait would then guard rows already converted.
    WEFT_CHECK(!options.wait,
               "grouped_gemm_masked_fp8: options.wait is not supported (the dequantisation of a runs "
               "before the GEMM and waits for nothing): make a, a_scales and the counts ready before "
               "the call, in stream order");
    // The dequantisation reads the counts while other CTAs write a_bf16, and the GEMM reads b after it: the workspace
    // must meet neither. The codes and scales are read before the GEMM starts (the launches are stream-ordered).
    detail::check_apart("grouped_gemm_masked_fp8", "a_bf16", a_bf16,
                        {{"b", b}, {"counts", detail::int32_array_view(counts, p.groups)}},
                        "the dequantisation reads the counts while writing a_bf16, the GEMM reads b after it");
    check_output_apart("grouped_gemm_masked_fp8", p, "a_bf16", a_bf16, b, d, nullptr, counts);
    detail::check_device_views({{"a", a},
                                {"a_scales", a_scales},
                                {"b", b},
                                {"d", d},
                                {"a_bf16", a_bf16},
                                {"counts", detail::int32_array_view(counts, p.groups)}},
                               "grouped_gemm_masked_fp8", stream);
    detail::check_grouped_option_words(options, "grouped_gemm_masked_fp8", stream);
    if (p.groups == 0 || p.capacity == 0 || p.n == 0) return;
    (void)checked_plan(p, options);  // the GEMM's own checks, before the dequantisation is enqueued

    const int device = current_device();
    int num_sms = 0;
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
    weft::gemm::GroupedDequantArgs args{};
    args.codes = static_cast<const unsigned char*>(a.data);
    args.scales = static_cast<const float*>(a_scales.data);
    args.out = static_cast<unsigned short*>(a_bf16.data);
    args.counts = counts;
    args.lda_codes = a.stride(1);
    args.lds = a_scales.stride(1);
    args.ldo = a_bf16.stride(1);
    args.groups = static_cast<int32_t>(p.groups);
    args.capacity = static_cast<int32_t>(p.capacity);
    args.k = static_cast<int32_t>(p.k);
    constexpr int kThreads = weft::gemm::kGroupedDequantThreads, kWarps = kThreads / 32;
    const int64_t rows = p.groups * p.capacity;
    jit::Kernel& kernel = detail::gemm_jit_kernel(grouped_dequant_kernel_spec());
    jit::LaunchParams lp;
    lp.grid = dim3(static_cast<unsigned>(std::min<int64_t>(ceil_div(rows, kWarps), int64_t{4} * num_sms)), 1, 1);
    lp.block = dim3(kThreads, 1, 1);
    lp.stream = stream;
    kernel.launch(lp, args);
    launch(p, a_bf16, b, d, nullptr, counts, stream, options);
}

std::string describe_grouped_status(const GroupedStatus& s) {
    std::ostringstream os;
    switch (static_cast<GroupedStatusCode>(s.code)) {
        case GroupedStatusCode::kOk: return "";
        case GroupedStatusCode::kCountNegative:
            os << "grouped_gemm: group " << s.group << " has a negative row count " << s.value << " (clamped to 0)";
            break;
        case GroupedStatusCode::kCountOverCapacity:
            os << "grouped_gemm: group " << s.group << " has " << s.value << " rows, over the capacity " << s.limit
               << " (clamped to the capacity)";
            break;
        case GroupedStatusCode::kRowsOutOfRange:
            os << "grouped_gemm: group " << s.group << "'s rows end at " << s.value << " (or start below 0), outside "
               << "a's " << s.limit << " rows (clamped to them)";
            break;
        default: os << "grouped_gemm: unknown status code " << s.code << " (group " << s.group << ")"; break;
    }
    return os.str();
}

void check_grouped_status(const GroupedStatus& status) {
    const std::string what = describe_grouped_status(status);
    WEFT_CHECK(what.empty(), what);
}

namespace {

// grouped_gemm_contiguous; `check_memory`: also that every buffer is this GPU's memory.
void contiguous(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout, const int32_t* offsets,
                const int32_t* counts, cudaStream_t stream, const GroupedGemmOptions& options, bool check_memory) {
    WEFT_NVTX_RANGE("grouped_gemm_contiguous");
    const GroupedGemmProblem p =
        validate_grouped_gemm_args(GroupedLayout::kContiguous, a, b, d, b_layout, offsets, counts);
    detail::check_grouped_gemm_options(options, p);
    check_output_apart("grouped_gemm_contiguous", p, "a", a, b, d, offsets, counts);
    if (check_memory) {
        detail::check_device_views({{"a", a},
                                    {"b", b},
                                    {"d", d},
                                    {"offsets", detail::int32_array_view(offsets, p.groups)},
                                    {"counts", detail::int32_array_view(counts, p.groups)}},
                                   "grouped_gemm_contiguous", stream);
        detail::check_grouped_option_words(options, "grouped_gemm_contiguous", stream);
    }
    launch(p, a, b, d, offsets, counts, stream, options);
}

}  // namespace

void grouped_gemm_contiguous(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout,
                             const int32_t* offsets, const int32_t* counts, cudaStream_t stream,
                             const GroupedGemmOptions& options) {
    contiguous(a, b, d, b_layout, offsets, counts, stream, options, true);
}

namespace detail {

void grouped_gemm_contiguous_on_device(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout,
                                       const int32_t* offsets, const int32_t* counts, cudaStream_t stream,
                                       const GroupedGemmOptions& options) {
    contiguous(a, b, d, b_layout, offsets, counts, stream, options, false);
}

}  // namespace detail

void grouped_gemm_masked(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout,
                         const int32_t* counts, cudaStream_t stream, const GroupedGemmOptions& options) {
    WEFT_NVTX_RANGE("grouped_gemm_masked");
    const GroupedGemmProblem p = validate_grouped_gemm_args(GroupedLayout::kMasked, a, b, d, b_layout, nullptr, counts);
    detail::check_grouped_gemm_options(options, p);
    check_output_apart("grouped_gemm_masked", p, "a", a, b, d, nullptr, counts);
    detail::check_device_views({{"a", a}, {"b", b}, {"d", d}, {"counts", detail::int32_array_view(counts, p.groups)}},
                               "grouped_gemm_masked", stream);
    detail::check_grouped_option_words(options, "grouped_gemm_masked", stream);
    launch(p, a, b, d, nullptr, counts, stream, options);
}

namespace detail {

void check_grouped_gemm_launch(const GroupedGemmProblem& p, const GroupedGemmOptions& options) {
    if (p.groups == 0 || p.rows == 0 || p.n == 0) return;  // nothing will be launched
    (void)checked_plan(p, options);
}

GroupedGemmLaunch prepare_grouped_gemm_launch(const GroupedGemmProblem& p, const TensorView& a, const TensorView& b,
                                              const TensorView& d, const int32_t* offsets, const int32_t* counts,
                                              int num_sms, const GroupedGemmOptions& options) {
    WEFT_CHECK(p.groups > 0 && p.rows > 0 && p.n > 0, "grouped_gemm: a fused launch needs groups, rows and columns");
    GroupedGemmLaunch out;
    const GroupedGemmPlan plan = plan_grouped_gemm(p, num_sms, options);
    out.config = plan.config;
    out.grid = plan.grid;
    const TensorView a_rows = as_rows(a);
    const TensorView d_rows = as_rows(d);
    out.maps = make_maps(plan.config, a_rows, b, d_rows);
    GemmOptions dense_options;
    dense_options.timeout = options.timeout;
    out.args = make_gemm_args(a_rows, d_rows, gemm_timeout_ns(dense_options));
    out.groups.counts = counts;
    out.groups.offsets = p.layout == GroupedLayout::kContiguous ? offsets : nullptr;
    out.groups.num_groups = static_cast<int32_t>(p.groups);
    out.groups.capacity = static_cast<int32_t>(p.capacity);
    out.groups.status = options.status;
    return out;
}

}  // namespace detail

}  // namespace weft::ops
