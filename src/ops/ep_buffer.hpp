// SPDX-License-Identifier: MIT
// The state behind weft::ops::ep's Buffer and handles, and the argument checks every EP op shares (private to
// src/ops: ep_buffer.cpp, ep_normal.cpp, ep_low_latency.cpp).
#pragma once

#include <cuda_runtime_api.h>

#include <deque>
#include <vector>

#include "abort_mark.hpp"
#include "weft/common/ep_internode.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/ep.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/stream.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops::ep {

namespace detail {

/// Threads per block of every EP kernel (the kernel_specs() instantiations use it).
inline constexpr int kThreads = 512;

/// Elements between rows of a row-major view (the column count for a view of at most one row).
int64_t row_stride_of(const TensorView& v);

/// Throws weft::Error naming `op` and `name` unless `v` is a 2-D row-major `dtype` view with `cols` columns
/// (rows and row strides 16-byte aligned when `align16`). A view of 0 rows passes with any data pointer.
void check_matrix(const char* op, const char* name, const TensorView& v, DType dtype, int64_t cols, bool align16);

/// Checks topk_idx (int32 [T, k]) and returns T: T must equal `rows_expected` (the rows of `rows_from`) unless
/// that is negative, and must not exceed max_tokens_per_rank.
int check_tokens(const char* op, const Geometry& g, const TensorView& idx, int64_t rows_expected,
                 const char* rows_from);

/// A zeroed private device allocation of `bytes` (nullptr for 0), stream-ordered on `stream` so that it never
/// synchronises the device while other ranks' kernels spin; synchronises `stream` before returning.
uint8_t* device_alloc_zeroed(uint64_t bytes, cudaStream_t stream);

/// The Config of the one-rank Buffer a normal Buffer across nodes feeds the received records to: this rank's experts
/// (E / W), every (source, token) of the exchange as a token of its own (W x max_tokens_per_rank, at most 2^24, else
/// weft::Error), in (source rank, source token) order, with the team's receive capacities and alignment; normal mode
/// only. The Buffer makes it with this Config and footprint() counts its Footprint.
Config one_rank_config(const Geometry& g);

/// describe_status for a receive overflow that only this rank skipped (a team across nodes: its one-rank Buffer found
/// it, the other ranks went ahead): the same sentence, with what happened instead of "every rank skipped the call".
std::string describe_status_one_rank_skipped(const Status& s);

/// A handle's Impl; weft::Error naming `op` when the handle was moved from (its Impl is gone) or its Buffer was
/// destroyed before it (Buffer::Impl::attach).
template <class ImplPtr>
const auto& live_impl(const ImplPtr& impl, const char* op) {
    WEFT_CHECK(impl != nullptr, "ep: " << op << ": the handle is empty (moved from)");
    WEFT_CHECK(impl->buffer != nullptr, "ep: " << op << ": the handle's Buffer was destroyed before it");
    return *impl;
}

}  // namespace detail

struct NormalHandle::Impl {
    Buffer::Impl* buffer = nullptr;
    uint8_t* symmetric = nullptr;  // heap allocation: Workspace::normal_handle_symmetric
    uint8_t* device = nullptr;     // private allocation: Workspace::normal_handle_device
    NormalHandleView view{};
    int num_tokens = -1;  // of the last dispatch
    bool dispatched = false;
    bool combine_pending = false;  // dispatched, not combined since: the layout arrays are the combine's
    int32_t ordinal = 0;           // its creation index on the Buffer (NormalArgs::handle_ordinal)
    // A team that spans nodes (docs/multinode.md, "EP across nodes"): `symmetric` is null, `device` holds the
    // team-wide layout arrays, the receive side is `inner`'s (the one-rank Buffer's handle), and the exchange buffers
    // are private: send and recv records, the combine's partials and the partials that came back.
    std::unique_ptr<NormalHandle> inner;
    uint8_t* exchange = nullptr;  // one private allocation: send | recv | partials | returned
    uint8_t* send = nullptr;
    uint8_t* recv = nullptr;
    uint16_t* partials = nullptr;
    uint16_t* returned = nullptr;
    // The two-hop dispatch's buffers (in `exchange` too): the network hop's blocks and the node stage's output.
    uint8_t* node_send = nullptr;
    uint8_t* node_recv = nullptr;
    uint8_t* gathered = nullptr;  // [L][N][T_max] records by (node member, source node): reordered into `recv`
    ~Impl();
};

struct LowLatencyHandle::Impl {
    Buffer::Impl* buffer = nullptr;
    uint8_t* device = nullptr;  // private allocation: Workspace::low_latency_handle_device
    LowLatencyHandleView view{};
    bool fp8 = false;
    int num_tokens = -1;
    enum class State { kIdle, kDispatchSent, kDispatched, kCombineSent } state = State::kIdle;
    // A team that spans nodes (docs/multinode.md, "EP across nodes"): the record exchanges' private buffers, in one
    // allocation: dispatch send | dispatch recv | route_row | combine send | combine recv.
    uint8_t* exchange = nullptr;
    uint8_t* send = nullptr;
    uint8_t* recv = nullptr;
    int32_t* route_row = nullptr;
    uint16_t* combine_send = nullptr;
    uint16_t* combine_recv = nullptr;
    ~Impl();
};

struct Buffer::Impl {
    World* world = nullptr;
    ops::detail::AbortMark abort_mark;  // enter() refuses once an abort was cleared after the Buffer was made
    Team team;        // the members the Buffer's collectives run over (a copy: it keeps the team's device tables)
    DeviceCtx ctx{};  // team.device_ctx(), for every launch
    Config config;
    Geometry geo{};
    Workspace ws{};
    Footprint fp;
    cudaStream_t alloc_stream = nullptr;
    uint8_t* symmetric = nullptr;  // heap allocation: Workspace::buffer_symmetric
    uint8_t* device = nullptr;     // private allocation: Workspace::buffer_device
    weft::ep::NormalBufferView normal{};
    weft::ep::LowLatencyBufferView low_latency{};
    TraceBuffer* trace = nullptr;  // this rank's trace buffer when the World traces (the low-latency kernels' a.trace)
    Status* status_host = nullptr;
    Status* status_dev = nullptr;
    jit::Kernel* k_layout = nullptr;
    jit::Kernel* k_dispatch = nullptr;
    jit::Kernel* k_combine = nullptr;
    jit::Kernel* k_ll_dispatch = nullptr;
    jit::Kernel* k_ll_combine = nullptr;
    // The `buffer` fields of the live handles (attach / detach): a Buffer destroyed before its handles clears them,
    // so the handles' later calls are refused and their destructors leave their memory to the World's heap.
    std::vector<Buffer::Impl**> handle_owners;
    void attach(Buffer::Impl** owner) {
        *owner = this;
        handle_owners.push_back(owner);
    }
    void detach(Buffer::Impl** owner) { std::erase(handle_owners, owner); }
    mutable StreamUses uses;  // the streams this Buffer's kernels ran on: waited for before its memory is freed
    std::deque<LowLatencyHandle::Impl*> ll_dispatch_queue;  // sent, not yet received (oldest first)
    std::deque<LowLatencyHandle::Impl*> ll_combine_queue;

    // ---- a team that spans nodes (docs/multinode.md, "EP across nodes") ----
    bool spans_nodes = false;
    // This Buffer is another's one-rank Buffer (`inner` below): its status is checked by the outer call's entry,
    // before the exchange it is fed by; checking again at its own entry would throw after that exchange ran.
    bool nested = false;
    int32_t normal_handles_made = 0;     // make_normal_handle's count: the next handle's ordinal
    mutable bool status_warned = false;  // enter() logged the pending error (warn_pending_status)
    // Normal mode: the one-rank Buffer (this rank alone, E / W experts) the records feed.
    std::unique_ptr<Buffer> inner;
    weft::ep::InternodeLayout net{};  // the exchange's layout
    jit::Kernel* k_pack = nullptr;
    jit::Kernel* k_sum = nullptr;
    // The dispatch's path across nodes: two hops (network to the column peer on each node, then the node's forward),
    // or the record exchange over all_to_all (WEFT_EP_ACROSS_NODES=all_to_all).
    bool two_hop = false;
    weft::ep::NodeRecordLayout hop{};
    int32_t* team_ranks_by_node = nullptr;  // device [N][L]
    jit::Kernel* k_node_pack = nullptr;
    jit::Kernel* k_forward = nullptr;
    // The low-latency mode's record exchanges and kernels (kernels/ep/internode_ll.cuh).
    weft::ep::LowLatencyRecordLayout ll_net{};
    jit::Kernel* k_ll_pack = nullptr;
    jit::Kernel* k_ll_layout = nullptr;
    jit::Kernel* k_ll_copy = nullptr;
    jit::Kernel* k_ll_combine_pack = nullptr;
    jit::Kernel* k_ll_combine_sum = nullptr;
    bool across_nodes() const { return spans_nodes; }
    /// The constructor's part for a team that spans nodes: the column communicators, the layout kernels' state, and
    /// for the normal mode the one-rank Buffer and the pack and sum kernels, for the low-latency mode its kernels.
    void init_across_nodes();
    /// The constructor's part for a team within one node: kernels, symmetric and private allocations.
    void init_one_node();
    /// Frees this rank's private resources (device memory, status words, the stream; not the symmetric block,
    /// whose release is collective): the destructor's last step, and a failed construction's only one. Idempotent.
    void release_private() noexcept;
    /// make_normal_handle's part for a team that spans nodes: the one-rank handle, the team-wide layout arrays and
    /// the exchange buffers.
    void init_across_nodes_handle(NormalHandle::Impl& h);
    /// The normal dispatch and combine of a team that spans nodes (src/ops/ep_internode.cpp).
    void internode_dispatch(NormalHandle::Impl& h, const TensorView& x, const TensorView& topk_idx,
                            const TensorView& topk_weights, int t, cudaStream_t stream, const NormalOptions& options);
    /// The two-hop dispatch's exchange: node pack, network hop, forward, node all_to_all, reorder into h.recv.
    void two_hop_exchange(NormalHandle::Impl& h, weft::ep::InternodeArgs a, int sms, cudaStream_t stream);
    void internode_combine(NormalHandle::Impl& h, const TensorView& y, const TensorView& out, int t,
                           cudaStream_t stream, const NormalOptions& options);
    /// make_low_latency_handle's part for a team that spans nodes: the exchange buffers.
    void init_across_nodes_handle(LowLatencyHandle::Impl& h);
    /// The low-latency dispatch of a team that spans nodes (`a`: the call's validated inputs): pack, record exchange,
    /// layout and copy into the handle's masked layout.
    void internode_ll_dispatch(LowLatencyHandle::Impl& h, weft::ep::LowLatencyInternodeArgs a, int sms,
                               cudaStream_t stream);
    /// The low-latency combine's halves across nodes: the send half packs and exchanges the expert outputs (`a.y`),
    /// the receive half sums each token's rows (`a.topk_idx`, `a.topk_weights`, `a.out`).
    void internode_ll_combine(LowLatencyHandle::Impl& h, weft::ep::LowLatencyInternodeArgs a, Phase phase, int sms,
                              cudaStream_t stream);
    /// Launches a one-node low-latency kernel (dispatch or combine) on `sms` blocks with its shared memory.
    void launch_one_node_ll(jit::Kernel& kernel, const weft::ep::LowLatencyArgs& a, int sms, cudaStream_t stream);
    /// The low-latency kernels' arguments across nodes with this Buffer's and `h`'s arrays; the caller adds the call's.
    weft::ep::LowLatencyInternodeArgs internode_ll_args(const LowLatencyHandle::Impl& h) const;

    /// What every op checks on entry, before anything else: the stream is one the ranks' kernels cannot be
    /// serialised on, and `handle_owner` is this Buffer. A device-reported error still pending (check()) is logged
    /// once as a warning by a call that starts an exchange (`warn_pending`), not thrown: whether a rank's host sees it
    /// before its next call depends on its GPU's progress, and a rank that refused alone would leave its peers waiting
    /// for it until their timeout (every status code leaves the Buffer consistent; check() throws it). A call that
    /// completes one already launched (a combine, a receive half) passes `warn_pending = false`.
    void enter(const char* op, cudaStream_t stream, const Buffer::Impl* handle_owner, bool warn_pending = true) const;
    /// The warning of enter() for a pending error, once per error (clear_status() rearms it).
    void warn_pending_status(const char* op) const;
    /// The grid of a launch: `requested` blocks (0 = `fallback`), within the rank's SM budget.
    int grid(const char* op, int requested, int fallback) const;
    /// Throws the pending device-reported error, if any, naming `op`.
    void check_status(const char* op) const;
    /// describe_status with the ranks as world ranks (the kernels write team ranks) and, for a team other than
    /// the world, the team's members (`one_rank_skipped`: detail::describe_status_one_rank_skipped's sentence).
    std::string describe(const Status& s, bool one_rank_skipped = false) const;
    /// The pending device-reported error of this rank: its own status word's, else (across nodes) the one-rank
    /// Buffer's the exchange feeds, with that Buffer's ranks (0: this rank) as this Buffer's team ranks and an
    /// overflow described as this rank's alone. None when nothing is pending.
    std::optional<StatusReport> pending_report() const;

    /// The normal kernels' arguments with this Buffer's and `h`'s arrays; the caller adds the call's inputs.
    weft::ep::NormalArgs normal_args(const NormalHandle::Impl& h) const;
    /// The low-latency kernels' arguments with this Buffer's and `h`'s arrays, for `phase`.
    weft::ep::LowLatencyArgs low_latency_args(const LowLatencyHandle::Impl& h, Phase phase) const;
    /// Launches the layout kernel for `t` tokens of `topk_idx` (validated by the caller).
    void launch_layout(const NormalHandle::Impl& h, const TensorView& topk_idx, int t, cudaStream_t stream) const;
};

}  // namespace weft::ops::ep
