// SPDX-License-Identifier: MIT
// Unit tests of the collectives' host logic (partitions, algorithm choice, grids, argument checks, descriptors)
// and NVRTC compilation of representative kernel specialisations for sm_90a. No GPU needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "support/error_text.hpp"
#include "support/jit_testing.hpp"
#include "weft/common/collectives.hpp"
#include "weft/detail/collectives.hpp"
#include "weft/jit/aot.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/runtime/diagnostics.hpp"
#include "weft/runtime/error.hpp"

namespace weft::ops {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * 1024;

using testing::error_of;

#define EXPECT_ERROR_MENTIONS(stmt, ...)                                               \
    do {                                                                               \
        const std::string weft_msg_ = error_of([&] { stmt; });                         \
        EXPECT_FALSE(weft_msg_.empty()) << #stmt " did not throw weft::Error";         \
        for (const char* weft_word_ : {__VA_ARGS__}) {                                 \
            EXPECT_NE(weft_msg_.find(weft_word_), std::string::npos)                   \
                << "message of " #stmt " lacks '" << weft_word_ << "': " << weft_msg_; \
        }                                                                              \
    } while (0)

CollectiveTopology topo(int n, int per_gpu = 1, int budget = 132) {
    CollectiveTopology t;
    t.num_ranks = n;
    t.max_ranks_per_gpu = per_gpu;
    t.grid_budget = budget;
    return t;
}

// ------------------------------------------------------------------------------------------------
// Partitions: the same pure code decides which block of which rank handles which elements.

TEST(CollectivesPartition, SplitSpanCoversContiguouslyAlignedAndBalanced) {
    for (uint64_t granule : {1u, 2u, 4u, 8u}) {
        for (uint64_t parts = 1; parts <= 9; ++parts) {
            for (uint64_t count = 0; count <= 300; ++count) {
                uint64_t expect_begin = 0;
                uint64_t min_units = ~0ull, max_units = 0;
                for (uint64_t i = 0; i < parts; ++i) {
                    const Span s = split_span(count, parts, i, granule);
                    ASSERT_EQ(s.begin, expect_begin) << "count " << count << " parts " << parts << " i " << i;
                    ASSERT_LE(s.begin, s.end);
                    ASSERT_TRUE(s.begin % granule == 0 || s.begin == count);
                    ASSERT_TRUE(s.end % granule == 0 || s.end == count);
                    const uint64_t units = (s.size() + granule - 1) / granule;
                    min_units = std::min(min_units, units);
                    max_units = std::max(max_units, units);
                    expect_begin = s.end;
                }
                ASSERT_EQ(expect_begin, count) << "count " << count << " parts " << parts;
                ASSERT_LE(max_units - min_units, 1u) << "count " << count << " parts " << parts;
            }
        }
    }
}

TEST(CollectivesPartition, SlicePartsTileTheMessageExactlyOnce) {
    for (uint64_t count : {1u, 7u, 8u, 9u, 100u, 1000u, 4099u}) {
        for (uint64_t slices : {2u, 3u, 5u, 8u}) {
            for (uint64_t parts : {1u, 3u, 16u}) {
                std::vector<int> hits(count, 0);
                for (uint64_t q = 0; q < slices; ++q) {
                    for (uint64_t b = 0; b < parts; ++b) {
                        const Span s = split_slice_part(count, slices, q, parts, b, 8);
                        for (uint64_t i = s.begin; i < s.end; ++i) ++hits[i];
                        EXPECT_TRUE(s.begin % 8 == 0 || s.empty());
                    }
                }
                for (uint64_t i = 0; i < count; ++i) {
                    ASSERT_EQ(hits[i], 1)
                        << "element " << i << " of " << count << ", " << slices << " slices, " << parts << " parts";
                }
            }
        }
    }
}

TEST(CollectivesPartition, LowLatencyFlagsNeverZeroAndChangeEveryEpoch) {
    for (uint64_t e : {0ull, 1ull, 2ull, 0xFFFFFFFDull, 0xFFFFFFFEull, 0xFFFFFFFFull, 0x100000000ull, 0x1FFFFFFFEull}) {
        EXPECT_NE(low_latency_flag(e), 0u) << e;
        EXPECT_NE(low_latency_flag(e), low_latency_flag(e + 1)) << e;
        EXPECT_NE(low_latency_flag(e), low_latency_flag(e + 2)) << e;
    }
}

// ------------------------------------------------------------------------------------------------
// Epochs: every collective kernel of a rank must run under an epoch of its own. BlockState checks it at each block's
// start (check_collective_start) before the kernel writes anything; this is the same check on a host model of one
// rank's CollectiveState.

TEST(CollectivesEpoch, ClaimsAndStartChecks) {
    const uint64_t d0 =
        detail::call_descriptor(CollectiveOp::kAllReduce, 1, DType::kBF16, 147527, {0, 131072, 0, ~0ull, ~0ull});
    const uint64_t d1 =
        detail::call_descriptor(CollectiveOp::kAllReduce, 1, DType::kBF16, 147527, {131072, 16455, 0, ~0ull, ~0ull});
    ASSERT_NE(d0 & 0xFFFFFFFFull, d1 & 0xFFFFFFFFull) << "the two launches of one call differ in the claimed bits";
    EXPECT_NE(collective_epoch_claim(0, 0), 0u) << "a claim is never the empty state";
    EXPECT_NE(collective_epoch_claim(7, d0), collective_epoch_claim(8, d0));
    EXPECT_NE(collective_epoch_claim(7, d0), collective_epoch_claim(7, d1));
    using S = CollectiveStart;
    EXPECT_EQ(check_collective_start(0, 0, d0, 0, 16), S::kOk) << "the first kernel";
    EXPECT_EQ(check_collective_start(collective_epoch_claim(6, d1), 7, d0, 0, 16), S::kOk) << "the epoch moved on";
    EXPECT_EQ(check_collective_start(collective_epoch_claim(7, d0), 7, d0, 5, 16), S::kOk)
        << "a block of the same kernel finished first";
    EXPECT_EQ(check_collective_start(collective_epoch_claim(7, d0), 7, d1, 0, 16), S::kEpochReused)
        << "launch 1 under launch 0's epoch";
    EXPECT_EQ(check_collective_start(collective_epoch_claim(7, d0), 7, d1, 16, 16), S::kDoneCount);
    EXPECT_EQ(check_collective_start(collective_epoch_claim(6, d1), 7, d0, 16, 16), S::kDoneCount);
    EXPECT_EQ(check_collective_start(collective_epoch_claim(7, d0), 7, d0, 15, 16), S::kOk)
        << "15 of its own blocks finished first";
    EXPECT_EQ(check_collective_start(collective_epoch_claim(6, d1), 7, d0, 15, 16), S::kDoneCount)
        << "15 blocks counted under another kernel's claim: a count left over (done is read before claim, with "
           "acquire, so this kernel's own finished blocks always show its claim)";
    EXPECT_EQ(check_collective_start(collective_epoch_claim(6, d1), 7, d0, 1, 1), S::kDoneCount);
    EXPECT_EQ(check_collective_start(collective_epoch_claim(6, d1), 7, d0, 1, 16), S::kDoneCount);
    EXPECT_EQ(collective_epoch_claim(6 + (1ull << 31), d0), collective_epoch_claim(6, d0))
        << "31 bits of the epoch: enough, since only consecutive kernels' claims meet";
}

// One rank's CollectiveState as BlockState uses it: every block reads epoch, claim and done at its start and checks
// them; at its end it stores the claim and counts itself done, and the last one advances the epoch.
struct RankStateModel {
    CollectiveState s{};
    struct Kernel {
        uint64_t descriptor;
        uint32_t grid;
        std::vector<uint64_t> epoch;  // per block, as read at its start
        uint32_t started = 0, finished = 0;
    };
    std::vector<CollectiveStart> found;  // every block start's check that was not kOk

    Kernel launch(uint64_t descriptor, uint32_t grid) { return Kernel{descriptor, grid, {}, 0, 0}; }
    // Block `k.started` starts; false when it found the state out of step (it then ends without finishing).
    bool start(Kernel& k) {
        k.epoch.push_back(s.epoch);
        ++k.started;
        const CollectiveStart c = check_collective_start(s.claim, s.epoch, k.descriptor, s.done, k.grid);
        if (c != CollectiveStart::kOk) found.push_back(c);
        return c == CollectiveStart::kOk;
    }
    uint32_t counted_past_grid = 0;  // finishes that found more blocks counted than the grid (a kGe record)
    void finish(Kernel& k, uint32_t block) {
        s.claim = collective_epoch_claim(k.epoch[block], k.descriptor);
        const uint32_t before = s.done++;
        if (before == k.grid - 1) {
            s.done = 0;
            s.epoch = k.epoch[block] + 1;
        } else if (before >= k.grid) {
            ++counted_past_grid;
        }
        ++k.finished;
    }
    // A whole kernel, its blocks starting and finishing in a shuffled order (some start after others finished).
    // Returns the epochs its blocks ran under, or an empty set when a block found the state out of step.
    std::set<uint64_t> run(uint64_t descriptor, uint32_t grid, uint64_t seed) {
        Kernel k = launch(descriptor, grid);
        std::vector<uint32_t> running;
        uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
        while (k.finished < grid) {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            if (k.started < grid && (running.empty() || (x & 1) != 0)) {
                running.push_back(k.started);
                if (!start(k)) return {};
            } else {
                const size_t i = (x >> 8) % running.size();
                finish(k, running[i]);
                running.erase(running.begin() + static_cast<std::ptrdiff_t>(i));
            }
        }
        return std::set<uint64_t>(k.epoch.begin(), k.epoch.end());
    }
};

TEST(CollectivesEpoch, ConsecutiveKernelsEachRunUnderAnEpochOfTheirOwnAndNothingFires) {
    RankStateModel m;
    uint64_t last = ~0ull;
    for (uint64_t i = 0; i < 2000; ++i) {
        const uint32_t grid = 1 + static_cast<uint32_t>((i * 7) % 64);
        // Identical calls back to back, as well as different ones.
        const uint64_t d =
            detail::call_descriptor(CollectiveOp::kAllReduce, 1, DType::kBF16, 1000 + (i / 2) % 3, {(i / 2) % 5});
        const std::set<uint64_t> epochs = m.run(d, grid, i);
        ASSERT_EQ(epochs.size(), 1u) << "kernel " << i << ": every block under one epoch";
        EXPECT_NE(*epochs.begin(), last) << "kernel " << i;
        last = *epochs.begin();
        EXPECT_EQ(last, i);
        EXPECT_EQ(m.s.done, 0u);
    }
    EXPECT_TRUE(m.found.empty());
}

TEST(CollectivesEpoch, ALostAdvanceIsFoundBeforeTheNextKernelWritesAnything) {
    const uint64_t d0 = detail::call_descriptor(CollectiveOp::kAllReduce, 1, DType::kBF16, 147527, {0, 131072});
    const uint64_t d1 = detail::call_descriptor(CollectiveOp::kAllReduce, 1, DType::kBF16, 147527, {131072, 16455});
    const auto prepared = [] {
        RankStateModel m;
        for (uint64_t i = 0; i < 10; ++i) {
            m.run(detail::call_descriptor(CollectiveOp::kReduceScatter, 1, DType::kF32, 99, {i}), 4, i);
        }
        return m;
    };
    {  // Another grid's worth of blocks counted while launch 0 runs (a kernel of this rank on another stream, say):
       // its last block never sees the count it advances at, and the count left behind stops launch 1.
        RankStateModel m = prepared();
        RankStateModel::Kernel k = m.launch(d0, 16);
        for (uint32_t b = 0; b < 16; ++b) ASSERT_TRUE(m.start(k));
        m.s.done += 16;
        for (uint32_t b = 0; b < 16; ++b) m.finish(k, b);
        EXPECT_EQ(m.s.epoch, 10u) << "the advance was lost";
        EXPECT_EQ(m.counted_past_grid, 16u) << "each block's end saw it too";
        RankStateModel::Kernel k1 = m.launch(d1, 16);
        EXPECT_FALSE(m.start(k1)) << "launch 1's first block ends before it sends";
        EXPECT_EQ(m.found.back(), CollectiveStart::kDoneCount);
    }
    {  // The count reset while launch 0 runs: too few blocks counted, no advance, launch 1 under launch 0's epoch.
        RankStateModel m = prepared();
        RankStateModel::Kernel k = m.launch(d0, 16);
        for (uint32_t b = 0; b < 16; ++b) ASSERT_TRUE(m.start(k));
        for (uint32_t b = 0; b < 8; ++b) m.finish(k, b);
        m.s.done = 0;
        for (uint32_t b = 8; b < 16; ++b) m.finish(k, b);
        EXPECT_EQ(m.s.epoch, 10u);
        RankStateModel::Kernel k1 = m.launch(d1, 16);
        EXPECT_FALSE(m.start(k1));
        EXPECT_EQ(m.found.back(), CollectiveStart::kEpochReused);
    }
    {  // The epoch word written back after the advance.
        RankStateModel m = prepared();
        m.run(d0, 16, 1);
        m.s.epoch -= 1;
        RankStateModel::Kernel k1 = m.launch(d1, 16);
        EXPECT_FALSE(m.start(k1));
        EXPECT_EQ(m.found.back(), CollectiveStart::kEpochReused);
    }
    {  // A count left over from before (blocks of an earlier kernel counted but never advanced): found at the start.
        RankStateModel m = prepared();
        m.s.done = 16;
        RankStateModel::Kernel k = m.launch(d0, 16);
        EXPECT_FALSE(m.start(k));
        EXPECT_EQ(m.found.back(), CollectiveStart::kDoneCount);
    }
    {  // One count too many while launch 0 runs, and the epoch still advances (at its second-to-last block): the count
       // left behind is below any grid and the claim is launch 0's under an older epoch, so only the count's claim
       // gives it away. Unchecked, launch 1 would advance the epoch one block early: a block of it that starts after
       // that runs under the next epoch, its lines under a flag its peers' blocks do not wait for.
        RankStateModel m = prepared();
        RankStateModel::Kernel k = m.launch(d0, 16);
        for (uint32_t b = 0; b < 16; ++b) ASSERT_TRUE(m.start(k));
        m.s.done += 1;
        for (uint32_t b = 0; b < 16; ++b) m.finish(k, b);
        EXPECT_EQ(m.s.epoch, 11u) << "advanced, at the 15th block";
        EXPECT_EQ(m.s.done, 1u) << "the extra count stays";
        EXPECT_EQ(m.counted_past_grid, 0u) << "no end saw a count past the grid";
        RankStateModel::Kernel k1 = m.launch(d1, 16);
        EXPECT_FALSE(m.start(k1)) << "launch 1's first block ends before it sends";
        EXPECT_EQ(m.found.back(), CollectiveStart::kDoneCount);
        RankStateModel::Kernel k2 = m.launch(d1, 1);
        EXPECT_FALSE(m.start(k2)) << "and a one-block kernel (the copy-engine entry) too";
    }
    {  // A kernel whose every block ended before finishing (an LL call mismatch) leaves no claim and no count: this
       // check does not fire on the next kernel for that reason.
        RankStateModel m = prepared();
        RankStateModel::Kernel k = m.launch(d0, 16);
        for (uint32_t b = 0; b < 16; ++b) ASSERT_TRUE(m.start(k));  // each then exits at its descriptor check
        EXPECT_EQ(m.run(d1, 16, 3), std::set<uint64_t>{10});
        EXPECT_EQ(m.found.size(), 0u);
    }
}

TEST(CollectivesEpoch, TheDiagnosticNamesTheCallTheEpochAndTheCause) {
    const uint64_t d0 = detail::call_descriptor(CollectiveOp::kAllReduce, 1, DType::kBF16, 147527, {0, 131072});
    const uint64_t d1 = detail::call_descriptor(CollectiveOp::kAllReduce, 1, DType::kBF16, 147527, {131072, 16455});
    Diagnostic d{};
    d.claimed = 2;
    d.kind = SpinKind::kCollectiveEpoch;
    d.cmp = Cmp::kNe;
    d.rank = 5;
    d.peer = -1;
    d.block_x = 3;
    d.expected = d1;
    d.observed = collective_epoch_claim(5371, d0);
    d.waited_ns = 5371ull << 16 | 7;
    std::string m = format_diagnostic(d);
    for (const char* word : {"rank 5 block (3,0,0)", "out of step", "all_reduce (ll) of 147527 bf16 elements",
                             "epoch 5371,", "already finished", "not advanced", "7 blocks counted done",
                             "replace the World"}) {
        EXPECT_NE(m.find(word), std::string::npos) << "'" << word << "' not in: " << m;
    }
    d.cmp = Cmp::kLt;
    d.observed = 16ull << 32 | 17;
    m = format_diagnostic(d);
    for (const char* word : {"17 blocks were counted done before it started", "grid of 16", "miscounted"}) {
        EXPECT_NE(m.find(word), std::string::npos) << "'" << word << "' not in: " << m;
    }
    d.cmp = Cmp::kGe;
    d.observed = 16ull << 32 | 16;
    m = format_diagnostic(d);
    for (const char* word : {"counted 17 blocks done at its end", "grid of 16", "did not advance the epoch"}) {
        EXPECT_NE(m.find(word), std::string::npos) << "'" << word << "' not in: " << m;
    }
    EXPECT_STREQ(spin_kind_name(SpinKind::kCollectiveEpoch), "collective_epoch");
}

TEST(AllToAllCounts, TheDiagnosticNamesBothCountsAndThePeer) {
    Diagnostic d{};
    d.claimed = 2;
    d.kind = SpinKind::kAllToAllCounts;
    d.cmp = Cmp::kEq;
    d.rank = 1;
    d.peer = 2;
    d.block_x = 4;
    d.expected = 7000;
    d.observed = 5000;
    d.line = 70;
    const std::string m = format_diagnostic(d);
    for (const char* word : {"rank 1 block (4,0,0)", "all_to_all_v counts differ", "expects 7000 bytes from rank 2",
                             "sends it 5000 bytes", "read nothing", "source line 70"}) {
        EXPECT_NE(m.find(word), std::string::npos) << "'" << word << "' not in: " << m;
    }
    EXPECT_STREQ(spin_kind_name(SpinKind::kAllToAllCounts), "all_to_all_counts");
}

TEST(CollectivesPartition, RankBucketsAndConfigValidity) {
    EXPECT_EQ(collective_rank_bucket(2), 8);
    EXPECT_EQ(collective_rank_bucket(8), 8);
    EXPECT_EQ(collective_rank_bucket(9), 16);
    EXPECT_EQ(collective_rank_bucket(64), 64);
    EXPECT_EQ(collective_rank_bucket(65), 0);
    EXPECT_TRUE(is_valid(ReduceKernelConfig{}));
    EXPECT_TRUE(
        is_valid(ReduceKernelConfig{.dtype = DType::kF32, .max_ranks = 64, .vec_bytes = 4, .block_threads = 64}));
    EXPECT_FALSE(is_valid(ReduceKernelConfig{.dtype = DType::kF32, .vec_bytes = 2}));  // narrower than an element
    EXPECT_FALSE(is_valid(ReduceKernelConfig{.dtype = DType::kI32}));
    EXPECT_FALSE(is_valid(ReduceKernelConfig{.max_ranks = 12}));
    EXPECT_FALSE(is_valid(ReduceKernelConfig{.max_ranks = 64, .block_threads = 32}));
    EXPECT_TRUE(is_valid(CopyKernelConfig{.max_ranks = 8, .vec_bytes = 1, .block_threads = 32}));
    EXPECT_FALSE(is_valid(CopyKernelConfig{.vec_bytes = 3}));
    EXPECT_FALSE(is_valid(CopyKernelConfig{.block_threads = 100}));
}

// ------------------------------------------------------------------------------------------------
// Algorithm names, selection and resolution.

TEST(CollectivesSelect, NamesRoundTrip) {
    for (auto a :
         {AllReduceAlgo::kAuto, AllReduceAlgo::kLowLatency, AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot}) {
        EXPECT_EQ(parse_all_reduce_algo(algo_name(a)), a);
    }
    for (auto a : {AllGatherAlgo::kAuto, AllGatherAlgo::kLowLatency, AllGatherAlgo::kSmPush,
                   AllGatherAlgo::kCopyEnginePull, AllGatherAlgo::kCopyEnginePush}) {
        EXPECT_EQ(parse_all_gather_algo(algo_name(a)), a);
    }
    for (auto a : {ReduceScatterAlgo::kAuto, ReduceScatterAlgo::kSmPull, ReduceScatterAlgo::kLowLatency}) {
        EXPECT_EQ(parse_reduce_scatter_algo(algo_name(a)), a);
    }
    EXPECT_EQ(parse_reduce_scatter_algo("sm_pull"), ReduceScatterAlgo::kSmPull);
    EXPECT_EQ(parse_reduce_scatter_algo("ll"), ReduceScatterAlgo::kLowLatency);
    EXPECT_STREQ(algo_name(ReduceScatterAlgo::kLowLatency), "ll");
    EXPECT_FALSE(parse_reduce_scatter_algo("low_latency").has_value());
    EXPECT_FALSE(parse_all_reduce_algo("oneshot").has_value());
    EXPECT_FALSE(parse_all_gather_algo("").has_value());
    EXPECT_STREQ(algo_name(AllReduceAlgo::kTwoShot), "two_shot");
}

TEST(CollectivesSelect, LowLatencyThresholdShrinksWithTheWorld) {
    EXPECT_EQ(low_latency_threshold_bytes(topo(2)), 256 * kKiB);
    EXPECT_EQ(low_latency_threshold_bytes(topo(4)), 128 * kKiB);
    EXPECT_EQ(low_latency_threshold_bytes(topo(8)), 64 * kKiB);
    EXPECT_EQ(low_latency_threshold_bytes(topo(64)), 16 * kKiB);
    CollectiveTopology small = topo(2);
    small.low_latency_capacity_bytes = 32 * kKiB;
    EXPECT_EQ(low_latency_threshold_bytes(small), 32 * kKiB);  // never above what the LL buffers hold
}

TEST(CollectivesSelect, AllReduceBySizeAndWorld) {
    // 8 ranks: LL <= 64 KiB, one-shot <= 256 KiB, then two-shot.
    EXPECT_EQ(select_all_reduce_algo(8, topo(8)), AllReduceAlgo::kLowLatency);
    EXPECT_EQ(select_all_reduce_algo(16 * kKiB, topo(8)), AllReduceAlgo::kLowLatency);
    EXPECT_EQ(select_all_reduce_algo(64 * kKiB, topo(8)), AllReduceAlgo::kLowLatency);
    EXPECT_EQ(select_all_reduce_algo(64 * kKiB + 2, topo(8)), AllReduceAlgo::kOneShot);
    EXPECT_EQ(select_all_reduce_algo(256 * kKiB, topo(8)), AllReduceAlgo::kOneShot);
    EXPECT_EQ(select_all_reduce_algo(256 * kKiB + 2, topo(8)), AllReduceAlgo::kTwoShot);
    EXPECT_EQ(select_all_reduce_algo(256 * kMiB, topo(8)), AllReduceAlgo::kTwoShot);
    // 2 ranks: one-shot up to 1 MiB too (two-shot wins from a few MiB: kernels/all_reduce/README.md).
    EXPECT_EQ(select_all_reduce_algo(256 * kKiB, topo(2)), AllReduceAlgo::kLowLatency);
    EXPECT_EQ(select_all_reduce_algo(1 * kMiB, topo(2)), AllReduceAlgo::kOneShot);
    EXPECT_EQ(select_all_reduce_algo(1 * kMiB + 2, topo(2)), AllReduceAlgo::kTwoShot);
    EXPECT_EQ(select_all_reduce_algo(1024 * kMiB, topo(2)), AllReduceAlgo::kTwoShot);
    // 3 and 4 ranks: one-shot up to 1 MiB.
    EXPECT_EQ(select_all_reduce_algo(1 * kMiB, topo(3)), AllReduceAlgo::kOneShot);
    EXPECT_EQ(select_all_reduce_algo(1 * kMiB + 2, topo(4)), AllReduceAlgo::kTwoShot);
}

TEST(CollectivesSelect, AllGatherByShardOutputAndSharing) {
    EXPECT_EQ(select_all_gather_algo(4 * kKiB, topo(8), false), AllGatherAlgo::kLowLatency);
    EXPECT_EQ(select_all_gather_algo(4 * kKiB, topo(8), true), AllGatherAlgo::kLowLatency);
    EXPECT_EQ(select_all_gather_algo(1 * kMiB, topo(8), false), AllGatherAlgo::kCopyEnginePull);
    EXPECT_EQ(select_all_gather_algo(1 * kMiB, topo(8), true), AllGatherAlgo::kSmPush);
    EXPECT_EQ(select_all_gather_algo(8 * kMiB - 16, topo(8), true), AllGatherAlgo::kSmPush);  // < 64 MiB gathered
    EXPECT_EQ(select_all_gather_algo(8 * kMiB, topo(8), true), AllGatherAlgo::kCopyEnginePush);
    EXPECT_EQ(select_all_gather_algo(8 * kMiB + 16, topo(8), true), AllGatherAlgo::kCopyEnginePush);
    EXPECT_EQ(select_all_gather_algo(64 * kMiB, topo(8, 8), true), AllGatherAlgo::kSmPush);  // ranks share a GPU
    EXPECT_EQ(select_all_gather_algo(64 * kMiB, topo(8, 8), false), AllGatherAlgo::kCopyEnginePull);
}

TEST(CollectivesSelect, ReduceScatterByOutputBytesAndWorld) {
    // LL up to the all-reduce's LL threshold, counted in output (per-rank) bytes; SM pull above.
    for (int n : {2, 3, 4, 5, 8, 16, 64}) {
        const auto t = topo(n);
        const uint64_t ll_max = low_latency_threshold_bytes(t);
        EXPECT_EQ(select_reduce_scatter_algo(2, t), ReduceScatterAlgo::kLowLatency) << n;
        EXPECT_EQ(select_reduce_scatter_algo(4 * kKiB, t), ReduceScatterAlgo::kLowLatency) << n;
        EXPECT_EQ(select_reduce_scatter_algo(ll_max, t), ReduceScatterAlgo::kLowLatency) << n;
        EXPECT_EQ(select_reduce_scatter_algo(ll_max + 2, t), ReduceScatterAlgo::kSmPull) << n;
        EXPECT_EQ(select_reduce_scatter_algo(256 * kMiB, t), ReduceScatterAlgo::kSmPull) << n;
    }
    EXPECT_EQ(select_reduce_scatter_algo(256 * kKiB, topo(2)), ReduceScatterAlgo::kLowLatency);
    EXPECT_EQ(select_reduce_scatter_algo(256 * kKiB + 2, topo(2)), ReduceScatterAlgo::kSmPull);
    EXPECT_EQ(select_reduce_scatter_algo(64 * kKiB, topo(8)), ReduceScatterAlgo::kLowLatency);
    EXPECT_EQ(select_reduce_scatter_algo(64 * kKiB + 2, topo(8)), ReduceScatterAlgo::kSmPull);
    EXPECT_EQ(select_reduce_scatter_algo(1 * kKiB, topo(3)), ReduceScatterAlgo::kLowLatency);
    // Ranks sharing a GPU: the same rule (the choice depends only on agreed facts).
    EXPECT_EQ(select_reduce_scatter_algo(16 * kKiB, topo(4, 4, 33)), ReduceScatterAlgo::kLowLatency);
    // Never above what the LL buffers hold in one kernel (larger forced LL calls run in rounds).
    CollectiveTopology small = topo(2);
    small.low_latency_capacity_bytes = 32 * kKiB;
    EXPECT_EQ(select_reduce_scatter_algo(32 * kKiB, small), ReduceScatterAlgo::kLowLatency);
    EXPECT_EQ(select_reduce_scatter_algo(32 * kKiB + 2, small), ReduceScatterAlgo::kSmPull);
}

TEST(CollectivesSelect, ArgumentBeatsEnvironmentBeatsAutomatic) {
    const auto t = topo(8);
    EXPECT_EQ(resolve_all_reduce_algo(AllReduceAlgo::kTwoShot, std::string("ll"), 8, t), AllReduceAlgo::kTwoShot);
    EXPECT_EQ(resolve_all_reduce_algo(AllReduceAlgo::kAuto, std::string("one_shot"), 8, t), AllReduceAlgo::kOneShot);
    EXPECT_EQ(resolve_all_reduce_algo(AllReduceAlgo::kAuto, std::string("auto"), 8, t), AllReduceAlgo::kLowLatency);
    EXPECT_EQ(resolve_all_reduce_algo(AllReduceAlgo::kAuto, std::nullopt, 64 * kMiB, t), AllReduceAlgo::kTwoShot);
    EXPECT_ERROR_MENTIONS(resolve_all_reduce_algo(AllReduceAlgo::kAuto, std::string("fast"), 8, t),
                          "WEFT_ALLREDUCE_ALGO", "fast", "two_shot");
    EXPECT_EQ(resolve_all_gather_algo(AllGatherAlgo::kAuto, std::string("ce_push"), 8, t, true),
              AllGatherAlgo::kCopyEnginePush);
    EXPECT_EQ(resolve_all_gather_algo(AllGatherAlgo::kSmPush, std::string("ce_push"), 8, t, true),
              AllGatherAlgo::kSmPush);
    EXPECT_ERROR_MENTIONS(resolve_all_gather_algo(AllGatherAlgo::kAuto, std::string("ring"), 8, t, true),
                          "WEFT_ALLGATHER_ALGO", "ce_pull");
    EXPECT_ERROR_MENTIONS(resolve_reduce_scatter_algo(ReduceScatterAlgo::kAuto, std::string("x"), 8, t),
                          "WEFT_REDUCESCATTER_ALGO", "sm_pull", "ll");
    EXPECT_EQ(resolve_reduce_scatter_algo(ReduceScatterAlgo::kAuto, std::string("ll"), 64 * kMiB, t),
              ReduceScatterAlgo::kLowLatency);
    EXPECT_EQ(resolve_reduce_scatter_algo(ReduceScatterAlgo::kAuto, std::string("sm_pull"), 8, t),
              ReduceScatterAlgo::kSmPull);
    EXPECT_EQ(resolve_reduce_scatter_algo(ReduceScatterAlgo::kSmPull, std::string("ll"), 8, t),
              ReduceScatterAlgo::kSmPull);
    EXPECT_EQ(resolve_reduce_scatter_algo(ReduceScatterAlgo::kAuto, std::string("auto"), 8, t),
              ReduceScatterAlgo::kLowLatency);
    EXPECT_EQ(resolve_reduce_scatter_algo(ReduceScatterAlgo::kAuto, std::nullopt, 8, t),
              ReduceScatterAlgo::kLowLatency);
    EXPECT_EQ(resolve_reduce_scatter_algo(ReduceScatterAlgo::kAuto, std::nullopt, 64 * kMiB, t),
              ReduceScatterAlgo::kSmPull);
}

TEST(CollectivesSelect, GridsStayWithinBudgetAndCaps) {
    for (int budget : {1, 16, 33, 132, 1000}) {
        const auto t = topo(8, 1, budget);
        for (uint64_t bytes : {1ull, 8ull, 4096ull, 65536ull, 1ull << 20, 1ull << 28}) {
            for (auto a : {AllReduceAlgo::kLowLatency, AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot}) {
                const int g = all_reduce_grid(a, bytes, t);
                EXPECT_GE(g, 1);
                EXPECT_LE(g, std::min(budget, 64));
                EXPECT_LE(g, static_cast<int>(kMaxCollectiveBlocks));
            }
            for (auto a : {AllGatherAlgo::kLowLatency, AllGatherAlgo::kSmPush, AllGatherAlgo::kCopyEnginePull}) {
                const int g = all_gather_grid(a, bytes, t);
                EXPECT_GE(g, 1);
                EXPECT_LE(g, std::min(budget, 64));
            }
            for (auto a : {ReduceScatterAlgo::kSmPull, ReduceScatterAlgo::kLowLatency}) {
                const int g = reduce_scatter_grid(a, bytes, t);
                EXPECT_GE(g, 1);
                EXPECT_LE(g, std::min(budget, 64));
            }
            EXPECT_LE(reduce_scatter_grid(ReduceScatterAlgo::kLowLatency, bytes, t), std::min(budget, 32));
        }
    }
    // Grids grow with the message (more parallel reads), up to the cap.
    const auto t = topo(8);
    EXPECT_LT(all_reduce_grid(AllReduceAlgo::kTwoShot, 1 * kMiB, t),
              all_reduce_grid(AllReduceAlgo::kTwoShot, 64 * kMiB, t));
    EXPECT_EQ(all_reduce_grid(AllReduceAlgo::kOneShot, 8, t), 1);
    EXPECT_ERROR_MENTIONS(all_reduce_grid(AllReduceAlgo::kAuto, 8, t), "auto");
    EXPECT_ERROR_MENTIONS(reduce_scatter_grid(ReduceScatterAlgo::kAuto, 8, t), "auto");
    // LL reduce-scatter: a line of output per thread (256 threads x 8 bytes = 2 KiB a block), as the LL all-reduce.
    EXPECT_EQ(reduce_scatter_grid(ReduceScatterAlgo::kLowLatency, 8, t), 1);
    EXPECT_EQ(reduce_scatter_grid(ReduceScatterAlgo::kLowLatency, 2 * kKiB, t), 1);
    EXPECT_EQ(reduce_scatter_grid(ReduceScatterAlgo::kLowLatency, 2 * kKiB + 2, t), 2);
    EXPECT_EQ(reduce_scatter_grid(ReduceScatterAlgo::kLowLatency, 16 * kKiB, t), 8);
    EXPECT_EQ(reduce_scatter_grid(ReduceScatterAlgo::kLowLatency, 256 * kKiB, t), 32);
    EXPECT_EQ(reduce_scatter_grid(ReduceScatterAlgo::kLowLatency, 16 * kKiB, topo(2, 2, 5)), 5);  // SM budget
    for (uint64_t bytes : {uint64_t{8}, uint64_t{4096}, 64 * kKiB, 256 * kKiB}) {
        EXPECT_EQ(reduce_scatter_grid(ReduceScatterAlgo::kLowLatency, bytes, t),
                  all_reduce_grid(AllReduceAlgo::kLowLatency, bytes, t));
    }
}

// ------------------------------------------------------------------------------------------------
// Argument checks (the paths that need no GPU).

TensorView view(uintptr_t addr, DType t, int64_t n) { return TensorView(reinterpret_cast<void*>(addr), t, {n}); }

TEST(CollectivesArgs, AllReduceChecks) {
    using detail::check_all_reduce_args;
    const uintptr_t a = 0x10000, b = 0x80000;
    EXPECT_NO_THROW(check_all_reduce_args(view(a, DType::kBF16, 100), view(b, DType::kBF16, 100)));
    EXPECT_NO_THROW(check_all_reduce_args(view(a, DType::kF32, 100), view(a, DType::kF32, 100)));  // in place
    EXPECT_NO_THROW(check_all_reduce_args(view(0, DType::kF32, 0), view(0, DType::kF32, 0)));      // empty
    EXPECT_ERROR_MENTIONS(check_all_reduce_args(view(a, DType::kBF16, 100), view(b, DType::kF16, 100)), "dtype", "bf16",
                          "f16");
    EXPECT_ERROR_MENTIONS(check_all_reduce_args(view(a, DType::kI32, 4), view(b, DType::kI32, 4)), "bf16, f16 or f32",
                          "i32");
    EXPECT_ERROR_MENTIONS(check_all_reduce_args(view(a, DType::kF32, 100), view(b, DType::kF32, 99)), "output", "100",
                          "99");
    EXPECT_ERROR_MENTIONS(check_all_reduce_args(view(a, DType::kF32, 100), view(a + 8, DType::kF32, 100)),
                          "partly overlap");
    EXPECT_ERROR_MENTIONS(check_all_reduce_args(view(0, DType::kF32, 5), view(b, DType::kF32, 5)), "input", "null");
    EXPECT_ERROR_MENTIONS(check_all_reduce_args(view(a + 1, DType::kF16, 5), view(b, DType::kF16, 5)), "input",
                          "aligned");
    const TensorView strided(reinterpret_cast<void*>(a), DType::kF32, {4, 4}, {8, 1});
    EXPECT_ERROR_MENTIONS(check_all_reduce_args(strided, view(b, DType::kF32, 16)), "input", "contiguous");
}

TEST(CollectivesArgs, AllGatherChecks) {
    using detail::check_all_gather_args;
    const uintptr_t a = 0x10000, b = 0x80000;
    EXPECT_NO_THROW(check_all_gather_args(view(a, DType::kU8, 7), view(b, DType::kU8, 21), 3, 1));
    // In place: input is this rank's slot of the output.
    EXPECT_NO_THROW(check_all_gather_args(view(b + 2 * 14, DType::kBF16, 7), view(b, DType::kBF16, 21), 3, 2));
    EXPECT_ERROR_MENTIONS(check_all_gather_args(view(b + 14, DType::kBF16, 7), view(b, DType::kBF16, 21), 3, 2), "slot",
                          "overlap");
    EXPECT_ERROR_MENTIONS(check_all_gather_args(view(a, DType::kU8, 7), view(b, DType::kU8, 20), 3, 0), "num_ranks (3)",
                          "21", "20");
    EXPECT_ERROR_MENTIONS(check_all_gather_args(view(a, DType::kU8, 7), view(b, DType::kI32, 21), 3, 0), "dtype");
    EXPECT_ERROR_MENTIONS(detail::check_all_gather_output(AllGatherAlgo::kSmPush, false), "sm_push", "symmetric heap");
    EXPECT_ERROR_MENTIONS(detail::check_all_gather_output(AllGatherAlgo::kCopyEnginePush, false), "ce_push");
    EXPECT_NO_THROW(detail::check_all_gather_output(AllGatherAlgo::kCopyEnginePull, false));
    EXPECT_NO_THROW(detail::check_all_gather_output(AllGatherAlgo::kSmPush, true));
}

TEST(CollectivesArgs, ReduceScatterChecks) {
    using detail::check_reduce_scatter_args;
    const uintptr_t a = 0x10000, b = 0x80000;
    EXPECT_NO_THROW(check_reduce_scatter_args(view(a, DType::kF16, 30), view(b, DType::kF16, 10), 3, 0));
    EXPECT_NO_THROW(check_reduce_scatter_args(view(a, DType::kF16, 30), view(a + 20, DType::kF16, 10), 3, 1));
    EXPECT_ERROR_MENTIONS(check_reduce_scatter_args(view(a, DType::kF16, 30), view(a + 20, DType::kF16, 10), 3, 2),
                          "slice", "overlap");
    EXPECT_ERROR_MENTIONS(check_reduce_scatter_args(view(a, DType::kF16, 31), view(b, DType::kF16, 10), 3, 0), "input",
                          "30", "31");
    EXPECT_ERROR_MENTIONS(check_reduce_scatter_args(view(a, DType::kU8, 30), view(b, DType::kU8, 10), 3, 0), "u8");
}

// Views set up by hand (the fields are public) and options out of their enums: clear errors, never a division by an
// unknown dtype's zero size, a count made positive by two negative extents, or a fall-through to a default kernel.
TEST(CollectivesArgs, HandMadeViewsAndUnknownAlgorithmsAreRefused) {
    const uintptr_t a = 0x10000, b = 0x80000;
    TensorView unknown = view(a, DType::kF32, 8);
    unknown.dtype = static_cast<DType>(42);
    EXPECT_ERROR_MENTIONS(detail::check_all_gather_args(unknown, view(b, DType::kF32, 16), 2, 0), "input",
                          "unknown dtype", "42");
    EXPECT_ERROR_MENTIONS(detail::check_all_reduce_args(view(a, DType::kF32, 8), unknown), "output", "unknown dtype");
    TensorView negative(reinterpret_cast<void*>(a), DType::kF32, {2, 3});
    negative.shape = {-2, -3, 0, 0};  // numel() = 6
    EXPECT_ERROR_MENTIONS(detail::check_all_reduce_args(negative, view(b, DType::kF32, 6)), "input", "negative extent");
    EXPECT_ERROR_MENTIONS(detail::check_reduce_scatter_args(view(a, DType::kF32, 12), negative, 2, 0), "output",
                          "negative extent");
    TensorView too_many = view(a, DType::kF32, 8);
    too_many.ndim = 6;
    EXPECT_ERROR_MENTIONS(detail::check_all_reduce_args(too_many, view(b, DType::kF32, 8)), "input",
                          "0 to 4 dimensions, got 6");

    EXPECT_ERROR_MENTIONS(detail::check_algo_option(static_cast<AllReduceAlgo>(7)), "all_reduce", "options.algo",
                          "auto, ll, one_shot, two_shot", "7");
    EXPECT_ERROR_MENTIONS(detail::check_algo_option(static_cast<AllGatherAlgo>(-1)), "all_gather", "options.algo",
                          "ce_push");
    EXPECT_ERROR_MENTIONS(detail::check_algo_option(static_cast<ReduceScatterAlgo>(3)), "reduce_scatter",
                          "options.algo", "sm_pull");
    EXPECT_NO_THROW(detail::check_algo_option(AllReduceAlgo::kTwoShot));
    EXPECT_NO_THROW(detail::check_algo_option(AllGatherAlgo::kAuto));
    EXPECT_NO_THROW(detail::check_algo_option(ReduceScatterAlgo::kLowLatency));
    // The pure resolution refuses them too (it used to return them, and the op fell through to a default kernel).
    const CollectiveTopology t = topo(4);
    EXPECT_ERROR_MENTIONS(resolve_all_reduce_algo(static_cast<AllReduceAlgo>(7), std::nullopt, 1024, t),
                          "options.algo");
    EXPECT_ERROR_MENTIONS(resolve_all_gather_algo(static_cast<AllGatherAlgo>(9), std::nullopt, 1024, t, true),
                          "options.algo");
    EXPECT_ERROR_MENTIONS(resolve_reduce_scatter_algo(static_cast<ReduceScatterAlgo>(9), std::nullopt, 1024, t),
                          "options.algo");
}

TEST(CollectivesArgs, DescriptorsAndRounds) {
    using detail::call_descriptor;
    using detail::call_descriptor_bytes;
    const auto ar = CollectiveOp::kAllReduce;
    const uint64_t d = call_descriptor(ar, 2, DType::kBF16, 1000, {0, 1000, 1, ~0ull, ~0ull});
    EXPECT_NE(d, 0u);
    EXPECT_EQ(d, call_descriptor(ar, 2, DType::kBF16, 1000, {0, 1000, 1, ~0ull, ~0ull}));
    EXPECT_NE(d, call_descriptor(ar, 2, DType::kBF16, 1001, {0, 1000, 1, ~0ull, ~0ull}));  // the call's count
    EXPECT_NE(d, call_descriptor(ar, 2, DType::kBF16, 1000, {0, 1001, 1, ~0ull, ~0ull}));  // the round's
    EXPECT_NE(d, call_descriptor(ar, 3, DType::kBF16, 1000, {0, 1000, 1, ~0ull, ~0ull}));
    EXPECT_NE(d, call_descriptor(ar, 2, DType::kF16, 1000, {0, 1000, 1, ~0ull, ~0ull}));
    EXPECT_NE(d, call_descriptor(ar, 2, DType::kBF16, 1000, {0, 1000, 1, 4096, ~0ull}));
    EXPECT_NE(d, call_descriptor(CollectiveOp::kReduceScatter, 2, DType::kBF16, 1000, {0, 1000, 1, ~0ull, ~0ull}));
    // The same bytes in another dtype (1000 bf16, 500 f32) is another call.
    EXPECT_NE(call_descriptor(ar, 1, DType::kBF16, 1000, {0, 1000}), call_descriptor(ar, 1, DType::kF32, 500, {0, 500}));
    EXPECT_NE(call_descriptor_bytes(CollectiveOp::kAllGather, 1, 1000, {}),
              call_descriptor(CollectiveOp::kAllGather, 1, DType::kU8, 1000, {}));
    EXPECT_EQ(detail::round_units(256 * kKiB, 2, 8), 128 * kKiB);
    EXPECT_EQ(detail::round_units(100, 3, 8), 32u);  // 33 elements fit, rounded down to the granule
    EXPECT_ERROR_MENTIONS(detail::round_units(16, 4, 8), "WEFT_COLLECTIVE_STAGING_BYTES");
}

TEST(CallDescriptor, FieldsReadBackAndLargeCountsSaturate) {
    const uint64_t d = make_call_descriptor(CollectiveOp::kReduceScatter, 2, true, DType::kF32, 123456, 77);
    EXPECT_EQ(call_descriptor_op(d), CollectiveOp::kReduceScatter);
    EXPECT_EQ(call_descriptor_algo(d), 2u);
    EXPECT_EQ(call_descriptor_dtype_plus_one(d), static_cast<uint32_t>(DType::kF32) + 1);
    EXPECT_EQ(call_descriptor_count(d), 123456u);
    const uint64_t bytes = make_call_descriptor(CollectiveOp::kAllGather, 3, false, DType::kBF16, 4096, 0);
    EXPECT_EQ(call_descriptor_dtype_plus_one(bytes), 0u);
    const uint64_t big = make_call_descriptor(CollectiveOp::kAllReduce, 1, true, DType::kBF16, 1ull << 40, 0);
    const uint64_t bigger = make_call_descriptor(CollectiveOp::kAllReduce, 1, true, DType::kBF16, (1ull << 40) + 1, 0);
    EXPECT_EQ(call_descriptor_count(big), kCallDescriptorMaxCount);
    EXPECT_NE(big, bigger) << "counts past the field still differ through the digest";
    EXPECT_NE(describe_call_descriptor(big).find("at least 4294967295 bf16 elements"), std::string::npos)
        << describe_call_descriptor(big);
    // Every field change is a different word, and the digest changes with the words.
    EXPECT_NE(make_call_descriptor(CollectiveOp::kAllReduce, 1, true, DType::kBF16, 8, 1),
              make_call_descriptor(CollectiveOp::kAllReduce, 1, true, DType::kBF16, 8, 2));
}

TEST(CallDescriptor, DescriptionsUseTheOpsAlgorithmNames) {
    for (AllReduceAlgo a : {AllReduceAlgo::kLowLatency, AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot}) {
        const std::string text = describe_call_descriptor(
            detail::call_descriptor(CollectiveOp::kAllReduce, static_cast<uint32_t>(a), DType::kBF16, 1000, {}));
        EXPECT_NE(text.find(std::string("all_reduce (") + algo_name(a) + ") of 1000 bf16 elements"), std::string::npos)
            << text;
    }
    for (AllGatherAlgo a : {AllGatherAlgo::kLowLatency, AllGatherAlgo::kSmPush, AllGatherAlgo::kCopyEnginePull,
                            AllGatherAlgo::kCopyEnginePush}) {
        const std::string text = describe_call_descriptor(
            detail::call_descriptor_bytes(CollectiveOp::kAllGather, static_cast<uint32_t>(a), 4096, {}));
        EXPECT_NE(text.find(std::string("all_gather (") + algo_name(a) + ") of 4096 bytes"), std::string::npos) << text;
    }
    for (ReduceScatterAlgo a : {ReduceScatterAlgo::kSmPull, ReduceScatterAlgo::kLowLatency}) {
        const std::string text = describe_call_descriptor(
            detail::call_descriptor(CollectiveOp::kReduceScatter, static_cast<uint32_t>(a), DType::kF16, 64, {}));
        EXPECT_NE(text.find(std::string("reduce_scatter (") + algo_name(a) + ") of 64 f16 elements"),
                  std::string::npos)
            << text;
    }
    // all_to_all names its staging; all_to_all_v does not (its ranks may differ in it).
    EXPECT_NE(describe_call_descriptor(detail::call_descriptor_bytes(CollectiveOp::kAllToAll, 1, 4096, {}))
                  .find("all_to_all (staged) of 4096 bytes"),
              std::string::npos);
    const std::string uneven = describe_call_descriptor(detail::call_descriptor_bytes(CollectiveOp::kAllToAllV, 0, 0, {}));
    EXPECT_NE(uneven.find("all_to_all_v (uneven splits)"), std::string::npos) << uneven;
    EXPECT_EQ(uneven.find("direct"), std::string::npos) << uneven;
    EXPECT_NE(describe_call_descriptor(
                  make_call_descriptor(CollectiveOp::kGemmAr, 0, true, DType::kBF16, 64, 0))
                  .find("gemm_ar with M = 64, bf16 output"),
              std::string::npos);
    EXPECT_NE(describe_call_descriptor(make_call_descriptor(CollectiveOp::kAgGemm, 0, true, DType::kF16, 256, 7))
                  .find("ag_gemm with M = 256, f16 ["),
              std::string::npos);
    EXPECT_NE(describe_call_descriptor(make_call_descriptor(CollectiveOp::kGemmRs, 0, true, DType::kF32, 128, 7))
                  .find("gemm_rs with M = 128, f32 partials"),
              std::string::npos);
    EXPECT_NE(describe_call_descriptor(make_call_descriptor(CollectiveOp::kAgAttention, 0, true, DType::kBF16, 96, 3))
                  .find("ag_attention with S = 96, bf16 ["),
              std::string::npos);
    EXPECT_NE(describe_call_descriptor(detail::call_descriptor_bytes(CollectiveOp::kAllToAll, 1, 512, {}))
                  .find("all_to_all (staged) of 512 bytes"),
              std::string::npos);
    EXPECT_NE(describe_call_descriptor(0xabc).find("an unknown call"), std::string::npos);
}

// A complete kCollectiveMismatch record: rank `rank` found `observed` where its own call is `expected`, from `peer`.
Diagnostic mismatch_record(int rank, int peer, uint64_t expected, uint64_t observed) {
    Diagnostic d{};
    d.claimed = 2;
    d.kind = SpinKind::kCollectiveMismatch;
    d.cmp = Cmp::kEq;
    d.rank = rank;
    d.peer = peer;
    d.expected = expected;
    d.observed = observed;
    return d;
}

TEST(CallDescriptor, MismatchOfThousandBf16AndFiveHundredF32NamesBothCalls) {
    Diagnostic d =
        mismatch_record(0, 1, detail::call_descriptor(CollectiveOp::kAllReduce, 1, DType::kBF16, 1000, {0, 1000}),
                        detail::call_descriptor(CollectiveOp::kAllReduce, 1, DType::kF32, 500, {0, 500}));
    d.block_x = 17;
    const std::string m = format_diagnostic(d);
    for (const char* word : {"rank 0 block (17,0,0)", "differs from rank 1", "rank 0 called all_reduce (ll) of 1000 bf16",
                             "rank 1 called all_reduce (ll) of 500 f32 elements"}) {
        EXPECT_NE(m.find(word), std::string::npos) << "'" << word << "' not in: " << m;
    }
}

// Calls that agree in op, algorithm, dtype and count yet differ (a call's place in the team's sequence,
// next_collective_call, or its buffers' offsets): the error says so; calls that differ in a field shown need no such
// note, nor fused ops.
TEST(CallDescriptor, CallsThatDifferOnlyInTheirDigestSaySo) {
    const char* note = "their place in the team's sequence of collective calls";
    Diagnostic d =
        mismatch_record(0, 1, detail::call_descriptor(CollectiveOp::kAllReduce, 1, DType::kBF16, 4096, {1, 0, 4096}),
                        detail::call_descriptor(CollectiveOp::kAllReduce, 1, DType::kBF16, 4096, {0, 0, 4096}));
    ASSERT_NE(d.expected, d.observed) << "the call index is in the digest";
    std::string m = format_diagnostic(d);
    EXPECT_NE(m.find(note), std::string::npos) << m;
    d.observed = detail::call_descriptor(CollectiveOp::kAllReduce, 1, DType::kBF16, 2048, {1, 0, 2048});
    m = format_diagnostic(d);
    EXPECT_EQ(m.find(note), std::string::npos) << m;
    d.expected = make_call_descriptor(CollectiveOp::kAgGemm, 0, true, DType::kBF16, 128, call_descriptor_mix(0, 1));
    d.observed = make_call_descriptor(CollectiveOp::kAgGemm, 0, true, DType::kBF16, 128, call_descriptor_mix(0, 2));
    m = format_diagnostic(d);
    EXPECT_EQ(m.find(note), std::string::npos) << m;
}

// The fused ops' mismatch (AgGemm, GemmRs): both ranks' M in the op's words.
TEST(CallDescriptor, FusedOpsMismatchNamesBothM) {
    for (CollectiveOp op : {CollectiveOp::kAgGemm, CollectiveOp::kGemmRs}) {
        const char* name = op == CollectiveOp::kAgGemm ? "ag_gemm" : "gemm_rs";
        const Diagnostic d =
            mismatch_record(1, 0, make_call_descriptor(op, 0, true, DType::kBF16, 128, call_descriptor_mix(0, 256)),
                            make_call_descriptor(op, 0, true, DType::kBF16, 256, call_descriptor_mix(0, 256)));
        const std::string m = format_diagnostic(d);
        for (const std::string& word : {std::string("differs from rank 0"),
                                        "rank 1 called " + std::string(name) + " with M = 128",
                                        "rank 0 called " + std::string(name) + " with M = 256"}) {
            EXPECT_NE(m.find(word), std::string::npos) << "'" << word << "' not in: " << m;
        }
    }
}

TEST(CollectivesArgs, MismatchDiagnosticNamesBothRanksAndDescriptors) {
    Diagnostic d = mismatch_record(3, 5, 0xabc, 0xdef);
    d.line = 77;
    const std::string m = format_diagnostic(d);
    for (const char* word : {"rank 3", "differs from rank 5", "0xabc", "0xdef", "same order", "line 77"}) {
        EXPECT_NE(m.find(word), std::string::npos) << "'" << word << "' not in: " << m;
    }
    EXPECT_STREQ(spin_kind_name(SpinKind::kCollectiveMismatch), "collective_mismatch");
}

// ------------------------------------------------------------------------------------------------
// NVRTC: representative specialisations compile for sm_90a without spills, and the LL kernel uses the
// one-instruction 2 x 8-byte stores and loads the protocol depends on.

jit::CompileResult compile_spec(jit::Compiler& c, jit::KernelSpec spec) {
    spec.arch = "sm_90a";
    return c.compile(spec);
}

// ------------------------------------------------------------------------------------------------
// Copy-engine all-gathers where ranks of this process share this rank's GPU: the bytes move in the pull kernel, so
// nothing but kernels sits behind the spinning entry kernel in the ranks' shared hardware queues.

TEST(CollectivesCopyEngine, RanksOfOneProcessSharingAGpuCopyWithTheKernel) {
    EXPECT_TRUE(detail::copy_engine_copies_with_kernel(true, 8, 8)) << "weft_soak --world 8: 8 threads on one GPU";
    EXPECT_TRUE(detail::copy_engine_copies_with_kernel(true, 3, 3));
    EXPECT_TRUE(detail::copy_engine_copies_with_kernel(true, 4, 8))
        << "run_local(8) on 2 GPUs: members on the other GPU too (system-scope signals)";
    EXPECT_TRUE(detail::copy_engine_copies_with_kernel(true, 2, 2)) << "a team of 2 on two GPUs shared with others";
    EXPECT_FALSE(detail::copy_engine_copies_with_kernel(false, 8, 8)) << "processes: queues of their own contexts";
    EXPECT_FALSE(detail::copy_engine_copies_with_kernel(true, 1, 1)) << "one rank launches nothing";
    EXPECT_FALSE(detail::copy_engine_copies_with_kernel(true, 8, 1)) << "a one-rank team launches nothing";
    EXPECT_FALSE(detail::copy_engine_copies_with_kernel(true, 1, 8)) << "a GPU to itself: side streams, copy engines";
}

TEST(CollectivesCopyEngine, KernelItemsCopyEveryPeersBytesThenSignalThatPeer) {
    constexpr int n = 4;
    constexpr int me = 1;
    constexpr uint64_t shard = 100;
    std::vector<uint8_t> out(n * shard), in(shard), region(shard);
    std::vector<std::vector<uint8_t>> peer_out(n, std::vector<uint8_t>(n * shard));
    uint64_t flag_words[n] = {};
    std::vector<uint64_t*> flags(n, nullptr);
    std::vector<const uint8_t*> from(n, nullptr);
    std::vector<uint8_t*> to(n, nullptr);
    for (int q = 0; q < n; ++q) {
        if (q == me) continue;
        flags[q] = &flag_words[q];
        from[q] = peer_out[q].data() + q * shard;  // pull in place: q's own slot of its output
        to[q] = peer_out[q].data() + me * shard;   // push: slot `me` of q's output
    }
    // Pull, out of place: the peers from rank me + 1 on, each signalled, then this rank's own bytes without a signal.
    std::vector<PeerPullItem> items =
        detail::copy_engine_kernel_items(true, n, me, in.data(), out.data(), shard, 0, shard, from, to, flags);
    ASSERT_EQ(items.size(), 4u);
    const int order[] = {2, 3, 0};
    for (int k = 0; k < 3; ++k) {
        const int q = order[k];
        EXPECT_EQ(items[k].peer, q);
        EXPECT_EQ(items[k].dst, out.data() + q * shard);
        EXPECT_EQ(items[k].src, from[q]);
        EXPECT_EQ(items[k].signal, &flag_words[q]);
        EXPECT_EQ(items[k].bytes, shard);
        EXPECT_EQ(items[k].wait_ready, nullptr) << "the entry kernel before it is the only wait";
    }
    EXPECT_EQ(items[3].dst, out.data() + me * shard);
    EXPECT_EQ(items[3].src, in.data());
    EXPECT_EQ(items[3].signal, nullptr) << "nobody waits for this rank's own slot";
    // In place: the own bytes are there already.
    items = detail::copy_engine_kernel_items(true, n, me, out.data() + me * shard, out.data(), shard, 0, shard, from,
                                             to, flags);
    EXPECT_EQ(items.size(), 3u);
    // A staged round [40, 100): every peer's staging region holds the round's bytes at its start.
    for (int q = 0; q < n; ++q) from[q] = q == me ? nullptr : region.data();
    items = detail::copy_engine_kernel_items(true, n, me, in.data(), out.data(), shard, 40, 60, from, to, flags);
    ASSERT_EQ(items.size(), 4u);
    EXPECT_EQ(items[0].dst, out.data() + 2 * shard + 40);
    EXPECT_EQ(items[0].bytes, 60u);
    EXPECT_EQ(items[3].dst, out.data() + me * shard + 40);
    EXPECT_EQ(items[3].src, in.data() + 40);
    // Push: this rank's bytes into slot `me` of every peer's output, each peer signalled.
    items = detail::copy_engine_kernel_items(false, n, me, in.data(), out.data(), shard, 0, shard, from, to, flags);
    ASSERT_EQ(items.size(), 4u);
    for (int k = 0; k < 3; ++k) {
        const int q = order[k];
        EXPECT_EQ(items[k].dst, to[q]);
        EXPECT_EQ(items[k].src, in.data());
        EXPECT_EQ(items[k].signal, &flag_words[q]);
        EXPECT_EQ(items[k].chunk, me) << "the slot written (trace: copy chunk " << me << ")";
    }
    EXPECT_EQ(detail::copy_engine_kernel_items(true, n, me, in.data(), out.data(), shard, 0, shard, from, to, flags)[0]
                  .chunk,
              2);
    // One entry per rank, or a clear error.
    const std::string e = error_of([&] {
        detail::copy_engine_kernel_items(true, n, me, in.data(), out.data(), shard, 0, shard,
                                         std::span<const uint8_t* const>(from).first(2), to, flags);
    });
    EXPECT_NE(e.find("one source and one flag per rank (4), got 2 and 4"), std::string::npos) << e;
}

TEST(CollectivesNvrtc, RepresentativeSpecsCompileForSm90a) {
    weft::testing::TempDir cache("weft_coll_nvrtc");
    jit::Compiler c(weft::testing::isolated_compiler_config(cache.path()));
    using detail::KernelId;
    struct Case {
        KernelId id;
        DType dtype;
    };
    for (const Case& k :
         {Case{KernelId::kAllReduceLowLatency, DType::kBF16}, Case{KernelId::kAllReduceTwoShot, DType::kF32},
          Case{KernelId::kReduceScatterPull, DType::kF16}, Case{KernelId::kReduceScatterLowLatency, DType::kBF16},
          Case{KernelId::kReduceScatterLowLatency, DType::kF32}, Case{KernelId::kAllGatherPush, DType::kU8},
          Case{KernelId::kCopyEngineExit, DType::kU8}, Case{KernelId::kAllToAllPull, DType::kU8},
          Case{KernelId::kAttentionSpCombine, DType::kBF16}, Case{KernelId::kCopyEngineEnter, DType::kU8},
          Case{KernelId::kAllGatherLowLatency, DType::kU8}, Case{KernelId::kAllReduceOneShot, DType::kF16}}) {
        const jit::KernelSpec spec = detail::collective_kernel_spec(k.id, k.dtype, 8);
        SCOPED_TRACE(spec.describe());
        const jit::CompileResult r = compile_spec(c, spec);
        ASSERT_TRUE(r.cubin);
        EXPECT_GT(r.ptxas_info.registers, 0) << r.log;
        EXPECT_EQ(r.ptxas_info.spill_store_bytes, 0) << r.ptxas_info.text;
        if (k.id == KernelId::kAllReduceLowLatency || k.id == KernelId::kReduceScatterLowLatency) {
            EXPECT_NE(r.ptx.find("st.relaxed.sys.v2.b64"), std::string::npos) << "LL lines must be one v2.b64 store";
            EXPECT_NE(r.ptx.find("ld.relaxed.sys.v2.b64"), std::string::npos) << "LL polls must be one v2.b64 load";
        }
        if (k.id == KernelId::kAllReduceTwoShot) {
            EXPECT_NE(r.ptx.find("red.release.sys.add.u64"), std::string::npos)
                << "block barrier arrivals are release adds";
            EXPECT_EQ(r.ptx.find("ld.global.nc"), std::string::npos) << "never .nc loads of peer data";
        }
    }
    // The vector-width knob: a narrower specialisation also compiles (the ops use 16 and step down at run time).
    jit::KernelSpec narrow = detail::collective_kernel_spec(KernelId::kAllReduceOneShot, DType::kBF16, 16);
    const std::string from = ".vec_bytes = 16";
    narrow.instantiation.replace(narrow.instantiation.find(from), from.size(), ".vec_bytes = 4");
    EXPECT_TRUE(compile_spec(c, narrow).cubin);
}

TEST(CollectivesNvrtc, AotRegistrationCoversEveryKernelOnce) {
    const size_t before = jit::aot_specs().size();
    register_collective_aot_specs(8);
    register_collective_aot_specs(5);  // same bucket: no duplicates
    const std::vector<jit::KernelSpec> specs = jit::aot_specs();
    EXPECT_EQ(specs.size() - before, detail::collective_kernel_specs(8).size());
    std::set<std::string> names;
    for (const auto& s : detail::collective_kernel_specs(8)) names.insert(s.instantiation);
    EXPECT_EQ(names.size(), 23u);  // 6 reducing kernels x 3 dtypes + 5 byte-moving kernels
    for (const char* kernel : {"reduce_scatter_low_latency", "reduce_scatter_pull", "all_reduce_low_latency"}) {
        for (const char* dtype : {"kBF16", "kF16", "kF32"}) {
            EXPECT_EQ(std::count_if(names.begin(), names.end(),
                                    [&](const std::string& s) {
                                        return s.find(kernel) != std::string::npos &&
                                               s.find(dtype) != std::string::npos;
                                    }),
                      1)
                << kernel << " " << dtype;
        }
    }
}

}  // namespace
}  // namespace weft::ops
