// SPDX-License-Identifier: MIT
// GPU tests of the JIT: compiled kernels load and compute correctly, launches validate their input,
// dynamic shared memory and clusters work, a linked device library runs, the autotuner picks the
// faster config on every rank, and a cache warmed by weft-compile loads without compiling.
#include <gtest/gtest.h>
#include <nvrtc.h>

#include <cmath>
#include <random>
#include <thread>

#include "support/jit_testing.hpp"
#include "weft/common/device_ctx.hpp"
#include "weft/jit/aot.hpp"
#include "weft/jit/autotune.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"

namespace weft::jit {
namespace {

namespace fs = std::filesystem;
using weft::testing::TempDir;

#define REQUIRE_GPU()                                                   \
    do {                                                                \
        if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible"; \
    } while (0)

// Device buffer, freed on scope exit.
template <class T>
struct DeviceBuffer {
    T* ptr = nullptr;
    size_t count = 0;
    explicit DeviceBuffer(size_t n) : count(n) { WEFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), n * sizeof(T))); }
    ~DeviceBuffer() { cudaFree(ptr); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    void upload(const std::vector<T>& h) { WEFT_CUDA_CHECK(cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice)); }
    std::vector<T> download() const {
        std::vector<T> h(count);
        WEFT_CUDA_CHECK(cudaMemcpy(h.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
        return h;
    }
};

std::vector<float> random_floats(size_t n, std::mt19937& rng) {
    std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
    std::vector<float> v(n);
    for (auto& x : v) x = dist(rng);
    return v;
}

std::mt19937 fresh_rng() {
    const unsigned seed = std::random_device{}();
    std::printf("[ seed     ] %u\n", seed);
    return std::mt19937(seed);
}

// Runs saxpy for one config and n on fresh data; checks every element against an fp64 reference and
// that the guard elements past n were not touched.
void check_saxpy(Kernel& kernel, int items_per_thread, int n, unsigned grid, std::mt19937& rng) {
    SCOPED_TRACE("n = " + std::to_string(n) + ", grid = " + std::to_string(grid) + ", items_per_thread = " +
                 std::to_string(items_per_thread));
    constexpr int kGuard = 37;
    const auto x = random_floats(static_cast<size_t>(n), rng);
    auto y = random_floats(static_cast<size_t>(n) + kGuard, rng);  // the guard tail is poison to keep
    const float a = std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
    DeviceCtx ctx{};
    ctx.rank = std::uniform_int_distribution<int>(0, 7)(rng);
    ctx.num_ranks = 8;
    DeviceBuffer<float> dx(x.size()), dy(y.size());
    dx.upload(x);
    dy.upload(y);
    kernel.launch(LaunchParams{.grid = dim3(grid), .block = dim3(128)}, ctx, a, static_cast<const float*>(dx.ptr), dy.ptr, n);
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    const auto out = dy.download();
    int bad = 0;
    for (int i = 0; i < n && bad < 5; ++i) {
        const double ref = static_cast<double>(a) * x[static_cast<size_t>(i)] + y[static_cast<size_t>(i)] + ctx.rank;
        const double got = out[static_cast<size_t>(i)];
        if (!(std::fabs(got - ref) <= 1e-5 * (1.0 + std::fabs(ref)))) {
            ADD_FAILURE() << "y[" << i << "] = " << got << ", expected " << ref;
            ++bad;
        }
    }
    for (int i = n; i < n + kGuard; ++i) {
        ASSERT_EQ(out[static_cast<size_t>(i)], y[static_cast<size_t>(i)]) << "element " << i << " past n was written";
    }
}

TEST(JitGpu, SaxpyLoadsAndComputesCorrectly) {
    REQUIRE_GPU();
    auto rng = fresh_rng();
    for (int items : {1, 4}) {
        Kernel& k = compiler().get_kernel(jit_selftest_saxpy_spec(items, 1));
        EXPECT_EQ(k.param_bytes().size(), 5u);
        EXPECT_EQ(k.param_bytes()[0], sizeof(DeviceCtx));
        for (int n : {1, 7, 128, 129, 1000, 4097, (1 << 20) + 3}) {
            const unsigned full = static_cast<unsigned>((n + 128 * items - 1) / (128 * items));
            check_saxpy(k, items, n, full, rng);
            check_saxpy(k, items, n, 1, rng);  // one block: the grid-stride loop covers the rest
            check_saxpy(k, items, n, 3, rng);
        }
    }
}

TEST(JitGpu, SecondGetKernelIsAMemoryHitOnTheSameKernel) {
    REQUIRE_GPU();
    TempDir cache("weft_jit_gpu_cache");
    Compiler c(weft::testing::isolated_compiler_config(cache.path()));
    Kernel& a = c.get_kernel(jit_selftest_saxpy_spec(2, 1));
    Kernel& b = c.get_kernel(jit_selftest_saxpy_spec(2, 1));
    EXPECT_EQ(&a, &b);
    EXPECT_EQ(c.stats().compiles, 1u);
    EXPECT_EQ(c.stats().loads, 1u);
    EXPECT_EQ(c.stats().memory_hits, 1u);
    // A new compiler on the same folder loads from disk.
    Compiler d(weft::testing::isolated_compiler_config(cache.path()));
    Kernel& e = d.get_kernel(jit_selftest_saxpy_spec(2, 1));
    EXPECT_EQ(d.stats().compiles, 0u);
    EXPECT_EQ(d.stats().disk_hits, 1u);
    auto rng = fresh_rng();
    check_saxpy(e, 2, 5000, 8, rng);
}

TEST(JitGpu, LaunchRejectsWrongArgumentsAndGeometry) {
    REQUIRE_GPU();
    Kernel& k = compiler().get_kernel(jit_selftest_saxpy_spec(4, 1));
    DeviceBuffer<float> x(16), y(16);
    DeviceCtx ctx{};
    const LaunchParams ok{.grid = dim3(1), .block = dim3(32)};
    auto message = [](const std::function<void()>& f) -> std::string {
        try {
            f();
        } catch (const Error& e) {
            return e.what();
        }
        return "(no error)";
    };
    EXPECT_NE(message([&] { k.launch(ok, ctx, 2.0f, x.ptr, y.ptr); }).find("takes 5 parameters"), std::string::npos);
    EXPECT_NE(message([&] { k.launch(ok, ctx, 2.0, x.ptr, y.ptr, 16); }).find("argument 1 has 8 bytes"), std::string::npos)
        << "double passed for float";
    EXPECT_NE(message([&] { k.launch(ok, ctx, 2.0f, x.ptr, y.ptr, size_t{16}); }).find("argument 4"), std::string::npos);
    EXPECT_NE(message([&] { k.launch(LaunchParams{.grid = dim3(0), .block = dim3(32)}, ctx, 2.0f, x.ptr, y.ptr, 16); })
                  .find("grid must be positive"),
              std::string::npos);
    EXPECT_NE(message([&] { k.launch(LaunchParams{.grid = dim3(1), .block = dim3(2048)}, ctx, 2.0f, x.ptr, y.ptr, 16); })
                  .find("more than 1024"),
              std::string::npos);
    EXPECT_NE(message([&] {
                  k.launch(LaunchParams{.grid = dim3(1), .block = dim3(32), .dynamic_smem_bytes = size_t{1} << 30}, ctx,
                           2.0f, x.ptr, y.ptr, 16);
              }).find("the device allows"),
              std::string::npos);
    EXPECT_NE(message([&] {
                  k.launch(LaunchParams{.grid = dim3(3), .block = dim3(32), .cluster = dim3(2)}, ctx, 2.0f, x.ptr, y.ptr, 16);
              }).find("multiple of the cluster"),
              std::string::npos);
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
}

KernelSpec smem_spec() {
    KernelSpec spec;
    spec.header = "weft/device/token.cuh";
    spec.extra_code = R"(
// Fills n floats of dynamic shared memory, then each thread reads them back reversed.
extern "C" __global__ void weft_test_smem_reverse(float* out, int n) {
    extern __shared__ float buf[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = static_cast<float>(i) * 0.5f + blockIdx.x;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[blockIdx.x * n + i] = buf[n - 1 - i];
}
)";
    spec.instantiation = "weft_test_smem_reverse";
    spec.description = "dynamic shared memory test kernel";
    return spec;
}

TEST(JitGpu, DynamicSharedMemoryAbove48KiBIsRaisedAutomatically) {
    REQUIRE_GPU();
    Kernel& k = compiler().get_kernel(smem_spec());
    for (int n : {1000, 40 * 1024, 50 * 1024}) {  // 4 KB, 160 KB, 200 KB
        SCOPED_TRACE(n);
        const size_t bytes = static_cast<size_t>(n) * sizeof(float);
        constexpr unsigned kBlocks = 3;
        DeviceBuffer<float> out(kBlocks * static_cast<size_t>(n));
        WEFT_CUDA_CHECK(cudaMemset(out.ptr, 0xff, kBlocks * bytes));  // poison (NaN)
        k.launch(LaunchParams{.grid = dim3(kBlocks), .block = dim3(256), .dynamic_smem_bytes = bytes}, out.ptr, n);
        WEFT_CUDA_CHECK(cudaDeviceSynchronize());
        const auto h = out.download();
        for (unsigned b = 0; b < kBlocks; ++b) {
            for (int i = 0; i < n; ++i) {
                const float expect = static_cast<float>(n - 1 - i) * 0.5f + static_cast<float>(b);
                ASSERT_EQ(h[b * static_cast<size_t>(n) + static_cast<size_t>(i)], expect) << "block " << b << " i " << i;
            }
        }
    }
}

TEST(JitGpu, ClusterLaunchSetsTheClusterShape) {
    REQUIRE_GPU();
    KernelSpec spec;
    spec.header = "weft/device/token.cuh";
    spec.extra_code = R"(
extern "C" __global__ void weft_test_cluster_shape(unsigned* out) {
    unsigned nctarank, ctarank;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(nctarank));
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(ctarank));
    if (threadIdx.x == 0) { out[2 * blockIdx.x] = nctarank; out[2 * blockIdx.x + 1] = ctarank; }
}
)";
    spec.instantiation = "weft_test_cluster_shape";
    Kernel& k = compiler().get_kernel(spec);
    for (unsigned cluster : {1u, 2u, 4u}) {
        SCOPED_TRACE(cluster);
        constexpr unsigned kBlocks = 8;
        DeviceBuffer<unsigned> out(2 * kBlocks);
        WEFT_CUDA_CHECK(cudaMemset(out.ptr, 0xff, 2 * kBlocks * sizeof(unsigned)));
        k.launch(LaunchParams{.grid = dim3(kBlocks), .block = dim3(64), .cluster = dim3(cluster)}, out.ptr);
        WEFT_CUDA_CHECK(cudaDeviceSynchronize());
        const auto h = out.download();
        for (unsigned b = 0; b < kBlocks; ++b) {
            EXPECT_EQ(h[2 * b], cluster) << "block " << b;
            EXPECT_EQ(h[2 * b + 1], b % cluster) << "block " << b;
        }
    }
}

TEST(JitGpu, LinkedDeviceLibraryRuns) {
    REQUIRE_GPU();
    TempDir dir("weft_jit_gpu_lib");
    // The library: weft_test_scale(v) = 3v, as LTO-IR.
    const char* lib_src = "extern \"C\" __device__ float weft_test_scale(float v) { return 3.0f * v; }\n";
    nvrtcProgram prog = nullptr;
    ASSERT_EQ(nvrtcCreateProgram(&prog, lib_src, "scale.cu", 0, nullptr, nullptr), NVRTC_SUCCESS);
    const std::string arch = "-arch=" + Compiler::resolve_arch("");
    const char* opts[] = {arch.c_str(), "-rdc=true", "-dlto"};
    ASSERT_EQ(nvrtcCompileProgram(prog, 3, opts), NVRTC_SUCCESS);
    size_t size = 0;
    nvrtcGetLTOIRSize(prog, &size);
    std::vector<char> ltoir(size);
    nvrtcGetLTOIR(prog, ltoir.data());
    nvrtcDestroyProgram(&prog);
    const fs::path lib = dir / "scale.ltoir";
    write_file_atomically(lib, ltoir.data(), ltoir.size());

    KernelSpec spec;
    spec.header = "weft/device/token.cuh";
    spec.extra_code =
        "extern \"C\" __device__ float weft_test_scale(float v);\n"
        "extern \"C\" __global__ void weft_test_scaled_copy(const float* x, float* y, int n) {\n"
        "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "    if (i < n) y[i] = weft_test_scale(x[i]);\n}\n";
    spec.instantiation = "weft_test_scaled_copy";
    spec.options.lto = true;
    spec.options.link_files = {lib.string()};
    Compiler c(weft::testing::isolated_compiler_config(fs::path()));
    Kernel& k = c.get_kernel(spec);
    auto rng = fresh_rng();
    const int n = 3001;
    const auto x = random_floats(n, rng);
    DeviceBuffer<float> dx(n), dy(n);
    dx.upload(x);
    WEFT_CUDA_CHECK(cudaMemset(dy.ptr, 0xff, n * sizeof(float)));
    k.launch(LaunchParams{.grid = dim3((n + 255) / 256), .block = dim3(256)}, static_cast<const float*>(dx.ptr), dy.ptr, n);
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
    const auto y = dy.download();
    for (int i = 0; i < n; ++i) ASSERT_EQ(y[static_cast<size_t>(i)], 3.0f * x[static_cast<size_t>(i)]) << i;
}

TEST(JitGpu, KernelsLoadEagerlyOnEveryDevice) {
    REQUIRE_GPU();
    int devices = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&devices));
    int original = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&original));
    auto rng = fresh_rng();
    for (int d = 0; d < devices; ++d) {
        WEFT_CUDA_CHECK(cudaSetDevice(d));
        Kernel& k = compiler().get_kernel(jit_selftest_saxpy_spec(1, 1));
        const CUfunction f = k.load_for_current_context();
        ASSERT_NE(f, nullptr);
        // Loaded now, before any launch: nothing is left to load lazily behind a spinning kernel.
        CUfunctionLoadingState state = CU_FUNCTION_LOADING_STATE_UNLOADED;
        WEFT_CU_CHECK(driver().cuFuncIsLoaded(&state, f));
        EXPECT_EQ(state, CU_FUNCTION_LOADING_STATE_LOADED) << "device " << d;
        check_saxpy(k, 1, 777, 2, rng);
    }
    WEFT_CUDA_CHECK(cudaSetDevice(original));
}

// Two configs of saxpy on one large problem: "slow" reloads every element 64 times.
struct SaxpyTuneProblem {
    static constexpr int kN = 1 << 24;
    DeviceBuffer<float> x{kN}, y0{kN}, y1{kN};
    float* current_y = nullptr;
    DeviceCtx ctx{};
    explicit SaxpyTuneProblem(std::mt19937& rng) {
        const auto hx = random_floats(kN, rng);
        x.upload(hx);
        y0.upload(hx);
        y1.upload(hx);
        current_y = y0.ptr;
    }
    std::vector<TuneCandidate> candidates(Compiler& c) {
        std::vector<TuneCandidate> out;
        for (auto [name, passes] : {std::pair<const char*, int>{"slow", 64}, {"fast", 1}}) {
            Kernel* k = &c.get_kernel(jit_selftest_saxpy_spec(4, passes));
            out.push_back({name, [this, k](cudaStream_t s) {
                               k->launch(LaunchParams{.grid = dim3(1024), .block = dim3(256), .stream = s}, ctx, 0.5f,
                                         static_cast<const float*>(x.ptr), current_y, kN);
                           }});
        }
        return out;
    }
    TuneOptions options(cudaStream_t stream) {
        TuneOptions o;
        o.stream = stream;
        o.warmup_iters = 2;
        o.repeat_iters = 5;
        o.rotate_inputs = [this](int i) { current_y = (i % 2 == 0) ? y0.ptr : y1.ptr; };
        return o;
    }
};

TEST(JitGpu, AutotunerPicksTheFasterConfig) {
    REQUIRE_GPU();
    TempDir dir("weft_jit_gpu_tune");
    auto rng = fresh_rng();
    SaxpyTuneProblem problem(rng);
    cudaStream_t stream = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    AutotuneConfig config;
    config.cache_dir = dir.path();
    Autotuner tuner(config);
    const TuneKey key{"jit_selftest_saxpy", "n=16777216,f32", 0, ""};
    const TuneResult r = tuner.tune(key, problem.candidates(compiler()), nullptr, problem.options(stream));
    EXPECT_EQ(r.origin, TuneResult::Origin::kTuned);
    EXPECT_EQ(r.name, "fast");
    ASSERT_EQ(r.times_ms.size(), 2u);
    EXPECT_GT(r.times_ms[0], 3.0 * r.times_ms[1]) << "slow " << r.times_ms[0] << " ms, fast " << r.times_ms[1] << " ms";
    EXPECT_GT(r.times_ms[1], 0.0);
    const TuneResult again = tuner.tune(key, problem.candidates(compiler()), nullptr, problem.options(stream));
    EXPECT_EQ(again.origin, TuneResult::Origin::kCached);
    EXPECT_EQ(again.name, "fast");
    WEFT_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(JitGpu, AutotunerTwoRanksPickTheSameFasterConfig) {
    REQUIRE_GPU();
    constexpr int kRanks = 2;
    TempDir dir("weft_jit_gpu_tune2");
    int device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&device));
    // Everything that could fail on one rank only is set up here, before the rank threads start:
    // inside tune() the ranks meet at barriers, and a rank that left early would strand the other.
    std::vector<std::unique_ptr<SaxpyTuneProblem>> problems;
    std::vector<std::vector<TuneCandidate>> candidates;
    std::vector<cudaStream_t> streams(kRanks);
    for (int rank = 0; rank < kRanks; ++rank) {
        std::mt19937 rng(1234u + static_cast<unsigned>(rank));
        problems.push_back(std::make_unique<SaxpyTuneProblem>(rng));
        candidates.push_back(problems.back()->candidates(compiler()));
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[static_cast<size_t>(rank)], cudaStreamNonBlocking));
    }
    weft::testing::ThreadTuneComm comm(kRanks);
    std::vector<TuneResult> results(kRanks);
    std::vector<std::string> errors(kRanks);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < kRanks; ++rank) {
        threads.emplace_back([&, rank] {
            const auto r = static_cast<size_t>(rank);
            auto tune_comm = comm.for_rank(rank);
            try {
                WEFT_CUDA_CHECK(cudaSetDevice(device));  // ranks share the GPU
                AutotuneConfig config;
                config.cache_dir = dir.path();
                Autotuner tuner(config);
                results[r] = tuner.tune(TuneKey{"jit_selftest_saxpy", "n=16777216,f32", 0, ""}, candidates[r],
                                        tune_comm.get(), problems[r]->options(streams[r]));
            } catch (const std::exception& e) {
                errors[r] = e.what();
            }
        });
    }
    for (auto& t : threads) t.join();
    for (cudaStream_t s : streams) WEFT_CUDA_CHECK(cudaStreamDestroy(s));
    for (int rank = 0; rank < kRanks; ++rank) {
        SCOPED_TRACE(rank);
        ASSERT_EQ(errors[static_cast<size_t>(rank)], "");
        EXPECT_EQ(results[static_cast<size_t>(rank)].name, "fast");
        EXPECT_EQ(results[static_cast<size_t>(rank)].origin, TuneResult::Origin::kTuned);
        EXPECT_EQ(results[static_cast<size_t>(rank)].times_ms, results[0].times_ms) << "every rank sees the same maxima";
    }
}

// Run after `weft-compile --builtin --cache-dir DIR` with WEFT_CACHE_DIR=DIR and
// WEFT_TEST_EXPECT_WARM_JIT_CACHE=1: every built-in spec must load from DIR without compiling.
TEST(JitGpu, WarmCacheLoadsWithoutCompiling) {
    REQUIRE_GPU();
    if (!env::get_bool("WEFT_TEST_EXPECT_WARM_JIT_CACHE").value_or(false)) {
        GTEST_SKIP() << "set WEFT_TEST_EXPECT_WARM_JIT_CACHE=1 and WEFT_CACHE_DIR to a cache warmed by weft-compile";
    }
    Compiler c(CompilerConfig::from_env());
    ASSERT_TRUE(c.cache_dir().has_value()) << "WEFT_CACHE_DIR is not usable";
    const auto specs = aot_specs();
    for (const auto& spec : specs) c.get_kernel(spec);
    EXPECT_EQ(c.stats().compiles, 0u) << "a spec was compiled although the cache should hold it";
    EXPECT_EQ(c.stats().disk_hits, specs.size());
    EXPECT_EQ(c.stats().loads, specs.size());
    auto rng = fresh_rng();
    check_saxpy(c.get_kernel(jit_selftest_saxpy_spec(4, 1)), 4, 100003, 40, rng);
    std::printf("[ warm     ] %zu kernels loaded from %s without compiling\n", specs.size(),
                c.cache_dir()->string().c_str());
}

}  // namespace
}  // namespace weft::jit
