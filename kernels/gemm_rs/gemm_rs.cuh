// SPDX-License-Identifier: MIT
// GEMM+ReduceScatter device side: the GEMM's tile scheduler (destination rank+1's rows first, its own last;
// the first load waits until every rank has finished reading the previous call's partials), the epilogue
// hook that raises the destination's per-(source, chunk) counter after each tile's TMA store, and the
// reduction kernel that runs beside the GEMM on a few SMs and sums the partials of its rows in fp32 in the
// order they complete. Every rank's call descriptor (M, n, dtypes, tiles, chunks, mode) goes from each CTA of its
// GEMM into a slot on every peer before any of its tiles counts there; the reader of a peer's partial waits for the
// chunk's count or a differing descriptor, and compares before it reads (kCollectiveMismatch: the reduction's
// CTAs exit, no C is written). The schedule picture and the protocol are in kernels/gemm_rs/README.md.
//
// JIT instantiations (weft::ops::GemmRs builds them):
//   weft::kernels::gemm_rs::rs_gemm_kernel<CFG, weft::kernels::gemm_rs::RsGemmHook<CFG>>   (RsPushHook<CFG> in push
//                                                                                          mode)
//   weft::kernels::gemm_rs::rs_reduce_kernel<PARTIAL_DTYPE, OUT_DTYPE>
#pragma once

#include "gemm/gemm_sm90.cuh"
#include "tp_common/tp_device.cuh"
#include "weft/common/tp_params.hpp"
#include "weft/common/tp_schedule.hpp"
#include "weft/device/tile.cuh"
#include "weft/device/trace.cuh"

namespace weft::kernels::gemm_rs {

namespace tile = device::tile;
using tp_common::arrive_last;
using tp_common::half_bits_to_float;
using tp_common::load8;
using tp_common::load_elem;
using tp_common::load_raw8;
using tp_common::Raw8;
using tp_common::store8;
using tp_common::store_elem;
using tp_common::unpack8;

/// After a tile's TMA store completed: += 1 on destination `dest`'s counter [this rank][chunk of t] (release
/// at system scope, after a proxy fence: TMA wrote the tile). Both modes' epilogue hooks (consumer warpgroup:
/// no calls, no trap; false with a diagnostic recorded when dest is unreachable).
__device__ __forceinline__ bool notify_tile_stored(const DeviceCtx& ctx, uint64_t* counters, const RsGemmOrder& order,
                                                   const GemmTile& t, int32_t dest, int32_t line) {
    const int32_t idx = rs_counter_index(ctx.rank, order.chunk_of(t), order.map.chunks_per_rank());
    ptx::fence_proxy_async_global();
    return tile::notify_checked(device::Thread{}, ctx, counters + idx, dest, 1ull, device::SignalOp::kAdd, line);
}

/// The end of a call on this rank, by one thread once every partial sent to this rank has been read: zero
/// its `num_signals` counters (no source raises one again before it sees `released`; the next call's M, and so the
/// layout, may differ) and the sources' descriptor slots of this call's parity `signatures[num_ranks]` (written again
/// two calls on, by sources that have seen this `released`), then released[rank] += 1
/// on every rank (each source's next GEMM waits for it before its first store into this rank's buffer). Both modes:
/// the push hook's last tile and the reduction. False (diagnostic recorded, no trap) when a rank is unreachable.
__device__ __forceinline__ bool release_received_partials(const DeviceCtx& ctx, uint64_t* counters, int32_t num_signals,
                                                          uint64_t* signatures, uint64_t* released, int32_t line) {
    for (int32_t i = 0; i < num_signals; ++i) ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(counters + i, 0ull);
    for (int32_t i = 0; i < ctx.num_ranks; ++i) ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(signatures + i, 0ull);
    bool ok = true;
    for (int32_t pe = 0; pe < ctx.num_ranks; ++pe) {
        ok = tile::notify_checked(device::Thread{}, ctx, released + ctx.rank, pe, 1ull, device::SignalOp::kAdd, line) &&
             ok;
    }
    return ok;
}

/// Waits (one thread) until source `source`'s count `*counter` of a chunk reaches `need` with its call descriptor
/// `*slot` (this call's parity) equal to `mine`, and returns true; or, once the slot holds another descriptor (0: not
/// written yet this call), records a kCollectiveMismatch diagnostic naming both, raises the abort word and returns
/// false: a source that called with another M sends other counts (never enough, or more than awaited, some on other
/// sources' counters), so the slot, not the count, decides. A timeout or an aborted World: the kTileWait diagnostic,
/// the abort word, false. The slot is polled first: a count is trusted only once its source's descriptor agrees.
/// Inline: no call, no trap.
__device__ __forceinline__ bool wait_count_or_mismatch(const DeviceCtx& ctx, const uint64_t* counter, uint64_t need,
                                                       const uint64_t* slot, uint64_t mine, int32_t source,
                                                       int32_t line) {
    uint64_t theirs = 0, count = 0, waited_ns = 0;
    bool aborted = false;
    const auto probe = [&] {
        theirs = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(slot);
        if (theirs == 0) return false;
        if (theirs != mine) return true;
        count = ptx::ld<ptx::Sem::kAcquire, ptx::Scope::kSys>(counter);
        return count >= need;
    };
    if (!device::detail::poll_bounded(ctx.timeout_ns, ctx.abort_flag, probe, &waited_ns, &aborted)) {
        device::record_diagnostic(ctx, device::SpinSite{SpinKind::kTileWait, source, line}, Cmp::kGe, counter, need,
                                  count, waited_ns, aborted);
        device::raise_abort(ctx);
        return false;
    }
    if (theirs != mine) {
        device::record_diagnostic(ctx, device::SpinSite{SpinKind::kCollectiveMismatch, source, line}, Cmp::kEq, slot,
                                  mine, theirs, 0);
        device::raise_abort(ctx);
        return false;
    }
    return true;
}

/// Persistent striding over RsGemmOrder (cluster-free configs). The first tile of each CTA waits until
/// every rank's reduction has released the previous call's partials (released[s] >= calls completed), so
/// no TMA store overwrites a partial a peer is still reading.
template <GemmConfig kCfg>
class RsGemmScheduler {
public:
    using Params = RsGemmParams;
    static_assert(kCfg.cluster_m == 1 && kCfg.cluster_n == 1, "GEMM+ReduceScatter takes cluster-free configs");

    // NOTE: as AgGemmScheduler, nothing derived is kept in members (the producer has 40 registers).
    __device__ RsGemmScheduler(const Params& p, const GemmArgs& args) : p_(p), n_(args.n) {}

    __device__ int32_t num_tiles() const {
        const int32_t total = order().num_tiles();
        const auto b = static_cast<int32_t>(blockIdx.x);
        return b < total ? (total - 1 - b) / static_cast<int32_t>(gridDim.x) + 1 : 0;
    }
    __device__ GemmTile tile(int32_t i) const {
        return order().tile(static_cast<int32_t>(blockIdx.x) + i * static_cast<int32_t>(gridDim.x));
    }

    __device__ device::Token wait_before_load(const GemmTile&) const {
        if (waited_) return device::Token::assume_local_data();
        waited_ = true;
        const uint64_t calls = ptx::ld(p_.gemm_calls);
        // One thread polls every rank's word in rank order; the wait's proxy fence orders the reads the peers
        // released before the TMA stores that follow overwrite them.
        // A wait that gives up (its Diagnostic recorded, the abort word raised): the kernel runs on (the call's output
        // is not defined; the op throws), as it waits only once.
        return tile::wait_checked(device::Thread{}, p_.ctx, p_.released, p_.ctx.num_ranks, Cmp::kGe, calls).token();
    }

private:
    __device__ RsGemmOrder order() const {
        return RsGemmOrder(kCfg, p_.rows_per_rank, p_.ctx.num_ranks, p_.chunk_rows, n_, p_.ctx.rank);
    }

    const Params& p_;
    int32_t n_;
    mutable bool waited_ = false;
};

/// After each stored tile: += 1 on the destination's counter [this rank][chunk] (release at system scope,
/// after a proxy fence: the tile was written by TMA). The last tile of the call advances gemm_calls.
template <GemmConfig kCfg>
struct RsGemmHook {
    using Params = RsGemmHookParams;
    static constexpr bool kNotifies = true;
    __device__ static bool after_tile_stored(const Params& p, const GemmTile& t) {
        const RsGemmOrder order(kCfg, p.rows_per_rank, p.ctx.num_ranks, p.chunk_rows, p.n, p.ctx.rank);
        if (!notify_tile_stored(p.ctx, p.counters, order, t, order.dest_of(t), __LINE__)) return false;
        if (arrive_last(p.tile_counter, static_cast<uint32_t>(p.num_tiles))) {
            ptx::st(p.gemm_calls, ptx::ld(p.gemm_calls) + 1);
        }
        return true;
    }
};

/// Push mode (no reduction kernel): a tile for peer d goes by TMA straight into d's receive slot for this
/// rank (recv rows [rank * R, (rank+1) * R) on d, R = rows_per_rank), then += 1 on d's counter [rank][chunk]
/// as RsGemmHook does. This rank's own tiles (last in every CTA's order) wait for every peer's counter of
/// their chunk, add the peers' partials from the local receive buffer to the fp32 accumulator and store C
/// through the kernel's tma_d. The call's last stored tile zeroes this rank's counters and releases its
/// receive buffer to every rank (released[rank] += 1; the peers' next GEMM waits for it before its first
/// load), then advances gemm_calls.
template <GemmConfig kCfg>
struct RsPushHook {
    using Params = RsPushHookParams;
    static constexpr bool kNotifies = true;
    static constexpr bool kAddsToTile = true;
    static constexpr bool kRoutesStores = true;
    static_assert(kCfg.out_dtype == DType::kBF16 || kCfg.out_dtype == DType::kF16,
                  "push mode sends 16-bit partials (f32 partials take the pull mode)");

    __device__ static RsGemmOrder order(const Params& p) {
        return RsGemmOrder(kCfg, p.rows_per_rank, p.ctx.num_ranks, p.chunk_rows, p.n, p.ctx.rank);
    }

    /// Own tiles through tma_d (C, [R, n]); a peer's through its receive-slot map. Both maps are R rows high:
    /// a segment's short last M-tile is clipped at the segment's end.
    __device__ static gemm::GemmStoreTarget store_target(const Params& p, const GemmTile& t,
                                                         const ptx::TmaDescriptor* own) {
        const int32_t dest = order(p).dest_of(t);
        const auto* map = dest == p.ctx.rank ? own : reinterpret_cast<const ptx::TmaDescriptor*>(&p.peer_maps[dest]);
        return {map, static_cast<int32_t>(dest * p.rows_per_rank), static_cast<int32_t>(p.rows_per_rank)};
    }

    /// Own tiles only: acc += every peer's partial of this tile. Fragment layout of the accumulator (per 64-row
    /// slab): thread (warp w, lane l) holds rows 16w + l/4 and +8, columns 8g + 2(l%4) + {0, 1} at acc[4g + {0,1}]
    /// and acc[4g + {2,3}]. A wait that gives up, or a peer's differing call descriptor (Diagnostic recorded, the
    /// abort word raised; the same in every thread of the warpgroup), skips the partials and returns true as well: the
    /// kernel runs to its end (no trap: a failure path among the live accumulators would spill them), the tile's
    /// stores are not defined, and the op throws.
    template <GemmConfig kC, int kSlabs, int kAccPerSlab>
    __device__ static bool add_to_tile(const Params& p, const GemmTile& t, float (&acc)[kSlabs][kAccPerSlab], int wg,
                                       int slab0, int tid) {
        const RsGemmOrder o = order(p);
        const int32_t rank = p.ctx.rank;
        const int32_t num_ranks = p.ctx.num_ranks;
        if (o.dest_of(t) != rank) return true;
        const int32_t cpr = o.map.chunks_per_rank();
        const int32_t chunk = o.chunk_of(t);
        // Thread s of the warpgroup waits for peer s's counter of this chunk (checked: no call, no trap among the
        // live accumulators), ending at a peer's differing call descriptor (wait_count_or_mismatch, diagnosed); the
        // warpgroup's barrier extends the acquire to every thread.
        const int32_t sig = o.map.local_signal_at(rank, chunk);
        const auto need = static_cast<uint64_t>(o.map.expected_count(sig));
        WEFT_TRACE_BEGIN(wait_t0);
        {
            const int32_t s = tid;
            const uint64_t* slots = p.signatures + (ptx::ld(p.gemm_calls) & 1u) * static_cast<uint64_t>(num_ranks);
            const bool ok = s >= num_ranks || s == rank ||
                            wait_count_or_mismatch(p.ctx, p.counters + rs_counter_index(s, chunk, cpr), need,
                                                   slots + s, p.signature, s, __LINE__);
            if (!device::Warpgroup{static_cast<uint32_t>(gemm::detail::kBarConsumer0 + wg)}.all(ok)) return true;
        }
        const device::WaitResult waited = tile::wait_each_checked(
            device::Warpgroup{static_cast<uint32_t>(gemm::detail::kBarConsumer0 + wg)}, p.ctx, num_ranks,
            [&](int s) { return s == rank ? nullptr : p.counters + rs_counter_index(s, chunk, cpr); }, Cmp::kGe,
            need);
        if (!waited.ok()) return true;  // the same in every thread of the warpgroup: the partials are not there
        // Traced: "wait chunk" and "reduce" on the warpgroup's consumer track, inside its tile's event.
        WEFT_TRACE_DO(const TraceRole role = wg == 0 ? TraceRole::kConsumer0 : TraceRole::kConsumer1);
        WEFT_TRACE_DO(if (tid == 0) device::trace::record(p.ctx, TraceKind::kWaitChunk, role, wait_t0, sig, sig,
                                                          t.m_idx, t.n_idx));
        WEFT_TRACE_BEGIN(reduce_t0);

        constexpr int kGroups = kC.tile_n / 8;
        constexpr int kBatch = kGroups < 8 ? kGroups : 8;  // 2 x kBatch 4-byte loads in flight per thread
        static_assert(kGroups % kBatch == 0);
        const int warp = tid / 32;
        const int lane = tid % 32;
        const int64_t rows = p.rows_per_rank;
        const auto* recv = tile::consume_token(static_cast<const unsigned char*>(p.recv), waited.token());
#pragma unroll
        for (int si = 0; si < kSlabs; ++si) {
            const int64_t lo = t.m0 - rank * rows + (slab0 + si) * kGemmSlabRows + warp * 16 + lane / 4;
            const bool lo_ok = lo < rows;
            const bool hi_ok = lo + 8 < rows;
            for (int32_t s = 0; s < num_ranks; ++s) {
                if (s == rank) continue;
                // Two base addresses; every load of the tile is at an immediate offset from one of them.
                const int32_t col0 = t.n0 + 2 * (lane % 4);
                const unsigned char* base_lo = recv + ((s * rows + lo) * p.ldr + col0) * 2;
                const unsigned char* base_hi = base_lo + 16 * p.ldr;
#pragma unroll
                for (int g0 = 0; g0 < kGroups; g0 += kBatch) {
                    uint32_t vlo[kBatch];
                    uint32_t vhi[kBatch];
#pragma unroll
                    for (int b = 0; b < kBatch; ++b) {
                        const bool col_ok = col0 + 8 * (g0 + b) < p.n;
                        vlo[b] = lo_ok && col_ok ? ld_l2_u32(base_lo + 16 * (g0 + b)) : 0u;
                        vhi[b] = hi_ok && col_ok ? ld_l2_u32(base_hi + 16 * (g0 + b)) : 0u;
                    }
#pragma unroll
                    for (int b = 0; b < kBatch; ++b) {
                        float* a = &acc[si][4 * (g0 + b)];
                        a[0] += half_bits_to_float<kC.out_dtype>(static_cast<unsigned short>(vlo[b] & 0xffffu));
                        a[1] += half_bits_to_float<kC.out_dtype>(static_cast<unsigned short>(vlo[b] >> 16));
                        a[2] += half_bits_to_float<kC.out_dtype>(static_cast<unsigned short>(vhi[b] & 0xffffu));
                        a[3] += half_bits_to_float<kC.out_dtype>(static_cast<unsigned short>(vhi[b] >> 16));
                        // NOTE: the sums pass through an empty volatile asm, which the next batch's (volatile)
                        // loads may not pass: without it ptxas hoists every load of the tile ahead of the adds
                        // and spills the accumulator to hold them.
                        asm volatile("" : "+f"(a[0]), "+f"(a[1]), "+f"(a[2]), "+f"(a[3]));
                    }
                }
            }
        }
        WEFT_TRACE_DO(if (tid == 0)
                          device::trace::record(p.ctx, TraceKind::kReduce, role, reduce_t0, sig, -1, t.m_idx, t.n_idx));
        return true;
    }

    __device__ static bool after_tile_stored(const Params& p, const GemmTile& t) {
        const RsGemmOrder o = order(p);
        const int32_t dest = o.dest_of(t);
        if (dest != p.ctx.rank && !notify_tile_stored(p.ctx, p.counters, o, t, dest, __LINE__)) return false;  // by TMA
        if (arrive_last(p.tile_counter, static_cast<uint32_t>(p.num_tiles))) {
            // Every own tile waited for all its chunk's counters and has read the peers' partials.
            uint64_t* slots = p.signatures + (ptx::ld(p.gemm_calls) & 1u) * static_cast<uint64_t>(p.ctx.num_ranks);
            if (!release_received_partials(p.ctx, p.counters, o.map.num_signals(), slots, p.released, __LINE__)) {
                return false;
            }
            ptx::st(p.gemm_calls, ptx::ld(p.gemm_calls) + 1);
        }
        return true;
    }

private:
    /// A 4-byte load that skips L1: a line of the receive buffer may straddle a chunk a peer has not written
    /// yet when this SM first touches it (rows are only 16-byte aligned).
    __device__ static uint32_t ld_l2_u32(const unsigned char* ptr) {
        uint32_t v;
        asm volatile("ld.global.cg.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr));
        return v;
    }
};

/// 16-byte partial loads each reduction thread keeps in flight.
inline constexpr int kRsUnroll = 8;

/// The reduction on destination rank d (this rank): for phase 0 .. W-1 it adds the partial of source
/// rs_source_at(d, phase) (rank d-1 first, itself last), chunk by chunk as each chunk's counter reaches
/// expected_count, into an fp32 accumulator (local memory); the last phase writes C in kOut. Every CTA owns
/// the same elements in every phase (grid-stride over 8-element vectors), so the accumulator needs no
/// synchronisation beyond program order. The last CTA to finish zeroes the counters and releases the
/// partials to every rank (released[d] += 1; the sources' next GEMM waits for it before its first load).
// NOTE: as in ar_reduce_kernel, the waits take the checked forms, inline (a call costs registers here): a wait that
// gives up ends the block with `exit`; only an unreachable peer (a programming error) traps.
template <DType kPartial, DType kOut>
__global__ void __launch_bounds__(kTpReduceThreads) rs_reduce_kernel(const RsReduceParams p) {
    __shared__ uint64_t s_epoch;
    if (threadIdx.x == 0) s_epoch = ptx::ld(p.epoch) + 1;
    __syncthreads();
    const uint64_t e = s_epoch;
    const int32_t num_ranks = p.ctx.num_ranks;
    const int32_t rank = p.ctx.rank;
    // The sources' descriptors of this call (its parity: calls completed, the same count as the sources' GEMMs').
    uint64_t* const signatures = p.signatures + ((e - 1) & 1u) * static_cast<uint64_t>(num_ranks);
    const ReduceScatterTileMap map{p.rows_per_rank, num_ranks, p.n, p.tile_m, p.tile_n, p.chunk_rows};
    const int32_t cpr = map.chunks_per_rank();
    const int64_t vecs_per_row = (p.n + kTpVecElems - 1) / kTpVecElems;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t step_rows = stride / vecs_per_row;  // one grid stride, as rows and vectors
    const int64_t step_cols = stride - step_rows * vecs_per_row;
    constexpr int64_t kPBytes = dtype_bytes(kPartial);
    constexpr int64_t kOBytes = dtype_bytes(kOut);

    for (int32_t phase = 0; phase < num_ranks; ++phase) {
        const int32_t source = rs_source_at(rank, phase, num_ranks);
        const bool first_phase = phase == 0;
        const bool last_phase = phase == num_ranks - 1;
        const auto* peer_partial =
            static_cast<const unsigned char*>(device::symm_at_checked(p.ctx, p.partial, source, __LINE__));
        device::trap_unless(peer_partial != nullptr);
        for (int32_t c = 0; c < cpr; ++c) {
            const int32_t sig = map.local_signal_at(rank, c);
            const auto need = static_cast<uint64_t>(map.expected_count(sig));
            // Thread 0 waits for the chunk's counter, the block barrier extends the acquire; the partial's reads
            // take the wait's token.
            WEFT_TRACE_BEGIN(wait_t0);
            if (source != rank) {
                // A peer's count, or its differing descriptor: then every CTA ends here (no C written: this rank's
                // own partial, the last phase, is the only one that writes C).
                bool ok = true;
                if (threadIdx.x == 0) {
                    ok = wait_count_or_mismatch(p.ctx, p.counters + rs_counter_index(source, c, cpr), need,
                                                signatures + source, p.signature, source, __LINE__);
                }
                device::exit_unless(device::Block{}.all(ok));
            }
            // (For a peer's chunk the count is complete by now: the wait acquires it and makes the Token.)
            const device::Token token =
                tile::wait_checked(device::Block{}, p.ctx, p.counters + rs_counter_index(source, c, cpr), 1, Cmp::kGe,
                                   need)
                    .token_or_exit();
            if (threadIdx.x == 0) {
                WEFT_TRACE_RECORD(p.ctx, TraceKind::kWaitChunk, TraceRole::kComm, wait_t0, sig, sig, -1, source);
            }
            WEFT_TRACE_BEGIN(reduce_t0);
            const unsigned char* src_base = tile::consume_token(peer_partial, token);
            const ChunkInfo ch = map.chunk(sig);
            const int64_t local_row0 = ch.row_begin - static_cast<int64_t>(rank) * p.rows_per_rank;
            const int64_t total = ch.num_rows * vecs_per_row;
            // NOTE: a peer's partial is read over NVLink (microseconds a round trip): each thread keeps kRsUnroll
            // 16-byte loads in flight, or R CTAs would move only R * 256 * 16 B per round trip. (row, column) of the
            // flat vector index advance by additions: a 64-bit division per vector bounds the kernel by integer
            // arithmetic (kernels/gemm_rs/README.md, History).
            int64_t row = first / vecs_per_row;
            int64_t col_vec = first - row * vecs_per_row;
            for (int64_t i0 = first; i0 < total; i0 += stride * kRsUnroll) {
                int64_t rows[kRsUnroll];
                int64_t cols[kRsUnroll];
                Raw8<kPartial> raw[kRsUnroll] = {};
#pragma unroll
                for (int u = 0; u < kRsUnroll; ++u) {
                    rows[u] = row;
                    cols[u] = col_vec * kTpVecElems;
                    col_vec += step_cols;
                    row += step_rows;
                    if (col_vec >= vecs_per_row) {
                        col_vec -= vecs_per_row;
                        ++row;
                    }
                }
#pragma unroll
                for (int u = 0; u < kRsUnroll; ++u) {
                    if (i0 + u * stride < total && cols[u] + kTpVecElems <= p.n) {
                        raw[u] = load_raw8<kPartial>(src_base + ((ch.row_begin + rows[u]) * p.ldp + cols[u]) * kPBytes);
                    }
                }
#pragma unroll
                for (int u = 0; u < kRsUnroll; ++u) {
                    if (i0 + u * stride >= total) break;
                    const int64_t r = rows[u];
                    const int64_t col = cols[u];
                    const unsigned char* src = src_base + ((ch.row_begin + r) * p.ldp + col) * kPBytes;
                    float* acc = p.acc + (local_row0 + r) * p.lda + col;
                    auto* out = static_cast<unsigned char*>(p.out) + ((local_row0 + r) * p.ldc + col) * kOBytes;
                    if (col + kTpVecElems <= p.n) {
                        float v[8];
                        unpack8<kPartial>(raw[u], v);
                        if (!first_phase) {
                            float a[8];
                            load8<DType::kF32>(acc, a);
#pragma unroll
                            for (int j = 0; j < 8; ++j) v[j] += a[j];
                        }
                        if (last_phase) {
                            store8<kOut>(out, v);
                        } else {
                            store8<DType::kF32>(acc, v);
                        }
                    } else {
                        for (int64_t j = 0; col + j < p.n; ++j) {
                            float x = load_elem<kPartial>(src, j);
                            if (!first_phase) x += acc[j];
                            if (last_phase) {
                                store_elem<kOut>(out, j, x);
                            } else {
                                acc[j] = x;
                            }
                        }
                    }
                }
            }
            if (threadIdx.x == 0) {
                WEFT_TRACE_RECORD(p.ctx, TraceKind::kReduce, TraceRole::kComm, reduce_t0, sig, source, 0, 0);
            }
        }
    }
    __syncthreads();  // every thread of this CTA has read its share of every partial
    if (threadIdx.x == 0 && arrive_last(p.exit_count, gridDim.x)) {
        // Every counter reached its count (every CTA waited for all of them).
        ptx::st(p.epoch, e);
        device::trap_unless(
            release_received_partials(p.ctx, p.counters, map.num_signals(), signatures, p.released, __LINE__));
    }
}

/// Stores this call's descriptor into slot [parity][rank] on every peer (parity: calls completed, gemm_calls; the
/// peer zeroed that slot at the end of the call two back, before the `released` this rank's previous call awaited).
/// One thread, before the GEMM (its producer's 40 registers have no room for it).
__device__ __forceinline__ void publish_signature(const RsGemmParams& p) {
    const uint64_t parity = ptx::ld(p.gemm_calls) & 1u;
    uint64_t* const mine = p.signatures + parity * static_cast<uint64_t>(p.ctx.num_ranks) + p.ctx.rank;
    for (int32_t pe = 0; pe < p.ctx.num_ranks; ++pe) {
        if (pe == p.ctx.rank) continue;
        uint64_t* slot = device::symm_at(p.ctx, mine, pe);  // no call in a kernel that issues wgmma: trap inline
        device::trap_unless(slot != nullptr);
        ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(slot, p.signature);
    }
}

/// The GEMM+ReduceScatter kernel: CTA 0 publishes the call's descriptor (publish_signature), then weft's GEMM with
/// RsGemmScheduler and `Hook` (RsGemmHook<CFG>, pull; RsPushHook<CFG>, push: its parameters __grid_constant__, the
/// peer maps are read in place).
template <GemmConfig kCfg, class Hook>
__global__ void __launch_bounds__(kGemmThreads, 1)
    rs_gemm_kernel(const __grid_constant__ ptx::TmaDescriptor tma_a, const __grid_constant__ ptx::TmaDescriptor tma_b,
                   const __grid_constant__ ptx::TmaDescriptor tma_d, const GemmArgs args,
                   const RsGemmParams sched_params, const __grid_constant__ typename Hook::Params hook_params) {
    if (blockIdx.x == 0 && threadIdx.x == 0) publish_signature(sched_params);
    gemm::gemm_device<kCfg, RsGemmScheduler<kCfg>, Hook>(&tma_a, &tma_b, &tma_d, args, sched_params, hook_params);
}

}  // namespace weft::kernels::gemm_rs
