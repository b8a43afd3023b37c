// SPDX-License-Identifier: MIT
// Decode attention on the CPU: the split plan, argument checks, and NVRTC compilation of every kernel
// specialisation with the SASS the bandwidth depends on (cp.async 16-byte copies, tensor-core mma, no local memory).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "support/jit_testing.hpp"
#include "support/sass_testing.hpp"
#include "weft/common/attention.hpp"
#include "weft/common/collectives.hpp"
#include "weft/jit/aot.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/attention.hpp"
#include "weft/runtime/diagnostics.hpp"
#include "weft/runtime/error.hpp"

namespace weft::ops {
namespace {

// ------------------------------------------------------------------------------------------------
// Split plan

// The tag each pushed row carries (sp_decode_attention): rounds that differ in any field get different tags, and the
// descriptor rebuilt from a peer's tag names its row count exactly (up to 2^20 rows).
TEST(AttentionPlan, PushTagsTellCallsApartAndNameTheirRows) {
    const auto descriptor = [](uint64_t rows, uint64_t dim, uint64_t heads, uint64_t b0, uint64_t batch) {
        return make_call_descriptor(
            CollectiveOp::kAttentionCombine, 0, true, DType::kBF16, rows,
            call_descriptor_mix(call_descriptor_mix(call_descriptor_mix(call_descriptor_mix(0, dim), heads), b0),
                                batch));
    };
    const uint64_t mine = descriptor(256, 128, 32, 0, 8);
    const std::vector<uint64_t> others = {descriptor(128, 128, 32, 0, 4), descriptor(256, 64, 32, 0, 8),
                                          descriptor(256, 128, 32, 8, 16), descriptor(8192, 128, 32, 0, 256),
                                          descriptor(256, 128, 16, 0, 16)};
    for (uint64_t other : others) {
        EXPECT_NE(attention_push_tag(other), attention_push_tag(mine)) << std::hex << other;
        const uint64_t rebuilt = attention_descriptor_of_tag(mine, attention_push_tag(other));
        EXPECT_EQ(call_descriptor_count(rebuilt), call_descriptor_count(other)) << describe_call_descriptor(rebuilt);
    }
    EXPECT_EQ(attention_descriptor_of_tag(mine, attention_push_tag(mine)), mine);
    EXPECT_NE(
        describe_call_descriptor(attention_descriptor_of_tag(mine, attention_push_tag(others[3]))).find("8192 rows"),
        std::string::npos);
    // The combine's mismatch record says that a peer with another row layout (head_dim) shows no meaningful row count.
    Diagnostic d{};
    d.claimed = 2;
    d.kind = SpinKind::kCollectiveMismatch;
    d.rank = 0;
    d.peer = 1;
    d.expected = mine;
    d.observed = attention_descriptor_of_tag(mine, attention_push_tag(others[1]));
    const std::string m = format_diagnostic(d);
    EXPECT_NE(m.find("another head_dim"), std::string::npos) << m;
    EXPECT_NE(m.find("differs from rank 1's"), std::string::npos) << m;
}

TEST(AttentionPlan, SplitsCoverEveryTokenOnceInWholeTiles) {
    for (int64_t len : {0, 1, 63, 64, 65, 1000, 33000, 1 << 20}) {
        for (int64_t batch : {1, 8, 64, 256}) {
            for (int32_t requested : {0, 1, 3, 1000}) {
                const AttentionSplitPlan s = plan_attention_splits(batch, 8, len, 264, requested);
                SCOPED_TRACE(::testing::Message() << "len " << len << " batch " << batch << " req " << requested);
                ASSERT_GE(s.num_splits, 1);
                EXPECT_LE(s.num_splits, kAttentionMaxSplits);
                EXPECT_EQ(s.tokens_per_split % kAttentionTileTokens, 0);
                EXPECT_GT(s.tokens_per_split, 0);
                // Every token is in exactly one split, and the last split is not empty (when there are tokens).
                EXPECT_GE(static_cast<int64_t>(s.num_splits) * s.tokens_per_split, len);
                if (len > 0) {
                    EXPECT_LT(static_cast<int64_t>(s.num_splits - 1) * s.tokens_per_split, len);
                }
                if (requested > 0 && len > 0) {
                    EXPECT_LE(s.num_splits, requested);
                }
            }
        }
    }
}

TEST(AttentionPlan, AutomaticSplitsFillWholeWaves) {
    // 132 SMs x 2 blocks. The blocks of a plan run in waves of 264; a wave that is mostly empty costs as much as a
    // full one, so the plan's last wave is well filled wherever there are enough tiles to fill it.
    const auto last_wave = [](const AttentionSplitPlan& s, int64_t base) {
        const int64_t blocks = base * s.num_splits;
        return blocks % 264 == 0 ? 264 : blocks % 264;
    };
    for (int64_t batch : {1, 2, 8, 16}) {
        for (int64_t len : {int64_t{32768}, int64_t{131072}, int64_t{1} << 20}) {
            const AttentionSplitPlan s = plan_attention_splits(batch, 8, len, 264, 0);
            SCOPED_TRACE(::testing::Message() << "batch " << batch << " len " << len << " splits " << s.num_splits);
            EXPECT_GE(last_wave(s, batch * 8), 3 * 264 / 4);
        }
    }
    // batch 1, 8 KV heads, 32K tokens: one wave of 16-tile splits (a second wave of 8-tile splits costs its blocks'
    // overhead twice).
    const AttentionSplitPlan a = plan_attention_splits(1, 8, 32768, 264, 0);
    EXPECT_EQ(a.num_splits, 32);
    EXPECT_EQ(a.tokens_per_split, 16 * kAttentionTileTokens);
    // Many sequences already fill the GPU: one split each (no combine).
    const AttentionSplitPlan b = plan_attention_splits(256, 8, 32768, 264, 0);
    EXPECT_EQ(b.num_splits, 1);
    // Short sequences keep at least two tiles per split.
    const AttentionSplitPlan c = plan_attention_splits(1, 1, 1000, 264, 0);
    EXPECT_GE(c.tokens_per_split, 2 * kAttentionTileTokens);
    EXPECT_GT(c.num_splits, 1);
}

TEST(AttentionPlan, ConfigValidityAndSharedMemory) {
    for (int d : {64, 128, 256}) {
        AttentionDecodeConfig c{.dtype = DType::kBF16, .head_dim = d, .stages = attention_default_stages(d)};
        EXPECT_TRUE(is_valid(c)) << d;
        EXPECT_LE(attention_decode_smem_bytes(c), 227 * 1024);
        // Default depths: two blocks per SM up to head_dim 128.
        const int64_t blocks = detail::attention_resident_blocks(c, 132, 228 * 1024) / 132;
        EXPECT_EQ(blocks, d <= 128 ? 2 : 1) << d;
    }
    EXPECT_FALSE(is_valid(AttentionDecodeConfig{.dtype = DType::kF32, .head_dim = 128, .stages = 3}));
    EXPECT_FALSE(is_valid(AttentionDecodeConfig{.dtype = DType::kBF16, .head_dim = 96, .stages = 3}));
    EXPECT_FALSE(is_valid(AttentionDecodeConfig{.dtype = DType::kBF16, .head_dim = 128, .stages = 1}));
    EXPECT_FALSE(is_valid(AttentionDecodeConfig{.dtype = DType::kBF16, .head_dim = 256, .stages = 4}));  // > 227 KiB
}

// ------------------------------------------------------------------------------------------------
// Argument checks (no CUDA call: plan_decode_attention is pure)

struct Args {
    // Fake, aligned, never dereferenced addresses.
    static void* at(uintptr_t a) { return reinterpret_cast<void*>(a); }
    int64_t batch = 4, hq = 32, hkv = 8, dim = 128, pages = 100, page = 16, max_pages = 20, max_len = 300;
    TensorView q{at(0x10000), DType::kBF16, {batch, hq, dim}};
    TensorView k{at(0x100000), DType::kBF16, {pages, page, hkv, dim}};
    TensorView v{at(0x900000), DType::kBF16, {pages, page, hkv, dim}};
    TensorView table{at(0x2000000), DType::kI32, {batch, max_pages}};
    TensorView lens{at(0x3000000), DType::kI32, {batch}};
    TensorView out{at(0x4000000), DType::kBF16, {batch, hq, dim}};
    TensorView lse{at(0x5000000), DType::kF32, {batch, hq}};
    DecodeAttentionOptions options;

    detail::DecodeAttentionPlan plan() const {
        return detail::plan_decode_attention(q, k, v, table, lens, max_len, out, lse, options, 264);
    }
};

// Expects plan() to throw a weft::Error whose message contains every one of `words`.
void expect_rejected(const Args& a, std::vector<std::string> words) {
    try {
        (void)a.plan();
        ADD_FAILURE() << "accepted; expected an error naming: " << words.front();
    } catch (const Error& e) {
        const std::string msg = e.what();
        for (const std::string& w : words)
            EXPECT_NE(msg.find(w), std::string::npos) << msg << "\n(missing " << w << ")";
    }
}

TEST(AttentionArgs, ValidArgumentsPlanTheLaunch) {
    Args a;
    const detail::DecodeAttentionPlan p = a.plan();
    EXPECT_EQ(p.params.group, 4);
    EXPECT_EQ(p.params.page_size, 16);
    EXPECT_EQ(p.params.page_shift, 4);
    EXPECT_EQ(p.params.slot_stride, 8 * 128);
    EXPECT_EQ(p.params.page_stride, 16 * 8 * 128);
    EXPECT_EQ(p.params.head_stride, 128);
    EXPECT_NEAR(p.params.scale_log2, 1.4426950408889634 / std::sqrt(128.0), 1e-6);
    EXPECT_EQ(p.config.head_dim, 128);
    EXPECT_EQ(p.params.lse, Args::at(0x5000000));
    if (p.params.num_splits > 1) {
        EXPECT_EQ(p.workspace_bytes, static_cast<uint64_t>(4 * 32 * p.params.num_splits) * (128 * 4) +
                                         (static_cast<uint64_t>(4 * 32 * p.params.num_splits) * 4 + 15) / 16 * 16);
    }
    // The [pages, heads, slots, dim] layout as a strided view, lse omitted, an explicit scale and split count.
    a.k = TensorView(Args::at(0x100000), DType::kBF16, {100, 16, 8, 128}, {16 * 8 * 128, 128, 16 * 128, 1});
    a.v = TensorView(Args::at(0x900000), DType::kBF16, {100, 16, 8, 128}, {16 * 8 * 128, 128, 16 * 128, 1});
    a.lse = TensorView();
    a.options.scale = 0.5f;
    a.options.num_splits = 3;
    const detail::DecodeAttentionPlan s = a.plan();
    EXPECT_EQ(s.params.lse, nullptr);
    EXPECT_EQ(s.params.slot_stride, 128);
    EXPECT_EQ(s.params.head_stride, 16 * 128);
    EXPECT_EQ(s.params.num_splits, 3);
    EXPECT_FLOAT_EQ(s.params.scale_log2, 0.5f * 1.4426950408889634f);
    // A page size that is not a power of two divides instead of shifting.
    Args odd;
    odd.k = TensorView(Args::at(0x100000), DType::kBF16, {100, 24, 8, 128});
    odd.v = TensorView(Args::at(0x900000), DType::kBF16, {100, 24, 8, 128});
    EXPECT_EQ(odd.plan().params.page_shift, -1);
    // batch 0 plans nothing.
    Args e;
    e.q = TensorView(Args::at(0x10000), DType::kBF16, {0, 32, 128});
    e.out = TensorView(Args::at(0x4000000), DType::kBF16, {0, 32, 128});
    e.table = TensorView(Args::at(0x2000000), DType::kI32, {0, 20});
    e.lens = TensorView(Args::at(0x3000000), DType::kI32, {0});
    e.lse = TensorView(Args::at(0x5000000), DType::kF32, {0, 32});
    EXPECT_TRUE(e.plan().empty);
}

TEST(AttentionArgs, BadArgumentsNameTheArgument) {
    {
        Args a;
        a.q.dtype = DType::kF32;
        expect_rejected(a, {"q", "bf16 or f16"});
    }
    {
        Args a;
        a.q = TensorView(Args::at(0x10000), DType::kBF16, {4, 32, 96});
        expect_rejected(a, {"head_dim", "64, 128 or 256"});
    }
    {
        Args a;
        a.q = TensorView(Args::at(0x10008), DType::kBF16, {4, 32, 128});
        expect_rejected(a, {"q", "16-byte aligned"});
    }
    {
        Args a;
        a.q = TensorView(Args::at(0x10000), DType::kBF16, {4, 32, 128}, {32 * 132, 132, 1});
        expect_rejected(a, {"q", "multiple of 8"});
    }
    {
        Args a;
        a.k.dtype = DType::kF16;
        expect_rejected(a, {"k_cache", "dtype"});
    }
    {
        Args a;
        a.v = TensorView(Args::at(0x900000), DType::kBF16, {100, 8, 8, 128});
        expect_rejected(a, {"v_cache", "k_cache's shape"});
    }
    {
        Args a;
        a.k = TensorView(Args::at(0x100000), DType::kBF16, {100, 16, 8, 64});
        a.v = TensorView(Args::at(0x900000), DType::kBF16, {100, 16, 8, 64});
        expect_rejected(a, {"k_cache", "head_dim"});
    }
    {
        Args a;
        a.q = TensorView(Args::at(0x10000), DType::kBF16, {4, 30, 128});
        a.out = TensorView(Args::at(0x4000000), DType::kBF16, {4, 30, 128});
        expect_rejected(a, {"num_q_heads", "multiple of num_kv_heads"});
    }
    {
        Args a;  // 17 q-heads per KV head
        a.q = TensorView(Args::at(0x10000), DType::kBF16, {4, 136, 128});
        a.out = TensorView(Args::at(0x4000000), DType::kBF16, {4, 136, 128});
        expect_rejected(a, {"16 q-heads per KV head"});
    }
    {
        Args a;
        a.table.dtype = DType::kI64;
        expect_rejected(a, {"block_table", "i32"});
    }
    {
        Args a;
        a.table = TensorView(Args::at(0x2000000), DType::kI32, {3, 20});
        expect_rejected(a, {"block_table", "batch"});
    }
    {
        Args a;
        a.lens = TensorView(Args::at(0x3000000), DType::kI32, {5});
        expect_rejected(a, {"seq_lens", "batch"});
    }
    {
        Args a;
        a.max_len = 20 * 16 + 1;
        expect_rejected(a, {"max_seq_len", "block_table"});
    }
    {
        Args a;
        a.max_len = -1;
        expect_rejected(a, {"max_seq_len"});
    }
    {
        Args a;
        a.out = TensorView(Args::at(0x4000000), DType::kBF16, {4, 32, 64});
        expect_rejected(a, {"out", "[4, 32, 128]"});
    }
    {
        Args a;
        a.out.dtype = DType::kF16;
        expect_rejected(a, {"out", "dtype"});
    }
    {
        Args a;
        a.lse = TensorView(Args::at(0x5000000), DType::kBF16, {4, 32});
        expect_rejected(a, {"lse", "f32"});
    }
    {
        Args a;
        a.lse = TensorView(Args::at(0x5000000), DType::kF32, {4, 8});
        expect_rejected(a, {"lse", "[4, 32]"});
    }
    {
        Args a;
        a.options.scale = std::nanf("");
        expect_rejected(a, {"options.scale", "finite"});
    }
    {
        Args a;
        a.options.num_splits = -2;
        expect_rejected(a, {"options.num_splits"});
    }
}

// The public entry points check every argument before they ask the device anything: on a machine without a GPU a bad
// argument is still the argument's error (a CUDA call first would fail with the runtime's own error).
TEST(AttentionArgs, PublicCallsCheckArgumentsBeforeTheDevice) {
    Args a;
    a.k.dtype = DType::kF16;
    try {
        decode_attention(a.q, a.k, a.v, a.table, a.lens, a.max_len, a.out, a.lse, nullptr, a.options);
        ADD_FAILURE() << "decode_attention accepted a k_cache of another dtype";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("k_cache must have q's dtype"), std::string::npos) << e.what();
    }
    Args b;
    b.lens = TensorView(Args::at(0x3000000), DType::kI32, {5});
    try {
        decode_attention(b.q, b.k, b.v, b.table, b.lens, b.max_len, b.out, b.lse, nullptr, b.options);
        ADD_FAILURE() << "decode_attention accepted 5 seq_lens for 4 sequences";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("seq_lens must have batch (4) entries"), std::string::npos) << e.what();
    }
}

TEST(AttentionArgs, OutputsOverlappingTheInputsAreRefused) {
    {
        Args a;
        a.out = TensorView(Args::at(0x100000 + 4096), DType::kBF16, {4, 32, 128});  // inside k_cache
        expect_rejected(a, {"out must not overlap k_cache"});
    }
    {
        Args a;
        a.lse = TensorView(Args::at(0x4000000 + 256), DType::kF32, {4, 32});  // inside out
        expect_rejected(a, {"lse must not overlap out"});
    }
}

// A caller's workspace holds the split partials, written while the inputs are read and read while out and lse are
// written: it must meet none of them.
TEST(AttentionArgs, AWorkspaceOverlappingAnArgumentIsRefused) {
    Args a;
    a.options.num_splits = 4;
    const auto bytes = static_cast<int64_t>(a.plan().workspace_bytes);
    ASSERT_GT(bytes, 0);
    a.options.workspace = TensorView(Args::at(0x6000000), DType::kU8, {bytes});
    EXPECT_NO_THROW((void)a.plan());
    const std::pair<uintptr_t, const char*> cases[] = {
        {0x10000 + 256, "options.workspace must not overlap q"},
        {0x900000 + 4096, "options.workspace must not overlap v_cache"},
        {0x3000000 + 16 - static_cast<uintptr_t>(bytes), "options.workspace must not overlap seq_lens"},  // last 16 B
        {0x4000000 + 512, "options.workspace must not overlap out"},
        {0x5000000, "options.workspace must not overlap lse"},
    };
    for (const auto& [start, words] : cases) {
        Args b = a;
        b.options.workspace = TensorView(Args::at(start), DType::kU8, {bytes});
        expect_rejected(b, {words});
    }
    // Without lse the workspace may sit where an lse would have been.
    Args c = a;
    c.lse = TensorView();
    c.options.workspace = TensorView(Args::at(0x5000000), DType::kU8, {bytes});
    EXPECT_NO_THROW((void)c.plan());
}

TEST(AttentionArgs, HugeBlockTablesAndHeadCountsAreCheckedWithoutOverflow) {
    {
        // max_pages x page_size overflows int64; max_seq_len fits the table whatever it is.
        // (Huge views at addresses far apart: out and lse must not overlap the inputs.)
        Args a;
        a.table = TensorView(Args::at(uintptr_t{1} << 44), DType::kI32, {4, int64_t{1} << 40});
        a.k = TensorView(Args::at(uintptr_t{1} << 50), DType::kBF16, {100, int64_t{1} << 30, 8, 128});
        a.v = TensorView(Args::at(uintptr_t{1} << 52), DType::kBF16, {100, int64_t{1} << 30, 8, 128});
        a.max_len = 300;
        EXPECT_NO_THROW((void)a.plan());
    }
    {
        // A one-page table of 16 tokens cannot hold 17.
        Args a;
        a.table = TensorView(Args::at(0x2000000), DType::kI32, {4, 1});
        a.max_len = 17;
        expect_rejected(a, {"max_seq_len (17) exceeds what block_table holds (1 pages of 16 tokens)"});
        a.max_len = 16;
        EXPECT_NO_THROW((void)a.plan());
    }
    // 65535 sequences x 65535 q-heads: more (sequence, q-head) rows than the combine kernel's grid holds. One split
    // needs no combine (the automatic plan, with this many blocks); forced splits are refused.
    Args big;
    big.q = TensorView(Args::at(uintptr_t{1} << 41), DType::kBF16, {65535, 65535, 128});
    big.out = TensorView(Args::at(uintptr_t{1} << 43), DType::kBF16, {65535, 65535, 128});
    big.k = TensorView(Args::at(uintptr_t{1} << 45), DType::kBF16, {100, 16, 65535, 128});
    big.v = TensorView(Args::at(uintptr_t{1} << 46), DType::kBF16, {100, 16, 65535, 128});
    big.table = TensorView(Args::at(0x2000000), DType::kI32, {65535, 20});
    big.lens = TensorView(Args::at(0x3000000), DType::kI32, {65535});
    big.lse = TensorView();
    EXPECT_EQ(big.plan().params.num_splits, 1);
    big.options.num_splits = 2;
    expect_rejected(big, {"batch x num_q_heads must be at most 2147483647", "65535 x 65535"});
}

// ------------------------------------------------------------------------------------------------
// NVRTC: every split specialisation, with and without check_pages (and the bf16 combine ones), compiles for sm_90a
// without spills or local memory; the split kernel copies with 16-byte cp.async (LDGSTS.E.BYPASS.128), reads shared
// memory with ldmatrix (LDSM) and multiplies on tensor cores (HMMA.16816.F32); the combine kernel reads the partials
// with 16-byte loads (LDG.E.128).

TEST(AttentionNvrtc, EverySpecialisationCompilesWithTheExpectedSass) {
    weft::testing::TempDir cache("weft_attention_nvrtc");
    jit::Compiler c(weft::testing::isolated_compiler_config(cache.path()));
    int checked_sass = 0;
    std::string why_not;
    for (DType t : {DType::kBF16, DType::kF16}) {
        for (int d : {64, 128, 256}) {
            // The combine kernel differs between dtypes only in its final conversion: bf16 is enough to check; it is
            // one kernel for both split builds (with and without the block-table check).
            for (const int kind : {0, 1, 2}) {  // split, split with check_pages, combine
                const bool combine = kind == 2;
                if (combine && t != DType::kBF16) continue;
                const AttentionDecodeConfig config{
                    .dtype = t, .head_dim = d, .stages = attention_default_stages(d), .check_pages = kind == 1};
                jit::KernelSpec spec = decode_attention_kernel_spec(config, combine);
                spec.arch = "sm_90a";
                SCOPED_TRACE(spec.describe());
                const jit::CompileResult r = c.compile(spec);
                ASSERT_TRUE(r.cubin && !r.cubin->empty()) << r.log;
                weft::testing::expect_clean_ptxas_report(r.log, spec.describe());
                EXPECT_EQ(r.ptxas_info.spill_store_bytes, 0) << r.ptxas_info.text;
                EXPECT_EQ(r.ptxas_info.stack_frame_bytes, 0) << r.ptxas_info.text;
                std::printf("[ PTXAS    ] %s: %d registers\n", spec.describe().c_str(), r.ptxas_info.registers);
                std::string tool;
                const auto sass = weft::testing::disassemble(*r.cubin, &tool, &why_not);
                if (sass.empty()) continue;
                const auto fn = sass.find(r.lowered_name);
                ASSERT_NE(fn, sass.end()) << "no SASS for " << r.lowered_name << " (" << tool << ")";
                const std::string& text = fn->second;
                EXPECT_EQ(text.find("LDL"), std::string::npos) << "local memory loads";
                EXPECT_EQ(text.find("STL"), std::string::npos) << "local memory stores";
                if (!combine) {
                    EXPECT_NE(text.find("LDGSTS.E.BYPASS.128"), std::string::npos) << "K/V: 16-byte cp.async.cg";
                    EXPECT_NE(text.find("LDSM.16.M88.4"), std::string::npos) << "ldmatrix.x4";
                    EXPECT_NE(text.find("LDSM.16.MT88.4"), std::string::npos) << "ldmatrix.x4.trans (V)";
                    EXPECT_NE(text.find(t == DType::kBF16 ? "HMMA.16816.F32.BF16" : "HMMA.16816.F32"),
                              std::string::npos)
                        << "tensor-core mma";
                } else {
                    EXPECT_NE(text.find("LDG.E.128"), std::string::npos) << "partials: 16-byte loads";
                }
                ++checked_sass;
            }
        }
    }
    if (checked_sass == 0) GTEST_SKIP() << "SKIPPED: SASS not checked: " << why_not;
    EXPECT_EQ(checked_sass, 15);
}

TEST(AttentionNvrtc, AotRegistrationListsEverySpecialisationOnce) {
    register_attention_aot_specs();
    register_attention_aot_specs();  // idempotent
    int split = 0, combine = 0;
    std::set<std::string> seen;
    for (const jit::KernelSpec& s : jit::aot_specs()) {
        if (s.header != "attention/decode.cuh") continue;
        EXPECT_TRUE(seen.insert(s.instantiation).second) << "listed twice: " << s.instantiation;
        (s.instantiation.find("decode_split") != std::string::npos ? split : combine) += 1;
    }
    EXPECT_EQ(split, 12);  // with and without check_pages
    EXPECT_EQ(combine, 6);
}

}  // namespace
}  // namespace weft::ops
