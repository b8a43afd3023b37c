// SPDX-License-Identifier: MIT
// Unit tests (CPU) of the gathered grouped GEMM and the TP MoE layers (weft/ops/moe_tp.hpp): NVRTC compiles every
// kernel they launch for sm_90a with a clean ptxas report (the layers' GEMMs with HGMMA, TMA and nothing in local
// memory; the memory-bound kernels with 16-byte accesses), and the argument checks.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <nvrtc.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "support/error_text.hpp"
#include "support/nvrtc_testing.hpp"
#include "support/sass_testing.hpp"
#include "weft/common/gemm_config.hpp"
#include "weft/common/moe_tp_params.hpp"
#include "weft/ops/grouped_gemm.hpp"
#include "weft/ops/moe_tp.hpp"
#include "weft/runtime/diagnostics.hpp"
#include "weft/runtime/error.hpp"

#ifndef WEFT_SOURCE_DIR
#error "WEFT_SOURCE_DIR must name the source tree (tests/CMakeLists.txt defines it)"
#endif
#ifndef WEFT_CUDA_INCLUDE_DIR
#error "WEFT_CUDA_INCLUDE_DIR must name the toolkit's include folder (tests/CMakeLists.txt defines it)"
#endif

namespace weft {
namespace {

using ops::MoeRouting;
using ops::MoeTpOptions;
using ops::MoeTpShape;
using Compiled = testing::NvrtcCompiled;

constexpr const char* kSource =
    "#include \"moe_tp/moe_tp_gemm.cuh\"\n#include \"moe_tp/moe_gather.cuh\"\n#include \"moe_tp/moe_routing.cuh\"\n";

size_t count(const std::string& hay, const std::string& needle) {
    size_t n = 0;
    for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
    return n;
}

// The SASS of `names` compiled together (empty when no disassembler works; `why_not` says why).
std::map<std::string, std::string> compile_sass(const std::vector<std::string>& names, const std::string& what,
                                                std::string* why_not) {
    const Compiled r = testing::nvrtc_compile(kSource, "weft_moe_tp_test.cu", names);
    EXPECT_EQ(r.result, NVRTC_SUCCESS) << what << ":\n" << r.log;
    if (r.result != NVRTC_SUCCESS) return {};
    EXPECT_EQ(r.lowered.size(), names.size()) << what << ": some instantiation has no lowered name";
    testing::expect_clean_ptxas_report(r.log, what);
    std::string tool;
    const auto sass = testing::disassemble(r.cubin, &tool, why_not);
    std::map<std::string, std::string> out;
    for (const auto& name : names) {
        const auto lowered = r.lowered.find(name);
        if (lowered == r.lowered.end()) continue;
        const auto fn = sass.find(lowered->second);
        if (fn != sass.end()) out[name] = fn->second;
    }
    return out;
}

// Both layers' GEMMs over every grouped candidate their heuristic may pick: wgmma (HGMMA, no HMMA), TMA loads and
// stores, no local memory (a reachable call or trap in the consumer warpgroups would spill the accumulators).
// The TP MoE layer-0 call signature: M stays readable (the op and count fields are the host descriptor's), and the
// routing's counts change the digest.
TEST(MoeTpSignature, MAndTheRoutingTellCallsApart) {
    const auto desc = [](uint64_t m) {
        return make_call_descriptor(CollectiveOp::kMoeAgGemm, 0, true, DType::kBF16, m, call_descriptor_mix(0, 2));
    };
    const auto routing = [](const std::vector<int32_t>& counts) {
        uint64_t h = 0;
        for (size_t e = 0; e < counts.size(); ++e) {
            h += call_descriptor_mix(e + 1, static_cast<uint64_t>(static_cast<uint32_t>(counts[e])));
        }
        return h;
    };
    const uint64_t a = moe::moe_call_signature(desc(64), routing({64, 64, 0, 0}));
    EXPECT_EQ(call_descriptor_op(a), CollectiveOp::kMoeAgGemm);
    EXPECT_EQ(call_descriptor_count(a), 64u);
    EXPECT_NE(a, moe::moe_call_signature(desc(64), routing({0, 0, 64, 64})));  // same M, other experts
    EXPECT_NE(a, moe::moe_call_signature(desc(64), routing({64, 0, 64, 0})));
    EXPECT_NE(a, moe::moe_call_signature(desc(32), routing({64, 64, 0, 0})));  // other M
    EXPECT_EQ(a, moe::moe_call_signature(desc(64), routing({64, 64, 0, 0})));
    EXPECT_NE(describe_call_descriptor(a).find("moe_ag_grouped_gemm with M = 64 tokens"), std::string::npos)
        << describe_call_descriptor(a);
}

TEST(MoeTpNvrtc, LayerGemmsCompileWithHgmmaAndNoSpills) {
    std::vector<std::string> names;
    for (const GemmConfig& c : ops::grouped_gemm_candidate_configs(DType::kBF16, DType::kBF16, BLayout::kNK, true)) {
        names.push_back(ops::detail::moe_ag_gemm_kernel_spec(c, "sm_90a").instantiation);
    }
    for (const GemmConfig& c : ops::grouped_gemm_candidate_configs(DType::kBF16, DType::kF32, BLayout::kNK)) {
        names.push_back(ops::detail::moe_gemm_rs_kernel_spec(c, "sm_90a").instantiation);
    }
    ASSERT_FALSE(names.empty());
    EXPECT_EQ(ops::detail::moe_ag_gemm_kernel_spec(
                  ops::grouped_gemm_candidate_configs(DType::kBF16, DType::kBF16, BLayout::kNK)[0])
                  .header,
              "moe_tp/moe_tp_gemm.cuh");
    std::string why_not;
    const auto sass = compile_sass(names, "moe tp gemms", &why_not);
    if (sass.empty()) GTEST_SKIP() << "SKIPPED: SASS not checked (" << why_not << "); ptxas reports were";
    for (const auto& name : names) {
        const auto fn = sass.find(name);
        ASSERT_NE(fn, sass.end()) << "no SASS for " << name;
        const std::string& code = fn->second;
        EXPECT_GT(count(code, "HGMMA"), 0u) << name;
        EXPECT_EQ(count(code, " HMMA"), 0u) << name;
        EXPECT_EQ(count(code, " LDL"), 0u) << name << ": local-memory loads";
        EXPECT_EQ(count(code, " STL"), 0u) << name << ": local-memory stores";
        EXPECT_GT(count(code, "UTMALDG"), 0u) << name;
        EXPECT_GT(count(code, "UTMASTG"), 0u) << name;
    }
}

// The routing, gather, combine, push and protocol kernels: clean ptxas reports, nothing in local memory, and the row
// copies (gather, push) move 16 bytes per access.
TEST(MoeTpNvrtc, MemoryKernelsCompileCleanly) {
    std::vector<std::string> names;
    for (const std::string& k : ops::detail::moe_kernel_names()) {
        const jit::KernelSpec spec = ops::detail::moe_kernel_spec(k, "sm_90a");
        EXPECT_NE(std::string(kSource).find(spec.header), std::string::npos) << spec.header;
        names.push_back(spec.instantiation);
    }
    ASSERT_EQ(names.size(), 8u);
    std::string why_not;
    const auto sass = compile_sass(names, "moe tp memory kernels", &why_not);
    if (sass.empty()) GTEST_SKIP() << "SKIPPED: SASS not checked (" << why_not << "); ptxas reports were";
    for (const auto& name : names) {
        const auto fn = sass.find(name);
        ASSERT_NE(fn, sass.end()) << "no SASS for " << name;
        EXPECT_EQ(count(fn->second, " LDL"), 0u) << name;
        EXPECT_EQ(count(fn->second, " STL"), 0u) << name;
    }
    for (const char* copy : {"gather", "push"}) {
        const std::string name = ops::detail::moe_kernel_spec(copy, "sm_90a").instantiation;
        EXPECT_GT(count(sass.at(name), ".128"), 0u) << name << ": no 16-byte accesses\n" << sass.at(name);
    }
}

TEST(MoeTpNvrtc, UnknownKernelNameIsAnError) { EXPECT_THROW(ops::detail::moe_kernel_spec("no_such_kernel"), Error); }

// ---- argument checks ---------------------------------------------------------------------------------------------

// A view of a fake (aligned, never dereferenced) device address; views of different `slot`s do not alias.
TensorView view(DType t, std::initializer_list<int64_t> dims, int slot = 0) {
    return TensorView(reinterpret_cast<void*>((uintptr_t{1} << 32) + (static_cast<uintptr_t>(slot) << 28)), t, dims);
}
int32_t* fake_ints(int i) { return reinterpret_cast<int32_t*>(uintptr_t{1} << (22 + i)); }

using testing::error_of;

TEST(MoeTpArgs, GatheredRows) {
    EXPECT_EQ(ops::moe_gathered_rows(100, 2, 8), 200);
    EXPECT_EQ(ops::moe_gathered_rows(100, 2, 8, 64), 200 + 8 * 63);
    EXPECT_EQ(ops::moe_gathered_rows(0, 8, 4), 0);
    EXPECT_THROW(ops::moe_gathered_rows(10, 2, 8, 0), Error);
    EXPECT_THROW(ops::moe_gathered_rows(-1, 2, 8), Error);
}

MoeRouting fake_routing(int64_t tokens, int64_t topk, int64_t experts) {
    MoeRouting r;
    r.counts = fake_ints(0);
    r.offsets = fake_ints(1);
    r.gather_index = fake_ints(2);
    r.slot_rows = fake_ints(3);
    r.num_experts = experts;
    r.tokens = tokens;
    r.topk = topk;
    r.rows_capacity = tokens * topk;
    return r;
}

TEST(MoeTpArgs, RouteNamesTheBadArgument) {
    MoeRouting r = fake_routing(0, 0, 8);
    r.rows_capacity = 100 * 2;
    const auto idx = view(DType::kI32, {100, 2});
    EXPECT_NE(error_of([&] {
                  ops::moe_route(view(DType::kF32, {100, 2}), r, 1, nullptr);
              }).find("topk_idx must be i32"),
              std::string::npos);
    EXPECT_NE(error_of([&] { ops::moe_route(idx, r, 4, nullptr); }).find("rows_capacity"), std::string::npos);
    EXPECT_NE(error_of([&] { ops::moe_route(idx, r, 0, nullptr); }).find("align"), std::string::npos);
    MoeRouting no_arrays = r;
    no_arrays.slot_rows = nullptr;
    EXPECT_NE(error_of([&] { ops::moe_route(idx, no_arrays, 1, nullptr); }).find("slot_rows"), std::string::npos);
    EXPECT_NE(error_of([&] {
                  ops::moe_route(view(DType::kI32, {100, 65}), r, 1, nullptr);
              }).find("topk"),
              std::string::npos);
    MoeRouting too_many = r;
    too_many.num_experts = int64_t{1} << 31;
    EXPECT_NE(error_of([&] {
                  ops::moe_route(idx, too_many, 1, nullptr);
              }).find("routing.num_experts must be in [1, 2^31 - 2^24], got 2147483648"),
              std::string::npos);
    // A refused call leaves the caller's routing as it was.
    EXPECT_EQ(r.tokens, 0);
    EXPECT_EQ(r.topk, 0);
}

TEST(MoeTpArgs, GatheredGemmNamesTheBadArgument) {
    const MoeRouting r = fake_routing(100, 2, 8);
    const MoeRouting top1 = fake_routing(100, 1, 8);
    const auto a = view(DType::kBF16, {100, 256});
    const auto b = view(DType::kBF16, {8, 512, 256});
    const auto d = view(DType::kBF16, {200, 512});
    const auto a_rows = view(DType::kBF16, {200, 256}, 1);
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_gathered(view(DType::kBF16, {99, 256}), b, d, BLayout::kNK, r, a_rows, nullptr);
              }).find("a must have 100 rows"),
              std::string::npos);
    // The gather copies a's rows before the GEMM's per-group wait: a wait would guard a copy already made.
    ops::GroupedGemmOptions waiting;
    waiting.wait = weft::gemm::GroupedWaitParams{};
    waiting.wait->flags = reinterpret_cast<const uint64_t*>(uintptr_t{1} << 30);
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_gathered(a, b, d, BLayout::kNK, r, a_rows, nullptr, waiting);
              }).find("grouped_gemm_gathered: options.wait is not supported"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_gathered(a, b, d, BLayout::kNK, r, view(DType::kBF16, {199, 256}, 1), nullptr);
              }).find("a_rows must have 200 rows"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_gathered(a, view(DType::kBF16, {7, 512, 256}), d, BLayout::kNK, r, a_rows, nullptr);
              }).find("b must be [E, ...]"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_gathered(a, b, view(DType::kBF16, {200, 520}), BLayout::kNK, r, a_rows, nullptr);
              }).find("d must be [rows, N]"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_gathered(a, b, d, BLayout::kNK, top1, a, nullptr);
              }).find("a_rows (the workspace) must not overlap a"),
              std::string::npos);
    // A workspace that starts inside a (a's row 50) overlaps it without aliasing it.
    const TensorView inside(static_cast<char*>(a.data) + 50 * 256 * 2, DType::kBF16, {100, 256});
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_gathered(a, b, d, BLayout::kNK, top1, inside, nullptr);
              }).find("a_rows (the workspace) must not overlap a"),
              std::string::npos);
    // The grouped GEMM's options are checked before the gather runs (nothing launched for a refused call).
    ops::GroupedGemmOptions bad;
    bad.sm_budget = -1;
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_gathered(a, b, d, BLayout::kNK, r, a_rows, nullptr, bad);
              }).find("options.sm_budget must be >= 0"),
              std::string::npos);
    bad = {};
    bad.status = reinterpret_cast<ops::GroupedStatus*>(uintptr_t{0x1002});
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_gathered(a, b, d, BLayout::kNK, r, a_rows, nullptr, bad);
              }).find("options.status must be 4-byte aligned"),
              std::string::npos);
    MoeRouting small = r;
    small.rows_capacity = 150;
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_gathered(a, b, d, BLayout::kNK, small, a_rows, nullptr);
              }).find("rows_capacity"),
              std::string::npos);
}

TEST(MoeTpArgs, CombineNamesTheBadArgument) {
    const MoeRouting r = fake_routing(100, 2, 8);
    const auto a = view(DType::kBF16, {100, 256});
    const auto b = view(DType::kBF16, {8, 512, 256});
    const auto a_rows = view(DType::kBF16, {200, 256}, 1);
    const auto d_rows = view(DType::kF32, {200, 512});
    const auto w = view(DType::kF32, {100, 2});
    auto combine = [&](const TensorView& out, ops::MoeCombineMode mode, const TensorView& weights,
                       const TensorView& dr) {
        return error_of([&] {
            ops::grouped_gemm_gathered_combine(a, b, out, BLayout::kNK, r, mode, weights, a_rows, dr, nullptr);
        });
    };
    using ops::MoeCombineMode;
    EXPECT_NE(
        combine(view(DType::kBF16, {200, 512}), MoeCombineMode::kWeightedSum, w, d_rows).find("out must have 100 rows"),
        std::string::npos);
    EXPECT_NE(
        combine(view(DType::kBF16, {100, 512}), MoeCombineMode::kPerSlot, w, d_rows).find("out must have 200 rows"),
        std::string::npos);
    EXPECT_NE(combine(view(DType::kBF16, {100, 512}), MoeCombineMode::kWeightedSum, view(DType::kF32, {100, 3}), d_rows)
                  .find("weights must have 2 columns"),
              std::string::npos);
    EXPECT_NE(combine(view(DType::kBF16, {100, 512}), MoeCombineMode::kWeightedSum, w, view(DType::kBF16, {200, 512}))
                  .find("d_rows must be f32"),
              std::string::npos);
    EXPECT_NE(
        combine(view(DType::kF16, {100, 512}), MoeCombineMode::kWeightedSum, w, d_rows).find("out must be bf16 or f32"),
        std::string::npos);
    EXPECT_NE(combine(view(DType::kBF16, {100, 512}), static_cast<MoeCombineMode>(7), w, d_rows).find("mode"),
              std::string::npos);
    // Rows that repeat (stride 0) or overlap (a stride below the row) would land tokens on each other.
    for (const int64_t stride : {int64_t{0}, int64_t{504}}) {
        const auto out = view(DType::kBF16, {100, 512});
        EXPECT_NE(combine(TensorView(out.data, DType::kBF16, {100, 512}, {stride, 1}), MoeCombineMode::kWeightedSum, w,
                          d_rows)
                      .find("out's row stride must be at least its 512 columns"),
                  std::string::npos)
            << stride;
    }
    // The forms that took an acc workspace forward to the ones without it (the same checks).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_gathered_combine(a, b, view(DType::kBF16, {200, 512}), BLayout::kNK, r,
                                                     MoeCombineMode::kWeightedSum, w, a_rows, d_rows,
                                                     view(DType::kF32, {100, 512}), nullptr);
              }).find("grouped_gemm_gathered_combine: out must have 100 rows"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                  ops::moe_combine(d_rows, r, MoeCombineMode::kWeightedSum, w, view(DType::kF32, {100, 512}),
                                   view(DType::kBF16, {200, 512}), nullptr);
              }).find("moe_combine: out must have 100 rows"),
              std::string::npos);
#pragma GCC diagnostic pop
    // The combine kernel steps its columns in int32: N keeps the GEMM's margin below 2^31.
    const int64_t wide = (int64_t{1} << 31) - 8;
    EXPECT_NE(error_of([&] {
                  ops::moe_combine(view(DType::kF32, {200, wide}), r, MoeCombineMode::kPerSlot, TensorView(),
                                   view(DType::kBF16, {200, wide}), nullptr);
              }).find("N a multiple of 8 (at most 2^31 - 2^24)"),
              std::string::npos);
}

// The gather writes a_rows while reading gather_index; the GEMM writes d while reading a_rows, b and the group arrays;
// the combine writes out while reading d_rows, the weights and the routing's arrays: any of these pairs
// overlapping is refused before the device, naming both.
TEST(MoeTpArgs, OutputsOverlappingTheirInputsAreRefused) {
    const MoeRouting r = fake_routing(100, 2, 8);  // counts, offsets, gather_index, slot_rows at 4, 8, 16, 32 MiB
    const auto a = view(DType::kBF16, {100, 256});
    const auto a_rows = view(DType::kBF16, {200, 256}, 1);
    const auto b = view(DType::kBF16, {8, 512, 256}, 2);
    const auto d = view(DType::kBF16, {200, 512}, 3);
    const auto ends_in = [](const int32_t* array, DType t, int64_t rows, int64_t cols) {
        // A [rows, cols] view whose last 16 bytes are the array's first four values.
        const auto end = reinterpret_cast<uintptr_t>(array) + 16;
        return TensorView(reinterpret_cast<void*>(end - static_cast<uintptr_t>(rows * cols * dtype_bytes(t))), t,
                          {rows, cols});
    };
    const auto gathered = [&](const TensorView& dd, const TensorView& ws) {
        return error_of([&] { ops::grouped_gemm_gathered(a, b, dd, BLayout::kNK, r, ws, nullptr); });
    };
    const auto mentions = [](const std::string& e, const std::string& what) {
        EXPECT_NE(e.find(what), std::string::npos) << "expected '" << what << "', got '" << e << "'";
    };
    mentions(gathered(d, ends_in(r.gather_index, DType::kBF16, 200, 256)),
             "grouped_gemm_gathered: a_rows must not overlap routing.gather_index (");
    mentions(gathered(d, view(DType::kBF16, {200, 256}, 2)), "a_rows must not overlap b (");
    mentions(gathered(view(DType::kBF16, {200, 512}, 1), a_rows), "grouped_gemm_gathered: d must not overlap a_rows (");
    mentions(gathered(view(DType::kBF16, {200, 512}, 2), a_rows), "d must not overlap b (");
    mentions(gathered(ends_in(r.counts, DType::kBF16, 200, 512), a_rows), "d must not overlap routing.counts (");
    mentions(gathered(ends_in(r.offsets, DType::kBF16, 200, 512), a_rows), "d must not overlap routing.offsets (");

    using ops::MoeCombineMode;
    const auto d_rows = view(DType::kF32, {200, 512}, 4);
    const auto w = view(DType::kF32, {100, 2}, 6);
    const auto out = view(DType::kBF16, {100, 512}, 7);
    const auto combine = [&](const TensorView& o, const TensorView& weights, const TensorView& dr) {
        return error_of([&] {
            ops::grouped_gemm_gathered_combine(a, b, o, BLayout::kNK, r, MoeCombineMode::kWeightedSum, weights, a_rows,
                                               dr, nullptr);
        });
    };
    mentions(combine(view(DType::kBF16, {100, 512}, 4), w, d_rows),
             "grouped_gemm_gathered_combine: out must not overlap d_rows (");
    mentions(combine(out, ends_in(static_cast<const int32_t*>(out.data), DType::kF32, 100, 2), d_rows),
             "out must not overlap weights (");
    mentions(combine(ends_in(r.slot_rows, DType::kBF16, 100, 512), w, d_rows),
             "out must not overlap routing.slot_rows (");
    mentions(combine(out, w, ends_in(r.slot_rows, DType::kF32, 200, 512)),
             "d_rows must not overlap routing.slot_rows (");
    mentions(combine(out, w, ends_in(static_cast<const int32_t*>(w.data), DType::kF32, 200, 512)),
             "d_rows must not overlap weights (");
    // The gather writes a_rows before the combine reads the weights and slot_rows.
    const auto combine_rows = [&](const TensorView& weights, const TensorView& ar) {
        return error_of([&] {
            ops::grouped_gemm_gathered_combine(a, b, out, BLayout::kNK, r, MoeCombineMode::kWeightedSum, weights, ar,
                                               d_rows, nullptr);
        });
    };
    mentions(combine_rows(w, ends_in(r.slot_rows, DType::kBF16, 200, 256)),
             "a_rows must not overlap routing.slot_rows (");
    mentions(combine_rows(ends_in(static_cast<const int32_t*>(a_rows.data), DType::kF32, 100, 2), a_rows),
             "a_rows must not overlap weights (");
    // The routing's int32 arrays must be 4-byte aligned.
    {
        MoeRouting odd = r;
        odd.offsets = reinterpret_cast<int32_t*>(reinterpret_cast<uintptr_t>(r.offsets) + 2);
        mentions(error_of([&] { ops::grouped_gemm_gathered(a, b, d, BLayout::kNK, odd, a_rows, nullptr); }),
                 "routing.offsets (int32) must be 4-byte aligned");
    }
    // Arguments that pass every check: on a machine without a GPU the call then fails at its first CUDA call (with a
    // GPU it would launch on these fake pointers: not tried).
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        (void)cudaGetLastError();
        mentions(combine(view(DType::kF32, {100, 512}, 5), w, d_rows), "CUDA call failed");
    }
    // moe_route: its arrays apart from topk_idx and each other.
    {
        MoeRouting rr = fake_routing(0, 0, 8);
        rr.rows_capacity = 200;
        const TensorView idx(r.slot_rows, DType::kI32, {100, 2});  // topk_idx where slot_rows is written
        mentions(error_of([&] { ops::moe_route(idx, rr, 1, nullptr); }),
                 "moe_route: routing.slot_rows must not overlap topk_idx (");
        rr.offsets = rr.counts + 4;
        mentions(error_of([&] {
                     ops::moe_route(view(DType::kI32, {100, 2}, 9), rr, 1, nullptr);
                 }),
                 "moe_route: routing.offsets must not overlap routing.counts (");
    }
    // moe_combine alone: the same checks of out.
    mentions(error_of([&] {
                 ops::moe_combine(d_rows, r, MoeCombineMode::kPerSlot, TensorView(), view(DType::kF32, {200, 512}, 4),
                                  nullptr);
             }),
             "moe_combine: out must not overlap d_rows (");
}

TEST(MoeTpArgs, ShapeChecksNameTheField) {
    const MoeTpShape ok{.max_tokens = 8192, .hidden = 4096, .ffn = 14336 / 8, .num_experts = 8, .topk = 2};
    EXPECT_NO_THROW(ops::validate_moe_tp_shape(ok, 8, {}, "op"));
    auto err = [&](MoeTpShape s, int w, MoeTpOptions o = {}) {
        return error_of([&] { ops::validate_moe_tp_shape(s, w, o, "op"); });
    };
    MoeTpShape s = ok;
    s.max_tokens = 8190;
    EXPECT_NE(err(s, 8).find("max_tokens"), std::string::npos);
    s = ok;
    s.hidden = 100;
    EXPECT_NE(err(s, 8).find("hidden"), std::string::npos);
    s = ok;
    s.ffn = 0;
    EXPECT_NE(err(s, 8).find("ffn"), std::string::npos);
    s = ok;
    s.topk = 9;
    EXPECT_NE(err(s, 8).find("topk"), std::string::npos);
    s = ok;
    s.num_experts = 0;
    EXPECT_NE(err(s, 8).find("num_experts"), std::string::npos);
    EXPECT_NE(err(ok, 9).find("1 .. 8 ranks"), std::string::npos);
    // The grouped GEMM's rows (max_tokens x topk) and extents keep a margin below 2^31; a huge max_tokens is refused
    // without an overflowing product.
    s = ok;
    s.max_tokens = (int64_t{1} << 30) + 8;
    EXPECT_NE(err(s, 8).find("max_tokens x topk (the grouped GEMM's rows) must be at most 2^31 - 2^24"),
              std::string::npos);
    s.max_tokens = int64_t{1} << 61;
    EXPECT_NE(err(s, 8).find("max_tokens x topk"), std::string::npos);
    s = ok;
    s.hidden = (int64_t{1} << 31) - 8;
    EXPECT_NE(err(s, 8).find("shape.hidden must be a positive multiple of 8, at most 2^31 - 2^24"), std::string::npos);
    s = ok;
    s.ffn = int64_t{1} << 32;
    EXPECT_NE(err(s, 8).find("shape.ffn (this rank's shard) must be a positive multiple of 8, at most 2^31 - 2^24"),
              std::string::npos);
    s = ok;
    s.num_experts = 4096;
    EXPECT_NO_THROW(ops::validate_moe_tp_shape(s, 8, {}, "op"));
    s.num_experts = 4097;
    EXPECT_NE(err(s, 8).find("shape.num_experts must be in [1, 4096], got 4097"), std::string::npos);
    MoeTpOptions o;
    o.comm_blocks = 65;
    EXPECT_NE(err(ok, 8, o).find("comm_blocks"), std::string::npos);
    o = {};
    GemmConfig clustered = ops::grouped_gemm_candidate_configs(DType::kBF16, DType::kBF16, BLayout::kNK)[0];
    clustered.cluster_m = 2;
    o.config = clustered;
    EXPECT_NE(err(ok, 8, o).find("options.config"), std::string::npos);
    // A forced config must write the layer's GEMM output: bf16 for layer 0, f32 for layer 1 (checked before the
    // members compare their records, so a member whose config alone is wrong fails every member at once).
    const GemmConfig f32_out = ops::grouped_gemm_candidate_configs(DType::kBF16, DType::kF32, BLayout::kNK)[0];
    o.config = f32_out;
    EXPECT_NO_THROW(ops::validate_moe_tp_shape(ok, 8, o, "op", DType::kF32));
    const std::string wrong_out = error_of([&] { ops::validate_moe_tp_shape(ok, 8, o, "op", DType::kBF16); });
    EXPECT_NE(wrong_out.find("options.config must write bf16 (this layer's GEMM output)"), std::string::npos)
        << wrong_out;
    // Layer 0's GEMM waits for its rows: a forced config of more than 128 accumulators (ping-pong 128x192) is refused
    // there and taken by layer 1.
    GemmConfig pp192 = gemm_candidate(9, DType::kBF16, DType::kBF16, BLayout::kNK);
    ASSERT_TRUE(pp192.pingpong && pp192.tile_n == 192 && is_valid_grouped(pp192));
    o.config = pp192;
    const std::string waiting = error_of([&] { ops::validate_moe_tp_shape(ok, 8, o, "op", DType::kBF16); });
    EXPECT_NE(waiting.find("is_valid_grouped_wait"), std::string::npos) << waiting;
    pp192.out_dtype = DType::kF32;
    o.config = pp192;
    EXPECT_NO_THROW(ops::validate_moe_tp_shape(ok, 8, o, "op", DType::kF32));
    o = {};
    o.timeout = std::chrono::hours(24 * 31);
    EXPECT_NE(err(ok, 8, o).find("options.timeout must be in [0, 30 days]"), std::string::npos);
    o.timeout = std::chrono::hours(24 * 30);
    EXPECT_NO_THROW(ops::validate_moe_tp_shape(ok, 8, o, "op"));
}

TEST(MoeTpArgs, RoutingStatusMessage) {
    EXPECT_EQ(ops::describe_routing_status(ops::MoeRoutingStatus{}), "");
    const std::string what = ops::describe_routing_status(ops::MoeRoutingStatus{1, 7, 12, 8});
    EXPECT_NE(what.find("slot 7"), std::string::npos) << what;
    EXPECT_NE(what.find("12"), std::string::npos) << what;
    EXPECT_NE(what.find("[-1, 8)"), std::string::npos) << what;
}

// A peer that stalls must expire a peer wait (a Diagnostic naming it) before the GEMM's pipeline waits, which trap
// without one: layer 0's consumers wait on the producer while it waits for the members' pushes. The GEMM's bound was
// the grouped GEMM's own (WEFT_TIMEOUT_MS or 10 s) under peer waits of twice the World's timeout: at world 8 on one
// GPU the bench's stall ended in a bare cudaErrorLaunchFailure.
TEST(MoeTpArgs, GemmPipelineOutlastsEveryPeerWait) {
    using std::chrono::milliseconds;
    for (const auto& [world, option] :
         {std::pair{milliseconds(10000), milliseconds(0)}, std::pair{milliseconds(60000), milliseconds(0)},
          std::pair{milliseconds(60000), milliseconds(500)}, std::pair{milliseconds(1), milliseconds(0)},
          std::pair{milliseconds(0), milliseconds(0)}}) {
        const ops::detail::MoeTpTimeouts t = ops::detail::moe_tp_timeouts(world, option);
        const int64_t want_ms = option.count() > 0 ? option.count() : std::max<int64_t>(1, world.count());
        EXPECT_EQ(t.wait_ns, static_cast<uint64_t>(want_ms) * 1000000ull) << world.count() << " " << option.count();
        EXPECT_EQ(t.pipeline_ns, 2 * t.wait_ns) << world.count() << " " << option.count();
        EXPECT_GT(t.pipeline_ns, t.wait_ns);
    }
    EXPECT_THROW(ops::detail::moe_tp_timeouts(milliseconds(1000), milliseconds(-1)), Error);
}

}  // namespace
}  // namespace weft
