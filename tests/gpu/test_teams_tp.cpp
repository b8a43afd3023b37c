// SPDX-License-Identifier: MIT
// GPU tests of the tensor-parallel fused ops on Teams: one process, 8 ranks as threads on the visible GPUs, split
// into TP teams (2 x 4 and 4 x 2 by colour, one of them with team ranks in the reverse of world order; 2 x 4 strided).
// AgGemm, GemmRs and GemmAr run in every team at once (each rank on its own stream, each team its own shapes, among
// them shapes that are not a multiple of any tile), each call checked against an fp64 reference on fresh random data
// with a poisoned output; a team of one rank runs the plain GEMMs; a call by a rank that is not a member, or on an
// empty team, is a weft::Error naming the op and the team, and does not disturb the members' own calls.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "support/error_text.hpp"
#include "support/runtime_checks.hpp"
#include "tp_test_util.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

using namespace tp_test;

constexpr int kWorld = 8;
constexpr int kCalls = 2;  // per op; the second AgGemm / GemmRs call uses about 2/3 of the rows
constexpr DType kDtype = DType::kBF16;

/// One team's problems (every member of a team uses the same; teams use different ones, so that their kernels,
/// signal counts and buffer sizes differ while they run side by side).
struct TeamShapes {
    int64_t ag_rows, ag_n, ag_k;  // AgGemm: rows per member, this member's N (its shard of the outputs), K
    int64_t rs_rows, rs_n, rs_k;  // GemmRs: rows per member (of C), N, this member's K
    int64_t ar_m, ar_n, ar_k;     // GemmAr: M (decode), N, this member's K
    int64_t ar_c_pad;             // GemmAr: padding of C's rows (> 0: the op's own all-reduce kernel)
};

// Shapes by team index. 100, 200, 72, 264, 1100 ... are not a multiple of any tile; an N that is a multiple of 8
// with a contiguous C takes GemmAr's ops::all_reduce half over the team, the others its own kernel.
const TeamShapes kShapes[] = {
    {100, 200, 72, 96, 264, 128, 1, 1000, 256, 0},
    {128, 256, 128, 200, 520, 136, 5, 1100, 512, 0},
    {64, 384, 256, 33, 1000, 256, 16, 520, 136, 8},
    {72, 136, 512, 64, 130, 64, 3, 2048, 256, 0},
};

/// A buffer size no call below exceeds (rows x row stride x 2 bytes of every view).
constexpr size_t kBufBytes = size_t{8} << 20;

/// The team every rank of a test lands in, and the index that picks its shapes and seeds (the same on every member).
struct TeamOf {
    Team team;
    int index = 0;
};

std::string team_text(const TeamOf& t) {
    std::ostringstream os;
    os << "team " << t.index << " '" << t.team.id() << "' (" << t.team.describe() << ") team rank " << t.team.rank();
    return os.str();
}

/// A role of seed_of for team `index`: every team draws its own data.
int role_of(int index, int role) { return 16 * (index + 1) + role; }

/// The buffers one rank's calls use. Made before any team runs (a world barrier follows) and freed after every team
/// is done, so that no device-synchronising cudaMalloc / cudaFree runs while a team's kernels wait for a member.
struct RankBuffers {
    DevBuf a{kBufBytes}, b{kBufBytes}, c{kBufBytes};
};

void check_fits(const HostMat& h, const char* what) {
    WEFT_CHECK(h.bytes() <= kBufBytes, "test: " << what << " needs " << h.bytes() << " bytes, more than the "
                                                << kBufBytes << " of the test's buffers");
}

/// One call of `op` on this rank's a, b and (poisoned) c through the rank's buffers; c comes back with the result.
template <class Op>
void run_op(World& w, Op& op, const HostMat& a, const HostMat& b, HostMat& c, RankBuffers& buf, cudaStream_t st) {
    check_fits(a, "a");
    check_fits(b, "b");
    check_fits(c, "c");
    upload(a, buf.a.ptr, st);
    upload(b, buf.b.ptr, st);
    upload(c, buf.c.ptr, st);
    op.run(view(a, buf.a.ptr), view(b, buf.b.ptr), view(c, buf.c.ptr), st);
    w.sync_and_check(st);
    download(c, buf.c.ptr, st);
}

/// AgGemm on the team: kCalls calls, C against fp64 of AllGather(A) * B^T.
void check_ag_gemm(World& w, const TeamOf& t, const TeamShapes& sh, RankBuffers& buf, cudaStream_t st, uint64_t base,
                   Failures& f) {
    const Team& team = t.team;
    const int nr = team.num_ranks(), me = team.rank();
    const int64_t ldk = ld_for(sh.ag_k), ldc = ld_for(sh.ag_n, 8);
    ops::AgGemm op(team, {sh.ag_rows * nr, sh.ag_n, sh.ag_k, kDtype});
    for (int call = 0; call < kCalls; ++call) {
        const int64_t rows = call == 1 ? std::max<int64_t>(1, sh.ag_rows * 2 / 3) : sh.ag_rows;
        const int64_t m = rows * nr;
        const std::string at = "ag_gemm " + team_text(t) + " call " + std::to_string(call) + " M " + std::to_string(m);
        HostMat a_full(m, sh.ag_k, ldk, kDtype);  // the gathered A: member r holds rows [r*rows, (r+1)*rows)
        a_full.fill_random(seed_of(base, role_of(t.index, 0), 0, call));
        HostMat a(rows, sh.ag_k, ldk, kDtype);
        std::copy(a_full.bits.begin() + me * rows * ldk, a_full.bits.begin() + (me + 1) * rows * ldk, a.bits.begin());
        HostMat b(sh.ag_n, sh.ag_k, ldk, kDtype);  // this member's weight shard
        b.fill_random(seed_of(base, role_of(t.index, 1), me, call));
        HostMat c(m, sh.ag_n, ldc, kDtype);
        poison(c);
        run_op(w, op, a, b, c, buf, st);
        const std::vector<int64_t> rows_checked =
            rows_to_check(m, rows, static_cast<double>(sh.ag_n * sh.ag_k), seed_of(base, 2, w.rank(), call));
        Reference ref(static_cast<int64_t>(rows_checked.size()), sh.ag_n);
        ref.add(a_full, 0, rows_checked, b);
        const std::string bad = compare(c, rows_checked, ref, ErrorModel::gemm(kDtype));
        if (!bad.empty()) f.add(at + ": " + bad);
    }
}

/// GemmRs on the team: kCalls calls, this member's rows of sum over members of A_r * B_r^T.
void check_gemm_rs(World& w, const TeamOf& t, const TeamShapes& sh, RankBuffers& buf, cudaStream_t st, uint64_t base,
                   Failures& f) {
    const Team& team = t.team;
    const int nr = team.num_ranks(), me = team.rank();
    const int64_t ldk = ld_for(sh.rs_k), ldc = ld_for(sh.rs_n, 8);
    ops::GemmRs op(team, {sh.rs_rows * nr, sh.rs_n, sh.rs_k, kDtype});
    for (int call = 0; call < kCalls; ++call) {
        const int64_t rows = call == 1 ? std::max<int64_t>(1, sh.rs_rows * 2 / 3) : sh.rs_rows;
        const int64_t m = rows * nr;
        const std::string at = "gemm_rs " + team_text(t) + " call " + std::to_string(call) + " M " + std::to_string(m);
        std::vector<HostMat> as, bs;  // every member's A and B (the reference needs all of them)
        for (int r = 0; r < nr; ++r) {
            as.emplace_back(m, sh.rs_k, ldk, kDtype);
            as.back().fill_random(seed_of(base, role_of(t.index, 3), r, call));
            bs.emplace_back(sh.rs_n, sh.rs_k, ldk, kDtype);
            bs.back().fill_random(seed_of(base, role_of(t.index, 4), r, call));
        }
        const HostMat& a = as[static_cast<size_t>(me)];
        const HostMat& b = bs[static_cast<size_t>(me)];
        HostMat c(rows, sh.rs_n, ldc, kDtype);
        poison(c);
        run_op(w, op, a, b, c, buf, st);
        const std::vector<int64_t> rows_checked =
            rows_to_check(rows, rows, static_cast<double>(sh.rs_n * sh.rs_k * nr), seed_of(base, 5, w.rank(), call));
        Reference ref(static_cast<int64_t>(rows_checked.size()), sh.rs_n);
        for (int r = 0; r < nr; ++r) {
            ref.add(as[static_cast<size_t>(r)], me * rows, rows_checked, bs[static_cast<size_t>(r)]);
        }
        const std::string bad = compare(c, rows_checked, ref, ErrorModel::tp_sum(kDtype, op.partial_dtype(), nr));
        if (!bad.empty()) f.add(at + ": " + bad);
    }
}

/// The bits of every member's GemmAr result, by (team, call): members must agree bit for bit.
struct ArHashes {
    std::mutex mutex;
    std::map<std::string, std::map<int, uint64_t>> by_call;  // "team id / call" -> team rank -> hash

    void add(const std::string& key, int team_rank, const HostMat& h) {
        uint64_t x = 1469598103934665603ull;
        for (int64_t r = 0; r < h.rows; ++r)
            for (int64_t c = 0; c < h.cols; ++c) x = (x ^ h.bits[static_cast<size_t>(r * h.ld + c)]) * 1099511628211ull;
        std::lock_guard<std::mutex> lock(mutex);
        by_call[key][team_rank] = x;
    }
    void check() {
        for (const auto& [key, hashes] : by_call) {
            for (const auto& [team_rank, hash] : hashes) {
                EXPECT_EQ(hash, hashes.begin()->second)
                    << "gemm_ar " << key << ": team rank " << team_rank << "'s result differs from team rank "
                    << hashes.begin()->first << "'s";
            }
        }
    }
};

/// GemmAr on the team: kCalls calls, sum over members of A_r * B_r^T on every member.
void check_gemm_ar(World& w, const TeamOf& t, const TeamShapes& sh, RankBuffers& buf, cudaStream_t st, uint64_t base,
                   Failures& f, ArHashes& hashes) {
    const Team& team = t.team;
    const int nr = team.num_ranks(), me = team.rank();
    const int64_t ldk = ld_for(sh.ar_k), ldc = ld_for(sh.ar_n, sh.ar_c_pad);
    ops::GemmAr op(team, {sh.ar_m, sh.ar_n, sh.ar_k, kDtype});
    for (int call = 0; call < kCalls; ++call) {
        const int64_t m = call == 1 ? std::max<int64_t>(1, sh.ar_m / 2) : sh.ar_m;
        const std::string at = "gemm_ar " + team_text(t) + " call " + std::to_string(call) + " M " + std::to_string(m);
        std::vector<HostMat> as, bs;
        for (int r = 0; r < nr; ++r) {
            as.emplace_back(m, sh.ar_k, ldk, kDtype);
            as.back().fill_random(seed_of(base, role_of(t.index, 6), r, call));
            bs.emplace_back(sh.ar_n, sh.ar_k, ldk, kDtype);
            bs.back().fill_random(seed_of(base, role_of(t.index, 7), r, call));
        }
        const HostMat& a = as[static_cast<size_t>(me)];
        const HostMat& b = bs[static_cast<size_t>(me)];
        HostMat c(m, sh.ar_n, ldc, kDtype);
        poison(c);
        run_op(w, op, a, b, c, buf, st);
        std::vector<int64_t> rows(static_cast<size_t>(m));
        for (int64_t r = 0; r < m; ++r) rows[static_cast<size_t>(r)] = r;
        Reference ref(m, sh.ar_n);
        for (int r = 0; r < nr; ++r) ref.add(as[static_cast<size_t>(r)], 0, rows, bs[static_cast<size_t>(r)]);
        const std::string bad = compare(c, rows, ref, ErrorModel::tp_sum(kDtype, op.partial_dtype(), nr));
        if (!bad.empty()) f.add(at + ": " + bad);
        hashes.add(team.id() + " / call " + std::to_string(call), me, c);
    }
}

/// Every rank: its team from `team_of`, then AgGemm, GemmRs and GemmAr on it, while the other teams run theirs.
void run_teams(const std::function<TeamOf(World&)>& team_of) {
    const uint64_t base = fresh_seed();
    Failures f;
    ArHashes hashes;
    test::run_ranks(
        kWorld,
        [&](World& w) {
            const TeamOf t = team_of(w);
            const TeamShapes& sh = kShapes[static_cast<size_t>(t.index) % std::size(kShapes)];
            SCOPED_TRACE(team_text(t) + " seed " + std::to_string(base));
            cudaStream_t st = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
            {
                // Ranks sharing a GPU: every team's kernels are loaded before any team's kernels spin (a module load
                // can wait for the context to idle, i.e. for another team's spinning kernels; docs/runtime.md,
                // "Teams"). Making each op once loads everything its calls launch.
                const int nr = t.team.num_ranks();
                { ops::AgGemm warm(t.team, {sh.ag_rows * nr, sh.ag_n, sh.ag_k, kDtype}); }
                { ops::GemmRs warm(t.team, {sh.rs_rows * nr, sh.rs_n, sh.rs_k, kDtype}); }
                { ops::GemmAr warm(t.team, {sh.ar_m, sh.ar_n, sh.ar_k, kDtype}); }
                RankBuffers buf;
                w.barrier();  // every rank's buffers exist before any team's kernels wait (RankBuffers)
                check_ag_gemm(w, t, sh, buf, st, base, f);
                check_gemm_rs(w, t, sh, buf, st, base, f);
                check_gemm_ar(w, t, sh, buf, st, base, f, hashes);
                w.barrier();  // every team is done before any buffer is freed
            }
            WEFT_CUDA_CHECK(cudaStreamDestroy(st));
        },
        test::test_options(256ull << 20));
    f.report();
    hashes.check();
}

// Two TP teams of 4, {0,1,2,3} and {4,5,6,7}, with team ranks in the reverse of world order (key = -rank): a peer
// addressed by its world rank where the op means its team rank would read or write another member's buffers.
TEST(TpTeams, TwoTeamsOfFourRunAllOpsAtOnce) {
    run_teams([](World& w) {
        const int color = w.rank() / 4;
        return TeamOf{w.team().split_color(color, -w.rank()), color};
    });
}

// Four TP teams of 2: {0,1}, {2,3}, {4,5}, {6,7}.
TEST(TpTeams, FourTeamsOfTwoRunAllOpsAtOnce) {
    run_teams([](World& w) {
        const int color = w.rank() / 2;
        return TeamOf{w.team().split_color(color, w.rank()), color};
    });
}

// Two strided teams of 4, {0,2,4,6} and {1,3,5,7} (the DP groups of a 4 x 2 layout, as TP teams).
TEST(TpTeams, StridedTeamsRunAllOpsAtOnce) {
    run_teams([](World& w) {
        const int start = w.rank() % 2;
        return TeamOf{w.team().split_strided(start, 2, 4), start};
    });
}

// Every rank a team of its own: the ops run the plain GEMM (and GemmAr no all-reduce), eight teams at once.
TEST(TpTeams, TeamsOfOneRankRunThePlainGemm) {
    run_teams([](World& w) { return TeamOf{w.team().split_color(w.rank(), 0), w.rank()}; });
}

using testing::error_of;

void expect_contains(const std::string& what, const std::string& part, const std::string& context) {
    EXPECT_NE(what.find(part), std::string::npos)
        << context << ": expected an error containing '" << part << "', got '" << what << "'";
}

// The odd ranks hold the team of the even ranks without being members: each op's constructor (and FusedGemm's) is a
// weft::Error naming the op, the rank and the team's world ranks, while the members run an AgGemm on that team at the
// same time, unaffected. An empty team is an error too, and a shape that does not fit the team's size names it.
TEST(TpTeams, NonMemberCallIsAnErrorNamingTheTeam) {
    const uint64_t base = fresh_seed();
    Failures f;
    std::mutex mutex;
    std::vector<std::string> non_member_errors;  // one per op per odd rank
    test::run_ranks(
        kWorld,
        [&](World& w) {
            const Team evens = w.team().split_strided(0, 2, 4);
            const std::string members = evens.describe();  // "world ranks 0, 2, 4, 6"
            cudaStream_t st = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
            {
                RankBuffers buf;
                w.barrier();
                if (evens.is_member()) {
                    check_ag_gemm(w, TeamOf{evens, 0}, kShapes[0], buf, st, base, f);
                    // A max_m that is not a multiple of the team's size: every member throws before any collective.
                    const std::string e = error_of([&] { ops::GemmRs op(evens, {6, 64, 64, kDtype}); });
                    expect_contains(e, "gemm_rs", "gemm_rs with max_m 6 on a team of 4");
                    expect_contains(e, "team's num_ranks 4", "gemm_rs with max_m 6 on a team of 4");
                } else {
                    const std::string rank = "world rank " + std::to_string(w.rank()) + " is not a member";
                    const std::vector<std::pair<std::string, std::string>> calls = {
                        {"ag_gemm", error_of([&] {
                             ops::AgGemm op(evens, {400, 200, 72, kDtype});
                         })},
                        {"gemm_rs", error_of([&] {
                             ops::GemmRs op(evens, {400, 264, 128, kDtype});
                         })},
                        {"gemm_ar", error_of([&] {
                             ops::GemmAr op(evens, {1, 1000, 256, kDtype});
                         })},
                        {"fused_gemm", error_of([&] {
                             ops::FusedGemm g(evens, ops::plain_gemm_fused_spec(),
                                              ops::fused_gemm_config({.m = 128, .n = 128, .k = 64}, 4));
                         })},
                    };
                    for (const auto& [op, e] : calls) {
                        const std::string context = op + " on a team this rank is not in";
                        expect_contains(e, op == "fused_gemm" ? "plain_gemm" : op, context);
                        expect_contains(e, rank, context);
                        expect_contains(e, members, context);
                        std::lock_guard<std::mutex> lock(mutex);
                        non_member_errors.push_back(e);
                    }
                }
                // An empty team (a split_color with a negative colour gives one) on every rank.
                const Team empty = w.team().split_color(-1, 0);
                const std::string e = error_of([&] { ops::AgGemm op(empty, {400, 200, 72, kDtype}); });
                expect_contains(e, "ag_gemm", "ag_gemm on an empty team");
                w.barrier();
            }
            WEFT_CUDA_CHECK(cudaStreamDestroy(st));
        },
        test::test_options(256ull << 20));
    f.report();
    EXPECT_EQ(non_member_errors.size(), 4u * kWorld / 2);
}

}  // namespace
}  // namespace weft
