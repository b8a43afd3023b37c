// SPDX-License-Identifier: MIT
// The memory-bound halves of the gathered grouped GEMM and the TP MoE layers: rows gathered through an index list
// (moe_gather_kernel), expert-sorted fp32 rows written back to token order per slot or as a top-k weighted sum over
// one or more sources (moe_combine_kernel: the ReduceScatter of TP MoE layer 1 when the sources are the team's
// partial products), and two one-block helpers (moe_notify_kernel, moe_wait_kernel) of the layers' call protocol.
//
//   moe_gather_kernel<0>            one warp per row, 16-byte copies
//   moe_combine_kernel<0>           one warp per token; waits per (group, source) for MoeCombineArgs::done
//   moe_combine_ready_kernel<0>     one warp per token, no waits (every source's rows written before the launch)
//   moe_notify_kernel<0>            1 block of 32 threads
//   moe_wait_kernel<0>              1 block of 32 threads
//   moe_push_rows_kernel<0>         TP MoE layer 0: this rank's rows into every member's gathered A
#pragma once

#include "weft/common/moe_tp_params.hpp"
#include "weft/device/signal.cuh"
#include "weft/device/tile.cuh"
#include "weft/ptx/cvt.cuh"
#include "weft/ptx/ld_st.cuh"

namespace weft::kernels::moe_tp {

using weft::moe::kMoeMaxRanks;
using weft::moe::kMoeThreads;
using weft::moe::MoeCombineArgs;
using weft::moe::MoeCombineMode;
using weft::moe::MoeGatherArgs;
using weft::moe::MoeNotifyArgs;
using weft::moe::MoePushArgs;
using weft::moe::MoeWaitArgs;

/// out[r] = a[gather_index[r]] (zeros for an index < 0 or >= tokens), one warp per row, 16 bytes per lane per step.
template <int kUnused>
__global__ void __launch_bounds__(kMoeThreads) moe_gather_kernel(const MoeGatherArgs g) {
    constexpr int kWarps = kMoeThreads / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int32_t warps = static_cast<int32_t>(gridDim.x) * kWarps;
    for (int32_t r = static_cast<int32_t>(blockIdx.x) * kWarps + static_cast<int32_t>(threadIdx.x) / 32; r < g.rows;
         r += warps) {
        const int32_t src = g.gather_index[r];
        uint4* dst = reinterpret_cast<uint4*>(g.out + static_cast<int64_t>(r) * g.ldo);
        if (src < 0 || src >= g.tokens) {
            for (int32_t c = lane; c < g.k / 8; c += 32) dst[c] = make_uint4(0, 0, 0, 0);
        } else {
            const uint4* s = reinterpret_cast<const uint4*>(g.a + static_cast<int64_t>(src) * g.lda);
            for (int32_t c = lane; c < g.k / 8; c += 32) dst[c] = s[c];
        }
    }
}

namespace detail {

/// arr[i] for a runtime i < kMoeMaxRanks, as selects over the kernel parameter array (indexing it directly copies the
/// array to the stack).
template <class T>
__device__ __forceinline__ T pick(const T (&arr)[kMoeMaxRanks], int i) {
    T out = arr[0];
#pragma unroll
    for (int j = 1; j < kMoeMaxRanks; ++j) {
        if (j == i) out = arr[j];
    }
    return out;
}

/// Bounded wait (checked form, inline: no call) until *word >= value for the n words word_at(i) of owners owner_at(i);
/// the whole group (a block, or the kernel's one warp) calls. A wait that gives up (its Diagnostic recorded, the abort
/// word raised) ends every thread of the group (`exit`, not a trap: the kernel ends, the context stays usable, and
/// World::sync_and_check throws the diagnosis). Callers keep no barrier after it that other groups would wait in.
/// kTrap: trap instead (the push kernel, whose loop spills 16 bytes around an exit).
template <bool kTrap = false, class Group, class WordAt>
__device__ __forceinline__ void wait_words(Group group, const DeviceCtx& ctx, int n, WordAt&& word_at, uint64_t value) {
    const bool ok = device::tile::wait_each_checked(group, ctx, n, word_at, Cmp::kGe, value).ok();
    if constexpr (kTrap) {
        if (!ok) __trap();
    } else {
        device::exit_unless(ok);
    }
}

/// The routing part of moe_call_signature: the sum over experts e of call_descriptor_mix(e + 1, counts[e]), the same in
/// every lane (the whole warp calls).
__device__ __forceinline__ uint64_t routing_digest(const int32_t* counts, int32_t num_experts) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    uint64_t h = 0;
    for (int32_t e = lane; e < num_experts; e += 32) {
        h += call_descriptor_mix(static_cast<uint64_t>(e) + 1, static_cast<uint64_t>(static_cast<uint32_t>(counts[e])));
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) h += __shfl_xor_sync(0xFFFFFFFFu, h, off);
    return h;
}

/// Row `row` of source s's partial (4 floats at column c).
__device__ __forceinline__ float4 partial_at(const MoeCombineArgs& a, int s, int32_t row, int32_t c) {
    return __ldcg(reinterpret_cast<const float4*>(pick(a.partials, s) + static_cast<int64_t>(row) * a.ldp + c));
}

/// Stores 4 floats of a row of `out` (bf16 or f32) at column c.
__device__ __forceinline__ void store4(const MoeCombineArgs& a, int64_t row, int32_t c, float4 v) {
    if (a.out_f32) {
        *reinterpret_cast<float4*>(static_cast<float*>(a.out) + row * a.ldo + c) = v;
    } else {
        uint2 packed;
        packed.x = ptx::cvt_rn_bf16x2(v.x, v.y);
        packed.y = ptx::cvt_rn_bf16x2(v.z, v.w);
        *reinterpret_cast<uint2*>(static_cast<unsigned short*>(a.out) + row * a.ldo + c) = packed;
    }
}

/// The sum over sources (in index order) of row `row`, 4 columns at c.
__device__ __forceinline__ float4 sources_sum(const MoeCombineArgs& a, int32_t row, int32_t c) {
    float4 v = partial_at(a, 0, row, c);
    for (int s = 1; s < a.num_sources; ++s) {
        const float4 w = partial_at(a, s, row, c);
        v.x += w.x;
        v.y += w.y;
        v.z += w.z;
        v.w += w.w;
    }
    return v;
}

/// The combine without waits (every source's rows are written before the launch), one
/// pass in token order: kPerSlot writes each slot's row (zeros for a dropped one); kWeightedSum sums a token's slots in
/// fp32 registers, in ascending row order (for a routing moe_route made: ascending expert, then k, as the waiting
/// combine's group walk adds them), and casts once. A slot row outside [0, rows) is a
/// dropped slot. No scratch: each token's partial rows are read once.
__device__ __forceinline__ void combine_ready(const MoeCombineArgs& a) {
    constexpr int kWarps = kMoeThreads / 32;
    constexpr int kMaxTopk = weft::moe::kMoeMaxTopk;
    __shared__ int32_t sorted_rows[kWarps][kMaxTopk];
    __shared__ float sorted_weights[kWarps][kMaxTopk];
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int32_t warp0 = static_cast<int32_t>(blockIdx.x) * kWarps + warp;
    const int32_t num_warps = static_cast<int32_t>(gridDim.x) * kWarps;
    const bool sum = a.mode == MoeCombineMode::kWeightedSum;
    const int32_t quads = a.n / 4;
    for (int32_t t = warp0; t < a.tokens; t += num_warps) {
        const int64_t slot0 = static_cast<int64_t>(a.token_begin + t) * a.topk;
        if (!sum) {
            for (int32_t k = 0; k < a.topk; ++k) {
                const int32_t row = a.slot_rows[slot0 + k];
                const bool valid = row >= 0 && row < a.rows;
                for (int32_t c = lane; c < quads; c += 32) {
                    const float4 v = valid ? sources_sum(a, row, 4 * c) : make_float4(0.f, 0.f, 0.f, 0.f);
                    store4(a, static_cast<int64_t>(t) * a.topk + k, 4 * c, v);
                }
            }
            continue;
        }
        // Lane j (and j + 32) holds slot j; its place among the valid slots in (row, j) order.
        const int32_t row_lo = lane < a.topk ? a.slot_rows[slot0 + lane] : -1;
        const int32_t row_hi = lane + 32 < a.topk ? a.slot_rows[slot0 + lane + 32] : -1;
        const bool valid_lo = row_lo >= 0 && row_lo < a.rows;
        const bool valid_hi = row_hi >= 0 && row_hi < a.rows;
        const int count = __popc(__ballot_sync(0xFFFFFFFFu, valid_lo)) + __popc(__ballot_sync(0xFFFFFFFFu, valid_hi));
        int place_lo = 0, place_hi = 0;
        for (int32_t i = 0; i < a.topk; ++i) {
            const int32_t other = __shfl_sync(0xFFFFFFFFu, i < 32 ? row_lo : row_hi, i % 32);
            if (other < 0 || other >= a.rows) continue;
            place_lo += other < row_lo || (other == row_lo && i < lane) ? 1 : 0;
            place_hi += other < row_hi || (other == row_hi && i < lane + 32) ? 1 : 0;
        }
        if (valid_lo) {
            sorted_rows[warp][place_lo] = row_lo;
            sorted_weights[warp][place_lo] = a.weights != nullptr ? a.weights[slot0 + lane] : 1.0f;
        }
        if (valid_hi) {
            sorted_rows[warp][place_hi] = row_hi;
            sorted_weights[warp][place_hi] = a.weights != nullptr ? a.weights[slot0 + lane + 32] : 1.0f;
        }
        __syncwarp();
        for (int32_t c = lane; c < quads; c += 32) {
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
            for (int i = 0; i < count; ++i) {
                const float wi = sorted_weights[warp][i];
                const float4 v = sources_sum(a, sorted_rows[warp][i], 4 * c);
                acc.x += wi * v.x;
                acc.y += wi * v.y;
                acc.z += wi * v.z;
                acc.w += wi * v.w;
            }
            store4(a, t, 4 * c, acc);
        }
        __syncwarp();  // the next token's places overwrite this one's
    }
}

/// The combine with waits (MoeCombineArgs::done): the block walks the groups in order, first waits (the block,
/// bounded) until every source finished the group, then each warp adds its tokens' slots that the group holds into
/// their fp32 accumulators (kWeightedSum) or writes the slots' rows (kPerSlot); kWeightedSum ends with the
/// accumulators cast to `out`.
__device__ __forceinline__ void combine_waiting(const MoeCombineArgs& a) {
    constexpr int kWarps = kMoeThreads / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int32_t warp0 = static_cast<int32_t>(blockIdx.x) * kWarps + static_cast<int32_t>(threadIdx.x) / 32;
    const int32_t num_warps = static_cast<int32_t>(gridDim.x) * kWarps;
    const bool sum = a.mode == MoeCombineMode::kWeightedSum;
    if (sum) {
        for (int32_t t = warp0; t < a.tokens; t += num_warps) {
            float4* row = reinterpret_cast<float4*>(a.acc + static_cast<int64_t>(t) * a.n);
            for (int32_t c = lane; c < a.n / 4; c += 32) row[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    } else {
        // Dropped slots, and rows outside the partials (a routing built by hand): zero rows (no group holds them).
        for (int32_t t = warp0; t < a.tokens; t += num_warps) {
            for (int32_t k = 0; k < a.topk; ++k) {
                const int64_t slot = static_cast<int64_t>(a.token_begin + t) * a.topk + k;
                const int32_t row = a.slot_rows[slot];
                if (row >= 0 && row < a.rows) continue;
                for (int32_t c = lane * 4; c < a.n; c += 128) {
                    store4(a, static_cast<int64_t>(t) * a.topk + k, c, make_float4(0.f, 0.f, 0.f, 0.f));
                }
            }
        }
    }
    for (int32_t g = 0; g < a.num_experts; ++g) {
        const int32_t count = a.counts[g];
        if (count <= 0) continue;
        const int32_t first = a.offsets[g];
        const uint64_t expected = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(a.epoch);
        wait_words(
            device::Block{}, a.ctx, a.num_sources,
            [&](int s) {
                return device::tile::SignalFrom{pick(a.done, s) + g, pick(a.done_owner, s)};
            },
            expected);
        for (int32_t t = warp0; t < a.tokens; t += num_warps) {
            for (int32_t k = 0; k < a.topk; ++k) {
                const int64_t slot = static_cast<int64_t>(a.token_begin + t) * a.topk + k;
                const int32_t row = a.slot_rows[slot];
                if (row < first || row >= first + count || row < 0 || row >= a.rows) continue;
                if (sum) {
                    const float w = a.weights != nullptr ? a.weights[slot] : 1.0f;
                    float4* acc = reinterpret_cast<float4*>(a.acc + static_cast<int64_t>(t) * a.n);
                    for (int32_t c = lane; c < a.n / 4; c += 32) {
                        const float4 v = sources_sum(a, row, 4 * c);
                        float4 x = acc[c];
                        x.x += w * v.x;
                        x.y += w * v.y;
                        x.z += w * v.z;
                        x.w += w * v.w;
                        acc[c] = x;
                    }
                } else {
                    for (int32_t c = lane * 4; c < a.n; c += 128) {
                        store4(a, static_cast<int64_t>(t) * a.topk + k, c, sources_sum(a, row, c));
                    }
                }
            }
        }
    }
    if (sum) {
        for (int32_t t = warp0; t < a.tokens; t += num_warps) {
            const float4* acc = reinterpret_cast<const float4*>(a.acc + static_cast<int64_t>(t) * a.n);
            for (int32_t c = lane; c < a.n / 4; c += 32) store4(a, t, 4 * c, acc[c]);
        }
    }
}

}  // namespace detail

/// Expert-sorted fp32 rows back to token order (MoeCombineArgs) as the sources finish them: MoeCombineArgs::done set
/// (combine_waiting: the block walks the groups, waiting for every source's done word of each). Each warp owns tokens
/// warp, warp + W, ... of the launch; a token's slots sit in distinct rows and only its warp touches its accumulator
/// and rows of `out`: no atomics, the same sums in the same order in every run. After the launch's reads, each block
/// adds 1 to every *consumed[s] (when set).
template <int kUnused>
__global__ void __launch_bounds__(kMoeThreads) moe_combine_kernel(const MoeCombineArgs a) {
    detail::combine_waiting(a);
    if (a.consumed[0] != nullptr) {
        __syncthreads();  // every read of the sources' partials of this block is done
        if (threadIdx.x < static_cast<unsigned>(a.num_sources)) {
            device::signal_release<ptx::Scope::kSys>(detail::pick(a.consumed, static_cast<int>(threadIdx.x)), 1,
                                                     device::SignalOp::kAdd);
        }
    }
}

/// The same combine once every source's rows are written (MoeCombineArgs::done and consumed unused): one pass in token
/// order, each token's sum in registers (combine_ready), its terms in moe_combine_kernel's order for moe_route's
/// layout. A kernel of its own: beside the waiting walk's bounded-wait exit, the register sort spills.
template <int kUnused>
__global__ void __launch_bounds__(kMoeThreads) moe_combine_ready_kernel(const MoeCombineArgs a) {
    detail::combine_ready(a);
}

/// *words[i] += value (release, system scope), i in [0, n): thread i.
template <int kUnused>
__global__ void __launch_bounds__(32) moe_notify_kernel(const MoeNotifyArgs a) {
    if (a.signatures != nullptr) {
        const uint64_t mine =
            weft::moe::moe_call_signature(a.descriptor, detail::routing_digest(a.counts, a.num_experts));
        const uint64_t expected = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(a.epoch) * a.per_epoch;
        detail::wait_words(
            device::Warp{}, a.ctx, a.n,
            [&](int i) {
                return device::tile::SignalFrom{a.arrived + i, i};
            },
            expected);
        const int q = static_cast<int>(threadIdx.x);
        if (q < a.n) {
            // Written by q's push before the arrived adds this wait acquired.
            const uint64_t theirs = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(a.signatures + q);
            if (theirs != mine) {  // inline (no call: this kernel keeps no local memory)
                device::record_diagnostic(a.ctx, device::SpinSite{SpinKind::kCollectiveMismatch, q, __LINE__}, Cmp::kEq,
                                          a.signatures + q, mine, theirs, 0, false);
                device::raise_abort(a.ctx);
            }
        }
    }
    if (threadIdx.x < static_cast<unsigned>(a.n)) {
        device::signal_release<ptx::Scope::kSys>(detail::pick(a.words, static_cast<int>(threadIdx.x)), a.value,
                                                 device::SignalOp::kAdd);
    }
}

/// Waits until *words[i] >= *epoch * per_epoch - lag for every i in [0, n) (bounded: a timeout records a kTileWait
/// diagnostic naming owner[i] and ends the kernel).
template <int kUnused>
__global__ void __launch_bounds__(32) moe_wait_kernel(const MoeWaitArgs a) {
    const uint64_t e = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(a.epoch) * a.per_epoch;
    const uint64_t expected = e > a.lag ? e - a.lag : 0;
    detail::wait_words(
        device::Warp{}, a.ctx, a.n,
        [&](int i) {
            return device::tile::SignalFrom{detail::pick(a.words, i), detail::pick(a.owner, i)};
        },
        expected);
}

/// TP MoE layer 0: this rank's tokens' rows into every member's gathered A, one row per routed slot (MoePushArgs).
/// Members in rank-rotated order from this one (its own rows first: its GEMM's local tiles start at once); warps
/// grid-stride over this rank's (token, k) slots; after a block's share of member q, a block barrier then one release
/// add of 1 on q's arrived[this rank] (q's GEMM waits for *epoch * gridDim.x of them).
template <int kUnused>
__global__ void __launch_bounds__(kMoeThreads) moe_push_rows_kernel(const MoePushArgs a) {
    constexpr int kWarps = kMoeThreads / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int32_t warp0 = static_cast<int32_t>(blockIdx.x) * kWarps + static_cast<int32_t>(threadIdx.x) / 32;
    const int32_t num_warps = static_cast<int32_t>(gridDim.x) * kWarps;
    const uint64_t epoch = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(a.epoch);
    // This call's signature (M and the routing), written to every member before the arrived add that releases it.
    uint64_t signature = 0;
    if (threadIdx.x < 32) {
        signature = weft::moe::moe_call_signature(a.descriptor, detail::routing_digest(a.counts, a.num_experts));
    }
    const int32_t slots = a.tokens_per_rank * a.topk;
    const int64_t slot0 = static_cast<int64_t>(a.rank) * slots;
    for (int32_t i = 0; i < a.num_ranks; ++i) {
        const int32_t q = (a.rank + i) % a.num_ranks;
        if (q != a.rank) {
            // q's GEMM of the previous call has read its gathered A (q adds 1 to consumed[this rank] per call).
            detail::wait_words<true>(
                device::Block{}, a.ctx, 1,
                [&](int) {
                    return device::tile::SignalFrom{a.consumed + q, q};
                },
                epoch - 1);
        }
        unsigned short* dst = detail::pick(a.dst, q);
        for (int32_t s = warp0; s < slots; s += num_warps) {
            const int32_t row = a.slot_rows[slot0 + s];
            if (row < 0) continue;
            const uint4* src = reinterpret_cast<const uint4*>(a.x + static_cast<int64_t>(s / a.topk) * a.ldx);
            uint4* d = reinterpret_cast<uint4*>(dst + static_cast<int64_t>(row) * a.ldd);
            for (int32_t c = lane; c < a.k / 8; c += 32) d[c] = src[c];
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(detail::pick(a.signature_at, q), signature);
            device::signal_release<ptx::Scope::kSys>(detail::pick(a.arrived, q), 1, device::SignalOp::kAdd);
        }
    }
}

}  // namespace weft::kernels::moe_tp
