// SPDX-License-Identifier: MIT
// GPU tests that a fused TP op (AllGather+GEMM, GEMM+ReduceScatter, GEMM+AllReduce, the TP MoE layers) whose peer
// never calls ends in a weft::Error naming that peer's wait, within the bound, not a hang and not a trap: the CUDA
// context stays usable, the op refuses its next call once the abort was cleared, and a new op on the same World
// computes again.
//
// Two ranks (threads) of one process: rank 0 calls once; rank 1 makes the op (construction is collective) but never
// calls it, and waits until the abort of rank 0's failed wait reaches its World. Both then clear the diagnostics
// (after every rank saw the abort) before anything else meets.
#include <gtest/gtest.h>

#include <unistd.h>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "support/runtime_checks.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/ops/moe_tp.hpp"
#include "weft/weft.hpp"

namespace weft::test {
namespace {

enum class Op { kAgGemm, kGemmRs, kGemmAr, kMoeAgGroupedGemm, kMoeGroupedGemmRs };

constexpr int64_t kRows = 128, kN = 256, kK = 128;  // per rank (AgGemm, GemmRs: M = 2 x kRows)

/// Whether the `bytes` bytes at device address `p` are all zero (a poisoned output every element of which was written
/// as zero).
bool all_zero(const void* p, size_t bytes, cudaStream_t s) {
    std::vector<unsigned char> host(bytes);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(host.data(), p, bytes, cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    for (unsigned char v : host) {
        if (v != 0) return false;
    }
    return true;
}

/// Device allocations of one scenario (operands, routing), each filled with a byte value, freed together.
struct DeviceAllocations {
    std::vector<void*> ptrs;
    void* alloc(size_t bytes, int fill, cudaStream_t s) {
        void* p = nullptr;
        WEFT_CUDA_CHECK(cudaMalloc(&p, bytes));
        ptrs.push_back(p);
        WEFT_CUDA_CHECK(cudaMemsetAsync(p, fill, bytes, s));
        return p;
    }
    ~DeviceAllocations() {
        for (void* p : ptrs) cudaFree(p);
    }
};

/// One op of kind `op` on `w` and a function that runs one call of it on zeroed inputs.
struct Scenario {
    std::function<void(cudaStream_t)> call;
    std::function<bool(cudaStream_t)> output_all_zero;
    std::shared_ptr<void> keep;  // the op and its buffers
};

Scenario make(World& w, Op op, cudaStream_t s) {
    const DType dt = DType::kBF16;
    const int64_t m = 2 * kRows;
    Scenario sc;
    if (op == Op::kMoeGroupedGemmRs) {
        // Layer 1 on a routing of its own (moe_route): every token's two slots to experts (2i, 2i + 1) % 4; zero
        // activations and weights, so every element of out is zero once written.
        constexpr int64_t kE = 4, kTopk = 2, kFfn = 64;
        const ops::MoeTpShape shape{.max_tokens = m, .hidden = kK, .ffn = kFfn, .num_experts = kE, .topk = kTopk};
        auto down = std::make_shared<ops::MoeGroupedGemmRs>(w, shape);
        const int64_t rows = down->rows_capacity();
        auto mem = std::make_shared<DeviceAllocations>();
        auto* words =
            static_cast<int32_t*>(mem->alloc(static_cast<size_t>((kE + kE + 1 + rows + m * kTopk) * 4), 0, s));
        void* idx = mem->alloc(static_cast<size_t>(m * kTopk * 4), 0, s);
        void* h = mem->alloc(static_cast<size_t>(rows * kFfn * 2), 0, s);
        void* wt = mem->alloc(static_cast<size_t>(kE * kK * kFfn * 2), 0, s);
        void* weights = mem->alloc(static_cast<size_t>(m * kTopk * 4), 0, s);
        const size_t out_bytes = static_cast<size_t>(kRows * kK * 2);
        void* out = mem->alloc(out_bytes, 0xff, s);
        std::vector<int32_t> ids(static_cast<size_t>(m * kTopk));
        for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % kE);
        WEFT_CUDA_CHECK(cudaMemcpyAsync(idx, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, s));
        ops::MoeRouting routing;
        routing.counts = words;
        routing.offsets = routing.counts + kE;
        routing.gather_index = routing.offsets + kE + 1;
        routing.slot_rows = routing.gather_index + rows;
        routing.num_experts = kE;
        routing.rows_capacity = rows;
        ops::moe_route(TensorView(idx, DType::kI32, {m, kTopk}), routing, 1, s);
        WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
        sc.call = [down, mem, routing, h, wt, weights, out, rows, m](cudaStream_t st) {
            down->run(TensorView(h, DType::kBF16, {rows, kFfn}), TensorView(wt, DType::kBF16, {kE, kK, kFfn}), routing,
                      TensorView(weights, DType::kF32, {m, kTopk}), TensorView(out, DType::kBF16, {kRows, kK}), st);
        };
        sc.output_all_zero = [out, out_bytes](cudaStream_t st) { return all_zero(out, out_bytes, st); };
        sc.keep = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(down, mem);
        return sc;
    }
    if (op == Op::kMoeAgGroupedGemm) {
        const ops::MoeTpShape shape{.max_tokens = m, .hidden = kK, .ffn = 64, .num_experts = 4, .topk = 2};
        auto up = std::make_shared<ops::MoeAgGroupedGemm>(w, shape);
        const int64_t cap = up->rows_capacity();
        auto mem = std::make_shared<DeviceAllocations>();
        void* x = mem->alloc(static_cast<size_t>(kRows * kK * 2), 0, s);
        void* idx = mem->alloc(static_cast<size_t>(m * 2 * 4), 0, s);
        void* wt = mem->alloc(static_cast<size_t>(4 * 64 * kK * 2), 0, s);
        void* y = mem->alloc(static_cast<size_t>(cap * 64 * 2), 0xff, s);
        std::vector<int32_t> ids(static_cast<size_t>(m * 2));
        for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % 4);  // experts 0, 1 / 2, 3
        WEFT_CUDA_CHECK(cudaMemcpyAsync(idx, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, s));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
        sc.call = [up, x, idx, wt, y, cap, m](cudaStream_t st) {
            up->run(TensorView(x, DType::kBF16, {kRows, kK}), TensorView(idx, DType::kI32, {m, 2}),
                    TensorView(wt, DType::kBF16, {4, 64, kK}), TensorView(y, DType::kBF16, {cap, 64}), st);
        };
        // The routed rows (offsets[e] .. offsets[e] + counts[e] of each expert) are written; the rest need not be.
        sc.output_all_zero = [up, y](cudaStream_t st) {
            const ops::MoeRouting r = up->routing();
            int32_t counts[4] = {}, offsets[5] = {};
            WEFT_CUDA_CHECK(cudaMemcpyAsync(counts, r.counts, sizeof counts, cudaMemcpyDeviceToHost, st));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(offsets, r.offsets, sizeof offsets, cudaMemcpyDeviceToHost, st));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(st));
            bool written = offsets[4] > 0;  // the routing is not empty (2 slots per token)
            for (int e = 0; e < 4; ++e) {
                const size_t row_bytes = 64 * 2;
                written = written && all_zero(static_cast<char*>(y) + static_cast<size_t>(offsets[e]) * row_bytes,
                                              static_cast<size_t>(counts[e]) * row_bytes, st);
            }
            return written;
        };
        sc.keep = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(up, mem);
        return sc;
    }
    const int64_t a_rows = op == Op::kAgGemm ? kRows : m;
    const int64_t c_rows = op == Op::kGemmRs ? kRows : m;
    auto mem = std::make_shared<DeviceAllocations>();
    const size_t c_bytes = static_cast<size_t>(c_rows * kN * 2);
    void* c_ptr = mem->alloc(c_bytes, 0xff, s);
    const TensorView a(mem->alloc(static_cast<size_t>(a_rows * kK * 2), 0, s), dt, {a_rows, kK}),
        b(mem->alloc(static_cast<size_t>(kN * kK * 2), 0, s), dt, {kN, kK}), c(c_ptr, dt, {c_rows, kN});
    std::shared_ptr<void> held;
    if (op == Op::kAgGemm) {
        auto g = std::make_shared<ops::AgGemm>(w, ops::AgGemmShape{m, kN, kK, dt});
        sc.call = [g, a, b, c](cudaStream_t st) { g->run(a, b, c, st); };
        held = g;
    } else if (op == Op::kGemmRs) {
        auto g = std::make_shared<ops::GemmRs>(w, ops::GemmRsShape{m, kN, kK, dt});
        sc.call = [g, a, b, c](cudaStream_t st) { g->run(a, b, c, st); };
        held = g;
    } else {
        auto g = std::make_shared<ops::GemmAr>(w, ops::GemmArShape{m, kN, kK, dt});
        sc.call = [g, a, b, c](cudaStream_t st) { g->run(a, b, c, st); };
        held = g;
    }
    sc.output_all_zero = [c_ptr, c_bytes](cudaStream_t st) { return all_zero(c_ptr, c_bytes, st); };
    sc.keep = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(held, mem);
    return sc;
}

/// Waits (bounded) until `w` sees an abort: a peer's wait gave up and the watchdog told this rank.
void wait_for_abort(World& w, std::chrono::seconds bound) {
    const auto until = std::chrono::steady_clock::now() + bound;
    while (!w.aborted() && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
}

/// Makes a new op of kind `op` on `w` and runs one call (every rank): whether every element of its output was written.
bool call_new_op(World& w, Op op, cudaStream_t s) {
    Scenario again = make(w, op, s);
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    w.barrier();
    again.call(s);
    w.sync_and_check(s);
    const bool written = again.output_all_zero(s);
    w.barrier();
    return written;
}

void expect_peer_that_never_calls_is_an_error(Op op, const char* name) {
    alarm(240);  // a hang ends the binary with SIGALRM (the test fails) instead of hanging it
    WorldOptions options = test_options(256ull << 20);  // GemmAr's all-reduce half: the collectives' 96 MiB
    // The bound of the failing wait, and of every barrier after it: the ranks reach those up to ~2 s apart (rank 1
    // learns of the abort at its watchdog's beat after rank 0's watchdog published it).
    options.timeout = std::chrono::milliseconds(4000);
    std::mutex mutex;
    std::string message, refusal;
    double seconds = 0;
    bool context_ok = true, second_op_ok = false, rank1_saw_abort = false;
    const auto new_op = [&](World& w, cudaStream_t s) {
        const bool written = call_new_op(w, op, s);
        if (w.rank() == 0) {
            const std::lock_guard<std::mutex> lock(mutex);
            second_op_ok = written;
        }
    };
    run_ranks(
        2,
        [&](World& w) {
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            {
                Scenario sc = make(w, op, s);
                WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
                w.barrier();  // both made the op: rank 0's call must not race rank 1's construction
                if (w.rank() == 0) {
                    const auto start = std::chrono::steady_clock::now();
                    try {
                        sc.call(s);
                        w.sync_and_check(s);
                    } catch (const Error& e) {
                        const std::lock_guard<std::mutex> lock(mutex);
                        message = e.what();
                        seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
                    }
                    // Not a trap: the stream drained and nothing sticky is left in the context.
                    const cudaError_t sync = cudaStreamSynchronize(s);
                    const cudaError_t last = cudaGetLastError();
                    const std::lock_guard<std::mutex> lock(mutex);
                    context_ok = sync == cudaSuccess && last == cudaSuccess;
                } else {
                    wait_for_abort(w, std::chrono::seconds(60));
                    const std::lock_guard<std::mutex> lock(mutex);
                    rank1_saw_abort = w.aborted();
                }
                // Clear once every rank has seen the abort: rank 0 at its failure, rank 1 up to two beats later.
                std::this_thread::sleep_for(std::chrono::milliseconds(w.rank() == 0 ? 3000 : 1500));
                w.clear_diagnostics();
                w.barrier();
                if (w.rank() == 0) {
                    try {
                        sc.call(s);  // refused before any launch: no peer takes part
                    } catch (const Error& e) {
                        const std::lock_guard<std::mutex> lock(mutex);
                        refusal = e.what();
                    }
                }
                w.barrier();
            }
            // A new op on the same World computes: every element of its output written. (GemmAr's all-reduce half runs
            // on the collectives' workspace, which an abort retires with the World: a new World, below.)
            if (op != Op::kGemmAr) new_op(w, s);
            WEFT_CUDA_CHECK(cudaStreamDestroy(s));
        },
        options);
    if (op == Op::kGemmAr) {
        run_ranks(
            2,
            [&](World& w) {
                cudaStream_t s = nullptr;
                WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
                new_op(w, s);
                WEFT_CUDA_CHECK(cudaStreamDestroy(s));
            },
            options);
    }
    alarm(0);
    SCOPED_TRACE(name);
    const bool gave_up = message.find("timed out") != std::string::npos || message.find("gave up") != std::string::npos;
    EXPECT_TRUE(gave_up) << "rank 0's error: " << message;
    // The TP MoE layer 0's GEMM waits on bare words (its producer has no registers for an owner): its diagnostic, when
    // it is the first recorded, names the word (arrived[1]), not the member (kernels/moe_tp/README.md).
    if (op != Op::kMoeAgGroupedGemm) {
        EXPECT_NE(message.find("rank 1"), std::string::npos)
            << "the error names the peer that never called: " << message;
    }
    EXPECT_GE(seconds, 3.0) << message;  // not before the bound (4 s)
    EXPECT_LT(seconds, 60.0) << message;
    EXPECT_TRUE(context_ok) << "the CUDA context stays usable (no trap)";
    EXPECT_TRUE(rank1_saw_abort) << "rank 0's abort reached rank 1";
    EXPECT_NE(refusal.find("this World was aborted after"), std::string::npos)
        << "the op refuses its next call once the abort was cleared: " << refusal;
    EXPECT_TRUE(second_op_ok) << "a new op (GemmAr: on a new World) writes every element";
}

class TpFaults : public ::testing::Test {
protected:
    void SetUp() override {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "needs a GPU";
    }
};

TEST_F(TpFaults, AgGemmWhosePeerNeverCallsFailsNamingItAndTheContextStaysUsable) {
    expect_peer_that_never_calls_is_an_error(Op::kAgGemm, "ag_gemm");
}

TEST_F(TpFaults, GemmRsWhosePeerNeverCallsFailsNamingItAndTheContextStaysUsable) {
    expect_peer_that_never_calls_is_an_error(Op::kGemmRs, "gemm_rs");
}

TEST_F(TpFaults, GemmArWhosePeerNeverCallsFailsNamingItAndTheContextStaysUsable) {
    expect_peer_that_never_calls_is_an_error(Op::kGemmAr, "gemm_ar");
}

TEST_F(TpFaults, MoeLayer0WhosePeerNeverCallsFailsNamingItAndTheContextStaysUsable) {
    expect_peer_that_never_calls_is_an_error(Op::kMoeAgGroupedGemm, "moe_ag_grouped_gemm");
}

TEST_F(TpFaults, MoeLayer1WhosePeerNeverCallsFailsNamingItAndTheContextStaysUsable) {
    expect_peer_that_never_calls_is_an_error(Op::kMoeGroupedGemmRs, "moe_grouped_gemm_rs");
}

}  // namespace
}  // namespace weft::test
