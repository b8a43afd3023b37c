// SPDX-License-Identifier: MIT
// Normal (throughput) expert-parallel dispatch and combine: device size exchange, deduplicated push, expert-contiguous
// receive.
//
// Dispatch, on every rank at once (grid <= the SM budget; every rank's grid must be resident):
//   1. counts: each rank writes its per-expert route counts and per-rank token counts into every
//      rank's mailbox (double-buffered by call parity) and adds 1 to that rank's count signal;
//   2. every block waits for all counts and derives the same global layout on every rank: each
//      expert's padded segment on its owner, each source's first row in it, each rank's received
//      tokens. A rank whose receive capacity would overflow is seen by ALL ranks: none moves data, and
//      each reports the overflow in its status word (no hang, no truncation);
//   3. send: one warp per token writes the row ONCE per destination rank, at the position of the
//      token's first expert there, plus a receive record {source, token, landing slot, (position,
//      weight) per top-k slot}; then each block adds its row counts to the destinations' data signals;
//   4. receive, source by source (own rows first): wait for the source's rows, then copy each of its
//      tokens' first row to the rows of the token's other local experts.
// Combine: each received token's weighted sum over its local experts (fp32, top-k slot order, rounded
// once to bf16) is written into its source's landing; the source adds the partials of its
// destinations in rank order (fp32) and rounds to bf16.
// Traced builds (weft/device/trace.cuh, docs/profiling.md): "notify" per count mailbox written, "wait peer r" per
// signal awaited (tile::wait_each), "send to r" per destination a block sent rows to (from the start of its sends to
// its signal), "recv from r" per source (thread 0: the wait and the copies), "combine" (thread 0).
#pragma once

#include "ep/common.cuh"
#include "ep/transport.cuh"
#include "weft/device/trace.cuh"
#include "weft/common/device_ctx.hpp"
#include "weft/common/ep_workspace.hpp"

namespace weft::kernels::ep {

/// Compile-time knobs of the normal dispatch and combine kernels.
struct NormalConfig {
    int threads = 512;  ///< threads per block (one block per SM of the budget)
    int unroll = 4;     ///< 16-byte granules each lane keeps in flight per row chunk
};

__host__ __device__ constexpr bool is_valid(const NormalConfig& c) {
    return c.threads >= 64 && c.threads <= 1024 && c.threads % 32 == 0 && c.unroll >= 1 && c.unroll <= 8;
}

namespace detail {

/// The shared-memory arrays of the normal kernels (NormalSmem's plan).
struct NormalShared {
    uint8_t** peer_base;
    int32_t* exp_base;
    int32_t* exp_start;
    int32_t* exp_total;
    int32_t* tok_base;
    int64_t* rank_tokens;
    int64_t* rank_rows;
    int32_t* recv_from;
    int32_t* src_offset;
    int32_t* send_base;
    int32_t* sent;
    int32_t* dests;
    int32_t* dest_rows;
    int32_t* dest_meta;
    int32_t* flags;
    int32_t* exp_rows;

    __device__ static NormalShared carve(uint8_t* smem, const weft::ep::NormalSmem& p) {
        return NormalShared{
            reinterpret_cast<uint8_t**>(smem + p.peer_base), reinterpret_cast<int32_t*>(smem + p.exp_base),
            reinterpret_cast<int32_t*>(smem + p.exp_start),  reinterpret_cast<int32_t*>(smem + p.exp_total),
            reinterpret_cast<int32_t*>(smem + p.tok_base),   reinterpret_cast<int64_t*>(smem + p.rank_tokens),
            reinterpret_cast<int64_t*>(smem + p.rank_rows),  reinterpret_cast<int32_t*>(smem + p.recv_from),
            reinterpret_cast<int32_t*>(smem + p.src_offset), reinterpret_cast<int32_t*>(smem + p.send_base),
            reinterpret_cast<int32_t*>(smem + p.sent),       reinterpret_cast<int32_t*>(smem + p.dests),
            reinterpret_cast<int32_t*>(smem + p.dest_rows),  reinterpret_cast<int32_t*>(smem + p.dest_meta),
            reinterpret_cast<int32_t*>(smem + p.flags),      reinterpret_cast<int32_t*>(smem + p.exp_rows)};
    }
};

/// The rows of a received token's receive record, for warp_weighted_sum: lane j holds the row of top-k slot j in `y`.
struct RowsOfRecord {
    const uint16_t* y;
    int64_t y_stride;
    int32_t lane_row;
    __device__ __forceinline__ int32_t index(int j) const { return __shfl_sync(0xffffffffu, lane_row, j); }
    __device__ __forceinline__ const uint4* at(int32_t row) const {
        return reinterpret_cast<const uint4*>(y + static_cast<int64_t>(row) * y_stride);
    }
};

/// The local expert whose rows hold `row`: the last of `starts[0..n)` (ascending segment starts, empty experts'
/// included) at or below it.
__device__ __forceinline__ int local_expert_of_row(const int32_t* starts, int n, int32_t row) {
    int lo = 0;
    int hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (starts[mid] <= row) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

/// Fused dispatch: adds the rows of local experts this block completed since the last flush (sh.exp_rows, then
/// zeroed) to the rank's counters; the add that completes an expert's `totals[le]` rows raises its ready word. Every
/// thread of the block calls (two block barriers). The acq_rel atomic orders this block's stores (and the arrivals it
/// waited for) before the count, and the counts of every block before the ready signal of the last one.
__device__ __forceinline__ void flush_expert_rows(const weft::ep::NormalFused& f, int32_t* exp_rows,
                                                  const int32_t* totals, int local_experts, int tid, int threads) {
    __syncthreads();
    for (int le = tid; le < local_experts; le += threads) {
        const int32_t n = exp_rows[le];
        if (n > 0) {
            exp_rows[le] = 0;
            __threadfence();
            const uint32_t before =
                ptx::atom_add<ptx::Sem::kAcqRel, ptx::Scope::kGpu>(f.expert_rows + le, static_cast<uint32_t>(n));
            if (before + static_cast<uint32_t>(n) == static_cast<uint32_t>(totals[le])) {
                __threadfence();
                device::signal_release<ptx::Scope::kSys>(f.expert_ready + le, 1, device::SignalOp::kAdd);
            }
        }
    }
    __syncthreads();
}

}  // namespace detail

/// Normal dispatch (see the file comment). Grid: any number of blocks up to the SM budget, C.threads
/// each, NormalSmem bytes of dynamic shared memory. Requires the layout kernel's outputs for the same
/// topk_idx (a.handle.tokens_per_expert ... a.handle.route_pos) and that every rank of the team runs it
/// (collective).
template <NormalConfig C>
__global__ void __launch_bounds__(C.threads, 1) normal_dispatch(weft::DeviceCtx ctx, weft::ep::NormalArgs a) {
    static_assert(is_valid(C), "NormalConfig: threads a multiple of 32 in 64..1024, unroll 1..8");
    extern __shared__ __align__(16) uint8_t smem[];
    constexpr int kWarps = C.threads / 32;
    const Geometry g = a.geo;
    const detail::NormalShared sh = detail::NormalShared::carve(smem, weft::ep::NormalSmem::make(g, C.threads));
    const int tid = static_cast<int>(threadIdx.x);
    const int lane = lane_id();
    const int warp = warp_id();
    const int num_ranks = g.num_ranks;
    const int num_experts = g.num_experts;
    const int local_experts = g.local_experts();
    const int k = g.topk;
    const int me = ctx.rank;
    const int mailbox_ints = g.mailbox_ints();
    const int meta_ints = g.meta_ints();
    const int64_t hidden = g.hidden;
    const int granules = static_cast<int>(hidden / 8);
    const uint64_t call = a.buffer.state->dispatch_calls + 1;  // read by every block before it arrives
    const int parity = static_cast<int>(call & 1u);
    const PeerTable peers = load_peer_table(ctx, sh.peer_base);
    const bool fused = a.fused.counts_ready != nullptr;

    // 1. Publish this rank's counts into every rank's mailbox (block b serves ranks b, b + grid, ...).
    for (int p = static_cast<int>(blockIdx.x); p < num_ranks; p += static_cast<int>(gridDim.x)) {
        WEFT_TRACE_BEGIN(count_t0);
        int32_t* row =
            peers.at(ctx, a.buffer.mailbox + (static_cast<int64_t>(parity) * num_ranks + me) * mailbox_ints, p);
        for (int i = tid; i < num_experts; i += C.threads) {
            put4(row + i, static_cast<uint32_t>(a.handle.tokens_per_expert[i]));
        }
        for (int i = tid; i < num_ranks; i += C.threads) {
            put4(row + num_experts + i, static_cast<uint32_t>(a.handle.tokens_per_rank[i]));
        }
        if (tid == 0) put4(row + num_experts + num_ranks, static_cast<uint32_t>(a.handle_ordinal));
        __syncthreads();
        if (tid == 0) {
            signal_add(peers.at(ctx, a.buffer.count_signal + me, p), 1);
            WEFT_TRACE_RECORD(ctx, TraceKind::kNotify, TraceRole::kComm, count_t0, me, p, 0, 0);
        }
    }

    // 2. Every rank's counts of this call, then the global layout (the same on every rank).
    if (tid < num_ranks) {
        sh.sent[tid] = 0;
    }
    const Token counts = tile::wait_each(Block{}, ctx, num_ranks, FromRank{a.buffer.count_signal}, Cmp::kGe, call);
    const int32_t* box = tile::consume_token<const int32_t*>(
        a.buffer.mailbox + static_cast<int64_t>(parity) * num_ranks * mailbox_ints, counts);
    for (int e = tid; e < num_experts; e += C.threads) {
        int32_t total = 0;
        int32_t before = 0;
        for (int s = 0; s < num_ranks; ++s) {
            const int32_t c = box[static_cast<int64_t>(s) * mailbox_ints + e];
            total += c;
            before += s < me ? c : 0;
        }
        sh.exp_total[e] = total;
        sh.exp_base[e] = before;
    }
    for (int r = tid; r < num_ranks; r += C.threads) {
        int64_t tokens = 0;
        int32_t before = 0;
        for (int s = 0; s < num_ranks; ++s) {
            const int32_t n = box[static_cast<int64_t>(s) * mailbox_ints + num_experts + r];
            tokens += n;
            before += s < me ? n : 0;
        }
        sh.rank_tokens[r] = tokens;
        sh.tok_base[r] = before;
        sh.recv_from[r] = box[static_cast<int64_t>(r) * mailbox_ints + num_experts + me];  // r -> me
    }
    __syncthreads();
    const int64_t align = g.expert_alignment;
    for (int e = tid; e < num_experts; e += C.threads) {
        int64_t start = 0;
        for (int f = (e / local_experts) * local_experts; f < e; ++f) {
            start += round_up(sh.exp_total[f], align);
        }
        // Only used when every rank's rows fit (then start < max_recv_rows < 2^31).
        sh.exp_start[e] = static_cast<int32_t>(start);
        sh.exp_base[e] = static_cast<int32_t>(start + sh.exp_base[e]);
    }
    for (int r = tid; r < num_ranks; r += C.threads) {
        int64_t rows = 0;
        for (int f = r * local_experts; f < (r + 1) * local_experts; ++f) {
            rows += round_up(sh.exp_total[f], align);
        }
        sh.rank_rows[r] = rows;
    }
    __syncthreads();
    if (tid == 0) {
        int32_t run = 0;
        for (int s = 0; s < num_ranks; ++s) {
            sh.src_offset[s] = run;
            run += sh.recv_from[s];
        }
        sh.src_offset[num_ranks] = run;
        run = 0;
        for (int r = 0; r < num_ranks; ++r) {
            sh.send_base[r] = run;
            run += a.handle.tokens_per_rank[r];
        }
        // Every source dispatches on the same handle (its rows land in that handle's recv_x): every rank sees every
        // rank's ordinal, so all agree on whether data moves.
        int valid = 1;
        for (int s = 0; s < num_ranks && valid; ++s) {
            const int32_t theirs = box[static_cast<int64_t>(s) * mailbox_ints + num_experts + num_ranks];
            if (theirs != a.handle_ordinal) {
                valid = 0;
                if (blockIdx.x == 0) {
                    report_status(a.status, StatusCode::kCallMismatch, me, s, a.handle_ordinal, theirs, -1, -1, call,
                                  KernelId::kNormalDispatch);
                }
            }
        }
        // Capacity: every rank sees every rank's totals, so all agree on whether data moves.
        for (int r = 0; r < num_ranks && valid; ++r) {
            if (sh.rank_tokens[r] > g.max_recv_tokens) {
                valid = 0;
                if (blockIdx.x == 0) {
                    report_status(a.status, StatusCode::kRecvTokensOverflow, me, r, sh.rank_tokens[r],
                                  g.max_recv_tokens, -1, -1, call, KernelId::kNormalDispatch);
                }
            } else if (sh.rank_rows[r] > g.max_recv_rows) {
                valid = 0;
                if (blockIdx.x == 0) {
                    report_status(a.status, StatusCode::kRecvRowsOverflow, me, r, sh.rank_rows[r], g.max_recv_rows, -1,
                                  -1, call, KernelId::kNormalDispatch);
                }
            }
        }
        sh.flags[0] = valid;
    }
    __syncthreads();
    const bool valid = sh.flags[0] != 0;

    if (blockIdx.x == 0) {
        for (int le = tid; le < local_experts; le += C.threads) {
            const int e = me * local_experts + le;
            a.handle.expert_counts[le] = valid ? sh.exp_total[e] : 0;
            a.handle.expert_offsets[le] = valid ? sh.exp_start[e] : 0;
        }
        if (tid == 0) {
            a.handle.expert_offsets[local_experts] = valid ? static_cast<int32_t>(sh.rank_rows[me]) : 0;
            a.handle.info[weft::ep::kInfoValid] = valid ? 1 : 0;
            a.handle.info[weft::ep::kInfoNumTokens] = a.num_tokens;
            a.handle.info[weft::ep::kInfoRecvTokens] = valid ? static_cast<int32_t>(sh.rank_tokens[me]) : 0;
            a.handle.info[weft::ep::kInfoRecvRows] = valid ? static_cast<int32_t>(sh.rank_rows[me]) : 0;
            a.handle.info[weft::ep::kInfoCall] = static_cast<int32_t>(call);
        }
        for (int s = tid; s <= num_ranks; s += C.threads) {
            a.handle.source_offsets[s] = valid ? sh.src_offset[s] : 0;
        }
        if (fused) {
            // The counts are out: a GEMM running alongside may plan its tiles; experts without rows are complete.
            __syncthreads();
            if (tid == 0) {
                __threadfence();
                device::signal_release<ptx::Scope::kSys>(a.fused.counts_ready, 1, device::SignalOp::kAdd);
            }
            for (int le = tid; le < local_experts; le += C.threads) {
                if (!valid || sh.exp_total[me * local_experts + le] == 0) {
                    device::signal_release<ptx::Scope::kSys>(a.fused.expert_ready + le, 1, device::SignalOp::kAdd);
                }
            }
        }
    }
    if (fused) {
        for (int le = tid; le < local_experts; le += C.threads) {
            sh.exp_rows[le] = 0;
        }
    }

    if (valid) {
        // 3. Send: one warp per token; the row goes once to each destination rank.
        WEFT_TRACE_BEGIN(send_t0);
        const int global_warp = static_cast<int>(blockIdx.x) * kWarps + warp;
        const int num_warps = static_cast<int>(gridDim.x) * kWarps;
        int32_t* dests = sh.dests + warp * num_ranks;
        int32_t* dest_rows = sh.dest_rows + warp * num_ranks;
        int32_t* dest_meta = sh.dest_meta + warp * num_ranks;
        for (int t = global_warp; t < a.num_tokens; t += num_warps) {
            const int32_t* idx_row = a.topk_idx + static_cast<int64_t>(t) * a.idx_stride;
            const float* w_row = a.topk_weights + static_cast<int64_t>(t) * a.weight_stride;
            const int32_t* pos_row = a.handle.route_pos + static_cast<int64_t>(t) * k;
            // Lane j holds slot j's expert, destination row and weight.
            int32_t slot_expert = -1;
            int32_t slot_row = -1;
            float slot_weight = 0.0f;
            if (lane < k) {
                slot_expert = pos_row[lane] >= 0 ? idx_row[lane] : -1;
                if (slot_expert >= 0) {
                    slot_row = sh.exp_base[slot_expert] + pos_row[lane];
                    slot_weight = w_row[lane];
                }
            }
            int num_dests = 0;
            for (int r0 = 0; r0 < num_ranks; r0 += 32) {
                const int r = r0 + lane;
                const bool in = r < num_ranks && a.handle.token_in_rank[static_cast<int64_t>(t) * num_ranks + r] != 0;
                const uint32_t ballot = __ballot_sync(0xffffffffu, in);
                if (in) {
                    const int d = num_dests + __popc(ballot & lanemask_lt());
                    dests[d] = r;
                    dest_meta[d] = sh.tok_base[r] + a.handle.send_idx[static_cast<int64_t>(t) * num_ranks + r];
                }
                num_dests += __popc(ballot);
            }
            __syncwarp();
            // First row of each destination: the lowest slot whose expert lives there.
            for (int d = 0; d < num_dests; ++d) {
                const int r = dests[d];
                const bool here = slot_expert >= 0 && slot_expert / local_experts == r;
                const uint32_t ballot = __ballot_sync(0xffffffffu, here);
                const int first = __ffs(ballot) - 1;  // a destination always has a slot there
                const int32_t row = __shfl_sync(0xffffffffu, slot_row, first < 0 ? 0 : first);
                if (lane == 0) {
                    dest_rows[d] = row;
                }
            }
            __syncwarp();
            // Receive records: {source, token, landing slot, 0, (row, weight) per slot}.
            for (int i = lane; i < num_dests * meta_ints; i += 32) {
                const int d = i / meta_ints;
                const int word = i % meta_ints;
                const int r = dests[d];
                uint32_t v = 0;
                if (word == 0) {
                    v = static_cast<uint32_t>(me);
                } else if (word == 1) {
                    v = static_cast<uint32_t>(t);
                } else if (word == 2) {
                    v = static_cast<uint32_t>(sh.send_base[r] +
                                              a.handle.send_idx[static_cast<int64_t>(t) * num_ranks + r]);
                } else if (word >= 4 && word < 4 + 2 * k) {
                    const int j = (word - 4) >> 1;
                    const int32_t e = j < k ? (pos_row[j] >= 0 ? idx_row[j] : -1) : -1;
                    const bool there = e >= 0 && e / local_experts == r;
                    if (((word - 4) & 1) == 0) {
                        v = static_cast<uint32_t>(there ? sh.exp_base[e] + pos_row[j] : -1);
                    } else {
                        v = there ? __float_as_uint(w_row[j]) : 0u;
                    }
                }
                int32_t* rec = a.handle.recv_meta + static_cast<int64_t>(dest_meta[d]) * meta_ints;
                put4(peers.at(ctx, rec + word, r), v);
            }
            // The row, loaded once, stored to every destination.
            const auto* src = reinterpret_cast<const uint4*>(a.x + static_cast<int64_t>(t) * a.x_stride);
            for (int c0 = 0; c0 < granules; c0 += 32 * C.unroll) {
                uint4 v[C.unroll];
#pragma unroll
                for (int u = 0; u < C.unroll; ++u) {
                    const int i = c0 + u * 32 + lane;
                    if (i < granules) {
                        v[u] = ptx::ld(src + i);
                    }
                }
                for (int d = 0; d < num_dests; ++d) {
                    auto* dst = reinterpret_cast<uint4*>(
                        peers.at(ctx, a.handle.recv_x + static_cast<int64_t>(dest_rows[d]) * hidden, dests[d]));
#pragma unroll
                    for (int u = 0; u < C.unroll; ++u) {
                        const int i = c0 + u * 32 + lane;
                        if (i < granules) {
                            put16(dst + i, v[u]);
                        }
                    }
                }
            }
            if (lane == 0) {
                for (int d = 0; d < num_dests; ++d) {
                    atomicAdd(&sh.sent[dests[d]], 1);
                }
            }
            __syncwarp();  // dests/dest_rows are rewritten by the next token
        }
        __syncthreads();
        if (tid < num_ranks && sh.sent[tid] > 0) {
            signal_add(peers.at(ctx, a.buffer.data_signal + me, tid), static_cast<uint64_t>(sh.sent[tid]));
            WEFT_TRACE_RECORD(ctx, TraceKind::kSend, TraceRole::kComm, send_t0, tid, sh.sent[tid], 0, 0);
        }

        // 4. Receive, source by source (this rank first: its rows arrive soonest): wait for the source's
        //    rows, then copy each of its tokens' first row to the token's other local experts.
        for (int q = 0; q < num_ranks; ++q) {
            const int s = (me + q) % num_ranks;
            if (sh.recv_from[s] == 0) {
                continue;
            }
            WEFT_TRACE_BEGIN(recv_t0);
            // Thread 0 waits, the block barrier extends its acquire to every thread.
            const Token arrived =
                tile::wait_each(Block{}, ctx, 1, FromRank{a.buffer.data_signal, s}, Cmp::kGe,
                                a.buffer.state->data_expected[s] + static_cast<uint64_t>(sh.recv_from[s]));
            const int32_t* recv_meta = tile::consume_token<const int32_t*>(a.handle.recv_meta, arrived);
            const uint16_t* recv_x = tile::consume_token<const uint16_t*>(a.handle.recv_x, arrived);
            for (int i = sh.src_offset[s] + global_warp; i < sh.src_offset[s + 1]; i += num_warps) {
                const int32_t* rec = recv_meta + static_cast<int64_t>(i) * meta_ints;
                const int32_t row = lane < k ? rec[4 + 2 * lane] : -1;
                uint32_t rows = __ballot_sync(0xffffffffu, row >= 0);
                if (rows == 0) {
                    continue;
                }
                const int first = __ffs(rows) - 1;
                const int32_t first_row = __shfl_sync(0xffffffffu, row, first);
                rows &= rows - 1;
                while (rows != 0) {
                    const int j = __ffs(rows) - 1;
                    rows &= rows - 1;
                    const int32_t other = __shfl_sync(0xffffffffu, row, j);
                    warp_copy_row<C.unroll>(
                        reinterpret_cast<uint4*>(a.handle.recv_x + static_cast<int64_t>(other) * hidden),
                        reinterpret_cast<const uint4*>(recv_x + static_cast<int64_t>(first_row) * hidden), granules);
                }
                if (fused && row >= 0) {
                    // This row is in place: the first arrived (the wait above), the others were copied by this warp
                    // (the flush's block barrier orders the copies before the count).
                    atomicAdd(&sh.exp_rows[detail::local_expert_of_row(sh.exp_start + me * local_experts,
                                                                       local_experts, row)],
                              1);
                }
            }
            if (fused) {
                detail::flush_expert_rows(a.fused, sh.exp_rows, sh.exp_total + me * local_experts, local_experts, tid,
                                          C.threads);
            }
            WEFT_TRACE_RECORD_IF(tid == 0, ctx, TraceKind::kRecv, TraceRole::kComm, recv_t0, s, sh.recv_from[s], 0, 0);
        }
    }

    // 5. The last block to finish advances this buffer's state for the next call (every block's rows are counted:
    //    the fused counters start the next call at zero).
    if (last_block_arrive(&a.buffer.state->dispatch_arrivals)) {
        if (tid == 0) {
            a.buffer.state->dispatch_calls = call;
        }
        if (fused) {
            for (int le = tid; le < local_experts; le += C.threads) {
                a.fused.expert_rows[le] = 0;
            }
        }
        if (valid && tid < num_ranks) {
            a.buffer.state->data_expected[tid] += static_cast<uint64_t>(sh.recv_from[tid]);
        }
    }
}

/// Normal combine (see the file comment). Same grid rules as normal_dispatch; a.y holds one row per
/// received row (the layout of recv_x), a.out receives this rank's T rows. Collective.
template <NormalConfig C>
__global__ void __launch_bounds__(C.threads, 1) normal_combine(weft::DeviceCtx ctx, weft::ep::NormalArgs a) {
    static_assert(is_valid(C), "NormalConfig: threads a multiple of 32 in 64..1024, unroll 1..8");
    extern __shared__ __align__(16) uint8_t smem[];
    constexpr int kWarps = C.threads / 32;
    constexpr int U = C.unroll;
    const Geometry g = a.geo;
    const detail::NormalShared sh = detail::NormalShared::carve(smem, weft::ep::NormalSmem::make(g, C.threads));
    const int tid = static_cast<int>(threadIdx.x);
    const int lane = lane_id();
    const int warp = warp_id();
    const int num_ranks = g.num_ranks;
    const int k = g.topk;
    const int me = ctx.rank;
    const int meta_ints = g.meta_ints();
    const int64_t hidden = g.hidden;
    const int granules = static_cast<int>(hidden / 8);
    const int global_warp = static_cast<int>(blockIdx.x) * kWarps + warp;
    const int num_warps = static_cast<int>(gridDim.x) * kWarps;
    const int num_tokens = a.handle.info[weft::ep::kInfoNumTokens];

    if (a.handle.info[weft::ep::kInfoValid] == 0) {
        // The dispatch moved nothing (a capacity error every rank saw): zeros, no communication.
        for (int t = global_warp; t < num_tokens; t += num_warps) {
            auto* dst = reinterpret_cast<uint4*>(a.out + static_cast<int64_t>(t) * a.out_stride);
            for (int i = lane; i < granules; i += 32) {
                ptx::st(dst + i, uint4{0, 0, 0, 0});
            }
        }
        return;
    }

    const uint64_t call = a.buffer.state->combine_calls + 1;
    const PeerTable peers = load_peer_table(ctx, sh.peer_base);
    if (tid < num_ranks) {
        sh.sent[tid] = 0;
    }
    if (tid == 0) {
        int32_t run = 0;
        for (int r = 0; r < num_ranks; ++r) {
            sh.send_base[r] = run;
            run += a.handle.tokens_per_rank[r];
        }
    }
    // A rank's landing is reused by every combine: wait until each rank has read its previous one. The wait guards
    // the stores into the landings below (no load: its Token is not needed).
    tile::wait_each(Block{}, ctx, call > 1 ? num_ranks : 0, FromRank{a.buffer.combine_done}, Cmp::kGe, call - 1);

    // A. Partial sums of the received tokens, into their sources' landing. The receive records came with the
    //    dispatch, an earlier kernel whose waits made them visible: no wait here guards them.
    //    Fused (a.fused.tile_done): y is being written by a GEMM running alongside; a token's sum first waits until
    //    the tiles holding its rows are stored (one lane per row), so tokens of finished experts go out while the
    //    others compute.
    const int received = a.handle.info[weft::ep::kInfoRecvTokens];
    const int local_experts = g.local_experts();
    const bool fused = a.fused.tile_done != nullptr;
    if (fused) {
        for (int le = tid; le < local_experts; le += C.threads) {
            sh.exp_start[le] = a.handle.expert_offsets[le];
        }
        __syncthreads();
    }
    WEFT_TRACE_BEGIN(send_t0);
    for (int i = global_warp; i < received; i += num_warps) {
        const int32_t* rec = a.handle.recv_meta + static_cast<int64_t>(i) * meta_ints;
        const int src = rec[0];
        const int slot = rec[2];
        const int32_t row = lane < k ? rec[4 + 2 * lane] : -1;
        const float weight = lane < k ? __int_as_float(rec[5 + 2 * lane]) : 0.0f;
        const uint32_t rows = __ballot_sync(0xffffffffu, row >= 0);
        auto* dst =
            reinterpret_cast<uint4*>(peers.at(ctx, a.handle.landing + static_cast<int64_t>(slot) * hidden, src));
        const uint16_t* y = a.y;
        if (fused) {
            const Token stored = tile::wait_each(
                device::Warp{}, ctx, k,
                [&](int j) -> const uint64_t* {
                    const int32_t r = rec[4 + 2 * j];
                    if (r < 0) {
                        return nullptr;
                    }
                    const int le = detail::local_expert_of_row(sh.exp_start, local_experts, r);
                    return a.fused.tile_done + static_cast<int64_t>(le) * a.fused.tile_stride +
                           (r - sh.exp_start[le]) / a.fused.tile_m;
                },
                Cmp::kGe, a.fused.tile_target);
            y = tile::consume_token<const uint16_t*>(a.y, stored);
        }
        const detail::RowsOfRecord rows_of{y, a.y_stride, row};
        warp_weighted_sum<U>(rows, weight, rows_of, 0, granules, [dst](int gi, uint4 v) { put16(dst + gi, v); });
        if (lane == 0) {
            atomicAdd(&sh.sent[src], 1);
        }
    }
    __syncthreads();
    if (tid < num_ranks && sh.sent[tid] > 0) {
        // Which handle these partials are of, released with them: a rank combining another handle sees it.
        ptx::st<Sem::kRelaxed, Scope::kSys>(peers.at(ctx, a.buffer.combine_handle + me, tid),
                                            static_cast<uint64_t>(a.handle_ordinal) + 1);
        signal_add(peers.at(ctx, a.buffer.partial_signal + me, tid), static_cast<uint64_t>(sh.sent[tid]));
        WEFT_TRACE_RECORD(ctx, TraceKind::kSend, TraceRole::kComm, send_t0, tid, sh.sent[tid], 0, 0);
    }

    // B. This rank's tokens: the partials of their destinations, in rank order. Thread r waits for rank r's partials;
    //    each rank has its own count, so each thread is its own group (n = 0 where nothing comes from r), and the
    //    block barrier then extends every thread's acquire to the whole block. A wait that gave up ends the whole
    //    block there (Block::all): none of its threads sums rows that did not come or signals a peer after it.
    const bool from_rank = tid < num_ranks && a.handle.tokens_per_rank[tid] > 0;
    const device::WaitResult partials = tile::wait_each_checked(
        Thread{}, ctx, from_rank ? 1 : 0, FromRank{a.buffer.partial_signal, tid}, Cmp::kGe,
        from_rank ? a.buffer.state->partial_expected[tid] + static_cast<uint64_t>(a.handle.tokens_per_rank[tid]) : 0);
    device::exit_unless(Block{}.all(partials.ok()));
    // Rank r's partials of this call came from its combine on another handle (the ranks combine their handles in
    // different orders; each dispatch matched): what landed is not this handle's. Every block reads the same words
    // (r's next combine waits for this one to end), so all write zeros; block 0 reports it.
    const uint64_t theirs = from_rank ? ptx::ld<Sem::kRelaxed, Scope::kSys>(a.buffer.combine_handle + tid) : 0;
    const bool other_handle = from_rank && theirs != static_cast<uint64_t>(a.handle_ordinal) + 1;
    if (other_handle && blockIdx.x == 0) {
        report_status(a.status, StatusCode::kCallMismatch, me, tid, a.handle_ordinal, static_cast<int64_t>(theirs) - 1,
                      -1, -1, call, KernelId::kNormalCombine);
    }
    const bool mismatch = __syncthreads_or(other_handle) != 0;
    const uint16_t* landing = tile::consume_token<const uint16_t*>(a.handle.landing, partials.token());
    WEFT_TRACE_BEGIN(combine_t0);
    for (int t = global_warp; t < num_tokens; t += num_warps) {
        const int32_t* sidx = a.handle.send_idx + static_cast<int64_t>(t) * num_ranks;
        auto* dst = reinterpret_cast<uint4*>(a.out + static_cast<int64_t>(t) * a.out_stride);
        for (int c0 = 0; c0 < granules; c0 += 32 * U) {
            float acc[U][8];
#pragma unroll
            for (int u = 0; u < U; ++u) {
#pragma unroll
                for (int q = 0; q < 8; ++q) {
                    acc[u][q] = 0.0f;
                }
            }
            for (int r0 = 0; r0 < num_ranks; r0 += 32) {
                const int32_t my_idx = !mismatch && r0 + lane < num_ranks ? sidx[r0 + lane] : -1;
                uint32_t present = __ballot_sync(0xffffffffu, my_idx >= 0);
                // Two partials at a time: both rows' loads in flight before the first is added (in rank order).
                while (present != 0) {
                    int l0 = 0, l1 = 0;
                    const bool two = take_two_lanes(present, l0, l1);  // warp-uniform
                    const int32_t idx0 = __shfl_sync(0xffffffffu, my_idx, l0);
                    const int32_t idx1 = __shfl_sync(0xffffffffu, my_idx, l1);
                    const auto* part0 = reinterpret_cast<const uint4*>(
                        landing + static_cast<int64_t>(sh.send_base[r0 + l0] + idx0) * hidden);
                    const auto* part1 = reinterpret_cast<const uint4*>(
                        landing + static_cast<int64_t>(sh.send_base[r0 + l1] + idx1) * hidden);
                    uint4 v0[U];
                    uint4 v1[U];
                    warp_load_chunk<U>(v0, part0, c0, granules);
                    warp_load_chunk<U>(v1, part1, c0, two ? granules : 0);  // end 0: no loads
                    add_bf16x8<U>(acc, v0);
                    if (two) {
                        add_bf16x8<U>(acc, v1);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int gi = c0 + u * 32 + lane;
                if (gi < granules) {
                    ptx::st(dst + gi, f32_to_bf16x8(acc[u]));
                }
            }
        }
    }
    WEFT_TRACE_RECORD_IF(tid == 0, ctx, TraceKind::kCombine, TraceRole::kComm, combine_t0, num_tokens, 0, 0, 0);

    // C. The last block: state for the next call, and "my landing is free" to every rank.
    if (last_block_arrive(&a.buffer.state->combine_arrivals)) {
        if (tid == 0) {
            a.buffer.state->combine_calls = call;
        }
        if (fused) {
            // Every row of every local expert belongs to a received token whose wait saw its tile row complete: the
            // GEMM's adds are all in, and the counters it used start the next call at zero.
            for (int le = warp; le < local_experts; le += kWarps) {
                const int32_t tile_rows = (a.handle.expert_counts[le] + a.fused.tile_m - 1) / a.fused.tile_m;
                for (int m = lane; m < tile_rows; m += 32) {
                    a.fused.tile_done[static_cast<int64_t>(le) * a.fused.tile_stride + m] = 0;
                }
            }
        }
        if (tid < num_ranks) {
            a.buffer.state->partial_expected[tid] += static_cast<uint64_t>(a.handle.tokens_per_rank[tid]);
            signal_add(peers.at(ctx, a.buffer.combine_done + me, tid), 1);
        }
    }
}

}  // namespace weft::kernels::ep
