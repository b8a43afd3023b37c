// SPDX-License-Identifier: MIT
// GPU tests of all_to_all / all_to_all_v and the Ulysses helpers (ranks as threads sharing the visible GPUs), worlds
// 1, 2, 3, 4, 5, 7 and 8: byte-exact results against the pattern every rank can compute, for 1-, 2- and 4-byte dtypes,
// equal splits (staged in rounds through a small staging region, or read in place from a symmetric input) and uneven
// splits with zeros; outputs poisoned and the bytes after them checked untouched; a CUDA graph replayed on new inputs.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "support/jit_testing.hpp"
#include "support/runtime_checks.hpp"
#include "weft/ops/all_to_all.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

constexpr uint64_t kCapacity = 8ull << 20;  // bytes per buffer
constexpr uint64_t kGuard = 64;

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

uint64_t fresh_seed() {
    std::random_device rd;
    const uint64_t s = (uint64_t{rd()} << 20) ^ rd();
    std::printf("[ seed     ] %llu\n", static_cast<unsigned long long>(s));
    return s;
}

// Byte i of the chunk rank `src` sends to rank `dst` in case `tag`.
uint8_t chunk_byte(uint64_t seed, uint64_t tag, int src, int dst, uint64_t i) {
    uint64_t z = seed ^ (tag * 0x9e3779b97f4a7c15ull) ^ (uint64_t(src) << 48) ^ (uint64_t(dst) << 40) ^ i;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return static_cast<uint8_t>(z ^ (z >> 31));
}

// The elements rank `src` sends rank `dst` in uneven case `tag`: zero for about a third of the pairs.
int64_t uneven_count(uint64_t seed, uint64_t tag, int src, int dst) {
    const uint8_t r = chunk_byte(seed, tag, src, dst, ~0ull);
    if (r % 3 == 0) return 0;
    return r % 3 == 1 ? r % 17 : 1000 + 37 * r;
}

// One rank's buffers, allocated once (before any collective) and freed after a barrier.
struct Buffers {
    World& w;
    cudaStream_t stream = nullptr;
    uint8_t* local_in = nullptr;
    uint8_t* out = nullptr;
    uint8_t* sym_in = nullptr;
    uint8_t* scratch = nullptr;

    explicit Buffers(World& world) : w(world) {
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&local_in), kCapacity, stream));
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&out), kCapacity + kGuard, stream));
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&scratch), kCapacity, stream));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
        sym_in = static_cast<uint8_t*>(w.heap().alloc(kCapacity));
        ops::prepare_collectives(w);
        w.barrier();
    }
    void release() {
        w.sync_and_check(stream);
        w.barrier();
        w.heap().free(sym_in);
        cudaFreeAsync(local_in, stream);
        cudaFreeAsync(out, stream);
        cudaFreeAsync(scratch, stream);
        cudaStreamSynchronize(stream);
        cudaStreamDestroy(stream);
    }
};

void upload(cudaStream_t s, void* dst, const std::vector<uint8_t>& h) {
    if (!h.empty()) WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, h.data(), h.size(), cudaMemcpyHostToDevice, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
}

std::vector<uint8_t> download(cudaStream_t s, const void* src, uint64_t bytes) {
    std::vector<uint8_t> h(bytes);
    if (bytes > 0) WEFT_CUDA_CHECK(cudaMemcpyAsync(h.data(), src, bytes, cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    return h;
}

// Runs one all-to-all case on every rank and records mismatches in `failures`. counts[src][dst] in elements.
void a2a_case(Buffers& b, const std::vector<std::vector<int64_t>>& counts, DType t, bool equal, bool symmetric,
              uint64_t seed, uint64_t tag, std::vector<std::string>* failures) {
    World& w = b.w;
    const int n = w.num_ranks();
    const int me = w.rank();
    const auto elem = static_cast<uint64_t>(dtype_bytes(t));
    std::vector<int64_t> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
    uint64_t send_bytes = 0, recv_bytes = 0;
    for (int q = 0; q < n; ++q) {
        send[static_cast<size_t>(q)] = counts[static_cast<size_t>(me)][static_cast<size_t>(q)];
        recv[static_cast<size_t>(q)] = counts[static_cast<size_t>(q)][static_cast<size_t>(me)];
        send_bytes += static_cast<uint64_t>(send[static_cast<size_t>(q)]) * elem;
        recv_bytes += static_cast<uint64_t>(recv[static_cast<size_t>(q)]) * elem;
    }
    std::vector<uint8_t> in_host;
    in_host.reserve(send_bytes);
    for (int q = 0; q < n; ++q) {
        for (uint64_t i = 0; i < static_cast<uint64_t>(send[static_cast<size_t>(q)]) * elem; ++i) {
            in_host.push_back(chunk_byte(seed, tag, me, q, i));
        }
    }
    uint8_t* in = symmetric ? b.sym_in : b.local_in;
    upload(b.stream, in, in_host);
    WEFT_CUDA_CHECK(cudaMemsetAsync(b.out, 0xFF, recv_bytes + kGuard, b.stream));
    const TensorView tin(in, t, {static_cast<int64_t>(send_bytes / elem)});
    const TensorView tout(b.out, t, {static_cast<int64_t>(recv_bytes / elem)});
    if (equal) {
        ops::all_to_all(w, tin, tout, b.stream);
    } else {
        ops::all_to_all_v(w, tin, send, tout, recv, b.stream);
    }
    w.sync_and_check(b.stream);
    const std::vector<uint8_t> got = download(b.stream, b.out, recv_bytes + kGuard);
    uint64_t at = 0;
    for (int q = 0; q < n && failures->size() < 20; ++q) {
        for (uint64_t i = 0; i < static_cast<uint64_t>(recv[static_cast<size_t>(q)]) * elem; ++i, ++at) {
            if (got[at] != chunk_byte(seed, tag, q, me, i)) {
                failures->push_back("case " + std::to_string(tag) + (equal ? " equal" : " uneven") +
                                    (symmetric ? " symmetric" : " local") + " " + dtype_name(t) + ": byte " +
                                    std::to_string(i) + " from rank " + std::to_string(q) + " wrong");
                break;
            }
        }
    }
    for (uint64_t g = 0; g < kGuard; ++g) {
        if (got[recv_bytes + g] != 0xFF) {
            failures->push_back("case " + std::to_string(tag) + ": wrote past the output's end");
            break;
        }
    }
}

class AllToAll : public ::testing::TestWithParam<int> {};

TEST_P(AllToAll, EqualAndUnevenSplitsEveryDtypeAndPlacement) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device visible";
    const int n = GetParam();
    const uint64_t seed = fresh_seed();
    // A small staging region: local inputs above ~1 MiB per call take several rounds.
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::string("1M"));
    run_ranks(
        n,
        [&](World& w) {
            Buffers b(w);
            std::vector<std::string> failures;
            uint64_t tag = 0;
            for (DType t : {DType::kU8, DType::kBF16, DType::kF32}) {
                for (int64_t per_peer : {0, 1, 7, 1000, 70001}) {
                    if (static_cast<uint64_t>(per_peer * n * dtype_bytes(t)) > kCapacity) continue;
                    const std::vector<std::vector<int64_t>> counts(
                        static_cast<size_t>(n), std::vector<int64_t>(static_cast<size_t>(n), per_peer));
                    for (bool sym : {false, true}) a2a_case(b, counts, t, true, sym, seed, ++tag, &failures);
                }
                for (int k = 0; k < 3; ++k) {
                    ++tag;
                    std::vector<std::vector<int64_t>> counts(static_cast<size_t>(n),
                                                             std::vector<int64_t>(static_cast<size_t>(n)));
                    for (int s = 0; s < n; ++s) {
                        for (int d = 0; d < n; ++d) {
                            counts[static_cast<size_t>(s)][static_cast<size_t>(d)] = uneven_count(seed, tag, s, d);
                        }
                    }
                    for (bool sym : {false, true}) a2a_case(b, counts, t, false, sym, seed, tag, &failures);
                }
            }
            // Uneven, rank 0 sends nothing (an empty input counts as local, so rank 0 stages) while the others send
            // from the heap (direct) or from local memory (staged): the ranks differ in staging, which is allowed.
            for (bool sym : {true, false}) {
                ++tag;
                std::vector<std::vector<int64_t>> counts(static_cast<size_t>(n),
                                                         std::vector<int64_t>(static_cast<size_t>(n)));
                for (int s = 1; s < n; ++s) {
                    for (int d = 0; d < n; ++d) {
                        counts[static_cast<size_t>(s)][static_cast<size_t>(d)] = 1 + uneven_count(seed, tag, s, d);
                    }
                }
                a2a_case(b, counts, DType::kBF16, false, sym, seed, tag, &failures);
            }
            // Uneven, all zero on every rank: one kernel each, nothing moved.
            const std::vector<std::vector<int64_t>> zeros(static_cast<size_t>(n),
                                                          std::vector<int64_t>(static_cast<size_t>(n), 0));
            a2a_case(b, zeros, DType::kF32, false, false, seed, ++tag, &failures);
            for (const std::string& f : failures) ADD_FAILURE() << "rank " << w.rank() << " of " << n << ": " << f;
            b.release();
        },
        test_options(64ull << 20));
}

// Captured once (equal staged, equal direct, uneven), replayed three times on new inputs.
TEST_P(AllToAll, GraphReplaysWithNewInputs) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device visible";
    const int n = GetParam();
    const uint64_t seed = fresh_seed();
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::string("1M"));  // fits the test's heap
    run_ranks(
        n,
        [&](World& w) {
            Buffers b(w);
            const int me = w.rank();
            constexpr int64_t kPerPeer = 5003;  // bf16
            const int64_t total = kPerPeer * n;
            uint8_t* out_equal = b.out;
            uint8_t* out_direct = b.scratch;
            std::vector<int64_t> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
            int64_t s_total = 0, r_total = 0;
            for (int q = 0; q < n; ++q) {
                send[static_cast<size_t>(q)] = uneven_count(seed, 99, me, q);
                recv[static_cast<size_t>(q)] = uneven_count(seed, 99, q, me);
                s_total += send[static_cast<size_t>(q)];
                r_total += recv[static_cast<size_t>(q)];
            }
            uint8_t* v_in = b.local_in + total * 2;
            uint8_t* v_out = b.out + total * 2;
            cudaGraph_t graph = nullptr;
            WEFT_CUDA_CHECK(cudaStreamBeginCapture(b.stream, cudaStreamCaptureModeThreadLocal));
            ops::all_to_all(w, TensorView(b.local_in, DType::kBF16, {total}),
                            TensorView(out_equal, DType::kBF16, {total}), b.stream);
            ops::all_to_all(w, TensorView(b.sym_in, DType::kBF16, {total}),
                            TensorView(out_direct, DType::kBF16, {total}), b.stream);
            ops::all_to_all_v(w, TensorView(v_in, DType::kBF16, {s_total}), send,
                              TensorView(v_out, DType::kBF16, {r_total}), recv, b.stream);
            WEFT_CUDA_CHECK(cudaStreamEndCapture(b.stream, &graph));
            cudaGraphExec_t exec = nullptr;
            WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            WEFT_CUDA_CHECK(cudaGraphUpload(exec, b.stream));
            w.sync_and_check(b.stream);
            w.barrier();
            std::vector<std::string> failures;
            for (int replay = 0; replay < 3; ++replay) {
                const uint64_t tag = 1000 + static_cast<uint64_t>(replay);
                std::vector<uint8_t> eq, vin;
                for (int q = 0; q < n; ++q) {
                    for (uint64_t i = 0; i < kPerPeer * 2; ++i) eq.push_back(chunk_byte(seed, tag, me, q, i));
                }
                for (int q = 0; q < n; ++q) {
                    for (uint64_t i = 0; i < static_cast<uint64_t>(send[static_cast<size_t>(q)]) * 2; ++i) {
                        vin.push_back(chunk_byte(seed, tag + 100, me, q, i));
                    }
                }
                upload(b.stream, b.local_in, eq);
                upload(b.stream, b.sym_in, eq);
                upload(b.stream, v_in, vin);
                WEFT_CUDA_CHECK(cudaMemsetAsync(b.out, 0xFF, kCapacity, b.stream));
                WEFT_CUDA_CHECK(cudaMemsetAsync(b.scratch, 0xFF, static_cast<size_t>(total * 2), b.stream));
                w.sync_and_check(b.stream);
                w.barrier();  // every rank's inputs are in place before any rank's graph reads them
                WEFT_CUDA_CHECK(cudaGraphLaunch(exec, b.stream));
                w.sync_and_check(b.stream);
                for (const uint8_t* o : {out_equal, out_direct}) {
                    const std::vector<uint8_t> got = download(b.stream, o, static_cast<uint64_t>(total) * 2);
                    for (int q = 0; q < n; ++q) {
                        for (uint64_t i = 0; i < kPerPeer * 2; ++i) {
                            if (got[static_cast<uint64_t>(q) * kPerPeer * 2 + i] != chunk_byte(seed, tag, q, me, i)) {
                                failures.push_back("replay " + std::to_string(replay) + " equal: byte " +
                                                   std::to_string(i) + " from rank " + std::to_string(q));
                                break;
                            }
                        }
                    }
                }
                const std::vector<uint8_t> got = download(b.stream, v_out, static_cast<uint64_t>(r_total) * 2);
                uint64_t at = 0;
                for (int q = 0; q < n; ++q) {
                    for (uint64_t i = 0; i < static_cast<uint64_t>(recv[static_cast<size_t>(q)]) * 2; ++i, ++at) {
                        if (got[at] != chunk_byte(seed, tag + 100, q, me, i)) {
                            failures.push_back("replay " + std::to_string(replay) + " uneven: byte " +
                                               std::to_string(i) + " from rank " + std::to_string(q));
                            break;
                        }
                    }
                }
                w.barrier();  // nobody overwrites inputs a peer's replay may still read
            }
            for (const std::string& f : failures) ADD_FAILURE() << "rank " << me << " of " << n << ": " << f;
            WEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
            WEFT_CUDA_CHECK(cudaGraphDestroy(graph));
            b.release();
        },
        test_options(64ull << 20));
}

// [S/W, H, D] -> [S, H/W, D] against the reference layout, then back to the original.
TEST_P(AllToAll, UlyssesReshardRoundTrip) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device visible";
    const int n = GetParam();
    const uint64_t seed = fresh_seed();
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::string("1M"));
    run_ranks(
        n,
        [&](World& w) {
            Buffers b(w);
            const int me = w.rank();
            const int64_t s_local = 37, h = 4 * n, d = 64;  // f32 elements
            const int64_t elems = s_local * h * d;
            // Value of (rank r's local token t, head hh, dim e): unique per position.
            const auto value = [&](int r, int64_t t, int64_t hh, int64_t e) {
                return static_cast<float>(((r * s_local + t) * h + hh) * d + e) + static_cast<float>(seed % 7);
            };
            std::vector<float> in(static_cast<size_t>(elems));
            for (int64_t t = 0; t < s_local; ++t)
                for (int64_t hh = 0; hh < h; ++hh)
                    for (int64_t e = 0; e < d; ++e) in[static_cast<size_t>((t * h + hh) * d + e)] = value(me, t, hh, e);
            std::vector<uint8_t> bytes(in.size() * 4);
            std::memcpy(bytes.data(), in.data(), bytes.size());
            upload(b.stream, b.local_in, bytes);
            float* head_sharded = reinterpret_cast<float*>(b.out);
            float* back = reinterpret_cast<float*>(b.sym_in);  // any device memory works as the output
            const TensorView seq_view(b.local_in, DType::kF32, {s_local, h, d});
            const TensorView head_view(head_sharded, DType::kF32, {s_local * n, h / n, d});
            const TensorView scratch(b.scratch, DType::kF32, {elems});
            WEFT_CUDA_CHECK(cudaMemsetAsync(head_sharded, 0xFF, static_cast<size_t>(elems) * 4, b.stream));  // NaN
            ops::ulysses_seq_to_head(w, seq_view, head_view, scratch, b.stream);
            w.sync_and_check(b.stream);
            const std::vector<uint8_t> got = download(b.stream, head_sharded, static_cast<uint64_t>(elems) * 4);
            std::vector<std::string> failures;
            for (int64_t tg = 0; tg < s_local * n && failures.empty(); ++tg) {
                for (int64_t hl = 0; hl < h / n && failures.empty(); ++hl) {
                    for (int64_t e = 0; e < d; ++e) {
                        float v = 0;
                        std::memcpy(&v, got.data() + ((tg * (h / n) + hl) * d + e) * 4, 4);
                        const float want = value(static_cast<int>(tg / s_local), tg % s_local, me * (h / n) + hl, e);
                        if (v != want) {
                            failures.push_back("seq_to_head: token " + std::to_string(tg) + " head " +
                                               std::to_string(hl) + " dim " + std::to_string(e));
                            break;
                        }
                    }
                }
            }
            WEFT_CUDA_CHECK(cudaMemsetAsync(back, 0xFF, static_cast<size_t>(elems) * 4, b.stream));
            ops::ulysses_head_to_seq(w, head_view, TensorView(back, DType::kF32, {s_local, h, d}), scratch, b.stream);
            w.sync_and_check(b.stream);
            if (download(b.stream, back, static_cast<uint64_t>(elems) * 4) != bytes) {
                failures.push_back("head_to_seq did not restore the sequence-sharded input");
            }
            for (const std::string& f : failures) ADD_FAILURE() << "rank " << me << " of " << n << ": " << f;
            b.release();
        },
        test_options(64ull << 20));
}

INSTANTIATE_TEST_SUITE_P(Worlds, AllToAll, ::testing::Values(1, 2, 3, 4, 5, 7, 8),
                         [](const ::testing::TestParamInfo<int>& i) { return "world" + std::to_string(i.param); });

// Bad arguments are errors on every rank before any launch.
TEST(AllToAllErrors, BadArgumentsThrow) {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device visible";
    const testing::ScopedEnv staging("WEFT_COLLECTIVE_STAGING_BYTES", std::string("1M"));
    run_ranks(
        2,
        [&](World& w) {
            Buffers b(w);
            const TensorView in(b.local_in, DType::kF32, {10});
            EXPECT_THROW(ops::all_to_all(w, in, TensorView(b.out, DType::kF32, {8}), b.stream), Error);  // sizes differ
            const std::vector<int64_t> one = {3};
            EXPECT_THROW(ops::all_to_all_v(w, in, one, TensorView(b.out, DType::kF32, {3}), one, b.stream), Error);
            EXPECT_THROW(ops::all_to_all(w, TensorView(b.local_in, DType::kF32, {7}),
                                         TensorView(b.out, DType::kF32, {7}), b.stream),
                         Error);
            b.release();
        },
        test_options(64ull << 20));
}

}  // namespace
}  // namespace weft::test
