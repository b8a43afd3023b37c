// SPDX-License-Identifier: MIT
// First-writer-wins records in memory the host reads while (or after) a kernel fails: the device layer's
// Diagnostic and any other per-launch error record with a `claimed` word (0 empty, 1 being written, 2 complete).
//
//     if (device::write_record_once(&rec->claimed, [&] { rec->code = code; rec->value = v; })) { ... }
//     device::wait_record_complete(&rec->claimed);   // before a trap: the record reaches host memory first
#pragma once

#include "weft/common/macros.hpp"
#include "weft/ptx/atom.cuh"
#include "weft/ptx/fence.cuh"
#include "weft/ptx/ld_st.cuh"
#include "weft/ptx/timer.cuh"

namespace weft::device {

/// Longest wait for a record to read back complete (wait_record_complete) before the caller goes on (and traps).
inline constexpr uint64_t kRecordDrainNs = 100ull * 1000 * 1000;

/// Writes a record at most once per `claimed` word: the first thread (of any block, of any kernel that shares the
/// word) that claims it, `claimed` 0 -> 1 with atom.relaxed.gpu.cas (why GPU scope: below), runs `fill()` (plain stores
/// of the record's fields), then `fence.sc.sys`, `claimed` = 2 (st.relaxed.sys), `fence.sc.sys`: whoever reads `claimed
/// == 2` at system scope (the host, through host-mapped memory) reads every field `fill` wrote. Returns true in the
/// thread that wrote the record; false in every other (someone claimed it first, whether or not it has finished: see
/// wait_record_complete). Inline, no call and no trap (pass `fill` as a lambda, which is inlined too). Any thread.
template <class Fill>
__device__ __forceinline__ bool write_record_once(uint32_t* claimed, Fill&& fill) {
    // GPU scope: the contenders are this GPU's threads (the host only reads), and a system-scoped atomic on
    // host-mapped memory needs host-native atomics, which a PCIe-attached GPU lacks (compute-sanitizer flags it).
    if (ptx::atom_cas<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(claimed, 0u, 1u) != 0u) {
        return false;
    }
    fill();
    ptx::fence<ptx::Sem::kSc, ptx::Scope::kSys>();
    ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(claimed, 2u);
    ptx::fence<ptx::Sem::kSc, ptx::Scope::kSys>();
    return true;
}

/// Waits, bounded by kRecordDrainNs (nanosleep polls of ld.relaxed.sys), until the record reads back complete
/// (`claimed == 2`); true when it did. Call it before a trap: a trap ends every thread of the grid at once and can
/// drop writes still on their way to host memory, so the writer reads its record back (a read does not pass the
/// posted writes before it), and a thread that lost the claim waits for the winner instead of trapping over a
/// half-written record. Inline, no call and no trap. Any thread.
__device__ __forceinline__ bool wait_record_complete(const uint32_t* claimed) {
    const uint64_t start = ptx::globaltimer();
    while (ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(claimed) != 2u) {
        if (ptx::globaltimer() - start >= kRecordDrainNs) {
            return false;
        }
        ptx::nanosleep(256);
    }
    return true;
}

}  // namespace weft::device
