// SPDX-License-Identifier: MIT
// Communication hooks of the GEMM: the epilogue hooks that raise a signal once a tile's output is in global memory,
// and the epoch word that makes their values graph-safe. Waits and signals go through the device layer
// (weft/device: tile.cuh, signal.cuh); code in the consumer warpgroups uses its *_checked forms.
#pragma once

#include "weft/common/diagnostics.hpp"
#include "weft/common/gemm_config.hpp"
#include "weft/common/gemm_hook_params.hpp"
#include "weft/device/signal.cuh"
#include "weft/device/tile.cuh"
#include "weft/device/trace.cuh"
#include "weft/ptx/ld_st.cuh"
#include "weft/ptx/mbarrier.cuh"
#include "weft/ptx/tma.cuh"

namespace weft::kernels::gemm {

// The parameter structs are host+device data (weft/common/gemm_hook_params.hpp, namespace weft::gemm): host-only
// code fills them for a launch.
using weft::gemm::ChunkWaitParams;
using weft::gemm::GroupedSignalMode;
using weft::gemm::GroupedTileSignalParams;
using weft::gemm::NoEpilogueHookParams;
using weft::gemm::PersistentSchedulerParams;
using weft::gemm::SignalValueMode;
using weft::gemm::TileSignalMode;
using weft::gemm::TileSignalParams;

namespace detail {

/// A hook's value: the argument (SignalValueMode::kArgument) or *epoch * argument (kEpoch). The epoch word
/// was advanced before this launch in stream order and is not written during it: a relaxed load suffices.
__device__ __forceinline__ uint64_t signal_value(SignalValueMode mode, const uint64_t* epoch, uint64_t value) {
    if (mode != SignalValueMode::kEpoch) return value;
    return ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(epoch) * value;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------------------
// Epilogue hooks. Interface (a type H): `using Params`, `static constexpr bool kNotifies` and
// `__device__ static bool after_tile_stored(const Params&, const GemmTile&)`; the contract (when and by whom it
// is called, what it may do) is weft/ops/fused_gemm.hpp's. In ping-pong both warpgroups call it, for their own
// tiles. weft's hooks use the device layer's *_checked forms (no call, no trap in the consumer warpgroups:
// weft/device/spin.cuh says why).
// ---------------------------------------------------------------------------------------------------------

// Optional, for hooks that move where a tile goes (GEMM+ReduceScatter's push mode):
//   static constexpr bool kAddsToTile = true;
//   template <GemmConfig kCfg, int kSlabs, int kAccPerSlab>
//   __device__ static bool add_to_tile(const Params&, const GemmTile&, float (&acc)[kSlabs][kAccPerSlab],
//                                      int wg, int slab0, int tid);
//       called by every thread of the warpgroups that hold the tile (both, cooperative; one, ping-pong) after
//       its mainloop, before its epilogue; acc holds the tile's 64-row slabs slab0 .. slab0 + kSlabs - 1; a
//       barrier inside may only span warpgroup wg (named barrier kBarConsumer0 + wg, 128 threads); may wait
//       (bounded) and add to the fp32 accumulator (the wgmma fragment layout: see store_slab_tail); false (in
//       any thread) when a wait expired, as after_tile_stored;
//   static constexpr bool kRoutesStores = true;
//   __device__ static GemmStoreTarget store_target(const Params&, const GemmTile&, const ptx::TmaDescriptor* d);
//       the tensor map the tile's TMA stores go through (`d`: the kernel's tma_d, or one kept in Params,
//       which the kernel takes as __grid_constant__), rows shifted by -row_offset, rows >= `rows` skipped.
//       The host keeps such a GEMM free of ragged columns (N * element size a multiple of 16 bytes).
// ---------------------------------------------------------------------------------------------------------

/// Where one tile's TMA stores go (Hook::store_target); a plain GEMM stores through tma_d, rows unshifted.
struct GemmStoreTarget {
    const ptx::TmaDescriptor* map;
    int32_t row_offset;
    int32_t rows;
};

template <class Hook>
inline constexpr bool kHookAddsToTile = requires { requires Hook::kAddsToTile; };
template <class Hook>
inline constexpr bool kHookRoutesStores = requires { requires Hook::kRoutesStores; };

/// No signal (a plain GEMM).
struct NoEpilogueHook {
    using Params = NoEpilogueHookParams;
    static constexpr bool kNotifies = false;
    __device__ static bool after_tile_stored(const Params&, const GemmTile&) { return true; }
};

/// Raises a system-scope signal per finished tile: a generation value per tile, or a counter per tile row
/// (a waiter of the counter form waits for num_n_tiles * value per generation). The generation is the
/// argument, or *epoch * value in SignalValueMode::kEpoch (graph-safe).
struct TileSignalHook {
    using Params = TileSignalParams;
    static constexpr bool kNotifies = true;
    __device__ static bool after_tile_stored(const Params& p, const GemmTile& t) {
        if (p.mode == TileSignalMode::kSetPerTile) {
            device::signal_release<ptx::Scope::kSys>(p.flags + static_cast<int64_t>(t.m_idx) * p.num_n_tiles + t.n_idx,
                                                     detail::signal_value(p.value_mode, p.epoch, p.value),
                                                     device::SignalOp::kSet);
        } else {
            device::signal_release<ptx::Scope::kSys>(p.flags + t.m_idx, p.value, device::SignalOp::kAdd);
        }
        return true;
    }
};

/// Grouped GEMM (GroupedScheduler): raises a system-scope add-only counter per finished tile, per group or per (group,
/// row of tiles) of the group (GemmTile::group, GemmTile::m_idx): what a fused MoE consumer of one expert's rows
/// waits for (>= its expected total per call, which it knows from the same counts).
struct GroupedTileSignalHook {
    using Params = GroupedTileSignalParams;
    static constexpr bool kNotifies = true;
    __device__ static bool after_tile_stored(const Params& p, const GemmTile& t) {
        const int64_t idx = p.mode == GroupedSignalMode::kAddPerGroup
                                ? static_cast<int64_t>(t.group)
                                : static_cast<int64_t>(t.group) * p.group_stride + t.m_idx;
        device::signal_release<ptx::Scope::kSys>(p.flags + idx, p.value, device::SignalOp::kAdd);
        return true;
    }
};

#if defined(WEFT_TRACE)
/// The trace's tile event (weft/device/trace.cuh), for hooks whose Params carry the kernel's DeviceCtx as `ctx`; other
/// hooks (a plain GEMM) record nothing. Called through WEFT_TRACE_GEMM_TILE; untraced builds do not see it.
template <class Params>
__device__ __forceinline__ void trace_tile(const Params& p, const GemmTile& t, int wg, uint64_t begin_ns) {
    if constexpr (requires { p.ctx.rank; }) {
        if (t.valid) {
            device::trace::record(p.ctx, TraceKind::kTile, wg == 0 ? TraceRole::kConsumer0 : TraceRole::kConsumer1,
                                  begin_ns, t.m_idx, t.n_idx, 0, 0);
        }
    }
}
#define WEFT_TRACE_GEMM_TILE(params, tile, wg, tid, begin) \
    if ((tid) == 0) ::weft::kernels::gemm::trace_tile((params), (tile), (wg), (begin))
#else
#define WEFT_TRACE_GEMM_TILE(params, tile, wg, tid, begin) static_cast<void>(0)
#endif

/// Advances a hook's epoch word (SignalValueMode::kEpoch) by one: launch it with one thread, in stream order
/// before the launches that read the word (weft::ops::gemm_advance_epoch does). kUnused: a template, so that a
/// header included by several translation units defines no non-inline kernel.
template <int kUnused>
__global__ void __launch_bounds__(32) gemm_advance_epoch_kernel(uint64_t* epoch) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        const uint64_t e = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(epoch);
        ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(epoch, e + 1);
    }
}

}  // namespace weft::kernels::gemm
