// SPDX-License-Identifier: MIT
// Every device header compiles alone under NVRTC for sm_90a, and a kernel using every primitive
// compiles to a CUBIN (so ptxas checks each inline-asm instruction) and emits the PTX the docs promise.
#include <gtest/gtest.h>
#include <nvrtc.h>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#ifndef WEFT_SOURCE_INCLUDE_DIR
#error "WEFT_SOURCE_INCLUDE_DIR must name the source include/ folder (set in tests/CMakeLists.txt)"
#endif
#ifndef WEFT_CUDA_INCLUDE_DIRS
#error "WEFT_CUDA_INCLUDE_DIRS must name the CUDA include folders, '|'-separated (set in tests/CMakeLists.txt)"
#endif

namespace weft {
namespace {

struct NvrtcResult {
    bool ok = false;
    std::string log;
    std::string ptx;
    size_t cubin_bytes = 0;
};

std::vector<std::string> split(const std::string& s, char sep) {
    std::vector<std::string> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, sep)) {
        if (!item.empty()) {
            out.push_back(item);
        }
    }
    return out;
}

// Compiles `source` with NVRTC for sm_90a (CUBIN: ptxas runs) and, when asked, again for compute_90a
// to return the PTX.
NvrtcResult compile(const std::string& source, bool want_ptx, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> options = {"-std=c++20", "-arch=sm_90a", std::string("-I") + WEFT_SOURCE_INCLUDE_DIR};
    for (const std::string& dir : split(WEFT_CUDA_INCLUDE_DIRS, '|')) {
        options.push_back("-I" + dir);
    }
    options.insert(options.end(), extra.begin(), extra.end());
    NvrtcResult result;
    for (int pass = 0; pass < (want_ptx ? 2 : 1); ++pass) {
        if (pass == 1) {
            options[1] = "-arch=compute_90a";
        }
        std::vector<const char*> argv;
        for (const std::string& o : options) {
            argv.push_back(o.c_str());
        }
        nvrtcProgram prog = nullptr;
        EXPECT_EQ(nvrtcCreateProgram(&prog, source.c_str(), "weft_header_check.cu", 0, nullptr, nullptr),
                  NVRTC_SUCCESS);
        const nvrtcResult status = nvrtcCompileProgram(prog, static_cast<int>(argv.size()), argv.data());
        size_t log_size = 0;
        nvrtcGetProgramLogSize(prog, &log_size);
        std::string log(log_size, '\0');
        nvrtcGetProgramLog(prog, log.data());
        result.log += log;
        result.ok = status == NVRTC_SUCCESS;
        if (result.ok && pass == 0) {
            nvrtcGetCUBINSize(prog, &result.cubin_bytes);
        }
        if (result.ok && pass == 1) {
            size_t ptx_size = 0;
            nvrtcGetPTXSize(prog, &ptx_size);
            result.ptx.assign(ptx_size, '\0');
            nvrtcGetPTX(prog, result.ptx.data());
        }
        nvrtcDestroyProgram(&prog);
        if (!result.ok) {
            break;
        }
    }
    return result;
}

// Every header under include/weft/{ptx,device,common} plus the device umbrella: found on disk, so a
// header someone adds later is checked too. (.hpp files under common/ are shared with the host.)
std::vector<std::string> device_headers() {
    namespace fs = std::filesystem;
    const fs::path root = fs::path(WEFT_SOURCE_INCLUDE_DIR);
    std::vector<std::string> headers;
    for (const char* dir : {"weft/ptx", "weft/device", "weft/common"}) {
        if (!fs::exists(root / dir)) {
            continue;
        }
        for (const auto& entry : fs::directory_iterator(root / dir)) {
            const std::string ext = entry.path().extension().string();
            if (ext == ".cuh" || ext == ".hpp") {
                headers.push_back(fs::relative(entry.path(), root).generic_string());
            }
        }
    }
    headers.push_back("weft/device.cuh");
    std::sort(headers.begin(), headers.end());
    return headers;
}

TEST(DeviceHeadersNvrtc, EveryHeaderCompilesAlone) {
    const std::vector<std::string> headers = device_headers();
    ASSERT_GE(headers.size(), 15u) << "device headers not found under " << WEFT_SOURCE_INCLUDE_DIR;
    for (const std::string& h : headers) {
        const NvrtcResult r = compile("#include \"" + h + "\"\n", false);
        EXPECT_TRUE(r.ok) << h << " does not compile alone under NVRTC:\n" << r.log;
    }
}

// A kernel that instantiates every primitive at every group scope.
constexpr const char* kPrimitivesKernel = R"(
#include "weft/device.cuh"
using namespace weft;
using namespace weft::device;
template <class G>
__device__ void exercise(G grp, const DeviceCtx& ctx, uint8_t* buf, uint64_t* sig, uint64_t* psync, uint32_t* w32) {
    const int pe = (ctx.rank + 1) % ctx.num_ranks;
    shmem::putmem(grp, ctx, buf, buf + 1000, 777, pe);
    shmem::putmem_nbi(grp, ctx, buf + 3, buf + 1001, 123, pe);
    shmem::getmem(grp, ctx, buf + 5, buf + 2001, 99, pe);
    shmem::getmem_nbi(grp, ctx, buf + 7, buf + 3001, 1, pe);
    shmem::putmem_signal(grp, ctx, buf, buf + 1000, 64, sig, 1, SignalOp::kAdd, pe);
    shmem::putmem_signal_nbi(grp, ctx, buf, buf + 1000, 64, sig + 1, 5, SignalOp::kSet, pe);
    shmem::signal_op(grp, ctx, sig + 2, 1, SignalOp::kAdd, pe);
    const uint64_t v = shmem::signal_wait_until(grp, ctx, sig, Cmp::kGe, 1);
    shmem::fence(grp, ctx);
    shmem::quiet(grp, ctx);
    shmem::barrier_all(grp, ctx, psync);
    shmem::sync_all(grp, ctx, psync);
    const Token t = tile::wait(grp, ctx, sig, 40, Cmp::kGe, v);
    const Token t2 = tile::wait<ptx::Scope::kGpu, ptx::Sem::kRelaxed>(grp, ctx, sig, 3, Cmp::kEq, v);
    const uint8_t* b = tile::consume_token(buf, t);
    w32[grp.rank()] = b[1] + tile::consume_token(7u, t2) + static_cast<uint32_t>(tile::consume_token(1.5f, t));
    tile::notify(grp, ctx, sig + 3, pe, 1);
    tile::notify<ptx::Scope::kGpu>(grp, ctx, sig + 4, pe, 2, SignalOp::kSet);
    // The forms that return instead of trapping, and waits over signal sets that are not one run.
    const WaitResult r = tile::wait_checked(grp, ctx, sig, 5, Cmp::kGe, v);
    const WaitResult r2 = tile::wait_each_checked<ptx::Scope::kGpu, ptx::Sem::kRelaxed>(
        grp, ctx, 4, [&](int i) { return i == 1 ? nullptr : sig + 2 * i; }, Cmp::kGe, v);
    const Token t3 = tile::wait_each(grp, ctx, 3, [&](int i) { return sig + 3 * i; }, Cmp::kEq, v);
    const Token t4 = tile::wait_each(grp, ctx, 2, [&](int i) { return tile::SignalFrom{sig + i, i}; }, Cmp::kGe, v);
    const bool sent = tile::notify_checked(grp, ctx, sig + 5, pe, 1);
    const tile::PeerSignal peer_word = tile::peer_signal(ctx, sig + 6, pe);
    tile::notify(grp, peer_word, 1);
    tile::notify<ptx::Scope::kGpu>(grp, peer_word, 3, SignalOp::kSet);
    if (const tile::PeerSignal checked_word = tile::peer_signal_checked(ctx, sig + 7, pe)) {
        tile::notify(grp, checked_word, 1);
    }
    w32[grp.rank() + 1] = r.ok() + r2.ok() + sent + tile::consume_token(3u, r.token()) + t3.value() + t4.value() +
                          tile::consume_token(1u, r2.token_or_trap());
    trap_unless(grp.all(r.ok()));
    w32[grp.rank() + 2] = tile::consume_token(2u, r2.token_or_exit());
    exit_unless(grp.all(r2.ok()));
}
template <ptx::Scope C>
__device__ void scoped(uint64_t* p, uint32_t* q, uint4* v) {
    p[1] = ptx::ld<ptx::Sem::kRelaxed, C>(p) + ptx::ld<ptx::Sem::kAcquire, C>(q) + ptx::ld<ptx::Sem::kVolatile, C>(p);
    v[1] = ptx::ld<ptx::Sem::kAcquire, C>(v);
    ptx::st<ptx::Sem::kRelease, C>(p, 3);
    ptx::st<ptx::Sem::kRelaxed, C>(v, make_uint4(1, 2, 3, 4));
    p[2] = ptx::atom_add<ptx::Sem::kAcqRel, C>(p, 1) + ptx::atom_cas<ptx::Sem::kAcquire, C>(q, 1u, 2u) +
           ptx::atom_exch<ptx::Sem::kRelease, C>(p, 9);
    ptx::red_add<ptx::Sem::kRelease, C>(q, 1u);
    ptx::fence<ptx::Sem::kAcqRel, C>();
    ptx::fence<ptx::Sem::kSc, C>();
}
extern "C" __global__ void primitives(DeviceCtx ctx, uint8_t* buf, uint64_t* sig, uint64_t* psync, uint32_t* w32,
                                      uint4* v, const __grid_constant__ ptx::TmaDescriptor map) {
    exercise(Thread{}, ctx, buf, sig, psync, w32);
    exercise(Warp{}, ctx, buf, sig, psync, w32);
    exercise(Warpgroup{1}, ctx, buf, sig, psync, w32);
    exercise(Block{}, ctx, buf, sig, psync, w32);
    // The per-thread bounded calls and the diagnostic record, in both forms.
    const SpinResult s = spin_until_checked<ptx::Sem::kRelaxed, ptx::Scope::kGpu>(
        ctx, sig + 8, Cmp::kNe, 0, SpinSite{SpinKind::kOther, -1, __LINE__});
    w32[4] = static_cast<uint32_t>(s.observed) + s.ok +
             static_cast<uint32_t>(spin_until(ctx, sig + 9, Cmp::kLe, 7, SpinSite{SpinKind::kOther, 0, __LINE__}));
    uint8_t* peer = symm_at_checked(ctx, buf, 1, __LINE__);
    trap_unless(peer != nullptr);
    peer[0] = 1;
    symm_at_or_trap(ctx, buf, 0, __LINE__)[1] = 2;
    if (w32[5] != 0) {
        record_diagnostic(ctx, SpinSite{SpinKind::kOther, -1, __LINE__}, Cmp::kEq, sig, 1, 2, 3);
    }
    w32[6] = write_record_once(w32 + 7, [&] { w32[8] = 9; }) + wait_record_complete(w32 + 7);
    __shared__ alignas(1024) uint8_t tile_smem[4096];
    __shared__ uint64_t tile_bar;
    if (threadIdx.x == 0) {
        const Token t = tile::wait(Thread{}, ctx, sig, 2, Cmp::kGe, 1);
        tile::tma_load_2d(t, ptx::shared_address(tile_smem), &map, ptx::shared_address(&tile_bar), 0, 0);
        tile::tma_load_2d_multicast(Token::assume_local_data(), ptx::shared_address(tile_smem), &map,
                                    ptx::shared_address(&tile_bar), 64, 0, 3);
    }
    scoped<ptx::Scope::kCta>(sig, w32, v);
    scoped<ptx::Scope::kGpu>(sig, w32, v);
    scoped<ptx::Scope::kSys>(sig, w32, v);
    shmem::p(ctx, w32, 5u, 0);
    shmem::p(ctx, sig, 5ull, 0);
    shmem::p(ctx, reinterpret_cast<double*>(sig), 1.0, 0);
    w32[1] = shmem::g(ctx, w32, 0) + static_cast<uint32_t>(shmem::g(ctx, sig, 0)) + shmem::my_pe(ctx) +
             shmem::n_pes(ctx) + static_cast<uint32_t>(shmem::signal_fetch(ctx, sig)) +
             (shmem::ptr(ctx, buf, 1) != nullptr) + tile::rank(ctx) + tile::num_ranks(ctx) +
             (tile::symm_at(ctx, sig, 0) != nullptr);
    constexpr AllGatherTileMap ag{100, 3, 7, 32};
    static_assert(ag.is_valid());
    const SignalRange r = ag.signals_for_tile(ag.tile_at(ctx.rank, 1));
    w32[2] = r.first + r.count();
    constexpr ReduceScatterTileMap rs{100, 3, 50, 16, 16, 32};
    static_assert(rs.is_valid());
    w32[3] = rs.tile_at(ctx.rank, 2).signal_idx + rs.expected_count(1);
    ptx::fence_proxy_async_shared_cta();
    ptx::fence_proxy_async();
    ptx::nanosleep(100);
    sig[7] = ptx::globaltimer();
}
)";

TEST(DeviceHeadersNvrtc, PrimitivesKernelCompilesToCubin) {
    const NvrtcResult r = compile(kPrimitivesKernel, true);
    ASSERT_TRUE(r.ok) << r.log;
    EXPECT_GT(r.cubin_bytes, 0u);
    // The PTX the memory-model document promises (docs/memory_model.md).
    for (const char* insn :
         {"ld.acquire.sys.b64", "red.release.sys.add.u64", "st.release.sys.b64", "st.release.gpu.b64",
          "ld.relaxed.gpu.b64", "fence.acq_rel.sys", "fence.acq_rel.gpu", "fence.proxy.async.global",
          "fence.proxy.async.shared::cta", "ld.v4.b32", "st.v4.b32", "nanosleep.u32", "%globaltimer", "trap",
          "atom.relaxed.gpu.cas.b32", "st.relaxed.sys.b32", "ld.relaxed.sys.b64", "ld.acquire.cta.v4.b32",
          "atom.acq_rel.cta.add.u64", "fence.sc.gpu", "ld.volatile.b64", "bar.sync", "bar.warp.sync",
          "shfl.sync.idx.b32", "bar.red.and.pred", "vote.sync.all.pred", "fence.sc.sys",
          "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes", "exit;",
          "ld.relaxed.sys.b32"}) {
        EXPECT_NE(r.ptx.find(insn), std::string::npos) << "PTX lacks " << insn;
    }
    // Nothing another agent writes may be read through the non-coherent path.
    EXPECT_EQ(r.ptx.find("ld.global.nc"), std::string::npos) << "PTX uses ld.global.nc";
}

TEST(DeviceHeadersNvrtc, IllegalSemanticsAreRejectedAtCompileTime) {
    // Each must fail to compile: the static_asserts name the rule.
    const char* bad[] = {
        "ptx::ld<ptx::Sem::kRelease, ptx::Scope::kSys>(p);",
        "ptx::st<ptx::Sem::kAcquire, ptx::Scope::kSys>(p, 1);",
        "ptx::red_add<ptx::Sem::kAcquire, ptx::Scope::kSys>(p, 1);",
        "ptx::atom_add<ptx::Sem::kVolatile, ptx::Scope::kSys>(p, 1);",
        "ptx::fence<ptx::Sem::kRelease, ptx::Scope::kSys>();",
        "ptx::atom_add(reinterpret_cast<float*>(p), 1.0f);",
        "weft::device::spin_until<ptx::Sem::kVolatile>(weft::DeviceCtx{}, p, weft::Cmp::kEq, 0, {});",
        "(void)weft::device::spin_until_checked<ptx::Sem::kAcqRel>(weft::DeviceCtx{}, p, weft::Cmp::kEq, 0, {});",
        "(void)weft::device::tile::wait(1, weft::DeviceCtx{}, p, 1, weft::Cmp::kEq, 0);",
    };
    for (const char* stmt : bad) {
        const std::string src = std::string("#include \"weft/device.cuh\"\nusing namespace weft;\n"
                                             "__global__ void k(unsigned long long* p) { ") +
                                stmt + " }\n";
        const NvrtcResult r = compile(src, false);
        EXPECT_FALSE(r.ok) << "compiled but should not: " << stmt;
        EXPECT_NE(r.log.find("static assertion failed"), std::string::npos) << stmt << "\n" << r.log;
    }
}

}  // namespace
}  // namespace weft
