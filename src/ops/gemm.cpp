// SPDX-License-Identifier: MIT
// weft::ops::gemm: argument validation, path/config heuristics, tensor maps, kernel registry and launch.
#include "weft/ops/gemm.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

#include "weft/jit/aot.hpp"
#include "weft/jit/autotune.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"

namespace weft::ops {
namespace {

constexpr int64_t kMaxCoord = (int64_t{1} << 31) - 1;  // TMA coordinates are int32
constexpr int64_t kMaxStrideBytes = int64_t{1} << 40;   // TMA global strides

const char* layout_name(BLayout l) { return l == BLayout::kNK ? "[N,K] row-major" : "[K,N] row-major"; }

void check_matrix(const TensorView& v, const char* name, const char* shape_text) {
    WEFT_CHECK(v.ndim == 2, "gemm: " << name << " must be a 2-D matrix " << shape_text << ", got " << v.ndim
                                     << " dimensions (" << v.describe() << ")");
    WEFT_CHECK(v.dim(0) >= 0 && v.dim(1) >= 0, "gemm: " << name << " has a negative extent: " << v.describe());
    WEFT_CHECK(v.dim(1) <= 1 || v.stride(1) == 1,
               "gemm: " << name << " must be row-major (inner stride 1), got " << v.describe());
    WEFT_CHECK(v.dim(0) <= 1 || v.stride(0) >= v.dim(1),
               "gemm: " << name << "'s row stride must be >= its row length " << v.dim(1) << ", got "
                        << v.describe());
    WEFT_CHECK(v.dim(0) <= kMaxCoord && v.dim(1) <= kMaxCoord,
               "gemm: " << name << "'s extents must fit in 31 bits (TMA coordinates), got " << v.describe());
    if (v.numel() == 0) return;
    WEFT_CHECK(v.data != nullptr, "gemm: " << name << " has a null data pointer (" << v.describe() << ")");
    const auto addr = reinterpret_cast<uintptr_t>(v.data);
    WEFT_CHECK(addr % 16 == 0, "gemm: " << name << "'s base address must be 16-byte aligned (TMA), got 0x"
                                        << std::hex << addr << std::dec);
    const int64_t row_bytes = (v.dim(0) <= 1 ? std::max<int64_t>(v.stride(0), v.dim(1)) : v.stride(0)) *
                              dtype_bytes(v.dtype);
    WEFT_CHECK(v.dim(0) <= 1 || row_bytes % 16 == 0,
               "gemm: " << name << "'s row stride must be a multiple of 16 bytes (TMA), got " << v.stride(0)
                        << " elements = " << row_bytes << " bytes (" << v.describe() << ")");
    WEFT_CHECK(row_bytes < kMaxStrideBytes, "gemm: " << name << "'s row stride is too large for TMA: " << row_bytes
                                                     << " bytes");
}

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Relative speed of one tile's worth of MMAs at depth k: planning estimates fitted to the ratios measured on the
// issue's shapes (H200, 2026-11-30, kernels/gemm/README.md v24; with them the heuristic picks the fastest measured
// candidate or one within 1%). Larger tiles reuse shared memory better; a cooperative tile's epilogue stalls both
// consumer warpgroups for about as long as 128 k of mainloop, which ping-pong hides under the other's mainloop.
// Cooperative tiles in cluster pairs ran no faster than alone (v3, v12, v23): 2% less, so the plain tile wins a tie;
// the ping-pong 128x128 pair ran 2% above the cooperative 128x128 at N = 1792 (v26).
double tile_efficiency(const GemmConfig& c, int64_t k) {
    const int area = c.tile_m * c.tile_n;
    if (c.pingpong) {
        if (area >= 128 * 192) return 1.0;
        if (area >= 128 * 176) return 0.99;
        if (area >= 128 * 160) return 0.98;
        return area >= 128 * 128 ? 0.95 : 0.70;
    }
    double e = 0.70;                 // 128x64
    if (area >= 128 * 256) {
        e = 1.0;                     // 128x256, 256x128
    } else if (area == 128 * 176) {
        e = 0.96;                    // 128x176 (its last 48 columns by plain stores)
    } else if (area >= 128 * 128) {
        e = 0.97;                    // 128x128, 128x192
    }
    if (c.cluster_m * c.cluster_n > 1) e *= 0.98;
    constexpr double kEpilogueK = 128;
    return e * static_cast<double>(k) / (static_cast<double>(k) + kEpilogueK);
}

struct GemvKey {
    int m_tiles;
    DType in, out;
    int variant;
    bool operator<(const GemvKey& o) const {
        return std::tie(m_tiles, in, out, variant) < std::tie(o.m_tiles, o.in, o.out, o.variant);
    }
};

struct Registry {
    std::mutex mutex;
    std::vector<std::pair<GemmConfig, const void*>> tiled;
    std::map<GemvKey, const void*> gemv;
    std::set<const void*> smem_configured;
    // JIT side, per device: kernels by spec text (gemm_jit_kernel), by config (the op's hot path), arch.
    std::map<std::pair<int, std::string>, jit::Kernel*> jit_specs;
    std::vector<std::tuple<int, GemmConfig, jit::Kernel*>> jit_tiled;
    std::map<std::pair<int, GemvKey>, jit::Kernel*> jit_gemv;
    std::map<int, std::string> arch;
    std::map<std::pair<int, const jit::Kernel*>, int> jit_cluster_fit;  // clusters that fit at once
};

Registry& registry() {
    static Registry r;
    return r;
}

// Per-(device, stream) scratch for the small-M path: split-K counters (zero between calls: each call's last
// CTA resets its counter) and fp32 partial sums. The counters get their own allocation so that a later call
// with another shape never finds partial sums where it expects zero counters. Outgrown buffers are kept
// (launches already enqueued may still use them); growth doubles.
struct SmallMScratch {
    void* counters = nullptr;
    size_t counter_bytes = 0;
    void* partials = nullptr;
    size_t partial_bytes = 0;
};

SmallMScratch small_m_scratch(size_t counter_bytes, size_t partial_bytes, cudaStream_t stream) {
    static std::mutex mutex;
    static std::map<std::pair<int, cudaStream_t>, SmallMScratch> cache;
    int device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(mutex);
    SmallMScratch& w = cache[{device, stream}];
    if (w.counter_bytes < counter_bytes) {
        const size_t grow = std::max(counter_bytes, 2 * w.counter_bytes);
        void* p = nullptr;
        WEFT_CUDA_CHECK(cudaMalloc(&p, grow));
        WEFT_CUDA_CHECK(cudaMemsetAsync(p, 0, grow, stream));
        w.counters = p;
        w.counter_bytes = grow;
    }
    if (w.partial_bytes < partial_bytes) {
        const size_t grow = std::max(partial_bytes, 2 * w.partial_bytes);
        void* p = nullptr;
        WEFT_CUDA_CHECK(cudaMalloc(&p, grow));
        w.partials = p;
        w.partial_bytes = grow;
        WEFT_LOG_DEBUG("gemm: small-M partials " << grow << " bytes on device " << device);
    }
    return w;
}

size_t round256(size_t x) { return (x + 255) / 256 * 256; }

const char* dtype_enum(DType t) {
    switch (t) {
        case DType::kBF16: return "weft::DType::kBF16";
        case DType::kF16: return "weft::DType::kF16";
        case DType::kF32: return "weft::DType::kF32";
        default: break;
    }
    WEFT_FAIL("gemm: no kernel dtype for " << dtype_name(t));
}

// Short config text for logs and spec descriptions: "gemm 128x256x64_s4_c1x1 bf16->bf16 B[N,K]" (plus the
// raster when it is not the default).
std::string describe_config(const GemmConfig& c) {
    std::ostringstream os;
    os << "gemm " << gemm_candidate_name(c) << " " << dtype_name(c.in_dtype) << "->" << dtype_name(c.out_dtype)
       << (c.b_layout == BLayout::kNK ? " B[N,K]" : " B[K,N]");
    if (c.raster != Raster::kAlongN || c.raster_group != 8) {
        os << " raster " << (c.raster == Raster::kAlongN ? "N" : "M") << "/" << c.raster_group;
    }
    return os.str();
}

int current_device() {
    int device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    return device;
}

// The JIT arch of a device (resolved once: WEFT_JIT_ARCH, else the device's compute capability).
std::string arch_of_device(int device) {
    Registry& r = registry();
    {
        std::lock_guard<std::mutex> lock(r.mutex);
        if (auto it = r.arch.find(device); it != r.arch.end()) return it->second;
    }
    const std::string arch = jit::Compiler::resolve_arch("");
    std::lock_guard<std::mutex> lock(r.mutex);
    r.arch[device] = arch;
    return arch;
}

std::string candidate_name(const GemmPlan& plan) {
    return plan.path == GemmPath::kSmallM ? "small_m_v" + std::to_string(plan.small_m_variant)
                                          : gemm_candidate_name(plan.config);
}

CUtensorMapDataType tma_dtype(DType t) {
    switch (t) {
        case DType::kBF16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
        case DType::kF16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
        case DType::kF32: return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
        default: break;
    }
    WEFT_FAIL("gemm: no tensor-map type for dtype " << dtype_name(t));
}

void encode_2d(CUtensorMap* map, const TensorView& v, const char* name, uint64_t inner, uint64_t outer,
               uint32_t box_inner, uint32_t box_outer, CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
    const uint64_t dims[2] = {inner, outer};
    uint64_t stride_bytes = 0;
    if (outer <= 1) {
        // One row: the stride is never followed, but must be legal (a multiple of 16 bytes): round it up.
        const int64_t row_elems = std::max<int64_t>(v.stride(0), static_cast<int64_t>(inner));
        stride_bytes = (static_cast<uint64_t>(row_elems) * static_cast<uint64_t>(dtype_bytes(v.dtype)) + 15u) / 16u * 16u;
    } else {
        stride_bytes = static_cast<uint64_t>(v.stride(0)) * static_cast<uint64_t>(dtype_bytes(v.dtype));
        WEFT_CHECK(stride_bytes % 16 == 0, "gemm: " << name << "'s row stride must be a multiple of 16 bytes (TMA), got "
                                                    << v.stride(0) << " elements (" << v.describe() << ")");
    }
    const uint64_t strides[1] = {stride_bytes};
    const uint32_t box[2] = {box_inner, box_outer};
    const uint32_t elem_strides[2] = {1, 1};
    const CUresult r = driver().cuTensorMapEncodeTiled(
        map, tma_dtype(v.dtype), 2, v.data, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
        swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        WEFT_FAIL("gemm: cuTensorMapEncodeTiled failed for " << name << " (" << v.describe() << ", box {"
                                                             << box_inner << ", " << box_outer
                                                             << "}): CUresult " << static_cast<int>(r));
    }
}

}  // namespace

GemmProblem validate_gemm_args(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout) {
    WEFT_CHECK(b_layout == BLayout::kNK || b_layout == BLayout::kKN,
               "gemm: b_layout must be BLayout::kNK or BLayout::kKN, got " << static_cast<int>(b_layout));
    check_matrix(a, "a", "[M,K]");
    check_matrix(b, "b", b_layout == BLayout::kNK ? "[N,K]" : "[K,N]");
    check_matrix(d, "d", "[M,N]");
    WEFT_CHECK(a.dtype == DType::kBF16 || a.dtype == DType::kF16,
               "gemm: a must be bf16 or f16, got " << dtype_name(a.dtype));
    WEFT_CHECK(b.dtype == a.dtype,
               "gemm: b must have a's dtype " << dtype_name(a.dtype) << ", got " << dtype_name(b.dtype));
    WEFT_CHECK(d.dtype == a.dtype || d.dtype == DType::kF32,
               "gemm: d must be " << dtype_name(a.dtype) << " (the input dtype) or f32, got " << dtype_name(d.dtype));
    GemmProblem p;
    p.m = a.dim(0);
    p.k = a.dim(1);
    p.b_layout = b_layout;
    p.in_dtype = a.dtype;
    p.out_dtype = d.dtype;
    const int64_t b_k = b_layout == BLayout::kNK ? b.dim(1) : b.dim(0);
    p.n = b_layout == BLayout::kNK ? b.dim(0) : b.dim(1);
    WEFT_CHECK(b_k == p.k, "gemm: b (" << layout_name(b_layout) << ") must have K = " << p.k
                                      << " (a's columns), got " << b.describe());
    WEFT_CHECK(d.dim(0) == p.m && d.dim(1) == p.n,
               "gemm: d must be [M,N] = [" << p.m << ", " << p.n << "], got " << d.describe());
    WEFT_CHECK(p.k >= 8 && p.k % 8 == 0, "gemm: K (a's columns) must be a positive multiple of 8, got " << p.k);
    p.b_rows_contiguous = b_layout == BLayout::kNK && (b.dim(0) <= 1 || b.stride(0) == p.k) &&
                          reinterpret_cast<uintptr_t>(b.data) % 16 == 0;
    return p;
}

std::string gemv_rows_unsupported(const GemmProblem& p) {
    std::ostringstream why;
    if (p.m > kGemvGroupsMaxM) why << "M = " << p.m << " > " << kGemvGroupsMaxM;
    else if (p.b_layout != BLayout::kNK || !p.b_rows_contiguous) why << "B is not [N,K] with contiguous, 16-byte aligned rows (ldb = K)";
    else if (!gemv_rows_uses_ffma(p.m, p.k) && p.k % kGemvRowsSpanElems != 0) {
        why << "K = " << p.k << " is not a multiple of " << kGemvRowsSpanElems;
    }
    return why.str();
}

std::vector<GemmConfig> gemm_candidate_configs(DType in_dtype, DType out_dtype, BLayout b_layout) {
    std::vector<GemmConfig> out;
    for (int i = 0; i < kGemmNumCandidates; ++i) {
        const GemmConfig c = gemm_candidate(i, in_dtype, out_dtype, b_layout);
        if (is_valid(c)) out.push_back(c);
    }
    return out;
}

size_t gemm_workspace_bytes(const GemmProblem& p, int splits, int small_m_variant) {
    if (splits <= 1) return 0;
    WEFT_CHECK(small_m_variant >= 0 && small_m_variant < kGemvNumVariants,
               "gemm_workspace_bytes: small_m_variant must be in [0, " << kGemvNumVariants - 1 << "], got "
                                                                      << small_m_variant);
    const size_t partials = static_cast<size_t>(splits) * static_cast<size_t>(p.m) * static_cast<size_t>(p.n) * 4;
    const int m_tiles = std::clamp(ceil_div(p.m, 16), 1, kGemvMaxM / 16);
    const int n_tiles = gemv_shape(small_m_variant, m_tiles).n_tiles;
    const size_t blocks = static_cast<size_t>(ceil_div(p.n, gemv_cols_per_cta(n_tiles)));
    return round256(blocks * 4) + round256(partials);
}

double gemm_config_cost(const GemmProblem& p, const GemmConfig& c, int budget, double per_tile_cost) {
    const int cluster = c.cluster_m * c.cluster_n;
    if (cluster > budget) return std::numeric_limits<double>::infinity();
    const GemmTileGrid g(c, static_cast<int32_t>(p.m), static_cast<int32_t>(p.n));
    const int clusters = std::max(1, budget / cluster);
    // A wave of cluster tiles runs on `cluster` CTAs at once: one tile's time per CTA.
    const int waves = ceil_div(g.num_cluster_tiles(), clusters);
    const double cost = static_cast<double>(waves) * (c.tile_m * c.tile_n / tile_efficiency(c, p.k) + per_tile_cost);
    // Padding tiles of a cluster pair past the edge of D are pure waste.
    const double useful = static_cast<double>(g.num_tiles()) / (g.num_cluster_tiles() * cluster);
    return cost / useful;
}

bool gemm_allows_small_m(const GemmProblem& p, const GemmOptions& options) {
    WEFT_CHECK(options.small_m_max_m >= 0 && options.small_m_max_m <= kGemvMaxM,
               "gemm: options.small_m_max_m must be in [0, " << kGemvMaxM << "] (kGemvMaxM), got "
                                                             << options.small_m_max_m);
    return !options.config && options.allow_small_m && p.m <= options.small_m_max_m && p.b_layout == BLayout::kNK;
}

// The small-M variant when the caller leaves it to the op: bulk-copied rows (4) where it serves and K >= 4096, else
// the TMA ring (3). H200, bf16, 2026-11-30 (kernels/gemm/README.md, v10, v11, v14): variant 4 took 34.6-36.3 us at
// 1x8192x8192 against variant 3's 37.3-38.1 (cuBLASLt 36.5-37.4), 57.8-58.7 against 64.8-65.3 at 1x28672x4096,
// 36.2-36.9 against 37.9-38.0 at 3x8192x8192 (its whole-row body then; the row groups took M = 3, 4 over in v25), and
// was never slower at M = 3, 4 with K >= 4096; at K = 2048 (one span per row) it gained nothing at M = 1 and lost 3%
// at M = 2. Its row-group body (M 3..16): 35.8-37.8 us against
// 37.6-38.9 at M = 5, 8, 16 with N = K = 8192, 63.3 against 65.8-66.2 at 16x28672x4096, 14.9-15.2 against 16.3-16.6
// at 8x4096x4096, even at 16x8192x16384 and (with its L2 hints) at 16x8192x4096 (22.5-22.6 against 22.4-22.6).
namespace {
int auto_small_m_variant(const GemmProblem& p) {
    return p.k >= 2 * kGemvRowsSpanElems && gemv_rows_unsupported(p).empty() ? 4 : 3;
}
}  // namespace

bool gemm_launches_programmatically(const GemmPlan& plan, const GemmOptions& options) {
    return options.programmatic_launch && plan.path == GemmPath::kSmallM &&
           gemv_shape(plan.small_m_variant, plan.small_m_tiles).bulk;
}

GemmPlan plan_gemm(const GemmProblem& p, int num_sms, const GemmOptions& options) {
    WEFT_CHECK(num_sms > 0, "gemm: the device must report a positive SM count, got " << num_sms);
    WEFT_CHECK(options.sm_budget >= 0, "gemm: options.sm_budget must be >= 0, got " << options.sm_budget);
    const int budget = options.sm_budget > 0 ? std::min(options.sm_budget, num_sms) : num_sms;
    GemmPlan plan;

    if (gemm_allows_small_m(p, options)) {
        WEFT_CHECK(options.small_m_variant >= -1 && options.small_m_variant < kGemvNumVariants,
                   "gemm: options.small_m_variant must be -1 (auto), 0, 1, 2, 3 or 4, got " << options.small_m_variant);
        plan.path = GemmPath::kSmallM;
        plan.small_m_variant = options.small_m_variant >= 0 ? options.small_m_variant : auto_small_m_variant(p);
        plan.small_m_tiles = ceil_div(p.m, 16);
        const GemvShape shape = gemv_shape(plan.small_m_variant, plan.small_m_tiles);
        plan.grid = ceil_div(p.n, gemv_cols_per_cta(shape.n_tiles));
        if (shape.whole_rows) {
            const std::string why = gemv_rows_unsupported(p);
            WEFT_CHECK(why.empty(), "gemm: small-M variant 4 (bulk-copied rows) cannot serve this call: " << why);
            WEFT_CHECK(options.small_m_splits <= 1,
                       "gemm: small-M variant 4 (bulk-copied rows) has no split-K, got small_m_splits " << options.small_m_splits);
            // One CTA per SM of the budget, N spread evenly: ceil(N / grid) rows each, none empty.
            plan.grid = static_cast<int>(ceil_div(p.n, ceil_div(p.n, static_cast<int64_t>(budget))));
            plan.small_m_k_per_split = static_cast<int32_t>(ceil_div(p.k, 32) * 32);
            plan.small_m_splits = 1;
            plan.workspace_bytes = 0;
            return plan;
        }
        int splits = options.small_m_splits;
        if (splits <= 0) {
            // One wave of CTAs streaming B: shape.ctas_per_sm per SM (variant 1: 8, 32 columns per CTA, best
            // measured N = K = 8192: 4 splits; variant 0: 4, 128 columns, best 8 splits; variant 2: what its
            // registers allow, gemm_config.hpp); at least 256 k per split. Variants 0 and 1 also keep a split
            // length that divides K into whole 32-wide chunks where possible; variant 2 keeps the full wave
            // (a shorter last split costs nothing: its missing steps load nothing).
            splits = std::clamp(shape.ctas_per_sm * num_sms / plan.grid, 1, 32);
            splits = std::min(splits, std::max(1, static_cast<int>(p.k / 256)));
            if (shape.stages == 0) {
                while (splits > 1 && p.k % (static_cast<int64_t>(splits) * 32) != 0) --splits;
            }
        }
        plan.small_m_k_per_split = ceil_div(ceil_div(p.k, splits), 32) * 32;
        plan.small_m_splits = ceil_div(p.k, plan.small_m_k_per_split);
        plan.workspace_bytes = gemm_workspace_bytes(p, plan.small_m_splits, plan.small_m_variant);
        return plan;
    }

    plan.path = GemmPath::kTiled;
    if (options.config) {
        const GemmConfig& c = *options.config;
        WEFT_CHECK(is_valid(c), "gemm: options.config is not a valid GemmConfig: " << format_gemm_config(c));
        WEFT_CHECK(c.in_dtype == p.in_dtype && c.out_dtype == p.out_dtype && c.b_layout == p.b_layout,
                   "gemm: options.config's dtypes/layout must match the call (in " << dtype_name(p.in_dtype)
                                                                                   << ", out " << dtype_name(p.out_dtype)
                                                                                   << ", " << layout_name(p.b_layout)
                                                                                   << "), got " << format_gemm_config(c));
        plan.config = c;
    } else {
        // Minimise waves x tile work / efficiency; ties keep the earlier (preferred) candidate.
        double best = 0;
        bool have = false;
        for (const GemmConfig& c : gemm_candidate_configs(p.in_dtype, p.out_dtype, p.b_layout)) {
            if (c.cluster_m * c.cluster_n > budget) continue;  // a cluster pair would break the SM budget
            const double cost = gemm_config_cost(p, c, budget);
            // NOTE: no bonus for multicast pairs: on equal cost the plain config (listed first) wins until
            // measurements say otherwise (kernels/gemm/README.md, variant log).
            if (!have || cost < best * 0.999) {
                best = cost;
                plan.config = c;
                have = true;
            }
        }
        WEFT_CHECK(have, "gemm: no valid config for in " << dtype_name(p.in_dtype) << ", out "
                                                         << dtype_name(p.out_dtype));
    }
    const GemmConfig& c = plan.config;
    const GemmTileGrid g(c, static_cast<int32_t>(p.m), static_cast<int32_t>(p.n));
    const int cluster = c.cluster_m * c.cluster_n;
    const int clusters = std::max(1, std::min(budget / cluster, g.num_cluster_tiles()));
    plan.grid = clusters * cluster;
    plan.smem_bytes = gemm_smem_plan(c).alloc_bytes;
    return plan;
}

std::string format_gemm_config(const GemmConfig& c) {
    auto dt = [](DType t) {
        switch (t) {
            case DType::kBF16: return "weft::DType::kBF16";
            case DType::kF16: return "weft::DType::kF16";
            case DType::kF32: return "weft::DType::kF32";
            default: return "weft::DType(-1)";
        }
    };
    std::ostringstream os;
    os << "weft::GemmConfig{.tile_m = " << c.tile_m << ", .tile_n = " << c.tile_n << ", .tile_k = " << c.tile_k
       << ", .stages = " << c.stages << ", .cluster_m = " << c.cluster_m << ", .cluster_n = " << c.cluster_n
       << ", .raster = " << (c.raster == Raster::kAlongN ? "weft::Raster::kAlongN" : "weft::Raster::kAlongM")
       << ", .raster_group = " << c.raster_group
       << ", .b_layout = " << (c.b_layout == BLayout::kNK ? "weft::BLayout::kNK" : "weft::BLayout::kKN")
       << ", .in_dtype = " << dt(c.in_dtype) << ", .out_dtype = " << dt(c.out_dtype);
    if (c.pingpong) os << ", .pingpong = true";  // omitted when false: cooperative kernels keep their names
    os << "}";
    return os.str();
}

std::string gemm_kernel_instantiation(const GemmConfig& c) {
    const std::string cfg = format_gemm_config(c);
    return "weft::gemm::gemm_kernel<" + cfg + ", weft::gemm::PersistentScheduler<" + cfg +
           ">, weft::gemm::NoEpilogueHook>";
}

std::string gemm_kernel_instantiation(const GemmConfig& c, const std::string& scheduler_template,
                                      const std::string& hook) {
    WEFT_CHECK(!scheduler_template.empty() && !hook.empty(),
               "gemm_kernel_instantiation: the scheduler template and the hook type must be named, got '"
                   << scheduler_template << "' and '" << hook << "'");
    const std::string cfg = format_gemm_config(c);
    return "weft::gemm::gemm_kernel<" + cfg + ", " + scheduler_template + "<" + cfg + ">, " + hook + ">";
}

std::string gemv_kernel_instantiation(int m_tiles, DType in_dtype, DType out_dtype, int variant) {
    WEFT_CHECK(m_tiles >= 1 && m_tiles <= kGemvMaxM / 16,
               "gemv_kernel_instantiation: m_tiles must be in [1, " << kGemvMaxM / 16 << "], got " << m_tiles);
    WEFT_CHECK(variant >= 0 && variant < kGemvNumVariants,
               "gemv_kernel_instantiation: variant must be 0, 1, 2, 3 or 4, got " << variant);
    const GemvShape shape = gemv_shape(variant, m_tiles);
    WEFT_CHECK(!shape.whole_rows || m_tiles == 1,
               "gemv_kernel_instantiation: variant 4 (bulk-copied rows) serves M <= " << kGemvGroupsMaxM << " (m_tiles 1), got m_tiles "
                                                                              << m_tiles);
    std::ostringstream os;
    os << "weft::gemm::gemv_kernel<" << m_tiles << ", " << dtype_enum(in_dtype) << ", " << dtype_enum(out_dtype) << ", "
       << shape.n_tiles;
    if (shape.stages > 0) os << ", " << shape.stages;  // variants 0 and 1 keep their four-argument names
    if (shape.bulk) os << ", true";
    if (shape.whole_rows) os << ", true";
    os << ">";
    return os.str();
}

jit::KernelSpec gemm_kernel_spec(const GemmConfig& config, const std::string& arch) {
    WEFT_CHECK(is_valid(config), "gemm: invalid config " << format_gemm_config(config));
    jit::KernelSpec spec;
    spec.header = "gemm/gemm_sm90.cuh";
    spec.instantiation = gemm_kernel_instantiation(config);
    spec.description = describe_config(config);
    spec.arch = arch;
    return spec;
}

jit::KernelSpec gemm_kernel_spec(const GemmConfig& config, const std::string& scheduler_template,
                                 const std::string& hook, const std::string& arch) {
    WEFT_CHECK(is_valid(config), "gemm: invalid config " << format_gemm_config(config));
    jit::KernelSpec spec;
    spec.header = "gemm/gemm_sm90.cuh";
    spec.instantiation = gemm_kernel_instantiation(config, scheduler_template, hook);
    spec.description = describe_config(config) + " " + scheduler_template + " " + hook;
    spec.arch = arch;
    return spec;
}

jit::KernelSpec gemv_kernel_spec(int m_tiles, DType in_dtype, DType out_dtype, int variant, const std::string& arch) {
    jit::KernelSpec spec;
    spec.header = "gemm/gemv_sm90.cuh";
    spec.instantiation = gemv_kernel_instantiation(m_tiles, in_dtype, out_dtype, variant);
    spec.description = "gemm small-M m_tiles " + std::to_string(m_tiles) + " " + dtype_name(in_dtype) + "->" +
                       dtype_name(out_dtype) + " variant " + std::to_string(variant);
    spec.arch = arch;
    return spec;
}

jit::KernelSpec gemm_advance_epoch_spec(const std::string& arch) {
    jit::KernelSpec spec;
    spec.header = "gemm/gemm_hooks.cuh";
    spec.instantiation = "weft::gemm::gemm_advance_epoch_kernel<0>";
    spec.description = "gemm hook epoch advance";
    spec.arch = arch;
    return spec;
}

std::vector<jit::KernelSpec> gemm_aot_specs() {
    std::vector<jit::KernelSpec> specs;
    const std::pair<DType, DType> pairs[] = {{DType::kBF16, DType::kBF16},
                                             {DType::kBF16, DType::kF32},
                                             {DType::kF16, DType::kF16},
                                             {DType::kF16, DType::kF32}};
    for (const auto& [in, out] : pairs) {
        for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
            for (const GemmConfig& c : gemm_candidate_configs(in, out, layout)) specs.push_back(gemm_kernel_spec(c));
        }
        for (int variant : {1, 0, 2, 3, 4}) {
            for (int m_tiles = 1; m_tiles <= (gemv_shape(variant, 1).whole_rows ? 1 : kGemvMaxM / 16); ++m_tiles) {
                specs.push_back(gemv_kernel_spec(m_tiles, in, out, variant));
            }
        }
    }
    specs.push_back(gemm_advance_epoch_spec());
    return specs;
}

void register_gemm_aot_specs() {
    static std::once_flag once;
    std::call_once(once, [] {
        for (auto& spec : gemm_aot_specs()) jit::register_aot_spec(std::move(spec));
    });
}

std::string gemm_candidate_name(const GemmConfig& c) {
    std::ostringstream os;
    os << c.tile_m << "x" << c.tile_n << "x" << c.tile_k << "_s" << c.stages << "_c" << c.cluster_m << "x"
       << c.cluster_n;
    if (c.pingpong) os << "_pp";
    return os.str();
}

std::vector<GemmCandidate> gemm_tune_candidates(const GemmProblem& p, int num_sms, const GemmOptions& options) {
    std::vector<GemmCandidate> out;
    auto add = [&](const GemmPlan& plan) {
        const std::string name = candidate_name(plan);
        for (const auto& c : out) {
            if (c.name == name) return;
        }
        out.push_back({name, plan});
    };
    GemmOptions base = options;
    base.config.reset();
    add(plan_gemm(p, num_sms, base));  // the heuristic's pick first: it wins ties
    const int budget = options.sm_budget > 0 ? std::min(options.sm_budget, num_sms) : num_sms;
    for (const GemmConfig& c : gemm_candidate_configs(p.in_dtype, p.out_dtype, p.b_layout)) {
        if (c.cluster_m * c.cluster_n > budget) continue;  // as plan_gemm: a pair would break the SM budget
        GemmOptions forced = base;
        forced.config = c;
        add(plan_gemm(p, num_sms, forced));
    }
    if (gemm_allows_small_m(p, base)) {  // as plan_gemm: only where the small-M path may serve this M
        for (int variant : {2, 3, 1, 0, 4}) {
            if (gemv_shape(variant, 1).whole_rows && !gemv_rows_unsupported(p).empty()) continue;
            GemmOptions small = base;
            small.small_m_variant = variant;
            add(plan_gemm(p, num_sms, small));
        }
    }
    return out;
}

std::string gemm_tune_problem(const GemmProblem& p, int num_sms, const GemmOptions& options) {
    const int budget = options.sm_budget > 0 ? std::min(options.sm_budget, num_sms) : num_sms;
    std::ostringstream os;
    os << "m=" << p.m << ",n=" << p.n << ",k=" << p.k << ",in=" << dtype_name(p.in_dtype)
       << ",out=" << dtype_name(p.out_dtype) << ",b=" << (p.b_layout == BLayout::kNK ? "nk" : "kn")
       << ",sms=" << budget << ",small_m=" << (gemm_allows_small_m(p, options) ? 1 : 0)
       << ",splits=" << options.small_m_splits;
    return os.str();
}

bool gemm_wants_autotuner(const GemmOptions& options, std::optional<bool> env_autotune, bool env_force_names_gemm) {
    if (options.config) return false;           // the caller chose
    if (env_force_names_gemm) return true;      // forcing needs no timing
    if (env_autotune.has_value() && !*env_autotune) return false;  // WEFT_AUTOTUNE=0: the heuristic
    return options.autotune || env_autotune.value_or(false);
}

GemmSelection select_gemm_plan(const GemmProblem& p, int num_sms, const GemmOptions& options, const std::string& arch,
                               const GemmRunPlan& run, cudaStream_t stream, bool capturing,
                               const GemmPrepareCandidates& prepare) {
    GemmSelection sel;
    sel.plan = plan_gemm(p, num_sms, options);
    sel.candidate = candidate_name(sel.plan);
    if (options.config) {
        sel.origin = GemmChoice::kOptions;
        return sel;
    }
    bool forced = false;
    if (const auto f = env::get("WEFT_AUTOTUNE_FORCE")) forced = jit::parse_force_list(*f).count("gemm") > 0;
    if (!gemm_wants_autotuner(options, env::get_bool("WEFT_AUTOTUNE"), forced)) return sel;

    const std::vector<GemmCandidate> candidates = gemm_tune_candidates(p, num_sms, options);
    jit::Autotuner& tuner = options.autotuner != nullptr ? *options.autotuner : jit::autotuner();
    jit::TuneKey key;
    key.op = "gemm";
    key.problem = gemm_tune_problem(p, num_sms, options);
    key.world_size = 1;
    key.arch = arch;
    auto index_of = [&](const std::string& name) -> int {
        for (size_t i = 0; i < candidates.size(); ++i) {
            if (candidates[i].name == name) return static_cast<int>(i);
        }
        return -1;
    };
    const std::optional<std::string> cached = tuner.cached_decision(key);
    if (capturing && !forced) {
        // Timing synchronises the stream, which a capture forbids: use what is known.
        const int idx = cached ? index_of(*cached) : -1;
        if (idx >= 0) {
            sel.plan = candidates[static_cast<size_t>(idx)].plan;
            sel.candidate = candidates[static_cast<size_t>(idx)].name;
            sel.origin = GemmChoice::kCached;
        } else {
            WEFT_LOG_WARN("gemm: autotuning [" << key.problem << "] was asked for during CUDA graph capture, which "
                                              "cannot time kernels; using the heuristic's " << sel.candidate
                                              << " (tune once outside the capture to record a decision)");
        }
        return sel;
    }
    if (!forced && !(cached && index_of(*cached) >= 0) && prepare) prepare(candidates);

    std::vector<jit::TuneCandidate> runs;
    runs.reserve(candidates.size());
    for (const GemmCandidate& c : candidates) {
        const GemmPlan* plan = &c.plan;
        runs.push_back({c.name, [&run, plan](cudaStream_t s) { run(*plan, s); }});
    }
    jit::TuneOptions tune_options;
    tune_options.stream = stream;
    const jit::TuneResult r = tuner.tune(key, runs, nullptr, tune_options);
    WEFT_CHECK(r.index < candidates.size(), "gemm: the autotuner returned candidate " << r.index << " of "
                                                                                     << candidates.size());
    sel.plan = candidates[r.index].plan;
    sel.candidate = candidates[r.index].name;
    switch (r.origin) {
        case jit::TuneResult::Origin::kTuned: sel.origin = GemmChoice::kTuned; break;
        case jit::TuneResult::Origin::kCached: sel.origin = GemmChoice::kCached; break;
        case jit::TuneResult::Origin::kForced: sel.origin = GemmChoice::kForced; break;
        case jit::TuneResult::Origin::kDisabled: sel.origin = GemmChoice::kHeuristic; break;
    }
    return sel;
}

namespace detail {

GemmTensorMaps make_gemm_tensor_maps(const GemmConfig& c, const TensorView& a, const TensorView& b,
                                     const TensorView& d) {
    WEFT_CHECK(is_valid(c), "gemm: invalid config " << format_gemm_config(c));
    GemmTensorMaps maps;
    std::memset(&maps, 0, sizeof(maps));
    const uint64_t m = static_cast<uint64_t>(a.dim(0)), k = static_cast<uint64_t>(a.dim(1));
    encode_2d(&maps.a, a, "a", k, m, static_cast<uint32_t>(c.tile_k), static_cast<uint32_t>(c.tile_m / c.cluster_n));
    if (c.b_layout == BLayout::kNK) {
        encode_2d(&maps.b, b, "b", static_cast<uint64_t>(b.dim(1)), static_cast<uint64_t>(b.dim(0)),
                  static_cast<uint32_t>(c.tile_k), static_cast<uint32_t>(c.tile_n / c.cluster_m));
    } else {
        encode_2d(&maps.b, b, "b", static_cast<uint64_t>(b.dim(1)), static_cast<uint64_t>(b.dim(0)), 64,
                  static_cast<uint32_t>(c.tile_k));
    }
    maps.d = make_gemm_store_map(c, d);
    return maps;
}

CUtensorMap make_gemm_store_map(const GemmConfig& c, const TensorView& d) {
    // TMA stores write whole 16-byte chunks: the map covers the 16-byte-aligned columns only and the kernel
    // writes the ragged rest with plain stores (GemmArgs::n_tma). With fewer than 16 bytes of columns the
    // map is a placeholder the kernel never stores through.
    CUtensorMap map;
    std::memset(&map, 0, sizeof(map));
    const int32_t n_tma = gemm_tma_store_cols(static_cast<int32_t>(d.dim(1)), d.dtype);
    const uint64_t d_cols = n_tma > 0 ? static_cast<uint64_t>(n_tma) : static_cast<uint64_t>(16 / dtype_bytes(d.dtype));
    encode_2d(&map, d, "d", d_cols, static_cast<uint64_t>(d.dim(0)), static_cast<uint32_t>(gemm_epi_cols(c)),
              kGemmSlabRows);
    return map;
}

GemvLaunch make_gemv_launch(const GemmPlan& plan, const TensorView& a, const TensorView& b, const TensorView& d) {
    WEFT_CHECK(plan.path == GemmPath::kSmallM, "make_gemv_launch: the plan is not a small-M plan");
    GemvLaunch l;
    l.args.a = a.data;
    l.args.b = b.data;
    l.args.d = d.data;
    l.args.lda = a.stride(0);
    l.args.ldb = b.stride(0);
    l.args.ldd = d.stride(0);
    l.args.m = static_cast<int32_t>(a.dim(0));
    l.args.n = static_cast<int32_t>(b.dim(0));
    l.args.k = static_cast<int32_t>(a.dim(1));
    l.args.k_per_split = plan.small_m_k_per_split;
    l.args.num_splits = plan.small_m_splits;
    l.args.rows_per_cta = static_cast<int32_t>(ceil_div(b.dim(0), static_cast<int64_t>(plan.grid)));
    const GemvShape shape = gemv_shape(plan.small_m_variant, plan.small_m_tiles);
    if (shape.whole_rows) {
        // A is read 16 bytes at a time (the plan checked B): 16-byte aligned rows.
        WEFT_CHECK(reinterpret_cast<uintptr_t>(a.data) % 16 == 0 &&
                       (a.dim(0) <= 1 || (a.stride(0) * dtype_bytes(a.dtype)) % 16 == 0),
                   "gemm: small-M variant 4 (bulk-copied rows) needs a's base and row stride 16-byte aligned, got "
                       << a.describe());
        WEFT_CHECK(b.stride(0) == b.dim(1) || b.dim(0) <= 1,
                   "gemm: small-M variant 4 (bulk-copied rows) needs b's rows back to back (ldb = K), got " << b.describe());
    } else if (shape.bulk) {
        const CUtensorMapSwizzle swizzle = kGemvBulkBoxK == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE;
        encode_2d(&l.maps.a, a, "a", static_cast<uint64_t>(a.dim(1)), static_cast<uint64_t>(a.dim(0)), kGemvBulkBoxK,
                  static_cast<uint32_t>(16 * plan.small_m_tiles), swizzle);
        encode_2d(&l.maps.b, b, "b", static_cast<uint64_t>(b.dim(1)), static_cast<uint64_t>(b.dim(0)), kGemvBulkBoxK,
                  static_cast<uint32_t>(32 * shape.n_tiles), swizzle);
    }
    l.grid = dim3(static_cast<unsigned>(plan.grid), static_cast<unsigned>(plan.small_m_splits), 1);
    l.block = dim3(static_cast<unsigned>(shape.whole_rows ? gemv_rows_threads(l.args.m, l.args.k) : gemv_threads(shape.bulk)),
                   1, 1);
    l.smem_bytes = gemv_smem_bytes(plan.small_m_variant, plan.small_m_tiles);
    return l;
}

GemmArgs make_gemm_args(const TensorView& a, const TensorView& d, uint64_t timeout_ns) {
    GemmArgs args{};
    args.m = static_cast<int32_t>(a.dim(0));
    args.k = static_cast<int32_t>(a.dim(1));
    args.n = static_cast<int32_t>(d.dim(1));
    args.n_tma = gemm_tma_store_cols(args.n, d.dtype);
    args.timeout_ns = timeout_ns;
    args.d = d.data;
    args.ldd = d.dim(0) <= 1 ? d.dim(1) : d.stride(0);
    return args;
}

uint64_t gemm_timeout_ns(const GemmOptions& options) {
    int64_t ms = options.timeout.count();
    if (ms <= 0) ms = env::get_int("WEFT_TIMEOUT_MS").value_or(10000);
    WEFT_CHECK(ms > 0, "gemm: WEFT_TIMEOUT_MS must be positive, got " << ms);
    return static_cast<uint64_t>(ms) * 1000000ull;
}

void launch_gemm_kernel(const void* func, const GemmConfig& c, const GemmTensorMaps& maps, const GemmArgs& args,
                        int grid, const void* sched_params, const void* hook_params, cudaStream_t stream) {
    WEFT_CHECK(func != nullptr, "gemm: null kernel function");
    const int cluster = c.cluster_m * c.cluster_n;
    WEFT_CHECK(grid > 0 && grid % cluster == 0,
               "gemm: grid must be a positive multiple of the cluster size " << cluster << ", got " << grid);
    const int smem = gemm_smem_plan(c).alloc_bytes;
    {
        Registry& r = registry();
        std::lock_guard<std::mutex> lock(r.mutex);
        if (r.smem_configured.insert(func).second) {
            WEFT_CUDA_CHECK(cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        }
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
    cfg.blockDim = dim3(kGemmThreads, 1, 1);
    cfg.dynamicSmemBytes = static_cast<size_t>(smem);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    if (cluster > 1) {
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
    }
    GemmTensorMaps local = maps;  // the launch copies parameters; keep them alive for the call
    GemmArgs a = args;
    void* params[] = {&local.a, &local.b, &local.d, &a, const_cast<void*>(sched_params),
                      const_cast<void*>(hook_params)};
    WEFT_CUDA_CHECK(cudaLaunchKernelExC(&cfg, func, params));
}

void register_gemm_kernel(const GemmConfig& config, const void* func) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto& e : r.tiled) {
        if (e.first == config) {
            e.second = func;
            return;
        }
    }
    r.tiled.emplace_back(config, func);
}

const void* find_gemm_kernel(const GemmConfig& config) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& e : r.tiled) {
        if (e.first == config) return e.second;
    }
    return nullptr;
}

void register_gemv_kernel(int m_tiles, DType in_dtype, DType out_dtype, int variant, const void* func) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.gemv[GemvKey{m_tiles, in_dtype, out_dtype, variant}] = func;
}

const void* find_gemv_kernel(int m_tiles, DType in_dtype, DType out_dtype, int variant) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.gemv.find(GemvKey{m_tiles, in_dtype, out_dtype, variant});
    return it == r.gemv.end() ? nullptr : it->second;
}

jit::Kernel& gemm_jit_kernel(const jit::KernelSpec& spec) {
    const int device = current_device();
    std::ostringstream id;
    id << spec.header << '\n' << spec.instantiation << '\n' << spec.arch << '\n' << spec.preamble << '\n'
       << spec.extra_code << '\n' << spec.options.canonical();
    const std::pair<int, std::string> key{device, id.str()};
    Registry& r = registry();
    {
        std::lock_guard<std::mutex> lock(r.mutex);
        if (auto it = r.jit_specs.find(key); it != r.jit_specs.end()) return *it->second;
    }
    // Outside the lock: a compile can take seconds, and the compiler serialises equal keys itself.
    jit::Kernel& kernel = jit::compiler().get_kernel(spec);
    std::lock_guard<std::mutex> lock(r.mutex);
    r.jit_specs[key] = &kernel;
    return kernel;
}

void launch_gemm_jit(const jit::Kernel& kernel, const GemmConfig& c, const GemmTensorMaps& maps, const GemmArgs& args,
                     int grid, const void* sched_params, size_t sched_bytes, const void* hook_params, size_t hook_bytes,
                     cudaStream_t stream) {
    WEFT_CHECK(is_valid(c), "gemm: invalid config " << format_gemm_config(c));
    WEFT_CHECK(sched_params != nullptr && hook_params != nullptr,
               "gemm: the scheduler and hook parameters must be given (kernel " << kernel.description() << ")");
    const int cluster = c.cluster_m * c.cluster_n;
    WEFT_CHECK(grid > 0 && grid % cluster == 0,
               "gemm: grid must be a positive multiple of the cluster size " << cluster << ", got " << grid);
    jit::LaunchParams lp;
    lp.grid = dim3(static_cast<unsigned>(grid), 1, 1);
    lp.block = dim3(kGemmThreads, 1, 1);
    lp.dynamic_smem_bytes = static_cast<size_t>(gemm_smem_plan(c).alloc_bytes);
    lp.stream = stream;
    if (cluster > 1) lp.cluster = dim3(static_cast<unsigned>(cluster), 1, 1);
    GemmTensorMaps local = maps;  // the launch copies parameters; keep them alive for the call
    GemmArgs a = args;
    void* params[] = {&local.a, &local.b, &local.d, &a, const_cast<void*>(sched_params), const_cast<void*>(hook_params)};
    const size_t bytes[] = {sizeof(CUtensorMap), sizeof(CUtensorMap), sizeof(CUtensorMap), sizeof(GemmArgs),
                            sched_bytes, hook_bytes};
    kernel.launch_packed(lp, params, bytes, 6);
}

int fit_gemm_jit_grid(const jit::Kernel& kernel, const GemmConfig& c, int grid) {
    const int cluster = c.cluster_m * c.cluster_n;
    if (cluster <= 1) return grid;
    const int device = current_device();
    const std::pair<int, const jit::Kernel*> key{device, &kernel};
    Registry& r = registry();
    int fit = 0;
    {
        std::lock_guard<std::mutex> lock(r.mutex);
        if (auto it = r.jit_cluster_fit.find(key); it != r.jit_cluster_fit.end()) fit = it->second;
    }
    if (fit == 0) {
        kernel.load_for_current_context();
        // The runtime takes a library kernel handle (cudaKernel_t == CUkernel) wherever it takes a function.
        const void* func = reinterpret_cast<const void*>(kernel.handle());
        const int smem = gemm_smem_plan(c).alloc_bytes;
        cudaError_t e = cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e == cudaSuccess) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
            cfg.blockDim = dim3(kGemmThreads, 1, 1);
            cfg.dynamicSmemBytes = static_cast<size_t>(smem);
            cudaLaunchAttribute attr[1];
            attr[0].id = cudaLaunchAttributeClusterDimension;
            attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
            attr[0].val.clusterDim.y = 1;
            attr[0].val.clusterDim.z = 1;
            cfg.attrs = attr;
            cfg.numAttrs = 1;
            e = cudaOccupancyMaxActiveClusters(&fit, func, &cfg);
        }
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            // Not fatal: more clusters than fit at once run in waves (the persistent loop needs no co-residency).
            WEFT_LOG_WARN("gemm: cannot query how many clusters of " << kernel.description() << " fit ("
                                                                     << cudaGetErrorString(e)
                                                                     << "); launching the full grid");
            fit = -1;
        }
        fit = fit == 0 ? 1 : fit;
        std::lock_guard<std::mutex> lock(r.mutex);
        r.jit_cluster_fit[key] = fit;
    }
    return fit < 0 ? grid : std::min(grid, fit * cluster);
}

}  // namespace detail

namespace {

jit::Kernel& tiled_jit_kernel(int device, const GemmConfig& config) {
    Registry& r = registry();
    {
        std::lock_guard<std::mutex> lock(r.mutex);
        for (const auto& [dev, c, k] : r.jit_tiled) {
            if (dev == device && c == config) return *k;
        }
    }
    jit::Kernel& kernel = detail::gemm_jit_kernel(gemm_kernel_spec(config, arch_of_device(device)));
    std::lock_guard<std::mutex> lock(r.mutex);
    r.jit_tiled.emplace_back(device, config, &kernel);
    return kernel;
}

/// Raises an nvcc-compiled kernel's dynamic shared memory limit to `bytes` on `device`, once per (kernel,
/// device): later launches make no runtime call for it.
void allow_dynamic_smem(const void* func, int device, int bytes) {
    static std::mutex mutex;
    static std::map<std::pair<const void*, int>, int> raised;
    std::lock_guard<std::mutex> lock(mutex);
    int& have = raised[{func, device}];
    if (have >= bytes) return;
    WEFT_CUDA_CHECK(cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    have = bytes;
}

jit::Kernel& gemv_jit_kernel(int device, int m_tiles, DType in, DType out, int variant) {
    const std::pair<int, GemvKey> key{device, GemvKey{m_tiles, in, out, variant}};
    Registry& r = registry();
    {
        std::lock_guard<std::mutex> lock(r.mutex);
        if (auto it = r.jit_gemv.find(key); it != r.jit_gemv.end()) return *it->second;
    }
    jit::Kernel& kernel = detail::gemm_jit_kernel(gemv_kernel_spec(m_tiles, in, out, variant, arch_of_device(device)));
    std::lock_guard<std::mutex> lock(r.mutex);
    r.jit_gemv[key] = &kernel;
    return kernel;
}

const char* const kNoInstanceHint =
    " is not compiled into this program and options.backend is GemmBackend::kAot: include "
    "gemm/gemm_instances.cuh in one .cu and call weft::gemm::register_gemm_instances(), or use GemmBackend::kAuto "
    "(the default) or kJit to compile it with weft::jit";

// The kernel spec a plan launches when it goes through the JIT; nullopt when a registered nvcc instance serves it.
std::optional<jit::KernelSpec> jit_spec_for(const GemmPlan& plan, const GemmProblem& p, GemmBackend backend,
                                            const std::string& arch) {
    if (plan.path == GemmPath::kSmallM) {
        if (backend != GemmBackend::kJit &&
            detail::find_gemv_kernel(plan.small_m_tiles, p.in_dtype, p.out_dtype, plan.small_m_variant) != nullptr) {
            return std::nullopt;
        }
        return gemv_kernel_spec(plan.small_m_tiles, p.in_dtype, p.out_dtype, plan.small_m_variant, arch);
    }
    if (backend != GemmBackend::kJit && detail::find_gemm_kernel(plan.config) != nullptr) return std::nullopt;
    return gemm_kernel_spec(plan.config, arch);
}

// Compiles the JIT kernels of the candidates on several threads before the autotuner times them one by one.
void compile_candidates(const std::vector<GemmCandidate>& candidates, const GemmProblem& p, GemmBackend backend,
                        const std::string& arch) {
    if (backend == GemmBackend::kAot) return;
    std::vector<jit::KernelSpec> specs;
    for (const auto& c : candidates) {
        if (auto spec = jit_spec_for(c.plan, p, backend, arch)) specs.push_back(std::move(*spec));
    }
    if (specs.size() <= 1) return;  // the autotuner's warm-up compiles it
    const size_t num_threads = std::min<size_t>(specs.size(), std::max(1u, std::thread::hardware_concurrency()));
    std::atomic<size_t> next{0};
    std::vector<std::thread> threads;
    for (size_t t = 0; t < num_threads; ++t) {
        threads.emplace_back([&] {
            for (size_t i = next++; i < specs.size(); i = next++) {
                try {
                    jit::compiler().compile(specs[i]);
                } catch (const std::exception& e) {
                    // The candidate's own run reports it (and the autotuner disqualifies it).
                    WEFT_LOG_DEBUG("gemm: compiling " << specs[i].describe() << " for autotuning failed: " << e.what());
                }
            }
        });
    }
    for (auto& t : threads) t.join();
}

// Enqueues one plan (plan_gemm's or the autotuner's) for validated views.
void launch_plan(const GemmPlan& plan_in, const GemmProblem& p, const TensorView& a, const TensorView& b,
                 const TensorView& d, const GemmOptions& options, cudaStream_t stream) {
    GemmPlan plan = plan_in;
    const int device = current_device();
    if (plan.path == GemmPath::kSmallM) {
        detail::GemvLaunch launch = detail::make_gemv_launch(plan, a, b, d);
        GemvArgs& args = launch.args;
        if (plan.small_m_splits > 1) {
            const size_t counter_bytes = round256(static_cast<size_t>(plan.grid) * 4);  // as gemm_workspace_bytes
            if (options.workspace != nullptr) {
                WEFT_CHECK(options.workspace_bytes >= plan.workspace_bytes,
                           "gemm: options.workspace_bytes must be >= " << plan.workspace_bytes << ", got "
                                                                      << options.workspace_bytes);
                WEFT_CHECK(reinterpret_cast<uintptr_t>(options.workspace) % 256 == 0,
                           "gemm: options.workspace must be 256-byte aligned");
                args.counters = static_cast<uint32_t*>(options.workspace);
                args.partials = reinterpret_cast<float*>(static_cast<char*>(options.workspace) + counter_bytes);
            } else {
                const SmallMScratch w =
                    small_m_scratch(counter_bytes, plan.workspace_bytes - counter_bytes, stream);
                args.counters = static_cast<uint32_t*>(w.counters);
                args.partials = static_cast<float*>(w.partials);
            }
        }
        const void* func = options.backend == GemmBackend::kJit
                               ? nullptr
                               : detail::find_gemv_kernel(plan.small_m_tiles, p.in_dtype, p.out_dtype,
                                                          plan.small_m_variant);
        WEFT_CHECK(func != nullptr || options.backend != GemmBackend::kAot,
                   "gemm: the small-M kernel " << gemv_kernel_instantiation(plan.small_m_tiles, p.in_dtype,
                                                                            p.out_dtype, plan.small_m_variant)
                                               << kNoInstanceHint);
        const bool programmatic = gemm_launches_programmatically(plan, options);
        args.programmatic = programmatic ? 1 : 0;
        if (func != nullptr) {
            if (launch.smem_bytes > 0) allow_dynamic_smem(func, device, launch.smem_bytes);
            void* params[] = {&launch.args, &launch.maps};
            cudaLaunchConfig_t cfg{};
            cfg.gridDim = launch.grid;
            cfg.blockDim = launch.block;
            cfg.dynamicSmemBytes = static_cast<size_t>(launch.smem_bytes);
            cfg.stream = stream;
            cudaLaunchAttribute attribute{};
            attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attribute.val.programmaticStreamSerializationAllowed = 1;
            cfg.attrs = programmatic ? &attribute : nullptr;
            cfg.numAttrs = programmatic ? 1 : 0;
            WEFT_CUDA_CHECK(cudaLaunchKernelExC(&cfg, func, params));
            return;
        }
        jit::Kernel& kernel = gemv_jit_kernel(device, plan.small_m_tiles, p.in_dtype, p.out_dtype, plan.small_m_variant);
        jit::LaunchParams lp;
        lp.grid = launch.grid;
        lp.block = launch.block;
        lp.dynamic_smem_bytes = static_cast<size_t>(launch.smem_bytes);
        lp.stream = stream;
        lp.programmatic = programmatic;
        kernel.launch(lp, launch.args, launch.maps);
        return;
    }

    const detail::GemmTensorMaps maps = detail::make_gemm_tensor_maps(plan.config, a, b, d);
    const GemmArgs args = detail::make_gemm_args(a, d, detail::gemm_timeout_ns(options));
    const int32_t sched_params = 0;  // PersistentScheduler::Params and NoEpilogueHook::Params: one int32
    const int32_t hook_params = 0;
    const void* func = options.backend == GemmBackend::kJit ? nullptr : detail::find_gemm_kernel(plan.config);
    WEFT_CHECK(func != nullptr || options.backend != GemmBackend::kAot,
               "gemm: kernel " << gemm_kernel_instantiation(plan.config) << kNoInstanceHint);
    if (func == nullptr) {
        jit::Kernel& kernel = tiled_jit_kernel(device, plan.config);
        plan.grid = detail::fit_gemm_jit_grid(kernel, plan.config, plan.grid);
        detail::launch_gemm_jit(kernel, plan.config, maps, args, plan.grid, sched_params, hook_params, stream);
        return;
    }
    const int cluster = plan.config.cluster_m * plan.config.cluster_n;
    if (cluster > 1) {
        // Not every SM can host a cluster pair (GPC boundaries): never ask for more than fit at once.
        static std::mutex mutex;
        static std::map<const void*, int> max_clusters;
        int fit = 0;
        {
            std::lock_guard<std::mutex> lock(mutex);
            auto it = max_clusters.find(func);
            if (it != max_clusters.end()) fit = it->second;
        }
        if (fit == 0) {
            WEFT_CUDA_CHECK(cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, plan.smem_bytes));
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(static_cast<unsigned>(plan.grid), 1, 1);
            cfg.blockDim = dim3(kGemmThreads, 1, 1);
            cfg.dynamicSmemBytes = static_cast<size_t>(plan.smem_bytes);
            cudaLaunchAttribute attr[1];
            attr[0].id = cudaLaunchAttributeClusterDimension;
            attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
            attr[0].val.clusterDim.y = 1;
            attr[0].val.clusterDim.z = 1;
            cfg.attrs = attr;
            cfg.numAttrs = 1;
            WEFT_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&fit, func, &cfg));
            fit = std::max(fit, 1);
            std::lock_guard<std::mutex> lock(mutex);
            max_clusters[func] = fit;
        }
        plan.grid = std::min(plan.grid, fit * cluster);
    }
    detail::launch_gemm_kernel(func, plan.config, maps, args, plan.grid, &sched_params, &hook_params, stream);
}

bool stream_is_capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t e = cudaStreamIsCapturing(stream, &status);
    if (e != cudaSuccess) {
        // e.g. the legacy stream while another stream captures in global mode: treat as capturing (no timing).
        (void)cudaGetLastError();
        return true;
    }
    return status != cudaStreamCaptureStatusNone;
}

GemmSelection select_for_views(const GemmProblem& p, const TensorView& a, const TensorView& b, const TensorView& d,
                               cudaStream_t stream, const GemmOptions& options) {
    const int device = current_device();
    int num_sms = 0;
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
    if (options.config || (p.m == 0 || p.n == 0)) {
        GemmSelection sel;
        sel.plan = plan_gemm(p, num_sms, options);
        sel.candidate = candidate_name(sel.plan);
        sel.origin = options.config ? GemmChoice::kOptions : GemmChoice::kHeuristic;
        return sel;
    }
    const std::string arch = arch_of_device(device);
    const GemmRunPlan run = [&](const GemmPlan& plan, cudaStream_t s) { launch_plan(plan, p, a, b, d, options, s); };
    const GemmPrepareCandidates prepare = [&](const std::vector<GemmCandidate>& candidates) {
        compile_candidates(candidates, p, options.backend, arch);
    };
    return select_gemm_plan(p, num_sms, options, arch, run, stream, stream_is_capturing(stream), prepare);
}

}  // namespace

GemmSelection select_gemm(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout,
                          cudaStream_t stream, const GemmOptions& options) {
    const GemmProblem p = validate_gemm_args(a, b, d, b_layout);
    return select_for_views(p, a, b, d, stream, options);
}

void gemm(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout, cudaStream_t stream,
          const GemmOptions& options) {
    const GemmProblem p = validate_gemm_args(a, b, d, b_layout);
    if (p.m == 0 || p.n == 0) return;  // nothing to write
    const GemmSelection sel = select_for_views(p, a, b, d, stream, options);
    launch_plan(sel.plan, p, a, b, d, options, stream);
}

void gemm_advance_epoch(uint64_t* epoch, cudaStream_t stream) {
    WEFT_CHECK(epoch != nullptr && reinterpret_cast<uintptr_t>(epoch) % 8 == 0,
               "gemm_advance_epoch: epoch must be a non-null, 8-byte aligned device pointer, got "
                   << static_cast<const void*>(epoch));
    jit::Kernel& kernel = detail::gemm_jit_kernel(gemm_advance_epoch_spec(arch_of_device(current_device())));
    jit::LaunchParams lp;
    lp.grid = dim3(1, 1, 1);
    lp.block = dim3(32, 1, 1);
    lp.stream = stream;
    kernel.launch(lp, epoch);
}

}  // namespace weft::ops
