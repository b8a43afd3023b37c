// SPDX-License-Identifier: MIT
// Example 07: a whole MoE layer over expert parallelism, as one op (weft::ops::ep::MoeBlock) and as weft's separate
// ops.
//
//   weft_example_07_moe_layer [num_ranks=4] [tokens_per_rank=256] [hidden=2048] [experts=32] [topk=4] [ffn=1024]
//
// Each rank holds E / W experts, each a SwiGLU MLP: gate_up [2F, H] (gate rows, then up rows) and down [H, F]. The
// block dispatches every token to its k experts, runs the up-projection as one grouped GEMM over the rank's experts,
// applies silu(gate) * up, runs the down-projection, and combines each token's k outputs weighted by its router
// weights. Fused, the up-projection starts each expert's tiles as soon as that expert's rows have arrived and the
// combine sends a token back as soon as the tiles of its rows are stored. The same layer is then composed from the
// separate ops by hand (ep::Buffer::dispatch, grouped_gemm_contiguous, a SwiGLU kernel, grouped_gemm_contiguous,
// ep::Buffer::combine) and the outputs compared; last, a table of the time per call, fused against the separate ops.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <vector>

#include "args.hpp"
#include "weft/ops/ep_moe.hpp"
#include "weft/ops/grouped_gemm.hpp"
#include "weft/weft.hpp"

namespace {

// out[r][j] = silu(gate_up[r][j]) * gate_up[r][F + j] for the rows before offsets[local_experts] (the expert
// segments, padding included: the count comes from the device, as the dispatch left it).
__global__ void swiglu_rows(const __nv_bfloat16* gate_up, __nv_bfloat16* out, const int32_t* rows_end, int ffn) {
    const int64_t rows = *rows_end;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        for (int j = threadIdx.x; j < ffn; j += blockDim.x) {
            const float g = __bfloat162float(gate_up[r * 2 * ffn + j]);
            const float u = __bfloat162float(gate_up[r * 2 * ffn + ffn + j]);
            out[r * ffn + j] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
        }
    }
}

uint16_t float_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}
float bf16_to_float(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

struct Timing {
    std::mutex mutex;
    double fused_us = 0, separate_us = 0, worst_diff = 0;
};

}  // namespace

int main(int argc, char** argv) {
    namespace ep = weft::ops::ep;
    // The bounds are ep::Config's limits (normal mode) and hidden's for ffn; footprint() and MoeBlock check the rest.
    const weft::examples::Args args(
        argc, argv, "[num_ranks=4] [tokens_per_rank=256] [hidden=2048] [experts=32] [topk=4] [ffn=1024]");
    args.at_most(6);
    const int num_ranks = args.positional<int>(1, "num_ranks", 1, ep::kMaxRanks, 4);
    const int tokens = args.positional<int>(2, "tokens_per_rank", 1, 1 << 24, 256);
    ep::MoeConfig cfg;
    cfg.ep.hidden = args.positional<int>(3, "hidden", 8, 1 << 20, 2048);
    cfg.ep.num_experts = args.positional<int>(4, "experts", 1, ep::kMaxExperts, 32);
    cfg.ep.topk = args.positional<int>(5, "topk", 1, ep::kMaxTopk, 4);
    cfg.ffn = args.positional<int>(6, "ffn", 8, 1 << 20, 1024);
    cfg.ep.max_tokens_per_rank = tokens;
    cfg.ep.low_latency = false;
    Timing timing;
    try {
        const ep::Footprint fp = ep::footprint(cfg.ep, num_ranks);  // validates the EP part of the config
        weft::WorldOptions options;
        options.heap_bytes = 2 * fp.heap_bytes(1) + (64ull << 20);  // the block's buffer and the hand-made one
        weft::run_local(
            num_ranks,
            [&](weft::World& world) {
                const int me = world.rank();
                const int local = cfg.ep.num_experts / num_ranks;
                const int64_t h = cfg.ep.hidden, f = cfg.ffn, k = cfg.ep.topk;
                cudaStream_t stream;
                WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

                // This rank's tokens, routing (k distinct experts each) and experts' weights.
                std::mt19937 rng(1234 + me);
                std::uniform_real_distribution<float> value(-1.0f, 1.0f);
                std::vector<uint16_t> x(static_cast<size_t>(tokens * h));
                for (auto& v : x) v = float_to_bf16(value(rng));
                std::vector<uint16_t> gate_up(static_cast<size_t>(local * 2 * f * h)),
                    down(static_cast<size_t>(local * h * f));
                for (auto& v : gate_up) v = float_to_bf16(value(rng) / 16.0f);
                for (auto& v : down) v = float_to_bf16(value(rng) / 16.0f);
                std::vector<int32_t> idx;
                std::vector<float> weights;
                std::vector<int> pool(static_cast<size_t>(cfg.ep.num_experts));
                std::iota(pool.begin(), pool.end(), 0);
                for (int t = 0; t < tokens; ++t) {
                    std::shuffle(pool.begin(), pool.end(), rng);
                    for (int j = 0; j < k; ++j) {
                        idx.push_back(pool[static_cast<size_t>(j)]);
                        weights.push_back(std::uniform_real_distribution<float>(0.0f, 1.0f)(rng));
                    }
                }
                const auto upload = [&](const void* src, size_t bytes) {
                    void* d = nullptr;
                    WEFT_CUDA_CHECK(cudaMallocAsync(&d, bytes, stream));
                    if (src != nullptr) WEFT_CUDA_CHECK(cudaMemcpyAsync(d, src, bytes, cudaMemcpyHostToDevice, stream));
                    return d;
                };
                void* dx = upload(x.data(), x.size() * 2);
                void* didx = upload(idx.data(), idx.size() * 4);
                void* dw = upload(weights.data(), weights.size() * 4);
                void* dgu = upload(gate_up.data(), gate_up.size() * 2);
                void* ddown = upload(down.data(), down.size() * 2);
                void* dout = upload(nullptr, x.size() * 2);
                void* dref = upload(nullptr, x.size() * 2);
                const weft::TensorView xv(dx, weft::DType::kBF16, {tokens, h});
                const weft::TensorView iv(didx, weft::DType::kI32, {tokens, k});
                const weft::TensorView wv(dw, weft::DType::kF32, {tokens, k});
                const ep::MoeWeights mw{weft::TensorView(dgu, weft::DType::kBF16, {local, 2 * f, h}),
                                        weft::TensorView(ddown, weft::DType::kBF16, {local, h, f})};
                const weft::TensorView ov(dout, weft::DType::kBF16, {tokens, h});
                const weft::TensorView rv(dref, weft::DType::kBF16, {tokens, h});

                // Outputs poisoned (NaN): a token either path leaves unwritten fails the checks below.
                WEFT_CUDA_CHECK(cudaMemsetAsync(dout, 0xFF, x.size() * 2, stream));
                WEFT_CUDA_CHECK(cudaMemsetAsync(dref, 0xFF, x.size() * 2, stream));

                // ---- the block: one call ----
                ep::MoeBlock moe(world, cfg);  // collective
                moe.forward(xv, iv, wv, mw, ov, stream);
                moe.sync_and_check(stream);

                // ---- the same layer from the separate ops ----
                ep::Buffer buffer(world, cfg.ep);  // collective
                ep::NormalHandle hd = buffer.make_normal_handle();
                const int64_t rows = buffer.geometry().max_recv_rows;
                void* dgu_out = upload(nullptr, static_cast<size_t>(rows * 2 * f * 2));
                void* dact = upload(nullptr, static_cast<size_t>(rows * f * 2));
                void* dy = upload(nullptr, static_cast<size_t>(rows * h * 2));
                const weft::TensorView gu_out(dgu_out, weft::DType::kBF16, {rows, 2 * f});
                const weft::TensorView act(dact, weft::DType::kBF16, {rows, f});
                const weft::TensorView y(dy, weft::DType::kBF16, {rows, h});
                // Every kernel loaded before any rank's dispatch can spin (ranks may share a GPU): the GEMMs and the
                // SwiGLU run once on the fresh handle's zero counts, which compute nothing.
                const auto experts = [&] {
                    weft::ops::grouped_gemm_contiguous(hd.recv_x(), mw.gate_up, gu_out, weft::BLayout::kNK,
                                                       hd.expert_offsets(), hd.expert_counts(), stream);
                    swiglu_rows<<<512, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(dgu_out),
                                                         static_cast<__nv_bfloat16*>(dact), hd.expert_offsets() + local,
                                                         static_cast<int>(f));
                    WEFT_CUDA_CHECK(cudaGetLastError());
                    weft::ops::grouped_gemm_contiguous(act, mw.down, y, weft::BLayout::kNK, hd.expert_offsets(),
                                                       hd.expert_counts(), stream);
                };
                experts();
                WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
                world.barrier();
                buffer.dispatch(hd, xv, iv, wv, stream);
                experts();
                buffer.combine(hd, y, rv, stream);
                buffer.sync_and_check(stream);

                std::vector<uint16_t> out(x.size()), ref(x.size());
                WEFT_CUDA_CHECK(cudaMemcpyAsync(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost, stream));
                WEFT_CUDA_CHECK(cudaMemcpyAsync(ref.data(), dref, ref.size() * 2, cudaMemcpyDeviceToHost, stream));
                WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
                // Relative to the row's scale: the two differ only in the GEMMs' tile shapes and the SwiGLU's exp.
                double worst = 0;
                for (int t = 0; t < tokens; ++t) {
                    double scale = 1e-3;
                    for (int c = 0; c < h; ++c)
                        scale = std::max(scale, std::fabs(double{bf16_to_float(ref[t * h + c])}));
                    for (int c = 0; c < h; ++c) {
                        const double d =
                            std::fabs(double{bf16_to_float(out[t * h + c])} - bf16_to_float(ref[t * h + c]));
                        worst = std::max(worst, std::isfinite(d) ? d / scale : 1e30);
                    }
                }
                WEFT_CHECK(worst < 2e-2, "rank " << me << ": the block differs from the separate ops by " << worst
                                                 << " of the row's largest value");
                // The block's unfused form (MoeOptions::fused = false) gives the same bits as the fused one.
                WEFT_CUDA_CHECK(cudaMemsetAsync(dout, 0xFF, x.size() * 2, stream));
                moe.forward(xv, iv, wv, mw, ov, stream, ep::MoeOptions{.fused = false});
                moe.sync_and_check(stream);
                std::vector<uint16_t> unfused(x.size());
                WEFT_CUDA_CHECK(
                    cudaMemcpyAsync(unfused.data(), dout, unfused.size() * 2, cudaMemcpyDeviceToHost, stream));
                WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
                WEFT_CHECK(unfused == out, "rank " << me << ": the block's unfused form differs from its fused one");

                // ---- time per call: fused against the separate ops (MoeOptions::fused = false) ----
                constexpr int kIters = 20;
                double us[2] = {0, 0};
                cudaEvent_t start, stop;
                WEFT_CUDA_CHECK(cudaEventCreate(&start));
                WEFT_CUDA_CHECK(cudaEventCreate(&stop));
                for (int form = 0; form < 2; ++form) {
                    const ep::MoeOptions mo{.fused = form == 0};
                    for (int i = 0; i < 3; ++i) moe.forward(xv, iv, wv, mw, ov, stream, mo);  // warm-up
                    moe.sync_and_check(stream);
                    world.barrier();
                    WEFT_CUDA_CHECK(cudaEventRecord(start, stream));
                    for (int i = 0; i < kIters; ++i) moe.forward(xv, iv, wv, mw, ov, stream, mo);
                    WEFT_CUDA_CHECK(cudaEventRecord(stop, stream));
                    moe.sync_and_check(stream);
                    float ms = 0;
                    WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
                    us[form] = 1e3 * ms / kIters;
                }
                {
                    std::lock_guard<std::mutex> lock(timing.mutex);
                    timing.fused_us = std::max(timing.fused_us, us[0]);
                    timing.separate_us = std::max(timing.separate_us, us[1]);
                    timing.worst_diff = std::max(timing.worst_diff, worst);
                }
                cudaEventDestroy(start);
                cudaEventDestroy(stop);
                for (void* p : {dx, didx, dw, dgu, ddown, dout, dref, dgu_out, dact, dy}) {
                    WEFT_CUDA_CHECK(cudaFreeAsync(p, stream));
                }
                WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
                world.barrier();
                cudaStreamDestroy(stream);
            },
            options);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    std::printf("MoE block over %d ranks: %d tokens/rank, hidden %d, %d experts, top-%d, ffn %d\n", num_ranks, tokens,
                cfg.ep.hidden, cfg.ep.num_experts, cfg.ep.topk, cfg.ffn);
    std::printf("block vs separate ops: largest difference %.2e of a row's scale: ok\n", timing.worst_diff);
    std::printf("%-28s %12s\n", "form", "us per call");
    std::printf("%-28s %12.1f\n", "fused (MoeBlock)", timing.fused_us);
    std::printf("%-28s %12.1f\n", "separate ops, one by one", timing.separate_us);
    std::printf("%-28s %11.2fx\n", "speedup", timing.separate_us / timing.fused_us);
    return 0;
}
