// SPDX-License-Identifier: MIT
// Launch of weft::ops::gemm: tensor maps, kernel arguments, the small-M scratch, JIT kernel lookup, the
// launches, and gemm() / select_gemm() themselves.
#include "weft/detail/gemm_launch.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

#include "collective_workspace.hpp"
#include "stream_key.hpp"
#include "views_overlap.hpp"
#include "weft/common/math.hpp"
#include "weft/detail/runtime_config.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/nvtx.hpp"

namespace weft::ops {
namespace {

// What the launch side remembers, per device: JIT kernels by spec text (gemm_jit_kernel) and by config (the op's
// hot path), the JIT arch, and how many clusters of a kernel fit at once (fit_gemm_grid).
struct LaunchMemo {
    std::mutex mutex;
    std::map<std::pair<int, std::string>, jit::Kernel*> jit_specs;
    std::vector<std::tuple<int, GemmConfig, jit::Kernel*>> jit_tiled;
    std::vector<std::tuple<int, GemvConfig, jit::Kernel*>> jit_gemv;
    std::map<int, std::string> arch;
    std::map<std::pair<int, const jit::Kernel*>, int> jit_cluster_fit;  // clusters that fit at once
};

LaunchMemo& launch_memo() {
    static LaunchMemo r;
    return r;
}

// Per-(device, stream) scratch for split-K (the small-M path's and the tiled kernel's): counters (zero between calls:
// each call's last CTA of a column block or tile resets its counter) and fp32 partial sums. The counters get their own
// allocation so that a later call with another shape never finds partial sums where it expects zero counters. Outgrown
// buffers are kept (launches already enqueued may still use them); growth doubles.
struct SmallMScratch {
    void* counters = nullptr;
    size_t counter_bytes = 0;
    void* partials = nullptr;
    size_t partial_bytes = 0;
};

SmallMScratch small_m_scratch(size_t counter_bytes, size_t partial_bytes, cudaStream_t stream) {
    static std::mutex mutex;
    static std::map<detail::StreamKey, SmallMScratch> cache;
    const detail::StreamKey key = detail::StreamKey::of(stream);
    std::lock_guard<std::mutex> lock(mutex);
    SmallMScratch& w = cache[key];
    if (w.counter_bytes < counter_bytes) {
        const size_t grow = std::max(counter_bytes, 2 * w.counter_bytes);
        // Zeroed before any launch uses it (a capture in progress on `stream` would record a zeroing of its own).
        void* p = detail::malloc_beside_captures(grow, true);
        w.counters = p;
        w.counter_bytes = grow;
    }
    if (w.partial_bytes < partial_bytes) {
        const size_t grow = std::max(partial_bytes, 2 * w.partial_bytes);
        w.partials = detail::malloc_beside_captures(grow);
        w.partial_bytes = grow;
        WEFT_LOG_DEBUG("gemm: small-M partials " << grow << " bytes on device " << key.device);
    }
    return w;
}

int current_device() {
    int device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    return device;
}

// The JIT arch of a device (resolved once: WEFT_JIT_ARCH, else the device's compute capability).
std::string arch_of_device(int device) {
    LaunchMemo& r = launch_memo();
    {
        std::lock_guard<std::mutex> lock(r.mutex);
        if (auto it = r.arch.find(device); it != r.arch.end()) return it->second;
    }
    const std::string arch = jit::Compiler::resolve_arch("");
    std::lock_guard<std::mutex> lock(r.mutex);
    r.arch[device] = arch;
    return arch;
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
        stride_bytes = static_cast<uint64_t>(round_up(row_elems * dtype_bytes(v.dtype), 16));
    } else {
        stride_bytes = static_cast<uint64_t>(v.stride(0)) * static_cast<uint64_t>(dtype_bytes(v.dtype));
        WEFT_CHECK(stride_bytes % 16 == 0, "gemm: " << name
                                                    << "'s row stride must be a multiple of 16 bytes (TMA), got "
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
              static_cast<uint32_t>(gemm_store_box_rows(c)));
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
    l.args.rows_per_cta = static_cast<int32_t>(ceil_div(b.dim(0), plan.grid));
    // The shape and shared memory depend on the variant and row tiles only (every kernel takes 16-bit inputs).
    const GemvConfig config{.variant = plan.small_m_variant, .m_tiles = plan.small_m_tiles};
    const GemvShape shape = gemv_shape(config);
    const bool bulk_rows = plan.small_m_variant == GemvVariant::kBulkRows;
    const bool wgmma = plan.small_m_variant == GemvVariant::kTmaWgmma;
    if (wgmma) {
        // The kernel's stages are whole boxes of kGemvWgmmaStageK k: a split must start on one.
        WEFT_CHECK(plan.small_m_k_per_split > 0 && plan.small_m_k_per_split % kGemvWgmmaStageK == 0,
                   "gemm: small-M variant 5 needs k_per_split a positive multiple of " << kGemvWgmmaStageK << ", got "
                                                                                       << plan.small_m_k_per_split);
        WEFT_CHECK(plan.small_m_splits >= 1 && plan.small_m_splits <= kGemvWgmmaMaxSplits,
                   "gemm: small-M variant 5 splits K over one cluster of at most "
                       << kGemvWgmmaMaxSplits << " CTAs per column block, got " << plan.small_m_splits << " splits");
        if (plan.small_m_splits > 1) l.cluster = dim3(1, static_cast<unsigned>(plan.small_m_splits), 1);
        WEFT_CHECK(
            plan.small_m_tiles >= 1 && plan.small_m_tiles <= kGemvWgmmaMaxM / 16 && a.dim(0) <= 16 * plan.small_m_tiles,
            "gemm: small-M variant 5 serves M <= 16 x m_tiles <= " << kGemvWgmmaMaxM << ", got M = " << a.dim(0)
                                                                   << ", m_tiles " << plan.small_m_tiles);
        // Both operands K-major in 128-byte swizzled rows of 64 k: B's 64 rows of the CTA (the wgmma's M side) and
        // all of A's rows, padded to 16 m_tiles (its N side).
        encode_2d(&l.maps.a, a, "a", static_cast<uint64_t>(a.dim(1)), static_cast<uint64_t>(a.dim(0)), kGemvWgmmaStageK,
                  static_cast<uint32_t>(16 * plan.small_m_tiles), CU_TENSOR_MAP_SWIZZLE_128B);
        encode_2d(&l.maps.b, b, "b", static_cast<uint64_t>(b.dim(1)), static_cast<uint64_t>(b.dim(0)), kGemvWgmmaStageK,
                  kGemvWgmmaCols, CU_TENSOR_MAP_SWIZZLE_128B);
    } else if (bulk_rows) {
        // A is read 16 bytes at a time (the plan checked B): 16-byte aligned rows.
        WEFT_CHECK(reinterpret_cast<uintptr_t>(a.data) % 16 == 0 &&
                       (a.dim(0) <= 1 || (a.stride(0) * dtype_bytes(a.dtype)) % 16 == 0),
                   "gemm: small-M variant 4 (bulk-copied rows) needs a's base and row stride 16-byte aligned, got "
                       << a.describe());
        WEFT_CHECK(b.stride(0) == b.dim(1) || b.dim(0) <= 1,
                   "gemm: small-M variant 4 (bulk-copied rows) needs b's rows back to back (ldb = K), got "
                       << b.describe());
    } else {
        const CUtensorMapSwizzle swizzle =
            kGemvBulkBoxK == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE;
        encode_2d(&l.maps.a, a, "a", static_cast<uint64_t>(a.dim(1)), static_cast<uint64_t>(a.dim(0)), kGemvBulkBoxK,
                  static_cast<uint32_t>(16 * plan.small_m_tiles), swizzle);
        encode_2d(&l.maps.b, b, "b", static_cast<uint64_t>(b.dim(1)), static_cast<uint64_t>(b.dim(0)), kGemvBulkBoxK,
                  static_cast<uint32_t>(32 * shape.n_tiles), swizzle);
    }
    l.grid = dim3(static_cast<unsigned>(plan.grid), static_cast<unsigned>(plan.small_m_splits), 1);
    const int threads = wgmma       ? kGemvWgmmaThreads
                        : bulk_rows ? gemv_rows_threads(l.args.m, l.args.k)
                                    : kGemvBulkThreads;
    l.block = dim3(static_cast<unsigned>(threads), 1, 1);
    l.smem_bytes = gemv_smem_bytes(config);
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
    constexpr std::chrono::milliseconds kGemmDefaultTimeout{10000};  // GemmOptions::timeout's documented default
    // The grouped GEMM and the MoE layers pass their own options' timeout here.
    const std::chrono::milliseconds ms = weft::detail::resolve_timeout(options.timeout, env::get("WEFT_TIMEOUT_MS"),
                                                                       "gemm: options.timeout", kGemmDefaultTimeout);
    return static_cast<uint64_t>(ms.count()) * 1000000ull;
}

jit::Kernel& gemm_jit_kernel(const jit::KernelSpec& spec) {
    const int device = current_device();
    std::ostringstream id;
    id << spec.header << '\n' << spec.instantiation << '\n' << spec.arch << '\n' << spec.preamble << '\n'
       << spec.extra_code << '\n' << spec.options.canonical();
    const std::pair<int, std::string> key{device, id.str()};
    LaunchMemo& r = launch_memo();
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

void launch_gemm_kernel(const jit::Kernel& kernel, const GemmConfig& c, const GemmTensorMaps& maps,
                        const GemmArgs& args, int grid, const void* sched_params, size_t sched_bytes,
                        const void* hook_params, size_t hook_bytes, cudaStream_t stream) {
    WEFT_CHECK(is_valid(c), "gemm: invalid config " << format_gemm_config(c));
    WEFT_CHECK(sched_params != nullptr && hook_params != nullptr,
               "gemm: the scheduler and hook parameters must be given (kernel " << kernel.description() << ")");
    WEFT_CHECK(c.splits == 1 || (args.partials != nullptr && args.counters != nullptr),
               "gemm: a split-K config (splits " << c.splits << ") needs GemmArgs::partials and counters (kernel "
                                                 << kernel.description() << ")");
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
    void* params[] = {&local.a, &local.b, &local.d,
                      &a,        const_cast<void*>(sched_params), const_cast<void*>(hook_params)};
    const size_t bytes[] = {sizeof(CUtensorMap), sizeof(CUtensorMap), sizeof(CUtensorMap), sizeof(GemmArgs),
                            sched_bytes, hook_bytes};
    kernel.launch_packed(lp, params, bytes, 6);
}

int fit_gemm_grid(const jit::Kernel& kernel, const GemmConfig& c, int grid) {
    const int cluster = c.cluster_m * c.cluster_n;
    if (cluster <= 1) return grid;
    const int device = current_device();
    const std::pair<int, const jit::Kernel*> key{device, &kernel};
    LaunchMemo& r = launch_memo();
    int fit = 0;
    {
        std::lock_guard<std::mutex> lock(r.mutex);
        if (auto it = r.jit_cluster_fit.find(key); it != r.jit_cluster_fit.end()) fit = it->second;
    }
    if (fit == 0) {
        const int smem = gemm_smem_plan(c).alloc_bytes;
        // The query needs the function's limit at the launch's shared memory: the kernel's one cache of it.
        const CUfunction function = kernel.allow_dynamic_smem(static_cast<size_t>(smem));
        CUlaunchConfig cfg{};
        cfg.gridDimX = static_cast<unsigned>(grid);
        cfg.gridDimY = 1;
        cfg.gridDimZ = 1;
        cfg.blockDimX = kGemmThreads;
        cfg.blockDimY = 1;
        cfg.blockDimZ = 1;
        cfg.sharedMemBytes = static_cast<unsigned>(smem);
        CUlaunchAttribute attr{};
        attr.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attr.value.clusterDim.x = static_cast<unsigned>(cluster);
        attr.value.clusterDim.y = 1;
        attr.value.clusterDim.z = 1;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        const CUresult e = driver().cuOccupancyMaxActiveClusters(&fit, function, &cfg);
        if (e != CUDA_SUCCESS) {
            // Not fatal: more clusters than fit at once run in waves (the persistent loop needs no co-residency).
            const char* name = "?";
            driver().cuGetErrorName(e, &name);
            WEFT_LOG_WARN("gemm: cannot query how many clusters of " << kernel.description() << " fit (" << name
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
    LaunchMemo& r = launch_memo();
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

jit::Kernel& gemv_jit_kernel(int device, const GemvConfig& config) {
    LaunchMemo& r = launch_memo();
    {
        std::lock_guard<std::mutex> lock(r.mutex);
        for (const auto& [dev, c, k] : r.jit_gemv) {
            if (dev == device && c == config) return *k;
        }
    }
    jit::Kernel& kernel = detail::gemm_jit_kernel(gemv_kernel_spec(config, arch_of_device(device)));
    std::lock_guard<std::mutex> lock(r.mutex);
    r.jit_gemv.emplace_back(device, config, &kernel);
    return kernel;
}

// The kernel spec a plan launches.
jit::KernelSpec jit_spec_for(const GemmPlan& plan, const GemmProblem& p, const std::string& arch) {
    if (plan.path == GemmPath::kSmallM) {
        return gemv_kernel_spec(gemv_config(plan, p), arch);
    }
    return gemm_kernel_spec(plan.config, arch);
}

// Compiles the JIT kernels of the candidates on several threads before the autotuner times them one by one.
void compile_candidates(const std::vector<GemmCandidate>& candidates, const GemmProblem& p, const std::string& arch) {
    std::vector<jit::KernelSpec> specs;
    for (const auto& c : candidates) specs.push_back(jit_spec_for(c.plan, p, arch));

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

// The split-K counters (`counter_bytes`, zero) and partials of a plan: the caller's options.workspace or the
// per-(device, stream) scratch.
std::pair<uint32_t*, float*> split_k_workspace(const GemmPlan& plan, size_t counter_bytes, const GemmOptions& options,
                                               cudaStream_t stream) {
    if (options.workspace != nullptr) {
        WEFT_CHECK(options.workspace_bytes >= plan.workspace_bytes,
                   "gemm: options.workspace_bytes must be >= " << plan.workspace_bytes << ", got "
                                                              << options.workspace_bytes);
        WEFT_CHECK(reinterpret_cast<uintptr_t>(options.workspace) % 256 == 0,
                   "gemm: options.workspace must be 256-byte aligned");
        return {static_cast<uint32_t*>(options.workspace),
                reinterpret_cast<float*>(static_cast<char*>(options.workspace) + counter_bytes)};
    }
    const SmallMScratch w = small_m_scratch(counter_bytes, plan.workspace_bytes - counter_bytes, stream);
    return {static_cast<uint32_t*>(w.counters), static_cast<float*>(w.partials)};
}

// Enqueues one plan (plan_gemm's or the autotuner's) for validated views.
void launch_plan(const GemmPlan& plan_in, const GemmProblem& p, const TensorView& a, const TensorView& b,
                 const TensorView& d, const GemmOptions& options, cudaStream_t stream) {
    GemmPlan plan = plan_in;
    const int device = current_device();
    if (plan.path == GemmPath::kSmallM) {
        detail::GemvLaunch launch = detail::make_gemv_launch(plan, a, b, d);
        GemvArgs& args = launch.args;
        if (plan.workspace_bytes > 0) {
            // Counters first, rounded to 256 bytes, as gemm_workspace_bytes lays them out.
            const auto counter_bytes = static_cast<size_t>(round_up(int64_t{plan.grid} * 4, 256));
            std::tie(args.counters, args.partials) = split_k_workspace(plan, counter_bytes, options, stream);
        }
        const bool programmatic = gemm_launches_programmatically(plan, options);
        args.programmatic = programmatic ? 1 : 0;
        jit::Kernel& kernel = gemv_jit_kernel(device, gemv_config(plan, p));
        jit::LaunchParams lp;
        lp.grid = launch.grid;
        lp.block = launch.block;
        lp.dynamic_smem_bytes = static_cast<size_t>(launch.smem_bytes);
        lp.stream = stream;
        lp.cluster = launch.cluster;
        lp.programmatic = programmatic;
        kernel.launch(lp, launch.args, launch.maps);
        return;
    }

    const detail::GemmTensorMaps maps = detail::make_gemm_tensor_maps(plan.config, a, b, d);
    GemmArgs args = detail::make_gemm_args(a, d, detail::gemm_timeout_ns(options));
    if (plan.config.splits > 1) {
        const GemmSplitKLayout l = gemm_split_k_layout(plan.config, args.m, args.n);
        WEFT_CHECK(plan.workspace_bytes >= static_cast<size_t>(l.counter_bytes + l.partial_bytes),
                   "gemm: the plan's workspace_bytes " << plan.workspace_bytes << " is smaller than split-K needs ("
                                                       << l.counter_bytes + l.partial_bytes << ")");
        std::tie(args.counters, args.partials) =
            split_k_workspace(plan, static_cast<size_t>(l.counter_bytes), options, stream);
    }
    const int32_t sched_params = 0;  // PersistentScheduler::Params and NoEpilogueHook::Params: one int32
    const int32_t hook_params = 0;
    jit::Kernel& kernel = tiled_jit_kernel(device, plan.config);
    plan.grid = detail::fit_gemm_grid(kernel, plan.config, plan.grid);
    detail::launch_gemm_kernel(kernel, plan.config, maps, args, plan.grid, sched_params, hook_params, stream);
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
        sel.candidate = gemm_candidate_name(sel.plan);
        sel.origin = options.config ? GemmChoice::kOptions : GemmChoice::kHeuristic;
        return sel;
    }
    const std::string arch = arch_of_device(device);
    // Candidates are timed on weft's per-stream scratch, never on a workspace of the caller's: each candidate keeps
    // counters of its own size there, and one's partials would land on another's counters (which must stay zero).
    // A candidate the caller's workspace cannot hold is refused (the autotuner disqualifies it): it would win, and
    // then fail every call.
    GemmOptions timing = options;
    timing.workspace = nullptr;
    timing.workspace_bytes = 0;
    const GemmRunPlan run = [&](const GemmPlan& plan, cudaStream_t s) {
        WEFT_CHECK(options.workspace == nullptr || plan.workspace_bytes <= options.workspace_bytes,
                   "gemm: the candidate needs " << plan.workspace_bytes << " bytes of workspace, options.workspace has "
                                                << options.workspace_bytes);
        launch_plan(plan, p, a, b, d, timing, s);
    };
    const GemmPrepareCandidates prepare = [&](const std::vector<GemmCandidate>& candidates) {
        compile_candidates(candidates, p, arch);
    };
    GemmSelection sel = select_gemm_plan(p, num_sms, options, arch, run, stream, stream_is_capturing(stream), prepare);
    if (options.workspace != nullptr && sel.plan.workspace_bytes > options.workspace_bytes) {
        // A decision recorded for this problem without the caller's workspace (cached, or forced) that does not fit it.
        sel.plan = plan_gemm(p, num_sms, options);
        sel.candidate = gemm_candidate_name(sel.plan);
        sel.origin = GemmChoice::kHeuristic;
    }
    return sel;
}

// D is written while A and B are still being read (by other CTAs, or other k ranges of a split-K tile): their bytes
// must not meet. Nor may a caller's workspace (its workspace_bytes) meet any of them: split-K writes its counters and
// partials there while the kernel reads A and B and writes D.
void check_output_apart(const TensorView& a, const TensorView& b, const TensorView& d, const GemmOptions& options) {
    WEFT_CHECK(!detail::views_overlap(d, a) && !detail::views_overlap(d, b),
               "gemm: d's bytes must not overlap a's or b's, got d " << d.describe() << " at " << d.data << ", a "
                                                                     << a.describe() << " at " << a.data << ", b "
                                                                     << b.describe() << " at " << b.data);
    if (options.workspace != nullptr && options.workspace_bytes > 0 && options.workspace_bytes <= INT64_MAX) {
        const TensorView workspace(options.workspace, DType::kU8, {static_cast<int64_t>(options.workspace_bytes)});
        detail::check_apart("gemm", "options.workspace", workspace, {{"a", a}, {"b", b}, {"d", d}},
                            "split-K writes its counters and partials there while the kernel reads a and b and "
                            "writes d");
    }
}

}  // namespace

GemmSelection select_gemm(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout,
                          cudaStream_t stream, const GemmOptions& options) {
    const GemmProblem p = validate_gemm_args(a, b, d, b_layout);
    validate_gemm_options(p, options);
    check_output_apart(a, b, d, options);
    return select_for_views(p, a, b, d, stream, options);
}

void gemm(const TensorView& a, const TensorView& b, const TensorView& d, BLayout b_layout, cudaStream_t stream,
          const GemmOptions& options) {
    WEFT_NVTX_RANGE("gemm");
    const GemmProblem p = validate_gemm_args(a, b, d, b_layout);
    validate_gemm_options(p, options);  // before anything touches the device, whatever the problem's size
    check_output_apart(a, b, d, options);
    if (p.m == 0 || p.n == 0) return;   // nothing to write
    // Host memory or another GPU's would reach the tensor maps unchecked (a fault, or silent peer traffic).
    detail::check_device_views({{"a", a}, {"b", b}, {"d", d}}, "gemm", stream);
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
