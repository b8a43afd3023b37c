// SPDX-License-Identifier: MIT
// GPU tests of the shmem layer: every call at every group scope, odd sizes and alignments, signals,
// comparisons, p/g, and barrier_all/sync_all epochs (ranks share the visible GPUs; world sizes 1-8).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "gpu/device_test_util.cuh"
#include "weft/device.cuh"

namespace weft {
namespace {

using device::Block;
using device::SignalOp;
using device::Thread;
using device::Warp;
namespace shmem = device::shmem;
using test::blocks_for;
using test::finish;
using test::run_world;

constexpr int kThreads = 128;

// Which group instance the calling thread belongs to, and how many the grid holds.
template <class G>
__device__ int unit_index() {
    const int tid = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if constexpr (std::is_same_v<G, Thread>) {
        return tid;
    } else if constexpr (std::is_same_v<G, Warp>) {
        return tid / 32;
    } else {
        return static_cast<int>(blockIdx.x);
    }
}
template <class G>
__device__ int unit_count() {
    const int threads = static_cast<int>(gridDim.x * blockDim.x);
    if constexpr (std::is_same_v<G, Thread>) {
        return threads;
    } else if constexpr (std::is_same_v<G, Warp>) {
        return threads / 32;
    } else {
        return static_cast<int>(gridDim.x);
    }
}
// Whether the calling thread belongs to its block's first group instance (thread 0, warp 0, the block).
template <class G>
__device__ bool first_in_block() {
    if constexpr (std::is_same_v<G, Thread>) {
        return threadIdx.x == 0;
    } else if constexpr (std::is_same_v<G, Warp>) {
        return threadIdx.x < 32;
    } else {
        return true;
    }
}

template <class G>
const char* group_name() {
    if constexpr (std::is_same_v<G, Thread>) {
        return "Thread";
    } else if constexpr (std::is_same_v<G, Warp>) {
        return "Warp";
    } else {
        return "Block";
    }
}

// ---------------------------------------------------------------------------------------------------
// putmem / getmem / putmem_signal (blocking and nbi) at every scope, odd sizes and alignments.

enum class Op : int { kPut = 0, kPutNbi, kGet, kGetNbi, kPutSignal, kPutSignalNbi };
constexpr Op kOps[] = {Op::kPut, Op::kPutNbi, Op::kGet, Op::kGetNbi, Op::kPutSignal, Op::kPutSignalNbi};
const char* op_name(Op op) {
    switch (op) {
        case Op::kPut: return "putmem";
        case Op::kPutNbi: return "putmem_nbi";
        case Op::kGet: return "getmem";
        case Op::kGetNbi: return "getmem_nbi";
        case Op::kPutSignal: return "putmem_signal";
        case Op::kPutSignalNbi: return "putmem_signal_nbi";
    }
    return "?";
}

struct CopyCase {
    uint64_t bytes;
    uint32_t src_off;  // bytes past the slot's start (and past 256-byte alignment)
    uint32_t dst_off;
    uint64_t slot;     // byte offset of the case's slot in a region
};

// Every rank copies every case to (put) or from (get) every rank; the copies land in the destination
// rank's region for the source rank: dst[src_rank * region_bytes + slot + dst_off].
template <class G>
__global__ void copy_cases_kernel(DeviceCtx ctx, Op op, const CopyCase* cases, int num_cases, uint8_t* src,
                                  uint8_t* dst, uint64_t region_bytes, uint64_t* signals) {
    G g;
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    for (int job = unit_index<G>(); job < n * num_cases; job += unit_count<G>()) {
        const int pe = (me + job % n) % n;
        const CopyCase c = cases[job / n];
        const uint8_t* my_src = src + c.slot + c.src_off;
        switch (op) {
            case Op::kPut:
                shmem::putmem(g, ctx, dst + me * region_bytes + c.slot + c.dst_off, my_src, c.bytes, pe);
                break;
            case Op::kPutNbi:
                shmem::putmem_nbi(g, ctx, dst + me * region_bytes + c.slot + c.dst_off, my_src, c.bytes, pe);
                break;
            case Op::kGet:
                shmem::getmem(g, ctx, dst + pe * region_bytes + c.slot + c.dst_off, my_src, c.bytes, pe);
                break;
            case Op::kGetNbi:
                shmem::getmem_nbi(g, ctx, dst + pe * region_bytes + c.slot + c.dst_off, my_src, c.bytes, pe);
                break;
            case Op::kPutSignal:
                shmem::putmem_signal(g, ctx, dst + me * region_bytes + c.slot + c.dst_off, my_src, c.bytes,
                                     &signals[me], 1, SignalOp::kAdd, pe);
                break;
            case Op::kPutSignalNbi:
                shmem::putmem_signal_nbi(g, ctx, dst + me * region_bytes + c.slot + c.dst_off, my_src, c.bytes,
                                         &signals[me], c.bytes, SignalOp::kAdd, pe);
                break;
        }
    }
    if (op == Op::kPutNbi || op == Op::kGetNbi) {
        shmem::quiet(g, ctx);
    }
}

std::vector<CopyCase> make_cases(uint64_t* region_bytes) {
    // Up to 16 bytes a copy takes one access per word of the widest size that divides both addresses and the size
    // (group_copy.hpp: small_copy): here 16-, 8-, 4-, 2- and 1-byte words, and 17 bytes just past that path.
    const uint64_t sizes[] = {1, 2, 3, 4, 6, 7, 8, 12, 15, 16, 17, 31, 32, 33, 100, 255, 1000, 4097, 20011};
    const uint32_t offsets[][2] = {{0, 0}, {1, 0}, {0, 1}, {3, 7}, {8, 8}, {4, 12}, {2, 6}, {12, 4}, {15, 1}, {9, 9}};
    std::vector<CopyCase> cases;
    uint64_t slot = 0;
    const auto add = [&](uint64_t bytes, uint32_t so, uint32_t d) {
        cases.push_back(CopyCase{bytes, so, d, slot});
        slot += (bytes + 32 + 255) / 256 * 256;  // 256-aligned slots with poison around every copy
    };
    for (uint64_t bytes : sizes) {
        for (const auto& o : offsets) {
            add(bytes, o[0], o[1]);
        }
    }
    add((1u << 20) + 13, 5, 3);  // long enough for every thread of a block to run the unrolled loop
    add(1u << 20, 0, 0);
    *region_bytes = slot;
    return cases;
}

constexpr uint8_t kPoison = 0xA5;

template <class G>
void run_copy_variant(World& w, cudaStream_t stream, Op op, const std::vector<CopyCase>& cases,
                      const CopyCase* d_cases, uint8_t* src, uint8_t* dst, uint64_t region_bytes,
                      uint64_t* signals, const std::vector<std::vector<uint8_t>>& sources, uint64_t seed) {
    const int n = w.num_ranks();
    const uint64_t dst_bytes = region_bytes * static_cast<uint64_t>(n);
    WEFT_CUDA_CHECK(cudaMemsetAsync(dst, kPoison, dst_bytes, stream));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    w.barrier();  // everyone has poisoned before anyone writes
    copy_cases_kernel<G><<<blocks_for(w, 4), kThreads, 0, stream>>>(w.device_ctx(), op, d_cases,
                                                                     static_cast<int>(cases.size()), src, dst,
                                                                     region_bytes, signals);
    finish(w, stream, op_name(op));
    w.barrier();  // every rank's copies into this rank are done

    const std::vector<uint8_t> got = test::to_host(dst, dst_bytes, stream);
    for (int s = 0; s < n; ++s) {
        for (const CopyCase& c : cases) {
            const uint8_t* slot = got.data() + static_cast<uint64_t>(s) * region_bytes + c.slot;
            const uint64_t slot_bytes = (c.bytes + 32 + 255) / 256 * 256;
            for (uint64_t i = 0; i < slot_bytes; ++i) {
                const bool inside = i >= c.dst_off && i < c.dst_off + c.bytes;
                const uint8_t want = inside ? sources[s][c.slot + c.src_off + (i - c.dst_off)] : kPoison;
                WEFT_CHECK(slot[i] == want, op_name(op) << "<" << group_name<G>() << "> rank " << w.rank()
                                                        << ": from rank " << s << ", case bytes=" << c.bytes
                                                        << " src_off=" << c.src_off << " dst_off=" << c.dst_off
                                                        << ": byte " << i << " of the slot is "
                                                        << int{slot[i]} << ", expected " << int{want}
                                                        << (inside ? "" : " (poison: written outside the copy)")
                                                        << " [seed " << seed << "]");
            }
        }
    }
    if (op == Op::kPutSignal || op == Op::kPutSignalNbi) {
        uint64_t per_source = 0;
        for (const CopyCase& c : cases) {
            per_source += op == Op::kPutSignal ? 1 : c.bytes;
        }
        const std::vector<uint64_t> sig = test::to_host(signals, static_cast<size_t>(n), stream);
        for (int s = 0; s < n; ++s) {
            WEFT_CHECK(sig[s] == per_source, op_name(op) << "<" << group_name<G>() << "> rank " << w.rank()
                                                         << ": signal from rank " << s << " is " << sig[s]
                                                         << ", expected " << per_source);
        }
    }
}

TEST(DeviceShmem, PutGetEveryScopeSizeAndAlignment) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    uint64_t region_bytes = 0;
    const std::vector<CopyCase> cases = make_cases(&region_bytes);
    // Every rank's source region, computed once (independently of the device code).
    std::vector<std::vector<uint8_t>> sources(8, std::vector<uint8_t>(region_bytes));
    for (int r = 0; r < 8; ++r) {
        for (uint64_t i = 0; i < region_bytes; ++i) {
            sources[r][i] = test::pattern_byte(seed, r, i);
        }
    }
    for (int n : test::kWorldSizes) {
        SCOPED_TRACE("world " + std::to_string(n));
        run_world(n, [&](World& w) {
            test::RankStream stream;
            SymmetricHeap& heap = w.heap();
            auto* src = static_cast<uint8_t*>(heap.alloc(region_bytes));
            auto* dst = static_cast<uint8_t*>(heap.alloc(region_bytes * static_cast<uint64_t>(n)));
            uint64_t* signals = heap.alloc_signals(static_cast<uint64_t>(n) * 18);
            WEFT_CUDA_CHECK(cudaMemcpyAsync(src, sources[w.rank()].data(), region_bytes, cudaMemcpyHostToDevice, stream));
            test::DeviceArray<CopyCase> d_cases(cases.size(), stream);
            WEFT_CUDA_CHECK(cudaMemcpyAsync(d_cases.get(), cases.data(), cases.size() * sizeof(CopyCase),
                                            cudaMemcpyHostToDevice, stream));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
            int variant = 0;
            for (Op op : kOps) {
                uint64_t* sig = signals + static_cast<uint64_t>(n) * static_cast<uint64_t>(variant);
                run_copy_variant<Thread>(w, stream, op, cases, d_cases.get(), src, dst, region_bytes, sig, sources, seed);
                sig += n * 6;
                run_copy_variant<Warp>(w, stream, op, cases, d_cases.get(), src, dst, region_bytes, sig, sources, seed);
                sig += n * 6;
                run_copy_variant<Block>(w, stream, op, cases, d_cases.get(), src, dst, region_bytes, sig, sources, seed);
                ++variant;
            }
            w.barrier();
            heap.free(signals);
            heap.free(dst);
            heap.free(src);
        });
    }
}

// ---------------------------------------------------------------------------------------------------
// p / g for 32- and 64-bit types, ptr, my_pe, n_pes.

struct Words {
    uint32_t* u32;
    int64_t* i64;
    float* f32;
    double* f64;
};

__host__ __device__ uint32_t word_value(uint64_t seed, int writer, int owner) {
    return static_cast<uint32_t>(test::mix64(seed + static_cast<uint64_t>(writer) * 131 + static_cast<uint64_t>(owner)));
}

// Thread t < n_pes writes this rank's slot in rank t's words with p.
__global__ void p_kernel(DeviceCtx ctx, Words words, uint64_t seed, int* info) {
    const int pe = static_cast<int>(threadIdx.x);
    const int me = shmem::my_pe(ctx);
    if (threadIdx.x == 0) {
        info[0] = shmem::my_pe(ctx);
        info[1] = shmem::n_pes(ctx);
        info[2] = shmem::ptr(ctx, words.u32, me) == words.u32 ? 1 : 0;
        info[3] = shmem::ptr(ctx, reinterpret_cast<uint32_t*>(0x10), me) == nullptr ? 1 : 0;  // not symmetric
        info[4] = shmem::ptr(ctx, words.u32, shmem::n_pes(ctx)) == nullptr ? 1 : 0;         // no such rank
    }
    if (pe < shmem::n_pes(ctx)) {
        const uint32_t v = word_value(seed, me, pe);
        shmem::p(ctx, &words.u32[me], v, pe);
        shmem::p(ctx, &words.i64[me], -static_cast<int64_t>(v) * 1000003, pe);
        shmem::p(ctx, &words.f32[me], static_cast<float>(v % 100000) + 0.25f, pe);
        shmem::p(ctx, &words.f64[me], static_cast<double>(v) * 0.5, pe);
        shmem::quiet(Thread{}, ctx);
    }
}

// Thread t < n_pes reads, from rank t, the slot that rank (t + 1) % n wrote there.
__global__ void g_kernel(DeviceCtx ctx, Words words, uint32_t* out_u32, int64_t* out_i64, float* out_f32,
                         double* out_f64) {
    const int pe = static_cast<int>(threadIdx.x);
    const int n = shmem::n_pes(ctx);
    if (pe < n) {
        const int slot = (pe + 1) % n;
        out_u32[pe] = shmem::g(ctx, &words.u32[slot], pe);
        out_i64[pe] = shmem::g(ctx, &words.i64[slot], pe);
        out_f32[pe] = shmem::g(ctx, &words.f32[slot], pe);
        out_f64[pe] = shmem::g(ctx, &words.f64[slot], pe);
    }
}

TEST(DeviceShmem, TypedPAndG) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    for (int n : test::kWorldSizes) {
        SCOPED_TRACE("world " + std::to_string(n));
        run_world(n, [&](World& w) {
            test::RankStream stream;
            SymmetricHeap& heap = w.heap();
            Words words{heap.alloc_array<uint32_t>(n), heap.alloc_array<int64_t>(n), heap.alloc_array<float>(n),
                        heap.alloc_array<double>(n)};
            test::DeviceArray<int> info(8, stream);
            w.barrier();
            p_kernel<<<1, 32, 0, stream>>>(w.device_ctx(), words, seed, info.get());
            finish(w, stream, "p_kernel");
            w.barrier();
            const auto u32 = test::to_host(words.u32, n, stream);
            const auto i64 = test::to_host(words.i64, n, stream);
            const auto f32 = test::to_host(words.f32, n, stream);
            const auto f64 = test::to_host(words.f64, n, stream);
            for (int s = 0; s < n; ++s) {
                const uint32_t v = word_value(seed, s, w.rank());
                WEFT_CHECK(u32[s] == v, "rank " << w.rank() << ": p<uint32_t> from " << s << " gave " << u32[s]);
                WEFT_CHECK(i64[s] == -static_cast<int64_t>(v) * 1000003, "p<int64_t> from " << s << " gave " << i64[s]);
                WEFT_CHECK(f32[s] == static_cast<float>(v % 100000) + 0.25f, "p<float> from " << s << " gave " << f32[s]);
                WEFT_CHECK(f64[s] == static_cast<double>(v) * 0.5, "p<double> from " << s << " gave " << f64[s]);
            }
            const auto inf = info.to_host();
            WEFT_CHECK(inf[0] == w.rank() && inf[1] == n, "my_pe/n_pes gave " << inf[0] << "/" << inf[1]);
            WEFT_CHECK(inf[2] == 1, "ptr(own rank) is not the local address");
            WEFT_CHECK(inf[3] == 1, "ptr of a non-symmetric address is not nullptr");
            WEFT_CHECK(inf[4] == 1, "ptr of an out-of-range rank is not nullptr");

            test::DeviceArray<uint32_t> o32(n, stream);
            test::DeviceArray<int64_t> o64(n, stream);
            test::DeviceArray<float> of32(n, stream);
            test::DeviceArray<double> of64(n, stream);
            g_kernel<<<1, 32, 0, stream>>>(w.device_ctx(), words, o32.get(), o64.get(), of32.get(), of64.get());
            finish(w, stream, "g_kernel");
            const auto g32 = o32.to_host();
            const auto g64 = o64.to_host();
            const auto gf32 = of32.to_host();
            const auto gf64 = of64.to_host();
            for (int pe = 0; pe < n; ++pe) {
                const uint32_t v = word_value(seed, (pe + 1) % n, pe);
                WEFT_CHECK(g32[pe] == v, "rank " << w.rank() << ": g<uint32_t> from " << pe << " gave " << g32[pe]
                                                 << ", expected " << v);
                WEFT_CHECK(g64[pe] == -static_cast<int64_t>(v) * 1000003, "g<int64_t> from " << pe);
                WEFT_CHECK(gf32[pe] == static_cast<float>(v % 100000) + 0.25f, "g<float> from " << pe);
                WEFT_CHECK(gf64[pe] == static_cast<double>(v) * 0.5, "g<double> from " << pe);
            }
            w.barrier();
            heap.free(words.f64);
            heap.free(words.f32);
            heap.free(words.i64);
            heap.free(words.u32);
        });
    }
}

// ---------------------------------------------------------------------------------------------------
// signal_op (set, add), signal_fetch and signal_wait_until across ranks, every scope.

// Block 0 signals every rank (add me+1, set round*1000+me); block 1 waits for every rank's signals.
template <class G>
__global__ void signal_kernel(DeviceCtx ctx, uint64_t* add_sigs, uint64_t* set_sigs, uint64_t* observed, uint64_t round,
                              uint64_t seed) {
    G g;
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    if (!first_in_block<G>()) {
        return;  // one group instance per block
    }
    if (blockIdx.x == 0) {
        for (int k = 0; k < n; ++k) {
            const int pe = (me + k) % n;
            if (g.is_leader()) {
                test::random_delay(seed, round * 64 + static_cast<uint64_t>(k), 3000);
            }
            shmem::signal_op(g, ctx, &set_sigs[me], round * 1000 + static_cast<uint64_t>(me), SignalOp::kSet, pe);
            shmem::signal_op(g, ctx, &add_sigs[me], static_cast<uint64_t>(me + 1), SignalOp::kAdd, pe);
        }
    } else {
        for (int s = 0; s < n; ++s) {
            // The set precedes the add in the signaller's program order and both are releases: once the
            // add is observed, the set is too.
            const uint64_t v = shmem::signal_wait_until(g, ctx, &add_sigs[s], Cmp::kGe, round * static_cast<uint64_t>(s + 1));
            const uint64_t set = shmem::signal_fetch(ctx, &set_sigs[s]);
            if (g.is_leader()) {
                observed[2 * s] = v;
                observed[2 * s + 1] = set;
            }
        }
    }
}

template <class G>
void run_signal_rounds(World& w, cudaStream_t stream, uint64_t* add_sigs, uint64_t* set_sigs, uint64_t* first_round,
                       uint64_t seed) {
    const int n = w.num_ranks();
    test::DeviceArray<uint64_t> observed(2 * static_cast<size_t>(n), stream);
    for (int i = 0; i < 3; ++i) {
        const uint64_t round = ++*first_round;
        signal_kernel<G><<<2, kThreads, 0, stream>>>(w.device_ctx(), add_sigs, set_sigs, observed.get(), round, seed);
        finish(w, stream, "signal_kernel");
        w.barrier();  // no rank starts the next round (and adds again) before every rank has read this one
        const auto obs = observed.to_host();
        for (int s = 0; s < n; ++s) {
            WEFT_CHECK(obs[2 * s] == round * static_cast<uint64_t>(s + 1),
                       "signal_wait_until<" << group_name<G>() << "> on rank " << w.rank() << " returned "
                                            << obs[2 * s] << " for rank " << s << "'s adds, expected "
                                            << round * static_cast<uint64_t>(s + 1));
            WEFT_CHECK(obs[2 * s + 1] == round * 1000 + static_cast<uint64_t>(s),
                       "signal_fetch<" << group_name<G>() << "> on rank " << w.rank() << " read " << obs[2 * s + 1]
                                       << " for rank " << s << "'s set, expected " << round * 1000 + s);
        }
    }
}

TEST(DeviceShmem, SignalOpFetchAndWaitAcrossRanks) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    for (int n : test::kWorldSizes) {
        SCOPED_TRACE("world " + std::to_string(n));
        run_world(n, [&](World& w) {
            test::RankStream stream;
            uint64_t* add_sigs = w.heap().alloc_signals(static_cast<uint64_t>(n));
            uint64_t* set_sigs = w.heap().alloc_signals(static_cast<uint64_t>(n));
            uint64_t round = 0;  // rounds continue across scopes: the add signal only grows
            run_signal_rounds<Thread>(w, stream, add_sigs, set_sigs, &round, seed);
            run_signal_rounds<Warp>(w, stream, add_sigs, set_sigs, &round, seed);
            run_signal_rounds<Block>(w, stream, add_sigs, set_sigs, &round, seed);
            w.barrier();
            w.heap().free(set_sigs);
            w.heap().free(add_sigs);
        });
    }
}

// Every comparison, from a state where it is false until a second block makes it true: the wait must
// return only then, with a value that satisfies it (a comparison that is too loose returns early with
// the initial value; one that is too strict never returns and times out).
struct CmpCase {
    uint64_t initial;
    Cmp cmp;
    uint64_t value;
    uint64_t target;
};
constexpr int kNumCmpCases = 6;
struct CmpCases {
    CmpCase c[kNumCmpCases];
};
constexpr CmpCases kCmpCases = {{
    {9, Cmp::kGt, 9, 10},
    {8, Cmp::kGe, 9, 9},
    {9, Cmp::kEq, 10, 10},
    {3, Cmp::kNe, 3, 4},
    {1, Cmp::kLt, 1, 0},
    {2, Cmp::kLe, 1, 1},
}};

bool host_compare(uint64_t v, Cmp cmp, uint64_t value) {
    switch (cmp) {
        case Cmp::kEq: return v == value;
        case Cmp::kNe: return v != value;
        case Cmp::kGt: return v > value;
        case Cmp::kGe: return v >= value;
        case Cmp::kLt: return v < value;
        case Cmp::kLe: return v <= value;
    }
    return false;
}

// Block 0 announces each case (words[kNumCmpCases] = i + 1) and waits on it; block 1 sees the
// announcement, lets the waiter poll for 20 us, then stores the target.
template <class G>
__global__ void cmp_kernel(DeviceCtx ctx, CmpCases cases, uint64_t* words, uint64_t* observed) {
    G g;
    if (!first_in_block<G>()) {
        return;
    }
    uint64_t* ready = &words[kNumCmpCases];
    for (int i = 0; i < kNumCmpCases; ++i) {
        const CmpCase c = cases.c[i];
        if (blockIdx.x == 0) {
            if (g.is_leader()) {
                weft::ptx::st<weft::ptx::Sem::kRelease, weft::ptx::Scope::kGpu>(ready, static_cast<uint64_t>(i + 1));
            }
            const uint64_t v = shmem::signal_wait_until(g, ctx, &words[i], c.cmp, c.value);
            if (g.is_leader()) {
                observed[i] = v;
            }
        } else if (g.is_leader()) {
            device::spin_until(ctx, ready, Cmp::kGe, static_cast<uint64_t>(i + 1),
                               device::SpinSite{SpinKind::kOther, -1, __LINE__});
            weft::ptx::nanosleep(20000);
            shmem::p(ctx, &words[i], c.target, ctx.rank);
        }
    }
}

template <class G>
void run_cmp_cases(World& w, cudaStream_t stream, uint64_t* words) {
    std::vector<uint64_t> init;
    for (const CmpCase& c : kCmpCases.c) {
        init.push_back(c.initial);
    }
    init.push_back(0);  // the announcement word
    WEFT_CUDA_CHECK(cudaMemcpyAsync(words, init.data(), init.size() * 8, cudaMemcpyHostToDevice, stream));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    test::DeviceArray<uint64_t> observed(kNumCmpCases, stream);
    cmp_kernel<G><<<2, kThreads, 0, stream>>>(w.device_ctx(), kCmpCases, words, observed.get());
    finish(w, stream, "cmp_kernel");
    const auto obs = observed.to_host();
    for (int i = 0; i < kNumCmpCases; ++i) {
        const CmpCase& c = kCmpCases.c[i];
        WEFT_CHECK(obs[i] == c.target && host_compare(obs[i], c.cmp, c.value),
                   "signal_wait_until<" << group_name<G>() << "> case " << i << " (cmp " << static_cast<int>(c.cmp)
                                        << ", value " << c.value << ", from " << c.initial << " to " << c.target
                                        << ") returned " << obs[i]);
    }
}

TEST(DeviceShmem, SignalWaitUntilEveryComparison) {
    run_world(1, [](World& w) {
        test::RankStream stream;
        uint64_t* words = w.heap().alloc_signals(kNumCmpCases + 1);
        run_cmp_cases<Thread>(w, stream, words);
        run_cmp_cases<Warp>(w, stream, words);
        run_cmp_cases<Block>(w, stream, words);
        w.heap().free(words);
    });
}

// ---------------------------------------------------------------------------------------------------
// barrier_all / sync_all: repeated, every scope, epochs carried across kernels (no reset).

// Each iteration: (random delay) write `iter` into this rank's slot on every rank, barrier, check every
// slot here holds `iter`, barrier again (sync_all) so nobody overwrites a slot before all have read.
template <class G>
__global__ void barrier_kernel(DeviceCtx ctx, uint64_t* slots, uint64_t* psync, uint64_t first_iter, int iters,
                               uint64_t seed, unsigned long long* errors) {
    G g;
    if (!first_in_block<G>()) {
        return;
    }
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    for (int it = 0; it < iters; ++it) {
        const uint64_t iter = first_iter + static_cast<uint64_t>(it);
        if (g.is_leader()) {
            test::random_delay(seed, iter * 8 + static_cast<uint64_t>(me), 2000);
        }
        for (int pe = static_cast<int>(g.rank()); pe < n; pe += static_cast<int>(g.size())) {
            shmem::p(ctx, &slots[me], iter, pe);
        }
        shmem::barrier_all(g, ctx, psync);
        for (int s = static_cast<int>(g.rank()); s < n; s += static_cast<int>(g.size())) {
            const uint64_t v = weft::ptx::ld<weft::ptx::Sem::kRelaxed, weft::ptx::Scope::kSys>(&slots[s]);
            if (v != iter) {
                atomicAdd(errors, 1ull);
                atomicCAS(errors + 1, 0ull, (iter << 16) | static_cast<unsigned long long>(s));
            }
        }
        shmem::sync_all(g, ctx, psync);
    }
}

TEST(DeviceShmem, BarrierAllRepeatedEveryScopeWithoutReset) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    constexpr int kIters = 300;
    for (int n : test::kWorldSizes) {
        SCOPED_TRACE("world " + std::to_string(n));
        run_world(n, [&](World& w) {
            test::RankStream stream;
            uint64_t* slots = w.heap().alloc_signals(static_cast<uint64_t>(n));
            uint64_t* psync = w.heap().alloc_signals(static_cast<uint64_t>(n));
            test::DeviceArray<unsigned long long> errors(2, stream);
            uint64_t iter = 1;
            int launches = 0;
            for (int rep = 0; rep < 2; ++rep) {  // twice: the epoch carries over between launches
                barrier_kernel<Thread><<<1, kThreads, 0, stream>>>(w.device_ctx(), slots, psync, iter, kIters, seed, errors.get());
                finish(w, stream, "barrier_kernel<Thread>");
                iter += kIters;
                barrier_kernel<Warp><<<1, kThreads, 0, stream>>>(w.device_ctx(), slots, psync, iter, kIters, seed, errors.get());
                finish(w, stream, "barrier_kernel<Warp>");
                iter += kIters;
                barrier_kernel<Block><<<1, kThreads, 0, stream>>>(w.device_ctx(), slots, psync, iter, kIters, seed, errors.get());
                finish(w, stream, "barrier_kernel<Block>");
                iter += kIters;
                launches += 3;
            }
            const auto err = errors.to_host();
            WEFT_CHECK(err[0] == 0, "rank " << w.rank() << ": " << err[0] << " slots were stale after barrier_all; first: iteration "
                                            << (err[1] >> 16) << " slot " << (err[1] & 0xffff));
            // The epoch words: own word counts this rank's barriers, the others count arrivals.
            w.barrier();
            const auto ps = test::to_host(psync, static_cast<size_t>(n), stream);
            const uint64_t barriers = 2ull * kIters * static_cast<uint64_t>(launches);
            for (int q = 0; q < n; ++q) {
                WEFT_CHECK(ps[q] == barriers, "rank " << w.rank() << ": psync[" << q << "] is " << ps[q]
                                                      << " after " << barriers << " barriers");
            }
            w.heap().free(psync);
            w.heap().free(slots);
        });
    }
}

}  // namespace
}  // namespace weft
