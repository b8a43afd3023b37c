// SPDX-License-Identifier: MIT
// Host-only pieces of the tensor-parallel op tests: matrices, the fp64 reference and the rounding-model bound.
#include "support/tp_reference.hpp"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include "weft/runtime/error.hpp"

namespace weft::tp_test {

uint16_t float_to_bits(DType t, float x) {
    if (t == DType::kBF16) {
        uint32_t u;
        std::memcpy(&u, &x, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
        u += 0x7fffu + ((u >> 16) & 1u);                     // round to nearest even
        return static_cast<uint16_t>(u >> 16);
    }
    WEFT_CHECK(t == DType::kF16, "tp_test: 16-bit matrices are bf16 or f16, got " << dtype_name(t));
    const __half_raw r = __float2half_rn(x);
    return r.x;
}

float bits_to_float(DType t, uint16_t b) {
    if (t == DType::kBF16) {
        const uint32_t u = static_cast<uint32_t>(b) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    __half_raw r;
    r.x = b;
    return __half2float(__half(r));
}

HostMat::HostMat(int64_t r, int64_t c, int64_t l, DType t) : rows(r), cols(c), ld(l), dtype(t) {
    bits.assign(static_cast<size_t>(std::max<int64_t>(1, r) * l), 0);
}

void HostMat::fill_random(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) set(r, c, u(rng));
}

void poison(HostMat& h) {
    for (int64_t r = 0; r < h.rows; ++r)
        for (int64_t c = 0; c < h.ld; ++c) h.bits[static_cast<size_t>(r * h.ld + c)] = c < h.cols ? 0xFFFF : kSentinel;
}

std::vector<int64_t> rows_to_check(int64_t m, int64_t block, double work_per_row, uint64_t seed) {
    std::vector<int64_t> rows;
    if (static_cast<double>(m) * work_per_row <= 64e6) {
        for (int64_t r = 0; r < m; ++r) rows.push_back(r);
        return rows;
    }
    for (int64_t b0 = 0; b0 < m; b0 += block) {
        for (int64_t r : {b0, b0 + 1, std::min(m, b0 + block) - 1}) {
            if (r < m && (rows.empty() || rows.back() != r)) rows.push_back(r);
        }
    }
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int64_t> u(0, m - 1);
    for (int i = 0; i < 24; ++i) rows.push_back(u(rng));
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    return rows;
}

double unit_roundoff(DType t) {
    switch (t) {
        case DType::kBF16:
            return std::ldexp(1.0, -8);  // 8 significand bits
        case DType::kF16:
            return std::ldexp(1.0, -11);  // 11
        case DType::kF32:
            return std::ldexp(1.0, -24);  // 24
        default:
            break;
    }
    WEFT_FAIL("tp_test: no unit roundoff for " << dtype_name(t));
}

Reference::Reference(int64_t r, int64_t c)
    : rows(r),
      cols(c),
      want(static_cast<size_t>(r * c), 0.0),
      abs_partials(static_cast<size_t>(r * c), 0.0),
      abs_products(static_cast<size_t>(r * c), 0.0) {}

void Reference::add(const HostMat& a, int64_t a_row0, const std::vector<int64_t>& row_ids, const HostMat& b) {
    WEFT_CHECK(static_cast<int64_t>(row_ids.size()) == rows && b.rows == cols && a.cols == b.cols,
               "tp_test: Reference::add got " << row_ids.size() << " rows of a [" << a.rows << ", " << a.cols
                                              << "] and b [" << b.rows << ", " << b.cols << "] for a reference ["
                                              << rows << ", " << cols << "]");
    const int64_t k = a.cols;
    std::vector<double> bt(static_cast<size_t>(cols * k));
    for (int64_t c = 0; c < cols; ++c)
        for (int64_t j = 0; j < k; ++j) bt[static_cast<size_t>(c * k + j)] = b.at(c, j);
    std::vector<double> arow(static_cast<size_t>(k));
    for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < k; ++j)
            arow[static_cast<size_t>(j)] = a.at(a_row0 + row_ids[static_cast<size_t>(i)], j);
        for (int64_t c = 0; c < cols; ++c) {
            const double* bc = bt.data() + c * k;
            double s = 0, sa = 0;
            for (int64_t j = 0; j < k; ++j) {
                const double p = arow[static_cast<size_t>(j)] * bc[j];
                s += p;
                sa += std::fabs(p);
            }
            want[index(i, c)] += s;
            abs_partials[index(i, c)] += std::fabs(s);
            abs_products[index(i, c)] += sa;
        }
    }
    ++terms;
    max_k = std::max(max_k, k);
}

void Reference::add_partial(const std::vector<double>& p, const std::vector<double>& abs_prod, int64_t k) {
    WEFT_CHECK(p.size() == want.size() && abs_prod.size() == want.size(),
               "tp_test: Reference::add_partial needs " << want.size() << " values, got " << p.size() << " and "
                                                        << abs_prod.size());
    for (size_t e = 0; e < want.size(); ++e) {
        want[e] += p[e];
        abs_partials[e] += std::fabs(p[e]);
        abs_products[e] += abs_prod[e];
    }
    ++terms;
    max_k = std::max(max_k, k);
}

namespace {
// The relative Frobenius tolerance the tests used before the element bound modelled the partials: 4e-3
// (bf16) or 1e-3 (f16) times 1 + terms/4.
double frob_tolerance(DType out, int terms) {
    const double scale = 1.0 + terms / 4.0;
    return (out == DType::kBF16 ? 4e-3 : 1e-3) * scale;
}
}  // namespace

ErrorModel ErrorModel::gemm(DType out) {
    ErrorModel m;
    m.u_partial = 0;
    m.u_out = unit_roundoff(out);
    m.frob = frob_tolerance(out, 1);
    return m;
}

ErrorModel ErrorModel::summed_partials(DType partial, DType out, int terms) {
    ErrorModel m;
    m.u_partial = unit_roundoff(partial);
    m.u_out = unit_roundoff(out);
    m.frob = frob_tolerance(out, partial == DType::kF32 ? 1 : terms);
    return m;
}

ErrorModel ErrorModel::tp_sum(DType out, DType partial, int num_ranks) {
    return num_ranks == 1 ? gemm(out) : summed_partials(partial, out, num_ranks);
}

double ErrorModel::first_order(const Reference& ref, size_t e) const {
    constexpr double kU32 = 1.0 / (1 << 24);
    const double n_acc = static_cast<double>((ref.max_k + 15) / 16 + 48 + ref.terms);
    return u_partial * ref.abs_partials[e] + u_out * std::fabs(ref.want[e]) + kU32 * n_acc * ref.abs_products[e] +
           (ref.terms + 1) * kU32 / 2;
}

double ErrorModel::bound(const Reference& ref, size_t e) const { return 2.0 * first_order(ref, e); }

std::string compare(const HostMat& got, const std::vector<int64_t>& rows, const Reference& ref,
                    const ErrorModel& model) {
    WEFT_CHECK(static_cast<int64_t>(rows.size()) == ref.rows && got.cols == ref.cols,
               "tp_test: compare got " << rows.size() << " rows of " << got.cols << " columns for a reference ["
                                       << ref.rows << ", " << ref.cols << "]");
    double num = 0, den = 0, first_order_sq = 0;
    for (size_t e = 0; e < ref.want.size(); ++e) {
        den += ref.want[e] * ref.want[e];
        const double b = model.first_order(ref, e);
        first_order_sq += b * b;
    }
    int64_t bad = 0, nonfinite = 0, padding = 0;
    double worst_ratio = 0;
    std::string first;
    for (size_t i = 0; i < rows.size(); ++i) {
        const int64_t r = rows[i];
        for (int64_t c = 0; c < got.ld; ++c) {
            const uint16_t b = got.bits[static_cast<size_t>(r * got.ld + c)];
            std::ostringstream here;
            if (c >= got.cols) {
                if (b != kSentinel && padding++ == 0 && first.empty()) {
                    here << "padding (" << r << ", " << c << ") overwritten";
                    first = here.str();
                }
                continue;
            }
            const double g = bits_to_float(got.dtype, b);
            const size_t e = ref.index(static_cast<int64_t>(i), c);
            const double w = ref.want[e];
            if (!std::isfinite(g)) {
                if (nonfinite++ == 0 && first.empty()) {
                    here << "non-finite at (" << r << ", " << c << ")";
                    first = here.str();
                }
                continue;
            }
            num += (g - w) * (g - w);
            const double err = std::fabs(g - w), limit = model.bound(ref, e);
            worst_ratio = std::max(worst_ratio, err / limit);
            if (err > limit) {
                if (bad++ == 0 && first.empty()) {
                    here << "(" << r << ", " << c << "): got " << g << ", want " << w << ", |error| " << err
                         << " > bound " << limit << " (sum |partials| " << ref.abs_partials[e] << ", sum |a b| "
                         << ref.abs_products[e] << ")";
                    first = here.str();
                }
            }
        }
    }
    // Relative to ||want||; where the model's first-order error is larger (cancelling partials), relative to
    // that: the check never rejects a result whose every error is within the first-order bound.
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    const double frob = std::max(model.frob, den > 0 ? std::sqrt(first_order_sq / den) : std::sqrt(first_order_sq));
    if (bad == 0 && nonfinite == 0 && padding == 0 && rel <= frob) return "";
    std::ostringstream os;
    os << bad << " out of bound, " << nonfinite << " non-finite (unwritten poison?), " << padding
       << " padding elements overwritten, relative Frobenius error " << rel << " (tolerance " << frob
       << "), worst |error| / bound " << worst_ratio << " (rows checked " << rows.size() << ", " << ref.terms
       << " partials, u_partial " << model.u_partial << ", u_out " << model.u_out << ", K " << ref.max_k
       << "); first: " << first;
    return os.str();
}

}  // namespace weft::tp_test
