// SPDX-License-Identifier: MIT
// Communication hooks of the GEMM: bounded signal wait/notify helpers and the epilogue hooks that raise a
// signal once a tile's output is in global memory.
//
// TODO(device layer): switch the helpers in weft::gemm::detail to weft::device's tile-layer wait/notify
// (and ptx/ld_st, ptx/fence) when they land; the hook interfaces below stay as they are.
#pragma once

#include "weft/common/diagnostics.hpp"
#include "weft/common/gemm_config.hpp"
#include "weft/common/gemm_hook_params.hpp"
#include "weft/device/spin.cuh"  // wait_for_diagnostic_record
#include "weft/ptx/mbarrier.cuh"
#include "weft/ptx/tma.cuh"

namespace weft::gemm {
namespace detail {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* addr) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];\n" : "=l"(v) : "l"(addr) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* addr, uint64_t value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;\n" ::"l"(addr), "l"(value) : "memory");
}

__device__ __forceinline__ void red_release_sys_add(uint64_t* addr, uint64_t value) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;\n" ::"l"(addr), "l"(value) : "memory");
}

/// A hook's value: the argument (SignalValueMode::kArgument) or *epoch * argument (kEpoch). The epoch word
/// was advanced before this launch in stream order and is not written during it: a relaxed load suffices.
__device__ __forceinline__ uint64_t signal_value(SignalValueMode mode, const uint64_t* epoch, uint64_t value) {
    if (mode != SignalValueMode::kEpoch) return value;
    uint64_t e;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];\n" : "=l"(e) : "l"(epoch) : "memory");
    return e * value;
}

/// Records the first timeout of this launch (claimed atomically) and traps.
__device__ __noinline__ void report_timeout_and_trap(Diagnostic* diag, SpinKind kind, const void* addr,
                                                     uint64_t expected, uint64_t observed, uint64_t waited_ns,
                                                     int line) {
    if (diag != nullptr && atomicCAS(&diag->claimed, 0u, 1u) == 0u) {
        diag->kind = kind;
        diag->cmp = Cmp::kGe;
        diag->rank = -1;
        diag->block_x = static_cast<int32_t>(blockIdx.x);
        diag->block_y = static_cast<int32_t>(blockIdx.y);
        diag->block_z = static_cast<int32_t>(blockIdx.z);
        diag->thread_x = static_cast<int32_t>(threadIdx.x);
        diag->signal_addr = reinterpret_cast<uint64_t>(addr);
        diag->expected = expected;
        diag->observed = observed;
        diag->waited_ns = waited_ns;
        diag->peer = -1;
        diag->line = line;
        __threadfence_system();
        atomicExch(&diag->claimed, 2u);
        __threadfence_system();
    }
    if (diag != nullptr) device::wait_for_diagnostic_record(diag);
    __trap();
}

/// One thread waits until *flag >= expected (acquire, system scope), with nanosleep backoff, for at most
/// timeout_ns; on expiry it records a Diagnostic (when given) and traps. Returns the observed value.
__device__ __forceinline__ uint64_t wait_flag_geq(const uint64_t* flag, uint64_t expected, uint64_t timeout_ns,
                                                  Diagnostic* diag, int line) {
    uint64_t v = ld_acquire_sys(flag);
    if (v >= expected) return v;
    const uint64_t start = ptx::globaltimer();
    unsigned sleep_ns = 32;
    while (true) {
        __nanosleep(sleep_ns);
        if (sleep_ns < 1024) sleep_ns *= 2;
        v = ld_acquire_sys(flag);
        if (v >= expected) return v;
        const uint64_t waited = ptx::globaltimer() - start;
        if (waited > timeout_ns) report_timeout_and_trap(diag, SpinKind::kTileWait, flag, expected, v, waited, line);
    }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------------------
// Epilogue hooks. Interface (a type H):
//   struct Params { ... };                        trivially copyable kernel argument
//   static constexpr bool kNotifies;              false: the kernel never waits for stores to complete
//   __device__ static bool after_tile_stored(const Params&, const GemmTile&);
// after_tile_stored is called by one thread, once per valid tile, after every TMA store of that tile has
// completed (cp.async.bulk.wait_group 0 in each storing thread, then a barrier of the warpgroups that
// stored it): the tile's data is in global memory. Cooperative tiles (both consumer warpgroups store half
// of each) defer the wait by one tile, so the notify of tile i happens after tile i+1's mainloop (or at the
// end); a ping-pong tile's warpgroup waits right after its epilogue, under the other warpgroup's mainloop.
// Either way stores never stall the tensor cores. In ping-pong both warpgroups call it (for their own tiles).
// It runs inside the consumer warpgroups' tile loop and must not trap there (see tp_common/tp_sync.cuh): on a
// failure it records its diagnostic and returns false, and the kernel traps once it has left the loop.
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
            detail::st_release_sys(p.flags + static_cast<int64_t>(t.m_idx) * p.num_n_tiles + t.n_idx,
                                   detail::signal_value(p.value_mode, p.epoch, p.value));
        } else {
            detail::red_release_sys_add(p.flags + t.m_idx, p.value);
        }
        return true;
    }
};

/// Advances a hook's epoch word (SignalValueMode::kEpoch) by one: launch it with one thread, in stream order
/// before the launches that read the word (weft::ops::gemm_advance_epoch does). kUnused: a template, so that a
/// header included by several translation units defines no non-inline kernel.
template <int kUnused>
__global__ void __launch_bounds__(32) gemm_advance_epoch_kernel(uint64_t* epoch) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        uint64_t e;
        asm volatile("ld.relaxed.sys.global.u64 %0, [%1];\n" : "=l"(e) : "l"(epoch) : "memory");
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;\n" ::"l"(epoch), "l"(e + 1) : "memory");
    }
}

}  // namespace weft::gemm
