// SPDX-License-Identifier: MIT
// All-to-all on the CPU: the per-round layout (offsets tile input and output exactly, staged chunks fit the staging
// half and stay 16-byte aligned), argument checks, and the Ulysses helpers' shape checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "weft/ops/all_to_all.hpp"
#include "weft/runtime/error.hpp"

namespace weft::ops {
namespace {

void* at(uintptr_t a) { return reinterpret_cast<void*>(a); }

// Every byte of input is sent exactly once and every byte of output received exactly once over all rounds.
void expect_tiles(const detail::AllToAllPlan& plan, int n, uint64_t in_bytes, uint64_t out_bytes, uint64_t capacity) {
    std::vector<int> sent(in_bytes, 0), got(out_bytes, 0);
    for (const AllToAllTable& t : plan.rounds) {
        uint64_t staged_end = 0;
        for (int q = 0; q < n; ++q) {
            for (uint64_t i = 0; i < t.send_bytes[q]; ++i) ++sent[t.send_offset[q] + i];
            for (uint64_t i = 0; i < t.recv_bytes[q]; ++i) ++got[t.recv_offset[q] + i];
            if (plan.staged) {
                EXPECT_EQ(t.source_offset[q] % 16, 0u);
                staged_end = std::max(staged_end, t.source_offset[q] + t.send_bytes[q]);
            } else {
                EXPECT_EQ(t.source_offset[q], t.send_offset[q]);
            }
        }
        if (plan.staged) {
            EXPECT_LE(staged_end, capacity);
        }
    }
    EXPECT_TRUE(std::all_of(sent.begin(), sent.end(), [](int c) { return c == 1; }));
    EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](int c) { return c == 1; }));
}

TEST(AllToAllPlan, EqualSplitsStagedInRoundsOrDirect) {
    for (int n : {1, 2, 3, 5, 8}) {
        for (int64_t per_peer : {1, 7, 1000, 5000}) {
            const int64_t count = per_peer * n;
            const TensorView in(at(0x100000), DType::kBF16, {count});
            const TensorView out(at(0x10000000), DType::kBF16, {count});
            const uint64_t capacity = 4096;
            const detail::AllToAllPlan staged = detail::plan_all_to_all(in, {}, out, {}, n, true, false, capacity);
            EXPECT_TRUE(staged.staged);
            const uint64_t chunk = static_cast<uint64_t>(per_peer) * 2;
            const uint64_t per_round = capacity / static_cast<uint64_t>(n) / 16 * 16;
            EXPECT_EQ(staged.rounds.size(), (chunk + per_round - 1) / per_round) << n << " " << per_peer;
            expect_tiles(staged, n, static_cast<uint64_t>(count) * 2, static_cast<uint64_t>(count) * 2, capacity);
            const detail::AllToAllPlan direct = detail::plan_all_to_all(in, {}, out, {}, n, true, true, capacity);
            EXPECT_FALSE(direct.staged);
            EXPECT_EQ(direct.rounds.size(), 1u);
            expect_tiles(direct, n, static_cast<uint64_t>(count) * 2, static_cast<uint64_t>(count) * 2, capacity);
        }
    }
    // Nothing to move: no kernel at all (the count is the same on every rank).
    const TensorView empty(at(0x100000), DType::kF32, {0});
    EXPECT_TRUE(detail::plan_all_to_all(empty, {}, empty, {}, 4, true, false, 4096).rounds.empty());
}

TEST(AllToAllPlan, UnevenSplitsIncludingZeros) {
    const std::vector<int64_t> send = {0, 5, 17, 0, 1};
    const std::vector<int64_t> recv = {3, 0, 0, 9, 2};
    const int64_t s = std::accumulate(send.begin(), send.end(), int64_t{0});
    const int64_t r = std::accumulate(recv.begin(), recv.end(), int64_t{0});
    const TensorView in(at(0x100000), DType::kF32, {s});
    const TensorView out(at(0x10000000), DType::kF32, {r});
    for (bool sym : {false, true}) {
        const detail::AllToAllPlan p = detail::plan_all_to_all(in, send, out, recv, 5, false, sym, 1 << 20);
        ASSERT_EQ(p.rounds.size(), 1u);  // every rank launches exactly one kernel, even with nothing to move
        expect_tiles(p, 5, static_cast<uint64_t>(s) * 4, static_cast<uint64_t>(r) * 4, 1 << 20);
        EXPECT_EQ(p.rounds[0].recv_offset[3], 12u);
        EXPECT_EQ(p.rounds[0].recv_bytes[4], 8u);
    }
    // All zero on this rank: still one kernel (peers meet it).
    const std::vector<int64_t> zeros(3, 0);
    const TensorView none(at(0x100000), DType::kF32, {0});
    EXPECT_EQ(detail::plan_all_to_all(none, zeros, none, zeros, 3, false, false, 4096).rounds.size(), 1u);
}

void expect_error(const std::function<void()>& f, const std::string& words) {
    try {
        f();
        ADD_FAILURE() << "accepted; expected an error mentioning " << words;
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
}

TEST(AllToAllArgs, BadArgumentsNameTheArgument) {
    const TensorView in(at(0x100000), DType::kBF16, {12});
    const TensorView out(at(0x10000000), DType::kBF16, {12});
    expect_error(
        [&] {
            detail::plan_all_to_all(in, {}, TensorView(at(0x10000000), DType::kBF16, {10}), {}, 4, true, false, 4096);
        },
        "output must have as many elements");
    expect_error([&] { detail::plan_all_to_all(in, {}, out, {}, 5, true, false, 4096); }, "multiple of num_ranks");
    expect_error(
        [&] {
            detail::plan_all_to_all(in, {}, TensorView(at(0x10000000), DType::kF16, {12}), {}, 4, true, false, 4096);
        },
        "same dtype");
    expect_error(
        [&] {
            detail::plan_all_to_all(in, {}, TensorView(at(0x100008), DType::kBF16, {12}), {}, 4, true, false, 4096);
        },
        "must not overlap");
    const std::vector<int64_t> three = {4, 4, 4};
    const std::vector<int64_t> bad = {4, -1, 9};
    const std::vector<int64_t> two = {6, 6};
    expect_error([&] { detail::plan_all_to_all(in, two, out, three, 3, false, false, 4096); }, "send_counts must have");
    expect_error([&] { detail::plan_all_to_all(in, three, out, two, 3, false, false, 4096); }, "recv_counts must have");
    expect_error([&] { detail::plan_all_to_all(in, bad, out, three, 3, false, false, 4096); }, "send_counts[1]");
    expect_error(
        [&] {
            detail::plan_all_to_all(in, three, TensorView(at(0x10000000), DType::kBF16, {11}), three, 3, false, false,
                                    4096);
        },
        "sum(recv_counts)");
    // A rank's count to itself must be its count from itself; counts whose bytes pass 2^62 are refused, not wrapped.
    const std::vector<int64_t> self_more = {4, 5, 3};
    expect_error([&] { detail::plan_all_to_all(in, three, out, self_more, 3, false, true, 4096, 1); },
                 "send_counts[1] (to this rank itself) must equal recv_counts[1] (from itself), got 4 and 5");
    EXPECT_NO_THROW(detail::plan_all_to_all(in, three, out, self_more, 3, false, true, 4096, 0));
    const std::vector<int64_t> one_more = {5};
    expect_error(
        [&] {
            detail::plan_all_to_all(TensorView(at(0x100000), DType::kBF16, {5}), one_more,
                                    TensorView(at(0x10000000), DType::kBF16, {3}), std::vector<int64_t>{3}, 1, false,
                                    true, 0, 0);
        },
        "send_counts[0]");
    const std::vector<int64_t> wrapping = {INT64_MAX, INT64_MAX, 2};
    expect_error([&] { detail::plan_all_to_all(in, wrapping, out, three, 3, false, true, 4096); },
                 "send_counts sums to more than 2^62 bytes");
    // A local input larger than the staging region: an error that says to use the symmetric heap.
    const std::vector<int64_t> big = {3000, 3000, 3000};
    const TensorView big_in(at(0x100000), DType::kBF16, {9000});
    expect_error(
        [&] {
            detail::plan_all_to_all(big_in, big, TensorView(at(0x10000000), DType::kBF16, {9000}), big, 3, false, false,
                                    4096);
        },
        "symmetric heap");
    EXPECT_NO_THROW(detail::plan_all_to_all(big_in, big, TensorView(at(0x10000000), DType::kBF16, {9000}), big, 3,
                                            false, true, 4096));
}

TEST(AllToAllArgs, HandMadeViewsAreRefused) {
    TensorView unknown(at(0x100000), DType::kBF16, {12});
    unknown.dtype = static_cast<DType>(99);
    const TensorView out(at(0x10000000), DType::kBF16, {12});
    expect_error([&] { detail::plan_all_to_all(unknown, {}, out, {}, 4, true, false, 4096); }, "unknown dtype");
    TensorView negative(at(0x100000), DType::kBF16, {3, 4});
    negative.shape = {-3, -4, 0, 0};
    expect_error([&] { detail::plan_all_to_all(negative, {}, out, {}, 4, true, false, 4096); }, "negative extent");
}

// Ulysses: shapes, scratch (large enough, overlapping neither view) and the all-to-all's own checks, before the
// helpers copy anything. S/W = 4 tokens, H = 8 heads, D = 16, W = 2.
TEST(AllToAllArgs, UlyssesChecksEveryArgumentFirst) {
    const TensorView seq(at(0x100000), DType::kBF16, {4, 8, 16});
    const TensorView head(at(0x200000), DType::kBF16, {8, 4, 16});
    const TensorView scratch(at(0x300000), DType::kBF16, {4 * 8 * 16});
    EXPECT_NO_THROW(detail::check_ulysses_args(seq, head, scratch, 2, true));
    EXPECT_NO_THROW(detail::check_ulysses_args(head, seq, scratch, 2, false));
    expect_error(
        [&] { detail::check_ulysses_args(seq, head, TensorView(at(0x100000 + 64), DType::kBF16, {512}), 2, true); },
        "scratch must overlap neither input nor output");
    expect_error(
        [&] { detail::check_ulysses_args(head, seq, TensorView(at(0x100000 + 64), DType::kBF16, {512}), 2, false); },
        "scratch must overlap neither input nor output");
    expect_error([&] { detail::check_ulysses_args(seq, head, TensorView(at(0x300000), DType::kBF16, {100}), 2, true); },
                 "scratch must be a contiguous buffer of at least 1024 bytes");
    expect_error(
        [&] {
            detail::check_ulysses_args(seq, TensorView(at(0x200000), DType::kBF16, {8, 8, 16}), scratch, 2, true);
        },
        "shapes do not match");
    expect_error([&] { detail::check_ulysses_args(seq, head, scratch, 3, true); }, "multiple of num_ranks");
    expect_error(
        [&] {
            detail::check_ulysses_args(TensorView(nullptr, DType::kBF16, {4, 8, 16}), head, scratch, 2, true);
        },
        "input and output must not be null");
    // The all-to-all's bound on the team (here more ranks than it serves).
    const int many = kMaxAllToAllRanks + 1;
    const TensorView seq_many(at(0x100000), DType::kBF16, {1, many, 16});
    const TensorView head_many(at(0x200000), DType::kBF16, {many, 1, 16});
    const TensorView scratch_many(at(0x300000), DType::kBF16, {many * 16});
    expect_error([&] { detail::check_ulysses_args(seq_many, head_many, scratch_many, many, true); },
                 "up to 64 ranks, got 65");
    // A team over several nodes has no such bound (its node stages keep it).
    EXPECT_NO_THROW(detail::check_ulysses_args(seq_many, head_many, scratch_many, many, true, 2));
}

}  // namespace
}  // namespace weft::ops
