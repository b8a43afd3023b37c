// SPDX-License-Identifier: MIT
// GEMM+AllReduce device side (small M, decode): after the GEMM wrote this rank's partial into its symmetric
// buffer (stream order), a one-shot all-reduce: CTA 0 tells every rank the partial is complete, every CTA
// waits for all ranks' partials, sums its share of the elements over the ranks in rank order (fp32, the
// same order on every rank: every rank gets bit-identical results), and the last CTA to finish runs a
// done-barrier so that no rank overwrites its partial (next call) while a peer still reads it. Every rank's call
// descriptor (M, n, dtypes) rides with its ready flag; every CTA compares them after its wait and, before reading a
// partial, ends (exit, a kCollectiveMismatch diagnostic, the abort word raised) when a rank called with another
// shape, so that no rank reads rows a peer never wrote.
// The picture and the protocol are in kernels/gemm_ar/README.md.
//
// JIT instantiation (weft::ops::GemmAr builds it): weft::kernels::gemm_ar::ar_reduce_kernel<PARTIAL_DTYPE, OUT_DTYPE>
#pragma once

#include "tp_common/tp_device.cuh"
#include "weft/common/tp_params.hpp"
#include "weft/device/tile.cuh"

namespace weft::kernels::gemm_ar {

namespace tile = device::tile;
using tp_common::arrive_last;
using tp_common::load8;
using tp_common::load_elem;
using tp_common::store8;
using tp_common::store_elem;

// NOTE: waits and notifies take the device layer's checked forms, inline: the trapping forms' shared failure path is
// a call, whose ABI would cost this kernel registers. A wait that gives up (a peer that never called, an aborted World:
// its Diagnostic recorded) ends the block with `exit` (the CUDA context stays usable); only an unreachable peer (a
// programming error) traps. The launch bound's minimum of 4 CTAs per SM
// (at most 64 registers) keeps ptxas from squeezing the kernel into 32 registers and spilling the reduction.
template <DType kPartial, DType kOut>
__global__ void __launch_bounds__(kTpReduceThreads, 4) ar_reduce_kernel(const ArReduceParams p) {
    __shared__ uint64_t s_epoch;
    if (threadIdx.x == 0) s_epoch = ptx::ld(p.epoch) + 1;
    __syncthreads();
    const uint64_t e = s_epoch;
    const int32_t num_ranks = p.ctx.num_ranks;
    const int32_t rank = p.ctx.rank;
    uint64_t* const signatures = p.signatures + (e & 1u) * static_cast<uint64_t>(num_ranks);
    if (blockIdx.x == 0) {
        // This rank's partial was written by the GEMM before this kernel started (stream order). The signature store
        // precedes the notify (a release) in program order: a rank that sees the flag sees the signature.
        for (int pe = static_cast<int>(threadIdx.x); pe < num_ranks; pe += static_cast<int>(blockDim.x)) {
            // notify_checked, with the signature stored through the same translation (one allocation holds both).
            uint64_t* ready = device::symm_at_checked(p.ctx, p.ready + rank, pe, __LINE__);
            device::trap_unless(ready != nullptr);
            ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(ready + (signatures - p.ready), p.signature);
            device::signal_release<ptx::Scope::kSys>(ready, 1ull, device::SignalOp::kAdd);
        }
    }
    // Thread s waits for rank s's partial; the block barrier extends the acquire; the partials' reads take the token.
    const device::Token token =
        tile::wait_checked(device::Block{}, p.ctx, p.ready, num_ranks, Cmp::kGe, e).token_or_exit();

    constexpr int64_t kPBytes = dtype_bytes(kPartial);
    constexpr int64_t kOBytes = dtype_bytes(kOut);
    constexpr int kMaxRanks = 8;
    __shared__ const unsigned char* s_src[kMaxRanks];  // every rank's partial as mapped here
    if (static_cast<int>(threadIdx.x) < num_ranks) {
        const void* partial = device::symm_at_checked(p.ctx, p.partial, static_cast<int>(threadIdx.x), __LINE__);
        device::trap_unless(partial != nullptr);
        s_src[threadIdx.x] = static_cast<const unsigned char*>(tile::consume_token(partial, token));
    }
    // Every CTA checks every rank's call before it reads any partial (the same words for every CTA).
    bool agrees = true;
    if (static_cast<int>(threadIdx.x) < num_ranks) {
        const uint64_t* word = signatures + threadIdx.x;
        const uint64_t theirs = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(word);
        if (theirs != p.signature) {
            agrees = false;
            device::record_diagnostic(
                p.ctx, device::SpinSite{SpinKind::kCollectiveMismatch, static_cast<int32_t>(threadIdx.x), __LINE__},
                Cmp::kEq, word, p.signature, theirs, 0);
            device::raise_abort(p.ctx);
        }
    }
    device::exit_unless(device::Block{}.all(agrees));  // also the barrier that publishes s_src
    const int64_t vecs_per_row = (p.n + kTpVecElems - 1) / kTpVecElems;
    const int64_t total = static_cast<int64_t>(p.m) * vecs_per_row;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t r = i / vecs_per_row;
        const int64_t col = (i - r * vecs_per_row) * kTpVecElems;
        const int64_t src_off = (r * p.ldp + col) * kPBytes;
        auto* out = static_cast<unsigned char*>(p.out) + (r * p.ldc + col) * kOBytes;
        if (col + kTpVecElems <= p.n) {
            float sum[8] = {-0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f};  // -0: a sum of -0 is -0
            for (int s = 0; s < num_ranks; ++s) {
                float v[8];
                load8<kPartial>(s_src[s] + src_off, v);
#pragma unroll
                for (int j = 0; j < 8; ++j) sum[j] += v[j];
            }
            store8<kOut>(out, sum);
        } else {
            for (int64_t j = 0; col + j < p.n; ++j) {
                float sum = -0.f;
                for (int s = 0; s < num_ranks; ++s) sum += load_elem<kPartial>(s_src[s] + src_off, j);
                store_elem<kOut>(out, j, sum);
            }
        }
    }
    __syncthreads();  // this CTA has read its share of every partial
    if (threadIdx.x == 0 && arrive_last(p.exit_count, gridDim.x)) {
        for (int32_t pe = 0; pe < num_ranks; ++pe) {
            device::trap_unless(tile::notify_checked(device::Thread{}, p.ctx, p.done + rank, pe, 1ull));
        }
        // A done-barrier that gives up leaves the epoch behind: the op refuses its next call (AbortMark).
        if (tile::wait_checked(device::Thread{}, p.ctx, p.done, num_ranks, Cmp::kGe, e).ok()) ptx::st(p.epoch, e);
    }
}

}  // namespace weft::kernels::gemm_ar
