// SPDX-License-Identifier: MIT
// Unit tests (CPU) of the grouped GEMM (weft/ops/grouped_gemm.hpp): NVRTC compiles every grouped kernel the op may
// launch for sm_90a with a clean ptxas report, its SASS multiplies with wgmma (HGMMA) and keeps nothing in local
// memory; argument checks, the candidate set, the plan and the status messages.
#include <gtest/gtest.h>
#include <nvrtc.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "support/error_text.hpp"
#include "support/nvrtc_testing.hpp"
#include "support/sass_testing.hpp"
#include "weft/common/gemm_config.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/jit/aot.hpp"
#include "weft/ops/aot.hpp"
#include "weft/ops/grouped_gemm.hpp"
#include "weft/runtime/error.hpp"

#ifndef WEFT_SOURCE_DIR
#error "WEFT_SOURCE_DIR must name the source tree (tests/CMakeLists.txt defines it)"
#endif
#ifndef WEFT_CUDA_INCLUDE_DIR
#error "WEFT_CUDA_INCLUDE_DIR must name the toolkit's include folder (tests/CMakeLists.txt defines it)"
#endif

namespace weft {
namespace {

using ops::GroupedGemmOptions;
using ops::GroupedGemmProblem;
using ops::GroupedLayout;

using Compiled = testing::NvrtcCompiled;

Compiled compile(const std::vector<std::string>& instantiations) {
    return testing::nvrtc_compile("#include \"gemm/gemm_sm90.cuh\"\n#include \"gemm/grouped_dequant.cuh\"\n",
                                  "weft_grouped_gemm_test.cu", instantiations);
}

size_t count(const std::string& hay, const std::string& needle) {
    size_t n = 0;
    for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
    return n;
}

// Compiles `names` together: NVRTC succeeds, ptxas' report is clean (no spills, no wgmma serialisation, setmaxnreg
// honoured), and, where a disassembler works, each kernel's SASS has HGMMA (no HMMA), TMA loads and stores, and no
// local-memory access. Returns how many kernels' SASS was checked.
int check_kernels(const std::vector<std::string>& names, const std::string& what) {
    const Compiled r = compile(names);
    EXPECT_EQ(r.result, NVRTC_SUCCESS) << what << ":\n" << r.log;
    if (r.result != NVRTC_SUCCESS) return 0;
    EXPECT_EQ(r.lowered.size(), names.size()) << what << ": some instantiation has no lowered name";
    testing::expect_clean_ptxas_report(r.log, what);
    std::string tool, why_not;
    const auto sass = testing::disassemble(r.cubin, &tool, &why_not);
    if (sass.empty()) return 0;
    int checked = 0;
    for (const auto& name : names) {
        const auto lowered = r.lowered.find(name);
        if (lowered == r.lowered.end()) continue;
        const auto fn = sass.find(lowered->second);
        EXPECT_NE(fn, sass.end()) << "no SASS for " << name << " (tool " << tool << ")";
        if (fn == sass.end()) continue;
        const std::string& code = fn->second;
        EXPECT_GT(count(code, "HGMMA"), 0u) << name << ": no HGMMA in SASS";
        EXPECT_EQ(count(code, " HMMA"), 0u) << name << ": HMMA (mma.sync path)";
        EXPECT_EQ(count(code, " LDL"), 0u) << name << ": local-memory loads";
        EXPECT_EQ(count(code, " STL"), 0u) << name << ": local-memory stores";
        EXPECT_GT(count(code, "UTMALDG"), 0u) << name << ": no TMA loads";
        EXPECT_GT(count(code, "UTMASTG"), 0u) << name << ": no TMA stores";
        ++checked;
    }
    return checked;
}

std::vector<std::string> grouped_instantiations(DType out, BLayout layout, bool wait, bool signal) {
    std::vector<std::string> names;
    for (const GemmConfig& c : ops::grouped_gemm_candidate_configs(DType::kBF16, out, layout, wait)) {
        names.push_back(ops::grouped_gemm_kernel_spec(c, wait, signal, "sm_90a").instantiation);
    }
    return names;
}

TEST(GroupedGemmNvrtc, EveryCandidateCompilesWithHgmmaAndNoSpills) {
    int checked = 0;
    size_t expected = 0;
    bool have_sass = true;
    for (DType out : {DType::kBF16, DType::kF32}) {
        for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
            const auto names = grouped_instantiations(out, layout, false, false);
            ASSERT_FALSE(names.empty());
            expected += names.size();
            const int n = check_kernels(names, std::string("grouped ") + dtype_name(out) +
                                                   (layout == BLayout::kNK ? " kNK" : " kKN"));
            have_sass = have_sass && n > 0;
            checked += n;
        }
    }
    if (!have_sass) GTEST_SKIP() << "SKIPPED: SASS not checked (no disassembler); ptxas reports were";
    EXPECT_EQ(checked, static_cast<int>(expected));
}

// The hooks fused MoE layers build on: the per-group wait before loading A and the per-tile signal.
TEST(GroupedGemmNvrtc, WaitAndSignalHooksCompileWithHgmmaAndNoSpills) {
    std::vector<std::string> names;
    for (bool wait : {false, true}) {
        for (bool signal : {false, true}) {
            if (!wait && !signal) continue;
            for (auto& n : grouped_instantiations(DType::kBF16, BLayout::kNK, wait, signal)) names.push_back(n);
        }
    }
    const int checked = check_kernels(names, "grouped hooks");
    if (checked == 0) GTEST_SKIP() << "SKIPPED: SASS not checked (no disassembler); ptxas reports were";
    EXPECT_EQ(checked, static_cast<int>(names.size()));
}

// The fp8 front of the masked call: e4m3 codes to bf16 with 16-byte loads and stores (LDG.E.128 / STG.E.128), the
// e4m3 conversion in hardware (F2FP), nothing in local memory.
TEST(GroupedGemmNvrtc, Fp8DequantisationLoadsAndStores16BytesAndConvertsInHardware) {
    const std::string name = ops::grouped_dequant_kernel_spec("sm_90a").instantiation;
    const Compiled r = compile({name});
    ASSERT_EQ(r.result, NVRTC_SUCCESS) << r.log;
    testing::expect_clean_ptxas_report(r.log, "grouped fp8 dequantisation");
    std::string tool, why_not;
    const auto sass = testing::disassemble(r.cubin, &tool, &why_not);
    if (sass.empty()) GTEST_SKIP() << "SKIPPED: cannot check SASS: " << why_not;
    const auto lowered = r.lowered.find(name);
    ASSERT_NE(lowered, r.lowered.end());
    const auto fn = sass.find(lowered->second);
    ASSERT_NE(fn, sass.end()) << "no SASS for " << name;
    const std::string& code = fn->second;
    EXPECT_GT(count(code, "LDG.E.128"), 0u) << code;
    EXPECT_GE(count(code, "STG.E.128"), 2u) << code;
    EXPECT_GT(count(code, "F2FP"), 0u) << code;
    EXPECT_EQ(count(code, " LDL"), 0u);
    EXPECT_EQ(count(code, " STL"), 0u);
}

// weft-compile --builtin warms the grouped kernels (through weft::ops::register_op_aot_specs).
TEST(GroupedGemmPlan, KernelsAreInTheAotRegistry) {
    ops::register_op_aot_specs();
    const std::vector<jit::KernelSpec> registered = jit::aot_specs();
    std::vector<jit::KernelSpec> wanted = ops::grouped_gemm_aot_specs();
    wanted.push_back(ops::grouped_dequant_kernel_spec());
    for (const auto& w : wanted) {
        bool found = false;
        for (const auto& r : registered) found = found || (r.header == w.header && r.instantiation == w.instantiation);
        EXPECT_TRUE(found) << w.instantiation << " is not in weft::jit::aot_specs()";
    }
}

// ---- planning and argument checks -------------------------------------------------------------------------------

// A view of a fake (aligned, never dereferenced) device address.
TensorView view(DType t, std::initializer_list<int64_t> dims) {
    return TensorView(reinterpret_cast<void*>(uintptr_t{1} << 20), t, dims);
}
const int32_t* fake_counts() { return reinterpret_cast<const int32_t*>(uintptr_t{1} << 21); }

using testing::error_of;

TEST(GroupedGemmPlan, ValidatesContiguousAndMaskedViews) {
    const auto a = view(DType::kBF16, {1000, 256});
    const auto b = view(DType::kBF16, {8, 512, 256});
    const auto d = view(DType::kF32, {1000, 512});
    const GroupedGemmProblem p = ops::validate_grouped_gemm_args(GroupedLayout::kContiguous, a, b, d, BLayout::kNK,
                                                                 fake_counts(), fake_counts());
    EXPECT_EQ(p.groups, 8);
    EXPECT_EQ(p.rows, 1000);
    EXPECT_EQ(p.n, 512);
    EXPECT_EQ(p.k, 256);
    EXPECT_EQ(p.out_dtype, DType::kF32);

    const auto bkn = view(DType::kBF16, {8, 256, 512});
    EXPECT_EQ(ops::validate_grouped_gemm_args(GroupedLayout::kContiguous, a, bkn, d, BLayout::kKN, fake_counts(),
                                              fake_counts())
                  .n,
              512);

    const GroupedGemmProblem m = ops::validate_grouped_gemm_args(
        GroupedLayout::kMasked, view(DType::kBF16, {8, 256, 256}), b, view(DType::kBF16, {8, 256, 512}),
        BLayout::kNK, nullptr, fake_counts());
    EXPECT_EQ(m.capacity, 256);
    EXPECT_EQ(m.rows, 8 * 256);

    auto contiguous = [&](const TensorView& aa, const TensorView& bb, const TensorView& dd, const int32_t* offsets,
                          const int32_t* counts) {
        return error_of([&] {
            ops::validate_grouped_gemm_args(GroupedLayout::kContiguous, aa, bb, dd, BLayout::kNK, offsets, counts);
        });
    };
    EXPECT_NE(contiguous(a, b, d, nullptr, fake_counts()).find("offsets"), std::string::npos);
    EXPECT_NE(contiguous(a, b, d, fake_counts(), nullptr).find("counts"), std::string::npos);
    EXPECT_NE(contiguous(a, view(DType::kBF16, {8, 512, 128}), d, fake_counts(), fake_counts()).find("K = 256"),
              std::string::npos);
    EXPECT_NE(contiguous(a, view(DType::kF16, {8, 512, 256}), d, fake_counts(), fake_counts()).find("b must"),
              std::string::npos);
    EXPECT_NE(contiguous(a, b, view(DType::kF32, {999, 512}), fake_counts(), fake_counts()).find("d must be"),
              std::string::npos);
    void* base = reinterpret_cast<void*>(uintptr_t{1} << 20);
    EXPECT_NE(contiguous(TensorView(base, DType::kBF16, {1000, 12}, {16, 1}),
                         TensorView(base, DType::kBF16, {8, 512, 12}, {512 * 16, 16, 1}), d, fake_counts(),
                         fake_counts())
                  .find("multiple of 8"),
              std::string::npos);
    EXPECT_NE(contiguous(a, view(DType::kBF16, {512, 256}), d, fake_counts(), fake_counts()).find("[G, N, K]"),
              std::string::npos);
    // Masked: groups of A must be back to back.
    const TensorView padded(reinterpret_cast<void*>(uintptr_t{1} << 20), DType::kBF16, {8, 256, 256},
                            {300 * 256, 256, 1});
    EXPECT_NE(error_of([&] {
                  ops::validate_grouped_gemm_args(GroupedLayout::kMasked, padded, b, view(DType::kBF16, {8, 256, 512}),
                                                  BLayout::kNK, nullptr, fake_counts());
              }).find("back to back"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                  ops::validate_grouped_gemm_args(GroupedLayout::kMasked, view(DType::kBF16, {4, 256, 256}), b,
                                                  view(DType::kBF16, {4, 256, 512}), BLayout::kNK, nullptr,
                                                  fake_counts());
              }).find("G = 8"),
              std::string::npos);
    // Masked with capacity 1: the groups' rows are stride(0) apart, whatever stride(1) says; rows 8 elements apart
    // with 256 columns would overlap.
    const TensorView one_row(reinterpret_cast<void*>(uintptr_t{1} << 20), DType::kBF16, {8, 1, 256}, {8, 8, 1});
    EXPECT_NE(error_of([&] {
                  ops::validate_grouped_gemm_args(GroupedLayout::kMasked, one_row, b, view(DType::kBF16, {8, 1, 512}),
                                                  BLayout::kNK, nullptr, fake_counts());
              }).find("a's rows must not overlap"),
              std::string::npos);
}

TEST(GroupedGemmPlan, ValidatesFp8Operands) {
    const GroupedGemmProblem p = ops::validate_grouped_gemm_args(
        GroupedLayout::kMasked, view(DType::kBF16, {4, 64, 256}), view(DType::kBF16, {4, 128, 256}),
        view(DType::kBF16, {4, 64, 128}), BLayout::kNK, nullptr, fake_counts());
    const auto codes = view(DType::kF8E4M3, {4, 64, 256});
    const auto scales = view(DType::kF32, {4, 64, 2});
    EXPECT_NO_THROW(ops::validate_grouped_fp8_args(p, codes, scales));
    auto err = [&](const TensorView& a, const TensorView& s) {
        return error_of([&] { ops::validate_grouped_fp8_args(p, a, s); });
    };
    EXPECT_NE(err(view(DType::kBF16, {4, 64, 256}), scales).find("f8e4m3"), std::string::npos);
    EXPECT_NE(err(view(DType::kF8E4M3, {4, 32, 256}), scales).find("a must be [G, capacity, K]"), std::string::npos);
    EXPECT_NE(err(codes, view(DType::kF32, {4, 64, 4})).find("K / 128"), std::string::npos);
    EXPECT_NE(err(codes, view(DType::kBF16, {4, 64, 2})).find("f32"), std::string::npos);
    const GroupedGemmProblem odd_k = ops::validate_grouped_gemm_args(
        GroupedLayout::kMasked, view(DType::kBF16, {4, 64, 192}), view(DType::kBF16, {4, 128, 192}),
        view(DType::kBF16, {4, 64, 128}), BLayout::kNK, nullptr, fake_counts());
    EXPECT_NE(error_of([&] {
                  ops::validate_grouped_fp8_args(odd_k, view(DType::kF8E4M3, {4, 64, 192}),
                                                 view(DType::kF32, {4, 64, 1}));
              }).find("multiple of 128"),
              std::string::npos);
}

// The public calls check their options before anything touches the device (these run without a GPU: a CUDA call
// would fail with the runtime's error), and for every problem size, the empty ones (nothing to launch) included.
TEST(GroupedGemmPlan, PublicCallsCheckOptionsBeforeTheDeviceAtEverySize) {
    const auto a = view(DType::kBF16, {8, 64, 256});
    const auto b = view(DType::kBF16, {8, 128, 256});
    const auto d = view(DType::kBF16, {8, 64, 128});
    const auto a_empty = view(DType::kBF16, {0, 64, 256});
    const auto b_empty = view(DType::kBF16, {0, 128, 256});
    const auto d_empty = view(DType::kBF16, {0, 64, 128});
    // Empty problems with good options are no-ops (no CUDA call: they return on a machine without a GPU).
    EXPECT_NO_THROW(ops::grouped_gemm_masked(a_empty, b_empty, d_empty, BLayout::kNK, nullptr, nullptr));
    EXPECT_NO_THROW(ops::grouped_gemm_contiguous(view(DType::kBF16, {0, 256}), b, view(DType::kBF16, {0, 128}),
                                                 BLayout::kNK, fake_counts(), fake_counts(), nullptr));
    struct Bad {
        const char* what;
        ops::GroupedGemmOptions options;
    };
    std::vector<Bad> bad(5);
    bad[0] = {"options.sm_budget must be >= 0", {}};
    bad[0].options.sm_budget = -1;
    bad[1] = {"options.expected_rows_per_group must be >= 0", {}};
    bad[1].options.expected_rows_per_group = -8;
    bad[2] = {"options.config must be a valid cluster-free config", {}};
    bad[2].options.config = gemm_candidate(0, DType::kBF16, DType::kBF16, BLayout::kNK);
    bad[2].options.config->cluster_m = 2;
    bad[3] = {"options.config's dtypes/layout must match the call", {}};
    bad[3].options.config = ops::grouped_gemm_candidate_configs(DType::kBF16, DType::kF32, BLayout::kNK).front();
    bad[4] = {"options.timeout must be >= 0", {}};
    bad[4].options.timeout = std::chrono::milliseconds(-1);
    for (const Bad& x : bad) {
        EXPECT_NE(error_of([&] {
                      ops::grouped_gemm_masked(a, b, d, BLayout::kNK, fake_counts(), nullptr, x.options);
                  }).find(x.what),
                  std::string::npos)
            << x.what;
        EXPECT_NE(error_of([&] {
                      ops::grouped_gemm_masked(a_empty, b_empty, d_empty, BLayout::kNK, nullptr, nullptr, x.options);
                  }).find(x.what),
                  std::string::npos)
            << x.what << " (empty problem)";
        EXPECT_NE(error_of([&] {
                      ops::grouped_gemm_contiguous(view(DType::kBF16, {512, 256}), b, view(DType::kBF16, {512, 128}),
                                                   BLayout::kNK, fake_counts(), fake_counts(), nullptr, x.options);
                  }).find(x.what),
                  std::string::npos)
            << x.what << " (contiguous)";
    }
}

TEST(GroupedGemmPlan, RowsAndExtentsLeaveTheKernelsInt32TileArithmeticAMargin) {
    const int64_t max = ops::kGemmMaxExtent;
    const auto b = view(DType::kBF16, {8, 128, 256});
    EXPECT_EQ(
        ops::validate_grouped_gemm_args(GroupedLayout::kContiguous, view(DType::kBF16, {max, 256}), b,
                                        view(DType::kBF16, {max, 128}), BLayout::kNK, fake_counts(), fake_counts())
            .rows,
        max);
    EXPECT_NE(error_of([&] {
                  ops::validate_grouped_gemm_args(GroupedLayout::kContiguous, view(DType::kBF16, {max + 8, 256}), b,
                                                  view(DType::kBF16, {max + 8, 128}), BLayout::kNK, fake_counts(),
                                                  fake_counts());
              }).find("a's extents must be in [0, 2^31 - 2^24"),
              std::string::npos);
    // Masked: G x capacity rows over the bound, each extent within it.
    EXPECT_NE(error_of([&] {
                  ops::validate_grouped_gemm_args(GroupedLayout::kMasked, view(DType::kBF16, {8, max / 4, 256}), b,
                                                  view(DType::kBF16, {8, max / 4, 128}), BLayout::kNK, nullptr,
                                                  fake_counts());
              }).find("a has too many rows for int32 tile indices"),
              std::string::npos);
}

TEST(GroupedGemmPlan, Fp8WorkspaceMustNotOverlapTheCodesOrScales) {
    const auto b = view(DType::kBF16, {4, 128, 256});
    const auto d = view(DType::kBF16, {4, 64, 128});
    const TensorView codes(reinterpret_cast<void*>(uintptr_t{1} << 24), DType::kF8E4M3, {4, 64, 256});
    const TensorView scales(reinterpret_cast<void*>(uintptr_t{1} << 25), DType::kF32, {4, 64, 2});
    // a_bf16 starting in the codes' second half (not at their base): they partly overlap.
    const TensorView a_bf16(reinterpret_cast<void*>((uintptr_t{1} << 24) + 32 * 1024), DType::kBF16, {4, 64, 256});
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_masked_fp8(codes, scales, b, d, BLayout::kNK, fake_counts(), a_bf16, nullptr);
              }).find("a_bf16 (the workspace) must not overlap a or a_scales"),
              std::string::npos);
    const TensorView over_scales(reinterpret_cast<void*>((uintptr_t{1} << 25) - 1024), DType::kBF16, {4, 64, 256});
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_masked_fp8(codes, scales, b, d, BLayout::kNK, fake_counts(), over_scales, nullptr);
              }).find("must not overlap a or a_scales"),
              std::string::npos);
    // The dequantisation reads a before the GEMM's per-group wait: a wait would guard rows already converted.
    const TensorView a_apart(reinterpret_cast<void*>(uintptr_t{1} << 26), DType::kBF16, {4, 64, 256});
    ops::GroupedGemmOptions waiting;
    waiting.wait = weft::gemm::GroupedWaitParams{};
    waiting.wait->flags = reinterpret_cast<const uint64_t*>(uintptr_t{1} << 30);
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_masked_fp8(codes, scales, b, d, BLayout::kNK, fake_counts(), a_apart, nullptr,
                                               waiting);
              }).find("grouped_gemm_masked_fp8: options.wait is not supported"),
              std::string::npos);
    // Apart, with an empty problem (nothing to launch): accepted.
    const TensorView codes0(reinterpret_cast<void*>(uintptr_t{1} << 24), DType::kF8E4M3, {0, 64, 256});
    const TensorView scales0(reinterpret_cast<void*>(uintptr_t{1} << 25), DType::kF32, {0, 64, 2});
    const TensorView a0(reinterpret_cast<void*>(uintptr_t{1} << 26), DType::kBF16, {0, 64, 256});
    EXPECT_NO_THROW(ops::grouped_gemm_masked_fp8(codes0, scales0, view(DType::kBF16, {0, 128, 256}),
                                                 view(DType::kBF16, {0, 64, 128}), BLayout::kNK, nullptr, a0, nullptr));
}

// The kernel reads A, B and the group arrays while other CTAs write D: a D whose bytes meet any of them is refused
// before the device, naming both arguments.
TEST(GroupedGemmPlan, AnOutputOverlappingAnInputIsRefused) {
    const auto at = [](uintptr_t addr, DType t, std::initializer_list<int64_t> dims) {
        return TensorView(reinterpret_cast<void*>(addr), t, dims);
    };
    constexpr uintptr_t kA = uintptr_t{1} << 24, kB = uintptr_t{1} << 25, kCounts = uintptr_t{1} << 27;
    constexpr uintptr_t kOffsets = uintptr_t{1} << 28;
    constexpr uintptr_t kDBytes = 512 * 128 * 2;
    const auto* counts = reinterpret_cast<const int32_t*>(kCounts);
    const auto* offsets = reinterpret_cast<const int32_t*>(kOffsets);
    const auto a = at(kA, DType::kBF16, {512, 256});     // bytes [kA, kA + 256 KiB)
    const auto b = at(kB, DType::kBF16, {4, 128, 256});  // bytes [kB, kB + 256 KiB)
    const auto contiguous = [&](const TensorView& d) {
        return error_of([&] { ops::grouped_gemm_contiguous(a, b, d, BLayout::kNK, offsets, counts, nullptr); });
    };
    const std::pair<TensorView, const char*> cases[] = {
        {at(kA + 64 * 1024, DType::kBF16, {512, 128}), "d must not overlap a ("},
        {at(kB - kDBytes + 256, DType::kBF16, {512, 128}), "d must not overlap b ("},  // its last 256 bytes
        {at(kCounts - kDBytes + 16, DType::kBF16, {512, 128}), "d must not overlap counts ("},
        {at(kOffsets - kDBytes + 16, DType::kBF16, {512, 128}), "d must not overlap offsets ("},
    };
    for (const auto& [d, what] : cases) {
        const std::string e = contiguous(d);
        EXPECT_NE(e.find(std::string("grouped_gemm_contiguous: ") + what), std::string::npos) << e;
    }
    // Masked: the same for a [G, capacity, K] (no offsets: the masked layout reads none).
    const auto a3 = at(kA, DType::kBF16, {4, 64, 256});
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_masked(a3, b, at(kA + 16 * 1024, DType::kBF16, {4, 64, 128}), BLayout::kNK, counts,
                                           nullptr);
              }).find("grouped_gemm_masked: d must not overlap a ("),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                  ops::grouped_gemm_masked(a3, b, at(kCounts - 64 * 1024 + 16, DType::kBF16, {4, 64, 128}),
                                           BLayout::kNK, counts, nullptr);
              }).find("grouped_gemm_masked: d must not overlap counts ("),
              std::string::npos);
    // Spans are exact: a D that ends where A starts or starts where A ends is apart (no groups: nothing launched).
    const auto b0 = at(kB, DType::kBF16, {0, 128, 256});
    for (const uintptr_t d_at : {kA - kDBytes, kA + 512 * 256 * 2}) {
        EXPECT_NO_THROW(ops::grouped_gemm_contiguous(a, b0, at(d_at, DType::kBF16, {512, 128}), BLayout::kNK, offsets,
                                                     counts, nullptr));
    }
}

// fp8: the dequantisation writes a_bf16 while reading the counts, and the GEMM then reads a_bf16, b and the counts
// while writing d.
TEST(GroupedGemmPlan, Fp8OutputsOverlappingTheirInputsAreRefused) {
    const auto at = [](uintptr_t addr, DType t, std::initializer_list<int64_t> dims) {
        return TensorView(reinterpret_cast<void*>(addr), t, dims);
    };
    constexpr uintptr_t kCodes = uintptr_t{1} << 24, kScales = uintptr_t{1} << 25, kB = uintptr_t{1} << 26;
    constexpr uintptr_t kABf16 = uintptr_t{1} << 27, kCounts = uintptr_t{1} << 28;
    const auto* counts = reinterpret_cast<const int32_t*>(kCounts);
    const auto codes = at(kCodes, DType::kF8E4M3, {4, 64, 256});
    const auto scales = at(kScales, DType::kF32, {4, 64, 2});
    const auto b = at(kB, DType::kBF16, {4, 128, 256});
    const auto a_bf16 = at(kABf16, DType::kBF16, {4, 64, 256});  // 128 KiB
    const auto fp8 = [&](const TensorView& d, const TensorView& ws) {
        return error_of([&] { ops::grouped_gemm_masked_fp8(codes, scales, b, d, BLayout::kNK, counts, ws, nullptr); });
    };
    const auto d_apart = at(uintptr_t{1} << 29, DType::kBF16, {4, 64, 128});
    EXPECT_NE(fp8(at(kABf16 + 4096, DType::kBF16, {4, 64, 128}), a_bf16)
                  .find("grouped_gemm_masked_fp8: d must not overlap a_bf16 ("),
              std::string::npos);
    EXPECT_NE(
        fp8(at(kB + 4096, DType::kBF16, {4, 64, 128}), a_bf16).find("grouped_gemm_masked_fp8: d must not overlap b ("),
        std::string::npos);
    EXPECT_NE(fp8(d_apart, at(kCounts - 128 * 1024 + 16, DType::kBF16, {4, 64, 256}))
                  .find("grouped_gemm_masked_fp8: a_bf16 must not overlap counts ("),
              std::string::npos);
    EXPECT_NE(fp8(d_apart, at(kB + 1024, DType::kBF16, {4, 64, 256}))
                  .find("grouped_gemm_masked_fp8: a_bf16 must not overlap b ("),
              std::string::npos);
}

TEST(GroupedGemmPlan, CandidatesAreGroupedValidAndThePlanFitsTheBudget) {
    for (DType out : {DType::kBF16, DType::kF32}) {
        for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
            const auto configs = ops::grouped_gemm_candidate_configs(DType::kBF16, out, layout);
            EXPECT_GE(configs.size(), 4u);
            for (const GemmConfig& c : configs) {
                EXPECT_TRUE(is_valid_grouped(c)) << ops::format_gemm_config(c);
                EXPECT_EQ(c.cluster_m * c.cluster_n, 1);
            }
        }
    }
    GroupedGemmProblem p;
    p.layout = GroupedLayout::kContiguous;
    p.groups = 8;
    p.rows = 8 * 4096;
    p.n = 4096;
    p.k = 7168;
    const ops::GroupedGemmPlan big = ops::plan_grouped_gemm(p, 132);
    EXPECT_EQ(big.grid, 132);
    EXPECT_TRUE(is_valid_grouped(big.config));
    EXPECT_GE(big.config.tile_m * big.config.tile_n, 128 * 128) << ops::format_gemm_config(big.config);
    // The dense engine's ping-pong 128x192 (192 accumulators per consumer thread) is a grouped candidate too.
    GemmConfig pp192 = gemm_candidate(9, DType::kBF16, DType::kBF16, BLayout::kNK);
    ASSERT_TRUE(pp192.pingpong && pp192.tile_m == 128 && pp192.tile_n == 192);
    EXPECT_TRUE(is_valid_grouped(pp192));
    const auto bf16_nk = ops::grouped_gemm_candidate_configs(DType::kBF16, DType::kBF16, BLayout::kNK);
    EXPECT_NE(std::find(bf16_nk.begin(), bf16_nk.end(), pp192), bf16_nk.end());
    // A waiting call's consumers keep the scheduler's cursor: at most 128 accumulators (is_valid_grouped_wait).
    EXPECT_FALSE(is_valid_grouped_wait(pp192));
    for (const GemmConfig& c : ops::grouped_gemm_candidate_configs(DType::kBF16, DType::kBF16, BLayout::kNK, true)) {
        EXPECT_TRUE(is_valid_grouped_wait(c)) << ops::format_gemm_config(c);
    }
    GroupedGemmOptions waiting;
    waiting.wait = weft::gemm::GroupedWaitParams{};
    EXPECT_TRUE(is_valid_grouped_wait(ops::plan_grouped_gemm(p, 132, waiting).config));
    waiting.config = pp192;
    EXPECT_NE(error_of([&] { ops::plan_grouped_gemm(p, 132, waiting); }).find("is_valid_grouped_wait"),
              std::string::npos);
    EXPECT_NE(error_of([&] { ops::grouped_gemm_kernel_spec(pp192, true, false, "sm_90a"); }).find("waiting"),
              std::string::npos);

    // Masked decode: small capacity prefers a tile no taller than the capacity needs.
    GroupedGemmProblem m = p;
    m.layout = GroupedLayout::kMasked;
    m.groups = 32;
    m.capacity = 64;
    m.rows = 32 * 64;
    const ops::GroupedGemmPlan small = ops::plan_grouped_gemm(m, 132);
    EXPECT_LE(small.config.tile_m, 128) << ops::format_gemm_config(small.config);
    // Groups of 192 rows (3/4 of a 256 capacity): 64-row tiles waste nothing where 128-row ones waste a quarter.
    m.capacity = 256;
    m.rows = 32 * 256;
    GroupedGemmOptions hint;
    hint.expected_rows_per_group = 192;
    EXPECT_EQ(ops::plan_grouped_gemm(m, 132, hint).config.tile_m, 64)
        << ops::format_gemm_config(ops::plan_grouped_gemm(m, 132, hint).config);

    // A grid never exceeds the tiles any counts could make, nor the budget.
    GroupedGemmProblem tiny = p;
    tiny.groups = 1;
    tiny.rows = 64;
    tiny.n = 64;
    GroupedGemmOptions o;
    o.sm_budget = 16;
    EXPECT_LE(ops::plan_grouped_gemm(tiny, 132, o).grid, 2);
    EXPECT_LE(ops::plan_grouped_gemm(p, 132, o).grid, 16);

    // A forced config must be grouped-valid and match the call.
    o.config = gemm_candidate(1, DType::kBF16, DType::kBF16, BLayout::kNK);  // a cluster pair
    EXPECT_NE(error_of([&] { ops::plan_grouped_gemm(p, 132, o); }).find("is_valid_grouped"), std::string::npos);
    o.config = gemm_candidate(0, DType::kBF16, DType::kF32, BLayout::kNK);
    EXPECT_NE(error_of([&] { ops::plan_grouped_gemm(p, 132, o); }).find("match the call"), std::string::npos);
}

TEST(GroupedGemmPlan, RowSpreadsKeepTheExpectedRows) {
    GroupedGemmProblem m;
    m.layout = GroupedLayout::kMasked;
    m.groups = 32;
    m.capacity = 256;
    m.rows = 32 * 256;
    m.n = 4096;
    m.k = 7168;
    // 8 rows per expert: 256 rows, evenly or all in one expert.
    ops::GroupedRowSpread s = ops::grouped_row_spreads(m, 8);
    EXPECT_EQ(s.even_groups, 32);
    EXPECT_EQ(s.even_rows, 8);
    EXPECT_EQ(s.full_groups, 1);
    EXPECT_EQ(s.full_rows, 256);
    EXPECT_EQ(s.rest_rows, 0);
    // 100 rows per expert: 3200 rows = 12 full experts and 128 rows in a thirteenth.
    s = ops::grouped_row_spreads(m, 100);
    EXPECT_EQ(s.full_groups, 12);
    EXPECT_EQ(s.rest_rows, 128);
    EXPECT_EQ(s.full_groups * s.full_rows + s.rest_rows, s.even_groups * s.even_rows);
    // More than the capacity: clamped to it (every expert full); 0: at least one row.
    s = ops::grouped_row_spreads(m, 1000);
    EXPECT_EQ(s.even_rows, 256);
    EXPECT_EQ(s.full_groups, 32);
    EXPECT_EQ(s.rest_rows, 0);
    s = ops::grouped_row_spreads(m, 0);
    EXPECT_EQ(s.even_rows, 1);
    EXPECT_EQ(s.full_groups, 0);
    EXPECT_EQ(s.rest_rows, 32);
    // Contiguous: one group holds them all.
    GroupedGemmProblem c = m;
    c.layout = GroupedLayout::kContiguous;
    c.capacity = 0;
    s = ops::grouped_row_spreads(c, 300);
    EXPECT_EQ(s.even_rows, 300);
    EXPECT_EQ(s.full_groups, 0);
    EXPECT_EQ(s.rest_rows, 32 * 300);
}

// The measured shapes of weft_bench_moe (docs/performance.md, "Grouped GEMM"): the pick is the dense cost model's over
// both spreads of the expected rows.
TEST(GroupedGemmPlan, FewRowsInOneExpertGetTilesThatFillTheSms) {
    GroupedGemmProblem m;
    m.layout = GroupedLayout::kMasked;
    m.groups = 32;
    m.capacity = 256;
    m.rows = 32 * 256;
    m.n = 4096;
    m.k = 7168;
    GroupedGemmOptions o;
    // 256 rows expected in all (8 per expert): if they are one expert's, ping-pong 64x128 makes 128 tiles on 132 SMs
    // (the dense GEMM's pick for 256 x 4096 x 7168) where ping-pong 64x256, the even spread's cheapest, makes 64.
    o.expected_rows_per_group = 8;
    const GemmConfig one = ops::plan_grouped_gemm(m, 132, o).config;
    EXPECT_TRUE(one.pingpong && one.tile_m == 64 && one.tile_n == 128) << ops::format_gemm_config(one);
    ops::GemmProblem dense;
    dense.m = 256;
    dense.n = m.n;
    dense.k = m.k;
    const ops::GemmPlan dense_plan = ops::plan_gemm(dense, 132);
    ASSERT_EQ(dense_plan.path, ops::GemmPath::kTiled);
    EXPECT_EQ(ops::gemm_candidate_name(dense_plan.config), ops::gemm_candidate_name(one));
    EXPECT_GE(GemmTileGrid(one, 256, 4096).num_tiles(), 3 * 132 / 4);

    // 192 rows per expert (uniform): 64-row tiles, no padding; 32 per expert (skewed) keeps them too.
    o.expected_rows_per_group = 192;
    GemmConfig c = ops::plan_grouped_gemm(m, 132, o).config;
    EXPECT_TRUE(c.pingpong && c.tile_m == 64 && c.tile_n == 256) << ops::format_gemm_config(c);
    o.expected_rows_per_group = 32;
    c = ops::plan_grouped_gemm(m, 132, o).config;
    EXPECT_TRUE(c.pingpong && c.tile_m == 64 && c.tile_n == 256) << ops::format_gemm_config(c);
    // No hint: capacity / 2 per expert, 4096 rows whichever way they fall: the cooperative 128x256.
    o.expected_rows_per_group = 0;
    c = ops::plan_grouped_gemm(m, 132, o).config;
    EXPECT_TRUE(!c.pingpong && c.tile_m == 128 && c.tile_n == 256) << ops::format_gemm_config(c);

    // Contiguous, 8 experts, the benchmark's rows (uniform 8 x 4096, skewed 11131, one expert 4096). At 4096 x 7168
    // the cooperative 128x256 for all three (forced configs in one run, one H100: uniform 2.52 ms against ping-pong
    // 128x192's 2.54 and 128x176's 2.70, skewed 0.84 against 0.92 and 0.95). At 7168 x 2048 ping-pong 128x192 for
    // uniform rows (the dense GEMM's pick), and the tiles with a plain-stored tail where the rows are fewer: 128x160
    // skewed (0.436 ms; 128x192 0.426), 128x176 for one expert (0.155 ms; 128x192 0.164, the dense GEMM's 128x176
    // 0.152).
    GroupedGemmProblem ct;
    ct.layout = GroupedLayout::kContiguous;
    ct.groups = 8;
    struct Pick {
        int64_t rows, n, k;
        bool pingpong;
        int tile_n;
    };
    for (const Pick& want : {Pick{8 * 4096, 4096, 7168, false, 256}, Pick{11131, 4096, 7168, false, 256},
                             Pick{4096, 4096, 7168, false, 256}, Pick{8 * 4096, 7168, 2048, true, 192},
                             Pick{11131, 7168, 2048, true, 160}, Pick{4096, 7168, 2048, true, 176}}) {
        ct.rows = want.rows;
        ct.n = want.n;
        ct.k = want.k;
        c = ops::plan_grouped_gemm(ct, 132).config;
        EXPECT_TRUE(c.pingpong == want.pingpong && c.tile_m == 128 && c.tile_n == want.tile_n)
            << want.rows << " rows, " << want.n << "x" << want.k << ": " << ops::format_gemm_config(c);
    }
}

TEST(GroupedGemmPlan, StatusRecordsBecomeErrorsThatNameTheGroup) {
    EXPECT_EQ(ops::describe_grouped_status({}), "");
    EXPECT_NO_THROW(ops::check_grouped_status({}));
    const ops::GroupedStatus over{static_cast<int32_t>(ops::GroupedStatusCode::kCountOverCapacity), 3, 300, 256};
    const std::string msg = ops::describe_grouped_status(over);
    EXPECT_NE(msg.find("group 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("300"), std::string::npos) << msg;
    EXPECT_NE(msg.find("256"), std::string::npos) << msg;
    EXPECT_THROW(ops::check_grouped_status(over), Error);
    const ops::GroupedStatus range{static_cast<int32_t>(ops::GroupedStatusCode::kRowsOutOfRange), 1, 1100, 1000};
    EXPECT_NE(ops::describe_grouped_status(range).find("1000"), std::string::npos);
}

}  // namespace
}  // namespace weft
