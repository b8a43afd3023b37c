// SPDX-License-Identifier: MIT
// The host-API network backend: NCCL send/receive and collectives on a communication stream per team, ordered against
// weft's kernels through signal words in device memory (docs/multinode.md).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "weft/common/dtype.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/world.hpp"

namespace weft::net {

/// Empty when this process can use NCCL (weft was built with nccl.h and libnccl.so.2 loads: from WEFT_NCCL_LIBRARY
/// alone when set, else the loader's path, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, python3's nvidia.nccl package:
/// weft/detail/nccl_library.hpp), else the reason, as a sentence.
std::string nccl_unavailable_reason();

namespace detail {
/// Loads NCCL from `path` alone and unloads it: empty when it has every entry point the backend needs, else why not.
/// For tests and diagnostics; the backend itself loads NCCL once, from WEFT_NCCL_LIBRARY alone when that is set.
std::string try_load_nccl(const std::string& path);
}  // namespace detail

/// The loaded NCCL's version code (e.g. 22809), or 0 when unavailable.
int nccl_version();

/// Prepares NCCL's environment for `world`'s virtual nodes before this process's first NCCL call (NCCL reads its host
/// identity once per process): with world.virtual_nodes() > 1 and ranks that are processes of their own, sets
/// NCCL_HOSTID to "<NCCL_HOSTID or host name>-vnode<node>" and, unless set, NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1,
/// so that NCCL's network transport carries every byte between virtual nodes. No-op without virtual nodes, when
/// `ranks_are_threads` (one environment for every rank of the process: docs/multinode.md), and after the first call.
void prepare_nccl_environment(const World& world, bool ranks_are_threads);

/// The network backend of one team that spans nodes: the NCCL communicator of this member's column (the team's
/// members with this member's local index, one per node, ranked by node index), a non-blocking communication
/// stream, the team's node-local sub-team, and two rows of kMaxChunks signal words in device memory:
///   ready(c):   raised by the compute stream when chunk c may leave (the comm stream waits for it);
///   arrived(c): raised by the comm stream when chunk c's network step has completed (the compute stream waits).
/// A call runs begin_call, then any sequence of comm-stream steps and waits, then end_call, all from the rank's thread.
/// Every wait is for a word whose writer is already enqueued; NCCL itself is bounded by a watcher that aborts the
/// communicator and the World when a network step is not done within the World's timeout.
class HostBackend final : public WorldExtension {
public:
    /// The team's backend, made on first use: collective over the team's members (a bounded all_gather through the
    /// World's store publishes the column heads' NCCL unique ids, then ncclCommInitRank per column). Throws
    /// weft::Error naming the team when NCCL is unavailable, the team does not span nodes or holds different
    /// numbers of members per node, two members of a column are threads of one process on one GPU (NCCL refuses
    /// them), or a member does not arrive within the World's timeout.
    static HostBackend& get(const Team& team);
    /// True once get() made the team's backend.
    static bool exists(const Team& team);
    ~HostBackend() override;
    /// A communicator that reports an asynchronous error (the network failed) aborts the World, naming the error.
    /// After network operations it asks the World to read its peers' abort records now: a column member that left
    /// (its World destroyed) closes its connections, and NCCL then ends the others' pending operation without an
    /// error; the leaving World publishes why before it releases its communicator.
    bool check_after_sync() override;

    const Team& team() const { return team_; }
    /// The members on this member's node, as a team (its own collectives run over it).
    const Team& node_team() const { return node_team_; }
    int num_nodes() const { return static_cast<int>(column_.size()); }
    int ranks_per_node() const { return ranks_per_node_; }
    int node_index() const { return node_index_; }
    int local_index() const { return local_index_; }
    /// Team rank of the member on node `node` with local index `local`.
    int team_rank_at(int node, int local) const;
    /// Every member's team rank by node and local index: [node][local] is team_rank_at(node, local).
    const std::vector<std::vector<int>>& team_ranks_by_node() const { return by_node_; }
    cudaStream_t comm_stream() const { return comm_stream_; }

    /// Starts a call on `stream`: zeroes the signal words in stream order and makes the comm stream wait for
    /// everything enqueued on `stream` so far.
    void begin_call(cudaStream_t stream);
    /// Ends a call: `stream` waits for everything enqueued on the comm stream (an event: this also joins a captured
    /// graph's branches).
    void end_call(cudaStream_t stream);

    /// On `stream`: raise ready(chunk).            On the comm stream: wait for ready(chunk).
    void mark_ready(cudaStream_t stream, int chunk);
    void comm_wait_ready(int chunk);
    /// On the comm stream: raise arrived(chunk).   On `stream`: wait for arrived(chunk).
    void comm_mark_arrived(int chunk);
    void wait_arrived(cudaStream_t stream, int chunk);

    /// Comm-stream steps over the column (ranks = node indices). exchange: sends `bytes` at `send` to every other
    /// node's column member and receives each one's bytes at recv_at(node) (grouped ncclSend/ncclRecv).
    void exchange(const void* send, uint64_t bytes, const std::function<void*(int node)>& recv_at);
    /// One shift of a ring over the column: sends `bytes` at `send` to node `to_node` and receives `bytes` from node
    /// `from_node` at `recv` (one grouped ncclSend/ncclRecv; either side skipped when its node is this one). Every
    /// member pairs so that the sends and receives of a step match (AgGemm across nodes: to = n - k, from = n + k).
    void send_recv(const void* send, uint64_t bytes, int to_node, void* recv, int from_node);
    /// The same with a size per direction (all-to-all across nodes, uneven splits): either side skipped when its size
    /// is 0 or its node is this one. The receiver's `recv_bytes` must equal its sender's `send_bytes`.
    void send_recv(const void* send, uint64_t send_bytes, int to_node, void* recv, uint64_t recv_bytes, int from_node);
    /// ncclReduceScatter (sum) of num_nodes() x `recv_count` elements at `send` into `recv`.
    void reduce_scatter(const void* send, void* recv, uint64_t recv_count, DType dtype);
    /// ncclAllReduce (sum) of `count` elements, in place.
    void all_reduce(void* buffer, uint64_t count, DType dtype);

    struct Impl;

private:
    HostBackend(const Team& team, Team node_team);
    uint64_t begin_step(const char* what);
    void end_step(uint64_t id);
    /// Drops a step whose NCCL calls threw (nothing was enqueued for it to wait on).
    void cancel_step(uint64_t id) noexcept;
    /// body() (the step's NCCL calls), then end_step; cancel_step when it throws.
    template <class Body>
    void run_step(uint64_t id, Body&& body);
    void release() noexcept;  // the destructor's work, also run when the constructor throws part way

    Team team_;
    Team node_team_;
    std::vector<int> column_;  // team ranks by node index
    std::vector<std::vector<int>> by_node_;
    int ranks_per_node_ = 0;
    int node_index_ = -1;
    int local_index_ = -1;
    cudaStream_t comm_stream_ = nullptr;
    uint64_t* flags_ = nullptr;  // ready[kMaxChunks], then arrived[kMaxChunks]
    cudaEvent_t fork_ = nullptr;
    cudaEvent_t join_ = nullptr;
    std::unique_ptr<Impl> impl_;
};

}  // namespace weft::net
