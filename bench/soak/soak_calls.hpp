// SPDX-License-Identifier: MIT
// weft_soak's calls: one rank's ops and buffers, made once per World, and per op the call and its check against a
// host reference. Host-compilable (.hpp): the inputs' kernels and the checks live in soak_calls.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "soak_plan.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/ep.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/runtime/world.hpp"

namespace weft::bench::soak {

/// The EP Buffer's configuration for a World of num_ranks: kEpExpertsPerRank experts per rank, normal and low-latency.
ops::ep::Config ep_config(int num_ranks);

/// Where a rank's thread is in its calls (weft_soak reports every rank's at the first failure): a rank that a hang's
/// waiters name but that never failed itself was here.
enum class Phase : int {
    kBetween,  ///< between calls (the plan, the loop, a collective barrier every 64 calls)
    kDelay,    ///< sleeping before a call (the random delay)
    kLaunch,   ///< in the call: filling inputs, launching the op
    kDevice,   ///< waiting for its stream (sync_and_check)
    kCheck,    ///< copying results to the host and checking them
};
inline constexpr const char* kPhaseNames[] = {"between calls", "delay", "launching", "waiting for the device",
                                              "copying results out"};

/// A cudaMalloc'd buffer, freed with it.
struct DeviceBuffer {
    void* ptr = nullptr;
    explicit DeviceBuffer(size_t bytes);
    ~DeviceBuffer();
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    uint8_t* bytes() const { return static_cast<uint8_t*>(ptr); }
};

/// A page-locked host buffer (cudaHostAlloc), freed with it. The calls' host copies go through these: CUDA stages a
/// pageable copy through its own pinned buffers, and with ranks sharing a GPU such copies have been seen held up while
/// peers' kernels spin (docs/runtime.md, "Pageable host copies"). Allocated with the ops, before any call.
struct PinnedBuffer {
    void* ptr = nullptr;
    explicit PinnedBuffer(size_t bytes);
    ~PinnedBuffer();
    PinnedBuffer(const PinnedBuffer&) = delete;
    PinnedBuffer& operator=(const PinnedBuffer&) = delete;
    uint8_t* bytes() const { return static_cast<uint8_t*>(ptr); }
};

/// One rank's ops and buffers for every Kind (AgGemm, GemmRs, two GemmAr, one EP Buffer with a normal and a
/// low-latency handle, the collective workspace, symmetric and private buffers). Construction and destruction are
/// collective: every rank of the World makes and drops its RankOps together.
class RankOps {
public:
    explicit RankOps(World& w);
    ~RankOps();
    RankOps(const RankOps&) = delete;
    RankOps& operator=(const RankOps&) = delete;

    cudaStream_t stream() const { return s_; }
    /// Where run() records its phase and the steady-clock time (ns) it entered it (nullptr: nowhere).
    void report_phase_to(std::atomic<int>* phase, std::atomic<int64_t>* since_ns) {
        phase_ = phase;
        phase_since_ns_ = since_ns;
    }

    /// Runs the call and checks this rank's result: "" when right, else what was wrong. Throws weft::Error when the
    /// call fails (a diagnosed device wait, an abort). Every rank of the World runs the same plan.
    std::string run(const Plan& p);

    /// The host's count of this rank's EP normal launches, for a failed call's report: "EP normal dispatch N
    /// launched; rows sent to ranks 0..w-1 before it: ...; in it: ...". N is the count signal the peers wait for from
    /// this rank in that dispatch (its mailbox epoch); "before" plus "in it" for rank d is the data signal rank d
    /// waits for from this rank (cumulative over the Buffer's dispatches). "" before the first.
    std::string ep_normal_ledger() const;

private:
    // Per op: fill this rank's inputs on the device, call, wait, check sampled outputs against the host reference.
    std::string all_reduce(const Plan& p);
    std::string all_gather(const Plan& p);
    std::string reduce_scatter(const Plan& p);
    std::string all_to_all(const Plan& p);
    std::string ag_gemm(const Plan& p);
    std::string gemm_rs(const Plan& p);
    std::string gemm_ar(const Plan& p);
    std::string ep_call(const Plan& p, bool low_latency);

    // Shared by the calls.
    uint8_t* in_buffer(const Plan& p) const { return p.in_sym ? sym_in_ : dev_in_.bytes(); }
    uint8_t* out_buffer(const Plan& p) const { return p.out_sym ? sym_out_ : dev_out_.bytes(); }
    void set_phase(Phase p) const;
    void sync();  // w_.sync_and_check(s_), in phase kDevice
    const std::vector<uint8_t>& download(const void* src, uint64_t bytes);
    std::string check_sums(const Plan& p, const void* out, uint64_t count, uint64_t first);
    std::string check_gathered(const Plan& p, const void* out, uint64_t block, uint64_t first);
    template <class Op>
    void run_gemm(Op& op, const Plan& p, int64_t a_rows, int64_t c_rows);
    template <class Ref>
    std::string check_gemm(const Plan& p, int64_t rows, Ref&& ref);

    World& w_;
    int me_, n_;
    cudaStream_t s_ = nullptr;
    uint8_t* sym_in_ = nullptr;
    uint8_t* sym_out_ = nullptr;
    DeviceBuffer dev_in_, dev_out_, gemm_a_, gemm_b_, gemm_c_, ep_x_, ep_idx_, ep_weights_, ep_out_;
    std::unique_ptr<ops::AgGemm> ag_;
    std::unique_ptr<ops::GemmRs> rs_;
    std::unique_ptr<ops::GemmAr> ar_, ar_own_;
    std::unique_ptr<ops::ep::Buffer> ep_;
    std::unique_ptr<ops::ep::NormalHandle> normal_;
    std::unique_ptr<ops::ep::LowLatencyHandle> low_latency_;
    PinnedBuffer pinned_in_, pinned_out_;  // the EP routing's upload; each download (kBufferBytes)
    std::vector<uint8_t> host_;            // the last download
    int64_t ep_normal_dispatches_ = 0;     // normal dispatches launched on ep_ (the warm-up pass's included)
    std::vector<int64_t> ep_rows_before_;  // per destination: rows sent by the dispatches before the last
    std::vector<int64_t> ep_rows_last_;    // per destination: rows sent by the last dispatch
    std::atomic<int>* phase_ = nullptr;
    std::atomic<int64_t>* phase_since_ns_ = nullptr;
};

/// The steady clock in nanoseconds (the phases' times).
int64_t steady_now_ns();

}  // namespace weft::bench::soak
