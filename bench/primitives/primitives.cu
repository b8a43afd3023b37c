// SPDX-License-Identifier: MIT
// Benchmark of the device primitives: put/get bandwidth by size and group scope against the measured
// copy of the same bytes, signal round-trip latency between two ranks against a hand-written minimal
// ping-pong, and barrier_all latency by world size.
//
//   weft_bench_primitives [--sizes 1K:1G[:4] | --sizes 4K,1M,...] [--iters N] [--warmup N] [--dtype u8]
//                         [--world 2,4,8] [--placement shared|spread] [--block-threads N] [--check] [--json FILE]
//
// Ranks are threads of this process (weft::run_local). --placement shared (the default) puts every rank on
// GPU 0: the "remote" memory is local HBM, so a put is a device copy and cudaMemcpy D2D of the same bytes is
// its roofline. --placement spread puts rank r on visible GPU r % GPUs (at least two): rank 0 and rank 1 are
// on different GPUs, a put or get crosses NVLink (or PCIe), and the roofline is the copy engine's copy of the
// same bytes between the two GPUs (cudaMemcpyAsync over the peer mapping, GPU0 -> GPU1 for puts, GPU1 -> GPU0
// for gets); the .gpu-scope round trips are skipped there (a .gpu release/acquire does not order memory for
// another GPU) and the barrier's worlds go over the GPUs round robin.
// Sizes are bytes whatever --dtype says (the dtype is recorded in the JSON). Buffers rotate through a
// 256 MiB pool so that sizes below the L2 do not run from the L2. The header also gives the device's copy peak
// (a 1 GiB cudaMemcpyAsync, measured at start-up). The bandwidth kernels run one block per SM of --block-threads
// threads (default 256); each thread, warp or block moves one contiguous slice of the message.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "common/cli.hpp"
#include "common/json.hpp"
#include "common/peaks.hpp"
#include "common/report.hpp"
#include "common/timing.hpp"
#include "weft/common/dtype.hpp"
#include "weft/device.cuh"
#include "weft/runtime/error.hpp"
#include "weft/runtime/world.hpp"

namespace weft::bench {
namespace {

using device::Block;
using device::SignalOp;
using device::Thread;
using device::Warp;
namespace shmem = device::shmem;
namespace tile = device::tile;

// ------------------------------------------------------------------------------------------------
// Command line.

struct Options {
    std::vector<uint64_t> sizes;
    int iters = 20;
    int warmup = 3;
    DType dtype = DType::kU8;
    std::vector<int> worlds = {2, 4, 8};
    Placement placement = Placement::kShared;
    int block_threads = 256;  // --block-threads: threads per block of the bandwidth kernels (one block per SM)
    bool check = false;
    std::string json;
};

Options parse_options(int argc, char** argv) {
    Options o;
    o.sizes = parse_byte_sizes("1K:1G", "--sizes");
    Cli cli("weft_bench_primitives",
            "put/get bandwidth, signal round trip and barrier latency, ranks sharing GPU 0 or spread over the GPUs");
    cli.sizes("A:B[:F]|A,B,...", "message bytes (default 1K:1G: 1K, 4K, ... 1G)",
              [&](const std::string& v) { o.sizes = parse_byte_sizes(v, "--sizes"); });
    cli.iters(&o.iters).warmup(&o.warmup);
    cli.dtype(&o.dtype,
              {DType::kBF16, DType::kF16, DType::kF32, DType::kF8E4M3, DType::kI32, DType::kI64, DType::kU8});
    cli.world(&o.worlds, 2, 64).placement(&o.placement).check(&o.check).json(&o.json);
    cli.int_option("--block-threads", "threads per block of the put/get kernels, one block per SM", &o.block_threads,
                   32, 1024);
    cli.parse(argc, argv);
    if (o.block_threads % 32 != 0) {
        throw UsageError("--block-threads must be a multiple of 32 (whole warps), got " +
                         std::to_string(o.block_threads));
    }
    return o;
}

// ------------------------------------------------------------------------------------------------
// Kernels.

__host__ __device__ inline uint8_t pattern(uint64_t seed, uint64_t i) {
    uint64_t x = seed ^ (i * 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return static_cast<uint8_t>(x >> 40);
}

__global__ void fill_kernel(uint8_t* p, uint64_t bytes, uint64_t seed) {
    for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < bytes; i += gridDim.x * uint64_t{blockDim.x}) {
        p[i] = pattern(seed, i);
    }
}

__global__ void count_mismatches_kernel(const uint8_t* p, uint64_t bytes, uint64_t seed, unsigned long long* bad) {
    for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < bytes; i += gridDim.x * uint64_t{blockDim.x}) {
        if (p[i] != pattern(seed, i)) {
            atomicAdd(bad, 1ull);
        }
    }
}

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

// Every group instance moves one contiguous, 16-byte aligned slice of the message.
template <class G, bool kGet>
__global__ void bandwidth_kernel(DeviceCtx ctx, uint8_t* local, uint8_t* symmetric, uint64_t bytes, int pe) {
    G g;
    const auto units = static_cast<uint64_t>(unit_count<G>());
    const uint64_t per = ((bytes + units - 1) / units + 15) / 16 * 16;
    const uint64_t begin = static_cast<uint64_t>(unit_index<G>()) * per;
    if (begin >= bytes) {
        return;
    }
    const uint64_t len = per < bytes - begin ? per : bytes - begin;
    if constexpr (kGet) {
        shmem::getmem_nbi(g, ctx, local + begin, symmetric + begin, len, pe);
    } else {
        shmem::putmem_nbi(g, ctx, symmetric + begin, local + begin, len, pe);
    }
}

// The last four split tile::notify/wait<gpu>'s cost from the hand-written ping-pong's: the bounded poll loop alone
// (spin_until, no group barrier or proxy fence) behind a hand-written store; tile::notify behind a hand-written wait;
// and notify's two differences from the hand-written store, one at a time: a red.add instead of a st, and the peer's
// address translated (symm_at: a load of the peer-base table) on every send instead of once. The tile::notify rows
// with `peer_signal` translate the peer's word once before the loop (tile::PeerSignal), as a kernel that signals one
// peer many times should; `set` raises the round's value with SignalOp::kSet (a st.release, as the hand-written
// rows), `add` adds 1 (a red.release.add).
enum class PingPong : int {
    kRawGpu = 0,
    kRawSys,
    kTileGpu,
    kTileSys,
    kShmemSys,
    kPutSignalSys,
    kPutSignalOddSys,
    kSpinGpu,
    kNotifyRawWaitGpu,
    kRedGpu,
    kSymmAtStGpu,
    kTilePeerAddGpu,
    kTilePeerSetGpu,
    kTilePeerAddSys,
    kTilePeerSetSys,
    kCount
};
const char* ping_pong_name(PingPong v) {
    switch (v) {
        case PingPong::kRawGpu: return "hand-written st.release/ld.acquire .gpu";
        case PingPong::kRawSys: return "hand-written st.release/ld.acquire .sys";
        case PingPong::kTileGpu: return "tile::notify/wait<gpu>";
        case PingPong::kTileSys: return "tile::notify/wait<sys>";
        case PingPong::kShmemSys: return "shmem::signal_op/signal_wait_until";
        case PingPong::kPutSignalSys: return "shmem::putmem_signal 8 B + wait";
        case PingPong::kPutSignalOddSys: return "shmem::putmem_signal 3 B unaligned + wait";
        case PingPong::kSpinGpu: return "st.release + spin_until<gpu> (no fence)";
        case PingPong::kNotifyRawWaitGpu: return "tile::notify<gpu> + ld.acquire loop";
        case PingPong::kRedGpu: return "red.release.gpu.add + ld.acquire loop";
        case PingPong::kSymmAtStGpu: return "symm_at each time + st.release + ld.acquire";
        case PingPong::kTilePeerAddGpu: return "tile::notify(peer_signal, add)/wait<gpu>";
        case PingPong::kTilePeerSetGpu: return "tile::notify(peer_signal, set)/wait<gpu>";
        case PingPong::kTilePeerAddSys: return "tile::notify(peer_signal, add)/wait<sys>";
        case PingPong::kTilePeerSetSys: return "tile::notify(peer_signal, set)/wait<sys>";
        case PingPong::kCount: break;
    }
    return "?";
}

// Whether a variant signals at GPU scope (its ratio is to the hand-written .gpu ping-pong), else system scope.
bool ping_pong_gpu_scope(PingPong v) {
    switch (v) {
        case PingPong::kRawGpu:
        case PingPong::kTileGpu:
        case PingPong::kSpinGpu:
        case PingPong::kNotifyRawWaitGpu:
        case PingPong::kRedGpu:
        case PingPong::kSymmAtStGpu:
        case PingPong::kTilePeerAddGpu:
        case PingPong::kTilePeerSetGpu: return true;
        default: return false;
    }
}

// The minimal baseline: no backoff, and no clock read on the way to a value that comes within 2^16 polls; past
// that, the clock every 2^16 polls, to give up after kRawWaitNs.
constexpr uint64_t kRawWaitNs = 10'000'000'000ull;

template <ptx::Scope C>
__device__ bool raw_wait(const uint64_t* sig, uint64_t value) {
    uint64_t first_check = 0;
    for (uint32_t polls = 1;; ++polls) {
        if (ptx::ld<ptx::Sem::kAcquire, C>(sig) >= value) {
            return true;
        }
        if ((polls & 0xffffu) == 0) {
            const uint64_t now = ptx::globaltimer();
            if (first_check == 0) {
                first_check = now;
            } else if (now - first_check > kRawWaitNs) {
                return false;
            }
        }
    }
}

// One thread per rank. Rank 0 sends i and waits for i back; rank 1 echoes. Rank 0 times `iters`
// round trips (after `warmup` untimed ones) with %globaltimer.
__global__ void ping_pong_kernel(DeviceCtx ctx, PingPong v, uint64_t* sig, uint8_t* data, int warmup, int iters,
                                 uint64_t* result_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) {
        return;
    }
    const int me = ctx.rank;
    const int peer = 1 - me;
    uint64_t* peer_sig = tile::symm_at(ctx, sig, peer);
    const tile::PeerSignal peer_word = tile::peer_signal(ctx, sig, peer);
    bool ok = true;
    const auto send = [&](uint64_t i) {
        switch (v) {
            case PingPong::kRawGpu:
            case PingPong::kSpinGpu: ptx::st<ptx::Sem::kRelease, ptx::Scope::kGpu>(peer_sig, i); break;
            case PingPong::kNotifyRawWaitGpu: tile::notify<ptx::Scope::kGpu>(Thread{}, ctx, sig, peer, 1); break;
            case PingPong::kRedGpu: ptx::red_add<ptx::Sem::kRelease, ptx::Scope::kGpu>(peer_sig, 1); break;
            case PingPong::kSymmAtStGpu:
                ptx::st<ptx::Sem::kRelease, ptx::Scope::kGpu>(tile::symm_at(ctx, sig, peer), i);
                break;
            case PingPong::kRawSys: ptx::st<ptx::Sem::kRelease, ptx::Scope::kSys>(peer_sig, i); break;
            case PingPong::kTileGpu: tile::notify<ptx::Scope::kGpu>(Thread{}, ctx, sig, peer, 1); break;
            case PingPong::kTileSys: tile::notify(Thread{}, ctx, sig, peer, 1); break;
            case PingPong::kTilePeerAddGpu: tile::notify<ptx::Scope::kGpu>(Thread{}, peer_word, 1); break;
            case PingPong::kTilePeerSetGpu:
                tile::notify<ptx::Scope::kGpu>(Thread{}, peer_word, i, SignalOp::kSet);
                break;
            case PingPong::kTilePeerAddSys: tile::notify(Thread{}, peer_word, 1); break;
            case PingPong::kTilePeerSetSys: tile::notify(Thread{}, peer_word, i, SignalOp::kSet); break;
            case PingPong::kShmemSys: shmem::signal_op(Thread{}, ctx, sig, 1, SignalOp::kAdd, peer); break;
            case PingPong::kPutSignalSys:
                shmem::putmem_signal(Thread{}, ctx, data, data + 64, 8, sig, 1, SignalOp::kAdd, peer);
                break;
            case PingPong::kPutSignalOddSys:  // odd size and addresses: three 1-byte words
                shmem::putmem_signal(Thread{}, ctx, data + 1, data + 64 + 5, 3, sig, 1, SignalOp::kAdd, peer);
                break;
            case PingPong::kCount: break;
        }
    };
    const auto wait = [&](uint64_t i) {
        switch (v) {
            case PingPong::kRawGpu:
            case PingPong::kNotifyRawWaitGpu:
            case PingPong::kRedGpu:
            case PingPong::kSymmAtStGpu: ok = ok && raw_wait<ptx::Scope::kGpu>(sig, i); break;
            case PingPong::kSpinGpu:
                device::spin_until<ptx::Sem::kAcquire, ptx::Scope::kGpu>(
                    ctx, sig, Cmp::kGe, i, device::SpinSite{SpinKind::kSignalWait, peer, __LINE__});
                break;
            case PingPong::kRawSys: ok = ok && raw_wait<ptx::Scope::kSys>(sig, i); break;
            case PingPong::kTileGpu:
            case PingPong::kTilePeerAddGpu:
            case PingPong::kTilePeerSetGpu: tile::wait<ptx::Scope::kGpu>(Thread{}, ctx, sig, 1, Cmp::kGe, i); break;
            case PingPong::kTileSys:
            case PingPong::kTilePeerAddSys:
            case PingPong::kTilePeerSetSys: tile::wait(Thread{}, ctx, sig, 1, Cmp::kGe, i); break;
            case PingPong::kShmemSys:
            case PingPong::kPutSignalSys:
            case PingPong::kPutSignalOddSys: shmem::signal_wait_until(Thread{}, ctx, sig, Cmp::kGe, i); break;
            case PingPong::kCount: break;
        }
    };
    uint64_t start = 0;
    const int total = warmup + iters;
    for (int k = 1; k <= total && ok; ++k) {
        if (k == warmup + 1) {
            start = ptx::globaltimer();
        }
        const auto i = static_cast<uint64_t>(k);
        if (me == 0) {
            send(i);
            wait(i);
        } else {
            wait(i);
            send(i);
        }
    }
    if (me == 0) {
        *result_ns = ok ? ptx::globaltimer() - start : ~0ull;
    }
}

template <class G>
__global__ void barrier_kernel(DeviceCtx ctx, uint64_t* psync, int warmup, int iters, uint64_t* result_ns) {
    G g;
    if constexpr (std::is_same_v<G, Thread>) {
        if (threadIdx.x != 0) {
            return;
        }
    }
    for (int k = 0; k < warmup; ++k) {
        shmem::barrier_all(g, ctx, psync);
    }
    const uint64_t start = ptx::globaltimer();
    for (int k = 0; k < iters; ++k) {
        shmem::barrier_all(g, ctx, psync);
    }
    if (g.is_leader()) {
        *result_ns = ptx::globaltimer() - start;
    }
}

// ------------------------------------------------------------------------------------------------
// Host side.

class Stream {
public:
    Stream() { WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
    ~Stream() { cudaStreamDestroy(s_); }
    operator cudaStream_t() const { return s_; }

private:
    cudaStream_t s_ = nullptr;
};

constexpr int kScopes = 3;
const char* kScopeNames[kScopes] = {"thread", "warp", "block"};

struct BandwidthRow {
    uint64_t bytes = 0;
    double roofline_gbps = 0;      // the copy in the puts' direction
    double roofline_get_gbps = 0;  // the copy in the gets' direction (the same copy when the ranks share a GPU)
    double put_gbps[kScopes] = {};
    double get_gbps[kScopes] = {};
    bool checked = false;
    uint64_t mismatches = 0;
};

struct PingPongRow {
    PingPong variant;
    double round_trip_us = 0;
    bool skipped = false;  // a .gpu-scope variant between ranks on different GPUs: kGpuScopeAcrossGpus says why
};

constexpr const char* kGpuScopeAcrossGpus = "a .gpu-scope release/acquire does not order memory for another GPU";

struct BarrierRow {
    int world;
    const char* group;
    double us = 0;
};

constexpr uint64_t kPoolBytes = 256ull << 20;  // rotate through this much memory (> 4x the 60 MB L2)

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Times `iters` operations launched back to back on `stream` (after `warmup`) and returns GB/s (bytes per op / time
// per op).
template <class Launch>
double time_gbps(cudaStream_t stream, uint64_t bytes, int warmup, int iters, const Launch& launch) {
    const double ms = time_batch_ms(stream, warmup, iters, launch);
    return static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
}

template <class G, bool kGet>
void launch_bandwidth(int blocks, int threads, cudaStream_t stream, const DeviceCtx& ctx, uint8_t* local,
                      uint8_t* symmetric, uint64_t bytes, int pe) {
    bandwidth_kernel<G, kGet><<<blocks, threads, 0, stream>>>(ctx, local, symmetric, bytes, pe);
}

// The most threads per block every put/get kernel launches with on this GPU (their registers bound it).
int bandwidth_max_threads() {
    int most = 1024;
    const auto take = [&](const void* kernel) {
        cudaFuncAttributes attr{};
        WEFT_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
        most = std::min(most, attr.maxThreadsPerBlock);
    };
    take(reinterpret_cast<const void*>(bandwidth_kernel<Thread, false>));
    take(reinterpret_cast<const void*>(bandwidth_kernel<Warp, false>));
    take(reinterpret_cast<const void*>(bandwidth_kernel<Block, false>));
    take(reinterpret_cast<const void*>(bandwidth_kernel<Thread, true>));
    take(reinterpret_cast<const void*>(bandwidth_kernel<Warp, true>));
    take(reinterpret_cast<const void*>(bandwidth_kernel<Block, true>));
    return most;
}

uint64_t count_mismatches(cudaStream_t stream, const uint8_t* p, uint64_t bytes, uint64_t seed) {
    unsigned long long* bad = nullptr;
    WEFT_CUDA_CHECK(cudaMalloc(&bad, sizeof(*bad)));
    WEFT_CUDA_CHECK(cudaMemsetAsync(bad, 0, sizeof(*bad), stream));
    count_mismatches_kernel<<<264, 256, 0, stream>>>(p, bytes, seed, bad);
    unsigned long long h = 0;
    WEFT_CUDA_CHECK(cudaMemcpyAsync(&h, bad, sizeof(h), cudaMemcpyDeviceToHost, stream));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaFree(bad);
    return h;
}

// Two ranks on one world: rank 0 puts to / gets from rank 1 while rank 1 waits at the host barrier. Each rank records
// its GPU in rank_devices[rank].
void run_bandwidth(World& w, const Options& o, std::vector<BandwidthRow>* rows, std::array<int, 2>* rank_devices) {
    (*rank_devices)[static_cast<size_t>(w.rank())] = w.device();
    const bool spread = o.placement == Placement::kSpread;
    Stream stream;
    const uint64_t max_size = *std::max_element(o.sizes.begin(), o.sizes.end());
    const int max_threads = bandwidth_max_threads();
    if (o.block_threads > max_threads) {
        throw UsageError("--block-threads " + std::to_string(o.block_threads) +
                         ": the put/get kernels launch with at most " + std::to_string(max_threads) +
                         " threads per block on this GPU (their registers)");
    }
    const uint64_t pool = std::max(kPoolBytes, round_up(max_size, 256));
    auto* symmetric = static_cast<uint8_t*>(w.heap().alloc(pool));
    uint8_t* local = nullptr;
    WEFT_CUDA_CHECK(cudaMalloc(&local, pool));
    const uint64_t seed_a = 0x1234567ull + static_cast<uint64_t>(w.rank());
    const uint64_t seed_b = 0xabcdefull;
    const uint64_t seed_poison = 0x5a5a5a5aull;  // neither pattern: what a check must not find
    fill_kernel<<<264, 256, 0, stream>>>(local, pool, seed_a);
    fill_kernel<<<264, 256, 0, stream>>>(symmetric, pool, seed_b);
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const DeviceCtx ctx = w.device_ctx();
    const int blocks = w.sm_budget();
    // Rank 1's heap as this rank maps it: what the put kernels write, the get kernels read and, with the ranks on two
    // GPUs, what the copy-engine roofline copies to and from.
    uint8_t* const peer = w.heap().symm_at(symmetric, 1);
    WEFT_CHECK(peer != nullptr, "rank " << w.rank() << " (GPU " << w.device()
                                        << ") cannot reach rank 1's heap: the ranks' GPUs need peer access to each "
                                           "other (cudaDeviceCanAccessPeer) and one node (WEFT_VIRTUAL_NODES unset)");
    w.barrier();
    for (uint64_t bytes : o.sizes) {
        BandwidthRow row;
        row.bytes = bytes;
        const PoolRotation rotation(pool, bytes);
        const auto offset = [&](int k) { return rotation.offset(k); };
        if (w.rank() == 0) {
            // The copy a user would otherwise make: the copy engine, into the puts' destination on rank 1's GPU
            // (spread), or within the one GPU (shared).
            uint8_t* const copy_dst = spread ? peer : symmetric;
            row.roofline_gbps = time_gbps(stream, bytes, o.warmup, o.iters, [&](int k) {
                WEFT_CUDA_CHECK(
                    cudaMemcpyAsync(copy_dst + offset(k), local + offset(k), bytes, cudaMemcpyDefault, stream));
            });
            if (o.check && spread) {
                // The copy left pattern A where the puts write: poison it, so that the check sees the puts' bytes.
                fill_kernel<<<264, 256, 0, stream>>>(peer, pool, seed_poison);
                WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
            }
            const auto put = [&](auto launcher) {
                return time_gbps(stream, bytes, o.warmup, o.iters, [&](int k) {
                    launcher(blocks, o.block_threads, stream, ctx, local + offset(k), symmetric + offset(k), bytes, 1);
                });
            };
            row.put_gbps[0] = put(launch_bandwidth<Thread, false>);
            row.put_gbps[1] = put(launch_bandwidth<Warp, false>);
            row.put_gbps[2] = put(launch_bandwidth<Block, false>);
            if (o.check) {
                // Rank 1's slot 0 now holds rank 0's local slot 0 (pattern A).
                row.mismatches += count_mismatches(stream, peer, bytes, seed_a);
            }
        }
        w.barrier();
        if (o.check && w.rank() == 1) {
            fill_kernel<<<264, 256, 0, stream>>>(symmetric, pool, seed_b);  // pattern B for the gets
            WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
        }
        w.barrier();
        if (w.rank() == 0) {
            if (spread) {
                // The gets' direction: GPU 1 -> GPU 0, issued on GPU 0 as the gets are.
                row.roofline_get_gbps = time_gbps(stream, bytes, o.warmup, o.iters, [&](int k) {
                    WEFT_CUDA_CHECK(
                        cudaMemcpyAsync(local + offset(k), peer + offset(k), bytes, cudaMemcpyDefault, stream));
                });
                if (o.check) {
                    // As for the puts: the copy left pattern B where the gets write.
                    fill_kernel<<<264, 256, 0, stream>>>(local, pool, seed_poison);
                    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
                }
            } else {
                row.roofline_get_gbps = row.roofline_gbps;  // one GPU: the same device-to-device copy either way
            }
            const auto get = [&](auto launcher) {
                return time_gbps(stream, bytes, o.warmup, o.iters, [&](int k) {
                    launcher(blocks, o.block_threads, stream, ctx, local + offset(k), symmetric + offset(k), bytes, 1);
                });
            };
            row.get_gbps[0] = get(launch_bandwidth<Thread, true>);
            row.get_gbps[1] = get(launch_bandwidth<Warp, true>);
            row.get_gbps[2] = get(launch_bandwidth<Block, true>);
            if (o.check) {
                row.mismatches += count_mismatches(stream, local, bytes, seed_b);
                fill_kernel<<<264, 256, 0, stream>>>(local, pool, seed_a);  // pattern A again for the next puts
                WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
                row.checked = true;
            }
            rows->push_back(row);
        }
        w.barrier();
    }
    w.barrier();
    cudaFree(local);
    w.heap().free(symmetric);
}

void run_ping_pong(World& w, const Options& o, std::vector<PingPongRow>* rows) {
    Stream stream;
    const int iters = std::max(2000, o.iters * 500);
    const int warmup = std::max(100, o.warmup * 50);
    auto* data = static_cast<uint8_t*>(w.heap().alloc(256));
    uint64_t* result = nullptr;
    WEFT_CUDA_CHECK(cudaMalloc(&result, sizeof(uint64_t)));
    const bool across_gpus = w.num_ranks_on_device() == 1;  // two ranks: the peer is on another GPU
    for (int v = 0; v < static_cast<int>(PingPong::kCount); ++v) {
        const auto variant = static_cast<PingPong>(v);
        if (across_gpus && ping_pong_gpu_scope(variant)) {
            if (w.rank() == 0) rows->push_back(PingPongRow{variant, 0, true});
            continue;  // every rank skips the same variants: no collective call is left unmatched
        }
        uint64_t* sig = w.heap().alloc_signals(1);  // fresh words: every variant counts from zero
        w.barrier();
        ping_pong_kernel<<<1, 32, 0, stream>>>(w.device_ctx(), variant, sig, data, warmup, iters, result);
        WEFT_CUDA_CHECK(cudaGetLastError());
        w.sync_and_check(stream);
        if (w.rank() == 0) {
            uint64_t ns = 0;
            WEFT_CUDA_CHECK(cudaMemcpy(&ns, result, sizeof(ns), cudaMemcpyDeviceToHost));
            WEFT_CHECK(ns != ~0ull, ping_pong_name(variant) << ": the hand-written wait gave up (no value in 10 s)");
            rows->push_back(PingPongRow{variant, static_cast<double>(ns) / iters / 1e3});
        }
        w.barrier();
        w.heap().free(sig);
    }
    cudaFree(result);
    w.heap().free(data);
}

void run_barrier(World& w, const Options& o, std::vector<BarrierRow>* rows) {
    Stream stream;
    const int iters = std::max(1000, o.iters * 100);
    const int warmup = std::max(50, o.warmup * 20);
    uint64_t* psync = w.heap().alloc_signals(static_cast<uint64_t>(w.num_ranks()));
    uint64_t* result = nullptr;
    WEFT_CUDA_CHECK(cudaMalloc(&result, sizeof(uint64_t)));
    for (int g = 0; g < 2; ++g) {
        w.barrier();
        if (g == 0) {
            barrier_kernel<Thread><<<1, 32, 0, stream>>>(w.device_ctx(), psync, warmup, iters, result);
        } else {
            barrier_kernel<Block><<<1, 128, 0, stream>>>(w.device_ctx(), psync, warmup, iters, result);
        }
        WEFT_CUDA_CHECK(cudaGetLastError());
        w.sync_and_check(stream);
        if (w.rank() == 0) {
            uint64_t ns = 0;
            WEFT_CUDA_CHECK(cudaMemcpy(&ns, result, sizeof(ns), cudaMemcpyDeviceToHost));
            rows->push_back(BarrierRow{w.num_ranks(), g == 0 ? "thread" : "block", static_cast<double>(ns) / iters / 1e3});
        }
    }
    w.barrier();
    cudaFree(result);
    w.heap().free(psync);
}

// The put/get bandwidth table, below its caption: size, roofline, the three put scopes, the gets' own roofline
// (`get_roofline`: spread, where the copy back is another copy), the three get scopes, best/r, and with `check` the
// rows' check. False when a checked row has mismatches.
bool print_bandwidth_table(const std::vector<BandwidthRow>& rows, bool get_roofline, bool check) {
    std::printf("%8s %9s | %9s %9s %9s | ", "size", "roofline", "put.thrd", "put.warp", "put.block");
    if (get_roofline) std::printf("%9s ", "rfl.get");
    std::printf("%9s %9s %9s | %6s%s\n", "get.thrd", "get.warp", "get.block", "best/r", check ? "  check" : "");
    bool all_ok = true;
    for (const BandwidthRow& r : rows) {
        const double best_put = std::max({r.put_gbps[0], r.put_gbps[1], r.put_gbps[2]});
        const double best_get = std::max({r.get_gbps[0], r.get_gbps[1], r.get_gbps[2]});
        const double best_ratio = std::max(best_put / r.roofline_gbps, best_get / r.roofline_get_gbps);
        const char* checked = r.checked ? (r.mismatches == 0 ? "  ok" : "  FAILED") : "";
        std::printf("%8s %9.1f | %9.1f %9.1f %9.1f | ", format_bytes(r.bytes).c_str(), r.roofline_gbps, r.put_gbps[0],
                    r.put_gbps[1], r.put_gbps[2]);
        if (get_roofline) std::printf("%9.1f ", r.roofline_get_gbps);
        std::printf("%9.1f %9.1f %9.1f | %6.2f%s\n", r.get_gbps[0], r.get_gbps[1], r.get_gbps[2], best_ratio, checked);
        all_ok = all_ok && r.mismatches == 0;
    }
    return all_ok;
}

int run(int argc, char** argv) {
    const Options o = parse_options(argc, argv);
    int num_devices = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&num_devices));
    check_placement(o.placement, num_devices);
    const bool spread = o.placement == Placement::kSpread;
    int sms = 0;
    cudaDeviceProp prop{};
    WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    sms = prop.multiProcessorCount;
    const Peaks peaks = measure_peaks(kPeakCopy);
    const uint64_t max_size = *std::max_element(o.sizes.begin(), o.sizes.end());
    // shared: every rank on GPU 0 ("remote" memory is local HBM, the D2D copy roofline applies, and the .gpu-scope
    // ping-pong is valid). spread: -1, run_local's rank % visible GPUs.
    const int world_device = spread ? -1 : 0;

    // Bandwidth: rank 1 is idle while rank 0 measures, so rank 0 may use every SM (spread: each rank has a GPU of its
    // own, whose SMs the default budget gives it).
    std::vector<BandwidthRow> bw;
    std::array<int, 2> bw_devices{};
    WorldOptions big;
    big.heap_bytes = round_up(std::max(kPoolBytes, round_up(max_size, 256)) + (64ull << 20), 2ull << 20);
    big.sm_budget = spread ? 0 : sms;
    big.device = world_device;
    run_local(
        2, [&](World& w) { run_bandwidth(w, o, &bw, &bw_devices); }, big);

    std::vector<PingPongRow> pp;
    WorldOptions small;
    small.heap_bytes = 64ull << 20;
    small.device = world_device;
    run_local(2, [&](World& w) { run_ping_pong(w, o, &pp); }, small);

    std::vector<BarrierRow> bar;
    for (int n : o.worlds) {
        run_local(n, [&](World& w) { run_barrier(w, o, &bar); }, small);
    }

    // Table.
    char where[160];
    if (spread) {
        std::snprintf(where, sizeof(where), "ranks spread over %d GPUs (rank 0 on GPU %d, rank 1 on GPU %d)",
                      num_devices, bw_devices[0], bw_devices[1]);
    } else {
        std::snprintf(where, sizeof(where), "ranks share one GPU");
    }
    std::printf("weft primitives benchmark: %s (%d SMs), %s, %s, iters %d, warmup %d, dtype %s%s\n", prop.name, sms,
                utc_date().c_str(), where, o.iters, o.warmup, dtype_name(o.dtype), o.check ? ", checked" : "");
    std::printf("%s\n", describe(peaks).c_str());
    if (spread) {
        const int d0 = bw_devices[0], d1 = bw_devices[1];
        std::printf(
            "\nput/get bandwidth, rank 0 (GPU %d) <-> rank 1 (GPU %d), %d threads per block (GB/s = bytes / time; "
            "put: rank 0 writes rank 1's heap, roofline = cudaMemcpyAsync GPU%d->GPU%d of the same bytes; "
            "get: rank 0 reads rank 1's heap, rfl.get = cudaMemcpyAsync GPU%d->GPU%d issued on GPU %d; "
            "best/r: the better of best put / roofline and best get / rfl.get)\n",
            d0, d1, o.block_threads, d0, d1, d1, d0, d0);
    } else {
        std::printf(
            "\nput/get bandwidth, rank 0 <-> rank 1, %d threads per block (GB/s = bytes / time; roofline = cudaMemcpy "
            "D2D of the same bytes)\n",
            o.block_threads);
    }
    const bool all_ok = print_bandwidth_table(bw, spread, o.check);
    std::printf("\nsignal round trip, 2 ranks, one thread each (us per round trip; ratio to the hand-written ping-pong at the same scope)\n");
    double raw_gpu = 0, raw_sys = 0;
    for (const PingPongRow& r : pp) {
        if (r.variant == PingPong::kRawGpu) raw_gpu = r.round_trip_us;
        if (r.variant == PingPong::kRawSys) raw_sys = r.round_trip_us;
    }
    for (const PingPongRow& r : pp) {
        if (r.skipped) {
            std::printf("%-44s skipped: %s\n", ping_pong_name(r.variant), kGpuScopeAcrossGpus);
            continue;
        }
        const double base = ping_pong_gpu_scope(r.variant) ? raw_gpu : raw_sys;
        std::printf("%-44s %8.3f %6.2f\n", ping_pong_name(r.variant), r.round_trip_us, base > 0 ? r.round_trip_us / base : 0.0);
    }
    char round_robin[128] = "";
    if (spread) {
        std::snprintf(round_robin, sizeof(round_robin),
                      "; a world's ranks go over the %d GPUs round robin: rank r on GPU r %% %d", num_devices,
                      num_devices);
    }
    std::printf("\nbarrier_all latency (us per barrier, one group per rank%s)\n%6s %7s %9s\n", round_robin, "world",
                "group", "us");
    for (const BarrierRow& r : bar) {
        std::printf("%6d %7s %9.3f\n", r.world, r.group, r.us);
    }

    if (!o.json.empty()) {
        Json j;
        j.begin_object().field("bench", "primitives").field("device", prop.name).field("sms", sms);
        j.field("date", utc_date()).field("iters", o.iters).field("warmup", o.warmup);
        j.field("dtype", dtype_name(o.dtype));
        j.field("placement", placement_name(o.placement)).field("gpus", num_devices);
        j.field("block_threads", o.block_threads);
        j.key("rank_devices").begin_array(true).value(bw_devices[0]).value(bw_devices[1]).end_array();
        j.field("roofline_copy", spread ? "cudaMemcpyAsync GPU to GPU (put: rank 0's GPU to rank 1's, get: back)"
                                        : "cudaMemcpyAsync D2D");
        add_peaks(j, peaks);
        j.key("bandwidth_gbps").begin_array();
        for (const BandwidthRow& r : bw) {
            j.begin_object(true).field("bytes", r.bytes).field("roofline", r.roofline_gbps);
            if (spread) j.field("roofline_get", r.roofline_get_gbps);
            for (int s = 0; s < kScopes; ++s) j.field(std::string("put_") + kScopeNames[s], r.put_gbps[s]);
            for (int s = 0; s < kScopes; ++s) j.field(std::string("get_") + kScopeNames[s], r.get_gbps[s]);
            if (r.checked) j.field("mismatches", r.mismatches);
            j.end_object();
        }
        j.end_array().key("round_trip_us").begin_array();
        for (const PingPongRow& r : pp) {
            j.begin_object(true).field("variant", ping_pong_name(r.variant));
            if (r.skipped) {
                j.field("us", nullptr).field("skipped", kGpuScopeAcrossGpus);
            } else {
                j.field("us", r.round_trip_us);
            }
            j.end_object();
        }
        j.end_array().key("barrier_us").begin_array();
        for (const BarrierRow& r : bar) {
            j.begin_object(true).field("world", r.world).field("group", r.group).field("us", r.us).end_object();
        }
        j.end_array().end_object();
        write_json_file(o.json, j);
        std::printf("\nwrote %s\n", o.json.c_str());
    }
    return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace weft::bench

int main(int argc, char** argv) {
    return weft::bench::run_main("weft_bench_primitives", [&] { return weft::bench::run(argc, argv); });
}
