// SPDX-License-Identifier: MIT
// What the collective ops share: algorithm names, the pure selection rules, and the per-team workspace.
//
// The ops themselves are in all_reduce.hpp, all_gather.hpp and reduce_scatter.hpp. Each runs on a weft::Team (a TP
// group, a node ...; the World& overloads run on world.team()), and ranks and rank order are the team's. Contract
// common to all three:
//  - Collective over the team's members: every member calls the same op, in the same order, with the same count,
//    dtype and algorithm (checked on the device by every block before it writes: a member that differs makes
//    World::sync_and_check throw on every rank, naming both calls and both world ranks; the copy-engine all-gather
//    traps instead, docs/reliability.md). all_gather and all_to_all compare bytes, not dtypes. Across nodes the
//    check covers each node's members; what crosses the network (NCCL) is not compared, except all_to_all_v's
//    counts (exchanged over the whole team on the host before anything is enqueued). A count of 0 launches
//    nothing, so it is a no-op only when every member passes 0. Every call counts in the team's sequence of
//    collective calls, one of 0 elements and one refused on a single rank included (refused by the op, or by a
//    wrapper that calls count_refused_collective_call, as weft's Python wrappers do), and a call's place in it is
//    part of what is compared: a member that made a call the others did not fails its next call as a mismatch, on
//    every rank; with no next call, the others' waits for it end at the World's timeout naming it as absent. A rank
//    that is not a member gets weft::Error naming the op and the team's world ranks.
//  - Asynchronous on `stream`, never synchronises the host, capturable in a CUDA graph (signals compare against
//    epochs the kernels keep in device memory, per team). Calls on one team are stream-ordered: issue them on one
//    stream, or order the streams with events. Teams that share no member may run at the same time; a rank in
//    two teams orders its calls on them (same stream, or events). Use a non-blocking stream of the rank's own:
//    ranks that are threads of one process share the legacy default stream, which would serialise their (mutually
//    waiting) kernels.
//  - Buffers: any device memory. A buffer on the symmetric heap (SymmetricHeap::contains) lets peers read or
//    write it directly (no staging copy, no rounds); pass symmetric buffers on every member or on none, and then
//    the same allocation (made by this team's members or the world: the same offset on every member). The push
//    all-gathers need a symmetric output (on a team of one, any output: the call is a copy).
//  - The first call on a team (or prepare_collectives) is itself collective over the team: it allocates the
//    team's workspace on the heap (team-collective allocations), agrees the SM budget, compiles or loads every
//    collective kernel and ends with a barrier of the team.
//  - Within a node every member must be load/store reachable from every other (peer access); otherwise weft::Error
//    on every member. A team that spans nodes runs the collectives over each node's members and the network
//    (docs/multinode.md).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "weft/common/collectives.hpp"

namespace weft {
class Team;
class World;
}  // namespace weft

namespace weft::ops {

/// All-reduce algorithms. kAuto: select_all_reduce_algo (overridable by WEFT_ALLREDUCE_ALGO).
enum class AllReduceAlgo : int32_t {
    kAuto = 0,
    kLowLatency = 1,  ///< "ll": LL lines (data + flag per 8-byte word) pushed to every peer; no barrier
    kOneShot = 2,     ///< "one_shot": stage, meet, every rank reads every rank and reduces
    kTwoShot = 3,     ///< "two_shot": reduce-scatter then all-gather, SM-driven
};

/// All-gather algorithms. kAuto: select_all_gather_algo (overridable by WEFT_ALLGATHER_ALGO).
enum class AllGatherAlgo : int32_t {
    kAuto = 0,
    kLowLatency = 1,      ///< "ll": LL lines pushed to every peer; no barrier
    kSmPush = 2,          ///< "sm_push": blocks write this rank's shard into every peer's output (symmetric output)
    kCopyEnginePull = 3,  ///< "ce_pull": cudaMemcpyAsync of every peer's shard on side streams (a rank that shares
                          ///< its GPU with ranks of its process: the one-CTA pull kernel, kernels/all_gather/README.md)
    kCopyEnginePush = 4,  ///< "ce_push": cudaMemcpyAsync of this shard into every peer's output (symmetric output;
                          ///< the pull kernel where ce_pull takes it)
};

/// Reduce-scatter algorithms. kAuto: select_reduce_scatter_algo (overridable by WEFT_REDUCESCATTER_ALGO).
enum class ReduceScatterAlgo : int32_t {
    kAuto = 0,
    kSmPull = 1,      ///< "sm_pull": every rank reads its slice from every rank, reduces in fp32, writes once
    kLowLatency = 2,  ///< "ll": every rank pushes slice q to rank q as LL lines; no barrier
};

/// Short names, as WEFT_*_ALGO and the benchmark use them ("auto", "ll", "one_shot", ...).
const char* algo_name(AllReduceAlgo algo);
const char* algo_name(AllGatherAlgo algo);
const char* algo_name(ReduceScatterAlgo algo);
/// The algorithm called `name`, or nullopt.
std::optional<AllReduceAlgo> parse_all_reduce_algo(std::string_view name);
std::optional<AllGatherAlgo> parse_all_gather_algo(std::string_view name);
std::optional<ReduceScatterAlgo> parse_reduce_scatter_algo(std::string_view name);

/// Facts every rank agrees on (exchanged once, when the workspace is made); the selection rules depend only
/// on these and the message size, so every rank picks the same algorithm and grid.
struct CollectiveTopology {
    int num_ranks = 1;          ///< ranks of the team
    int max_ranks_per_gpu = 1;  ///< most team members sharing one GPU (> 1: traffic is local HBM, not NVLink)
    int grid_budget = 1;        ///< most blocks per kernel: min over members of World::sm_budget() (per GPU)
    uint64_t low_latency_capacity_bytes = 256 * 1024;  ///< LL payload per rank per kernel (larger: rounds)
};

/// Largest message (all-reduce) or shard (all-gather), in bytes, that the automatic choice sends as LL lines:
/// LL writes twice the payload but saves a flag round trip, so it pays while (num_ranks - 1) * bytes stays
/// small (about 512 KiB of traffic per rank), between 16 and 256 KiB, and within the LL capacity.
uint64_t low_latency_threshold_bytes(const CollectiveTopology& topo);

/// The automatic all-reduce choice for a message of `bytes` bytes per rank: LL up to
/// low_latency_threshold_bytes, then one-shot (up to 4 ranks: up to 1 MiB; more: up to 256 KiB), then two-shot.
/// Pure: unit-tested on the CPU.
AllReduceAlgo select_all_reduce_algo(uint64_t bytes, const CollectiveTopology& topo);
/// The automatic all-gather choice for shards of `shard_bytes`: LL up to low_latency_threshold_bytes; then, with
/// a symmetric output, SM push below 64 MiB gathered (always when ranks share a GPU) and copy-engine push
/// above; with a local output, copy-engine pull.
AllGatherAlgo select_all_gather_algo(uint64_t shard_bytes, const CollectiveTopology& topo, bool output_symmetric);
/// The automatic reduce-scatter choice for an output (one slice) of `output_bytes`: LL up to
/// low_latency_threshold_bytes (each rank then sends (n - 1) x output_bytes as LL lines, the same traffic as an LL
/// all-reduce of that size), SM pull above.
ReduceScatterAlgo select_reduce_scatter_algo(uint64_t output_bytes, const CollectiveTopology& topo);

/// The algorithm a call uses: `requested` unless kAuto, else `env_value` (the WEFT_*_ALGO variable) unless unset
/// or "auto", else the automatic choice. An unknown env value is a weft::Error naming `env_name` and the choices.
AllReduceAlgo resolve_all_reduce_algo(AllReduceAlgo requested, const std::optional<std::string>& env_value,
                                      uint64_t bytes, const CollectiveTopology& topo,
                                      const char* env_name = "WEFT_ALLREDUCE_ALGO");
AllGatherAlgo resolve_all_gather_algo(AllGatherAlgo requested, const std::optional<std::string>& env_value,
                                      uint64_t shard_bytes, const CollectiveTopology& topo, bool output_symmetric,
                                      const char* env_name = "WEFT_ALLGATHER_ALGO");
ReduceScatterAlgo resolve_reduce_scatter_algo(ReduceScatterAlgo requested, const std::optional<std::string>& env_value,
                                              uint64_t output_bytes, const CollectiveTopology& topo,
                                              const char* env_name = "WEFT_REDUCESCATTER_ALGO");

/// Whether a collective on a team whose members span `num_nodes` nodes takes the hierarchical path (weft's collectives
/// within each node, NCCL across nodes: docs/multinode.md): exactly when num_nodes > 1. `forced` is the algorithm the
/// call or its WEFT_*_ALGO variable asked for ("" or "auto": none). Throws weft::Error naming `op` when a single-node
/// algorithm is forced on a team that spans nodes (its kernels need every peer load/store reachable).
bool select_hierarchical(const char* op, int num_nodes, std::string_view forced);

/// Blocks of the main kernel of each algorithm (the same on every rank: a function of agreed facts only).
/// At least 1, at most topo.grid_budget (so ranks sharing a GPU stay co-resident) and 32 (latency kernels) or
/// 64 (bandwidth kernels).
int all_reduce_grid(AllReduceAlgo algo, uint64_t bytes, const CollectiveTopology& topo);
int all_gather_grid(AllGatherAlgo algo, uint64_t shard_bytes, const CollectiveTopology& topo);
int reduce_scatter_grid(ReduceScatterAlgo algo, uint64_t output_bytes, const CollectiveTopology& topo);

/// A team's workspace, as prepare_collectives reports it.
struct CollectiveWorkspaceInfo {
    CollectiveTopology topology;
    uint64_t staging_region_bytes = 0;  ///< each of the 3 staging regions (2 epoch parities + copy engine)
    uint64_t ll_slot_bytes = 0;         ///< LL receive buffer per sender and parity (2 x the LL capacity)
    uint64_t heap_bytes = 0;            ///< symmetric heap bytes the workspace holds
    int num_kernels = 0;                ///< kernels compiled (or loaded from the cache) and loaded
};

/// Collective over the team's members: creates the team's collective workspace unless it exists, and returns its
/// description. Allocates on the symmetric heap, over the members (3 x WEFT_COLLECTIVE_STAGING_BYTES, default
/// 3 x 32 MiB, plus the LL buffers: 2 x num_ranks x 512 KiB, plus a few KiB of signals), agrees the SM budget and
/// checks that every member is load/store reachable (all through the team's all_gather), compiles or loads every
/// collective kernel (so no module loads later while kernels spin), and ends with a barrier of the team. The ops
/// call it on first use; call it yourself before capturing a graph or launching kernels that spin. The workspace
/// lives until the World is destroyed (one per team id). A non-member caller gets weft::Error. A team that spans nodes:
/// makes its network backend (collective, weft/net/host_backend.hpp) and prepares its node team's workspace, whose
/// info it returns (all zero with one member per node).
const CollectiveWorkspaceInfo& prepare_collectives(const Team& team);
/// prepare_collectives(world.team()).
const CollectiveWorkspaceInfo& prepare_collectives(World& world);

/// Counts a collective call on `team` that this rank refused before reaching weft's op (a wrapper's own argument
/// checks; weft's ops count their own calls, refused ones included). Each call's place in the team's sequence of
/// collective calls is part of what the ranks compare, so a rank that refused a call its peers made then fails its
/// next call as a mismatch on every rank instead of pairing with their refused one. Not collective; a non-member
/// caller gets weft::Error.
void count_refused_collective_call(const Team& team);

/// Symmetric heap bytes prepare_collectives allocates on each member of a team of `num_ranks` ranks (0 for one rank:
/// it allocates nothing), with the staging regions WEFT_COLLECTIVE_STAGING_BYTES asks for in this process; heap
/// sizing aid, no GPU needed. The workspace's own allocations are made from the same sizes. Throws weft::Error when
/// num_ranks is not in [1, 64] or WEFT_COLLECTIVE_STAGING_BYTES is malformed or above 1 TiB.
uint64_t collective_workspace_heap_bytes(int num_ranks);

/// Registers the kernel specialisations the collectives launch for teams of up to `max_ranks` ranks with
/// weft::jit::register_aot_spec, so `weft-compile --builtin` warms them (weft::ops::register_op_aot_specs calls it).
void register_collective_aot_specs(int max_ranks = 8);

}  // namespace weft::ops
