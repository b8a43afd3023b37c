// SPDX-License-Identifier: MIT
// Host pieces shared by the tensor-parallel fused ops (AgGemm, GemmRs, GemmAr): JIT specs, GEMM config and
// grid choice, the plain GEMM call, symmetric-allocation ownership, streams and events.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weft/common/gemm_config.hpp"
#include "weft/common/math.hpp"
#include "weft/detail/gemm_launch.hpp"
#include "weft/jit/autotune.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/gemm_plan.hpp"

namespace weft {
class World;
}

namespace weft::ops::tp_detail {

/// A KernelSpec for header + instantiation with a log description; `arch` as KernelSpec::arch.
jit::KernelSpec make_spec(const std::string& header, const std::string& instantiation, const std::string& description,
                          const std::string& arch);

/// "gemm_kernel<CFG, SCHED<CFG>, HOOK>" for a scheduler template and a hook type (HOOK may contain "CFG",
/// which is replaced by the config).
std::string gemm_instantiation(const GemmConfig& config, const std::string& scheduler_template,
                               const std::string& hook);

/// Short config text for logs: "128x256x64/4 bf16->bf16".
std::string config_text(const GemmConfig& config);

/// The current device's SM count.
int device_sm_count();

/// Checks a forced config for a fused op (valid, of whole store boxes, cluster-free, dtypes and B [N,K]);
/// throws naming `op`.
void check_forced_config(const GemmConfig& config, DType in, DType out, const char* op);

/// The candidates the fused kernels can run, without duplicates: those of gemm_candidate_configs(in, out, B [N,K])
/// with their cluster dropped (the fused schedulers and launches are cluster-free) and of whole store boxes (their
/// hooks route or signal every store: gemm_sm90.cuh), cooperative or ping-pong, with tile_m dividing `rows_multiple`
/// when it is > 0.
std::vector<GemmConfig> fused_candidates(DType in, DType out, int64_t rows_multiple = 0);

/// The GEMM config of a fused op: `forced`, else the cheapest (gemm_config_cost on `budget` SMs, each tile charged
/// the hooks' cost) cluster-free candidate of whole store boxes (what the fused kernels run).
/// `rows_multiple` > 0: the config's tile_m must divide it (GemmRs's explicit chunk_rows); throws naming `op` when
/// no candidate's does. A forced config is returned as is (its callers check it against their own constraints).
GemmConfig choose_gemm_config(const GemmProblem& problem, int budget, const std::optional<GemmConfig>& forced,
                              const char* op, int64_t rows_multiple = 0);

/// CTAs of the persistent GEMM: min(budget, tiles), at least 1.
int gemm_grid(const GemmConfig& config, int64_t m, int64_t n, int budget);

/// Bounds the GEMM's pipeline waits: twice the world's timeout, so that a communication wait (bounded by
/// the world's timeout, with a diagnostic) always expires first.
uint64_t pipeline_timeout_ns(const World& world);

/// A plain GEMM call (PersistentScheduler, no hook) set up on the host: launching it only enqueues.
struct PlainGemmLaunch {
    detail::GemmTensorMaps maps{};
    GemmArgs args{};
    int grid = 1;
};

/// Builds (and checks) the plain GEMM call of a world of one rank: d = a * b^T on at most `budget` SMs.
PlainGemmLaunch prepare_plain_gemm(const GemmConfig& config, const TensorView& a, const TensorView& b,
                                   const TensorView& d, int budget, uint64_t timeout_ns);
/// Launches a prepared plain GEMM call.
void launch_plain_gemm(const jit::Kernel& kernel, const GemmConfig& config, const PlainGemmLaunch& call,
                       cudaStream_t stream);
/// prepare_plain_gemm then launch_plain_gemm.
void launch_plain_gemm(const jit::Kernel& kernel, const GemmConfig& config, const TensorView& a, const TensorView& b,
                       const TensorView& d, int budget, uint64_t timeout_ns, cudaStream_t stream);

/// Throws when rank `r`'s copy of a symmetric object is not load/store reachable from this rank.
void check_peers_reachable(const World& world, const void* symmetric_ptr, const char* op);

/// Owns symmetric allocations of one op; free_all() is collective (call it from every rank, in order).
class SymmetricAllocations {
public:
    explicit SymmetricAllocations(World& world) : world_(&world) {}
    void* alloc(uint64_t bytes);
    uint64_t* alloc_signals(uint64_t count);
    /// Synchronises the device, meets the other ranks at a barrier (no peer still touches these buffers),
    /// frees everything; logs instead of throwing (destructors call it).
    void free_all() noexcept;

private:
    World* world_;
    std::vector<void*> ptrs_;
};

/// Non-blocking streams and events created on the current device, destroyed with the owner.
class StreamSet {
public:
    StreamSet() = default;
    ~StreamSet();
    StreamSet(const StreamSet&) = delete;
    StreamSet& operator=(const StreamSet&) = delete;
    cudaStream_t add_stream();
    cudaEvent_t add_event();

private:
    std::vector<cudaStream_t> streams_;
    std::vector<cudaEvent_t> events_;
};

/// Ranks sharing a GPU: a config's first call on each rank ends (stream synchronised, then a barrier of all ranks)
/// before the rank launches anything more: a rank's first launch of a kernel could stay queued for good while a
/// peer's instance of it spun waiting for it (kernels/gemm_rs/README.md, "Ranks sharing a GPU"). Every rank must
/// arm it alike (World::max_ranks_per_device: the barrier is collective). Not while the stream is being captured.
class FirstCallSync {
public:
    void arm(size_t num_configs) { pending_.assign(num_configs, true); }
    /// After the launches of a call with config `idx`.
    void after_call(World& world, size_t idx, cudaStream_t stream);

private:
    std::vector<bool> pending_;
};

/// The cluster-free candidates a fused op may tune over: `first` (the op's choice), then every other valid candidate
/// of gemm_candidate_configs with its cluster dropped and whole store boxes
/// (gemm_whole_store_boxes: the fused ops route or signal every store), without duplicates; with `rows_multiple` > 0
/// only those whose tile_m divides it (`first` must).
std::vector<GemmConfig> tune_candidates(const GemmConfig& first, DType in, DType out, int64_t rows_multiple = 0);

/// A TuneComm over the World (host barrier, all-gather through its store). `tag` must be the same on every
/// rank and unique among the live users of the store (e.g. the heap offset of an op's signal words).
std::unique_ptr<jit::TuneComm> make_tune_comm(World& world, uint64_t tag);

/// Wraps a validation error of a GEMM view check with the op's name.
[[noreturn]] void rethrow_with_op(const char* op, const std::exception& e);

}  // namespace weft::ops::tp_detail
