// SPDX-License-Identifier: MIT
// The per-team collective workspace (private to src/ops): symmetric buffers, device state, kernels, side streams.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "abort_mark.hpp"
#include "views_overlap.hpp"
#include "weft/common/all_to_all.hpp"
#include "weft/common/collectives.hpp"
#include "weft/common/device_ctx.hpp"
#include "weft/detail/collectives.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops::detail {

/// The symmetric heap allocations of a team's workspace, in the order the workspace makes them (signal words are
/// 8 bytes each). The workspace allocates exactly these; collective_workspace_heap_bytes() sums them.
struct CollectiveHeapSizes {
    uint64_t staging_region_bytes = 0;  ///< each of the 3 staging regions
    uint64_t ll_slot_bytes = 0;         ///< LL receive buffer per sender and parity
    uint64_t barrier_signals = 0;       ///< kMaxCollectiveBlocks per member
    uint64_t descriptor_signals = 0;    ///< 2 per member (epoch parities)
    uint64_t copy_engine_signals = 0;   ///< 1 per member
    uint64_t ll_buffer_signals = 0;     ///< 2 parities x members x ll_slot_bytes, in signal words
    uint64_t ll_header_signals = 0;     ///< 2 parities x members x kMaxCollectiveBlocks LL lines, in signal words
    uint64_t staging_bytes = 0;         ///< 3 x staging_region_bytes (256-byte aligned)
    /// Sizes for `num_ranks` > 1 ranks with the resolved staging region (staging_region_from_env) and `topo`'s LL
    /// capacity.
    static CollectiveHeapSizes make(int num_ranks, uint64_t staging_region_bytes, const CollectiveTopology& topo);
    /// Heap bytes of the six allocations, each rounded up to the heap's 256-byte alignment.
    uint64_t bytes() const;
};

/// WEFT_COLLECTIVE_STAGING_BYTES (default 32 MiB), rounded up to 256 bytes, at least 64 KiB.
uint64_t staging_region_from_env();

/// Symmetric buffers (team-collective allocations), the rank's device state, loaded kernels and side streams; one
/// per team, made collectively over the team's members on first use (prepare_collectives) and destroyed with the
/// World (a World extension named extension_name(team)).
class CollectiveWorkspace final : public WorldExtension {
public:
    static constexpr const char* kExtensionName = "weft.ops.collectives";
    /// kExtensionName for the world team, kExtensionName + "/" + team.id() for any other.
    static std::string extension_name(const Team& team);

    /// The team's workspace, made (collectively over its members) if it does not exist yet. The caller has
    /// checked that this rank is a member.
    static CollectiveWorkspace& get(const Team& team);
    /// get(), for an op's call on `stream`: refused (weft::Error naming `op`) when the workspace does not exist yet
    /// and `stream` is being captured (making it allocates, compiles and synchronises).
    static CollectiveWorkspace& get(const Team& team, cudaStream_t stream, const char* op);
    ~CollectiveWorkspace() override;

    const CollectiveWorkspaceInfo& info() const { return info_; }
    const CollectiveTopology& topology() const { return info_.topology; }
    World& world() { return world_; }
    const Team& team() const { return team_; }
    int rank() const { return rank_; }  ///< team rank
    int num_ranks() const { return num_ranks_; }

    /// True when [ptr, ptr + bytes) is on this rank's symmetric heap.
    bool symmetric(const void* ptr, uint64_t bytes) const;
    /// Heap offset of a symmetric pointer, or ~0 for any other (for call descriptors).
    uint64_t offset_or_none(const void* ptr) const;
    /// Team rank `peer`'s copy of the symmetric `ptr` (weft::Error when unreachable: checked at creation).
    void* peer_pointer(const void* ptr, int peer) const;

    /// Params with the workspace fields filled in (the op fills in buffers, count, strides, flags, descriptor).
    CollectiveParams params() const;
    /// The copy-engine staging region (not epoch-alternated; its readers finish before the call returns).
    uint8_t* copy_engine_region() const { return staging_ + 2 * info_.staging_region_bytes; }
    /// This rank's copy-engine flag on `peer` (the word `peer` waits on for this rank).
    uint64_t* copy_engine_flag_on(int peer) const;

    /// Launches `id` (specialised on `dtype` when reducing) with `grid` blocks on `stream`.
    void launch(KernelId id, DType dtype, int grid, cudaStream_t stream, const CollectiveParams& p);
    /// The same for a byte-moving kernel that also takes an all-to-all table (kAllToAllPull).
    void launch(KernelId id, int grid, cudaStream_t stream, const CollectiveParams& p, const AllToAllTable& table);

    /// Side streams for copy-engine work (none when ranks share a GPU: the copies then go on the caller's stream):
    /// fork() makes the first `count` of them wait for `stream`'s work so far; join() makes `stream` wait for
    /// theirs. Graph-capturable (events).
    int num_side_streams() const { return static_cast<int>(side_streams_.size()); }
    cudaStream_t side_stream(int i) const { return side_streams_[static_cast<size_t>(i)]; }
    void fork(cudaStream_t stream, int count);
    void join(cudaStream_t stream, int count);

    /// Whether the copy-engine all-gathers move their bytes with the one-CTA pull kernel
    /// (copy_engine_copies_with_kernel: ranks of this process share this rank's GPU).
    bool copies_with_kernel() const { return pull_kernel_ != nullptr; }
    /// Launches the pull kernel on `items` (in order) on `stream`. Only when copies_with_kernel().
    void launch_pulls(const std::vector<PeerPullItem>& items, cudaStream_t stream) const;

private:
    explicit CollectiveWorkspace(const Team& team);
    jit::Kernel& kernel_for_launch(KernelId id, DType dtype, int grid) const;
    jit::LaunchParams launch_params(KernelId id, int grid, cudaStream_t stream) const;
    void release() noexcept;

    Team team_;
    World& world_;
    AbortMark abort_mark_;  // get() refuses the workspace once an abort was cleared after it was made
    int rank_ = 0;
    int num_ranks_ = 1;
    int max_ranks_ = 8;
    DeviceCtx ctx_{};
    CollectiveWorkspaceInfo info_;
    uint64_t* barrier_flags_ = nullptr;
    uint64_t* descriptors_ = nullptr;
    uint64_t* ce_flags_ = nullptr;
    uint8_t* ll_buffer_ = nullptr;
    uint8_t* ll_headers_ = nullptr;  // [2][n][kMaxCollectiveBlocks] LL lines carrying the LL kernels' descriptors
    uint8_t* staging_ = nullptr;
    CollectiveState* state_ = nullptr;
    cudaStream_t setup_stream_ = nullptr;
    std::vector<cudaStream_t> side_streams_;
    cudaEvent_t fork_event_ = nullptr;
    std::vector<cudaEvent_t> join_events_;
    std::array<std::array<jit::Kernel*, 3>, static_cast<size_t>(KernelId::kCount)> kernels_{};
    const jit::Kernel* pull_kernel_ = nullptr;  // copy-engine all-gathers' copies (copies_with_kernel)
};

/// The index of this rank's next collective call on `team` (all_reduce, all_gather, reduce_scatter, all_to_all and
/// all_to_all_v, and the fused ops' calls of them), counted from 0 at the team's first call: every call counts, one of
/// 0 elements and one refused on this rank included. The ops fold it into their call descriptors, so that a call one
/// rank made and its peers did not (an empty batch on one rank) shows as a mismatch at its next call, on every rank,
/// instead of pairing every later call with its peers' earlier one. 0 on a team of one rank (nothing is compared).
uint64_t next_collective_call(const Team& team);

/// Throws weft::Error naming `op` and `what` (the state a first call makes) when `stream` is being captured.
void refuse_setup_under_capture(cudaStream_t stream, const char* op, const char* what);

/// Throws weft::Error unless `ptr` is device memory (or managed memory) of this GPU. While `stream` is being captured
/// (the query then runs in relaxed capture mode) only pinned host memory and another GPU's memory are refused: an
/// address the graph allocates itself is not known to CUDA until the graph runs.
void check_device_pointer(const void* ptr, const char* what, const char* op, cudaStream_t stream);

/// check_device_pointer that also takes pinned host memory mapped at the same address (a host-mapped status or flag
/// word the kernels write and the host reads); nullptr passes (an optional word not given).
void check_device_or_mapped_pointer(const void* ptr, const char* what, const char* op, cudaStream_t stream);

/// A call's user buffers, each named: check_device_pointer on every one that is neither empty nor on `heap` (the
/// symmetric heap's buffers are this GPU's memory by construction).
void check_device_buffers(const SymmetricHeap& heap, std::initializer_list<NamedView> views, const char* op,
                          cudaStream_t stream);

/// check_device_pointer on every view that is not empty (a call without a heap: the grouped GEMM, the MoE steps).
void check_device_views(std::initializer_list<NamedView> views, const char* op, cudaStream_t stream);

/// ops::all_reduce with `output` taken as the caller's own memory wherever it lives: peers never read it (a two-shot
/// reduces into staging, not into a symmetric output), so ranks may pass outputs on the heap or off it, at any offset.
/// For fused ops whose users' buffers carry no symmetric-placement contract (GemmAr's c). `input` != `output`.
void all_reduce_into_private(const Team& team, const TensorView& input, const TensorView& output, cudaStream_t stream);

}  // namespace weft::ops::detail
