// SPDX-License-Identifier: MIT
// weft::ops::FusedGemm: a fused GEMM of your own. weft's persistent sm_90a GEMM kernel with your tile scheduler
// (the wait before a tile's rows of A are loaded) and your epilogue hook (the signal after a tile's output is
// stored), compiled by weft's JIT, set up from TensorViews and launched on a stream. weft's own AllGather+GEMM,
// GEMM+ReduceScatter and GEMM+AllReduce launch their GEMMs through it.
//
//     weft::ops::FusedGemm gemm(team, {.header = "chain.cuh", .scheduler = "example::WaitForRows",
//                                      .hook = "example::NotifyNextRank", .include_root = dir},
//                               weft::ops::fused_gemm_config({.m = m, .n = n, .k = k}, world.shared_sm_budget()));
//     const weft::ops::FusedGemmCall call = gemm.prepare(a, b, d);   // checks the views; may throw
//     gemm.launch(call, ChainWait{...}, ChainNotify{...}, stream);   // only enqueues
//
// A complete overlapped GEMM with a walk-through: examples/10_custom_fused_gemm.
//
// ---- Device side: what your header defines --------------------------------------------------------------------
// NVRTC compiles it (C++20, no host standard library: weft/common/macros.hpp maps the fixed-width integers). It
// includes weft's public headers only: weft/device.cuh (tile::wait, tile::notify, Token, ptx) and
// weft/common/gemm_config.hpp (GemmConfig, GemmTile, GemmArgs, GemmTileGrid); weft includes its GEMM kernel after it.
//
// The scheduler, a class template over the config (FusedGemmSpec::scheduler names it; weft instantiates S<config>):
//   template <weft::GemmConfig kCfg> struct S {
//       using Params = P;                                      // trivially copyable: the launch's `sched` argument
//       __device__ S(const Params&, const weft::GemmArgs&);   // built by every thread of the CTA
//       __device__ int32_t num_tiles() const;                  // tiles this CTA computes
//       __device__ weft::GemmTile tile(int32_t i) const;       // its i-th tile: the same answer in every thread
//       __device__ weft::device::Token wait_before_load(const weft::GemmTile&) const;
//   };
//   - Every tile of D's tile grid (GemmTileGrid(kCfg, args.m, args.n)) goes to exactly one CTA; the grid is
//     FusedGemmCall::grid CTAs (blockIdx.x), one CTA per SM, cluster-free.
//   - wait_before_load runs in one thread (the producer) before it TMA-loads the tile's rows of A (its columns of
//     B follow). It returns the Token of the wait that made those rows visible: `tile::wait_checked(
//     device::Thread{}, ctx, signals, n, Cmp::kGe, value).token_or_trap()`, with n = 0 when the tile needs nothing
//     (its rows are this rank's own). The wait's fence.proxy.async.global is what lets the TMA loads see data other
//     agents wrote. Never make a Token otherwise. It may return the device::WaitResult itself instead: one that is not
//     ok() then stops the CTA's waiting and the kernel runs to its end (the CUDA context stays usable), storing and
//     signalling tiles of undefined data; do that only where your hook publishes nothing to another rank that could
//     take them as ready before it learns of the failure (weft's own ops do; a chain like examples/10 traps). Not
//     `tile::wait`: on a timeout or an abort it ends the producer (`exit`), and the consumers, whose pipeline waits
//     do not read the abort word, stay until their own bound and trap.
//   - The producer runs with kGemmProducerRegs (40) registers: keep a reference to the Params (`const Params& p_`,
//     in the kernel's parameter bank) rather than a copy, and 32-bit index arithmetic. The tile maps
//     (weft/common/tile_map.hpp) have 64-bit members and divide in 64 bits: compute what tile(i) needs from them once,
//     in the constructor (e.g. the rotation's start, map.tile_at(rank, 0)) or on the host, or the kernel spills.
//   - Speed: a function call anywhere in the kernel can make ptxas serialise its wgmma (warning C7510 in the JIT log,
//     WEFT_JIT_VERBOSE_PTXAS=1): the _checked forms are fully inline (no call, no reachable trap); tile::wait and
//     tile::notify report a failure through a call.
//
// The epilogue hook, a type (FusedGemmSpec::hook names it; "CFG" in the name stands for the config, so a hook
// template is named "my::Hook<CFG>"):
//   struct H {
//       using Params = P;                          // trivially copyable: the launch's `hook` argument
//       static constexpr bool kNotifies = true;    // false: never called, and the stores are never waited for
//       __device__ static bool after_tile_stored(const Params&, const weft::GemmTile&);
//   };
//   - Called by one thread, once per tile, after every TMA store of the tile has completed (cp.async.bulk.wait_group
//     0 in the storing threads, then a barrier of the warpgroups that stored it): the tile is in global memory,
//     written through the async proxy. Publish it with `ptx::fence_proxy_async_global()` then a release:
//     `return tile::notify_checked(...)` (one signal per tile; a .sys release costs a MEMBAR), which records a
//     Diagnostic and returns false on an unreachable peer (below).
//   - Cooperative configs signal a tile after the next tile's mainloop (or at the end); ping-pong configs right after
//     its epilogue: the stores never stall the tensor cores.
//   - It runs in the consumer warpgroups' tile loop: it returns false after recording a Diagnostic (the kernel traps
//     once it has left the loop) rather than trapping (a reachable trap among the live accumulators makes ptxas spill
//     them).
//   - The config's tile_n must be whole store boxes (gemm_whole_store_boxes: every candidate of
//     fused_gemm_candidates is): the kernel's static_assert says so otherwise.
//   Optional members that move a tile's stores or add to its accumulators (kRoutesStores, kAddsToTile; weft's
//   GEMM+ReduceScatter push mode uses both) are described in kernels/gemm/gemm_hooks.cuh. A hook that routes stores
//   needs N whose rows are whole 16-byte units (N a multiple of 8 for 16-bit D, of 4 for f32; the call's
//   FusedGemmCall::args.n_tma == args.n): the columns past the last whole unit are stored with plain stores into d at
//   the call's own rows, not through the hook's target. The host cannot see the hook's traits: checking it is the
//   caller's (weft's push mode refuses such N).
//
// FusedGemmSpec::kernel_template (advanced): a __global__ template of your own over the config with gemm_kernel's
// parameters (tma_a, tma_b, tma_d, GemmArgs, Scheduler::Params, Hook::Params) that runs
// weft::kernels::gemm::gemm_device<kCfg, Scheduler, Hook> and may add work after it (weft's AllGather+GEMM ends each
// call there). Its header includes gemm/gemm_sm90.cuh itself.
//
// ---- Host side ------------------------------------------------------------------------------------------------
// - Which ranks call: the members of the team it is made for (a World& means its world team); nothing here is
//   collective. The protocol is yours: every member whose signals a launch waits for must launch its side (or a
//   bounded wait expires with a Diagnostic, which World::sync_and_check reports). Pass your kernels
//   team.device_ctx() (ranks are team ranks, peers indexed by team rank). Build every member's FusedGemm (it loads
//   the kernel) and meet at team.barrier() before the first launch that waits: a kernel loaded lazily behind a
//   spinning one can deadlock (docs/jit.md).
// - Streams: launch() enqueues one kernel on `stream` and returns; it never synchronises the host.
// - Graph capture: prepare() and launch() are capturable. A captured launch replays its Params as captured: a value
//   that must change per call (an epoch, an expected count) belongs in device memory, advanced by the kernels
//   (weft's ops do that; SignalValueMode::kEpoch in weft/common/gemm_hook_params.hpp reads one at run time).
// - Ranks sharing a GPU: prepare()'s grid stays within World::sm_budget(), so every rank's persistent grid is
//   resident at once (a spinning CTA whose producer cannot start waits for good). A config's first launch on
//   each rank should end (World::sync_and_check, then team.barrier()) before more is launched
//   (kernels/gemm_rs/README.md, "Ranks sharing a GPU"). World::sm_budget() is per device, not per team: ranks of
//   other teams on the same GPU keep their SMs. Chunks fed by copy engines (docs/memory_model.md, rule 4) while the
//   GEMM spins: with several ranks of one process on the GPU (World::same_process() and num_ranks_on_device() > 1,
//   e.g. run_local on fewer GPUs than ranks) the ranks' streams share hardware queues, so a copy or
//   stream_write_u64 can sit behind a spinning kernel that waits for it (docs/runtime.md, "Hardware queues").
//   weft's own AllGather+GEMM pulls with a kernel there instead (one CTA: a bounded wait on the peer's ready flag,
//   the copy, then the chunk's signal; kernels/tp_common/peer_pull.cuh) and, whenever ranks share a GPU, leaves one
//   SM of the share free of the GEMM for such helpers (prepare(a, b, d, World::sm_budget() - 1); a driver may run a
//   same-device copy as a kernel). One rank per GPU, or processes sharing a GPU (a context each), keep the copy
//   engines.
// - Timeouts: the GEMM's pipeline waits are bounded by twice World::timeout(), so the waits of your scheduler and
//   hook (bounded by World::timeout() through the DeviceCtx) expire first, with their diagnosis. An abort (a peer
//   that failed, World::abort) ends a wait_checked within ~16 ms.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "weft/common/gemm_config.hpp"
#include "weft/common/gemm_hook_params.hpp"
#include "weft/detail/gemm_launch.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/gemm_plan.hpp"
#include "weft/runtime/tensor_view.hpp"

namespace weft {
class Team;
class World;
}

namespace weft::ops {

/// Names the device code of a fused GEMM: weft::kernels::gemm::gemm_kernel<config, scheduler<config>, hook> (or
/// kernel_template). Plain text the JIT prints into the generated translation unit.
struct FusedGemmSpec {
    std::string header{};     ///< the header defining scheduler and hook, relative to include_root (or to weft's roots)
    std::string scheduler{};  ///< a class template over the config, e.g. "example::WaitForRows"
    std::string hook{};       ///< a type; "CFG" stands for the config: "example::NotifyNextRank", "my::Hook<CFG>"
    /// The folder `header` is found in (searched before weft's roots; its headers are hashed into the JIT cache key).
    /// Empty: a header under weft's own roots, which includes gemm/gemm_sm90.cuh itself; otherwise weft includes it
    /// after `header`.
    std::filesystem::path include_root{};
    std::string name{};             ///< for logs and errors (default "fused_gemm")
    /// Advanced (see the file comment): a wrapper kernel template, "CFG" standing for the config; empty: gemm_kernel.
    std::string kernel_template{};
};

/// weft's plain GEMM as a fused GEMM: weft::kernels::gemm::PersistentScheduler (waits for nothing) and NoEpilogueHook
/// (signals nothing), launched with PersistentSchedulerParams{} and NoEpilogueHookParams{}
/// (weft/common/gemm_hook_params.hpp): the same kernel, and JIT cache entry, as weft::ops::gemm's for the config. The
/// fused ops run it in a team of one rank.
FusedGemmSpec plain_gemm_fused_spec();

/// The cluster-free candidates fused GEMMs run, without duplicates: those of gemm_candidate_configs(in, out, B [N,K])
/// with their cluster dropped and of whole store boxes (gemm_whole_store_boxes), cooperative or ping-pong; with
/// `rows_multiple` > 0 only those whose tile_m divides it.
std::vector<GemmConfig> fused_gemm_candidates(DType in, DType out, int64_t rows_multiple = 0);

/// The cheapest candidate of fused_gemm_candidates(problem.in_dtype, problem.out_dtype) on `budget` SMs
/// (gemm_config_cost with each tile charged the hooks' cost). The same on every rank given the same arguments:
/// plan with World::shared_sm_budget() where ranks must agree on the tiles (they count each other's signals).
GemmConfig fused_gemm_config(const GemmProblem& problem, int budget);

/// Throws weft::Error unless `config` can run as a fused GEMM: valid (is_valid), cluster-free, whole store boxes.
void check_fused_gemm_config(const GemmConfig& config);

/// CTAs of a persistent fused GEMM over an [m, n] output: min(budget, tiles), at least 1.
int fused_gemm_grid(const GemmConfig& config, int64_t m, int64_t n, int budget);

/// The bound on a fused GEMM's pipeline waits: twice the world's timeout (at most 30 days) (its signal waits expire
/// first).
uint64_t fused_gemm_timeout_ns(const World& world);
/// The same for a team's kernels (a team's timeout is its World's).
uint64_t fused_gemm_timeout_ns(const Team& team);

/// The weft::jit spec of spec's kernel for `config` (checked with check_fused_gemm_config). `arch` as
/// KernelSpec::arch (empty: WEFT_JIT_ARCH, else the current device's). Compile it with a Compiler whose extra include
/// roots hold spec.include_root (FusedGemm does).
jit::KernelSpec fused_gemm_kernel_spec(const FusedGemmSpec& spec, const GemmConfig& config,
                                       const std::string& arch = "");

/// The compiler FusedGemm uses for headers under `include_root`: weft::jit::compiler(include_root) (process-wide,
/// never destroyed; weft::jit::compiler() when it is empty).
jit::Compiler& fused_gemm_compiler(const std::filesystem::path& include_root);

/// One call set up on the host: the tensor maps of A, B and D, the kernel's run-time arguments and the grid.
/// Plain data: launching it only enqueues.
struct FusedGemmCall {
    detail::GemmTensorMaps maps{};
    GemmArgs args{};
    int grid = 1;
    GemmConfig config{};    ///< the config the maps' boxes were made for (FusedGemm::launch checks it is its own)
    bool prepared = false;  ///< made by FusedGemm::prepare (or the ops' detail::make_fused_gemm_call)
};

namespace detail {
/// FusedGemm::launch's checks of weft's own parameter types (weft::Error naming the field); other types: none.
void check_fused_gemm_params(const gemm::ChunkWaitParams& p, const FusedGemmCall& call);
void check_fused_gemm_params(const gemm::TileSignalParams& p, const FusedGemmCall& call);
template <class Params>
void check_fused_gemm_params(const Params&, const FusedGemmCall&) {}
}  // namespace detail

/// A fused GEMM kernel for one config, compiled (JIT, cached on disk) and loaded into the current device's context.
/// Copyable; the kernel lives as long as the process.
class FusedGemm {
public:
    /// Compiles and loads spec's kernel for `config` (check_fused_gemm_config), for the members of `team`. Throws
    /// weft::Error for a bad spec or config, with NVRTC's log when the header does not compile, and naming the team's
    /// world ranks when this rank is not a member.
    FusedGemm(const Team& team, const FusedGemmSpec& spec, const GemmConfig& config);
    /// The world team's: FusedGemm(world.team(), spec, config).
    FusedGemm(World& world, const FusedGemmSpec& spec, const GemmConfig& config);

    /// Checks and sets up one call D[M, N] = A[M, K] * B^T:
    ///   a: [M, K] row-major, config.in_dtype; b: [N, K] (B [K, N] when config.b_layout is kKN), a's dtype;
    ///   d: [M, N] row-major, config.out_dtype (any device memory, a peer's symmetric buffer included);
    ///   M, N >= 1; K a positive multiple of 8; bases 16-byte aligned, row strides multiples of 16 bytes (TMA).
    /// Grid: min(max_ctas, tiles) CTAs, max_ctas in [0, World::sm_budget()] (0 = the budget). d's bytes must be
    /// apart from a's and b's. Throws weft::Error naming the argument.
    FusedGemmCall prepare(const TensorView& a, const TensorView& b, const TensorView& d, int max_ctas = 0) const;

    /// Enqueues `call` on `stream` with the scheduler's and the hook's parameters (their byte sizes are checked
    /// against the kernel's: a mismatch is a weft::Error naming the parameter). A call prepared by a FusedGemm of
    /// another config (its tensor maps' boxes are that config's tiles), or never prepared, is a weft::Error. weft's
    /// own parameter types are checked too (gemm::ChunkWaitParams: flags set, rows_per_chunk >= 1;
    /// gemm::TileSignalParams: flags set, a known mode, kSetPerTile's num_n_tiles covering the call's N; either
    /// reading SignalValueMode::kEpoch's value: an epoch word), each a weft::Error naming the field; a type of the
    /// caller's own is the caller's to check. Nothing else can fail on the host but the launch itself.
    template <class SchedulerParams, class HookParams>
    void launch(const FusedGemmCall& call, const SchedulerParams& sched, const HookParams& hook,
                cudaStream_t stream) const {
        static_assert(std::is_trivially_copyable_v<SchedulerParams> && std::is_trivially_copyable_v<HookParams>,
                      "fused GEMM parameters are copied byte for byte into the kernel's parameter space");
        check_prepared_for_this(call);
        detail::check_fused_gemm_params(sched, call);
        detail::check_fused_gemm_params(hook, call);
        detail::launch_gemm_kernel(*kernel_, config_, call.maps, call.args, call.grid, sched, hook, stream);
    }

    const GemmConfig& config() const { return config_; }
    const FusedGemmSpec& spec() const { return spec_; }
    const jit::Kernel& kernel() const { return *kernel_; }

private:
    void check_prepared_for_this(const FusedGemmCall& call) const;

    World* world_;
    FusedGemmSpec spec_;
    GemmConfig config_;
    const jit::Kernel* kernel_;
};

namespace detail {

/// FusedGemm::prepare without the checks, for an op's views it validated itself (one validation per call) and the
/// internal buffers it built: the maps of (a, b, d), the arguments of (a, d) and `grid` CTAs.
FusedGemmCall make_fused_gemm_call(const GemmConfig& config, const TensorView& a, const TensorView& b,
                                   const TensorView& d, int grid, uint64_t timeout_ns);

/// The cheapest of fused_gemm_candidates(problem's dtypes, rows_multiple) on `budget` SMs; nullopt when none has a
/// tile_m dividing `rows_multiple`.
std::optional<GemmConfig> cheapest_fused_gemm_config(const GemmProblem& problem, int budget,
                                                     int64_t rows_multiple = 0);

/// Short config text for logs, spec descriptions and tuning candidates' names: "128x256x64/4 bf16->bf16" (plus
/// "ping-pong").
std::string config_text(const GemmConfig& config);

/// Rethrows a view check's weft::Error ("weft: gemm: d's row stride ...") as `op`'s ("weft: <op>: gemm: ...").
[[noreturn]] void rethrow_with_op(const std::string& op, const std::exception& e);

}  // namespace detail

}  // namespace weft::ops
