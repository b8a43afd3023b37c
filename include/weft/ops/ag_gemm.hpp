// SPDX-License-Identifier: MIT
// weft::ops::AgGemm: AllGather+GEMM (column-parallel linear layer) with the all-gather on copy engines
// overlapped with a persistent GEMM that waits per tile on exactly the chunks it needs.
//
//     weft::ops::AgGemm op(tp_team, {.max_m = 8192, .n = 1376, .k = 4096, .dtype = weft::DType::kBF16});
//     op.run(a_local /*[M/W, K]*/, b /*[N, K]*/, c /*[M, N]*/, stream);  // C = AllGather(A) * B^T
//     weft::TensorView a_full = op.gathered(8192);                        // [M, K], for the backward pass
//
// W is the team's size and r a team rank (a World& means its world team). Schedule, protocol and knobs:
// kernels/ag_gemm/README.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "weft/common/gemm_config.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft {
class Team;
class World;
}

namespace weft::ops {

/// Problem bounds, fixed when the op is made (the symmetric buffers are sized from them).
struct AgGemmShape {
    int64_t max_m = 0;  ///< largest M (rows of the gathered A) of a call; a positive multiple of the team's size
    int64_t n = 0;      ///< columns of C = rows of this rank's B [n, k] (its shard of the layer's outputs)
    int64_t k = 0;      ///< a positive multiple of 8
    DType dtype = DType::kBF16;  ///< of A, B and C: kBF16 or kF16
};

/// Knobs. Zero / empty: chosen from the problem and the device.
struct AgGemmOptions {
    std::optional<GemmConfig> config;  ///< the GEMM's tile config: cluster-free, dtypes = shape.dtype, B [N,K]
    int64_t chunk_rows = 0;            ///< rows per copy-engine chunk (one signal each); 0 = heuristic
    int copy_streams = 0;              ///< streams pulling the peers' shards, 1 .. num_ranks-1; 0 = 1; ranks sharing
                                       ///< a GPU use 1
    int sm_budget = 0;                 ///< CTAs of the persistent GEMM; 0 = World::sm_budget() (per device: ranks of
                                       ///< other teams on the GPU keep theirs); where ranks share a GPU, at most
                                       ///< World::shared_sm_budget() (weft::Error otherwise), and one SM of the
                                       ///< rank's share stays free for the copy helpers (the default and a budget of
                                       ///< the whole share run the share less one)
    /// Tune the GEMM config on the first run() outside graph capture: every cluster-free candidate is timed
    /// by the team's members together (the slowest counts; that call synchronises the host) and the fastest is
    /// kept (weft::jit::autotuner: decisions cached on disk; WEFT_AUTOTUNE=0 keeps `config` / the heuristic's).
    bool autotune = false;
};

/// AllGather+GEMM for the members of a Team (a TP group; a World& means its world team). Construction and
/// destruction are collective over the team's members (every member, same shape and options, same order as its other
/// collectives on that team); teams without common members may run theirs at the same time, each on its own stream.
/// Not thread-safe: one rank's thread uses it.
class AgGemm {
public:
    /// Allocates the gathered buffer [max_m, k] and the signal words in the symmetric heap (team-collectively),
    /// creates the copy streams, compiles (JIT, cached on disk) and loads every kernel a call launches, and ends with
    /// a team barrier, so that no member launches a waiting kernel before every member's kernels are loaded. Throws
    /// weft::Error (on every member, at once: a member that refuses its own arguments is named on the others) for a
    /// bad shape or options, or when a member's heap is not load/store reachable
    /// from this rank; on a rank that is not a member, a weft::Error naming the team's world ranks. A team that spans
    /// nodes gathers the other nodes' shards through the network backend (weft/net/host_backend.hpp; made here,
    /// collectively; its errors are thrown here): docs/multinode.md, "AllGather+GEMM across nodes".
    AgGemm(const Team& team, const AgGemmShape& shape, const AgGemmOptions& options = {});
    /// AgGemm(world.team(), shape, options).
    AgGemm(World& world, const AgGemmShape& shape, const AgGemmOptions& options = {});
    /// Collective over the team: waits for this op's eager work (not the whole device's), then frees its
    /// buffers. Its calls are made by one thread and ordered on one stream (or by events: two calls racing on two
    /// streams share its signal words and buffers); a CUDA graph that captured a call must not be replayed once it
    /// is gone (replays are not waited for).
    ~AgGemm();
    AgGemm(const AgGemm&) = delete;
    AgGemm& operator=(const AgGemm&) = delete;

    /// C[M, N] = AllGather(A) * B^T, where team rank r's a_local holds rows [r*M/W, (r+1)*M/W) of A.
    ///   a_local: [M/W, k] (this GPU's device memory; local_shard(M) itself skips the local copy), row stride >= k
    ///   (rows
    ///            not back to back: a row pitch of at most the device's maximum, 2 GiB - 1, else refused)
    ///   b:       [n, k] row-major with a row stride (a linear layer's weight)
    ///   c:       [M, n] row-major with a row stride; every row stride a multiple of 16 bytes, bases 16-byte
    ///            aligned (TMA); same dtype as shape.dtype
    /// c's bytes must not overlap a_local's, b's or the gathered buffer's; a_local is local_shard(M) itself or apart
    /// from the gathered buffer (a weft::Error names the two views otherwise).
    /// Every member calls with the same M (1 <= M/W, M <= max_m). A member that calls with another M (or was built
    /// with another K or dtype) is diagnosed on every rank: the call throws weft::Error at the next sync_and_check,
    /// naming both ranks' M, and no row of c that depends on a differing rank's shard is written (rows computed
    /// before from this rank's own shard or agreeing peers' may be); the op stays usable once every rank cleared
    /// its diagnostics (kernels/ag_gemm/README.md, "Ranks that call differently"). On a team that spans nodes, an M
    /// that differs between nodes is found on the comm stream ahead of the chunks (each call's descriptor crosses
    /// first; the abort ends the chunk transfers queued behind the check): the kCollectiveMismatch is recorded on every
    /// rank and the World is aborted (make a new World; docs/multinode.md, "AllGather+GEMM across nodes"). Asynchronous
    /// on `stream` (it forks the copy streams from it and joins them back); never synchronises the host; capturable in
    /// a CUDA graph (no value of a call is frozen into the graph: see kernels/ag_gemm/README.md). After the call's work
    /// on `stream`, gathered(M) holds A until the next call. A team of one rank runs the plain GEMM on a_local (and
    /// copies it into gathered(M) beside it).
    void run(const TensorView& a_local, const TensorView& b, const TensorView& c, cudaStream_t stream);

    /// [m, k] view of the gathered A (symmetric heap), as the last call with M = m left it.
    TensorView gathered(int64_t m) const;
    /// This rank's rows of gathered(m): [m/W, k]. Writing A there (stream-ordered before run) skips the copy.
    TensorView local_shard(int64_t m) const;

    const AgGemmShape& shape() const;
    const GemmConfig& config() const;  ///< the GEMM's tile config (after tuning: the winner)
    int64_t chunk_rows() const;
    int gemm_grid() const;             ///< CTAs of the persistent GEMM at max_m

    struct State;

private:
    std::unique_ptr<State> s_;
};

/// Checks a shape and options against a team size `num_ranks` (CPU only; the constructor calls it). Throws
/// weft::Error naming the argument.
void validate_ag_gemm_shape(const AgGemmShape& shape, int num_ranks, const AgGemmOptions& options = {});
/// Checks one call's views against the shape; returns M. Throws weft::Error naming the argument.
int64_t validate_ag_gemm_call(const AgGemmShape& shape, int num_ranks, const TensorView& a_local,
                              const TensorView& b, const TensorView& c);
/// The default chunk rows for a shard of rows_per_rank rows of k elements of elem_bytes bytes.
int64_t ag_gemm_default_chunk_rows(int64_t rows_per_rank, int64_t k, int elem_bytes);

namespace detail {
/// AgGemm's GEMM as a fused GEMM (weft/ops/fused_gemm.hpp): AgGemmScheduler (per-chunk waits) and AgGemmHook (stored
/// tiles counted) in weft::kernels::ag_gemm::ag_gemm_kernel, which ends each call (kernels/ag_gemm/ag_gemm.cuh). A
/// team of one rank runs the plain GEMM instead.
FusedGemmSpec ag_gemm_fused_spec();
/// JIT specs of the kernels AgGemm launches (`arch` as KernelSpec::arch).
jit::KernelSpec ag_gemm_kernel_spec(const GemmConfig& config, const std::string& arch = "");
jit::KernelSpec ag_notify_kernel_spec(const std::string& arch = "");
/// A team that spans nodes, with more than one member per node: the relay notification (ag_relay_notify_kernel).
jit::KernelSpec ag_relay_kernel_spec(const std::string& arch = "");
}  // namespace detail

}  // namespace weft::ops
