// SPDX-License-Identifier: MIT
// World: the set of ranks, each bound to a GPU, with its store, symmetric heap, teams and diagnostics.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <cuda_runtime_api.h>

#include "weft/common/device_ctx.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/runtime/store.hpp"
#include "weft/runtime/symmetric_heap.hpp"
#include "weft/runtime/team.hpp"

namespace weft {

namespace detail {
struct WorldSetup;
struct WorldContext;
}  // namespace detail

/// State that a higher layer keeps per World (e.g. the collectives' workspace, weft/ops/collectives.hpp).
/// The World owns it and destroys it during shutdown, after the device synchronisation and the shutdown
/// barrier and before the heap is released; the destructor must not make collective calls (the heap's
/// allocations die with the heap) and must not throw.
class WorldExtension {
public:
    virtual ~WorldExtension() = default;
    /// Called by World::sync_and_check after the stream has completed, before the World's diagnostics are read: an
    /// extension whose own machinery failed without a kernel noticing (a network communicator's asynchronous error)
    /// aborts the World here, so that the call that used it fails. Returns true when the World should also read the
    /// other ranks' abort records now (one store round trip) rather than at its next heartbeat: the extension ran
    /// work that a peer leaving could have ended early without an error (NCCL ends an operation when its peer closes
    /// the connection). Must not block.
    virtual bool check_after_sync() { return false; }
};

/// Zero means "from the environment, else the default".
struct WorldOptions {
    int device = -1;                       ///< -1: LOCAL_RANK % visible devices (run_local: rank % devices)
    uint64_t heap_bytes = 0;               ///< 0: WEFT_SYMMETRIC_HEAP_BYTES, else 1 GiB
    int sm_budget = 0;                     ///< 0: WEFT_SM_BUDGET, else the device's SMs / ranks sharing it
    /// Bound on every host wait and device spin: how long a LATE peer is waited for. 0: WEFT_TIMEOUT_MS, else 10 min.
    std::chrono::milliseconds timeout{0};
    /// How often the World's watchdog beats and checks its peers. 0: WEFT_HEARTBEAT_MS, else 1 s.
    std::chrono::milliseconds heartbeat{0};
    /// How long a peer's heartbeat may stand still before the peer counts as DEAD and the World is aborted (a peer
    /// process of this host that exits is noticed at the next beat). 0: WEFT_DEAD_PEER_MS, else 10 s; at least two
    /// heartbeats.
    std::chrono::milliseconds dead_peer_timeout{0};
    /// Split the world's ranks into this many virtual nodes of world / k consecutive ranks (docs/multinode.md): peers
    /// on another virtual node are reached through the network only. 0: WEFT_VIRTUAL_NODES, else 1 (real hosts).
    /// Must divide the world size.
    int virtual_nodes = 0;
};

/// Who this rank is in a World built on a store of your own (World::from_store).
struct WorldMembership {
    int rank = -1;      ///< this rank, in [0, num_ranks)
    int num_ranks = 0;  ///< ranks of the World (at least 1)
    /// This rank's index among the ranks of its host, and their number. -1 and 0 (the defaults): derived from
    /// the host names every rank publishes, in rank order. Give both or neither.
    int local_rank = -1;
    int local_num_ranks = 0;
    /// Every key the World reads or writes in the store starts with key_prefix + "/" (printable ASCII, no
    /// spaces). Worlds that share one store at the same time need different prefixes; one World after another
    /// may reuse a prefix (each World keeps its keys under an id of its own and removes them as it goes), except
    /// after a World whose construction failed on some rank: its start-up records may remain under the prefix and
    /// be read by the next World's start-up, so give the next one another prefix (weft.init counts its Worlds
    /// into the prefix for this reason).
    std::string key_prefix = "weft";
};

/// One rank's view of the job. Created collectively (every rank creates its World; the constructor
/// exchanges device, host and heap information and maps the peers' heaps, and before that launches one
/// empty kernel per CUDA context: docs/runtime.md, "A context's first kernel launch"); destroyed collectively (the
/// destructor synchronises the device and meets the other ranks at a bounded barrier before releasing
/// anything). All methods are called from the rank's own thread (the one that created the World).
class World {
public:
    /// One process per rank, started by weftrun, torchrun, mpirun or srun (see detect_launch_env), with nothing
    /// set beyond what the launcher sets. Without any launcher environment it returns a world of one rank.
    /// The ranks meet at a store rank 0 starts: on one host an abstract Unix socket named after the user, the
    /// job and the World (the n-th from_env of each process meets the n-th of the others), across hosts TCP
    /// on rank 0's host at WEFT_STORE_PORT or a port derived from the job; never the launcher's MASTER_PORT
    /// (docs/runtime.md, "Finding the store"). Sets eager module loading first.
    static std::unique_ptr<World> from_env(const WorldOptions& options = {});

    /// Every rank calls it with the same `store` (one shared object for ranks that are threads of one process,
    /// or clients of one store for processes: torch.distributed's store, through an adapter) and its own
    /// `membership`. Everything the World exchanges (start-up records, heap handles, the pids the descriptor
    /// checks compare, barriers, teams, the ops' and autotuner's agreements) goes through `store`, under
    /// `membership.key_prefix`; weft opens no store or port of its own. The store must honour the contract in
    /// store.hpp. Whether the ranks are threads of one process or processes of their own is found from what
    /// they publish (a mix is an error). Sets eager module loading first. Throws weft::Error naming the field
    /// of `membership` that is wrong, or the ranks that did not arrive within the start-up timeout.
    static std::unique_ptr<World> from_store(std::shared_ptr<Store> store, const WorldMembership& membership,
                                             const WorldOptions& options = {});

    /// Collective: meets the other ranks at a shutdown barrier, then releases. Destroyed while an exception
    /// propagates (this rank is leaving on an error), it aborts the World first, so that peers inside a call with
    /// this rank stop at their next heartbeat with this rank named, instead of at their timeout.
    ~World();
    World(const World&) = delete;
    World& operator=(const World&) = delete;

    int rank() const;
    int num_ranks() const;
    int local_rank() const;           ///< index among the ranks of this host
    int local_num_ranks() const;      ///< ranks on this host
    int device() const;               ///< CUDA device ordinal this rank uses (current on its thread)
    int sm_budget() const;            ///< SMs this rank's persistent kernels may use
    int num_ranks_on_device() const;  ///< ranks sharing this rank's GPU (same host and PCI bus id)
    /// Whether the World's ranks are threads of one process (run_local, an in-process store): ranks sharing a GPU
    /// then share its CUDA context, legacy default stream included; processes sharing a GPU do not.
    bool same_process() const;
    /// The most ranks any one GPU of the world hosts: the same on every rank (num_ranks_on_device is not when
    /// some GPUs host more ranks than others, e.g. 3 ranks on 2 GPUs).
    int max_ranks_per_device() const;
    /// The SM budget a rank of the world's most shared GPU has (sm_budget's rule with max_ranks_per_device): the same
    /// on every rank given the same WorldOptions, WEFT_SM_BUDGET and GPU model. Ops whose ranks must make the same
    /// choices (a GEMM tile that fixes how many signals each rank expects) plan with it.
    int shared_sm_budget() const;
    std::chrono::milliseconds timeout() const;
    SymmetricHeap& heap();
    const SymmetricHeap& heap() const;
    /// The World's store: the one it was built on, with every key under a prefix private to this World.
    Store& store();
    const Team& team() const;       ///< the world team
    const Team& node_team() const;  ///< the ranks on this rank's node (same host name and virtual node)
    /// This rank's node, numbered in order of first appearance in rank order, and the number of nodes: hosts, each
    /// split into virtual nodes when WorldOptions::virtual_nodes / WEFT_VIRTUAL_NODES asks (docs/multinode.md).
    int node() const;
    int num_nodes() const;
    /// The virtual nodes per world (1 when none were asked for).
    int virtual_nodes() const;
    /// The world team's DeviceCtx (rank, num_ranks, heap_base, peer_bases, sm_budget, timeout_ns, diag).
    DeviceCtx device_ctx() const;

    /// Host barrier among all ranks through the store; throws weft::Error after timeout() naming the ranks
    /// that did not arrive.
    void barrier();

    /// Throws weft::Error when the World was aborted (naming this rank and the reason: a dead peer, a peer's or the
    /// user's abort, a device wait that gave up) or a device spin wrote its Diagnostic record (rank, block, signal
    /// address, expected and observed values); no-op otherwise. Both stay (see clear_diagnostics).
    void check_diagnostics() const;
    /// Zeroes the diagnostic record and this rank's abort word and reason: waits on this rank run again (after a
    /// handled failure, on every rank, before the next op): the heap, barriers, teams and kernels of your own. A
    /// peer that is dead stays dead: its watchdog aborts the World again at the next beat. weft's ops that keep
    /// protocol state on the device between calls (the collectives' workspace, AgAttention, AgGemm, GemmRs, GemmAr,
    /// the TP MoE layers, ep::Buffer and MoeBlock)
    /// do not come back with it: a wait that gave up or an abort may have left their flags and epochs out of step
    /// across ranks, so once an abort was cleared their next call throws weft::Error naming it: make a new World.
    /// (An op made after the clear runs when it needs neither the collectives' workspace nor the network: a new
    /// AgAttention, AgGemm or GemmRs on one node; not a GemmAr with its all-reduce half, nor anything across nodes,
    /// whose communicator the abort aborted.) See cleared_aborts().
    void clear_diagnostics();
    /// How many times clear_diagnostics cleared an abort of this World, and the text of the last one (empty before
    /// any). Ops with device protocol state note the count when made and refuse calls once it moved.
    uint64_t cleared_aborts() const;
    std::string last_cleared_abort() const;
    /// cudaStreamSynchronize(stream) then check_diagnostics(). A wait that gives up ends its kernel cleanly (the
    /// CUDA context stays usable) and aborts the World, so this throws weft::Error naming the rank, the reason and
    /// the signal. When the synchronisation itself fails (a trap: symm_at_or_trap, the GEMM kernels), the error
    /// also names the CUDA error and the call that returned it. While an embedding's wait check is set
    /// (set_wait_interrupt_check; the Python binding sets one), the stream is polled with cudaStreamQuery instead and
    /// the check asked every 100 ms: its reason throws weft::Error with the stream's work still running.
    void sync_and_check(cudaStream_t stream);

    /// Aborts the World: sets this rank's abort word (every device wait of this rank stops within about 17 ms and its
    /// kernel ends: a wait reads the word once every ~16 ms of its backoff, kSpinAbortPollNs), makes the World's later
    /// store waits fail, and tells every other rank through the store (their watchdogs set theirs at their next beat).
    /// `reason` appears in every rank's error. Any thread of this process may call it while the World is alive (not
    /// beside its destruction); idempotent (the first reason stays).
    void abort(const std::string& reason);
    /// True once the World was aborted (by abort(), a peer, a dead peer or a device wait), until clear_diagnostics.
    bool aborted() const;

    /// The extension registered under `name`, or nullptr. Called from the rank's own thread.
    WorldExtension* find_extension(const std::string& name) const;
    /// Registers `extension` under `name` (which must be free) and returns it; the World owns it from now on.
    WorldExtension& add_extension(const std::string& name, std::unique_ptr<WorldExtension> extension);

private:
    friend void run_local(int num_ranks, const std::function<void(World&)>& fn, const WorldOptions& options);
    explicit World(detail::WorldSetup&& setup);

    std::string diagnostic_message(bool wait_for_writer) const;
    std::string failure_message() const;
    void shutdown() noexcept;

    std::unique_ptr<detail::WorldContext> ctx_;
};

/// One process, ranks as threads over the visible GPUs (rank r uses device r % num_devices unless
/// options.device says otherwise); `fn` runs once per rank on that rank's thread, with its World. Sets
/// eager module loading first. Exceptions thrown by any rank are collected; when one rank fails, the
/// others' store calls fail at once. After all threads end, run_local throws weft::Error naming the first
/// failing rank and its message. Once a rank has failed, the others have 2 x max(timeout, 60 s) to return;
/// a rank that does not is named in the error and its thread left running, detached, with every rank's
/// World unreleased (docs/runtime.md, "run_local's end"): end the process soon after such an error.
void run_local(int num_ranks, const std::function<void(World&)>& fn, const WorldOptions& options = {});

}  // namespace weft
