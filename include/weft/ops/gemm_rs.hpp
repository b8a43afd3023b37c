// SPDX-License-Identifier: MIT
// weft::ops::GemmRs: GEMM+ReduceScatter (row-parallel linear layer): the GEMM computes its partial tile by
// tile in destination order. Push mode: each peer's tiles go straight into that peer's buffer and each rank
// adds the peers' partials to its own tiles in the epilogue. Pull mode: a reduction on a few SMs beside the
// GEMM sums the ranks' partials of its own rows in fp32 as they complete.
//
//     weft::ops::GemmRs op(tp_team, {.max_m = 8192, .n = 4096, .k = 1376, .dtype = weft::DType::kBF16});
//     op.run(a /*[M, K/W]*/, b /*[N, K/W]*/, c /*[M/W, N]*/, stream);  // C = ReduceScatter(A * B^T)
//
// W is the team's size and r a team rank (a World& means its world team). Schedule, protocol and knobs:
// kernels/gemm_rs/README.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weft/common/gemm_config.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft {
class Team;
class World;
}

namespace weft::ops {

/// Problem bounds, fixed when the op is made.
struct GemmRsShape {
    int64_t max_m = 0;  ///< largest M of a call (rows of A and of the unreduced product); a multiple of the team's size
    int64_t n = 0;      ///< columns of C
    int64_t k = 0;      ///< this rank's K (its shard of the layer's inputs); a positive multiple of 8
    DType dtype = DType::kBF16;  ///< of A, B and C: kBF16 or kF16
};

/// How the partials meet (kernels/gemm_rs/README.md draws both).
enum class GemmRsMode {
    kAuto,  ///< kPush where it applies (below) and every rank of the world (not only of the team: other teams' ranks
            ///< on a shared GPU run beside it) has a GPU of its own, else kPull
    kPull,  ///< the GEMM writes its partial locally; a reduction kernel on reduce_ctas SMs reads the peers'
    kPush,  ///< the GEMM stores each peer's tiles into that peer's buffer (TMA over NVLink) and adds the peers'
            ///< partials to its own tiles in the epilogue: no reduction kernel, every SM of the budget computes.
            ///< Needs 16-bit partials (partial_dtype = shape.dtype), n a multiple of 8, at most
            ///< kRsPushMaxRanks (8) ranks, and no reduce_ctas (a team of one runs the plain GEMM, needing none
            ///< of these). Refused where ranks share a GPU (kAuto takes kPull there): the GEMM's CTAs wait inside
            ///< the kernel for the peers' tiles, so every rank's CTAs must be resident at once, which ranks sharing
            ///< a GPU's SMs cannot be promised (back-to-back push calls there have waited for a peer kernel that
            ///< never started: kernels/gemm_rs/README.md, "Ranks sharing a GPU"); push_on_shared_gpus overrides
};
const char* gemm_rs_mode_name(GemmRsMode mode);

/// Knobs. Zero / empty: chosen from the problem and the device.
struct GemmRsOptions {
    GemmRsMode mode = GemmRsMode::kAuto;  ///< kAuto: kPush where it applies (one rank per GPU), else kPull
    std::optional<GemmConfig> config;   ///< the GEMM's tile config: cluster-free, in = shape.dtype, B [N,K]
    /// The partials' dtype: shape.dtype (default) or kF32. Each rank's partial is rounded to it once before the
    /// fp32 sum: with 16-bit partials an element's error is bounded by u·Σ_r|P_r| (u of that dtype), not u·|C|,
    /// which matters where the ranks' partials cancel; f16 partials beyond 65504 become inf even where C fits.
    /// kF32 (pull mode) keeps the partials exact.
    std::optional<DType> partial_dtype;
    int64_t chunk_rows = 0;             ///< rows per counter: a multiple of the tile's rows; 0 = heuristic
    int reduce_ctas = 0;                ///< pull mode: CTAs of the reduction kernel; 0 = heuristic (budget/8, at
                                        ///< most 16 with one rank per GPU)
    int sm_budget = 0;                  ///< SMs for GEMM + reduction; 0 = World::shared_sm_budget() (per device);
                                        ///< where ranks share a GPU, at most that (weft::Error otherwise)
    bool autotune = false;              ///< tune the GEMM config on the first run(), as AgGemmOptions::autotune
    /// Runs mode = kPush where ranks share a GPU (refused otherwise, GemmRsMode::kPush says why): for tests of the
    /// push kernels on one GPU, which accept that a call can then wait out the World's timeout.
    bool push_on_shared_gpus = false;
};

/// GEMM+ReduceScatter for the members of a Team (a World& means its world team). Construction and destruction are
/// collective over the team's members (as AgGemm); teams without common members may run theirs at the same time.
class GemmRs {
public:
    /// Allocates the partial buffer [max_m, n] and the counters in the symmetric heap (team-collectively) and an fp32
    /// accumulator, compiles and loads the kernels, ends with a team barrier. shape.k is each member's own (its
    /// shard; shards may be uneven): the tile config is chosen for the team's largest. Throws weft::Error on every
    /// member for a bad shape or options on any member (naming it), for members whose max_m, n, dtype, partial dtype,
    /// mode or chunk_rows differ (naming both), or when a member's heap is not load/store reachable; on a rank that is
    /// not a
    /// member, a weft::Error naming the team's world ranks. A team that spans nodes reduces in two stages: this op
    /// over each node's members, then the network backend's send/receive across the nodes (weft/net/host_backend.hpp;
    /// made here, collectively; its errors are thrown here): docs/multinode.md, "GEMM+ReduceScatter across nodes".
    GemmRs(const Team& team, const GemmRsShape& shape, const GemmRsOptions& options = {});
    /// GemmRs(world.team(), shape, options).
    GemmRs(World& world, const GemmRsShape& shape, const GemmRsOptions& options = {});
    /// Collective over the team: waits for this op's eager work (not the whole device's), then frees its
    /// buffers. Its calls are made by one thread and ordered on one stream (or by events: two calls racing on two
    /// streams share its signal words and buffers); a CUDA graph that captured a call must not be replayed once it
    /// is gone (replays are not waited for).
    ~GemmRs();
    GemmRs(const GemmRs&) = delete;
    GemmRs& operator=(const GemmRs&) = delete;

    /// C[M/W, N] = rows [r*M/W, (r+1)*M/W) of sum over the team's ranks s of A_s * B_s^T (each partial accumulated
    /// in fp32 and stored as GemmRsOptions::partial_dtype, the sum of the partials in fp32).
    ///   a: [M, k] this rank's A; b: [n, k] this rank's weight shard; c: [M/W, n] (TMA rules as AgGemm::run), its
    ///   bytes apart from a's and b's
    /// Every member calls with the same M. A member that calls with another M (or another n, partial dtype, tiles,
    /// chunks or mode) is diagnosed on every rank of its node: the call throws weft::Error at the next sync_and_check
    /// naming both ranks' M, and in pull mode no element of c is written; in push mode this rank's c of that call is
    /// not defined (kernels/gemm_rs/README.md). Replace the op after such an error (an argument refused on the host,
    /// before any launch, leaves the op usable). On a team that spans nodes, an M that differs between nodes is
    /// found on the comm stream ahead of the rows (each call's descriptor crosses first; the abort ends the transfers):
    /// every rank records a kCollectiveMismatch naming both calls, the World is aborted (make a new World) and no
    /// element of c is written (docs/multinode.md, "GEMM+ReduceScatter across nodes"). Asynchronous on `stream` (the
    /// reduction runs on a side stream forked from it and joined back); graph-capturable. A team of one rank runs the
    /// plain GEMM into c.
    void run(const TensorView& a, const TensorView& b, const TensorView& c, cudaStream_t stream);

    const GemmRsShape& shape() const;
    const GemmConfig& config() const;
    DType partial_dtype() const;
    int64_t chunk_rows() const;
    int gemm_grid() const;
    int reduce_ctas() const;  ///< 0 in push mode
    GemmRsMode mode() const;  ///< kPull or kPush (a team of one rank runs the plain GEMM in either)

    struct State;

private:
    std::unique_ptr<State> s_;
};

void validate_gemm_rs_shape(const GemmRsShape& shape, int num_ranks, const GemmRsOptions& options = {});
/// Checks one call's views against the shape; returns M.
int64_t validate_gemm_rs_call(const GemmRsShape& shape, int num_ranks, const TensorView& a, const TensorView& b,
                              const TensorView& c);

namespace detail {
/// The GEMM configs of a GemmRs (first: the one run() starts with; the rest: autotuning candidates) and its
/// rows per counter, chosen on the host for `gemm_budget` SMs. Every config's tile_m divides chunk_rows: the
/// heuristic chunk is a multiple of every candidate's tile_m; an explicit options.chunk_rows restricts the
/// configs to those whose tile_m divides it. Throws weft::Error for bad options (validate_gemm_rs_shape),
/// or when no config fits an explicit chunk_rows.
struct GemmRsPlan {
    std::vector<GemmConfig> configs;
    int64_t chunk_rows = 0;
    int64_t max_chunks_per_rank = 1;  ///< counters per destination rank for the largest M
};
GemmRsPlan plan_gemm_rs(const GemmRsShape& shape, int num_ranks, int gemm_budget, const GemmRsOptions& options);

/// Why push mode cannot serve these options (empty: it can).
std::string gemm_rs_push_unsupported(const GemmRsShape& shape, int num_ranks, const GemmRsOptions& options);
/// kPull or kPush for these options; throws weft::Error when kPush is asked for and cannot serve them.
/// kAuto picks kPull for ranks that share a GPU (see GemmRsMode::kAuto).
GemmRsMode resolve_gemm_rs_mode(const GemmRsShape& shape, int num_ranks, const GemmRsOptions& options,
                                bool ranks_share_a_gpu = false);

/// GemmRs's GEMM as a fused GEMM (weft/ops/fused_gemm.hpp) in a resolved mode: its own kernel rs_gemm_kernel (CTA 0
/// publishes the call's descriptor to the peers, then the GEMM) over RsGemmScheduler (destination order, the first
/// load waits for `released`) with RsGemmHook (pull: per-tile counters) or RsPushHook (push: peers' tiles stored into
/// their buffers, own tiles add the peers' partials). A team of one rank runs the plain GEMM instead.
FusedGemmSpec gemm_rs_fused_spec(GemmRsMode mode);
jit::KernelSpec gemm_rs_kernel_spec(const GemmConfig& config, const std::string& arch = "",
                                    GemmRsMode mode = GemmRsMode::kPull);
jit::KernelSpec rs_reduce_kernel_spec(DType partial, DType out, const std::string& arch = "");
/// A team that spans nodes: the final sum of the nodes' partial sums (kernels/gemm_rs/node_sum.cuh).
jit::KernelSpec rs_node_sum_kernel_spec(DType dtype, const std::string& arch = "");
}  // namespace detail

}  // namespace weft::ops
