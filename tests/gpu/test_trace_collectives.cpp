// SPDX-License-Identifier: MIT
// GPU tests of the intra-kernel trace on collectives and on EP at world 2 (ranks as threads): a traced one-shot
// all_reduce yields per rank its blocks' staging, their waits for the peer and their reductions, each wait ending
// after the peer staged that block's part and before the block reduces it; a traced copy-engine all_gather yields
// every copy, each peer's pull of this rank's shard ending before this rank's exit stops waiting for that peer; a
// traced EP dispatch yields per rank
// the layout, sends to both ranks, receives from both ranks, each receive ending after every send to it began, and a
// traced combine's weighted sums begin after the block's waits and after the partials sent to it; traced low-latency
// dispatch and combine (whose events are written at the kernels' end) yield sends, one notify per rank, waits for both
// ranks, and receives / weighted sums that end after every rank's notify to them began.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "support/ep_testing.hpp"
#include "support/jit_testing.hpp"
#include "support/runtime_checks.hpp"
#include "tp_test_util.hpp"
#include "trace_check.hpp"
#include "weft/ops/all_gather.hpp"
#include "weft/ops/all_reduce.hpp"
#include "weft/ops/ep.hpp"
#include "weft/runtime/trace.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

namespace fs = std::filesystem;

// Reads a trace with Python's json module and checks what `mode` expects; prints "ok <counts>" or the first
// violations. Device events of ranks on one host share %globaltimer; `tol` covers its granularity.
constexpr const char* kCheckScript = R"PY(
import json, sys
mode, path = sys.argv[1], sys.argv[2]
# Optional: the events each rank counted (trace_event_count) before the trace was written, "n0,n1".
recorded = [int(x) for x in sys.argv[3].split(',')] if len(sys.argv) > 3 else None
d = json.load(open(path))
ev = [e for e in d['traceEvents'] if e['ph'] == 'X']
ranks = sorted({e['pid'] for e in d['traceEvents'] if e['ph'] == 'M' and e['name'] == 'process_name'})
tol = 2_000  # ns
bad = []
def of(r, prefix):
    return [e for e in ev if e['pid'] == r and e['name'].startswith(prefix)]
def a(e, i): return e['args']['args'][i]
def blk(e): return e['args']['block']
def b(e): return e['args']['begin_ns']
def t(e): return e['args']['end_ns']
if len(ranks) != 2: bad.append('%d processes, expected 2' % len(ranks))
counts = {}
if mode == 'all_reduce':
    for r in ranks:
        p = 1 - r
        stages, waits, reduces = of(r, 'stage chunk'), of(r, 'wait peer %d' % p), of(r, 'reduce')
        counts['stage'] = counts.get('stage', 0) + len(stages)
        counts['wait'] = counts.get('wait', 0) + len(waits)
        counts['reduce'] = counts.get('reduce', 0) + len(reduces)
        if not stages or not waits or not reduces:
            bad.append('rank %d: %d stages, %d waits for peer %d, %d reduces' % (r, len(stages), len(waits), p,
                                                                                 len(reduces)))
        if of(r, 'wait peer %d' % r): bad.append('rank %d waited for itself' % r)
        peer_stage = {blk(s): s for s in of(p, 'stage chunk')}
        for red in reduces:
            if a(red, 0) != blk(red): bad.append('rank %d: reduce of chunk %d on block %d' % (r, a(red, 0), blk(red)))
            w = [x for x in waits if blk(x) == blk(red)]
            if not w:
                bad.append('rank %d: block %d reduced without waiting for peer %d' % (r, blk(red), p))
            elif max(t(x) for x in w) > b(red) + tol:
                bad.append('rank %d: block %d reduced %d ns before its wait ended' % (r, blk(red),
                                                                                   max(t(x) for x in w) - b(red)))
        for w in waits:
            s = peer_stage.get(blk(w))
            if s is None:
                bad.append('rank %d: block %d waited for peer %d, which staged no such block' % (r, blk(w), p))
            elif t(w) + tol < t(s):
                bad.append('rank %d: block %d stopped waiting for peer %d %d ns before the peer staged the block' %
                           (r, blk(w), p, t(s) - t(w)))
elif mode == 'all_gather_ce':
    cetol = 50_000  # ns: copies are timed with CUDA events mapped onto %globaltimer
    for r in ranks:
        p = 1 - r
        copies, waits = of(r, 'copy chunk %d' % p), of(r, 'wait peer %d' % p)
        counts['copy'] = counts.get('copy', 0) + len(copies)
        counts['wait'] = counts.get('wait', 0) + len(waits)
        if not copies or not waits:
            bad.append('rank %d: %d copies of chunk %d, %d waits for peer %d' % (r, len(copies), p, len(waits), p))
            continue
        if any(a(c, 1) != p for c in copies): bad.append('rank %d: a copy of chunk %d names another peer' % (r, p))
        # The peer pulled this rank's shard (its chunk r), then raised this rank's flag: the exit's wait ends later.
        for c in of(p, 'copy chunk %d' % r):
            if max(t(w) for w in waits) + cetol < t(c):
                bad.append('rank %d: its last wait for peer %d ended %d ns before the peer\'s copy of chunk %d' %
                           (r, p, t(c) - max(t(w) for w in waits), r))
elif mode == 'dispatch':
    for r in ranks:
        for what in ['layout', 'send to 0', 'send to 1', 'recv from 0', 'recv from 1', 'wait peer 0', 'wait peer 1',
                     'notify']:
            n = len(of(r, what))
            counts[what] = counts.get(what, 0) + n
            if n == 0: bad.append('rank %d: no "%s" event' % (r, what))
        for rec in of(r, 'recv from'):
            s = a(rec, 0)
            for snd in of(s, 'send to %d' % r):
                if t(rec) + tol < b(snd):
                    bad.append('rank %d: recv from %d (block %d) ended %d ns before a send of rank %d to it began' %
                               (r, s, blk(rec), b(snd) - t(rec), s))
elif mode == 'combine':
    for r in ranks:
        for what in ['send to 0', 'send to 1', 'wait peer', 'combine']:
            n = len(of(r, what))
            counts[what] = counts.get(what, 0) + n
            if n == 0: bad.append('rank %d: no "%s" event' % (r, what))
        for c in of(r, 'combine'):
            for w in of(r, 'wait peer'):
                if blk(w) == blk(c) and t(w) > b(c) + tol:
                    bad.append('rank %d: block %d combined %d ns before its wait for peer %d ended' %
                               (r, blk(c), t(w) - b(c), a(w, 0)))
            for s in ranks:
                for snd in of(s, 'send to %d' % r):
                    if b(c) + tol < b(snd):
                        bad.append('rank %d: block %d combined %d ns before rank %d began sending it partials' %
                                   (r, blk(c), b(snd) - b(c), s))
elif mode in ('ll_dispatch', 'll_combine'):
    # Low-latency: every event is written at the kernel's end (the block's trace log); their times are unchanged.
    # Per rank: "send" (every destination), one "notify" per destination from the last block, "wait peer p" for both
    # ranks, and "recv" (dispatch) or "combine" (the wait included) that ends after every rank's notify to it began.
    last = 'recv' if mode == 'll_dispatch' else 'combine'
    for r in ranks:
        # Blocks claim their slots at the kernel's start, for more events than most of them record (only the last
        # block notifies): the slots left empty are neither events in the file nor counted as recorded.
        mine = [e for e in ev if e['pid'] == r]
        counts['events'] = counts.get('events', 0) + len(mine)
        if any(e['args']['kind'] == 0 for e in mine): bad.append('rank %d: an empty slot (kind 0) became an event' % r)
        if recorded is not None and recorded[r] != len(mine):
            bad.append('rank %d: %d events recorded, %d in the file' % (r, recorded[r], len(mine)))
        for what in ['send', 'notify', 'wait peer 0', 'wait peer 1', last]:
            n = len([e for e in of(r, what) if e['name'] == what])
            counts[what] = counts.get(what, 0) + n
            if n == 0: bad.append('rank %d: no "%s" event' % (r, what))
        notes = of(r, 'notify')
        if sorted(a(n, 1) for n in notes) != ranks:
            bad.append('rank %d: notified ranks %s, expected one notify per rank' % (r, sorted(a(n, 1) for n in notes)))
        for e in [x for x in of(r, last) if x['name'] == last]:
            for s in ranks:
                for n in [x for x in of(s, 'notify') if a(x, 1) == r]:
                    if t(e) + tol < b(n):
                        bad.append('rank %d: %s (block %d) ended %d ns before rank %d began notifying it' %
                                   (r, last, blk(e), b(n) - t(e), s))
else:
    bad.append('unknown mode ' + mode)
print('\n'.join(bad[:20]) if bad else 'ok ' + ' '.join('%s=%d' % (k.replace(' ', '_'), v)
                                                          for k, v in sorted(counts.items())))
)PY";

bool have_python() { return std::system("python3 -c 'import json' >/dev/null 2>&1") == 0; }

/// Runs the check script on `trace` in `mode` (with `extra`, the script's optional third argument); fails the test
/// unless it prints "ok ...".
void expect_trace_ok(const fs::path& dir, const std::string& mode, const fs::path& trace,
                     const std::string& extra = "") {
    ASSERT_TRUE(fs::exists(trace)) << "no trace at " << trace.string();
    test::expect_trace_check_ok(dir, kCheckScript, mode + " " + trace.string() + " " + extra, mode);
}

TEST(TraceCollectives, OneShotAllReduceWaitsFollowThePeersStagingAndPrecedeTheReduction) {
    if (!have_python()) GTEST_SKIP() << "SKIPPED: python3 with its json module reads the trace";
    testing::TempDir dir("weft_trace_all_reduce");
    const fs::path path = dir / "all_reduce.json";
    const testing::ScopedEnv trace("WEFT_TRACE", (dir / "at_exit.json").string());
    constexpr int64_t kCount = 1 << 18;  // f32: 1 MiB, a part for every block
    tp_test::Failures f;
    test::run_ranks(
        2,
        [&](World& w) {
            ASSERT_TRUE(tracing(w));
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            std::vector<float> host(kCount);
            for (int64_t i = 0; i < kCount; ++i) {
                host[static_cast<size_t>(i)] = static_cast<float>((w.rank() + 1) * (i % 7));
            }
            void* in = nullptr;
            void* out = nullptr;
            WEFT_CUDA_CHECK(cudaMalloc(&in, kCount * sizeof(float)));
            WEFT_CUDA_CHECK(cudaMalloc(&out, kCount * sizeof(float)));
            WEFT_CUDA_CHECK(cudaMemcpyAsync(in, host.data(), kCount * sizeof(float), cudaMemcpyHostToDevice, s));
            const TensorView vin(in, DType::kF32, {kCount}), vout(out, DType::kF32, {kCount});
            const ops::AllReduceOptions opt{.algo = ops::AllReduceAlgo::kOneShot};
            ops::all_reduce(w, vin, vout, s, opt);  // warm-up: its events go to a file of their own
            w.sync_and_check(s);
            write_trace(w, (dir / "warmup.json").string());
            ops::all_reduce(w, vin, vout, s, opt);
            w.sync_and_check(s);
            write_trace(w, path.string());
            WEFT_CUDA_CHECK(cudaMemcpyAsync(host.data(), out, kCount * sizeof(float), cudaMemcpyDeviceToHost, s));
            WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
            for (int64_t i = 0; i < kCount; ++i) {
                if (host[static_cast<size_t>(i)] != static_cast<float>(3 * (i % 7))) {
                    f.add("rank " + std::to_string(w.rank()) + ": out[" + std::to_string(i) + "] = " +
                          std::to_string(host[static_cast<size_t>(i)]));
                    break;
                }
            }
            cudaFree(out);
            cudaFree(in);
            WEFT_CUDA_CHECK(cudaStreamDestroy(s));
        },
        test::test_options(192ull << 20));  // the collective workspace: 3 staging regions of 32 MiB
    f.report();
    expect_trace_ok(dir.path(), "all_reduce", path);
}

// A rank that never joins the gather of a trace does not cost the others' events: rank 0's write_trace fails after
// the World's timeout, naming the gather, and the file holds rank 0's events (a process, its tracks) all the same.
TEST(TraceCollectives, ARankThatDoesNotJoinTheGatherLeavesRankZerosEventsWritten) {
    if (!have_python()) GTEST_SKIP() << "SKIPPED: python3 with its json module reads the trace";
    testing::TempDir dir("weft_trace_partial");
    const fs::path path = dir / "partial.json";
    const testing::ScopedEnv trace("WEFT_TRACE", (dir / "at_exit.json").string());
    constexpr int64_t kCount = 1 << 16;
    std::string rank0_error;
    WorldOptions options = test::test_options(192ull << 20);
    options.timeout = std::chrono::milliseconds(3000);
    test::run_ranks(
        2,
        [&](World& w) {
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            void* buf = nullptr;
            WEFT_CUDA_CHECK(cudaMalloc(&buf, 2 * kCount * sizeof(float)));
            WEFT_CUDA_CHECK(cudaMemsetAsync(buf, 0, 2 * kCount * sizeof(float), s));
            const TensorView vin(buf, DType::kF32, {kCount});
            const TensorView vout(static_cast<float*>(buf) + kCount, DType::kF32, {kCount});
            ops::all_reduce(w, vin, vout, s, ops::AllReduceOptions{.algo = ops::AllReduceAlgo::kOneShot});
            w.sync_and_check(s);
            if (w.rank() == 0) {
                try {
                    write_trace(w, path.string());
                } catch (const Error& e) {
                    rank0_error = e.what();
                }
            } else {
                std::this_thread::sleep_for(w.timeout() + std::chrono::seconds(2));  // past rank 0's gather
            }
            cudaFree(buf);
            WEFT_CUDA_CHECK(cudaStreamDestroy(s));
        },
        options);
    EXPECT_NE(rank0_error.find("rank 1 did not send"), std::string::npos)
        << "rank 0's write did not fail naming rank 1: " << rank0_error;
    ASSERT_TRUE(fs::exists(path)) << "rank 0 wrote no trace";
    const std::string json = testing::read_text_file(path);
    EXPECT_NE(json.find("\"rank 0"), std::string::npos) << "rank 0's process is not in the trace";
    EXPECT_EQ(json.find("\"rank 1"), std::string::npos) << "rank 1 sent nothing, yet it is in the trace";
}

// The write at shutdown keeps a trace the program wrote to WEFT_TRACE's own file (however the path is spelt, and with
// writes to other paths after it): nothing recorded since, no write; events recorded since go beside it ("t.json" ->
// "t.at_exit.json").
TEST(TraceCollectives, TheWriteAtShutdownKeepsATraceWrittenToItsPath) {
    testing::TempDir dir("weft_trace_shutdown");
    const fs::path path = dir / "t.json";
    const fs::path beside = dir / "t.at_exit.json";
    const testing::ScopedEnv trace("WEFT_TRACE", path.string());
    constexpr int64_t kCount = 1 << 16;
    const fs::path spelt = dir / "." / "t.json";  // the same file, another path
    for (const bool more_after : {false, true}) {
        std::error_code ignored;
        fs::remove(path, ignored);
        fs::remove(beside, ignored);
        test::run_ranks(
            2,
            [&](World& w) {
                cudaStream_t s = nullptr;
                WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
                void* buf = nullptr;
                WEFT_CUDA_CHECK(cudaMalloc(&buf, 2 * kCount * sizeof(float)));
                WEFT_CUDA_CHECK(cudaMemsetAsync(buf, 0, 2 * kCount * sizeof(float), s));
                const TensorView vin(buf, DType::kF32, {kCount});
                const TensorView vout(static_cast<float*>(buf) + kCount, DType::kF32, {kCount});
                const ops::AllReduceOptions opt{.algo = ops::AllReduceAlgo::kOneShot};
                ops::all_reduce(w, vin, vout, s, opt);
                w.sync_and_check(s);
                write_trace(w, spelt.string());
                if (more_after) {
                    ops::all_reduce(w, vin, vout, s, opt);
                    w.sync_and_check(s);
                    write_trace(w, (dir / "other.json").string());  // a later write elsewhere keeps t.json kept
                    ops::all_reduce(w, vin, vout, s, opt);
                    w.sync_and_check(s);
                }
                cudaFree(buf);
                WEFT_CUDA_CHECK(cudaStreamDestroy(s));
            },
            test::test_options(192ull << 20));
        ASSERT_TRUE(fs::exists(path)) << "no trace at " << path.string();
        const std::string json = testing::read_text_file(path);
        EXPECT_NE(json.find("\"rank 1"), std::string::npos)
            << "the written trace was replaced: " << json.size() << " bytes";
        EXPECT_NE(json.find("\"ph\":\"X\""), std::string::npos) << "the written trace lost its events";
        EXPECT_EQ(fs::exists(beside), more_after) << "more_after = " << more_after;
        if (more_after && fs::exists(beside)) {
            EXPECT_NE(testing::read_text_file(beside).find("\"ph\":\"X\""), std::string::npos)
                << "the events after the write are not in " << beside.string();
        }
    }
}

TEST(TraceCollectives, CopyEngineAllGatherCopiesAreTimedAndPrecedeThePeersExitWaits) {
    if (!have_python()) GTEST_SKIP() << "SKIPPED: python3 with its json module reads the trace";
    testing::TempDir dir("weft_trace_all_gather");
    const fs::path path = dir / "all_gather.json";
    const testing::ScopedEnv trace("WEFT_TRACE", (dir / "at_exit.json").string());
    constexpr uint64_t kShard = 1 << 20;  // bytes per rank
    test::run_ranks(
        2,
        [&](World& w) {
            ASSERT_TRUE(tracing(w));
            cudaStream_t s = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            void* in = nullptr;
            void* out = nullptr;
            WEFT_CUDA_CHECK(cudaMalloc(&in, kShard));
            WEFT_CUDA_CHECK(cudaMalloc(&out, 2 * kShard));
            WEFT_CUDA_CHECK(cudaMemsetAsync(in, w.rank() + 1, kShard, s));
            const TensorView vin(in, DType::kU8, {static_cast<int64_t>(kShard)});
            const TensorView vout(out, DType::kU8, {static_cast<int64_t>(2 * kShard)});
            const ops::AllGatherOptions opt{.algo = ops::AllGatherAlgo::kCopyEnginePull};
            ops::all_gather(w, vin, vout, s, opt);  // warm-up: its events go to a file of their own
            w.sync_and_check(s);
            write_trace(w, (dir / "warmup.json").string());
            ops::all_gather(w, vin, vout, s, opt);
            w.sync_and_check(s);
            write_trace(w, path.string());
            cudaFree(out);
            cudaFree(in);
            WEFT_CUDA_CHECK(cudaStreamDestroy(s));
        },
        test::test_options(192ull << 20));  // the collective workspace: 3 staging regions of 32 MiB
    expect_trace_ok(dir.path(), "all_gather_ce", path);
}

TEST(TraceEp, DispatchReceivesFollowTheSendsAndCombineFollowsItsWaits) {
    if (!have_python()) GTEST_SKIP() << "SKIPPED: python3 with its json module reads the trace";
    testing::TempDir dir("weft_trace_ep");
    const testing::ScopedEnv trace("WEFT_TRACE", (dir / "at_exit.json").string());
    ops::ep::Config c;
    c.num_experts = 8;  // 4 per rank
    c.hidden = 256;
    c.topk = 2;
    c.max_tokens_per_rank = 64;
    c.low_latency = false;
    constexpr int kTokens = 64;
    WorldOptions wo = test::test_options();
    wo.heap_bytes = std::max<uint64_t>(64ull << 20, ops::ep::footprint(c, 2).heap_bytes(1) + (16ull << 20));
    tp_test::Failures f;
    test::run_ranks(
        2,
        [&](World& w) {
            ASSERT_TRUE(tracing(w));
            test::ep::RankStream rs;
            ops::ep::Buffer ep(w, c);
            ops::ep::NormalHandle h = ep.make_normal_handle();
            // Token t goes to experts t % 4 (rank 0) and 4 + (t + 1) % 4 (rank 1): every rank sends to both ranks.
            std::vector<int32_t> idx(static_cast<size_t>(kTokens) * 2);
            std::vector<float> weights(idx.size(), 0.5f);
            for (int t = 0; t < kTokens; ++t) {
                idx[static_cast<size_t>(t) * 2] = t % 4;
                idx[static_cast<size_t>(t) * 2 + 1] = 4 + (t + 1) % 4;
            }
            const std::vector<uint16_t> rows = test::ep::payload_rows(w.rank(), kTokens, c.hidden, 7, false);
            test::ep::DeviceArray<uint16_t> x(rows.size(), rs.s);
            test::ep::DeviceArray<int32_t> di(idx.size(), rs.s);
            test::ep::DeviceArray<float> dw(weights.size(), rs.s);
            test::ep::DeviceArray<uint16_t> out(rows.size(), rs.s);
            x.upload(rows);
            di.upload(idx);
            dw.upload(weights);
            const TensorView vx(x.get(), DType::kBF16, {kTokens, c.hidden});
            const TensorView vi(di.get(), DType::kI32, {kTokens, 2});
            const TensorView vw(dw.get(), DType::kF32, {kTokens, 2});
            const TensorView vo(out.get(), DType::kBF16, {kTokens, c.hidden});
            const ops::ep::NormalOptions opt{.num_sms = std::min(2, w.sm_budget())};  // several blocks
            // Warm-up: the first calls load the kernels; their events go to a file of their own.
            ep.dispatch(h, vx, vi, vw, rs.s, opt);
            ep.combine(h, h.recv_x(), vo, rs.s, opt);
            ep.sync_and_check(rs.s);
            write_trace(w, (dir / "warmup.json").string());
            ep.dispatch(h, vx, vi, vw, rs.s, opt);
            ep.sync_and_check(rs.s);
            write_trace(w, (dir / "dispatch.json").string());
            ep.combine(h, h.recv_x(), vo, rs.s, opt);
            ep.sync_and_check(rs.s);
            write_trace(w, (dir / "combine.json").string());
            if (w.rank() == 0 && !fs::exists(dir / "combine.json")) f.add("rank 0 wrote no trace");
        },
        wo);
    f.report();
    expect_trace_ok(dir.path(), "dispatch", dir / "dispatch.json");
    expect_trace_ok(dir.path(), "combine", dir / "combine.json");
}

TEST(TraceEp, LowLatencyEventsKeptUntilTheKernelsEndReadAsTheyHappened) {
    if (!have_python()) GTEST_SKIP() << "SKIPPED: python3 with its json module reads the trace";
    testing::TempDir dir("weft_trace_ep_ll");
    const testing::ScopedEnv trace("WEFT_TRACE", (dir / "at_exit.json").string());
    ops::ep::Config c;
    c.num_experts = 8;  // 4 per rank
    c.hidden = 256;
    c.topk = 2;
    c.max_tokens_per_rank = 64;
    c.normal = false;
    c.low_latency = true;
    constexpr int kTokens = 64;
    WorldOptions wo = test::test_options();
    wo.heap_bytes = std::max<uint64_t>(64ull << 20, ops::ep::footprint(c, 2).heap_bytes(0) + (16ull << 20));
    tp_test::Failures f;
    // Events each rank's launch recorded (trace_event_count), against those in the file.
    std::vector<uint64_t> dispatch_events(2, 0), combine_events(2, 0);
    test::run_ranks(
        2,
        [&](World& w) {
            ASSERT_TRUE(tracing(w));
            test::ep::RankStream rs;
            ops::ep::Buffer ep(w, c);
            ops::ep::LowLatencyHandle h = ep.make_low_latency_handle();
            // Token t goes to experts t % 4 (rank 0) and 4 + (t + 1) % 4 (rank 1): every rank sends to both ranks.
            std::vector<int32_t> idx(static_cast<size_t>(kTokens) * 2);
            std::vector<float> weights(idx.size(), 0.5f);
            for (int t = 0; t < kTokens; ++t) {
                idx[static_cast<size_t>(t) * 2] = t % 4;
                idx[static_cast<size_t>(t) * 2 + 1] = 4 + (t + 1) % 4;
            }
            const std::vector<uint16_t> rows = test::ep::payload_rows(w.rank(), kTokens, c.hidden, 7, false);
            test::ep::DeviceArray<uint16_t> x(rows.size(), rs.s);
            test::ep::DeviceArray<int32_t> di(idx.size(), rs.s);
            test::ep::DeviceArray<float> dw(weights.size(), rs.s);
            test::ep::DeviceArray<uint16_t> out(rows.size(), rs.s);
            x.upload(rows);
            di.upload(idx);
            dw.upload(weights);
            const TensorView vx(x.get(), DType::kBF16, {kTokens, c.hidden});
            const TensorView vi(di.get(), DType::kI32, {kTokens, 2});
            const TensorView vw(dw.get(), DType::kF32, {kTokens, 2});
            const TensorView vo(out.get(), DType::kBF16, {kTokens, c.hidden});
            const ops::ep::LowLatencyOptions opt{.num_sms = std::min(2, w.sm_budget())};  // several blocks
            // Three calls: the third send waits for a credit (call > 2), so its waits name both ranks.
            for (int i = 0; i < 2; ++i) {
                ep.low_latency_dispatch(h, vx, vi, rs.s, opt);
                ep.low_latency_combine(h, h.recv_x(), vi, vw, vo, rs.s, opt);
            }
            ep.sync_and_check(rs.s);
            write_trace(w, (dir / "warmup.json").string());
            ep.low_latency_dispatch(h, vx, vi, rs.s, opt);
            ep.sync_and_check(rs.s);
            w.barrier();
            dispatch_events[static_cast<size_t>(w.rank())] = trace_event_count(w);
            w.barrier();
            write_trace(w, (dir / "ll_dispatch.json").string());
            ep.low_latency_combine(h, h.recv_x(), vi, vw, vo, rs.s, opt);
            ep.sync_and_check(rs.s);
            w.barrier();
            combine_events[static_cast<size_t>(w.rank())] = trace_event_count(w);
            w.barrier();
            write_trace(w, (dir / "ll_combine.json").string());
            if (w.rank() == 0 && !fs::exists(dir / "ll_combine.json")) f.add("rank 0 wrote no trace");
        },
        wo);
    f.report();
    const auto both = [](const std::vector<uint64_t>& n) { return std::to_string(n[0]) + "," + std::to_string(n[1]); };
    expect_trace_ok(dir.path(), "ll_dispatch", dir / "ll_dispatch.json", both(dispatch_events));
    expect_trace_ok(dir.path(), "ll_combine", dir / "ll_combine.json", both(combine_events));
}

}  // namespace
}  // namespace weft
