// SPDX-License-Identifier: MIT
// Low-latency (decode) expert-parallel dispatch and combine: fixed worst-case slots, optional fp8, send/receive halves.
//
// Dispatch send (no wait on any peer's data; only on a credit that is normally already there):
//   every block computes the stable slot of each route (token, slot) in its (expert, source) area; one
//   warp per token loads the row once (quantising it to e4m3 with one fp32 scale per 128 channels
//   when asked) and stores it into the slot of each of its experts on the experts' owners, with a
//   16-byte trailer {token, top-k slot}. The last block to finish writes the per-expert route counts
//   into each rank's mailbox and adds 1 to each rank's dispatch signal.
// Dispatch receive: wait for every source's signal, read the counts, and copy each (expert, source)
//   area into the masked output [local expert, rank-major rows, H] (source rank, then token order),
//   recording each row's source token and slot. The last block adds 1 to every source's credit.
//   Each count word also carries its sender's call signature (fp8 or bf16, the geometry's digest): when a source's
//   differs, every block receives nothing (kCallMismatch in the status word; the handle's combine writes zeros).
// Receive areas and mailboxes are double-buffered by call parity; a send of call c waits until every
// destination has received call c - 2 (its credit), so any interleaving of sends and receives with at
// most two sends outstanding is safe, and nothing is cleared between calls.
// Combine send: each output row goes back to its source's landing [token, top-k slot]; the last block
//   adds 1 to each rank's combine signal. Combine receive: wait for all ranks, then each token's
//   weighted sum over its valid slots in slot order (fp32 fma), rounded once to bf16.
// Traced builds (weft/device/trace.cuh, docs/profiling.md): "wait peer r" per signal awaited (tile::wait_each);
// from thread 0 of each block "send" (its rows, after the credit wait), "recv" (the wait and the copies into the
// masked output) and "combine" (the wait and the weighted sums); "notify" per rank from the last block of a send.
// Every event is kept at a slot of its own in the block's trace log (shared memory; weft::ep::LlTraceSlots: no
// atomic) and written at the kernel's end, after its signals, into slots the block's last thread claimed at the start
// (a.trace: the buffer's address, a kernel parameter; the claim LlTraceSlots::count): recording costs these short
// kernels no atomic before a signal that a peer waits for, and no round trip at their end.
#pragma once

#include "ep/common.cuh"
#include "ep/transport.cuh"
#include "weft/device/trace.cuh"
#include "weft/common/device_ctx.hpp"
#include "weft/common/ep_workspace.hpp"

namespace weft::kernels::ep {

/// Compile-time knobs of the low-latency kernels.
struct LowLatencyConfig {
    int threads = 512;  ///< threads per block
    int unroll = 2;     ///< 16-byte granules each lane keeps in flight per row chunk
};

__host__ __device__ constexpr bool is_valid(const LowLatencyConfig& c) {
    return c.threads >= 64 && c.threads <= 1024 && c.threads % 32 == 0 && c.unroll >= 1 && c.unroll <= 8;
}

namespace detail {

struct LowLatencyShared {
    uint8_t** peer_base;
    int32_t* hist;
    int32_t* route_slot;
    int32_t* expert_count;
    int32_t* unit_count;
    int32_t* unit_prefix;
    int32_t* expert_base;

    __device__ static LowLatencyShared carve(uint8_t* smem, const weft::ep::LowLatencySmem& p) {
        return LowLatencyShared{
            reinterpret_cast<uint8_t**>(smem + p.peer_base), reinterpret_cast<int32_t*>(smem + p.hist),
            reinterpret_cast<int32_t*>(smem + p.route_slot), reinterpret_cast<int32_t*>(smem + p.expert_count),
            reinterpret_cast<int32_t*>(smem + p.unit_count), reinterpret_cast<int32_t*>(smem + p.unit_prefix),
            reinterpret_cast<int32_t*>(smem + p.expert_base)};
    }
};

/// Byte offset of slot (half, local expert, source, index) in the receive area.
__device__ __forceinline__ int64_t ll_slot_offset(const Geometry& g, int half, int local_expert, int source,
                                                  int index) {
    const int64_t unit = (static_cast<int64_t>(half) * g.local_experts() + local_expert) * g.num_ranks + source;
    return (unit * g.max_tokens + index) * g.ll_slot_bytes();
}

/// Quantises the 8 channels a lane holds; the 16 lanes of a half-warp form one 128-channel group.
/// Returns the 8 codes; `scale` gets the group's scale (every lane of the group). All 32 lanes call it.
__device__ __forceinline__ uint2 quantize_e4m3x8(const float (&f)[8], float& scale) {
    float amax = 0.0f;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        amax = fmaxf(amax, fabsf(f[q]));
    }
#pragma unroll
    for (int d = 8; d >= 1; d >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    }
    amax = fmaxf(amax, weft::ep::kFp8MinAmax);
    scale = __fdiv_rn(amax, weft::ep::kFp8Max);
    const float inv = __fdiv_rn(weft::ep::kFp8Max, amax);
    const uint32_t c01 = ptx::cvt_rn_satfinite_e4m3x2(__fmul_rn(f[0], inv), __fmul_rn(f[1], inv));
    const uint32_t c23 = ptx::cvt_rn_satfinite_e4m3x2(__fmul_rn(f[2], inv), __fmul_rn(f[3], inv));
    const uint32_t c45 = ptx::cvt_rn_satfinite_e4m3x2(__fmul_rn(f[4], inv), __fmul_rn(f[5], inv));
    const uint32_t c67 = ptx::cvt_rn_satfinite_e4m3x2(__fmul_rn(f[6], inv), __fmul_rn(f[7], inv));
    return uint2{c01 | (c23 << 16), c45 | (c67 << 16)};
}

/// How a warp's work item maps to (token, chunk range) when tokens are split into `parts` pieces of
/// whole row chunks (so a few tokens still keep every warp busy). Chunks are 32 * U granules: a
/// multiple of 16, so an fp8 scale group never straddles two parts.
struct RowParts {
    int parts;
    int chunk;  ///< granules per chunk
    int chunks_per_part;
    __device__ static RowParts make(int num_tokens, int granules, int num_warps, int unroll) {
        const int chunk = 32 * unroll;
        const int chunks = (granules + chunk - 1) / chunk;
        int parts = num_tokens > 0 ? num_warps / num_tokens : 1;
        parts = parts < 1 ? 1 : (parts > chunks ? chunks : parts);
        return RowParts{parts, chunk, (chunks + parts - 1) / parts};
    }
    __device__ int begin(int part) const { return part * chunks_per_part * chunk; }
    __device__ int end(int part, int granules) const {
        const int e = (part + 1) * chunks_per_part * chunk;
        return e < granules ? e : granules;
    }
};

/// A token's landing rows, for warp_weighted_sum: row j (top-k slot j) at base + j * hidden.
struct RowsOfSlots {
    const uint16_t* base;
    const Geometry& g;
    __device__ __forceinline__ int index(int j) const { return j; }
    __device__ __forceinline__ const uint4* at(int j) const {
        return reinterpret_cast<const uint4*>(base + static_cast<int64_t>(j) * g.hidden);
    }
};

template <LowLatencyConfig C>
__device__ void ll_dispatch_send(const DeviceCtx& ctx, const weft::ep::LowLatencyArgs& a, const LowLatencyShared& sh,
                                 const PeerTable& peers) {
    constexpr int kWarps = C.threads / 32;
    constexpr int U = C.unroll;
    const Geometry& g = a.geo;
    const int tid = static_cast<int>(threadIdx.x);
    const int lane = lane_id();
    const int num_ranks = g.num_ranks;
    const int local_experts = g.local_experts();
    const int k = g.topk;
    const int me = ctx.rank;
    const int granules = g.hidden / 8;
    const int64_t slot_bytes = g.ll_slot_bytes();
    const uint64_t call = a.buffer.state->dispatch_send_calls + 1;
    const int half = static_cast<int>(call & 1u);
    const weft::ep::LlTraceSlots trace_slots{a.phases, num_ranks};  // traced builds: the block log's slot per event

    if (blockIdx.x == 0 && tid == 0) {
        a.handle.dispatch_call[0] = call;  // its combine sends this with its rows (ll_combine_send)
    }
    RouteOut out{sh.route_slot, sh.expert_count, nullptr, nullptr, nullptr};
    compute_routes(g, a.topk_idx, a.idx_stride, a.num_tokens, sh.hist, nullptr, out, a.status, blockIdx.x == 0, call,
                   KernelId::kLowLatencyDispatch);
    // Half `half` of every destination must be free: it has received call - 2. The wait guards the stores into the
    // destinations' slots below (no load: its Token is not needed).
    tile::wait_each(Block{}, ctx, call > 2 ? num_ranks : 0,
                    FromRankLogged{a.buffer.dispatch_credit, trace_slots.credit_wait(0)}, Cmp::kGe, call - 2);

    WEFT_TRACE_BEGIN(send_t0);
    const int global_warp = static_cast<int>(blockIdx.x) * kWarps + warp_id();
    const int num_warps = static_cast<int>(gridDim.x) * kWarps;
    const RowParts split = RowParts::make(a.num_tokens, granules, num_warps, U);
    for (int item = global_warp; item < a.num_tokens * split.parts; item += num_warps) {
        const int t = item / split.parts;
        const int part = item % split.parts;
        const int g_end = split.end(part, granules);
        if (part == 0) {  // the combine compares its topk_idx with this
            const uint32_t digest = route_row_digest(a.topk_idx + static_cast<int64_t>(t) * a.idx_stride, lane, k);
            if (lane == 0) a.handle.route_digest[t] = digest;
        }
        // Lane j: the slot of route j on its expert's owner (a peer mapping), or null.
        uint8_t* dst = nullptr;
        if (lane < k) {
            const int32_t slot = sh.route_slot[t * k + lane];
            if (slot >= 0) {
                const int32_t e = a.topk_idx[static_cast<int64_t>(t) * a.idx_stride + lane];
                const int r = e / local_experts;
                dst = peers.at(ctx, a.buffer.recv_slots + ll_slot_offset(g, half, e % local_experts, me, slot), r);
            }
        }
        const uint32_t routes = __ballot_sync(0xffffffffu, dst != nullptr);
        const auto* src = reinterpret_cast<const uint4*>(a.x + static_cast<int64_t>(t) * a.x_stride);
        for (int c0 = split.begin(part); c0 < g_end; c0 += split.chunk) {
            uint4 v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int gi = c0 + u * 32 + lane;
                v[u] = gi < g_end ? ptx::ld(src + gi) : uint4{0, 0, 0, 0};
            }
            if (a.fp8) {
                uint2 codes[U];
                float scales[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    float f[8];
                    bf16x8_to_f32(v[u], f);
                    codes[u] = quantize_e4m3x8(f, scales[u]);
                }
                uint32_t left = routes;
                while (left != 0) {
                    const int j = __ffs(left) - 1;
                    left &= left - 1;
                    auto* d = reinterpret_cast<uint8_t*>(__shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(dst), j));
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const int gi = c0 + u * 32 + lane;
                        if (gi < g_end) {
                            put8(d + static_cast<int64_t>(gi) * 8, codes[u]);
                            if ((lane & 15) == 0) {
                                put4(d + g.hidden + static_cast<int64_t>(gi / 16) * 4, __float_as_uint(scales[u]));
                            }
                        }
                    }
                }
            } else {
                uint32_t left = routes;
                while (left != 0) {
                    const int j = __ffs(left) - 1;
                    left &= left - 1;
                    auto* d = reinterpret_cast<uint4*>(__shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(dst), j));
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const int gi = c0 + u * 32 + lane;
                        if (gi < g_end) {
                            put16(d + gi, v[u]);
                        }
                    }
                }
            }
        }
        if (part == 0 && dst != nullptr) {
            put16(dst + slot_bytes - 16, uint4{static_cast<uint32_t>(t), static_cast<uint32_t>(lane), 0u, 0u});
        }
    }
    WEFT_TRACE_DEFER_AT_IF(tid == 0, trace_slots.send_span(), ctx, TraceKind::kSend, TraceRole::kComm, send_t0, -1,
                           a.num_tokens, 0, 0);

    if (last_block_arrive(&a.buffer.state->arrivals[0])) {
        // Every block's rows are written (acquired above): counts, then one release per rank.
        WEFT_TRACE_BEGIN(notify_t0);
        const int units = num_ranks * local_experts;
        for (int i = tid; i < units; i += C.threads) {
            const int r = i / local_experts;
            const int le = i % local_experts;
            int32_t* box = a.buffer.mailbox + (static_cast<int64_t>(half) * num_ranks + me) * local_experts + le;
            put4(peers.at(ctx, box, r), weft::ep::ll_mailbox_word(a.signature, sh.expert_count[i]));
        }
        __syncthreads();
        if (tid < num_ranks) {
            signal_add(peers.at(ctx, a.buffer.dispatch_signal + me, tid), 1);
            WEFT_TRACE_DEFER_AT(trace_slots.notify(tid), ctx, TraceKind::kNotify, TraceRole::kComm, notify_t0, me, tid,
                                0, 0);
        }
        if (tid == 0) {
            a.buffer.state->dispatch_send_calls = call;
        }
    }
}

template <LowLatencyConfig C>
__device__ void ll_dispatch_recv(const DeviceCtx& ctx, const weft::ep::LowLatencyArgs& a, const LowLatencyShared& sh,
                                 const PeerTable& peers) {
    constexpr int kWarps = C.threads / 32;
    constexpr int U = C.unroll;
    const Geometry& g = a.geo;
    const int tid = static_cast<int>(threadIdx.x);
    const int lane = lane_id();
    const int num_ranks = g.num_ranks;
    const int local_experts = g.local_experts();
    const int me = ctx.rank;
    const int64_t rows_per_expert = g.ll_rows_per_expert();
    const int64_t slot_bytes = g.ll_slot_bytes();
    const uint64_t call = a.buffer.state->dispatch_recv_calls + 1;
    const int half = static_cast<int>(call & 1u);
    const int units = local_experts * num_ranks;
    const weft::ep::LlTraceSlots trace_slots{a.phases, num_ranks};  // traced builds: the block log's slot per event

    // Every source's sends of this call: its counts (mailbox) and rows (receive slots) are here.
    WEFT_TRACE_BEGIN(recv_t0);
    const Token arrived = tile::wait_each(
        Block{}, ctx, num_ranks, FromRankLogged{a.buffer.dispatch_signal, trace_slots.recv_wait(0)}, Cmp::kGe, call);
    const int32_t* mailbox = tile::consume_token<const int32_t*>(a.buffer.mailbox, arrived);
    const uint8_t* recv_slots = tile::consume_token<const uint8_t*>(a.buffer.recv_slots, arrived);
    // Each word: a count and its source's call signature. A source whose call differs from this rank's (fp8 against
    // bf16, another geometry) makes every block of every rank receive nothing (each rank sees some differing source):
    // no row is read in a layout it was not written in, and every block still reaches the credit below.
    bool differs = false;
    for (int u = tid; u < units; u += C.threads) {
        const int le = u / num_ranks;
        const int s = u % num_ranks;
        const auto word =
            static_cast<uint32_t>(mailbox[(static_cast<int64_t>(half) * num_ranks + s) * local_experts + le]);
        const int32_t n = weft::ep::ll_mailbox_count(word);
        if (weft::ep::ll_mailbox_signature(word) != a.signature && !differs) {
            differs = true;
            if (blockIdx.x == 0) {
                report_status(a.status, StatusCode::kCallMismatch, me, s, a.signature,
                              weft::ep::ll_mailbox_signature(word), -1, -1, call, KernelId::kLowLatencyDispatch);
            }
        }
        sh.unit_count[u] = n;
        sh.unit_prefix[u] = n;
    }
    const bool mismatch = __syncthreads_or(differs) != 0;
    if (mismatch) {
        for (int u = tid; u < units; u += C.threads) {
            sh.unit_count[u] = 0;
            sh.unit_prefix[u] = 0;
        }
        __syncthreads();
    }
    if (blockIdx.x == 0 && tid == 0) {
        a.handle.mismatch[0] = mismatch ? 1 : 0;
    }
    for (int le = tid; le < local_experts; le += C.threads) {
        int32_t run = 0;
        for (int s = 0; s < num_ranks; ++s) {
            sh.expert_base[le * num_ranks + s] = run;
            run += sh.unit_count[le * num_ranks + s];
        }
        if (blockIdx.x == 0) {
            a.handle.expert_counts[le] = run;
        }
    }
    const int32_t total = block_exclusive_scan(sh.unit_prefix, units);
    if (tid == 0) {
        sh.unit_prefix[units] = total;
    }
    __syncthreads();

    const int granules_bf16 = g.hidden / 8;
    const int granules_fp8 = g.hidden / 16;
    const int num_scales = static_cast<int>(g.ll_fp8_scales());
    const int out_row_bytes = a.fp8 ? g.hidden : g.hidden * 2;
    const int global_warp = static_cast<int>(blockIdx.x) * kWarps + warp_id();
    const int num_warps = static_cast<int>(gridDim.x) * kWarps;
    for (int f = global_warp; f < total; f += num_warps) {
        const int u = upper_bound_index(sh.unit_prefix, units, f);
        const int i = f - sh.unit_prefix[u];
        const int le = u / num_ranks;
        const int s = u % num_ranks;
        const int64_t out_row = static_cast<int64_t>(le) * rows_per_expert + sh.expert_base[u] + i;
        const uint8_t* src = recv_slots + ll_slot_offset(g, half, le, s, i);
        uint8_t* dst = a.handle.recv_x + out_row * out_row_bytes;
        warp_copy_row<U>(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src),
                         a.fp8 ? granules_fp8 : granules_bf16);
        if (a.fp8) {
            const auto* sc = reinterpret_cast<const uint32_t*>(src + g.hidden);
            auto* out_sc = reinterpret_cast<uint32_t*>(a.handle.recv_scales + out_row * num_scales);
            for (int q = lane; q < num_scales; q += 32) {
                out_sc[q] = sc[q];
            }
        }
        if (lane == 0) {
            const uint4 trailer = ptx::ld(reinterpret_cast<const uint4*>(src + slot_bytes - 16));
            a.handle.recv_src_info[out_row] = s * g.max_tokens + static_cast<int32_t>(trailer.x);
            a.handle.recv_src_slot[out_row] = static_cast<int32_t>(trailer.y);
        }
    }
    WEFT_TRACE_DEFER_AT_IF(tid == 0, trace_slots.recv_span(), ctx, TraceKind::kRecv, TraceRole::kComm, recv_t0, -1,
                           total, 0, 0);

    if (last_block_arrive(&a.buffer.state->arrivals[1])) {
        if (tid < num_ranks) {
            signal_add(peers.at(ctx, a.buffer.dispatch_credit + me, tid), 1);
        }
        if (tid == 0) {
            a.buffer.state->dispatch_recv_calls = call;
        }
    }
}

template <LowLatencyConfig C>
__device__ void ll_combine_send(const DeviceCtx& ctx, const weft::ep::LowLatencyArgs& a, const LowLatencyShared& sh,
                                const PeerTable& peers) {
    constexpr int kWarps = C.threads / 32;
    constexpr int U = C.unroll;
    const Geometry& g = a.geo;
    const int tid = static_cast<int>(threadIdx.x);
    const int num_ranks = g.num_ranks;
    const int local_experts = g.local_experts();
    const int k = g.topk;
    const int me = ctx.rank;
    const int64_t rows_per_expert = g.ll_rows_per_expert();
    const int granules = g.hidden / 8;
    const uint64_t call = a.buffer.state->combine_send_calls + 1;
    const int half = static_cast<int>(call & 1u);
    const weft::ep::LlTraceSlots trace_slots{a.phases, num_ranks};  // traced builds: the block log's slot per event

    for (int le = tid; le < local_experts; le += C.threads) {
        sh.unit_prefix[le] = a.handle.expert_counts[le];
    }
    // Half `half` of every source's landing must be free: it has received call - 2. The wait guards the stores into
    // the landings below (no load: its Token is not needed).
    tile::wait_each(Block{}, ctx, call > 2 ? num_ranks : 0,
                    FromRankLogged{a.buffer.combine_credit, trace_slots.credit_wait(0)}, Cmp::kGe, call - 2);
    const int32_t total = block_exclusive_scan(sh.unit_prefix, local_experts);
    if (tid == 0) {
        sh.unit_prefix[local_experts] = total;
    }
    __syncthreads();

    WEFT_TRACE_BEGIN(send_t0);
    const int global_warp = static_cast<int>(blockIdx.x) * kWarps + warp_id();
    const int num_warps = static_cast<int>(gridDim.x) * kWarps;
    for (int f = global_warp; f < total; f += num_warps) {
        const int le = upper_bound_index(sh.unit_prefix, local_experts, f);
        const int i = f - sh.unit_prefix[le];
        const int64_t row = static_cast<int64_t>(le) * rows_per_expert + i;
        const int32_t info = a.handle.recv_src_info[row];
        const int s = info / g.max_tokens;
        const int t = info % g.max_tokens;
        const int j = a.handle.recv_src_slot[row];
        const auto* src = reinterpret_cast<const uint4*>(a.y + le * a.y_expert_stride + i * a.y_row_stride);
        auto* dst = reinterpret_cast<uint4*>(
            peers.at(ctx, a.buffer.landing + ((static_cast<int64_t>(half) * g.max_tokens + t) * k + j) * g.hidden, s));
        const int lane = lane_id();
        for (int c0 = 0; c0 < granules; c0 += 32 * U) {
            uint4 v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int gi = c0 + u * 32 + lane;
                if (gi < granules) {
                    v[u] = ptx::ld(src + gi);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int gi = c0 + u * 32 + lane;
                if (gi < granules) {
                    put16(dst + gi, v[u]);
                }
            }
        }
    }
    WEFT_TRACE_DEFER_AT_IF(tid == 0, trace_slots.send_span(), ctx, TraceKind::kSend, TraceRole::kComm, send_t0, -1,
                           total, 0, 0);

    if (last_block_arrive(&a.buffer.state->arrivals[2])) {
        WEFT_TRACE_BEGIN(notify_t0);
        if (tid < num_ranks) {
            // Which dispatch these rows are of, released with them: a rank combining another dispatch sees it.
            ptx::st<Sem::kRelaxed, Scope::kSys>(
                peers.at(ctx, a.buffer.combine_call + static_cast<int64_t>(half) * num_ranks + me, tid),
                a.handle.dispatch_call[0]);
            signal_add(peers.at(ctx, a.buffer.combine_signal + me, tid), 1);
            WEFT_TRACE_DEFER_AT(trace_slots.notify(tid), ctx, TraceKind::kNotify, TraceRole::kComm, notify_t0, me, tid,
                                0, 0);
        }
        if (tid == 0) {
            a.buffer.state->combine_send_calls = call;
        }
    }
}

template <LowLatencyConfig C>
__device__ void ll_combine_recv(const DeviceCtx& ctx, const weft::ep::LowLatencyArgs& a, const PeerTable& peers) {
    constexpr int kWarps = C.threads / 32;
    constexpr int U = C.unroll;
    const Geometry& g = a.geo;
    const int tid = static_cast<int>(threadIdx.x);
    const int lane = lane_id();
    const int num_ranks = g.num_ranks;
    const int k = g.topk;
    const int me = ctx.rank;
    const int granules = g.hidden / 8;
    const uint64_t call = a.buffer.state->combine_recv_calls + 1;
    const int half = static_cast<int>(call & 1u);
    const weft::ep::LlTraceSlots trace_slots{a.phases, num_ranks};  // traced builds: the block log's slot per event

    // Every expert rank's rows of this call are in the landing.
    WEFT_TRACE_BEGIN(combine_t0);  // the wait included
    const Token arrived = tile::wait_each(
        Block{}, ctx, num_ranks, FromRankLogged{a.buffer.combine_signal, trace_slots.recv_wait(0)}, Cmp::kGe, call);
    const uint16_t* landing = tile::consume_token<const uint16_t*>(a.buffer.landing, arrived);
    const int global_warp = static_cast<int>(blockIdx.x) * kWarps + warp_id();
    const int num_warps = static_cast<int>(gridDim.x) * kWarps;
    const RowParts split = RowParts::make(a.num_tokens, granules, num_warps, U);
    // Rank r's rows of this call came from its combine of another dispatch (the ranks combine their dispatches in
    // different orders): what landed is not this handle's. Every block reads the same words (r's combine two calls
    // on waits for this one's credit), so all write zeros; block 0 reports it.
    const uint64_t mine = a.handle.dispatch_call[0];
    const uint64_t theirs =
        tid < num_ranks ? ptx::ld<Sem::kRelaxed, Scope::kSys>(a.buffer.combine_call + half * num_ranks + tid) : mine;
    if (theirs != mine && blockIdx.x == 0) {
        report_status(a.status, StatusCode::kCallMismatch, me, tid, static_cast<int64_t>(mine),
                      static_cast<int64_t>(theirs), -1, -1, call, KernelId::kLowLatencyCombine);
    }
    const bool other_dispatch = __syncthreads_or(theirs != mine) != 0;
    // After a dispatch whose calls differed (kCallMismatch, seen by every rank) nothing came back: zeros.
    const bool received = a.handle.mismatch[0] == 0 && !other_dispatch;
    for (int item = global_warp; item < a.num_tokens * split.parts; item += num_warps) {
        const int t = item / split.parts;
        const int part = item % split.parts;
        const int g_end = split.end(part, granules);
        const int32_t* idx_row = a.topk_idx + static_cast<int64_t>(t) * a.idx_stride;
        const bool same_row =
            combine_row_matches_dispatch(idx_row, lane, k, a.handle.route_digest[t], part == 0, a.status, me, t, call);
        const bool valid = received && same_row && lane < k && route_expert(idx_row, lane, g.num_experts) >= 0;
        const float weight = valid ? a.topk_weights[static_cast<int64_t>(t) * a.weight_stride + lane] : 0.0f;
        const uint32_t slots = __ballot_sync(0xffffffffu, valid);
        const uint16_t* base = landing + (static_cast<int64_t>(half) * g.max_tokens + t) * k * g.hidden;
        auto* dst = reinterpret_cast<uint4*>(a.out + static_cast<int64_t>(t) * a.out_stride);
        const detail::RowsOfSlots rows_of{base, g};
        warp_weighted_sum<U>(slots, weight, rows_of, split.begin(part), g_end,
                             [dst](int gi, uint4 v) { ptx::st(dst + gi, v); });
    }
    WEFT_TRACE_DEFER_AT_IF(tid == 0, trace_slots.recv_span(), ctx, TraceKind::kCombine, TraceRole::kComm, combine_t0,
                           a.num_tokens, 0, 0, 0);

    if (last_block_arrive(&a.buffer.state->arrivals[3])) {
        if (tid < num_ranks) {
            signal_add(peers.at(ctx, a.buffer.combine_credit + me, tid), 1);
        }
        if (tid == 0) {
            a.buffer.state->combine_recv_calls = call;
        }
    }
}

}  // namespace detail

/// Low-latency dispatch: the phases in a.phases (send, receive, or both in one launch). Grid: up to
/// the SM budget, C.threads each, LowLatencySmem bytes of dynamic shared memory. Collective.
template <LowLatencyConfig C>
__global__ void __launch_bounds__(C.threads, 1) low_latency_dispatch(weft::DeviceCtx ctx, weft::ep::LowLatencyArgs a) {
    static_assert(is_valid(C), "LowLatencyConfig: threads a multiple of 32 in 64..1024, unroll 1..8");
    extern __shared__ __align__(16) uint8_t smem[];
    const detail::LowLatencyShared sh =
        detail::LowLatencyShared::carve(smem, weft::ep::LowLatencySmem::make(a.geo, C.threads));
    WEFT_TRACE_OPEN_BLOCK_LOG(trace_claim, a.trace, weft::ep::ll_trace_events_per_block(a.phases, a.geo.num_ranks));
    const PeerTable peers = load_peer_table(ctx, sh.peer_base);
    if (a.phases & weft::ep::kPhaseSend) {
        detail::ll_dispatch_send<C>(ctx, a, sh, peers);
    }
    if (a.phases & weft::ep::kPhaseRecv) {
        detail::ll_dispatch_recv<C>(ctx, a, sh, peers);
    }
    WEFT_TRACE_FLUSH_BLOCK_LOG(trace_claim);  // after every signal of the launch
}

/// Low-latency combine: the phases in a.phases. Same grid rules as low_latency_dispatch. Collective.
template <LowLatencyConfig C>
__global__ void __launch_bounds__(C.threads, 1) low_latency_combine(weft::DeviceCtx ctx, weft::ep::LowLatencyArgs a) {
    static_assert(is_valid(C), "LowLatencyConfig: threads a multiple of 32 in 64..1024, unroll 1..8");
    extern __shared__ __align__(16) uint8_t smem[];
    const detail::LowLatencyShared sh =
        detail::LowLatencyShared::carve(smem, weft::ep::LowLatencySmem::make(a.geo, C.threads));
    WEFT_TRACE_OPEN_BLOCK_LOG(trace_claim, a.trace, weft::ep::ll_trace_events_per_block(a.phases, a.geo.num_ranks));
    const PeerTable peers = load_peer_table(ctx, sh.peer_base);
    if (a.phases & weft::ep::kPhaseSend) {
        detail::ll_combine_send<C>(ctx, a, sh, peers);
    }
    if (a.phases & weft::ep::kPhaseRecv) {
        detail::ll_combine_recv<C>(ctx, a, peers);
    }
    WEFT_TRACE_FLUSH_BLOCK_LOG(trace_claim);  // after every signal of the launch
}

}  // namespace weft::kernels::ep
