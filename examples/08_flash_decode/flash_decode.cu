// SPDX-License-Identifier: MIT
// Example 08: flash-decoding on one GPU with weft::ops::decode_attention: a paged bf16 KV cache in random page
// order, 32 q-heads over 8 KV heads, head_dim 128; a small table of time per call against the time a plain
// streaming-read kernel needs for the same bytes (the roofline of a memory-bound kernel), and one row checked
// against a host reference.
//
//   weft_example_08_flash_decode [batch=1] [page_size=16]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "args.hpp"
#include "weft/ops/attention.hpp"
#include "weft/runtime/error.hpp"

using weft::DType;
using weft::TensorView;

namespace {

constexpr int kQHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kDim = 128;

// Reads `n` 16-byte vectors and keeps one xor so that the loads cannot be dropped.
__global__ void stream_read(const uint4* p, size_t n, unsigned* sink) {
    unsigned x = 0;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const uint4 v = p[i];
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x12345678u) *sink = x;
}

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        p[i] = __float2bfloat16(static_cast<float>(h & 0xffff) / 32768.f - 1.f);
    }
}

template <class F>
float time_ms(F&& f, int iters) {
    cudaEvent_t a, b;
    WEFT_CUDA_CHECK(cudaEventCreate(&a));
    WEFT_CUDA_CHECK(cudaEventCreate(&b));
    f();  // warm-up (and the JIT compile on the first call)
    WEFT_CUDA_CHECK(cudaEventRecord(a));
    for (int i = 0; i < iters; ++i) f();
    WEFT_CUDA_CHECK(cudaEventRecord(b));
    WEFT_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    WEFT_CUDA_CHECK(cudaEventDestroy(a));
    WEFT_CUDA_CHECK(cudaEventDestroy(b));
    return ms / static_cast<float>(iters);
}

float bf16_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

}  // namespace

int main(int argc, char** argv) {
    // Page ids are int32 (batch x 2^19 of them at most); a page beyond the longest sequence (2^19) only wastes memory.
    const weft::examples::Args args(argc, argv, "[batch >= 1] [page_size >= 1]");
    args.at_most(2);
    const int batch = args.positional<int>(1, "batch", 1, 1024, 1);
    const int page = args.positional<int>(2, "page_size", 1, 1 << 19, 16);
    try {
        const std::vector<int> lens = {1024, 8192, 32768, 131072, 524288};
        const int longest = lens.back();
        const int64_t pages_per_seq = (longest + page - 1) / page;
        const int64_t num_pages = batch * pages_per_seq;
        const size_t cache_elems = static_cast<size_t>(num_pages) * page * kKvHeads * kDim;
        __nv_bfloat16 *k = nullptr, *v = nullptr, *q = nullptr, *out = nullptr;
        int32_t *table = nullptr, *seq_lens = nullptr;
        float* lse = nullptr;
        unsigned* sink = nullptr;
        WEFT_CUDA_CHECK(cudaMalloc(&k, cache_elems * 2));
        WEFT_CUDA_CHECK(cudaMalloc(&v, cache_elems * 2));
        WEFT_CUDA_CHECK(cudaMalloc(&q, static_cast<size_t>(batch) * kQHeads * kDim * 2));
        WEFT_CUDA_CHECK(cudaMalloc(&out, static_cast<size_t>(batch) * kQHeads * kDim * 2));
        WEFT_CUDA_CHECK(cudaMalloc(&lse, static_cast<size_t>(batch) * kQHeads * 4));
        WEFT_CUDA_CHECK(cudaMalloc(&table, static_cast<size_t>(num_pages) * 4));
        WEFT_CUDA_CHECK(cudaMalloc(&seq_lens, static_cast<size_t>(batch) * 4));
        WEFT_CUDA_CHECK(cudaMalloc(&sink, 4));
        fill<<<1024, 256>>>(k, cache_elems, 1u);
        fill<<<1024, 256>>>(v, cache_elems, 2u);
        fill<<<64, 256>>>(q, static_cast<size_t>(batch) * kQHeads * kDim, 3u);
        // Pages in random order: the cache is what an allocator leaves after many sequences came and went.
        std::vector<int32_t> order(static_cast<size_t>(num_pages));
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), std::mt19937(7));
        WEFT_CUDA_CHECK(cudaMemcpy(table, order.data(), order.size() * 4, cudaMemcpyHostToDevice));

        // The roofline: a streaming read of the whole K cache.
        int sms = 0;
        WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        const float read_ms = time_ms(
            [&] { stream_read<<<sms * 8, 512>>>(reinterpret_cast<const uint4*>(k), cache_elems / 8, sink); }, 10);
        const double read_tbs = static_cast<double>(cache_elems) * 2 / (read_ms * 1e-3) / 1e12;
        std::printf("decode attention, bf16, %d q-heads / %d KV heads, head_dim %d, batch %d, page %d (random order)\n",
                    kQHeads, kKvHeads, kDim, batch, page);
        std::printf("streaming read of %.2f GB: %.2f TB/s\n\n", static_cast<double>(cache_elems) * 2 / 1e9, read_tbs);
        std::printf("%9s %7s %10s %10s %8s %7s\n", "kv_len", "splits", "us", "roof_us", "TB/s", "%roof");

        const TensorView tq(q, DType::kBF16, {batch, kQHeads, kDim});
        const TensorView tk(k, DType::kBF16, {num_pages, page, kKvHeads, kDim});
        const TensorView tv(v, DType::kBF16, {num_pages, page, kKvHeads, kDim});
        const TensorView tout(out, DType::kBF16, {batch, kQHeads, kDim});
        const TensorView tlse(lse, DType::kF32, {batch, kQHeads});
        for (int len : lens) {
            std::vector<int32_t> l(static_cast<size_t>(batch), len);
            WEFT_CUDA_CHECK(cudaMemcpy(seq_lens, l.data(), l.size() * 4, cudaMemcpyHostToDevice));
            const TensorView ttable(table, DType::kI32, {batch, pages_per_seq});
            const TensorView tlens(seq_lens, DType::kI32, {batch});
            const float ms =
                time_ms([&] { weft::ops::decode_attention(tq, tk, tv, ttable, tlens, len, tout, tlse, nullptr); }, 20);
            const double bytes = 2.0 * batch * len * kKvHeads * kDim * 2;
            const double tbs = bytes / (ms * 1e-3) / 1e12;
            const int splits = weft::ops::decode_attention_split_plan(batch, kQHeads, kKvHeads, kDim, len).num_splits;
            std::printf("%9d %7d %10.2f %10.2f %8.3f %6.1f%%\n", len, splits, ms * 1e3, bytes / (read_tbs * 1e12) * 1e6,
                        tbs, 100.0 * tbs / read_tbs);
        }

        // Check q-head 5 of sequence 0 (the last length) against a host reference, on a fresh call's output
        // poisoned first (NaN), so that a row the call leaves unwritten fails.
        const int h = 5, kvh = h / (kQHeads / kKvHeads);
        const int len = lens.back();
        WEFT_CUDA_CHECK(cudaMemset(out, 0xFF, static_cast<size_t>(batch) * kQHeads * kDim * 2));
        WEFT_CUDA_CHECK(cudaMemset(lse, 0xFF, static_cast<size_t>(batch) * kQHeads * 4));
        weft::ops::decode_attention(tq, tk, tv, TensorView(table, DType::kI32, {batch, pages_per_seq}),
                                    TensorView(seq_lens, DType::kI32, {batch}), len, tout, tlse, nullptr);
        WEFT_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<__nv_bfloat16> hq(kDim), hout(kDim), row(kDim);
        std::vector<double> acc(kDim, 0.0);
        float got_lse = 0;
        WEFT_CUDA_CHECK(cudaMemcpy(hq.data(), q + h * kDim, kDim * 2, cudaMemcpyDeviceToHost));
        WEFT_CUDA_CHECK(cudaMemcpy(hout.data(), out + h * kDim, kDim * 2, cudaMemcpyDeviceToHost));
        WEFT_CUDA_CHECK(cudaMemcpy(&got_lse, lse + h, 4, cudaMemcpyDeviceToHost));
        std::vector<__nv_bfloat16> hk(cache_elems), hv(cache_elems);
        WEFT_CUDA_CHECK(cudaMemcpy(hk.data(), k, cache_elems * 2, cudaMemcpyDeviceToHost));
        WEFT_CUDA_CHECK(cudaMemcpy(hv.data(), v, cache_elems * 2, cudaMemcpyDeviceToHost));
        std::vector<double> s(static_cast<size_t>(len));
        double m = -INFINITY;
        auto at = [&](int t) {
            return (static_cast<size_t>(order[static_cast<size_t>(t / page)]) * page + t % page) * kKvHeads * kDim +
                   static_cast<size_t>(kvh) * kDim;
        };
        for (int t = 0; t < len; ++t) {
            double dot = 0;
            for (int e = 0; e < kDim; ++e)
                dot += bf16_to_float(hq[e]) * static_cast<double>(bf16_to_float(hk[at(t) + e]));
            s[static_cast<size_t>(t)] = dot / std::sqrt(static_cast<double>(kDim));
            m = std::max(m, s[static_cast<size_t>(t)]);
        }
        double sum = 0;
        for (int t = 0; t < len; ++t) {
            const double p = std::exp(s[static_cast<size_t>(t)] - m);
            sum += p;
            for (int e = 0; e < kDim; ++e) acc[static_cast<size_t>(e)] += p * bf16_to_float(hv[at(t) + e]);
        }
        double worst = 0;
        for (int e = 0; e < kDim; ++e) {
            const double d = std::fabs(acc[static_cast<size_t>(e)] / sum - bf16_to_float(hout[e]));
            worst = std::isfinite(d) ? std::max(worst, d) : INFINITY;  // a NaN fails
        }
        const double lse_err = std::fabs(got_lse - (m + std::log(sum)));
        std::printf("\ncheck (sequence 0, q-head %d, %d tokens): max |out - ref| = %.2e, |lse - ref| = %.2e\n", h, len,
                    worst, lse_err);
        const bool ok = worst < 5e-3 && lse_err < 2e-3;
        for (void* p : {static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(q), static_cast<void*>(out),
                        static_cast<void*>(lse), static_cast<void*>(table), static_cast<void*>(seq_lens),
                        static_cast<void*>(sink)}) {
            WEFT_CUDA_CHECK(cudaFree(p));
        }
        if (!ok) {
            std::fprintf(stderr, "check FAILED\n");
            return 1;
        }
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}
