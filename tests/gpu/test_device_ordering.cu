// SPDX-License-Identifier: MIT
// GPU stress tests of ordering: put-with-signal, fence and quiet, tile notify/wait with many signals.
// Thousands of iterations with random delays; the consumer never sees a signal before its data.
#include <gtest/gtest.h>

#include <cstdint>
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
using device::Token;
using device::Warp;
namespace shmem = device::shmem;
namespace tile = device::tile;
using test::finish;
using test::run_world;

constexpr int kThreads = 128;
constexpr int kSlots = 4;  // messages in flight per ring

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

// Byte `idx` of message number `k` that rank `src` sends.
__host__ __device__ inline uint8_t msg_byte(uint64_t seed, int src, uint64_t k, uint64_t idx) {
    return static_cast<uint8_t>(test::mix64(seed ^ (static_cast<uint64_t>(src) << 56) ^ (k << 24) ^ idx) >> 8);
}

// Records one error: the count, and the first message number that was wrong.
__device__ inline void record_error(unsigned long long* errors, uint64_t k) {
    atomicAdd(errors, 1ull);
    atomicCAS(errors + 1, 0ull, static_cast<unsigned long long>(k) + 1);
}

// The buffers of one ring (rank r sends to r + 1): symmetric slots and signals, local staging.
struct Ring {
    uint8_t* data;       // symmetric, kSlots * stride bytes
    uint64_t* data_sig;  // symmetric: messages received here
    uint64_t* ack;       // symmetric: messages the next rank has consumed
    uint64_t* flag;      // symmetric: set-style flag (fence / quiet modes)
    uint8_t* staging;    // local source of the puts
    uint64_t stride;
};

// ---------------------------------------------------------------------------------------------------
// putmem_signal: block 0 produces to the next rank, block 1 consumes from the previous one.

template <class G>
__global__ void put_signal_ring_kernel(DeviceCtx ctx, Ring ring, uint64_t msg_bytes, uint32_t dst_off, uint64_t base,
                                       int iters, uint64_t seed, unsigned long long* errors) {
    G g;
    if (!first_in_block<G>()) {
        return;
    }
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    const int next = (me + 1) % n;
    const int prev = (me + n - 1) % n;
    for (int i = 0; i < iters; ++i) {
        const uint64_t k = base + static_cast<uint64_t>(i);
        uint8_t* slot = ring.data + (k % kSlots) * ring.stride + dst_off;
        if (blockIdx.x == 0) {
            if (k >= kSlots) {  // the next rank has consumed the message that used this slot
                shmem::signal_wait_until(g, ctx, ring.ack, Cmp::kGe, k - kSlots + 1);
            }
            for (uint64_t idx = g.rank(); idx < msg_bytes; idx += g.size()) {
                ring.staging[idx] = msg_byte(seed, me, k, idx);
            }
            g.sync();
            test::random_delay(seed, (k << 12) ^ (threadIdx.x << 1), 1000);
            shmem::putmem_signal(g, ctx, slot, ring.staging, msg_bytes, ring.data_sig, 1, SignalOp::kAdd, next);
        } else {
            shmem::signal_wait_until(g, ctx, ring.data_sig, Cmp::kGe, k + 1);
            for (uint64_t idx = g.rank(); idx < msg_bytes; idx += g.size()) {
                if (slot[idx] != msg_byte(seed, prev, k, idx)) {
                    record_error(errors, k);
                }
            }
            test::random_delay(seed, (k << 12) ^ (threadIdx.x << 1) ^ 1, 500);
            shmem::signal_op(g, ctx, ring.ack, 1, SignalOp::kAdd, prev);
        }
    }
}

struct RingBuffers {
    Ring ring{};
    cudaStream_t stream;
    RingBuffers(World& w, cudaStream_t s, uint64_t stride) : stream(s) {
        // Stream-ordered: cudaMalloc/cudaFree may synchronise the device (and so wait for other ranks'
        // spinning kernels).
        WEFT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&ring.staging), stride, stream));
        ring.data = static_cast<uint8_t*>(w.heap().alloc(kSlots * stride));
        ring.data_sig = w.heap().alloc_signals(1);
        ring.ack = w.heap().alloc_signals(1);
        ring.flag = w.heap().alloc_signals(1);
        WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
        ring.stride = stride;
    }
    void release(World& w) {
        w.barrier();
        cudaFreeAsync(ring.staging, stream);
        w.heap().free(ring.flag);
        w.heap().free(ring.ack);
        w.heap().free(ring.data_sig);
        w.heap().free(ring.data);
    }
};

template <class G>
void run_put_signal_ring(World& w, cudaStream_t stream, RingBuffers& rb, uint64_t* base, uint64_t msg_bytes,
                         uint32_t dst_off, int iters, uint64_t seed) {
    test::DeviceArray<unsigned long long> errors(2, stream);
    put_signal_ring_kernel<G><<<2, kThreads, 0, stream>>>(w.device_ctx(), rb.ring, msg_bytes, dst_off, *base, iters,
                                                          seed, errors.get());
    finish(w, stream, "put_signal_ring_kernel");
    *base += static_cast<uint64_t>(iters);
    const auto err = errors.to_host();
    WEFT_CHECK(err[0] == 0, "putmem_signal<" << group_name<G>() << "> rank " << w.rank() << ": " << err[0]
                                             << " bytes seen before their data (or wrong); first message "
                                             << (err[1] - 1) << " of " << msg_bytes << " bytes [seed " << seed << "]");
    const uint64_t sig = test::to_host(rb.ring.data_sig, 1, stream)[0];
    WEFT_CHECK(sig == *base, "data signal is " << sig << " after " << *base << " messages");
    w.barrier();  // no rank starts the next launch (and signals again) before every rank has checked
}

TEST(DeviceOrdering, PutSignalNeverOvertakesItsData) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    for (int n : test::kWorldSizes) {
        SCOPED_TRACE("world " + std::to_string(n));
        run_world(n, [&](World& w) {
            test::RankStream stream;
            RingBuffers rb(w, stream, 8192);
            uint64_t base = 0;  // messages so far: signals carry on across launches (no reset)
            run_put_signal_ring<Block>(w, stream, rb, &base, 4099, 3, 3000, seed);
            run_put_signal_ring<Warp>(w, stream, rb, &base, 1029, 0, 3000, seed);
            run_put_signal_ring<Thread>(w, stream, rb, &base, 131, 5, 2000, seed);
            // Small puts (one access per word, group_copy.hpp: small_copy): 8-, 1-, 4-, 2- and 16-byte words, and
            // 17 bytes just past that path. The staging source is 256-byte aligned; the offset sets the destination's.
            run_put_signal_ring<Thread>(w, stream, rb, &base, 8, 0, 1000, seed);
            run_put_signal_ring<Thread>(w, stream, rb, &base, 3, 5, 1000, seed);
            run_put_signal_ring<Thread>(w, stream, rb, &base, 1, 7, 1000, seed);
            run_put_signal_ring<Warp>(w, stream, rb, &base, 12, 4, 1000, seed);
            run_put_signal_ring<Warp>(w, stream, rb, &base, 6, 2, 1000, seed);
            run_put_signal_ring<Block>(w, stream, rb, &base, 16, 0, 1000, seed);
            run_put_signal_ring<Warp>(w, stream, rb, &base, 17, 1, 1000, seed);
            rb.release(w);
        });
    }
}

// ---------------------------------------------------------------------------------------------------
// fence and quiet: data puts, then fence/quiet, then a plain (relaxed) flag store by another thread.

enum class Mode : int { kFenceThread = 0, kFenceBlock = 1, kQuietBlock = 2 };

template <Mode M>
__global__ void fence_ring_kernel(DeviceCtx ctx, Ring ring, uint64_t msg_bytes, uint64_t base, int iters,
                                  uint64_t seed, unsigned long long* errors) {
    constexpr bool kThreadMode = M == Mode::kFenceThread;
    using G = std::conditional_t<kThreadMode, Thread, Block>;
    G g;
    if (kThreadMode && threadIdx.x != 0) {
        return;
    }
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    const int next = (me + 1) % n;
    const int prev = (me + n - 1) % n;
    // The flag is stored by the block's last thread: fence/quiet must order every thread's puts.
    const bool flag_thread = kThreadMode || threadIdx.x == blockDim.x - 1;
    for (int i = 0; i < iters; ++i) {
        const uint64_t k = base + static_cast<uint64_t>(i);
        uint8_t* slot = ring.data + (k % kSlots) * ring.stride;
        if (blockIdx.x == 0) {
            if (k >= kSlots) {
                shmem::signal_wait_until(g, ctx, ring.ack, Cmp::kGe, k - kSlots + 1);
            }
            if constexpr (kThreadMode) {
                // Eight 8-byte p's, then fence, then the flag.
                for (uint64_t j = 0; j < msg_bytes / 8; ++j) {
                    uint64_t v = 0;
                    for (int b = 0; b < 8; ++b) {
                        v |= static_cast<uint64_t>(msg_byte(seed, me, k, j * 8 + b)) << (8 * b);
                    }
                    shmem::p(ctx, reinterpret_cast<uint64_t*>(slot) + j, v, next);
                }
                shmem::fence(g, ctx);
            } else {
                for (uint64_t idx = g.rank(); idx < msg_bytes; idx += g.size()) {
                    ring.staging[idx] = msg_byte(seed, me, k, idx);
                }
                g.sync();
                test::random_delay(seed, (k << 12) ^ (threadIdx.x << 1), 1000);
                shmem::putmem_nbi(g, ctx, slot, ring.staging, msg_bytes, next);
                if constexpr (M == Mode::kQuietBlock) {
                    shmem::quiet(g, ctx);
                } else {
                    shmem::fence(g, ctx);
                }
            }
            if (flag_thread) {
                shmem::p(ctx, ring.flag, k + 1, next);  // st.relaxed.sys: ordered only by the fence/quiet
            }
        } else {
            shmem::signal_wait_until(g, ctx, ring.flag, Cmp::kGe, k + 1);
            for (uint64_t idx = g.rank(); idx < msg_bytes; idx += g.size()) {
                if (slot[idx] != msg_byte(seed, prev, k, idx)) {
                    record_error(errors, k);
                }
            }
            shmem::signal_op(g, ctx, ring.ack, 1, SignalOp::kAdd, prev);
        }
    }
}

template <Mode M>
void run_fence_ring(World& w, cudaStream_t stream, RingBuffers& rb, uint64_t* base, uint64_t msg_bytes, int iters,
                    uint64_t seed) {
    test::DeviceArray<unsigned long long> errors(2, stream);
    fence_ring_kernel<M><<<2, kThreads, 0, stream>>>(w.device_ctx(), rb.ring, msg_bytes, *base, iters, seed,
                                                     errors.get());
    finish(w, stream, "fence_ring_kernel");
    *base += static_cast<uint64_t>(iters);
    const auto err = errors.to_host();
    const char* names[] = {"fence(Thread) + p", "fence(Block) + p", "quiet(Block) + p"};
    WEFT_CHECK(err[0] == 0, names[static_cast<int>(M)] << " rank " << w.rank() << ": " << err[0]
                                                       << " bytes seen before their data; first message "
                                                       << (err[1] - 1) << " [seed " << seed << "]");
    w.barrier();
}

TEST(DeviceOrdering, FenceAndQuietOrderPutsBeforeLaterStores) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    for (int n : test::kWorldSizes) {
        SCOPED_TRACE("world " + std::to_string(n));
        run_world(n, [&](World& w) {
            test::RankStream stream;
            RingBuffers rb(w, stream, 4096);
            uint64_t base = 0;  // the flag only grows, the ack counts on: no reset between launches
            run_fence_ring<Mode::kFenceThread>(w, stream, rb, &base, 64, 2000, seed);
            run_fence_ring<Mode::kFenceBlock>(w, stream, rb, &base, 2053, 2000, seed);
            run_fence_ring<Mode::kQuietBlock>(w, stream, rb, &base, 2053, 2000, seed);
            rb.release(w);
        });
    }
}

// ---------------------------------------------------------------------------------------------------
// tile::notify / tile::wait over 40 signals (more than a warp's lanes), consume_token on the data.

constexpr int kChunks = 40;
constexpr int kChunkWords = 24;

__host__ __device__ inline uint32_t chunk_word(uint64_t seed, int src, uint64_t epoch, int chunk, int j) {
    return static_cast<uint32_t>(test::mix64(seed ^ (static_cast<uint64_t>(src) << 56) ^ (epoch << 16) ^
                                             static_cast<uint64_t>(chunk * kChunkWords + j)));
}

// Block 0: its warps write the 40 chunks into the next rank in a per-epoch order, each raising its own
// signal (kPeerSignal: through a tile::PeerSignal translated before the chunk's stores). Block 1: waits for all 40
// with group G, then reads through consume_token.
template <class G, ptx::Scope C, ptx::Sem S, bool kPeerSignal>
__global__ void tile_ring_kernel(DeviceCtx ctx, uint32_t* data, uint64_t* sigs, uint64_t* ack, uint64_t first_epoch,
                                 int iters, uint64_t seed, unsigned long long* errors) {
    const int n = ctx.num_ranks;
    const int me = tile::rank(ctx);
    const int next = (me + 1) % n;
    const int prev = (me + n - 1) % n;
    for (int i = 0; i < iters; ++i) {
        const uint64_t epoch = first_epoch + static_cast<uint64_t>(i);
        if (blockIdx.x == 0) {
            // Wait until the next rank has read the previous epoch's chunks (one slot).
            shmem::signal_wait_until(Block{}, ctx, ack, Cmp::kGe, epoch - 1);
            uint32_t* remote = tile::symm_at(ctx, data, next);
            const int warp = static_cast<int>(threadIdx.x / 32);
            const int lane = static_cast<int>(threadIdx.x % 32);
            for (int pos = warp; pos < kChunks; pos += static_cast<int>(blockDim.x / 32)) {
                const int c = static_cast<int>((static_cast<uint64_t>(pos) * 7 + epoch) % kChunks);
                const tile::PeerSignal chunk_signal =
                    kPeerSignal ? tile::peer_signal(ctx, &sigs[c], next) : tile::PeerSignal{};
                test::random_delay(seed, (epoch << 16) ^ static_cast<uint64_t>(c * 32 + lane), 800);
                for (int j = lane; j < kChunkWords; j += 32) {
                    remote[c * kChunkWords + j] = chunk_word(seed, me, epoch, c, j);
                }
                if constexpr (kPeerSignal) {
                    tile::notify(Warp{}, chunk_signal, 1, SignalOp::kAdd);
                } else {
                    tile::notify(Warp{}, ctx, &sigs[c], next, 1, SignalOp::kAdd);
                }
            }
        } else if (first_in_block<G>()) {
            G g;
            const Token token = tile::wait<C, S>(g, ctx, sigs, kChunks, Cmp::kGe, epoch);
            const uint32_t* d = tile::consume_token(static_cast<const uint32_t*>(data), token);
            for (int idx = static_cast<int>(g.rank()); idx < kChunks * kChunkWords; idx += static_cast<int>(g.size())) {
                if (d[idx] != chunk_word(seed, prev, epoch, idx / kChunkWords, idx % kChunkWords)) {
                    record_error(errors, epoch);
                }
            }
            shmem::signal_op(g, ctx, ack, 1, SignalOp::kAdd, prev);
        }
    }
}

template <class G, ptx::Scope C = ptx::Scope::kSys, ptx::Sem S = ptx::Sem::kAcquire, bool kPeerSignal = false>
void run_tile_ring(World& w, cudaStream_t stream, uint32_t* data, uint64_t* sigs, uint64_t* ack, uint64_t* epoch,
                   int iters, uint64_t seed, const char* what) {
    test::DeviceArray<unsigned long long> errors(2, stream);
    tile_ring_kernel<G, C, S, kPeerSignal><<<2, kThreads, 0, stream>>>(w.device_ctx(), data, sigs, ack, *epoch, iters, seed,
                                                          errors.get());
    finish(w, stream, what);
    *epoch += static_cast<uint64_t>(iters);
    const auto err = errors.to_host();
    WEFT_CHECK(err[0] == 0, what << " rank " << w.rank() << ": " << err[0]
                                 << " words read before their signal arrived; first epoch " << (err[1] - 1)
                                 << " [seed " << seed << "]");
    const auto s = test::to_host(sigs, kChunks, stream);
    for (int c = 0; c < kChunks; ++c) {
        WEFT_CHECK(s[c] == *epoch - 1, what << ": signal " << c << " is " << s[c] << ", expected " << *epoch - 1);
    }
    w.barrier();  // no rank starts the next launch (and signals again) before every rank has checked
}

TEST(DeviceOrdering, TileNotifyWaitManySignals) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    for (int n : test::kWorldSizes) {
        SCOPED_TRACE("world " + std::to_string(n));
        run_world(n, [&](World& w) {
            test::RankStream stream;
            auto* data = w.heap().alloc_array<uint32_t>(kChunks * kChunkWords);
            uint64_t* sigs = w.heap().alloc_signals(kChunks);
            uint64_t* ack = w.heap().alloc_signals(1);
            uint64_t epoch = 1;  // signals only grow: each launch continues where the last stopped
            run_tile_ring<Block>(w, stream, data, sigs, ack, &epoch, 500, seed, "tile::wait<Block>");
            run_tile_ring<Warp>(w, stream, data, sigs, ack, &epoch, 500, seed, "tile::wait<Warp>");
            run_tile_ring<Thread>(w, stream, data, sigs, ack, &epoch, 300, seed, "tile::wait<Thread>");
            run_tile_ring<Block, ptx::Scope::kSys, ptx::Sem::kAcquire, true>(w, stream, data, sigs, ack, &epoch, 300,
                                                                            seed, "tile::notify(PeerSignal)");
            run_tile_ring<Block, ptx::Scope::kSys, ptx::Sem::kRelaxed>(w, stream, data, sigs, ack, &epoch, 300, seed,
                                                                      "tile::wait<Block, sys, relaxed+fence>");
            if (w.num_ranks_on_device() == w.num_ranks()) {
                // .gpu scope is enough only when every rank runs on this GPU.
                run_tile_ring<Block, ptx::Scope::kGpu, ptx::Sem::kAcquire>(w, stream, data, sigs, ack, &epoch, 300,
                                                                          seed, "tile::wait<Block, gpu, acquire>");
            }
            w.barrier();
            w.heap().free(ack);
            w.heap().free(sigs);
            w.heap().free(data);
        });
    }
}

}  // namespace
}  // namespace weft
