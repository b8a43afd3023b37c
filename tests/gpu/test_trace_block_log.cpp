// SPDX-License-Identifier: MIT
// GPU tests of the trace's block log (weft/device/trace.cuh) on a buffer of the test's own: a traced kernel whose
// blocks claim slots at their start (the buffer's address a kernel parameter) and defer events at slots of the log
// writes each event once, with its block and SM, into the claimed slot of its log slot (whatever the block's size: a
// partial last warp, a block smaller than a warp); the claimed slots no event went to (at the end of the claim or
// between events) read as empty events (kind 0), which the host's drop_empty_trace_events counts as unused; events
// at log slots past the claim, or past the log, are still recorded; a full buffer drops what does not fit and counts
// its empty slots past the capacity.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "weft/common/device_ctx.hpp"
#include "weft/common/trace.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/trace.hpp"

namespace weft {
namespace {

// Thread t of each block defers the events i = t, t + blockDim.x, ... < defers at log slot i * stride: "reduce", args
// {block, i}. Past the log's 64 slots a defer records at once through ctx (no peer table here: ctx.peer_bases names
// the buffer).
jit::KernelSpec block_log_spec() {
    jit::KernelSpec spec;
    spec.header = "weft/device/trace.cuh";
    spec.extra_code = R"(
extern "C" __global__ void weft_test_block_log(weft::DeviceCtx ctx, weft::TraceBuffer* buffer, int slots, int defers,
                                               int stride) {
    WEFT_TRACE_OPEN_BLOCK_LOG(claim, buffer, slots);
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < defers; i += static_cast<int>(blockDim.x)) {
        WEFT_TRACE_BEGIN(t0);
        WEFT_TRACE_DEFER_AT(i * stride, ctx, TraceKind::kReduce, TraceRole::kComm, t0, static_cast<int>(blockIdx.x), i, 0, 0);
    }
    WEFT_TRACE_FLUSH_BLOCK_LOG(claim);
}
)";
    spec.instantiation = "weft_test_block_log";
    spec.description = "trace block log test kernel";
    spec.options.defines.push_back("WEFT_TRACE=1");
    return spec;
}

/// A TraceBuffer of `capacity` events (zeroed, as the World's) and a one-rank DeviceCtx whose peer table's entry
/// after the peers names it (where record_span finds it).
struct TestBuffer {
    uint32_t capacity;
    TraceBuffer* buffer = nullptr;
    uint8_t** table = nullptr;

    explicit TestBuffer(uint32_t cap) : capacity(cap) {
        const uint64_t bytes = trace_buffer_bytes(cap);
        WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&buffer), bytes));
        WEFT_CUDA_CHECK(cudaMemset(buffer, 0, bytes));
        TraceBuffer header{};
        header.capacity = cap;
        WEFT_CUDA_CHECK(cudaMemcpy(buffer, &header, offsetof(TraceBuffer, events), cudaMemcpyHostToDevice));
        WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&table), 2 * sizeof(uint8_t*)));
        uint8_t* const entries[2] = {nullptr, reinterpret_cast<uint8_t*>(buffer)};
        WEFT_CUDA_CHECK(cudaMemcpy(table, entries, sizeof(entries), cudaMemcpyHostToDevice));
    }
    ~TestBuffer() {
        cudaFree(table);
        cudaFree(buffer);
    }
    TestBuffer(const TestBuffer&) = delete;
    TestBuffer& operator=(const TestBuffer&) = delete;

    DeviceCtx ctx() const {
        DeviceCtx c{};
        c.rank = 0;
        c.num_ranks = 1;
        c.peer_bases = table;
        return c;
    }
    TraceBuffer header() const {
        TraceBuffer h{};
        WEFT_CUDA_CHECK(cudaMemcpy(&h, buffer, offsetof(TraceBuffer, events), cudaMemcpyDeviceToHost));
        return h;
    }
    std::vector<TraceEvent> events() const {
        std::vector<TraceEvent> e(capacity);
        WEFT_CUDA_CHECK(cudaMemcpy(e.data(), buffer->events, capacity * sizeof(TraceEvent), cudaMemcpyDeviceToHost));
        return e;
    }
};

struct Case {
    unsigned blocks;
    unsigned threads;
    int slots;  ///< claimed per block
    int defers;
    uint32_t capacity;
    int stride = 1;  ///< event i at log slot i * stride
};

void run_case(jit::Kernel& kernel, const Case& c) {
    SCOPED_TRACE(::testing::Message() << c.blocks << " blocks of " << c.threads << " threads, claim " << c.slots
                                      << ", defer " << c.defers << " at stride " << c.stride << ", capacity "
                                      << c.capacity);
    TestBuffer b(c.capacity);
    kernel.launch(jit::LaunchParams{.grid = dim3(c.blocks), .block = dim3(c.threads)}, b.ctx(), b.buffer, c.slots,
                  c.defers, c.stride);
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    const TraceBuffer h = b.header();
    const std::vector<TraceEvent> all = b.events();
    const auto used = static_cast<uint32_t>(std::min<uint64_t>(h.count, c.capacity));
    const uint64_t deferred = static_cast<uint64_t>(c.blocks) * static_cast<uint64_t>(c.defers);
    const int claim = std::min(c.slots, 64);  // the log's capacity caps a claim
    int in_claim = 0;                         // a block's events at log slots inside its claim
    for (int i = 0; i < c.defers; ++i) in_claim += i * c.stride < claim ? 1 : 0;
    const uint64_t holes = static_cast<uint64_t>(c.blocks) * static_cast<uint64_t>(claim - in_claim);
    // Every block's claim, and a slot per event past it.
    EXPECT_EQ(h.count, static_cast<uint64_t>(c.blocks) * static_cast<uint64_t>(claim + c.defers - in_claim));
    // The host's view: the empty slots it reads plus those past the capacity are the holes; the rest are events.
    std::vector<TraceEvent> kept(all.begin(), all.begin() + used);
    const uint64_t empty_read = detail::drop_empty_trace_events(kept);
    EXPECT_EQ(empty_read + h.unused_past_capacity, holes) << "unused slots";
    EXPECT_EQ(h.count - holes, deferred) << "events recorded (kept or dropped)";
    std::set<std::pair<int32_t, int32_t>> seen;
    std::map<uint32_t, uint16_t> sm_of_block;  // a block stays on its SM: every event of it names the same one
    // An event at log slot s < claim lands at buffer slot first + s of its block's claim: one `first` per block.
    std::map<int32_t, int64_t> first_of_block;
    for (uint32_t s = 0; s < used; ++s) {
        const TraceEvent& e = all[s];
        const int64_t log_slot = static_cast<int64_t>(e.args[1]) * c.stride;
        if (e.kind == 0 || log_slot >= claim) continue;
        const auto [at, fresh] = first_of_block.emplace(e.args[0], static_cast<int64_t>(s) - log_slot);
        EXPECT_TRUE(fresh || at->second == static_cast<int64_t>(s) - log_slot)
            << "event " << e.args[1] << " of block " << e.args[0] << " at buffer slot " << s << ", not "
            << at->second + log_slot;
    }
    for (const TraceEvent& e : kept) {
        EXPECT_EQ(e.kind, static_cast<uint16_t>(TraceKind::kReduce));
        EXPECT_EQ(e.role, static_cast<uint8_t>(TraceRole::kComm));
        EXPECT_EQ(static_cast<int32_t>(e.block), e.args[0]) << "the block of another's event";
        const auto [at, fresh] = sm_of_block.emplace(e.block, e.sm);
        EXPECT_TRUE(fresh || at->second == e.sm) << "block " << e.block << " on SMs " << at->second << " and " << e.sm;
        EXPECT_LE(e.begin_ns, e.end_ns);
        EXPECT_GT(e.begin_ns, 0u);
        EXPECT_TRUE(e.args[0] >= 0 && e.args[0] < static_cast<int32_t>(c.blocks) && e.args[1] >= 0 &&
                    e.args[1] < c.defers)
            << "args " << e.args[0] << ", " << e.args[1];
        EXPECT_TRUE(seen.insert({e.args[0], e.args[1]}).second)
            << "event " << e.args[1] << " of block " << e.args[0] << " written twice";
    }
    for (uint32_t s = used; s < c.capacity; ++s) EXPECT_EQ(all[s].kind, 0) << "slot " << s << " past the count";
    if (h.count <= c.capacity) {
        EXPECT_EQ(seen.size(), deferred) << "events lost with room in the buffer";
        EXPECT_EQ(h.unused_past_capacity, 0u);
    } else {
        EXPECT_LT(seen.size(), deferred) << "a full buffer dropped nothing";
    }
    std::printf(
        "[ LOG      ] %u x %d deferred, claim %d, capacity %u: count %llu, %llu empty read, %llu empty past "
        "the capacity, %zu kept\n",
        c.blocks, c.defers, c.slots, c.capacity, h.count, static_cast<unsigned long long>(empty_read),
        h.unused_past_capacity, seen.size());
}

TEST(TraceBlockLog, EventsLandOnceInTheClaimedSlotsAndEmptySlotsAreCountedAsUnused) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    jit::Kernel& kernel = jit::compiler().get_kernel(block_log_spec());
    const Case cases[] = {
        {3, 96, 8, 5, 4096},       // fewer events than claimed: empty slots
        {3, 96, 5, 5, 4096},       // exactly the claim
        {4, 512, 4, 10, 4096},     // more than claimed: the rest recorded one by one at the flush
        {2, 80, 8, 70, 4096},      // more than the log holds (64): the rest recorded at once; a partial last warp
        {2, 80, 40, 40, 4096},     // the claim filled by a block of 80 threads (16 in its last warp)
        {3, 16, 20, 20, 4096},     // a block smaller than a warp: its 16 lanes write 20 events
        {3, 16, 30, 7, 4096},      // ... and 23 empty slots
        {2, 64, 100, 3, 4096},     // a claim above the log's 64 is capped at 64
        {1, 1024, 0, 3, 4096},     // nothing claimed: every event recorded at the flush
        {8, 64, 3, 0, 4096},       // claimed, nothing deferred
        {3, 96, 8, 5, 20},         // the buffer fills up: events dropped, the empty slots past it counted
        {4, 96, 8, 2, 12},         // ... where the buffer's end falls among a block's empty slots
        {3, 96, 12, 4, 4096, 3},   // events at log slots 0, 3, 6, 9: empty slots between them
        {2, 64, 10, 6, 4096, 2},   // slots 0..10 by 2: the last two past the claim, recorded at the flush
        {2, 64, 20, 40, 4096, 2},  // slots past the log (64) recorded at once, those in [20, 64) at the flush
        {3, 96, 12, 4, 14, 3},     // sparse slots where the buffer's end falls inside the second block's claim
    };
    for (const Case& c : cases) run_case(kernel, c);
}

}  // namespace
}  // namespace weft
