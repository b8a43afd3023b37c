// SPDX-License-Identifier: MIT
// GPU tests of the public fused-GEMM interface (weft::ops::FusedGemm) with ranks as threads sharing the visible GPUs:
// examples/10_custom_fused_gemm's chain (rank r's GEMM stores its tiles into rank r+1's input and signals them; rank
// r+1's scheduler waits per row of tiles) on world sizes 1-4, cooperative and ping-pong configs, ragged M and K,
// poisoned inputs, fresh data and no reset between calls, each rank's GEMM against an fp64 reference; and the
// host-side checks of prepare() and launch().
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "support/runtime_checks.hpp"
#include "tp_test_util.hpp"
#include "weft/common/gemm_hook_params.hpp"
#include "weft/jit/paths.hpp"
#include "weft/ops/fused_gemm.hpp"
#include "weft/weft.hpp"

// The example's parameter structs (one definition for the host and the kernel).
#include "../../examples/10_custom_fused_gemm/device/chain_params.hpp"

namespace weft {
namespace {

using namespace tp_test;
namespace fs = std::filesystem;

fs::path example_device_dir() {
    return jit::find_include_roots().weft_include.parent_path() / "examples" / "10_custom_fused_gemm" / "device";
}

struct ChainCase {
    int64_t m, k;
    std::optional<GemmConfig> config = std::nullopt;  // default: fused_gemm_config on the shared budget
};

/// `calls` calls of the chain; every rank checks its own GEMM (X as it arrived, times its W) after each.
void run_chain(World& w, const ChainCase& cs, int calls, uint64_t base, std::vector<HostMat>& xs, Failures& f) {
    const int nr = w.num_ranks(), me = w.rank();
    const DType dt = DType::kBF16;
    const int64_t m = cs.m, k = cs.k, ld = k;  // k % 8 == 0: rows of 16-byte multiples, no padding
    std::ostringstream id;
    id << "chain W=" << nr << " m " << m << " k " << k;
    if (cs.config) id << " " << ops::detail::config_text(*cs.config);
    id << " seed " << base << " rank " << me;
    const std::string what = id.str();
    const GemmConfig cfg =
        cs.config ? *cs.config : ops::fused_gemm_config({.m = m, .n = k, .k = k}, w.shared_sm_budget());
    const ops::FusedGemm gemm(w, {.header = "chain_gemm.cuh", .scheduler = "example::WaitForRows",
                                  .hook = "example::NotifyNextRank", .include_root = example_device_dir()}, cfg);
    const GemmTileGrid tiles(cfg, static_cast<int32_t>(m), static_cast<int32_t>(k));
    auto* x = static_cast<uint16_t*>(w.heap().alloc(static_cast<uint64_t>(m * ld * 2)));
    uint64_t* rows_ready = w.heap().alloc_signals(static_cast<uint64_t>(tiles.num_m_tiles));
    HostMat wt(k, k, ld, dt), y(m, k, ld, dt);
    DevBuf wt_dev(wt.bytes()), y_dev(y.bytes());
    cudaStream_t st = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    uint16_t* d = me + 1 < nr ? w.heap().symm_at(x, me + 1) : static_cast<uint16_t*>(y_dev.ptr);
    const ops::FusedGemmCall call = gemm.prepare(TensorView(x, dt, {m, k}, {ld, 1}), view(wt, wt_dev.ptr),
                                                 TensorView(d, dt, {m, k}, {ld, 1}));
    for (int c = 1; c <= calls; ++c) {
        const std::string at = what + " call " + std::to_string(c);
        wt.fill_random(seed_of(base, 1, me, c));
        upload(wt, wt_dev.ptr, st);
        HostMat x0(m, k, ld, dt);
        if (me == 0) {
            x0.fill_random(seed_of(base, 0, 0, c));
            upload(x0, x, st);
        } else {
            WEFT_CUDA_CHECK(cudaMemsetAsync(x, 0xff, static_cast<size_t>(m * ld * 2), st));  // NaN: early reads show
        }
        poison(y);
        upload(y, y_dev.ptr, st);
        w.sync_and_check(st);
        w.barrier();
        gemm.launch(call,
                    example::ChainWait{w.device_ctx(), rows_ready,
                                       static_cast<uint64_t>(c) * static_cast<uint64_t>(tiles.num_n_tiles), me > 0},
                    example::ChainNotify{w.device_ctx(), rows_ready, me + 1 < nr ? me + 1 : -1}, st);
        w.sync_and_check(st);
        // Every rank's input as it arrived (rank r+1's X is rank r's output): downloaded by its owner.
        xs[static_cast<size_t>(me)] = HostMat(m, k, ld, dt);
        download(xs[static_cast<size_t>(me)], x, st);
        if (me + 1 == nr) download(y, y_dev.ptr, st);
        w.barrier();
        const HostMat& got = me + 1 < nr ? xs[static_cast<size_t>(me) + 1] : y;
        const std::vector<int64_t> rows = rows_to_check(m, m, static_cast<double>(k * k), seed_of(base, 2, me, c));
        Reference ref(static_cast<int64_t>(rows.size()), k);
        ref.add(xs[static_cast<size_t>(me)], 0, rows, wt);
        const std::string bad = compare(got, rows, ref, ErrorModel::gemm(dt));
        if (!bad.empty()) f.add(at + ": " + bad);
        if (me == 0 && !std::equal(x0.bits.begin(), x0.bits.end(), xs[0].bits.begin())) f.add(at + ": X_0 changed");
        w.barrier();  // nobody reads xs before the next call's downloads
    }
    WEFT_CUDA_CHECK(cudaStreamDestroy(st));
    w.heap().free(rows_ready);
    w.heap().free(x);
}

void run_world(int num_ranks, const std::vector<ChainCase>& cases, int calls) {
    const uint64_t base = fresh_seed();
    Failures f;
    std::vector<HostMat> xs(static_cast<size_t>(num_ranks));
    test::run_ranks(
        num_ranks,
        [&](World& w) {
            for (const ChainCase& c : cases) run_chain(w, c, calls, base, xs, f);
        },
        test::test_options(64ull << 20));
    f.report();
}

std::vector<ChainCase> chain_cases() {
    auto fused = [](int index) {
        GemmConfig c = gemm_candidate(index, DType::kBF16, DType::kBF16, BLayout::kNK);
        c.cluster_m = c.cluster_n = 1;
        return c;
    };
    return {
        {300, 136},             // ragged rows and columns; the heuristic's config
        {512, 384, fused(0)},   // 128x256 cooperative: whole rows of tiles signalled one tile late
        {256, 512, fused(9)},   // 128x192 ping-pong: each consumer warpgroup signals its own tiles
        {200, 256, fused(12)},  // 64x128 ping-pong
    };
}

TEST(TpFusedGemm, ChainWorldSize1) { run_world(1, chain_cases(), 2); }
TEST(TpFusedGemm, ChainWorldSize2) { run_world(2, chain_cases(), 3); }
TEST(TpFusedGemm, ChainWorldSize3) { run_world(3, chain_cases(), 3); }
TEST(TpFusedGemm, ChainWorldSize4) { run_world(4, chain_cases(), 3); }

// prepare() names what is wrong with a view; launch() refuses Params of the wrong size before anything runs.
TEST(TpFusedGemm, PrepareAndLaunchCheckTheirArguments) {
    Failures f;
    test::run_ranks(1, [&](World& w) {
        DevBuf buf(1 << 20);
        const GemmConfig cfg = ops::fused_gemm_config({.m = 128, .n = 64, .k = 64}, w.sm_budget());
        const ops::FusedGemm fused(w, ops::plain_gemm_fused_spec(), cfg);
        auto* base = static_cast<char*>(buf.ptr);
        const TensorView a(base, DType::kBF16, {128, 64}), b(base + 65536, DType::kBF16, {64, 64});
        const TensorView d(base + 131072, DType::kBF16, {128, 64});
        const auto expect = [&](const std::function<void()>& fn, const std::string& needle) {
            try {
                fn();
                f.add("no error; expected one mentioning \"" + needle + "\"");
            } catch (const Error& e) {
                if (std::string(e.what()).find(needle) == std::string::npos) f.add(e.what());
            }
        };
        expect([&] { fused.prepare(a, b, TensorView(base + 131080, DType::kBF16, {128, 64})); },
               "plain_gemm: gemm: d's base address must be 16-byte aligned");
        expect([&] { fused.prepare(a, b, TensorView(base + 131072, DType::kF32, {128, 64})); }, "the config's dtypes");
        const TensorView empty(base, DType::kBF16, {0, 64});
        expect([&] { fused.prepare(empty, b, empty); }, "at least one row");
        expect([&] { fused.prepare(a, b, d, -1); }, "max_ctas");
        const ops::FusedGemmCall call = fused.prepare(a, b, d);
        expect([&] { fused.launch(call, uint64_t{0}, gemm::NoEpilogueHookParams{}, nullptr); },
               "argument 4 has 8 bytes");
        // A call whose tensor maps were made for another config's tiles, or never made, is refused.
        expect(
            [&] {
                fused.launch(ops::FusedGemmCall{}, gemm::PersistentSchedulerParams{}, gemm::NoEpilogueHookParams{},
                             nullptr);
            },
            "not made by FusedGemm::prepare");
        GemmConfig other = cfg;
        other.tile_n = cfg.tile_n == 128 ? 64 : 128;
        if (!is_valid(other)) {
            f.add("the other config is not valid");
        } else {
            const ops::FusedGemm fused_other(w, ops::plain_gemm_fused_spec(), other);
            expect(
                [&] {
                    fused.launch(fused_other.prepare(a, b, d), gemm::PersistentSchedulerParams{},
                                 gemm::NoEpilogueHookParams{}, nullptr);
                },
                "prepare it with the FusedGemm that launches it");
        }
        cudaStream_t st = nullptr;
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        fused.launch(call, gemm::PersistentSchedulerParams{}, gemm::NoEpilogueHookParams{}, st);  // the right ones run
        w.sync_and_check(st);
        WEFT_CUDA_CHECK(cudaStreamDestroy(st));
    });
    f.report();
}

}  // namespace
}  // namespace weft
