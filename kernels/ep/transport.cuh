// SPDX-License-Identifier: MIT
// The expert-parallel kernels' only door to other ranks: peer table, remote stores, remote signal adds.
//
// Every byte an EP kernel writes into another rank goes through this file, and every word it waits on
// is raised through it. Today peers are load/store reachable (NVLink or PCIe P2P within a node):
// `PeerTable` maps a symmetric address to the peer's mapping (symm_at semantics, an unreachable peer
// ends the kernel with a kUnreachablePeer diagnostic naming it) and the puts are plain stores. A
// network transport replaces this file: the same calls would stage rows locally and post put/signal
// descriptors (NCCL GIN, or a host proxy), while the kernels stay unchanged. Signals are add-only
// (GIN has add, not set). The kernels wait for local signal words with the tile layer (tile::wait_each
// over FromRank, bounded, naming the rank that did not arrive) and read what arrived through its Token.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/ep_workspace.hpp"
#include "weft/device/signal.cuh"
#include "weft/device/symmetric.cuh"
#include "weft/device/tile.cuh"
#include "weft/ptx/ld_st.cuh"

namespace weft::kernels::ep {

namespace tile = device::tile;
using device::Block;
using device::Thread;
using device::Token;

/// The heap base of every rank of the team as mapped here, cached in shared memory for one kernel.
struct PeerTable {
    uint8_t** base;  ///< [num_ranks] in shared memory

    /// `local` (a symmetric address in this rank's heap) as rank `pe` holds it, mapped here.
    template <class T>
    __device__ __forceinline__ T* at(const DeviceCtx& ctx, T* local, int pe) const {
        const auto offset = reinterpret_cast<const uint8_t*>(local) - ctx.heap_base;
        return reinterpret_cast<T*>(base[pe] + offset);
    }
};

/// Fills `table` (shared memory, num_ranks pointers) for the calling block; ends with a block barrier.
/// A rank that is not load/store reachable ends the kernel with a kUnreachablePeer diagnostic (only
/// the load/store transport exists today).
__device__ __forceinline__ PeerTable load_peer_table(const DeviceCtx& ctx, uint8_t** table,
                                                     int line = __builtin_LINE()) {
    for (int p = static_cast<int>(threadIdx.x); p < ctx.num_ranks; p += static_cast<int>(blockDim.x)) {
        table[p] = device::symm_at_or_trap(ctx, ctx.heap_base, p, line);
    }
    __syncthreads();
    return PeerTable{table};
}

/// Writes 16 bytes into a peer's memory (a pointer from PeerTable::at). Weak store: ordering comes
/// from the signal that follows (signal_add after a block barrier).
__device__ __forceinline__ void put16(void* remote, uint4 v) { ptx::st(static_cast<uint4*>(remote), v); }

/// Writes 8 bytes into a peer's memory.
__device__ __forceinline__ void put8(void* remote, uint2 v) {
    ptx::st(static_cast<uint64_t*>(remote), (static_cast<uint64_t>(v.y) << 32) | v.x);
}

/// Writes one 4-byte word into a peer's memory.
__device__ __forceinline__ void put4(void* remote, uint32_t v) { ptx::st(static_cast<uint32_t*>(remote), v); }

/// Adds `value` to a peer's signal word with release semantics at system scope: every write the
/// calling thread made or observed before (the whole block's, after a block barrier) is visible to a
/// rank that acquires the new value. One thread calls it.
__device__ __forceinline__ void signal_add(uint64_t* remote_signal, uint64_t value) {
    device::signal_release<ptx::Scope::kSys>(remote_signal, value, device::SignalOp::kAdd);
}

/// tile::wait_each's `signal_at` for a local array of signal words indexed by source rank, word s raised only by rank
/// s (signal_add(peers.at(ctx, signals + me, r), ...) on rank me): index i of the wait is the word of rank first + i,
/// and a timeout's Diagnostic names that rank as the word's owner (translated to the world rank).
///
///     const Token t = tile::wait_each(Block{}, ctx, num_ranks, FromRank{a.buffer.count_signal}, Cmp::kGe, call);
///     const Token u = tile::wait_each(Block{}, ctx, 1, FromRank{a.buffer.data_signal, s}, Cmp::kGe, rows);  // rank s
struct FromRank {
    const uint64_t* signals;
    int first = 0;
    __device__ __forceinline__ device::tile::SignalFrom operator()(int i) const {
        return {signals + first + i, first + i};
    }
};

/// FromRank whose waits keep their "wait peer" trace events in the block's trace log (weft/device/trace.cuh), the
/// wait for rank first + i at log slot trace_slot + i, written when the block ends, instead of into the trace buffer
/// at once: for the low-latency kernels, which flush the log after their last signal. The same wait otherwise
/// (untraced builds: identical; trace_slot unused).
struct FromRankLogged : FromRank {
    int trace_slot;
    __device__ __forceinline__ FromRankLogged(const uint64_t* s, int slot, int f = 0)
        : FromRank{s, f}, trace_slot(slot) {}
    /// The log slot of the wait for rank `peer`.
    __device__ __forceinline__ int trace_slot_of(int peer) const { return trace_slot + peer - first; }
};

}  // namespace weft::kernels::ep
