// SPDX-License-Identifier: MIT
// What every collective kernel shares: per-block bookkeeping (epoch, barriers, call descriptors), staging, the
// rank-ordered reduction of n ranks' data, and LL payload access.
//
// Protocol summary (kernels/all_reduce/README.md has the pictures):
//  - Every kernel reads the rank's epoch (CollectiveState::epoch) at its start; the last block to finish advances
//    it. Collectives of one World run in stream order and every kernel waits on every peer, so a rank running
//    kernel e + 2 knows every peer has finished kernel e: buffers indexed by the epoch's parity (staging, LL lines,
//    descriptors) are therefore reused without clearing and without an exit barrier.
//  - The whole protocol assumes each kernel of a rank runs under an epoch of its own. Every block checks it before it
//    writes anything (check_collective_start): the last kernel whose blocks finished left its claim (epoch and
//    descriptor) in CollectiveState::claim, and `done` must count fewer blocks than this grid has. A kernel that
//    starts under the epoch of a finished kernel with another descriptor (the advance between them was lost) would
//    otherwise send its LL lines and descriptors into the very slots its slower peers are still reading for the
//    earlier kernel, under a flag they accept (a peer past its header check then reads wrong data, with no error).
//    Such a block records a kCollectiveEpoch diagnostic and ends instead.
//  - Block b of every rank handles the same part of the message and meets only block b of the other ranks
//    (device::block_barrier, add-only counters; the count lives in CollectiveState::arrivals[b]). All ranks launch
//    the same grid (the host agrees on the SM budget once), so the counts stay equal on every rank.
//  - Every rank's call carries a descriptor (make_call_descriptor: op, algorithm, dtype, count, a digest of offsets
//    and flags), and every block compares the peers' with its own before it moves any data, in the handshake the
//    kernel makes anyway, so the check adds no round trip:
//      barrier kernels: every block writes it into its slot of every peer's descriptor row before the entry barrier
//        (the same thread then arrives at that peer: the arrival's release covers the store) and reads the peers'
//        after it (enter);
//      LL kernels: every block sends it as one LL line (the epoch's flag in both words) to every peer before its
//        data lines, and waits for the peers' before it writes any output (send_ll_descriptor, check_ll_descriptor);
//        the headers travel with the data, so waiting for them overlaps the wait for the data lines. Barrier kernels
//        send the header too, so that ranks that chose different algorithms (LL on one, a barrier kernel on another)
//        are diagnosed by the LL side, whose abort then stops the barrier side's wait.
//    On a mismatch a block records a kCollectiveMismatch diagnostic (this rank's descriptor and the peer's), raises
//    the abort word and ends all its threads with `exit` before touching the output; the other blocks of the rank do
//    the same or stop at their next wait (the abort word), so the op throws on every rank and the CUDA context stays
//    usable. The copy-engine algorithms trap instead: the copies that follow their entry kernel are already queued
//    on the host and only a trap stops them.
//
// Traced builds (weft/device/trace.cuh, docs/profiling.md): the barriers record "wait peer p" per peer (thread p of
// each block); the kernels record their block's steps from thread 0 ("stage chunk b", "push chunk b to p", "pull
// chunk b from p", "recv from p", "reduce"), chunk b being block b's part of the message, timed as thread 0 saw it.
#pragma once

#include "weft/common/collectives.hpp"
#include "weft/common/device_ctx.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/device/block_barrier.cuh"
#include "weft/device/copy.cuh"
#include "weft/device/ll.cuh"
#include "weft/device/scope.cuh"
#include "weft/device/spin.cuh"
#include "weft/device/symmetric.cuh"
#include "weft/ptx/atom.cuh"
#include "weft/ptx/cvt.cuh"
#include "weft/ptx/ld_st.cuh"

namespace weft::kernels::common {

// ------------------------------------------------------------------------------------------------
// Number formats: elements are handled as raw bits (uint16_t or uint32_t) and converted to fp32 to add (exactly),
// and back with round to nearest even (weft/ptx/cvt.cuh).

template <DType D>
struct Num;

template <>
struct Num<DType::kBF16> {
    using Bits = uint16_t;
    __device__ __forceinline__ static float to_float(Bits b) { return ptx::bf16_bits_to_f32(b); }
    __device__ __forceinline__ static Bits from_float(float f) { return ptx::cvt_rn_bf16(f); }
};

template <>
struct Num<DType::kF16> {
    using Bits = uint16_t;
    __device__ __forceinline__ static float to_float(Bits b) { return ptx::f16_bits_to_f32(b); }
    __device__ __forceinline__ static Bits from_float(float f) { return ptx::cvt_rn_f16(f); }
};

template <>
struct Num<DType::kF32> {
    using Bits = uint32_t;
    __device__ __forceinline__ static float to_float(Bits b) { return __uint_as_float(b); }
    __device__ __forceinline__ static Bits from_float(float f) { return __float_as_uint(f); }
};

/// The unsigned type of `kBytes` bytes used to move a vector (2, 4, 8 or 16).
template <int kBytes>
struct RawOf;
template <>
struct RawOf<2> {
    using type = uint16_t;
};
template <>
struct RawOf<4> {
    using type = uint32_t;
};
template <>
struct RawOf<8> {
    using type = uint2;
};
template <>
struct RawOf<16> {
    using type = uint4;
};

/// Plain (weak, never .nc) load of kBytes bytes. Data other ranks wrote is read only after an acquiring wait.
template <int kBytes>
__device__ __forceinline__ typename RawOf<kBytes>::type load_raw(const void* p) {
    if constexpr (kBytes == 2) {
        return *static_cast<const volatile uint16_t*>(p);
    } else {
        return ptx::ld(static_cast<const typename RawOf<kBytes>::type*>(p));
    }
}

template <int kBytes>
__device__ __forceinline__ void store_raw(void* p, typename RawOf<kBytes>::type v) {
    if constexpr (kBytes == 2) {
        *static_cast<volatile uint16_t*>(p) = v;
    } else {
        ptx::st(static_cast<typename RawOf<kBytes>::type*>(p), v);
    }
}

/// kE element bit patterns, as one value (for __builtin_bit_cast to and from a raw vector).
template <class Bits, int kE>
struct Lanes {
    Bits v[kE];
};

// ------------------------------------------------------------------------------------------------
// Per-block bookkeeping.

/// One block's view of the collective state: the epoch this kernel runs under and the slot's barrier count.
/// Construct it first thing in the kernel (every thread); call finish() last (every thread).
class BlockState {
public:
    /// What a block does when the call (a peer's descriptor) or this rank's collective state is out of step.
    enum class OnMismatch { kExit, kTrap };

    /// Reads the epoch and the slot's barrier count, and checks this rank's state (check_collective_start: the
    /// epoch was advanced since the last kernel, no block was miscounted) before the kernel writes anything: out of
    /// step, the block records a kCollectiveEpoch diagnostic and ends (kExit: all its threads; kTrap: the kernel, for
    /// the copy-engine entry, whose queued copies only a trap stops), so that it never overwrites the lines and
    /// descriptors its peers are still reading under that epoch. Every thread constructs it, first thing.
    __device__ __forceinline__ BlockState(const DeviceCtx& ctx, const CollectiveParams& p,
                                          OnMismatch on = OnMismatch::kExit)
        : ctx_(ctx), p_(p) {
        __shared__ uint64_t shared_state[3];
        if (threadIdx.x == 0) {
            // The three words share a sector. `done` first, with acquire: the blocks it counts (this kernel's, if the
            // state is in step) stored their claim before their releasing count (check_collective_start).
            const uint32_t done = ptx::ld<ptx::Sem::kAcquire, ptx::Scope::kGpu>(&p.state->done);
            const uint64_t epoch = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(&p.state->epoch);
            const uint64_t claim = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(&p.state->claim);
            shared_state[0] = epoch;
            shared_state[1] = p.state->arrivals[blockIdx.x];
            const CollectiveStart check = check_collective_start(claim, epoch, p.descriptor, done, gridDim.x);
            shared_state[2] = check == CollectiveStart::kOk ? 1u : 0u;
            if (check != CollectiveStart::kOk) {
                const bool reused = check == CollectiveStart::kEpochReused;
                out_of_step(ctx, p, on, reused ? Cmp::kNe : Cmp::kLt, reused ? claim : state_count(gridDim.x, done),
                            epoch_and_count(epoch, done),
                            reused ? static_cast<const void*>(&p.state->claim) : &p.state->done);
            }
        }
        __syncthreads();
        epoch_ = shared_state[0];
        completed_ = shared_state[1];
        device::exit_unless(shared_state[2] != 0);  // the whole block ends before anything moves
    }

    __device__ __forceinline__ uint64_t epoch() const { return epoch_; }
    __device__ __forceinline__ uint32_t parity() const { return static_cast<uint32_t>(epoch_ & 1u); }
    /// This epoch's half of the staging buffer (symmetric: the same offset on every rank).
    __device__ __forceinline__ uint8_t* staging() const { return p_.staging + parity() * p_.staging_half_bytes; }
    /// This epoch's LL buffer for lines sent by `sender` (local address; translate for a peer's copy).
    __device__ __forceinline__ uint8_t* ll_slot(int sender) const {
        return p_.ll_buffer + (static_cast<uint64_t>(parity()) * static_cast<uint64_t>(ctx_.num_ranks) +
                               static_cast<uint64_t>(sender)) *
                                  p_.ll_slot_bytes;
    }

    /// This epoch's LL header line of this block for lines sent by `sender` (local address).
    __device__ __forceinline__ uint8_t* ll_header(int sender) const {
        return p_.ll_headers + ((static_cast<uint64_t>(parity()) * static_cast<uint64_t>(ctx_.num_ranks) +
                                 static_cast<uint64_t>(sender)) *
                                    kMaxCollectiveBlocks +
                                blockIdx.x) *
                                   kLowLatencyLineBytes;
    }

    /// Meets block blockIdx.x of every rank (see device::block_barrier). Every thread calls.
    __device__ __forceinline__ void barrier(int line = __builtin_LINE()) {
        completed_ = device::block_barrier(device::Block{}, ctx_, p_.barrier_flags, blockIdx.x, completed_, line);
    }

    /// The entry barrier, with the call descriptor check (top of this file): every block writes its descriptor into
    /// slot `rank` of every peer's row before the barrier and compares the peers' after it; on a mismatch the block
    /// records it and ends (kExit: all its threads, before any data moves; kTrap: the kernel, for the copy-engine
    /// entry). Every thread calls.
    template <OnMismatch kOn = OnMismatch::kExit>
    __device__ __forceinline__ void enter(int line = __builtin_LINE()) {
        const int n = ctx_.num_ranks;
        const int me = ctx_.rank;
        uint64_t* row = p_.descriptors + static_cast<uint64_t>(parity()) * static_cast<uint64_t>(n);
        // The LL header too (one store per peer, no wait): a peer that runs an LL kernel at this epoch (another
        // algorithm) then diagnoses the mismatch and aborts, which stops this block's barrier wait.
        send_ll_descriptor(line);
        // Thread t writes to peer t and then, in the barrier, arrives at peer t: its release covers this store in
        // program order. Every block writes the same value, so the slot is this epoch's once any block arrived.
        for (int t = static_cast<int>(threadIdx.x); t < n; t += static_cast<int>(blockDim.x)) {
            if (t != me) {
                ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kSys>(device::symm_at_or_trap(ctx_, row + me, t, line),
                                                              p_.descriptor);
            }
        }
        barrier(line);
        bool same = true;
        for (int t = static_cast<int>(threadIdx.x); t < n; t += static_cast<int>(blockDim.x)) {
            if (t != me) {
                const uint64_t theirs = ptx::ld<ptx::Sem::kRelaxed, ptx::Scope::kSys>(row + t);
                if (theirs != p_.descriptor) {
                    same = false;
                    if constexpr (kOn == OnMismatch::kTrap) {
                        device::fail_and_trap(ctx_, device::SpinSite{SpinKind::kCollectiveMismatch, t, line}, Cmp::kEq,
                                              row + t, p_.descriptor, theirs, 0);
                    } else {
                        device::record_failure(ctx_, device::SpinSite{SpinKind::kCollectiveMismatch, t, line},
                                               Cmp::kEq, row + t, p_.descriptor, theirs, 0, false);
                    }
                }
            }
        }
        device::exit_unless(device::Block{}.all(same));  // the whole block ends before any data moves
    }

    /// LL kernels, first thing after constructing the state: sends this block's call descriptor to every peer, as
    /// line blockIdx.x of slot `rank` of its LL headers with the epoch's flag. Every thread calls; no sync.
    __device__ __forceinline__ void send_ll_descriptor(int line = __builtin_LINE()) const {
        const int n = ctx_.num_ranks;
        const int me = ctx_.rank;
        const uint2 d = make_uint2(static_cast<uint32_t>(p_.descriptor), static_cast<uint32_t>(p_.descriptor >> 32));
        for (int t = static_cast<int>(threadIdx.x); t < n; t += static_cast<int>(blockDim.x)) {
            if (t != me) {
                device::ll::store_line(device::symm_at_or_trap(ctx_, ll_header(me), t, line), d,
                                       low_latency_flag(epoch_));
            }
        }
    }

    /// LL kernels, before the first write of any output: waits for every peer's header line (this epoch's flag) for
    /// this block and compares its descriptor with this call's; on a mismatch the block records it and ends all its
    /// threads (exit). A header that never comes is a wait that gives up (ll::wait_line). Every thread calls; syncs
    /// the block.
    __device__ __forceinline__ void check_ll_descriptor(int line = __builtin_LINE()) const {
        const int n = ctx_.num_ranks;
        const int me = ctx_.rank;
        bool same = true;
        for (int t = static_cast<int>(threadIdx.x); t < n; t += static_cast<int>(blockDim.x)) {
            if (t != me) {
                const uint8_t* header = ll_header(t);
                const uint2 v = device::ll::wait_line_from(ctx_, header, low_latency_flag(epoch_), t, line);
                const uint64_t theirs = (static_cast<uint64_t>(v.y) << 32) | v.x;
                if (theirs != p_.descriptor) {
                    same = false;
                    device::record_failure(ctx_, device::SpinSite{SpinKind::kCollectiveMismatch, t, line}, Cmp::kEq,
                                           header, p_.descriptor, theirs, 0, false);
                }
            }
        }
        device::exit_unless(device::Block{}.all(same));
    }

    /// Records the slot's barrier count and this kernel's claim and, in the last block to finish, advances the epoch.
    /// A count past the grid (a block miscounted: the epoch is not advanced) records a kCollectiveEpoch diagnostic.
    /// Every thread calls.
    __device__ __forceinline__ void finish() {
        __syncthreads();
        if (threadIdx.x == 0) {
            p_.state->arrivals[blockIdx.x] = completed_;
            // The next kernel's blocks check that the epoch moved on from this claim (check_collective_start).
            ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(&p_.state->claim,
                                                          collective_epoch_claim(epoch_, p_.descriptor));
            // Every block read the epoch before it counts itself done here, so the last one may advance it.
            const uint32_t before = ptx::atom_add<ptx::Sem::kAcqRel, ptx::Scope::kGpu>(&p_.state->done, 1u);
            if (before == gridDim.x - 1) {
                p_.state->done = 0;
                ptx::st<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(&p_.state->epoch, epoch_ + 1);
            } else if (before >= gridDim.x) {
                device::record_failure(ctx_, device::SpinSite{SpinKind::kCollectiveEpoch, -1, __LINE__}, Cmp::kGe,
                                       &p_.state->done, p_.descriptor, state_count(gridDim.x, before),
                                       epoch_and_count(epoch_, before), false);
            }
        }
    }

private:
    /// A kCollectiveEpoch diagnostic's `observed` for a miscount: the grid above the count found.
    __device__ __forceinline__ static uint64_t state_count(uint32_t grid, uint32_t done) {
        return static_cast<uint64_t>(grid) << 32 | done;
    }
    /// A kCollectiveEpoch diagnostic's `waited_ns`: the epoch above the count found (at most 0xFFFF).
    __device__ __forceinline__ static uint64_t epoch_and_count(uint64_t epoch, uint32_t done) {
        return epoch << 16 | (done < 0xFFFFu ? done : 0xFFFFu);
    }

    /// Records the kCollectiveEpoch diagnostic (expected = the call's descriptor), raises the abort word, and traps
    /// for kTrap; the caller ends the block for kExit. Thread 0.
    __device__ __noinline__ static void out_of_step(const DeviceCtx& ctx, const CollectiveParams& p, OnMismatch on,
                                                    Cmp cmp, uint64_t observed, uint64_t epoch_count,
                                                    const void* word) {
        const device::SpinSite site{SpinKind::kCollectiveEpoch, -1, __LINE__};
        if (on == OnMismatch::kTrap) {
            device::fail_and_trap(ctx, site, cmp, word, p.descriptor, observed, epoch_count);
        }
        device::record_failure(ctx, site, cmp, word, p.descriptor, observed, epoch_count, false);
    }

    const DeviceCtx& ctx_;
    const CollectiveParams& p_;
    uint64_t epoch_;
    uint64_t completed_;
};

/// Fills `ptrs[q]` (shared memory, one per rank) with rank q's copy of the symmetric `local` plus `offset` bytes,
/// then syncs the block. A peer that is not load/store reachable traps with kUnreachablePeer.
__device__ __forceinline__ void peer_pointers(const DeviceCtx& ctx, const uint8_t** ptrs, uint8_t* local,
                                              uint64_t offset, int line = __builtin_LINE()) {
    for (int q = static_cast<int>(threadIdx.x); q < ctx.num_ranks; q += static_cast<int>(blockDim.x)) {
        ptrs[q] = device::symm_at_or_trap(ctx, local, q, line) + offset;
    }
    __syncthreads();
}

// ------------------------------------------------------------------------------------------------
// Rank-ordered reduction: out[i] = sum over q = 0 .. n-1 of srcs[q][i], in fp32, in the same order on every rank
// (so every rank produces the same bits).

/// kU vectors (v, v + stride, ...) of the rank-ordered sum: the kU x kChunk loads of a chunk of ranks are issued
/// before their adds, so a thread keeps 8 x 16 bytes in flight (enough to cover a remote read's latency with 64
/// blocks) while staying under 128 registers (two blocks per SM).
template <DType D, int kVec, int kMaxRanks, int kU>
__device__ __forceinline__ void reduce_vectors(const uint8_t* const* srcs, int n, uint64_t v, uint64_t stride,
                                               uint8_t* dst0, uint8_t* dst1) {
    using N = Num<D>;
    using Bits = typename N::Bits;
    using Raw = typename RawOf<kVec>::type;
    constexpr int kE = kVec / static_cast<int>(sizeof(Bits));
    constexpr int kChunk = kMaxRanks < 4 ? kMaxRanks : 4;  // kU x kChunk 16-byte loads in flight per thread
    float acc[kU][kE];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
#pragma unroll
        for (int k = 0; k < kE; ++k) {
            acc[u][k] = -0.0f;  // the sum's identity: -0 + -0 is -0, as a sequential sum gives
        }
    }
    for (int q0 = 0; q0 < n; q0 += kChunk) {
        Raw r[kU][kChunk];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
                if (q0 + j < n) {
                    r[u][j] = load_raw<kVec>(srcs[q0 + j] + (v + u * stride) * kVec);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
                if (q0 + j < n) {
                    const auto lanes = __builtin_bit_cast(Lanes<Bits, kE>, r[u][j]);
#pragma unroll
                    for (int k = 0; k < kE; ++k) {
                        acc[u][k] += N::to_float(lanes.v[k]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
        Lanes<Bits, kE> out;
#pragma unroll
        for (int k = 0; k < kE; ++k) {
            out.v[k] = N::from_float(acc[u][k]);
        }
        const Raw packed = __builtin_bit_cast(Raw, out);
        const uint64_t off = (v + u * stride) * kVec;
        store_raw<kVec>(dst0 + off, packed);
        if (dst1 != nullptr) {
            store_raw<kVec>(dst1 + off, packed);
        }
    }
}

template <DType D, int kVec, int kMaxRanks>
__device__ __forceinline__ void reduce_elements_vec(const uint8_t* const* srcs, int n, uint64_t begin, uint64_t end,
                                                    uint8_t* dst0, uint8_t* dst1) {
    constexpr int kElemBytes = static_cast<int>(sizeof(typename Num<D>::Bits));
    constexpr int kE = kVec / kElemBytes;
    constexpr int kU = 2;
    const uint64_t vec_begin = begin / kE;
    const uint64_t vec_end = end / kE;
    const uint64_t stride = blockDim.x;
    uint64_t v = vec_begin + threadIdx.x;
    for (; v + (kU - 1) * stride < vec_end; v += kU * stride) {
        reduce_vectors<D, kVec, kMaxRanks, kU>(srcs, n, v, stride, dst0, dst1);
    }
    for (; v < vec_end; v += stride) {
        reduce_vectors<D, kVec, kMaxRanks, 1>(srcs, n, v, stride, dst0, dst1);
    }
    if constexpr (kE > 1) {
        // The elements after the last whole vector (only the part that ends at the message's end has any).
        const uint64_t tail = vec_end * kE > begin ? vec_end * kE : begin;
        if (tail < end) {
            reduce_elements_vec<D, kElemBytes, kMaxRanks>(srcs, n, tail, end, dst0, dst1);
        }
    }
}

/// Reduces elements [begin, end) of the n buffers `srcs[q]` (element 0 of each; peers' copies already translated)
/// into dst0 (and dst1 when not null). `begin` is a multiple of the granule. Uses kVec-byte accesses when every
/// pointer allows, element-sized ones otherwise. Every thread of the block calls; no synchronisation.
template <DType D, int kVec, int kMaxRanks>
__device__ __forceinline__ void reduce_elements(const uint8_t* const* srcs, int n, uint64_t begin, uint64_t end,
                                                uint8_t* dst0, uint8_t* dst1) {
    if (begin >= end) {
        return;
    }
    constexpr int kElemBytes = static_cast<int>(sizeof(typename Num<D>::Bits));
    uintptr_t bits = reinterpret_cast<uintptr_t>(dst0) | reinterpret_cast<uintptr_t>(dst1);
    for (int q = 0; q < n; ++q) {
        bits |= reinterpret_cast<uintptr_t>(srcs[q]);
    }
    if constexpr (kVec > kElemBytes) {
        if ((bits & static_cast<uintptr_t>(kVec - 1)) == 0) {
            reduce_elements_vec<D, kVec, kMaxRanks>(srcs, n, begin, end, dst0, dst1);
            return;
        }
    }
    reduce_elements_vec<D, kElemBytes, kMaxRanks>(srcs, n, begin, end, dst0, dst1);
}

// ------------------------------------------------------------------------------------------------
// LL payloads: 8 bytes of a buffer, fewer at its end; 8-byte accesses when aligned, bytes otherwise.

/// Reads the (up to 8) bytes at `p`; bytes past `valid` read as zero.
__device__ __forceinline__ uint2 load_payload(const uint8_t* p, uint64_t valid) {
    if (valid >= 8 && (reinterpret_cast<uintptr_t>(p) & 7u) == 0) {
        return ptx::ld(reinterpret_cast<const uint2*>(p));
    }
    unsigned long long v = 0;  // assembled in a register (an indexed array would live in local memory)
    for (uint32_t k = 0; k < 8 && k < valid; ++k) {
        v |= static_cast<unsigned long long>(static_cast<const volatile uint8_t*>(p)[k]) << (8 * k);
    }
    return make_uint2(static_cast<uint32_t>(v), static_cast<uint32_t>(v >> 32));
}

/// Writes the first min(valid, 8) bytes of `v` to `p`.
__device__ __forceinline__ void store_payload(uint8_t* p, uint2 v, uint64_t valid) {
    if (valid >= 8 && (reinterpret_cast<uintptr_t>(p) & 7u) == 0) {
        ptx::st(reinterpret_cast<uint2*>(p), v);
        return;
    }
    const unsigned long long bits = (static_cast<unsigned long long>(v.y) << 32) | v.x;
    for (uint32_t k = 0; k < 8 && k < valid; ++k) {
        static_cast<volatile uint8_t*>(p)[k] = static_cast<uint8_t>(bits >> (8 * k));
    }
}

/// Line j of a low-latency reduction (all_reduce_low_latency, reduce_scatter_low_latency): the rank-ordered fp32
/// sum of every rank's 8-byte payload, this rank's read from `own` (bytes past `valid` as zero) and each peer's
/// polled from this epoch's LL slot for it at `flag`, kChunk = min(kMaxRanks, 8) waits in flight at a time;
/// returned converted back to D.
template <DType D, int kMaxRanks>
__device__ __forceinline__ uint2 reduce_ll_line(const DeviceCtx& ctx, const BlockState& st, const uint8_t* own,
                                                uint64_t valid, uint64_t j, uint32_t flag) {
    using N = Num<D>;
    using Bits = typename N::Bits;
    constexpr int kLineElems = static_cast<int>(kLowLatencyPayloadBytes / sizeof(Bits));
    constexpr int kChunk = kMaxRanks < 8 ? kMaxRanks : 8;
    const int n = ctx.num_ranks;
    const int me = ctx.rank;
    float acc[kLineElems];
#pragma unroll
    for (int k = 0; k < kLineElems; ++k) {
        acc[k] = -0.0f;  // the sum's identity (see reduce_vectors)
    }
    for (int q0 = 0; q0 < n; q0 += kChunk) {
        uint2 got[kChunk];
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
            const int q = q0 + i;
            if (q < n) {
                got[i] = q == me ? load_payload(own, valid)
                                 : device::ll::wait_line_from(ctx, st.ll_slot(q) + j * kLowLatencyLineBytes, flag, q);
            }
        }
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
            if (q0 + i < n) {
                const auto lanes = __builtin_bit_cast(Lanes<Bits, kLineElems>, got[i]);
#pragma unroll
                for (int k = 0; k < kLineElems; ++k) {
                    acc[k] += N::to_float(lanes.v[k]);
                }
            }
        }
    }
    Lanes<Bits, kLineElems> sum;
#pragma unroll
    for (int k = 0; k < kLineElems; ++k) {
        sum.v[k] = N::from_float(acc[k]);
    }
    return __builtin_bit_cast(uint2, sum);
}

}  // namespace weft::kernels::common
