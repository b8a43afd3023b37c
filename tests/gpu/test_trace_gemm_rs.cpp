// SPDX-License-Identifier: MIT
// GPU test of the intra-kernel trace on GEMM+ReduceScatter at world 2 (ranks as threads), in both modes. Push: every
// own tile's "wait chunk" ends before its "reduce" (the peers' partials added in the epilogue) begins, both inside
// the tile's event on the same consumer track, and after the peer's tile of the same (m, n) ended. Pull: every
// "reduce" of the reduction kernel follows a "wait chunk" of its block for the same chunk and source.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "support/jit_testing.hpp"
#include "support/runtime_checks.hpp"
#include "tp_test_util.hpp"
#include "trace_check.hpp"
#include "weft/ops/gemm_rs.hpp"
#include "weft/runtime/trace.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

namespace fs = std::filesystem;
using namespace tp_test;

// Reads a trace with Python's json module and checks its order; prints "ok <tiles> <waits> <reduces>" or the first
// violations. Within a block the raw %globaltimer stamps compare; across ranks only when they share one GPU (one
// timer; ranks on two GPUs have two, not aligned between threads of one host), with a tolerance.
constexpr const char* kCheckScript = R"PY(
import json, sys
d = json.load(open(sys.argv[1]))
mode = sys.argv[2]
cross = sys.argv[3] == 'cross'  # ranks on one GPU: one %globaltimer, so their stamps compare across ranks
track = {(e['pid'], e['tid']): e['args']['name'] for e in d['traceEvents'] if e['ph'] == 'M' and e['name'] == 'thread_name'}
ev = [e for e in d['traceEvents'] if e['ph'] == 'X']
ranks = sorted({e['pid'] for e in d['traceEvents'] if e['ph'] == 'M' and e['name'] == 'process_name'})
tol = 50.0  # us
bad = []
counts = [0, 0, 0]
def on(e, role): return role in track[(e['pid'], e['tid'])]
def a(e): return e['args']['args']
def same_block(x, y): return x['args']['block'] == y['args']['block'] and x['tid'] == y['tid']
for r in ranks:
    mine = [e for e in ev if e['pid'] == r]
    tiles = [e for e in mine if e['name'].startswith('tile (')]
    waits = [e for e in mine if e['name'].startswith('wait chunk')]
    reduces = [e for e in mine if e['name'] == 'reduce']
    counts[0] += len(tiles); counts[1] += len(waits); counts[2] += len(reduces)
    if not tiles or not reduces: bad.append('rank %d: %d tiles, %d reduces' % (r, len(tiles), len(reduces)))
    if mode == 'push':
        if any(not on(e, 'consumer') for e in waits + reduces): bad.append('rank %d: a wait or reduce off the consumer tracks' % r)
        if 2 * len(reduces) != len(tiles): bad.append('rank %d: %d reduces for %d tiles (own tiles: half)' % (r, len(reduces), len(tiles)))
        for x in reduces:
            m, n = a(x)[2], a(x)[3]
            w = [y for y in waits if same_block(x, y) and a(y)[2:] == [m, n] and y['args']['end_ns'] <= x['args']['begin_ns']]
            t = [y for y in tiles if same_block(x, y) and a(y)[:2] == [m, n] and y['args']['begin_ns'] <= x['args']['begin_ns']
                 and y['args']['end_ns'] >= x['args']['end_ns']]
            if len(w) != 1: bad.append('rank %d: reduce of tile (%d, %d): %d waits before it' % (r, m, n, len(w)))
            if len(t) != 1: bad.append('rank %d: reduce of tile (%d, %d) not inside its tile' % (r, m, n))
            if w and cross:
                peer = [y for y in ev if y['pid'] != r and y['name'] == 'tile (%d, %d)' % (m, n)]
                if {y['pid'] for y in peer} != set(ranks) - {r}: bad.append('rank %d: tile (%d, %d) missing on a peer' % (r, m, n))
                for y in peer:
                    if y['ts'] + y['dur'] > w[0]['ts'] + w[0]['dur'] + tol:
                        bad.append('rank %d: wait for tile (%d, %d) ended before rank %d stored it' % (r, m, n, y['pid']))
    else:
        if any(not on(e, 'comm') for e in reduces): bad.append('rank %d: a reduce off the comm tracks' % r)
        for x in reduces:
            sig, source = a(x)[0], a(x)[1]
            w = [y for y in waits if same_block(x, y) and a(y)[0] == sig and a(y)[3] == source
                 and y['args']['end_ns'] <= x['args']['begin_ns']]
            if not w: bad.append('rank %d: reduce of chunk %d from %d on block %d: no wait before it' % (r, sig, source, x['args']['block']))
        if {a(x)[1] for x in reduces} != set(ranks): bad.append('rank %d: reduces from sources %s' % (r, sorted({a(x)[1] for x in reduces})))
if len(ranks) != 2: bad.append('%d processes, expected 2' % len(ranks))
print('\n'.join(bad[:20]) if bad else 'ok %d %d %d' % tuple(counts))
)PY";

void check_trace(const fs::path& dir, const fs::path& trace, const char* mode) {
    int devices = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&devices));  // two ranks share a GPU only when there is one
    test::expect_trace_check_ok(dir, kCheckScript, trace.string() + " " + mode + (devices == 1 ? " cross" : " own"),
                                mode);
}

TEST(TraceGemmRs, WaitsPrecedeTheirReductionsInBothModes) {
    if (std::system("python3 -c 'import json' >/dev/null 2>&1") != 0) {
        GTEST_SKIP() << "SKIPPED: python3 with its json module reads the trace";
    }
    testing::TempDir dir("weft_trace_gpu");
    const testing::ScopedEnv trace("WEFT_TRACE", (dir / "at_exit.json").string());
    constexpr int64_t kRows = 256, kN = 512, kK = 256;
    const std::pair<ops::GemmRsMode, const char*> modes[] = {{ops::GemmRsMode::kPush, "push"},
                                                             {ops::GemmRsMode::kPull, "pull"}};
    Failures f;
    test::run_ranks(
        2,
        [&](World& w) {
            ASSERT_TRUE(tracing(w));
            ops::GemmRsShape shape;
            shape.max_m = kRows * w.num_ranks();
            shape.n = kN;
            shape.k = kK;
            shape.dtype = DType::kBF16;
            HostMat a(shape.max_m, kK, kK, DType::kBF16), b(kN, kK, kK, DType::kBF16);
            a.fill_random(seed_of(2, 0, w.rank(), 0));
            b.fill_random(seed_of(2, 1, w.rank(), 0));
            DevBuf da(a.bytes()), db(b.bytes()), dc(static_cast<size_t>(kRows * kN * 2));
            cudaStream_t st = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
            upload(a, da.ptr, st);
            upload(b, db.ptr, st);
            const TensorView c(dc.ptr, DType::kBF16, {kRows, kN});
            for (const auto& [mode, name] : modes) {
                ops::GemmRsOptions opt;
                opt.mode = mode;
                opt.push_on_shared_gpus = true;  // the trace's ranks share one GPU
                opt.chunk_rows = 128;  // 2 chunks per rank
                ops::GemmRs op(w, shape, opt);
                op.run(view(a, da.ptr), view(b, db.ptr), c, st);  // warm-up: its events go to a file of its own
                WEFT_CUDA_CHECK(cudaStreamSynchronize(st));
                write_trace(w, (dir / (std::string(name) + "_warmup.json")).string());
                op.run(view(a, da.ptr), view(b, db.ptr), c, st);
                WEFT_CUDA_CHECK(cudaStreamSynchronize(st));
                const fs::path path = dir / (std::string(name) + ".json");
                write_trace(w, path.string());
                if (w.rank() == 0 && !fs::exists(path)) f.add(std::string("rank 0 wrote no ") + name + " trace");
            }
            WEFT_CUDA_CHECK(cudaStreamDestroy(st));
        },
        test::test_options(256ull << 20));
    f.report();
    for (const auto& [mode, name] : modes) check_trace(dir.path(), dir / (std::string(name) + ".json"), name);
}

}  // namespace
}  // namespace weft
