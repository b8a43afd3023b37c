// SPDX-License-Identifier: MIT
// GPU tests of ops on teams: 8 ranks as threads sharing the visible GPUs, split 2x4, 4x2 and 3+5 (split_color, with
// keys that make team order differ from world order; 3+5: teams of odd, unequal sizes) and strided (split_strided). The
// team runtime (barrier, all_gather, team-collective heap allocations, timeouts naming world ranks); every collective
// family and an EP dispatch/combine running in every team at once (each rank on its own stream, shapes and dtypes
// differing per team), against host references on fresh random data with the outputs poisoned first; a team of one;
// calls with a team this rank is not a member of; ops on overlapping teams one after the other.
//
// Collective inputs are integers in [-8, 8] (collectives_test_kernels.hpp) so every sum is exact; the seed is
// printed and WEFT_TEST_SEED=<n> replays a run.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/collectives_test_kernels.hpp"
#include "support/ep_reference.hpp"
#include "support/ep_testing.hpp"
#include "support/error_text.hpp"
#include "support/jit_testing.hpp"
#include "support/runtime_checks.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/ep.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

namespace ref = weft::test::ep;
using ops::AllGatherAlgo;
using ops::AllReduceAlgo;
using ops::ReduceScatterAlgo;

constexpr int kWorld = 8;
constexpr uint64_t kGuardBytes = 64;
constexpr DType kReduceTypes[] = {DType::kBF16, DType::kF16, DType::kF32};
constexpr DType kGatherTypes[] = {DType::kU8, DType::kBF16, DType::kF32};
constexpr AllReduceAlgo kAllReduceAlgos[] = {AllReduceAlgo::kAuto, AllReduceAlgo::kLowLatency, AllReduceAlgo::kOneShot,
                                             AllReduceAlgo::kTwoShot};
constexpr AllGatherAlgo kAllGatherAlgos[] = {AllGatherAlgo::kAuto, AllGatherAlgo::kLowLatency, AllGatherAlgo::kSmPush,
                                             AllGatherAlgo::kCopyEnginePull, AllGatherAlgo::kCopyEnginePush};
constexpr ReduceScatterAlgo kReduceScatterAlgos[] = {ReduceScatterAlgo::kAuto, ReduceScatterAlgo::kSmPull,
                                                     ReduceScatterAlgo::kLowLatency};

uint64_t test_seed() {
    static const uint64_t seed = [] {
        const std::optional<int64_t> fixed = env::get_int("WEFT_TEST_SEED");
        const uint64_t s =
            fixed ? static_cast<uint64_t>(*fixed) : (uint64_t{std::random_device{}()} << 20) ^ std::random_device{}();
        std::printf("[ seed     ] WEFT_TEST_SEED=%llu\n", static_cast<unsigned long long>(s));
        return s;
    }();
    return seed;
}

// ------------------------------------------------------------------------------------------------
// Splits of the 8-rank world.

enum class Split { kColor2x4, kColor4x2, kStrided, kColor3And5 };
constexpr Split kSplits[] = {Split::kColor2x4, Split::kColor4x2, Split::kStrided};
// With teams of odd, unequal sizes (3 and 5) too: for what takes any team size (the EP tests' configs need equal
// teams whose size divides the experts).
constexpr Split kSplitsWithUneven[] = {Split::kColor2x4, Split::kColor4x2, Split::kStrided, Split::kColor3And5};

const char* split_name(Split s) {
    switch (s) {
        case Split::kColor2x4:
            return "2x4";
        case Split::kColor4x2:
            return "4x2";
        case Split::kStrided:
            return "strided";
        case Split::kColor3And5:
            return "3+5";
    }
    return "?";
}

/// The team this rank is in under a split, and the team's index among the split's teams.
struct TeamOf {
    Team team;
    int index = 0;
};

/// World ranks of team `index` of a split, in team-rank order (what make_team must produce).
std::vector<int> expected_members(Split s, int index) {
    switch (s) {
        case Split::kColor2x4: {
            const int b = 4 * index;
            return {b, b + 3, b + 2, b + 1};  // keys (3 * rank) % 4: 0, 3, 2, 1
        }
        case Split::kColor4x2:
            return {2 * index + 1, 2 * index};  // keys -rank
        case Split::kStrided:
            return {index, index + 2, index + 4, index + 6};
        case Split::kColor3And5:
            if (index == 0) return {0, 1, 2};
            return {7, 6, 5, 4, 3};  // keys -rank
    }
    return {};
}

/// The colour splits are collective over the world (every rank calls them, in the same order); the strided one is
/// local. Keys are chosen so that team order differs from world order.
TeamOf make_team(World& w, Split s) {
    const int r = w.rank();
    TeamOf t;
    switch (s) {
        case Split::kColor2x4:
            t = {w.team().split_color(r / 4, (3 * r) % 4), r / 4};
            break;
        case Split::kColor4x2:
            t = {w.team().split_color(r / 2, -r), r / 2};
            break;
        case Split::kStrided:
            t = {w.team().split_strided(r % 2, 2, kWorld / 2), r % 2};
            break;
        case Split::kColor3And5:
            t = {w.team().split_color(r < 3 ? 0 : 1, r < 3 ? r : -r), r < 3 ? 0 : 1};
            break;
    }
    WEFT_CHECK(t.team.members() == expected_members(s, t.index),
               "world rank " << r << ": split " << split_name(s) << " gave the team of " << t.team.describe());
    return t;
}

void report(const std::vector<std::string>& failures) {
    for (size_t i = 0; i < failures.size() && i < 20; ++i) ADD_FAILURE() << failures[i];
    if (failures.size() > 20) ADD_FAILURE() << "... and " << failures.size() - 20 << " more failures";
}

using testing::error_of;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

Bytes to_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }

/// A stream of the rank's own (non-blocking).
struct RankStream {
    cudaStream_t s = nullptr;
    RankStream() { WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
    ~RankStream() {
        cudaStreamSynchronize(s);
        cudaStreamDestroy(s);
    }
    RankStream(const RankStream&) = delete;
    RankStream& operator=(const RankStream&) = delete;
};

std::vector<uint8_t> download(cudaStream_t s, const void* p, uint64_t bytes) {
    std::vector<uint8_t> h(bytes);
    if (bytes == 0) return h;
    WEFT_CUDA_CHECK(cudaMemcpyAsync(h.data(), p, bytes, cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    return h;
}

// ------------------------------------------------------------------------------------------------
// The team runtime.

// Every split: team ids agree across members and differ across teams; all_gather returns the members' bytes in
// team order (two teams using one key at the same time, and a key reused); barrier; team-collective allocations at
// one offset on every member, zeroed signals; a later world allocation avoids every team's live ranges; mismatched
// arguments, a non-member and a free with another team are errors naming world ranks.
TEST(Teams, BarrierAllGatherAndTeamHeap) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    run_ranks(kWorld, [](World& w) {
        const int me = w.rank();
        SymmetricHeap& heap = w.heap();
        EXPECT_TRUE(w.team().is_world());
        EXPECT_EQ(w.team().id(), "world");
        EXPECT_EQ(&w.team().world(), &w);
        EXPECT_EQ(w.team().timeout(), w.timeout());
        const uint64_t in_use_before = heap.bytes_in_use();
        for (Split s : kSplitsWithUneven) {
            SCOPED_TRACE(split_name(s));
            const TeamOf t = make_team(w, s);
            const Team& team = t.team;
            EXPECT_FALSE(team.is_world());
            EXPECT_EQ(&team.world(), &w);
            if (w.num_ranks_on_device() == kWorld) {
                EXPECT_EQ(team.num_ranks_on_device(), team.num_ranks()) << "one GPU hosts every member";
                EXPECT_EQ(team.max_ranks_per_device(), team.num_ranks());
            } else {
                EXPECT_TRUE(team.num_ranks_on_device() >= 1 &&
                            team.num_ranks_on_device() <= team.max_ranks_per_device() &&
                            team.max_ranks_per_device() <= team.num_ranks());
            }
            // Ids: the same on every member, different between teams (every rank posts its team's id to the world).
            const auto ids = w.team().all_gather("test-team-id", to_bytes(team.id()));
            for (int r = 0; r < kWorld; ++r) {
                const bool same_team = team.team_rank(r) >= 0;
                EXPECT_EQ(ids[static_cast<size_t>(r)] == to_bytes(team.id()), same_team)
                    << "world rank " << r << "'s team id";
            }
            // all_gather twice with one key (every team at once): the members' bytes in team order.
            const auto token = [](int world_rank, int round) { return Bytes{static_cast<uint8_t>(world_rank), 0xA5,
                                                                            static_cast<uint8_t>(round)}; };
            for (int round = 0; round < 2; ++round) {
                const auto all = team.all_gather("test-key", token(me, round));
                ASSERT_EQ(all.size(), static_cast<size_t>(team.num_ranks()));
                for (int q = 0; q < team.num_ranks(); ++q) {
                    EXPECT_EQ(all[static_cast<size_t>(q)], token(team.world_rank(q), round)) << "team rank " << q;
                }
            }
            team.barrier();

            // Team allocations: one offset on every member, and the same size and alignment rules as the world's.
            void* a = heap.alloc(team, 1000 + 256 * static_cast<uint64_t>(t.index), 512);
            uint64_t* sig = heap.alloc_signals(team, 333);
            auto* arr = heap.alloc_array<float>(team, 77);
            const uint64_t offsets[3] = {heap.offset_of(a), heap.offset_of(sig), heap.offset_of(arr)};
            EXPECT_EQ(offsets[0] % 512, 0u);
            const Bytes mine(reinterpret_cast<const uint8_t*>(offsets), reinterpret_cast<const uint8_t*>(offsets) + 24);
            for (const Bytes& theirs : team.all_gather("test-offsets", mine)) EXPECT_EQ(theirs, mine);
            std::vector<uint64_t> host(333, 1);
            WEFT_CUDA_CHECK(cudaMemcpy(host.data(), sig, host.size() * 8, cudaMemcpyDeviceToHost));
            EXPECT_EQ(std::count(host.begin(), host.end(), 0ull), 333) << "alloc_signals must zero";

            // A world allocation now: the same offset everywhere, clear of every team's live ranges on this rank.
            void* g = heap.alloc(4096);
            const uint64_t go = heap.offset_of(g);
            const Bytes gbytes(reinterpret_cast<const uint8_t*>(&go), reinterpret_cast<const uint8_t*>(&go) + 8);
            for (const Bytes& theirs : w.team().all_gather("test-world-offset", gbytes)) EXPECT_EQ(theirs, gbytes);
            const uint64_t sizes[3] = {1000 + 256 * static_cast<uint64_t>(t.index), 333 * 8, 77 * 4};
            for (int k = 0; k < 3; ++k) {
                EXPECT_TRUE(go + 4096 <= offsets[k] || offsets[k] + sizes[k] <= go)
                    << "the world allocation at " << go << " overlaps team allocation " << k;
            }

            // Mismatched sizes inside the team: an error on every member, naming world ranks; the heap stays usable.
            const int odd_one = team.world_rank(team.num_ranks() - 1);
            const std::string sizes_err =
                error_of([&] { heap.alloc(team, me == odd_one ? 8192 : 4096); });
            EXPECT_TRUE(contains(sizes_err, "differs across ranks") &&
                        contains(sizes_err, "world rank " + std::to_string(odd_one) + " asked alloc(8192 bytes") &&
                        contains(sizes_err, "of the team of " + team.describe()))
                << sizes_err;
            // A free with the wrong team: the world does not own `a`.
            const std::string wrong_team = error_of([&] { heap.free(w.team(), a); });
            EXPECT_FALSE(wrong_team.empty()) << "freeing a team allocation with the world team must fail";
            // A team this rank is not in.
            const Team other = w.team().split_strided(me % 2 == 0 ? 1 : 0, 2, kWorld / 2);
            const std::string non_member = error_of([&] { heap.alloc(other, 64); });
            EXPECT_TRUE(contains(non_member, "symmetric heap alloc: world rank " + std::to_string(me) +
                                                 " is not a member of this team (" + other.describe() + ")"))
                << non_member;
            EXPECT_TRUE(contains(error_of([&] { other.barrier(); }), "is not a member")) << "barrier of a non-member";

            heap.free(g);
            heap.free(team, arr);
            heap.free(team, sig);
            heap.free(team, a);
            w.barrier();
        }
        EXPECT_EQ(heap.bytes_in_use(), in_use_before);
    });
}

// A member that never arrives: the team's barrier and all_gather fail after the timeout on the others, naming the
// missing team rank and its world rank.
TEST(Teams, TimeoutsNameTheMissingTeamAndWorldRanks) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    WorldOptions options = test_options();
    options.timeout = std::chrono::milliseconds(1500);
    run_ranks(
        4,
        [](World& w) {
            const Team team = w.team().split_strided(1, 1, 3);  // world ranks 1, 2, 3; world rank 3 stays away
            if (w.rank() == 1 || w.rank() == 2) {
                const std::string missing = "team rank 2 (world rank 3) did not arrive";
                const std::string b = error_of([&] { team.barrier(); });
                EXPECT_TRUE(contains(b, missing)) << b;
                const std::string g = error_of([&] { team.all_gather("never", Bytes{1}); });
                EXPECT_TRUE(contains(g, missing)) << g;
            } else {
                std::this_thread::sleep_for(std::chrono::milliseconds(3750));  // past both timeouts of the others
            }
            w.barrier();
        },
        options);
}

// ------------------------------------------------------------------------------------------------
// Collectives in every team at once.

/// One rank's buffers for a team's cases: local ones, and symmetric ones allocated over the team.
class TeamBuffers {
public:
    TeamBuffers(const Team& team, uint64_t capacity, cudaStream_t stream)
        : team_(team), capacity_(capacity + 2 * kGuardBytes), stream_(stream) {
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&local_in_), capacity_, stream_));
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&local_out_), capacity_, stream_));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        sym_in_ = static_cast<uint8_t*>(team.world().heap().alloc(team, capacity_));
        sym_out_ = static_cast<uint8_t*>(team.world().heap().alloc(team, capacity_));
    }
    TeamBuffers(const TeamBuffers&) = delete;
    TeamBuffers& operator=(const TeamBuffers&) = delete;
    // Collective over the team: every member's work is done before anything is freed.
    void release() {
        team_.world().sync_and_check(stream_);
        team_.barrier();
        team_.world().heap().free(team_, sym_out_);
        team_.world().heap().free(team_, sym_in_);
        WEFT_CUDA_CHECK(cudaFreeAsync(local_out_, stream_));
        WEFT_CUDA_CHECK(cudaFreeAsync(local_in_, stream_));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    const Team& team() const { return team_; }
    cudaStream_t stream() const { return stream_; }
    uint8_t* in_base(bool symmetric) const { return symmetric ? sym_in_ : local_in_; }
    uint8_t* out_base(bool symmetric) const { return symmetric ? sym_out_ : local_out_; }

private:
    Team team_;
    uint64_t capacity_;
    cudaStream_t stream_;
    uint8_t* local_in_ = nullptr;
    uint8_t* local_out_ = nullptr;
    uint8_t* sym_in_ = nullptr;
    uint8_t* sym_out_ = nullptr;
};

uint32_t bits_at(const std::vector<uint8_t>& h, uint64_t byte_offset, int elem_bytes) {
    uint32_t v = 0;
    std::memcpy(&v, h.data() + byte_offset, static_cast<size_t>(elem_bytes));
    return v;
}

/// Compares `count` elements after `kGuardBytes` of lead with expected(i), and the guard bytes on both sides with the
/// 0xFF poison. "" or a description.
template <class Expected>
std::string compare(const std::vector<uint8_t>& h, uint64_t count, DType t, const Expected& expected) {
    const int es = dtype_bytes(t);
    for (uint64_t k = 0; k < kGuardBytes; ++k) {
        if (h[k] != 0xFF) return "byte " + std::to_string(kGuardBytes - k) + " before the output was overwritten";
    }
    for (uint64_t k = kGuardBytes + count * static_cast<uint64_t>(es); k < h.size(); ++k) {
        if (h[k] != 0xFF) return "a byte after the output was overwritten";
    }
    uint64_t bad = 0;
    std::ostringstream first;
    for (uint64_t i = 0; i < count; ++i) {
        const uint32_t got = bits_at(h, kGuardBytes + i * static_cast<uint64_t>(es), es);
        const uint32_t want = expected(i);
        if (got != want) {
            if (bad == 0) first << "element " << i << ": got 0x" << std::hex << got << ", expected 0x" << want;
            ++bad;
        }
    }
    if (bad == 0) return "";
    return std::to_string(bad) + " of " + std::to_string(count) + " elements wrong; first " + first.str();
}

/// Sum over team ranks q < n of pattern_value(seed, q, offset + i), computed on the host.
std::vector<int32_t> team_sums(uint64_t seed, int n, uint64_t offset, uint64_t count) {
    std::vector<int32_t> sums(count, 0);
    for (int q = 0; q < n; ++q) {
        for (uint64_t i = 0; i < count; ++i) sums[i] += pattern_value(seed, q, offset + i);
    }
    return sums;
}

std::string describe(const TeamBuffers& b, const char* op, const char* algo, DType t, uint64_t count, bool sym) {
    std::ostringstream os;
    os << op << " " << algo << " " << dtype_name(t) << " count " << count << (sym ? " symmetric" : " local")
       << " on the team of " << b.team().describe() << " (team rank " << b.team().rank() << ")";
    return os.str();
}

void all_reduce_case(TeamBuffers& b, DType t, AllReduceAlgo algo, uint64_t count, bool sym, uint64_t seed,
                     std::vector<std::string>* failures) {
    const Team& team = b.team();
    const uint64_t es = static_cast<uint64_t>(dtype_bytes(t));
    uint8_t* in = b.in_base(sym) + kGuardBytes;
    uint8_t* out = b.out_base(sym) + kGuardBytes;
    const uint64_t span = 2 * kGuardBytes + count * es;
    WEFT_CUDA_CHECK(cudaMemsetAsync(b.out_base(sym), 0xFF, span, b.stream()));
    launch_fill_pattern(b.stream(), in, t, count, seed, team.rank(), 0);
    ops::all_reduce(team, TensorView(in, t, {static_cast<int64_t>(count)}),
                    TensorView(out, t, {static_cast<int64_t>(count)}), b.stream(), {.algo = algo});
    team.world().sync_and_check(b.stream());
    const std::vector<int32_t> sums = team_sums(seed, team.num_ranks(), 0, count);
    const std::string err = compare(download(b.stream(), b.out_base(sym), span), count, t,
                                    [&](uint64_t i) { return int_bits(sums[i], t); });
    if (!err.empty()) failures->push_back(describe(b, "all_reduce", ops::algo_name(algo), t, count, sym) + ": " + err);
}

void all_gather_case(TeamBuffers& b, DType t, AllGatherAlgo algo, uint64_t count, bool sym, uint64_t seed,
                     std::vector<std::string>* failures) {
    const Team& team = b.team();
    const int n = team.num_ranks();
    const uint64_t es = static_cast<uint64_t>(dtype_bytes(t));
    uint8_t* in = b.in_base(sym) + kGuardBytes;
    uint8_t* out = b.out_base(sym) + kGuardBytes;
    const uint64_t total = count * static_cast<uint64_t>(n);
    const uint64_t span = 2 * kGuardBytes + total * es;
    uint8_t* out_base = out - kGuardBytes;
    WEFT_CUDA_CHECK(cudaMemsetAsync(out_base, 0xFF, span, b.stream()));
    launch_fill_pattern(b.stream(), in, t, count, seed, team.rank(), 0);
    ops::all_gather(team, TensorView(in, t, {static_cast<int64_t>(count)}),
                    TensorView(out, t, {static_cast<int64_t>(total)}), b.stream(), {.algo = algo});
    team.world().sync_and_check(b.stream());
    const std::string err = compare(download(b.stream(), out_base, span), total, t, [&](uint64_t k) {
        return int_bits(pattern_value(seed, static_cast<int>(k / count), k % count), t);
    });
    if (!err.empty()) failures->push_back(describe(b, "all_gather", ops::algo_name(algo), t, count, sym) + ": " + err);
}

void reduce_scatter_case(TeamBuffers& b, DType t, ReduceScatterAlgo algo, uint64_t count, bool sym, uint64_t seed,
                         std::vector<std::string>* failures) {
    const Team& team = b.team();
    const int n = team.num_ranks();
    const uint64_t es = static_cast<uint64_t>(dtype_bytes(t));
    const uint64_t total = count * static_cast<uint64_t>(n);
    uint8_t* in = b.in_base(sym) + kGuardBytes;
    uint8_t* out = b.out_base(sym) + kGuardBytes;
    const uint64_t span = 2 * kGuardBytes + count * es;
    WEFT_CUDA_CHECK(cudaMemsetAsync(b.out_base(sym), 0xFF, span, b.stream()));
    launch_fill_pattern(b.stream(), in, t, total, seed, team.rank(), 0);
    ops::reduce_scatter(team, TensorView(in, t, {static_cast<int64_t>(total)}),
                        TensorView(out, t, {static_cast<int64_t>(count)}), b.stream(), {.algo = algo});
    team.world().sync_and_check(b.stream());
    const std::vector<int32_t> sums = team_sums(seed, n, static_cast<uint64_t>(team.rank()) * count, count);
    const std::string err = compare(download(b.stream(), b.out_base(sym), span), count, t,
                                    [&](uint64_t i) { return int_bits(sums[i], t); });
    if (!err.empty())
        failures->push_back(describe(b, "reduce_scatter", ops::algo_name(algo), t, count, sym) + ": " + err);
}

/// Every collective family, algorithm and placement on `team`, with counts and dtypes that depend on the team's
/// index (so teams running at once differ in shape); the same sequence on every member.
void run_collectives(const Team& team, int index, uint64_t seed, cudaStream_t stream,
                     std::vector<std::string>* failures) {
    const uint64_t idx = static_cast<uint64_t>(index);
    const uint64_t counts[] = {1 + 2 * idx, 4099 + 100 * idx, 150001 + 1000 * idx};  // the last: LL and staging rounds
    const uint64_t capacity = counts[2] * 4 * static_cast<uint64_t>(team.num_ranks());
    TeamBuffers b(team, capacity, stream);
    ops::prepare_collectives(team);
    uint64_t case_no = 0;
    const auto case_seed = [&] { return seed ^ ((case_no + 1) * 0x9e3779b97f4a7c15ull); };
    for (AllReduceAlgo a : kAllReduceAlgos) {
        for (uint64_t count : counts) {
            for (bool sym : {false, true}) {
                all_reduce_case(b, kReduceTypes[(case_no + idx) % 3], a, count, sym, case_seed(), failures);
                ++case_no;
            }
        }
    }
    for (AllGatherAlgo a : kAllGatherAlgos) {
        const bool push = a == AllGatherAlgo::kSmPush || a == AllGatherAlgo::kCopyEnginePush;
        for (uint64_t count : counts) {
            for (bool sym : {false, true}) {
                if (push && !sym) continue;  // a push needs a symmetric output
                all_gather_case(b, kGatherTypes[(case_no + idx) % 3], a, count, sym, case_seed(), failures);
                ++case_no;
            }
        }
    }
    for (ReduceScatterAlgo a : kReduceScatterAlgos) {
        for (uint64_t count : counts) {
            for (bool sym : {false, true}) {
                reduce_scatter_case(b, kReduceTypes[(case_no + idx) % 3], a, count, sym, case_seed(), failures);
                ++case_no;
            }
        }
    }
    b.release();
}

// Small staging regions: the staged algorithms run in rounds already at the largest counts here.
testing::ScopedEnv small_staging() { return testing::ScopedEnv("WEFT_COLLECTIVE_STAGING_BYTES", std::string("1M")); }

TEST(Teams, CollectivesRunInEveryTeamAtOnce) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const uint64_t seed = test_seed();
    const auto staging = small_staging();
    run_ranks(
        kWorld,
        [&](World& w) {
            RankStream rs;
            std::vector<std::string> failures;
            for (Split s : kSplitsWithUneven) {
                const TeamOf t = make_team(w, s);
                // Only the team's members meet from here on: the teams of a split run at the same time.
                run_collectives(t.team, t.index, seed ^ (static_cast<uint64_t>(s) << 56) ^ static_cast<uint64_t>(t.index),
                                rs.s, &failures);
                // The split's workspace is the team's own, made once per team id.
                EXPECT_NE(w.find_extension(std::string("weft.ops.collectives/") + t.team.id()), nullptr);
                EXPECT_EQ(&ops::prepare_collectives(t.team), &ops::prepare_collectives(t.team));
                EXPECT_EQ(ops::prepare_collectives(t.team).topology.num_ranks, t.team.num_ranks());
            }
            report(failures);
            w.barrier();
        },
        test_options(128ull << 20));
}

// A rank in several teams uses them one after the other on one stream, without host synchronisation between the
// ops: all_reduce on the 2x4 team, all_reduce of that on the strided team, all_gather of that on the world, and
// reduce_scatter of the gathered vector on the 2x4 team again. Every value is an exact small integer in f32.
TEST(Teams, OverlappingTeamsOneAfterTheOther) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const auto staging = small_staging();  // three teams' workspaces fit the test heap
    const uint64_t seed = test_seed() ^ 0x5eedull;
    run_ranks(
        kWorld,
        [&](World& w) {
            RankStream rs;
            cudaStream_t s = rs.s;
            const TeamOf a = make_team(w, Split::kColor2x4);
            const TeamOf b = make_team(w, Split::kStrided);
            const int64_t n = 5003;
            SymmetricHeap& heap = w.heap();
            // x, z: private; y, gathered: world allocations (a symmetric buffer an op's peers read must come from
            // that op's team or the world); out: private. x, y, z: n floats; gathered: 8n; out: 2n (the 2x4 team
            // scatters 8n into 4 slices of 2n).
            auto* y = heap.alloc_array<float>(w.team(), static_cast<uint64_t>(n));
            auto* gathered = heap.alloc_array<float>(w.team(), static_cast<uint64_t>(8 * n));
            float* x = nullptr;
            float* z = nullptr;
            float* out = nullptr;
            WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&x), static_cast<size_t>(n) * 4, s));
            WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&z), static_cast<size_t>(n) * 4, s));
            WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&out), static_cast<size_t>(2 * n) * 4, s));
            for (float* p : {y, z, gathered, out}) {
                const int64_t count = p == gathered ? 8 * n : p == out ? 2 * n : n;
                WEFT_CUDA_CHECK(cudaMemsetAsync(p, 0xFF, static_cast<size_t>(count) * 4, s));
            }
            launch_fill_pattern(s, x, DType::kF32, static_cast<uint64_t>(n), seed, w.rank(), 0);
            ops::all_reduce(a.team, TensorView(x, DType::kF32, {n}), TensorView(y, DType::kF32, {n}), s);
            ops::all_reduce(b.team, TensorView(y, DType::kF32, {n}), TensorView(z, DType::kF32, {n}), s);
            ops::all_gather(w, TensorView(z, DType::kF32, {n}), TensorView(gathered, DType::kF32, {8 * n}), s);
            ops::reduce_scatter(a.team, TensorView(gathered, DType::kF32, {8 * n}),
                                TensorView(out, DType::kF32, {2 * n}), s);
            w.sync_and_check(s);

            // Host reference: y_r = sum over r's 2x4 team of x; z_r = sum over r's strided team of y; gathered =
            // z of every world rank; out = 4 x gathered's slice (the 2x4 team's members hold the same gathered).
            const auto x_of = [&](int r, int64_t i) { return pattern_value(seed, r, static_cast<uint64_t>(i)); };
            const auto y_of = [&](int r, int64_t i) {
                int32_t v = 0;
                for (int q : expected_members(Split::kColor2x4, r / 4)) v += x_of(q, i);
                return v;
            };
            const auto z_of = [&](int r, int64_t i) {
                int32_t v = 0;
                for (int q : expected_members(Split::kStrided, r % 2)) v += y_of(q, i);
                return v;
            };
            std::vector<float> host(static_cast<size_t>(2 * n));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(host.data(), out, host.size() * 4, cudaMemcpyDeviceToHost, s));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
            std::vector<std::string> failures;
            const int64_t slice = a.team.rank() * 2 * n;
            for (int64_t i = 0; i < 2 * n && failures.size() < 5; ++i) {
                const int64_t g = slice + i;  // index into gathered: world rank g / n, element g % n
                const float want = 4.0f * static_cast<float>(z_of(static_cast<int>(g / n), g % n));
                if (host[static_cast<size_t>(i)] != want) {
                    failures.push_back("world rank " + std::to_string(w.rank()) + ": out[" + std::to_string(i) +
                                       "] = " + std::to_string(host[static_cast<size_t>(i)]) + ", expected " +
                                       std::to_string(want));
                }
            }
            report(failures);
            for (float* p : {x, z, out}) WEFT_CUDA_CHECK(cudaFreeAsync(p, s));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
            w.barrier();
            heap.free(w.team(), gathered);
            heap.free(w.team(), y);
        },
        test_options(128ull << 20));
}

// Each rank alone in a team: the collectives copy (in place too), the team runtime works, the workspace knows one
// rank; every rank does it at the same time.
TEST(Teams, TeamOfOne) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const uint64_t seed = test_seed() ^ 0x1ull;
    run_ranks(kWorld, [&](World& w) {
        RankStream rs;
        const Team solo = w.team().split_strided(w.rank(), 1, 1);
        ASSERT_EQ(solo.num_ranks(), 1);
        ASSERT_EQ(solo.rank(), 0);
        EXPECT_EQ(solo.members(), std::vector<int>{w.rank()});
        solo.barrier();
        const auto all = solo.all_gather("solo", Bytes{7, 8});
        ASSERT_EQ(all.size(), 1u);
        EXPECT_EQ(all[0], (Bytes{7, 8}));
        EXPECT_EQ(ops::prepare_collectives(solo).topology.num_ranks, 1);
        std::vector<std::string> failures;
        TeamBuffers b(solo, 4 * 10007, rs.s);
        uint64_t k = 0;
        for (uint64_t count : {uint64_t{1}, uint64_t{10007}}) {
            for (bool sym : {false, true}) {
                for (AllReduceAlgo a : kAllReduceAlgos) all_reduce_case(b, DType::kF32, a, count, sym, seed + k++, &failures);
                for (AllGatherAlgo a : kAllGatherAlgos) all_gather_case(b, DType::kBF16, a, count, sym, seed + k++, &failures);
                for (ReduceScatterAlgo a : kReduceScatterAlgos) {
                    reduce_scatter_case(b, DType::kF16, a, count, sym, seed + k++, &failures);
                }
            }
        }
        // In place: output == input.
        uint8_t* buf = b.in_base(true) + kGuardBytes;
        launch_fill_pattern(rs.s, buf, DType::kF32, 999, seed, 0, 0);
        ops::all_reduce(solo, TensorView(buf, DType::kF32, {999}), TensorView(buf, DType::kF32, {999}), rs.s);
        const std::vector<uint8_t> h = download(rs.s, buf, 999 * 4);
        for (uint64_t i = 0; i < 999; ++i) {
            if (bits_at(h, i * 4, 4) != int_bits(pattern_value(seed, 0, i), DType::kF32)) {
                failures.push_back("in-place all_reduce on a team of one changed element " + std::to_string(i));
                break;
            }
        }
        report(failures);
        b.release();
        w.barrier();
    });
}

// The same split made again (as a training step might, every step) is the same team on the device too: it reuses the
// first one's tables instead of allocating new ones, and collectives on it still work.
TEST(Teams, SplittingAgainReusesTheDeviceTables) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const auto staging = small_staging();  // the team's collective workspace fits the test heap
    run_ranks(kWorld, [&](World& w) {
        RankStream rs;
        const int start = w.rank() % 2;  // the even and the odd world ranks
        const auto split = [&] { return w.team().split_strided(start, 2, (kWorld - start + 1) / 2); };
        const Team first = split();
        const DeviceCtx ctx = first.device_ctx();
        for (int i = 0; i < 100; ++i) {
            const Team again = split();
            ASSERT_EQ(again.id(), first.id());
            EXPECT_EQ(again.device_ctx().peer_bases, ctx.peer_bases) << "split " << i << " made new tables";
        }
        const Team again = split();
        std::vector<std::string> failures;
        TeamBuffers b(again, 4 * 4096, rs.s);
        all_reduce_case(b, DType::kF32, AllReduceAlgo::kOneShot, 4096, true, test_seed() ^ 0x5ull, &failures);
        report(failures);
        b.release();
        w.barrier();
    });
}

// A team this rank is not in: every op (and the team runtime) says so, naming the op, this world rank and the
// team's world ranks; nothing is allocated, and the rank's own team still works afterwards.
TEST(Teams, CallWithATeamThisRankIsNotInIsAnError) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const auto staging = small_staging();  // the members' workspace fits the test heap
    run_ranks(kWorld, [](World& w) {
        RankStream rs;
        const int me = w.rank();
        const Team mine = w.team().split_strided(me % 2, 2, kWorld / 2);
        const Team other = w.team().split_strided(1 - me % 2, 2, kWorld / 2);
        ASSERT_FALSE(other.is_member());
        const uint64_t in_use = w.heap().bytes_in_use();
        float* buf = nullptr;
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&buf), 64 * 4, rs.s));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(rs.s));
        const TensorView v4(buf, DType::kF32, {4});
        const TensorView v16(buf + 16, DType::kF32, {16});
        const std::string tail = "world rank " + std::to_string(me) + " is not a member of this team (" +
                                 other.describe() + ")";
        const std::vector<std::pair<std::string, std::function<void()>>> calls = {
            {"all_reduce", [&] { ops::all_reduce(other, v4, v4, rs.s); }},
            {"all_gather", [&] { ops::all_gather(other, v4, v16, rs.s); }},
            {"reduce_scatter", [&] { ops::reduce_scatter(other, v16, v4, rs.s); }},
            {"prepare_collectives", [&] { ops::prepare_collectives(other); }},
            {"ep::Buffer",
             [&] {
                 ops::ep::Config c{.num_experts = 8, .hidden = 64, .topk = 2, .max_tokens_per_rank = 8};
                 ops::ep::Buffer ep(other, c);
             }},
            {"Team::barrier", [&] { other.barrier(); }},
            {"Team::all_gather('k')", [&] { other.all_gather("k", Bytes{1}); }},
            {"symmetric heap alloc", [&] { w.heap().alloc(other, 256); }},
            {"symmetric heap alloc_signals", [&] { w.heap().alloc_signals(other, 4); }},
            {"device_ctx", [&] { other.device_ctx(); }},
        };
        for (const auto& [op, call] : calls) {
            const std::string e = error_of(call);
            EXPECT_TRUE(contains(e, op + ": " + tail)) << op << ": '" << e << "'";
        }
        EXPECT_TRUE(contains(error_of([&] { ops::all_reduce(Team(), v4, v4, rs.s); }), "all_reduce: the team is empty"));
        EXPECT_EQ(w.heap().bytes_in_use(), in_use) << "a refused call allocated";
        EXPECT_EQ(w.find_extension(std::string("weft.ops.collectives/") + other.id()), nullptr);
        // The rank's own team is unaffected.
        launch_fill_pattern(rs.s, buf, DType::kF32, 4, 77, mine.rank(), 0);
        ops::all_reduce(mine, v4, v4, rs.s);
        const std::vector<uint8_t> h = download(rs.s, buf, 16);
        for (uint64_t i = 0; i < 4; ++i) {
            int32_t sum = 0;
            for (int q = 0; q < mine.num_ranks(); ++q) sum += pattern_value(77, q, i);
            EXPECT_EQ(bits_at(h, i * 4, 4), int_bits(sum, DType::kF32)) << "element " << i;
        }
        WEFT_CUDA_CHECK(cudaFreeAsync(buf, rs.s));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(rs.s));
        w.barrier();
    });
}

// ------------------------------------------------------------------------------------------------
// EP in every team at once.

ref::Params params_of(const ops::ep::Config& c, int num_ranks) {
    ref::Params p;
    p.num_ranks = num_ranks;
    p.num_experts = c.num_experts;
    p.topk = c.topk;
    p.hidden = c.hidden;
    p.expert_alignment = c.expert_alignment;
    return p;
}

/// A config that depends on the team's size and index (teams running at once differ in every dimension).
ops::ep::Config ep_config(int num_ranks, int index) {
    ops::ep::Config c;
    c.num_experts = num_ranks * (3 + index % 2);
    c.hidden = 136 + 8 * index;  // rows of 272+ bytes: partial chunks
    c.topk = std::min(3, c.num_experts);
    c.max_tokens_per_rank = 24 + 8 * index;
    c.low_latency = false;
    c.expert_alignment = index % 2 == 0 ? 1 : 4;
    return c;
}

/// Dispatch then combine of three routing scenarios on `team`'s Buffer: every received row against its source
/// payload, the counts and offsets against the host plan, the combine bit for bit against the host emulation. Ranks
/// are team ranks throughout (the reference knows nothing of the world).
void run_ep(const Team& team, int index, uint32_t seed, cudaStream_t s, std::vector<std::string>* failures) {
    namespace ep = ops::ep;
    const int n = team.num_ranks();
    const int me = team.rank();
    const ep::Config c = ep_config(n, index);
    const ref::Params p = params_of(c, n);
    ep::Buffer buffer(team, c);
    EXPECT_EQ(&buffer.team().world(), &team.world());
    ep::NormalHandle h = buffer.make_normal_handle();
    const int64_t max_rows = buffer.geometry().max_recv_rows;
    const size_t hidden = static_cast<size_t>(c.hidden);
    ref::DeviceArray<uint16_t> x(static_cast<size_t>(c.max_tokens_per_rank) * hidden + 8, s);
    ref::DeviceArray<int32_t> idx(static_cast<size_t>(c.max_tokens_per_rank + 1) * c.topk, s);
    ref::DeviceArray<float> wts(static_cast<size_t>(c.max_tokens_per_rank + 1) * c.topk, s);
    ref::DeviceArray<uint16_t> y(static_cast<size_t>(max_rows) * hidden, s);
    ref::DeviceArray<uint16_t> out(static_cast<size_t>(c.max_tokens_per_rank) * hidden, s);
    const ref::Scenario scenarios[] = {ref::Scenario::kUniform, ref::Scenario::kSkewed, ref::Scenario::kMixedCounts,
                                       ref::Scenario::kSomeDropped};
    for (int k = 0; k < 3; ++k) {
        const ref::Scenario sc = scenarios[(k + index) % 4];
        const uint32_t case_seed = seed + 1000u * static_cast<uint32_t>(k);
        const std::string what = "ep " + std::string(ref::scenario_name(sc)) + " on the team of " + team.describe() +
                                 " (team rank " + std::to_string(me) + ")";
        const std::vector<ref::Routing> all = ref::make_routing(sc, p, c.max_tokens_per_rank, case_seed);
        std::vector<std::vector<uint16_t>> x_all;
        for (int r = 0; r < n; ++r) {
            x_all.push_back(ref::payload_rows(r, all[static_cast<size_t>(r)].num_tokens, c.hidden, case_seed, false));
        }
        const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
        const ref::Routing& mine = all[static_cast<size_t>(me)];
        const int t = mine.num_tokens;
        x.upload(x_all[static_cast<size_t>(me)]);
        idx.upload(mine.topk_idx);
        wts.upload(mine.topk_weights);
        WEFT_CUDA_CHECK(cudaMemsetAsync(h.recv_x().data, 0xEE, static_cast<size_t>(max_rows) * hidden * 2, s));
        buffer.dispatch(h, TensorView(x.get(), DType::kBF16, {t, c.hidden}),
                        TensorView(idx.get(), DType::kI32, {t, c.topk}),
                        TensorView(wts.get(), DType::kF32, {t, c.topk}), s);
        buffer.sync_and_check(s);

        const size_t el = static_cast<size_t>(p.local_experts());
        if (ref::download(h.expert_counts(), el, s) != plan.expert_counts[static_cast<size_t>(me)]) {
            failures->push_back(what + ": expert_counts differ from the plan");
        }
        if (ref::download(h.expert_offsets(), el + 1, s) != plan.expert_offsets[static_cast<size_t>(me)]) {
            failures->push_back(what + ": expert_offsets differ from the plan");
        }
        const auto& rows = plan.rows[static_cast<size_t>(me)];
        const std::vector<uint16_t> got = ref::download(static_cast<const uint16_t*>(h.recv_x().data),
                                                        rows.size() * hidden, s);
        for (size_t row = 0; row < rows.size(); ++row) {
            const ref::RowSource src = rows[row];
            if (src.src < 0) continue;  // padding: unspecified
            const uint16_t* want = &x_all[static_cast<size_t>(src.src)][static_cast<size_t>(src.token) * hidden];
            if (!std::equal(want, want + hidden, &got[row * hidden])) {
                failures->push_back(what + ": received row " + std::to_string(row) + " should be team rank " +
                                    std::to_string(src.src) + " token " + std::to_string(src.token) + ", found " +
                                    ref::describe_row(&got[row * hidden]));
                break;
            }
        }

        // y: each received row through its expert (padding rows NaN: a combine that reads one fails loudly).
        std::vector<std::vector<uint16_t>> y_all(static_cast<size_t>(n));
        for (int r = 0; r < n; ++r) {
            auto& yr = y_all[static_cast<size_t>(r)];
            yr.assign(static_cast<size_t>(max_rows) * hidden, 0x7fc1);
            const auto& off = plan.expert_offsets[static_cast<size_t>(r)];
            for (int le = 0; le < p.local_experts(); ++le) {
                const int expert = r * p.local_experts() + le;
                for (int32_t row = off[static_cast<size_t>(le)]; row < off[static_cast<size_t>(le) + 1]; ++row) {
                    const ref::RowSource src = plan.rows[static_cast<size_t>(r)][static_cast<size_t>(row)];
                    if (src.src < 0) continue;
                    const uint16_t* xr = &x_all[static_cast<size_t>(src.src)][static_cast<size_t>(src.token) * hidden];
                    for (size_t ch = 0; ch < hidden; ++ch) {
                        yr[static_cast<size_t>(row) * hidden + ch] = ref::expert_output(xr[ch], expert);
                    }
                }
            }
        }
        y.upload(y_all[static_cast<size_t>(me)]);
        out.poison(0xFF);
        buffer.combine(h, TensorView(y.get(), DType::kBF16, {max_rows, c.hidden}),
                       TensorView(out.get(), DType::kBF16, {t, c.hidden}), s);
        buffer.sync_and_check(s);
        const std::vector<uint16_t> combined = ref::download(out.get(), static_cast<size_t>(t) * hidden, s);
        const std::vector<uint16_t> want = ref::reference_normal_combine(p, plan, all, me, [&](int r, int32_t row) {
            return &y_all[static_cast<size_t>(r)][static_cast<size_t>(row) * hidden];
        });
        if (combined != want) {
            size_t i = 0;
            while (i < want.size() && combined[i] == want[i]) ++i;
            failures->push_back(what + ": combine out element " + std::to_string(i) + " differs from the host emulation");
        }
    }
    // Every member is done with every peer's buffers before the handle and the Buffer free them.
    team.barrier();
}

ops::ep::Footprint largest_ep_footprint() {
    ops::ep::Footprint most;
    for (int n : {1, 2, 4}) {
        for (int index = 0; index < 4; ++index) {
            const ops::ep::Footprint f = ops::ep::footprint(ep_config(n, index), n);
            if (f.heap_bytes(1) > most.heap_bytes(1)) most = f;
        }
    }
    return most;
}

// World options with room in the heap for the largest EP buffer any team of the tests makes.
WorldOptions ep_team_options() {
    WorldOptions options = test_options();
    options.heap_bytes = std::max<uint64_t>(64ull << 20, largest_ep_footprint().heap_bytes(1) + (16ull << 20));
    return options;
}

// The EP data seed of team `index` of split `s`: every team of every split draws its own routing.
uint32_t ep_seed(uint32_t seed, Split s, int index) {
    return seed + 17u * static_cast<uint32_t>(s) + static_cast<uint32_t>(index);
}

// Every team of each split in turn (the others wait at a world barrier): EP's rank translation and team workspace,
// without teams running at once.
TEST(Teams, EpDispatchCombineInEveryTeamInTurn) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const uint32_t seed = static_cast<uint32_t>(test_seed() ^ 0xe7ull);
    const WorldOptions options = ep_team_options();
    run_ranks(
        kWorld,
        [&](World& w) {
            RankStream rs;
            std::vector<std::string> failures;
            for (Split s : kSplits) {
                const TeamOf t = make_team(w, s);
                const int teams = kWorld / t.team.num_ranks();
                for (int turn = 0; turn < teams; ++turn) {
                    if (t.index == turn) {
                        run_ep(t.team, t.index, ep_seed(seed, s, t.index), rs.s, &failures);
                    }
                    w.barrier();
                }
            }
            report(failures);
        },
        options);
}

// Every team's Buffer is made, used and destroyed while the other teams' EP kernels may spin on the same GPU: a
// Buffer's construction and release must not wait for the whole device (cudaHostAlloc, cudaDeviceSynchronize), or a
// member held up there keeps its team's kernels, and through them the other teams, waiting.
TEST(Teams, EpDispatchCombineInEveryTeamAtOnce) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const uint32_t seed = static_cast<uint32_t>(test_seed() ^ 0xe9ull);
    const WorldOptions options = ep_team_options();
    run_ranks(
        kWorld,
        [&](World& w) {
            RankStream rs;
            std::vector<std::string> failures;
            for (Split s : kSplits) {
                const TeamOf t = make_team(w, s);
                // Ranks sharing a GPU: every team's EP kernels are loaded (by a Buffer's construction) before any
                // team's kernels spin; a module load can wait for the context to idle (docs/runtime.md, "Teams").
                { ops::ep::Buffer warm(t.team, ep_config(t.team.num_ranks(), t.index)); }
                w.barrier();
                run_ep(t.team, t.index, ep_seed(seed, s, t.index), rs.s, &failures);
            }
            report(failures);
            w.barrier();
        },
        options);
}

TEST(Teams, EpOnATeamOfOne) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    const uint32_t seed = static_cast<uint32_t>(test_seed() ^ 0x1e9ull);
    const WorldOptions options = ep_team_options();
    run_ranks(
        4,
        [&](World& w) {
            RankStream rs;
            std::vector<std::string> failures;
            run_ep(w.team().split_strided(w.rank(), 1, 1), w.rank(), seed + static_cast<uint32_t>(w.rank()), rs.s,
                   &failures);
            report(failures);
            w.barrier();
        },
        options);
}

}  // namespace
}  // namespace weft::test
