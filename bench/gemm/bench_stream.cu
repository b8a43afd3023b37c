// SPDX-License-Identifier: MIT
// weft_bench_stream: how fast one GPU streams a bf16 matrix B [N,K] from DRAM into shared memory, by copy
// mechanism and access pattern: the ceilings behind the small-M (decode) GEMM, whose time is B's bytes over
// this rate. Each row: the median time of --iters launches (CUDA events) and the rate in TB/s, beside the read
// bandwidth of plain streaming loads measured at start-up (the header line).
//
//   weft_bench_stream [--sizes NxK,...] [--iters N] [--warmup N] [--json FILE]   (N a multiple of 64, K of 256)
//
// Every ring pattern runs one CTA of 256 threads per 64 rows of B (N = 8192: 128 CTAs, one per SM, as the
// decode GEMM), a ring of 4 stages of 32 KiB on one mbarrier each, the CTA's rows taken k block by k block:
//   ldg              grid-stride 16-byte loads over the whole buffer (8 CTAs of 512 threads per SM)
//   tma-rows         one 2D TMA box of 64 rows x 256 k per stage (small-M variant 3's B stage), refilled as
//                    soon as it lands; "+read": every thread reads the stage and a barrier precedes the refill
//   tma-3d C x R     3D TMA boxes over B viewed as [N, K / 256, 256]: R rows x C 512-byte chunks (C x 512
//                    contiguous bytes per row) per stage; "+read" as above
//   tma-contig       2D TMA boxes over B viewed as [N K / 256, 256]: 32 contiguous KiB per box
//   launch floor     the bulk ring kernel with no steps (barrier setup only): what any launch costs between events
//                    (its "TB/s" is B's bytes over that time, not a rate)
//   bulk-contig      one 1D bulk copy of 32 contiguous KiB per stage (a CTA's 64 rows are one range); "+read":
//                    every thread reads the stage and a barrier precedes the refill
//   bulk-rows R      R 1D bulk copies per stage, R rows x 32 KiB / R bytes, issued by thread 0 or by lane 0 of
//                    8 warps; "pad 16": rows 16 bytes apart in shared memory (not 128-byte aligned)
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/cli.hpp"
#include "common/json.hpp"
#include "common/peaks.hpp"
#include "common/timing.hpp"
#include "weft/ptx/mbarrier.cuh"
#include "weft/ptx/tma.cuh"
#include "weft/runtime/driver.hpp"

namespace {

using weft::ptx::TmaDescriptor;

constexpr int kThreads = 256;
constexpr int kStages = 4;
constexpr int kStageBytes = 32 * 1024;
constexpr int kRowsPerCta = 64;
constexpr int kSmemBytes = kStages * (kStageBytes + 32 * 16) + 2048;  // ring (with row padding) + barriers

/// The ring's shared memory: barriers first, stages from the next 1024-byte boundary.
struct Ring {
    unsigned bars;
    unsigned base;
    unsigned char* ptr;
};

__device__ Ring ring_init(unsigned char* smem) {
    Ring r;
    r.bars = weft::ptx::shared_address(smem);
    r.base = (r.bars + 128 + 1023) & ~1023u;
    r.ptr = smem + (r.base - r.bars);
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) weft::ptx::mbarrier_init(r.bars + 8 * s, 1);
        weft::ptx::fence_mbarrier_init();
    }
    __syncthreads();
    return r;
}

__device__ void wait_stage(const Ring& r, int step) {
    while (!weft::ptx::mbarrier_try_wait_parity(r.bars + 8 * (step % kStages), (step / kStages) & 1)) {
    }
}

__global__ void ldg_kernel(const uint4* p, long long n, unsigned* sink) {
    unsigned acc = 0;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        uint4 v;
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p + i));
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads alive
}

/// The TMA rings' schedule: thread 0 fills the first kStages stages; step i waits for its stage (every thread
/// when `read`, which also reads it and meets at a barrier) and refills it with step i + kStages. `fill(i)` arms
/// stage i % kStages's barrier and issues its copies.
template <class Fill>
__device__ void stream_ring(const Ring& r, int steps, bool read, unsigned* sink, const Fill& fill) {
    if (threadIdx.x == 0) {
        for (int i = 0; i < kStages && i < steps; ++i) fill(i);
    }
    unsigned acc = 0;
    for (int i = 0; i < steps; ++i) {
        if (read || threadIdx.x == 0) wait_stage(r, i);
        if (read) {
            const auto* stage = reinterpret_cast<const uint4*>(r.ptr + (i % kStages) * kStageBytes);
            for (int j = static_cast<int>(threadIdx.x); j < kStageBytes / 16; j += kThreads) {
                const uint4 v = stage[j];
                acc ^= v.x ^ v.y ^ v.z ^ v.w;
            }
            __syncthreads();
        }
        if (threadIdx.x == 0 && i + kStages < steps) {
            weft::ptx::fence_proxy_async_shared_cta();
            fill(i + kStages);
        }
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

/// TMA boxes: step i of CTA c loads box (i % k_boxes) * box_k along the inner dimension at row
/// c * rows_per_cta_view + (i / k_boxes) * box_rows of the map's view.
__global__ void __launch_bounds__(kThreads, 1)
    tma_ring_kernel(const __grid_constant__ TmaDescriptor map, int box_k, int box_rows, int k_boxes, int steps,
                    int rows_per_cta_view, bool read, unsigned* sink) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const Ring r = ring_init(smem);
    const auto fill = [&](int i) {
        const unsigned bar = r.bars + 8 * (i % kStages);
        weft::ptx::mbarrier_arrive_expect_tx(bar, kStageBytes);
        weft::ptx::tma_load_2d(r.base + (i % kStages) * kStageBytes, &map, bar, (i % k_boxes) * box_k,
                               static_cast<int>(blockIdx.x) * rows_per_cta_view + (i / k_boxes) * box_rows);
    };
    stream_ring(r, steps, read, sink, fill);
}

/// 3D TMA boxes {256, chunks, rows} over B viewed as [N, K / 256, 256]: step i of CTA c loads rows
/// 64 c + (i % groups) rows .. of k block i / groups (chunks x 256 k), groups = 64 / rows.
__global__ void __launch_bounds__(kThreads, 1)
    tma3_ring_kernel(const __grid_constant__ TmaDescriptor map, int chunks, int rows, int steps, bool read,
                     unsigned* sink) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const Ring r = ring_init(smem);
    const int groups = kRowsPerCta / rows;
    const auto fill = [&](int i) {
        const unsigned bar = r.bars + 8 * (i % kStages);
        weft::ptx::mbarrier_arrive_expect_tx(bar, kStageBytes);
        weft::ptx::tma_load_3d(r.base + (i % kStages) * kStageBytes, &map, bar, 0, (i / groups) * chunks,
                               static_cast<int>(blockIdx.x) * kRowsPerCta + (i % groups) * rows);
    };
    stream_ring(r, steps, read, sink, fill);
}

/// 1D bulk copies: step i of CTA c copies `rows` pieces of 32 KiB / rows bytes: rows r0 + j of k block kb
/// (kb = i / groups, r0 = (i % groups) * rows, groups = 64 / rows), from B's rows of `row_bytes`; with rows = 0
/// one contiguous 32 KiB chunk i of the CTA's range instead. Issued by thread 0, or by lane 0 of each warp; with
/// `read` (contiguous chunks only) every thread reads each stage before thread 0 refills it, as stream_ring.
__global__ void __launch_bounds__(kThreads, 1)
    bulk_ring_kernel(const unsigned char* b, long long row_bytes, int rows, int pad, bool all_warps, int steps,
                     bool read, unsigned* sink) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const Ring r = ring_init(smem);
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const unsigned char* cta = b + static_cast<long long>(blockIdx.x) * kRowsPerCta * row_bytes;
    if (read && rows == 0) {  // every thread reads each stage, a barrier, then thread 0 refills it
        stream_ring(r, steps, true, sink, [&](int i) {
            const unsigned bar = r.bars + 8 * (i % kStages);
            weft::ptx::mbarrier_arrive_expect_tx(bar, kStageBytes);
            weft::ptx::bulk_load_1d(r.base + (i % kStages) * kStageBytes, cta + static_cast<long long>(i) * kStageBytes,
                                    kStageBytes, bar);
        });
        return;
    }
    if (!(threadIdx.x == 0 || (all_warps && threadIdx.x % 32 == 0))) return;
    const int piece = rows > 0 ? kStageBytes / rows : kStageBytes;
    const int groups = rows > 0 ? kRowsPerCta / rows : 1;
    const auto fill = [&](int i) {
        const unsigned bar = r.bars + 8 * (i % kStages);
        const unsigned stage = r.base + (i % kStages) * (kStageBytes + 32 * pad);
        if (threadIdx.x == 0) weft::ptx::mbarrier_arrive_expect_tx(bar, kStageBytes);
        if (rows == 0) {
            weft::ptx::bulk_load_1d(stage, cta + static_cast<long long>(i) * kStageBytes, kStageBytes, bar);
            return;
        }
        const int kb = i / groups, r0 = (i % groups) * rows;
        for (int j = all_warps ? warp : 0; j < rows; j += all_warps ? kThreads / 32 : 1) {
            weft::ptx::bulk_load_1d(stage + j * (piece + pad), cta + (r0 + j) * row_bytes + static_cast<long long>(kb) * piece,
                                    piece, bar);
        }
    };
    for (int i = 0; i < kStages && i < steps; ++i) fill(i);
    for (int i = 0; i < steps; ++i) {
        wait_stage(r, i);
        if (i + kStages < steps) fill(i + kStages);
    }
}

/// The median time of fn's launches in microseconds, launch errors checked.
template <class Fn>
double median_us(int warmup, int iters, Fn&& fn) {
    const double ms = weft::bench::time_median_ms(nullptr, warmup, iters, [&](int) { fn(); });
    BENCH_CUDA(cudaGetLastError());
    return ms * 1e3;
}

/// B [N, K] as a 3D tensor [N, K / 256, 256] with boxes {256, chunks, rows}.
TmaDescriptor encode_map_3d(void* base, unsigned long long n, unsigned long long k, unsigned chunks, unsigned rows) {
    CUtensorMap map;
    const cuuint64_t dims[3] = {256, k / 256, n};
    const cuuint64_t strides[2] = {512, k * 2};
    const cuuint32_t box[3] = {256, chunks, rows};
    const cuuint32_t elem_strides[3] = {1, 1, 1};
    const CUresult rc = weft::driver().cuTensorMapEncodeTiled(
        &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, base, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (rc != CUDA_SUCCESS) throw std::runtime_error("cuTensorMapEncodeTiled (3D) failed: " + std::to_string(rc));
    TmaDescriptor d;
    std::memcpy(&d, &map, sizeof(d));
    return d;
}

TmaDescriptor encode_map(void* base, unsigned long long inner, unsigned long long outer, unsigned box_inner,
                         unsigned box_outer) {
    CUtensorMap map;
    const cuuint64_t dims[2] = {inner, outer};
    const cuuint64_t strides[1] = {inner * 2};
    const cuuint32_t box[2] = {box_inner, box_outer};
    const cuuint32_t elem_strides[2] = {1, 1};
    const CUresult rc = weft::driver().cuTensorMapEncodeTiled(
        &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (rc != CUDA_SUCCESS) throw std::runtime_error("cuTensorMapEncodeTiled failed: " + std::to_string(rc));
    TmaDescriptor d;
    static_assert(sizeof(d) == sizeof(map));
    std::memcpy(&d, &map, sizeof(d));
    return d;
}

struct Options {
    std::vector<std::pair<long long, long long>> sizes{{8192, 8192}, {8192, 4096}};
    int iters = 60;
    int warmup = 5;
    std::string json;
};

Options parse(int argc, char** argv) {
    Options o;
    weft::bench::Cli cli("weft_bench_stream", "the rate at which B [N,K] bf16 streams into shared memory, by pattern");
    cli.sizes("NxK[,...]", "B's shapes, N a multiple of 64 and K of 256 (default 8192x8192,8192x4096)",
              [&](const std::string& v) {
                  o.sizes.clear();
                  for (const auto& [n, k] : weft::bench::parse_shapes2(v, "--sizes")) {
                      if (n % kRowsPerCta != 0 || k % 256 != 0) {
                          throw weft::bench::UsageError("--sizes: N must be a multiple of 64 and K of 256, got " +
                                                        std::to_string(n) + "x" + std::to_string(k));
                      }
                      o.sizes.emplace_back(n, k);
                  }
              });
    cli.iters(&o.iters).warmup(&o.warmup).json(&o.json);
    cli.parse(argc, argv);
    return o;
}

}  // namespace

int main(int argc, char** argv) {
    return weft::bench::run_main("weft_bench_stream", [&] {
        const Options opt = parse(argc, argv);
        const weft::bench::Peaks peaks = weft::bench::measure_peaks(weft::bench::kPeakRead);
        cudaDeviceProp prop{};
        BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
        BENCH_CUDA(cudaFuncSetAttribute(tma_ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
        BENCH_CUDA(cudaFuncSetAttribute(tma3_ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
        BENCH_CUDA(cudaFuncSetAttribute(bulk_ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
        std::printf("# weft_bench_stream  GPU %s (%d SMs)  iters %d warmup %d; one CTA per 64 rows, 4 stages of 32 KiB\n",
                    prop.name, prop.multiProcessorCount, opt.iters, opt.warmup);
        std::printf("# %s\n", weft::bench::describe(peaks).c_str());
        std::printf("%-11s %-44s %10s %8s\n", "B (NxK)", "pattern", "us", "TB/s");
        weft::bench::Json j;
        j.begin_object().field("bench", "stream").field("gpu", prop.name).field("sms", prop.multiProcessorCount);
        j.field("iters", opt.iters).field("warmup", opt.warmup);
        weft::bench::add_peaks(j, peaks);
        j.key("results").begin_array();
        for (const auto& [n, k] : opt.sizes) {
            const long long bytes = n * k * 2;
            void* buf = nullptr;
            unsigned* sink = nullptr;
            BENCH_CUDA(cudaMalloc(&buf, bytes));
            BENCH_CUDA(cudaMalloc(&sink, 256));
            BENCH_CUDA(cudaMemset(buf, 1, bytes));
            const int ctas = static_cast<int>(n / kRowsPerCta);
            const int steps = static_cast<int>(kRowsPerCta * k * 2 / kStageBytes);
            char shape[32];
            std::snprintf(shape, sizeof(shape), "%lldx%lld", n, k);
            const auto row = [&](const std::string& name, double us) {
                const double tbs = static_cast<double>(bytes) / (us * 1e-6) / 1e12;
                std::printf("%-11s %-44s %10.2f %8.3f\n", shape, name.c_str(), us, tbs);
                j.begin_object(true).field("n", n).field("k", k).field("pattern", name).field("us", us);
                j.field("tbs", tbs).end_object();
            };
            row("launch floor: the ring kernel with no steps", median_us(opt.warmup, opt.iters, [&] {
                    bulk_ring_kernel<<<ctas, kThreads, kSmemBytes>>>(static_cast<const unsigned char*>(buf), k * 2, 0,
                                                                     0, false, 0, false, sink);
                }));
            row("ldg (8 CTAs x 512 threads per SM)", median_us(opt.warmup, opt.iters, [&] {
                    ldg_kernel<<<prop.multiProcessorCount * 8, 512>>>(static_cast<const uint4*>(buf), bytes / 16, sink);
                }));
            const TmaDescriptor rows_map = encode_map(buf, k, n, 256, kRowsPerCta);
            for (bool read : {false, true}) {
                row(std::string("tma-rows 64 x 512 B") + (read ? " +read" : ""), median_us(opt.warmup, opt.iters, [&] {
                        tma_ring_kernel<<<ctas, kThreads, kSmemBytes>>>(rows_map, 256, kRowsPerCta, static_cast<int>(k / 256),
                                                                        steps, kRowsPerCta, read, sink);
                    }));
            }
            for (int chunks : {2, 4, 8}) {
                const int rows = kStageBytes / (512 * chunks);
                if (chunks * 256 > k) continue;
                const TmaDescriptor map3 = encode_map_3d(buf, n, k, chunks, rows);
                for (bool read : {false, true}) {
                    row("tma-3d " + std::to_string(rows) + " rows x " + std::to_string(512 * chunks) + " B" +
                            (read ? " +read" : ""),
                        median_us(opt.warmup, opt.iters, [&] {
                            tma3_ring_kernel<<<ctas, kThreads, kSmemBytes>>>(map3, chunks, rows, steps, read, sink);
                        }));
                }
            }
            const TmaDescriptor contig_map = encode_map(buf, 256, n * k / 256, 256, kRowsPerCta);
            row("tma-contig 32 KiB boxes", median_us(opt.warmup, opt.iters, [&] {
                    tma_ring_kernel<<<ctas, kThreads, kSmemBytes>>>(contig_map, 256, kRowsPerCta, 1, steps,
                                                                    static_cast<int>(k / 4), false, sink);
                }));
            const auto* b = static_cast<const unsigned char*>(buf);
            for (bool read : {false, true}) {
                const std::string name = std::string("bulk-contig 32 KiB copies") + (read ? " +read" : "");
                row(name, median_us(opt.warmup, opt.iters, [&] {
                        bulk_ring_kernel<<<ctas, kThreads, kSmemBytes>>>(b, k * 2, 0, 0, false, steps, read, sink);
                    }));
            }
            for (int rows : {2, 4, 8, 16, 32}) {
                if (kStageBytes / rows > k * 2) continue;  // a piece longer than a row
                for (bool all_warps : {false, true}) {
                    for (int pad : {0, 16}) {
                        if ((rows < 8 && all_warps) || (pad != 0 && rows != 16)) continue;
                        const std::string name = "bulk-rows " + std::to_string(rows) + " x " +
                                                 std::to_string(kStageBytes / rows) + " B" +
                                                 (all_warps ? ", 8 warps issue" : ", thread 0 issues") +
                                                 (pad ? ", pad 16" : "");
                        row(name, median_us(opt.warmup, opt.iters, [&] {
                                bulk_ring_kernel<<<ctas, kThreads, kSmemBytes>>>(b, k * 2, rows, pad, all_warps, steps,
                                                                                 false, sink);
                            }));
                    }
                }
            }
            BENCH_CUDA(cudaFree(buf));
            BENCH_CUDA(cudaFree(sink));
        }
        j.end_array().end_object();
        if (!opt.json.empty()) weft::bench::write_json_file(opt.json, j);
        return 0;
    });
}
