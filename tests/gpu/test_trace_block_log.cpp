// SPDX-License-Identifier: MIT
// GPU tests of the trace's block log (weft/device/trace.cuh) on a buffer of the test's own: a traced kernel whose
// blocks claim slots at their start and defer events writes each event once, with its block and SM, into the slots
// it claimed; the slots a block left empty read as kind 0 and are counted in TraceBuffer::unused; a block that defers
// more than it claimed, or more than the log holds, still records every event; a full buffer drops what does not fit
// and counts it.
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

namespace weft {
namespace {

// Thread t of each block defers the events i = t, t + blockDim.x, ... < defers: "reduce", args {block, i}.
jit::KernelSpec block_log_spec() {
    jit::KernelSpec spec;
    spec.header = "weft/device/trace.cuh";
    spec.extra_code = R"(
extern "C" __global__ void weft_test_block_log(weft::DeviceCtx ctx, int max_events, int defers) {
    WEFT_TRACE_OPEN_BLOCK_LOG(ctx, max_events);
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < defers; i += static_cast<int>(blockDim.x)) {
        WEFT_TRACE_BEGIN(t0);
        WEFT_TRACE_DEFER(ctx, TraceKind::kReduce, TraceRole::kComm, t0, static_cast<int>(blockIdx.x), i, 0, 0);
    }
    WEFT_TRACE_FLUSH_BLOCK_LOG(ctx);
}
)";
    spec.instantiation = "weft_test_block_log";
    spec.options.defines.push_back("WEFT_TRACE=1");
    return spec;
}

/// A TraceBuffer of `capacity` events (zeroed, as the World's) and the peer table a DeviceCtx of one rank finds it in.
struct TestBuffer {
    uint32_t capacity;
    TraceBuffer* buffer = nullptr;
    uint8_t** peer_table = nullptr;

    explicit TestBuffer(uint32_t cap) : capacity(cap) {
        const uint64_t bytes = trace_buffer_bytes(cap);
        WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&buffer), bytes));
        WEFT_CUDA_CHECK(cudaMemset(buffer, 0, bytes));
        WEFT_CUDA_CHECK(cudaMemcpy(&buffer->capacity, &cap, sizeof(cap), cudaMemcpyHostToDevice));
        uint8_t* table[2] = {nullptr, reinterpret_cast<uint8_t*>(buffer)};
        WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&peer_table), sizeof(table)));
        WEFT_CUDA_CHECK(cudaMemcpy(peer_table, table, sizeof(table), cudaMemcpyHostToDevice));
    }
    ~TestBuffer() {
        cudaFree(peer_table);
        cudaFree(buffer);
    }
    TestBuffer(const TestBuffer&) = delete;
    TestBuffer& operator=(const TestBuffer&) = delete;

    DeviceCtx ctx() const {
        DeviceCtx c{};
        c.rank = 0;
        c.num_ranks = 1;
        c.peer_bases = peer_table;
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
    int max_events;
    int defers;
    uint32_t capacity;
};

void run_case(jit::Kernel& kernel, const Case& c) {
    SCOPED_TRACE(::testing::Message() << c.blocks << " blocks of " << c.threads << " threads, claim " << c.max_events
                                      << ", defer " << c.defers << ", capacity " << c.capacity);
    TestBuffer b(c.capacity);
    kernel.launch(jit::LaunchParams{.grid = dim3(c.blocks), .block = dim3(c.threads)}, b.ctx(), c.max_events,
                  c.defers);
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    const TraceBuffer h = b.header();
    const std::vector<TraceEvent> all = b.events();
    const uint32_t used = std::min(h.count, c.capacity);
    const uint64_t deferred = static_cast<uint64_t>(c.blocks) * static_cast<uint64_t>(c.defers);
    // Every deferred event is recorded (count - unused), kept or dropped.
    EXPECT_EQ(h.count - h.unused, deferred);
    const int claimed = std::min(c.max_events, 64);
    const uint64_t holes = c.defers < claimed ? static_cast<uint64_t>(c.blocks) * (claimed - c.defers) : 0;
    EXPECT_EQ(h.unused, holes);
    std::set<std::pair<int32_t, int32_t>> seen;
    std::map<uint32_t, uint16_t> sm_of_block;  // a block stays on its SM: every event of it names the same one
    uint32_t empty = 0;
    for (uint32_t s = 0; s < used; ++s) {
        const TraceEvent& e = all[s];
        if (e.kind == 0) {
            ++empty;
            continue;
        }
        EXPECT_EQ(e.kind, static_cast<uint16_t>(TraceKind::kReduce)) << "slot " << s;
        EXPECT_EQ(e.role, static_cast<uint8_t>(TraceRole::kComm)) << "slot " << s;
        EXPECT_EQ(static_cast<int32_t>(e.block), e.args[0]) << "slot " << s << ": the block of another's event";
        const auto [at, fresh] = sm_of_block.emplace(e.block, e.sm);
        EXPECT_TRUE(fresh || at->second == e.sm) << "slot " << s << ": block " << e.block << " on SMs " << at->second
                                                 << " and " << e.sm;
        EXPECT_LE(e.begin_ns, e.end_ns) << "slot " << s;
        EXPECT_GT(e.begin_ns, 0u) << "slot " << s;
        EXPECT_TRUE(e.args[0] >= 0 && e.args[0] < static_cast<int32_t>(c.blocks) && e.args[1] >= 0 &&
                    e.args[1] < c.defers)
            << "slot " << s << ": args " << e.args[0] << ", " << e.args[1];
        EXPECT_TRUE(seen.insert({e.args[0], e.args[1]}).second)
            << "slot " << s << ": event " << e.args[1] << " of block " << e.args[0] << " written twice";
    }
    for (uint32_t s = used; s < c.capacity; ++s) EXPECT_EQ(all[s].kind, 0) << "slot " << s << " past the count";
    if (h.count <= c.capacity) {
        EXPECT_EQ(seen.size(), deferred) << "events lost with room in the buffer";
        EXPECT_EQ(empty, h.unused);
    } else {
        EXPECT_LE(seen.size(), deferred);
        EXPECT_LT(seen.size(), deferred) << "a full buffer dropped nothing";
        EXPECT_LE(empty, h.unused);
    }
    std::printf("[ LOG      ] %u x %d deferred, claim %d, capacity %u: count %u, unused %u, %zu kept\n", c.blocks,
                c.defers, c.max_events, c.capacity, h.count, h.unused, seen.size());
}

TEST(TraceBlockLog, EventsLandOnceInTheClaimedSlotsAndEmptySlotsAreCounted) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    jit::Kernel& kernel = jit::compiler().get_kernel(block_log_spec());
    const Case cases[] = {
        {3, 96, 8, 5, 4096},     // fewer events than claimed: holes
        {3, 96, 5, 5, 4096},     // exactly the claim
        {4, 512, 4, 10, 4096},   // more than claimed: the rest claimed at the end
        {2, 80, 8, 70, 4096},    // more than the log holds (64): the rest recorded at once; a partial last warp
        {1, 1024, 0, 3, 4096},   // nothing claimed
        {3, 96, 8, 5, 20},       // the buffer fills up: the last block's last events are dropped
        {8, 64, 3, 0, 4096},     // claimed, nothing deferred
    };
    for (const Case& c : cases) run_case(kernel, c);
}

}  // namespace
}  // namespace weft
