// SPDX-License-Identifier: MIT
// Host-only pieces of the tensor-parallel op tests: 16-bit host matrices, an fp64 reference of sum_r A_r B_r^T
// that also keeps the magnitudes an error bound needs, and the element-wise bound of the ops' rounding model.
//
// The rounding model. A fused TP op computes C = sum over ranks r of P_r, P_r = A_r B_r^T, as
//   got = fl_out( sum_r fl_partial(P~_r) )    (the sum over r in fp32)
// where P~_r is the GEMM's fp32 accumulation of P_r and fl_t rounds to nearest into dtype t. With the unit
// roundoff u_t (|fl_t(x) - x| <= u_t |x| in t's normal range: 2^-8 bf16, 2^-11 f16, 2^-24 f32):
//   |got - want| <= u_partial * sum_r |P_r| + u_out * |want| + (fp32 accumulation) + (second order)
// Each partial is rounded on its own, so where partials cancel (+5.1 and -4.4 -> 0.7) the error follows
// sum_r |P_r|, not |want|. The check allows twice the first-order terms (the second-order ones and the fp32
// sums are far smaller), plus the fp32 accumulation bound 2 * 2^-24 * n_acc * sum_r sum_j |a_rj b_rj|
// (2u: truncating adds), with n_acc = ceil(k/16) + 48 + terms: one accumulator rounding per K-step of 16 of
// the tensor-core MMAs (wgmma m64nNk16, mma.sync m16n8k16), the MMA's internal alignment of its 16 products,
// split-K sums (at most 32 splits) and the sum over the ranks; plus an absolute floor for fp16's subnormals.
// An op whose GEMM writes the output itself (AgGemm, a world of one rank) has no partial rounding.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weft/common/dtype.hpp"

namespace weft::tp_test {

uint16_t float_to_bits(DType t, float x);  ///< round to nearest even into bf16 or f16 bits
float bits_to_float(DType t, uint16_t b);  ///< exact

/// A row-major 16-bit matrix on the host, row stride `ld` elements.
struct HostMat {
    int64_t rows = 0, cols = 0, ld = 0;
    DType dtype = DType::kBF16;
    std::vector<uint16_t> bits;

    HostMat() = default;
    HostMat(int64_t r, int64_t c, int64_t l, DType t);
    float at(int64_t r, int64_t c) const { return bits_to_float(dtype, bits[static_cast<size_t>(r * ld + c)]); }
    void set(int64_t r, int64_t c, float v) { bits[static_cast<size_t>(r * ld + c)] = float_to_bits(dtype, v); }
    void fill_random(uint64_t seed);  ///< uniform in [-1, 1], then rounded
    size_t bytes() const { return bits.size() * 2; }
};

/// A row stride (elements) for `cols` columns plus `pad`, rounded up to 16 bytes.
inline int64_t ld_for(int64_t cols, int64_t pad = 0) { return (cols + pad + 7) / 8 * 8; }

/// Output poison: NaN bits inside [rows, cols]; a sentinel in the row padding that must survive.
constexpr uint16_t kSentinel = 0x1234;
void poison(HostMat& h);

/// The rows of an [m, ...] output to check: all of them when m * work_per_row is small, else the first and
/// last rows of every block of `block` rows (rank shards or segments) and some random rows.
std::vector<int64_t> rows_to_check(int64_t m, int64_t block, double work_per_row, uint64_t seed);

/// Unit roundoff of rounding to nearest into t: 2^-8 (bf16), 2^-11 (f16), 2^-24 (f32).
double unit_roundoff(DType t);

/// fp64 reference of sum over added terms r of A_r B_r^T on chosen rows, with per element the sum over r of
/// |P_r| (the partials' magnitudes) and of sum_j |a_rj b_rj| (the products' magnitudes).
struct Reference {
    int64_t rows = 0, cols = 0;
    std::vector<double> want;          ///< [rows, cols]: sum_r P_r
    std::vector<double> abs_partials;  ///< sum_r |P_r|
    std::vector<double> abs_products;  ///< sum_r sum_j |a_rj b_rj|
    int terms = 0;                     ///< partials added
    int64_t max_k = 0;                 ///< the longest K of a term

    Reference(int64_t rows, int64_t cols);
    /// Adds P = a[a_row0 + rows[i], :] * b^T (b is [cols, K]) as one more partial; rows.size() == this->rows.
    void add(const HostMat& a, int64_t a_row0, const std::vector<int64_t>& row_ids, const HostMat& b);
    /// Adds one partial given directly (the unit tests' hand-made cases): p and abs_products [rows, cols].
    void add_partial(const std::vector<double>& p, const std::vector<double>& abs_products, int64_t k);
    size_t index(int64_t i, int64_t c) const { return static_cast<size_t>(i * cols + c); }
};

/// How an op rounds (see the model at the top of this file) and the relative Frobenius tolerance.
struct ErrorModel {
    double u_partial = 0;  ///< 0: the GEMM writes the output itself
    double u_out = 0;
    double frob = 0;  ///< relative to ||want||; compare() takes the larger of this and ||first_order||

    /// A GEMM writing its output directly (AgGemm; GemmRs and GemmAr in a world of one rank).
    static ErrorModel gemm(DType out);
    /// Separately rounded partials in `partial`, summed in fp32 and written in `out` (GemmRs, GemmAr).
    static ErrorModel summed_partials(DType partial, DType out, int terms);
    /// The model of a GemmRs / GemmAr: summed_partials, or gemm() for one rank (the plain GEMM).
    static ErrorModel tp_sum(DType out, DType partial, int num_ranks);

    /// The first-order error bound of element e of `ref`: u_partial sum|P_r| + u_out |want| + the fp32
    /// accumulation term + half the floor.
    double first_order(const Reference& ref, size_t e) const;
    /// The bound on |got - want| for element e of `ref`: twice first_order.
    double bound(const Reference& ref, size_t e) const;
};

/// Compares rows `rows` of got [.., cols] (row rows[i] against reference row i) element-wise against the
/// model's bound and in relative Frobenius norm (||got - want|| <= max(frob ||want||, ||first_order||): the
/// old relative tolerance, unless cancelling partials make the model's first-order error larger); checks
/// NaN-freedom and that the row padding kept its sentinel. Returns "" when it matches, else a description of what is
/// wrong (the first bad element with its bound, and the worst error / bound ratio).
std::string compare(const HostMat& got, const std::vector<int64_t>& rows, const Reference& ref,
                    const ErrorModel& model);

}  // namespace weft::tp_test
