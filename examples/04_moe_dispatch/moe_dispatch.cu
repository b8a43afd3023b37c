// SPDX-License-Identifier: MIT
// Example 04: an MoE layer's communication round trip: dispatch tokens to their experts, compute per expert, combine.
//
//   weft_example_04_moe_dispatch [num_ranks=4] [tokens_per_rank=200] [hidden=1024] [experts=16] [topk=4]
//
// Every rank routes its tokens to k experts (experts spread evenly over the ranks). The normal mode
// delivers each rank's received tokens expert-contiguous (segments padded to 64 rows, the M tile a grouped
// GEMM would use); a toy "expert" scales its rows by (1 + expert / 8); combine returns each token's weighted
// sum over its experts. The low-latency mode does the same with the masked layout, its send and receive
// halves launched apart. No host synchronisation between the steps: the expert kernel reads the counts on
// the device. The results are checked against a double-precision host computation.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "args.hpp"
#include "weft/ops/ep.hpp"
#include "weft/weft.hpp"

namespace {

__host__ __device__ float expert_scale(int expert) { return 1.0f + static_cast<float>(expert) / 8.0f; }

// Normal layout: the rows of local expert e are [offsets[e], offsets[e] + counts[e]) of recv (padding rows
// between segments are skipped). One block per row, grid-stride over the host's row bound.
__global__ void scale_expert_rows(const __nv_bfloat16* recv, __nv_bfloat16* y, const int32_t* counts,
                                  const int32_t* offsets, int local_experts, int first_expert, int hidden,
                                  int64_t max_rows) {
    for (int64_t row = blockIdx.x; row < max_rows; row += gridDim.x) {
        int expert = -1;
        for (int e = 0; e < local_experts; ++e) {
            if (row >= offsets[e] && row < offsets[e] + counts[e]) expert = first_expert + e;
        }
        if (expert < 0) continue;
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
            y[row * hidden + c] = __float2bfloat16(__bfloat162float(recv[row * hidden + c]) * expert_scale(expert));
        }
    }
}

// Masked layout [local experts, rows_per_expert, hidden]: rows [0, counts[e]) of expert e are valid.
__global__ void scale_masked_rows(const __nv_bfloat16* recv, __nv_bfloat16* y, const int32_t* counts, int local_experts,
                                  int first_expert, int64_t rows_per_expert, int hidden) {
    for (int64_t r = blockIdx.x; r < local_experts * rows_per_expert; r += gridDim.x) {
        const int e = static_cast<int>(r / rows_per_expert);
        if (r % rows_per_expert >= counts[e]) continue;
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
            y[r * hidden + c] =
                __float2bfloat16(__bfloat162float(recv[r * hidden + c]) * expert_scale(first_expert + e));
        }
    }
}

float bf16_to_float(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
uint16_t float_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

}  // namespace

int main(int argc, char** argv) {
    // The bounds are ep::Config's limits (low-latency mode included); footprint() checks the rest (multiples, E % W).
    const weft::examples::Args args(argc, argv,
                                    "[num_ranks=4] [tokens_per_rank=200] [hidden=1024] [experts=16] [topk=4]");
    args.at_most(5);
    const int num_ranks = args.positional<int>(1, "num_ranks", 1, weft::ops::ep::kMaxRanks, 4);
    const int tokens = args.positional<int>(2, "tokens_per_rank", 1, weft::ops::ep::kMaxLowLatencyTokens, 200);
    weft::ops::ep::Config cfg;
    cfg.hidden = args.positional<int>(3, "hidden", 8, 1 << 20, 1024);
    cfg.num_experts = args.positional<int>(4, "experts", 1, weft::ops::ep::kMaxExperts, 16);
    cfg.topk = args.positional<int>(5, "topk", 1, weft::ops::ep::kMaxTopk, 4);
    cfg.max_tokens_per_rank = tokens;
    cfg.expert_alignment = 64;
    try {
        const weft::ops::ep::Footprint fp = weft::ops::ep::footprint(cfg, num_ranks);  // validates the config, too
        std::printf("memory per rank: %s\n", fp.describe().c_str());
        weft::WorldOptions options;
        options.heap_bytes = fp.heap_bytes(1) + (64ull << 20);
        weft::run_local(
            num_ranks,
            [&](weft::World& world) {
                const int me = world.rank();
                const int local = cfg.num_experts / num_ranks;
                const int hidden = cfg.hidden;
                const int k = cfg.topk;
                cudaStream_t stream;
                WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

                // This rank's tokens and routing: k distinct experts each, random weights.
                std::mt19937 rng(1234 + me);
                std::vector<uint16_t> x(static_cast<size_t>(tokens) * hidden);
                std::uniform_real_distribution<float> value(-1.0f, 1.0f);
                for (auto& v : x) v = float_to_bf16(value(rng));
                std::vector<int32_t> idx;
                std::vector<float> weights;
                std::vector<int> pool(static_cast<size_t>(cfg.num_experts));
                std::iota(pool.begin(), pool.end(), 0);
                for (int t = 0; t < tokens; ++t) {
                    std::shuffle(pool.begin(), pool.end(), rng);
                    for (int j = 0; j < k; ++j) {
                        idx.push_back(pool[static_cast<size_t>(j)]);
                        weights.push_back(std::uniform_real_distribution<float>(0.0f, 1.0f)(rng));
                    }
                }
                void *dx, *didx, *dw, *dout, *dy;
                WEFT_CUDA_CHECK(cudaMallocAsync(&dx, x.size() * 2, stream));
                WEFT_CUDA_CHECK(cudaMallocAsync(&didx, idx.size() * 4, stream));
                WEFT_CUDA_CHECK(cudaMallocAsync(&dw, weights.size() * 4, stream));
                WEFT_CUDA_CHECK(cudaMallocAsync(&dout, x.size() * 2, stream));
                WEFT_CUDA_CHECK(cudaMemcpyAsync(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice, stream));
                WEFT_CUDA_CHECK(cudaMemcpyAsync(didx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice, stream));
                WEFT_CUDA_CHECK(
                    cudaMemcpyAsync(dw, weights.data(), weights.size() * 4, cudaMemcpyHostToDevice, stream));
                const weft::TensorView xv(dx, weft::DType::kBF16, {tokens, hidden});
                const weft::TensorView iv(didx, weft::DType::kI32, {tokens, k});
                const weft::TensorView wv(dw, weft::DType::kF32, {tokens, k});
                const weft::TensorView ov(dout, weft::DType::kBF16, {tokens, hidden});

                // The expected output: sum_j w_j * bf16(x * scale(e_j)), in double precision.
                const auto check = [&](const char* mode) {
                    std::vector<uint16_t> out(x.size());
                    WEFT_CUDA_CHECK(cudaMemcpyAsync(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost, stream));
                    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
                    double worst = 0;
                    for (int t = 0; t < tokens; ++t) {
                        for (int c = 0; c < hidden; ++c) {
                            double want = 0;
                            for (int j = 0; j < k; ++j) {
                                const int e = idx[static_cast<size_t>(t * k + j)];
                                const float y = bf16_to_float(float_to_bf16(
                                    bf16_to_float(x[static_cast<size_t>(t) * hidden + c]) * expert_scale(e)));
                                want += weights[static_cast<size_t>(t * k + j)] * static_cast<double>(y);
                            }
                            const double got = bf16_to_float(out[static_cast<size_t>(t) * hidden + c]);
                            const double d = std::fabs(got - want) / (std::fabs(want) + 1e-2);
                            worst = std::isfinite(d) ? std::max(worst, d) : INFINITY;  // a NaN (poison) fails
                        }
                    }
                    WEFT_CHECK(worst < 2e-2, "rank " << me << ", " << mode << ": combine differs from the reference by "
                                                     << worst << " (relative)");
                };

                weft::ops::ep::Buffer ep(world, cfg);  // collective

                // ---- normal mode: dispatch, experts, combine ----
                weft::ops::ep::NormalHandle h = ep.make_normal_handle();
                const int64_t max_rows = ep.geometry().max_recv_rows;
                WEFT_CUDA_CHECK(cudaMallocAsync(&dy, static_cast<size_t>(max_rows) * hidden * 2, stream));
                ep.dispatch(h, xv, iv, wv, stream);
                scale_expert_rows<<<256, 128, 0, stream>>>(static_cast<const __nv_bfloat16*>(h.recv_x().data),
                                                           static_cast<__nv_bfloat16*>(dy), h.expert_counts(),
                                                           h.expert_offsets(), local, me * local, hidden, max_rows);
                WEFT_CUDA_CHECK(cudaGetLastError());
                ep.combine(h, weft::TensorView(dy, weft::DType::kBF16, {max_rows, hidden}), ov, stream);
                ep.sync_and_check(stream);
                check("normal");
                WEFT_CUDA_CHECK(cudaFreeAsync(dy, stream));

                // ---- low-latency mode: send half, (other work), receive half, experts, combine ----
                weft::ops::ep::LowLatencyHandle l = ep.make_low_latency_handle();
                const int64_t rows_per_expert = ep.geometry().ll_rows_per_expert();
                WEFT_CUDA_CHECK(
                    cudaMallocAsync(&dy, static_cast<size_t>(local) * rows_per_expert * hidden * 2, stream));
                ep.low_latency_dispatch(l, xv, iv, stream, {.phase = weft::ops::ep::Phase::kSend});
                // ... attention or a shared expert could run here while the rows travel ...
                ep.low_latency_dispatch(l, weft::TensorView(), weft::TensorView(), stream,
                                        {.phase = weft::ops::ep::Phase::kRecv});
                scale_masked_rows<<<256, 128, 0, stream>>>(static_cast<const __nv_bfloat16*>(l.recv_x().data),
                                                           static_cast<__nv_bfloat16*>(dy), l.expert_counts(), local,
                                                           me * local, rows_per_expert, hidden);
                WEFT_CUDA_CHECK(cudaGetLastError());
                WEFT_CUDA_CHECK(cudaMemsetAsync(dout, 0xFF, x.size() * 2, stream));  // poison
                ep.low_latency_combine(l, weft::TensorView(dy, weft::DType::kBF16, {local, rows_per_expert, hidden}),
                                       iv, wv, ov, stream);
                ep.sync_and_check(stream);
                check("low-latency");
                WEFT_CUDA_CHECK(cudaFreeAsync(dy, stream));

                for (void* p : {dx, didx, dw, dout}) WEFT_CUDA_CHECK(cudaFreeAsync(p, stream));
                WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
                world.barrier();
                if (me == 0) {
                    std::printf(
                        "MoE round trip over %d ranks (%d tokens/rank, hidden %d, %d experts, top-%d): normal and "
                        "low-latency verified: ok\n",
                        num_ranks, tokens, hidden, cfg.num_experts, k);
                }
                cudaStreamDestroy(stream);
            },
            options);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    return 0;
}
