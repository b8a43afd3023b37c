// SPDX-License-Identifier: MIT
// weft::ops::flash_attention and weft::ops::AgAttention: argument checks, the JIT prefill kernel and its launch, and
// the all-gather of K/V on a copy stream with one arrival flag per rank's shard.
#include "weft/ops/ag_attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "abort_mark.hpp"
#include "attention_scale.hpp"
#include "collective_workspace.hpp"
#include "stream_key.hpp"
#include "tp_common.hpp"
#include "views_overlap.hpp"
#include "weft/common/collectives.hpp"
#include "weft/common/tp_params.hpp"
#include "weft/jit/aot.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/nvtx.hpp"
#include "weft/runtime/stream.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops {

namespace {

constexpr int64_t kMaxSeq = (int64_t{1} << 31) - (int64_t{1} << 20);

// A view of `ndim` dimensions, every extent >= 0, innermost stride 1, non-null when it holds elements, data aligned
// to `align` bytes.
void check_basic(const TensorView& v, const char* op, const char* what, int ndim, size_t align) {
    WEFT_CHECK(v.ndim == ndim, op << ": " << what << " must have " << ndim << " dimensions, got " << v.describe());
    for (int i = 0; i < ndim; ++i) {
        WEFT_CHECK(v.dim(i) >= 0, op << ": " << what << " has a negative extent: " << v.describe());
    }
    WEFT_CHECK(v.numel() == 0 || v.data != nullptr,
               op << ": " << what << " is null but holds " << v.numel() << " elements (" << v.describe() << ")");
    WEFT_CHECK(v.dim(ndim - 1) <= 1 || v.stride(ndim - 1) == 1,
               op << ": " << what << " must have innermost stride 1, got " << v.describe());
    WEFT_CHECK(reinterpret_cast<uintptr_t>(v.data) % align == 0,
               op << ": " << what << " must be " << align << "-byte aligned, got " << v.data);
}

// Outer strides of a 16-bit tensor read with 16-byte copies: non-negative multiples of 8 elements.
void check_vector_strides(const TensorView& v, const char* op, const char* what) {
    for (int i = 0; i + 1 < v.ndim; ++i) {
        WEFT_CHECK(v.stride(i) >= 0 && v.stride(i) % 8 == 0, op << ": " << what << " stride " << i
                                                                << " must be a non-negative multiple of 8 elements "
                                                                << "(16-byte rows), got " << v.describe());
    }
}

// The wgmma kernel reads q, k and v through tensor maps, whose strides (in bytes) must be positive multiples of 16
// below 2^40: each stride the map follows (that of an extent above 1) must be positive and below 2^40 bytes
// (check_vector_strides has made it a multiple of 16 bytes). A broadcast (stride 0) fails the encode otherwise.
// The first stride of v that a tensor map cannot follow, or -1 when there is none.
int bad_tensor_map_stride(const TensorView& v) {
    const int64_t max_elems = (int64_t{1} << 40) / dtype_bytes(v.dtype);
    for (int i = 0; i + 1 < v.ndim; ++i) {
        if (v.dim(i) > 1 && !(v.stride(i) > 0 && v.stride(i) < max_elems)) return i;
    }
    return -1;
}

bool tensor_map_strides_ok(const TensorView& v) { return bad_tensor_map_stride(v) < 0; }

void check_tensor_map_strides(const TensorView& v, const char* op, const char* what) {
    const int i = bad_tensor_map_stride(v);
    WEFT_CHECK(i < 0, op << ": " << what << " stride " << i << " must be positive and below 2^40 bytes (a multiple of "
                         << "16 bytes) for the wgmma kernel's tensor maps, got " << v.describe()
                         << " (a broadcast with stride 0 runs on the mma.sync kernel: flash_attention picks it when "
                         << "options.config is unset; AgAttention needs options.config with its kernel set to "
                         << "AttentionPrefillKernel::kMmaSync)");
}

bool is_empty_view(const TensorView& v) { return v.data == nullptr && v.ndim == 0; }

const char* kernel_name(AttentionPrefillKernel k) {
    switch (k) {
        case AttentionPrefillKernel::kMmaSync: return "mma.sync";
        case AttentionPrefillKernel::kWgmma: return "wgmma";
    }
    return "unknown";
}

void check_config(const AttentionPrefillConfig& c, DType dtype, int64_t head_dim, const char* op) {
    const char* why = attention_prefill_invalid_reason(c);
    WEFT_CHECK(why == nullptr, op << ": options.config is not a valid AttentionPrefillConfig: " << (why ? why : "")
                                  << " (got kernel " << static_cast<int>(c.kernel) << ", head_dim " << c.head_dim
                                  << ", block_m " << c.block_m << ", stages " << c.stages << ")");
    WEFT_CHECK(c.dtype == dtype && c.head_dim == head_dim,
               op << ": options.config must have the inputs' dtype " << dtype_name(dtype) << " and head_dim "
                  << head_dim << ", got " << dtype_name(c.dtype) << " and " << c.head_dim);
}

}  // namespace

AttentionPrefillKernel attention_prefill_device_kernel() {
    int device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    int major = 0;
    int minor = 0;
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    return attention_prefill_default_kernel(major, minor);
}

namespace {

/// A config on a device: the key of the per-config memos below.
using ConfigKey = std::tuple<int, int, int, int, int, int>;
ConfigKey config_key(int device, const AttentionPrefillConfig& c) {
    return {device, static_cast<int>(c.dtype), c.head_dim, c.block_m, c.stages, static_cast<int>(c.kernel)};
}

// The prefill kernel of one config, compiled and loaded on first use per device.
jit::Kernel& kernel_for(const AttentionPrefillConfig& c) {
    static std::mutex mutex;
    static std::map<ConfigKey, jit::Kernel*> memo;
    int device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    const ConfigKey key = config_key(device, c);
    {
        std::lock_guard<std::mutex> lock(mutex);
        auto it = memo.find(key);
        if (it != memo.end()) return *it->second;
    }
    WEFT_CHECK(c.kernel != AttentionPrefillKernel::kWgmma || attention_prefill_device_kernel() == c.kernel,
               "flash_attention: the wgmma prefill kernel (AttentionPrefillConfig::kernel = kWgmma) runs on sm_90 "
               "devices only; this is device "
                   << device << ": use kMmaSync");
    jit::Kernel& k = jit::compiler().get_kernel(attention_prefill_kernel_spec(c));
    k.allow_dynamic_smem(static_cast<size_t>(attention_prefill_smem_bytes(c)));
    std::lock_guard<std::mutex> lock(mutex);
    memo[key] = &k;
    return k;
}

CUtensorMapDataType tma_dtype(DType t) {
    return t == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

// A 3-D map over [rows, heads, head_dim] (strides in elements), innermost first, box {64, 1, box_rows}, 128B swizzle,
// out-of-bounds rows read as zeros. An extent-1 dimension's stride is never followed: rounded up to a legal value.
void encode_rows_map(CUtensorMap* map, const char* name, DType dtype, const void* data, int64_t head_dim, int64_t heads,
                     int64_t rows, int64_t head_stride, int64_t row_stride, uint32_t box_rows) {
    const auto elem = static_cast<int64_t>(dtype_bytes(dtype));
    const auto legal = [&](int64_t extent, int64_t stride_elems) {
        const int64_t bytes = stride_elems * elem;
        return static_cast<uint64_t>(extent <= 1 ? std::max<int64_t>((bytes + 15) / 16 * 16, 16) : bytes);
    };
    const uint64_t dims[3] = {static_cast<uint64_t>(head_dim), static_cast<uint64_t>(heads),
                              static_cast<uint64_t>(rows)};
    const uint64_t strides[2] = {legal(heads, head_stride), legal(rows, row_stride)};
    const uint32_t box[3] = {64, 1, box_rows};
    const uint32_t elem_strides[3] = {1, 1, 1};
    const CUresult r =
        driver().cuTensorMapEncodeTiled(map, tma_dtype(dtype), 3, const_cast<void*>(data), dims, strides, box,
                                        elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    WEFT_CHECK(r == CUDA_SUCCESS, "flash_attention: cuTensorMapEncodeTiled failed for "
                                      << name << " ([" << rows << ", " << heads << ", " << head_dim << "], strides "
                                      << row_stride << ", " << head_stride << " elements, box rows " << box_rows
                                      << "): CUresult " << static_cast<int>(r)
                                      << " (the wgmma kernel needs positive strides that are multiples of 16 bytes)");
}

}  // namespace

jit::KernelSpec attention_prefill_kernel_spec(const AttentionPrefillConfig& config, const std::string& arch) {
    WEFT_CHECK(is_valid(config), "attention_prefill_kernel_spec: invalid AttentionPrefillConfig (dtype "
                                     << dtype_name(config.dtype) << ", head_dim " << config.head_dim << ", block_m "
                                     << config.block_m << ", stages " << config.stages << ")");
    const bool wgmma = config.kernel == AttentionPrefillKernel::kWgmma;
    std::ostringstream inst;
    inst << "weft::kernels::attention::" << (wgmma ? "prefill_forward_sm90" : "prefill_forward")
         << "<weft::AttentionPrefillConfig{.dtype = " << dtype_enum_name(config.dtype)
         << ", .head_dim = " << config.head_dim << ", .block_m = " << config.block_m << ", .stages = " << config.stages
         << (wgmma ? ", .kernel = weft::AttentionPrefillKernel::kWgmma" : "") << "}>";
    std::ostringstream desc;
    desc << "attention prefill " << (wgmma ? "wgmma " : "") << dtype_name(config.dtype)
         << " head_dim=" << config.head_dim << " block_m=" << config.block_m << " stages=" << config.stages;
    jit::KernelSpec spec;
    spec.header = wgmma ? "attention/prefill_sm90.cuh" : "attention/prefill.cuh";
    spec.instantiation = inst.str();
    spec.description = desc.str();
    spec.arch = arch;
    return spec;
}

namespace {

// Work counters of the wgmma prefill launches (each launch leaves its counter at zero). A launch on a stream that is
// not being captured uses the stream's own (one per device and stream; cudaStreamPerThread, one handle for a stream
// per thread, per device and thread). A launch captured in a CUDA graph takes a counter of its own for good, from
// spares that an uncaptured call made and zeroed beforehand (no allocation inside a capture): the graph's launches
// then share their counters with no stream and no other capture (an instantiation's launches are ordered behind its
// earlier ones). Null when a capture finds no spare (no uncaptured call on this device yet, or the spares used up
// since the last one): the launch then walks the items in waves.
constexpr size_t kSpareCounters = 64;

// A block of kSpareCounters zeroed counters on the current device (malloc_beside_captures: zeroed on a private stream,
// not the caller's, whose queued work the host need not wait for).
uint32_t* make_zeroed_counters() {
    return static_cast<uint32_t*>(detail::malloc_beside_captures(kSpareCounters * sizeof(uint32_t), true));
}

uint32_t* prefill_item_counter(cudaStream_t stream) {
    static std::mutex mutex;
    static std::map<detail::StreamKey, uint32_t*> per_stream;
    static std::map<int, std::vector<uint32_t*>> spares;
    const detail::StreamKey key = detail::StreamKey::of(stream);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
        std::lock_guard<std::mutex> lock(mutex);
        std::vector<uint32_t*>& spare = spares[key.device];
        if (spare.empty()) return nullptr;
        uint32_t* counter = spare.back();
        spare.pop_back();
        return counter;
    }
    bool refill = false;
    {
        std::lock_guard<std::mutex> lock(mutex);
        refill = spares[key.device].size() < kSpareCounters / 4;
    }
    // Made without the lock held (the host waits for the zeroing): two threads may both make a block, both kept.
    uint32_t* block = refill ? make_zeroed_counters() : nullptr;
    std::lock_guard<std::mutex> lock(mutex);
    std::vector<uint32_t*>& spare = spares[key.device];
    for (size_t i = 0; block != nullptr && i < kSpareCounters; ++i) spare.push_back(block + i);
    uint32_t*& counter = per_stream[key];
    if (counter == nullptr) {
        if (spare.empty()) {  // taken by concurrent captures since the check above: the next call makes more
            per_stream.erase(key);
            return nullptr;
        }
        counter = spare.back();
        spare.pop_back();
    }
    return counter;
}

}  // namespace

void register_prefill_attention_aot_specs() {
    static std::once_flag once;
    std::call_once(once, [] {
        for (DType t : {DType::kBF16, DType::kF16}) {
            for (int32_t d : {64, 128}) {
                jit::register_aot_spec(attention_prefill_kernel_spec(attention_prefill_default_config(t, d)));
                AttentionPrefillConfig wgmma = attention_prefill_default_config(t, d, AttentionPrefillKernel::kWgmma);
                jit::register_aot_spec(attention_prefill_kernel_spec(wgmma));
                if (wgmma.block_m == 192) {  // and the 128-row items of calls too small for 192 (call_config)
                    wgmma.block_m = 128;
                    jit::register_aot_spec(attention_prefill_kernel_spec(wgmma));
                }
            }
        }
    });
}

namespace detail {

FlashAttentionPlan plan_flash_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                        const TensorView& out, const TensorView& lse,
                                        const FlashAttentionOptions& options, const char* op) {
    check_basic(q, op, "q", 3, 16);
    WEFT_CHECK(q.dtype == DType::kBF16 || q.dtype == DType::kF16,
               op << ": q must be bf16 or f16, got " << dtype_name(q.dtype));
    check_vector_strides(q, op, "q");
    const int64_t seq_q = q.dim(0);
    const int64_t num_q_heads = q.dim(1);
    const int64_t head_dim = q.dim(2);
    WEFT_CHECK(head_dim == 64 || head_dim == 128,
               op << ": head_dim (q's last extent) must be 64 or 128, got " << q.describe());
    check_basic(k, op, "k", 3, 16);
    check_basic(v, op, "v", 3, 16);
    WEFT_CHECK(k.dtype == q.dtype,
               op << ": k must have q's dtype " << dtype_name(q.dtype) << ", got " << dtype_name(k.dtype));
    WEFT_CHECK(v.dtype == q.dtype,
               op << ": v must have q's dtype " << dtype_name(q.dtype) << ", got " << dtype_name(v.dtype));
    check_vector_strides(k, op, "k");
    check_vector_strides(v, op, "v");
    for (int i = 0; i < 3; ++i) {
        WEFT_CHECK(v.dim(i) == k.dim(i) && v.stride(i) == k.stride(i),
                   op << ": v must have k's shape and strides, got " << v.describe() << " and " << k.describe());
    }
    const int64_t seq_kv = k.dim(0);
    const int64_t num_kv_heads = k.dim(1);
    WEFT_CHECK(k.dim(2) == head_dim, op << ": k's head_dim must be q's (" << head_dim << "), got " << k.describe());
    WEFT_CHECK(num_kv_heads >= 1, op << ": num_kv_heads (k extent 1) must be at least 1, got " << k.describe());
    WEFT_CHECK(num_q_heads >= num_kv_heads && num_q_heads % num_kv_heads == 0,
               op << ": num_q_heads (" << num_q_heads << ") must be a positive multiple of num_kv_heads ("
                  << num_kv_heads << ")");
    const int64_t group = num_q_heads / num_kv_heads;
    WEFT_CHECK(group <= kPrefillMaxGroup, op << ": at most " << kPrefillMaxGroup
                                             << " q-heads per KV head are supported, got " << num_q_heads << " / "
                                             << num_kv_heads << " = " << group);
    WEFT_CHECK(seq_q < kMaxSeq && seq_kv < kMaxSeq,
               op << ": seq_q and seq_kv must be below " << kMaxSeq << ", got " << seq_q << " and " << seq_kv);
    WEFT_CHECK(num_q_heads <= 65536, op << ": at most 65536 q-heads, got " << num_q_heads);

    check_basic(out, op, "out", 3, 16);
    WEFT_CHECK(out.dtype == q.dtype,
               op << ": out must have q's dtype " << dtype_name(q.dtype) << ", got " << dtype_name(out.dtype));
    WEFT_CHECK(out.dim(0) == seq_q && out.dim(1) == num_q_heads && out.dim(2) == head_dim && out.is_contiguous(),
               op << ": out must be contiguous [" << seq_q << ", " << num_q_heads << ", " << head_dim << "], got "
                  << out.describe());
    if (!is_empty_view(lse)) {
        check_basic(lse, op, "lse", 2, 4);
        WEFT_CHECK(lse.dtype == DType::kF32, op << ": lse must be f32, got " << dtype_name(lse.dtype));
        WEFT_CHECK(lse.dim(0) == seq_q && lse.dim(1) == num_q_heads && lse.is_contiguous(),
                   op << ": lse must be contiguous [" << seq_q << ", " << num_q_heads << "], got " << lse.describe());
    }
    WEFT_CHECK(options.mask == AttentionMask::kNone || options.mask == AttentionMask::kCausal,
               op << ": options.mask must be kNone or kCausal, got " << static_cast<int>(options.mask));
    WEFT_CHECK(options.q_position >= 0 && options.q_position < (int64_t{1} << 31),
               op << ": options.q_position must be in [0, 2^31), got " << options.q_position);

    FlashAttentionPlan plan;
    plan.config =
        options.config ? *options.config : attention_prefill_default_config(q.dtype, static_cast<int32_t>(head_dim));
    check_config(plan.config, q.dtype, head_dim, op);
    if (plan.config.kernel == AttentionPrefillKernel::kWgmma) {
        check_tensor_map_strides(q, op, "q");
        check_tensor_map_strides(k, op, "k");  // v has k's strides
    }
    const int64_t m_tiles = attention_prefill_num_m_tiles(static_cast<int32_t>(seq_q), plan.config.block_m);
    plan.num_items = m_tiles * num_q_heads;
    WEFT_CHECK(plan.num_items < (int64_t{1} << 31),
               op << ": " << plan.num_items << " work items (query tiles x q-heads) exceed 2^31 - 1");

    AttentionPrefillParams& p = plan.params;
    p.q = q.data;
    p.k = k.data;
    p.v = v.data;
    p.out = out.data;
    p.lse = is_empty_view(lse) ? nullptr : static_cast<float*>(lse.data);
    p.q_row_stride = q.stride(0);
    p.q_head_stride = q.stride(1);
    p.kv_row_stride = k.stride(0);
    p.kv_head_stride = k.stride(1);
    p.q_position = options.q_position;
    p.seq_q = static_cast<int32_t>(seq_q);
    p.seq_kv = static_cast<int32_t>(seq_kv);
    p.num_q_heads = static_cast<int32_t>(num_q_heads);
    p.num_kv_heads = static_cast<int32_t>(num_kv_heads);
    p.group = static_cast<int32_t>(group);
    p.mask = static_cast<int32_t>(options.mask);
    p.scale_log2 = detail::attention_scale_log2(options.scale, head_dim, op);
    p.chunk_keys = static_cast<int32_t>(std::max<int64_t>(seq_kv, 1));
    p.num_chunks = 1;
    p.local_chunk = 0;
    // The kernel writes out (and lse) while other blocks still read k and v. out may be q itself (same view: each
    // block reads its Q tile before it writes those rows), not a part of it.
    const char* why = "the kernel writes it while other blocks still read the inputs";
    ops::detail::check_apart(op, "out", out, {{"k", k}, {"v", v}}, why);
    const bool out_is_q = out.data == q.data && out.ndim == q.ndim && out.shape == q.shape &&
                          out.strides == q.strides && out.dtype == q.dtype;
    if (!out_is_q) ops::detail::check_apart(op, "out", out, {{"q", q}}, why);
    if (p.lse != nullptr) ops::detail::check_apart(op, "lse", lse, {{"q", q}, {"k", k}, {"v", v}, {"out", out}}, why);
    return plan;
}

int attention_prefill_blocks_per_sm(const AttentionPrefillConfig& config) {
    // Asked once per device and config (flash_attention asks on every call).
    static std::mutex mutex;
    static std::map<ConfigKey, int> memo;
    int device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    const ConfigKey key = config_key(device, config);
    {
        std::lock_guard<std::mutex> lock(mutex);
        auto it = memo.find(key);
        if (it != memo.end()) return it->second;
    }
    jit::Kernel& k = kernel_for(config);
    const size_t smem = static_cast<size_t>(attention_prefill_smem_bytes(config));
    const CUfunction fn = k.allow_dynamic_smem(smem);
    int blocks = 0;
    WEFT_CU_CHECK(
        driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, attention_prefill_threads(config), smem));
    blocks = std::max(1, blocks);
    std::lock_guard<std::mutex> lock(mutex);
    memo[key] = blocks;
    return blocks;
}

void use_prefill_counter(FlashAttentionPlan& plan, uint32_t* counter, int64_t grid) {
    if (plan.config.kernel != AttentionPrefillKernel::kWgmma || plan.num_items == 0) return;
    AttentionPrefillParams& p = plan.params;
    p.item_counter = counter;
    p.head_group = attention_prefill_head_group(p.seq_kv, plan.config.head_dim, p.group, p.num_q_heads,
                                                plan.num_items / p.num_q_heads, std::min(grid, plan.num_items),
                                                tp_detail::device_attribute(cudaDevAttrL2CacheSize));
}

void launch_flash_attention(const FlashAttentionPlan& plan, int64_t grid, cudaStream_t stream) {
    if (plan.num_items == 0) return;
    jit::Kernel& k = kernel_for(plan.config);
    jit::LaunchParams lp;
    lp.grid = dim3(static_cast<unsigned>(grid <= 0 ? plan.num_items : std::min(grid, plan.num_items)));
    lp.block = dim3(static_cast<unsigned>(attention_prefill_threads(plan.config)));
    lp.dynamic_smem_bytes = static_cast<size_t>(attention_prefill_smem_bytes(plan.config));
    lp.stream = stream;
    if (plan.config.kernel != AttentionPrefillKernel::kWgmma) {
        k.launch(lp, plan.params);
        return;
    }
    // The wgmma kernel reads Q, K and V through tensor maps (K/V with no keys: a one-row map that is never read).
    const AttentionPrefillParams& p = plan.params;
    const int64_t d = plan.config.head_dim;
    CUtensorMap maps[3];
    std::memset(maps, 0, sizeof(maps));
    encode_rows_map(&maps[0], "q", plan.config.dtype, p.q, d, p.num_q_heads, p.seq_q, p.q_head_stride, p.q_row_stride,
                    static_cast<uint32_t>(plan.config.block_m));
    const bool no_keys = p.seq_kv == 0;
    const void* k_data = no_keys ? p.out : p.k;
    const void* v_data = no_keys ? p.out : p.v;
    const int64_t kv_rows = no_keys ? 1 : p.seq_kv;
    encode_rows_map(&maps[1], "k", plan.config.dtype, k_data, d, p.num_kv_heads, kv_rows, p.kv_head_stride,
                    p.kv_row_stride, static_cast<uint32_t>(kPrefillWgmmaTileKeys));
    encode_rows_map(&maps[2], "v", plan.config.dtype, v_data, d, p.num_kv_heads, kv_rows, p.kv_head_stride,
                    p.kv_row_stride, static_cast<uint32_t>(kPrefillWgmmaTileKeys));
    k.launch(lp, maps[0], maps[1], maps[2], p);
}

}  // namespace detail

void flash_attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                     const TensorView& lse, cudaStream_t stream, const FlashAttentionOptions& options) {
    WEFT_NVTX_RANGE("flash_attention");
    // Every argument is checked before the device is asked which kernel it runs by default.
    detail::FlashAttentionPlan plan = detail::plan_flash_attention(q, k, v, out, lse, options);
    detail::check_device_views({{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"lse", lse}}, "flash_attention", stream);
    if (!options.config) {
        FlashAttentionOptions o = options;
        // The device's kernel, unless q, k or v is a view its tensor maps cannot hold (a broadcast): mma.sync then.
        AttentionPrefillKernel kernel = attention_prefill_device_kernel();
        if (kernel == AttentionPrefillKernel::kWgmma && !(tensor_map_strides_ok(q) && tensor_map_strides_ok(k))) {
            kernel = AttentionPrefillKernel::kMmaSync;
        }
        o.config = attention_prefill_call_config(q.dtype, static_cast<int32_t>(q.dim(2)), kernel, q.dim(0), q.dim(1),
                                                 tp_detail::device_sm_count());
        plan = detail::plan_flash_attention(q, k, v, out, lse, o);
    }
    // mma.sync: one block per item (the hardware hands the longest items, first in the order, out first and balances
    // the rest). wgmma: a resident grid whose blocks claim the items from a work counter (prefill_item_counter),
    // longest first within groups of q-heads whose K and V share the L2 (attention_prefill_grouped_item); a captured
    // launch that finds no spare counter, attention_prefill_grid's waves.
    int64_t grid = 0;
    if (plan.config.kernel == AttentionPrefillKernel::kWgmma && plan.num_items > 0) {
        const int64_t resident =
            int64_t{tp_detail::device_sm_count()} * detail::attention_prefill_blocks_per_sm(plan.config);
        if (uint32_t* counter = prefill_item_counter(stream)) {
            grid = std::min(plan.num_items, resident);
            detail::use_prefill_counter(plan, counter, grid);
        } else {
            grid = attention_prefill_grid(plan.num_items, resident);
        }
    }
    detail::launch_flash_attention(plan, grid, stream);
}

// ------------------------------------------------------------------------------------------------
// AgAttention

namespace {
constexpr const char* kOp = "ag_attention";
}  // namespace

void validate_ag_attention_shape(const AgAttentionShape& s, int num_ranks, const AgAttentionOptions& o) {
    WEFT_CHECK(num_ranks >= 1, "ag_attention: the team's num_ranks must be >= 1, got " << num_ranks);
    WEFT_CHECK(s.max_seq > 0 && s.max_seq % num_ranks == 0,
               "ag_attention: shape.max_seq must be a positive multiple of the team's num_ranks "
                   << num_ranks << " (equal shards; uneven shards are not supported), got " << s.max_seq);
    WEFT_CHECK(s.max_seq < kMaxSeq, "ag_attention: shape.max_seq must be below " << kMaxSeq << ", got " << s.max_seq);
    WEFT_CHECK(s.head_dim == 64 || s.head_dim == 128,
               "ag_attention: shape.head_dim must be 64 or 128, got " << s.head_dim);
    WEFT_CHECK(s.num_kv_heads >= 1 && s.num_q_heads >= s.num_kv_heads && s.num_q_heads % s.num_kv_heads == 0 &&
                   s.num_q_heads / s.num_kv_heads <= kPrefillMaxGroup && s.num_q_heads <= 65536,
               "ag_attention: shape.num_q_heads must be a multiple of shape.num_kv_heads >= 1 with at most "
                   << kPrefillMaxGroup << " q-heads per KV head, got " << s.num_q_heads << " and " << s.num_kv_heads);
    WEFT_CHECK(s.dtype == DType::kBF16 || s.dtype == DType::kF16,
               "ag_attention: shape.dtype must be bf16 or f16, got " << dtype_name(s.dtype));
    WEFT_CHECK(s.mask == AttentionMask::kNone || s.mask == AttentionMask::kCausal,
               "ag_attention: shape.mask must be kNone or kCausal, got " << static_cast<int>(s.mask));
    WEFT_CHECK(o.sm_budget >= 0, "ag_attention: options.sm_budget must be >= 0 (0 = the world's), got " << o.sm_budget);
    (void)detail::attention_scale_log2(o.scale, s.head_dim, kOp);
    if (o.config) check_config(*o.config, s.dtype, s.head_dim, kOp);
}

struct AgAttention::State {
    Team team;
    World* world;
    int num_ranks = 1, rank = 0;
    DeviceCtx ctx{};
    AgAttentionShape shape;
    AgAttentionOptions options;
    AttentionPrefillConfig config;
    int grid = 1;

    tp_detail::SymmetricAllocations heap;
    tp_detail::StreamSet streams;
    tp_detail::FirstCallSync first_call;
    detail::AbortMark abort_mark;  // run() refuses once an abort was cleared after the op was made

    uint8_t* gathered_k = nullptr;  // [max_seq, num_kv_heads, head_dim]
    uint8_t* gathered_v = nullptr;
    uint64_t* chunk_signals = nullptr;  // [W]
    uint64_t* ready = nullptr;          // [W]
    uint64_t* done = nullptr;           // [W]
    uint64_t* epoch = nullptr;
    uint64_t* block_counter = nullptr;
    uint32_t* item_counter = nullptr;  // the kernel's work counter (the low half of a local word)
    // [W] each rank's call descriptor, in the allocation of `ready` (stored by the peers' notify kernels before their
    // ready flags, compared by the pull kernel after it waited for them)
    uint64_t* signatures = nullptr;

    const jit::Kernel* notify_kernel = nullptr;
    // The pull kernel: the copies themselves for ranks of one process sharing a GPU (tp_detail::pulls_with_kernel),
    // else only the bounded wait for each peer's shard in front of the copy engine's copies.
    const jit::Kernel* pull_kernel = nullptr;
    bool pulls_with_kernel = false;
    cudaStream_t copy_stream = nullptr;
    cudaEvent_t fork = nullptr;
    cudaEvent_t join = nullptr;

    explicit State(const Team& t)
        : team(tp_detail::require_member(t, kOp)),
          world(&t.world()),
          num_ranks(t.num_ranks()),
          rank(t.rank()),
          ctx(t.device_ctx()),
          heap(t) {}
    ~State() { heap.free_all(); }

    int64_t row_bytes() const { return shape.num_kv_heads * shape.head_dim * dtype_bytes(shape.dtype); }
    TensorView view(uint8_t* base, int64_t seq) const {
        return TensorView(base, shape.dtype, {seq, shape.num_kv_heads, shape.head_dim});
    }
    TensorView shard(uint8_t* base, int64_t seq) const {
        const int64_t rows = seq / num_ranks;
        return TensorView(base + rank * rows * row_bytes(), shape.dtype, {rows, shape.num_kv_heads, shape.head_dim});
    }
    void check_seq(int64_t seq) const {
        WEFT_CHECK(seq >= num_ranks && seq <= shape.max_seq && seq % num_ranks == 0,
                   "ag_attention: seq must be a multiple of the team's num_ranks "
                       << num_ranks << " in [" << num_ranks << ", max_seq = " << shape.max_seq << "], got " << seq);
    }
};

AgAttention::AgAttention(World& world, const AgAttentionShape& shape, const AgAttentionOptions& options)
    : AgAttention(world.team(), shape, options) {}

AgAttention::AgAttention(const Team& team, const AgAttentionShape& shape, const AgAttentionOptions& options)
    : s_(std::make_unique<State>(team)) {
    State& s = *s_;
    World& world = *s.world;
    s.abort_mark.note(world);
    validate_ag_attention_shape(shape, s.num_ranks, options);
    s.shape = shape;
    s.options = options;
    // Each rank's queries: its shard of the sequence.
    s.config = options.config
                   ? *options.config
                   : attention_prefill_call_config(shape.dtype, static_cast<int32_t>(shape.head_dim),
                                                   attention_prefill_device_kernel(), shape.max_seq / s.num_ranks,
                                                   shape.num_q_heads, tp_detail::device_sm_count());

    // Symmetric buffers (collective over the team, same order on every member).
    const auto kv_bytes = static_cast<uint64_t>(shape.max_seq * s.row_bytes());
    s.gathered_k = static_cast<uint8_t*>(s.heap.alloc(kv_bytes));
    s.gathered_v = static_cast<uint8_t*>(s.heap.alloc(kv_bytes));
    uint64_t* words = s.heap.alloc_signals(static_cast<uint64_t>(4 * s.num_ranks + 3));
    s.chunk_signals = words;
    s.ready = words + s.num_ranks;
    s.done = s.ready + s.num_ranks;
    s.epoch = s.done + s.num_ranks;
    s.block_counter = s.epoch + 1;
    s.item_counter = reinterpret_cast<uint32_t*>(s.block_counter + 1);
    s.signatures = s.block_counter + 2;
    tp_detail::check_peers_reachable(team, s.gathered_k, kOp);

    // Every kernel a call launches is loaded now (lazy loading behind a waiting kernel can deadlock).
    jit::Kernel& kernel = kernel_for(s.config);
    (void)kernel;
    const bool shared_gpu = world.num_ranks_on_device() > 1;
    // NOTE: ranks sharing a GPU keep one SM of their share free of the persistent kernel (for the notify kernel and
    // copy helpers of the other ranks; an explicit budget of the whole share is capped at the share less one) and run
    // one block per SM, so that every rank's blocks are resident together.
    // A GPU of its own: the persistent kernel leaves one SM of the device free (as many block slots as it holds), for
    // the copy stream's one-CTA waits, each peer's launched behind the previous peer's copies while the kernel runs.
    // An explicit budget above a shared GPU's per-rank share would leave the peers' blocks unresident.
    tp_detail::check_sm_budget_share(world, options.sm_budget, "AgAttention");
    int budget = tp_detail::resolve_sm_budget(options.sm_budget, world.sm_budget());
    if (s.num_ranks > 1 && shared_gpu) budget = tp_detail::cap_for_copy_helpers(world, budget, kOp);
    if (s.num_ranks > 1 && !shared_gpu) budget = std::min(budget, tp_detail::device_sm_count() - 1);
    WEFT_CHECK(budget >= 1, "ag_attention: the SM budget must be >= 1, got " << budget);
    s.grid = options.sm_budget > 0 || shared_gpu ? budget : budget * detail::attention_prefill_blocks_per_sm(s.config);
    if (s.num_ranks > 1) {
        s.notify_kernel = &jit::compiler().get_kernel(detail::ag_notify_kernel_spec());
        s.pull_kernel = &jit::compiler().get_kernel(tp_detail::peer_pull_kernel_spec());
        s.pulls_with_kernel = tp_detail::pulls_with_kernel(world);
        s.copy_stream = s.streams.add_stream();
        s.fork = s.streams.add_event();
        s.join = s.streams.add_event();
        // The first call on ranks sharing a GPU ends before anything more is launched (the same on every member).
        if (world.max_ranks_per_device() > 1) s.first_call.arm(1);
    }
    WEFT_LOG_INFO("ag_attention: " << kernel_name(s.config.kernel) << ", " << dtype_name(shape.dtype) << " head_dim "
                                   << shape.head_dim << ", block_m " << s.config.block_m << ", stages "
                                   << s.config.stages << ", grid " << s.grid << ", team of " << s.num_ranks);
    team.barrier();
}

AgAttention::~AgAttention() = default;

const AgAttentionShape& AgAttention::shape() const { return s_->shape; }
const AttentionPrefillConfig& AgAttention::config() const { return s_->config; }
int AgAttention::grid() const { return s_->grid; }

TensorView AgAttention::gathered_k(int64_t seq) const {
    s_->check_seq(seq);
    return s_->view(s_->gathered_k, seq);
}
TensorView AgAttention::gathered_v(int64_t seq) const {
    s_->check_seq(seq);
    return s_->view(s_->gathered_v, seq);
}
TensorView AgAttention::local_k(int64_t seq) const {
    s_->check_seq(seq);
    return s_->shard(s_->gathered_k, seq);
}
TensorView AgAttention::local_v(int64_t seq) const {
    s_->check_seq(seq);
    return s_->shard(s_->gathered_v, seq);
}

void AgAttention::run(const TensorView& q_local, const TensorView& k_local, const TensorView& v_local,
                      const TensorView& out, const TensorView& lse, cudaStream_t stream) {
    WEFT_NVTX_RANGE("ag_attention");
    State& s = *s_;
    if (s.num_ranks > 1) s.abort_mark.check(*s.world, "ag_attention", "make a new AgAttention");
    const AgAttentionShape& sh = s.shape;
    WEFT_CHECK(q_local.ndim == 3 && k_local.ndim == 3 && v_local.ndim == 3,
               "ag_attention: q_local, k_local and v_local must be 3-D [S/W, heads, head_dim], got "
                   << q_local.describe() << ", " << k_local.describe() << ", " << v_local.describe());
    const int64_t rows = q_local.dim(0);
    WEFT_CHECK(rows >= 1 && rows <= sh.max_seq / s.num_ranks,
               "ag_attention: q_local must have 1 .. max_seq/W = " << sh.max_seq / s.num_ranks << " rows, got "
                                                                   << q_local.describe());
    const int64_t seq = rows * s.num_ranks;
    WEFT_CHECK(q_local.dtype == sh.dtype,
               "ag_attention: q_local must be " << dtype_name(sh.dtype) << ", got " << dtype_name(q_local.dtype));
    WEFT_CHECK(q_local.dim(1) == sh.num_q_heads && q_local.dim(2) == sh.head_dim,
               "ag_attention: q_local must be [S/W, " << sh.num_q_heads << ", " << sh.head_dim << "], got "
                                                      << q_local.describe());
    for (const auto& [view, name] : {std::pair{&k_local, "k_local"}, std::pair{&v_local, "v_local"}}) {
        const TensorView& t = *view;
        WEFT_CHECK(t.dtype == sh.dtype,
                   "ag_attention: " << name << " must be " << dtype_name(sh.dtype) << ", got " << dtype_name(t.dtype));
        WEFT_CHECK(t.dim(0) == rows && t.dim(1) == sh.num_kv_heads && t.dim(2) == sh.head_dim,
                   "ag_attention: " << name << " must be [" << rows << ", " << sh.num_kv_heads << ", " << sh.head_dim
                                    << "] (q_local's rows), got " << t.describe());
        WEFT_CHECK(t.data != nullptr && reinterpret_cast<uintptr_t>(t.data) % 16 == 0,
                   "ag_attention: " << name << " must be a non-null 16-byte aligned device pointer, got " << t.data);
        WEFT_CHECK(t.stride(2) == 1 && t.stride(1) == sh.head_dim &&
                       (rows == 1 || t.stride(0) >= sh.num_kv_heads * sh.head_dim) && t.stride(0) % 8 == 0,
                   "ag_attention: " << name << " must have contiguous heads and dims and a row stride >= "
                                    << sh.num_kv_heads * sh.head_dim << " (a multiple of 8), got " << t.describe());
    }
    // In this call's slot of the gathered buffers, K/V are read there as they are (the copy is skipped): as contiguous
    // rows, the layout the peers pull. Elsewhere in them, they would be copied into the slot while the peers' shards
    // arrive around it (or onto themselves).
    const TensorView all_k = s.view(s.gathered_k, sh.max_seq);
    const TensorView all_v = s.view(s.gathered_v, sh.max_seq);
    for (const auto& [view, name] : {std::pair{&k_local, "k_local"}, std::pair{&v_local, "v_local"}}) {
        const TensorView& t = *view;
        const TensorView slot = s.shard(view == &k_local ? s.gathered_k : s.gathered_v, rows * s.num_ranks);
        WEFT_CHECK(t.data != slot.data || rows == 1 || t.stride(0) == sh.num_kv_heads * sh.head_dim,
                   "ag_attention: " << name << " starts at its slot (local_" << name[0] << "(S)) but has row stride "
                                    << t.stride(0)
                                    << " instead of num_kv_heads x head_dim = " << sh.num_kv_heads * sh.head_dim
                                    << " (the slot is read as contiguous rows, by the peers too)");
        if (t.data != slot.data) {
            detail::check_apart(kOp, name, t,
                                {{"the gathered K buffer (unless it is local_k(S) itself)", all_k},
                                 {"the gathered V buffer (unless it is local_v(S) itself)", all_v}},
                                "it is copied into this call's slot while the peers' shards arrive around it");
        }
    }
    // Q is read while the shards are copied into the gathered buffers (this rank's K/V into its slot first).
    detail::check_apart(kOp, "q_local", q_local,
                        {{"the gathered K buffer (local_k(S), gathered_k(S))", all_k},
                         {"the gathered V buffer (local_v(S), gathered_v(S))", all_v}},
                        "the shards are copied there while the kernel reads Q");
    // The caller's buffers: this GPU's memory (the kernels and copies would fault, and the peers wait until their
    // timeout).
    detail::check_device_buffers(
        s.world->heap(), {{"q_local", q_local}, {"k_local", k_local}, {"v_local", v_local}, {"out", out}, {"lse", lse}},
        kOp, stream);
    // A single row's copy reads that row alone (its stride is checked above all the same).
    const auto src_pitch = [&](const TensorView& t) {
        return static_cast<size_t>(rows == 1 ? s.row_bytes() : t.stride(0) * dtype_bytes(sh.dtype));
    };
    const TensorView gk = s.view(s.gathered_k, seq);
    const TensorView gv = s.view(s.gathered_v, seq);
    FlashAttentionOptions fo;
    fo.scale = s.options.scale;
    fo.mask = sh.mask;
    fo.q_position = s.rank * rows;
    fo.config = s.config;
    // The full argument check (q strides, out, lse) against the gathered K/V.
    detail::FlashAttentionPlan plan = detail::plan_flash_attention(q_local, gk, gv, out, lse, fo, kOp);

    // This rank's K and V into its slot of the gathered buffers (skipped where they already are), on `stream`.
    const auto row_bytes = static_cast<size_t>(s.row_bytes());
    tp_detail::check_row_copy(kOp, "k_local", row_bytes, src_pitch(k_local), row_bytes, static_cast<size_t>(rows));
    tp_detail::check_row_copy(kOp, "v_local", row_bytes, src_pitch(v_local), row_bytes, static_cast<size_t>(rows));
    const auto copy_local_into = [&](uint8_t* slot_k, uint8_t* slot_v) {
        for (const auto& [src, dst] : {std::pair{&k_local, slot_k}, std::pair{&v_local, slot_v}}) {
            if (src->data == dst) continue;
            tp_detail::copy_rows_async(dst, row_bytes, src->data, src_pitch(*src), row_bytes, static_cast<size_t>(rows),
                                       stream);
        }
    };
    if (s.num_ranks == 1) {
        // The kernel straight on the caller's K/V; the copy into the gathered buffer is what a call leaves behind. K
        // and V with different row strides (which one kernel launch cannot read) are copied first and read from there.
        const bool same_strides = k_local.stride(0) == v_local.stride(0);
        detail::FlashAttentionPlan local =
            same_strides ? detail::plan_flash_attention(q_local, k_local, v_local, out, lse, fo, kOp) : std::move(plan);
        if (!same_strides) copy_local_into(s.gathered_k, s.gathered_v);
        detail::use_prefill_counter(local, s.item_counter, s.grid);
        detail::launch_flash_attention(local, s.grid, stream);
        if (same_strides) copy_local_into(s.gathered_k, s.gathered_v);
        s.heap.note_use(stream);  // the destructor waits for this op's work before freeing its buffers
        return;
    }

    // Set-up on the host first: nothing that can throw may sit between this rank's launches (the peers would wait
    // on the device for work that never comes).
    const int64_t shard_bytes = rows * s.row_bytes();
    struct Pull {
        int peer;
        void* dst_k;
        void* dst_v;
        const void* src_k;
        const void* src_v;
    };
    std::vector<Pull> pulls;
    for (int32_t i = 1; i < s.num_ranks; ++i) {
        const int32_t c = attention_prefill_chunk_at(s.rank, s.num_ranks, i);
        // The causal mask: rank r's queries see shards 0..r only; the others are neither pulled nor awaited.
        if (sh.mask == AttentionMask::kCausal && c > s.rank) continue;
        Pull pull{};
        pull.peer = c;
        pull.dst_k = s.gathered_k + c * shard_bytes;
        pull.dst_v = s.gathered_v + c * shard_bytes;
        pull.src_k = s.world->heap().symm_at(pull.dst_k, s.team.world_rank(c));
        pull.src_v = s.world->heap().symm_at(pull.dst_v, s.team.world_rank(c));
        WEFT_CHECK(pull.src_k != nullptr && pull.src_v != nullptr, "ag_attention: the gathered K/V of team rank "
                                                                       << c << " (world rank " << s.team.world_rank(c)
                                                                       << ") is not reachable");
        pulls.push_back(pull);
    }
    // The same pulls as pull-kernel items (K, then V and the shard's flag), for ranks of one process sharing a GPU.
    std::vector<PeerPullItem> items;
    if (s.pulls_with_kernel) {
        const auto bytes = static_cast<uint64_t>(shard_bytes);
        for (const Pull& pull : pulls) {
            items.push_back(PeerPullItem{s.ready + pull.peer, pull.dst_k, pull.src_k, nullptr, bytes, pull.peer, -1});
            items.push_back(
                PeerPullItem{nullptr, pull.dst_v, pull.src_v, s.chunk_signals + pull.peer, bytes, pull.peer, pull.peer});
        }
    }
    AttentionPrefillParams& p = plan.params;
    p.ctx = s.ctx;
    p.chunk_keys = static_cast<int32_t>(rows);
    p.num_chunks = s.num_ranks;
    p.local_chunk = s.rank;
    p.chunk_signals = s.chunk_signals;
    p.finish.block_counter = s.block_counter;
    p.finish.chunk_signals = s.chunk_signals;
    p.finish.ready = s.ready;
    p.finish.done = s.done;
    p.finish.epoch = s.epoch;
    detail::use_prefill_counter(plan, s.item_counter, s.grid);
    // What every rank's call must agree on: S (every shard sits where the peers pull it from); the shape's heads,
    // head_dim, dtype and mask are folded in (the members may have built their ops differently).
    const uint64_t signature = make_call_descriptor(
        CollectiveOp::kAgAttention, 0, true, sh.dtype, static_cast<uint64_t>(seq),
        call_descriptor_mix(call_descriptor_mix(call_descriptor_mix(0, static_cast<uint64_t>(sh.num_kv_heads)),
                                                static_cast<uint64_t>(sh.head_dim)),
                            static_cast<uint64_t>(sh.mask)));
    const AgNotifyParams notify{s.ctx, s.ready, s.signatures, signature, {}};

    // 0. Fork the copy stream: it only needs the previous call to be over (it is, in stream order).
    WEFT_CUDA_CHECK(cudaEventRecord(s.fork, stream));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(s.copy_stream, s.fork, 0));
    // 1. This rank's shard into its slot of the gathered buffers, then ready[rank] = 1 on every peer.
    copy_local_into(s.gathered_k + s.rank * shard_bytes, s.gathered_v + s.rank * shard_bytes);
    {
        jit::LaunchParams lp;
        lp.grid = dim3(1, 1, 1);
        lp.block = dim3(kTpNotifyThreads, 1, 1);
        lp.stream = stream;
        s.notify_kernel->launch(lp, notify);
    }
    // 2. The copy stream pulls each needed peer's shard (K then V) in the kernel's visiting order, then raises the
    //    shard's flag (constant 1: reset by the kernel's end of call, so nothing is frozen in a graph).
    //    Ranks of one process sharing a GPU: the pull kernel, whose waits leave the hardware queues free.
    //    Otherwise the copy engines copy, each peer's copies behind a pull-kernel item that only waits for its flag:
    //    bounded (a stream memory wait is not), so that a peer that never calls fails the call (its Diagnostic
    //    recorded; the copies then run on and the join below completes) instead of holding the stream forever.
    if (!items.empty()) {
        tp_detail::launch_peer_pulls(*s.pull_kernel, s.ctx, items, s.copy_stream, s.signatures, signature);
    } else {
        for (const Pull& pull : pulls) {
            tp_detail::launch_peer_pulls(
                *s.pull_kernel, s.ctx, {PeerPullItem{s.ready + pull.peer, nullptr, nullptr, nullptr, 0, pull.peer, -1}},
                s.copy_stream, s.signatures, signature);
            WEFT_CUDA_CHECK(cudaMemcpyAsync(pull.dst_k, pull.src_k, static_cast<size_t>(shard_bytes),
                                            cudaMemcpyDefault, s.copy_stream));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(pull.dst_v, pull.src_v, static_cast<size_t>(shard_bytes),
                                            cudaMemcpyDefault, s.copy_stream));
            stream_write_u64(s.copy_stream, s.chunk_signals + pull.peer, 1);
        }
    }
    // 3. The attention kernel: own shard first, then each peer's after its flag; its last block ends the call.
    detail::launch_flash_attention(plan, s.grid, stream);
    // 4. Join the copy stream (finished by now: the kernel waited for every shard it pulled).
    WEFT_CUDA_CHECK(cudaEventRecord(s.join, s.copy_stream));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, s.join, 0));
    s.heap.note_use(stream);  // the destructor waits for this op's work (the copy stream joined) before freeing
    s.first_call.after_call(s.team, 0, stream);
}

}  // namespace weft::ops
