// SPDX-License-Identifier: MIT
// Seeded random fuzz of the public ops on one GPU: every case draws fresh inputs within what the headers allow, poisons
// the output (NaN bytes), runs the op and compares it with an independent reference (cuBLASLt in fp32 for every
// element plus host fp64 on sampled elements for the GEMMs, host fp64 softmax attention, the host's byte pattern for
// all_to_all_v); a fraction of the cases are invalid arguments that must throw weft::Error, never crash.
//
// Knobs (environment): WEFT_FUZZ_SEED (default a fixed seed: runs are reproducible), WEFT_FUZZ_SECONDS (time per test,
// default 15), WEFT_FUZZ_CASES (most cases per test), WEFT_FUZZ_KERNELS (most distinct JIT kernels a test may draw),
// WEFT_FUZZ_CASE=i.a (replay only draw a of case i, what a failure's line prints; AllToAllV, whose ranks are threads:
// a = W * 100, case i in a world of W ranks). A failure prints one line with the seed, the case and every parameter.
//
// JIT cost: a new kernel specialisation compiles on first use (seconds to tens of seconds when the cache is cold). What
// picks a specialisation: GEMM, the dtype pair, B's layout and the planner's tile config (from M, N, K, sm_budget,
// split_k) or, on the small-M path, the variant and ceil(M / 16); grouped GEMM, the dtypes, B's layout and the planned
// config (from N, K, the rows hint and sm_budget); decode attention, the dtype and head_dim; all_to_all_v, nothing
// (one kernel set for worlds 1..8). A test admits a draw with a kernel it has not run yet only while it has run fewer
// than WEFT_FUZZ_KERNELS of them and is in the first half of its time; otherwise it draws again.
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_collectives.hpp"
#include "fuzz_harness.hpp"
#include "support/gemm_testing.hpp"
#include "support/jit_testing.hpp"
#include "support/runtime_checks.hpp"
#include "support/tp_reference.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/ops/attention.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/ops/grouped_gemm.hpp"
#include "weft/runtime/error.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

using gemm_test::DeviceBuffer;

using namespace fuzz_test;

// ---- cuBLASLt: the GEMMs' full reference ----------------------------------------------------------------------

int64_t pointer_alignment(const void* p) {
    const auto a = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
    return a == 0 ? 256 : std::min<int64_t>(256, a & -a);
}

/// D (f32, row stride ldd) = A [m, k] (row stride lda) * B ([n, k] or [k, n], row stride ldb), fp32 accumulation.
class Cublas {
public:
    Cublas() : ws_(kWorkspaceBytes) {
        if (cublasLtCreate(&handle_) != CUBLAS_STATUS_SUCCESS) handle_ = nullptr;
    }
    ~Cublas() {
        if (handle_) cublasLtDestroy(handle_);
    }
    Cublas(const Cublas&) = delete;
    Cublas& operator=(const Cublas&) = delete;

    bool gemm(DType in, const void* a, int64_t lda, const void* b, int64_t ldb, BLayout layout, int64_t m, int64_t n,
              int64_t k, float* d, int64_t ldd, cudaStream_t stream, std::string* why) {
        if (m == 0 || n == 0) return true;
        if (!handle_ || !ws_.ptr) {
            *why = "cuBLASLt unavailable";
            return false;
        }
        const cudaDataType t = in == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
        cublasLtMatmulDesc_t desc = nullptr;
        cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
        cublasLtMatmulPreference_t pref = nullptr;
        bool ok = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS;
        // Column-major view: D^T [n, m] = op(B) [n, k] * A^T [k, m].
        const cublasOperation_t ta = layout == BLayout::kNK ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
        ok = ok && cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) == 0;
        ok = ok && cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) == 0;
        const auto u = [](int64_t x) { return static_cast<uint64_t>(x); };
        ok = ok && (layout == BLayout::kNK ? cublasLtMatrixLayoutCreate(&la, t, u(k), u(n), ldb)
                                           : cublasLtMatrixLayoutCreate(&la, t, u(n), u(k), ldb)) == 0;
        ok = ok && cublasLtMatrixLayoutCreate(&lb, t, u(k), u(m), lda) == 0;
        ok = ok && cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, u(n), u(m), ldd) == 0;
        ok = ok && cublasLtMatmulPreferenceCreate(&pref) == 0;
        const size_t ws_bytes = kWorkspaceBytes;
        const uint32_t align_a = static_cast<uint32_t>(pointer_alignment(b));
        const uint32_t align_b = static_cast<uint32_t>(pointer_alignment(a));
        const uint32_t align_d = static_cast<uint32_t>(pointer_alignment(d));
        ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                        sizeof(ws_bytes)) == 0;
        ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                        sizeof(align_a)) == 0;
        ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                        sizeof(align_b)) == 0;
        ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d,
                                                        sizeof(align_d)) == 0;
        ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                                        sizeof(align_d)) == 0;
        cublasLtMatmulHeuristicResult_t result{};
        int found = 0;
        ok = ok && cublasLtMatmulAlgoGetHeuristic(handle_, desc, la, lb, ld, ld, pref, 1, &result, &found) == 0 &&
             found > 0;
        const float alpha = 1.f, beta = 0.f;
        ok = ok && cublasLtMatmul(handle_, desc, &alpha, b, la, a, lb, &beta, d, ld, d, ld, &result.algo, ws_.ptr,
                                  ws_bytes, stream) == CUBLAS_STATUS_SUCCESS;
        if (pref) cublasLtMatmulPreferenceDestroy(pref);
        if (la) cublasLtMatrixLayoutDestroy(la);
        if (lb) cublasLtMatrixLayoutDestroy(lb);
        if (ld) cublasLtMatrixLayoutDestroy(ld);
        if (desc) cublasLtMatmulDescDestroy(desc);
        if (!ok) *why = "cuBLASLt found no algorithm or failed";
        return ok;
    }

private:
    static constexpr size_t kWorkspaceBytes = size_t{32} << 20;
    cublasLtHandle_t handle_ = nullptr;
    DeviceBuffer ws_;
};

/// Element-wise bound |got - want| <= rel |want| + abs rms(want) by output dtype (gemm_testing's tolerances).
struct GemmCompare {
    explicit GemmCompare(DType out) : tol(gemm_test::tolerance_for(out)) {}
    gemm_test::Tolerance tol;
    int64_t checked = 0, bad = 0, nonfinite = 0;
    std::string first;
    void expect(double got, double want, double rms, const char* what, int64_t g, int64_t r, int64_t c) {
        ++checked;
        const bool finite = std::isfinite(got);
        if (finite && std::fabs(got - want) <= tol.elem_rel * std::fabs(want) + tol.elem_abs * rms) return;
        finite ? ++bad : ++nonfinite;
        if (first.empty()) {
            std::ostringstream os;
            os << what << " (group " << g << ", row " << r << ", col " << c << "): got " << got << ", want " << want;
            first = os.str();
        }
    }
    bool ok() const { return bad == 0 && nonfinite == 0; }
    std::string report() const {
        std::ostringstream os;
        os << bad << " elements out of tolerance and " << nonfinite << " non-finite of " << checked << "; first "
           << first;
        return os.str();
    }
};

/// fp64 dot product of row r of A and column c of B (B [n, k] or [k, n]).
double dot64(const Host16& a, int64_t a_row, const Host16& b, int64_t b_first_row, BLayout layout, int64_t c,
             int64_t k) {
    double s = 0;
    for (int64_t kk = 0; kk < k; ++kk) {
        const double bv = layout == BLayout::kNK ? b.at(b_first_row + c, kk) : b.at(b_first_row + kk, c);
        s += static_cast<double>(a.at(a_row, kk)) * bv;
    }
    return s;
}

// ---- GpuFuzz.Gemm ------------------------------------------------------------------------------------------------

/// What makes an invalid GEMM call invalid (each one documented in weft/ops/gemm.hpp or its options).
enum class GemmBad {
    kNone,
    kLdaNot16Bytes,
    kLddNot16Bytes,
    kLdbNot16Bytes,
    kBaseNot16Bytes,
    kKNotMultipleOf8,
    kBDtypeDiffers,
    kDDtypeWrong,
    kInputF32,
    kBKMismatch,
    kDShapeMismatch,
    kDOverlapsA,
    kNot2D,
    kInnerStride,
    kNullData,
    kSplitKRange,
    kSmBudgetNegative,
    kSmallMMaxRange,
    kWgmmaMaxRange,
    kVariant5TooManyRows,
    kVariant5WithKN,
    kVariant4Unservable,
    kConfigDtypeMismatch,
    kWorkspaceMisaligned,
    kTimeoutNegative,
    kCount
};

const char* bad_name(GemmBad b) {
    static const char* const kNames[] = {"none",
                                         "lda_not_16B",
                                         "ldd_not_16B",
                                         "ldb_not_16B",
                                         "base_not_16B",
                                         "k_not_multiple_of_8",
                                         "b_dtype_differs",
                                         "d_dtype_wrong",
                                         "input_f32",
                                         "b_k_mismatch",
                                         "d_shape_mismatch",
                                         "d_overlaps_a",
                                         "not_2d",
                                         "inner_stride",
                                         "null_data",
                                         "split_k_range",
                                         "sm_budget_negative",
                                         "small_m_max_m_range",
                                         "small_m_wgmma_max_m_range",
                                         "variant5_m_over_256",
                                         "variant5_b_kn",
                                         "variant4_unservable",
                                         "config_dtype_mismatch",
                                         "workspace_misaligned",
                                         "timeout_negative"};
    return kNames[static_cast<int>(b)];
}

struct GemmCase {
    int64_t m = 0, n = 0, k = 0;
    DType in = DType::kBF16, out = DType::kBF16;
    BLayout layout = BLayout::kNK;
    int64_t lda = 0, ldb = 0, ldd = 0;        // row strides, elements
    int64_t off_a = 0, off_b = 0, off_d = 0;  // base offsets, bytes
    int sm_budget = 0, split_k = 0, small_m_max_m = 32, small_m_wgmma_max_m = 192, small_m_splits = 0;
    bool allow_small_m = true, programmatic = false, own_workspace = false;
    int variant = 0;  // 0: the op picks; else GemvVariant 3, 4 or 5
    GemmBad bad = GemmBad::kNone;
};

std::string describe(const GemmCase& c) {
    std::ostringstream os;
    os << "m=" << c.m << " n=" << c.n << " k=" << c.k << " in=" << dtype_name(c.in) << " out=" << dtype_name(c.out)
       << " b=" << (c.layout == BLayout::kNK ? "NK" : "KN") << " lda=" << c.lda << " ldb=" << c.ldb << " ldd=" << c.ldd
       << " off=" << c.off_a << "," << c.off_b << "," << c.off_d << " sm_budget=" << c.sm_budget
       << " split_k=" << c.split_k << " allow_small_m=" << c.allow_small_m << " small_m_max_m=" << c.small_m_max_m
       << " small_m_wgmma_max_m=" << c.small_m_wgmma_max_m << " small_m_splits=" << c.small_m_splits
       << " variant=" << c.variant << " programmatic=" << c.programmatic << " workspace=" << c.own_workspace
       << " invalid=" << bad_name(c.bad);
    return os.str();
}

int64_t b_rows(const GemmCase& c) { return c.layout == BLayout::kNK ? c.n : c.k; }
int64_t b_cols(const GemmCase& c) { return c.layout == BLayout::kNK ? c.k : c.n; }

/// A row stride for `cols` elements of `esize` bytes: 16-byte rows, sometimes padded further.
int64_t draw_ld(Rng& r, int64_t cols, int64_t esize) {
    const int64_t pad = r.chance(0.6) ? 0 : r.uniform(1, 72);
    return round_up(std::max<int64_t>(cols + pad, 1), 16 / esize);
}

GemmCase draw_gemm(Rng& r, int sms) {
    GemmCase c;
    const int io = static_cast<int>(r.uniform(0, 3));
    c.in = io < 2 ? DType::kBF16 : DType::kF16;
    c.out = io % 2 == 0 ? c.in : DType::kF32;
    c.layout = r.chance(0.35) ? BLayout::kKN : BLayout::kNK;
    const double shape = r.real(0, 1);
    if (shape < 0.3) {  // tiny
        c.m = r.uniform(1, 17);
        c.n = r.uniform(1, 17);
        c.k = 8 * r.uniform(1, 17);
    } else if (shape < 0.7) {  // awkward: nothing a multiple of a tile
        c.m = r.uniform(1, 700);
        c.n = r.uniform(1, 1500);
        c.k = 8 * r.uniform(1, 160);
    } else if (shape < 0.95) {  // large-ish, bounded in work and in the bytes the host compares
        c.m = r.log_uniform(64, 6000);
        c.n = r.log_uniform(64, 6000);
        c.k = 8 * r.log_uniform(8, 750);
        while (c.m * c.n > (int64_t{12} << 20)) c.m = std::max<int64_t>(1, c.m / 2);
        while (c.m * c.n * c.k > (int64_t{1} << 35)) c.k = std::max<int64_t>(8, c.k / 16 * 8);
    } else {  // empty: nothing may be written
        c.m = r.chance(0.5) ? 0 : r.uniform(1, 300);
        c.n = c.m == 0 ? r.uniform(0, 300) : 0;
        c.k = 8 * r.uniform(1, 64);
    }
    if (r.chance(0.15)) {  // tile-aligned extents too
        c.m = round_up(c.m, 64);
        c.n = round_up(c.n, 128);
        c.k = round_up(c.k, 64);
    }
    const int64_t ein = dtype_bytes(c.in), eout = dtype_bytes(c.out);
    c.lda = draw_ld(r, c.k, ein);
    c.ldb = draw_ld(r, b_cols(c), ein);
    c.ldd = draw_ld(r, c.n, eout);
    if (r.chance(0.3)) c.off_a = 16 * r.uniform(1, 15);
    if (r.chance(0.3)) c.off_b = 16 * r.uniform(1, 15);
    if (r.chance(0.3)) c.off_d = 16 * r.uniform(1, 15);
    if (r.chance(0.3)) c.sm_budget = static_cast<int>(r.chance(0.5) ? r.uniform(1, 8) : r.uniform(1, sms));
    if (r.chance(0.15)) c.split_k = static_cast<int>(r.uniform(1, 16));
    if (r.chance(0.1)) c.allow_small_m = false;
    if (r.chance(0.15)) c.small_m_max_m = static_cast<int>(r.uniform(0, 64));
    if (r.chance(0.1)) c.small_m_wgmma_max_m = static_cast<int>(r.uniform(0, 256));
    if (r.chance(0.15)) c.small_m_splits = static_cast<int>(r.uniform(1, 32));
    if (c.layout == BLayout::kNK && r.chance(0.2)) {
        c.variant = static_cast<int>(r.pick({3, 4, 5}));
        if (c.variant == 3) {  // its documented domain: M <= kGemvMaxM
            c.m = std::min<int64_t>(c.m, r.uniform(1, kGemvMaxM));
        } else if (c.variant == 5) {
            c.m = std::min<int64_t>(c.m, r.uniform(1, 256));
            c.small_m_splits = std::min(c.small_m_splits, 8);
        } else if (c.variant == 4) {  // its documented domain: M <= 16, ldb = K, K a multiple of 2048
            c.m = r.uniform(1, 16);
            c.k = 2048 * r.pick<int64_t>({1, 1, 2, 3, 4, 8});
            c.n = r.uniform(1, 3000);
            c.lda = draw_ld(r, c.k, ein);
            c.ldb = c.k;
            c.ldd = draw_ld(r, c.n, eout);
            c.small_m_splits = std::min(c.small_m_splits, 1);
            c.off_b = 0;
        }
    }
    c.programmatic = r.chance(0.15);
    c.own_workspace = r.chance(0.2);
    if (r.chance(0.12)) c.bad = static_cast<GemmBad>(r.uniform(1, static_cast<int>(GemmBad::kCount) - 1));
    if (c.bad != GemmBad::kNone) {  // small operands: the call must refuse them before touching the device
        c.m = std::max<int64_t>(2, std::min<int64_t>(c.m, 64));
        c.n = std::max<int64_t>(2, std::min<int64_t>(c.n, 64));
        c.k = std::min<int64_t>(c.k, 256);
        c.variant = 0;
        c.lda = round_up(c.k, 8);
        c.ldb = round_up(b_cols(c), 8);
        c.ldd = round_up(c.n, 8);
    }
    return c;
}

/// The kernel a valid case runs (its JIT specialisation), from the op's own planner on addresses of the case's
/// alignment.
std::string gemm_kernel_key(const GemmCase& c, const ops::GemmOptions& o, int sms) {
    if (c.m == 0 || c.n == 0) return "empty";
    auto* base = reinterpret_cast<uint8_t*>(uintptr_t{1} << 44);
    const TensorView a = view2(base + c.off_a, c.in, c.m, c.k, c.lda);
    const TensorView b = view2(base + (int64_t{1} << 38) + c.off_b, c.in, b_rows(c), b_cols(c), c.ldb);
    const TensorView d = view2(base + (int64_t{2} << 38) + c.off_d, c.out, c.m, c.n, c.ldd);
    const ops::GemmProblem p = ops::validate_gemm_args(a, b, d, c.layout);
    const ops::GemmPlan plan = ops::plan_gemm(p, sms, o);
    if (plan.path == ops::GemmPath::kTiled) return ops::format_gemm_config(plan.config);
    std::ostringstream os;
    os << "small_m v" << static_cast<int>(plan.small_m_variant) << " tiles " << plan.small_m_tiles << " "
       << dtype_name(c.in) << "->" << dtype_name(c.out);
    return os.str();
}

ops::GemmOptions gemm_options(const GemmCase& c) {
    ops::GemmOptions o;
    o.sm_budget = c.sm_budget;
    o.split_k = c.split_k;
    o.allow_small_m = c.allow_small_m;
    o.small_m_max_m = c.small_m_max_m;
    o.small_m_wgmma_max_m = c.small_m_wgmma_max_m;
    o.small_m_splits = c.small_m_splits;
    if (c.variant) o.small_m_variant = static_cast<GemvVariant>(c.variant);
    o.programmatic_launch = c.programmatic;
    return o;
}

/// An invalid case: the call must throw weft::Error with a message, launch nothing and leave d's poison. Returns "" or
/// what went wrong.
std::string run_invalid_gemm(const GemmCase& c, cudaStream_t stream) {
    // Every view lies inside one arena, apart (but for kDOverlapsA), so that a call that wrongly accepts them stays in
    // bounds.
    const size_t region = size_t{1} << 20;
    DeviceBuffer arena(3 * region);
    std::string why;
    if (!arena.ptr) return "cudaMalloc failed";
    if (!cuda_ok(cudaMemsetAsync(arena.ptr, 0xFF, 3 * region, stream), &why, "cudaMemsetAsync")) return why;
    auto* base = static_cast<uint8_t*>(arena.ptr);
    void* pa = base;
    void* pb = base + region;
    void* pd = base + 2 * region;
    DType ta = c.in, tb = c.in, td = c.out;
    int64_t m = c.m, n = c.n, k = c.k, lda = c.lda, ldb = c.ldb, ldd = c.ldd;
    int64_t b_k = k;
    int64_t d_rows = m, d_cols = n;
    ops::GemmOptions o = gemm_options(c);
    o.programmatic_launch = false;
    std::optional<TensorView> a_override;
    DeviceBuffer* keep = nullptr;
    (void)keep;
    switch (c.bad) {
        case GemmBad::kLdaNot16Bytes:
            lda = round_up(k, 8) + 1 + 2 * (k % 3);  // odd: never a multiple of 8 elements
            break;
        case GemmBad::kLddNot16Bytes:
            ldd = round_up(n, 8) + (td == DType::kF32 ? 1 : 3);
            break;
        case GemmBad::kLdbNot16Bytes:
            ldb = round_up(c.layout == BLayout::kNK ? k : n, 8) + 5;
            break;
        case GemmBad::kBaseNot16Bytes:
            pa = base + 2 * (1 + (m % 7));  // 2..14 bytes past a 16-byte boundary
            break;
        case GemmBad::kKNotMultipleOf8:
            k = b_k = 8 * std::max<int64_t>(1, k / 8) + 1 + (m % 7);
            lda = round_up(k, 8);
            if (c.layout == BLayout::kNK) ldb = round_up(k, 8);
            break;
        case GemmBad::kBDtypeDiffers:
            tb = ta == DType::kBF16 ? DType::kF16 : DType::kBF16;
            break;
        case GemmBad::kDDtypeWrong:
            td = ta == DType::kBF16 ? DType::kF16 : DType::kBF16;
            break;
        case GemmBad::kInputF32:
            ta = tb = DType::kF32;
            td = DType::kF32;
            break;
        case GemmBad::kBKMismatch:
            b_k = k + 8;
            if (c.layout == BLayout::kNK) ldb = round_up(b_k, 8);
            break;
        case GemmBad::kDShapeMismatch:
            (m % 2 ? d_rows : d_cols) += 1 + (n % 5);
            ldd = round_up(d_cols, 8);
            break;
        case GemmBad::kDOverlapsA:
            pd = base + 16 * (n % 4);
            ta = tb = td = DType::kBF16;
            ldd = lda;
            d_cols = std::min(n, k);
            n = d_cols;
            break;
        case GemmBad::kNot2D:
            a_override = TensorView(pa, ta, {1, m, k});
            break;
        case GemmBad::kInnerStride:
            a_override = TensorView(pa, ta, {m, k}, {2 * lda, 2});
            break;
        case GemmBad::kNullData:
            pa = nullptr;
            break;
        case GemmBad::kSplitKRange:
            o.split_k = m % 2 ? 17 : -1;
            break;
        case GemmBad::kSmBudgetNegative:
            o.sm_budget = -1 - static_cast<int>(m % 5);
            break;
        case GemmBad::kSmallMMaxRange:
            o.small_m_max_m = m % 2 ? 65 : -1;
            break;
        case GemmBad::kWgmmaMaxRange:
            o.small_m_wgmma_max_m = m % 2 ? 257 : -1;
            break;
        case GemmBad::kVariant5TooManyRows:
            o.small_m_variant = GemvVariant::kTmaWgmma;
            o.allow_small_m = true;
            m = d_rows = 257 + (n % 100);
            break;
        case GemmBad::kVariant5WithKN:
            o.small_m_variant = GemvVariant::kTmaWgmma;
            o.allow_small_m = true;
            o.small_m_max_m = 64;
            m = d_rows = std::min<int64_t>(m, 64);
            if (c.layout == BLayout::kNK) return "";  // the layout the draw gave is the valid one: nothing to check
            break;
        case GemmBad::kVariant4Unservable:
            if (c.layout == BLayout::kKN) return "";  // B [K,N] never takes the small-M path: a valid call
            o.small_m_variant = GemvVariant::kBulkRows;
            o.allow_small_m = true;
            o.small_m_max_m = 64;
            m = d_rows = std::min<int64_t>(m, 16);
            k = b_k = 8 * (1 + (n % 200));  // never a multiple of 2048
            if (k % 2048 == 0) k = b_k = k + 8;
            lda = round_up(k, 8);
            ldb = round_up(c.layout == BLayout::kNK ? k : n, 8);
            break;
        case GemmBad::kConfigDtypeMismatch: {
            GemmConfig cfg = ops::gemm_candidate_configs(DType::kBF16, DType::kBF16, BLayout::kNK).front();
            cfg.out_dtype = td == DType::kF32 ? DType::kBF16 : DType::kF32;
            cfg.in_dtype = ta;
            cfg.b_layout = c.layout;
            o.config = cfg;
            break;
        }
        case GemmBad::kWorkspaceMisaligned:
            o.workspace = base + 2 * region + region / 2 + 16;
            o.workspace_bytes = 4096;
            break;
        case GemmBad::kTimeoutNegative:
            o.timeout = std::chrono::milliseconds(-5);
            break;
        default:
            return "no such invalid kind";
    }
    const int64_t bk_rows = c.layout == BLayout::kNK ? n : b_k;
    const int64_t bk_cols = c.layout == BLayout::kNK ? b_k : n;
    const TensorView a = a_override ? *a_override : view2(pa, ta, m, k, lda);
    const TensorView b = view2(pb, tb, bk_rows, bk_cols, ldb);
    const TensorView d = view2(pd, td, d_rows, d_cols, ldd);
    if (!cuda_ok(cudaStreamSynchronize(stream), &why, "poison")) return why;
    try {
        ops::gemm(a, b, d, c.layout, stream, o);
        cudaStreamSynchronize(stream);
        return "the call accepted it (no weft::Error)";
    } catch (const Error& e) {
        if (std::string(e.what()).empty()) return "weft::Error with an empty message";
    } catch (const std::exception& e) {
        return std::string("threw a non-weft exception: ") + e.what();
    }
    if (!cuda_ok(cudaStreamSynchronize(stream), &why, "after the refused call")) return why;
    if (!cuda_ok(cudaGetLastError(), &why, "after the refused call")) return why;
    if (c.bad != GemmBad::kDOverlapsA) {
        std::vector<uint8_t> dd(region);
        if (!cuda_ok(cudaMemcpy(dd.data(), base + 2 * region, region, cudaMemcpyDeviceToHost), &why, "download")) {
            return why;
        }
        if (!poison_intact(dd.data(), dd.size())) return "a refused call wrote into d";
    }
    return "";
}

/// A valid case: returns "" or what went wrong; *fatal when the CUDA context may be unusable.
std::string run_valid_gemm(const GemmCase& c, Rng& r, Cublas& cublas, cudaStream_t stream, bool* fatal) {
    const int64_t ein = dtype_bytes(c.in), eout = dtype_bytes(c.out);
    Host16 a(c.m, c.k, c.lda, c.in), b(b_rows(c), b_cols(c), c.ldb, c.in);
    {
        const ValuePool pool(r, c.in, std::max<int64_t>(c.k, c.n));
        a.fill(pool, r);
        b.fill(pool, r);
    }
    const size_t a_bytes = static_cast<size_t>(c.off_a) + a.bytes();
    const size_t b_bytes = static_cast<size_t>(c.off_b) + b.bytes();
    const size_t d_bytes = static_cast<size_t>(c.off_d + c.m * c.ldd * eout + 256);  // 256 guard bytes after D
    DeviceBuffer da(a_bytes), db(b_bytes), dd(d_bytes), dref(static_cast<size_t>(std::max<int64_t>(1, c.m * c.n) * 4));
    if (!da.ptr || !db.ptr || !dd.ptr || !dref.ptr) return "cudaMalloc failed";
    auto* pa = static_cast<uint8_t*>(da.ptr) + c.off_a;
    auto* pb = static_cast<uint8_t*>(db.ptr) + c.off_b;
    auto* pd = static_cast<uint8_t*>(dd.ptr) + c.off_d;
    std::string why;
    if (!cuda_ok(cudaMemcpyAsync(pa, a.bits.data(), a.bytes(), cudaMemcpyHostToDevice, stream), &why, "upload a") ||
        !cuda_ok(cudaMemcpyAsync(pb, b.bits.data(), b.bytes(), cudaMemcpyHostToDevice, stream), &why, "upload b") ||
        !cuda_ok(cudaMemsetAsync(dd.ptr, 0xFF, d_bytes, stream), &why, "poison d")) {
        return why;
    }
    ops::GemmOptions o = gemm_options(c);
    const TensorView va = view2(pa, c.in, c.m, c.k, c.lda);
    const TensorView vb = view2(pb, c.in, b_rows(c), b_cols(c), c.ldb);
    const TensorView vd = view2(pd, c.out, c.m, c.n, c.ldd);
    std::unique_ptr<DeviceBuffer> ws;
    if (c.own_workspace && c.m > 0 && c.n > 0) {
        size_t bytes = 0;
        try {
            bytes = ops::select_gemm(va, vb, vd, c.layout, stream, o).plan.workspace_bytes;
        } catch (const std::exception& e) {
            return std::string("select_gemm refused a valid call: ") + e.what();
        }
        ws = std::make_unique<DeviceBuffer>(std::max<size_t>(bytes, 256));
        if (!ws->ptr) return "cudaMalloc failed (workspace)";
        if (!cuda_ok(cudaMemsetAsync(ws->ptr, 0, ws->bytes, stream), &why, "zero the workspace")) return why;
        o.workspace = ws->ptr;
        o.workspace_bytes = ws->bytes;
    }
    try {
        ops::gemm(va, vb, vd, c.layout, stream, o);
    } catch (const std::exception& e) {
        return std::string("the op refused a valid call: ") + e.what();
    }
    if (!cuda_ok(cudaStreamSynchronize(stream), &why, "the op's kernel")) {
        *fatal = true;
        return why;
    }
    const bool have_ref = cublas.gemm(c.in, pa, c.lda, pb, c.ldb, c.layout, c.m, c.n, c.k,
                                      static_cast<float*>(dref.ptr), c.n, stream, &why);
    if (have_ref && !cuda_ok(cudaStreamSynchronize(stream), &why, "cuBLASLt")) {
        *fatal = true;
        return why;
    }
    std::vector<uint8_t> got(d_bytes);
    std::vector<float> ref(have_ref ? static_cast<size_t>(c.m * c.n) : 0);
    if (!cuda_ok(cudaMemcpy(got.data(), dd.ptr, d_bytes, cudaMemcpyDeviceToHost), &why, "download d")) return why;
    if (have_ref && !ref.empty() &&
        !cuda_ok(cudaMemcpy(ref.data(), dref.ptr, ref.size() * 4, cudaMemcpyDeviceToHost), &why, "download ref")) {
        return why;
    }
    // Bytes outside [M, N]: before D, each row's padding, after the last row.
    const uint8_t* g = got.data() + c.off_d;
    if (!poison_intact(got.data(), static_cast<size_t>(c.off_d))) return "wrote before d's first element";
    for (int64_t row = 0; row < c.m; ++row) {
        if (!poison_intact(g + (row * c.ldd + c.n) * eout, static_cast<size_t>((c.ldd - c.n) * eout))) {
            return "wrote into the row padding past N of row " + std::to_string(row);
        }
    }
    if (!poison_intact(g + c.m * c.ldd * eout, 256)) return "wrote past d's last row";
    if (c.m == 0 || c.n == 0) return "";
    GemmCompare cmp(c.out);
    const double rms = std::sqrt(static_cast<double>(c.k) / 9.0);  // of a dot product of K values uniform in [-1, 1)
    if (have_ref) {
        for (int64_t row = 0; row < c.m; ++row) {
            for (int64_t col = 0; col < c.n; ++col) {
                cmp.expect(read_elem(g + (row * c.ldd + col) * eout, c.out), ref[static_cast<size_t>(row * c.n + col)],
                           rms, "vs cuBLASLt", 0, row, col);
            }
        }
    } else {
        std::printf("[ fuzz     ] %s; fp64 samples only\n", why.c_str());
    }
    // fp64 on the corners and sampled elements (every element when the work is small).
    const bool all = c.m * c.n * c.k <= (int64_t{1} << 21);
    std::vector<std::pair<int64_t, int64_t>> at = {{0, 0}, {0, c.n - 1}, {c.m - 1, 0}, {c.m - 1, c.n - 1}};
    if (all) {
        at.clear();
        for (int64_t row = 0; row < c.m; ++row)
            for (int64_t col = 0; col < c.n; ++col) at.emplace_back(row, col);
    } else {
        const int64_t samples = std::clamp<int64_t>((int64_t{1} << 22) / c.k, 16, 256);
        for (int64_t s = 0; s < samples; ++s) at.emplace_back(r.uniform(0, c.m - 1), r.uniform(0, c.n - 1));
    }
    for (const auto& [row, col] : at) {
        cmp.expect(read_elem(g + (row * c.ldd + col) * eout, c.out), dot64(a, row, b, 0, c.layout, col, c.k), rms,
                   "vs fp64", 0, row, col);
    }
    (void)ein;
    return cmp.ok() ? "" : cmp.report();
}

/// The kernel a valid case's planner picks (`key()`), for the budget; a planner that refuses fails attempt `attempt` of
/// case `idx` (no case this time).
template <class Case>
DrawKernel planned_kernel(FuzzRun& run, const Case& c, int64_t idx, int attempt,
                          const std::function<std::string()>& key) {
    try {
        return {key()};
    } catch (const std::exception& e) {
        run.fail(idx, attempt, describe(c), std::string("the planner refused a valid call: ") + e.what());
        return {std::nullopt, true};
    }
}

TEST_F(GpuFuzz, Gemm) {
    FuzzRun run("Gemm", 15, 2000, 8);
    const int sms = gemm_test::num_sms();
    Cublas cublas;
    fuzz_one_gpu<GemmCase>(run, {[sms](Rng& r) { return draw_gemm(r, sms); },
                                 [&](const GemmCase& c, int64_t idx, int attempt) -> DrawKernel {
                                     if (c.bad != GemmBad::kNone) return {};
                                     return planned_kernel(run, c, idx, attempt,
                                                           [&] { return gemm_kernel_key(c, gemm_options(c), sms); });
                                 },
                                 [](const GemmCase& c) { return c.bad != GemmBad::kNone; },
                                 [&](const GemmCase& c, Rng& r, cudaStream_t stream, bool* fatal) {
                                     return c.bad != GemmBad::kNone ? run_invalid_gemm(c, stream)
                                                                    : run_valid_gemm(c, r, cublas, stream, fatal);
                                 }});
}

// ---- GpuFuzz.GroupedGemm -----------------------------------------------------------------------------------------

enum class GroupedKind { kContiguous, kMasked, kMaskedFp8 };

enum class GroupedBad {
    kNone,
    kKNotMultipleOf8,
    kBDtypeDiffers,
    kDDtypeWrong,
    kMaskedNotBackToBack,
    kGroupsMismatch,
    kNullCounts,
    kNullOffsets,
    kDShapeMismatch,
    kStrideNot16Bytes,
    kDOverlapsA,
    kFp8KNotMultipleOf128,
    kFp8ScalesShape,
    kCount
};

const char* grouped_bad_name(GroupedBad b) {
    static const char* const kNames[] = {"none",
                                         "k_not_multiple_of_8",
                                         "b_dtype_differs",
                                         "d_dtype_wrong",
                                         "masked_not_back_to_back",
                                         "groups_mismatch",
                                         "null_counts",
                                         "null_offsets",
                                         "d_shape_mismatch",
                                         "stride_not_16B",
                                         "d_overlaps_a",
                                         "fp8_k_not_multiple_of_128",
                                         "fp8_scales_shape"};
    return kNames[static_cast<int>(b)];
}

struct GroupedCase {
    GroupedKind kind = GroupedKind::kContiguous;
    DType in = DType::kBF16, out = DType::kBF16;
    BLayout layout = BLayout::kNK;
    int64_t n = 0, k = 0;
    int64_t lda = 0, ldb = 0, ldd = 0;
    std::vector<int32_t> counts;   // as given to the op (masked: may pass the capacity or be negative: clamped)
    std::vector<int32_t> offsets;  // contiguous
    int64_t rows = 0;              // contiguous: rows of A and D
    int64_t capacity = 0;          // masked
    int64_t alignment = 1;
    bool shuffled = false;  // contiguous: groups placed in a random order
    int sm_budget = 0;
    int64_t rows_hint = 0;  // GroupedGemmOptions::expected_rows_per_group
    bool status = false;
    const char* pattern = "";
    GroupedBad bad = GroupedBad::kNone;
};

std::string describe(const GroupedCase& c) {
    std::ostringstream os;
    os << (c.kind == GroupedKind::kContiguous ? "contiguous"
           : c.kind == GroupedKind::kMasked   ? "masked"
                                              : "masked_fp8")
       << " G=" << c.counts.size() << " n=" << c.n << " k=" << c.k << " in=" << dtype_name(c.in)
       << " out=" << dtype_name(c.out) << " b=" << (c.layout == BLayout::kNK ? "NK" : "KN") << " lda=" << c.lda
       << " ldb=" << c.ldb << " ldd=" << c.ldd << " rows=" << c.rows << " capacity=" << c.capacity
       << " alignment=" << c.alignment << " shuffled=" << c.shuffled << " sm_budget=" << c.sm_budget
       << " rows_hint=" << c.rows_hint << " status=" << c.status << " pattern=" << c.pattern
       << " invalid=" << grouped_bad_name(c.bad) << " counts=[";
    for (size_t g = 0; g < c.counts.size(); ++g) os << (g ? "," : "") << c.counts[g];
    os << "]";
    if (c.kind == GroupedKind::kContiguous) {
        os << " offsets=[";
        for (size_t g = 0; g < c.offsets.size(); ++g) os << (g ? "," : "") << c.offsets[g];
        os << "]";
    }
    return os.str();
}

/// Rows of group g the kernel computes: masked counts clamped to [0, capacity].
int64_t valid_rows(const GroupedCase& c, size_t g) {
    const int64_t v = std::max<int32_t>(c.counts[g], 0);
    return c.kind == GroupedKind::kContiguous ? v : std::min(v, c.capacity);
}
int64_t first_row(const GroupedCase& c, size_t g) {
    return c.kind == GroupedKind::kContiguous ? c.offsets[g] : static_cast<int64_t>(g) * c.capacity;
}

GroupedCase draw_grouped(Rng& r) {
    GroupedCase c;
    const double kind = r.real(0, 1);
    c.kind = kind < 0.45 ? GroupedKind::kContiguous : kind < 0.85 ? GroupedKind::kMasked : GroupedKind::kMaskedFp8;
    c.in = c.kind == GroupedKind::kMaskedFp8 || r.chance(0.6) ? DType::kBF16 : DType::kF16;
    c.out = r.chance(0.5) ? c.in : DType::kF32;
    c.layout = r.chance(0.35) ? BLayout::kKN : BLayout::kNK;
    const int64_t groups = r.chance(0.3) ? r.uniform(1, 4) : r.uniform(1, 64);
    c.n = r.chance(0.25) ? r.uniform(1, 40) : r.uniform(8, 1024);
    if (r.chance(0.3)) c.n = round_up(c.n, 64);
    c.k = c.kind == GroupedKind::kMaskedFp8 ? 128 * r.uniform(1, 8) : 8 * r.uniform(1, 128);
    const int64_t ein = dtype_bytes(c.in);
    c.lda = c.kind == GroupedKind::kMaskedFp8 ? c.k : draw_ld(r, c.k, ein);  // fp8: a_bf16 is [G, capacity, K] dense
    c.ldb = draw_ld(r, c.layout == BLayout::kNK ? c.k : c.n, ein);
    c.ldd = draw_ld(r, c.n, dtype_bytes(c.out));
    // Rows in all: bounded so that the host's fp64 samples and the byte checks stay cheap.
    const int64_t max_rows = std::clamp<int64_t>((int64_t{1} << 27) / (c.n * c.k), 16, 4096);
    const int64_t per_group = std::max<int64_t>(1, max_rows / groups);
    const int64_t cap =
        c.kind == GroupedKind::kContiguous ? per_group : r.uniform(1, std::min<int64_t>(per_group, 300));
    if (c.kind != GroupedKind::kContiguous) c.capacity = cap;
    c.counts.assign(static_cast<size_t>(groups), 0);
    const int pattern = static_cast<int>(r.uniform(0, 5));
    static const char* const kPatterns[] = {"uniform", "skewed", "one_hot", "all_full", "all_empty", "tiny"};
    c.pattern = kPatterns[pattern];
    for (auto& n : c.counts) {
        switch (pattern) {
            case 0:
                n = static_cast<int32_t>(r.uniform(0, cap));
                break;
            case 1:
                n = static_cast<int32_t>(r.chance(0.2) ? cap : r.uniform(0, 4));
                break;
            case 3:
                n = static_cast<int32_t>(cap);
                break;
            case 5:
                n = static_cast<int32_t>(r.uniform(0, std::min<int64_t>(cap, 3)));
                break;
            default:
                break;
        }
    }
    if (pattern == 2) c.counts[static_cast<size_t>(r.uniform(0, groups - 1))] = static_cast<int32_t>(cap);
    if (c.kind == GroupedKind::kContiguous) {
        c.alignment = r.pick<int64_t>({1, 1, 8, 16, 64, 128, 3});
        c.shuffled = r.chance(0.3);
        std::vector<size_t> order(static_cast<size_t>(groups));
        for (size_t g = 0; g < order.size(); ++g) order[g] = g;
        if (c.shuffled) {
            for (size_t g = order.size(); g > 1; --g) std::swap(order[g - 1], order[static_cast<size_t>(r.next() % g)]);
        }
        c.offsets.assign(static_cast<size_t>(groups), 0);
        int64_t row = 0;
        for (size_t g : order) {
            if (r.chance(0.2)) row += r.uniform(1, 20);  // a gap the kernel must leave alone
            row = round_up(row, c.alignment);
            c.offsets[g] = static_cast<int32_t>(row);
            row += c.counts[g];
        }
        c.rows = row + (r.chance(0.5) ? r.uniform(0, 40) : 0);
    } else if (r.chance(0.1)) {  // counts outside [0, capacity]: clamped and recorded (documented)
        const size_t g = static_cast<size_t>(r.uniform(0, groups - 1));
        c.counts[g] =
            r.chance(0.5) ? static_cast<int32_t>(cap + r.uniform(1, 1000)) : -static_cast<int32_t>(r.uniform(1, 50));
        c.pattern = "clamped";
        c.status = true;
    }
    if (r.chance(0.25)) c.sm_budget = static_cast<int>(r.uniform(1, 16));
    if (r.chance(0.2)) c.rows_hint = r.uniform(1, std::max<int64_t>(1, cap));
    if (!c.status) c.status = r.chance(0.3);
    if (r.chance(0.1)) {
        c.bad = static_cast<GroupedBad>(r.uniform(1, static_cast<int>(GroupedBad::kCount) - 1));
        // Each kind within the layout it concerns.
        if (c.bad == GroupedBad::kNullOffsets) c.kind = GroupedKind::kContiguous;
        if (c.bad == GroupedBad::kMaskedNotBackToBack && c.kind == GroupedKind::kContiguous)
            c.kind = GroupedKind::kMasked;
        if (c.bad == GroupedBad::kGroupsMismatch && c.kind == GroupedKind::kContiguous) c.kind = GroupedKind::kMasked;
        if (c.bad == GroupedBad::kFp8KNotMultipleOf128 || c.bad == GroupedBad::kFp8ScalesShape) {
            c.kind = GroupedKind::kMaskedFp8;
            c.in = DType::kBF16;
            c.out = c.out == DType::kF32 ? DType::kF32 : DType::kBF16;
            c.k = round_up(c.k, 128);
            c.lda = c.k;
            c.ldb = draw_ld(r, c.layout == BLayout::kNK ? c.k : c.n, 2);
        }
        if (c.kind != GroupedKind::kContiguous && c.capacity == 0) c.capacity = 8;
        if (c.kind == GroupedKind::kContiguous && c.offsets.empty()) {
            c.offsets.assign(c.counts.size(), 0);
            c.rows = 0;
        }
    }
    return c;
}

ops::GroupedGemmOptions grouped_options(const GroupedCase& c) {
    ops::GroupedGemmOptions o;
    o.sm_budget = c.sm_budget;
    o.expected_rows_per_group = c.rows_hint;
    return o;
}

std::string grouped_kernel_key(const GroupedCase& c, int sms) {
    const int64_t groups = static_cast<int64_t>(c.counts.size());
    const bool masked = c.kind != GroupedKind::kContiguous;
    auto* base = reinterpret_cast<uint8_t*>(uintptr_t{1} << 44);
    const int64_t a_rows = masked ? groups * c.capacity : c.rows;
    const TensorView a = masked ? TensorView(base, c.in, {groups, c.capacity, c.k}, {c.capacity * c.lda, c.lda, 1})
                                : TensorView(base, c.in, {a_rows, c.k}, {c.lda, 1});
    const int64_t b1 = c.layout == BLayout::kNK ? c.n : c.k, b2 = c.layout == BLayout::kNK ? c.k : c.n;
    const TensorView b(base + (int64_t{1} << 38), c.in, {groups, b1, b2}, {b1 * c.ldb, c.ldb, 1});
    const TensorView d =
        masked ? TensorView(base + (int64_t{2} << 38), c.out, {groups, c.capacity, c.n}, {c.capacity * c.ldd, c.ldd, 1})
               : TensorView(base + (int64_t{2} << 38), c.out, {a_rows, c.n}, {c.ldd, 1});
    const auto* arrays = reinterpret_cast<const int32_t*>(base + (int64_t{3} << 38));
    const ops::GroupedGemmProblem p = ops::validate_grouped_gemm_args(
        masked ? ops::GroupedLayout::kMasked : ops::GroupedLayout::kContiguous, a, b, d, c.layout, arrays, arrays);
    return ops::format_gemm_config(ops::plan_grouped_gemm(p, sms, grouped_options(c)).config) +
           (c.kind == GroupedKind::kMaskedFp8 ? " +fp8 dequant" : "");
}

/// fp8 e4m3 code's value (no NaN codes are drawn).
float e4m3_value(uint8_t code) {
    const int sign = code >> 7, exp = (code >> 3) & 15, man = code & 7;
    const float mag = exp == 0 ? std::ldexp(static_cast<float>(man) / 8.0f, -6)
                               : std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
    return sign ? -mag : mag;
}

/// Runs one grouped case (valid or not); returns "" or what went wrong.
std::string run_grouped(const GroupedCase& c, Rng& r, Cublas& cublas, cudaStream_t stream, bool* fatal) {
    const int64_t groups = static_cast<int64_t>(c.counts.size());
    const bool masked = c.kind != GroupedKind::kContiguous;
    const bool fp8 = c.kind == GroupedKind::kMaskedFp8;
    const int64_t rows = masked ? groups * c.capacity : c.rows;  // of A and D as 2-D
    const int64_t ein = dtype_bytes(c.in), eout = dtype_bytes(c.out);
    const int64_t b1 = c.layout == BLayout::kNK ? c.n : c.k, b2 = c.layout == BLayout::kNK ? c.k : c.n;
    Host16 a(rows, c.k, c.lda, c.in), b(groups * b1, b2, c.ldb, c.in);
    std::vector<uint8_t> codes;
    std::vector<float> scales;
    {
        const ValuePool pool(r, c.in, std::max<int64_t>(c.k, c.n));
        b.fill(pool, r);
        if (!fp8) {
            a.fill(pool, r);
        } else {  // codes and scales; A is their dequantisation, rounded once to bf16
            codes.resize(static_cast<size_t>(rows * c.k));
            scales.resize(static_cast<size_t>(rows * (c.k / 128)));
            for (auto& x : codes) {
                x = static_cast<uint8_t>(r.next());
                if ((x & 0x7F) == 0x7F) x = 0;
            }
            for (auto& s : scales) s = static_cast<float>(r.real(1e-3, 1e-1));
            for (int64_t row = 0; row < rows; ++row) {
                for (int64_t kk = 0; kk < c.k; ++kk) {
                    const float v = e4m3_value(codes[static_cast<size_t>(row * c.k + kk)]) *
                                    scales[static_cast<size_t>(row * (c.k / 128) + kk / 128)];
                    a.bits[static_cast<size_t>(row * c.lda + kk)] = tp_test::float_to_bits(DType::kBF16, v);
                }
            }
        }
    }
    const size_t d_bytes = static_cast<size_t>(std::max<int64_t>(rows, 1) * c.ldd * eout + 256);
    DeviceBuffer da(a.bytes()), db(b.bytes()), dd(d_bytes), dcounts(static_cast<size_t>(groups) * 4 + 16),
        doffsets(static_cast<size_t>(groups) * 4 + 16), dcodes(std::max<size_t>(codes.size(), 16)),
        dscales(std::max<size_t>(scales.size() * 4, 16)),
        dref(static_cast<size_t>(std::max<int64_t>(rows * c.n, 1)) * 4), da_ref(fp8 ? a.bytes() : 16);
    if (!da.ptr || !db.ptr || !dd.ptr || !dcounts.ptr || !doffsets.ptr || !dcodes.ptr || !dscales.ptr || !dref.ptr ||
        !da_ref.ptr) {
        return "cudaMalloc failed";
    }
    std::string why;
    const bool uploaded =
        cuda_ok(cudaMemcpyAsync(db.ptr, b.bits.data(), b.bytes(), cudaMemcpyHostToDevice, stream), &why, "upload b") &&
        cuda_ok(cudaMemcpyAsync(dcounts.ptr, c.counts.data(), c.counts.size() * 4, cudaMemcpyHostToDevice, stream),
                &why, "upload counts") &&
        (masked ||
         cuda_ok(cudaMemcpyAsync(doffsets.ptr, c.offsets.data(), c.offsets.size() * 4, cudaMemcpyHostToDevice, stream),
                 &why, "upload offsets")) &&
        cuda_ok(cudaMemsetAsync(dd.ptr, 0xFF, d_bytes, stream), &why, "poison d") &&
        (fp8 ? cuda_ok(cudaMemcpyAsync(dcodes.ptr, codes.data(), codes.size(), cudaMemcpyHostToDevice, stream), &why,
                       "upload codes") &&
                   cuda_ok(
                       cudaMemcpyAsync(dscales.ptr, scales.data(), scales.size() * 4, cudaMemcpyHostToDevice, stream),
                       &why, "upload scales") &&
                   cuda_ok(cudaMemsetAsync(da.ptr, 0xFF, a.bytes(), stream), &why, "poison a_bf16") &&
                   cuda_ok(cudaMemcpyAsync(da_ref.ptr, a.bits.data(), a.bytes(), cudaMemcpyHostToDevice, stream), &why,
                           "upload a_ref")
             : cuda_ok(cudaMemcpyAsync(da.ptr, a.bits.data(), a.bytes(), cudaMemcpyHostToDevice, stream), &why,
                       "upload a"));
    if (!uploaded) return why;

    // The views, then the mutation of an invalid case.
    DType ta = c.in, tb = c.in, td = c.out;
    int64_t k = c.k, lda = c.lda, ldd = c.ldd, cap = c.capacity, d_rows = rows, b_groups = groups;
    int64_t a_group_stride = c.capacity * lda;
    const int32_t* counts = static_cast<const int32_t*>(dcounts.ptr);
    const int32_t* offsets = static_cast<const int32_t*>(doffsets.ptr);
    void* pd = dd.ptr;
    int64_t scale_cols = c.k / 128;
    switch (c.bad) {
        case GroupedBad::kNone:
            break;
        case GroupedBad::kKNotMultipleOf8:
            k = c.k - 1 - (c.k % 5 == 0 ? 1 : 0);  // a's view narrower than b's K, and not a multiple of 8
            break;
        case GroupedBad::kBDtypeDiffers:
            tb = ta == DType::kBF16 ? DType::kF16 : DType::kBF16;
            break;
        case GroupedBad::kDDtypeWrong:
            td = ta == DType::kBF16 ? DType::kF16 : DType::kBF16;
            break;
        case GroupedBad::kMaskedNotBackToBack:
            if (groups < 2) return "";  // one group has no group stride to get wrong
            a_group_stride += 8 * (16 / ein);
            break;
        case GroupedBad::kGroupsMismatch:
            b_groups = groups - 1;
            break;
        case GroupedBad::kNullCounts:
            counts = nullptr;
            break;
        case GroupedBad::kNullOffsets:
            offsets = nullptr;
            break;
        case GroupedBad::kDShapeMismatch:
            d_rows = rows > 1 ? rows - 1 : 2;
            if (masked) cap = c.capacity + 1;
            break;
        case GroupedBad::kStrideNot16Bytes:
            if (rows < 2) return "";  // a single row has no row stride to get wrong
            ldd = c.ldd + (td == DType::kF32 ? 1 : 3);
            break;
        case GroupedBad::kDOverlapsA:
            if (rows == 0) return "";  // empty views overlap nothing
            pd = da.ptr;
            td = ta;
            ldd = lda;
            break;
        case GroupedBad::kFp8KNotMultipleOf128:
            k = c.k - 8;
            break;
        case GroupedBad::kFp8ScalesShape:
            scale_cols = c.k / 128 + 1;
            break;
        default:
            return "no such invalid kind";
    }
    const TensorView va = masked ? TensorView(da.ptr, ta, {groups, c.capacity, k}, {a_group_stride, lda, 1})
                                 : TensorView(da.ptr, ta, {rows, k}, {lda, 1});
    const TensorView vb(db.ptr, tb, {b_groups, b1, b2 == c.k ? k : b2}, {b1 * c.ldb, c.ldb, 1});
    const TensorView vd = masked ? TensorView(pd, td, {groups, cap, c.n}, {c.capacity * ldd, ldd, 1})
                                 : TensorView(pd, td, {d_rows, c.n}, {ldd, 1});
    ops::GroupedGemmOptions o = grouped_options(c);
    ops::GroupedStatus* status = nullptr;
    if (c.status) {
        if (!cuda_ok(cudaHostAlloc(reinterpret_cast<void**>(&status), sizeof(*status), cudaHostAllocMapped), &why,
                     "cudaHostAlloc")) {
            return why;
        }
        std::memset(status, 0, sizeof(*status));
        o.status = status;
    }
    const std::unique_ptr<ops::GroupedStatus, void (*)(ops::GroupedStatus*)> status_guard(status,
                                                                                          [](ops::GroupedStatus* p) {
                                                                                              if (p) cudaFreeHost(p);
                                                                                          });
    if (c.bad != GroupedBad::kNone && !cuda_ok(cudaStreamSynchronize(stream), &why, "uploads")) return why;
    try {
        if (fp8) {
            const TensorView vcodes(dcodes.ptr, DType::kF8E4M3, {groups, c.capacity, k});
            const TensorView vscales(dscales.ptr, DType::kF32, {groups, c.capacity, scale_cols});
            ops::grouped_gemm_masked_fp8(vcodes, vscales, vb, vd, c.layout, counts, va, stream, o);
        } else if (masked) {
            ops::grouped_gemm_masked(va, vb, vd, c.layout, counts, stream, o);
        } else {
            ops::grouped_gemm_contiguous(va, vb, vd, c.layout, offsets, counts, stream, o);
        }
        if (c.bad != GroupedBad::kNone) {
            cudaStreamSynchronize(stream);
            return "the call accepted it (no weft::Error)";
        }
    } catch (const Error& e) {
        if (c.bad == GroupedBad::kNone) return std::string("the op refused a valid call: ") + e.what();
        if (std::string(e.what()).empty()) return "weft::Error with an empty message";
    } catch (const std::exception& e) {
        return std::string("threw a non-weft exception: ") + e.what();
    }
    if (!cuda_ok(cudaStreamSynchronize(stream), &why, "the op's kernels")) {
        *fatal = true;
        return why;
    }
    std::vector<uint8_t> got(d_bytes);
    if (!cuda_ok(cudaMemcpy(got.data(), dd.ptr, d_bytes, cudaMemcpyDeviceToHost), &why, "download d")) return why;
    if (c.bad != GroupedBad::kNone) {
        if (c.bad != GroupedBad::kDOverlapsA && !poison_intact(got.data(), got.size())) return "a refused call wrote d";
        return "";
    }
    // The status record: zero for counts within bounds, the first bad group's otherwise.
    if (status) {
        int64_t first_bad = -1;
        for (size_t g = 0; g < c.counts.size() && first_bad < 0; ++g) {
            if (masked && (c.counts[g] < 0 || c.counts[g] > c.capacity)) first_bad = static_cast<int64_t>(g);
        }
        if (first_bad < 0 && status->code != 0) return "status recorded " + ops::describe_grouped_status(*status);
        if (first_bad >= 0 && (status->code == 0 || status->group != first_bad)) {
            return "status should name group " + std::to_string(first_bad) + ", got '" +
                   ops::describe_grouped_status(*status) + "'";
        }
    }
    // fp8: the dequantised rows of each group, bit for bit.
    if (fp8) {
        std::vector<uint16_t> deq(a.bits.size());
        if (!cuda_ok(cudaMemcpy(deq.data(), da.ptr, a.bytes(), cudaMemcpyDeviceToHost), &why, "download a_bf16")) {
            return why;
        }
        for (size_t g = 0; g < c.counts.size(); ++g) {
            for (int64_t row = first_row(c, g); row < first_row(c, g) + valid_rows(c, g); ++row) {
                for (int64_t kk = 0; kk < c.k; ++kk) {
                    const size_t at = static_cast<size_t>(row * c.lda + kk);
                    if (deq[at] != a.bits[at]) {
                        return "a_bf16 row " + std::to_string(row) + " col " + std::to_string(kk) + " holds " +
                               std::to_string(deq[at]) + ", the dequantised value is " + std::to_string(a.bits[at]);
                    }
                }
            }
        }
    }
    // Every row outside the groups keeps its poison; the groups' rows against cuBLASLt and fp64 samples.
    std::vector<char> in_group(static_cast<size_t>(rows), 0);
    for (size_t g = 0; g < c.counts.size(); ++g) {
        for (int64_t row = first_row(c, g); row < first_row(c, g) + valid_rows(c, g); ++row)
            in_group[static_cast<size_t>(row)] = 1;
    }
    for (int64_t row = 0; row < rows; ++row) {
        const uint8_t* p = got.data() + row * c.ldd * eout;
        const size_t from = in_group[static_cast<size_t>(row)] ? static_cast<size_t>(c.n * eout) : 0;
        if (!poison_intact(p + from, static_cast<size_t>(c.ldd * eout) - from)) {
            return std::string(from ? "wrote into the row padding past N" : "wrote a row outside every group") +
                   " (row " + std::to_string(row) + ")";
        }
    }
    if (!poison_intact(got.data() + rows * c.ldd * eout, 256)) return "wrote past d's last row";
    const void* a_for_ref = fp8 ? da_ref.ptr : da.ptr;
    bool have_ref = true;
    for (size_t g = 0; g < c.counts.size() && have_ref; ++g) {
        const int64_t first = first_row(c, g), count = valid_rows(c, g);
        if (count == 0) continue;
        have_ref =
            cublas.gemm(c.in, static_cast<const uint8_t*>(a_for_ref) + first * c.lda * ein, c.lda,
                        static_cast<const uint8_t*>(db.ptr) + static_cast<int64_t>(g) * b1 * c.ldb * ein, c.ldb,
                        c.layout, count, c.n, c.k, static_cast<float*>(dref.ptr) + first * c.n, c.n, stream, &why);
    }
    if (have_ref && !cuda_ok(cudaStreamSynchronize(stream), &why, "cuBLASLt")) {
        *fatal = true;
        return why;
    }
    std::vector<float> ref(have_ref ? static_cast<size_t>(rows * c.n) : 0);
    if (have_ref && !ref.empty() &&
        !cuda_ok(cudaMemcpy(ref.data(), dref.ptr, ref.size() * 4, cudaMemcpyDeviceToHost), &why, "download ref")) {
        return why;
    }
    if (!have_ref) std::printf("[ fuzz     ] %s; fp64 samples only\n", why.c_str());
    GemmCompare cmp(c.out);
    // The scale of a dot product: rms(A) x rms(B) x sqrt(K), rms(A) measured (fp8 rows span many magnitudes).
    double a_sq = 0;
    int64_t a_num = 0;
    for (int64_t row = 0; row < rows && a_num < 100000; ++row) {
        for (int64_t kk = 0; kk < c.k; ++kk, ++a_num) a_sq += static_cast<double>(a.at(row, kk)) * a.at(row, kk);
    }
    const double a_rms = a_num > 0 ? std::sqrt(a_sq / static_cast<double>(a_num)) : 1.0;
    const double rms = std::max(a_rms, 1e-3) * std::sqrt(static_cast<double>(c.k) / 3.0);
    int64_t samples = 0;
    const int64_t max_samples = std::clamp<int64_t>((int64_t{1} << 22) / c.k, 16, 512);
    for (size_t g = 0; g < c.counts.size(); ++g) {
        const int64_t first = first_row(c, g), count = valid_rows(c, g);
        for (int64_t row = first; row < first + count; ++row) {
            for (int64_t col = 0; col < c.n && have_ref; ++col) {
                cmp.expect(read_elem(got.data() + (row * c.ldd + col) * eout, c.out),
                           ref[static_cast<size_t>(row * c.n + col)], rms, "vs cuBLASLt", static_cast<int64_t>(g), row,
                           col);
            }
        }
        // fp64: the group's first and last rows at a random column, then random elements.
        for (int s = 0; s < 4 && count > 0 && samples < max_samples; ++s, ++samples) {
            const int64_t row = s % 2 ? first + count - 1 : first + r.uniform(0, count - 1);
            const int64_t col = r.uniform(0, c.n - 1);
            cmp.expect(read_elem(got.data() + (row * c.ldd + col) * eout, c.out),
                       dot64(a, row, b, static_cast<int64_t>(g) * b1, c.layout, col, c.k), rms, "vs fp64",
                       static_cast<int64_t>(g), row, col);
        }
    }
    return cmp.ok() ? "" : cmp.report();
}

TEST_F(GpuFuzz, GroupedGemm) {
    FuzzRun run("GroupedGemm", 15, 1000, 6);
    const int sms = gemm_test::num_sms();
    Cublas cublas;
    fuzz_one_gpu<GroupedCase>(run, {draw_grouped,
                                    [&](const GroupedCase& c, int64_t idx, int attempt) -> DrawKernel {
                                        if (c.bad != GroupedBad::kNone) return {};
                                        return planned_kernel(run, c, idx, attempt,
                                                              [&] { return grouped_kernel_key(c, sms); });
                                    },
                                    [](const GroupedCase& c) { return c.bad != GroupedBad::kNone; },
                                    [&](const GroupedCase& c, Rng& r, cudaStream_t stream, bool* fatal) {
                                        return run_grouped(c, r, cublas, stream, fatal);
                                    }});
}

// ---- GpuFuzz.DecodeAttention ----------------------------------------------------------------------------------

struct AttentionCase {
    DType dtype = DType::kBF16;
    int64_t dim = 128, kv_heads = 1, group = 1, page = 16, batch = 1;
    std::vector<int32_t> lens;  // as given (may pass max_seq_len or be negative: clipped)
    int64_t max_seq_len = 0, max_pages = 0, table_ld = 0;
    bool heads_slots = false;  // the [pages, heads, slots, dim] layout (a strided view)
    int64_t q_pad_head = 0, q_pad_batch = 0, page_pad = 0;
    std::optional<float> scale;
    int32_t num_splits = 0;
    bool want_lse = true, own_workspace = false, programmatic = false;
    float q_range = 2.f;
};

std::string describe(const AttentionCase& c) {
    std::ostringstream os;
    os << "dtype=" << dtype_name(c.dtype) << " dim=" << c.dim << " kv_heads=" << c.kv_heads << " group=" << c.group
       << " page=" << c.page << " batch=" << c.batch << " max_seq_len=" << c.max_seq_len << " max_pages=" << c.max_pages
       << " table_ld=" << c.table_ld << " layout=" << (c.heads_slots ? "heads-slots" : "slots-heads")
       << " q_pad=" << c.q_pad_head << "," << c.q_pad_batch << " page_pad=" << c.page_pad
       << " scale=" << (c.scale ? std::to_string(*c.scale) : "default") << " splits=" << c.num_splits
       << " lse=" << c.want_lse << " workspace=" << c.own_workspace << " programmatic=" << c.programmatic
       << " q_range=" << c.q_range << " lens=[";
    for (size_t b = 0; b < c.lens.size(); ++b) os << (b ? "," : "") << c.lens[b];
    os << "]";
    return os.str();
}

int64_t effective_len(const AttentionCase& c, size_t b) { return std::clamp<int64_t>(c.lens[b], 0, c.max_seq_len); }

AttentionCase draw_attention(Rng& r) {
    AttentionCase c;
    c.dtype = r.chance(0.5) ? DType::kBF16 : DType::kF16;
    c.dim = r.pick<int64_t>({64, 128, 256});
    c.kv_heads = r.chance(0.6) ? r.uniform(1, 2) : r.uniform(1, 8);
    c.group = r.chance(0.3) ? r.pick<int64_t>({1, 4, 8, 16}) : r.uniform(1, 16);
    c.page = r.chance(0.5) ? (int64_t{1} << r.uniform(0, 8)) : r.uniform(1, 256);
    c.batch = r.chance(0.02) ? 0 : r.chance(0.3) ? r.uniform(1, 4) : r.uniform(1, 64);
    // Tokens in all: the host's fp64 reference costs tokens x q-heads x dim x 2.
    const int64_t hq = c.kv_heads * c.group;
    const int64_t budget = std::max<int64_t>(64, 12'000'000 / (hq * c.dim));
    const int64_t longest = std::max<int64_t>(1, std::min<int64_t>(budget, r.chance(0.3) ? 40000 : 4000));
    for (int64_t b = 0; b < c.batch; ++b) {
        const double u = r.real(0, 1);
        int64_t len;
        if (u < 0.05) {
            len = 0;
        } else if (u < 0.15) {
            len = 1;
        } else if (u < 0.3) {
            len = std::max<int64_t>(0, c.page * r.uniform(1, 4) + r.uniform(-1, 1));
        } else {
            len = r.log_uniform(1, longest);
        }
        c.lens.push_back(static_cast<int32_t>(len));
    }
    for (;;) {  // keep the total within the budget
        int64_t total = 0;
        for (int32_t l : c.lens) total += l;
        if (total <= budget) break;
        auto it = std::max_element(c.lens.begin(), c.lens.end());
        *it /= 2;
    }
    const int64_t actual_longest = c.lens.empty() ? 0 : *std::max_element(c.lens.begin(), c.lens.end());
    c.max_seq_len = actual_longest + (r.chance(0.3) ? r.uniform(0, 300) : 0);
    if (!c.lens.empty() && r.chance(0.1)) {  // lengths outside [0, max_seq_len]: clipped (documented)
        const size_t b = static_cast<size_t>(r.uniform(0, c.batch - 1));
        c.lens[b] = r.chance(0.5) ? -static_cast<int32_t>(r.uniform(1, 9))
                                  : static_cast<int32_t>(c.max_seq_len + r.uniform(1, 5000));
    }
    c.max_pages = std::max<int64_t>(1, (c.max_seq_len + c.page - 1) / c.page + (r.chance(0.3) ? r.uniform(0, 3) : 0));
    c.table_ld = c.max_pages + (r.chance(0.3) ? r.uniform(1, 5) : 0);
    c.heads_slots = r.chance(0.3);
    if (r.chance(0.25)) c.q_pad_head = 8 * r.uniform(1, 4);
    if (r.chance(0.25)) c.q_pad_batch = 8 * r.uniform(1, 4);
    if (r.chance(0.25)) c.page_pad = 8 * r.uniform(1, 8);
    if (r.chance(0.25)) c.scale = static_cast<float>(r.real(0.5, 2.0) / std::sqrt(static_cast<double>(c.dim)));
    if (r.chance(0.25)) c.num_splits = static_cast<int32_t>(r.chance(0.8) ? r.uniform(1, 64) : r.uniform(65, 400));
    c.want_lse = r.chance(0.8);
    c.own_workspace = r.chance(0.25);
    c.programmatic = r.chance(0.15);
    c.q_range = static_cast<float>(r.pick<double>({0.25, 1.0, 2.0, 4.0}));
    return c;
}

std::string run_attention(const AttentionCase& c, Rng& r, cudaStream_t stream, bool* fatal) {
    const int64_t hq = c.kv_heads * c.group, hkv = c.kv_heads, d = c.dim, ps = c.page, batch = c.batch;
    int64_t used_pages = 0;
    for (size_t b = 0; b < c.lens.size(); ++b) used_pages += (effective_len(c, b) + ps - 1) / ps;
    const int64_t num_pages = used_pages + r.uniform(0, 3) + (c.max_seq_len > 0 && used_pages == 0 ? 1 : 0);
    std::vector<int32_t> order(static_cast<size_t>(num_pages));
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[static_cast<size_t>(r.next() % i)]);
    constexpr int32_t kPoisonPage = 1 << 30;  // table entries no token reads: far outside the cache
    std::vector<int32_t> table(static_cast<size_t>(std::max<int64_t>(1, batch * c.table_ld)), kPoisonPage);
    size_t next_page = 0;
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t i = 0; i < (effective_len(c, static_cast<size_t>(b)) + ps - 1) / ps; ++i) {
            table[static_cast<size_t>(b * c.table_ld + i)] = order[next_page++];
        }
    }
    // Cache strides (elements) of either layout; every slot starts as NaN.
    const int64_t page_stride = ps * hkv * d + c.page_pad;
    const int64_t slot_stride = c.heads_slots ? d : hkv * d;
    const int64_t head_stride = c.heads_slots ? ps * d : d;
    const uint16_t nan_bits = c.dtype == DType::kBF16 ? 0x7fc0 : 0x7e00;
    const size_t cache_elems = static_cast<size_t>(std::max<int64_t>(1, num_pages * page_stride));
    std::vector<uint16_t> kc(cache_elems, nan_bits), vc(cache_elems, nan_bits);
    auto at = [&](int64_t b, int64_t t, int64_t h) {
        const int64_t page = table[static_cast<size_t>(b * c.table_ld + t / ps)];
        return static_cast<size_t>(page * page_stride + (t % ps) * slot_stride + h * head_stride);
    };
    const ValuePool pool(r, c.dtype, d);
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t t = 0; t < effective_len(c, static_cast<size_t>(b)); ++t) {
            for (int64_t h = 0; h < hkv; ++h) {
                std::memcpy(kc.data() + at(b, t, h), pool.window(r), static_cast<size_t>(d) * 2);
                std::memcpy(vc.data() + at(b, t, h), pool.window(r), static_cast<size_t>(d) * 2);
            }
        }
    }
    const int64_t q_head_stride = d + c.q_pad_head, q_batch_stride = hq * q_head_stride + c.q_pad_batch;
    std::vector<uint16_t> q(static_cast<size_t>(std::max<int64_t>(1, batch * q_batch_stride)), nan_bits);
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t h = 0; h < hq; ++h) {
            for (int64_t e = 0; e < d; ++e) {
                q[static_cast<size_t>(b * q_batch_stride + h * q_head_stride + e)] =
                    tp_test::float_to_bits(c.dtype, static_cast<float>(r.real(-c.q_range, c.q_range)));
            }
        }
    }
    std::vector<int32_t> lens(c.lens.begin(), c.lens.end());
    const size_t out_elems = static_cast<size_t>(batch * hq * d), lse_elems = static_cast<size_t>(batch * hq);
    DeviceBuffer dq(q.size() * 2), dk(kc.size() * 2), dv(vc.size() * 2), dtable(table.size() * 4),
        dlens(std::max<size_t>(lens.size(), 1) * 4), dout(out_elems * 2 + 256), dlse(lse_elems * 4 + 256);
    if (!dq.ptr || !dk.ptr || !dv.ptr || !dtable.ptr || !dlens.ptr || !dout.ptr || !dlse.ptr)
        return "cudaMalloc failed";
    std::string why;
    if (!cuda_ok(cudaMemcpyAsync(dq.ptr, q.data(), q.size() * 2, cudaMemcpyHostToDevice, stream), &why, "upload q") ||
        !cuda_ok(cudaMemcpyAsync(dk.ptr, kc.data(), kc.size() * 2, cudaMemcpyHostToDevice, stream), &why, "upload k") ||
        !cuda_ok(cudaMemcpyAsync(dv.ptr, vc.data(), vc.size() * 2, cudaMemcpyHostToDevice, stream), &why, "upload v") ||
        !cuda_ok(cudaMemcpyAsync(dtable.ptr, table.data(), table.size() * 4, cudaMemcpyHostToDevice, stream), &why,
                 "upload table") ||
        !cuda_ok(cudaMemcpyAsync(dlens.ptr, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice, stream), &why,
                 "upload lens") ||
        !cuda_ok(cudaMemsetAsync(dout.ptr, 0xFF, out_elems * 2 + 256, stream), &why, "poison out") ||
        !cuda_ok(cudaMemsetAsync(dlse.ptr, 0xFF, lse_elems * 4 + 256, stream), &why, "poison lse")) {
        return why;
    }
    const TensorView tq(dq.ptr, c.dtype, {batch, hq, d}, {q_batch_stride, q_head_stride, 1});
    const TensorView tk(dk.ptr, c.dtype, {num_pages, ps, hkv, d}, {page_stride, slot_stride, head_stride, 1});
    const TensorView tv(dv.ptr, c.dtype, {num_pages, ps, hkv, d}, {page_stride, slot_stride, head_stride, 1});
    const TensorView ttable(dtable.ptr, DType::kI32, {batch, c.max_pages}, {c.table_ld, 1});
    const TensorView tlens(dlens.ptr, DType::kI32, {batch});
    const TensorView tout(dout.ptr, c.dtype, {batch, hq, d});
    const TensorView tlse = c.want_lse ? TensorView(dlse.ptr, DType::kF32, {batch, hq}) : TensorView();
    ops::DecodeAttentionOptions opt;
    opt.scale = c.scale;
    opt.num_splits = c.num_splits;
    opt.programmatic_launch = c.programmatic;
    std::unique_ptr<DeviceBuffer> ws;
    if (c.own_workspace) {
        const uint64_t bytes = ops::decode_attention_workspace_bytes(batch, hq, hkv, d, c.max_seq_len, opt);
        ws = std::make_unique<DeviceBuffer>(std::max<size_t>(bytes, 16));
        if (!ws->ptr) return "cudaMalloc failed (workspace)";
        if (!cuda_ok(cudaMemsetAsync(ws->ptr, 0xFF, ws->bytes, stream), &why, "poison the workspace")) return why;
        opt.workspace = TensorView(ws->ptr, DType::kU8, {static_cast<int64_t>(std::max<uint64_t>(bytes, 16))});
    }
    try {
        ops::decode_attention(tq, tk, tv, ttable, tlens, c.max_seq_len, tout, tlse, stream, opt);
    } catch (const std::exception& e) {
        return std::string("the op refused a valid call: ") + e.what();
    }
    if (!cuda_ok(cudaStreamSynchronize(stream), &why, "the op's kernels")) {
        *fatal = true;
        return why;
    }
    std::vector<uint16_t> out(out_elems + 128);
    std::vector<float> lse(lse_elems + 64);
    if (!cuda_ok(cudaMemcpy(out.data(), dout.ptr, out.size() * 2, cudaMemcpyDeviceToHost), &why, "download out") ||
        !cuda_ok(cudaMemcpy(lse.data(), dlse.ptr, lse.size() * 4, cudaMemcpyDeviceToHost), &why, "download lse")) {
        return why;
    }
    if (!poison_intact(reinterpret_cast<const uint8_t*>(out.data() + out_elems), 256)) return "wrote past out's end";
    if (!poison_intact(reinterpret_cast<const uint8_t*>(lse.data() + (c.want_lse ? lse_elems : 0)),
                       c.want_lse ? 256 : lse.size() * 4)) {
        return c.want_lse ? "wrote past lse's end" : "wrote lse though none was asked for";
    }
    // fp64 reference from the rounded inputs (the caches as floats once).
    std::vector<float> kf(kc.size()), vf(vc.size());
    for (size_t i = 0; i < kc.size(); ++i) {
        kf[i] = tp_test::bits_to_float(c.dtype, kc[i]);
        vf[i] = tp_test::bits_to_float(c.dtype, vc[i]);
    }
    const double scale = c.scale ? static_cast<double>(*c.scale) : 1.0 / std::sqrt(static_cast<double>(d));
    const double atol = c.dtype == DType::kBF16 ? 6e-3 : 1.5e-3;
    const double rtol = c.dtype == DType::kBF16 ? 1.6e-2 : 4e-3;
    std::vector<double> s, o(static_cast<size_t>(d)), qd(static_cast<size_t>(d));
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t len = effective_len(c, static_cast<size_t>(b));
        for (int64_t h = 0; h < hq; ++h) {
            const int64_t kvh = h / c.group;
            const size_t row = static_cast<size_t>(b * hq + h);
            for (int64_t e = 0; e < d; ++e) {
                qd[static_cast<size_t>(e)] =
                    tp_test::bits_to_float(c.dtype, q[static_cast<size_t>(b * q_batch_stride + h * q_head_stride + e)]);
            }
            s.assign(static_cast<size_t>(len), 0.0);
            double m = -INFINITY;
            for (int64_t t = 0; t < len; ++t) {
                const float* kr = kf.data() + at(b, t, kvh);
                double dot = 0;
                for (int64_t e = 0; e < d; ++e) dot += qd[static_cast<size_t>(e)] * kr[e];
                s[static_cast<size_t>(t)] = dot * scale;
                m = std::max(m, s[static_cast<size_t>(t)]);
            }
            double l = 0;
            std::fill(o.begin(), o.end(), 0.0);
            for (int64_t t = 0; t < len; ++t) {
                const double p = std::exp(s[static_cast<size_t>(t)] - m);
                l += p;
                const float* vr = vf.data() + at(b, t, kvh);
                for (int64_t e = 0; e < d; ++e) o[static_cast<size_t>(e)] += p * vr[e];
            }
            std::ostringstream where;
            where << "(batch " << b << ", q-head " << h << ", len " << len << ")";
            if (c.want_lse) {
                const double got = lse[row];
                if (len == 0 ? !(std::isinf(got) && got < 0)
                             : !(std::fabs(got - (m + std::log(l))) <= 2e-3 + 1e-5 * std::fabs(m + std::log(l)))) {
                    std::ostringstream os;
                    os << "lse " << where.str() << " = " << got << ", want "
                       << (len == 0 ? -INFINITY : m + std::log(l));
                    return os.str();
                }
            }
            for (int64_t e = 0; e < d; ++e) {
                const double want = len == 0 ? 0.0 : o[static_cast<size_t>(e)] / l;
                const double got =
                    tp_test::bits_to_float(c.dtype, out[row * static_cast<size_t>(d) + static_cast<size_t>(e)]);
                if (len == 0 ? got != 0.0 : !(std::fabs(got - want) <= atol + rtol * std::fabs(want))) {
                    std::ostringstream os;
                    os << "out " << where.str() << " dim " << e << " = " << got << ", want " << want;
                    return os.str();
                }
            }
        }
    }
    return "";
}

TEST_F(GpuFuzz, DecodeAttention) {
    FuzzRun run("DecodeAttention", 15, 1000, 4);
    fuzz_one_gpu<AttentionCase>(run, {draw_attention,
                                      [](const AttentionCase& c, int64_t, int) -> DrawKernel {
                                          return {std::string(dtype_name(c.dtype)) + " dim " + std::to_string(c.dim)};
                                      },
                                      [](const AttentionCase&) { return false; }, run_attention});
}

// ---- GpuFuzz.AllToAllV (ranks as threads on the visible GPUs) ---------------------------------------------------

// The cases (draw_a2a, run_a2a) are fuzz_collectives.hpp's, on the world's team.

constexpr uint64_t kA2aCapacity = 8ull << 20;        // bytes of each rank's input and output buffers (and a guard)
constexpr int64_t kA2aRankBytes = int64_t{4} << 20;  // the most a rank sends: within the staging region and buffers

TEST_F(GpuFuzz, AllToAllV) {
    FuzzRun run("AllToAllV", 15, 100000, 1);
    // A staging region that holds any local input the draws make (4 MiB per rank) and fits the test's heaps.
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::string("6M"));
    fuzz_worlds<A2aCase>(
        run, test::test_options(64ull << 20),
        [](Rng& r, World& w) { return draw_a2a(r, w.num_ranks(), kA2aRankBytes); },
        [](const A2aCase&, World&) { return std::string(); }, [](const A2aCase& c) { return describe(c); },
        [](const A2aCase& c) { return c.invalid(); },
        [](World& w) { return std::make_unique<CollRank>(w, kA2aCapacity + kGuard); },
        [](const A2aCase& c, uint64_t seed, World& w, CollRank& rk) {
            return run_a2a(c, seed, 0, w.team(), rk.buffers, rk.stream.st);
        });
}

}  // namespace
}  // namespace weft
