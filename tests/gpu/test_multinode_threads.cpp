// SPDX-License-Identifier: MIT
// Virtual nodes with ranks as threads of one process (run_local): the topology, the heap that maps no peer on another
// node, and the network backend's refusals (docs/multinode.md: NCCL refuses two ranks of a communicator on one GPU
// in one process, so the collectives across virtual nodes on one GPU run as processes: tests/dist).
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include <cuda_runtime.h>

#include "tp_test_util.hpp"
#include "weft/net/host_backend.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/ep.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/ops/reduce_scatter.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

WorldOptions virtual_nodes(int k) {
    WorldOptions o;
    o.virtual_nodes = k;
    o.heap_bytes = 64ull << 20;
    o.timeout = std::chrono::milliseconds(20000);
    return o;
}

std::string run_local_error(int n, const std::function<void(World&)>& fn, const WorldOptions& options) {
    try {
        run_local(n, fn, options);
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

TEST(MultiNodeThreads, TopologyAndReachability) {
    for (const auto& [k, n] : {std::pair{2, 4}, std::pair{4, 4}, std::pair{2, 6}, std::pair{3, 6}}) {
        run_local(
            n,
            [k = k, n = n](World& w) {
                const int per_node = n / k;
                EXPECT_EQ(w.virtual_nodes(), k);
                EXPECT_EQ(w.num_nodes(), k);
                EXPECT_EQ(w.node(), w.rank() / per_node);
                EXPECT_EQ(w.node_team().num_ranks(), per_node);
                EXPECT_EQ(w.node_team().world_rank(0), w.node() * per_node);
                EXPECT_EQ(w.team().num_nodes(), k);
                EXPECT_EQ(w.team().ranks_per_node(), per_node);
                EXPECT_EQ(w.team().node_index(), w.node());
                EXPECT_EQ(w.team().local_index(), w.rank() % per_node);
                EXPECT_EQ(w.node_team().num_nodes(), 1);
                // A strided team: one member per node when per_node ranks apart.
                const Team column = w.team().split_strided(0, per_node, k);
                if (column.is_member()) {
                    EXPECT_EQ(column.num_nodes(), k);
                    EXPECT_EQ(column.ranks_per_node(), 1);
                }
                auto* probe = static_cast<uint8_t*>(w.heap().alloc(256));
                for (int r = 0; r < n; ++r) {
                    void* at = w.heap().symm_at(probe, r);
                    if (r / per_node == w.node()) {
                        EXPECT_NE(at, nullptr) << "rank " << r;
                    } else {
                        EXPECT_EQ(at, nullptr) << "rank " << r << " is on another node";
                    }
                }
                w.heap().free(probe);
            },
            virtual_nodes(k));
    }
}

TEST(MultiNodeThreads, VirtualNodesMustDivideTheWorld) {
    const std::string e = run_local_error(
        3, [](World&) {}, virtual_nodes(2));
    EXPECT_NE(e.find("WorldOptions::virtual_nodes = 2 must divide the world size 3"), std::string::npos) << e;
}

TEST(MultiNodeThreads, ForcingASingleNodeAlgorithmAcrossNodesIsAnError) {
    run_local(
        4,
        [](World& w) {
            float* buf = nullptr;
            WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&buf), 64));
            try {
                ops::all_reduce(w, TensorView(buf, DType::kF32, {16}), TensorView(buf, DType::kF32, {16}), nullptr,
                                {.algo = ops::AllReduceAlgo::kTwoShot});
                ADD_FAILURE() << "a two-shot all-reduce across virtual nodes was accepted";
            } catch (const Error& e) {
                EXPECT_NE(std::string(e.what()).find("spans 2 nodes"), std::string::npos) << e.what();
            }
            cudaFree(buf);
        },
        virtual_nodes(2));
}

// Every rank on one GPU: a column's members are threads of one process on one GPU, which NCCL refuses; weft says so
// (or, without NCCL, says that) on every rank instead of failing inside NCCL.
TEST(MultiNodeThreads, TheNetworkOnOneGpuInOneProcessIsRefusedClearly) {
    int devices = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&devices));
    if (devices > 1) GTEST_SKIP() << "ranks on several GPUs";
    const std::string unavailable = net::nccl_unavailable_reason();
    run_local(
        4,
        [&](World& w) {
            float* buf = nullptr;
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&buf), 64));
            try {
                ops::all_reduce(w, TensorView(buf, DType::kF32, {16}), TensorView(buf, DType::kF32, {16}), s);
                ADD_FAILURE() << "an all-reduce across virtual nodes of one GPU in one process was accepted";
            } catch (const Error& e) {
                const std::string what = e.what();
                if (unavailable.empty()) {
                    EXPECT_NE(what.find("threads of one process on one GPU"), std::string::npos) << what;
                } else {
                    EXPECT_NE(what.find("network backend is unavailable"), std::string::npos) << what;
                }
            }
            cudaFree(buf);
            cudaStreamDestroy(s);
        },
        virtual_nodes(2));
}

// A fused op made on a team that spans virtual nodes of one GPU, ranks as threads: its network backend refuses the
// columns in its constructor, on every member, naming why (or, without NCCL, that the backend is unavailable).
void expect_refused_across_virtual_nodes_of_one_gpu(const std::string& op_name,
                                                    const std::function<void(World&)>& make) {
    const std::string unavailable = net::nccl_unavailable_reason();
    run_local(
        4,
        [&](World& w) {
            try {
                make(w);
                ADD_FAILURE() << op_name << " across virtual nodes of one GPU in one process was accepted";
            } catch (const Error& e) {
                const std::string what = e.what();
                if (unavailable.empty()) {
                    EXPECT_NE(what.find("threads of one process on one GPU"), std::string::npos) << what;
                } else {
                    EXPECT_NE(what.find("network backend is unavailable"), std::string::npos) << what;
                }
            }
        },
        virtual_nodes(2));
}

int gpus_here() {
    int devices = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&devices));
    return devices;
}

// AgGemm on a team that spans virtual nodes of one GPU, ranks as threads: its network backend refuses the columns
// (threads of one process on one GPU), on every member, in its constructor, before any kernel runs; the AgGemm across
// nodes itself runs as processes (tests/dist, MultiNode.AgGemm*).
TEST(MultiNodeThreads, AgGemmAcrossNodesOnOneGpuInOneProcessIsRefusedClearly) {
    if (gpus_here() > 1) GTEST_SKIP() << "ranks on several GPUs";
    expect_refused_across_virtual_nodes_of_one_gpu("an AgGemm", [](World& w) {
        ops::AgGemm op(w, {64, 64, 64, DType::kBF16});
    });
}

// GemmRs on a team that spans virtual nodes of one GPU, ranks as threads: refused the same way (its network backend,
// in its constructor, on every member); GemmRs across nodes runs as processes (tests/dist, MultiNode.GemmRs*).
TEST(MultiNodeThreads, GemmRsAcrossNodesOnOneGpuInOneProcessIsRefusedClearly) {
    if (gpus_here() > 1) GTEST_SKIP() << "ranks on several GPUs";
    expect_refused_across_virtual_nodes_of_one_gpu("a GemmRs", [](World& w) {
        ops::GemmRs op(w, {64, 64, 64, DType::kBF16});
    });
}

// An EP Buffer on a team that spans virtual nodes of one GPU, ranks as threads: refused the same way (its network
// backend, in its constructor, on every member); EP across nodes runs as processes (tests/dist, MultiNode.Ep*).
TEST(MultiNodeThreads, EpAcrossNodesOnOneGpuInOneProcessIsRefusedClearly) {
    if (gpus_here() > 1) GTEST_SKIP() << "ranks on several GPUs";
    expect_refused_across_virtual_nodes_of_one_gpu("an ep::Buffer", [](World& w) {
        ops::ep::Config cfg;
        cfg.num_experts = 8;
        cfg.hidden = 128;
        cfg.topk = 2;
        cfg.max_tokens_per_rank = 16;
        ops::ep::Buffer ep(w, cfg);
    });
}

// One GPU per rank (a multi-GPU machine): NCCL accepts a column of threads on different GPUs, so the hierarchical
// collectives run with ranks as threads (NCCL may carry the bytes through P2P: correctness, not the network path).
TEST(MultiNodeThreads, CollectivesAcrossVirtualNodesWithAGpuPerRank) {
    int devices = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&devices));
    if (devices < 2) GTEST_SKIP() << "needs a GPU per rank (2 or more GPUs)";
    if (const std::string why = net::nccl_unavailable_reason(); !why.empty()) GTEST_SKIP() << why;
    const int n = devices - devices % 2;
    ::setenv("WEFT_NET_CHUNK_BYTES", "64K", 1);
    run_local(
        n,
        [n](World& w) {
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            const int64_t count = 100003;  // per rank; not a multiple of anything
            const auto total = static_cast<size_t>(count) * static_cast<size_t>(n);
            float *in = nullptr, *out = nullptr, *host = nullptr;
            WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&in), total * 4, s));
            WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&out), total * 4, s));
            WEFT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host), total * 4));
            const auto value = [](int rank, size_t i) { return static_cast<float>((rank * 5 + i * 3) % 13) - 6.0f; };
            const auto upload = [&](size_t elems) {
                for (size_t i = 0; i < elems; ++i) host[i] = value(w.rank(), i);
                WEFT_CUDA_CHECK(cudaMemcpyAsync(in, host, elems * 4, cudaMemcpyHostToDevice, s));
            };
            const auto download = [&](size_t elems) {
                WEFT_CUDA_CHECK(cudaMemcpyAsync(host, out, elems * 4, cudaMemcpyDeviceToHost, s));
                w.sync_and_check(s);
            };
            upload(static_cast<size_t>(count));
            ops::all_reduce(w, TensorView(in, DType::kF32, {count}), TensorView(out, DType::kF32, {count}), s);
            download(static_cast<size_t>(count));
            size_t bad = 0;
            for (size_t i = 0; i < static_cast<size_t>(count); ++i) {
                float want = 0;
                for (int r = 0; r < n; ++r) want += value(r, i);
                bad += host[i] != want;
            }
            EXPECT_EQ(bad, 0u) << "all_reduce, rank " << w.rank();
            upload(static_cast<size_t>(count));
            ops::all_gather(w, TensorView(in, DType::kF32, {count}),
                            TensorView(out, DType::kF32, {static_cast<int64_t>(total)}), s);
            download(total);
            bad = 0;
            for (size_t k = 0; k < total; ++k) {
                bad +=
                    host[k] != value(static_cast<int>(k / static_cast<size_t>(count)), k % static_cast<size_t>(count));
            }
            EXPECT_EQ(bad, 0u) << "all_gather, rank " << w.rank();
            upload(total);
            ops::reduce_scatter(w, TensorView(in, DType::kF32, {static_cast<int64_t>(total)}),
                                TensorView(out, DType::kF32, {count}), s);
            download(static_cast<size_t>(count));
            bad = 0;
            for (size_t i = 0; i < static_cast<size_t>(count); ++i) {
                float want = 0;
                for (int r = 0; r < n; ++r)
                    want += value(r, static_cast<size_t>(w.rank()) * static_cast<size_t>(count) + i);
                bad += host[i] != want;
            }
            EXPECT_EQ(bad, 0u) << "reduce_scatter, rank " << w.rank();
            cudaFreeHost(host);
            WEFT_CUDA_CHECK(cudaFreeAsync(in, s));
            WEFT_CUDA_CHECK(cudaFreeAsync(out, s));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
            cudaStreamDestroy(s);
        },
        virtual_nodes(2));
}

// GemmRs across two virtual nodes with a GPU per rank, ranks as threads (NCCL may carry the bytes through P2P:
// correctness of the two stages, not of the network path; with one rank per GPU the node stage takes the push mode):
// two calls with different M (segments not a multiple of the tile, several sub-blocks: WEFT_NET_CHUNK_BYTES=64K),
// poisoned C, against the fp64 reference.
TEST(MultiNodeThreads, GemmRsAcrossVirtualNodesWithAGpuPerRank) {
    using namespace tp_test;
    int devices = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&devices));
    if (devices < 2) GTEST_SKIP() << "needs a GPU per rank (2 or more GPUs)";
    if (const std::string why = net::nccl_unavailable_reason(); !why.empty()) GTEST_SKIP() << why;
    const int n = devices - devices % 2;
    ::setenv("WEFT_NET_CHUNK_BYTES", "64K", 1);
    const int64_t max_rows = 300, cols = 264, k = 128;
    const DType dt = DType::kBF16;
    const uint64_t base = fresh_seed();
    run_local(
        n,
        [&](World& w) {
            const int me = w.rank();
            cudaStream_t st = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
            {
                DevBuf a_dev(static_cast<size_t>(max_rows * n * k * 2)), b_dev(static_cast<size_t>(cols * k * 2)),
                    c_dev(static_cast<size_t>(max_rows * cols * 2));
                ops::GemmRs op(w, {max_rows * n, cols, k, dt});
                for (int call = 0; call < 2; ++call) {
                    const int64_t rows = call == 0 ? max_rows : 130;
                    const int64_t m = rows * n;
                    std::vector<HostMat> as, bs;
                    for (int r = 0; r < n; ++r) {
                        as.emplace_back(m, k, k, dt);
                        as.back().fill_random(seed_of(base, 0, r, call));
                        bs.emplace_back(cols, k, k, dt);
                        bs.back().fill_random(seed_of(base, 1, r, call));
                    }
                    upload(as[static_cast<size_t>(me)], a_dev.ptr, st);
                    upload(bs[static_cast<size_t>(me)], b_dev.ptr, st);
                    HostMat c(rows, cols, cols, dt);
                    poison(c);
                    upload(c, c_dev.ptr, st);
                    op.run(view(as[static_cast<size_t>(me)], a_dev.ptr), view(bs[static_cast<size_t>(me)], b_dev.ptr),
                           view(c, c_dev.ptr), st);
                    w.sync_and_check(st);
                    download(c, c_dev.ptr, st);
                    const std::vector<int64_t> check_rows =
                        rows_to_check(rows, rows, static_cast<double>(cols * k * n), seed_of(base, 2, me, call));
                    Reference ref(static_cast<int64_t>(check_rows.size()), cols);
                    for (int r = 0; r < n; ++r) {
                        ref.add(as[static_cast<size_t>(r)], me * rows, check_rows, bs[static_cast<size_t>(r)]);
                    }
                    ErrorModel model = ErrorModel::tp_sum(dt, op.partial_dtype(), n);
                    model.u_partial += unit_roundoff(dt);  // each node's sum is rounded once more
                    const std::string bad = compare(c, check_rows, ref, model);
                    EXPECT_TRUE(bad.empty())
                        << "gemm_rs across 2 virtual nodes, rank " << me << " (" << ops::gemm_rs_mode_name(op.mode())
                        << ") call " << call << " M " << m << " seed " << base << ": " << bad;
                }
            }
            WEFT_CUDA_CHECK(cudaStreamDestroy(st));
        },
        virtual_nodes(2));
}

}  // namespace
}  // namespace weft::test
