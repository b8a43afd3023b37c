// SPDX-License-Identifier: MIT
// weft::ops::decode_attention: argument checks, the split plan, the workspace, the JIT kernels and their launches.
#include "weft/ops/attention.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

#include "attention_scale.hpp"
#include "collective_workspace.hpp"
#include "stream_key.hpp"
#include "views_overlap.hpp"
#include "weft/jit/aot.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/nvtx.hpp"

namespace weft::ops {

namespace {

constexpr const char* kOp = "decode_attention";
constexpr int64_t kMaxSeqLen = (int64_t{1} << 31) - (int64_t{1} << 20);
constexpr int64_t kMaxGridX = (int64_t{1} << 31) - 1;

std::string shape_of(const TensorView& v) { return v.describe(); }

// A view of `ndim` dimensions, every extent >= 0, innermost stride 1, non-null when it holds elements, data aligned
// to `align` bytes.
void check_basic(const TensorView& v, const char* what, int ndim, size_t align) {
    WEFT_CHECK(v.ndim == ndim, kOp << ": " << what << " must have " << ndim << " dimensions, got " << shape_of(v));
    for (int i = 0; i < ndim; ++i) {
        WEFT_CHECK(v.dim(i) >= 0, kOp << ": " << what << " has a negative extent: " << shape_of(v));
    }
    WEFT_CHECK(v.numel() == 0 || v.data != nullptr,
               kOp << ": " << what << " is null but holds " << v.numel() << " elements (" << shape_of(v) << ")");
    WEFT_CHECK(v.dim(ndim - 1) <= 1 || v.stride(ndim - 1) == 1,
               kOp << ": " << what << " must have innermost stride 1, got " << shape_of(v));
    WEFT_CHECK(reinterpret_cast<uintptr_t>(v.data) % align == 0,
               kOp << ": " << what << " must be " << align << "-byte aligned, got " << v.data);
}

// Outer strides of a 16-bit tensor read with 16-byte loads: non-negative multiples of 8 elements.
void check_vector_strides(const TensorView& v, const char* what) {
    for (int i = 0; i + 1 < v.ndim; ++i) {
        WEFT_CHECK(v.stride(i) >= 0 && v.stride(i) % 8 == 0, kOp << ": " << what << " stride " << i
                                                                 << " must be a non-negative multiple of 8 elements "
                                                                 << "(16-byte rows), got " << shape_of(v));
    }
}

bool is_empty_view(const TensorView& v) { return v.data == nullptr && v.ndim == 0; }

}  // namespace

namespace detail {

int64_t attention_resident_blocks(const AttentionDecodeConfig& config, int64_t num_sms, int64_t smem_per_sm_bytes) {
    // The driver reserves 1 KiB of shared memory per block.
    const int64_t per_block = attention_decode_smem_bytes(config) + 1024;
    const int64_t by_smem = std::max<int64_t>(1, smem_per_sm_bytes / per_block);
    // 128 threads of at most 255 registers: two blocks always fit the register file; more only with fewer registers,
    // which the heuristic does not count on.
    return std::max<int64_t>(1, num_sms) * std::min<int64_t>(by_smem, 2);
}

DecodeAttentionPlan plan_decode_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                          const TensorView& block_table, const TensorView& seq_lens,
                                          int64_t max_seq_len, const TensorView& out, const TensorView& lse,
                                          const DecodeAttentionOptions& options, int64_t resident_blocks) {
    return plan_decode_attention(q, k_cache, v_cache, block_table, seq_lens, max_seq_len, out, lse, options,
                                 [resident_blocks](int64_t) { return resident_blocks; });
}

DecodeAttentionPlan plan_decode_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                                          const TensorView& block_table, const TensorView& seq_lens,
                                          int64_t max_seq_len, const TensorView& out, const TensorView& lse,
                                          const DecodeAttentionOptions& options,
                                          const std::function<int64_t(int64_t head_dim)>& resident_blocks) {
    check_basic(q, "q", 3, 16);
    WEFT_CHECK(q.dtype == DType::kBF16 || q.dtype == DType::kF16,
               kOp << ": q must be bf16 or f16, got " << dtype_name(q.dtype));
    check_vector_strides(q, "q");
    const int64_t batch = q.dim(0);
    const int64_t num_q_heads = q.dim(1);
    const int64_t head_dim = q.dim(2);
    WEFT_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256,
               kOp << ": head_dim (q's last extent) must be 64, 128 or 256, got " << shape_of(q));

    check_basic(k_cache, "k_cache", 4, 16);
    check_basic(v_cache, "v_cache", 4, 16);
    WEFT_CHECK(k_cache.dtype == q.dtype,
               kOp << ": k_cache must have q's dtype " << dtype_name(q.dtype) << ", got " << dtype_name(k_cache.dtype));
    WEFT_CHECK(v_cache.dtype == q.dtype,
               kOp << ": v_cache must have q's dtype " << dtype_name(q.dtype) << ", got " << dtype_name(v_cache.dtype));
    check_vector_strides(k_cache, "k_cache");
    check_vector_strides(v_cache, "v_cache");
    for (int i = 0; i < 4; ++i) {
        WEFT_CHECK(v_cache.dim(i) == k_cache.dim(i) && v_cache.stride(i) == k_cache.stride(i),
                   kOp << ": v_cache must have k_cache's shape and strides, got " << shape_of(v_cache) << " and "
                       << shape_of(k_cache));
    }
    const int64_t num_pages = k_cache.dim(0);
    const int64_t page_size = k_cache.dim(1);
    const int64_t num_kv_heads = k_cache.dim(2);
    WEFT_CHECK(k_cache.dim(3) == head_dim,
               kOp << ": k_cache's head_dim must be q's (" << head_dim << "), got " << shape_of(k_cache));
    WEFT_CHECK(page_size >= 1 && page_size <= (int64_t{1} << 30),
               kOp << ": page_size (k_cache extent 1) must be in [1, 2^30], got " << shape_of(k_cache));
    WEFT_CHECK(num_kv_heads >= 1,
               kOp << ": num_kv_heads (k_cache extent 2) must be at least 1, got " << shape_of(k_cache));
    WEFT_CHECK(num_q_heads >= num_kv_heads && num_q_heads % num_kv_heads == 0,
               kOp << ": num_q_heads (" << num_q_heads << ") must be a positive multiple of num_kv_heads ("
                   << num_kv_heads << ")");
    const int64_t group = num_q_heads / num_kv_heads;
    WEFT_CHECK(group <= kAttentionMaxGroup, kOp << ": at most " << kAttentionMaxGroup
                                                << " q-heads per KV head are supported, got " << num_q_heads << " / "
                                                << num_kv_heads << " = " << group);

    check_basic(block_table, "block_table", 2, 4);
    WEFT_CHECK(block_table.dtype == DType::kI32,
               kOp << ": block_table must be i32, got " << dtype_name(block_table.dtype));
    WEFT_CHECK(block_table.dim(0) == batch,
               kOp << ": block_table must have batch (" << batch << ") rows, got " << shape_of(block_table));
    WEFT_CHECK(block_table.stride(0) >= 0,
               kOp << ": block_table's row stride must be >= 0, got " << shape_of(block_table));
    check_basic(seq_lens, "seq_lens", 1, 4);
    WEFT_CHECK(seq_lens.dtype == DType::kI32, kOp << ": seq_lens must be i32, got " << dtype_name(seq_lens.dtype));
    WEFT_CHECK(seq_lens.dim(0) == batch,
               kOp << ": seq_lens must have batch (" << batch << ") entries, got " << shape_of(seq_lens));
    WEFT_CHECK(max_seq_len >= 0 && max_seq_len < kMaxSeqLen,
               kOp << ": max_seq_len must be in [0, " << kMaxSeqLen << "), got " << max_seq_len);
    WEFT_CHECK((max_seq_len + page_size - 1) / page_size <= block_table.dim(1),
               kOp << ": max_seq_len (" << max_seq_len << ") exceeds what block_table holds (" << block_table.dim(1)
                   << " pages of " << page_size << " tokens)");
    WEFT_CHECK(max_seq_len == 0 || num_pages >= 1, kOp << ": k_cache has no pages but max_seq_len is " << max_seq_len);

    check_basic(out, "out", 3, 16);
    WEFT_CHECK(out.dtype == q.dtype,
               kOp << ": out must have q's dtype " << dtype_name(q.dtype) << ", got " << dtype_name(out.dtype));
    WEFT_CHECK(
        out.dim(0) == batch && out.dim(1) == num_q_heads && out.dim(2) == head_dim,
        kOp << ": out must be [" << batch << ", " << num_q_heads << ", " << head_dim << "], got " << shape_of(out));
    WEFT_CHECK(out.is_contiguous(), kOp << ": out must be contiguous, got " << shape_of(out));
    const bool want_lse = !is_empty_view(lse);
    if (want_lse) {
        check_basic(lse, "lse", 2, 4);
        WEFT_CHECK(lse.dtype == DType::kF32, kOp << ": lse must be f32, got " << dtype_name(lse.dtype));
        WEFT_CHECK(lse.dim(0) == batch && lse.dim(1) == num_q_heads,
                   kOp << ": lse must be [" << batch << ", " << num_q_heads << "], got " << shape_of(lse));
        WEFT_CHECK(lse.is_contiguous(), kOp << ": lse must be contiguous, got " << shape_of(lse));
    }
    // The split and combine kernels write out and lse while other blocks read q and the cache.
    {
        const char* why = "the kernels write it while other blocks still read the inputs";
        ops::detail::check_apart(kOp, "out", out,
                                 {{"q", q},
                                  {"k_cache", k_cache},
                                  {"v_cache", v_cache},
                                  {"block_table", block_table},
                                  {"seq_lens", seq_lens}},
                                 why);
        if (want_lse) {
            ops::detail::check_apart(kOp, "lse", lse,
                                     {{"q", q},
                                      {"k_cache", k_cache},
                                      {"v_cache", v_cache},
                                      {"block_table", block_table},
                                      {"seq_lens", seq_lens},
                                      {"out", out}},
                                     why);
        }
    }
    const float scale_log2 = detail::attention_scale_log2(options.scale, head_dim, kOp);
    WEFT_CHECK(reinterpret_cast<uintptr_t>(options.status) % alignof(AttentionStatus) == 0,
               kOp << ": options.status must be " << alignof(AttentionStatus) << "-byte aligned, got "
                   << static_cast<const void*>(options.status));
    WEFT_CHECK(options.num_splits >= 0,
               kOp << ": options.num_splits must be >= 0 (0: automatic), got " << options.num_splits);
    WEFT_CHECK(batch <= 65535 && num_kv_heads <= 65535,
               kOp << ": batch and num_kv_heads must be at most 65535 (grid limits), got " << batch << " and "
                   << num_kv_heads);

    DecodeAttentionPlan plan;
    plan.config.dtype = q.dtype;
    plan.config.head_dim = static_cast<int32_t>(head_dim);
    plan.config.stages = attention_default_stages(plan.config.head_dim);
    plan.config.check_pages = options.status != nullptr;
    plan.empty = batch == 0;
    plan.splits =
        plan_attention_splits(batch, num_kv_heads, max_seq_len, resident_blocks(head_dim), options.num_splits);
    // The combine kernel (more than one split) runs one block per (sequence, q-head).
    WEFT_CHECK(plan.splits.num_splits <= 1 || batch * num_q_heads <= kMaxGridX,
               kOp << ": with " << plan.splits.num_splits << " KV splits, batch x num_q_heads must be at most "
                   << kMaxGridX << " (the combine kernel's grid), got " << batch << " x " << num_q_heads
                   << " (options.num_splits = 1 needs no combine)");

    AttentionDecodeParams& p = plan.params;
    p.q = q.data;
    p.k = k_cache.data;
    p.v = v_cache.data;
    p.block_table = static_cast<const int32_t*>(block_table.data);
    p.seq_lens = static_cast<const int32_t*>(seq_lens.data);
    p.out = out.data;
    p.lse = want_lse ? static_cast<float*>(lse.data) : nullptr;
    p.q_batch_stride = q.stride(0);
    p.q_head_stride = q.stride(1);
    p.page_stride = k_cache.stride(0);
    p.slot_stride = k_cache.stride(1);
    p.head_stride = k_cache.stride(2);
    p.block_table_stride = block_table.stride(0);
    p.max_seq_len = max_seq_len;
    p.tokens_per_split = plan.splits.tokens_per_split;
    p.batch = static_cast<int32_t>(batch);
    p.num_q_heads = static_cast<int32_t>(num_q_heads);
    p.num_kv_heads = static_cast<int32_t>(num_kv_heads);
    p.group = static_cast<int32_t>(group);
    p.page_size = static_cast<int32_t>(page_size);
    p.num_pages =
        static_cast<uint32_t>(std::min<int64_t>(num_pages, int64_t{1} << 31));  // i32 entries reach no further
    p.status = options.status;
    p.page_shift = -1;
    if ((page_size & (page_size - 1)) == 0) {
        p.page_shift = 0;
        while ((int64_t{1} << p.page_shift) < page_size) ++p.page_shift;
    }
    p.num_splits = plan.splits.num_splits;
    p.scale_log2 = scale_log2;
    if (p.num_splits > 1) {
        const uint64_t rows =
            static_cast<uint64_t>(batch) * static_cast<uint64_t>(num_q_heads) * static_cast<uint64_t>(p.num_splits);
        const uint64_t o_bytes = rows * static_cast<uint64_t>(head_dim) * 4;
        plan.workspace_bytes = o_bytes + (rows * 4 + 15) / 16 * 16;
        // The split kernel writes its partials into a caller's workspace while other blocks read the inputs, and the
        // combine reads them while it writes out and lse.
        if (!is_empty_view(options.workspace) && options.workspace.data != nullptr) {
            // The bytes a call uses: the plan's, within the view (a view too small is refused at launch, by size).
            const int64_t used_bytes =
                std::min(static_cast<int64_t>(plan.workspace_bytes), options.workspace.size_bytes());
            const TensorView used(options.workspace.data, DType::kU8, {used_bytes});
            const TensorView no_lse = want_lse ? lse : TensorView();
            ops::detail::check_apart(kOp, "options.workspace", used,
                                     {{"q", q},
                                      {"k_cache", k_cache},
                                      {"v_cache", v_cache},
                                      {"block_table", block_table},
                                      {"seq_lens", seq_lens},
                                      {"out", out},
                                      {"lse", no_lse}},
                                     "the split kernel writes its partials there while the inputs are read, and the "
                                     "combine reads them while it writes out and lse");
        }
    }
    return plan;
}

}  // namespace detail

namespace {

struct DeviceFacts {
    int64_t num_sms = 0;
    int64_t smem_per_sm = 0;
};

DeviceFacts device_facts() {
    static std::mutex mutex;
    static std::map<int, DeviceFacts> cache;
    int device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(device);
    if (it != cache.end()) return it->second;
    int sms = 0;
    int smem = 0;
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    const DeviceFacts f{sms, smem};
    cache[device] = f;
    return f;
}

int64_t resident_blocks_here(const AttentionDecodeConfig& config) {
    const DeviceFacts f = device_facts();
    return detail::attention_resident_blocks(config, f.num_sms, f.smem_per_sm);
}

// Both kernels of one config, compiled and loaded on first use (per device: get_kernel loads into the current
// context each call, cheaply once done).
struct AttentionKernels {
    jit::Kernel* split = nullptr;
    jit::Kernel* combine = nullptr;
};

AttentionKernels kernels_for(const AttentionDecodeConfig& c) {
    static std::mutex mutex;
    static std::map<std::tuple<int, int, int, int, bool>, AttentionKernels> memo;
    int device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    const auto key = std::make_tuple(device, static_cast<int>(c.dtype), c.head_dim, c.stages, c.check_pages);
    {
        std::lock_guard<std::mutex> lock(mutex);
        auto it = memo.find(key);
        if (it != memo.end()) return it->second;
    }
    AttentionKernels k;
    k.split = &jit::compiler().get_kernel(decode_attention_kernel_spec(c, false));
    AttentionDecodeConfig combine_config = c;
    combine_config.check_pages = false;  // the combine reads no page: one kernel for both
    k.combine = &jit::compiler().get_kernel(decode_attention_kernel_spec(combine_config, true));
    k.split->allow_dynamic_smem(static_cast<size_t>(attention_decode_smem_bytes(c)));
    std::lock_guard<std::mutex> lock(mutex);
    memo[key] = k;
    return k;
}

// The internal workspace per stream (detail::StreamKey). Outgrown buffers are kept: launches already enqueued may use
// them.
void* internal_workspace(uint64_t bytes, cudaStream_t stream) {
    static std::mutex mutex;
    static std::map<detail::StreamKey, std::pair<void*, uint64_t>> cache;
    const detail::StreamKey key = detail::StreamKey::of(stream);
    std::lock_guard<std::mutex> lock(mutex);
    auto& slot = cache[key];
    if (slot.second >= bytes) return slot.first;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    WEFT_CHECK(capture == cudaStreamCaptureStatusNone,
               kOp << ": the internal workspace of this stream must grow to " << bytes
                   << " bytes while the stream is being captured (the workspace is per stream: an uncaptured call on "
                      "the capturing stream itself, e.g. torch.cuda.graph's capture stream, sizes it); pass a "
                      "workspace (options.workspace in C++, workspace= in Python: "
                      "decode_attention_workspace_bytes() bytes) or run once on this stream before capturing");
    const uint64_t grow = std::max<uint64_t>(bytes, 2 * slot.second);
    void* ptr = detail::malloc_beside_captures(grow);
    WEFT_LOG_DEBUG(kOp << ": workspace " << grow << " bytes on device " << key.device);
    slot = {ptr, grow};
    return ptr;
}

}  // namespace

jit::KernelSpec decode_attention_kernel_spec(const AttentionDecodeConfig& config, bool combine) {
    WEFT_CHECK(is_valid(config), kOp << ": invalid AttentionDecodeConfig (dtype " << dtype_name(config.dtype)
                                     << ", head_dim " << config.head_dim << ", stages " << config.stages << ")");
    std::ostringstream inst;
    inst << "weft::kernels::attention::" << (combine ? "decode_combine" : "decode_split")
         << "<weft::AttentionDecodeConfig{.dtype = " << dtype_enum_name(config.dtype)
         << ", .head_dim = " << config.head_dim << ", .stages = " << config.stages
         << (config.check_pages ? ", .check_pages = true" : "") << "}>";
    std::ostringstream desc;
    desc << "attention " << (combine ? "decode_combine " : "decode_split ") << dtype_name(config.dtype)
         << " head_dim=" << config.head_dim << " stages=" << config.stages
         << (config.check_pages ? " check_pages" : "");
    jit::KernelSpec spec;
    spec.header = "attention/decode.cuh";
    spec.instantiation = inst.str();
    spec.description = desc.str();
    return spec;
}

void register_attention_aot_specs() {
    static std::once_flag once;
    std::call_once(once, [] {
        for (DType t : {DType::kBF16, DType::kF16}) {
            for (int32_t d : {64, 128, 256}) {
                AttentionDecodeConfig c{.dtype = t, .head_dim = d, .stages = attention_default_stages(d)};
                jit::register_aot_spec(decode_attention_kernel_spec(c, false));
                jit::register_aot_spec(decode_attention_kernel_spec(c, true));
                c.check_pages = true;
                jit::register_aot_spec(decode_attention_kernel_spec(c, false));
            }
        }
    });
}

AttentionSplitPlan decode_attention_split_plan(int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
                                               int64_t head_dim, int64_t max_seq_len,
                                               const DecodeAttentionOptions& options) {
    WEFT_CHECK(batch >= 0 && num_kv_heads >= 1 && num_q_heads >= 1 && max_seq_len >= 0,
               kOp << ": the split plan needs batch >= 0, heads >= 1 and max_seq_len >= 0, got batch " << batch
                   << ", num_q_heads " << num_q_heads << ", num_kv_heads " << num_kv_heads << ", max_seq_len "
                   << max_seq_len);
    WEFT_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256,
               kOp << ": head_dim must be 64, 128 or 256, got " << head_dim);
    WEFT_CHECK(reinterpret_cast<uintptr_t>(options.status) % alignof(AttentionStatus) == 0,
               kOp << ": options.status must be " << alignof(AttentionStatus) << "-byte aligned, got "
                   << static_cast<const void*>(options.status));
    WEFT_CHECK(options.num_splits >= 0,
               kOp << ": options.num_splits must be >= 0 (0: automatic), got " << options.num_splits);
    AttentionDecodeConfig c;
    c.head_dim = static_cast<int32_t>(head_dim);
    c.stages = attention_default_stages(c.head_dim);
    return plan_attention_splits(batch, num_kv_heads, max_seq_len, resident_blocks_here(c), options.num_splits);
}

uint64_t decode_attention_workspace_bytes(int64_t batch, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                                          int64_t max_seq_len, const DecodeAttentionOptions& options) {
    const AttentionSplitPlan s =
        decode_attention_split_plan(batch, num_q_heads, num_kv_heads, head_dim, max_seq_len, options);
    if (s.num_splits <= 1) return 0;
    // Partial rows (batch x q-heads x splits), each head_dim fp32 values and an fp32 LSE: checked products, so an
    // absurd batch is an error rather than a wrapped byte count.
    uint64_t rows = 0, values = 0, bytes = 0;
    const bool overflow =
        __builtin_mul_overflow(static_cast<uint64_t>(batch), static_cast<uint64_t>(num_q_heads), &rows) ||
        __builtin_mul_overflow(rows, static_cast<uint64_t>(s.num_splits), &rows) ||
        __builtin_mul_overflow(rows, static_cast<uint64_t>(head_dim) * 4 + 4, &values) ||
        __builtin_add_overflow(values, uint64_t{16}, &bytes);
    WEFT_CHECK(!overflow, kOp << ": the workspace of batch " << batch << " x " << num_q_heads << " q-heads x "
                              << s.num_splits << " splits overflows a 64-bit byte count");
    return rows * static_cast<uint64_t>(head_dim) * 4 + (rows * 4 + 15) / 16 * 16;
}

namespace detail {

int64_t attention_resident_blocks_here(int64_t head_dim) {
    AttentionDecodeConfig c;
    c.head_dim = head_dim == 64 || head_dim == 256 ? static_cast<int32_t>(head_dim) : 128;
    c.stages = attention_default_stages(c.head_dim);
    return resident_blocks_here(c);
}

void load_decode_attention_kernels(const AttentionDecodeConfig& config) { (void)kernels_for(config); }

void launch_decode_attention(DecodeAttentionPlan& plan, const DecodeAttentionOptions& options, cudaStream_t stream) {
    if (plan.empty) return;
    AttentionDecodeParams& p = plan.params;
    if (plan.workspace_bytes > 0) {
        void* ws = nullptr;
        if (!is_empty_view(options.workspace)) {
            const TensorView& w = options.workspace;
            WEFT_CHECK(w.data != nullptr && w.is_contiguous(),
                       kOp << ": options.workspace must be a contiguous device buffer, got " << w.describe());
            WEFT_CHECK(reinterpret_cast<uintptr_t>(w.data) % 16 == 0,
                       kOp << ": options.workspace must be 16-byte aligned, got " << w.data);
            WEFT_CHECK(static_cast<uint64_t>(w.size_bytes()) >= plan.workspace_bytes,
                       kOp << ": options.workspace holds " << w.size_bytes() << " bytes, " << plan.workspace_bytes
                           << " needed (decode_attention_workspace_bytes)");
            ws = w.data;
        } else {
            ws = internal_workspace(plan.workspace_bytes, stream);
        }
        const uint64_t rows =
            static_cast<uint64_t>(p.batch) * static_cast<uint64_t>(p.num_q_heads) * static_cast<uint64_t>(p.num_splits);
        p.partial_o = static_cast<float*>(ws);
        p.partial_lse = p.partial_o + rows * static_cast<uint64_t>(plan.config.head_dim);
    }
    const AttentionKernels k = kernels_for(plan.config);
    jit::LaunchParams split;
    split.grid = dim3(static_cast<unsigned>(p.num_splits), static_cast<unsigned>(p.num_kv_heads),
                      static_cast<unsigned>(p.batch));
    split.block = dim3(kAttentionThreads);
    split.dynamic_smem_bytes = static_cast<size_t>(attention_decode_smem_bytes(plan.config));
    split.stream = stream;
    split.programmatic = options.programmatic_launch;
    k.split->launch(split, p);
    if (p.num_splits > 1) {
        const int64_t rows = static_cast<int64_t>(p.batch) * p.num_q_heads;
        jit::LaunchParams combine;
        combine.grid = dim3(static_cast<unsigned>(rows));  // one block per row
        combine.block = dim3(kAttentionCombineThreads);
        combine.stream = stream;
        // Scheduled while the split kernel's last blocks run (decode_split calls launch_dependents); the combine
        // waits for it to complete before reading the partials.
        combine.programmatic = true;
        k.combine->launch(combine, p);
    }
}

}  // namespace detail

std::string describe_attention_status(const AttentionStatus& s) {
    if (s.code == 0) return "";
    std::ostringstream os;
    if (s.code == -1) {
        os << "decode attention: a status record is being written (read it after the call has completed)";
    } else if (s.code == 1) {
        os << "decode attention: block_table[" << s.sequence << "][" << s.page << "] = " << s.value
           << " is outside the cache's pages [0, num_pages): that sequence's out and lse are NaN";
    } else {
        os << "decode attention: unknown status code " << s.code;
    }
    return os.str();
}

void check_attention_status(const AttentionStatus& status) {
    const std::string what = describe_attention_status(status);
    WEFT_CHECK(what.empty(), what);
}

void decode_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                      const TensorView& block_table, const TensorView& seq_lens, int64_t max_seq_len,
                      const TensorView& out, const TensorView& lse, cudaStream_t stream,
                      const DecodeAttentionOptions& options) {
    WEFT_NVTX_RANGE("decode_attention");
    detail::DecodeAttentionPlan plan =
        detail::plan_decode_attention(q, k_cache, v_cache, block_table, seq_lens, max_seq_len, out, lse, options,
                                      detail::attention_resident_blocks_here);
    detail::check_device_views({{"q", q},
                                {"k_cache", k_cache},
                                {"v_cache", v_cache},
                                {"block_table", block_table},
                                {"seq_lens", seq_lens},
                                {"out", out},
                                {"lse", lse},
                                {"options.workspace", options.workspace}},
                               "decode_attention", stream);
    detail::check_device_or_mapped_pointer(options.status, "options.status", "decode_attention", stream);
    detail::launch_decode_attention(plan, options, stream);
}

}  // namespace weft::ops
