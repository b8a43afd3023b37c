// SPDX-License-Identifier: MIT
// GPU test of the intra-kernel trace on AllGather+GEMM at world 2 (ranks as threads): a traced call yields a trace
// in which every tile's chunk wait ends before the tile's compute begins (same CTA) and every chunk's copy lands
// before a wait that needs it ends; a process per rank, tiles and copies on both.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "support/jit_testing.hpp"
#include "support/runtime_checks.hpp"
#include "tp_test_util.hpp"
#include "trace_check.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/runtime/trace.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

namespace fs = std::filesystem;
using namespace tp_test;

// Reads a trace with Python's json module and checks its order; prints "ok <tiles> <waits> <copies>" or the first
// violations. A copy's end comes from CUDA events mapped onto %globaltimer (microseconds of error): a tolerance.
constexpr const char* kCheckScript = R"PY(
import json, sys
d = json.load(open(sys.argv[1]))
ev = [e for e in d['traceEvents'] if e['ph'] == 'X']
ranks = sorted({e['pid'] for e in d['traceEvents'] if e['ph'] == 'M' and e['name'] == 'process_name'})
tol = 50_000  # ns
bad = []
counts = [0, 0, 0]
for r in ranks:
    mine = [e for e in ev if e['pid'] == r]
    waits = [e for e in mine if e['name'].startswith('wait chunk')]
    tiles = [e for e in mine if e['name'].startswith('tile (')]
    copies = [e for e in mine if e['name'].startswith('copy chunk')]
    counts[0] += len(tiles); counts[1] += len(waits); counts[2] += len(copies)
    if not tiles or not waits: bad.append('rank %d: %d tiles, %d waits' % (r, len(tiles), len(waits)))
    if len(ranks) > 1 and not copies: bad.append('rank %d: no copy' % r)
    for t in tiles:
        a = t['args']
        m, n = a['args'][0], a['args'][1]
        ok = [w for w in waits if w['args']['block'] == a['block'] and w['args']['args'][2] == m
              and w['args']['args'][3] == n and w['args']['end_ns'] <= a['begin_ns']]
        if not ok:
            bad.append('rank %d: tile (%d, %d) on block %d: no wait ended before it' % (r, m, n, a['block']))
    for w in waits:
        first, last = w['args']['args'][0], w['args']['args'][1]
        for c in copies:
            if first <= c['args']['args'][0] <= last and c['args']['end_ns'] > w['args']['end_ns'] + tol:
                bad.append('rank %d: copy of chunk %d ended %d ns after a wait for it ended' %
                           (r, c['args']['args'][0], c['args']['end_ns'] - w['args']['end_ns']))
if len(ranks) != 2: bad.append('%d processes, expected 2' % len(ranks))
print('\n'.join(bad[:20]) if bad else 'ok %d %d %d' % tuple(counts))
)PY";

TEST(TraceAgGemm, WaitsPrecedeTilesAndCopiesPrecedeTheWaitsThatNeedThem) {
    if (std::system("python3 -c 'import json' >/dev/null 2>&1") != 0) {
        GTEST_SKIP() << "SKIPPED: python3 with its json module reads the trace";
    }
    testing::TempDir dir("weft_trace_gpu");
    const fs::path path = dir / "ag_gemm.json";
    const testing::ScopedEnv trace("WEFT_TRACE", (dir / "at_exit.json").string());
    constexpr int64_t kRows = 512, kN = 512, kK = 256;
    Failures f;
    test::run_ranks(
        2,
        [&](World& w) {
            ASSERT_TRUE(tracing(w));
            ops::AgGemmShape shape;
            shape.max_m = kRows * w.num_ranks();
            shape.n = kN;
            shape.k = kK;
            shape.dtype = DType::kBF16;
            ops::AgGemmOptions opt;
            opt.chunk_rows = 128;  // 4 chunks per rank: waits on several chunks
            HostMat a(kRows, kK, kK, DType::kBF16), b(kN, kK, kK, DType::kBF16);
            a.fill_random(seed_of(1, 0, w.rank(), 0));
            b.fill_random(seed_of(1, 1, 0, 0));
            DevBuf da(a.bytes()), db(b.bytes()), dc(static_cast<size_t>(shape.max_m * kN * 2));
            cudaStream_t st = nullptr;
            WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
            upload(a, da.ptr, st);
            upload(b, db.ptr, st);
            const TensorView c(dc.ptr, DType::kBF16, {shape.max_m, kN});
            {
                ops::AgGemm op(w, shape, opt);
                op.run(view(a, da.ptr), view(b, db.ptr), c, st);  // warm-up: its events go to a file of its own
                WEFT_CUDA_CHECK(cudaStreamSynchronize(st));
                write_trace(w, (dir / "warmup.json").string());
                op.run(view(a, da.ptr), view(b, db.ptr), c, st);
                WEFT_CUDA_CHECK(cudaStreamSynchronize(st));
                write_trace(w, path.string());
                if (w.rank() == 0 && !fs::exists(path)) f.add("rank 0 wrote no trace");
            }
            WEFT_CUDA_CHECK(cudaStreamDestroy(st));
        },
        test::test_options(256ull << 20));
    f.report();
    test::expect_trace_check_ok(dir.path(), kCheckScript, path.string(), "ag_gemm");
}

}  // namespace
}  // namespace weft
