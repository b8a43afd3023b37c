// SPDX-License-Identifier: MIT
// weft::ops::GemmAr: GEMM+AllReduce for small M (decode): the small-M (or tiled) GEMM writes this rank's
// partial into a symmetric buffer (in GemmArOptions::partial_dtype), then the all-reduce sums every rank's partial
// in fp32.
//
//     weft::ops::GemmAr op(tp_team, {.max_m = 128, .n = 8192, .k = 1024, .dtype = weft::DType::kBF16});
//     op.run(a /*[M, K/W]*/, b /*[N, K/W]*/, c /*[M, N]*/, stream);  // C = AllReduce(A * B^T)
//
// W is the team's size (a World& means its world team). Protocol and knobs: kernels/gemm_ar/README.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "weft/common/gemm_config.hpp"
#include "weft/common/gemv_config.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft {
class Team;
class World;
}

namespace weft::ops {

struct GemmArShape {
    int64_t max_m = 0;  ///< largest M of a call (any M >= 1; the op is built for decode, M <= 128)
    int64_t n = 0;
    int64_t k = 0;      ///< this rank's K; a positive multiple of 8
    DType dtype = DType::kBF16;  ///< of A, B and C: kBF16 or kF16
};

struct GemmArOptions {
    std::optional<GemmConfig> config;    ///< tiled-path config (M > 64): cluster-free, in = shape.dtype
    /// The partials' dtype: shape.dtype (default) or kF32. Each rank's partial is rounded to it once before the
    /// fp32 sum: with 16-bit partials an element's error is bounded by u·Σ_r|P_r| (u of that dtype), not u·|C|,
    /// which matters where the ranks' partials cancel; f16 partials beyond 65504 become inf even where C fits.
    /// kF32 keeps them exact (and takes the op's own all-reduce kernel: ops::all_reduce needs 16-bit partials).
    std::optional<DType> partial_dtype;
    int reduce_ctas = 0;                 ///< CTAs of the all-reduce kernel; 0 = heuristic
    int sm_budget = 0;                   ///< 0 = World::sm_budget(); bounds the tiled GEMM (M > 64) and the
                                         ///< reduction: the small-M kernels (M <= 64, no waits) span the device
    /// The all-reduce half: weft's ops::all_reduce over the op's team (automatic algorithm: low-latency for decode
    /// sizes) when the partials have the output dtype and N % 8 == 0 (a C with padded rows: reduced into a private
    /// [max_m, N] buffer, made by the first such call, then copied into C's rows); it needs the team's collective
    /// workspace on the symmetric heap (ops::prepare_collectives(team), made by the constructor). false, or when those
    /// conditions fail: the op's own one-shot kernel (a ready and a done barrier around the reads).
    bool collective_all_reduce = true;
};

/// GEMM+AllReduce for the members of a Team (at most 8; a World& means its world team). Construction and destruction
/// are collective over the team's members (as AgGemm); teams without common members may run theirs at the same time.
class GemmAr {
public:
    /// Allocates the partial and the signal words team-collectively, loads the kernels (and makes the team's
    /// collective workspace when the all-reduce half is ops::all_reduce), ends with a team barrier. Throws
    /// weft::Error on every member for a bad shape or options, for a team that spans nodes (first, before anything
    /// is made: across nodes run the GEMM, then ops::all_reduce), or when a member's heap is not load/store
    /// reachable; on a rank that is not a member, a weft::Error naming the team's world ranks.
    GemmAr(const Team& team, const GemmArShape& shape, const GemmArOptions& options = {});
    /// GemmAr(world.team(), shape, options).
    GemmAr(World& world, const GemmArShape& shape, const GemmArOptions& options = {});
    /// Collective over the team: waits for this op's eager work (not the whole device's), then frees its
    /// buffers. Its calls are made by one thread and ordered on one stream (or by events: two calls racing on two
    /// streams share its signal words and buffers); a CUDA graph that captured a call must not be replayed once it
    /// is gone (replays are not waited for).
    ~GemmAr();
    GemmAr(const GemmAr&) = delete;
    GemmAr& operator=(const GemmAr&) = delete;

    /// C[M, N] = sum over the team's ranks s of A_s * B_s^T on every member (bit-identical on every member: the
    /// partials are summed in team rank order).
    ///   a: [M, k]; b: [n, k]; c: [M, n] (row strides multiples of 16 bytes, bases 16-byte aligned; a padded c's
    ///      row pitch at most the device's maximum, 2 GiB - 1, on the collective all-reduce path), its bytes apart
    ///   from a's and b's
    /// Every member calls with the same M; one that calls with another M is diagnosed on every rank (the call throws
    /// weft::Error at the next sync_and_check naming both M; c untouched; an argument refused on the host, before any
    /// launch, leaves the op usable): replace the op after such an error (its
    /// flags are left as the failed call found them), and, on the default all-reduce path (ops::all_reduce over the
    /// team's collectives workspace, whose epochs the failed call left out of step), the World. On that path a call
    /// is one of the team's collectives: stream-ordered with the team's other collectives like them.
    /// Asynchronous on `stream`; graph-capturable. A team of one rank runs the plain GEMM into c.
    void run(const TensorView& a, const TensorView& b, const TensorView& c, cudaStream_t stream);

    const GemmArShape& shape() const;
    DType partial_dtype() const;
    int reduce_ctas() const;
    /// Whether a call with M rows takes the small-M (split-K) GEMM path.
    bool uses_small_m_path(int64_t m) const;

    struct State;

private:
    std::unique_ptr<State> s_;
};

void validate_gemm_ar_shape(const GemmArShape& shape, int num_ranks, const GemmArOptions& options = {});
int64_t validate_gemm_ar_call(const GemmArShape& shape, const TensorView& a, const TensorView& b,
                              const TensorView& c);

namespace detail {
jit::KernelSpec ar_reduce_kernel_spec(DType partial, DType out, const std::string& arch = "");
/// The small-M GEMM kernel for ceil(M/16) row tiles and the plan's kernel variant (GemmPlan::small_m_variant:
/// kTmaRing = TMA into a shared-memory ring, kBulkRows = b's rows by 1D bulk copies, M <= 16 with b's rows back to
/// back; weft/common/gemv_config.hpp).
jit::KernelSpec gemv_kernel_spec(int m_tiles, DType in, DType out, GemvVariant variant, const std::string& arch = "");
}  // namespace detail

}  // namespace weft::ops
