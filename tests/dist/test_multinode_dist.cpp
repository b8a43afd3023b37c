// SPDX-License-Identifier: MIT
// Teams that span (virtual) nodes, one process per rank: the hierarchical collectives, all_to_all, AgGemm
// (AllGather+GEMM), GemmRs (GEMM+ReduceScatter) and expert-parallel dispatch/combine (normal and low-latency modes)
// against a host reference on awkward sizes, and a rank on another node that never arrives (docs/multinode.md). Run
// under virtual nodes, e.g.
//   WEFT_VIRTUAL_NODES=2 weftrun -n 4 -- weft_dist_tests --gtest_filter='MultiNode*'
// Without virtual nodes (one node) every test here skips.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "dist/dist_world.hpp"
#include "gpu/collectives_test_kernels.hpp"
#include "gpu/tp_test_util.hpp"
#include "support/ep_reference.hpp"
#include "support/ep_testing.hpp"
#include "weft/net/host_backend.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/ops/ep.hpp"
#include "weft/ops/ep_moe.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/runtime/stream.hpp"
#include "weft/weft.hpp"

namespace weft::test {

std::string why_no_network_across_nodes(const World& w) {
    if (w.num_nodes() < 2) return "one node (set WEFT_VIRTUAL_NODES)";
    return net::nccl_unavailable_reason();
}

namespace {

// Small chunks, so that every size above a few KiB runs the pipeline over several chunks; small staging for the
// node teams' workspaces (the dist World's heap is small). Every process sets the same.
void set_test_environment() {
    ::setenv("WEFT_NET_CHUNK_BYTES", "64K", 1);
    ::setenv("WEFT_COLLECTIVE_STAGING_BYTES", "1M", 1);
}

bool spans_nodes(const World& w) { return w.num_nodes() > 1; }

struct Buffers {
    cudaStream_t stream = nullptr;
    uint8_t* in = nullptr;
    uint8_t* out = nullptr;
    explicit Buffers(uint64_t bytes) {
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&in), bytes));
        WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&out), bytes));
    }
    ~Buffers() {
        cudaStreamSynchronize(stream);
        cudaFree(in);
        cudaFree(out);
        cudaStreamDestroy(stream);
    }
};

void upload(cudaStream_t s, void* dst, DType t, uint64_t count, uint64_t seed, int rank) {
    const int es = dtype_bytes(t);
    std::vector<uint8_t> h(count * static_cast<uint64_t>(es));
    for (uint64_t i = 0; i < count; ++i) {
        const uint32_t b = int_bits(pattern_value(seed, rank, i), t);
        std::memcpy(h.data() + i * static_cast<uint64_t>(es), &b, static_cast<size_t>(es));
    }
    WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, h.data(), h.size(), cudaMemcpyHostToDevice, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
}

std::vector<uint32_t> download(cudaStream_t s, const void* src, DType t, uint64_t count) {
    const int es = dtype_bytes(t);
    std::vector<uint8_t> h(count * static_cast<uint64_t>(es));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(h.data(), src, h.size(), cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<uint32_t> bits(count, 0);
    for (uint64_t i = 0; i < count; ++i) {
        std::memcpy(&bits[i], h.data() + i * static_cast<uint64_t>(es), static_cast<size_t>(es));
    }
    return bits;
}

// The teams to test: the world, and (with an even number of ranks per node, at least 2) every other rank, which spans
// the nodes with half the members per node and interleaves them in team-rank order. (With an odd number per node,
// every other rank would put unequal numbers of members on the nodes, which the ops across nodes refuse.)
std::vector<Team> teams_under_test(World& w) {
    std::vector<Team> teams{w.team()};
    const int per_node = w.num_ranks() / w.num_nodes();
    if (per_node >= 2 && per_node % 2 == 0) teams.push_back(w.team().split_strided(0, 2, w.num_ranks() / 2));
    return teams;
}

// teams_under_test and, with 2 or more ranks per node, the world with team ranks interleaved across the nodes (team
// rank l * N + n is node n's member l: not node-major; every node stage packs and every received step unpacks).
// Collective over the world.
std::vector<Team> teams_with_interleaved(World& w) {
    std::vector<Team> teams = teams_under_test(w);
    const int per_node = w.num_ranks() / w.num_nodes();
    if (per_node >= 2) teams.push_back(w.team().split_color(0, (w.rank() % per_node) * w.num_nodes() + w.node()));
    return teams;
}

TEST(MultiNode, TopologyOfVirtualNodes) {
    World& w = dist_world();
    if (!spans_nodes(w)) GTEST_SKIP() << "one node (set WEFT_VIRTUAL_NODES)";
    const int per_node = w.num_ranks() / w.num_nodes();
    EXPECT_EQ(w.node(), w.rank() / per_node);
    EXPECT_EQ(w.node_team().num_ranks(), per_node);
    EXPECT_EQ(w.team().num_nodes(), w.num_nodes());
    EXPECT_EQ(w.team().ranks_per_node(), per_node);
    EXPECT_EQ(w.team().local_index(), w.rank() % per_node);
    // Peers on another node are not load/store reachable; peers on this node are.
    auto* probe = static_cast<uint8_t*>(w.heap().alloc(256));
    for (int r = 0; r < w.num_ranks(); ++r) {
        void* at = w.heap().symm_at(probe, r);
        if (r / per_node == w.node()) {
            EXPECT_NE(at, nullptr) << "rank " << r << " is on this node";
        } else {
            EXPECT_EQ(at, nullptr) << "rank " << r << " is on another node";
        }
    }
    w.heap().free(probe);
}

TEST(MultiNode, AllGatherMatchesTheReference) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    for (const Team& team : teams_under_test(w)) {
        if (!team.is_member()) continue;
        const int n = team.num_ranks();
        for (DType t : {DType::kU8, DType::kBF16}) {
            for (uint64_t count : {1ull, 37ull, 4099ull, 100003ull}) {
                const uint64_t total = count * static_cast<uint64_t>(n);
                Buffers b(total * static_cast<uint64_t>(dtype_bytes(t)));
                const uint64_t seed = count * 13 + static_cast<uint64_t>(t);
                WEFT_CUDA_CHECK(cudaMemsetAsync(b.out, 0xA5, total * dtype_bytes(t), b.stream));
                upload(b.stream, b.in, t, count, seed, team.rank());
                ops::all_gather(team, TensorView(b.in, t, {static_cast<int64_t>(count)}),
                                TensorView(b.out, t, {static_cast<int64_t>(total)}), b.stream);
                w.sync_and_check(b.stream);
                const std::vector<uint32_t> got = download(b.stream, b.out, t, total);
                const uint32_t mask = t == DType::kU8 ? 0xFFu : 0xFFFFu;
                uint64_t bad = 0;
                for (uint64_t k = 0; k < total; ++k) {
                    bad += got[k] != (int_bits(pattern_value(seed, static_cast<int>(k / count), k % count), t) & mask);
                }
                EXPECT_EQ(bad, 0u) << "rank " << w.rank() << ": all_gather on " << team.describe() << " "
                                   << dtype_name(t) << " count " << count;
            }
        }
    }
}

TEST(MultiNode, ReduceScatterMatchesTheReference) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    for (const Team& team : teams_under_test(w)) {
        if (!team.is_member()) continue;
        const int n = team.num_ranks();
        for (DType t : {DType::kBF16, DType::kF32}) {
            for (uint64_t count : {1ull, 129ull, 70001ull}) {
                const uint64_t total = count * static_cast<uint64_t>(n);
                Buffers b(total * static_cast<uint64_t>(dtype_bytes(t)));
                const uint64_t seed = count * 17 + static_cast<uint64_t>(t);
                WEFT_CUDA_CHECK(cudaMemsetAsync(b.out, 0xFF, count * dtype_bytes(t), b.stream));
                upload(b.stream, b.in, t, total, seed, team.rank());
                ops::reduce_scatter(team, TensorView(b.in, t, {static_cast<int64_t>(total)}),
                                    TensorView(b.out, t, {static_cast<int64_t>(count)}), b.stream);
                w.sync_and_check(b.stream);
                const std::vector<uint32_t> got = download(b.stream, b.out, t, count);
                uint64_t bad = 0;
                for (uint64_t i = 0; i < count; ++i) {
                    int32_t sum = 0;
                    for (int r = 0; r < n; ++r) {
                        sum += pattern_value(seed, r, static_cast<uint64_t>(team.rank()) * count + i);
                    }
                    bad += got[i] != int_bits(sum, t);
                }
                EXPECT_EQ(bad, 0u) << "rank " << w.rank() << ": reduce_scatter on " << team.describe() << " "
                                   << dtype_name(t) << " count " << count;
            }
        }
    }
}

TEST(MultiNode, AllReduceMatchesTheReference) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    for (const Team& team : teams_under_test(w)) {
        if (!team.is_member()) continue;
        const int n = team.num_ranks();
        for (DType t : {DType::kBF16, DType::kF32}) {
            for (uint64_t count : {1ull, 7ull, 1001ull, 300001ull}) {
                for (bool in_place : {false, true}) {
                    Buffers b(count * static_cast<uint64_t>(dtype_bytes(t)));
                    const uint64_t seed = count * 7 + static_cast<uint64_t>(t) + (in_place ? 3 : 0);
                    uint8_t* out = in_place ? b.in : b.out;
                    if (!in_place) WEFT_CUDA_CHECK(cudaMemsetAsync(b.out, 0xFF, count * dtype_bytes(t), b.stream));
                    upload(b.stream, b.in, t, count, seed, team.rank());
                    ops::all_reduce(team, TensorView(b.in, t, {static_cast<int64_t>(count)}),
                                    TensorView(out, t, {static_cast<int64_t>(count)}), b.stream);
                    w.sync_and_check(b.stream);
                    const std::vector<uint32_t> got = download(b.stream, out, t, count);
                    uint64_t bad = 0;
                    for (uint64_t i = 0; i < count; ++i) {
                        int32_t sum = 0;
                        for (int r = 0; r < n; ++r) sum += pattern_value(seed, r, i);
                        bad += got[i] != int_bits(sum, t);
                    }
                    EXPECT_EQ(bad, 0u) << "rank " << w.rank() << ": all_reduce on " << team.describe() << " "
                                       << dtype_name(t) << " count " << count << (in_place ? " in place" : "");
                }
            }
        }
    }
}

// all_to_all on a team that spans nodes (docs/multinode.md, "All-to-all across nodes"), against a host reference:
// the teams of teams_under_test and, with 2 or more ranks per node, the world with interleaved team ranks (team rank
// t(n, l) = l * N + n: every node stage packs and every received step unpacks). Blocks of 1 element and of sizes that
// are not multiples of 16 bytes, one and several network chunks, several dtypes, poisoned output, fresh data per call;
// with `graph`, the second call replays a CUDA graph captured after the first (new data uploaded between them).
void run_all_to_all_across_nodes(bool graph) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    const std::vector<Team> teams = teams_with_interleaved(w);
    for (const Team& team : teams) {
        if (!team.is_member()) continue;
        const int n = team.num_ranks();
        const int me = team.rank();
        for (DType t : {DType::kU8, DType::kBF16, DType::kF32}) {
            const int es = dtype_bytes(t);
            const uint32_t mask = es == 4 ? 0xFFFFFFFFu : (1u << (8 * es)) - 1u;
            for (uint64_t count : {1ull, 3ull, 37ull, 4099ull, 70001ull}) {
                const uint64_t total = count * static_cast<uint64_t>(n);
                const uint64_t bytes = total * static_cast<uint64_t>(es);
                Buffers b(bytes);
                const TensorView in(b.in, t, {static_cast<int64_t>(total)});
                const TensorView out(b.out, t, {static_cast<int64_t>(total)});
                cudaGraphExec_t exec = nullptr;
                for (int call = 0; call < 2; ++call) {
                    const uint64_t seed = count * 19 + static_cast<uint64_t>(t) * 5 + static_cast<uint64_t>(call);
                    WEFT_CUDA_CHECK(cudaMemsetAsync(b.out, 0xA5 + call, bytes, b.stream));
                    upload(b.stream, b.in, t, total, seed, me);
                    if (graph && call == 1) {
                        WEFT_CUDA_CHECK(cudaGraphLaunch(exec, b.stream));
                    } else {
                        ops::all_to_all(team, in, out, b.stream);
                    }
                    w.sync_and_check(b.stream);
                    const std::vector<uint32_t> got = download(b.stream, b.out, t, total);
                    uint64_t bad = 0;
                    for (uint64_t k = 0; k < total; ++k) {
                        // Block q of the output is block `me` of team rank q's input.
                        const auto q = static_cast<int>(k / count);
                        const uint64_t at = static_cast<uint64_t>(me) * count + k % count;
                        bad += got[k] != (int_bits(pattern_value(seed, q, at), t) & mask);
                    }
                    EXPECT_EQ(bad, 0u) << "rank " << w.rank() << ": all_to_all on " << team.describe() << " "
                                       << dtype_name(t) << " count " << count << " call " << call
                                       << (graph ? " (graph)" : "");
                    if (graph && call == 0) {
                        // The communicators exist (first call): capture a call, replayed as call 1.
                        team.barrier();
                        cudaGraph_t gr = nullptr;
                        WEFT_CUDA_CHECK(cudaStreamBeginCapture(b.stream, cudaStreamCaptureModeThreadLocal));
                        ops::all_to_all(team, in, out, b.stream);
                        WEFT_CUDA_CHECK(cudaStreamEndCapture(b.stream, &gr));
                        WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, gr, 0));
                        WEFT_CUDA_CHECK(cudaGraphDestroy(gr));
                    }
                }
                if (exec != nullptr) WEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
            }
        }
    }
}

TEST(MultiNode, AllToAllMatchesTheReference) { run_all_to_all_across_nodes(false); }

TEST(MultiNode, AllToAllGraphReplay) { run_all_to_all_across_nodes(true); }

// all_to_all_v on a team that spans nodes, against a host reference: the same teams as all_to_all; counts from a
// hash of (source, destination), the same on every rank (zeros included, a few elements to several network chunks).
TEST(MultiNode, AllToAllVMatchesTheReference) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    const std::vector<Team> teams = teams_with_interleaved(w);
    for (const Team& team : teams) {
        if (!team.is_member()) continue;
        const int n = team.num_ranks();
        const int me = team.rank();
        for (DType t : {DType::kU8, DType::kBF16, DType::kF32}) {
            const int es = dtype_bytes(t);
            const uint32_t mask = es == 4 ? 0xFFFFFFFFu : (1u << (8 * es)) - 1u;
            for (uint64_t max_count : {5ull, 1000ull, 30000ull}) {
                const uint64_t seed = max_count * 29 + static_cast<uint64_t>(t) * 3 + 1;
                const auto count = [&](int src, int dst) {
                    const uint64_t h = (seed ^ (static_cast<uint64_t>(src) * 0x9E3779B97F4A7C15ull)) +
                                       static_cast<uint64_t>(dst) * 0xC2B2AE3D27D4EB4Full;
                    return static_cast<int64_t>((h >> 17) % (max_count + 1));
                };
                std::vector<int64_t> send_counts(static_cast<size_t>(n)), recv_counts(static_cast<size_t>(n));
                uint64_t sent = 0, received = 0;
                for (int q = 0; q < n; ++q) {
                    send_counts[static_cast<size_t>(q)] = count(me, q);
                    recv_counts[static_cast<size_t>(q)] = count(q, me);
                    sent += static_cast<uint64_t>(count(me, q));
                    received += static_cast<uint64_t>(count(q, me));
                }
                Buffers b(std::max<uint64_t>(1, std::max(sent, received)) * static_cast<uint64_t>(es));
                WEFT_CUDA_CHECK(cudaMemsetAsync(b.out, 0xA5, received * static_cast<uint64_t>(es), b.stream));
                upload(b.stream, b.in, t, sent, seed, me);
                ops::all_to_all_v(team, TensorView(b.in, t, {static_cast<int64_t>(sent)}), send_counts,
                                  TensorView(b.out, t, {static_cast<int64_t>(received)}), recv_counts, b.stream);
                w.sync_and_check(b.stream);
                const std::vector<uint32_t> got = download(b.stream, b.out, t, received);
                uint64_t bad = 0, at = 0;
                for (int q = 0; q < n; ++q) {
                    // Rank q's piece for this rank starts after its pieces for ranks 0 .. me - 1.
                    uint64_t from = 0;
                    for (int d = 0; d < me; ++d) from += static_cast<uint64_t>(count(q, d));
                    for (int64_t i = 0; i < count(q, me); ++i, ++at) {
                        bad += got[at] != (int_bits(pattern_value(seed, q, from + static_cast<uint64_t>(i)), t) & mask);
                    }
                }
                EXPECT_EQ(bad, 0u) << "rank " << w.rank() << ": all_to_all_v on " << team.describe() << " "
                                   << dtype_name(t) << " max count " << max_count;
            }
        }
    }
}

// all_to_all_v counts that disagree, within a node (rank 1 expects one element more from rank 0 than rank 0 sends it)
// or across nodes (the last rank does): every member refuses before anything is enqueued (the counts are exchanged
// over the whole team), well inside the World's minute-long timeout.
TEST(MultiNode, AllToAllVCountsThatDisagreeFailEveryRankPromptly) {
    World& main_world = dist_world();
    if (const std::string why = why_no_network_across_nodes(main_world); !why.empty()) GTEST_SKIP() << why;
    if (main_world.num_ranks() / main_world.num_nodes() < 2) GTEST_SKIP() << "needs 2 ranks per node";
    set_test_environment();
    for (bool across : {false, true}) {
        SCOPED_TRACE(across ? "across nodes" : "within a node");
        WorldOptions options;
        options.timeout = std::chrono::milliseconds(60000);
        options.heartbeat = std::chrono::milliseconds(200);
        options.heap_bytes = 64ull << 20;
        std::unique_ptr<World> w = World::from_env(options);
        const auto n = static_cast<size_t>(w->num_ranks());
        // Virtual nodes are consecutive ranks: 0 and 1 share node 0, the last rank is on the last node.
        const int odd = across ? w->num_ranks() - 1 : 1;
        std::vector<int64_t> send(n, 100), recv(n, 100);
        if (w->rank() == odd) recv[0] = 101;
        Buffers b(n * 101 * 4);
        const auto start = std::chrono::steady_clock::now();
        std::string error;
        try {
            ops::all_to_all_v(*w, TensorView(b.in, DType::kF32, {static_cast<int64_t>(n * 100)}), send,
                              TensorView(b.out, DType::kF32, {static_cast<int64_t>(n * 100 + (w->rank() == odd))}),
                              recv, b.stream);
            w->sync_and_check(b.stream);
        } catch (const Error& e) {
            error = e.what();
        }
        const auto waited = std::chrono::steady_clock::now() - start;
        EXPECT_FALSE(error.empty()) << "rank " << w->rank() << ": the disagreeing counts were not refused";
        EXPECT_LT(waited, std::chrono::milliseconds(20000)) << error;
        const std::string want = "team rank 0 (node 0) sends 100 elements to team rank " + std::to_string(odd) +
                                 " (node " + std::to_string(across ? w->num_nodes() - 1 : 0) +
                                 "), whose recv_counts[0] is 101";
        EXPECT_NE(error.find(want), std::string::npos) << "rank " << w->rank() << ": " << error;
        std::printf("rank %d: %s\n", w->rank(), error.c_str());
        w.reset();  // collective
    }
}

TEST(MultiNode, ForcingASingleNodeAlgorithmIsAnError) {
    World& w = dist_world();
    if (!spans_nodes(w)) GTEST_SKIP() << "one node (set WEFT_VIRTUAL_NODES)";
    Buffers b(4096);
    try {
        ops::all_reduce(w, TensorView(b.in, DType::kF32, {16}), TensorView(b.out, DType::kF32, {16}), b.stream,
                        {.algo = ops::AllReduceAlgo::kOneShot});
        ADD_FAILURE() << "a one-shot all-reduce across nodes was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("spans " + std::to_string(w.num_nodes()) + " nodes"), std::string::npos)
            << e.what();
    }
}

// AgGemm on a team that spans nodes (docs/multinode.md, "AllGather+GEMM across nodes"): awkward M/N/K (nothing a
// multiple of a tile), one and several chunks per shard, one row per rank, poisoned C and gathered buffer, fresh
// data every call, a second call with another M; C against an fp64 reference, the gathered A bit for bit. The world
// team (L members per node: this node's shards by copy engine, this column's over the network, the others relayed)
// and, with 2 or more ranks per node, every other rank (fewer members per node, interleaved team ranks: the
// rank-rotated tile order). `graph`: the second and third calls replay a CUDA graph captured after the first.
struct AgNodesCase {
    int64_t rows, n, k, chunk_rows;
    int sm_budget;
};

void run_ag_gemm_across_nodes(bool graph) {
    using namespace tp_test;
    World& w = dist_world();
    const std::vector<AgNodesCase> cases = {{100, 200, 72, 0, 0}, {300, 136, 256, 64, 4}, {1, 8, 8, 0, 2}};
    const DType dt = DType::kBF16;
    for (const Team& team : teams_under_test(w)) {
        if (!team.is_member()) continue;
        const int nr = team.num_ranks(), me = team.rank();
        for (const AgNodesCase& cs : cases) {
            const uint64_t base = 0x5eed0000ull + static_cast<uint64_t>(cs.rows * 31 + cs.n) + (graph ? 7 : 0);
            const int64_t max_m = cs.rows * nr;
            const std::string what =
                "ag_gemm across " + std::to_string(team.num_nodes()) + " nodes on " + team.describe() + " rows/rank " +
                std::to_string(cs.rows) + " n " + std::to_string(cs.n) + " k " + std::to_string(cs.k) + " chunk_rows " +
                std::to_string(cs.chunk_rows) + (graph ? " graph" : "") + ", team rank " + std::to_string(me);
            ops::AgGemmOptions opt;
            opt.chunk_rows = cs.chunk_rows;
            opt.sm_budget = cs.sm_budget;
            const int64_t lda = ld_for(cs.k, 8), ldc = ld_for(cs.n, 8);
            HostMat b(cs.n, cs.k, ld_for(cs.k), dt);
            DevBuf a_dev(static_cast<size_t>(cs.rows * lda * 2)), b_dev(b.bytes()),
                c_dev(static_cast<size_t>(max_m * ldc * 2));
            cudaStream_t st = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
            {
                ops::AgGemm op(team, {max_m, cs.n, cs.k, dt}, opt);
                cudaGraphExec_t exec = nullptr;
                for (int call = 0; call < 3; ++call) {
                    const int64_t rows = !graph && call == 1 ? std::max<int64_t>(1, cs.rows * 2 / 3) : cs.rows;
                    const int64_t m = rows * nr;
                    const std::string at = what + " call " + std::to_string(call) + " M " + std::to_string(m);
                    std::vector<HostMat> shards;
                    for (int r = 0; r < nr; ++r) {
                        shards.emplace_back(rows, cs.k, cs.k, dt);
                        shards.back().fill_random(seed_of(base, 0, r, call));
                    }
                    b.fill_random(seed_of(base, 1, me, call));
                    upload(b, b_dev.ptr, st);
                    const TensorView g = op.gathered(m);
                    WEFT_CUDA_CHECK(cudaMemsetAsync(g.data, 0xFF, static_cast<size_t>(g.size_bytes()), st));
                    HostMat c(m, cs.n, ldc, dt);
                    poison(c);
                    upload(c, c_dev.ptr, st);
                    HostMat a(rows, cs.k, lda, dt);
                    for (int64_t r = 0; r < rows; ++r) {
                        for (int64_t j = 0; j < cs.k; ++j) a.set(r, j, shards[static_cast<size_t>(me)].at(r, j));
                    }
                    upload(a, a_dev.ptr, st);
                    // Nobody may overwrite a gathered buffer a peer still reads: the poison above is this rank's
                    // own, and every member finished the previous call (sync_and_check) before anyone poisons.
                    team.barrier();
                    const TensorView av = view(a, a_dev.ptr), bv = view(b, b_dev.ptr), cv = view(c, c_dev.ptr);
                    if (!graph || call == 0) {
                        op.run(av, bv, cv, st);
                        if (graph) {
                            // The communicators exist (first call); capture the next call and replay it from call 1.
                            w.sync_and_check(st);
                            team.barrier();
                            cudaGraph_t gr = nullptr;
                            WEFT_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                            op.run(av, bv, cv, st);
                            WEFT_CUDA_CHECK(cudaStreamEndCapture(st, &gr));
                            WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, gr, 0));
                            WEFT_CUDA_CHECK(cudaGraphDestroy(gr));
                        }
                    } else {
                        WEFT_CUDA_CHECK(cudaGraphLaunch(exec, st));
                    }
                    w.sync_and_check(st);

                    download(c, c_dev.ptr, st);
                    const std::vector<int64_t> check_rows =
                        rows_to_check(m, rows, static_cast<double>(cs.n * cs.k), seed_of(base, 2, me, call));
                    HostMat a_full(m, cs.k, cs.k, dt);
                    for (int r = 0; r < nr; ++r) {
                        const auto& sh = shards[static_cast<size_t>(r)].bits;
                        std::copy(sh.begin(), sh.end(), a_full.bits.begin() + r * rows * cs.k);
                    }
                    Reference ref(static_cast<int64_t>(check_rows.size()), cs.n);
                    ref.add(a_full, 0, check_rows, b);
                    const std::string bad = compare(c, check_rows, ref, ErrorModel::gemm(dt));
                    EXPECT_TRUE(bad.empty()) << at << ": C: " << bad;
                    HostMat gathered(m, cs.k, cs.k, dt);
                    download(gathered, g.data, st);
                    for (int r = 0; r < nr; ++r) {
                        const auto& sh = shards[static_cast<size_t>(r)].bits;
                        EXPECT_TRUE(std::equal(sh.begin(), sh.end(), gathered.bits.begin() + r * rows * cs.k))
                            << at << ": the gathered A differs in the shard of team rank " << r;
                    }
                    team.barrier();  // every member checked its gathered buffer before anyone's next call
                }
                if (exec != nullptr) WEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
            }
            WEFT_CUDA_CHECK(cudaStreamDestroy(st));
        }
    }
}

TEST(MultiNode, AgGemmMatchesTheReference) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    run_ag_gemm_across_nodes(false);
}

TEST(MultiNode, AgGemmGraphReplay) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    run_ag_gemm_across_nodes(true);
}

// GemmRs on a team that spans nodes (docs/multinode.md, "GEMM+ReduceScatter across nodes"): M not a multiple of the
// tile (segments of 100 and 300 rows, and of one row), ragged N (100: the final sum's element-wise tail), one and
// several counters per segment, bf16 and fp32 partials, a small SM budget, poisoned C, fresh A and B for every rank on
// every call, a second call with another M; C against an fp64 host reference of sum_t A_t B_t^T on this rank's rows.
// The world team (L members per node: the one-node GemmRs over each node, then the network) and, with 2 or more ranks
// per node, every other rank (fewer members per node; one with 2 ranks per node: the node stage is the plain GEMM)
// and the world with its team ranks interleaved over the nodes (team rank i on node i mod N: a block's A rows are not
// one slice of A and are gathered first). `graph`: the second and third calls replay a CUDA graph captured after the
// first.
struct RsNodesCase {
    int64_t rows, n, k, chunk_rows;
    int sm_budget;
    bool f32_partials;
};

void run_gemm_rs_across_nodes(bool graph) {
    using namespace tp_test;
    World& w = dist_world();
    const std::vector<RsNodesCase> cases = {
        {100, 200, 72, 0, 0, false}, {300, 136, 256, 128, 4, true}, {1, 8, 8, 0, 2, false}, {65, 100, 40, 0, 0, false}};
    const DType dt = DType::kBF16;
    const std::vector<Team> teams = teams_with_interleaved(w);  // collective over the world
    for (const Team& team : teams) {
        if (!team.is_member()) continue;
        const int nr = team.num_ranks(), me = team.rank();
        for (const RsNodesCase& cs : cases) {
            const uint64_t base = 0x75ed0000ull + static_cast<uint64_t>(cs.rows * 31 + cs.n) + (graph ? 7 : 0);
            const int64_t max_m = cs.rows * nr;
            const std::string what = "gemm_rs across " + std::to_string(team.num_nodes()) + " nodes on " +
                                     team.describe() + " rows/rank " + std::to_string(cs.rows) + " n " +
                                     std::to_string(cs.n) + " k " + std::to_string(cs.k) + " chunk_rows " +
                                     std::to_string(cs.chunk_rows) + (cs.f32_partials ? " f32 partials" : "") +
                                     (graph ? " graph" : "") + ", team rank " + std::to_string(me);
            ops::GemmRsOptions opt;
            opt.chunk_rows = cs.chunk_rows;
            opt.sm_budget = cs.sm_budget;
            if (cs.f32_partials) opt.partial_dtype = DType::kF32;
            const int64_t lda = ld_for(cs.k, 8), ldc = ld_for(cs.n, 8);
            DevBuf a_dev(static_cast<size_t>(max_m * lda * 2)), b_dev(static_cast<size_t>(cs.n * lda * 2)),
                c_dev(static_cast<size_t>(cs.rows * ldc * 2));
            cudaStream_t st = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
            {
                ops::GemmRs op(team, {max_m, cs.n, cs.k, dt}, opt);
                // The node sums are rounded into the output dtype once more than on one node (one rounding per node,
                // relative to the node's sum, which is at most the sum of its partials' magnitudes).
                ErrorModel model = ErrorModel::tp_sum(dt, op.partial_dtype(), nr);
                model.u_partial += unit_roundoff(dt);
                cudaGraphExec_t exec = nullptr;
                for (int call = 0; call < 3; ++call) {
                    const int64_t rows = !graph && call == 1 ? std::max<int64_t>(1, cs.rows * 2 / 3) : cs.rows;
                    const int64_t m = rows * nr;
                    const std::string at = what + " call " + std::to_string(call) + " M " + std::to_string(m);
                    // Every rank's A and B (the reference needs all of them); this rank uploads its own.
                    std::vector<HostMat> as, bs;
                    for (int r = 0; r < nr; ++r) {
                        as.emplace_back(m, cs.k, lda, dt);
                        as.back().fill_random(seed_of(base, 0, r, call));
                        bs.emplace_back(cs.n, cs.k, lda, dt);
                        bs.back().fill_random(seed_of(base, 1, r, call));
                    }
                    upload(as[static_cast<size_t>(me)], a_dev.ptr, st);
                    upload(bs[static_cast<size_t>(me)], b_dev.ptr, st);
                    HostMat c(rows, cs.n, ldc, dt);
                    poison(c);
                    upload(c, c_dev.ptr, st);
                    const TensorView av = view(as[static_cast<size_t>(me)], a_dev.ptr);
                    const TensorView bv = view(bs[static_cast<size_t>(me)], b_dev.ptr), cv = view(c, c_dev.ptr);
                    if (!graph || call == 0) {
                        op.run(av, bv, cv, st);
                        if (graph) {
                            // The communicators exist (the constructor made them) and the first call connected them:
                            // capture the next call and replay it from call 1.
                            w.sync_and_check(st);
                            cudaGraph_t gr = nullptr;
                            WEFT_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                            op.run(av, bv, cv, st);
                            WEFT_CUDA_CHECK(cudaStreamEndCapture(st, &gr));
                            WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, gr, 0));
                            WEFT_CUDA_CHECK(cudaGraphDestroy(gr));
                        }
                    } else {
                        WEFT_CUDA_CHECK(cudaGraphLaunch(exec, st));
                    }
                    w.sync_and_check(st);

                    download(c, c_dev.ptr, st);
                    const std::vector<int64_t> check_rows =
                        rows_to_check(rows, rows, static_cast<double>(cs.n * cs.k * nr), seed_of(base, 2, me, call));
                    Reference ref(static_cast<int64_t>(check_rows.size()), cs.n);
                    for (int r = 0; r < nr; ++r) {
                        ref.add(as[static_cast<size_t>(r)], me * rows, check_rows, bs[static_cast<size_t>(r)]);
                    }
                    const std::string bad = compare(c, check_rows, ref, model);
                    EXPECT_TRUE(bad.empty()) << at << ": C: " << bad;
                }
                if (exec != nullptr) WEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
            }
            WEFT_CUDA_CHECK(cudaStreamDestroy(st));
        }
    }
}

TEST(MultiNode, GemmRsMatchesTheReference) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    run_gemm_rs_across_nodes(false);
}

TEST(MultiNode, GemmRsGraphReplay) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    run_gemm_rs_across_nodes(true);
}

// Members on different nodes that call with different M (node 0 with 64 rows per rank, the other nodes with 32): the
// call descriptors that cross the network show it, so every rank's call ends in a weft::Error naming the mismatch,
// within a bound well under the World's timeout, not in a hang or a network timeout (the descriptors cross the network
// before the rows, and the comm stream's check aborts the World before rows of other sizes are sent); GemmRs's c keeps
// its poison. A World of its own (the mismatch aborts it).
void run_m_differs_across_nodes(bool rs) {
    using namespace tp_test;
    set_test_environment();
    WorldOptions options;
    options.timeout = std::chrono::milliseconds(30000);
    options.heartbeat = std::chrono::milliseconds(200);
    options.heap_bytes = 128ull << 20;
    std::unique_ptr<World> w = World::from_env(options);
    const Team& team = w->team();
    const int nr = team.num_ranks();
    const int64_t n = 128, k = 64, max_rows = 64;
    const int64_t rows = team.node_index() == 0 ? max_rows : max_rows / 2;
    const DType dt = DType::kBF16;
    const int64_t a_rows = rs ? rows * nr : rows, c_rows = rs ? rows : rows * nr;
    DevBuf a_dev(static_cast<size_t>(max_rows * nr * k * 2)), b_dev(static_cast<size_t>(n * k * 2)),
        c_dev(static_cast<size_t>(max_rows * nr * n * 2));
    HostMat a(a_rows, k, k, dt), bm(n, k, k, dt), c(c_rows, n, n, dt);
    a.fill_random(seed_of(0x3d1ffull, 0, w->rank(), 0));
    bm.fill_random(seed_of(0x3d1ffull, 1, w->rank(), 0));
    poison(c);
    cudaStream_t st = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    upload(a, a_dev.ptr, st);
    upload(bm, b_dev.ptr, st);
    upload(c, c_dev.ptr, st);
    std::string error;
    std::chrono::steady_clock::duration waited{};
    {
        std::unique_ptr<ops::AgGemm> ag;
        std::unique_ptr<ops::GemmRs> grs;
        if (rs) {
            grs = std::make_unique<ops::GemmRs>(team, ops::GemmRsShape{max_rows * nr, n, k, dt});
        } else {
            ag = std::make_unique<ops::AgGemm>(team, ops::AgGemmShape{max_rows * nr, n, k, dt});
        }
        w->barrier();
        const auto start = std::chrono::steady_clock::now();
        try {
            if (rs) {
                grs->run(view(a, a_dev.ptr), view(bm, b_dev.ptr), view(c, c_dev.ptr), st);
            } else {
                ag->run(view(a, a_dev.ptr), view(bm, b_dev.ptr), view(c, c_dev.ptr), st);
            }
            w->sync_and_check(st);
        } catch (const Error& e) {
            error = e.what();
        }
        waited = std::chrono::steady_clock::now() - start;
    }
    std::printf("rank %d (%s, %.1f s): %s\n", w->rank(), rs ? "gemm_rs" : "ag_gemm",
                std::chrono::duration<double>(waited).count(), error.c_str());
    EXPECT_FALSE(error.empty()) << "rank " << w->rank() << ": calls whose M differs across nodes were not diagnosed";
    EXPECT_LT(waited, std::chrono::milliseconds(15000)) << error;
    EXPECT_NE(error.find("differs from rank"), std::string::npos) << "rank " << w->rank() << ": " << error;
    if (rs) {  // the final sum writes nothing when the nodes' calls differ
        const HostMat poisoned = c;
        download(c, c_dev.ptr, st);
        EXPECT_EQ(c.bits, poisoned.bits) << "rank " << w->rank() << ": c was written by calls that differ";
    }
    cudaStreamSynchronize(st);
    cudaStreamDestroy(st);
    w.reset();  // collective
}

TEST(MultiNode, AgGemmWhoseMDiffersAcrossNodesFailsEveryRankNamingTheMismatch) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    run_m_differs_across_nodes(false);
}

TEST(MultiNode, GemmRsWhoseMDiffersAcrossNodesFailsEveryRankNamingTheMismatch) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    run_m_differs_across_nodes(true);
}

// Members that cut their shards into different chunks across nodes (the network steps pair chunk by chunk, and relays
// raise node peers' words by chunk number): every member's constructor refuses, naming the difference, at once, with
// the same text; and a member that alone refuses its options fails every member at once, naming it.
TEST(MultiNode, AgGemmWhoseChunkRowsOrOptionsDifferAcrossNodesIsRefusedOnEveryMember) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    const Team& team = w.team();
    ops::AgGemmOptions options;
    options.chunk_rows = team.node_index() == 0 ? 16 : 32;
    std::string error;
    const auto start = std::chrono::steady_clock::now();
    try {
        ops::AgGemm ag(team, ops::AgGemmShape{64 * team.num_ranks(), 128, 64, DType::kBF16}, options);
    } catch (const Error& e) {
        error = e.what();
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    EXPECT_NE(error.find("the members' chunk rows (options.chunk_rows, resolved) differ: world rank " +
                         std::to_string(team.world_rank(0)) + " has 16, world rank "),
              std::string::npos)
        << "rank " << w.rank() << ": " << error;
    EXPECT_LT(waited, std::chrono::milliseconds(30000)) << error;  // far below the World's timeout
    // The text is the same on every member.
    const std::vector<std::vector<uint8_t>> texts =
        team.all_gather("ag-gemm-chunk-error", std::vector<uint8_t>(error.begin(), error.end()));
    for (const auto& t : texts) EXPECT_EQ(std::string(t.begin(), t.end()), error);
    w.barrier();

    // One member's options that only it refuses (autotune across nodes): every member fails at once, naming it.
    const int refusing = team.num_ranks() - 1;
    ops::AgGemmOptions tuned;
    tuned.autotune = team.rank() == refusing;
    error.clear();
    const auto start2 = std::chrono::steady_clock::now();
    try {
        ops::AgGemm ag(team, ops::AgGemmShape{64 * team.num_ranks(), 128, 64, DType::kBF16}, tuned);
    } catch (const Error& e) {
        error = e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start2, std::chrono::milliseconds(30000)) << error;
    EXPECT_NE(error.find("options.autotune on a team that spans nodes"), std::string::npos) << error;
    if (team.rank() != refusing) {
        EXPECT_NE(
            error.find("world rank " + std::to_string(team.world_rank(refusing)) + "'s shape or options are invalid"),
            std::string::npos)
            << error;
    }
    w.barrier();
}

// ---- expert parallelism across nodes (docs/multinode.md, "EP across nodes") ----

namespace ref = weft::test::ep;

// Runs `check` on this member, then agrees over the team: when any member's check failed, every member throws naming
// it, so that no member goes on to a collective that a failed member will never join.
void team_check(const Team& team, const std::function<void()>& check) {
    std::string error;
    try {
        check();
    } catch (const std::exception& e) {
        error = e.what();
        if (error.empty()) error = "check failed";
    }
    const auto all = team.all_gather("ep-multinode-check", std::vector<uint8_t>(error.begin(), error.end()));
    for (size_t r = 0; r < all.size(); ++r) {
        if (!all[r].empty()) WEFT_FAIL("team rank " << r << ": " << std::string(all[r].begin(), all[r].end()));
    }
}

// A fresh seed (printed), the same on every member: team rank 0's.
uint32_t team_seed(const Team& team) {
    const uint32_t mine = ref::fresh_seed();
    std::vector<uint8_t> bytes(4);
    std::memcpy(bytes.data(), &mine, 4);
    const auto all = team.all_gather("ep-multinode-seed", bytes);
    uint32_t seed = 0;
    std::memcpy(&seed, all[0].data(), 4);
    return seed;
}

struct EpCase {
    int experts_per_rank;
    int hidden;
    int topk;  // capped at the number of experts
    int max_tokens;
    int alignment;
};

ops::ep::Config ep_config(const EpCase& c, int num_ranks) {
    ops::ep::Config cfg;
    cfg.num_experts = c.experts_per_rank * num_ranks;
    cfg.hidden = c.hidden;
    cfg.topk = std::min(c.topk, cfg.num_experts);
    cfg.max_tokens_per_rank = c.max_tokens;
    cfg.expert_alignment = c.alignment;
    cfg.low_latency = false;
    return cfg;
}

ref::Params ep_params(const ops::ep::Config& c, int num_ranks) {
    ref::Params p;
    p.num_ranks = num_ranks;
    p.num_experts = c.num_experts;
    p.topk = c.topk;
    p.hidden = c.hidden;
    p.expert_alignment = c.expert_alignment;
    return p;
}

// This member's device inputs, sized for the Buffer's limits.
struct EpInputs {
    ref::DeviceArray<uint16_t> x;
    ref::DeviceArray<int32_t> idx;
    ref::DeviceArray<float> w;
    ref::DeviceArray<uint16_t> y;
    ref::DeviceArray<uint16_t> out;
    int num_tokens = 0;
    int hidden;
    int topk;
    EpInputs(const ops::ep::Config& c, int64_t max_rows, cudaStream_t s)
        : x(static_cast<size_t>(c.max_tokens_per_rank) * c.hidden, s),
          idx(static_cast<size_t>(c.max_tokens_per_rank) * c.topk, s),
          w(static_cast<size_t>(c.max_tokens_per_rank) * c.topk, s),
          y(static_cast<size_t>(max_rows) * c.hidden, s),
          out(static_cast<size_t>(c.max_tokens_per_rank) * c.hidden, s),
          hidden(c.hidden),
          topk(c.topk) {}
    void load(const ref::Routing& r, const std::vector<uint16_t>& rows) {
        num_tokens = r.num_tokens;
        x.upload(rows);
        idx.upload(r.topk_idx);
        w.upload(r.topk_weights);
    }
    TensorView x_view() const { return TensorView(x.get(), DType::kBF16, {num_tokens, hidden}); }
    TensorView idx_view() const { return TensorView(idx.get(), DType::kI32, {num_tokens, topk}); }
    TensorView w_view() const { return TensorView(w.get(), DType::kF32, {num_tokens, topk}); }
    TensorView out_view() const { return TensorView(out.get(), DType::kBF16, {num_tokens, hidden}); }
};

// The y rows of team rank r: expert_output of each received row's payload; padding rows NaN (a combine that reads one
// fails loudly).
std::vector<uint16_t> ep_expected_y(const ref::Params& p, const ref::NormalPlan& plan,
                                    const std::vector<std::vector<uint16_t>>& x_all, int r, int64_t max_rows) {
    std::vector<uint16_t> y(static_cast<size_t>(max_rows) * p.hidden, 0x7fc1);
    const auto& rows = plan.rows[static_cast<size_t>(r)];
    const auto& off = plan.expert_offsets[static_cast<size_t>(r)];
    for (int le = 0; le < p.local_experts(); ++le) {
        const int expert = r * p.local_experts() + le;
        for (int32_t row = off[static_cast<size_t>(le)]; row < off[static_cast<size_t>(le) + 1]; ++row) {
            const ref::RowSource src = rows[static_cast<size_t>(row)];
            if (src.src < 0) continue;
            const uint16_t* x = &x_all[static_cast<size_t>(src.src)][static_cast<size_t>(src.token) * p.hidden];
            for (int c = 0; c < p.hidden; ++c) {
                y[static_cast<size_t>(row) * p.hidden + static_cast<size_t>(c)] = ref::expert_output(x[c], expert);
            }
        }
    }
    return y;
}

// The handle after a dispatch against the one-node plan (team rank `me`): this rank's layout over the team, its
// per-expert counts and offsets, and every received row.
void ep_check_dispatch(const ref::Params& p, const ref::NormalPlan& plan,
                       const std::vector<std::vector<uint16_t>>& x_all, const ops::ep::NormalHandle& h, int me, int t,
                       cudaStream_t s) {
    const ops::ep::NormalHandleView& v = h.view();
    const size_t w = static_cast<size_t>(p.num_ranks);
    const size_t el = static_cast<size_t>(p.local_experts());
    const size_t tu = static_cast<size_t>(t);
    const ref::RankLayout& l = plan.layouts[static_cast<size_t>(me)];
    if (ref::download(v.tokens_per_expert, static_cast<size_t>(p.num_experts), s) != l.tokens_per_expert)
        WEFT_FAIL("tokens_per_expert differs");
    if (ref::download(v.tokens_per_rank, w, s) != l.tokens_per_rank) WEFT_FAIL("tokens_per_rank differs");
    if (ref::download(v.token_in_rank, tu * w, s) != l.token_in_rank) WEFT_FAIL("token_in_rank differs");
    if (ref::download(v.send_idx, tu * w, s) != l.send_idx) WEFT_FAIL("send_idx differs");
    if (ref::download(v.route_pos, tu * static_cast<size_t>(p.topk), s) != l.route_pos) WEFT_FAIL("route_pos differs");
    if (ref::download(h.expert_counts(), el, s) != plan.expert_counts[static_cast<size_t>(me)])
        WEFT_FAIL("expert_counts differ");
    if (ref::download(h.expert_offsets(), el + 1, s) != plan.expert_offsets[static_cast<size_t>(me)])
        WEFT_FAIL("expert_offsets differ");
    const auto& rows = plan.rows[static_cast<size_t>(me)];
    const size_t hsz = static_cast<size_t>(p.hidden);
    const std::vector<uint16_t> got = ref::download(v.recv_x, rows.size() * hsz, s);
    for (size_t row = 0; row < rows.size(); ++row) {
        const ref::RowSource src = rows[row];
        if (src.src < 0) continue;  // padding: unspecified
        const uint16_t* want = &x_all[static_cast<size_t>(src.src)][static_cast<size_t>(src.token) * hsz];
        if (std::memcmp(want, &got[row * hsz], hsz * 2) != 0) {
            WEFT_FAIL("received row " << row << ": expected team rank " << src.src << " token " << src.token
                                      << " (slot " << src.slot << "), found " << ref::describe_row(&got[row * hsz]));
        }
    }
}

// The combine's output against the exact emulation of the one-node arithmetic (bits).
void ep_check_combine(const ref::Params& p, const ref::NormalPlan& plan, const std::vector<ref::Routing>& all,
                      const std::vector<std::vector<uint16_t>>& y_all, const std::vector<uint16_t>& out, int me) {
    const auto y_row = [&](int r, int32_t row) {
        return &y_all[static_cast<size_t>(r)][static_cast<size_t>(row) * p.hidden];
    };
    const std::vector<uint16_t> want = ref::reference_normal_combine(p, plan, all, me, y_row);
    if (out.size() != want.size()) WEFT_FAIL("combine output size " << out.size() << ", expected " << want.size());
    for (size_t i = 0; i < want.size(); ++i) {
        if (out[i] != want[i]) {
            WEFT_FAIL("combine out[" << i / static_cast<size_t>(p.hidden) << "][" << i % static_cast<size_t>(p.hidden)
                                     << "] = " << ref::bf16_to_f32(out[i]) << " (0x" << std::hex << out[i]
                                     << "), the one-node arithmetic gives " << ref::bf16_to_f32(want[i]) << " (0x"
                                     << want[i] << std::dec << ")");
        }
    }
}

// One dispatch + combine of a routing, checked on every member. `launch` runs them (eagerly, or a graph's replay).
void ep_run_and_check(const Team& team, ops::ep::Buffer& ep, ops::ep::NormalHandle& h, EpInputs& in,
                      const std::vector<ref::Routing>& all, uint32_t seed, cudaStream_t s, const std::string& what,
                      const std::function<void()>& launch = nullptr, bool buffer_status = true) {
    const ref::Params p = ep_params(ep.config(), team.num_ranks());
    const int me = team.rank();
    std::vector<std::vector<uint16_t>> x_all;
    for (int r = 0; r < p.num_ranks; ++r) {
        x_all.push_back(ref::payload_rows(r, all[static_cast<size_t>(r)].num_tokens, p.hidden, seed, false));
    }
    const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
    const int64_t max_rows = ep.geometry().max_recv_rows;
    std::vector<std::vector<uint16_t>> y_all;
    for (int r = 0; r < p.num_ranks; ++r) y_all.push_back(ep_expected_y(p, plan, x_all, r, max_rows));
    in.load(all[static_cast<size_t>(me)], x_all[static_cast<size_t>(me)]);
    in.y.upload(y_all[static_cast<size_t>(me)]);
    const int t = in.num_tokens;
    WEFT_CUDA_CHECK(cudaMemsetAsync(h.recv_x().data, 0xEE, static_cast<size_t>(max_rows) * p.hidden * 2, s));
    in.out.poison(0xFF);
    const TensorView y(in.y.get(), DType::kBF16, {max_rows, p.hidden});
    if (launch) {
        launch();
    } else {
        ep.dispatch(h, in.x_view(), in.idx_view(), in.w_view(), s);
        ep.combine(h, y, in.out_view(), s);
    }
    if (buffer_status) {
        ep.sync_and_check(s);
    } else {
        ep.world().sync_and_check(s);  // the Buffer's status is the caller's to read
    }
    team_check(team, [&] {
        try {
            ep_check_dispatch(p, plan, x_all, h, me, t, s);
            ep_check_combine(p, plan, all, y_all, ref::download(in.out.get(), static_cast<size_t>(t) * p.hidden, s),
                             me);
        } catch (const std::exception& e) {
            WEFT_FAIL("world rank " << team.world().rank() << ", " << what << ": " << e.what());
        }
    });
}

// Normal dispatch and combine on teams that span nodes, against the one-node reference: every routing scenario
// (tokens with no expert on a node, ranks receiving nothing, uneven loads, 0 / 1 / 7 / 129 tokens), hidden sizes
// that are not multiples of 128, top-k 1, 2 and 8 (more than a rank's experts too), expert alignment, the node-major
// and the interleaved layouts.
TEST(MultiNode, EpDispatchCombineMatchTheReference) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    const EpCase cases[] = {{2, 136, 2, 129, 1}, {4, 200, 8, 7, 4}, {1, 8, 1, 7, 1}, {3, 1000, 8, 1, 2}};
    const std::vector<Team> teams = teams_with_interleaved(w);
    // Both dispatch paths (every process sets the same before its Buffers are made): two hops on every team, the
    // record exchange on the world.
    for (const char* path : {"two_hop", "all_to_all"}) {
        ::setenv("WEFT_EP_ACROSS_NODES", path, 1);
        for (const Team& team : teams) {
            if (!team.is_member()) continue;
            if (std::string(path) == "all_to_all" && !team.is_world()) continue;
            ref::RankStream stream;
            const cudaStream_t s = stream.s;
            const uint32_t seed = team_seed(team);
            for (const EpCase& c : cases) {
                const ops::ep::Config cfg = ep_config(c, team.num_ranks());
                ops::ep::Buffer ep(team, cfg);
                ops::ep::NormalHandle h = ep.make_normal_handle();
                EpInputs in(cfg, ep.geometry().max_recv_rows, s);
                const ref::Params p = ep_params(cfg, team.num_ranks());
                for (const ref::Scenario sc : ref::all_scenarios()) {
                    const std::vector<ref::Routing> all = ref::make_routing(sc, p, cfg.max_tokens_per_rank, seed);
                    std::ostringstream what;
                    what << path << ", team " << team.describe() << ", " << ref::scenario_name(sc) << ", E "
                         << cfg.num_experts << ", H " << cfg.hidden << ", k " << cfg.topk
                         << ", T <= " << cfg.max_tokens_per_rank << ", alignment " << cfg.expert_alignment << ", seed "
                         << seed;
                    ep_run_and_check(team, ep, h, in, all, seed, s, what.str());
                }
            }
        }
    }
    ::unsetenv("WEFT_EP_ACROSS_NODES");
}

// A dispatch + combine captured in a CUDA graph after one eager call, replayed with new routings in the same input
// buffers (the layout is computed on the device, so a replay follows the routing).
TEST(MultiNode, EpGraphReplay) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    const Team team = w.team();
    ref::RankStream stream;
    const cudaStream_t s = stream.s;
    const uint32_t seed = team_seed(team);
    const ops::ep::Config cfg = ep_config({2, 136, 2, 33, 2}, team.num_ranks());
    ops::ep::Buffer ep(team, cfg);
    ops::ep::NormalHandle h = ep.make_normal_handle();
    EpInputs in(cfg, ep.geometry().max_recv_rows, s);
    const ref::Params p = ep_params(cfg, team.num_ranks());
    const TensorView y(in.y.get(), DType::kBF16, {ep.geometry().max_recv_rows, p.hidden});
    cudaGraphExec_t exec = nullptr;
    for (int call = 0; call < 3; ++call) {
        // Every rank's T is max_tokens, so that the captured views stay valid.
        const std::vector<ref::Routing> all = ref::make_routing(ref::Scenario::kMaxTokens, p, cfg.max_tokens_per_rank,
                                                                seed + static_cast<uint32_t>(call));
        const std::string what = "graph call " + std::to_string(call) + ", seed " + std::to_string(seed);
        if (call == 0) {
            ep_run_and_check(team, ep, h, in, all, seed + 0, s, what);
            team.barrier();
            cudaGraph_t g = nullptr;
            WEFT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            ep.dispatch(h, in.x_view(), in.idx_view(), in.w_view(), s);
            ep.combine(h, y, in.out_view(), s);
            WEFT_CUDA_CHECK(cudaStreamEndCapture(s, &g));
            WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
            WEFT_CUDA_CHECK(cudaGraphDestroy(g));
        } else {
            ep_run_and_check(team, ep, h, in, all, seed + static_cast<uint32_t>(call), s, what,
                             [&] { WEFT_CUDA_CHECK(cudaGraphLaunch(exec, s)); });
        }
    }
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    WEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
}

// Invalid and repeated expert ids across nodes: dropped and reported by the source, as on one node; the other routes
// of the same tokens still arrive and combine.
TEST(MultiNode, EpInvalidAndRepeatedExpertIdsAreReportedAndDropped) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    const Team team = w.team();
    ref::RankStream stream;
    const cudaStream_t s = stream.s;
    const uint32_t seed = team_seed(team);
    const ops::ep::Config cfg = ep_config({2, 64, 4, 9, 1}, team.num_ranks());
    ops::ep::Buffer ep(team, cfg);
    ops::ep::NormalHandle h = ep.make_normal_handle();
    EpInputs in(cfg, ep.geometry().max_recv_rows, s);
    const ref::Params p = ep_params(cfg, team.num_ranks());
    std::vector<ref::Routing> all = ref::make_routing(ref::Scenario::kMaxTokens, p, cfg.max_tokens_per_rank, seed);
    // Rank 0's token 1: slot 1 repeats slot 0; token 2: slot 3 out of range.
    all[0].topk_idx[1 * 4 + 1] = all[0].topk_idx[1 * 4 + 0];
    all[0].topk_idx[2 * 4 + 3] = cfg.num_experts + 3;
    ep_run_and_check(team, ep, h, in, all, seed, s, "invalid and repeated ids", nullptr, false);
    const std::optional<ops::ep::StatusReport> report = ep.status();
    if (team.rank() == 0) {
        ASSERT_TRUE(report.has_value()) << "rank 0's bad ids were not reported";
        EXPECT_TRUE(report->code == ops::ep::StatusCode::kDuplicateExpert ||
                    report->code == ops::ep::StatusCode::kInvalidExpert)
            << report->message;
        std::printf("rank %d: %s\n", w.rank(), report->message.c_str());
        EXPECT_THROW(ep.check(), Error);
        ep.clear_status();
    } else {
        EXPECT_FALSE(report.has_value()) << "only the source of the bad ids reports them: " << report->message;
    }
    team.barrier();
    // The Buffer goes on: a clean call afterwards.
    const std::vector<ref::Routing> clean =
        ref::make_routing(ref::Scenario::kUniform, p, cfg.max_tokens_per_rank, seed + 1);
    ep_run_and_check(team, ep, h, in, clean, seed + 1, s, "after the report");
}

// Receive capacity across nodes: a rank whose received tokens exceed max_recv_tokens reports it (kRecvTokensOverflow)
// and receives nothing, its partials are zero; the other ranks' dispatch and combine are exact (docs/multinode.md, "EP
// across nodes": on one node every rank would report). The report is in the Buffer's team ranks (raw.rank and
// raw.culprit_rank are this rank's team rank) and check() throws it naming the world rank. On the world and, with 2 or
// more ranks per node, a team whose ranks are interleaved across the nodes (team rank != world rank). After
// clear_status the Buffer goes on; inputs taken from the handle's receive area are refused, as on one node.
TEST(MultiNode, EpCapacityOverflowIsReportedByTheRankThatOverflows) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    for (const Team& team : teams_with_interleaved(w)) {
        if (!team.is_member()) continue;
        SCOPED_TRACE(team.describe());
        const int n = team.num_ranks();
        const int me = team.rank();
        ref::RankStream stream;
        const cudaStream_t s = stream.s;
        const uint32_t seed = team_seed(team);
        ops::ep::Config cfg = ep_config({2, 72, 2, 9, 1}, n);
        cfg.max_recv_tokens = std::max(1, n * cfg.max_tokens_per_rank / 2);
        ops::ep::Buffer ep(team, cfg);
        ops::ep::NormalHandle h = ep.make_normal_handle();
        EpInputs in(cfg, ep.geometry().max_recv_rows, s);
        const ref::Params p = ep_params(cfg, n);
        // Every token's slot 0 is the last expert: its rank receives every token of every rank.
        const std::vector<ref::Routing> all =
            ref::make_routing(ref::Scenario::kSkewed, p, cfg.max_tokens_per_rank, seed);
        const ref::NormalPlan plan = ref::reference_normal_plan(p, all);
        std::vector<bool> over(static_cast<size_t>(n));
        for (int r = 0; r < n; ++r) {
            over[static_cast<size_t>(r)] = plan.recv_tokens[static_cast<size_t>(r)] > cfg.max_recv_tokens ||
                                           plan.recv_rows[static_cast<size_t>(r)] > ep.geometry().max_recv_rows;
        }
        ASSERT_TRUE(over[static_cast<size_t>(n - 1)]) << "the hot expert's rank should overflow";
        std::vector<std::vector<uint16_t>> x_all;
        for (int r = 0; r < n; ++r) {
            x_all.push_back(ref::payload_rows(r, all[static_cast<size_t>(r)].num_tokens, p.hidden, seed, false));
        }
        const int64_t max_rows = ep.geometry().max_recv_rows;
        std::vector<std::vector<uint16_t>> y_all;
        for (int r = 0; r < n; ++r) {
            y_all.push_back(over[static_cast<size_t>(r)]
                                ? std::vector<uint16_t>(static_cast<size_t>(max_rows) * p.hidden, 0)
                                : ep_expected_y(p, plan, x_all, r, max_rows));
        }
        in.load(all[static_cast<size_t>(me)], x_all[static_cast<size_t>(me)]);
        in.y.upload(y_all[static_cast<size_t>(me)]);
        in.out.poison(0xFF);
        const TensorView y(in.y.get(), DType::kBF16, {max_rows, p.hidden});
        ep.dispatch(h, in.x_view(), in.idx_view(), in.w_view(), s);
        ep.combine(h, y, in.out_view(), s);
        w.sync_and_check(s);
        const std::optional<ops::ep::StatusReport> report = ep.status();
        team_check(team, [&] {
            if (over[static_cast<size_t>(me)]) {
                if (!report.has_value()) WEFT_FAIL("world rank " << w.rank() << " overflowed without a report");
                if (report->code != ops::ep::StatusCode::kRecvTokensOverflow &&
                    report->code != ops::ep::StatusCode::kRecvRowsOverflow) {
                    WEFT_FAIL("world rank " << w.rank() << " reported " << report->message);
                }
                if (report->raw.rank != me || report->raw.culprit_rank != me) {
                    WEFT_FAIL("world rank " << w.rank() << " (team rank " << me << "): raw.rank " << report->raw.rank
                                            << ", raw.culprit_rank " << report->raw.culprit_rank
                                            << "; both should be the team rank");
                }
                const std::string named = "rank " + std::to_string(w.rank()) + " would receive";
                if (report->message.find(named) == std::string::npos ||
                    report->message.find("this rank received nothing") == std::string::npos) {
                    WEFT_FAIL("world rank " << w.rank() << "'s report should name it (\"" << named
                                            << "\") and say that it received nothing: " << report->message);
                }
                std::string thrown;
                try {
                    ep.check();
                } catch (const Error& e) {
                    thrown = e.what();
                }
                if (thrown.find(report->message) == std::string::npos) {
                    WEFT_FAIL("world rank " << w.rank() << ": check() should throw the report, threw: " << thrown);
                }
                std::printf("rank %d: %s\n", w.rank(), report->message.c_str());
                const std::vector<int32_t> counts =
                    ref::download(h.expert_counts(), static_cast<size_t>(p.local_experts()), s);
                for (const int32_t c : counts) {
                    if (c != 0) WEFT_FAIL("world rank " << w.rank() << " overflowed but counts " << c << " rows");
                }
            } else {
                if (report.has_value()) WEFT_FAIL("world rank " << w.rank() << " reported " << report->message);
                ep_check_dispatch(p, plan, x_all, h, me, in.num_tokens, s);
            }
            // The overflowing ranks' partials are zero: their y rows are zero in y_all.
            ep_check_combine(p, plan, all, y_all,
                             ref::download(in.out.get(), static_cast<size_t>(in.num_tokens) * p.hidden, s), me);
        });
        if (report.has_value()) ep.clear_status();
        team.barrier();
        // Inputs inside this handle's own receive area: refused on every member before anything is launched.
        try {
            ep.dispatch(h, TensorView(h.recv_x().data, DType::kBF16, {1, p.hidden}),
                        TensorView(in.idx.get(), DType::kI32, {1, p.topk}),
                        TensorView(in.w.get(), DType::kF32, {1, p.topk}), s);
            ADD_FAILURE() << "world rank " << w.rank() << ": x inside the handle's receive area was accepted";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("receive area"), std::string::npos) << e.what();
        }
        // At most T / 2 tokens per rank: no rank can exceed max_recv_tokens = W T / 2.
        const std::vector<ref::Routing> clean =
            ref::make_routing(ref::Scenario::kUniform, p, cfg.max_tokens_per_rank / 2, seed + 1);
        ep_run_and_check(team, ep, h, in, clean, seed + 1, s, "after the overflow");
    }
}

// ---- low-latency mode across nodes ----

ops::ep::Config ll_config(int experts_per_rank, int hidden, int topk, int max_tokens, int num_ranks) {
    ops::ep::Config cfg;
    cfg.num_experts = experts_per_rank * num_ranks;
    cfg.hidden = hidden;
    cfg.topk = std::min(topk, cfg.num_experts);
    cfg.max_tokens_per_rank = max_tokens;
    cfg.normal = false;
    cfg.low_latency = true;
    return cfg;
}

// Everything the tests know about one low-latency call, on every member (team ranks).
using LlCall = ref::LowLatencyCall;

// This member's device inputs and outputs of the low-latency calls.
struct LlInputs {
    ref::DeviceArray<uint16_t> x;
    ref::DeviceArray<int32_t> idx;
    ref::DeviceArray<float> w;
    ref::DeviceArray<uint16_t> y;
    ref::DeviceArray<uint16_t> out;
    int num_tokens = 0;
    const ops::ep::Config& c;
    int64_t rows_per_expert;
    LlInputs(const ops::ep::Config& cfg, int num_ranks, cudaStream_t s)
        : x(static_cast<size_t>(cfg.max_tokens_per_rank + 1) * cfg.hidden, s),
          idx(static_cast<size_t>(cfg.max_tokens_per_rank + 1) * cfg.topk, s),
          w(static_cast<size_t>(cfg.max_tokens_per_rank + 1) * cfg.topk, s),
          y(static_cast<size_t>(cfg.num_experts) * cfg.max_tokens_per_rank * cfg.hidden, s),  // E_local * W * T * H
          out(static_cast<size_t>(cfg.max_tokens_per_rank) * cfg.hidden, s),
          c(cfg),
          rows_per_expert(int64_t{num_ranks} * cfg.max_tokens_per_rank) {}
    void load(const LlCall& call, int me) {
        num_tokens = call.all[static_cast<size_t>(me)].num_tokens;
        x.upload(call.x_all[static_cast<size_t>(me)]);
        idx.upload(call.all[static_cast<size_t>(me)].topk_idx);
        w.upload(call.all[static_cast<size_t>(me)].topk_weights);
    }
    TensorView x_view() const { return TensorView(x.get(), DType::kBF16, {num_tokens, c.hidden}); }
    TensorView idx_view() const { return TensorView(idx.get(), DType::kI32, {num_tokens, c.topk}); }
    TensorView w_view() const { return TensorView(w.get(), DType::kF32, {num_tokens, c.topk}); }
    TensorView out_view() const { return TensorView(out.get(), DType::kBF16, {num_tokens, c.hidden}); }
    TensorView y_view(int local_experts) const {
        return TensorView(y.get(), DType::kBF16, {local_experts, rows_per_expert, c.hidden});
    }
};

// The handle after a dispatch against the one-node op (team rank `me`): each local expert's count, and for each of its
// rows the source (rank * T + token), the top-k slot and the row (bf16 bits; fp8 codes and scales against the host
// quantiser). The one-node op's order inside an expert is (source rank, source token): compared exactly.
void ll_check_dispatch(const ref::Params& p, const LlCall& call, const ops::ep::LowLatencyHandle& h, bool fp8, int me,
                       int max_tokens, cudaStream_t s) {
    const ops::ep::LowLatencyHandleView& v = h.view();
    const size_t el = static_cast<size_t>(p.local_experts());
    const size_t rpe = static_cast<size_t>(p.num_ranks) * static_cast<size_t>(max_tokens);
    const size_t hsz = static_cast<size_t>(p.hidden);
    const size_t row_bytes = fp8 ? hsz : 2 * hsz;
    const size_t groups = hsz / 128;
    const std::vector<int32_t> counts = ref::download(v.expert_counts, el, s);
    const std::vector<int32_t> info = ref::download(v.recv_src_info, el * rpe, s);
    const std::vector<int32_t> slots = ref::download(v.recv_src_slot, el * rpe, s);
    const std::vector<uint8_t> data = ref::download(v.recv_x, el * rpe * row_bytes, s);
    const std::vector<float> scales = fp8 ? ref::download(v.recv_scales, el * rpe * groups, s) : std::vector<float>();
    std::vector<uint8_t> codes(hsz);
    std::vector<float> want_scales(groups);
    for (size_t le = 0; le < el; ++le) {
        const auto& list = call.rows[static_cast<size_t>(me)][le];
        if (counts[le] != static_cast<int32_t>(list.size())) {
            WEFT_FAIL("expert " << le << " count " << counts[le] << ", the one-node op gives " << list.size());
        }
        for (size_t i = 0; i < list.size(); ++i) {
            const size_t row = le * rpe + i;
            const ref::RowSource rs = list[i];
            if (info[row] != rs.src * max_tokens + rs.token || slots[row] != rs.slot) {
                WEFT_FAIL("expert " << le << " row " << i << ": source info " << info[row] << " slot " << slots[row]
                                    << ", expected rank " << rs.src << " token " << rs.token << " slot " << rs.slot);
            }
            const uint16_t* x = &call.x_all[static_cast<size_t>(rs.src)][static_cast<size_t>(rs.token) * hsz];
            if (!fp8) {
                if (std::memcmp(x, &data[row * row_bytes], row_bytes) != 0) {
                    WEFT_FAIL(
                        "expert " << le << " row " << i << ": expected rank " << rs.src << " token " << rs.token
                                  << ", found "
                                  << ref::describe_row(reinterpret_cast<const uint16_t*>(&data[row * row_bytes])));
                }
                continue;
            }
            ref::reference_quantize_row(x, p.hidden, codes.data(), want_scales.data());
            for (size_t g = 0; g < groups; ++g) {
                if (!(scales[row * groups + g] == want_scales[g])) {
                    WEFT_FAIL("expert " << le << " row " << i << " scale " << g << " = " << scales[row * groups + g]
                                        << ", the host quantiser gives " << want_scales[g]);
                }
            }
            for (size_t c = 0; c < hsz; ++c) {
                if (ref::e4m3_to_f32(data[row * row_bytes + c]) != ref::e4m3_to_f32(codes[c])) {
                    WEFT_FAIL("expert " << le << " row " << i << " channel " << c << ": code "
                                        << int{data[row * row_bytes + c]} << ", the host quantiser gives "
                                        << int{codes[c]});
                }
            }
        }
    }
}

// y of team rank r: expert_output of each valid row's payload; rows past the count NaN (a combine that reads one fails
// loudly).
std::vector<uint16_t> ll_expected_y(const ref::Params& p, const LlCall& call, int r, int max_tokens) {
    const size_t rpe = static_cast<size_t>(p.num_ranks) * static_cast<size_t>(max_tokens);
    const size_t hsz = static_cast<size_t>(p.hidden);
    std::vector<uint16_t> y(static_cast<size_t>(p.local_experts()) * rpe * hsz, 0x7fc1);
    for (int le = 0; le < p.local_experts(); ++le) {
        const auto& list = call.rows[static_cast<size_t>(r)][static_cast<size_t>(le)];
        for (size_t i = 0; i < list.size(); ++i) {
            const uint16_t* x = &call.x_all[static_cast<size_t>(list[i].src)][static_cast<size_t>(list[i].token) * hsz];
            for (size_t c = 0; c < hsz; ++c) {
                y[(static_cast<size_t>(le) * rpe + i) * hsz + c] = ref::expert_output(x[c], r * p.local_experts() + le);
            }
        }
    }
    return y;
}

// The combine's output of team rank `me` against the one-node arithmetic (fp32 fma over the valid slots in slot order,
// one bf16 rounding): the same bits.
void ll_check_combine(const ref::Params& p, const LlCall& call, const std::vector<std::vector<uint16_t>>& y_all,
                      const std::vector<uint16_t>& out, int me, int max_tokens) {
    const ref::Routing& r = call.all[static_cast<size_t>(me)];
    const size_t rpe = static_cast<size_t>(p.num_ranks) * static_cast<size_t>(max_tokens);
    const size_t hsz = static_cast<size_t>(p.hidden);
    for (int t = 0; t < r.num_tokens; ++t) {
        for (size_t c = 0; c < hsz; ++c) {
            float acc = 0.0f;
            for (int j = 0; j < p.topk; ++j) {
                const int e = ref::valid_expert(p, r, t, j);
                if (e < 0) continue;
                const int owner = p.owner(e);
                const size_t i =
                    static_cast<size_t>(call.row_of[static_cast<size_t>(me)][static_cast<size_t>(t) * p.topk + j]);
                const size_t le = static_cast<size_t>(e - owner * p.local_experts());
                acc = std::fma(r.topk_weights[static_cast<size_t>(t) * p.topk + j],
                               ref::bf16_to_f32(y_all[static_cast<size_t>(owner)][(le * rpe + i) * hsz + c]), acc);
            }
            const uint16_t want = ref::f32_to_bf16(acc);
            const uint16_t got = out[static_cast<size_t>(t) * hsz + c];
            if (got != want) {
                WEFT_FAIL("combine out[" << t << "][" << c << "] = " << ref::bf16_to_f32(got) << " (0x" << std::hex
                                         << got << "), the one-node arithmetic gives " << ref::bf16_to_f32(want)
                                         << " (0x" << want << std::dec << ")");
            }
        }
    }
}

// One low-latency dispatch + combine of `call`, outputs poisoned first, checked on every member. `launch` runs them
// (eagerly by default, or a graph's replay); `y_in_place` passes the handle's recv_x as y (bf16).
void ll_run_and_check(const Team& team, ops::ep::Buffer& ep, ops::ep::LowLatencyHandle& h, LlInputs& in,
                      const LlCall& call, bool fp8, cudaStream_t s, const std::string& what,
                      const std::function<void()>& launch = nullptr, int num_sms = 0, bool y_in_place = false) {
    const ref::Params p = ep_params(ep.config(), team.num_ranks());
    const int me = team.rank();
    const int tmax = ep.config().max_tokens_per_rank;
    in.load(call, me);
    const ops::ep::LowLatencyHandleView& v = h.view();
    const size_t rows = static_cast<size_t>(p.local_experts()) * static_cast<size_t>(in.rows_per_expert);
    WEFT_CUDA_CHECK(cudaMemsetAsync(v.recv_x, 0xEE, rows * static_cast<size_t>(p.hidden) * 2, s));
    WEFT_CUDA_CHECK(cudaMemsetAsync(v.recv_scales, 0xEE, rows * static_cast<size_t>(p.hidden / 128) * 4, s));
    WEFT_CUDA_CHECK(cudaMemsetAsync(v.recv_src_info, 0xEE, rows * 4, s));
    WEFT_CUDA_CHECK(cudaMemsetAsync(v.recv_src_slot, 0xEE, rows * 4, s));
    WEFT_CUDA_CHECK(cudaMemsetAsync(v.expert_counts, 0xEE, static_cast<size_t>(p.local_experts()) * 4, s));
    in.out.poison(0xFF);
    std::vector<std::vector<uint16_t>> y_all;
    for (int r = 0; r < p.num_ranks; ++r) y_all.push_back(ll_expected_y(p, call, r, tmax));
    const ops::ep::LowLatencyOptions options{.fp8 = fp8, .num_sms = num_sms};
    if (launch) {
        in.y.upload(y_all[static_cast<size_t>(me)]);
        launch();
        ep.sync_and_check(s);
    } else {
        ep.low_latency_dispatch(h, in.x_view(), in.idx_view(), s, options);
        ep.sync_and_check(s);
        team_check(team, [&] {
            try {
                ll_check_dispatch(p, call, h, fp8, me, tmax, s);
            } catch (const std::exception& e) {
                WEFT_FAIL("world rank " << team.world().rank() << ", " << what << (fp8 ? ", fp8" : ", bf16")
                                        << ", dispatch: " << e.what());
            }
        });
        TensorView y = in.y_view(p.local_experts());
        if (y_in_place && !fp8) {
            WEFT_CUDA_CHECK(cudaMemcpyAsync(h.recv_x().data, y_all[static_cast<size_t>(me)].data(),
                                            y_all[static_cast<size_t>(me)].size() * 2, cudaMemcpyHostToDevice, s));
            y = h.recv_x();
        } else {
            in.y.upload(y_all[static_cast<size_t>(me)]);
        }
        ep.low_latency_combine(h, y, in.idx_view(), in.w_view(), in.out_view(), s,
                               ops::ep::LowLatencyOptions{.num_sms = num_sms});
        ep.sync_and_check(s);
    }
    team_check(team, [&] {
        try {
            if (launch) ll_check_dispatch(p, call, h, fp8, me, tmax, s);
            ll_check_combine(p, call, y_all,
                             ref::download(in.out.get(), static_cast<size_t>(in.num_tokens) * p.hidden, s), me, tmax);
        } catch (const std::exception& e) {
            WEFT_FAIL("world rank " << team.world().rank() << ", " << what << (fp8 ? ", fp8" : ", bf16") << ": "
                                    << e.what());
        }
    });
}

// Low-latency dispatch and combine on teams that span nodes, against the one-node op computed on the host: every
// routing scenario (one hot expert, ranks with no tokens, -1 slots, all dropped, 0 / 1 / max tokens), top-k 1, 2 and
// 8 (more than a rank's experts too), 1 to 4 experts per rank, H = 128 to 640 (1 to 5 fp8 groups), bf16 and fp8, the
// world, every other rank and the interleaved team; outputs poisoned first; some calls on one block, some with
// y = recv_x in place.
TEST(MultiNode, EpLowLatencyMatchesTheOneNodeReference) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    struct Case {
        int experts_per_rank, hidden, topk, max_tokens;
    };
    const Case cases[] = {{2, 384, 2, 40}, {4, 256, 8, 7}, {1, 128, 1, 9}, {3, 640, 8, 17}};
    for (const Team& team : teams_with_interleaved(w)) {
        if (!team.is_member()) continue;
        ref::RankStream stream;
        const cudaStream_t s = stream.s;
        const uint32_t seed = team_seed(team);
        for (const Case& c : cases) {
            const ops::ep::Config cfg = ll_config(c.experts_per_rank, c.hidden, c.topk, c.max_tokens, team.num_ranks());
            ops::ep::Buffer ep(team, cfg);
            ops::ep::LowLatencyHandle h = ep.make_low_latency_handle();
            LlInputs in(cfg, team.num_ranks(), s);
            const ref::Params p = ep_params(cfg, team.num_ranks());
            int i = 0;
            for (const ref::Scenario sc : ref::all_scenarios()) {
                for (const bool fp8 : {false, true}) {
                    ++i;
                    const LlCall call = ref::low_latency_call(
                        p, ref::make_routing(sc, p, cfg.max_tokens_per_rank, seed + static_cast<uint32_t>(i)),
                        seed + static_cast<uint32_t>(i), fp8);
                    std::ostringstream what;
                    what << "team " << team.describe() << ", " << ref::scenario_name(sc) << ", E " << cfg.num_experts
                         << ", H " << cfg.hidden << ", k " << cfg.topk << ", T <= " << cfg.max_tokens_per_rank
                         << ", seed " << seed + static_cast<uint32_t>(i);
                    ll_run_and_check(team, ep, h, in, call, fp8, s, what.str(), nullptr, i % 3 == 0 ? 1 : 0,
                                     i % 4 == 1);
                }
            }
        }
    }
}

// Dispatch and combine captured in a CUDA graph after one eager call, replayed with new routings in the same input
// buffers (the placement is computed on the device), bf16 and fp8 (a graph each).
TEST(MultiNode, EpLowLatencyGraphReplay) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    const Team team = w.team();
    ref::RankStream stream;
    const cudaStream_t s = stream.s;
    const uint32_t seed = team_seed(team);
    const ops::ep::Config cfg = ll_config(3, 256, 4, 24, team.num_ranks());
    ops::ep::Buffer ep(team, cfg);
    ops::ep::LowLatencyHandle h = ep.make_low_latency_handle();
    LlInputs in(cfg, team.num_ranks(), s);
    const ref::Params p = ep_params(cfg, team.num_ranks());
    for (const bool fp8 : {false, true}) {
        cudaGraphExec_t exec = nullptr;
        for (int call = 0; call < 4; ++call) {
            // Every rank's T is max_tokens, so that the captured views stay valid; a hot expert in one replay.
            const ref::Scenario sc = call == 2 ? ref::Scenario::kSkewed : ref::Scenario::kMaxTokens;
            std::vector<ref::Routing> all = ref::make_routing(sc, p, cfg.max_tokens_per_rank,
                                                              seed + static_cast<uint32_t>(10 * call + (fp8 ? 1 : 0)));
            for (ref::Routing& r : all) {
                if (r.num_tokens == cfg.max_tokens_per_rank) continue;
                WEFT_FAIL("scenario " << ref::scenario_name(sc) << " gave " << r.num_tokens << " tokens, not T");
            }
            const LlCall c = ref::low_latency_call(p, std::move(all), seed + static_cast<uint32_t>(10 * call), fp8);
            const std::string what = "graph call " + std::to_string(call) + ", seed " + std::to_string(seed);
            if (call == 0) {
                ll_run_and_check(team, ep, h, in, c, fp8, s, what);
                team.barrier();
                cudaGraph_t g = nullptr;
                WEFT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
                ep.low_latency_dispatch(h, in.x_view(), in.idx_view(), s, ops::ep::LowLatencyOptions{.fp8 = fp8});
                ep.low_latency_combine(h, in.y_view(p.local_experts()), in.idx_view(), in.w_view(), in.out_view(), s);
                WEFT_CUDA_CHECK(cudaStreamEndCapture(s, &g));
                WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
                WEFT_CUDA_CHECK(cudaGraphDestroy(g));
            } else {
                ll_run_and_check(team, ep, h, in, c, fp8, s, what, [&] { WEFT_CUDA_CHECK(cudaGraphLaunch(exec, s)); });
            }
        }
        WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
        WEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
    }
}

// Split halves across nodes: send A, send B, receive A, receive B, then the combines the same way (the send half
// carries the exchange, the receive half completes the call's bookkeeping or sums); the results are the one-node op's.
TEST(MultiNode, EpLowLatencySplitHalves) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    const Team team = w.team();
    const int me = team.rank();
    ref::RankStream stream;
    const cudaStream_t s = stream.s;
    const uint32_t seed = team_seed(team);
    const ops::ep::Config cfg = ll_config(2, 256, 3, 12, team.num_ranks());
    ops::ep::Buffer ep(team, cfg);
    const ref::Params p = ep_params(cfg, team.num_ranks());
    ops::ep::LowLatencyHandle ha = ep.make_low_latency_handle();
    ops::ep::LowLatencyHandle hb = ep.make_low_latency_handle();
    LlInputs a(cfg, team.num_ranks(), s);
    LlInputs b(cfg, team.num_ranks(), s);
    const LlCall ca = ref::low_latency_call(p, ref::make_routing(ref::Scenario::kUniform, p, 12, seed), seed, true);
    const LlCall cb =
        ref::low_latency_call(p, ref::make_routing(ref::Scenario::kSomeDropped, p, 12, seed + 1), seed + 1, false);
    a.load(ca, me);
    b.load(cb, me);
    const ops::ep::LowLatencyOptions send{.phase = ops::ep::Phase::kSend};
    const ops::ep::LowLatencyOptions recv{.phase = ops::ep::Phase::kRecv};
    ep.low_latency_dispatch(ha, a.x_view(), a.idx_view(), s,
                            ops::ep::LowLatencyOptions{.fp8 = true, .phase = send.phase});
    ep.low_latency_dispatch(hb, b.x_view(), b.idx_view(), s, send);
    ep.low_latency_dispatch(ha, TensorView(), TensorView(), s,
                            ops::ep::LowLatencyOptions{.fp8 = true, .phase = recv.phase});
    ep.low_latency_dispatch(hb, TensorView(), TensorView(), s, recv);
    ep.sync_and_check(s);
    team_check(team, [&] {
        ll_check_dispatch(p, ca, ha, true, me, 12, s);
        ll_check_dispatch(p, cb, hb, false, me, 12, s);
    });
    std::vector<std::vector<uint16_t>> ya, yb;
    for (int r = 0; r < p.num_ranks; ++r) {
        ya.push_back(ll_expected_y(p, ca, r, 12));
        yb.push_back(ll_expected_y(p, cb, r, 12));
    }
    a.y.upload(ya[static_cast<size_t>(me)]);
    b.y.upload(yb[static_cast<size_t>(me)]);
    a.out.poison(0xFF);
    b.out.poison(0xFF);
    ep.low_latency_combine(ha, a.y_view(p.local_experts()), TensorView(), TensorView(), TensorView(), s, send);
    ep.low_latency_combine(hb, b.y_view(p.local_experts()), TensorView(), TensorView(), TensorView(), s, send);
    ep.low_latency_combine(ha, TensorView(), a.idx_view(), a.w_view(), a.out_view(), s, recv);
    ep.low_latency_combine(hb, TensorView(), b.idx_view(), b.w_view(), b.out_view(), s, recv);
    ep.sync_and_check(s);
    team_check(team, [&] {
        ll_check_combine(p, ca, ya, ref::download(a.out.get(), static_cast<size_t>(a.num_tokens) * p.hidden, s), me,
                         12);
        ll_check_combine(p, cb, yb, ref::download(b.out.get(), static_cast<size_t>(b.num_tokens) * p.hidden, s), me,
                         12);
    });
}

// Errors across nodes as on one node: invalid and repeated ids are reported by their source (kInvalidExpert /
// kDuplicateExpert) and dropped, the other routes still arrive and combine; more tokens than max_tokens_per_rank is a
// host error on the calling rank before anything is launched; a rank dispatching fp8 while the others dispatch bf16
// makes every rank report kCallMismatch and receive nothing (counts 0, the combine gives zeros). After clear_status
// the Buffer goes on.
TEST(MultiNode, EpLowLatencyErrorsAreReportedAsOnOneNode) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    const Team team = w.team();
    const int me = team.rank();
    ref::RankStream stream;
    const cudaStream_t s = stream.s;
    const uint32_t seed = team_seed(team);
    const ops::ep::Config cfg = ll_config(2, 128, 4, 9, team.num_ranks());
    ops::ep::Buffer ep(team, cfg);
    ops::ep::LowLatencyHandle h = ep.make_low_latency_handle();
    LlInputs in(cfg, team.num_ranks(), s);
    const ref::Params p = ep_params(cfg, team.num_ranks());

    // Invalid and repeated ids on team rank 0: token 1's slot 1 repeats slot 0, token 2's slot 3 is out of range.
    std::vector<ref::Routing> all = ref::make_routing(ref::Scenario::kMaxTokens, p, cfg.max_tokens_per_rank, seed);
    all[0].topk_idx[1 * 4 + 1] = all[0].topk_idx[1 * 4 + 0];
    all[0].topk_idx[2 * 4 + 3] = cfg.num_experts + 3;
    const LlCall bad = ref::low_latency_call(p, all, seed, false);
    in.load(bad, me);
    ep.low_latency_dispatch(h, in.x_view(), in.idx_view(), s);
    w.sync_and_check(s);
    std::optional<ops::ep::StatusReport> report = ep.status();
    team_check(team, [&] {
        if (me == 0) {
            if (!report.has_value()) WEFT_FAIL("rank 0's bad ids were not reported");
            if (report->code != ops::ep::StatusCode::kDuplicateExpert &&
                report->code != ops::ep::StatusCode::kInvalidExpert) {
                WEFT_FAIL("rank 0 reported " << report->message);
            }
            std::printf("rank %d: %s\n", w.rank(), report->message.c_str());
        } else if (report.has_value()) {
            WEFT_FAIL("only the source of the bad ids reports them: " << report->message);
        }
        ll_check_dispatch(p, bad, h, false, me, cfg.max_tokens_per_rank, s);
    });
    if (report.has_value()) ep.clear_status();
    team.barrier();
    // The same routing through a whole call: the valid routes still combine as on one node.
    ll_run_and_check(team, ep, h, in, bad, false, s, "invalid and repeated ids (combine)", [&] {
        ep.low_latency_dispatch(h, in.x_view(), in.idx_view(), s);
        ep.low_latency_combine(h, in.y_view(p.local_experts()), in.idx_view(), in.w_view(), in.out_view(), s);
        w.sync_and_check(s);
        if (ep.status().has_value()) ep.clear_status();
    });
    team.barrier();

    // More tokens than the Buffer's limit: a host error naming the limit, on the calling rank, nothing launched.
    const int64_t too_many = cfg.max_tokens_per_rank + 1;
    try {
        ep.low_latency_dispatch(h, TensorView(in.x.get(), DType::kBF16, {too_many, cfg.hidden}),
                                TensorView(in.idx.get(), DType::kI32, {too_many, cfg.topk}), s);
        ADD_FAILURE() << "a dispatch of " << too_many << " tokens was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("exceed Config::max_tokens_per_rank"), std::string::npos) << e.what();
    }

    // fp8 on the last rank, bf16 on the others.
    const LlCall clean = ref::low_latency_call(
        p, ref::make_routing(ref::Scenario::kUniform, p, cfg.max_tokens_per_rank, seed + 1), seed + 1, false);
    in.load(clean, me);
    in.y.upload(ll_expected_y(p, clean, me, cfg.max_tokens_per_rank));
    in.out.poison(0xFF);
    const bool fp8 = me == team.num_ranks() - 1;
    ep.low_latency_dispatch(h, in.x_view(), in.idx_view(), s, ops::ep::LowLatencyOptions{.fp8 = fp8});
    ep.low_latency_combine(h, in.y_view(p.local_experts()), in.idx_view(), in.w_view(), in.out_view(), s);
    w.sync_and_check(s);
    report = ep.status();
    team_check(team, [&] {
        if (!report.has_value() || report->code != ops::ep::StatusCode::kCallMismatch) {
            WEFT_FAIL("world rank " << w.rank() << ": expected kCallMismatch, got "
                                    << (report ? report->message : std::string("no report")));
        }
        std::printf("rank %d: %s\n", w.rank(), report->message.c_str());
        for (const int32_t c : ref::download(h.expert_counts(), static_cast<size_t>(p.local_experts()), s)) {
            if (c != 0) WEFT_FAIL("world rank " << w.rank() << " received " << c << " rows despite the mismatch");
        }
        for (const uint16_t v : ref::download(in.out.get(), static_cast<size_t>(in.num_tokens) * p.hidden, s)) {
            if (v != 0) WEFT_FAIL("world rank " << w.rank() << ": the combine after a mismatch must give zeros");
        }
    });
    ep.clear_status();
    team.barrier();
    ll_run_and_check(team, ep, h, in, clean, true, s, "after the mismatch");
}

// ---- the footprint across nodes ----

// Bytes in use in this rank's default stream-ordered pool (the Buffer's private allocations come from it).
uint64_t pool_bytes_in_use() {
    int device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    cudaMemPool_t pool = nullptr;
    WEFT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t used = 0;
    WEFT_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
    return used;
}

// ops::ep::footprint(config, num_ranks, num_nodes) is what a Buffer across nodes takes: a World of its own whose heap
// is the footprint's heap_bytes runs a dispatch and combine (the first exchange makes the node team's collective
// workspace, which the footprint counts); the heap the Buffer, its handles and the exchange took is at least the
// Buffer's and its handles' symmetric bytes and at most those plus the node stage's workspace; the private device
// memory the Buffer and its handles took from the stream-ordered pool is what the footprint says (within the pool's
// rounding). Two-hop dispatch (the default path).
TEST(MultiNode, EpFootprintCoversWhatTheBufferTakes) {
    World& main_world = dist_world();
    if (const std::string why = why_no_network_across_nodes(main_world); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    ::unsetenv("WEFT_EP_ACROSS_NODES");
    const int n = main_world.num_ranks();
    const int nodes = main_world.num_nodes();
    ops::ep::Config both = ep_config({2, 256, 2, 64, 1}, n);
    both.low_latency = true;
    const ops::ep::Config configs[] = {ep_config({2, 256, 2, 64, 1}, n), ll_config(2, 256, 3, 12, n), both};
    for (const ops::ep::Config& cfg : configs) {
        const ops::ep::Footprint fp = ops::ep::footprint(cfg, n, nodes);
        const int normal_handles = cfg.normal ? 1 : 0;
        const int ll_handles = cfg.low_latency ? 1 : 0;
        WorldOptions options;
        options.heap_bytes = fp.heap_bytes(normal_handles);
        std::unique_ptr<World> w = World::from_env(options);
        ASSERT_EQ(w->num_nodes(), nodes);
        const std::string what = std::string(cfg.normal ? "normal" : "") + (cfg.normal && cfg.low_latency ? "+" : "") +
                                 (cfg.low_latency ? "low-latency" : "") + ", " + std::to_string(nodes) +
                                 " nodes: footprint " + fp.describe();
        const uint64_t heap_before = w->heap().bytes_in_use();
        const uint64_t pool_before = pool_bytes_in_use();
        {
            ref::RankStream stream;
            const cudaStream_t s = stream.s;
            ops::ep::Buffer ep(*w, cfg);
            std::optional<ops::ep::NormalHandle> h;
            std::optional<ops::ep::LowLatencyHandle> l;
            if (cfg.normal) h.emplace(ep.make_normal_handle());
            if (cfg.low_latency) l.emplace(ep.make_low_latency_handle());
            const uint64_t device = pool_bytes_in_use() - pool_before;
            const uint64_t want_device = fp.buffer_device_bytes +
                                         static_cast<uint64_t>(normal_handles) * fp.normal_handle_device_bytes +
                                         static_cast<uint64_t>(ll_handles) * fp.low_latency_handle_device_bytes;
            std::printf("[ footprint] world rank %d, %s; device bytes taken %llu, counted %llu\n", w->rank(),
                        what.c_str(), static_cast<unsigned long long>(device),
                        static_cast<unsigned long long>(want_device));
            EXPECT_GE(device, want_device) << what;
            EXPECT_LE(device, want_device + (1ull << 20)) << what;  // the pool's rounding of some 8 allocations

            const ref::Params p = ep_params(cfg, n);
            const uint32_t seed = team_seed(w->team());
            if (cfg.normal) {
                EpInputs in(cfg, ep.geometry().max_recv_rows, s);
                ep_run_and_check(w->team(), ep, *h, in,
                                 ref::make_routing(ref::Scenario::kUniform, p, cfg.max_tokens_per_rank, seed), seed, s,
                                 what);
            }
            if (cfg.low_latency) {
                LlInputs in(cfg, n, s);
                const LlCall call = ref::low_latency_call(
                    p, ref::make_routing(ref::Scenario::kUniform, p, cfg.max_tokens_per_rank, seed + 1), seed + 1,
                    false);
                ll_run_and_check(w->team(), ep, *l, in, call, false, s, what);
            }
            WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
            const uint64_t heap = w->heap().bytes_in_use() - heap_before;
            const uint64_t own =
                fp.buffer_symmetric_bytes + static_cast<uint64_t>(normal_handles) * fp.normal_handle_symmetric_bytes;
            std::printf("[ footprint] world rank %d, %s; heap bytes taken %llu, counted %llu + %llu (node stage)\n",
                        w->rank(), what.c_str(), static_cast<unsigned long long>(heap),
                        static_cast<unsigned long long>(own),
                        static_cast<unsigned long long>(fp.node_collectives_symmetric_bytes));
            EXPECT_GE(heap, own) << what;
            EXPECT_LE(heap, own + fp.node_collectives_symmetric_bytes) << what;
            EXPECT_LE(heap, fp.heap_bytes(normal_handles)) << what;
        }
        w->barrier();
    }
}

TEST(MultiNode, MoeBlockAcrossNodesIsRefused) {
    World& w = dist_world();
    if (w.num_nodes() < 2) GTEST_SKIP() << "the world is on one node";
    ops::ep::MoeConfig cfg;
    cfg.ep = ep_config({2, 128, 2, 16, 1}, w.num_ranks());
    cfg.ffn = 64;
    try {
        ops::ep::MoeBlock block(w, cfg);
        ADD_FAILURE() << "an ep::MoeBlock across nodes was made";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("spans " + std::to_string(w.num_nodes()) + " nodes"), std::string::npos)
            << e.what();
    }
}

// On a rank other than `absent`: `call` (an op and its sync_and_check) must throw a weft::Error within the bound of a
// World made with a 5 s timeout, because rank `absent` never takes part. Prints the error.
template <class Call>
void expect_error_within_bound(World& w, int absent, Call&& call) {
    const auto start = std::chrono::steady_clock::now();
    std::string error;
    try {
        call();
    } catch (const Error& e) {
        error = e.what();
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    EXPECT_FALSE(error.empty()) << "rank " << w.rank() << ": no error although rank " << absent << " never came (after "
                                << std::chrono::duration_cast<std::chrono::milliseconds>(waited).count()
                                << " ms; World aborted: " << (w.aborted() ? "yes" : "no") << ")";
    EXPECT_LT(waited, std::chrono::milliseconds(3 * 5000 + 10000)) << error;
    std::printf("rank %d: %s\n", w.rank(), error.c_str());
}

// A World of its own with a short timeout: the last rank (on the last node) takes part in the first all-reduce (the
// backend exists then) and skips the second. Every other rank gets a weft::Error within the bound: its column peers
// from the network watcher, its node's members from their device waits.
TEST(MultiNode, ARankOnAnotherNodeThatNeverArrivesIsAnErrorWithinTheTimeout) {
    World& main_world = dist_world();
    if (!spans_nodes(main_world)) GTEST_SKIP() << "one node (set WEFT_VIRTUAL_NODES)";
    if (const std::string why = net::nccl_unavailable_reason(); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    WorldOptions options;
    options.timeout = std::chrono::milliseconds(5000);
    options.heap_bytes = 64ull << 20;
    std::unique_ptr<World> w = World::from_env(options);
    ASSERT_GT(w->num_nodes(), 1);
    const int absent = w->num_ranks() - 1;
    const uint64_t count = 200000;
    Buffers b(count * 4);
    upload(b.stream, b.in, DType::kF32, count, 5, w->rank());
    const TensorView in(b.in, DType::kF32, {static_cast<int64_t>(count)});
    const TensorView out(b.out, DType::kF32, {static_cast<int64_t>(count)});
    ops::all_reduce(*w, in, out, b.stream);
    w->sync_and_check(b.stream);
    w->barrier();
    if (w->rank() != absent) {
        expect_error_within_bound(*w, absent, [&] {
            ops::all_reduce(*w, in, out, b.stream);
            w->sync_and_check(b.stream);
        });
    }
    // Every rank leaves together: the World's shutdown is collective (an aborted World still meets its peers).
    w.reset();
}

// Work queued on the caller's stream ahead of a call does not count against the call's network bound: the stream is
// held (a wait on a host-mapped word) for twice the World's timeout before it reaches an all_reduce across nodes,
// which must then complete and check.
TEST(MultiNode, WorkQueuedAheadOfACallDoesNotCountAgainstItsNetworkBound) {
    World& main_world = dist_world();
    if (const std::string why = why_no_network_across_nodes(main_world); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    WorldOptions options;
    options.timeout = std::chrono::milliseconds(2000);
    options.heap_bytes = 64ull << 20;
    std::unique_ptr<World> w = World::from_env(options);
    const uint64_t count = 100000;
    Buffers b(count * 4);
    upload(b.stream, b.in, DType::kF32, count, 9, w->rank());
    uint64_t* gate_host = nullptr;
    uint64_t* gate_dev = nullptr;
    WEFT_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&gate_host), sizeof(uint64_t), cudaHostAllocMapped));
    *reinterpret_cast<volatile uint64_t*>(gate_host) = 0;
    WEFT_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&gate_dev), gate_host, 0));
    const TensorView in(b.in, DType::kF32, {static_cast<int64_t>(count)});
    const TensorView out(b.out, DType::kF32, {static_cast<int64_t>(count)});
    ops::all_reduce(*w, in, out, b.stream);  // first: what the first call sets up (the backend, its communicator)
    w->sync_and_check(b.stream);
    stream_wait_u64_geq(b.stream, gate_dev, 1);
    ops::all_reduce(*w, in, out, b.stream);
    std::this_thread::sleep_for(2 * options.timeout);
    *reinterpret_cast<volatile uint64_t*>(gate_host) = 1;
    EXPECT_NO_THROW(w->sync_and_check(b.stream));
    const std::vector<uint32_t> got = download(b.stream, b.out, DType::kF32, count);
    uint64_t wrong = 0;
    for (uint64_t i = 0; i < count; ++i) {
        int32_t sum = 0;
        for (int r = 0; r < w->num_ranks(); ++r) sum += pattern_value(9, r, i);
        wrong += got[i] != int_bits(sum, DType::kF32);
    }
    EXPECT_EQ(wrong, 0u) << "of " << count;
    w->barrier();
    cudaFreeHost(gate_host);
    w.reset();
}

// A value of WEFT_EP_ACROSS_NODES that one member refuses fails every member's Buffer at once, naming that member.
TEST(MultiNode, EpAnInvalidPathOnOneMemberIsRefusedOnEveryMember) {
    World& w = dist_world();
    if (const std::string why = why_no_network_across_nodes(w); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    const Team& team = w.team();
    const int odd = team.num_ranks() - 1;  // on the last node
    if (team.rank() == odd) ::setenv("WEFT_EP_ACROSS_NODES", "two-hop", 1);
    std::string error;
    const auto start = std::chrono::steady_clock::now();
    try {
        ops::ep::Buffer ep(team, ep_config({2, 64, 2, 9, 1}, team.num_ranks()));
    } catch (const Error& e) {
        error = e.what();
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    if (team.rank() == odd) ::unsetenv("WEFT_EP_ACROSS_NODES");
    EXPECT_NE(error.find("WEFT_EP_ACROSS_NODES must be two_hop or all_to_all; world rank " +
                         std::to_string(team.world_rank(odd))),
              std::string::npos)
        << "rank " << w.rank() << ": " << error;
    EXPECT_LT(waited, std::chrono::milliseconds(30000)) << error;  // far below the World's timeout
    w.barrier();

    // A valid path that differs: the same text on every member, naming the first member and the one that differs.
    if (team.rank() == odd) ::setenv("WEFT_EP_ACROSS_NODES", "all_to_all", 1);
    error.clear();
    try {
        ops::ep::Buffer ep(team, ep_config({2, 64, 2, 9, 1}, team.num_ranks()));
    } catch (const Error& e) {
        error = e.what();
    }
    if (team.rank() == odd) ::unsetenv("WEFT_EP_ACROSS_NODES");
    EXPECT_NE(error.find("the members' WEFT_EP_ACROSS_NODES differ: world rank " + std::to_string(team.world_rank(0)) +
                         " takes two_hop, world rank " + std::to_string(team.world_rank(odd)) + " all_to_all"),
              std::string::npos)
        << "rank " << w.rank() << ": " << error;
    w.barrier();
}

// The same for expert parallelism: a World of its own with a short timeout and an EP Buffer on it; the last rank takes
// part in the first dispatch and combine and skips the second dispatch. Every other rank's call fails within the bound
// (the record exchange waits for it: across nodes under the network watcher, on its node in bounded device waits).
TEST(MultiNode, EpARankOnAnotherNodeThatNeverArrivesIsAnErrorWithinTheTimeout) {
    World& main_world = dist_world();
    if (!spans_nodes(main_world)) GTEST_SKIP() << "one node (set WEFT_VIRTUAL_NODES)";
    if (const std::string why = net::nccl_unavailable_reason(); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    WorldOptions options;
    options.timeout = std::chrono::milliseconds(5000);
    options.heap_bytes = 64ull << 20;
    std::unique_ptr<World> w = World::from_env(options);
    ASSERT_GT(w->num_nodes(), 1);
    const int absent = w->num_ranks() - 1;
    {
        ref::RankStream stream;
        const cudaStream_t s = stream.s;
        const ops::ep::Config cfg = ep_config({2, 256, 2, 64, 1}, w->num_ranks());
        ops::ep::Buffer ep(*w, cfg);
        ops::ep::NormalHandle h = ep.make_normal_handle();
        EpInputs in(cfg, ep.geometry().max_recv_rows, s);
        const ref::Params p = ep_params(cfg, w->num_ranks());
        const std::vector<ref::Routing> all = ref::make_routing(ref::Scenario::kUniform, p, cfg.max_tokens_per_rank, 9);
        ep_run_and_check(w->team(), ep, h, in, all, 9, s, "before the absence");
        w->barrier();
        if (w->rank() != absent) {
            expect_error_within_bound(*w, absent, [&] {
                ep.dispatch(h, in.x_view(), in.idx_view(), in.w_view(), s);
                ep.sync_and_check(s);
            });
        }
    }
    // Every rank leaves together: the World's shutdown is collective (an aborted World still meets its peers).
    w.reset();
}

// The low-latency mode with a rank on another node that never arrives: a World of its own with a short timeout; the
// last rank takes part in the first dispatch and combine and skips the second dispatch. Every other rank's call fails
// within the bound (its record exchange waits for the absent rank: across nodes under the network watcher, whose error
// names the team and the column, on its node in bounded device waits, whose diagnostic names the peer).
TEST(MultiNode, EpLowLatencyARankOnAnotherNodeThatNeverArrivesIsAnErrorWithinTheTimeout) {
    World& main_world = dist_world();
    if (!spans_nodes(main_world)) GTEST_SKIP() << "one node (set WEFT_VIRTUAL_NODES)";
    if (const std::string why = net::nccl_unavailable_reason(); !why.empty()) GTEST_SKIP() << why;
    set_test_environment();
    WorldOptions options;
    options.timeout = std::chrono::milliseconds(5000);
    options.heap_bytes = 64ull << 20;
    std::unique_ptr<World> w = World::from_env(options);
    ASSERT_GT(w->num_nodes(), 1);
    const int absent = w->num_ranks() - 1;
    {
        ref::RankStream stream;
        const cudaStream_t s = stream.s;
        const ops::ep::Config cfg = ll_config(2, 256, 2, 64, w->num_ranks());
        ops::ep::Buffer ep(*w, cfg);
        ops::ep::LowLatencyHandle h = ep.make_low_latency_handle();
        LlInputs in(cfg, w->num_ranks(), s);
        const ref::Params p = ep_params(cfg, w->num_ranks());
        const LlCall call = ref::low_latency_call(
            p, ref::make_routing(ref::Scenario::kUniform, p, cfg.max_tokens_per_rank, 9), 9, false);
        ll_run_and_check(w->team(), ep, h, in, call, false, s, "before the absence");
        w->barrier();
        if (w->rank() != absent) {
            expect_error_within_bound(*w, absent, [&] {
                ep.low_latency_dispatch(h, in.x_view(), in.idx_view(), s);
                ep.sync_and_check(s);
            });
        }
    }
    // Every rank leaves together: the World's shutdown is collective (an aborted World still meets its peers).
    w.reset();
}

}  // namespace
}  // namespace weft::test
