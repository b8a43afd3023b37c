// SPDX-License-Identifier: MIT
// Unit tests (CPU) of the tensor-parallel tests' reference and error bound (tests/support/tp_reference.hpp):
// the unit roundoffs, a CPU simulation of the fused ops' arithmetic (fp32 GEMM accumulation, partials rounded
// to bf16/f16/f32, an fp32 sum over ranks, the output rounded) that the bound must accept, also where the
// ranks' partials cancel, and broken results it must reject: a missing k-term, a missing rank, a stale value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "support/tp_reference.hpp"

namespace weft::tp_test {
namespace {

// fp32 rounding toward zero of d (the model allows truncating tensor-core adds; the simulation uses them).
float trunc_to_float(double d) {
    float f = static_cast<float>(d);
    if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
    return f;
}

struct Problem {
    int w = 2;
    int64_t m = 0, n = 0, k = 0;
    DType dtype = DType::kBF16;    // of A, B and C
    DType partial = DType::kBF16;  // of the partials (dtype or f32)
    std::vector<HostMat> as, bs;   // [m, k] and [n, k] per rank
};

// Fresh random data; with `cancel`, ranks pair up (1 with 0, 3 with 2, ...): the same A and B negated plus a
// little noise, so that their partials nearly cancel and the sum is much smaller than either.
Problem make_problem(int w, int64_t m, int64_t n, int64_t k, DType dt, DType partial, bool cancel, uint64_t seed) {
    Problem p;
    p.w = w;
    p.m = m;
    p.n = n;
    p.k = k;
    p.dtype = dt;
    p.partial = partial;
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> noise(-0.05f, 0.05f);
    for (int r = 0; r < w; ++r) {
        p.as.emplace_back(m, k, k, dt);
        p.bs.emplace_back(n, k, k, dt);
        if (cancel && r % 2 == 1) {
            p.as[r].bits = p.as[r - 1].bits;
            for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j < k; ++j) p.bs[r].set(i, j, -p.bs[r - 1].at(i, j) + noise(rng));
        } else {
            p.as[r].fill_random(rng());
            p.bs[r].fill_random(rng());
        }
    }
    return p;
}

// One rank's product in fp32 as the model's GEMM computes it: products of 16 consecutive k exact, each block
// added to an fp32 accumulator with truncation. `skip_k` >= 0 leaves that k-term out (a broken GEMM).
float gemm_elem(const HostMat& a, const HostMat& b, int64_t i, int64_t c, int64_t skip_k) {
    float acc = 0;
    for (int64_t j0 = 0; j0 < a.cols; j0 += 16) {
        double block = 0;
        for (int64_t j = j0; j < std::min<int64_t>(a.cols, j0 + 16); ++j) {
            if (j != skip_k) block += static_cast<double>(a.at(i, j)) * b.at(c, j);
        }
        acc = trunc_to_float(static_cast<double>(acc) + block);
    }
    return acc;
}

struct Breakage {
    int64_t skip_k = -1;  // rank 0's GEMM leaves this k-term out
    int skip_rank = -1;   // this rank's partial is not added
};

// The op's output as the rounding model describes it (c_pad columns of padding keep the sentinel).
HostMat simulate(const Problem& p, const Breakage& br = {}, int64_t c_pad = 8) {
    HostMat c(p.m, p.n, ld_for(p.n, c_pad), p.dtype);
    poison(c);
    for (int64_t i = 0; i < p.m; ++i) {
        for (int64_t col = 0; col < p.n; ++col) {
            float sum = 0;
            for (int r = 0; r < p.w; ++r) {
                if (r == br.skip_rank) continue;
                const float acc = gemm_elem(p.as[r], p.bs[r], i, col, r == 0 ? br.skip_k : -1);
                if (p.w == 1) {
                    sum = acc;  // the plain GEMM writes C itself: no partial
                    break;
                }
                const float part =
                    p.partial == DType::kF32 ? acc : bits_to_float(p.partial, float_to_bits(p.partial, acc));
                sum = trunc_to_float(static_cast<double>(sum) + part);
            }
            c.set(i, col, sum);
        }
    }
    return c;
}

std::vector<int64_t> all_rows(int64_t m) {
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < m; ++r) rows.push_back(r);
    return rows;
}

Reference reference(const Problem& p) {
    Reference ref(p.m, p.n);
    for (int r = 0; r < p.w; ++r) ref.add(p.as[r], 0, all_rows(p.m), p.bs[r]);
    return ref;
}

ErrorModel model(const Problem& p) { return ErrorModel::tp_sum(p.dtype, p.partial, p.w); }

// The element tolerance the tests used before (tol_for + compare): elem_rel |want| + elem_abs rms(want).
int64_t count_over_old_tolerance(const HostMat& got, const Reference& ref, int terms) {
    double den = 0;
    for (double v : ref.want) den += v * v;
    const double rms = std::sqrt(den / static_cast<double>(ref.want.size()));
    const double scale = 1.0 + terms / 4.0;
    const double rel = got.dtype == DType::kBF16 ? 1.0 / 128 : 1.0 / 1024;
    const double abs = (got.dtype == DType::kBF16 ? scale / 256 : scale / 2048) * rms;
    int64_t over = 0;
    for (int64_t i = 0; i < ref.rows; ++i)
        for (int64_t c = 0; c < ref.cols; ++c) {
            const double w = ref.want[ref.index(i, c)];
            over += std::fabs(got.at(i, c) - w) > rel * std::fabs(w) + abs;
        }
    return over;
}

TEST(TpTolerance, UnitRoundoffIsTheHalfUlpRelativeBound) {
    EXPECT_EQ(unit_roundoff(DType::kBF16), std::ldexp(1.0, -8));
    EXPECT_EQ(unit_roundoff(DType::kF16), std::ldexp(1.0, -11));
    EXPECT_EQ(unit_roundoff(DType::kF32), std::ldexp(1.0, -24));
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<double> mant(1.0, 2.0);
    std::uniform_int_distribution<int> expo(-12, 12);
    for (DType t : {DType::kBF16, DType::kF16}) {
        const double u = unit_roundoff(t);
        double worst = 0;
        for (int i = 0; i < 200000; ++i) {
            const float x = static_cast<float>(std::ldexp(mant(rng), expo(rng)) * (i % 2 ? -1 : 1));
            const double rounded = bits_to_float(t, float_to_bits(t, x));
            worst = std::max(worst, std::fabs(rounded - x) / std::fabs(x));
        }
        EXPECT_LE(worst, u) << dtype_name(t);
        EXPECT_GT(worst, 0.99 * u) << dtype_name(t) << ": u is not tight (a whole ulp would be twice as loose)";
    }
}

TEST(TpTolerance, AcceptsModelledRoundingOfRandomPartials) {
    int cases = 0;
    for (int w : {1, 2, 3, 8}) {
        for (DType dt : {DType::kBF16, DType::kF16}) {
            for (DType partial : {dt, DType::kF32}) {
                for (int64_t k : {8, 72, 256, 1000}) {
                    const Problem p = make_problem(w, 9, 40, k, dt, partial, false, 1000 + cases);
                    const std::string bad = compare(simulate(p), all_rows(p.m), reference(p), model(p));
                    EXPECT_EQ(bad, "") << "W " << w << " " << dtype_name(dt) << " partials " << dtype_name(partial)
                                       << " k " << k;
                    ++cases;
                }
            }
        }
    }
}

// Cancelling partials, as GPU runs produce them: bf16 partials of magnitude 2..8 that cancel to < 1. The result's
// error follows the partials' magnitude; a bound relative to the result (the old one) rejects such correct results,
// the modelled one accepts them.
TEST(TpTolerance, AcceptsModelledRoundingOfCancellingPartials) {
    int64_t old_rejects = 0;
    int cases = 0;
    for (int w : {2, 3, 4, 8}) {
        for (DType dt : {DType::kBF16, DType::kF16}) {
            for (DType partial : {dt, DType::kF32}) {
                for (int64_t k : {72, 256, 1000}) {
                    const Problem p = make_problem(w, 16, 64, k, dt, partial, true, 5000 + cases);
                    const HostMat got = simulate(p);
                    const Reference ref = reference(p);
                    const std::string bad = compare(got, all_rows(p.m), ref, model(p));
                    EXPECT_EQ(bad, "") << "W " << w << " " << dtype_name(dt) << " partials " << dtype_name(partial)
                                       << " k " << k;
                    if (partial != DType::kF32) old_rejects += count_over_old_tolerance(got, ref, w);
                    ++cases;
                }
            }
        }
    }
    // The cases reproduce what the GPU tests saw: correct results that the old bound called wrong.
    EXPECT_GT(old_rejects, 0) << "the cancelling cases no longer exercise the partials' rounding";
}

TEST(TpTolerance, RejectsAResultMissingOneKTerm) {
    for (int w : {1, 2, 8}) {
        for (DType dt : {DType::kBF16, DType::kF16}) {
            for (DType partial : {dt, DType::kF32}) {
                for (int64_t k : {72, 1000}) {
                    for (bool cancel : {false, true}) {
                        const Problem p = make_problem(w, 12, 48, k, dt, partial, cancel, 9000 + k + w);
                        Breakage br;
                        br.skip_k = k - 1;  // e.g. a dropped ragged last K-step
                        const std::string bad = compare(simulate(p, br), all_rows(p.m), reference(p), model(p));
                        EXPECT_NE(bad, "") << "W " << w << " " << dtype_name(dt) << " partials " << dtype_name(partial)
                                           << " k " << k << " cancel " << cancel;
                        EXPECT_NE(bad.find("> bound"), std::string::npos) << bad;
                    }
                }
            }
        }
    }
}

TEST(TpTolerance, RejectsAResultMissingOneRanksPartial) {
    for (int w : {2, 3, 8}) {
        for (DType dt : {DType::kBF16, DType::kF16}) {
            for (bool cancel : {false, true}) {
                const Problem p = make_problem(w, 12, 48, 256, dt, dt, cancel, 12000 + w);
                Breakage br;
                br.skip_rank = w - 1;
                const std::string bad = compare(simulate(p, br), all_rows(p.m), reference(p), model(p));
                EXPECT_NE(bad, "") << "W " << w << " " << dtype_name(dt) << " cancel " << cancel;
            }
        }
    }
}

TEST(TpTolerance, RejectsAStaleResult) {
    for (int w : {1, 2, 8}) {
        for (DType dt : {DType::kBF16, DType::kF16}) {
            // The previous call's output, checked against this call's data (same shapes, fresh values).
            const Problem before = make_problem(w, 12, 48, 136, dt, dt, true, 15000 + w);
            const Problem now = make_problem(w, 12, 48, 136, dt, dt, true, 16000 + w);
            const std::string bad = compare(simulate(before), all_rows(now.m), reference(now), model(now));
            EXPECT_NE(bad, "") << "W " << w << " " << dtype_name(dt);
        }
    }
}

TEST(TpTolerance, RejectsPoisonAndOverwrittenPadding) {
    const Problem p = make_problem(2, 4, 24, 72, DType::kBF16, DType::kBF16, false, 17);
    const Reference ref = reference(p);
    HostMat got = simulate(p);
    ASSERT_EQ(compare(got, all_rows(p.m), ref, model(p)), "");
    HostMat unwritten = got;
    unwritten.bits[static_cast<size_t>(2 * unwritten.ld + 5)] = 0xFFFF;  // the poison (NaN) left in place
    EXPECT_NE(compare(unwritten, all_rows(p.m), ref, model(p)).find("1 non-finite"), std::string::npos);
    HostMat spilled = got;
    spilled.bits[static_cast<size_t>(3 * spilled.ld + p.n)] = 0;  // a store past N into the row padding
    EXPECT_NE(compare(spilled, all_rows(p.m), ref, model(p)).find("1 padding"), std::string::npos);
}

// AgGemm (one GEMM, no partials): the bound is at least as strict as the tolerance it replaces at the test
// shapes (K up to 512), element by element.
TEST(TpTolerance, OneTermBoundIsNoLooserThanTheOldTolerance) {
    for (DType dt : {DType::kBF16, DType::kF16}) {
        for (int64_t k : {8, 72, 136, 256, 512}) {
            const Problem p = make_problem(1, 16, 64, k, dt, dt, false, 20000 + k);
            const Reference ref = reference(p);
            const ErrorModel em = ErrorModel::gemm(dt);
            double den = 0;
            for (double v : ref.want) den += v * v;
            const double rms = std::sqrt(den / static_cast<double>(ref.want.size()));
            const double old_rel = dt == DType::kBF16 ? 1.0 / 128 : 1.0 / 1024;
            const double old_abs = (dt == DType::kBF16 ? 1.25 / 256 : 1.25 / 2048) * rms;
            for (size_t e = 0; e < ref.want.size(); ++e) {
                ASSERT_LE(em.bound(ref, e), old_rel * std::fabs(ref.want[e]) + old_abs)
                    << dtype_name(dt) << " k " << k << " element " << e;
            }
            EXPECT_LE(em.frob, dt == DType::kBF16 ? 5e-3 : 1.25e-3);
        }
    }
}

}  // namespace
}  // namespace weft::tp_test
