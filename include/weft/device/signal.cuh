// SPDX-License-Identifier: MIT
// Signal words: the update operations (set, add) with release semantics, shared by shmem and tile layers.
#pragma once

#include "weft/ptx/atom.cuh"
#include "weft/ptx/ld_st.cuh"

namespace weft::device {

/// How a signal word is updated (OpenSHMEM's SHMEM_SIGNAL_SET / SHMEM_SIGNAL_ADD). Prefer kAdd: the
/// planned network transport (NCCL GIN) has signal add but no set, so add-only protocols move to the
/// network unchanged.
enum class SignalOp : uint32_t { kSet = 0, kAdd = 1 };

/// One thread updates `*signal` with release semantics at scope C: everything this thread has written,
/// and everything it has observed (including other threads' writes ordered before it by a group
/// barrier), is visible to whoever acquires the new value. `st.release` (set) or `red.release.add`.
template <ptx::Scope C = ptx::Scope::kSys>
__device__ __forceinline__ void signal_release(uint64_t* signal, uint64_t value, SignalOp op) {
    if (op == SignalOp::kAdd) {
        ptx::red_add<ptx::Sem::kRelease, C>(signal, value);
    } else {
        ptx::st<ptx::Sem::kRelease, C>(signal, value);
    }
}

}  // namespace weft::device
