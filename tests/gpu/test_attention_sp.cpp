// SPDX-License-Identifier: MIT
// GPU tests of weft::ops::sp_decode_attention (ranks as threads sharing the visible GPUs), worlds 1-4: every rank
// holds a random contiguous share of every sequence's tokens (some shares empty) in its own paged cache (random page
// order, unused slots NaN); every rank's output and LSE are compared with an fp64 reference over the whole sequences;
// batches large enough to take several LL rounds; repeated calls (epochs alternate); a CUDA graph replayed.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/jit_testing.hpp"
#include "support/runtime_checks.hpp"
#include "weft/ops/attention.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

bool have_sm90() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return false;
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    return prop.major == 9;
}

uint16_t bf16_bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

float bf16_value(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

struct Problem {
    int batch = 3, hq = 8, hkv = 2, dim = 128, page = 16;
    std::vector<int> lens;                    // whole sequences
    std::vector<std::vector<int>> cuts;       // cuts[b][r] .. cuts[b][r + 1]: rank r's tokens of sequence b
    std::vector<std::vector<uint16_t>> k, v;  // [b][t * hkv * dim + h * dim + e]
    std::vector<uint16_t> q;                  // [b][h][e]
    std::vector<double> out, lse;             // reference
};

Problem make_problem(int n, int batch, int hq, int hkv, std::vector<int> lens, uint64_t seed) {
    Problem pr;
    pr.batch = batch;
    pr.hq = hq;
    pr.hkv = hkv;
    pr.lens = std::move(lens);
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    pr.cuts.resize(static_cast<size_t>(batch));
    pr.k.resize(static_cast<size_t>(batch));
    pr.v.resize(static_cast<size_t>(batch));
    for (int b = 0; b < batch; ++b) {
        const int len = pr.lens[static_cast<size_t>(b)];
        std::vector<int> c = {0, len};
        for (int r = 1; r < n; ++r) c.push_back(static_cast<int>(rng() % static_cast<uint64_t>(len + 1)));
        std::sort(c.begin(), c.end());
        if (n > 1 && b % 2 == 0) c[1] = 0;  // rank 0's share of every other sequence is empty
        std::sort(c.begin(), c.end());
        pr.cuts[static_cast<size_t>(b)] = c;
        const size_t elems = static_cast<size_t>(len) * hkv * pr.dim;
        pr.k[static_cast<size_t>(b)].resize(elems);
        pr.v[static_cast<size_t>(b)].resize(elems);
        for (size_t i = 0; i < elems; ++i) {
            pr.k[static_cast<size_t>(b)][i] = bf16_bits(u(rng));
            pr.v[static_cast<size_t>(b)][i] = bf16_bits(u(rng));
        }
    }
    pr.q.resize(static_cast<size_t>(batch) * hq * pr.dim);
    for (auto& x : pr.q) x = bf16_bits(2.f * u(rng));
    // fp64 reference over whole sequences.
    pr.out.assign(pr.q.size(), 0.0);
    pr.lse.assign(static_cast<size_t>(batch) * hq, -INFINITY);
    const double scale = 1.0 / std::sqrt(static_cast<double>(pr.dim));
    const int group = hq / hkv;
    for (int b = 0; b < batch; ++b) {
        const int len = pr.lens[static_cast<size_t>(b)];
        for (int h = 0; h < hq; ++h) {
            const size_t row = static_cast<size_t>(b) * hq + h;
            const int kvh = h / group;
            std::vector<double> s(static_cast<size_t>(len));
            double m = -INFINITY;
            for (int t = 0; t < len; ++t) {
                double dot = 0;
                const size_t base = (static_cast<size_t>(t) * hkv + kvh) * pr.dim;
                for (int e = 0; e < pr.dim; ++e) {
                    dot += bf16_value(pr.q[row * pr.dim + e]) * static_cast<double>(bf16_value(pr.k[b][base + e]));
                }
                s[static_cast<size_t>(t)] = dot * scale;
                m = std::max(m, s[static_cast<size_t>(t)]);
            }
            if (len == 0) continue;
            double l = 0;
            for (int t = 0; t < len; ++t) {
                const double p = std::exp(s[static_cast<size_t>(t)] - m);
                l += p;
                const size_t base = (static_cast<size_t>(t) * hkv + kvh) * pr.dim;
                for (int e = 0; e < pr.dim; ++e) pr.out[row * pr.dim + e] += p * bf16_value(pr.v[b][base + e]);
            }
            for (int e = 0; e < pr.dim; ++e) pr.out[row * pr.dim + e] /= l;
            pr.lse[row] = m + std::log(l);
        }
    }
    return pr;
}

// Every row as the reference's, but those of sequence `nan_sequence` (when >= 0): NaN, out and lse.
void check(const Problem& pr, const std::vector<uint16_t>& out, const std::vector<float>& lse, int rank,
           const std::string& what, int nan_sequence = -1) {
    int bad = 0;
    for (size_t row = 0; row < pr.lse.size() && bad < 8; ++row) {
        if (static_cast<int>(row) / pr.hq == nan_sequence) {
            const bool nan_out = std::all_of(out.begin() + static_cast<std::ptrdiff_t>(row * pr.dim),
                                             out.begin() + static_cast<std::ptrdiff_t>((row + 1) * pr.dim),
                                             [](uint16_t x) { return std::isnan(bf16_value(x)); });
            if (!nan_out || !std::isnan(lse[row])) {
                ADD_FAILURE() << what << " rank " << rank << ": row " << row << " (sequence " << nan_sequence
                              << ") is not NaN: lse " << lse[row];
                ++bad;
            }
            continue;
        }
        const bool empty = std::isinf(pr.lse[row]);
        if (empty ? !(std::isinf(lse[row]) && lse[row] < 0) : !(std::fabs(lse[row] - pr.lse[row]) <= 2e-3)) {
            ADD_FAILURE() << what << " rank " << rank << ": lse[" << row << "] = " << lse[row] << ", want "
                          << pr.lse[row];
            ++bad;
        }
        for (int e = 0; e < pr.dim; ++e) {
            const double want = pr.out[row * pr.dim + e];
            const double got = bf16_value(out[row * pr.dim + e]);
            if (!(std::fabs(got - want) <= 6e-3 + 1.6e-2 * std::fabs(want))) {
                ADD_FAILURE() << what << " rank " << rank << ": out[" << row << ", " << e << "] = " << got << ", want "
                              << want;
                ++bad;
                break;
            }
        }
    }
}

// Every rank builds its shard, calls sp_decode_attention `calls` times (eagerly, then from a graph when asked) and
// checks its output after each. With `bad_rank` >= 0, every rank passes a status (and `num_splits`), and that rank's
// block table holds -1 at the last page of its share of `bad_sequence`: one call, that sequence NaN on every rank, the
// others exact, the entry recorded (its index within the call) in that rank's status only.
void run_sp(int n, const Problem& pr, bool graph, int bad_rank = -1, int bad_sequence = -1, int num_splits = 0) {
    // A small staging region keeps the collective workspace within the test's heap (the LL buffer is what this op
    // uses).
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::string("1M"));
    run_ranks(
        n,
        [&](World& w) {
            const int me = w.rank();
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            const int ps = pr.page;
            // This rank's shard: tokens [cuts[b][me], cuts[b][me + 1]) of each sequence.
            std::vector<int32_t> lens(static_cast<size_t>(pr.batch));
            int64_t pages_total = 0, max_len = 1;
            for (int b = 0; b < pr.batch; ++b) {
                const auto& c = pr.cuts[static_cast<size_t>(b)];
                lens[static_cast<size_t>(b)] = c[static_cast<size_t>(me) + 1] - c[static_cast<size_t>(me)];
                pages_total += (lens[static_cast<size_t>(b)] + ps - 1) / ps;
                max_len = std::max<int64_t>(max_len, lens[static_cast<size_t>(b)]);
            }
            const int64_t max_pages = (max_len + ps - 1) / ps;
            const int64_t num_pages = pages_total + 1;
            std::vector<int32_t> order(static_cast<size_t>(num_pages));
            std::iota(order.begin(), order.end(), 0);
            std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(me + 17)));
            std::vector<int32_t> table(static_cast<size_t>(pr.batch * max_pages), 1 << 30);
            const size_t row_elems = static_cast<size_t>(pr.hkv) * pr.dim;
            std::vector<uint16_t> kc(static_cast<size_t>(num_pages) * ps * row_elems, 0x7fc0);  // NaN
            std::vector<uint16_t> vc(kc.size(), 0x7fc0);
            size_t next = 0;
            for (int b = 0; b < pr.batch; ++b) {
                const int first = pr.cuts[static_cast<size_t>(b)][static_cast<size_t>(me)];
                for (int t = 0; t < lens[static_cast<size_t>(b)]; ++t) {
                    if (t % ps == 0) table[static_cast<size_t>(b * max_pages + t / ps)] = order[next++];
                    const size_t dst =
                        (static_cast<size_t>(table[static_cast<size_t>(b * max_pages + t / ps)]) * ps + t % ps) *
                        row_elems;
                    const size_t src = static_cast<size_t>(first + t) * row_elems;
                    std::copy_n(pr.k[static_cast<size_t>(b)].begin() + static_cast<std::ptrdiff_t>(src), row_elems,
                                kc.begin() + static_cast<std::ptrdiff_t>(dst));
                    std::copy_n(pr.v[static_cast<size_t>(b)].begin() + static_cast<std::ptrdiff_t>(src), row_elems,
                                vc.begin() + static_cast<std::ptrdiff_t>(dst));
                }
            }
            int32_t bad_page = -1;
            if (bad_rank >= 0) {
                const auto& c = pr.cuts[static_cast<size_t>(bad_sequence)];
                const int share = c[static_cast<size_t>(bad_rank) + 1] - c[static_cast<size_t>(bad_rank)];
                ASSERT_GT(share, 0) << "rank " << bad_rank << " holds no token of sequence " << bad_sequence;
                bad_page = (share - 1) / ps;
                if (me == bad_rank) table[static_cast<size_t>(bad_sequence * max_pages + bad_page)] = -1;
            }
            void *dq, *dk, *dv, *dt, *dl, *dout, *dlse;
            WEFT_CUDA_CHECK(cudaMalloc(&dq, pr.q.size() * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dk, kc.size() * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dv, vc.size() * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dt, table.size() * 4));
            WEFT_CUDA_CHECK(cudaMalloc(&dl, lens.size() * 4));
            WEFT_CUDA_CHECK(cudaMalloc(&dout, pr.q.size() * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dlse, pr.lse.size() * 4));
            // On `s`: a cudaMemcpy from pageable memory may return before its DMA lands, on the legacy stream.
            WEFT_CUDA_CHECK(cudaMemcpyAsync(dq, pr.q.data(), pr.q.size() * 2, cudaMemcpyHostToDevice, s));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(dk, kc.data(), kc.size() * 2, cudaMemcpyHostToDevice, s));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(dv, vc.data(), vc.size() * 2, cudaMemcpyHostToDevice, s));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(dt, table.data(), table.size() * 4, cudaMemcpyHostToDevice, s));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(dl, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice, s));
            ops::prepare_collectives(w);
            const TensorView tq(dq, DType::kBF16, {pr.batch, pr.hq, pr.dim});
            const TensorView tk(dk, DType::kBF16, {num_pages, ps, pr.hkv, pr.dim});
            const TensorView tv(dv, DType::kBF16, {num_pages, ps, pr.hkv, pr.dim});
            const TensorView tt(dt, DType::kI32, {pr.batch, max_pages});
            const TensorView tl(dl, DType::kI32, {pr.batch});
            const TensorView tout(dout, DType::kBF16, {pr.batch, pr.hq, pr.dim});
            const TensorView tlse(dlse, DType::kF32, {pr.batch, pr.hq});
            // Every rank passes the same max_seq_len (it sizes the split plan; the descriptor of the combine does not
            // depend on it, but equal plans keep the ranks' work alike).
            const int64_t max_seq_len = max_pages * ps;
            // Every other call runs on -V (the output negates exactly, the LSE stays): a merge that took an earlier
            // call's lines (an epoch or flag not advanced) shows.
            std::vector<uint16_t> vc_negated(vc);
            for (uint16_t& x : vc_negated) x ^= 0x8000u;
            const auto set_v = [&](bool negated) {
                WEFT_CUDA_CHECK(cudaMemcpyAsync(dv, negated ? vc_negated.data() : vc.data(), vc.size() * 2,
                                                cudaMemcpyHostToDevice, s));
            };
            const auto download_and_check = [&](const std::string& what, bool negated) {
                w.sync_and_check(s);
                std::vector<uint16_t> out(pr.q.size());
                std::vector<float> lse(pr.lse.size());
                WEFT_CUDA_CHECK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
                WEFT_CUDA_CHECK(cudaMemcpy(lse.data(), dlse, lse.size() * 4, cudaMemcpyDeviceToHost));
                if (negated) {
                    for (uint16_t& x : out) x ^= 0x8000u;  // back to the reference's sign (a NaN stays a NaN)
                }
                check(pr, out, lse, me, what + (negated ? " (on -V)" : ""));
            };
            if (bad_rank >= 0) {
                ops::AttentionStatus* status = nullptr;
                WEFT_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&status), sizeof(*status), cudaHostAllocMapped));
                *status = {};
                ops::DecodeAttentionOptions options;
                options.status = status;
                options.num_splits = num_splits;
                WEFT_CUDA_CHECK(cudaMemsetAsync(dout, 0xff, pr.q.size() * 2, s));
                WEFT_CUDA_CHECK(cudaMemsetAsync(dlse, 0xff, pr.lse.size() * 4, s));
                ops::sp_decode_attention(w, tq, tk, tv, tt, tl, max_seq_len, tout, tlse, s, options);
                w.sync_and_check(s);
                std::vector<uint16_t> out(pr.q.size());
                std::vector<float> lse(pr.lse.size());
                WEFT_CUDA_CHECK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
                WEFT_CUDA_CHECK(cudaMemcpy(lse.data(), dlse, lse.size() * 4, cudaMemcpyDeviceToHost));
                check(pr, out, lse, me, "a -1 block-table entry on rank " + std::to_string(bad_rank), bad_sequence);
                if (me == bad_rank) {
                    EXPECT_EQ(status->code, 1);
                    EXPECT_EQ(status->sequence, bad_sequence);
                    EXPECT_EQ(status->page, bad_page);
                    EXPECT_EQ(status->value, -1);
                } else {
                    EXPECT_EQ(status->code, 0) << "rank " << me << ": " << ops::describe_attention_status(*status);
                }
                WEFT_CUDA_CHECK(cudaFreeHost(status));
            }
            for (int call = 0; call < (bad_rank >= 0 ? 0 : 3); ++call) {
                set_v(call % 2 == 1);
                WEFT_CUDA_CHECK(cudaMemsetAsync(dout, 0xff, pr.q.size() * 2, s));
                WEFT_CUDA_CHECK(cudaMemsetAsync(dlse, 0xff, pr.lse.size() * 4, s));
                ops::sp_decode_attention(w, tq, tk, tv, tt, tl, max_seq_len, tout, tlse, s);
                download_and_check("eager call " + std::to_string(call), call % 2 == 1);
            }
            if (graph) {
                // The internal attention workspace is already large enough (the eager calls grew it).
                cudaGraph_t g = nullptr;
                WEFT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
                ops::sp_decode_attention(w, tq, tk, tv, tt, tl, max_seq_len, tout, tlse, s);
                WEFT_CUDA_CHECK(cudaStreamEndCapture(s, &g));
                cudaGraphExec_t exec = nullptr;
                WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
                WEFT_CUDA_CHECK(cudaGraphUpload(exec, s));
                w.sync_and_check(s);
                w.barrier();
                for (int r = 0; r < 3; ++r) {
                    set_v(r % 2 == 0);
                    WEFT_CUDA_CHECK(cudaMemsetAsync(dout, 0xff, pr.q.size() * 2, s));
                    WEFT_CUDA_CHECK(cudaMemsetAsync(dlse, 0xff, pr.lse.size() * 4, s));
                    WEFT_CUDA_CHECK(cudaGraphLaunch(exec, s));
                    download_and_check("graph replay " + std::to_string(r), r % 2 == 0);
                }
                WEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
                WEFT_CUDA_CHECK(cudaGraphDestroy(g));
            }
            w.sync_and_check(s);
            w.barrier();
            for (void* p : {dq, dk, dv, dt, dl, dout, dlse}) cudaFree(p);
            cudaStreamDestroy(s);
        },
        test_options(64ull << 20));
}

TEST(SpDecodeAttention, ShardedSequencesMatchTheWholeSequenceReference) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    std::random_device rd;
    const uint64_t seed = (uint64_t{rd()} << 20) ^ rd();
    std::printf("[ seed     ] %llu\n", static_cast<unsigned long long>(seed));
    for (int n : {1, 2, 3, 4, 5, 8}) {
        SCOPED_TRACE("world " + std::to_string(n));
        const Problem pr = make_problem(n, 4, 8, 2, {1, 3000, 0, 20000}, seed + static_cast<uint64_t>(n));
        run_sp(n, pr, n == 3);
    }
}

// 40 sequences x 32 q-heads exceed one LL buffer (rounds), 96/12 heads and GQA 8.
TEST(SpDecodeAttention, ManySequencesTakeSeveralRounds) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    const uint64_t seed = std::random_device{}();
    std::vector<int> lens(40);
    for (size_t i = 0; i < lens.size(); ++i) lens[i] = static_cast<int>(i * 37 % 400);
    const Problem pr = make_problem(2, 40, 32, 8, lens, seed);
    run_sp(2, pr, false);
    const Problem wide = make_problem(3, 6, 96, 12, {100, 0, 7, 2000, 1, 64}, seed + 1);
    run_sp(3, wide, false);
}

// A status given: a block-table entry outside one rank's cache poisons its sequence on every rank (a partial LSE of
// +inf), the other sequences stay exact, and only that rank records it, naming the sequence within the call: with the
// sequence shared among the ranks, held by the bad rank alone (every other rank's share empty: the +inf it pushes must
// stay +inf), in one split and in several, and in a later round of a batch that takes several.
TEST(SpDecodeAttention, ABadBlockTableEntryOnOneRankMakesItsSequenceNaNOnEveryRank) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    const uint64_t seed = std::random_device{}();
    std::printf("[ seed     ] %llu\n", static_cast<unsigned long long>(seed));
    // Sequence `b` of `pr`, every token on rank `r`.
    const auto all_on = [](Problem pr, int b, int r) {
        auto& c = pr.cuts[static_cast<size_t>(b)];
        const int len = pr.lens[static_cast<size_t>(b)];
        for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<int>(i) <= r ? 0 : len;
        return pr;
    };
    run_sp(1, make_problem(1, 3, 8, 2, {300, 50, 4000}, seed), false, 0, 2);
    const Problem pr3 = make_problem(3, 4, 8, 2, {1000, 3000, 5, 20000}, seed + 1);
    for (const int splits : {0, 1}) {
        SCOPED_TRACE("num_splits " + std::to_string(splits));
        run_sp(3, all_on(pr3, 3, 2), false, 2, 3, splits);
        run_sp(3, all_on(pr3, 1, 1), false, 1, 1, splits);
    }
    std::vector<int> lens(40);
    for (size_t i = 0; i < lens.size(); ++i) lens[i] = static_cast<int>(i * 37 % 400) + 1;
    run_sp(2, all_on(make_problem(2, 40, 32, 8, lens, seed + 2), 37, 1), false, 1, 37);
}

// Ranks that call with different batches (or head dims) are a call mismatch on every rank, named, not merged rows of
// unrelated calls (the tag each pushed row carries: AttentionPeerPush::tag). So is a rank whose call was refused by a
// check of its own (its max_seq_len past its block table) and that goes on: its next call is one call ahead of its
// peers' (every call counts in the team's sequence), not merged with the call they are in.
TEST(SpDecodeAttention, RanksThatCallDifferentlyAreAMismatchOnEveryRank) {
    if (!have_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::string("1M"));
    for (int scenario = 0; scenario < 3; ++scenario) {
        const bool dims_differ = scenario == 1, skipped = scenario == 2;
        SCOPED_TRACE(scenario == 0 ? "batch 8 against 4"
                     : dims_differ ? "head_dim 64 against 128"
                                   : "rank 1's call refused, then its next");
        const std::vector<std::string> messages = error_of_each_rank(2, [&](World& w) {
            const int batch = scenario == 0 && w.rank() == 1 ? 4 : 8;
            const int dim = dims_differ && w.rank() == 1 ? 64 : 128;
            const int hq = 32, hkv = 8, page = 16;
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            const size_t q_elems = static_cast<size_t>(batch) * hq * dim;
            const size_t kv_elems = static_cast<size_t>(batch) * page * hkv * dim;
            void *dq, *dk, *dv, *dt, *dl, *dout, *dlse;
            WEFT_CUDA_CHECK(cudaMalloc(&dq, q_elems * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dk, kv_elems * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dv, kv_elems * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dt, static_cast<size_t>(batch) * 4));
            WEFT_CUDA_CHECK(cudaMalloc(&dl, static_cast<size_t>(batch) * 4));
            WEFT_CUDA_CHECK(cudaMalloc(&dout, q_elems * 2));
            WEFT_CUDA_CHECK(cudaMalloc(&dlse, static_cast<size_t>(batch) * hq * 4));
            WEFT_CUDA_CHECK(cudaMemsetAsync(dq, 0, q_elems * 2, s));
            WEFT_CUDA_CHECK(cudaMemsetAsync(dk, 0, kv_elems * 2, s));
            WEFT_CUDA_CHECK(cudaMemsetAsync(dv, 0, kv_elems * 2, s));
            std::vector<int32_t> table(static_cast<size_t>(batch)), lens(static_cast<size_t>(batch), page);
            std::iota(table.begin(), table.end(), 0);
            WEFT_CUDA_CHECK(cudaMemcpyAsync(dt, table.data(), table.size() * 4, cudaMemcpyHostToDevice, s));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(dl, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice, s));
            ops::prepare_collectives(w);
            const auto free_all = [&] {
                // Every rank's abort reached every rank; then the World is usable again.
                std::this_thread::sleep_for(std::chrono::milliseconds(1500));
                w.clear_diagnostics();
                w.barrier();
                for (void* p : {dq, dk, dv, dt, dl, dout, dlse}) cudaFree(p);
                cudaStreamDestroy(s);
            };
            const auto call = [&](int64_t max_seq_len) {
                ops::sp_decode_attention(w, TensorView(dq, DType::kBF16, {batch, hq, dim}),
                                         TensorView(dk, DType::kBF16, {batch, page, hkv, dim}),
                                         TensorView(dv, DType::kBF16, {batch, page, hkv, dim}),
                                         TensorView(dt, DType::kI32, {batch, 1}), TensorView(dl, DType::kI32, {batch}),
                                         max_seq_len, TensorView(dout, DType::kBF16, {batch, hq, dim}),
                                         TensorView(dlse, DType::kF32, {batch, hq}), s);
            };
            try {
                if (skipped && w.rank() == 1) {
                    bool refused = false;
                    try {
                        call(page + 1);  // past the one page its block table holds: refused on this rank alone
                    } catch (const Error& e) {
                        refused = std::string(e.what()).find("exceeds what block_table holds") != std::string::npos;
                    }
                    WEFT_CHECK(refused, "rank 1's call with max_seq_len past its block table was not refused");
                }
                call(page);
                w.sync_and_check(s);
            } catch (...) {
                free_all();
                throw;
            }
            free_all();
        });
        for (int r = 0; r < 2; ++r) {
            const std::string& m = messages[static_cast<size_t>(r)];
            EXPECT_NE(m.find("collective call differs"), std::string::npos) << "rank " << r << ": " << m;
            EXPECT_NE(m.find("sp_decode_attention"), std::string::npos) << "rank " << r << ": " << m;
        }
    }
}

}  // namespace
}  // namespace weft::test
