// SPDX-License-Identifier: MIT
// The grouped GEMM's scheduler and epilogue hook for the tensor-parallel MoE layers (weft::ops::MoeAgGroupedGemm,
// MoeGroupedGemmRs): the kernel is weft's sm_90a GEMM (gemm/gemm_sm90.cuh) with GroupedScheduler's walk over every
// expert's tiles; these add the layers' waits and signals.
//
//   gemm_kernel<CFG, GatheredWaitScheduler<CFG>, NoEpilogueHook>   layer 0: each tile waits for the members whose
//                                                                   tokens its rows hold (their push kernels)
//   gemm_kernel<CFG, GroupedScheduler<CFG>, GroupDoneHook>          layer 1: the tile that completes an expert raises
//                                                                   its done word (the members' combine waits on it)
#pragma once

#include "gemm/gemm_sm90.cuh"
#include "weft/common/moe_tp_params.hpp"
#include "weft/device/signal.cuh"
#include "weft/device/tile.cuh"
#include "weft/ptx/atom.cuh"
#include "weft/ptx/ld_st.cuh"

namespace weft::kernels::gemm {

using weft::moe::GatheredWaitParams;
using weft::moe::GroupDoneParams;

/// GroupedScheduler whose producer waits, before loading a tile's rows of A, until every member whose tokens those
/// rows hold has pushed its rows (GatheredWaitParams). Rows of a group are in token order and a member's tokens are
/// one contiguous range, so the members of a tile are those between its first and last row's; a row of no token
/// (padding, -1) makes the tile wait for every member. tile::wait_each's checked form (one thread, ld.acquire.sys
/// polls, then the proxy fence the TMA loads need), inline; a wait that gives up at its bound (a member that never
/// called: its Diagnostic recorded) stops the CTA's waiting (kSchedulerWaitMayFail): the kernel runs to its end, the
/// CUDA context stays usable, and the output of that call is not defined (the layer's own rows only). NOTE: no abort
/// word here: reading it made ptxas spill the producer's 40 registers; each CTA waits out at most one bound (its later
/// tiles do not wait), all CTAs at once.
template <GemmConfig kCfg>
class GatheredWaitScheduler {
public:
    using Params = GatheredWaitParams;
    static constexpr bool kGrouped = true;

    __device__ GatheredWaitScheduler(const Params& p, const GemmArgs& args) : base_(p.groups, args), p_(p) {}

    __device__ int32_t num_tiles() const { return base_.num_tiles(); }
    __device__ GemmTile tile(int32_t i) const { return base_.tile(i); }

    __device__ device::WaitResult wait_before_load(const GemmTile& t) const {
        const uint64_t expected = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(p_.epoch) * p_.per_epoch;
        const int32_t last = (t.m0 + kCfg.tile_m < t.m_end ? t.m0 + kCfg.tile_m : t.m_end) - 1;
        const int32_t first_token = t.m0 <= last ? p_.gather_index[t.m0] : -1;
        const int32_t last_token = t.m0 <= last ? p_.gather_index[last] : -1;
        int32_t s0 = 0, n = p_.num_ranks;
        if (first_token >= 0 && last_token >= first_token) {
            s0 = first_token / p_.tokens_per_rank;
            n = last_token / p_.tokens_per_rank - s0 + 1;
        }
        DeviceCtx ctx{};
        ctx.world_rank = p_.world_rank;
        ctx.timeout_ns = p_.timeout_ns;
        ctx.diag = p_.diag;
        return device::tile::wait_each_checked(
            device::Thread{}, ctx, n, [&](int i) { return p_.arrived + s0 + i; }, Cmp::kGe, expected);
    }

private:
    GroupedScheduler<kCfg> base_;
    const Params& p_;
};

/// Counts each group's stored tiles; the tile that completes its group (ceil(count / tile_m) x ceil(n / tile_n) tiles,
/// count clamped to [0, capacity] as the scheduler clamps it) resets the counter for the next call and raises
/// done[group] to *epoch (GroupDoneParams). The count is an acq_rel add at system scope, so the last tile's release
/// covers every tile of the group (each tile's stores completed before its add: notify_stored).
struct GroupDoneHook {
    using Params = GroupDoneParams;
    static constexpr bool kNotifies = true;
    __device__ static bool after_tile_stored(const Params& p, const GemmTile& t) {
        const int32_t raw = p.counts[t.group];
        const int32_t count = raw < 0 ? 0 : (raw > p.capacity ? p.capacity : raw);
        const uint32_t tiles = static_cast<uint32_t>((count + p.tile_m - 1) / p.tile_m) *
                               static_cast<uint32_t>((p.n + p.tile_n - 1) / p.tile_n);
        const uint32_t before = ptx::atom_add<ptx::Sem::kAcqRel, ptx::Scope::kSys>(p.counters + t.group, 1u);
        if (before + 1 == tiles) {
            ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(p.counters + t.group, 0u);
            const uint64_t epoch = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(p.epoch);
            device::signal_release<ptx::Scope::kSys>(p.done + t.group, epoch, device::SignalOp::kSet);
        }
        return true;
    }
};

}  // namespace weft::kernels::gemm
